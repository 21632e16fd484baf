//! The leases of a quota this process holds: adopting the backend's replies, finding and
//! forgetting them.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Instant;

use super::Shared;
use crate::backend::LeaseRecord;
use crate::error::LostReason;
use crate::lease::{Lease, LeaseInner};

impl Shared {
    /// The live lease of `task_id` in this process, if any.
    pub(crate) fn lease(&self, task_id: &str) -> Option<Arc<LeaseInner>> {
        live_in(self.admissions.registry(), task_id)
    }

    /// The backend answered a call about `task_id` sent at `sent` in a way that ends the task's
    /// lease: an acquire answered full (never the answer while the task holds a live lease,
    /// PROTOCOL.md §5.2) or cancelled, a forced release. The task's lease in this process, if
    /// the call that admitted it was sent before, ends with `reason` now rather than at its next
    /// renewal, up to a heartbeat later, while another process may already hold its slot.
    pub(crate) fn end_lease_admitted_before(
        &self,
        task_id: &str,
        sent: Instant,
        reason: LostReason,
    ) {
        if let Some(lease) = self.lease(task_id).filter(|l| l.admitted_before(sent)) {
            self.tell_lost(lease, reason);
        }
    }

    /// Tells `lease`, looked up by a background task, that it is lost, counted as work for
    /// `Quota::flush` until this handle is dropped: a holder told here may drop its lease and
    /// flush at once, and then this handle is the last, whose drop sends the release (found by
    /// review: `flush` returned before it).
    pub(crate) fn tell_lost(&self, lease: Arc<LeaseInner>, reason: LostReason) {
        let _work = self.admissions.pending.start();
        lease.mark_lost(reason);
        drop(lease);
    }

    /// The live lease the backend-down policy granted `task_id` in this process, if any.
    pub(crate) fn local_lease_of(&self, task_id: &str) -> Option<Arc<LeaseInner>> {
        live_in(self.admissions.local(), task_id)
    }

    /// The lease `task_id` holds in this process, from the backend or from the policy, if it is
    /// not over.
    pub(super) fn held_lease_of(&self, task_id: &str) -> Option<Arc<LeaseInner>> {
        self.lease(task_id)
            .or_else(|| self.local_lease_of(task_id))
            .filter(|l| !l.is_over())
    }

    /// The live leases this handle admitted (and renews), in this process.
    pub(crate) fn leases(&self) -> Vec<Arc<LeaseInner>> {
        let found: Vec<_> = {
            let registry = self.admissions.registry();
            registry.values().filter_map(Weak::upgrade).collect()
        };
        // Other handles of this quota share the registry, and renew their own leases.
        found
            .into_iter()
            .filter(|l| !l.is_lost() && std::ptr::eq(Arc::as_ptr(&l.quota), self))
            .collect()
    }

    /// Returns a handle to the lease the backend just reported, sharing the live one of this
    /// process when it is the same admission.
    pub(super) fn adopt(self: &Arc<Self>, record: &LeaseRecord, sent: Instant) -> Lease {
        let mut registry = self.admissions.registry();
        // `live` may be the last handle of a stale admission: it is dropped only after the
        // registry is unlocked, because that drop needs the registry.
        let live = registry.get(&record.task_id).and_then(Weak::upgrade);
        // A handle past its local deadline is lost even if the renewal task has not said so
        // yet: it is not shared, and hears it below.
        let held = live.as_ref().filter(|l| !l.is_over());
        if let Some(same) = held.filter(|l| l.token == record.token) {
            // The deadline this call grants is by this handle's ttl, the one it sent. Refused
            // only if the local deadline passed in between: then a new handle, as below.
            if same.renewed(
                record.deadline_ms,
                sent,
                self.config.local_deadline(sent),
                &record.epoch,
            ) {
                let shared = same.clone();
                drop(registry);
                return Lease::from_inner(shared);
            }
        }
        let held = held.filter(|l| !l.is_over());
        let inner = Arc::new(LeaseInner::new(self.clone(), record, sent));
        // A newer admission still held keeps its place: an older late reply never takes it over.
        // One past its local deadline does not (tokens restart after a dataset loss, so a fresh
        // admission may carry a lower token).
        let newer_held = held.is_some_and(|l| l.token > record.token);
        if !newer_held {
            registry.insert(record.task_id.clone(), Arc::downgrade(&inner));
        }
        // Marking a lease lost needs the registry too.
        drop(registry);
        if newer_held {
            // A late reply of an older admission: the live, newer one stays this process's.
            inner.mark_lost(LostReason::Superseded);
        } else if let Some(older) = held {
            // The backend admitted this task again (its older lease was released or expired
            // there): the older handle is never renewed again and must hear it.
            older.mark_lost(LostReason::Superseded);
        } else if let Some(expired) = live.as_ref().filter(|l| !l.is_lost()) {
            // Past its local deadline, and no longer in the registry the renewal task reads.
            expired.mark_past_local_deadline();
        }
        drop(live);
        if !newer_held {
            self.alarm.renewal_due(inner.renew_due());
        }
        Lease::from_inner(inner)
    }

    /// Removes `lease` from the registry (or, for a local lease, the local leases) if it is the
    /// entry for its task id.
    pub(crate) fn forget(&self, lease: &LeaseInner) {
        let mut map = match lease.local {
            true => self.admissions.local(),
            false => self.admissions.registry(),
        };
        if map
            .get(&lease.task_id)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), lease))
        {
            map.remove(&lease.task_id);
        }
    }
}

/// The live lease of `task_id` in `map` (the registry or the local leases), if any. The guard is
/// released before the upgraded handle can drop: a last handle's drop re-enters the map (see
/// `Shared::forget`).
fn live_in(
    map: std::sync::MutexGuard<'_, HashMap<String, Weak<LeaseInner>>>,
    task_id: &str,
) -> Option<Arc<LeaseInner>> {
    let found = map.get(task_id).and_then(Weak::upgrade);
    drop(map);
    found.filter(|l| !l.is_lost())
}
