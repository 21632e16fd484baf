//! [`Lease`]: a held slot, released when dropped, renewed while it lives.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::backend::LeaseRecord;
use crate::error::{Error, LostReason, Misconfiguration, Result};
use crate::quota::Shared;
use crate::runtime;

/// A held slot of a [`Quota`](crate::Quota).
///
/// While a `Lease` lives, leasehold renews it in the background (one batched call per heartbeat
/// for all leases admitted through one [`Quota`](crate::Quota) handle and its clones). Dropping
/// it releases the slot in the background, shortly after (an acquire right after the drop may
/// still find the slot taken); [`release`](Lease::release) does it now and reports errors.
/// A background release is lost if the process exits before it is sent (returning from `main`
/// ends it), and the slot then stays taken for one ttl. Before exiting, `release().await` every
/// lease, or drop every lease and then await [`Quota::flush`](crate::Quota::flush), in that
/// order: a lease still alive when `flush` runs (a `let _lease = ...` in `main`, leases in a
/// `Vec`) is dropped only after it, at the end of its scope, and its release dies with the
/// process.
/// Clones of a `Lease` (and handles returned by an idempotent re-acquire of the same task id)
/// share one lease: it is released when the last of them is dropped, or at the first explicit
/// `release`. One exception keeps a task's calls in order: a `release` called while an acquire
/// of the same task id is on its way waits for it, and if it comes back `held` with this very
/// lease, leaves the lease to the handle that acquire returned and sends nothing.
///
/// A lease keeps being renewed after every [`Quota`](crate::Quota) handle it came from is
/// dropped, until it is released or dropped itself.
///
/// A lease can be lost while held: await [`lost`](Lease::lost) (or watch
/// [`lost_token`](Lease::lost_token)) beside the protected work and stop when it fires.
#[derive(Clone)]
pub struct Lease {
    inner: Arc<LeaseInner>,
}

pub(crate) struct LeaseInner {
    pub(crate) quota: Arc<Shared>,
    pub(crate) task_id: String,
    pub(crate) token: u64,
    acquired_at_ms: u64,
    times: Mutex<Times>,
    lost: watch::Sender<Option<LostReason>>,
    lost_token: CancellationToken,
    /// Shared with renewals in flight, which may outlive this lease.
    pub(crate) release: Arc<ReleaseState>,
    /// Granted by the backend-down policy, without the backend.
    pub(crate) local: bool,
    /// When the call that admitted it was sent: a later call's answer that the task holds no
    /// lease in the backend is about this admission too.
    admitted_sent: Instant,
}

/// Whether a lease's release was sent. Shared with renewals in flight, which may outlive the
/// lease: a renewal that still finds a released lease in the backend (it got there first, or
/// re-registered the lease after a loss of the backend's state) must release it again.
#[derive(Debug, Default)]
pub(crate) struct ReleaseState {
    /// The release was sent (or is on its way): by `release`, the last drop, or `abandon`.
    sent: AtomicBool,
    /// Left to expire on purpose (`abandon`): nobody releases it.
    abandoned: AtomicBool,
    /// Held, on leasehold's runtime, by the task of a `Lease::release` call while it claims and
    /// sends: a concurrent call of another handle of the admission waits for that send's outcome
    /// instead of returning `Ok` while the slot is still held (found by review), and sends again
    /// if it failed.
    calls: Arc<tokio::sync::Mutex<()>>,
}

impl ReleaseState {
    /// Whether a renewal that found the lease still in the backend must release it.
    pub(crate) fn wants_release(&self) -> bool {
        self.sent.load(Ordering::Acquire) && !self.abandoned.load(Ordering::Acquire)
    }
}

struct Times {
    deadline_ms: u64,
    local_deadline: Instant,
    /// The quota's epoch at this lease's latest admission or renewal: what its next renewal
    /// sends, so that after a loss of the quota's state it re-registers (protocol §8) even when
    /// other leases of this process already learned the new epoch.
    epoch: Arc<str>,
    /// When the call whose reply set `epoch` was sent: renewals may overlap and their replies
    /// come back out of order (on a replaced connection), and the reply of an earlier call must
    /// not move the epoch back.
    epoch_sent: Instant,
    /// When the next renewal of this lease is due: one heartbeat after its acquire was sent,
    /// then one heartbeat after each beat that renewed it. A lease adopted just after a beat
    /// would otherwise wait for the next one, having spent its acquire round trip already.
    renew_due: Instant,
    /// The refusal in the answer to the latest renewal call (by send time) that was answered
    /// or failed, `None` when that call renewed the lease or failed transiently: what the
    /// holder is told if its local deadline passes.
    refusal: Option<Misconfiguration>,
    /// When the call that set `refusal` was sent; an older call's late outcome does not count.
    outcome_sent: Instant,
}

impl Times {
    /// Records the outcome of a renewal call sent at `sent`, unless a later call's is in;
    /// returns whether it did.
    fn outcome(&mut self, sent: Instant, refusal: Option<Misconfiguration>) -> bool {
        let latest = sent >= self.outcome_sent;
        if latest {
            self.outcome_sent = sent;
            self.refusal = refusal;
        }
        latest
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("quota", &self.inner.quota.keys.name)
            .field("task_id", &self.inner.task_id)
            .field("fencing_token", &self.inner.token)
            .field("lost", &self.lost_reason())
            .finish()
    }
}

fn system_time(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

impl LeaseInner {
    /// A lease admitted by an attempt sent at `sent`.
    pub(crate) fn new(quota: Arc<Shared>, record: &LeaseRecord, sent: Instant) -> Self {
        let local_deadline = quota.config.local_deadline(sent);
        let renew_due = sent + quota.config.heartbeat;
        LeaseInner {
            quota,
            task_id: record.task_id.clone(),
            token: record.token,
            acquired_at_ms: record.acquired_at_ms,
            times: Mutex::new(Times {
                deadline_ms: record.deadline_ms,
                local_deadline,
                epoch: record.epoch.as_str().into(),
                epoch_sent: sent,
                renew_due,
                refusal: None,
                outcome_sent: sent,
            }),
            lost: watch::channel(None).0,
            lost_token: CancellationToken::new(),
            release: Arc::default(),
            local: false,
            admitted_sent: sent,
        }
    }

    /// A lease granted without the backend (backend-down policy): token 0, never renewed, never
    /// lost by expiry; its deadline is informational only.
    pub(crate) fn local(quota: Arc<Shared>, task_id: &str) -> Self {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let record = LeaseRecord {
            task_id: task_id.to_owned(),
            token: 0,
            acquired_at_ms: now_ms,
            deadline_ms: now_ms + quota.config.ttl.as_millis() as u64,
            now_ms,
            epoch: String::new(),
        };
        let mut inner = LeaseInner::new(quota, &record, Instant::now());
        inner.local = true;
        inner
            .times
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .local_deadline = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
        inner
    }

    fn times(&self) -> MutexGuard<'_, Times> {
        self.times.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn local_deadline(&self) -> Instant {
        self.times().local_deadline
    }

    /// When the next renewal of this lease is due.
    pub(crate) fn renew_due(&self) -> Instant {
        self.times().renew_due
    }

    /// A beat is renewing this lease; the next one is due at `next`.
    pub(crate) fn renewing(&self, next: Instant) {
        self.times().renew_due = next;
    }

    /// A renewal of this lease failed: the next one is due by `at`, if not sooner.
    pub(crate) fn renew_by(&self, at: Instant) {
        let mut times = self.times();
        times.renew_due = times.renew_due.min(at);
    }

    /// The epoch this lease was last confirmed in.
    pub(crate) fn epoch(&self) -> Arc<str> {
        self.times().epoch.clone()
    }

    /// Whether the call that admitted this lease was sent before `sent`.
    pub(crate) fn admitted_before(&self, sent: Instant) -> bool {
        self.admitted_sent < sent
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.borrow().is_some()
    }

    /// Lost, or past the local deadline even if the renewal task has not noticed yet.
    pub(crate) fn is_over(&self) -> bool {
        self.is_lost() || Instant::now() >= self.local_deadline()
    }

    /// Records an acknowledged renewal (or `held` answer) in `epoch` of a call sent at `sent`,
    /// which grants the holder up to `local` (`sent` + the ttl it sent − margin). A lease already
    /// past its local deadline is not extended: it was reported lost, or is about to be, and
    /// stays so. Returns whether it extended the lease.
    pub(crate) fn renewed(
        &self,
        deadline_ms: u64,
        sent: Instant,
        local: Instant,
        epoch: &str,
    ) -> bool {
        let mut times = self.times();
        if Instant::now() >= times.local_deadline {
            return false;
        }
        times.deadline_ms = times.deadline_ms.max(deadline_ms);
        times.local_deadline = times.local_deadline.max(local);
        times.outcome(sent, None);
        if sent >= times.epoch_sent {
            times.epoch_sent = sent;
            if *times.epoch != *epoch {
                times.epoch = epoch.into();
            }
        }
        true
    }

    /// A renewal call sent at `sent` failed: `refusal` is what the backend refused it for, or
    /// `None` for a transient failure (an outage, a timeout). Returns whether it is the latest
    /// outcome (no later call's is in). Past the local deadline nothing is recorded, as for a
    /// late success (`renewed`): the reason the lease ended with stays what it was then.
    pub(crate) fn renewal_failed(&self, sent: Instant, refusal: Option<Misconfiguration>) -> bool {
        let mut times = self.times();
        if Instant::now() >= times.local_deadline {
            return false;
        }
        times.outcome(sent, refusal)
    }

    /// Marks the lease lost at its local deadline, with [`local_deadline_reason`].
    ///
    /// [`local_deadline_reason`]: Self::local_deadline_reason
    pub(crate) fn mark_past_local_deadline(&self) {
        self.mark_lost(self.local_deadline_reason());
    }

    /// Why the lease ends at its local deadline: the latest renewal's refusal, if it was
    /// refused, else no renewal confirmed in time.
    pub(crate) fn local_deadline_reason(&self) -> LostReason {
        match &self.times().refusal {
            Some(refusal) => LostReason::RenewalRefused(refusal.clone()),
            None => LostReason::LocalDeadline,
        }
    }

    /// Marks the lease lost (first reason wins); returns whether this call marked it.
    pub(crate) fn mark_lost(&self, reason: LostReason) -> bool {
        let marked = self.lost.send_if_modified(|current| {
            if current.is_some() {
                return false;
            }
            *current = Some(reason.clone());
            true
        });
        if marked {
            if reason != LostReason::Released {
                tracing::warn!(quota = %self.quota.keys.name, task_id = %self.task_id,
                    token = self.token, %reason, "lease lost");
            }
            self.lost_token.cancel();
            self.quota.forget(self);
        }
        marked
    }

    /// Marks the lease released and says whether the backend still needs a release call: once,
    /// and only while the backend may still hold it (not after it was found gone there).
    pub(crate) fn claim_release(&self) -> bool {
        self.mark_lost(LostReason::Released);
        if self.local {
            if !self.release.sent.swap(true, Ordering::AcqRel) {
                self.quota.local_released();
            }
            return false;
        }
        // A release message is not checked against the backend (anyone allowed to publish on
        // the channel can send one), so the lease may still be there after `ReleasedElsewhere`:
        // the token-guarded release costs one call and can free nothing but this admission.
        let may_be_held = matches!(
            *self.lost.borrow(),
            Some(
                LostReason::Released
                    | LostReason::LocalDeadline
                    | LostReason::RenewalRefused(_)
                    | LostReason::Cancelled(_)
                    | LostReason::ReleasedElsewhere
            )
        );
        // Whether another handle of this same admission owns the slot now is settled when the
        // release gets its task's turn (`Shared::release_in_backend`).
        may_be_held && !self.release.sent.swap(true, Ordering::AcqRel)
    }

    /// A release call failed: a later `release` may try again.
    pub(crate) fn release_failed(&self) {
        self.release.sent.store(false, Ordering::Release);
    }
}

impl Drop for LeaseInner {
    fn drop(&mut self) {
        // Counted before the claim, which wakes `lost()`: a watcher that hears it and flushes
        // at once must find the release counted (found by review). Only when a release may be
        // sent: not for a local lease, nor in the usual drop after `release` (this is the last
        // handle, so nothing else can send it meanwhile).
        let work = (!self.local && !self.release.sent.load(Ordering::Acquire))
            .then(|| self.quota.admissions.pending.start());
        if self.claim_release() {
            let quota = self.quota.clone();
            let task_id = std::mem::take(&mut self.task_id);
            let token = self.token;
            runtime::spawn(async move {
                let _work = work;
                if let Err(e) = quota.release_in_backend(&task_id, Some(token)).await {
                    tracing::warn!(quota = %quota.keys.name, %task_id, token, error = %e,
                        "background release failed; the lease will expire after its ttl");
                }
            });
        }
    }
}

impl Lease {
    pub(crate) fn from_inner(inner: Arc<LeaseInner>) -> Self {
        Lease { inner }
    }

    /// The task id this lease is held for.
    pub fn task_id(&self) -> &str {
        &self.inner.task_id
    }

    /// The fencing token of this admission: it increases with every admission in the quota, so
    /// a resource that can check it may reject a stale holder. Tokens are kept in Redis: if Redis
    /// loses the quota's keys (a restart without persistence), they go on, after a quarantine of
    /// one ttl, from the highest token that a surviving process has seen (it re-registers its
    /// leases, and its first call after the loss raises the counter), or from 1 if no process
    /// that saw one, and still has a handle of the quota, calls during the quarantine
    /// (docs/PROTOCOL.md §8): a resource that keeps tokens across such a loss cannot rely on
    /// them alone.
    pub fn fencing_token(&self) -> u64 {
        self.inner.token
    }

    /// The name of the quota this lease belongs to.
    pub fn quota_name(&self) -> &str {
        &self.inner.quota.keys.name
    }

    /// When the lease was admitted, by the backend's clock.
    pub fn acquired_at(&self) -> SystemTime {
        system_time(self.inner.acquired_at_ms)
    }

    /// The deadline last acknowledged by the backend, by the backend's clock: the slot is
    /// reclaimed then unless renewed.
    pub fn deadline(&self) -> SystemTime {
        system_time(self.inner.times().deadline_ms)
    }

    /// The holder's own monotonic deadline: last acknowledged renewal (or admission) + ttl in
    /// whole ms − 1 ms − safety margin, measured from when that call was sent. The lease is
    /// reported lost at this instant if no renewal is acknowledged before it.
    pub fn local_deadline(&self) -> Instant {
        self.inner.local_deadline()
    }

    /// Why the lease is no longer held, or `None` while it is.
    pub fn lost_reason(&self) -> Option<LostReason> {
        self.inner.lost.borrow().clone()
    }

    /// True for a lease granted by the quota's
    /// [`BackendDownPolicy`](crate::BackendDownPolicy) while the backend could not answer: it
    /// counts only in this process, is not renewed and has fencing token 0.
    pub fn is_local(&self) -> bool {
        self.inner.local
    }

    /// True while the lease is held as far as this process knows: not lost, and its local
    /// deadline not passed.
    pub fn is_held(&self) -> bool {
        !self.inner.is_over()
    }

    /// Resolves when the lease is no longer held, with the reason. Resolves at once if it is
    /// already lost.
    ///
    /// A clone of the lease moved into a task that awaits `lost()` keeps the lease held (it is
    /// released when its last clone goes): to watch a lease from another task without holding
    /// it, give that task [`Lease::lost_token`] instead.
    ///
    /// ```no_run
    /// # async fn work() {}
    /// # async fn example(lease: leasehold::Lease) {
    /// tokio::select! {
    ///     _ = work() => {}
    ///     reason = lease.lost() => eprintln!("stopping: {reason}"),
    /// }
    /// # }
    /// ```
    pub async fn lost(&self) -> LostReason {
        let mut rx = self.inner.lost.subscribe();
        let result = rx.wait_for(Option::is_some).await;
        match result {
            Ok(reason) => reason.clone().unwrap_or(LostReason::Released),
            // The sender lives in `inner`, which `self` keeps alive.
            Err(_) => LostReason::Released,
        }
    }

    /// A token cancelled when the lease is lost, for code that already speaks
    /// `tokio_util::sync::CancellationToken`.
    pub fn lost_token(&self) -> CancellationToken {
        self.inner.lost_token.clone()
    }

    /// Fails with [`Error::LeaseLost`] if the lease is no longer held. Call it before an
    /// irreversible step; it reads local state only.
    pub fn ensure_held(&self) -> Result<()> {
        match self.lost_reason() {
            Some(reason) => Err(Error::LeaseLost(reason)),
            None if self.inner.is_over() => {
                Err(Error::LeaseLost(self.inner.local_deadline_reason()))
            }
            None => Ok(()),
        }
    }

    /// Stops renewing the lease without releasing it, as a crashed holder would: the slot stays
    /// taken until its deadline passes, then any acquire reclaims it. For fault-injection tests
    /// and demonstrations; [`lost`](Self::lost) resolves with [`LostReason::Released`].
    pub fn abandon(self) {
        if self.inner.local {
            // Nothing in the backend to leave behind; only the local count.
            self.inner.claim_release();
            return;
        }
        self.inner.release.abandoned.store(true, Ordering::Release);
        self.inner.release.sent.store(true, Ordering::Release);
        self.inner.mark_lost(LostReason::Released);
    }

    /// Releases the slot now. Idempotent: a second call does nothing and succeeds. After a loss
    /// it still sends the release when the backend may hold the lease (its local deadline passed,
    /// it was cancelled, or a release message said it was released elsewhere, which the backend
    /// did not confirm), and does nothing otherwise. When it sends, a failure of that call is
    /// returned (and a later `release` may try again). The backend only removes the lease while
    /// it still carries this fencing token, so a late release can never free someone else's slot.
    ///
    /// From the call on, the lease is no longer held for this process: [`is_held`](Self::is_held)
    /// says false and [`lost`](Self::lost) resolves ([`LostReason::Released`], unless it was lost
    /// before). A release that fails leaves it so, and the lease is not renewed: the backend
    /// frees the slot at its deadline, one ttl at most, unless a later `release` gets through.
    ///
    /// Calls through several handles of one lease (clones) go one after another: a call made
    /// while another one's release is on its way returns once that one is answered (and sends
    /// again if it failed). A call whose caller stops waiting (a timeout, a `select!`) leaves its
    /// release to finish in the background, and a concurrent call still waits for it.
    pub async fn release(&self) -> Result<()> {
        // Everything below runs on leasehold's runtime, the wait for the lock included: a
        // caller's future parked while it waits holds no place in the lock's queue, and a caller
        // that gives up cannot cancel the send half-way (found by review, twice: a caller that
        // gave up let a concurrent call return `Ok` with the slot held, and a parked future kept
        // the lock for good). Counted before the spawn, so that a `flush` right after this call
        // sees it, and before the claim, which wakes `lost()`.
        let work = self.inner.quota.admissions.pending.start();
        // The holder's view changes now, as the call is made, not when the task gets the lock
        // (found by review: `is_held()` still said true after a `release()` polled once and
        // dropped). A loss already told keeps its reason, which the claim below reads.
        self.inner.mark_lost(LostReason::Released);
        let inner = self.inner.clone();
        runtime::finish(async move {
            let _work = work;
            // Declared after `_work`, so dropped before it: if this is the last handle, its drop
            // (which sends a failed release again) is counted before `_work` goes.
            let inner = inner;
            let _one_at_a_time = inner.release.calls.clone().lock_owned().await;
            if !inner.claim_release() {
                return Ok(());
            }
            let result = inner
                .quota
                .release_in_backend(&inner.task_id, Some(inner.token))
                .await;
            if result.is_err() {
                inner.release_failed();
            }
            result.map(|_| ())
        })
        .await
    }
}
