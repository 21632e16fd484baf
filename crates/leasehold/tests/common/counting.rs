//! A backend wrapper that counts the acquire answers "full" per task id, so that a test can wait
//! (bounded) until a waiter was refused and is in line, on either backend, the admission
//! attempts and the renew calls;
//! and that can be taken "down", on either backend.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold::backend::{
    AcquireReply, LimitUpdate, QuotaEvent, RenewReply, Snapshot, VersionedLimit,
};
use leasehold::{Backend, Error, QuotaKeys, Result, Unavailable};
use tokio::sync::broadcast;

/// Delegates every call to `inner`, including its [`Backend::identity`]: handles built on this
/// share what the process knows of the quota with handles built on `inner`, exactly as before.
#[derive(Debug)]
pub struct Counting {
    inner: Arc<dyn Backend>,
    refused: Mutex<HashMap<String, u64>>,
    renewals: AtomicU64,
    attempts: AtomicU64,
    down: AtomicBool,
}

impl Counting {
    pub fn new(inner: Arc<dyn Backend>) -> Arc<Counting> {
        Arc::new(Counting {
            inner,
            refused: Mutex::default(),
            renewals: AtomicU64::new(0),
            attempts: AtomicU64::new(0),
            down: AtomicBool::new(false),
        })
    }

    /// While down, acquires, renewals and releases fail `BackendUnavailable` with no reply (the
    /// outcome unknown, as a Redis that stopped answering leaves it: a release may land late);
    /// the other calls still go through.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    fn up(&self) -> Result<()> {
        match self.down.load(Ordering::SeqCst) {
            true => Err(Error::unavailable(Unavailable::NoReply, "switched off")),
            false => Ok(()),
        }
    }

    /// How many renew calls went to the backend (answered or not).
    pub fn renewals(&self) -> u64 {
        self.renewals.load(Ordering::SeqCst)
    }

    /// How many admission attempts (one per task id) went to the backend.
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::SeqCst)
    }

    /// How many acquires of `task_id` the backend answered "full".
    pub fn refused(&self, task_id: &str) -> u64 {
        self.refused
            .lock()
            .unwrap()
            .get(task_id)
            .copied()
            .unwrap_or(0)
    }

    /// Waits until each of `task_ids` was answered "full" at least once, or `within` passes;
    /// returns whether they all were.
    pub async fn all_refused(&self, task_ids: &[&str], within: Duration) -> bool {
        super::eventually(within, || task_ids.iter().all(|id| self.refused(id) > 0)).await
    }
}

#[async_trait]
impl Backend for Counting {
    async fn acquire_with_limit(
        &self,
        keys: &QuotaKeys,
        id: &str,
        ttl: Duration,
        limit: VersionedLimit,
    ) -> Result<AcquireReply> {
        self.up()?;
        self.attempts.fetch_add(1, Ordering::SeqCst);
        let answer = self.inner.acquire_with_limit(keys, id, ttl, limit).await;
        if let Ok(AcquireReply::Full { .. }) = answer {
            *self
                .refused
                .lock()
                .unwrap()
                .entry(id.to_owned())
                .or_default() += 1;
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
        self.renewals.fetch_add(1, Ordering::SeqCst);
        self.up()?;
        self.inner.renew(keys, ttl, epoch, leases).await
    }
    async fn set_limit(
        &self,
        keys: &QuotaKeys,
        limit: u32,
        version: Option<u64>,
    ) -> Result<LimitUpdate> {
        self.inner.set_limit(keys, limit, version).await
    }
    async fn release(&self, keys: &QuotaKeys, id: &str, token: Option<u64>) -> Result<bool> {
        self.up()?;
        self.inner.release(keys, id, token).await
    }
    async fn cancel(
        &self,
        keys: &QuotaKeys,
        id: &str,
        reason: &str,
        ttl: Duration,
    ) -> Result<bool> {
        self.inner.cancel(keys, id, reason, ttl).await
    }
    async fn cancel_reason(&self, keys: &QuotaKeys, id: &str) -> Result<Option<String>> {
        self.inner.cancel_reason(keys, id).await
    }
    async fn snapshot(&self, keys: &QuotaKeys) -> Result<Snapshot> {
        self.inner.snapshot(keys).await
    }
    async fn subscribe(&self, keys: &QuotaKeys) -> Result<broadcast::Receiver<QuotaEvent>> {
        self.inner.subscribe(keys).await
    }
    fn forget(&self, keys: &QuotaKeys) {
        self.inner.forget(keys)
    }
    fn identity(&self) -> usize {
        self.inner.identity()
    }
}
