//! What [`Quota::status`](super::Quota::status) reports: the holders and the limits.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::backend::VersionedLimit;

/// One holder in a [`Status`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The task id.
    pub task_id: String,
    /// The fencing token of its admission.
    pub fencing_token: u64,
    /// When it was admitted (backend clock).
    pub acquired_at: SystemTime,
    /// When it expires unless renewed (backend clock).
    pub deadline: SystemTime,
}

/// A point-in-time view of a quota, from [`Quota::status`](crate::Quota::status).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Status {
    /// The quota's name.
    pub quota: String,
    /// The limit configured on this handle.
    pub limit: u32,
    /// The limit version configured on this handle.
    pub limit_version: u64,
    /// The limit the backend stores and admits up to, with its version. `None` before the
    /// quota's first acquire, or after the backend lost its data; the next acquire stores its
    /// caller's.
    pub stored_limit: Option<VersionedLimit>,
    /// The backend's time of the snapshot.
    pub now: SystemTime,
    /// The live leases, earliest deadline first.
    pub holders: Vec<Holder>,
    /// How long new admissions are still refused after the backend lost the quota's state
    /// (their [`FullCause::Quarantined`](crate::FullCause::Quarantined)), while its holders
    /// re-register; `None` when no quarantine is in force. A loss that no acquire or renewal has
    /// noticed yet shows none: the quarantine starts when the first one does.
    pub quarantine: Option<Duration>,
}

impl Status {
    /// The limit this handle's next acquire is admitted against: the stored one, or this
    /// handle's own while none is stored or the stored one has a lower version (that acquire
    /// stores this handle's limit first). Handles with an older version than the stored one
    /// follow the stored limit.
    pub fn effective_limit(&self) -> u32 {
        match self.stored_limit {
            Some(stored) if stored.version >= self.limit_version => stored.limit,
            _ => self.limit,
        }
    }

    /// True when the backend stores another limit under this handle's limit version: this
    /// handle's acquires are refused with
    /// [`Misconfiguration::LimitMismatch`](crate::Misconfiguration::LimitMismatch).
    pub fn limit_mismatch(&self) -> bool {
        self.stored_limit
            .is_some_and(|s| s.version == self.limit_version && s.limit != self.limit)
    }

    /// Slots an acquire through this handle could take right now: those free under the
    /// [effective limit](Self::effective_limit), or 0 during a [quarantine](Self::quarantine)
    /// (which admits nobody) and when more leases are live than the limit allows (after it was
    /// lowered). A handle in a [limit mismatch](Self::limit_mismatch) takes none whatever this
    /// says.
    pub fn free(&self) -> u32 {
        if self.quarantine.is_some() {
            return 0;
        }
        self.effective_limit()
            .saturating_sub(self.holders.len() as u32)
    }
}

pub(super) fn system_time(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}
