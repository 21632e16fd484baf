//! `Quota::flush` returns only once the background work it promises has reached the backend,
//! and a dropped lease is released even while its renewal is out: the renewal task does not keep
//! the lease alive, nor brings it back. Memory backend behind `Switchable` (slow renewals or
//! releases: a slow link).
//! Each test failed before its fix.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::switchable::Switchable;
use leasehold::{Lease, Quota};

fn quota(backend: &Arc<Switchable>, name: &str, heartbeat: Duration) -> Quota {
    common::quota_with(backend.clone(), name, 1, Duration::from_secs(3))
        .heartbeat(heartbeat)
        .build()
        .unwrap()
}

/// A quota of limit 1 on a fresh `Switchable`, renewing every `heartbeat`, and its lease of task
/// `t`.
async fn holding_t(name: &str, heartbeat: Duration) -> (Arc<Switchable>, Quota, Lease) {
    let backend = Arc::new(Switchable::default());
    let quota = quota(&backend, &common::unique(name), heartbeat);
    let lease = quota.try_acquire("t").await.unwrap();
    (backend, quota, lease)
}

/// Makes each renewal take `delay`, and returns once one is out.
async fn renewal_out(backend: &Switchable, delay: Duration) {
    backend.slow_renewals(delay);
    backend.renewing.notified().await;
}

/// The `flush` example (drop, then flush) with a renewal of the lease out at the drop: the
/// release must be sent before `flush` returns, not when the renewal answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_waits_for_the_release_of_a_lease_dropped_during_a_renewal() {
    let (backend, quota, lease) = holding_t("flush", Duration::from_secs(1)).await;
    renewal_out(&backend, Duration::from_millis(500)).await;
    drop(lease);
    quota.flush().await;
    let holders = common::holder_ids(&quota).await;
    assert!(
        holders.is_empty(),
        "flush returned with the dropped lease's release not sent: {holders:?}"
    );
}

/// Renewals slower than the heartbeat overlap: a lease dropped meanwhile was kept alive by them
/// and renewed for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_lease_is_released_even_when_renewals_outlast_the_heartbeat() {
    let (backend, quota, lease) = holding_t("overlap", Duration::from_millis(200)).await;
    renewal_out(&backend, Duration::from_millis(500)).await;
    drop(lease);
    // Bounded well under the 3 s ttl: an expiry would not count.
    let end = Instant::now() + Duration::from_secs(2);
    let mut holders = common::holder_ids(&quota).await;
    while !holders.is_empty() && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
        holders = common::holder_ids(&quota).await;
    }
    assert!(
        holders.is_empty(),
        "the dropped lease is still held: {holders:?}"
    );
}

/// Two handles of one quota share its leases: `b`'s acquire of a task `a` holds returns `a`'s
/// lease. A flush through either covers that lease's release, whichever handle counted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_through_any_handle_of_the_quota_waits_for_its_releases() {
    let backend = Arc::new(Switchable::default());
    let name = common::unique("two-handles");
    let (a, b) = (
        quota(&backend, &name, Duration::from_secs(1)),
        quota(&backend, &name, Duration::from_secs(1)),
    );
    let from_a = a.try_acquire("t").await.unwrap();
    let from_b = b.try_acquire("t").await.unwrap(); // held: the same lease
    assert_eq!(from_a.fencing_token(), from_b.fencing_token());
    backend.slow_releases(Duration::from_millis(200));
    drop(from_a);
    drop(from_b); // the last handle: released in the background
    b.flush().await;
    let holders = common::holder_ids(&b).await;
    assert!(
        holders.is_empty(),
        "b.flush() returned before the release: {holders:?}"
    );
}

/// The backend lost its state, and a renewal carrying the old epoch is out when the lease is
/// dropped: its release reaches the backend first, then the renewal re-registers the lease
/// (PROTOCOL §8). Nobody holds it any more: it must be released again, before `flush` returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_dropped_while_a_renewal_re_registers_it_is_not_left_held() {
    let (backend, quota, lease) = holding_t("rereg", Duration::from_secs(1)).await;
    backend.inner.wipe(); // a restart without persistence
                          // t's renewal, with its old epoch, is on its way.
    renewal_out(&backend, Duration::from_millis(300)).await;
    drop(lease); // released at once: before the renewal arrives
    quota.flush().await;
    backend.slow_renewals(Duration::ZERO);
    let holders = common::holder_ids(&quota).await;
    assert!(
        holders.is_empty(),
        "the dropped lease was re-registered after its release, held by nobody: {holders:?}"
    );
}

/// Like the test above, but the holder releases explicitly and keeps its handle (a `Lease` kept
/// in a struct, a clone elsewhere): the re-registered lease is released again all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_released_while_a_renewal_re_registers_it_is_not_left_held() {
    let (backend, quota, lease) = holding_t("rereg2", Duration::from_secs(1)).await;
    backend.inner.wipe();
    renewal_out(&backend, Duration::from_millis(300)).await;
    lease.release().await.unwrap(); // released, handle kept
    quota.flush().await;
    backend.slow_renewals(Duration::ZERO);
    let holders = common::holder_ids(&quota).await;
    assert!(
        holders.is_empty(),
        "released lease re-registered after its release, held by nobody: {holders:?} (lost: {:?})",
        lease.lost_reason()
    );
}

/// `abandon` promises that the slot stays taken until its deadline passes (a crashed holder): a
/// renewal out at the abandon must not release it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_lease_is_not_released_by_a_renewal_in_flight() {
    let (backend, quota, lease) = holding_t("abandon", Duration::from_secs(1)).await;
    renewal_out(&backend, Duration::from_millis(300)).await;
    lease.abandon();
    quota.flush().await; // the renewal has answered
    let holders = common::holder_ids(&quota).await;
    assert_eq!(
        holders,
        vec!["t".to_owned()],
        "the abandoned lease was released well before its deadline"
    );
}

/// The README's exit sequence (drop every lease, then `flush`) after a loss at the local deadline
/// (renewals failing): the backend may still hold the lease, so its drop releases it, and
/// `flush` waits for that release (found by review: 10-12 of 20 were released after `flush`
/// returned).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_then_flush_after_a_local_deadline() {
    let backend = Arc::new(Switchable::default());
    let quota = common::quota_with(
        backend.clone(),
        &common::unique("deadline-flush"),
        100,
        Duration::from_millis(400),
    )
    .safety_margin(Duration::from_millis(100))
    .breaker(leasehold::BreakerConfig {
        failures_to_open: u32::MAX,
        cool_down: Duration::from_millis(1),
    })
    .build()
    .unwrap();
    let mut left = Vec::new();
    for i in 0..20 {
        let id = format!("t{i}");
        backend.set_renewals_down(false);
        let lease = quota.try_acquire(&id).await.unwrap();
        backend.set_renewals_down(true);
        assert_eq!(lease.lost().await, leasehold::LostReason::LocalDeadline);
        drop(lease);
        quota.flush().await;
        if common::holder_ids(&quota).await.contains(&id) {
            left.push(id);
        }
    }
    assert!(
        left.is_empty(),
        "{} of 20 leases lost at their local deadline still held after drop + flush: {left:?}",
        left.len()
    );
}
