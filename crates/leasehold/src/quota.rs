//! [`Quota`]: a handle to one named, fleet-wide concurrency quota.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::Rng;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::admissions::Admissions;
use crate::backend::{AcquireReply, Backend, LeaseRecord, LimitUpdate, VersionedLimit};
use crate::breaker::{Breaker, BreakerMode, Permit};
use crate::config::BackendDownPolicy;
use crate::config::{QuotaBuilder, QuotaConfig};
use crate::error::{Error, FullCause, LostReason, Misconfiguration, Result};
use crate::keys::{
    validate_cancel_reason, validate_limit, validate_limit_version, validate_task_id, QuotaKeys,
};
use crate::lease::{Lease, LeaseInner};
use crate::waiters::WaitQueue;
use crate::{admissions, heartbeat, runtime};

/// A handle to one named quota: at most `limit` leases held at once across every process that
/// uses the same quota name on the same backend.
///
/// Cheap to clone; clones share the renewal task, the waiter queue and the event subscription.
/// One per quota and process is the normal use. Handles built separately for the same name on the
/// same backend (the same [`Backend::identity`](crate::backend::Backend::identity): one
/// connection) share what this process knows of the quota's leases: a task acquired through one
/// of them while another holds it gets that same lease. It ends when any of its handles
/// releases it, or when the last of them is dropped.
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
    /// A subscription attempt started by a waiter is under way.
    subscribing: AtomicBool,
    /// The task that keeps the subscription in place for local leases runs.
    watching_local: AtomicBool,
    /// Cancelled when the last handle of the quota goes: its background tasks stop.
    pub(crate) shutdown: CancellationToken,
    /// Wakes the renewal task for a new lease whose local deadline comes first.
    pub(crate) alarm: Arc<heartbeat::Alarm>,
    pub(crate) breaker: Breaker,
}

/// The longest an admission whose caller gave up waits for another attempt of the same task in
/// this process to share it, before it is released (see `attempt`).
const ORPHAN_GRACE: Duration = Duration::from_secs(2);

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

/// A point-in-time view of a quota, from [`Quota::status`].
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

fn system_time(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

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
/// on a slot others could use: the admission is released and the waiter tries again later.
const TAKE_GRACE: Duration = Duration::from_millis(100);

/// How long after a failed subscription a waiter tries again (each try may cost a call timeout).
const SUBSCRIBE_RETRY: Duration = Duration::from_secs(1);

/// An admission attempt under way (or decided at once, without the backend).
pub(crate) enum StartedAttempt {
    Done(Result<Attempt>),
    Running {
        outcome: oneshot::Receiver<Result<Attempt>>,
        /// For an attempt started on a waiter's behalf: tells it the waiter is there to take it.
        taken: Option<oneshot::Sender<()>>,
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
        match self {
            StartedAttempt::Done(outcome) => outcome,
            StartedAttempt::Running { outcome, taken } => {
                if let Some(taken) = taken {
                    let _ = taken.send(());
                }
                outcome.await.unwrap_or_else(|_| {
                    Err(Error::BackendUnavailable(
                        "leasehold runtime stopped during an attempt".into(),
                    ))
                })
            }
        }
    }
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
            watching_local: AtomicBool::new(false),
            shutdown: CancellationToken::new(),
            alarm: Arc::default(),
            breaker: Breaker::new(config.breaker),
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
    /// still out when another arrives is not ahead of it yet, and a younger waiter's
    /// safety-net poll may take a slot that freed during an older waiter's round trip.
    ///
    /// Waiting is for a free slot, not for the backend: when the backend cannot answer, the
    /// quota's [`BackendDownPolicy`] decides at once (the default fails closed with
    /// [`Error::BackendUnavailable`]), so a caller is never stuck behind an outage it cannot see.
    /// It fails with [`Error::Cancelled`] if the task is cancelled while it waits.
    pub async fn acquire(&self, task_id: &str) -> Result<Lease> {
        validate_task_id(task_id)?;
        self.shared.listen_in_background();
        self.wait_for_slot(task_id).await
    }

    /// Like [`acquire`](Self::acquire), but gives up after `timeout` with [`Error::TimedOut`].
    /// Like `acquire`, it needs a Tokio runtime with its timer enabled.
    /// An attempt still in flight at that moment is not lost: if its late reply admits the task,
    /// the slot is released in the background. A task that holds a lease in this process gets
    /// that lease when the timeout passes before the backend confirmed it (a slow link), as it
    /// does when the backend is down: never an error for a lease it holds.
    pub async fn acquire_timeout(&self, task_id: &str, timeout: Duration) -> Result<Lease> {
        validate_task_id(task_id)?;
        self.shared.listen_in_background();
        match tokio::time::timeout(timeout, self.wait_for_slot(task_id)).await {
            Ok(result) => result,
            Err(_) => match self.shared.held_lease_of(task_id) {
                Some(held) => Ok(Lease::from_inner(held)),
                None => Err(Error::TimedOut {
                    quota: self.name().to_owned(),
                    waited: timeout,
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
        self.shared.release_in_backend(task_id, None).await
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
    /// with the higher version that stays. The same version stored with another limit fails with
    /// [`Misconfiguration::LimitMismatch`]. This handle's own configured limit is not changed.
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
            LimitUpdate::Mismatch(stored) => Err(Misconfiguration::limit_mismatch(limit, stored)),
            done => Ok(done),
        }
    }

    /// Waits until the work left in the background for this quota in this process (through
    /// this handle or any other handle of the same quota on the same backend) has reached the
    /// backend: the releases of dropped leases, and admission attempts still in flight, whose
    /// late admission is released if nobody takes it (an `acquire_timeout` that gave up, an
    /// `acquire` future dropped). Await it before the process exits: that work runs on
    /// leasehold's own thread, which dies with the process, and a release never sent leaves its
    /// slot taken for one ttl. Renewals in flight count too (one that still finds a lease
    /// dropped meanwhile releases it again). Returns at once when nothing is under way; a call
    /// is bounded by its timeout, a renewal by its leases' local deadline. Attempts of callers
    /// still waiting count too, so call it once the process has stopped acquiring (and, on a
    /// link slower than the heartbeat, where renewals overlap, once its leases are released).
    ///
    /// ```
    /// # async fn demo() -> leasehold::Result<()> {
    /// let quota = leasehold::Quota::builder("reports").limit(4).build()?;
    /// let lease = quota.try_acquire("report-17").await?;
    /// drop(lease); // released in the background...
    /// quota.flush().await; // ...and sent before `main` returns
    /// # Ok(()) }
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
    /// # async fn demo() -> leasehold::Result<()> {
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

    fn full(&self, cause: FullCause) -> Error {
        Error::Full {
            quota: self.name().to_owned(),
            limit: self.limit(),
            cause,
        }
    }

    async fn wait_for_slot(&self, task_id: &str) -> Result<Lease> {
        let shared = &self.shared;
        // Only a newcomer when nobody waits in line (or a task that already holds) may try at
        // once; otherwise it would overtake older waiters.
        let mut retry_after = shared.until_expiry_or_poll();
        let (place, try_at_once) = shared
            .waiters
            .join(task_id, shared.held_lease_of(task_id).is_some());
        if try_at_once {
            match self.settled(self.attempt(task_id).await)? {
                Attempt::Admitted(lease) | Attempt::AlreadyHeld(lease) => return Ok(lease),
                Attempt::Full { retry_after: r, .. } => {
                    retry_after = r;
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
                self.jitter(shared.config.poll_interval)
                    .min(retry_after)
                    .min(shared.config.ttl)
            } else {
                // Not first in line: the head watches expiries; poll rarely, as a safety net, but
                // within a ttl, so the `waiting` marker lives on even if the head is wedged.
                self.jitter(shared.config.poll_interval * 4)
                    .min(shared.config.ttl)
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
            let outcome = self.settled(attempt.outcome().await);
            if !matches!(outcome, Ok(Attempt::Admitted(_) | Attempt::Full { .. })) {
                // This waiter leaves without having taken a slot (another caller of its task
                // holds it, or an error: cancelled, the backend down...): a freed slot its
                // wake-up was for goes to the next waiter.
                place.took_no_slot();
            }
            match outcome? {
                Attempt::Admitted(lease) | Attempt::AlreadyHeld(lease) => return Ok(lease),
                Attempt::Full { retry_after: r, .. } => {
                    retry_after = r;
                    place.idle();
                }
            }
        }
    }

    /// An attempt's outcome, as a waiter takes it: a misconfiguration (a limit that disagrees
    /// with the stored one) ends every waiter's wait alike, so all of them try now and hear it,
    /// instead of each at its next poll.
    fn settled(&self, outcome: Result<Attempt>) -> Result<Attempt> {
        if matches!(outcome, Err(Error::Misconfigured(_))) {
            self.shared.recheck_all();
        }
        outcome
    }

    /// A duration uniformly jittered between half and one and a half of `base`.
    fn jitter(&self, base: Duration) -> Duration {
        base.mul_f64(rand::rng().random_range(0.5..1.5))
    }

    /// One admission attempt, run to completion on the leasehold runtime even if the caller stops
    /// waiting: a late admission nobody takes is released at once.
    async fn attempt(&self, task_id: &str) -> Result<Attempt> {
        self.shared.start_attempt(task_id).outcome().await
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

impl Drop for Shared {
    fn drop(&mut self) {
        self.shutdown.cancel();
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
    fn start_attempt_for(self: &Arc<Self>, task_id: &str, for_waiter: bool) -> StartedAttempt {
        // A task granted a local lease keeps it, even once the backend answers again: asking
        // the backend would take it a second slot.
        if let Some(local) = self.local_lease_of(task_id).filter(|l| !l.is_over()) {
            return StartedAttempt::Done(Ok(Attempt::AlreadyHeld(Lease::from_inner(local))));
        }
        if self.breaker.permit() == Permit::Reject {
            // O(1), no network I/O: the circuit is open.
            let down = Error::BackendUnavailable("circuit open after repeated failures".into());
            return StartedAttempt::Done(self.when_down(task_id, down));
        }
        let (tx, rx) = oneshot::channel();
        let (taken, taken_rx) = match for_waiter {
            true => {
                let (taken, taken_rx) = oneshot::channel();
                (Some(taken), Some(taken_rx))
            }
            false => (None, None),
        };
        let shared = self.clone();
        let id = task_id.to_owned();
        let work = self.admissions.pending.start();
        runtime::spawn(async move {
            // Dropped last: a late admission nobody takes is let go before `flush` returns.
            let _work = work;
            let counted = AttemptInFlight::new(&shared, &id);
            let (reply, admitted, sent) = {
                // Adopted before the turn ends, so that a release of this task that waits for
                // the turn sees the new handle and leaves the lease to it.
                let _turn = shared.admissions.turns.take(&id).await;
                let (reply, sent) = shared.acquire_in_backend(&id).await;
                let admitted = match &reply {
                    Ok(AcquireReply::Acquired(record)) | Ok(AcquireReply::Held(record)) => {
                        Some(shared.adopt(record, sent))
                    }
                    _ => None,
                };
                (reply, admitted, sent)
            };
            shared.record_backend_result(&reply, sent);
            if let Some(taken_rx) = taken_rx {
                // Usually taken long before the reply; otherwise the waiter is not running.
                let taken = matches!(tokio::time::timeout(TAKE_GRACE, taken_rx).await, Ok(Ok(())));
                if !taken {
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
                Err(e @ Error::BackendUnavailable(_)) => shared.when_down(&id, e),
                Err(e) => Err(e),
            };
            if let Err(Ok(Attempt::Admitted(orphan) | Attempt::AlreadyHeld(orphan))) =
                tx.send(outcome)
            {
                // The caller gave up. A retry of the same task already in flight will come back
                // `held` with this very lease: keep it until that retry has adopted it, then let
                // it go; if nobody shares it, its drop releases it at once. This attempt no longer
                // counts: another orphan of the task must not wait for it, nor it for them.
                drop(counted);
                shared.wait_for_other_attempts(&id).await;
                drop(orphan);
            }
        });
        StartedAttempt::Running { outcome: rx, taken }
    }

    /// The live lease of `task_id` in this process, if any.
    pub(crate) fn lease(&self, task_id: &str) -> Option<Arc<LeaseInner>> {
        live_in(self.admissions.registry(), task_id)
    }

    /// The live lease the backend-down policy granted `task_id` in this process, if any.
    pub(crate) fn local_lease_of(&self, task_id: &str) -> Option<Arc<LeaseInner>> {
        live_in(self.admissions.local(), task_id)
    }

    /// The lease `task_id` holds in this process, from the backend or from the policy, if it is
    /// not over.
    fn held_lease_of(&self, task_id: &str) -> Option<Arc<LeaseInner>> {
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

    /// Admission attempts of `task_id` under way in this process.
    fn attempts_in_flight(&self, task_id: &str) -> usize {
        let attempts = self.admissions.attempts();
        attempts.get(task_id).copied().unwrap_or(0)
    }

    /// Waits, at most [`ORPHAN_GRACE`], until no attempt of `task_id` whose caller still waits is
    /// under way (the caller's own no longer counts): one that comes back `held` adopts the
    /// caller's lease before it is let go.
    async fn wait_for_other_attempts(&self, task_id: &str) {
        let until = Instant::now() + ORPHAN_GRACE;
        while self.attempts_in_flight(task_id) > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Time until the earliest lease expiry the last full reply announced, or the poll interval
    /// when none is known.
    fn until_expiry_or_poll(&self) -> Duration {
        self.waiters
            .until_expiry()
            .unwrap_or(self.config.poll_interval)
    }

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

    /// Reads the cancel markers of the local leases held: a cancel message sent while nothing
    /// listened went unheard, and a local lease learns of a cancel only by message (it is never
    /// renewed). One call per local lease; they exist only around outages.
    fn recheck_local_cancels(self: &Arc<Self>) {
        // Upgraded under the lock, dropped after it: the drop of a lease that is over comes
        // back to this map.
        let held: Vec<Arc<LeaseInner>> = {
            let local = self.admissions.local();
            local.values().filter_map(Weak::upgrade).collect()
        };
        for lease in held.into_iter().filter(|l| !l.is_over()) {
            let shared = self.clone();
            let task_id = lease.task_id.clone();
            // Weak: a lease dropped while its marker is read is released at once.
            let lease = Arc::downgrade(&lease);
            runtime::spawn(async move {
                let marker = shared.backend.cancel_reason(&shared.keys, &task_id).await;
                if let (Ok(Some(reason)), Some(lease)) = (marker, lease.upgrade()) {
                    lease.mark_lost(LostReason::Cancelled(reason));
                }
            });
        }
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

    /// Returns a handle to the lease the backend just reported, sharing the live one of this
    /// process when it is the same admission.
    fn adopt(self: &Arc<Self>, record: &LeaseRecord, sent: Instant) -> Lease {
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
            expired.mark_lost(LostReason::LocalDeadline);
        }
        drop(live);
        if !newer_held {
            self.alarm.renewal_due(inner.renew_due());
        }
        Lease::from_inner(inner)
    }

    /// Subscribes in the background when the subscription is missing: no caller waits on a
    /// subscribe call (on a dead link it takes a whole call timeout, and subscribes of several
    /// quotas go one after another), and a waiter must not sit on a slot a release won for it
    /// while one is out.
    pub(crate) fn listen_in_background(self: &Arc<Self>) {
        if !self.config.events || self.listening.load(Ordering::Acquire) {
            return;
        }
        if self.subscribing.swap(true, Ordering::AcqRel) {
            return;
        }
        let shared = self.clone();
        // Releases announced before the subscription went unheard: once it is in place, every
        // waiter re-checks (`ensure_listening`).
        runtime::spawn(async move {
            shared.ensure_listening().await;
            shared.subscribing.store(false, Ordering::Release);
        });
    }

    /// Like [`listen_in_background`](Self::listen_in_background), but without waiting out the
    /// spacing of attempts after a failed one, which is there for waiters' rounds: for a caller
    /// with its own reason to try now (the backend answers again) or its own spacing.
    fn listen_now(self: &Arc<Self>) {
        *self
            .subscribe_failed_at
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
        self.listen_in_background();
    }

    /// Subscribes once to the quota's events; on failure, waiting falls back to timers and polls
    /// and the next call tries again.
    async fn ensure_listening(self: &Arc<Self>) {
        if !self.config.events || self.listening.load(Ordering::Acquire) {
            return;
        }
        if self.breaker.mode() == BreakerMode::Open {
            // The policy answers at once while the circuit is open; subscribing would wait on
            // the unreachable backend first. A later acquire, or a waiter's next round, subscribes.
            return;
        }
        let failed_at = *self
            .subscribe_failed_at
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if failed_at.is_some_and(|at| at.elapsed() < SUBSCRIBE_RETRY) {
            return;
        }
        let subscribed = self.backend.subscribe(&self.keys).await;
        *self
            .subscribe_failed_at
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = subscribed.is_err().then(Instant::now);
        match subscribed {
            Ok(events) => {
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
            Err(e) => tracing::debug!(quota = %self.keys.name, error = %e,
                "no event subscription yet; waiting relies on timers and polls"),
        }
    }

    /// Feeds the short-circuit with the outcome of a backend call. The first answer after an
    /// outage subscribes at once if the subscription is missing: cancels and releases are heard
    /// again without waiting for a caller's next round.
    pub(crate) fn record_backend_result<T>(self: &Arc<Self>, result: &Result<T>, sent: Instant) {
        match result {
            Err(Error::BackendUnavailable(_)) => self.breaker.failure(sent),
            _ => {
                if self.breaker.success() {
                    self.listen_now();
                }
            }
        }
    }

    /// Answers an admission the backend could not decide, by the quota's policy. A task that
    /// holds a lease in this process gets that lease back whatever the policy: never a second
    /// slot, never `Full`, never an error for a lease it holds.
    fn when_down(self: &Arc<Self>, task_id: &str, down: Error) -> Result<Attempt> {
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
    fn grant_locally(self: &Arc<Self>, task_id: &str, share: u32) -> Attempt {
        // Declared before the lock so that it drops after it: the drop of a lease that is over
        // may come back to this map (`forget`).
        let found: Option<Arc<LeaseInner>>;
        let mut local = self.admissions.local();
        found = local.get(task_id).and_then(Weak::upgrade);
        if let Some(held) = found.as_ref().filter(|l| !l.is_over()) {
            return Attempt::AlreadyHeld(Lease::from_inner(held.clone()));
        }
        let took = self
            .admissions
            .local_held
            // SeqCst: see `listen_while_local_leases_live`.
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
        self.listen_while_local_leases_live();
        Attempt::Admitted(Lease::from_inner(inner))
    }

    /// A local lease hears of a cancel only through the quota's channel, and a process that
    /// holds only local leases makes no backend call that would subscribe again (they are not
    /// renewed). So while any is held, the subscription is retried until it is in place, and
    /// again whenever it drops.
    fn listen_while_local_leases_live(self: &Arc<Self>) {
        // SeqCst on both sides: the grant's increment then swap, and the watcher's store then
        // load, must not both read the old value, or nobody would watch.
        if !self.config.events || self.watching_local.swap(true, Ordering::SeqCst) {
            return;
        }
        let shared = Arc::downgrade(self);
        let stop = self.shutdown.clone();
        runtime::spawn(async move {
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
                // This task's own tick spaces its attempts: the spacing of waiters' attempts
                // after a failure would skip every other tick.
                this.listen_now();
                drop(this);
                tokio::select! {
                    _ = tokio::time::sleep(SUBSCRIBE_RETRY) => {}
                    _ = stop.cancelled() => return,
                }
            }
        });
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

    /// One admission attempt for `task_id` in the backend, made under its turn; returns the
    /// reply and when the attempt was sent.
    ///
    /// A reply `held` with the token of this task's release that got no answer is not handed
    /// out: that release may still reach the backend (from a connection replaced since, whose
    /// bytes a proxy held) and end the lease under its new holder, while another process takes
    /// the slot. The release is sent again, and the attempt made afresh: it gets a new token,
    /// which the late release cannot touch.
    async fn acquire_in_backend(&self, task_id: &str) -> (Result<AcquireReply>, Instant) {
        let attempt = || async {
            let sent = Instant::now();
            let reply = self
                .backend
                .acquire_with_limit(&self.keys, task_id, self.config.ttl, self.config.limit)
                .await;
            (reply, sent)
        };
        let (reply, sent) = attempt().await;
        let Ok(AcquireReply::Held(record)) = &reply else {
            return (reply, sent);
        };
        if !self.admissions.is_release_unanswered(task_id, record.token) {
            return (reply, sent);
        }
        tracing::debug!(quota = %self.keys.name, task_id, token = record.token,
            "an admission whose release got no answer came back held; released again");
        if let Err(e) = self.release_token(task_id, record.token).await {
            return (Err(e), sent);
        }
        attempt().await
    }

    /// The backend call of a token-guarded release, remembering one that got no answer.
    async fn release_token(&self, task_id: &str, token: u64) -> Result<bool> {
        let result = self.backend.release(&self.keys, task_id, Some(token)).await;
        match &result {
            // A lease lives at most a ttl past its last renewal, all sent before this; twice
            // that leaves room for a server clock that runs a little faster than ours.
            Err(Error::BackendUnavailable(_)) => self.admissions.release_unanswered(
                task_id,
                token,
                Instant::now() + 2 * self.config.ttl,
            ),
            _ => self.admissions.release_answered(task_id, token),
        }
        result
    }

    /// Releases `task_id` in the backend (token-guarded unless `None`).
    pub(crate) async fn release_in_backend(
        &self,
        task_id: &str,
        token: Option<u64>,
    ) -> Result<bool> {
        let Some(token) = token else {
            return self.backend.release(&self.keys, task_id, None).await;
        };
        let _turn = self.admissions.turns.take(task_id).await;
        // An acquire of this task that came back `held` while the release waited for its turn
        // handed this very admission to a new handle: the slot is that handle's now.
        if self.lease(task_id).is_some_and(|live| live.token == token) {
            return Ok(false);
        }
        self.release_token(task_id, token).await
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
