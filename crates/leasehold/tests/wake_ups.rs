//! Wake-ups of waiters in one process are never lost nor spent on nothing: two slots freed
//! before the only waiter runs stay two wake-ups, a wake-up whose attempt came back with a lease
//! the task already held, or that ended the wait with an error (the task cancelled), is passed
//! on, and a re-check of every waiter (after subscribing) keeps arrival order. Each failed before
//! its fix (memory backend; the re-check through `Switchable`).

mod common;

use std::time::{Duration, Instant};

use common::counting::Counting;
use common::waiting::{assert_refused, memory_quota, waiter};
use common::Fixture;

/// Two slots free while the only waiter `a` has not yet taken its first wake-up (its runtime is
/// busy for 60 ms, within the 100 ms a started attempt waits to be taken). The second release
/// was folded into `a`'s pending one, so a newcomer `d` queued behind `a` slept until its poll
/// with the second slot free; `a` now passes that wake-up on when it leaves.
#[test]
fn a_second_slot_freed_before_the_only_waiter_runs_is_not_lost_for_a_newcomer() {
    let main = tokio::runtime::Runtime::new().unwrap();
    let fx = main.block_on(Fixture::memory());
    let counting = Counting::new(fx.backend.clone());
    let quota = fx
        .builder(2, Duration::from_secs(30))
        .poll_interval(Duration::from_secs(5))
        .shared_backend(counting.clone())
        .build()
        .unwrap();
    let h1 = main.block_on(quota.try_acquire("h1")).unwrap();
    let h2 = main.block_on(quota.try_acquire("h2")).unwrap();

    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let app = {
        let quota = quota.clone();
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async move {
                    let a = tokio::spawn(async move {
                        quota.acquire_timeout("a", Duration::from_secs(5)).await
                    });
                    assert_refused(&counting, "a").await; // a: refused, in line
                    assert!(!a.is_finished());
                    ready_tx.send(()).unwrap();
                    std::thread::sleep(Duration::from_millis(60)); // busy: a cannot run
                    a.await.unwrap()
                })
        })
    };
    ready_rx.recv().unwrap();
    main.block_on(async {
        // Two holders let go (e.g. one release batch): two events, back to back.
        h1.release().await.unwrap();
        h2.release().await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    });
    let q = quota.clone();
    let d = main.spawn(async move {
        let started = Instant::now();
        let got = q.acquire_timeout("d", Duration::from_secs(2)).await;
        (got, started.elapsed())
    });
    let a = app.join().unwrap();
    let (d, waited) = main.block_on(d).unwrap();
    let holders = main.block_on(common::holder_ids(&quota));
    println!("a: {a:?}\nd: {d:?} after {waited:?}\nholders at the end: {holders:?} (limit 2)");
    assert!(a.is_ok());
    assert!(
        d.is_ok(),
        "d waited {waited:?} with a slot free the whole time"
    );
}

/// Two waiters of one task id (`x`, an idempotent retry) ahead of `y`. Two slots free: one
/// wake-up each goes to the two `x` waiters; the second comes back `held` with the first's lease
/// (no slot taken), and its wake-up goes on to `y` instead of being spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_spent_on_a_task_that_already_holds_is_passed_on() {
    let (quota, counting) = memory_quota(2, Duration::from_secs(5)).await;
    let h1 = quota.try_acquire("h1").await.unwrap();
    let h2 = quota.try_acquire("h2").await.unwrap();
    let waiter = |id, within| waiter(&quota, id, within);
    let x1 = waiter("x", Duration::from_secs(5));
    assert_refused(&counting, "x").await; // x1: refused, head of the line
                                          // x2 and y join the line behind x1 without attempts of their own (not observable here).
    let x2 = waiter("x", Duration::from_secs(5));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let y = waiter("y", Duration::from_secs(2));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !x1.is_finished() && !x2.is_finished() && !y.is_finished(),
        "all three wait before the releases"
    );
    h1.release().await.unwrap();
    h2.release().await.unwrap();
    let released = Instant::now();
    let (x1, x2, y) = (x1.await.unwrap(), x2.await.unwrap(), y.await.unwrap());
    let holders = common::holder_ids(&quota).await;
    println!(
        "x1: {x1:?}\nx2: {x2:?}\ny: {y:?} ({:?} after the releases)\nholders: {holders:?}",
        released.elapsed()
    );
    assert_eq!(x1.unwrap().fencing_token(), x2.unwrap().fencing_token());
    assert!(y.is_ok(), "y timed out with a slot free");
}

/// A release unheard because the waiters' subscription was still being made: once it is in
/// place, every waiter re-checks. Each checking from its own runtime, the one slot went to
/// whichever attempt reached the backend first (the younger `b` in 2–7 of 20 rounds); the
/// attempts are now started in arrival order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_re_check_after_subscribing_keeps_arrival_order() {
    use common::switchable::Switchable;
    use std::sync::Arc;
    let mut overtaken = 0;
    let rounds = 20;
    for round in 0..rounds {
        let backend = Arc::new(Switchable::default());
        let name = common::unique("recheck-order");
        let quota = || {
            common::quota_with(backend.clone(), &name, 1, Duration::from_secs(30))
                .poll_interval(Duration::from_secs(10))
                .build()
                .unwrap()
        };
        let holder = quota().try_acquire("holder").await.unwrap();
        backend.slow_subscribe(true);
        // The waiters' handle, on the same backend (the same identity), counting refusals.
        let counting = Counting::new(backend.clone());
        let waiters = common::quota_with(counting.clone(), &name, 1, Duration::from_secs(30))
            .poll_interval(Duration::from_secs(10))
            .build()
            .unwrap();
        let spawn = |id: &'static str| {
            let q = waiters.clone();
            tokio::spawn(async move { q.acquire_timeout(id, Duration::from_secs(5)).await })
        };
        let a = spawn("a");
        assert_refused(&counting, "a").await; // a: refused, in line
        let b = spawn("b");
        // b: behind a, without an attempt of its own (not observable from here).
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !a.is_finished() && !b.is_finished(),
            "round {round}: both wait"
        );
        holder.release().await.unwrap(); // unheard: not subscribed yet
        let first = tokio::select! {
            r = a => { drop(r.unwrap().unwrap()); "a" }
            r = b => { drop(r.unwrap().unwrap()); "b" }
        };
        if first == "b" {
            overtaken += 1;
            println!("round {round}: b got the slot before the older a");
        }
    }
    assert_eq!(
        overtaken, 0,
        "b overtook a in {overtaken} of {rounds} rounds"
    );
}

/// `a` was cancelled before it queued (behind `w0`, so it made no attempt of its own). When `h`
/// releases, the wake-up goes to `a`, whose attempt answers `Cancelled`: no slot taken, and the
/// wake-up goes on to `b` instead of leaving with `a` (b slept to its poll, 10 s, before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_spent_on_a_cancelled_waiter_is_passed_on() {
    let (quota, counting) = memory_quota(1, Duration::from_secs(10)).await;
    let h = quota.try_acquire("h").await.unwrap();
    let waiter = |id, within| waiter(&quota, id, within);
    let w0 = waiter("w0", Duration::from_millis(300));
    assert_refused(&counting, "w0").await; // w0: refused, in line
    assert!(!quota.cancel("a", "stop").await.unwrap());
    let a = waiter("a", Duration::from_secs(5)); // queues behind w0, no attempt yet
    tokio::time::sleep(Duration::from_millis(20)).await;
    let b = waiter("b", Duration::from_secs(2));
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(matches!(
        w0.await.unwrap(),
        Err(leasehold::Error::TimedOut { .. })
    ));
    h.release().await.unwrap();
    let released = Instant::now();
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    assert!(matches!(a, Err(leasehold::Error::Cancelled(_))), "{a:?}");
    assert!(
        b.is_ok(),
        "b timed out {:?} after the release, with the slot free",
        released.elapsed()
    );
}
