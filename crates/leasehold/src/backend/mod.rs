//! Where leases are kept: the [`Backend`] trait and its two implementations.
//!
//! Both implementations keep the same semantics (same admission rules, server-side deadlines,
//! fencing, idempotent acquire) and pass one conformance suite (`tests/conformance.rs`).

use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::broadcast;

use crate::error::Result;
use crate::keys::QuotaKeys;

mod batch;
pub mod memory;
mod redacted_url;
pub mod redis;

/// The answer to one admission attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AcquireReply {
    /// A new lease was admitted.
    Acquired(LeaseRecord),
    /// The task id already held a lease; it was extended and is returned unchanged otherwise.
    Held(LeaseRecord),
    /// The task was cancelled (a cancel marker exists for it); nothing was admitted or extended.
    Cancelled {
        /// The canceller's reason.
        reason: String,
    },
    /// New admissions wait: the quota's state was lost (a restart without persistence, a
    /// FLUSHALL, an eviction) while leases may still run; their holders re-register through
    /// their renewals during this quarantine.
    Quarantined {
        /// How long the quarantine still lasts, in milliseconds.
        remaining_ms: u64,
    },
    /// Nothing was admitted: the quota stores another limit under the same limit version as the
    /// call's (the clients disagree on the limit). A held task id is answered
    /// [`Held`](Self::Held) all the same: only new admissions are refused.
    LimitMismatch {
        /// The limit and version the quota stores.
        stored: VersionedLimit,
    },
    /// No slot is free.
    Full {
        /// Backend time of the attempt, in milliseconds.
        now_ms: u64,
        /// The earliest deadline among the current holders: no slot frees by expiry before it.
        earliest_deadline_ms: u64,
    },
}

/// One lease as the backend stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    /// The task id (the lease's name).
    pub task_id: String,
    /// The fencing token of this admission: increases with every admission in the quota.
    pub token: u64,
    /// When it was admitted, backend milliseconds since the Unix epoch.
    pub acquired_at_ms: u64,
    /// When it expires unless renewed, backend milliseconds since the Unix epoch.
    pub deadline_ms: u64,
    /// Backend time at which this record was read, in milliseconds.
    pub now_ms: u64,
    /// The quota's epoch when this record was read (protocol §8): opaque, changes only when the
    /// quota's state was lost. A lease's renewals send back the epoch of its latest admission or
    /// renewal. Empty where the reply carries none (snapshots, leases granted without the
    /// backend).
    pub epoch: String,
}

/// A quota's limit with its version: what a client is configured with, or what the backend stores
/// (docs/PROTOCOL.md §5.2). A call with a higher version than the stored one replaces it; a call
/// with a lower version is admitted against the stored limit; equal versions must agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VersionedLimit {
    /// How many leases may be held at once.
    pub limit: u32,
    /// The limit's version: higher wins.
    pub version: u64,
}

/// What an operator's [`Backend::set_limit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitUpdate {
    /// The limit and version given replaced the stored ones (or none was stored).
    Stored(VersionedLimit),
    /// A higher version is stored and stays (or the same limit at the same version; or, asked
    /// for the next version, the stored one is already the largest): the limit in force.
    /// [`Quota::set_limit`](crate::Quota::set_limit) answers it only for an explicit version,
    /// or for `None` when the last version already stores the limit asked for.
    Kept(VersionedLimit),
    /// The same version is stored with another limit: nothing changed.
    /// [`Quota::set_limit`](crate::Quota::set_limit) reports it as
    /// [`Misconfiguration::LimitVersionTaken`](crate::Misconfiguration::LimitVersionTaken).
    Mismatch(VersionedLimit),
}

/// What a renewal found for one lease.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RenewOutcome {
    /// Still held; the new deadline in backend milliseconds.
    Renewed {
        /// The new deadline.
        deadline_ms: u64,
    },
    /// Not held any more (expired, reaped, released, or state lost). Never re-created.
    Gone,
    /// The task id is held under a different fencing token: a newer admission owns it.
    Superseded,
    /// Still held, but the task was cancelled: not extended; the holder should stop and release.
    Cancelled {
        /// The canceller's reason.
        reason: String,
    },
}

/// The answer to one renewal call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenewReply {
    /// The quota's epoch after the call: the leases it renewed (or re-registered) are confirmed
    /// in it, and their next renewal sends it.
    pub epoch: String,
    /// One outcome per lease, in the order they were sent.
    pub outcomes: Vec<RenewOutcome>,
}

/// A point-in-time view of one quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Backend time of the snapshot, in milliseconds.
    pub now_ms: u64,
    /// The live leases, earliest deadline first.
    pub holders: Vec<LeaseRecord>,
    /// The limit the backend admits up to, if one is stored (none before the quota's first
    /// acquire, or after the backend lost its data).
    pub limit: Option<VersionedLimit>,
    /// How long the quarantine after a detected loss of the quota's state still refuses new
    /// admissions, in milliseconds; 0 when none is in force.
    pub quarantine_left_ms: u64,
}

/// Something that happened to a quota, as announced on its channel. Delivery is at most once:
/// nothing that matters depends on receiving it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum QuotaEvent {
    /// A lease was removed by a release: a slot is free.
    Released {
        /// The released task id.
        task_id: String,
        /// Its fencing token.
        token: u64,
    },
    /// A task was cancelled: its holder (or its waiter) should stop.
    Cancelled {
        /// The cancelled task id.
        task_id: String,
        /// The canceller's reason.
        reason: String,
    },
    /// The subscription was (re)established; events may have been missed before it.
    Resubscribed,
}

/// Most leases in one renewal call; more are split so one script never blocks Redis long.
pub(crate) const RENEW_BATCH: usize = 5000;

/// Storage for leases. Every method is one atomic step on the backend (a renewal of more than
/// 5000 leases is one step per 5000); times come from the backend's clock, never the caller's.
#[async_trait]
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// Reaps expired leases, then admits `task_id` if a slot is free, or extends and returns its
    /// lease if it already holds one. Like [`acquire_with_limit`](Self::acquire_with_limit) at
    /// limit version 0.
    async fn acquire(
        &self,
        keys: &QuotaKeys,
        task_id: &str,
        ttl: Duration,
        limit: u32,
    ) -> Result<AcquireReply> {
        let limit = VersionedLimit { limit, version: 0 };
        self.acquire_with_limit(keys, task_id, ttl, limit).await
    }

    /// Reaps expired leases, settles the quota's stored limit with `limit` (the higher version
    /// wins; equal versions with other limits answer
    /// [`LimitMismatch`](AcquireReply::LimitMismatch)), then admits `task_id` if fewer leases
    /// than the stored limit are live, or extends and returns its lease if it already holds one.
    async fn acquire_with_limit(
        &self,
        keys: &QuotaKeys,
        task_id: &str,
        ttl: Duration,
        limit: VersionedLimit,
    ) -> Result<AcquireReply>;

    /// Extends each `(task id, fencing token)` lease that still exists with that token to
    /// `max(its deadline, now + ttl)`; never re-creates one, except that leases forgotten by a
    /// detected loss of the backend's state re-register (protocol §8). One round trip per 5000
    /// leases; if the backend's epoch changes between two of them, the call fails transiently,
    /// since one reply carries one epoch (the leases keep their deadlines and are renewed again).
    ///
    /// `epoch` is the epoch the leases were last confirmed in (the [`LeaseRecord::epoch`] of
    /// their admission, or the [`RenewReply::epoch`] of their latest renewal), so the backend
    /// can tell leases forgotten by a loss of its state from leases that ended (protocol §8).
    /// Leases confirmed in different epochs go in different calls.
    async fn renew(
        &self,
        keys: &QuotaKeys,
        ttl: Duration,
        epoch: &str,
        leases: &[(String, u64)],
    ) -> Result<RenewReply>;

    /// The operator's change of the quota's stored limit: stores `limit` at `version` if that is
    /// higher than the stored version (or none is stored). `None` means one above the stored
    /// version (1 when none is stored), chosen atomically; when the stored version is already
    /// [`MAX_LIMIT_VERSION`](crate::MAX_LIMIT_VERSION), there is none above it: the stored limit
    /// stays and the answer is [`LimitUpdate::Kept`] (as `set_limit.lua` answers), which
    /// [`Quota::set_limit`](crate::Quota::set_limit) reports as
    /// [`Misconfiguration::LimitVersionsExhausted`](crate::Misconfiguration::LimitVersionsExhausted)
    /// unless the stored limit is already the one asked for. Admissions use the new limit from
    /// the next acquire on; nobody is evicted.
    async fn set_limit(
        &self,
        keys: &QuotaKeys,
        limit: u32,
        version: Option<u64>,
    ) -> Result<LimitUpdate>;

    /// Removes the lease of `task_id` if its token is `token` (any token when `None`: the
    /// operator's forced release). Returns whether a lease was removed. A removal may be
    /// announced as an event: the Redis backend does so only while someone may be waiting, or
    /// when the release was forced.
    async fn release(&self, keys: &QuotaKeys, task_id: &str, token: Option<u64>) -> Result<bool>;

    /// Cancels `task_id`: writes its cancel marker (kept for `marker_ttl`), then announces it.
    /// The marker is the truth: acquire refuses a cancelled id and renew reports it. Returns
    /// whether the task held a lease at that moment (it may also be queued, or not started yet).
    async fn cancel(
        &self,
        keys: &QuotaKeys,
        task_id: &str,
        reason: &str,
        marker_ttl: Duration,
    ) -> Result<bool>;

    /// The reason `task_id` was cancelled, while its cancel marker lives; `None` if it was not
    /// (or the marker expired). Reads only.
    async fn cancel_reason(&self, keys: &QuotaKeys, task_id: &str) -> Result<Option<String>>;

    /// The live leases of the quota.
    async fn snapshot(&self, keys: &QuotaKeys) -> Result<Snapshot>;

    /// Subscribes to the quota's events. Each call returns a new receiver of one shared
    /// subscription per quota.
    async fn subscribe(&self, keys: &QuotaKeys) -> Result<broadcast::Receiver<QuotaEvent>>;

    /// Every handle of the quota of `keys` built on this backend in this process was dropped:
    /// what the backend keeps per quota for its callers (the epoch seen, batching queues) may
    /// go, so that quota names that come and go do not pile up. A later handle starts afresh, as
    /// a new process would. The default keeps nothing per quota, so does nothing. It is called
    /// under the lock that new handles are built under, so that it never takes the state of a
    /// handle started meanwhile: it must not build or drop quota handles itself.
    fn forget(&self, keys: &QuotaKeys) {
        let _ = keys;
    }

    /// Which connection this backend is: handles of one quota built on backends with the same
    /// identity share what the process knows of its leases (and take turns per task id). Clones
    /// that share one connection should return the same value, and no other live backend may
    /// return it. The default is this value's address, so only handles given the very same
    /// `Arc` share.
    fn identity(&self) -> usize {
        (self as *const Self).cast::<()>() as usize
    }
}

/// Parses the payload of a message on a quota's channel (protocol v1, see docs/PROTOCOL.md).
/// A payload that does not parse exactly is ignored, as the protocol asks of every client.
pub(crate) fn parse_event(payload: &str) -> Option<QuotaEvent> {
    if let Some(rest) = payload.strip_prefix("released:") {
        let (token, task_id) = rest.split_once(':')?;
        return Some(QuotaEvent::Released {
            task_id: task_id.to_owned(),
            token: decimal(token)?,
        });
    }
    // cancelled:<byte length of the task id>:<task id>:<reason>
    let rest = payload.strip_prefix("cancelled:")?;
    let (len, rest) = rest.split_once(':')?;
    let len = usize::try_from(decimal(len)?).ok()?;
    let task_id = rest.get(..len)?;
    let reason = rest.get(len..)?.strip_prefix(':')?;
    Some(QuotaEvent::Cancelled {
        task_id: task_id.to_owned(),
        reason: reason.to_owned(),
    })
}

/// A decimal integer of digits only: `str::parse` would also take a sign (`+5`).
fn decimal(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_that_do_not_parse_exactly_are_ignored() {
        for payload in [
            "released:+5:t",
            "released:-5:t",
            "released: 5:t",
            "released::t",
            "released:5",
            "cancelled:+1:t:why",
            "cancelled:1:tx",
            "cancelled:9:t:why",
            "cancelled::t:why",
            "other:1:t",
        ] {
            assert_eq!(parse_event(payload), None, "{payload}");
        }
        assert_eq!(
            parse_event("cancelled:1:t:"),
            Some(QuotaEvent::Cancelled {
                task_id: "t".into(),
                reason: String::new()
            })
        );
    }

    #[test]
    fn release_event_round_trips_ids_with_colons() {
        // The payload release.lua publishes: 'released:' .. token .. ':' .. id
        assert_eq!(
            parse_event("released:42:a:b:c"),
            Some(QuotaEvent::Released {
                task_id: "a:b:c".into(),
                token: 42
            })
        );
        assert_eq!(
            parse_event("cancelled:5:a:b:c:user: stop now"),
            Some(QuotaEvent::Cancelled {
                task_id: "a:b:c".into(),
                reason: "user: stop now".into()
            })
        );
        assert_eq!(parse_event("cancelled:9:a:b"), None);
        assert_eq!(parse_event("bogus"), None);
        assert_eq!(parse_event("released:x:y"), None);
    }
}
