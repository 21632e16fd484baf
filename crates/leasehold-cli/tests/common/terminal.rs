//! A pseudo-terminal whose new session runs one command, the test playing the terminal: it
//! types the input and reads what is shown. Nothing sits between the test and the session
//! leader (util-linux `script` did, and it sometimes never reaped a child that ended after a
//! stop and continue).

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// A command running as the leader of a new session whose controlling terminal is a pty.
pub struct InTerminal {
    child: Child,
    keyboard: File,
    shown: Receiver<Vec<u8>>,
}

/// What a command in a terminal left: how it ended and everything the terminal showed.
pub struct Shown {
    pub status: ExitStatus,
    pub text: String,
}

impl InTerminal {
    /// Starts `command` as the leader of a new session on a new pty: the foreground group of
    /// that terminal, alone in it, as an interactive shell starts a job.
    pub fn spawn(mut command: Command) -> InTerminal {
        let (master, slave) = open_pty();
        let slave = File::from(slave);
        command
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        // SAFETY: setsid(2) and ioctl(2) are async-signal-safe and allocate nothing. Standard
        // input is already the pty's slave side when this runs.
        unsafe {
            command.pre_exec(|| {
                if libc::setsid() == -1 || libc::ioctl(0, libc::TIOCSCTTY, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("spawn in a terminal");
        // The spawned `Command` still holds slave descriptors until it is dropped: reads on the
        // master end only once every slave descriptor is closed.
        drop(command);
        let master = File::from(master);
        let mut screen = master.try_clone().unwrap();
        let (tx, shown) = channel();
        std::thread::spawn(move || {
            let mut all = Vec::new();
            let mut buf = [0u8; 4096];
            // Ends with EIO once no process has the slave side open any more.
            while let Ok(n @ 1..) = screen.read(&mut buf) {
                all.extend_from_slice(&buf[..n]);
            }
            let _ = tx.send(all);
        });
        InTerminal {
            child,
            keyboard: master,
            shown,
        }
    }

    /// The session leader's pid.
    pub fn id(&self) -> i32 {
        self.child.id() as i32
    }

    /// Types `bytes` on the terminal's keyboard.
    pub fn type_in(&mut self, bytes: &[u8]) {
        self.keyboard.write_all(bytes).unwrap();
    }

    /// True once the session leader has ended (it is reaped then).
    pub fn ended(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    /// Waits (bounded) for the session leader to end and the terminal to close.
    pub fn wait(mut self, within: Duration) -> Shown {
        let end = Instant::now() + within;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            // On a timeout, the panic drops (kills and reaps) the session leader.
            assert!(
                Instant::now() <= end,
                "the command in the terminal did not finish within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let left = end.saturating_duration_since(Instant::now()) + Duration::from_secs(1);
        let shown = self
            .shown
            .recv_timeout(left)
            .expect("a process left behind kept the terminal open");
        Shown {
            status,
            text: String::from_utf8_lossy(&shown).into_owned(),
        }
    }
}

/// A test that panics kills and reaps the session leader (`leasehold run` then ends its
/// command); after [`InTerminal::wait`] it is already reaped and this does nothing.
impl Drop for InTerminal {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A new pty pair `(master, slave)`, both closed on exec.
fn open_pty() -> (OwnedFd, OwnedFd) {
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty(3) writes two descriptors into the integers given; no name, no settings.
    let opened = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(opened, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: openpty succeeded, so both are open descriptors that nothing else owns.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    for fd in [&master, &slave] {
        // SAFETY: fcntl(2) on a descriptor we own.
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    (master, slave)
}
