//! Cancellation and lifecycle edges, as async code meets them: acquire futures dropped at every
//! point (a `select!` against a short sleep, a tiny `timeout`, an aborted task, a future polled
//! once), waiters cancelled in the middle of the line, leases dropped on another runtime, after
//! their runtime shut down or on a thread without one, `release` raced with `lost`, every
//! `Quota` handle dropped while leases and waiters live, and a runtime shut down with leases
//! held in its tasks.
//!
//! What must hold afterwards: once every lease is dropped and `flush` has returned, the backend
//! shows no holder, the quota admits up to its limit again, and a waiter behind a full quota is
//! woken by the next release (no stale place in the line swallows it).

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::counting::Counting;
use common::Fixture;
use leasehold::{Error, Lease, LostReason, Quota};
use rand::Rng;

/// The poll interval of the quotas that must be woken by releases, not by polls: a waiter that
/// only gets its slot from a poll takes seconds, which the bounds below tell apart.
const NO_POLL: Duration = Duration::from_secs(10);

/// A quota of `f` woken by releases, not by polls ([`NO_POLL`]), warmed up.
async fn release_woken_quota(f: &Fixture, limit: u64, ttl: Duration) -> Quota {
    let quota = f
        .builder(limit, ttl)
        .poll_interval(NO_POLL)
        .build()
        .unwrap();
    common::warm_up(&quota).await;
    quota
}

/// Awaits `fut`, failing the test after `within`.
async fn within<T>(within: Duration, what: &str, fut: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(within, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {within:?}"),
    }
}

/// Checks that `quota` is back to normal once everything is dropped and flushed: no holder in
/// the backend, `limit` admissions in a row, then a waiter behind the full quota woken by a
/// release within `wake_within` (the quota's polls are [`NO_POLL`] apart or more).
async fn back_to_normal(quota: &Quota, limit: usize, wake_within: Duration) {
    within(Duration::from_secs(5), "flush", quota.flush()).await;
    let holders = common::holder_ids(quota).await;
    assert!(holders.is_empty(), "slots left taken: {holders:?}");
    let mut fresh = Vec::new();
    for i in 0..limit {
        let lease = quota.try_acquire(&format!("fresh-{i}")).await;
        fresh.push(lease.unwrap_or_else(|e| panic!("fresh acquire {i} of {limit}: {e}")));
    }
    assert!(
        matches!(
            quota.try_acquire("one-too-many").await,
            Err(Error::Full { .. })
        ),
        "admitted above the limit"
    );
    let waiter = tokio::spawn({
        let quota = quota.clone();
        async move {
            let lease = quota.acquire("late").await;
            (lease, Instant::now())
        }
    });
    // The waiter is refused (in line) before the release below, most of the time; either way it
    // must get the slot on the release, not on a poll.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let released = Instant::now();
    fresh.pop().unwrap().release().await.unwrap();
    let (lease, at) = within(Duration::from_secs(5), "the late waiter", waiter)
        .await
        .unwrap();
    let lease = lease.unwrap();
    let took = at.saturating_duration_since(released);
    println!("a waiter behind the full quota got the freed slot {took:?} after the release");
    assert!(
        took < wake_within,
        "the waiter got the freed slot only after {took:?}: a wake-up went astray"
    );
    drop(lease);
    drop(fresh);
    quota.flush().await;
    assert!(common::holder_ids(quota).await.is_empty());
}

/// One way of giving up on an acquire, picked at random by [`cancel_one`].
#[derive(Debug, Clone, Copy)]
enum GiveUp {
    /// `select!` between `acquire` and a sleep.
    SelectAcquire,
    /// `tokio::time::timeout` around `acquire`.
    TimeoutAcquire,
    /// `acquire_timeout` with a tiny timeout.
    AcquireTimeout,
    /// `acquire` in a task of its own, aborted.
    Abort,
    /// `select!` between `try_acquire` and a sleep.
    SelectTry,
    /// `timeout` around an `acquire_timeout` of its own, longer one.
    Nested,
    /// `acquire` polled a few times (1 to 4, yielding in between), then dropped: shorter than
    /// any timer (Tokio's are rounded up to the millisecond).
    Polls,
}

const GIVE_UPS: [GiveUp; 7] = [
    GiveUp::SelectAcquire,
    GiveUp::TimeoutAcquire,
    GiveUp::AcquireTimeout,
    GiveUp::Abort,
    GiveUp::SelectTry,
    GiveUp::Nested,
    GiveUp::Polls,
];

/// Polls `fut` up to `polls` times, yielding to the runtime in between; its output if it was
/// ready by then.
async fn poll_then_drop<F: std::future::Future>(fut: F, polls: u32) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    for _ in 0..polls {
        let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx)));
        if let std::task::Poll::Ready(v) = polled.await {
            return Some(v);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// Acquires `id`, giving up after `after` in the way `how`; returns the lease if one came back
/// first. Fails on any outcome but a lease, a time-out or `Full`.
async fn cancel_one(quota: Quota, id: String, how: GiveUp, after: Duration) -> Option<Lease> {
    let checked = |r: Result<Lease, Error>| match r {
        Ok(lease) => Some(lease),
        Err(Error::TimedOut { .. }) => None,
        Err(Error::Full { .. }) if matches!(how, GiveUp::SelectTry) => None,
        Err(e) => panic!("{how:?} {id}: unexpected error {e}"),
    };
    match how {
        GiveUp::SelectAcquire => tokio::select! {
            r = quota.acquire(&id) => checked(r),
            _ = tokio::time::sleep(after) => None,
        },
        GiveUp::TimeoutAcquire => match tokio::time::timeout(after, quota.acquire(&id)).await {
            Ok(r) => checked(r),
            Err(_) => None,
        },
        GiveUp::AcquireTimeout => checked(quota.acquire_timeout(&id, after).await),
        GiveUp::Abort => {
            let task = tokio::spawn({
                let (quota, id) = (quota.clone(), id.clone());
                async move { quota.acquire(&id).await }
            });
            tokio::time::sleep(after).await;
            task.abort();
            match task.await {
                Ok(r) => checked(r),
                Err(e) => {
                    assert!(e.is_cancelled(), "{id}: {e}");
                    None
                }
            }
        }
        GiveUp::SelectTry => tokio::select! {
            r = quota.try_acquire(&id) => checked(r),
            _ = tokio::time::sleep(after) => None,
        },
        GiveUp::Polls => {
            let polls = 1 + (after.as_micros() % 4) as u32;
            poll_then_drop(quota.acquire(&id), polls)
                .await
                .and_then(checked)
        }
        GiveUp::Nested => {
            let inner = quota.acquire_timeout(&id, after * 2 + Duration::from_millis(1));
            match tokio::time::timeout(after, inner).await {
                Ok(r) => checked(r),
                Err(_) => None,
            }
        }
    }
}

/// Hundreds of acquires given up at random points (before the first poll, during the first
/// attempt, in line, while a release event's attempt is out for them, just after they won),
/// mixed with leases held for random times, so that the quota is often full and waiters queue.
async fn acquires_given_up_at_random_points_leave_nothing_behind(f: Fixture) {
    const LIMIT: usize = 3;
    let quota = release_woken_quota(&f, LIMIT as u64, Duration::from_secs(10)).await;
    let stop_at = Instant::now() + Duration::from_millis(2500);
    let (mut rounds, mut won, mut given_up) = (0, 0, 0);
    let mut kept: Vec<Lease> = Vec::new();
    while rounds < 150 && Instant::now() < stop_at {
        let mut tasks = Vec::new();
        for k in 0..6 {
            let mut rng = rand::rng();
            let how = GIVE_UPS[rng.random_range(0..GIVE_UPS.len())];
            // Zero polls the future once; a few ms reaches the backend and back.
            let after = match rng.random_range(0..4) {
                0 => Duration::ZERO,
                _ => Duration::from_micros(rng.random_range(1..4000)),
            };
            let hold = Duration::from_micros(rng.random_range(0..3000));
            let id = format!("r{rounds}-{k}");
            let quota = quota.clone();
            tasks.push(tokio::spawn(async move {
                let lease = cancel_one(quota, id, how, after).await;
                if lease.is_some() {
                    tokio::time::sleep(hold).await;
                }
                lease
            }));
        }
        for task in tasks {
            match task.await.unwrap() {
                Some(lease) => {
                    won += 1;
                    // Some are kept across rounds (up to the limit less one), the others
                    // dropped: released in the background.
                    if kept.len() < LIMIT - 1 && rand::rng().random_bool(0.3) {
                        kept.push(lease);
                    }
                }
                None => given_up += 1,
            }
        }
        if !kept.is_empty() && rand::rng().random_bool(0.3) {
            let lease = kept.swap_remove(0);
            if rand::rng().random_bool(0.5) {
                lease.release().await.unwrap();
            }
        }
        rounds += 1;
    }
    println!("{rounds} rounds: {won} leases won, {given_up} acquires given up");
    assert!(won > 0 && given_up > 0, "the mix tested nothing");
    drop(kept);
    back_to_normal(&quota, LIMIT, Duration::from_secs(1)).await;
}

/// Retries of one task id, each given up quickly (the usual retry loop): an admission a retry
/// left behind is either shared by a later retry or released, never released under the retry
/// that returned it. Whenever a retry returns a lease, the backend holds that very admission
/// (same fencing token) a moment later, and it goes once the lease is dropped.
async fn retries_of_one_task_given_up_never_lose_the_lease_they_return(f: Fixture) {
    const LIMIT: usize = 2;
    let quota = release_woken_quota(&f, LIMIT as u64, Duration::from_secs(10)).await;
    let stop_at = Instant::now() + Duration::from_millis(2500);
    let (mut tries, mut won) = (0, 0);
    while tries < 200 && Instant::now() < stop_at {
        // Mostly shorter than a round trip: retries give up and leave admissions behind.
        let after = Duration::from_micros(rand::rng().random_range(0..400));
        let how = GIVE_UPS[tries % GIVE_UPS.len()];
        tries += 1;
        let Some(lease) = cancel_one(quota.clone(), "same".into(), how, after).await else {
            continue;
        };
        won += 1;
        // Earlier retries' admissions, given up, are let go meanwhile (within 2 s at most).
        tokio::time::sleep(Duration::from_millis(20)).await;
        let status = quota.status().await.unwrap();
        let tokens: Vec<_> = status.holders.iter().map(|h| h.fencing_token).collect();
        assert_eq!(
            tokens,
            [lease.fencing_token()],
            "try {tries} ({how:?}): the lease returned is not the one held ({:?})",
            lease.lost_reason()
        );
        assert!(lease.is_held(), "try {tries}: {:?}", lease.lost_reason());
        drop(lease);
        within(Duration::from_secs(5), "flush", quota.flush()).await;
        assert!(common::holder_ids(&quota).await.is_empty(), "try {tries}");
    }
    println!("{tries} retries, {won} returned a lease");
    assert!(won > 0, "no retry returned a lease");
    back_to_normal(&quota, LIMIT, Duration::from_secs(1)).await;
}

/// A quota of limit 1 held by "holder", with waiters `ids` in line in that order (each refused
/// before the next joins), recording the order in which they get the slot; each holds it 20 ms.
struct Line {
    quota: Quota,
    holder: Option<Lease>,
    order: Arc<Mutex<Vec<String>>>,
    waiters: Vec<(String, tokio::task::JoinHandle<()>)>,
}

impl Line {
    async fn new(f: &Fixture, ids: &[&str]) -> Line {
        let counting = Counting::new(f.backend.clone());
        let quota = common::quota_with(counting.clone(), &f.name, 1, Duration::from_secs(10))
            .poll_interval(NO_POLL)
            .build()
            .unwrap();
        common::warm_up(&quota).await;
        let holder = Some(quota.try_acquire("holder").await.unwrap());
        let order: Arc<Mutex<Vec<String>>> = Arc::default();
        let mut waiters = Vec::new();
        for id in ids {
            let (quota, order, id_owned) = (quota.clone(), order.clone(), id.to_string());
            let task = tokio::spawn(async move {
                let lease = quota.acquire(&id_owned).await.unwrap();
                order.lock().unwrap().push(id_owned);
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(lease);
            });
            if waiters.is_empty() {
                // The first is refused once, and heads the line.
                assert!(
                    counting.all_refused(&[id], Duration::from_secs(3)).await,
                    "{id} was never refused"
                );
            } else {
                // The others join behind it without an attempt of their own (nothing to watch
                // for): their place is taken at their first poll.
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            waiters.push((id.to_string(), task));
        }
        Line {
            quota,
            holder,
            order,
            waiters,
        }
    }

    /// Aborts waiter `id` and returns once its task has ended (its place in line dropped).
    async fn abort(&mut self, id: &str) {
        let at = self.waiters.iter().position(|(w, _)| w == id).unwrap();
        let (_, task) = self.waiters.remove(at);
        task.abort();
        let ended = within(Duration::from_secs(4), id, task).await;
        assert!(
            ended.unwrap_err().is_cancelled(),
            "{id} ended before its abort"
        );
    }

    /// Releases the holder and waits for every waiter not aborted; returns the order.
    async fn run(mut self, release: bool) -> Vec<String> {
        if release {
            self.holder.take().unwrap().release().await.unwrap();
        }
        for (id, task) in self.waiters.drain(..) {
            let done = within(Duration::from_secs(4), &id, task).await;
            assert!(
                done.is_ok() || done.as_ref().unwrap_err().is_cancelled(),
                "{id}: {done:?}"
            );
        }
        let order = self.order.lock().unwrap().clone();
        order
    }
}

/// Waiters cancelled in the middle of the line (and at its head) do not hold it up: the others
/// are served in arrival order, each on the previous one's release, not on a poll.
async fn waiters_cancelled_in_the_line_are_skipped(f: Fixture) {
    let mut line = Line::new(&f, &["a", "b", "c", "d", "e", "f"]).await;
    line.abort("a").await; // the head
    line.abort("c").await;
    line.abort("d").await; // two in a row
    let quota = line.quota.clone();
    let started = Instant::now();
    let order = line.run(true).await;
    let took = started.elapsed();
    println!("served {order:?} in {took:?}");
    assert_eq!(order, ["b", "e", "f"]);
    // Three hand-overs of 20 ms each: polls (10 s apart) would take far longer.
    assert!(took < Duration::from_secs(3), "served by polls: {took:?}");
    back_to_normal(&quota, 1, Duration::from_secs(1)).await;
}

/// The head of the line is cancelled just as a release wakes it (its attempt, started by the
/// release event, may be out, may have won the slot, or the waiter may have just returned the
/// lease): the next waiter must get the slot all the same, on a release, not on a poll.
async fn a_waiter_cancelled_as_it_is_woken_passes_the_slot_on(f: Fixture) {
    for i in 0..8 {
        let line = Line::new(&f, &["a", "b"]).await;
        let mut line = line;
        let holder = line.holder.take().unwrap();
        let (_, a) = line.waiters.remove(0);
        // Mostly within the release's round trip and the attempt the event starts for `a`.
        let gap = Duration::from_micros(match i % 2 {
            0 => rand::rng().random_range(0..400),
            _ => rand::rng().random_range(0..3000),
        });
        let started = Instant::now();
        drop(holder); // released in the background: the event reaches `a` soon after
        tokio::time::sleep(gap).await;
        a.abort();
        let _ = a.await; // a lease `a` got before the abort is dropped here
        let quota = line.quota.clone();
        let order = line.run(false).await;
        let took = started.elapsed();
        println!("round {i}: abort {gap:?} after the release; served {order:?} in {took:?}");
        assert!(
            order.last().map(String::as_str) == Some("b"),
            "round {i}: b was not served: {order:?}"
        );
        assert!(
            took < Duration::from_secs(2),
            "round {i}: b waited {took:?}"
        );
        quota.flush().await;
        assert!(common::holder_ids(&quota).await.is_empty(), "round {i}");
    }
}

/// `lost()` awaited by many tasks at once, while clones of the lease are released and dropped
/// from several tasks at the same time: every `release` succeeds, every `lost` resolves with
/// `Released`, and the slot is freed once.
async fn release_raced_with_lost_and_drops(f: Fixture) {
    let quota = release_woken_quota(&f, 1, Duration::from_secs(10)).await;
    for round in 0..30 {
        let lease = quota.try_acquire(&format!("t{round}")).await.unwrap();
        let mut losts = Vec::new();
        for _ in 0..8 {
            let lease = lease.clone();
            losts.push(tokio::spawn(async move { lease.lost().await }));
        }
        let mut releases = Vec::new();
        for k in 0..4 {
            let lease = lease.clone();
            releases.push(tokio::spawn(async move {
                match k {
                    0 | 1 => lease.release().await,
                    // A release given up at once: it is sent all the same.
                    2 => {
                        let _ = tokio::time::timeout(Duration::ZERO, lease.release()).await;
                        Ok(())
                    }
                    _ => {
                        drop(lease);
                        Ok(())
                    }
                }
            }));
        }
        drop(lease);
        for r in releases {
            within(Duration::from_secs(2), "release", r)
                .await
                .unwrap()
                .unwrap();
        }
        for l in losts {
            let reason = within(Duration::from_secs(2), "lost", l).await.unwrap();
            assert_eq!(reason, LostReason::Released, "round {round}");
        }
        // The next round's try_acquire must find the slot free: flush first.
        quota.flush().await;
        assert!(common::holder_ids(&quota).await.is_empty(), "round {round}");
    }
    back_to_normal(&quota, 1, Duration::from_secs(1)).await;
}

/// A lease released by someone else (the operator's `force_release`, through another handle):
/// every task awaiting its `lost()` hears it, and its own later release is harmless.
async fn lost_awaited_by_many_tasks_hears_a_release_elsewhere(f: Fixture) {
    let ttl = Duration::from_secs(2);
    let quota = release_woken_quota(&f, 2, ttl).await;
    let operator = common::quota_with(f.second_client().await, &f.name, 2, ttl)
        .build()
        .unwrap();
    let lease = quota.try_acquire("t").await.unwrap();
    let losts: Vec<_> = (0..16)
        .map(|_| {
            let lease = lease.clone();
            tokio::spawn(async move { lease.lost().await })
        })
        .collect();
    assert!(operator.force_release("t").await.unwrap());
    for l in losts {
        // The event says `ReleasedElsewhere`; if it were lost, the next renewal (ttl / 3) says
        // `Expired`.
        let reason = within(Duration::from_secs(3), "lost", l).await.unwrap();
        assert!(
            matches!(reason, LostReason::ReleasedElsewhere | LostReason::Expired),
            "{reason:?}"
        );
    }
    lease.release().await.unwrap();
    drop(lease);
    back_to_normal(&quota, 2, Duration::from_secs(1)).await;
}

conformance!(
    acquires_given_up_at_random_points_leave_nothing_behind,
    retries_of_one_task_given_up_never_lose_the_lease_they_return,
    waiters_cancelled_in_the_line_are_skipped,
    a_waiter_cancelled_as_it_is_woken_passes_the_slot_on,
    release_raced_with_lost_and_drops,
    lost_awaited_by_many_tasks_hears_a_release_elsewhere,
);

// ---------------------------------------------------------------------------------------------
// Runtimes: leases outliving the runtime that acquired them, dropped on threads without one.

/// A fixture built on `rt`, and a quota on it with a short ttl.
fn on_runtime(rt: &tokio::runtime::Runtime, redis: bool, limit: u64) -> (Fixture, Quota) {
    rt.block_on(async {
        let f = match redis {
            true => Fixture::redis().await,
            false => Fixture::memory().await,
        };
        let quota = f
            .builder(limit, Duration::from_millis(900))
            .poll_interval(NO_POLL)
            .build()
            .unwrap();
        (f, quota)
    })
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Leases acquired on a runtime that then shuts down: those held by its tasks are dropped with
/// them and released; those the test keeps go on being renewed past their ttl, are released by
/// `release` awaited on another runtime, or by a drop on a plain thread.
fn leases_outlive_the_runtime_that_acquired_them(redis: bool) {
    let observer = current_thread();
    let (_f, quota) = on_runtime(&observer, redis, 4);
    observer.block_on(common::warm_up(&quota));
    let app = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (kept, released_elsewhere) = app.block_on(async {
        let kept = quota.try_acquire("kept").await.unwrap();
        let other = quota.try_acquire("released-elsewhere").await.unwrap();
        (kept, other)
    });
    let (tx, rx) = std::sync::mpsc::channel();
    for id in ["in-task-1", "in-task-2"] {
        let (quota, tx) = (quota.clone(), tx.clone());
        app.spawn(async move {
            let lease = quota.acquire(id).await.unwrap();
            tx.send(()).unwrap();
            std::future::pending::<()>().await;
            drop(lease);
        });
    }
    for _ in 0..2 {
        rx.recv_timeout(Duration::from_secs(3)).unwrap();
    }
    // A waiter of the app runtime, behind a full quota, dropped with its runtime too.
    // (The quota is full: `kept`, `released-elsewhere` and the two tasks' leases.)
    let q = quota.clone();
    app.spawn(async move { q.acquire("waiting").await });
    observer.block_on(async { tokio::time::sleep(Duration::from_millis(50)).await });
    let shut = Instant::now();
    app.shutdown_timeout(Duration::from_secs(1));
    println!("app runtime shut down in {:?}", shut.elapsed());
    observer.block_on(async {
        // The tasks' leases were dropped with their tasks: released in the background.
        quota.flush().await;
        let mut holders = common::holder_ids(&quota).await;
        holders.sort();
        assert_eq!(holders, ["kept", "released-elsewhere"]);
        // Renewed by leasehold's own thread, whatever runtime acquired them: still held
        // after two ttls.
        tokio::time::sleep(Duration::from_millis(1800)).await;
        assert!(kept.is_held(), "{:?}", kept.lost_reason());
        assert!(released_elsewhere.is_held());
        released_elsewhere.release().await.unwrap();
        assert_eq!(common::holder_ids(&quota).await, ["kept"]);
    });
    // Dropped on a thread that has no runtime at all.
    std::thread::spawn(move || drop(kept)).join().unwrap();
    observer.block_on(async {
        quota.flush().await;
        assert!(common::holder_ids(&quota).await.is_empty());
    });
}

#[test]
fn memory_leases_outlive_the_runtime_that_acquired_them() {
    leases_outlive_the_runtime_that_acquired_them(false);
}

#[test]
fn redis_leases_outlive_the_runtime_that_acquired_them() {
    leases_outlive_the_runtime_that_acquired_them(true);
}

/// A lease moved to another task and from there to another runtime, its loss watched on a
/// third (through `lost_token`: a clone awaiting `lost()` would keep the lease alive): the drop
/// on the last one frees the slot, and the watcher hears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_moved_across_tasks_and_runtimes_is_released_once() {
    let f = Fixture::redis().await;
    let quota = f.builder(1, Duration::from_secs(5)).build().unwrap();
    let lease = quota.try_acquire("moved").await.unwrap();
    let watcher = {
        let lost = lease.lost_token();
        std::thread::spawn(move || current_thread().block_on(lost.cancelled_owned()))
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<Lease>();
    let hop = tokio::spawn(async move {
        let lease = rx.await.unwrap();
        // Then to a thread with a runtime of its own, which drops it there.
        std::thread::spawn(move || current_thread().block_on(async move { drop(lease) }))
            .join()
            .unwrap();
    });
    tx.send(lease).unwrap();
    within(Duration::from_secs(3), "hop", hop).await.unwrap();
    within(
        Duration::from_secs(3),
        "watcher",
        tokio::task::spawn_blocking(move || watcher.join().unwrap()),
    )
    .await
    .unwrap();
    quota.flush().await;
    assert!(common::holder_ids(&quota).await.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Handles dropped, backend gone.

/// Every `Quota` handle but a waiter's dropped while a lease lives: the lease goes on being
/// renewed, its drop frees the slot, and the waiter gets it on that release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_every_handle_keeps_leases_and_waiters_working() {
    let f = Fixture::redis().await;
    let ttl = Duration::from_millis(900);
    let backend = leasehold::RedisBackend::connect(&f.server.as_ref().unwrap().url())
        .await
        .unwrap();
    // The backend is owned by the quota: dropping the handles drops it unless something else
    // keeps it.
    let quota = Quota::builder(f.name.clone())
        .limit(1)
        .ttl(ttl)
        .poll_interval(NO_POLL)
        .backend(backend)
        .build()
        .unwrap();
    let observer = f.quota(1, ttl);
    let lease = quota.try_acquire("held").await.unwrap();
    let waiter = tokio::spawn({
        let quota = quota.clone();
        async move { quota.acquire("waiting").await.map(|l| (l, Instant::now())) }
    });
    let (server, channel) = (f.server.as_ref().unwrap(), f.keys().events);
    assert!(
        common::eventually(Duration::from_secs(2), || common::subscribers(
            server, &channel
        ) == 1)
        .await,
        "the waiting quota never subscribed to {channel}"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(quota); // the waiter's clone is the only handle left
    tokio::time::sleep(ttl * 2).await;
    assert!(lease.is_held(), "{:?}", lease.lost_reason());
    assert_eq!(common::holder_ids(&observer).await, ["held"]);
    let released = Instant::now();
    drop(lease);
    let (lease, at) = within(Duration::from_secs(3), "waiter", waiter)
        .await
        .unwrap()
        .unwrap();
    println!("waiter served {:?} after the drop", at - released);
    assert!(at - released < Duration::from_secs(1));
    assert_eq!(common::holder_ids(&observer).await, ["waiting"]);
    // The last handle goes with the waiter's lease, which is still released.
    drop(lease);
    let end = Instant::now() + Duration::from_secs(2);
    while !common::holder_ids(&observer).await.is_empty() && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(common::holder_ids(&observer).await.is_empty());
    // And nothing of the quota stays subscribed once its last handle and lease are gone.
    assert!(
        common::eventually(Duration::from_secs(2), || common::subscribers(
            server, &channel
        ) == 0)
        .await,
        "still subscribed to {channel} with no handle left"
    );
}

/// The Redis server goes away while a lease is held and waiters wait: the waiters get an error
/// (fail closed), not a wait for ever, and the lease ends at its local deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_and_holders_end_when_the_server_goes_away() {
    let mut f = Fixture::redis().await;
    let ttl = Duration::from_millis(900);
    let quota = f.builder(1, ttl).poll_interval(NO_POLL).build().unwrap();
    let lease = quota.try_acquire("held").await.unwrap();
    let waiters: Vec<_> = (0..3)
        .map(|i| {
            let quota = quota.clone();
            tokio::spawn(async move { quota.acquire(&format!("w{i}")).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let gone = Instant::now();
    drop(f.server.take());
    let reason = within(Duration::from_secs(3), "lost", lease.lost()).await;
    println!(
        "lease lost {:?} after the server went: {reason:?}",
        gone.elapsed()
    );
    assert_eq!(reason, LostReason::LocalDeadline);
    for w in waiters {
        let r = within(Duration::from_secs(4), "waiter", w).await.unwrap();
        assert!(matches!(r, Err(Error::BackendUnavailable { .. })), "{r:?}");
    }
    println!("waiters ended {:?} after the server went", gone.elapsed());
    drop(lease);
    within(Duration::from_secs(4), "flush", quota.flush()).await;
}

// ---------------------------------------------------------------------------------------------
// A runtime shut down with leases held in its tasks.

/// `#[tokio::main]` returning drops its tasks, and with them their leases: each drop hands its
/// release to leasehold's thread. In a process that lives on, they all arrive; how long after
/// the shutdown is measured here. (A process that exits at once loses them unless it flushes:
/// `processes.rs`, `a_process_that_flushes_before_exiting_leaves_no_lease_behind`.)
#[test]
fn a_runtime_shut_down_with_leases_in_its_tasks_releases_them() {
    let observer = current_thread();
    let (_f, quota) = on_runtime(&observer, true, 8);
    observer.block_on(common::warm_up(&quota));
    let app = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    for i in 0..8 {
        let (quota, tx) = (quota.clone(), tx.clone());
        app.spawn(async move {
            let _lease = quota.acquire(&format!("task-{i}")).await.unwrap();
            tx.send(()).unwrap();
            std::future::pending::<()>().await;
        });
    }
    for _ in 0..8 {
        rx.recv_timeout(Duration::from_secs(3)).unwrap();
    }
    let shut = Instant::now();
    drop(app); // as `#[tokio::main]` does when `main` returns
    let freed = observer.block_on(async {
        let mut left = common::holder_ids(&quota).await.len();
        while left > 0 && shut.elapsed() < Duration::from_secs(3) {
            tokio::time::sleep(Duration::from_millis(1)).await;
            left = common::holder_ids(&quota).await.len();
        }
        left
    });
    println!(
        "8 leases in tasks of a runtime dropped: {} left after {:?}",
        freed,
        shut.elapsed()
    );
    assert_eq!(freed, 0);
}

/// Documented, but a trap for `select!`-heavy code: a clone of a lease kept by a task that
/// awaits its `lost()` keeps the lease held (and renewed) after every other handle is dropped.
/// Watch `lost_token()` instead, which holds no handle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_awaiting_lost_keeps_the_lease_held() {
    let f = Fixture::memory().await;
    let quota = f.builder(1, Duration::from_millis(600)).build().unwrap();
    let lease = quota.try_acquire("watched").await.unwrap();
    let by_token = tokio::spawn(lease.lost_token().cancelled_owned());
    let by_clone = tokio::spawn({
        let lease = lease.clone();
        async move { lease.lost().await }
    });
    drop(lease);
    tokio::time::sleep(Duration::from_millis(1500)).await; // over two ttls
    quota.flush().await;
    assert_eq!(common::holder_ids(&quota).await, ["watched"]);
    assert!(!by_token.is_finished() && !by_clone.is_finished());
    by_clone.abort(); // the watcher goes, and its clone with it: released
    let _ = by_clone.await;
    within(Duration::from_secs(2), "lost_token", by_token)
        .await
        .unwrap();
    quota.flush().await;
    assert!(common::holder_ids(&quota).await.is_empty());
}

/// A minimal executor that is not Tokio: polls `fut` on this thread, parking in between.
fn block_on_without_tokio<F: std::future::Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(Unpark(std::thread::current())).into();
    let mut cx = std::task::Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_millis(50));
    }
}

/// `try_acquire`, `release`, `lost` and `status` need no runtime of the caller's (rustdoc of
/// `Quota::acquire`): from another executor, on a thread that has no Tokio runtime, they work,
/// and a lease dropped there is released.
#[test]
fn leases_work_from_a_thread_without_a_tokio_runtime() {
    let observer = current_thread();
    let (_f, quota) = on_runtime(&observer, true, 2);
    let q = quota.clone();
    std::thread::spawn(move || {
        block_on_without_tokio(async {
            let a = q.try_acquire("a").await.unwrap();
            let b = q.try_acquire("b").await.unwrap();
            assert!(matches!(q.try_acquire("c").await, Err(Error::Full { .. })));
            a.release().await.unwrap();
            assert_eq!(a.lost().await, LostReason::Released);
            assert_eq!(common::holder_ids(&q).await, ["b"]);
            drop(b);
        })
    })
    .join()
    .unwrap();
    observer.block_on(async {
        quota.flush().await;
        assert!(common::holder_ids(&quota).await.is_empty());
    });
}

// ---------------------------------------------------------------------------------------------
// A process whose `#[tokio::main]` returns with leases alive.

/// Set in the child process of `main_returning_with_live_leases`: the Redis URL, the quota name,
/// and whether the child flushes.
const CHILD_ENV: &str = "LEASEHOLD_CANCELLATION_CHILD";

/// The child: what `#[tokio::main] async fn main` expands to, with 8 leases alive in `main`'s
/// scope (`let _lease = ...`), dropped when its body ends; the runtime is dropped, then the
/// process exits, as it does when `main` returns. With "flush" the leases are dropped and
/// flushed first, as the README asks. Run only by the parent below (`--ignored`).
#[test]
#[ignore = "the child process of main_returning_with_live_leases"]
fn main_returning_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split(' ').collect();
    let (url, name, flush) = (parts[0], parts[1], parts[2] == "flush");
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let backend = leasehold::RedisBackend::connect(url).await.unwrap();
            let quota = Quota::builder(name)
                .limit(8)
                .ttl(Duration::from_secs(1))
                .backend(backend)
                .build()
                .unwrap();
            let mut leases = Vec::new();
            for i in 0..8 {
                leases.push(quota.try_acquire(&format!("t{i}")).await.unwrap());
            }
            if flush {
                drop(leases);
                quota.flush().await;
            } else {
                let _leases = leases; // alive until the end of `main`'s body
            }
        });
    std::process::exit(0);
}

/// Measures what happens to the slots of leases alive when `#[tokio::main]` returns: dropped at
/// the end of `main`'s body, their releases go to leasehold's thread, which dies with the process
/// (documented: README, "Before the process exits"; `Lease`). Leftovers must expire one ttl later;
/// with drop-then-flush, none is left.
#[test]
fn main_returning_with_live_leases() {
    let observer = current_thread();
    let (f, quota) = on_runtime(&observer, true, 8);
    let url = f.server.as_ref().unwrap().url();
    let exe = std::env::current_exe().unwrap();
    let run = |flush: &str| -> usize {
        let status = std::process::Command::new(&exe)
            .args([
                "--exact",
                "main_returning_child",
                "--ignored",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, format!("{url} {} {flush}", f.name))
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "child: {status}");
        observer.block_on(common::holder_ids(&quota)).len()
    };
    let mut left = Vec::new();
    for _ in 0..3 {
        left.push(run("no"));
        // Leftovers expire one ttl (1 s) after the child's last heartbeat.
        observer.block_on(async {
            let end = Instant::now() + Duration::from_secs(3);
            while !common::holder_ids(&quota).await.is_empty() && Instant::now() < end {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        assert!(observer.block_on(common::holder_ids(&quota)).is_empty());
    }
    println!("main returned with 8 live leases: {left:?} of 8 left held after exit (3 runs)");
    let flushed = run("flush");
    println!("drop, flush, return: {flushed} of 8 left");
    assert_eq!(flushed, 0);
}

// ---------------------------------------------------------------------------------------------
// Expiries and the backend-down policy.

/// Only the head of the line arms a timer to the earliest lease deadline (nobody announces an
/// expiry). The head cancelled before the expiry: the waiter promoted in its place must take
/// the slot at the expiry, not at the line's next poll (here up to a ttl later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waiter_promoted_when_the_head_is_cancelled_takes_the_slot_at_the_expiry() {
    for f in [Fixture::memory().await, Fixture::redis().await] {
        let ttl = Duration::from_millis(2000);
        let quota = release_woken_quota(&f, 1, ttl).await;
        let crashed = quota.try_acquire("crashed").await.unwrap();
        let expires = Instant::now() + ttl;
        // Its slot comes back only when its deadline passes.
        crashed.abandon();
        // The line behind the head polls one ttl after `next` joins (the poll interval is
        // longer): about 900 ms after the expiry, which the bound below tells apart.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let head = tokio::spawn({
            let quota = quota.clone();
            async move { quota.acquire("head").await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let next = tokio::spawn({
            let quota = quota.clone();
            async move { quota.acquire("next").await.map(|l| (l, Instant::now())) }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        head.abort();
        assert!(head.await.unwrap_err().is_cancelled());
        let (lease, at) = within(Duration::from_secs(5), "next", next)
            .await
            .unwrap()
            .unwrap();
        let late = at.saturating_duration_since(expires);
        println!(
            "{}: the promoted waiter got the expired slot {late:?} after the expiry",
            f.name
        );
        assert!(
            late < Duration::from_millis(450),
            "the promoted waiter waited {late:?} past the expiry: no timer armed"
        );
        drop(lease);
        quota.flush().await;
        assert!(common::holder_ids(&quota).await.is_empty());
    }
}

/// Acquires given up while the backend is down and `DegradeLocal` grants local leases (the
/// circuit kept closed, so every attempt goes out and fails): a local lease nobody took is
/// given back, and the local share is whole again afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_given_up_while_the_backend_is_down_give_their_local_share_back() {
    use common::switchable::Switchable;
    use leasehold::{BackendDownPolicy, BreakerConfig};
    const SHARE: u32 = 2;
    let backend = Arc::new(Switchable::default());
    let quota = common::quota_with(backend.clone(), "down", 4, Duration::from_secs(5))
        .when_backend_down(BackendDownPolicy::DegradeLocal { share: SHARE })
        .breaker(BreakerConfig {
            failures_to_open: u32::MAX,
            cool_down: Duration::from_secs(30),
        })
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    common::warm_up(&quota).await;
    backend.set_down(true);
    let (mut won, mut given_up) = (0, 0);
    for round in 0..60 {
        let mut tasks = Vec::new();
        for k in 0..4 {
            let mut rng = rand::rng();
            let how = GIVE_UPS[rng.random_range(0..GIVE_UPS.len())];
            let after = Duration::from_micros(rng.random_range(0..2000));
            let quota = quota.clone();
            tasks.push(tokio::spawn(cancel_one_while_down(
                quota,
                format!("d{round}-{k}"),
                how,
                after,
            )));
        }
        for task in tasks {
            match task.await.unwrap() {
                Some(lease) => {
                    assert!(lease.is_local());
                    won += 1;
                }
                None => given_up += 1,
            }
        }
    }
    println!("backend down: {won} local leases won, {given_up} acquires given up");
    within(Duration::from_secs(5), "flush", quota.flush()).await;
    assert_eq!(quota.local_leases(), 0, "local slots left taken");
    let fresh: Vec<_> = futures_all(&quota, SHARE).await;
    assert!(fresh.iter().all(Lease::is_local));
    assert_eq!(quota.local_leases(), SHARE);
}

/// Like [`cancel_one`], but `Full` (the local share used up) and `BackendUnavailable` are
/// expected answers too.
async fn cancel_one_while_down(
    quota: Quota,
    id: String,
    how: GiveUp,
    after: Duration,
) -> Option<Lease> {
    let fut = cancel_one_any(quota, id.clone(), how, after);
    match fut.await {
        Some(Ok(lease)) => Some(lease),
        Some(Err(
            Error::TimedOut { .. } | Error::Full { .. } | Error::BackendUnavailable { .. },
        )) => None,
        Some(Err(e)) => panic!("{how:?} {id}: unexpected error {e}"),
        None => None,
    }
}

/// [`cancel_one`]'s ways of giving up, returning whatever came back before.
async fn cancel_one_any(
    quota: Quota,
    id: String,
    how: GiveUp,
    after: Duration,
) -> Option<Result<Lease, Error>> {
    match how {
        GiveUp::SelectAcquire | GiveUp::Nested | GiveUp::Abort => tokio::select! {
            r = quota.acquire(&id) => Some(r),
            _ = tokio::time::sleep(after) => None,
        },
        GiveUp::TimeoutAcquire => tokio::time::timeout(after, quota.acquire(&id)).await.ok(),
        GiveUp::AcquireTimeout => Some(quota.acquire_timeout(&id, after).await),
        GiveUp::SelectTry => tokio::select! {
            r = quota.try_acquire(&id) => Some(r),
            _ = tokio::time::sleep(after) => None,
        },
        GiveUp::Polls => {
            let polls = 1 + (after.as_micros() % 4) as u32;
            poll_then_drop(quota.acquire(&id), polls).await
        }
    }
}

/// `n` leases of fresh task ids, one after another.
async fn futures_all(quota: &Quota, n: u32) -> Vec<Lease> {
    let mut leases = Vec::new();
    for i in 0..n {
        let lease = quota.try_acquire(&format!("after-{i}")).await;
        leases.push(lease.unwrap_or_else(|e| panic!("fresh acquire {i} of {n}: {e}")));
    }
    leases
}
