//! [`Quota`]: a handle to one named, fleet-wide concurrency quota.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::Rng;
use tokio::sync::{oneshot, Notify};

use crate::backend::{AcquireReply, Backend, LeaseRecord};
use crate::config::{QuotaBuilder, QuotaConfig};
use crate::error::{Error, Result};
use crate::keys::{validate_task_id, QuotaKeys};
use crate::lease::{Lease, LeaseInner};
use crate::waiters::WaitQueue;
use crate::{heartbeat, runtime};

/// A handle to one named quota: at most `limit` leases held at once across every process that
/// uses the same quota name on the same backend.
///
/// Cheap to clone; clones share the renewal task, the waiter queue and the event subscription.
/// One per quota and process is the normal use.
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
    /// Live leases of this quota in this process, by task id.
    registry: Mutex<HashMap<String, Weak<LeaseInner>>>,
    /// Signalled when a lease joins the registry, so the renewal task re-plans.
    pub(crate) registry_changed: Arc<Notify>,
    waiters: WaitQueue,
    listening: AtomicBool,
}

/// One holder in a [`Status`].
#[derive(Debug, Clone, PartialEq, Eq)]
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
pub struct Status {
    /// The quota's name.
    pub quota: String,
    /// The limit configured on this handle.
    pub limit: u32,
    /// The backend's time of the snapshot.
    pub now: SystemTime,
    /// The live leases, earliest deadline first.
    pub holders: Vec<Holder>,
}

impl Status {
    /// Slots free right now (0 when over-full, which only a lower limit on this handle shows).
    pub fn free(&self) -> u32 {
        self.limit.saturating_sub(self.holders.len() as u32)
    }
}

fn system_time(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// What one admission attempt produced.
enum Attempt {
    Admitted(Lease),
    Full { retry_after: Duration },
}

impl Quota {
    /// Starts building a quota named `name`. Names may hold any printable characters except
    /// braces, up to 256 bytes.
    pub fn builder(name: impl Into<String>) -> QuotaBuilder {
        QuotaBuilder::new(name)
    }

    pub(crate) fn start(keys: QuotaKeys, config: QuotaConfig, backend: Arc<dyn Backend>) -> Quota {
        let shared = Arc::new(Shared {
            keys,
            config,
            backend,
            registry: Mutex::new(HashMap::new()),
            registry_changed: Arc::new(Notify::new()),
            waiters: WaitQueue::default(),
            listening: AtomicBool::new(false),
        });
        heartbeat::start(&shared);
        Quota { shared }
    }

    /// The quota's name.
    pub fn name(&self) -> &str {
        &self.shared.keys.name
    }

    /// The limit this handle admits up to.
    pub fn limit(&self) -> u32 {
        self.shared.config.limit
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
        self.ensure_listening().await;
        match self.attempt(task_id).await? {
            Attempt::Admitted(lease) => Ok(lease),
            Attempt::Full { .. } => Err(self.full()),
        }
    }

    /// Waits for a slot as long as it takes. Waiters in one process are served in arrival order;
    /// they are woken by release events, by a timer to the earliest lease deadline, and by a
    /// bounded, jittered poll in case an event was lost.
    pub async fn acquire(&self, task_id: &str) -> Result<Lease> {
        validate_task_id(task_id)?;
        self.ensure_listening().await;
        self.wait_for_slot(task_id).await
    }

    /// Like [`acquire`](Self::acquire), but gives up after `timeout` with [`Error::TimedOut`].
    /// An attempt still in flight at that moment is not lost: if its late reply admits the task,
    /// the slot is released in the background.
    pub async fn acquire_timeout(&self, task_id: &str, timeout: Duration) -> Result<Lease> {
        validate_task_id(task_id)?;
        match tokio::time::timeout(timeout, async {
            self.ensure_listening().await;
            self.wait_for_slot(task_id).await
        })
        .await
        {
            Ok(result) => result,
            Err(_) => Err(Error::TimedOut {
                quota: self.name().to_owned(),
                waited: timeout,
            }),
        }
    }

    /// The live leases of the quota, fleet-wide, with this handle's limit.
    pub async fn status(&self) -> Result<Status> {
        let snapshot = self.shared.backend.snapshot(&self.shared.keys).await?;
        Ok(Status {
            quota: self.name().to_owned(),
            limit: self.limit(),
            now: system_time(snapshot.now_ms),
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
    /// Its holder learns it on its next renewal (or at once, through the release event) with
    /// [`LostReason::ReleasedElsewhere`](crate::LostReason::ReleasedElsewhere). Returns whether
    /// a lease was removed.
    pub async fn force_release(&self, task_id: &str) -> Result<bool> {
        validate_task_id(task_id)?;
        self.shared.release_in_backend(task_id, None).await
    }

    /// Cancels `task_id`, wherever it runs: writes the cancel marker (the truth, kept for the
    /// quota's [cancel marker ttl](crate::QuotaBuilder::cancel_marker_ttl)), then announces it.
    /// The holder's [`Lease::lost`] fires with
    /// [`LostReason::Cancelled`](crate::LostReason::Cancelled) as soon as the message arrives, or
    /// at its next renewal if the message was lost; an acquire of a cancelled id fails with
    /// [`Error::Cancelled`]. What the holder does then is its own choice.
    ///
    /// Returns whether the task held a lease; cancelling a task that holds none is not an error
    /// (it may be queued, or not started yet).
    pub async fn cancel(&self, task_id: &str, reason: &str) -> Result<bool> {
        validate_task_id(task_id)?;
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

    fn full(&self) -> Error {
        Error::Full {
            quota: self.name().to_owned(),
            limit: self.limit(),
        }
    }

    async fn wait_for_slot(&self, task_id: &str) -> Result<Lease> {
        let shared = &self.shared;
        // Only a newcomer to an empty queue (or a task that already holds) may try at once;
        // otherwise it would overtake older waiters.
        if shared.waiters.is_empty() || shared.holds(task_id) {
            if let Attempt::Admitted(lease) = self.attempt(task_id).await? {
                return Ok(lease);
            }
        }
        let place = shared.waiters.join();
        let mut retry_after = Duration::ZERO;
        loop {
            let sleep = if place.is_head() {
                self.jitter(shared.config.poll_interval).min(retry_after)
            } else {
                // Not first in line: the head watches expiries; poll rarely, as a safety net.
                self.jitter(shared.config.poll_interval * 4)
            };
            let asked = tokio::select! {
                asked = place.woken() => asked,
                _ = tokio::time::sleep(sleep) => { place.attempting(); true }
            };
            if !asked {
                // Promoted to head: re-plan the timer before sleeping again.
                retry_after = Duration::ZERO;
                continue;
            }
            match self.attempt(task_id).await? {
                Attempt::Admitted(lease) => return Ok(lease),
                Attempt::Full { retry_after: r } => {
                    retry_after = r;
                    place.idle();
                }
            }
        }
    }

    /// A duration uniformly jittered between half and one and a half of `base`.
    fn jitter(&self, base: Duration) -> Duration {
        base.mul_f64(rand::rng().random_range(0.5..1.5))
    }

    /// One admission attempt, run to completion on the leasehold runtime even if the caller stops
    /// waiting: a late admission nobody takes is released at once.
    async fn attempt(&self, task_id: &str) -> Result<Attempt> {
        let (tx, rx) = oneshot::channel();
        let shared = self.shared.clone();
        let id = task_id.to_owned();
        runtime::spawn(async move {
            let sent = Instant::now();
            let reply = shared
                .backend
                .acquire(&shared.keys, &id, shared.config.ttl, shared.config.limit)
                .await;
            let outcome = match reply {
                Ok(AcquireReply::Acquired(record)) | Ok(AcquireReply::Held(record)) => {
                    Ok(Attempt::Admitted(shared.adopt(&record, sent)))
                }
                Ok(AcquireReply::Full {
                    now_ms,
                    earliest_deadline_ms,
                }) => Ok(Attempt::Full {
                    // The first expiry in server time, plus 1 ms so the reap sees it passed.
                    retry_after: Duration::from_millis(
                        earliest_deadline_ms.saturating_sub(now_ms) + 1,
                    ),
                }),
                Ok(AcquireReply::Cancelled { reason }) => Err(Error::Cancelled(reason)),
                Err(e) => Err(e),
            };
            // If the caller gave up, the unsent lease drops here and releases itself.
            let _ = tx.send(outcome);
        });
        rx.await.unwrap_or_else(|_| {
            Err(Error::BackendUnavailable(
                "leasehold runtime stopped during an attempt".into(),
            ))
        })
    }

    /// Subscribes once to the quota's events; on failure, waiting falls back to timers and polls
    /// and the next call tries again.
    async fn ensure_listening(&self) {
        if !self.shared.config.events || self.shared.listening.load(Ordering::Acquire) {
            return;
        }
        match self.shared.backend.subscribe(&self.shared.keys).await {
            Ok(events) => {
                if !self.shared.listening.swap(true, Ordering::AcqRel) {
                    runtime::spawn(crate::events::listen(Arc::downgrade(&self.shared), events));
                }
            }
            Err(e) => tracing::debug!(quota = %self.name(), error = %e,
                "no event subscription yet; waiting relies on timers and polls"),
        }
    }
}

impl Shared {
    /// True when `task_id` holds a live lease in this process.
    fn holds(&self, task_id: &str) -> bool {
        self.lease(task_id).is_some()
    }

    /// The live lease of `task_id` in this process, if any.
    pub(crate) fn lease(&self, task_id: &str) -> Option<Arc<LeaseInner>> {
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        registry
            .get(task_id)
            .and_then(Weak::upgrade)
            .filter(|l| !l.is_lost())
    }

    /// The live leases in this process.
    pub(crate) fn leases(&self) -> Vec<Arc<LeaseInner>> {
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        registry
            .values()
            .filter_map(Weak::upgrade)
            .filter(|l| !l.is_lost())
            .collect()
    }

    /// Wakes one waiter: a slot may have freed.
    pub(crate) fn slot_freed(&self) {
        self.waiters.wake_one();
    }

    /// Wakes every waiter: events may have been missed.
    pub(crate) fn recheck_all(&self) {
        self.waiters.wake_all();
    }

    /// Returns a handle to the lease the backend just reported, sharing the live one of this
    /// process when it is the same admission.
    fn adopt(self: &Arc<Self>, record: &LeaseRecord, sent: Instant) -> Lease {
        let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(live) = registry.get(&record.task_id).and_then(Weak::upgrade) {
            if live.token == record.token && !live.is_lost() {
                live.renewed(record.deadline_ms, sent);
                return Lease::from_inner(live);
            }
        }
        let inner = Arc::new(LeaseInner::new(self.clone(), record, sent));
        registry.insert(record.task_id.clone(), Arc::downgrade(&inner));
        drop(registry);
        self.registry_changed.notify_one();
        Lease::from_inner(inner)
    }

    /// Removes `lease` from the registry if it is the entry for its task id.
    pub(crate) fn forget(&self, lease: &LeaseInner) {
        let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if registry
            .get(&lease.task_id)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), lease))
        {
            registry.remove(&lease.task_id);
        }
    }

    /// Releases `task_id` in the backend (token-guarded unless `None`).
    pub(crate) async fn release_in_backend(
        &self,
        task_id: &str,
        token: Option<u64>,
    ) -> Result<bool> {
        self.backend.release(&self.keys, task_id, token).await
    }
}
