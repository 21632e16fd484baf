//! `leasehold run`: hold a slot for exactly as long as a child process runs.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use leasehold::{Error, Lease, LostReason, Quota};
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::cli::RunArgs;
use crate::exit::{self, Failure};

/// Signals that `leasehold run` forwards to its child's process group.
struct Forwarded {
    interrupt: Signal,
    terminate: Signal,
    hangup: Signal,
}

impl Forwarded {
    fn install() -> Result<Self, Failure> {
        let make = |kind| {
            signal(kind).map_err(|e| Failure::new(exit::SOFTWARE, format!("signal handler: {e}")))
        };
        Ok(Forwarded {
            interrupt: make(SignalKind::interrupt())?,
            terminate: make(SignalKind::terminate())?,
            hangup: make(SignalKind::hangup())?,
        })
    }

    /// The next signal received, as its number.
    async fn next(&mut self) -> i32 {
        tokio::select! {
            _ = self.interrupt.recv() => libc::SIGINT,
            _ = self.terminate.recv() => libc::SIGTERM,
            _ = self.hangup.recv() => libc::SIGHUP,
        }
    }
}

pub async fn run(quota: Quota, args: RunArgs, verbose: bool) -> Result<i32, Failure> {
    let generated = args.task_id.is_none();
    let task_id = args
        .task_id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    if verbose {
        eprintln!("leasehold: quota {:?}, task id {task_id}", quota.name());
    }
    let mut signals = Forwarded::install()?;
    let lease = tokio::select! {
        lease = acquire(&quota, &task_id, args.wait) => match lease {
            Ok(lease) => lease,
            Err(failure) => {
                if failure.code == exit::NO_SLOT && args.wait.is_some_and(|d| !d.is_zero()) {
                    // `--wait` ran out, maybe with an attempt still in flight.
                    give_back_unclaimed(&quota, &task_id, generated).await;
                }
                return Err(failure);
            }
        },
        sig = signals.next() => {
            give_back_unclaimed(&quota, &task_id, generated).await;
            return Ok(128 + sig);
        }
    };
    if verbose {
        eprintln!(
            "leasehold: acquired, fencing token {}",
            lease.fencing_token()
        );
    }
    let mut child = match spawn(&args, &quota, &lease) {
        Ok(child) => child,
        Err(failure) => {
            // The process exits right after this: a release left to the lease's drop would
            // never be sent.
            release(&lease).await;
            return Err(failure);
        }
    };
    let pgid = child.id().map(|pid| pid as i32);
    let outcome = supervise(&mut child, pgid, &lease, &mut signals, args.grace).await;
    // Release whatever happened: the slot is ours until the backend says otherwise.
    release(&lease).await;
    match outcome? {
        Outcome::Exited(status) => Ok(exit_code(status)),
        Outcome::Lost(reason) => {
            eprintln!("leasehold: {reason}; the command was stopped");
            Ok(match reason {
                LostReason::Cancelled(_) => exit::CANCELLED,
                _ => exit::LEASE_LOST,
            })
        }
    }
}

/// Releases `lease`, or says on stderr that it will expire instead.
async fn release(lease: &Lease) {
    if let Err(e) = lease.release().await {
        eprintln!("leasehold: release failed ({e}); the slot frees when the lease expires");
    }
}

/// The wait ended without a lease, but an admission attempt may still be on its way to Redis,
/// and the process exits before the library could give back what it admits. A task id this run
/// generated is unique to it, so any lease under that id is this run's own, never taken up:
/// release it by id (bounded in time). A task id given by the user may be shared with another
/// process, so it is left alone: such a slot frees when the lease expires, one ttl later.
async fn give_back_unclaimed(quota: &Quota, task_id: &str, generated: bool) {
    if !generated {
        return;
    }
    // A short pause lets an attempt still queued in this process go out before the release;
    // the whole give-back is bounded (a call times out after 1 s).
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        quota.force_release(task_id).await
    })
    .await;
}

async fn acquire(quota: &Quota, task_id: &str, wait: Option<Duration>) -> Result<Lease, Failure> {
    let result = match wait {
        None => quota.acquire(task_id).await,
        Some(d) if d.is_zero() => quota.try_acquire(task_id).await,
        Some(d) => quota.acquire_timeout(task_id, d).await,
    };
    result.map_err(|e| match e {
        Error::Full { .. } | Error::TimedOut { .. } => Failure::new(
            exit::NO_SLOT,
            format!("no slot in quota {:?}: {e}", quota.name()),
        ),
        other => other.into(),
    })
}

fn spawn(args: &RunArgs, quota: &Quota, lease: &Lease) -> Result<Child, Failure> {
    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| Failure::new(exit::USAGE, "no command given"))?;
    Command::new(program)
        .args(rest)
        .env("LEASEHOLD_QUOTA", quota.name())
        .env("LEASEHOLD_TASK_ID", lease.task_id())
        .env("LEASEHOLD_FENCING_TOKEN", lease.fencing_token().to_string())
        // Its own group, so a signal reaches the whole tree the command starts.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
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
}

async fn supervise(
    child: &mut Child,
    pgid: Option<i32>,
    lease: &Lease,
    signals: &mut Forwarded,
    grace: Duration,
) -> Result<Outcome, Failure> {
    let wait_error =
        |e: std::io::Error| Failure::new(exit::SOFTWARE, format!("waiting for the command: {e}"));
    loop {
        tokio::select! {
            status = child.wait() => return status.map(Outcome::Exited).map_err(wait_error),
            sig = signals.next() => {
                // Ours to pass on; the slot is released after the command exits.
                signal_group(pgid, sig);
            }
            reason = lease.lost() => {
                terminate(child, pgid, grace).await.map_err(wait_error)?;
                return Ok(Outcome::Lost(reason));
            }
        }
    }
}

/// SIGTERM to the group, then SIGKILL after `grace` if the command is still there.
async fn terminate(child: &mut Child, pgid: Option<i32>, grace: Duration) -> std::io::Result<()> {
    signal_group(pgid, libc::SIGTERM);
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        signal_group(pgid, libc::SIGKILL);
        child.wait().await?;
    }
    // Children of the command that outlived it get the same end.
    signal_group(pgid, libc::SIGKILL);
    Ok(())
}

fn signal_group(pgid: Option<i32>, sig: i32) {
    if let Some(pgid) = pgid {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
        unsafe {
            libc::kill(-pgid, sig);
        }
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
