//! `leasehold run` and its command as one job: which signals are passed on, how the job stops
//! and continues (Ctrl-Z, `fg`, `bg`), who owns the terminal, and what happens to the command
//! when `leasehold run` itself dies.
//!
//! The command runs in its own process group, so a signal reaches the whole tree it starts.
//! Three things follow, and each would let the command run without a slot or hold one forever:
//! * a terminal sends Ctrl-C, Ctrl-\ and Ctrl-Z only to its foreground group, and lets only that
//!   group read: when `leasehold run` is a foreground job of its own (alone in its group, as an
//!   interactive shell starts a command), it hands the terminal to the command's group. It does
//!   not when it shares its group (a pipeline, a script), which would take the terminal from the
//!   others;
//! * a stop of one group does not stop the other: a job-control stop of either (SIGTSTP,
//!   SIGTTIN, SIGTTOU, and any stop of a command that holds the terminal) stops both, and on
//!   continue the command is continued only if the lease is still held (renewals stop while
//!   `leasehold run` is stopped);
//! * nothing ties the command's life to `leasehold run`: the command gets SIGKILL when the thread
//!   that started it ends (`PR_SET_PDEATHSIG`), so a SIGKILLed or crashed `leasehold run` leaves
//!   no command running on an expired lease. (The kernel clears that signal when the command
//!   changes its credentials: `sudo`, `setpriv`, a setuid program.)
//!
//! `leasehold run` ignores SIGTTOU itself: with `stty tostop`, its own lines on stderr from the
//! background would otherwise stop it (while its command runs on) or, caught, restart the write
//! forever. Its command gets the default back.

use std::os::fd::{AsRawFd, OwnedFd};

use futures_util::future::select_all;
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::exit::{self, Failure};

/// Signals passed on to the command's process group. A signal this process inherited as
/// ignored (`nohup`) stays ignored, and the command inherits that too.
const FORWARDED: [i32; 7] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGALRM,
];

/// Job-control stops sent to `leasehold run`: caught, so that the command stops with it instead
/// of running on while renewals are stopped. (SIGTTOU is ignored instead: see the module doc.)
const STOPPING: [i32; 2] = [libc::SIGTSTP, libc::SIGTTIN];

/// Stops of the command that stop the whole job.
const JOB_CONTROL_STOPS: [i32; 3] = [libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU];

/// What a signal asks of `leasehold run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Pass this signal on to the command's group (or end the wait for a slot).
    Forward(i32),
    /// Stop the job.
    Stop,
    /// A child changed state (SIGCHLD): look whether the command stopped.
    Child,
    /// This process was continued (SIGCONT): a shell's `fg` of a job that runs (after `bg`, or
    /// started with `&`) gives the terminal to our group, which passes it on to the command.
    Continued,
}

/// The signals `leasehold run` listens to, installed before anything is spawned.
pub struct Signals {
    streams: Vec<(Event, Signal)>,
    /// SIGTTOU was ignored when we started (so the command inherits it ignored).
    ttou_inherited_ignored: bool,
}

impl Signals {
    pub fn install() -> Result<Self, Failure> {
        let ttou_inherited_ignored = ignored(libc::SIGTTOU);
        // SAFETY: signal(2) setting a disposition, before any other thread could rely on it.
        unsafe { libc::signal(libc::SIGTTOU, libc::SIG_IGN) };
        let mut streams = Vec::new();
        let wanted = FORWARDED
            .iter()
            .map(|&sig| (sig, Event::Forward(sig)))
            .chain(STOPPING.iter().map(|&sig| (sig, Event::Stop)))
            .chain([
                (libc::SIGCHLD, Event::Child),
                (libc::SIGCONT, Event::Continued),
            ]);
        for (sig, event) in wanted {
            if !matches!(sig, libc::SIGCHLD | libc::SIGCONT) && ignored(sig) {
                continue;
            }
            let stream = signal(SignalKind::from_raw(sig)).map_err(|e| {
                Failure::new(exit::SOFTWARE, format!("signal handler for {sig}: {e}"))
            })?;
            streams.push((event, stream));
        }
        Ok(Signals {
            streams,
            ttou_inherited_ignored,
        })
    }

    /// True if the command must get SIGTTOU's default back (we ignore it only for ourselves).
    pub fn restore_ttou(&self) -> bool {
        !self.ttou_inherited_ignored
    }

    /// The next signal received.
    pub async fn next(&mut self) -> Event {
        let waits = self.streams.iter_mut().map(|(event, stream)| {
            let event = *event;
            Box::pin(async move {
                if stream.recv().await.is_none() {
                    // The signal driver is gone (the runtime is shutting down): nothing more
                    // will arrive from this stream.
                    std::future::pending::<()>().await;
                }
                event
            })
        });
        select_all(waits).await.0
    }
}

/// True if `sig` is ignored in this process (as `nohup` leaves SIGHUP).
fn ignored(sig: i32) -> bool {
    // SAFETY: sigaction(2) with a null new action only reads the current one into `current`.
    unsafe {
        let mut current: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut current) == 0
            && current.sa_sigaction == libc::SIG_IGN
    }
}

/// The controlling terminal of `leasehold run`, if it has one.
pub struct Terminal {
    fd: OwnedFd,
}

impl Terminal {
    /// The controlling terminal, or `None` (a service, a cron job).
    pub fn controlling() -> Option<Terminal> {
        let fd = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/tty")
            .ok()?;
        Some(Terminal { fd: fd.into() })
    }

    /// True when `leasehold run` may hand the terminal to its command now: its group is the
    /// terminal's foreground group and it is alone in it, as a job an interactive shell started.
    /// Sharing its group (a pipeline's other stages, the script that runs it), it keeps out:
    /// the others would lose the terminal, and a script its Ctrl-C.
    pub fn may_hand_over(&self) -> bool {
        self.is_held_by(own_group()) && alone_in_own_group()
    }

    /// How a command started now stands to `terminal` (the controlling terminal, if any).
    /// `alone_in_own_group` reads every process's state, so it is asked once here.
    pub fn role_for_command(terminal: Option<&Terminal>) -> TerminalRole {
        let Some(terminal) = terminal else {
            return TerminalRole::AsAnyJob;
        };
        if !alone_in_own_group() {
            // A pipeline stage or a command of a script: no `fg` can ever reach the command.
            TerminalRole::KeptOut
        } else if terminal.is_held_by(own_group()) {
            TerminalRole::Foreground(terminal.raw_fd())
        } else {
            TerminalRole::AsAnyJob
        }
    }

    /// True while `pgrp` is the terminal's foreground group.
    pub fn is_held_by(&self, pgrp: i32) -> bool {
        // SAFETY: a plain query on a descriptor we own.
        unsafe { libc::tcgetpgrp(self.fd.as_raw_fd()) == pgrp }
    }

    /// The descriptor, for the command's own hand-over before it executes.
    pub fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Makes `pgrp` the terminal's foreground group.
    pub fn give_to(&self, pgrp: i32) {
        // SAFETY: signal-mask calls on this thread and tcsetpgrp on a descriptor we own.
        unsafe { foreground(self.fd.as_raw_fd(), pgrp) };
    }
}

/// True if this process leads its process group and no other process is in it.
fn alone_in_own_group() -> bool {
    // SAFETY: getpid(2) cannot fail.
    let me = unsafe { libc::getpid() };
    let group = own_group();
    group == me
        && !processes().any(|pid| pid != me && state_and_group(pid).map(|s| s.1) == Some(group))
}

/// The pids in `/proc`: every process (of this pid namespace), at the moment each is read.
fn processes() -> impl Iterator<Item = i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
}

/// The state letter (`R`, `S`, `T`, `Z`, ...) and process group of `pid`, from
/// `/proc/<pid>/stat` (the fields after the command name: state, parent, group).
fn state_and_group(pid: i32) -> Option<(char, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    let group = fields.nth(1)?.parse().ok()?;
    Some((state, group))
}

/// Makes `pgrp` the foreground group of the terminal `fd`, from a foreground or background
/// group alike: SIGTTOU, which a background group gets for asking, is blocked meanwhile.
///
/// # Safety
/// Async-signal-safe (the command's side calls it between fork and exec); `fd` must be open.
unsafe fn foreground(fd: i32, pgrp: i32) {
    let mut block: libc::sigset_t = std::mem::zeroed();
    let mut before: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut block);
    libc::sigaddset(&mut block, libc::SIGTTOU);
    libc::pthread_sigmask(libc::SIG_BLOCK, &block, &mut before);
    libc::tcsetpgrp(fd, pgrp);
    libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut());
}

/// How the command stands to the controlling terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TerminalRole {
    /// No controlling terminal, or `leasehold run` is a job of its own in the background (`&`):
    /// job control works for the command as for any job (a read stops the job, `fg` hands the
    /// terminal over).
    AsAnyJob,
    /// The command takes the terminal (this descriptor) itself before it runs.
    Foreground(i32),
    /// A terminal is there but stays with the group `leasehold run` shares (a pipeline, a
    /// script): the command runs in the background of it. It ignores SIGTTIN and SIGTTOU, so a
    /// read of the terminal fails (EIO) and a write goes through, instead of stopping a
    /// command that no `fg` could ever bring to the foreground.
    KeptOut,
}

/// Sets up the command, between fork and exec: it dies with the thread that starts it, and it
/// takes the terminal (if it is to be in the foreground) itself, so it cannot read before it
/// has it.
///
/// Only async-signal-safe calls happen in the child. `PR_SET_PDEATHSIG` fires when the *thread*
/// that forked ends: `leasehold run` starts the command from the main thread, which lives as long
/// as the process.
pub fn prepare(command: &mut tokio::process::Command, role: TerminalRole, restore_ttou: bool) {
    // SAFETY: getpid(2) only.
    let parent = unsafe { libc::getpid() };
    let setup = move || -> std::io::Result<()> {
        // SAFETY: prctl, getppid, getpgrp, signal masks and tcsetpgrp are async-signal-safe.
        unsafe {
            #[cfg(target_os = "linux")]
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                // `leasehold run` died before the death signal was armed.
                return Err(std::io::Error::other("leasehold run exited"));
            }
            match role {
                TerminalRole::AsAnyJob => {}
                TerminalRole::Foreground(fd) => foreground(fd, libc::getpgrp()),
                TerminalRole::KeptOut => {
                    libc::signal(libc::SIGTTIN, libc::SIG_IGN);
                    libc::signal(libc::SIGTTOU, libc::SIG_IGN);
                }
            }
            if restore_ttou && role != TerminalRole::KeptOut {
                libc::signal(libc::SIGTTOU, libc::SIG_DFL);
            }
        }
        Ok(())
    };
    // SAFETY: `setup` only makes async-signal-safe calls and allocates nothing on success.
    unsafe {
        command.pre_exec(setup);
    }
}

/// The signal that stopped the child `pid` since the last look, if it stopped. Exits are left to
/// the `Child`'s own wait.
pub fn stopped_by(pid: i32) -> Option<i32> {
    // SAFETY: waitid(2) with WSTOPPED | WNOHANG reports (and consumes) only a stop, never an
    // exit, so the child stays reapable by its `Child` handle.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let found = libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WSTOPPED | libc::WNOHANG,
        );
        (found == 0 && info.si_pid() == pid).then(|| info.si_status())
    }
}

/// True if a stop of the command by `sig` stops the job: a job-control stop always; any stop
/// (SIGSTOP too, e.g. bash's `suspend`) while the command holds the terminal, since the shell
/// then cannot get it back. A SIGSTOP of a command in the background is someone's choice for the
/// command alone.
pub fn stops_the_job(sig: i32, command_holds_terminal: bool) -> bool {
    JOB_CONTROL_STOPS.contains(&sig) || command_holds_terminal
}

/// True if `pid` is stopped now (state `T`).
pub fn is_stopped(pid: i32) -> bool {
    state_and_group(pid).is_some_and(|(state, _)| state == 'T')
}

/// Ends this process by `sig`, as its command was ended, so a shell or a script sees what it
/// would have seen without `leasehold run` (bash stops a loop on a child killed by SIGINT, not
/// on one that exited 130). No core file is written. Returns only if `sig` did not end it.
pub fn die_by(sig: i32) {
    // SAFETY: plain system calls on this process; the slot is released and the terminal given
    // back before this is called.
    unsafe {
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &no_core);
        libc::signal(sig, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::kill(libc::getpid(), sig);
    }
}

/// Sends `sig` to the process group `pgid`.
pub fn signal_group(pgid: i32, sig: i32) {
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// True while a process of the group `pgid` still runs. A zombie does not count: it has ended,
/// and where its parent never reaps it (an init that does not reap, as in many containers) it
/// would otherwise hold the slot for the whole grace period.
pub fn group_alive(pgid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the group exists.
    let exists = unsafe { libc::kill(-pgid, 0) == 0 };
    exists
        && processes().any(|pid| {
            state_and_group(pid).is_some_and(|(state, group)| group == pgid && state != 'Z')
        })
}

/// This process's group.
pub fn own_group() -> i32 {
    // SAFETY: getpgrp(2) takes no arguments and cannot fail.
    unsafe { libc::getpgrp() }
}

/// Stops this whole process until someone continues it (the shell's `fg` or `bg`).
pub fn stop_self() {
    // SAFETY: kill(2) on our own pid; SIGSTOP stops every thread and returns once continued.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGSTOP);
    }
}
