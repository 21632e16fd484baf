//! [`QuotaBuilder`]: a quota's settings, checked before any backend call.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use crate::backend::memory::MemoryBackend;
use crate::backend::Backend;
use crate::backend::VersionedLimit;
use crate::breaker::BreakerConfig;
use crate::error::{Misconfiguration, Result};
use crate::keys::{validate_limit, validate_limit_version, QuotaKeys};
use crate::quota::Quota;

/// Shortest lease ttl accepted.
pub const MIN_TTL: Duration = Duration::from_millis(50);
/// The shortest heartbeat a quota accepts: each beat is a backend call.
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(10);
/// Longest lease ttl accepted.
pub const MAX_TTL: Duration = Duration::from_secs(24 * 3600);
/// The longest cancel marker ttl a quota accepts (30 days).
pub const MAX_CANCEL_MARKER_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// The embedded backend every quota built without [`QuotaBuilder::backend`] shares, so that two
/// handles to one quota name in one process see the same leases.
static EMBEDDED: LazyLock<Arc<MemoryBackend>> = LazyLock::new(|| Arc::new(MemoryBackend::new()));

/// What a quota answers when the backend cannot (errors, timeouts, an open circuit).
///
/// It applies to a built quota's calls. [`RedisBackend::connect`](crate::RedisBackend::connect)
/// needs the server to answer once, so a process that starts during an outage gets
/// `BackendUnavailable` there, whatever the policy; one built on
/// [`RedisBackend::connect_lazy`](crate::RedisBackend::connect_lazy) starts all the same, and its
/// quotas answer by their policy until Redis does.
///
/// A lease granted without the backend ([`Lease::is_local`](crate::Lease::is_local)) lasts
/// until it is released or dropped: it is not renewed, does not expire, and is not registered in
/// the backend once it answers again. Until such leases end, the fleet may hold more than the
/// limit; that is the price of admitting during an outage. A task that holds one keeps it (its
/// acquire returns it) even after the backend is back, so it never takes a second slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BackendDownPolicy {
    /// No admission without a positive answer from the backend: callers get
    /// [`Error::BackendUnavailable`](crate::Error::BackendUnavailable) at once. The default.
    #[default]
    FailClosed,
    /// Admit everyone while the backend cannot answer. The upstream's own limit (its 429s) is
    /// then the only limit: this sends the storm downstream.
    FailOpen,
    /// Admit up to `share` leases in this process while the backend cannot answer, for example
    /// limit / expected number of workers, so the fleet stays near the limit instead of at zero
    /// or at infinity. The share is counted across every handle of the quota on the same
    /// backend in the process.
    DegradeLocal {
        /// Leases this process may hold without the backend.
        share: u32,
    },
}

/// The validated settings of a quota.
#[derive(Debug, Clone)]
pub(crate) struct QuotaConfig {
    pub(crate) limit: VersionedLimit,
    pub(crate) ttl: Duration,
    pub(crate) heartbeat: Duration,
    pub(crate) safety_margin: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) cancel_marker_ttl: Duration,
    pub(crate) events: bool,
    pub(crate) when_down: BackendDownPolicy,
    pub(crate) breaker: BreakerConfig,
}

impl QuotaConfig {
    /// The holder's own deadline for a lease whose admission or renewal was sent at `sent`.
    ///
    /// The server counts in whole milliseconds: it reads its clock rounded down (up to 1 ms
    /// early) and adds the ttl's whole milliseconds, so its deadline can fall up to 1 ms plus
    /// the ttl's fraction of a millisecond before `sent + ttl`. Both are taken off here, so that
    /// even a zero safety margin never outlives the server's deadline.
    pub(crate) fn local_deadline(&self, sent: Instant) -> Instant {
        sent + validity(self.ttl, self.safety_margin)
    }
}

/// How long an acknowledged admission or renewal sent with `ttl` lets its holder hold (see
/// [`QuotaConfig::local_deadline`]): the ttl's whole milliseconds, less 1 ms and the margin.
fn validity(ttl: Duration, safety_margin: Duration) -> Duration {
    Duration::from_millis(ttl.as_millis() as u64)
        .saturating_sub(Duration::from_millis(1) + safety_margin)
}

/// Builds a [`Quota`]; see [`Quota::builder`].
#[derive(Debug, Clone)]
pub struct QuotaBuilder {
    name: String,
    limit: Option<u64>,
    limit_version: u64,
    ttl: Duration,
    heartbeat: Option<Duration>,
    safety_margin: Option<Duration>,
    poll_interval: Duration,
    cancel_marker_ttl: Option<Duration>,
    events: bool,
    when_down: BackendDownPolicy,
    breaker: BreakerConfig,
    backend: Option<Arc<dyn Backend>>,
}

impl QuotaBuilder {
    pub(crate) fn new(name: impl Into<String>) -> Self {
        QuotaBuilder {
            name: name.into(),
            limit: None,
            limit_version: 0,
            ttl: Duration::from_secs(10),
            heartbeat: None,
            safety_margin: None,
            poll_interval: Duration::from_millis(250),
            cancel_marker_ttl: None,
            events: true,
            when_down: BackendDownPolicy::FailClosed,
            breaker: BreakerConfig::default(),
            backend: None,
        }
    }

    /// How many leases may be held at once, fleet-wide. Required; 1 to [`MAX_LIMIT`](crate::MAX_LIMIT).
    ///
    /// The backend stores the quota's limit with a [version](Self::limit_version), and every
    /// client admits against the stored one: see `limit_version` for how a new limit takes
    /// effect.
    pub fn limit(mut self, limit: u64) -> Self {
        self.limit = Some(limit);
        self
    }

    /// The version of this handle's [`limit`](Self::limit). Default 0; at most
    /// [`MAX_LIMIT_VERSION`](crate::MAX_LIMIT_VERSION).
    ///
    /// The backend keeps one limit per quota, with its version, set by the first acquire. An
    /// acquire with a higher version replaces it, for every client at once; a client with a
    /// lower version admits up to the stored limit, not its own; a client with the same version
    /// but another limit admits nothing and gets
    /// [`Misconfiguration::LimitMismatch`](crate::Misconfiguration::LimitMismatch) (a task that
    /// already holds a lease still gets it back). So the effective limit is never the largest of
    /// the configured ones, and changing the limit means raising its version. A lower limit
    /// evicts nobody: admissions stop until fewer leases than it are live.
    ///
    /// A rolling deploy from limit 5 to limit 8: the new build raises the version with the
    /// limit. Its first acquire stores `8 @ v2`, and the workers still on `5 @ v1` admit up to 8
    /// from then on. Deploying `8` at the old version would be refused as a mismatch instead.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> leasehold::Result<()> {
    /// use leasehold::{Error, MemoryBackend, Misconfiguration, Quota};
    /// let backend = std::sync::Arc::new(MemoryBackend::new());
    /// let old = Quota::builder("api").limit(5).limit_version(1)
    ///     .shared_backend(backend.clone()).build()?;
    /// let new = Quota::builder("api").limit(8).limit_version(2)
    ///     .shared_backend(backend.clone()).build()?;
    /// let _a = old.try_acquire("a").await?; // stores 5 @ v1
    /// let _b = new.try_acquire("b").await?; // stores 8 @ v2, for everyone
    /// assert_eq!(old.status().await?.effective_limit(), 8);
    ///
    /// // The same version with another limit: a typed error, never `Full`, no slot taken.
    /// let wrong = Quota::builder("api").limit(6).limit_version(2)
    ///     .shared_backend(backend).build()?;
    /// assert!(matches!(
    ///     wrong.try_acquire("c").await,
    ///     Err(Error::Misconfigured(Misconfiguration::LimitMismatch { configured: 6, stored: 8, version: 2 }))
    /// ));
    /// # Ok(()) }
    /// ```
    pub fn limit_version(mut self, version: u64) -> Self {
        self.limit_version = version;
        self
    }

    /// How long a lease lives without a renewal: a crashed holder's slot is reclaimed this long
    /// after its last heartbeat. Default 10 s.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How often leases are renewed. Default ttl / 3; at least [`MIN_HEARTBEAT`], and must leave
    /// room for a renewal to arrive before the local deadline (ttl in whole ms − 1 ms − safety
    /// margin).
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = Some(every);
        self
    }

    /// How much earlier than the backend the holder gives up a lease it cannot renew, to cover
    /// network delay and clock-rate differences. Default ttl / 20, at least 10 ms.
    pub fn safety_margin(mut self, margin: Duration) -> Self {
        self.safety_margin = Some(margin);
        self
    }

    /// How long the oldest waiter of this process sleeps between attempts when no wake-up
    /// arrives (Pub/Sub can lose messages): jittered between half and one and a half of it, and
    /// never past the expiry hint of its last full answer or the ttl. The other waiters of the
    /// process poll together, one poll for all of them (so their attempts share one backend
    /// call), every 0.5–1.5 × 4 × this, at most the ttl. Default 250 ms; between 1 ms and
    /// [`MAX_TTL`] (a longer one would change nothing: no sleep outlasts the ttl).
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = every;
        self
    }

    /// How long a cancel marker is kept: long enough to outlive a queued task's wait plus one
    /// lease ttl, so a task cancelled while it waits is refused when its turn comes. A task id
    /// cannot be admitted again while its marker lives. At least two ttls (a holder whose cancel
    /// message was lost learns it from a renewal, which may arrive up to about one ttl late) and
    /// at most [`MAX_CANCEL_MARKER_TTL`]. Default 1 hour + ttl (two ttls when that is longer).
    pub fn cancel_marker_ttl(mut self, ttl: Duration) -> Self {
        self.cancel_marker_ttl = Some(ttl);
        self
    }

    /// Whether to subscribe to the quota's events (default true). Without them, waiters rely on
    /// expiry timers and polls, and a holder learns of a cancel or a forced release at its next
    /// renewal (a local lease of the backend-down policy, which is never renewed, reads its
    /// cancel marker every second instead): for servers whose ACL denies `SUBSCRIBE`.
    pub fn events(mut self, subscribe: bool) -> Self {
        self.events = subscribe;
        self
    }

    /// What to answer when the backend cannot: see [`BackendDownPolicy`]. Default
    /// [`FailClosed`](BackendDownPolicy::FailClosed).
    pub fn when_backend_down(mut self, policy: BackendDownPolicy) -> Self {
        self.when_down = policy;
        self
    }

    /// When the short-circuit opens and how long it stays open; see [`BreakerConfig`].
    pub fn breaker(mut self, config: BreakerConfig) -> Self {
        self.breaker = config;
        self
    }

    /// Where the leases live: a [`RedisBackend`](crate::RedisBackend) for a fleet, or a
    /// [`MemoryBackend`] for one process. Default: the process-wide embedded memory backend.
    pub fn backend(mut self, backend: impl Backend) -> Self {
        self.backend = Some(Arc::new(backend));
        self
    }

    /// Like [`backend`](Self::backend), for a backend already shared behind an `Arc`.
    pub fn shared_backend(mut self, backend: Arc<dyn Backend>) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Checks the settings and returns the quota. Makes no backend call.
    pub fn build(self) -> Result<Quota> {
        let (keys, config) = self.settings()?;
        let backend = self
            .backend
            .unwrap_or_else(|| EMBEDDED.clone() as Arc<dyn Backend>);
        Ok(Quota::start(keys, config, backend))
    }

    /// Checks the settings without building anything: what [`build`](Self::build) would
    /// reject, it rejects with the same error. Useful to refuse bad input before connecting to
    /// a backend.
    pub fn check(&self) -> Result<()> {
        self.settings().map(drop)
    }

    fn settings(&self) -> Result<(QuotaKeys, QuotaConfig)> {
        let keys = QuotaKeys::new(&self.name)?;
        let limit = VersionedLimit {
            limit: validate_limit(self.limit.ok_or(Misconfiguration::MissingLimit)?)?,
            version: validate_limit_version(self.limit_version)?,
        };
        let timing = |why: String| Misconfiguration::InvalidTiming(why);
        if self.ttl < MIN_TTL || self.ttl > MAX_TTL {
            return Err(timing(format!(
                "ttl {:?} must be between {MIN_TTL:?} and {MAX_TTL:?}",
                self.ttl
            ))
            .into());
        }
        let safety_margin = self
            .safety_margin
            .unwrap_or((self.ttl / 20).max(Duration::from_millis(10)));
        if safety_margin >= self.ttl / 2 {
            return Err(timing(format!(
                "safety margin {safety_margin:?} must be below half the ttl {:?}",
                self.ttl
            ))
            .into());
        }
        let heartbeat = self.heartbeat.unwrap_or(self.ttl / 3);
        // A heartbeat as long as what a renewal grants would lose every lease before its first
        // renewal.
        let validity = validity(self.ttl, safety_margin);
        // A floor, as for the poll interval: each beat is a backend call, and one held lease at
        // a 1 ns heartbeat cost Redis 871 renewals a second (found by review).
        if heartbeat < MIN_HEARTBEAT || heartbeat >= validity {
            return Err(timing(format!(
                "heartbeat {heartbeat:?} must be at least {MIN_HEARTBEAT:?} and below what a \
                 renewal grants, {validity:?} (ttl in whole ms − 1 ms − safety margin)"
            ))
            .into());
        }
        if self
            .cancel_marker_ttl
            .is_some_and(|t| t < self.ttl * 2 || t > MAX_CANCEL_MARKER_TTL)
        {
            return Err(timing(format!(
                "the cancel marker ttl must be between two lease ttls and {MAX_CANCEL_MARKER_TTL:?}"
            ))
            .into());
        }
        if self.when_down == (BackendDownPolicy::DegradeLocal { share: 0 }) {
            return Err(timing("DegradeLocal needs a share of at least 1".into()).into());
        }
        // Bounded like a ttl: the cool-down is jittered by multiplication, which overflows near
        // `Duration::MAX` (found by review: a panic on leasehold's runtime at the first failure).
        if self.breaker.failures_to_open == 0
            || self.breaker.cool_down.is_zero()
            || self.breaker.cool_down > MAX_TTL
        {
            return Err(timing(format!(
                "the breaker needs failures_to_open ≥ 1 and a cool-down above zero and at most \
                 {MAX_TTL:?}"
            ))
            .into());
        }
        if self.poll_interval < Duration::from_millis(1) || self.poll_interval > MAX_TTL {
            return Err(timing(format!(
                "poll interval {:?} must be between 1ms and {MAX_TTL:?}",
                self.poll_interval
            ))
            .into());
        }
        let config = QuotaConfig {
            limit,
            ttl: self.ttl,
            heartbeat,
            safety_margin,
            poll_interval: self.poll_interval,
            cancel_marker_ttl: self
                .cancel_marker_ttl
                .unwrap_or((Duration::from_secs(3600) + self.ttl).max(self.ttl * 2)),
            events: self.events,
            when_down: self.when_down,
            breaker: self.breaker,
        };
        Ok((keys, config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn misconfigured(b: QuotaBuilder) -> bool {
        let checked = matches!(b.check(), Err(Error::Misconfigured(_)));
        assert_eq!(checked, matches!(b.build(), Err(Error::Misconfigured(_))));
        checked
    }

    #[test]
    fn the_local_deadline_allows_for_the_servers_whole_milliseconds() {
        let config = |ttl, margin| {
            QuotaBuilder::new("q")
                .limit(1)
                .ttl(ttl)
                .safety_margin(margin)
                .settings()
                .unwrap()
                .1
        };
        let sent = Instant::now();
        // The server may read its clock up to 1 ms late and keeps only whole ms of the ttl.
        let c = config(Duration::from_micros(60_900), Duration::ZERO);
        assert_eq!(c.local_deadline(sent) - sent, Duration::from_millis(59));
        let c = config(Duration::from_secs(10), Duration::from_millis(50));
        assert_eq!(c.local_deadline(sent) - sent, Duration::from_millis(9949));
    }

    #[test]
    fn settings_are_checked_before_any_call() {
        let q = || QuotaBuilder::new("q").limit(3);
        assert!(
            matches!(
                QuotaBuilder::new("q").build(),
                Err(crate::Error::Misconfigured(Misconfiguration::MissingLimit))
            ),
            "limit is required, and said so"
        );
        assert!(misconfigured(q().limit(0)));
        assert!(misconfigured(
            q().limit_version(crate::MAX_LIMIT_VERSION + 1)
        ));
        assert!(!misconfigured(q().limit_version(crate::MAX_LIMIT_VERSION)));
        assert!(misconfigured(q().ttl(Duration::from_millis(1))));
        assert!(misconfigured(
            q().ttl(Duration::from_secs(1))
                .heartbeat(Duration::from_secs(1))
        ));
        assert!(misconfigured(q().heartbeat(Duration::ZERO)));
        // ttl 10 s, margin 500 ms: a renewal grants 9499 ms.
        assert!(misconfigured(q().heartbeat(Duration::from_millis(9499))));
        assert!(!misconfigured(q().heartbeat(Duration::from_millis(9498))));
        assert!(misconfigured(q().safety_margin(Duration::from_secs(6))));
        assert!(misconfigured(
            q().cancel_marker_ttl(Duration::from_secs(19))
        ));
        assert!(misconfigured(q().cancel_marker_ttl(Duration::MAX)));
        assert!(!misconfigured(
            q().cancel_marker_ttl(Duration::from_secs(20))
        ));
        assert!(misconfigured(QuotaBuilder::new("a{b}").limit(1)));
        assert!(misconfigured(q().poll_interval(Duration::ZERO)));
        assert!(misconfigured(q().poll_interval(Duration::MAX)));
        assert!(!misconfigured(q().poll_interval(MAX_TTL)));
        // Found by review: 871 renewals a second for one lease; a panic at the first failure.
        assert!(misconfigured(q().heartbeat(Duration::from_nanos(1))));
        assert!(!misconfigured(q().heartbeat(MIN_HEARTBEAT)));
        let breaker = |cool_down| crate::BreakerConfig {
            failures_to_open: 1,
            cool_down,
        };
        assert!(misconfigured(q().breaker(breaker(Duration::MAX))));
        assert!(!misconfigured(q().breaker(breaker(MAX_TTL))));
    }
}
