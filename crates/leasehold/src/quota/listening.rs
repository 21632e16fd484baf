//! The quota's event subscription: made in the background, made again after it drops, and the
//! rechecks that cover the events missed meanwhile.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::Shared;
use crate::breaker::{BreakerMode, Permit};
use crate::error::{Error, LostReason, Result};
use crate::lease::LeaseInner;
use crate::runtime;

/// How long after a failed subscription a waiter tries again (each try may cost a call timeout).
pub(super) const SUBSCRIBE_RETRY: Duration = Duration::from_secs(1);

impl Shared {
    /// Wakes one waiter, with its attempt already started: a slot may have freed.
    pub(crate) fn slot_freed(self: &Arc<Self>) {
        self.waiters
            .wake_one_starting(|task_id| self.start_attempt_for(task_id, true));
    }

    /// Wakes every waiter, the idle ones with their attempts already started in arrival order:
    /// events may have been missed.
    pub(crate) fn recheck_all(self: &Arc<Self>) {
        self.waiters
            .wake_all_starting(|task_id| self.start_attempt_for(task_id, true));
    }

    /// Events may have been missed (a subscription made or made again, a receiver that lagged):
    /// every waiter checks again, and every local lease reads its cancel marker.
    pub(crate) fn recheck_missed_events(self: &Arc<Self>) {
        self.recheck_all();
        self.recheck_local_cancels();
    }

    /// Has the watcher of local leases read their cancel markers now, and again at its next
    /// ticks until a read gets through: a cancel message sent while nothing listened went
    /// unheard. (A read skipped because the short-circuit was still open after an outage, and
    /// never made again, left a cancelled task running on its local lease for good: found by
    /// review.)
    pub(super) fn recheck_local_cancels(self: &Arc<Self>) {
        self.local_markers_due_at(Instant::now());
        self.local_watch.notify_one();
    }

    /// The local leases' cancel markers are to be read at `at`, or sooner if already due.
    pub(super) fn local_markers_due_at(&self, at: Instant) {
        let mut due = self
            .local_markers_due
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *due = Some(due.map_or(at, |due| due.min(at)));
    }

    /// Whether the local leases' cancel markers are due for a read now; if so, no longer due.
    pub(super) fn take_local_markers_due(&self) -> bool {
        let mut due = self
            .local_markers_due
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match *due {
            Some(at) if at <= Instant::now() => {
                *due = None;
                true
            }
            _ => false,
        }
    }

    /// Reads the cancel markers of the local leases held, one after another, and ends the
    /// leases cancelled meanwhile: a local lease is never renewed, so it learns of a cancel by
    /// message or by these reads. One call per local lease; they exist only around outages, so
    /// each read asks the short-circuit first and feeds it, like any call: while the backend is
    /// down the round stops at the first refusal or failure, and after the cool-down its first
    /// read is the probe. Returns whether every marker was read.
    pub(super) async fn read_local_cancel_markers(self: Arc<Self>) -> bool {
        // Weak, and upgraded only out of the lock: the drop of a lease that is over comes back
        // to this map; and a lease dropped while its marker is read is released at once.
        let held: Vec<(String, Weak<LeaseInner>)> = self
            .admissions
            .local()
            .iter()
            .map(|(task_id, lease)| (task_id.clone(), lease.clone()))
            .collect();
        for (task_id, lease) in held {
            if lease.upgrade().is_none_or(|l| l.is_over()) {
                continue;
            }
            if self.breaker.permit() == Permit::Reject {
                return false;
            }
            let sent = Instant::now();
            let marker = self.backend.cancel_reason(&self.keys, &task_id).await;
            self.record_backend_result(&marker, sent);
            match (marker, lease.upgrade()) {
                (Ok(Some(reason)), Some(lease)) => {
                    lease.mark_lost(LostReason::Cancelled(reason));
                }
                (Err(Error::BackendUnavailable { .. }), _) => return false,
                _ => {}
            }
        }
        true
    }

    /// Wakes the waiters of `task_id` only: it was cancelled, and its next attempt says so.
    pub(crate) fn recheck_task(&self, task_id: &str) {
        self.waiters.wake_task(task_id);
    }

    /// The event subscription ended (it failed, or the backend dropped it): the next acquire
    /// subscribes again.
    pub(crate) fn stopped_listening(&self) {
        self.listening.store(false, Ordering::Release);
    }

    /// Subscribes in the background when the subscription is missing: no caller waits on a
    /// subscribe call (on a dead link it takes a whole call timeout, and subscribes of several
    /// quotas go one after another), and a waiter must not sit on a slot a release won for it
    /// while one is out.
    ///
    /// After a failed attempt the next one waits out [`SUBSCRIBE_RETRY`], rather than being
    /// skipped: the call that asked may be the last for a while (a waiter that sleeps to a far
    /// expiry, a holder between renewals).
    pub(crate) fn listen_in_background(self: &Arc<Self>) {
        if !self.config.events || self.listening.load(Ordering::Acquire) {
            return;
        }
        if self.subscribing.swap(true, Ordering::AcqRel) {
            return;
        }
        let now = self.subscribe_now.clone();
        // Weak while it waits: a quota dropped meanwhile does not subscribe.
        let shared = Arc::downgrade(self);
        // Releases announced before the subscription went unheard: once it is in place, every
        // waiter re-checks (`ensure_listening`).
        runtime::spawn(async move {
            // Listening for `listen_now` before the spacing is read: it clears the spacing, then
            // notifies only those already listening, so a call in between is seen either way.
            let notified = now.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let Some(wait) = shared.upgrade().map(|s| s.subscribe_spacing_left()) else {
                return;
            };
            if !wait.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = notified => {}
                }
            }
            let Some(shared) = shared.upgrade() else {
                return;
            };
            shared.ensure_listening().await;
            shared.subscribing.store(false, Ordering::Release);
        });
    }

    /// What is left of the spacing after the latest failed subscription attempt.
    fn subscribe_spacing_left(&self) -> Duration {
        let failed_at = *self
            .subscribe_failed_at
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        failed_at.map_or(Duration::ZERO, |at| {
            SUBSCRIBE_RETRY.saturating_sub(at.elapsed())
        })
    }

    /// Like [`listen_in_background`](Self::listen_in_background), but without waiting out the
    /// spacing of attempts after a failed one, which is there for waiters' rounds: for a caller
    /// with its own reason to try now (the backend answers again) or its own spacing.
    pub(super) fn listen_now(self: &Arc<Self>) {
        *self
            .subscribe_failed_at
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
        // An attempt already waiting out the spacing goes now.
        self.subscribe_now.notify_waiters();
        self.listen_in_background();
    }

    /// Subscribes once to the quota's events; on failure, waiting falls back to timers and polls
    /// and the next call tries again, as does the next answer of the backend unless the
    /// subscription was refused (`SUBSCRIBE_RETRY` after the failure).
    async fn ensure_listening(self: &Arc<Self>) {
        if !self.config.events || self.listening.load(Ordering::Acquire) {
            return;
        }
        if self.breaker.mode() == BreakerMode::Open {
            // The policy answers at once while the circuit is open; subscribing would wait on
            // the unreachable backend first. A later acquire, or a waiter's next round, subscribes.
            return;
        }
        let subscribed = self.backend.subscribe(&self.keys).await;
        *self
            .subscribe_failed_at
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = subscribed.is_err().then(Instant::now);
        match subscribed {
            Ok(events) => {
                self.subscribe_refused.store(false, Ordering::Release);
                if !self.listening.swap(true, Ordering::AcqRel) {
                    let stop = self.shutdown.clone();
                    let listener = crate::events::listen(Arc::downgrade(self), events);
                    runtime::spawn(async move {
                        tokio::select! {
                            _ = listener => {}
                            _ = stop.cancelled() => {}
                        }
                    });
                    // Releases and cancels announced before this subscription went unheard,
                    // and no confirmation may come to say so (a channel another handle already
                    // subscribed, the memory backend).
                    self.recheck_missed_events();
                }
            }
            // Refused (an ACL without the quota's channel): an operator must hear of it, once,
            // and the backend's answers stop retrying it (a holder alone would otherwise send a
            // refused SUBSCRIBE every second); acquires and waiters' rounds still do.
            Err(e @ Error::Misconfigured(_)) => {
                if !self.subscribe_refused.swap(true, Ordering::AcqRel) {
                    tracing::warn!(quota = %self.keys.name, error = %e,
                        "event subscription refused: waiting relies on timers and polls, and \
                         holders hear of cancels and forced releases at their next renewal");
                }
            }
            Err(e) => {
                self.subscribe_refused.store(false, Ordering::Release);
                tracing::debug!(quota = %self.keys.name, error = %e,
                    "no event subscription yet; waiting relies on timers and polls")
            }
        }
    }

    /// Feeds the short-circuit with the outcome of a backend call. The first answer after an
    /// outage subscribes at once if the subscription is missing: cancels and releases are heard
    /// again without waiting for a caller's next round. Other answers subscribe too while it is
    /// missing (one that failed while the backend could not answer, a backend connected lazily
    /// during an outage), after the spacing of attempts, unless it was refused.
    pub(crate) fn record_backend_result<T>(self: &Arc<Self>, result: &Result<T>, sent: Instant) {
        match result {
            Err(Error::BackendUnavailable { .. }) => self.breaker.failure(sent),
            _ => {
                if self.breaker.success() {
                    self.listen_now();
                } else if !self.subscribe_refused.load(Ordering::Acquire) {
                    self.listen_in_background();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryBackend, Quota};

    /// `listen_now` (the backend answers again after an outage) cuts short a retry that waits
    /// out the spacing after a failed subscription, even one spawned in the same poll that has
    /// not started yet (found by review: its wake-up was lost, and it slept the whole second).
    #[tokio::test]
    async fn listen_now_cuts_short_a_retry_spawned_just_before_it() {
        let quota = Quota::builder("retry")
            .limit(1)
            .backend(MemoryBackend::new())
            .build()
            .unwrap();
        let shared = quota.shared.clone();
        *shared.subscribe_failed_at.lock().unwrap() = Some(Instant::now());
        let started = Instant::now();
        let both = shared.clone();
        runtime::run(async move {
            both.listen_in_background();
            both.listen_now();
            Ok(())
        })
        .await
        .unwrap();
        while !shared.listening.load(Ordering::Acquire) {
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "never subscribed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = started.elapsed();
        assert!(
            took < Duration::from_millis(500),
            "subscribed after {took:?}"
        );
    }
}
