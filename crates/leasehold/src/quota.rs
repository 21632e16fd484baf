//! [`Quota`]: a handle to one named, fleet-wide concurrency quota.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::admissions::Admissions;
use crate::backend::{Backend, LimitUpdate};
use crate::breaker::{Breaker, BreakerMode};
use crate::config::{QuotaBuilder, QuotaConfig};
use crate::error::{Error, FullCause, LostReason, Misconfiguration, Result};
use crate::keys::{
    validate_cancel_reason, validate_limit, validate_limit_version, validate_task_id, QuotaKeys,
    MAX_LIMIT_VERSION,
};
use crate::lease::Lease;
use crate::waiters::{Place, WaitQueue};
use crate::{admissions, heartbeat, runtime};

mod attempt;
mod backend_calls;
mod listening;
mod registry;
mod status;
mod when_down;

pub(crate) use attempt::{Attempt, StartedAttempt};
use status::system_time;
pub use status::{Holder, Status};

/// A handle to one named quota: at most `limit` leases held at once across every process that
/// uses the same quota name on the same backend.
///
/// Cheap to clone; clones share the renewal task, the waiter queue and the event subscription.
/// One per quota and process is the normal use. Handles built separately for the same name on the
/// same backend (the same [`Backend::identity`](crate::backend::Backend::identity): one
/// connection) share what this process knows of the quota's leases: a task acquired through one
/// of them while another holds it gets that same lease. It ends when any of its handles
/// releases it (unless an acquire of the task is on its way, whose handle then keeps it: see
/// [`Lease`](crate::Lease)), or when the last of them is dropped.
///
/// The operator's calls ([`status`](Self::status), [`cancel`](Self::cancel),
/// [`cancel_reason`](Self::cancel_reason), [`force_release`](Self::force_release),
/// [`set_limit`](Self::set_limit), which takes its own) send no limit: an operator's tool that
/// does not know the fleet's limit may build its handle with any valid one (say 1, at version
/// 0), and read the stored limit from [`Status::stored_limit`]. Only acquires send it; in a
/// `Status`, only `limit`, and `effective_limit()` and `free()` while no limit is stored,
/// reflect it. Give the handle the fleet's ttl, though: a cancel marker is kept for one hour
/// plus the ttl (two ttls when longer) unless
/// [`cancel_marker_ttl`](crate::QuotaBuilder::cancel_marker_ttl) says otherwise.
///
/// **Runtimes.** Backend calls and renewals run on leasehold's own runtime thread, started at
/// the first use, whatever runtime the caller uses (or none). Two things run on the caller's
/// tokio timer: the bound of [`acquire_timeout`](Self::acquire_timeout) and a waiter's sleeps
/// between attempts. Under a paused clock (tokio's `test-util`: `start_paused`,
/// `time::pause`), which jumps ahead whenever the caller's runtime idles, so also while it
/// waits for leasehold's thread, `acquire_timeout` ends at once with `TimedOut` and a waiter
/// retries in a busy loop: under a paused clock, use [`try_acquire`](Self::try_acquire).
/// leasehold's thread does not survive a `fork`: fork before the first use (or `exec` after
/// it); calls in a child forked after it never complete.
///
/// ```
/// # #[tokio::main] async fn main() -> leasehold::Result<()> {
/// use std::time::Duration;
/// let quota = leasehold::Quota::builder("llm-api").limit(2).ttl(Duration::from_secs(5)).build()?;
/// let a = quota.try_acquire("task-a").await?;
/// let _b = quota.try_acquire("task-b").await?;
/// assert!(matches!(quota.try_acquire("task-c").await, Err(leasehold::Error::Full { .. })));
/// a.release().await?;
/// let _c = quota.acquire_timeout("task-c", Duration::from_secs(1)).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Quota {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quota")
            .field("name", &self.shared.keys.name)
            .field("config", &self.shared.config)
            .field("backend", &self.shared.backend)
            .finish()
    }
}

/// State shared by the clones of one [`Quota`] and its leases.
pub(crate) struct Shared {
    pub(crate) keys: QuotaKeys,
    pub(crate) config: QuotaConfig,
    pub(crate) backend: Arc<dyn Backend>,
    /// Live leases, attempts and turns of this quota in this process, shared with the other
    /// handles built for it on this backend.
    pub(crate) admissions: Arc<Admissions>,
    waiters: WaitQueue,
    listening: AtomicBool,
    /// When the last subscription attempt failed, so that waiters retry it only now and then.
    subscribe_failed_at: Mutex<Option<Instant>>,
    /// A subscription attempt is under way (or waits out the spacing after a failed one).
    subscribing: AtomicBool,
    /// Wakes an attempt that waits out the spacing: the backend answers again after an outage.
    subscribe_now: Arc<tokio::sync::Notify>,
    /// The latest subscription attempt was refused (a misconfiguration: an ACL without the
    /// quota's channel), not cut short by an outage: the backend's answers do not retry it;
    /// acquires and waiters' rounds still do.
    subscribe_refused: AtomicBool,
    /// The task that watches local leases (their subscription, their cancel markers) runs.
    watching_local: AtomicBool,
    /// When the local leases' cancel markers must be read: a second after a lease was granted
    /// (its task may have been cancelled before, which the policy could not read; at once, the
    /// read would meet the failure that made the grant), at once when the subscription was made
    /// again (a cancel sent meanwhile went unheard). Cleared by the watcher's read.
    local_markers_due: Mutex<Option<Instant>>,
    /// Wakes the watcher of local leases for a read now.
    local_watch: Arc<tokio::sync::Notify>,
    /// Cancelled when the last handle of the quota goes: its background tasks stop.
    pub(crate) shutdown: CancellationToken,
    /// Wakes the renewal task for a new lease whose local deadline comes first.
    pub(crate) alarm: Arc<heartbeat::Alarm>,
    pub(crate) breaker: Breaker,
    /// Attempts of this handle's waiters (and its clones') answered "no slot": a waiter that
    /// runs out of time behind others, without an answer of its own, learns from theirs that the
    /// backend answers and the quota is full (`Error::TimedOut::answered`).
    waiter_refusals: AtomicU64,
}

impl Quota {
    /// Starts building a quota named `name`. Names may hold any printable characters except
    /// braces, up to 256 bytes.
    pub fn builder(name: impl Into<String>) -> QuotaBuilder {
        QuotaBuilder::new(name)
    }

    pub(crate) fn start(keys: QuotaKeys, config: QuotaConfig, backend: Arc<dyn Backend>) -> Quota {
        let shared = Arc::new(Shared {
            admissions: admissions::of(&backend, &keys),
            keys,
            backend,
            waiters: WaitQueue::default(),
            listening: AtomicBool::new(false),
            subscribe_failed_at: Mutex::new(None),
            subscribing: AtomicBool::new(false),
            subscribe_now: Arc::default(),
            subscribe_refused: AtomicBool::new(false),
            watching_local: AtomicBool::new(false),
            local_markers_due: Mutex::new(None),
            local_watch: Arc::default(),
            shutdown: CancellationToken::new(),
            alarm: Arc::default(),
            breaker: Breaker::new(config.breaker),
            waiter_refusals: AtomicU64::new(0),
            config,
        });
        heartbeat::start(&shared);
        Quota { shared }
    }

    /// The quota's name.
    pub fn name(&self) -> &str {
        &self.shared.keys.name
    }

    /// The state of the quota's short-circuit (closed, open, half-open).
    pub fn breaker_mode(&self) -> BreakerMode {
        self.shared.breaker.mode()
    }

    /// Leases granted in this process by the backend-down policy, without the backend, and not
    /// yet released.
    pub fn local_leases(&self) -> u32 {
        self.shared.admissions.local_held.load(Ordering::Acquire)
    }

    /// The limit this handle is configured with. The quota admits up to the limit its backend
    /// stores, which a client with a higher [limit version](crate::QuotaBuilder::limit_version)
    /// may have replaced: see [`Status::effective_limit`].
    pub fn limit(&self) -> u32 {
        self.shared.config.limit.limit
    }

    /// The version of this handle's limit (see
    /// [`QuotaBuilder::limit_version`](crate::QuotaBuilder::limit_version)).
    pub fn limit_version(&self) -> u64 {
        self.shared.config.limit.version
    }

    /// The lease ttl.
    pub fn ttl(&self) -> Duration {
        self.shared.config.ttl
    }

    /// The renewal interval.
    pub fn heartbeat(&self) -> Duration {
        self.shared.config.heartbeat
    }

    /// One admission attempt: a lease, or [`Error::Full`] when no slot is free. If `task_id`
    /// already holds a lease, that lease is returned (an idempotent retry), never a second slot
    /// and never `Full`.
    ///
    /// [`Error::BackendUnavailable`] after a call timeout does not mean nothing was admitted:
    /// the backend may admit the task after the client gave up (a stalled Redis that resumes),
    /// and that slot then stays taken for one ttl. Retry with the same task id, which returns
    /// that lease if there is one (see the error).
    pub async fn try_acquire(&self, task_id: &str) -> Result<Lease> {
        validate_task_id(task_id)?;
        self.shared.listen_in_background();
        match self.attempt(task_id).await? {
            Attempt::Admitted(lease) | Attempt::AlreadyHeld(lease) => Ok(lease),
            Attempt::Full { cause, .. } => Err(self.full(cause)),
        }
    }

    /// Waits for a slot as long as it takes. Call it from a Tokio runtime with its timer enabled
    /// (`enable_time`, as `#[tokio::main]` does): waiting sleeps on the caller's runtime.
    /// [`try_acquire`](Self::try_acquire), `release` and `status` need no runtime of their own.
    ///
    /// Waiters of one handle (and its clones) are served in
    /// arrival order; they are woken by release events, by a timer to the earliest lease
    /// deadline, and by a bounded, jittered poll in case an event was lost. Order is kept
    /// among the waiters this process knows to be waiting: a newcomer whose first attempt is
    /// still out when another arrives is not ahead of it yet, a younger waiter's
    /// safety-net poll may take a slot that freed during an older waiter's round trip, and a
    /// waiter whose task does not run in time (its future not polled, its runtime blocked) lets
    /// younger waiters go first rather than keep a free slot from them: a slot won for it is
    /// given back after 250 ms, and once it has left a refusal unread for a second, slots go
    /// to others until it reads.
    ///
    /// Waiting is for a free slot, not for the backend: when the backend cannot answer, the
    /// quota's [`BackendDownPolicy`](crate::BackendDownPolicy) decides (the default fails closed
    /// with [`Error::BackendUnavailable`]), so a caller is never stuck behind an outage it cannot
    /// see. It decides at once when the connection is refused or the short-circuit is open; a
    /// backend that stalls without refusing costs the first callers one call timeout
    /// ([`RedisOptions::call_timeout`](crate::RedisOptions::call_timeout)) each, until the
    /// short-circuit opens. An acquire that failed with such a call timeout may still have been
    /// admitted by the backend: retry with the same task id, as for
    /// [`try_acquire`](Self::try_acquire).
    /// It fails with [`Error::Cancelled`] if the task is cancelled while it waits.
    pub async fn acquire(&self, task_id: &str) -> Result<Lease> {
        validate_task_id(task_id)?;
        self.shared.listen_in_background();
        self.wait_for_slot(task_id).await
    }

    /// Like [`acquire`](Self::acquire), but gives up after `timeout` with [`Error::TimedOut`],
    /// whose `answered` tells a full quota (an attempt of the wait was answered: no slot) from a
    /// backend that answered no attempt in time (a stalled one, when `timeout` is shorter than a
    /// call timeout). A zero `timeout` leaves no time for an answer: for one attempt, use
    /// [`try_acquire`](Self::try_acquire).
    /// Like `acquire`, it needs a Tokio runtime with its timer enabled.
    /// An attempt still in flight at that moment is not lost: if its late reply admits the task,
    /// the slot is released in the background. A task that holds a lease in this process gets
    /// that lease when the timeout passes before the backend confirmed it (a slow link), as it
    /// does when the backend is down: never an error for a lease it holds.
    pub async fn acquire_timeout(&self, task_id: &str, timeout: Duration) -> Result<Lease> {
        validate_task_id(task_id)?;
        self.shared.listen_in_background();
        let refusals_before = self.shared.waiter_refusals.load(Ordering::Acquire);
        match tokio::time::timeout(timeout, self.wait_for_slot(task_id)).await {
            Ok(result) => result,
            Err(_) => match self.shared.held_lease_of(task_id) {
                Some(held) => Ok(Lease::from_inner(held)),
                None => Err(Error::TimedOut {
                    quota: self.name().to_owned(),
                    waited: timeout,
                    // This waiter's own attempts, or those of the waiters ahead of it (which
                    // alone attempt while it waits in line) were answered: no slot.
                    answered: self.shared.waiter_refusals.load(Ordering::Acquire) > refusals_before,
                }),
            },
        }
    }

    /// The live leases of the quota, fleet-wide, with this handle's limit and the one the backend
    /// stores.
    pub async fn status(&self) -> Result<Status> {
        let snapshot = self.shared.backend.snapshot(&self.shared.keys).await?;
        Ok(Status {
            quota: self.name().to_owned(),
            limit: self.limit(),
            limit_version: self.limit_version(),
            stored_limit: snapshot.limit,
            now: system_time(snapshot.now_ms),
            quarantine: (snapshot.quarantine_left_ms > 0)
                .then(|| Duration::from_millis(snapshot.quarantine_left_ms)),
            holders: snapshot
                .holders
                .into_iter()
                .map(|r| Holder {
                    task_id: r.task_id,
                    fencing_token: r.token,
                    acquired_at: system_time(r.acquired_at_ms),
                    deadline: system_time(r.deadline_ms),
                })
                .collect(),
        })
    }

    /// The operator's forced release: removes the lease of `task_id` whatever its fencing token.
    /// Its holder learns it at once through the release event, with
    /// [`LostReason::ReleasedElsewhere`](crate::LostReason::ReleasedElsewhere), or, if that
    /// message is lost, at its next renewal, which finds the lease gone:
    /// [`LostReason::Expired`](crate::LostReason::Expired). Returns whether a lease was removed.
    pub async fn force_release(&self, task_id: &str) -> Result<bool> {
        validate_task_id(task_id)?;
        let (shared, task_id) = (self.shared.clone(), task_id.to_owned());
        // On leasehold's runtime, the wait for the task's turn included: a caller's future
        // parked while it held the turn (a `select!` that went the other way) blocked every
        // release and acquire of the task, and `flush`, for as long as it lived (found by
        // review).
        runtime::finish(async move {
            // In the task's turn, as its acquires are: an acquire of the task under way could
            // otherwise run after this release in the backend (acquires and releases travel in
            // separate calls) and be taken for a lease it removed (found by review).
            let _turn = shared.admissions.turns.take(&task_id).await;
            let sent = Instant::now();
            let removed = shared.release_in_backend(&task_id, None).await?;
            // A lease of the task in this process is gone from the backend either way: removed
            // now, or not there to remove.
            let reason = match removed {
                true => LostReason::ReleasedElsewhere,
                false => LostReason::Expired,
            };
            shared.end_lease_admitted_before(&task_id, sent, reason);
            Ok(removed)
        })
        .await
    }

    /// The operator's change of the quota's limit, without a deploy: stores `limit` at
    /// `version` in the backend if that version is higher than the stored one (or none is
    /// stored). `None` takes one above the stored version (1 when none is stored), atomically.
    /// Every client admits against the stored limit from its next acquire on, whatever limit it
    /// was built with, as long as its own [limit version](crate::QuotaBuilder::limit_version) is
    /// lower; nobody is evicted when it goes down. A later deploy must use a version above this
    /// one to change the limit again.
    ///
    /// Returns [`LimitUpdate::Stored`] with the limit now in force, or [`LimitUpdate::Kept`]
    /// with the higher version that stays (or the same limit at the same version, already
    /// stored). The same version stored with another limit fails with
    /// [`Misconfiguration::LimitVersionTaken`]. This handle's own configured limit is not
    /// changed.
    ///
    /// The stored limit lives only in Redis: if Redis loses it (a restart without persistence,
    /// `FLUSHALL`, an eviction), the next acquire stores its caller's configured limit and
    /// version again, and a lowering made here is undone without a word. Change the fleet's
    /// configuration too, or set the limit again after such a loss
    /// ([`Status::stored_limit`](crate::Status::stored_limit) shows what is stored).
    ///
    /// Versions end at [`MAX_LIMIT_VERSION`](crate::MAX_LIMIT_VERSION): once a limit is stored
    /// there, `None` has no version to take and fails with
    /// [`Misconfiguration::LimitVersionsExhausted`] (nothing changed; unless the limit asked for
    /// is already the one stored there: then `Ok(Kept)`), and neither `set_limit` nor
    /// any client's acquire can replace that limit until an operator deletes the quota's limit
    /// key in Redis (docs/PROTOCOL.md §3). So leave the versions to `None`, or keep explicit ones
    /// small.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> leasehold::Result<()> {
    /// use leasehold::{backend::LimitUpdate, Quota, VersionedLimit};
    ///
    /// let quota = Quota::builder("llm").limit(10).build()?;
    /// let _lease = quota.try_acquire("job-1").await?; // stores 10 at version 0
    /// // The provider lowered its cap: 3 for everyone, from their next acquire on.
    /// let update = quota.set_limit(3, None).await?;
    /// assert_eq!(update, LimitUpdate::Stored(VersionedLimit { limit: 3, version: 1 }));
    /// assert_eq!(quota.status().await?.effective_limit(), 3);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn set_limit(&self, limit: u32, version: Option<u64>) -> Result<LimitUpdate> {
        validate_limit(u64::from(limit))?;
        if let Some(version) = version {
            validate_limit_version(version)?;
        }
        let update = self
            .shared
            .backend
            .set_limit(&self.shared.keys, limit, version)
            .await?;
        match update {
            LimitUpdate::Mismatch(stored) => Err(Misconfiguration::LimitVersionTaken {
                asked: limit,
                stored: stored.limit,
                version: stored.version,
            }
            .into()),
            // Asked for the version above the stored one, which is the last: a backend keeps the
            // stored limit (set_limit.lua answers `kept`), which would read as a higher version
            // stored by someone else.
            // (Unless the limit asked for is the one in force: nothing needs to change.)
            LimitUpdate::Kept(stored)
                if version.is_none()
                    && stored.version >= MAX_LIMIT_VERSION
                    && stored.limit != limit =>
            {
                Err(Misconfiguration::LimitVersionsExhausted {
                    asked: limit,
                    stored: stored.limit,
                    key: self.shared.keys.limit.clone(),
                }
                .into())
            }
            done => Ok(done),
        }
    }

    /// Waits until the work left in the background for this quota in this process (through
    /// this handle or any other handle of the same quota on the same backend) has reached the
    /// backend: the releases of leases dropped before the call, and admission attempts still in
    /// flight, whose late admission is released if nobody takes it (an `acquire_timeout` that
    /// gave up, an `acquire` future dropped). That work runs on leasehold's own thread, which
    /// dies with the process, and a release never sent leaves its slot taken for one ttl.
    ///
    /// Before the process exits, **release or drop every lease first, then flush**. A lease
    /// still alive when `flush` runs is not its business: dropped after it (a
    /// `let _lease = quota.acquire(..)` in `main`, dropped when `main` returns; leases kept in a
    /// `Vec` or a struct that outlives the call), its release only starts then, and dies with
    /// the process. [`Lease::release`] sends the release at once, without a flush.
    ///
    /// Renewals in flight count too (one that still finds a lease dropped meanwhile releases it
    /// again). Returns at once when nothing is under way; a call is bounded by its timeout, a
    /// renewal by its leases' local deadline. Attempts of callers still waiting count too, so
    /// call it once the process has stopped acquiring (and, on a link slower than the heartbeat,
    /// where renewals overlap, once its leases are released).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> leasehold::Result<()> {
    /// let quota = leasehold::Quota::builder("reports").limit(4).build()?;
    /// let leases = vec![
    ///     quota.try_acquire("report-17").await?,
    ///     quota.try_acquire("report-18").await?,
    /// ];
    /// // ... the work ...
    /// drop(leases); // first: their releases start in the background...
    /// quota.flush().await; // ...then wait until they reached the backend
    /// assert!(quota.status().await?.holders.is_empty());
    /// Ok(()) // `main` returns: nothing is left to send
    /// # }
    /// ```
    pub async fn flush(&self) {
        self.shared.admissions.pending.finished().await;
    }

    /// Cancels `task_id`, wherever it runs: writes the cancel marker (the truth, kept for the
    /// quota's [cancel marker ttl](crate::QuotaBuilder::cancel_marker_ttl)), then announces it.
    /// The holder's [`Lease::lost`] fires with
    /// [`LostReason::Cancelled`](crate::LostReason::Cancelled) as soon as the message arrives, or
    /// at its next renewal if the message was lost; an acquire of a cancelled id fails with
    /// [`Error::Cancelled`]. What the holder does then is its own choice.
    ///
    /// Returns whether the task held a lease; cancelling a task that holds none is not an error
    /// (it may be queued, or not started yet). A reason longer than
    /// [`MAX_CANCEL_REASON_BYTES`](crate::MAX_CANCEL_REASON_BYTES) is refused before any call.
    pub async fn cancel(&self, task_id: &str, reason: &str) -> Result<bool> {
        validate_task_id(task_id)?;
        validate_cancel_reason(reason)?;
        self.shared
            .backend
            .cancel(
                &self.shared.keys,
                task_id,
                reason,
                self.shared.config.cancel_marker_ttl,
            )
            .await
    }

    /// The reason `task_id` was cancelled, while its cancel marker lives (the quota's
    /// [cancel marker ttl](crate::QuotaBuilder::cancel_marker_ttl)); `None` if it was not.
    ///
    /// For a holder that lost its lease for another reason and wonders whether to run the task
    /// again: a lease lost at its [local deadline](crate::LostReason::LocalDeadline) while the
    /// process was paused may also have been cancelled meanwhile, and the cancel message, which
    /// arrives later, finds the lease already lost.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> leasehold::Result<()> {
    /// let quota = leasehold::Quota::builder("reports").limit(4).build()?;
    /// quota.cancel("report-17", "superseded").await?;
    /// assert_eq!(quota.cancel_reason("report-17").await?.as_deref(), Some("superseded"));
    /// assert_eq!(quota.cancel_reason("report-18").await?, None);
    /// # Ok(()) }
    /// ```
    pub async fn cancel_reason(&self, task_id: &str) -> Result<Option<String>> {
        validate_task_id(task_id)?;
        self.shared
            .backend
            .cancel_reason(&self.shared.keys, task_id)
            .await
    }

    /// How many entries this process keeps for the quota right now, for leak tests. Not part
    /// of the API.
    #[doc(hidden)]
    pub fn debug_sizes(&self) -> crate::debug::QuotaSizes {
        let admissions = &self.shared.admissions;
        // One lock at a time: a guard left as a temporary of the literal below would be held
        // until the end of the function, under the others.
        let registry = admissions.registry().len();
        let local = admissions.local().len();
        let attempts = admissions.attempts().len();
        crate::debug::QuotaSizes {
            registry,
            local,
            attempts,
            turns: admissions.turns.tracked(),
            unanswered_releases: admissions.unanswered_len(),
            waiters: self.shared.waiters.len(),
            pending_work: admissions.pending.count(),
            known_quotas: admissions::known_len(),
        }
    }

    fn full(&self, cause: FullCause) -> Error {
        Error::Full {
            quota: self.name().to_owned(),
            limit: self.limit(),
            cause,
        }
    }

    /// Waits for a slot. Each "no slot" answer counts in `waiter_refusals`, so that a caller
    /// that gives up can tell a full quota from a backend that never answered.
    async fn wait_for_slot(&self, task_id: &str) -> Result<Lease> {
        let shared = &self.shared;
        // Only a newcomer when nobody waits in line (or a task that already holds) may try at
        // once; otherwise it would overtake older waiters.
        let mut retry_after = shared.until_expiry_or_poll();
        // Told "quarantined": nobody is admitted until it ends, so polling sooner is wasted.
        let mut quarantined = false;
        let (place, try_at_once) = shared
            .waiters
            .join(task_id, shared.held_lease_of(task_id).is_some());
        if try_at_once {
            let attempt = shared.start_attempt(task_id);
            match self.settled(self.in_line(attempt, &place).await)? {
                Attempt::Admitted(lease) | Attempt::AlreadyHeld(lease) => return Ok(lease),
                Attempt::Full {
                    retry_after: r,
                    cause,
                } => {
                    retry_after = r;
                    quarantined = matches!(cause, FullCause::Quarantined { .. });
                    place.idle();
                }
            }
        }
        loop {
            // The backend answers (this waiter was told "full"): if the subscription is missing
            // (the circuit was open when the wait began, or it failed or ended), try again, so
            // that releases wake this waiter rather than its polls.
            self.shared.listen_in_background();
            let sleep = if place.is_head() {
                // At most one ttl: a refusal keeps releases announced (the `waiting` marker) only
                // for as long as some waiter comes back within that time.
                let poll = match quarantined {
                    true => retry_after,
                    false => self.jitter(shared.config.poll_interval),
                };
                poll.min(retry_after).min(shared.config.ttl)
            } else {
                // Not first in line: the head watches expiries; poll rarely, as a safety net, but
                // within a ttl, so the `waiting` marker lives on even if the head is wedged. The
                // whole line polls at once: its attempts share a script call.
                shared.waiters.until_line_poll(|| {
                    self.jitter(shared.config.poll_interval * 4)
                        .min(shared.config.ttl)
                })
            };
            let asked = tokio::select! {
                asked = place.woken() => asked,
                _ = tokio::time::sleep(sleep) => { place.attempting(); true }
            };
            if !asked {
                // Promoted to head: arm the expiry timer from the last full reply. Attempting
                // now would make this waiter busy and let a release skip it for a younger one.
                // Keep a shorter wait already due (a slot given back: "try at once").
                retry_after = retry_after.min(shared.until_expiry_or_poll());
                continue;
            }
            // A release event may already have started this waiter's attempt.
            let attempt = match place.take_started() {
                Some(started) => started,
                None => shared.start_attempt(task_id),
            };
            let outcome = self.settled(self.in_line(attempt, &place).await);
            if !matches!(outcome, Ok(Attempt::Admitted(_) | Attempt::Full { .. })) {
                // This waiter leaves without having taken a slot (another caller of its task
                // holds it, or an error: cancelled, the backend down...): a freed slot its
                // wake-up was for goes to the next waiter.
                place.took_no_slot();
            }
            match outcome? {
                Attempt::Admitted(lease) => {
                    place.took_slot();
                    return Ok(lease);
                }
                Attempt::AlreadyHeld(lease) => return Ok(lease),
                Attempt::Full {
                    retry_after: r,
                    cause,
                } => {
                    // Admitted meanwhile through another caller or handle of this process (the
                    // full answer was on its way): that lease is this task's.
                    if let Some(held) = shared.held_lease_of(task_id) {
                        // The refusal settles a freed slot this waiter was woken for: taken by
                        // someone else, not to be passed on (found by review).
                        place.took_slot();
                        return Ok(Lease::from_inner(held));
                    }
                    retry_after = r;
                    quarantined = matches!(cause, FullCause::Quarantined { .. });
                    place.idle();
                }
            }
        }
    }

    /// An attempt's outcome, as a waiter takes it: a misconfiguration (a limit that disagrees
    /// with the stored one) ends every waiter's wait alike, so all of them try now and hear it,
    /// instead of each at its next poll. A refusal counts in `waiter_refusals`.
    fn settled(&self, outcome: Result<Attempt>) -> Result<Attempt> {
        match &outcome {
            Err(Error::Misconfigured(_)) => self.shared.recheck_all(),
            Ok(Attempt::Full { .. }) => {
                self.shared.waiter_refusals.fetch_add(1, Ordering::AcqRel);
            }
            _ => {}
        }
        outcome
    }

    /// A duration uniformly jittered between half and one and a half of `base`.
    fn jitter(&self, base: Duration) -> Duration {
        base.mul_f64(rand::rng().random_range(0.5..1.5))
    }

    /// The outcome of a waiter's attempt. Slots freed while it is out are counted on the waiter,
    /// which tries again at once if refused; if it does not read a refusal in time (its task
    /// does not run), they go to the next waiters instead (`WaitQueue::stalled`).
    async fn in_line(&self, attempt: StartedAttempt, place: &Place<'_>) -> Result<Attempt> {
        let (shared, token) = (self.shared.clone(), place.stall_token());
        let if_stalled = Box::new(move || {
            shared
                .waiters
                .stalled(token, |task_id| shared.start_attempt_for(task_id, true))
        });
        attempt.outcome_or_if_stalled(Some(if_stalled)).await
    }

    /// One admission attempt, run to completion on the leasehold runtime even if the caller stops
    /// waiting: a late admission nobody takes is released at once.
    async fn attempt(&self, task_id: &str) -> Result<Attempt> {
        self.shared.start_attempt(task_id).outcome().await
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Shared {
    /// Time until the earliest lease expiry the last full reply announced, or the poll interval
    /// when none is known.
    pub(super) fn until_expiry_or_poll(&self) -> Duration {
        self.waiters
            .until_expiry()
            .unwrap_or(self.config.poll_interval)
    }
}
