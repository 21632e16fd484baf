//! What `RedisBackend` keeps per quota name (the epoch seen, the batching queues) goes with the
//! quota's last handle in this process, and only then: not with an unheard channel while a
//! handle still lives, and not under a handle of the same name started meanwhile. The state is
//! private, so these are unit tests against a private redis-server.

use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_testkit::RedisServer;
use tokio::sync::broadcast;

use super::RedisBackend;
use crate::backend::{
    AcquireReply, Backend, LimitUpdate, QuotaEvent, RenewReply, Snapshot, VersionedLimit,
};
use crate::{Quota, QuotaKeys, Result};

/// A quota of limit 1, ttl 10 s, with or without events, on `backend`.
fn quota(name: &str, events: bool, backend: Arc<dyn Backend>) -> Quota {
    Quota::builder(name)
        .limit(1)
        .ttl(Duration::from_secs(10))
        .events(events)
        .shared_backend(backend)
        .build()
        .unwrap()
}

/// A backend whose first `forget` is held until the test lets it go, as if the
/// thread that dropped the last handle were descheduled between the `Arc`'s count reaching
/// zero and `Drop for Admissions` calling `forget`.
#[derive(Debug)]
struct HeldForget {
    inner: RedisBackend,
    entered: Mutex<Option<mpsc::Sender<()>>>,
    go: Mutex<Option<mpsc::Receiver<()>>>,
}

impl HeldForget {
    /// Held once, on the thread that drops the last handle, at its first call.
    fn hold(&self) {
        if std::thread::current().name() != Some("dropper") {
            return;
        }
        if let Some(entered) = self.entered.lock().unwrap().take() {
            entered.send(()).unwrap();
            let go = self.go.lock().unwrap().take().unwrap();
            let _ = go.recv_timeout(Duration::from_secs(10));
        }
    }
}

#[async_trait]
impl Backend for HeldForget {
    async fn acquire_with_limit(
        &self,
        keys: &QuotaKeys,
        task_id: &str,
        ttl: Duration,
        limit: VersionedLimit,
    ) -> Result<AcquireReply> {
        self.inner
            .acquire_with_limit(keys, task_id, ttl, limit)
            .await
    }
    async fn renew(
        &self,
        keys: &QuotaKeys,
        ttl: Duration,
        epoch: &str,
        leases: &[(String, u64)],
    ) -> Result<RenewReply> {
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
    async fn release(&self, keys: &QuotaKeys, task_id: &str, token: Option<u64>) -> Result<bool> {
        self.inner.release(keys, task_id, token).await
    }
    async fn cancel(
        &self,
        keys: &QuotaKeys,
        task_id: &str,
        reason: &str,
        marker_ttl: Duration,
    ) -> Result<bool> {
        self.inner.cancel(keys, task_id, reason, marker_ttl).await
    }
    async fn cancel_reason(&self, keys: &QuotaKeys, task_id: &str) -> Result<Option<String>> {
        self.inner.cancel_reason(keys, task_id).await
    }
    async fn snapshot(&self, keys: &QuotaKeys) -> Result<Snapshot> {
        self.inner.snapshot(keys).await
    }
    async fn subscribe(&self, keys: &QuotaKeys) -> Result<broadcast::Receiver<QuotaEvent>> {
        self.inner.subscribe(keys).await
    }
    fn forget(&self, keys: &QuotaKeys) {
        self.hold();
        Backend::forget(&self.inner, keys);
    }
    fn identity(&self) -> usize {
        self.hold();
        Backend::identity(&self.inner)
    }
}

/// The last handle of a quota drops while a new handle of the same quota starts: the old
/// handle's `forget` must not take the new one's state (its epoch) with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_forget_does_not_wipe_a_new_handles_epoch() {
    let server = RedisServer::start();
    let redis = RedisBackend::connect(&server.url()).await.unwrap();
    let (entered_tx, entered) = mpsc::channel();
    let (go, go_rx) = mpsc::channel();
    let backend: Arc<dyn Backend> = Arc::new(HeldForget {
        inner: redis.clone(),
        entered: Mutex::new(Some(entered_tx)),
        go: Mutex::new(Some(go_rx)),
    });
    let build = || quota("q", false, backend.clone());
    let old = build();
    old.try_acquire("x").await.unwrap().release().await.unwrap();
    // Background tasks let go; then the last handle goes on another thread, descheduled just
    // before `forget` runs.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let dropper = std::thread::Builder::new()
        .name("dropper".into())
        .spawn(move || drop(old))
        .unwrap();
    entered.recv_timeout(Duration::from_secs(5)).unwrap();
    // Meanwhile a new handle of the same quota starts and takes a lease.
    let new = build();
    let a = new.try_acquire("a").await.unwrap();
    let seen = |r: &RedisBackend| r.inner.epochs.lock().unwrap().contains_key("q");
    assert!(seen(&redis));
    go.send(()).unwrap();
    dropper.join().unwrap();
    let kept = seen(&redis);
    // What it costs: the server loses its data (a restart without persistence). The new
    // handle knows the epoch `a` was admitted in, so its next acquire should be quarantined
    // (PROTOCOL §8) until `a` re-registers; with the epoch forgotten it is admitted next to
    // `a`, whose holder still runs: two holders of a quota of one.
    server.command(&["FLUSHALL"]);
    let b = new.try_acquire("b").await;
    assert!(
        kept,
        "the old handle's forget wiped the epoch of a live handle that holds {a:?}; \
         after a data loss its acquire of b returned {b:?}"
    );
}

/// A channel nobody listens to any more does not mean a quota nobody uses: another live
/// handle of the quota (events off, or not waiting yet) may share it, and keeps its state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unheard_channel_does_not_wipe_a_live_handles_epoch() {
    let server = RedisServer::start();
    let redis = RedisBackend::connect(&server.url()).await.unwrap();
    let build = |name: &str, events: bool| quota(name, events, Arc::new(redis.clone()));
    let b = build("x", false);
    let a = build("x", true);
    let h = a.try_acquire("h").await.unwrap();
    let _ = a.acquire_timeout("w", Duration::from_millis(300)).await; // a subscribes
    h.release().await.unwrap();
    drop(h);
    let held = b.try_acquire("held").await.unwrap();
    drop(a); // its listener goes: nobody hears channel x, but b lives and holds a lease
    tokio::time::sleep(Duration::from_millis(100)).await;
    let y = build("y", true);
    let y1 = y.try_acquire("y1").await.unwrap();
    let _ = y.acquire_timeout("y2", Duration::from_millis(300)).await; // y subscribes
    drop(y1);
    let kept = redis.inner.epochs.lock().unwrap().contains_key("x");
    server.command(&["FLUSHALL"]);
    let other = b.try_acquire("other").await;
    assert!(
        kept,
        "x's epoch was forgotten while b holds {held:?}; after a data loss: {other:?}"
    );
}

/// Quotas that never subscribe (events off) still let go of their per-name state when their
/// last handle goes: quota names that come and go do not pile up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_handle_of_a_quota_takes_its_per_name_state_with_it() {
    let server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let names = |backend: &RedisBackend| {
        let inner = &backend.inner;
        (
            inner.epochs.lock().unwrap().len(),
            inner.acquires.lock().unwrap().len(),
            inner.releases.lock().unwrap().len(),
        )
    };
    let kept = quota("kept", false, Arc::new(backend.clone()));
    kept.try_acquire("k")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    for i in 0..30 {
        let quota = quota(&format!("tenant-{i}"), false, Arc::new(backend.clone()));
        quota
            .try_acquire("t")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        let twin = quota.clone();
        drop(quota);
        assert_eq!(names(&backend).0, 2, "a clone still holds tenant-{i}");
        drop(twin);
    }
    // Only the quota still held keeps its state (its epoch, and its queues).
    assert_eq!(names(&backend), (1, 1, 1));
}

/// A long-lived handle beside short-lived ones built with a ttl per job: the admission queues of
/// settings no call uses any more go, instead of one per distinct ttl for the process's life
/// (found by review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_queues_of_settings_no_call_uses_do_not_pile_up() {
    let server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let keeper = quota("per-job", true, Arc::new(backend.clone()));
    keeper
        .try_acquire("kept")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    for ms in 0..20u64 {
        let job = Quota::builder("per-job")
            .limit(1)
            .ttl(Duration::from_millis(5_000 + ms))
            .shared_backend(Arc::new(backend.clone()))
            .build()
            .unwrap();
        job.try_acquire("job")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    let queues = backend.inner.acquires.lock().unwrap()["per-job"].len();
    assert!(queues <= 2, "{queues} admission queues kept for one quota");
}
