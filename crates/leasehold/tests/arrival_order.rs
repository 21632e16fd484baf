//! Waiters of one process: they hear of a release that came before their subscription was in
//! place, and they are served in arrival order even when a slot frees while a waiter's
//! own attempt is out (its first attempt, or the head's poll): that attempt was sent before the
//! slot freed and comes back refused, and a younger waiter must not take the slot meanwhile.
//! The backend is the memory backend, with one task's acquire answers held back 150 ms after
//! they were decided (`Switchable::answer_late`), so the slot frees exactly while that answer is on its way. The poll
//! interval is 1 s, so a younger waiter's safety-net poll (2–6 s) does not fall in that window:
//! such a poll may take a slot freed during an older waiter's round trip, which only wake-ups
//! guard against.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::counting::Counting;
use common::switchable::Switchable;
use common::waiting::{assert_refused, memory_quota, parked_acquire, waiter};
use leasehold::Quota;

struct Race {
    quota: Quota,
    backend: Arc<Switchable>,
    /// The quota's backend: `backend`, counting refusals.
    counting: Arc<Counting>,
    order: Arc<Mutex<Vec<&'static str>>>,
}

impl Race {
    fn new(name: &str) -> Race {
        let backend = Arc::new(Switchable::default());
        let counting = Counting::new(backend.clone());
        let quota = Quota::builder(name)
            .limit(1)
            .ttl(Duration::from_secs(10))
            .poll_interval(Duration::from_secs(1))
            .shared_backend(counting.clone())
            .build()
            .unwrap();
        Race {
            quota,
            backend,
            counting,
            order: Arc::default(),
        }
    }

    /// A task that waits for the slot, records when it got it, and holds it 50 ms.
    fn waiter(&self, id: &'static str) -> tokio::task::JoinHandle<()> {
        let (quota, order) = (self.quota.clone(), self.order.clone());
        tokio::spawn(async move {
            let lease = tokio::time::timeout(Duration::from_secs(5), quota.acquire(id))
                .await
                .expect("a waiter never got the slot")
                .unwrap();
            order.lock().unwrap().push(id);
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(lease);
        })
    }

    fn slow(&self, id: &str) {
        self.backend.answer_late(Some(id));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_head_out_on_its_poll_keeps_its_turn() {
    let race = Race::new("order-head");
    let holder = race.quota.try_acquire("holder").await.unwrap();
    let a = race.waiter("a");
    // a: refused once, head of the line.
    assert!(
        race.counting
            .all_refused(&["a"], Duration::from_secs(5))
            .await,
        "a's first attempt was answered full"
    );
    let b = race.waiter("b");
    // b joins the line behind a without an attempt of its own (nothing to observe from here).
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!a.is_finished() && !b.is_finished(), "both wait");
    race.slow("a");
    race.backend.decided_late.notified().await; // a's poll was refused; its answer is on its way
    holder.release().await.unwrap();
    let (ra, rb) = tokio::join!(a, b);
    ra.unwrap();
    rb.unwrap();
    assert_eq!(*race.order.lock().unwrap(), ["a", "b"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_refused_before_a_release_goes_before_a_later_one() {
    let race = Race::new("order-newcomer");
    let holder = race.quota.try_acquire("holder").await.unwrap();
    race.slow("a");
    let a = race.waiter("a");
    race.backend.decided_late.notified().await; // a's first attempt was refused; answer on its way
    race.backend.answer_late(None);
    holder.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await; // the release event has arrived
    let b = race.waiter("b");
    let (ra, rb) = tokio::join!(a, b);
    ra.unwrap();
    rb.unwrap();
    assert_eq!(*race.order.lock().unwrap(), ["a", "b"]);
}

/// A waiter refused while its quota's subscription is still being made (in the background,
/// never before an attempt) hears of a release announced before that subscription was in place:
/// it checks again once subscribed, instead of at its poll (10 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_before_the_subscription_is_in_place_still_wakes_the_waiter() {
    let backend = Arc::new(Switchable::default());
    let quota = || {
        Quota::builder("slow-subscribe")
            .limit(1)
            .ttl(Duration::from_secs(30))
            .poll_interval(Duration::from_secs(10))
            .shared_backend(backend.clone())
            .build()
            .unwrap()
    };
    let holder = quota().try_acquire("a").await.unwrap();
    backend.slow_subscribe(true);
    // The waiter's handle, on the same backend (the same identity), counting its refusals.
    let counting = Counting::new(backend.clone());
    let waiter = Quota::builder("slow-subscribe")
        .limit(1)
        .ttl(Duration::from_secs(30))
        .poll_interval(Duration::from_secs(10))
        .shared_backend(counting.clone())
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let b = tokio::spawn(async move { waiter.acquire("b").await });
    // b was refused; its subscription (which takes 150 ms) is still being made when the slot
    // frees.
    assert!(
        counting.all_refused(&["b"], Duration::from_secs(5)).await,
        "b's first attempt was answered full"
    );
    assert!(!b.is_finished());
    holder.release().await.unwrap();
    let admitted = tokio::time::timeout(Duration::from_secs(3), b).await;
    assert!(matches!(admitted, Ok(Ok(Ok(_)))), "{admitted:?}");
    println!("admitted {:?} after it asked", started.elapsed());
}

/// A waiter woken by a release, whose future is dropped (a timeout, a `select!`) while the
/// attempt the release started for it is out, and that attempt takes no slot (here it fails):
/// the slot it was woken for goes to the next waiter at once, not at that waiter's poll (10 s
/// here). Found by review: the waiter that would have passed the wake-up on was gone, and the
/// next one was served 11.7 s after the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_dropped_during_its_woken_attempt_passes_the_freed_slot_on() {
    let backend = Arc::new(Switchable::default());
    let counting = Counting::new(backend.clone());
    let quota = common::quota_with(
        counting.clone(),
        "order-dropped",
        1,
        Duration::from_secs(30),
    )
    .poll_interval(Duration::from_secs(10))
    .build()
    .unwrap();
    let holder = quota.try_acquire("holder").await.unwrap();
    let dropped = {
        let quota = quota.clone();
        tokio::spawn(async move { quota.acquire("dropped").await })
    };
    assert!(
        counting
            .all_refused(&["dropped"], Duration::from_secs(5))
            .await
    );
    let next = {
        let quota = quota.clone();
        tokio::spawn(async move { quota.acquire("next").await })
    };
    assert!(common::eventually(Duration::from_secs(5), || quota.debug_sizes().waiters == 2).await);
    backend.fail_late("dropped");
    let released = std::time::Instant::now();
    holder.release().await.unwrap();
    // The release woke the head; its attempt is out (failing 150 ms after it was made).
    tokio::time::sleep(Duration::from_millis(50)).await;
    dropped.abort();
    let lease = tokio::time::timeout(Duration::from_secs(3), next)
        .await
        .expect("the next waiter was not served within 3 s: the freed slot was not passed on")
        .unwrap()
        .unwrap();
    println!(
        "next waiter served {:?} after the release",
        released.elapsed()
    );
    assert_eq!(lease.task_id(), "next");
}

/// A slot freed while an older waiter's re-check (here: the one made once the subscription is in
/// place) is out goes to that waiter, as one freed during its own attempt does, not to a younger
/// waiter (found by review: the younger one took it in 5 runs of 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_freed_during_an_older_waiters_re_check_stays_its() {
    let backend = Arc::new(Switchable::default());
    let name = common::unique("recheck-order");
    let ttl = Duration::from_secs(30);
    let holders = common::quota_with(backend.clone(), &name, 1, ttl)
        .poll_interval(Duration::from_secs(10))
        .build()
        .unwrap();
    let holder = holders.try_acquire("holder").await.unwrap();
    backend.slow_subscribe(true); // the waiters' subscription takes 150 ms
    backend.answer_late(Some("a")); // a's answers come back 150 ms after they were decided
    let waiters = common::quota_with(backend.clone(), &name, 1, ttl)
        .poll_interval(Duration::from_secs(10))
        .build()
        .unwrap();
    let spawn = |id: &'static str| {
        let q = waiters.clone();
        tokio::spawn(async move { q.acquire_timeout(id, Duration::from_secs(3)).await })
    };
    let decided = |what: &'static str| {
        let backend = backend.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(2), backend.decided_late.notified())
                .await
                .unwrap_or_else(|_| panic!("{what} never went out"))
        }
    };
    let a = spawn("a");
    decided("a's first attempt").await;
    // The subscription is made: every waiter re-checks. a's re-check is decided (full: the
    // holder still holds) and its answer is on its way back.
    decided("a's re-check").await;
    let b = spawn("b");
    let both_wait = || waiters.debug_sizes().waiters == 2;
    assert!(common::eventually(Duration::from_secs(2), both_wait).await);
    holder.release().await.unwrap();
    let first = tokio::select! {
        r = a => { drop(r.unwrap().unwrap()); "a" }
        r = b => { drop(r.unwrap().unwrap()); "b" }
    };
    assert_eq!(
        first, "a",
        "the younger b took the slot freed during a's re-check"
    );
}

/// A caller that keeps its `acquire` future across a `select!` loop (polled once, then not while
/// another arm's body runs) leaves its waiter out on its own attempt. A slot freed then was
/// counted on that waiter, which would try again at once, and a runnable waiter behind it was
/// not woken: the slot sat free until the parked future ran again (found by review: 1.5 s and
/// more, with b timing out after 2 s). A refusal not read within a second now passes such
/// slots on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_parked_during_its_own_attempt_does_not_keep_a_freed_slot_from_a_runnable_one() {
    let (quota, counting) = memory_quota(1, Duration::from_secs(5)).await;
    common::warm_up(&quota).await;
    let h = quota.try_acquire("h").await.unwrap();
    // As `loop { select! { l = &mut acquire => .., m = rx.recv() => handle(m).await } }` does.
    let parked = parked_acquire(&quota, "p", Duration::from_secs(5)).await;
    assert_refused(&counting, "p").await; // p's first attempt was answered (p has not seen it)
    let b = waiter(&quota, "b", Duration::from_secs(4));
    assert_refused(&counting, "b").await; // b: refused, in line, runnable
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(quota.debug_sizes().waiters, 2);

    h.release().await.unwrap();
    let released = Instant::now();
    let mut free_for = Duration::ZERO;
    while released.elapsed() < Duration::from_millis(3000) {
        if common::holder_ids(&quota).await.is_empty() {
            free_for = released.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = b.await.unwrap();
    let b_after = released.elapsed();
    let b_held = b
        .as_ref()
        .map(|l| l.task_id().to_owned())
        .map_err(|e| e.to_string());
    drop(b); // p's turn once it runs again
    let (p, p_at) = tokio::time::timeout(Duration::from_secs(10), parked)
        .await
        .expect("p served once it ran again")
        .unwrap();
    println!(
        "slot still free {free_for:?} after the release; b: {:?} after {b_after:?}; \
         p (parked 5 s): {p:?} {:?} after the release",
        b_held,
        p_at - released
    );
    assert_eq!(p.as_deref().ok(), Some("p"));
    assert!(
        b_held.is_ok(),
        "the runnable waiter b was not served ({b_after:?}) while the slot stayed free \
         ({free_for:?} after the release): the wake-up sat with the parked waiter p"
    );
}

/// A slot freed after a waiter stalled (its future parked, its refusal unread) is kept for it
/// while nobody else waits; a runnable newcomer then tries at once and takes it, instead of
/// waiting in line behind the parked waiter for its line poll (found by review: it timed out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_is_not_held_back_by_a_stalled_waiter() {
    let (quota, counting) = memory_quota(1, Duration::from_secs(5)).await;
    common::warm_up(&quota).await;
    let h = quota.try_acquire("h").await.unwrap();
    let parked = parked_acquire(&quota, "p", Duration::from_secs(5)).await;
    assert_refused(&counting, "p").await;
    tokio::time::sleep(Duration::from_millis(1200)).await; // p's hook has run: p is `stalled`
    h.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let d = waiter(&quota, "d", Duration::from_secs(2)).await.unwrap();
    let free = common::holder_ids(&quota).await.is_empty();
    println!(
        "d: {:?} after {:?}",
        d.as_ref()
            .map(|l| l.task_id().to_owned())
            .map_err(|e| e.to_string()),
        started.elapsed()
    );
    drop(d);
    let _ = tokio::time::timeout(Duration::from_secs(10), parked).await;
    assert!(
        !free,
        "runnable newcomer d timed out after 2 s while the slot stayed free, promised to parked p"
    );
}
