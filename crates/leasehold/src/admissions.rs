//! What this process knows of one quota's admissions: its live leases, the attempts under way and
//! the turns of each task id.
//!
//! Shared by every [`Quota`](crate::Quota) built for the same quota name on the same backend, so
//! that two handles built separately (the embedded backend is one per process) behave as one: an
//! acquire through one of them that comes back `held` shares the other's lease instead of
//! holding a copy that the other's release would end, and their calls take the same turns.

use std::collections::HashMap;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Instant;

use crate::backend::Backend;
use crate::keys::QuotaKeys;
use crate::lease::LeaseInner;
use crate::pending::Pending;
use crate::task_turns::TaskTurns;

#[derive(Default)]
pub(crate) struct Admissions {
    /// Live leases, by task id.
    registry: Mutex<HashMap<String, Weak<LeaseInner>>>,
    /// Live leases granted by the backend-down policy, by task id: a task holds one slot,
    /// whether the backend or the policy granted it.
    local: Mutex<HashMap<String, Weak<LeaseInner>>>,
    /// Admission attempts under way whose caller still waits, by task id.
    attempts: Mutex<HashMap<String, usize>>,
    /// Admissions and releases of one task id reach the backend one at a time.
    pub(crate) turns: TaskTurns,
    /// Leases granted by the backend-down policy and not yet released: `DegradeLocal`'s share
    /// is for the process, whichever handle grants them.
    pub(crate) local_held: AtomicU32,
    /// Token-guarded releases that got no answer, by task id: the token, and until when its
    /// lease may still live in the backend.
    unanswered_releases: Mutex<HashMap<String, (u64, Instant)>>,
    /// Background work other processes depend on (releases, attempts), for `Quota::flush`:
    /// counted here, so that a flush through any handle of the quota covers the leases every
    /// handle shares.
    pub(crate) pending: Arc<Pending>,
    /// The backend and quota these are for: told when the last handle goes (see `Drop`).
    owner: Option<(Arc<dyn Backend>, QuotaKeys)>,
}

impl Drop for Admissions {
    fn drop(&mut self) {
        // The last handle of the quota on this backend is gone: what the backend keeps for it
        // may go too.
        if let Some((backend, keys)) = self.owner.take() {
            // Under the lock `of` builds a new one under: a handle of the same quota started
            // since this one's count reached zero owns the backend's state now.
            let key = (backend.identity(), keys.name.clone());
            let known = known();
            if known.get(&key).is_none_or(|w| w.strong_count() == 0) {
                backend.forget(&keys);
            }
        }
    }
}

impl Admissions {
    /// The live leases, by task id. A lease whose last handle may drop must not be dropped while
    /// this is held: its drop looks the registry up again.
    pub(crate) fn registry(&self) -> MutexGuard<'_, HashMap<String, Weak<LeaseInner>>> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live local leases, by task id; the same rule as for [`registry`](Self::registry).
    pub(crate) fn local(&self) -> MutexGuard<'_, HashMap<String, Weak<LeaseInner>>> {
        self.local.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Attempts under way whose caller still waits, by task id.
    pub(crate) fn attempts(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        self.attempts.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn unanswered(&self) -> MutexGuard<'_, HashMap<String, (u64, Instant)>> {
        self.unanswered_releases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Releases that got no answer, by task id (see `Quota::debug_sizes`).
    pub(crate) fn unanswered_len(&self) -> usize {
        self.unanswered().len()
    }

    /// The release of `task_id`'s admission `token` got no answer (a timeout, a lost
    /// connection): it may have been lost, or may still reach the backend late, from a
    /// connection that was replaced meanwhile. Its lease lives until `until` at the latest.
    pub(crate) fn release_unanswered(&self, task_id: &str, token: u64, until: Instant) {
        let mut unanswered = self.unanswered();
        let now = Instant::now();
        unanswered.retain(|_, (_, until)| *until > now);
        unanswered.insert(task_id.to_owned(), (token, until));
    }

    /// The release of `task_id`'s admission `token` was answered: it is settled.
    pub(crate) fn release_answered(&self, task_id: &str, token: u64) {
        let mut unanswered = self.unanswered();
        if unanswered.get(task_id).is_some_and(|(t, _)| *t == token) {
            unanswered.remove(task_id);
        }
    }

    /// Whether admission `token` of `task_id` was released without an answer and may still
    /// live in the backend: it must not be handed out again.
    pub(crate) fn is_release_unanswered(&self, task_id: &str, token: u64) -> bool {
        self.unanswered()
            .get(task_id)
            .is_some_and(|(t, until)| *t == token && *until > Instant::now())
    }
}

/// Backend (by [`Backend::identity`]) and quota name → their admissions, while some `Quota`
/// uses them.
type Known = HashMap<(usize, String), Weak<Admissions>>;

/// The admissions of quota `name` on `backend`, shared with every live `Quota` of that pair.
fn known() -> MutexGuard<'static, Known> {
    static KNOWN: OnceLock<Mutex<Known>> = OnceLock::new();
    KNOWN
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Entries of the process-wide map of admissions: live quotas, and dropped ones not pruned yet.
pub(crate) fn known_len() -> usize {
    known().len()
}

pub(crate) fn of(backend: &Arc<dyn Backend>, keys: &QuotaKeys) -> Arc<Admissions> {
    // Every live `Admissions` is held by a quota that also holds the backend, so its identity
    // cannot be taken by another backend while the entry is alive.
    let identity = backend.identity();
    let mut known = known();
    known.retain(|_, admissions| admissions.strong_count() > 0);
    let key = (identity, keys.name.clone());
    if let Some(live) = known.get(&key).and_then(Weak::upgrade) {
        return live;
    }
    let mut fresh = Admissions::default();
    fresh.owner = Some((backend.clone(), keys.clone()));
    let fresh = Arc::new(fresh);
    known.insert(key, Arc::downgrade(&fresh));
    fresh
}
