//! A release that got no answer may still reach the backend later: from a connection the Redis
//! backend replaced after it wedged, whose bytes a proxy held and then delivered. Such a release
//! must never end the lease of a later holder of the same task: the admission it names is not
//! handed out again. The backend is the memory backend behind a wrapper that holds releases
//! back and delivers them on command.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::switchable::Switchable;
use leasehold::{Backend, Error, Lease, Quota, QuotaKeys};

fn quota(backend: &Arc<Switchable>) -> Quota {
    Quota::builder("late")
        .limit(1)
        .ttl(Duration::from_secs(5))
        .shared_backend(backend.clone() as Arc<dyn Backend>)
        .build()
        .unwrap()
}

/// A fresh backend whose releases each take `delay`, its quota, and that quota's lease of task
/// `a`.
async fn holding_a_with_slow_releases(delay: Duration) -> (Arc<Switchable>, Quota, Lease) {
    let backend = Arc::new(Switchable::default());
    let quota = quota(&backend);
    let lease = quota.try_acquire("a").await.unwrap();
    backend.slow_releases(delay);
    (backend, quota, lease)
}

/// Polls `future` for 10 ms, then leaves it parked (kept, never polled again), as a `select!`
/// that went the other way does; its output if it was ready by then.
async fn poll_then_park<F: std::future::Future + Unpin>(future: &mut F) -> Option<F::Output> {
    tokio::time::timeout(Duration::from_millis(10), future)
        .await
        .ok()
}

#[tokio::test]
async fn a_release_delivered_late_never_ends_a_later_holder_of_the_same_task() {
    let backend = Arc::new(Switchable::default());
    let quota = quota(&backend);
    let first = quota.try_acquire("t").await.unwrap();
    backend.hold_back_releases(true);
    let err = first.release().await.unwrap_err();
    assert!(matches!(err, Error::BackendUnavailable { .. }), "{err:?}");
    backend.hold_back_releases(false);

    // The old admission is still live in the backend; asking for the task again must not hand
    // it out (a late delivery of the release above would end it).
    let again = quota.try_acquire("t").await.unwrap();
    assert_ne!(again.fencing_token(), first.fencing_token());
    let keys = QuotaKeys::new("late").unwrap();
    let holders = backend.inner.snapshot(&keys).await.unwrap().holders;
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0].token, again.fencing_token());

    // The held-back release arrives now: it names the old token and removes nothing.
    assert_eq!(backend.deliver_held_back().await, vec![false]);
    assert!(again.is_held());
    let holders = backend.inner.snapshot(&keys).await.unwrap().holders;
    assert_eq!(
        holders.len(),
        1,
        "the new holder's lease survived the late release"
    );
    assert!(
        matches!(quota.try_acquire("other").await, Err(Error::Full { .. })),
        "the slot stays counted: nobody else is admitted beside the new holder"
    );
}

#[tokio::test]
async fn an_answered_release_leaves_nothing_to_settle() {
    let backend = Arc::new(Switchable::default());
    let quota = quota(&backend);
    let first = quota.try_acquire("t").await.unwrap();
    first.release().await.unwrap();
    let again = quota.try_acquire("t").await.unwrap();
    assert!(again.fencing_token() > first.fencing_token());
    // A lease held by two callers of one task is still shared: no release is outstanding.
    let shared = quota.try_acquire("t").await.unwrap();
    assert_eq!(shared.fencing_token(), again.fencing_token());
    assert_eq!(backend.deliver_held_back().await, Vec::<bool>::new());
}

/// A release refused before it ran (no connection) cannot land late: the admission it named is
/// still the task's, and the next acquire of the task gets it back as is, with no release sent
/// again and no second admission.
#[tokio::test]
async fn a_release_refused_before_it_ran_leaves_nothing_to_land_late() {
    let backend = Arc::new(Switchable::default());
    let quota = quota(&backend);
    let first = quota.try_acquire("t").await.unwrap();
    backend.set_down(true);
    let err = first.release().await.unwrap_err();
    assert!(
        matches!(err, Error::BackendUnavailable { kind, .. } if !kind.may_have_run()),
        "{err:?}"
    );
    backend.set_down(false);

    let again = quota.try_acquire("t").await.unwrap();
    assert_eq!(again.fencing_token(), first.fencing_token());
    let keys = QuotaKeys::new("late").unwrap();
    let holders = backend.inner.snapshot(&keys).await.unwrap().holders;
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0].token, first.fencing_token());
    again.release().await.unwrap();
    let next = quota.try_acquire("other").await.unwrap();
    assert!(next.fencing_token() > first.fencing_token());
}

/// An acquire whose first round trip ran (answered `held`, which extends the lease by a ttl) but
/// whose re-release of the unanswered admission is then refused (no connection) is told
/// `NoReply` (it may have run), not the release's "not run" kind (found by review).
#[tokio::test]
async fn an_acquire_that_ran_is_not_reported_as_not_run() {
    use std::sync::atomic::Ordering;
    let backend = Arc::new(Switchable::default());
    let quota = quota(&backend);
    let keys = QuotaKeys::new("late").unwrap();
    let first = quota.try_acquire("t").await.unwrap();
    backend.hold_back_releases(true);
    first.release().await.unwrap_err(); // no reply: may land late
    backend.hold_back_releases(false);
    let before = backend.inner.snapshot(&keys).await.unwrap().holders[0].deadline_ms;
    tokio::time::sleep(Duration::from_millis(200)).await;
    backend.refuse_releases.store(true, Ordering::SeqCst);
    let err = quota.try_acquire("t").await.unwrap_err();
    let after = backend.inner.snapshot(&keys).await.unwrap().holders[0].deadline_ms;
    println!(
        "acquire error: {err:?}; lease deadline moved by {} ms",
        after - before
    );
    assert!(
        after > before,
        "the acquire's first call ran and extended the lease"
    );
    let kind = common::unavailable_kind(&err).expect("unavailable");
    assert!(
        kind.may_have_run(),
        "told {kind:?} (not run), but the acquire ran: the lease was extended by {} ms",
        after - before
    );
}

/// Two clones released at once, the first one's call slow: the second `release` waits for the
/// first one's answer, so that its `Ok` means the slot is free (found by review: it returned
/// `Ok` at once, with the slot still held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_second_release_returns_once_the_slot_is_free() {
    let (_backend, quota, lease) = holding_a_with_slow_releases(Duration::from_millis(300)).await;
    let (a, b) = (lease.clone(), lease);
    let first = tokio::spawn(async move { a.release().await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    b.release().await.unwrap();
    let holders = quota.status().await.unwrap().holders.len();
    assert_eq!(
        holders, 0,
        "release() returned Ok while the slot was still held"
    );
    first.await.unwrap().unwrap();
}

/// The first `release` is cancelled by its caller (a timeout) while its call is on its way; the
/// send goes on in the background, and a second `release` through a clone waits for it, so that
/// its `Ok` means the slot is free (found by review: it returned `Ok` in 29 µs, the slot held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_release_after_the_first_caller_gave_up_returns_once_the_slot_is_free() {
    let (_backend, quota, lease) = holding_a_with_slow_releases(Duration::from_millis(300)).await;
    let (a, b) = (lease.clone(), lease);
    let gave_up = tokio::time::timeout(Duration::from_millis(20), a.release()).await;
    assert!(
        gave_up.is_err(),
        "the slow release cannot be answered within 20 ms"
    );
    b.release().await.unwrap();
    let holders = quota.status().await.unwrap().holders.len();
    assert_eq!(
        holders, 0,
        "release() returned Ok while the slot was still held"
    );
}

/// A `release` future polled once and then parked (a `select!` that went the other way, kept in
/// scope) does not keep a clone's `release` waiting once its send is done (found by review: the
/// second call hung for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_a_parked_release_future_does_not_hang() {
    let (_backend, quota, lease) = holding_a_with_slow_releases(Duration::from_millis(50)).await;
    let (a, b) = (lease.clone(), lease);
    let first = a.release();
    tokio::pin!(first);
    if let Some(early) = poll_then_park(&mut first).await {
        early.unwrap();
    }
    let second = tokio::time::timeout(Duration::from_secs(5), b.release()).await;
    assert!(
        second.is_ok(),
        "release() through a clone hung behind a parked future"
    );
    assert_eq!(quota.status().await.unwrap().holders.len(), 0);
}

/// A `release` future polled once while another clone's release is on its way, then parked
/// (kept in scope, never polled again): it waits on leasehold's runtime, not in the caller's
/// future, so a third clone's `release` is not held behind it (found by review: it hung for as
/// long as the parked future lived).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_release_future_queued_behind_another_does_not_block_later_releases() {
    let (_backend, quota, lease) = holding_a_with_slow_releases(Duration::from_millis(200)).await;
    let (a, b, c) = (lease.clone(), lease.clone(), lease);
    let first = tokio::spawn(async move { a.release().await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let parked = b.release();
    tokio::pin!(parked);
    if let Some(r) = poll_then_park(&mut parked).await {
        panic!("the second call waits for the first: {r:?}");
    }
    first.await.unwrap().unwrap();
    assert_eq!(quota.status().await.unwrap().holders.len(), 0, "slot freed");
    let third = tokio::time::timeout(Duration::from_secs(3), c.release()).await;
    assert!(
        third.is_ok(),
        "release() through a clone hung behind a parked future queued for the lock"
    );
}

/// A `force_release` future polled once and then parked (a `select!` that went the other way)
/// does not hold the task's turn from the caller's future: a `Lease::release` of that task and
/// `flush` go on (found by review: both waited for as long as the parked future lived).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_force_release_does_not_block_release_or_flush() {
    let (backend, quota, lease) = holding_a_with_slow_releases(Duration::from_millis(50)).await;
    let parked = quota.force_release("a");
    tokio::pin!(parked);
    if let Some(r) = poll_then_park(&mut parked).await {
        panic!("force_release answered within 10 ms: {r:?}");
    }
    backend.slow_releases(Duration::ZERO);
    let released = tokio::time::timeout(Duration::from_secs(3), lease.release()).await;
    let flushed = tokio::time::timeout(Duration::from_secs(3), quota.flush()).await;
    println!(
        "release: {released:?}; flush timed out: {}",
        flushed.is_err()
    );
    assert!(
        released.is_ok(),
        "Lease::release hung behind a parked force_release future"
    );
    assert!(
        flushed.is_ok(),
        "flush hung behind a parked force_release future"
    );
}

/// A `release` future polled once then dropped (a biased `select!` that went the other way):
/// the release goes on in the background, and `is_held()` says false at once (found by review:
/// true in 183 of 200 runs, when the claim moved to leasehold's runtime).
#[tokio::test]
async fn a_release_polled_once_ends_the_holders_view_at_once() {
    let backend = Arc::new(Switchable::default());
    let quota = quota(&backend);
    let mut still_held = 0;
    let runs = 200;
    for i in 0..runs {
        let lease = quota.try_acquire(&format!("t{i}")).await.unwrap();
        {
            let f = lease.release();
            tokio::pin!(f);
            tokio::select! {
                biased;
                r = &mut f => { r.unwrap(); }
                _ = std::future::ready(()) => {}
            }
        }
        if lease.is_held() {
            still_held += 1;
        }
        lease.release().await.unwrap();
    }
    println!("{still_held} of {runs}: is_held() true right after a release polled once");
    assert_eq!(
        still_held, 0,
        "{still_held} of {runs} still held after the first poll"
    );
}
