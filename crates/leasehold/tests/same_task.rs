//! Calls about one task id in one process: whatever order they are made in, and however many
//! `Quota` handles make them, the process never believes it holds a lease the backend has freed,
//! and never keeps a slot nobody holds. Each test owns its backend (a private redis-server, or an
//! in-memory backend) and every loop is bounded.

mod common;

use std::time::{Duration, Instant};

use common::Fixture;

const TTL: Duration = Duration::from_millis(600);

/// Two `Quota` handles of one name on one backend (the embedded backend is one per process, so
/// `Quota::builder("q").build()` twice gives exactly this). The release sent by one handle's drop
/// and the acquire of the other travel in separate batches: without shared turns, the acquire
/// could come back `held` on the admission being released, and run on a freed slot.
async fn reacquire_through_a_second_handle(fx: Fixture) {
    let q1 = fx.quota(1, TTL);
    let q2 = fx.quota(1, TTL);
    // Both listen, as they would after any acquire.
    drop(q2.try_acquire("warm-up").await.unwrap());
    tokio::time::sleep(Duration::from_millis(20)).await;
    let end = Instant::now() + Duration::from_secs(20);
    for round in 0..100 {
        if Instant::now() > end {
            break;
        }
        let lease = q1.try_acquire("again").await.unwrap();
        let before = lease.fencing_token();
        drop(lease);
        let next = q2
            .acquire_timeout("again", Duration::from_secs(2))
            .await
            .unwrap();
        // Either a fresh admission, or, when this acquire took the task's turn before the drop's
        // background release did, the same admission adopted while still live: the release then
        // finds it adopted and leaves it. Both are fine; what must never happen is a handle that
        // says held on an admission the backend has freed. Give a late release time to land.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let holders = q2.status().await.unwrap().holders;
        let in_backend = holders
            .iter()
            .any(|h| h.fencing_token == next.fencing_token());
        assert!(
            next.is_held() && in_backend,
            "round {round}: q2's handle (token {}, previous {before}) lost={:?}, the backend \
             holds {holders:?}",
            next.fencing_token(),
            next.lost_reason(),
        );
        drop(next);
        // Let the release of `next` finish before the next round.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_task_dropped_by_one_handle_and_acquired_by_another_holds_a_live_lease() {
    reacquire_through_a_second_handle(Fixture::redis().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_task_dropped_by_one_handle_and_acquired_by_another_holds_a_live_lease() {
    reacquire_through_a_second_handle(Fixture::memory().await).await
}

/// A task held through one handle and acquired again through another: both share one lease,
/// which the first handle's drop does not end.
async fn one_lease_shared_by_two_handles(q1: leasehold::Quota, q2: leasehold::Quota) {
    let first = q1.try_acquire("shared").await.unwrap();
    let second = q2.try_acquire("shared").await.unwrap();
    assert_eq!(
        second.fencing_token(),
        first.fencing_token(),
        "the same admission"
    );
    drop(first);
    // Longer than a release takes, and than one ttl: the lease is still renewed.
    tokio::time::sleep(TTL + TTL / 2).await;
    let holders = q2.status().await.unwrap().holders;
    assert!(second.is_held(), "lost: {:?}", second.lost_reason());
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert_eq!(holders[0].fencing_token, second.fencing_token());
    second.release().await.unwrap();
    assert!(q2.status().await.unwrap().holders.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_one_lease_is_shared_by_two_handles_until_the_last_lets_go() {
    let fx = Fixture::redis().await;
    one_lease_shared_by_two_handles(fx.quota(1, TTL), fx.quota(1, TTL)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_one_lease_is_shared_by_two_handles_until_the_last_lets_go() {
    let fx = Fixture::memory().await;
    one_lease_shared_by_two_handles(fx.quota(1, TTL), fx.quota(1, TTL)).await
}

/// Handles built on clones of one `RedisBackend` (`.backend(redis.clone())`, each in its own
/// `Arc`) share one connection, so they share the lease as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_on_clones_of_one_redis_backend_share_a_lease() {
    let server = leasehold_testkit::RedisServer::start();
    let redis = leasehold::RedisBackend::connect(&server.url())
        .await
        .unwrap();
    let name = common::unique("clones");
    let handle = || {
        leasehold::Quota::builder(name.clone())
            .limit(1)
            .ttl(TTL)
            .backend(redis.clone())
            .build()
            .unwrap()
    };
    one_lease_shared_by_two_handles(handle(), handle()).await
}

/// A quota whose client reaches a private redis-server through a proxy (for latency), and a
/// second, direct client of the same server to look at the truth.
struct Proxied {
    _server: leasehold_testkit::RedisServer,
    proxy: leasehold_testkit::proxy::FaultProxy,
    quota: leasehold::Quota,
    direct: leasehold::Quota,
}

async fn proxied(limit: u64, ttl: Duration) -> Proxied {
    use std::sync::Arc;
    let server = leasehold_testkit::RedisServer::start();
    let proxy = leasehold_testkit::proxy::FaultProxy::start(server.port());
    let slow = leasehold::RedisBackend::connect(&proxy.url())
        .await
        .unwrap();
    let fast = leasehold::RedisBackend::connect(&server.url())
        .await
        .unwrap();
    let name = common::unique("proxied");
    let quota = leasehold::Quota::builder(name.clone())
        .limit(limit)
        .ttl(ttl)
        .shared_backend(Arc::new(slow))
        .build()
        .unwrap();
    let direct = leasehold::Quota::builder(name)
        .limit(limit)
        .ttl(ttl)
        .shared_backend(Arc::new(fast))
        .build()
        .unwrap();
    Proxied {
        _server: server,
        proxy,
        quota,
        direct,
    }
}

/// `Lease::release` may wait for the task's turn before its request goes out. A caller that stops
/// waiting then (a timeout, a `select!`, an aborted task) must not cancel it: the lease already
/// counts as released, so neither a second `release()` nor the drop would send it, and the slot
/// would stay taken, unrenewed, for a whole ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_caller_stops_waiting_is_still_sent() {
    let ttl = Duration::from_secs(3);
    let px = proxied(1, ttl).await;
    let quota = px.quota.clone();
    let lease = quota.try_acquire("x").await.unwrap();
    // The holder is cancelled; a duplicate attempt of the same task id is under way (it will be
    // answered `cancelled` and adopts nothing), on a link with 2 × 100 ms of latency.
    quota.cancel("x", "stop").await.unwrap();
    px.proxy.set_latency(Duration::from_millis(100));
    let duplicate = {
        let quota = quota.clone();
        tokio::spawn(async move { quota.try_acquire("x").await })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    // The holder lets go, but gives its release 50 ms only (e.g. a shutdown deadline).
    let first = tokio::time::timeout(Duration::from_millis(50), lease.release()).await;
    assert!(
        first.is_err(),
        "the release waited for the duplicate's turn"
    );
    let dup = tokio::time::timeout(Duration::from_secs(3), duplicate).await;
    assert!(
        matches!(dup, Ok(Ok(Err(leasehold::Error::Cancelled(_))))),
        "{dup:?}"
    );
    px.proxy.set_latency(Duration::ZERO);
    // A second release has nothing left to send.
    lease.release().await.unwrap();
    drop(lease);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let holders = px.direct.status().await.unwrap().holders;
    assert!(
        holders.is_empty(),
        "released twice (Ok), dropped, yet the backend still holds {holders:?} until its ttl"
    );
}

/// Two callers of one task id give up (`acquire_timeout`) while their attempts are in flight. A
/// late admission nobody waits for is kept only while another attempt whose caller still waits
/// is under way; two such orphans must not wait for each other (for the whole 2 s grace) while
/// the slot is taken by nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_callers_that_give_up_on_one_task_leave_its_slot_free() {
    let px = proxied(1, Duration::from_secs(5)).await;
    let quota = px.quota.clone();
    drop(quota.try_acquire("warm-up").await.unwrap());
    tokio::time::sleep(Duration::from_millis(50)).await;
    px.proxy.set_latency(Duration::from_millis(100));
    let give_up = |quota: leasehold::Quota| async move {
        quota.acquire_timeout("x", Duration::from_millis(50)).await
    };
    let (a, b) = tokio::join!(give_up(quota.clone()), give_up(quota.clone()));
    assert!(a.is_err() && b.is_err());
    px.proxy.set_latency(Duration::ZERO);
    // Both attempts are answered within ~0.5 s (two turns of 200 ms each).
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let holders = px.direct.status().await.unwrap().holders;
    assert!(
        holders.is_empty(),
        "nobody holds `x` in this process, yet 1 s later the backend still has {holders:?}"
    );
}

/// A task held in this process, acquired again with a timeout shorter than the round trip: it
/// gets its lease back, as it would with the backend down, not `TimedOut` for a lease it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_task_acquired_again_on_a_slow_link_gets_its_lease_not_a_timeout() {
    let px = proxied(1, Duration::from_secs(10)).await;
    let lease = px.quota.try_acquire("x").await.unwrap();
    px.proxy
        .set_latency_each_way(Duration::ZERO, Duration::from_millis(400));
    let again = px
        .quota
        .acquire_timeout("x", Duration::from_millis(150))
        .await
        .unwrap();
    assert_eq!(again.fencing_token(), lease.fencing_token());
    // A task held nowhere here still times out.
    let other = px
        .quota
        .acquire_timeout("y", Duration::from_millis(150))
        .await;
    assert!(
        matches!(other, Err(leasehold::Error::TimedOut { .. })),
        "{other:?}"
    );
    px.proxy
        .set_latency_each_way(Duration::ZERO, Duration::ZERO);
    drop((lease, again));
    px.quota.flush().await;
    assert!(px.direct.status().await.unwrap().holders.is_empty());
}

/// This process's forced release of a task whose acquire is under way waits for that acquire,
/// as the task's own calls do: the lease the acquire returns is the one it removes, and that
/// lease ends at once. The acquire's answer is decided first and delivered 150 ms later
/// (`Switchable::answer_late`). Without the wait (found by review) the release ran beside the
/// acquire: the acquire's lease was adopted after the release removed it, and believed held
/// until its next renewal; in the other order, a lease the release never touched was ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_release_waits_for_an_acquire_of_its_task_under_way() {
    use common::switchable::Switchable;
    use std::sync::Arc;
    let backend = Arc::new(Switchable::default());
    let quota = common::quota_with(backend.clone(), "forced-turn", 1, Duration::from_secs(30))
        .events(false)
        .build()
        .unwrap();
    backend.answer_late(Some("t"));
    let acquiring = {
        let quota = quota.clone();
        tokio::spawn(async move { quota.try_acquire("t").await })
    };
    backend.decided_late.notified().await; // admitted; the answer is on its way
    assert!(quota.force_release("t").await.unwrap());
    let lease = acquiring.await.unwrap().unwrap();
    assert_eq!(
        lease.lost_reason(),
        Some(leasehold::LostReason::ReleasedElsewhere),
        "the lease the forced release removed is still believed held"
    );
    assert!(quota.status().await.unwrap().holders.is_empty());
}

/// Two `acquire`s of one task wait in line; when the first is admitted, the second gets the same
/// lease at once, not at its next poll (5 s here; found by review: 2.5 s later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_waiter_of_a_task_gets_its_lease_as_the_first_is_admitted() {
    let (quota, counting) = common::waiting::memory_quota(1, Duration::from_secs(5)).await;
    common::warm_up(&quota).await;
    let holder = quota.try_acquire("h").await.unwrap();
    let spawn = |id: &'static str| {
        let quota = quota.clone();
        tokio::spawn(async move {
            let lease = quota.acquire(id).await;
            (lease, Instant::now())
        })
    };
    let x1 = spawn("x");
    assert!(
        counting.all_refused(&["x"], Duration::from_secs(5)).await,
        "x1's first attempt was answered full"
    );
    let x2 = spawn("x"); // behind x1, with no attempt of its own
    assert!(common::eventually(Duration::from_secs(2), || quota.debug_sizes().waiters == 2).await);
    holder.release().await.unwrap();
    let (l1, t1) = tokio::time::timeout(Duration::from_secs(2), x1)
        .await
        .expect("x1 served at the release")
        .unwrap();
    let (l2, t2) = tokio::time::timeout(Duration::from_secs(10), x2)
        .await
        .expect("x2 served")
        .unwrap();
    let (l1, l2) = (l1.unwrap(), l2.unwrap());
    assert_eq!(
        l1.fencing_token(),
        l2.fencing_token(),
        "one lease, one slot"
    );
    let gap = t2.saturating_duration_since(t1);
    println!("x2 got the task's lease {gap:?} after x1");
    assert!(
        gap < Duration::from_millis(1000),
        "x2 waited {gap:?} for its task's lease"
    );
}

/// The admission of a waiter's task wakes the task's other waiters, not the waiter it was made
/// for, whose attempt was started for it before its task ran: woken too, it left with a re-check
/// it passed on, and the next waiter (another task) went out on an attempt that could only be
/// refused (found by review).
///
/// current_thread runtime: the waiters run only when this thread lets them, and a 40 ms block
/// (well inside TAKE_GRACE) stands for a busy runtime.
#[tokio::test]
async fn an_admitted_waiter_sends_no_pointless_recheck_to_the_next_one() {
    let (quota, counting) = common::waiting::memory_quota(1, Duration::from_secs(10)).await;
    common::warm_up(&quota).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let holder = quota.try_acquire("h").await.unwrap();
    let spawn = |id: &'static str| {
        let quota = quota.clone();
        tokio::spawn(async move { quota.acquire(id).await })
    };
    let a = spawn("a");
    assert!(counting.all_refused(&["a"], Duration::from_secs(5)).await);
    let b = spawn("b"); // behind a: no attempt of its own
    assert!(common::eventually(Duration::from_secs(2), || quota.debug_sizes().waiters == 2).await);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b_refused_before = counting.refused("b");
    holder.release().await.unwrap();
    // The release event reaches the leasehold runtime, which starts a's attempt and adopts its
    // admission, while a's task cannot run yet.
    std::thread::sleep(Duration::from_millis(40));
    let lease = tokio::time::timeout(Duration::from_secs(2), a)
        .await
        .expect("a served at the release")
        .unwrap()
        .unwrap();
    assert_eq!(lease.task_id(), "a");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let extra = counting.refused("b") - b_refused_before;
    b.abort();
    assert_eq!(
        extra, 0,
        "b was sent on {extra} attempt(s) that could only be refused (a re-check a's own \
         admission asked of a, passed on when a left)"
    );
}
