//! Leases granted by the backend-down policy (`FailOpen`, `DegradeLocal`) obey the same rules as
//! the backend's: a task id holds one slot, gets its lease back when it asks again, and learns
//! of a cancel. The backend here is the memory backend behind a switch that makes every call
//! fail transiently, as an unreachable Redis would; every wait is bounded.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::switchable::Switchable;
use leasehold::{
    Backend, BackendDownPolicy, BreakerConfig, Lease, LostReason, Quota, QuotaBuilder,
};

fn builder(
    backend: &Arc<Switchable>,
    policy: BackendDownPolicy,
    cool_down: Duration,
) -> QuotaBuilder {
    common::quota_with(backend.clone(), "local", 2, Duration::from_secs(5))
        .when_backend_down(policy)
        .breaker(BreakerConfig {
            failures_to_open: 1,
            cool_down,
        })
}

fn quota(backend: &Arc<Switchable>, policy: BackendDownPolicy, cool_down: Duration) -> Quota {
    builder(backend, policy, cool_down).build().unwrap()
}

/// An acquire of task `x` is out to the backend (admitted there, its answer on its way) when the
/// circuit opens, and a second acquire of `x` is granted a local lease meanwhile: returns the
/// first acquire's lease, once answered, and the second's.
async fn acquired_while_the_circuit_opens(backend: &Arc<Switchable>, q: &Quota) -> (Lease, Lease) {
    backend.answer_late(Some("x"));
    let first = {
        let q = q.clone();
        tokio::spawn(async move { q.try_acquire("x").await })
    };
    backend.decided_late.notified().await; // decided in the backend, answer on its way
    backend.set_down(true);
    let _ = q.try_acquire("probe").await; // fails: the circuit opens (its local lease dropped)
    backend.set_down(false);
    assert_eq!(q.breaker_mode(), leasehold::BreakerMode::Open);
    let second = q.try_acquire("x").await.unwrap();
    assert!(second.is_local());
    let first = tokio::time::timeout(Duration::from_secs(5), first)
        .await
        .expect("the first acquire answered")
        .unwrap()
        .unwrap();
    (first, second)
}

const LONG: Duration = Duration::from_secs(30);

#[tokio::test]
async fn fail_open_gives_a_task_its_local_lease_again_not_a_second_slot() {
    let backend = Arc::new(Switchable::default());
    let q = quota(&backend, BackendDownPolicy::FailOpen, LONG);
    backend.set_down(true);
    let first = q.try_acquire("a").await.unwrap();
    assert!(first.is_local());
    let again = q.try_acquire("a").await.unwrap();
    assert_eq!(q.local_leases(), 1, "a second local slot for the same task");
    assert!(again.is_local());
}

#[tokio::test]
async fn degrade_local_gives_a_task_its_local_lease_again_never_full() {
    let backend = Arc::new(Switchable::default());
    let q = quota(&backend, BackendDownPolicy::DegradeLocal { share: 1 }, LONG);
    backend.set_down(true);
    let first = q.try_acquire("a").await.unwrap();
    assert!(first.is_local());
    let again = q.try_acquire("a").await;
    assert!(again.is_ok(), "a held task id answered {again:?}");
    assert_eq!(q.local_leases(), 1);
}

#[tokio::test]
async fn a_task_holding_a_backend_lease_gets_it_back_while_the_circuit_is_open() {
    for policy in [
        BackendDownPolicy::FailClosed,
        BackendDownPolicy::FailOpen,
        BackendDownPolicy::DegradeLocal { share: 1 },
    ] {
        let backend = Arc::new(Switchable::default());
        let q = quota(&backend, policy, LONG);
        let held = q.try_acquire("a").await.unwrap();
        assert!(!held.is_local());
        backend.set_down(true);
        let again = q.try_acquire("a").await;
        let again = again.unwrap_or_else(|e| panic!("{policy:?}: a held task got {e:?}"));
        assert_eq!(again.fencing_token(), held.fencing_token(), "{policy:?}");
        assert!(!again.is_local(), "{policy:?}");
        assert_eq!(q.local_leases(), 0, "{policy:?}: a second, local slot");
    }
}

#[tokio::test]
async fn a_task_with_a_local_lease_keeps_it_when_the_backend_answers_again() {
    let backend = Arc::new(Switchable::default());
    let q = quota(
        &backend,
        BackendDownPolicy::FailOpen,
        Duration::from_millis(50),
    );
    backend.set_down(true);
    let local = q.try_acquire("a").await.unwrap();
    assert!(local.is_local());
    backend.set_down(false);
    tokio::time::sleep(Duration::from_millis(120)).await; // past the cool-down
    let again = q.try_acquire("a").await.unwrap();
    assert!(
        again.is_local(),
        "the same lease, not a second slot in the backend"
    );
    assert!(q.status().await.unwrap().holders.is_empty());
    // Other tasks go to the backend again.
    assert!(!q.try_acquire("b").await.unwrap().is_local());
}

#[tokio::test]
async fn a_local_lease_learns_that_its_task_was_cancelled() {
    let backend = Arc::new(Switchable::default());
    let q = quota(
        &backend,
        BackendDownPolicy::FailOpen,
        Duration::from_millis(50),
    );
    let _listening = q.try_acquire("other").await.unwrap();
    backend.set_down(true);
    let local = q.try_acquire("a").await.unwrap();
    assert!(local.is_local());
    backend.set_down(false);
    q.cancel("a", "stop").await.unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(2), local.lost())
        .await
        .expect("a local lease is never renewed: the message must reach it");
    assert_eq!(reason, LostReason::Cancelled("stop".into()));
}

/// Concurrent calls for one task id, from several threads, while the circuit is open: one local
/// slot between them, whichever policy grants it.
#[test]
fn concurrent_calls_for_one_task_take_one_local_slot() {
    for policy in [
        BackendDownPolicy::FailOpen,
        BackendDownPolicy::DegradeLocal { share: 2 },
    ] {
        for round in 0..50 {
            let backend = Arc::new(Switchable::default());
            let q = quota(&backend, policy, LONG);
            backend.set_down(true);
            let callers = 4;
            let start = Arc::new(std::sync::Barrier::new(callers));
            let threads: Vec<_> = (0..callers)
                .map(|_| {
                    let (q, start) = (q.clone(), start.clone());
                    std::thread::spawn(move || {
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .unwrap();
                        start.wait();
                        rt.block_on(q.try_acquire("x"))
                    })
                })
                .collect();
            let leases: Vec<_> = threads
                .into_iter()
                .map(|t| t.join().unwrap().unwrap())
                .collect();
            assert!(leases.iter().all(|l| l.is_local()));
            assert_eq!(
                q.local_leases(),
                1,
                "{policy:?}, round {round}: one task took several local slots"
            );
            drop(leases);
            assert_eq!(
                q.local_leases(),
                0,
                "{policy:?}: the shared slot was not freed"
            );
        }
    }
}

/// A task that holds a local lease does not queue behind waiters for it: asking again returns
/// its lease at once, as it does for a backend lease.
#[tokio::test]
async fn a_task_holding_a_local_lease_is_not_queued_behind_waiters() {
    let backend = Arc::new(Switchable::default());
    let q = quota(&backend, BackendDownPolicy::DegradeLocal { share: 1 }, LONG);
    backend.set_down(true);
    let held = q.try_acquire("x").await.unwrap();
    assert!(held.is_local());
    let waiter = {
        let q = q.clone();
        tokio::spawn(async move { q.acquire_timeout("w", LONG).await })
    };
    // The waiter is refused (the share is used) and waits in line.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished());
    let again = q.acquire_timeout("x", Duration::from_millis(500)).await;
    assert!(again.is_ok(), "asked again while holding: {again:?}");
    assert_eq!(q.local_leases(), 1);
    waiter.abort();
}

/// A quota of `backend` whose subscription the backend refuses, and knows it: the warm-up's
/// subscription was refused before the backend went down (a subscription that fails while it is
/// down would say nothing of the channel).
async fn refused_quota(backend: &Arc<Switchable>, cool_down: Duration) -> Quota {
    use std::sync::atomic::Ordering;
    backend.refuse_subscribe(true);
    let q = quota(backend, BackendDownPolicy::FailOpen, cool_down);
    q.try_acquire("warm")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let asked = || backend.subscribes.load(Ordering::SeqCst) >= 1;
    assert!(common::eventually(Duration::from_secs(2), asked).await);
    tokio::time::sleep(Duration::from_millis(50)).await;
    q
}

/// While the backend refuses the quota's subscription, local leases read their cancel markers
/// every second instead (their only way to hear of a cancel), but only as the short-circuit
/// allows, like any call: while the backend stays down, one read per cool-down (the probe), not
/// one per lease per second (found by review: 40 reads in 3 s for 20 local leases, and, once a
/// first fix skipped reads only while the circuit was open, 80 in 8 s after the cool-down).
#[tokio::test]
async fn local_leases_read_cancel_markers_only_as_the_short_circuit_allows() {
    use std::sync::atomic::Ordering;
    let backend = Arc::new(Switchable::default());
    let q = refused_quota(&backend, Duration::from_secs(1)).await;
    backend.set_down(true);
    let mut leases = Vec::new();
    for i in 0..20 {
        leases.push(q.try_acquire(&format!("job-{i}")).await.unwrap());
    }
    assert!(leases.iter().all(|l| l.is_local()));
    let before = backend.marker_reads.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(6)).await;
    let reads = backend.marker_reads.load(Ordering::SeqCst) - before;
    println!("{reads} cancel markers read in 6 s from a backend down, 20 local leases");
    // A probe each 0.5–1.5 s cool-down, on the watch's 1 s ticks: at most one read a tick.
    assert!(
        reads <= 7,
        "{reads} cancel markers read from a backend known to be down"
    );
}

/// While the backend refuses the subscription and only local leases are held (they make no
/// call that would subscribe), the quota asks for it again every 10 s, not every second: an ACL
/// fixed meanwhile is noticed without a call from the application.
#[tokio::test]
async fn a_refused_subscription_is_asked_for_again_every_ten_seconds_while_local_leases_live() {
    use std::sync::atomic::Ordering;
    let backend = Arc::new(Switchable::default());
    let q = refused_quota(&backend, Duration::from_millis(100)).await;
    backend.set_down(true);
    let lease = q.try_acquire("job").await.unwrap();
    assert!(lease.is_local());
    backend.set_down(false);
    let before = backend.subscribes.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(12_500)).await;
    let asked = backend.subscribes.load(Ordering::SeqCst) - before;
    println!("{asked} subscriptions asked for in 12.5 s");
    // The local grant's own attempt, spaced a second after the warm-up's refusal, then the
    // watch's, 10 ticks after its first (one more when the breaker closing asked too); one each
    // second would be 12 or 13.
    assert!(
        (2..=4).contains(&asked),
        "{asked} subscriptions asked for in 12.5 s"
    );
    assert!(lease.is_held());
}

/// A task cancelled before a blip (its marker lives) is granted a local lease by the policy
/// while the circuit is open, which cannot read the marker. Once the backend answers again (the
/// subscription never lost, so no resubscription to read it), the marker is read and the lease
/// ends: a cancelled id is not reused (found by review: it ran on for good).
#[tokio::test]
async fn a_local_lease_of_a_task_cancelled_before_the_outage_hears_it_once_the_backend_answers() {
    let backend = Arc::new(Switchable::default());
    let q = quota(
        &backend,
        BackendDownPolicy::FailOpen,
        Duration::from_millis(50),
    );
    let _listening = q.try_acquire("other").await.unwrap();
    q.cancel("a", "stop").await.unwrap();
    assert!(matches!(
        q.try_acquire("a").await,
        Err(leasehold::Error::Cancelled(_))
    ));
    backend.set_down(true);
    let local = q.try_acquire("a").await.unwrap();
    assert!(local.is_local(), "the policy cannot read the marker");
    backend.set_down(false);
    let heard = tokio::time::timeout(Duration::from_secs(5), local.lost()).await;
    assert_eq!(heard, Ok(LostReason::Cancelled("stop".into())));
}

/// With events off (as advised for an ACL that denies `SUBSCRIBE`), a local lease, which is
/// never renewed, still hears of a cancel: its marker is read every tick (found by review: it
/// never heard).
#[tokio::test]
async fn a_local_lease_of_a_quota_without_events_hears_of_its_cancel() {
    let backend = Arc::new(Switchable::default());
    let q = builder(
        &backend,
        BackendDownPolicy::FailOpen,
        Duration::from_millis(50),
    )
    .events(false)
    .build()
    .unwrap();
    backend.set_down(true);
    let local = q.try_acquire("a").await.unwrap();
    assert!(local.is_local());
    backend.set_down(false);
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(!q.try_acquire("b").await.unwrap().is_local());
    q.cancel("a", "stop").await.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(5), local.lost()).await;
    assert_eq!(heard, Ok(LostReason::Cancelled("stop".into())));
}

/// An attempt of a task is out to the backend when the circuit opens; a second acquire of the
/// same task is granted a local lease (nothing is held yet); then the backend's answer admits
/// the task too. The task keeps one slot: the backend's is given back, and both callers share
/// the local lease (found by review: the task held a backend slot and a local one).
#[tokio::test]
async fn a_task_with_an_attempt_in_flight_takes_one_slot_not_a_local_one_too() {
    let backend = Arc::new(Switchable::default());
    let q = quota(&backend, BackendDownPolicy::DegradeLocal { share: 1 }, LONG);
    let (first, second) = acquired_while_the_circuit_opens(&backend, &q).await;
    assert!(first.is_local(), "token {}", first.fencing_token());
    assert_eq!(first.fencing_token(), second.fencing_token());
    assert_eq!(q.local_leases(), 1);
    let keys = leasehold::QuotaKeys::new("local").unwrap();
    let in_backend = backend.inner.snapshot(&keys).await.unwrap().holders;
    assert!(
        in_backend.is_empty(),
        "the backend still counts a slot for x: {in_backend:?}"
    );
}

/// Like `a_task_with_an_attempt_in_flight_takes_one_slot_not_a_local_one_too`, but the task
/// already has an admission in the backend that this process never saw answered (an earlier
/// attempt whose reply was lost after the backend ran it), so the attempt in flight comes back
/// `held`, not `acquired`: it is not adopted either, and both callers share the local lease
/// (found by review: only `acquired` was checked).
#[tokio::test]
async fn a_held_reply_for_a_task_granted_a_local_lease_meanwhile_takes_one_slot() {
    let backend = Arc::new(Switchable::default());
    let q = quota(&backend, BackendDownPolicy::DegradeLocal { share: 1 }, LONG);
    let keys = leasehold::QuotaKeys::new("local").unwrap();
    // The admission of an earlier attempt whose reply was lost (ran, no reply).
    backend
        .inner
        .acquire_with_limit(
            &keys,
            "x",
            Duration::from_secs(5),
            leasehold::backend::VersionedLimit {
                limit: 2,
                version: 0,
            },
        )
        .await
        .unwrap();
    let (first, second) = acquired_while_the_circuit_opens(&backend, &q).await;
    let in_backend = backend.inner.snapshot(&keys).await.unwrap().holders;
    println!(
        "first: local={} token={} held={}; second: local={} held={}; local_leases={}; backend holders={:?}",
        first.is_local(),
        first.fencing_token(),
        first.is_held(),
        second.is_local(),
        second.is_held(),
        q.local_leases(),
        in_backend.iter().map(|h| (&h.task_id, h.token)).collect::<Vec<_>>()
    );
    assert!(
        first.is_local() && second.is_held(),
        "task x holds a backend slot (token {}) and a local one at once",
        first.fencing_token()
    );
}
