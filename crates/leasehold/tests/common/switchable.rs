//! A backend wrapper for tests that need a backend which fails on command.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use leasehold::backend::{
    AcquireReply, LimitUpdate, QuotaEvent, RenewReply, Snapshot, VersionedLimit,
};
use leasehold::{Backend, Error, MemoryBackend, Misconfiguration, QuotaKeys, Result, Unavailable};
use tokio::sync::{broadcast, Notify};

/// The memory backend, with a switch that takes it "down" (every call fails transiently, as an
/// unreachable Redis would), one for renewals only, one that delivers some tasks' acquire
/// answers late (decided at once, answered after [`LATE_ANSWER`]), one that fails them late, one that makes subscribes
/// take that long, one that refuses subscribes, one that holds releases back: they fail as if they timed out,
/// and reach the backend only when the test delivers them, as a proxy that held a replaced
/// connection's bytes would, and delays that make renewals or releases slow (a slow link).
#[derive(Debug, Default)]
pub struct Switchable {
    pub inner: MemoryBackend,
    down: AtomicBool,
    renewals_down: AtomicBool,
    hold_back_releases: AtomicBool,
    /// Releases refused before they are sent (no connection); other calls unaffected.
    pub refuse_releases: AtomicBool,
    held_back: Mutex<Vec<(QuotaKeys, String, Option<u64>)>>,
    answered_late: Mutex<HashSet<String>>,
    failing_late: Mutex<HashSet<String>>,
    slow_subscribe: AtomicBool,
    refuse_subscribe: AtomicBool,
    /// Cancel markers read (`cancel_reason` calls, answered or not).
    pub marker_reads: AtomicU64,
    /// Subscribe calls (answered, refused or failed).
    pub subscribes: AtomicU64,
    /// Notified when an acquire answer that will come late was decided.
    pub decided_late: Notify,
    /// How long each renewal and each release takes, in ms (0: no delay).
    renew_delay_ms: AtomicU64,
    release_delay_ms: AtomicU64,
    /// Notified when a delayed renewal starts.
    pub renewing: Notify,
}

/// How late the answers of [`Switchable::answer_late`] come.
pub const LATE_ANSWER: Duration = Duration::from_millis(150);

impl Switchable {
    fn up(&self) -> Result<()> {
        match self.down.load(Ordering::SeqCst) {
            true => Err(Error::unavailable(
                Unavailable::NoConnection,
                "switched off",
            )),
            false => Ok(()),
        }
    }

    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// Renewals fail while the other calls get through (a holder cut off, others not).
    pub fn set_renewals_down(&self, down: bool) {
        self.renewals_down.store(down, Ordering::SeqCst);
    }

    /// Acquire answers for `task_id` are decided at once and delivered [`LATE_ANSWER`] later
    /// (`None`: none are, from now on).
    pub fn answer_late(&self, task_id: Option<&str>) {
        let mut late = self.answered_late.lock().unwrap();
        match task_id {
            Some(id) => {
                late.insert(id.to_owned());
            }
            None => late.clear(),
        }
    }

    /// Acquires of `task_id` fail transiently [`LATE_ANSWER`] after they were made, changing
    /// nothing (a call that timed out before it reached the backend).
    pub fn fail_late(&self, task_id: &str) {
        self.failing_late.lock().unwrap().insert(task_id.to_owned());
    }

    /// Subscribes take [`LATE_ANSWER`] (a slow link, or one queued behind other subscribes).
    pub fn slow_subscribe(&self, slow: bool) {
        self.slow_subscribe.store(slow, Ordering::SeqCst);
    }

    /// Subscribes are refused as an ACL without the quota's channel would refuse them.
    pub fn refuse_subscribe(&self, refuse: bool) {
        self.refuse_subscribe.store(refuse, Ordering::SeqCst);
    }

    /// Each renewal takes `delay` from now on (its start notifies [`renewing`](Self::renewing)).
    pub fn slow_renewals(&self, delay: Duration) {
        self.renew_delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// Each release takes `delay` from now on.
    pub fn slow_releases(&self, delay: Duration) {
        self.release_delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn hold_back_releases(&self, hold: bool) {
        self.hold_back_releases.store(hold, Ordering::SeqCst);
    }

    /// Delivers the releases held back, in order; returns whether each removed a lease.
    pub async fn deliver_held_back(&self) -> Vec<bool> {
        let held: Vec<_> = std::mem::take(&mut *self.held_back.lock().unwrap());
        let mut removed = Vec::new();
        for (keys, id, token) in held {
            removed.push(self.inner.release(&keys, &id, token).await.unwrap());
        }
        removed
    }
}

#[async_trait]
impl Backend for Switchable {
    async fn acquire_with_limit(
        &self,
        keys: &QuotaKeys,
        id: &str,
        ttl: Duration,
        limit: VersionedLimit,
    ) -> Result<AcquireReply> {
        self.up()?;
        if self.failing_late.lock().unwrap().contains(id) {
            tokio::time::sleep(LATE_ANSWER).await;
            return Err(Error::unavailable(
                Unavailable::NoReply,
                "timed out (failing late)",
            ));
        }
        let answer = self.inner.acquire_with_limit(keys, id, ttl, limit).await;
        if self.answered_late.lock().unwrap().contains(id) {
            self.decided_late.notify_one();
            tokio::time::sleep(LATE_ANSWER).await;
        }
        answer
    }
    async fn renew(
        &self,
        keys: &QuotaKeys,
        ttl: Duration,
        epoch: &str,
        leases: &[(String, u64)],
    ) -> Result<RenewReply> {
        self.up()?;
        if self.renewals_down.load(Ordering::SeqCst) {
            return Err(Error::unavailable(
                Unavailable::NoConnection,
                "renewals switched off",
            ));
        }
        let delay = self.renew_delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            self.renewing.notify_one();
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        self.inner.renew(keys, ttl, epoch, leases).await
    }
    async fn set_limit(
        &self,
        keys: &QuotaKeys,
        limit: u32,
        version: Option<u64>,
    ) -> Result<LimitUpdate> {
        self.up()?;
        self.inner.set_limit(keys, limit, version).await
    }
    async fn release(&self, keys: &QuotaKeys, id: &str, token: Option<u64>) -> Result<bool> {
        self.up()?;
        if self.refuse_releases.load(Ordering::SeqCst) {
            return Err(Error::unavailable(
                Unavailable::NoConnection,
                "releases refused",
            ));
        }
        if self.hold_back_releases.load(Ordering::SeqCst) {
            let call = (keys.clone(), id.to_owned(), token);
            self.held_back.lock().unwrap().push(call);
            return Err(Error::unavailable(
                Unavailable::NoReply,
                "no reply within the call timeout",
            ));
        }
        let delay = self.release_delay_ms.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        self.inner.release(keys, id, token).await
    }
    async fn cancel(
        &self,
        keys: &QuotaKeys,
        id: &str,
        reason: &str,
        ttl: Duration,
    ) -> Result<bool> {
        self.up()?;
        self.inner.cancel(keys, id, reason, ttl).await
    }
    async fn cancel_reason(&self, keys: &QuotaKeys, id: &str) -> Result<Option<String>> {
        self.marker_reads.fetch_add(1, Ordering::SeqCst);
        self.up()?;
        self.inner.cancel_reason(keys, id).await
    }
    async fn snapshot(&self, keys: &QuotaKeys) -> Result<Snapshot> {
        self.up()?;
        self.inner.snapshot(keys).await
    }
    async fn subscribe(&self, keys: &QuotaKeys) -> Result<broadcast::Receiver<QuotaEvent>> {
        self.subscribes.fetch_add(1, Ordering::SeqCst);
        self.up()?;
        if self.slow_subscribe.load(Ordering::SeqCst) {
            tokio::time::sleep(LATE_ANSWER).await;
        }
        if self.refuse_subscribe.load(Ordering::SeqCst) {
            return Err(Misconfiguration::NoPermission(
                "this user has no permissions to access the channel".into(),
            )
            .into());
        }
        self.inner.subscribe(keys).await
    }
}
