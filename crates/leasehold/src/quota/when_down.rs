//! Admissions the backend could not decide: the backend-down policy and its local leases.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use super::attempt::Attempt;
use super::listening::SUBSCRIBE_RETRY;
use super::Shared;
use crate::backend::{AcquireReply, LeaseRecord};
use crate::config::BackendDownPolicy;
use crate::error::{Error, FullCause, Result};
use crate::lease::{Lease, LeaseInner};
use crate::runtime;

/// While the backend refuses the subscription, the ticks ([`SUBSCRIBE_RETRY`]) between two
/// attempts of the watch over local leases: enough to notice an ACL fixed meanwhile.
const REFUSED_SUBSCRIBE_RETRY: u32 = 10;

impl Shared {
    /// Answers an admission the backend could not decide, by the quota's policy. A task that
    /// holds a lease in this process gets that lease back whatever the policy: never a second
    /// slot, never `Full`, never an error for a lease it holds.
    pub(super) fn when_down(self: &Arc<Self>, task_id: &str, down: Error) -> Result<Attempt> {
        if let Some(held) = self.held_lease_of(task_id) {
            return Ok(Attempt::AlreadyHeld(Lease::from_inner(held)));
        }
        match self.config.when_down {
            BackendDownPolicy::FailClosed => Err(down),
            BackendDownPolicy::FailOpen => Ok(self.grant_locally(task_id, u32::MAX)),
            BackendDownPolicy::DegradeLocal { share } => Ok(self.grant_locally(task_id, share)),
        }
    }

    /// A lease granted without the backend while fewer than `share` local leases are held, or
    /// the local lease `task_id` already holds. Both are decided under the local leases' lock, so
    /// that concurrent calls for one task take one slot, not two.
    pub(super) fn grant_locally(self: &Arc<Self>, task_id: &str, share: u32) -> Attempt {
        // Declared before the lock so that it drops after it: the drop of a lease that is over
        // may come back to this map (`forget`).
        let (found, in_backend): (Option<Arc<LeaseInner>>, Option<Arc<LeaseInner>>);
        let mut local = self.admissions.local();
        found = local.get(task_id).and_then(Weak::upgrade);
        if let Some(held) = found.as_ref().filter(|l| !l.is_over()) {
            return Attempt::AlreadyHeld(Lease::from_inner(held.clone()));
        }
        // A backend lease adopted since the caller looked (`when_down`): looked for again under
        // this lock, which `adopt_unless_local` holds while it adopts.
        in_backend = self.lease(task_id);
        if let Some(held) = in_backend.as_ref().filter(|l| !l.is_over()) {
            return Attempt::AlreadyHeld(Lease::from_inner(held.clone()));
        }
        let took = self
            .admissions
            .local_held
            // SeqCst: see `watch_local_leases`.
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
                (held < share).then_some(held + 1)
            })
            .is_ok();
        if !took {
            return Attempt::Full {
                retry_after: self.config.breaker.cool_down,
                cause: FullCause::LocalShareUsed,
            };
        }
        tracing::warn!(quota = %self.keys.name, task_id, policy = ?self.config.when_down,
            "backend unavailable: lease granted locally");
        let inner = Arc::new(LeaseInner::local(self.clone(), task_id));
        local.insert(task_id.to_owned(), Arc::downgrade(&inner));
        drop(local);
        // Its task may have been cancelled before, which the policy could not read: its marker
        // is read once the backend answers again, with or without an outage's resubscription.
        // Not at once: the backend just failed the call that led here, and a read now would
        // only fail too (and count towards opening the short-circuit).
        self.local_markers_due_at(Instant::now() + SUBSCRIBE_RETRY);
        self.watch_local_leases();
        Attempt::Admitted(Lease::from_inner(inner))
    }

    /// A local lease is never renewed: it hears of a cancel through the quota's channel, or by
    /// reading its cancel marker. A process that holds only local leases makes no backend call
    /// that would subscribe again, so while any is held, a watcher ticks every
    /// [`SUBSCRIBE_RETRY`]:
    /// - it retries the subscription until it is in place, and again whenever it drops;
    /// - it reads the markers while one may hold a cancel no message told (a tick after a lease
    ///   was granted, at once after a subscription made again), at each tick until a read gets
    ///   through the short-circuit;
    /// - it reads them at every tick when no message can come: events off, or the subscription
    ///   refused (an ACL without the channel), which is then asked for only every
    ///   [`REFUSED_SUBSCRIBE_RETRY`] ticks, since each refused attempt would be for nothing.
    pub(super) fn watch_local_leases(self: &Arc<Self>) {
        // SeqCst on both sides: the grant's increment then swap, and the watcher's store then
        // load, must not both read the old value, or nobody would watch.
        if self.watching_local.swap(true, Ordering::SeqCst) {
            return;
        }
        let shared = Arc::downgrade(self);
        let stop = self.shutdown.clone();
        let wake = self.local_watch.clone();
        runtime::spawn(async move {
            let mut ticks_since_attempt = 0;
            loop {
                let Some(this) = shared.upgrade() else { return };
                if this.admissions.local_held.load(Ordering::SeqCst) == 0 {
                    this.watching_local.store(false, Ordering::SeqCst);
                    // A lease granted just before the flag went down found it up and left the
                    // watching to this task.
                    if this.admissions.local_held.load(Ordering::SeqCst) == 0
                        || this.watching_local.swap(true, Ordering::SeqCst)
                    {
                        return;
                    }
                }
                let refused = this.subscribe_refused.load(Ordering::Acquire);
                let deaf = !this.config.events || refused;
                let due = this.take_local_markers_due();
                if (deaf || due) && !this.clone().read_local_cancel_markers().await {
                    // Not read through (the short-circuit, the backend still down): next tick.
                    this.local_markers_due_at(Instant::now());
                }
                if this.config.events
                    && (!refused || ticks_since_attempt >= REFUSED_SUBSCRIBE_RETRY)
                {
                    ticks_since_attempt = 0;
                    // This task's own tick spaces its attempts: the spacing of waiters'
                    // attempts after a failure would skip every other tick.
                    this.listen_now();
                }
                ticks_since_attempt += 1;
                drop(this);
                tokio::select! {
                    _ = tokio::time::sleep(SUBSCRIBE_RETRY) => {}
                    _ = wake.notified() => {}
                    _ = stop.cancelled() => return,
                }
            }
        });
    }

    /// Adopts an admission the backend reported for `record`'s task, unless the policy granted
    /// the task a local lease meanwhile (the circuit opened while the attempt was out): then the
    /// task keeps its local lease, returned as `Err`, and the admission is not adopted. A task of
    /// this process never holds a backend lease and a local one (found by review, three times).
    ///
    /// Decided under the local leases' lock, under which [`grant_locally`](Self::grant_locally)
    /// also looks for the task's backend lease: of an adoption and a grant that race, the later
    /// sees the earlier (a look at the local leases before the adoption, and a grant between the
    /// two, took two slots).
    pub(super) fn adopt_unless_local(
        self: &Arc<Self>,
        record: &LeaseRecord,
        sent: Instant,
    ) -> std::result::Result<Lease, Arc<LeaseInner>> {
        // Declared before the lock so that it drops after it: the drop of a local lease that is
        // over comes back to this map (`forget`).
        let found: Option<Arc<LeaseInner>>;
        let local = self.admissions.local();
        found = local.get(&record.task_id).and_then(Weak::upgrade);
        if let Some(held) = found.as_ref().filter(|l| !l.is_over()) {
            return Err(held.clone());
        }
        // Lock order: the local leases, then the registry (`adopt`), as in `grant_locally`.
        let adopted = self.adopt(record, sent);
        drop(local);
        Ok(adopted)
    }

    /// Gives back a new admission (`acquired`) of a task that keeps its local lease instead
    /// ([`adopt_unless_local`](Self::adopt_unless_local)): it is this process's alone. One the
    /// backend found (`held`: an earlier attempt's whose reply was lost, or another process's of
    /// the same id) is left to its holder or its expiry.
    pub(super) async fn give_back_beside_local(&self, reply: &AcquireReply) {
        let AcquireReply::Acquired(record) = reply else {
            return;
        };
        if let Err(e) = self.release_token(&record.task_id, record.token).await {
            tracing::warn!(quota = %self.keys.name, task_id = %record.task_id, error = %e,
                "a slot admitted beside the task's local lease was not given back; it \
                 expires after its ttl");
        }
    }

    /// A local lease was released.
    pub(crate) fn local_released(self: &Arc<Self>) {
        self.admissions.local_held.fetch_sub(1, Ordering::AcqRel);
        if matches!(
            self.config.when_down,
            BackendDownPolicy::DegradeLocal { .. }
        ) {
            // A waiter held back by the share may take it now, not at its next poll.
            self.slot_freed();
        }
    }
}
