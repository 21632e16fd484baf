//! One admission attempt, run to completion on the leasehold runtime whoever still waits for it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::Shared;
use crate::backend::AcquireReply;
use crate::breaker::Permit;
use crate::error::{Error, FullCause, LostReason, Misconfiguration, Result, Unavailable};
use crate::lease::Lease;
use crate::runtime;

/// The longest an admission whose caller gave up waits for another attempt of the same task in
/// this process to share it, before it is released (see `attempt`).
const ORPHAN_GRACE: Duration = Duration::from_secs(2);

/// What one admission attempt produced.
pub(crate) enum Attempt {
    /// The task holds a slot this attempt took (in the backend, or locally by the policy).
    Admitted(Lease),
    /// The task's lease in this process already held the slot: the attempt took none.
    AlreadyHeld(Lease),
    Full {
        retry_after: Duration,
        cause: FullCause,
    },
}

/// How long an attempt started for a waiter by a release event keeps a slot it won for that
/// waiter to take. A waiter whose runtime does not run it by then (blocked, wedged) must not sit
/// on a slot others could use: the admission is released and the waiter tries again later. At
/// 100 ms, a loaded test machine's runtime was sometimes that slow to run a woken waiter, which
/// lost its turn to the next (arrival order broke in about 1 run in 40 of the conformance suite
/// under load).
const TAKE_GRACE: Duration = Duration::from_millis(250);

/// How long a waiter may take to read a refusal before it counts as stalled (see
/// `WaitQueue::stalled`): well beyond what a loaded runtime takes to run a woken task (more than
/// [`TAKE_GRACE`]), so that arrival order holds there, and far shorter than a line poll, which
/// a stalled waiter kept freed slots for.
const STALL_GRACE: Duration = Duration::from_secs(1);

/// Run by an attempt's task, on leasehold's runtime, when the attempt was refused and its caller
/// did not read the refusal within [`STALL_GRACE`] of it: the caller's task is not running.
pub(crate) type IfStalled = Box<dyn FnOnce() + Send>;

/// An admission attempt under way (or decided at once, without the backend).
pub(crate) enum StartedAttempt {
    Done(Result<Attempt>),
    Running {
        outcome: oneshot::Receiver<Result<Attempt>>,
        /// Tells the attempt's task that its caller waits for the outcome (for an attempt
        /// started on a waiter's behalf: that the waiter is there to take it), with what to run
        /// if a refusal is not read in time (`outcome_or_if_stalled`).
        taken: oneshot::Sender<Option<IfStalled>>,
        /// Tells the attempt's task that its outcome was read.
        read: oneshot::Sender<()>,
    },
}

impl std::fmt::Debug for StartedAttempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StartedAttempt::Done(_) => "StartedAttempt::Done",
            StartedAttempt::Running { .. } => "StartedAttempt::Running",
        })
    }
}

impl StartedAttempt {
    /// Waits for the attempt's outcome.
    pub(crate) async fn outcome(self) -> Result<Attempt> {
        self.outcome_or_if_stalled(None).await
    }

    /// Waits for the attempt's outcome; if the attempt is refused and this future does not
    /// read the refusal within [`STALL_GRACE`] (it is not polled: a parked future, a blocked
    /// runtime), `if_stalled` runs then, on leasehold's runtime.
    pub(crate) async fn outcome_or_if_stalled(
        self,
        if_stalled: Option<IfStalled>,
    ) -> Result<Attempt> {
        match self {
            StartedAttempt::Done(outcome) => outcome,
            StartedAttempt::Running {
                outcome,
                taken,
                read,
            } => {
                let _ = taken.send(if_stalled);
                let outcome = outcome.await;
                let _ = read.send(());
                outcome.unwrap_or_else(|_| {
                    Err(Error::unavailable(
                        Unavailable::NoReply,
                        "leasehold runtime stopped during an attempt",
                    ))
                })
            }
        }
    }
}

/// Counts one admission attempt of a task for as long as it lives.
struct AttemptInFlight<'a> {
    shared: &'a Shared,
    task_id: &'a str,
}

impl<'a> AttemptInFlight<'a> {
    fn new(shared: &'a Shared, task_id: &'a str) -> Self {
        let mut attempts = shared.admissions.attempts();
        *attempts.entry(task_id.to_owned()).or_default() += 1;
        AttemptInFlight { shared, task_id }
    }
}

impl Drop for AttemptInFlight<'_> {
    fn drop(&mut self) {
        let mut attempts = self.shared.admissions.attempts();
        if let Some(n) = attempts.get_mut(self.task_id) {
            *n -= 1;
            if *n == 0 {
                attempts.remove(self.task_id);
            }
        }
    }
}

impl Shared {
    /// Starts one admission attempt of `task_id` on the leasehold runtime; it runs to completion
    /// even if nobody waits for its outcome any more (a late admission nobody takes is released).
    pub(crate) fn start_attempt(self: &Arc<Self>, task_id: &str) -> StartedAttempt {
        self.start_attempt_for(task_id, false)
    }

    /// Starts an attempt like [`start_attempt`](Self::start_attempt); when `for_waiter`, the
    /// waiter must take it within [`TAKE_GRACE`] of its reply, or a slot it won is given back.
    pub(super) fn start_attempt_for(
        self: &Arc<Self>,
        task_id: &str,
        for_waiter: bool,
    ) -> StartedAttempt {
        // A task granted a local lease keeps it, even once the backend answers again: asking
        // the backend would take it a second slot.
        if let Some(local) = self.local_lease_of(task_id).filter(|l| !l.is_over()) {
            return StartedAttempt::Done(Ok(Attempt::AlreadyHeld(Lease::from_inner(local))));
        }
        if self.breaker.permit() == Permit::Reject {
            // O(1), no network I/O: the circuit is open.
            let down = Error::unavailable(
                Unavailable::ShortCircuit,
                "circuit open after repeated failures",
            );
            return StartedAttempt::Done(self.when_down(task_id, down));
        }
        let (tx, rx) = oneshot::channel();
        let (taken, mut taken_rx) = oneshot::channel::<Option<IfStalled>>();
        let (read, read_rx) = oneshot::channel();
        let shared = self.clone();
        let id = task_id.to_owned();
        let work = self.admissions.pending.start();
        runtime::spawn(async move {
            // Dropped last: a late admission nobody takes is let go before `flush` returns.
            let _work = work;
            let counted = AttemptInFlight::new(&shared, &id);
            let (reply, admitted, sent, local) = {
                // Adopted before the turn ends, so that a release of this task that waits for
                // the turn sees the new handle and leaves the lease to it.
                let _turn = shared.admissions.turns.take(&id).await;
                let (reply, sent) = shared.acquire_in_backend(&id).await;
                let mut local = None;
                let admitted = match &reply {
                    Ok(found @ (AcquireReply::Acquired(record) | AcquireReply::Held(record))) => {
                        match shared.adopt_unless_local(record, sent) {
                            Ok(lease) => {
                                shared.waiters.task_admitted(&id);
                                Some(lease)
                            }
                            Err(kept) => {
                                shared.give_back_beside_local(found).await;
                                local = Some(kept);
                                None
                            }
                        }
                    }
                    // Not a limit mismatch: it is answered before the quarantine, so a lease
                    // that a loss of the backend's state dropped and its next renewal
                    // re-registers is answered that way too.
                    Ok(AcquireReply::Full { .. }) => {
                        shared.end_lease_admitted_before(&id, sent, LostReason::Expired);
                        None
                    }
                    Ok(AcquireReply::Cancelled { reason }) => {
                        let reason = LostReason::Cancelled(reason.clone());
                        shared.end_lease_admitted_before(&id, sent, reason);
                        None
                    }
                    _ => None,
                };
                (reply, admitted, sent, local)
            };
            shared.record_backend_result(&reply, sent);
            if let Some(local) = local {
                let _ = tx.send(Ok(Attempt::AlreadyHeld(Lease::from_inner(local))));
                return;
            }
            // What to run if a refusal is not read in time: sent by the caller as it waits.
            let mut if_stalled = None;
            if for_waiter {
                // Usually taken long before the reply; otherwise the waiter is not running.
                let taken = tokio::time::timeout(TAKE_GRACE, &mut taken_rx).await;
                if let Ok(Ok(hook)) = taken {
                    if_stalled = hook;
                } else {
                    if let Some(unclaimed) = admitted {
                        // Given back the way an orphan is: another caller of the same task may
                        // already share this admission (its acquire came back `held`), and then
                        // dropping this handle must not release it.
                        drop(counted);
                        shared.wait_for_other_attempts(&id).await;
                        drop(unclaimed);
                    }
                    // A waiter that runs later tries again at once.
                    let _ = tx.send(Ok(Attempt::Full {
                        retry_after: Duration::ZERO,
                        cause: FullCause::NoSlot,
                    }));
                    return;
                }
            }
            let outcome = match reply {
                Ok(AcquireReply::Acquired(_)) => Ok(Attempt::Admitted(
                    admitted.expect("an admission is adopted as it arrives"),
                )),
                Ok(AcquireReply::Held(_)) => Ok(Attempt::AlreadyHeld(
                    admitted.expect("an admission is adopted as it arrives"),
                )),
                Ok(AcquireReply::Full {
                    now_ms,
                    earliest_deadline_ms,
                }) => {
                    // The first expiry in server time, plus 1 ms so the reap sees it passed.
                    let retry_after =
                        Duration::from_millis(earliest_deadline_ms.saturating_sub(now_ms) + 1);
                    shared.waiters.note_expiry(Instant::now() + retry_after);
                    Ok(Attempt::Full {
                        retry_after,
                        cause: FullCause::NoSlot,
                    })
                }
                Ok(AcquireReply::Quarantined { remaining_ms }) => {
                    tracing::warn!(quota = %shared.keys.name, remaining_ms,
                        "admissions quarantined: the backend lost the quota's state");
                    match shared.lease(&id).filter(|l| !l.is_over()) {
                        // This process holds the task's lease, which its next renewal
                        // re-registers (PROTOCOL §8): it is held, not full.
                        Some(held) => Ok(Attempt::AlreadyHeld(Lease::from_inner(held))),
                        None => Ok(Attempt::Full {
                            retry_after: Duration::from_millis(remaining_ms + 1),
                            cause: FullCause::Quarantined {
                                remaining: Duration::from_millis(remaining_ms),
                            },
                        }),
                    }
                }
                Ok(AcquireReply::Cancelled { reason }) => Err(Error::Cancelled(reason)),
                Ok(AcquireReply::LimitMismatch { stored }) => Err(
                    Misconfiguration::limit_mismatch(shared.config.limit.limit, stored),
                ),
                Err(e @ Error::BackendUnavailable { .. }) => shared.when_down(&id, e),
                Err(e) => Err(e),
            };
            let refused = matches!(outcome, Ok(Attempt::Full { .. }));
            match tx.send(outcome) {
                Err(Ok(Attempt::Admitted(orphan) | Attempt::AlreadyHeld(orphan))) => {
                    // The caller gave up. A retry of the same task already in flight will come
                    // back `held` with this very lease: keep it until that retry has adopted it,
                    // then let it go; if nobody shares it, its drop releases it at once. This
                    // attempt no longer counts: another orphan of the task must not wait for
                    // it, nor it for them.
                    drop(counted);
                    shared.wait_for_other_attempts(&id).await;
                    drop(orphan);
                }
                Ok(()) if refused => {
                    // Done, for `flush` and for other attempts of the task; only the caller's
                    // reading is watched now.
                    drop((counted, _work));
                    let deadline = tokio::time::Instant::now() + STALL_GRACE;
                    if !for_waiter {
                        // Sent as the caller began to wait, usually before the reply.
                        let sent = tokio::time::timeout_at(deadline, taken_rx).await;
                        if_stalled = sent.ok().and_then(Result::ok).flatten();
                    }
                    if let Some(if_stalled) = if_stalled {
                        if tokio::time::timeout_at(deadline, read_rx).await.is_err() {
                            if_stalled();
                        }
                    }
                }
                _ => {}
            }
        });
        StartedAttempt::Running {
            outcome: rx,
            taken,
            read,
        }
    }

    /// Admission attempts of `task_id` under way in this process.
    pub(super) fn attempts_in_flight(&self, task_id: &str) -> usize {
        let attempts = self.admissions.attempts();
        attempts.get(task_id).copied().unwrap_or(0)
    }

    /// Waits, at most [`ORPHAN_GRACE`], until no attempt of `task_id` whose caller still waits is
    /// under way (the caller's own no longer counts): one that comes back `held` adopts the
    /// caller's lease before it is let go.
    pub(super) async fn wait_for_other_attempts(&self, task_id: &str) {
        let until = Instant::now() + ORPHAN_GRACE;
        while self.attempts_in_flight(task_id) > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
