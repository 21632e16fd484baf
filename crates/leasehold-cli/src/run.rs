//! `leasehold run`: hold a slot for exactly as long as a child process runs.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use leasehold::{Error, Lease, LostReason, Quota, Unavailable};
use tokio::process::{Child, Command};

use crate::cli::RunArgs;
use crate::exit::{self, Failure};
use crate::job::{self, Event, Signals, Terminal, TerminalRole};

pub async fn run(quota: Quota, args: RunArgs, verbose: bool) -> Result<i32, Failure> {
    let generated = args.task_id.is_none();
    let task_id = args
        .task_id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    if verbose {
        say!("leasehold: quota {:?}, task id {task_id}", quota.name());
    }
    let mut signals = Signals::install()?;
    let lease = {
        // Boxed, so that a signal can drop it (and leave the line of waiters) before the give
        // back: a waiter still in line could be handed a slot after it.
        let mut acquiring = Box::pin(acquire(&quota, &task_id, args.wait));
        loop {
            tokio::select! {
                lease = &mut acquiring => match lease {
                    Ok(lease) => break lease,
                    Err(failure) => {
                        let waited = args.wait.is_none_or(|d| !d.is_zero());
                        if waited && matches!(failure.code, exit::NO_SLOT | exit::UNAVAILABLE) {
                            // `--wait` ran out, maybe with an attempt still in flight.
                            give_back_unclaimed(&quota, &task_id, generated).await;
                        }
                        return Err(failure);
                    }
                },
                event = signals.next() => match event {
                    Event::Forward(sig) => {
                        drop(acquiring);
                        give_back_unclaimed(&quota, &task_id, generated).await;
                        job::die_by(sig);
                        return Ok(128 + sig);
                    }
                    // Nothing holds a slot yet: stop, and wait on once continued.
                    Event::Stop => job::stop_self(),
                    Event::Child | Event::Continued => {}
                },
            }
        }
    };
    if verbose {
        say!(
            "leasehold: acquired, fencing token {}",
            lease.fencing_token()
        );
    }
    if !lease.is_held() {
        // Admitted, but its local deadline passed before we could start (a stop, a slow reply):
        // the slot may be someone else's already.
        let _ = lease.release().await;
        let reason = lease.lost_reason().unwrap_or(LostReason::LocalDeadline);
        say!(
            "leasehold: {}; the command was not started",
            exit::one_line(&reason.to_string())
        );
        // A task cancelled as it was admitted is not one worth running again (found by review).
        return Ok(lost_code(&reason));
    }
    let terminal = Terminal::controlling();
    let role = Terminal::role_for_command(terminal.as_ref());
    let hand_over = terminal
        .as_ref()
        .filter(|_| matches!(role, TerminalRole::Foreground(_)));
    // In a group with others (a pipeline, a script) no `fg` can bring the command forward:
    // never looked for, which would read every process's state at each look for a stop.
    let fg_may_come = !matches!(role, TerminalRole::KeptOut);
    let mut child = match spawn(&args, &quota, &lease, role, signals.restore_ttou()) {
        Ok(child) => child,
        Err(failure) => {
            // The process exits right after this: a release left to the lease's drop would
            // never be sent.
            release(&lease).await;
            return Err(failure);
        }
    };
    let outcome = match child.id() {
        Some(pid) => {
            let job = Job {
                pid: pid as i32,
                terminal: terminal.as_ref(),
                fg_may_come,
            };
            if let Some(terminal) = hand_over {
                terminal.give_to(job.pid);
            }
            let outcome = supervise(&mut child, &job, &lease, &mut signals, args.grace).await;
            if matches!(outcome, Ok(Outcome::Exited(_))) {
                end_leftovers(job.pid, args.grace).await;
            }
            if let Some(terminal) = job.terminal.filter(|t| t.is_held_by(job.pid)) {
                // Back to our group, whose exit the shell is waiting for (unless the shell took
                // it meanwhile: after `bg`, it is not ours to give).
                terminal.give_to(job::own_group());
            }
            outcome
        }
        // Already reaped: it exited before we looked.
        None => child.wait().await.map(Outcome::Exited).map_err(wait_error),
    };
    let redis_answers = match outcome {
        // Release whatever happened: the slot is ours until the backend says otherwise.
        Ok(Outcome::Exited(_)) | Err(_) => {
            release(&lease).await;
            true
        }
        // Only in case the backend still has it (a token-guarded release cannot touch a
        // successor). Its failure is no news: the lease is already gone for us, and the error
        // line that matters is the loss.
        Ok(Outcome::Lost(_) | Outcome::StoppedTooLong) => release_lost(&lease).await,
    };
    let mut outcome = outcome?;
    // A cancel during a long stop (or a pause) reaches us only after the local deadline ended
    // the lease: the marker says whether the task was cancelled too, and a cancelled task must
    // not look like one worth running again (exit 79). Not when Redis just left the release
    // unanswered: it would not answer this look either, and the lease was lost to it.
    if redis_answers
        && matches!(
            outcome,
            Outcome::StoppedTooLong
                | Outcome::Lost(LostReason::LocalDeadline | LostReason::RenewalRefused(_))
        )
    {
        if let Some(reason) = cancelled_meanwhile(&quota, lease.task_id()).await {
            outcome = Outcome::Lost(LostReason::Cancelled(reason));
        }
    }
    match outcome {
        Outcome::Exited(status) => {
            if let Some(sig) = status.signal() {
                job::die_by(sig);
            }
            Ok(exit_code(status))
        }
        Outcome::Lost(reason) => {
            say!(
                "leasehold: {}; the command was stopped",
                exit::one_line(&reason.to_string())
            );
            Ok(lost_code(&reason))
        }
        Outcome::StoppedTooLong => {
            say!(
                "leasehold: the job was stopped for longer than the lease lasts; the lease is \
                 lost and the command was ended"
            );
            Ok(exit::LEASE_LOST)
        }
    }
}

/// The reason `task_id` was cancelled, if its marker says so. Bounded: Redis may be the reason
/// the lease was lost, and then this is no news.
async fn cancelled_meanwhile(quota: &Quota, task_id: &str) -> Option<String> {
    tokio::time::timeout(LOOK_AT_REDIS, quota.cancel_reason(task_id))
        .await
        .ok()?
        .ok()?
}

/// Releases `lease`, or says on stderr that it will expire instead.
async fn release(lease: &Lease) {
    if let Err(e) = lease.release().await {
        say!("leasehold: release failed ({e}); the slot frees when the lease expires");
    }
}

/// The release of a lease already lost: best effort, since the lease expires in Redis anyway
/// (the safety margin after the local deadline, when Redis was unreachable), and bounded by
/// [`RELEASE_AFTER_LOSS`], since Redis may be why the lease was lost and the process exits next.
/// Returns whether Redis answered it (a refusal is an answer); `false` when it was unreachable,
/// or did not answer in time.
async fn release_lost(lease: &Lease) -> bool {
    !matches!(
        tokio::time::timeout(RELEASE_AFTER_LOSS, lease.release()).await,
        Err(_) | Ok(Err(Error::BackendUnavailable { .. }))
    )
}

/// How long `leasehold run` waits for the release of a lost lease (docs/CLI.md): a round trip to
/// a Redis that answers, many times over; a Redis that stalls would otherwise keep the exit
/// waiting for a whole call timeout.
const RELEASE_AFTER_LOSS: Duration = Duration::from_millis(250);

/// The wait ended without a lease, but an admission attempt may still be on its way to Redis.
/// The library releases a late admission nobody takes, in the background (token-guarded, so
/// it never ends another process's lease of the same id): wait until it has (`Quota::flush`),
/// since the process exits next. Then release the id once more: an attempt whose reply was lost
/// (a connection dropped after Redis ran it) admitted nothing the library knows of. That last
/// release, by id alone, only for a task id this run generated, which is unique to it: a task id
/// given by the user may be shared with another process, so it is left alone (such a slot frees
/// when the lease expires, one ttl later). Bounded in time.
async fn give_back_unclaimed(quota: &Quota, task_id: &str, generated: bool) {
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        quota.flush().await;
        if generated {
            let _ = quota.force_release(task_id).await;
        }
    })
    .await;
}

/// Waits for a slot as long as `wait` says (forever when `None`, one try when zero). Redis
/// becoming unreachable during the wait does not end it: the holders ride out a short outage
/// on their ttl, and a waiter that gave up at once would lose its place for nothing. It ends
/// with exit 69 only when the wait runs out while Redis is still unreachable. (Redis
/// unreachable at the start was already exit 69, at connect.)
async fn acquire(quota: &Quota, task_id: &str, wait: Option<Duration>) -> Result<Lease, Failure> {
    if wait.is_some_and(|d| d.is_zero()) {
        // `Full` maps to exit 75 (no slot) and already names the quota.
        return quota.try_acquire(task_id).await.map_err(Failure::from);
    }
    let until = wait.and_then(|d| Instant::now().checked_add(d));
    let mut pause = OUTAGE_RETRY_FIRST;
    let mut told = false;
    loop {
        let result = match until {
            None => quota.acquire(task_id).await,
            Some(until) => {
                let left = until.saturating_duration_since(Instant::now());
                quota.acquire_timeout(task_id, left).await
            }
        };
        let down = match result {
            Err(down @ Error::BackendUnavailable { .. }) => down,
            Err(Error::TimedOut { .. }) => {
                return Err(ran_out(quota, wait.unwrap_or_default()).await);
            }
            other => return other.map_err(Failure::from),
        };
        let left = until.map(|until| until.saturating_duration_since(Instant::now()));
        if left.is_some_and(|left| left.is_zero()) {
            // This attempt was the last, and Redis did not answer it.
            return Err(down.into());
        }
        if !told {
            say!(
                "leasehold: Redis unavailable ({}); still waiting for a slot",
                exit::one_line(&unavailable_detail(&down))
            );
            told = true;
        }
        tokio::time::sleep(left.map_or(pause, |left| left.min(pause))).await;
        if until.is_some_and(|until| Instant::now() >= until) {
            return Err(ran_out(quota, wait.unwrap_or_default()).await);
        }
        pause = (pause * 2).min(OUTAGE_RETRY_MAX);
    }
}

/// The failure of a `--wait` that ran out: no slot (exit 75, naming the whole wait), unless
/// Redis does not answer: the attempt out when the wait ran out may then have been waiting for
/// Redis, not for a slot (exit 69). One look tells which: a round trip when Redis answers, at
/// most [`LOOK_AT_REDIS`] when it does not.
async fn ran_out(quota: &Quota, wait: Duration) -> Failure {
    let unreachable = match tokio::time::timeout(LOOK_AT_REDIS, quota.status()).await {
        Err(_) => Some((
            Unavailable::NoReply,
            format!("no answer within {LOOK_AT_REDIS:?}"),
        )),
        Ok(Err(Error::BackendUnavailable { kind, detail, .. })) => Some((kind, detail)),
        Ok(_) => None,
    };
    match unreachable {
        Some((kind, down)) => Error::unavailable(
            kind,
            format!(
                "Redis unreachable when --wait {} ran out ({down})",
                humantime::format_duration(wait)
            ),
        )
        .into(),
        // Redis answers now: the wait was for a slot.
        None => Error::TimedOut {
            quota: quota.name().to_owned(),
            waited: wait,
            answered: true,
        }
        .into(),
    }
}

/// How long a look at Redis after the fact may take (when a wait ran out, or the marker of a
/// task whose lease was lost): longer than a call timeout (1 s by default) and than a
/// reconnection to a Redis that just came back, which takes about 1.4 s.
const LOOK_AT_REDIS: Duration = Duration::from_secs(2);

/// The pauses between acquires while Redis cannot be reached during a wait: short at first (a
/// blip), then at most a second or two (the library short-circuits meanwhile anyway).
const OUTAGE_RETRY_FIRST: Duration = Duration::from_millis(100);
const OUTAGE_RETRY_MAX: Duration = Duration::from_secs(2);

fn spawn(
    args: &RunArgs,
    quota: &Quota,
    lease: &Lease,
    role: TerminalRole,
    restore_ttou: bool,
) -> Result<Child, Failure> {
    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| Failure::new(exit::USAGE, "no command given"))?;
    let mut command = Command::new(program);
    command
        .args(rest)
        .env("LEASEHOLD_QUOTA", quota.name())
        .env("LEASEHOLD_TASK_ID", lease.task_id())
        .env("LEASEHOLD_FENCING_TOKEN", lease.fencing_token().to_string())
        // Its own group, so a signal reaches the whole tree the command starts.
        .process_group(0)
        .kill_on_drop(true);
    job::prepare(&mut command, role, restore_ttou);
    command.spawn().map_err(|e| {
        let code = match e.kind() {
            std::io::ErrorKind::NotFound => exit::NOT_FOUND,
            _ => exit::CANNOT_EXECUTE,
        };
        Failure::new(
            code,
            format!("cannot run {}: {e}", program.to_string_lossy()),
        )
    })
}

enum Outcome {
    Exited(ExitStatus),
    Lost(LostReason),
    /// The job was stopped (Ctrl-Z) past the lease's local deadline: the command was ended
    /// instead of continued.
    StoppedTooLong,
}

/// The command's process (also its process group) and the controlling terminal, if any.
struct Job<'t> {
    pid: i32,
    terminal: Option<&'t Terminal>,
    /// `leasehold run` is alone in its group, so a shell's `fg` may give that group the
    /// terminal, to be passed on.
    fg_may_come: bool,
}

impl Job<'_> {
    fn holds_terminal(&self) -> bool {
        self.terminal.is_some_and(|t| t.is_held_by(self.pid))
    }

    /// `fg` gave the terminal to our group while the command ran (after `bg`, or a run started
    /// with `&`): passes it on, and says so. Else the command's first read of the terminal
    /// would stop the job again (found by review: after Ctrl-Z, `bg`, `fg`, the command never
    /// got the terminal back). bash sends no SIGCONT to a job it brings to the foreground while
    /// it runs, so this is also checked at every look for a stop, and when the command stops
    /// on a terminal read or setting.
    fn pass_terminal_on(&self) -> bool {
        // `may_hand_over` asks the terminal first (one ioctl), and reads /proc only when the
        // terminal is our group's.
        let Some(terminal) = self
            .terminal
            .filter(|t| self.fg_may_come && t.may_hand_over())
        else {
            return false;
        };
        terminal.give_to(self.pid);
        true
    }

    /// True if the command stopped since the last look in a way that stops the whole job.
    fn stopped(&self) -> bool {
        let Some(sig) = job::stopped_by(self.pid) else {
            self.pass_terminal_on();
            return false;
        };
        if matches!(sig, libc::SIGTTIN | libc::SIGTTOU) && self.pass_terminal_on() {
            // It stopped on the terminal that `fg` gave us: it has it now, and goes on.
            job::signal_group(self.pid, libc::SIGCONT);
            return false;
        }
        job::stops_the_job(sig, self.holds_terminal())
    }
}

fn wait_error(e: std::io::Error) -> Failure {
    Failure::new(exit::SOFTWARE, format!("waiting for the command: {e}"))
}

/// How often the command is checked for a stop besides SIGCHLD.
const STOP_CHECK: Duration = Duration::from_millis(250);

async fn supervise(
    child: &mut Child,
    job: &Job<'_>,
    lease: &Lease,
    signals: &mut Signals,
    grace: Duration,
) -> Result<Outcome, Failure> {
    let mut stop_check = tokio::time::interval(STOP_CHECK);
    loop {
        let stop = tokio::select! {
            status = child.wait() => return status.map(Outcome::Exited).map_err(wait_error),
            event = signals.next() => match event {
                // Ours to pass on; the slot is released after the command exits.
                Event::Forward(sig) => { job::signal_group(job.pid, sig); false }
                Event::Stop => true,
                Event::Child => job.stopped(),
                Event::Continued => { job.pass_terminal_on(); false }
            },
            _ = stop_check.tick() => job.stopped(),
            reason = lease.lost() => {
                terminate(child, job.pid, grace).await.map_err(wait_error)?;
                return Ok(Outcome::Lost(reason));
            }
        };
        if !stop {
            continue;
        }
        if let Err(lost) = suspend(job, lease).await {
            terminate(child, job.pid, grace).await.map_err(wait_error)?;
            // A lease can also be lost during a short stop (a cancel, a release by an
            // operator): the stop is to blame only when it outlasted the local deadline.
            return Ok(match lost {
                Some(reason) if reason != LostReason::LocalDeadline => Outcome::Lost(reason),
                _ => Outcome::StoppedTooLong,
            });
        }
    }
}

/// Stops the whole job, command first, until the shell continues it; then continues the
/// command if the lease is still held. Otherwise returns why it is not (`None`: its local
/// deadline passed, and the renewal task has not said so yet). Renewals stop meanwhile, so a
/// long stop ends the lease and the command is not let run again.
async fn suspend(job: &Job<'_>, lease: &Lease) -> Result<(), Option<LostReason>> {
    let already = job::is_stopped(job.pid);
    job::signal_group(job.pid, libc::SIGSTOP);
    if !already {
        // Take the report of our own SIGSTOP now, so it is not mistaken later for a new stop
        // (bounded: the command may exit instead).
        let end = tokio::time::Instant::now() + Duration::from_millis(200);
        while job::stopped_by(job.pid).is_none() && tokio::time::Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    job::stop_self();
    if !lease.is_held() {
        return Err(lease.lost_reason());
    }
    // `fg` gave the terminal to our group: pass it on. After `bg` it is not ours, and the
    // command runs in the background like any job (until a later `fg`: `Event::Continued`).
    job.pass_terminal_on();
    job::signal_group(job.pid, libc::SIGCONT);
    Ok(())
}

/// SIGTERM to the group, then SIGKILL after `grace` to whatever of it is still there: the
/// command, and the processes of its group, which get the whole grace too even when the command
/// ends at once (a wrapper shell that dies of SIGTERM while its worker shuts down cleanly; found
/// by review: the worker was killed 20 ms after the cancel).
async fn terminate(child: &mut Child, pgid: i32, grace: Duration) -> std::io::Result<()> {
    let end = term_group(pgid, grace);
    let exited = match end {
        Some(end) => tokio::time::timeout_at(end, child.wait()).await.is_ok(),
        None => child.wait().await.is_ok(),
    };
    if exited {
        wait_for_group(pgid, end).await;
    }
    job::signal_group(pgid, libc::SIGKILL);
    child.wait().await?;
    Ok(())
}

/// Processes COMMAND started in its group and left running when it exited would run on without
/// the slot, which is released next: SIGTERM to them, SIGKILL after `grace`.
async fn end_leftovers(pgid: i32, grace: Duration) {
    if !job::group_alive(pgid) {
        return;
    }
    let end = term_group(pgid, grace);
    wait_for_group(pgid, end).await;
    job::signal_group(pgid, libc::SIGKILL);
}

/// SIGTERM to the group (continued, since a stopped process acts on it only then); returns when
/// its grace ends: `None` for a grace too long to add to a clock, which waits as long as it
/// takes.
fn term_group(pgid: i32, grace: Duration) -> Option<tokio::time::Instant> {
    job::signal_group(pgid, libc::SIGTERM);
    job::signal_group(pgid, libc::SIGCONT);
    tokio::time::Instant::now().checked_add(grace)
}

/// Waits until nothing of the group is left running, or `end`.
async fn wait_for_group(pgid: i32, end: Option<tokio::time::Instant>) {
    while job::group_alive(pgid) && end.is_none_or(|end| tokio::time::Instant::now() < end) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The exit code of a run whose lease was lost: a cancelled task is not one worth running again.
fn lost_code(reason: &LostReason) -> i32 {
    match reason {
        LostReason::Cancelled(_) => exit::CANCELLED,
        _ => exit::LEASE_LOST,
    }
}

/// The exit code a shell would report for `status`.
fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => exit::SOFTWARE,
    }
}

/// The backend's words of an [`Error::BackendUnavailable`], without the "backend unavailable"
/// prefix the CLI's own message replaces.
fn unavailable_detail(error: &Error) -> String {
    match error {
        Error::BackendUnavailable { detail, .. } => detail.clone(),
        other => other.to_string(),
    }
}
