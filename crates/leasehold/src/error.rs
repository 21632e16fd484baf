//! Typed errors, split the way an operator needs them.

use std::time::Duration;

/// Why a [`Lease`](crate::Lease) is no longer held.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// A renewal found the lease gone from the backend: its deadline passed (the holder stopped
    /// renewing for longer than the ttl), the backend lost its state, or another process that
    /// shared the lease released it while nobody waited (such a release is not announced).
    Expired,
    /// A release of this lease by someone else was announced: an operator's forced release, or
    /// another process holding the same task id while someone waited for a slot. The message is
    /// not checked against the backend, so [`Lease::release`](crate::Lease::release) still
    /// sends the token-guarded release, which frees the slot if the message was wrong.
    ReleasedElsewhere,
    /// The same task id was admitted again with a newer fencing token; this admission is stale.
    Superseded,
    /// The task was cancelled; the text is the canceller's reason.
    Cancelled(String),
    /// The backend could not confirm a renewal before the holder's own monotonic deadline
    /// (last acknowledged renewal + ttl in whole ms − 1 ms − safety margin): it was unreachable
    /// or too slow, or this process was paused. The backend may already have given the slot to
    /// someone else, so the holder must stop.
    LocalDeadline,
    /// The holder's own monotonic deadline passed (as for
    /// [`LocalDeadline`](LostReason::LocalDeadline)) while the backend answered its latest
    /// renewal with a refusal that retrying cannot fix: a foreign value in one of the quota's
    /// keys, missing ACL rights. An operator must fix what the refusal names; the holder had to
    /// stop all the same. Each refusal is also logged at error level (`tracing`).
    RenewalRefused(Misconfiguration),
    /// This process released the lease itself: through this handle, or another handle of the
    /// same admission (a clone, or the lease an idempotent acquire of the same task id returned,
    /// which is the same lease).
    Released,
}

impl std::fmt::Display for LostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LostReason::Expired => f.write_str(
                "lease gone from the backend (expired, lost, or released by another holder of \
                 the task)",
            ),
            LostReason::ReleasedElsewhere => f.write_str("lease released elsewhere"),
            LostReason::Superseded => f.write_str("lease superseded by a newer admission"),
            LostReason::Cancelled(reason) if reason.is_empty() => {
                f.write_str("task cancelled (no reason given)")
            }
            LostReason::Cancelled(reason) => write!(f, "task cancelled: {reason}"),
            LostReason::LocalDeadline => f.write_str(
                "local deadline passed before a renewal was confirmed (the backend \
                 unreachable or slow, or this process paused)",
            ),
            LostReason::RenewalRefused(refusal) => write!(
                f,
                "local deadline passed while the backend refused renewals: {refusal}"
            ),
            LostReason::Released => f.write_str("lease released by its holder"),
        }
    }
}

/// What is wrong with the configuration or the input; retrying will not help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Misconfiguration {
    /// The builder was never given a limit.
    #[error("no limit set: QuotaBuilder::limit is required (1 to {max})", max = crate::MAX_LIMIT)]
    MissingLimit,
    /// The limit is 0 or above [`MAX_LIMIT`](crate::MAX_LIMIT).
    #[error("invalid limit {0}: must be between 1 and {max}", max = crate::MAX_LIMIT)]
    InvalidLimit(u64),
    /// The limit version is above [`MAX_LIMIT_VERSION`](crate::MAX_LIMIT_VERSION).
    #[error("invalid limit version {0}: must be at most {max}", max = crate::MAX_LIMIT_VERSION)]
    InvalidLimitVersion(u64),
    /// An acquire was refused: the backend stores another limit under the same limit version as
    /// this handle's, so clients of the quota disagree on its limit (say, half of a rolling
    /// deploy changed the limit without raising
    /// [`QuotaBuilder::limit_version`](crate::QuotaBuilder::limit_version)). Nothing was
    /// admitted. Raise the version of the new limit, or configure the stored one.
    /// ([`Quota::set_limit`](crate::Quota::set_limit) refused for the same reason fails with
    /// [`LimitVersionTaken`](Misconfiguration::LimitVersionTaken) instead.)
    #[error(
        "limit mismatch: this handle is configured with limit {configured}, the quota stores \
         limit {stored} under the same limit version {version}; raise the limit version to \
         change the limit"
    )]
    LimitMismatch {
        /// The limit this handle was configured with.
        configured: u32,
        /// The limit the backend stores for the quota.
        stored: u32,
        /// The limit version both share.
        version: u64,
    },
    /// [`Quota::set_limit`](crate::Quota::set_limit) was given a version that the backend
    /// stores with another limit: nothing changed. Give a version above `version`, or `None`
    /// (one above the stored version).
    #[error(
        "set_limit({asked}) at limit version {version}: the quota stores limit {stored} under \
         that version; use a higher version to change the limit"
    )]
    LimitVersionTaken {
        /// The limit passed to `set_limit`.
        asked: u32,
        /// The limit the backend stores for the quota.
        stored: u32,
        /// The version passed to `set_limit`, which the stored limit has too.
        version: u64,
    },
    /// [`Quota::set_limit`](crate::Quota::set_limit) was asked for the next version (`None`),
    /// but the stored version is already the largest,
    /// [`MAX_LIMIT_VERSION`](crate::MAX_LIMIT_VERSION): no version is left above it, and
    /// nothing changed. The stored limit can no longer be replaced, by `set_limit` or by any
    /// client's acquire, until an operator deletes the quota's limit key in Redis (`key`,
    /// docs/PROTOCOL.md §3): the next acquire, or `set_limit`, then stores its own limit and
    /// version again.
    #[error(
        "set_limit({asked}) with the next limit version: the quota stores limit {stored} at the \
         largest limit version, {max}, and no limit version is left above it; nothing changed. \
         To change the limit, delete the quota's limit key {key:?} in Redis: the next acquire or \
         set_limit stores a limit again",
        max = crate::MAX_LIMIT_VERSION
    )]
    LimitVersionsExhausted {
        /// The limit passed to `set_limit`.
        asked: u32,
        /// The limit the backend stores, at the largest version.
        stored: u32,
        /// The quota's limit key in Redis (docs/PROTOCOL.md §3).
        key: String,
    },
    /// The task id is empty, longer than [`MAX_TASK_ID_BYTES`](crate::MAX_TASK_ID_BYTES), or
    /// contains control characters.
    #[error("invalid task id: {0}")]
    InvalidTaskId(String),
    /// A cancel reason is longer than
    /// [`MAX_CANCEL_REASON_BYTES`](crate::MAX_CANCEL_REASON_BYTES).
    #[error("invalid cancel reason: {0}")]
    InvalidCancelReason(String),
    /// The quota name would break the key scheme.
    #[error("invalid quota name: {0}")]
    InvalidQuotaName(String),
    /// A timing or policy setting is out of range or contradicts another: ttl, heartbeat, safety
    /// margin, poll interval, cancel-marker ttl, breaker settings, or a
    /// `DegradeLocal` share of 0.
    #[error("invalid timing: {0}")]
    InvalidTiming(String),
    /// The backend URL cannot be used.
    #[error("invalid backend url: {0}")]
    InvalidUrl(String),
    /// One of the quota's keys exists with another type (WRONGTYPE).
    #[error("a key of quota {quota:?} holds the wrong type of value: {detail}")]
    WrongType {
        /// The quota whose keys are affected.
        quota: String,
        /// The server's message.
        detail: String,
    },
    /// The server refused the credentials (NOAUTH, WRONGPASS).
    #[error("authentication failed: {0}")]
    Auth(String),
    /// The ACL user may not run a command leasehold needs (NOPERM).
    #[error("permission denied: {0}")]
    NoPermission(String),
    /// The TLS handshake failed on the server's certificate (unknown issuer, wrong name).
    #[error("TLS certificate rejected: {0}")]
    Tls(String),
    /// The backend answered in a way this version of the protocol does not understand, a script
    /// failed, or a Redis Cluster redirected or refused the call (MOVED, ASK, CROSSSLOT).
    #[error("unexpected reply from backend: {0}")]
    Protocol(String),
}

impl Misconfiguration {
    /// A handle configured with `configured` was refused: the backend stores `stored` under
    /// the same limit version.
    pub(crate) fn limit_mismatch(configured: u32, stored: crate::VersionedLimit) -> Error {
        Misconfiguration::LimitMismatch {
            configured,
            stored: stored.limit,
            version: stored.version,
        }
        .into()
    }
}

/// Why an admission found no slot: what an operator does next differs. More causes may come:
/// match with a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FullCause {
    /// Every slot is held: the backend counts as many live leases as the limit it stores.
    NoSlot,
    /// The backend lost the quota's state (a restart without persistence, a failover to a
    /// lagging replica): it admits nobody for about one ttl, so that the holders still running
    /// re-register first (docs/PROTOCOL.md §8). `remaining` is what was left of that pause.
    Quarantined {
        /// Time left of the pause when the backend answered.
        remaining: Duration,
    },
    /// The backend cannot answer, and this process already holds the share of leases its
    /// [`BackendDownPolicy::DegradeLocal`](crate::BackendDownPolicy::DegradeLocal) allows.
    LocalShareUsed,
}

fn full_text(quota: &str, cause: &FullCause) -> String {
    match cause {
        FullCause::NoSlot => format!("quota {quota:?} is full (no slot free)"),
        FullCause::Quarantined { remaining } => format!(
            "quota {quota:?} admits nobody for {} ms more: the backend lost its state, and the \
             holders still running re-register first",
            remaining.as_millis()
        ),
        FullCause::LocalShareUsed => format!(
            "quota {quota:?}: the backend is unavailable, and this process holds all the leases \
             its backend-down policy grants"
        ),
    }
}

/// Why the backend could not serve a call, split by what the caller knows of its outcome.
///
/// An acquire that failed with [`NoReply`](Unavailable::NoReply) may have admitted the task:
/// that slot stays taken, unrenewed, for one ttl unless the same task id is acquired again
/// (which returns that lease) or force-released. The other kinds took nothing. More kinds may
/// come: match with a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Unavailable {
    /// Not sent: the quota's short-circuit is open after repeated failures, and refuses calls
    /// here until its cool-down lets a probe through (no network I/O, no wait).
    ShortCircuit,
    /// Not sent: there is no connection to the server. It refused the connection (nothing
    /// listens on its port), or `RedisBackend::connect` made none (the host unreachable, a TLS
    /// handshake that never finishes, no answer within the call timeout: every failure of
    /// `connect` is this kind, since no backend exists yet to run anything). A call that waits
    /// for a reconnection that does not come in time is [`NoReply`](Self::NoReply): it may have
    /// been sent before the link dropped.
    NoConnection,
    /// Not run: the server refused it for now (`LOADING`, `READONLY`, `MASTERDOWN`,
    /// `NOREPLICAS`, `OOM`, `BUSY`, `MISCONF`, `TRYAGAIN`, `CLUSTERDOWN`): a restart, a failover,
    /// memory or disk full, another client's long script. The detail names the code.
    ServerRefused,
    /// Outcome unknown: the call may have been sent, but no reply came within the call's
    /// timeout, the connection broke, or the reply could not be read. The backend may have run
    /// it, or may still run it (a server that stalled, then resumed). Also an operation made of
    /// several calls, one of which ran before a later one failed (a renewal of more leases than
    /// one call takes; an acquire that had to release an earlier admission first).
    NoReply,
}

impl Unavailable {
    /// True when the backend may have run the call, or may still run it: only for
    /// [`NoReply`](Unavailable::NoReply). The other kinds were refused before the backend
    /// ran anything.
    pub fn may_have_run(self) -> bool {
        matches!(self, Unavailable::NoReply)
    }
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unavailable::ShortCircuit => "short-circuit open",
            Unavailable::NoConnection => "no connection",
            Unavailable::ServerRefused => "refused by the server for now",
            Unavailable::NoReply => "no reply",
        })
    }
}

/// Every error leasehold returns.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No slot is free right now ([`Quota::try_acquire`](crate::Quota::try_acquire)); `cause`
    /// says why.
    #[error("{}", full_text(quota, cause))]
    Full {
        /// The quota's name.
        quota: String,
        /// The limit configured on the handle. The quota admits up to the limit its backend
        /// stores, which a client with a higher limit version may have set
        /// ([`Status::effective_limit`](crate::Status::effective_limit)).
        limit: u32,
        /// Why no slot was free.
        cause: FullCause,
    },
    /// No lease within the time the caller allowed.
    #[error("{}", timed_out(quota, waited, *answered))]
    TimedOut {
        /// The quota's name.
        quota: String,
        /// How long the caller waited.
        waited: Duration,
        /// Whether the backend answered an attempt of the wait (each time: no slot for this
        /// caller): the caller's own, or one of the waiters ahead of it in the same handle's
        /// line, which alone attempt while it waits behind them. `false` when none was answered
        /// in time: the backend was slow or stalled (a wait shorter than a call timeout ends
        /// before a stalled backend's call fails), or the wait was too short for any answer (a
        /// zero timeout); the quota may not be full.
        answered: bool,
    },
    /// The lease is no longer held.
    #[error("{0}")]
    LeaseLost(LostReason),
    /// The task was cancelled before or while it waited.
    #[error("{}", LostReason::Cancelled(.0.clone()))]
    Cancelled(String),
    /// The backend could not be reached or answered with a transient error (connection refused,
    /// timeout, LOADING, READONLY, ...). Retrying later may succeed.
    ///
    /// A call that got no reply ([`Unavailable::NoReply`]) has an unknown outcome: the backend
    /// may still run it after the client gave up (a Redis that stalled, then resumed). An acquire may thus have admitted the
    /// task, and that slot then stays taken, unrenewed, for one ttl, unless the same task id is
    /// acquired again, which returns that lease (an idempotent retry, never a second slot).
    /// Retry an acquire with the same task id; to give the task up instead,
    /// [`Quota::force_release`](crate::Quota::force_release) of an id that only this caller
    /// uses frees such a slot at once. The other kinds took nothing.
    #[error("backend unavailable: {detail}")]
    #[non_exhaustive]
    BackendUnavailable {
        /// What kind of unavailability: refused here, not connected, refused by the server for
        /// now, or no reply.
        kind: Unavailable,
        /// What happened, in the backend's words (the server's error text, the timeout).
        detail: String,
    },
    /// The configuration or input is wrong; retrying will not help.
    #[error("misconfigured: {0}")]
    Misconfigured(Misconfiguration),
}

// By hand, not `#[from]`, which would also make the misconfiguration this error's `source()`:
// its text is already in this one's, and error reporters print each source again.
impl From<Misconfiguration> for Error {
    fn from(misconfiguration: Misconfiguration) -> Self {
        Error::Misconfigured(misconfiguration)
    }
}

impl Error {
    /// True when retrying the same call later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::Full { .. } | Error::TimedOut { .. } | Error::BackendUnavailable { .. }
        )
    }

    /// This error, met by a later call of an operation whose earlier call ran: the operation as a
    /// whole may have changed the backend, whatever refused the later call (found by review).
    pub(crate) fn after_a_call_ran(self) -> Self {
        match self {
            Error::BackendUnavailable { kind, detail } if !kind.may_have_run() => {
                Error::BackendUnavailable {
                    kind: Unavailable::NoReply,
                    detail: format!("{detail} (after an earlier call of the same operation ran)"),
                }
            }
            other => other,
        }
    }

    /// An [`Error::BackendUnavailable`] of `kind`. For implementations of
    /// [`Backend`](crate::Backend), and test doubles.
    pub fn unavailable(kind: Unavailable, detail: impl Into<String>) -> Self {
        Error::BackendUnavailable {
            kind,
            detail: detail.into(),
        }
    }
}

/// The text of [`Error::TimedOut`]: an operator who reads "no slot" raises the limit, so it is
/// said only when the backend said so.
fn timed_out(quota: &str, waited: &Duration, answered: bool) -> String {
    match answered {
        true => format!("no slot in quota {quota:?} within {waited:?}"),
        false => format!(
            "no answer for quota {quota:?} within {waited:?}: the backend is slow or \
             unreachable, or the wait was too short for an answer (the quota may not be full)"
        ),
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// An error reporter that prints the chain (anyhow's `{:#}`, `tracing`'s error fields)
    /// shows a misconfiguration's text once, not once per level.
    #[test]
    fn a_misconfiguration_is_told_once_in_the_error_chain() {
        let error: Error = Misconfiguration::Protocol("a reply of the wrong shape".into()).into();
        let mut chain = vec![error.to_string()];
        let mut source = std::error::Error::source(&error);
        while let Some(cause) = source {
            chain.push(cause.to_string());
            source = cause.source();
        }
        let told = chain
            .iter()
            .filter(|text| text.contains("a reply of the wrong shape"))
            .count();
        assert_eq!(told, 1, "{chain:?}");
    }
}
