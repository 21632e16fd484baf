//! Waiters on a memory-backed quota: the quota with its refusal-counting backend, a waiter task,
//! and an `acquire` future parked after its first poll.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use leasehold::{Lease, Quota};
use tokio::task::JoinHandle;

use super::counting::Counting;
use super::Fixture;

/// A quota of `limit` on the memory backend, ttl 30 s, polling every `poll`, and its backend,
/// which counts refusals.
pub async fn memory_quota(limit: u64, poll: Duration) -> (Quota, Arc<Counting>) {
    let fx = Fixture::memory().await;
    let counting = Counting::new(fx.backend.clone());
    let quota = fx
        .builder(limit, Duration::from_secs(30))
        .poll_interval(poll)
        .shared_backend(counting.clone())
        .build()
        .unwrap();
    (quota, counting)
}

/// Asserts that `id`'s first attempt was answered full (within 5 s).
pub async fn assert_refused(counting: &Counting, id: &str) {
    assert!(
        counting.all_refused(&[id], Duration::from_secs(5)).await,
        "{id}'s first attempt was answered full"
    );
}

/// A task waiting at most `within` for a slot of `quota` for task `id`.
pub fn waiter(
    quota: &Quota,
    id: &'static str,
    within: Duration,
) -> JoinHandle<leasehold::Result<Lease>> {
    let quota = quota.clone();
    tokio::spawn(async move { quota.acquire_timeout(id, within).await })
}

/// An `acquire` of `id` polled once, then not for `parked` (as a `select!` loop leaves it while
/// another arm's body runs), then awaited: its task id, or the error, and when it ended. Returns
/// once the first poll is done.
pub async fn parked_acquire(
    quota: &Quota,
    id: &'static str,
    parked: Duration,
) -> JoinHandle<(Result<String, leasehold::Error>, Instant)> {
    let (polled_tx, polled_rx) = tokio::sync::oneshot::channel();
    let quota = quota.clone();
    let task = tokio::spawn(async move {
        let acquire = quota.acquire(id);
        tokio::pin!(acquire);
        std::future::poll_fn(|cx| {
            assert!(acquire.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        polled_tx.send(()).unwrap();
        tokio::time::sleep(parked).await; // another arm's body
        let got = acquire.await;
        (got.map(|l| l.task_id().to_owned()), Instant::now())
    });
    polled_rx.await.unwrap();
    task
}
