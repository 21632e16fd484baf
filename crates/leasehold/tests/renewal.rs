//! Renewals and the local deadline: a holder's own deadline never passes Redis's, fires on time
//! whenever the lease was admitted, and learns from every answer it gets. Every test owns its
//! redis-server (or memory backend) and every loop is bounded in time.

mod common;

use std::time::{Duration, Instant};

use leasehold::{Error, LostReason, MemoryBackend, Quota};
use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::RedisServer;

/// Two handles of one quota in one process share a lease. A `held` answer obtained through the
/// handle with the shorter ttl extends the shared lease's local deadline by that shorter ttl,
/// the one Redis granted (`max(score, now + short ttl)`), not by the owner's longer one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_reply_through_a_shorter_ttl_handle_does_not_stretch_the_local_deadline() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let backend = common::connect(&proxy.url()).await;
    let name = common::unique("mixttl");
    let long = common::quota_with(backend.clone(), &name, 1, Duration::from_secs(3))
        .heartbeat(Duration::from_millis(2800))
        .events(false)
        .build()
        .unwrap();
    let short = common::quota_with(backend, &name, 1, Duration::from_millis(500))
        .events(false)
        .build()
        .unwrap();
    let lease = long.try_acquire("a").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let again = short.try_acquire("a").await.unwrap();
    assert_eq!(
        again.fencing_token(),
        lease.fencing_token(),
        "one shared lease"
    );
    // From now on nothing of this process reaches Redis (a half-open link).
    proxy.stall(true);

    // Another process, straight to the server.
    let direct = common::quota_with(
        common::connect(&server.url()).await,
        &name,
        1,
        Duration::from_secs(3),
    )
    .events(false)
    .build()
    .unwrap();
    let status = direct.status().await.unwrap();
    let holder = status.holders.iter().find(|h| h.task_id == "a").unwrap();
    let server_left = holder.deadline.duration_since(status.now).unwrap();
    let local_left = lease
        .local_deadline()
        .saturating_duration_since(Instant::now());
    eprintln!("server deadline in {server_left:?}, local deadline in {local_left:?}");

    // Wait until just past the server deadline, then another process takes the slot.
    tokio::time::sleep(server_left + Duration::from_millis(150)).await;
    let other = direct.try_acquire("b").await;
    let held_here = lease.is_held();
    let admitted_there = other.is_ok();
    proxy.stall(false);
    // Nothing of this process reached Redis since the stall: the lease expired there, and the
    // other process was admitted (otherwise the check below would hold vacuously).
    assert!(
        admitted_there,
        "the other process was not admitted past the server deadline ({server_left:?}): {other:?}"
    );
    assert!(
        !held_here,
        "both hold the only slot: this process says is_held() (local deadline {local_left:?} \
         after the short-ttl acquire) while Redis expired it after {server_left:?} and admitted \
         another task"
    );
}

/// A lease whose acquire was out while a beat went by is renewed one heartbeat after that acquire
/// was sent, not at the beat after: on a slow but healthy link it keeps its lease like the older
/// ones do. ttl 1 s, heartbeat 400 ms, margin 50 ms, round trip about 350 ms: renewed at the
/// beat after, such a lease would hear its renewal about 1.05 s after its acquire was sent,
/// past its local deadline (949 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_adopted_just_after_a_beat_is_renewed_a_heartbeat_after_its_acquire() {
    const HEARTBEAT: Duration = Duration::from_millis(400);
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let backend = common::connect_with_call_timeout(&proxy.url(), Duration::from_secs(2)).await;
    let quota = Quota::builder(common::unique("slow-link"))
        .limit(50)
        .ttl(Duration::from_secs(1))
        .heartbeat(HEARTBEAT)
        .safety_margin(Duration::from_millis(50))
        .events(false)
        .backend(backend)
        .build()
        .unwrap();
    proxy.set_latency(Duration::from_millis(170));
    // An older lease shows when the beats go out: its local deadline moves to (renewal sent +
    // 949 ms) when a renewal is answered.
    let older = quota.try_acquire("older").await.unwrap();
    let renewal_sent =
        |lease: &leasehold::Lease| lease.local_deadline() - Duration::from_millis(949);
    for round in 0..3 {
        let seen = older.local_deadline();
        let end = Instant::now() + Duration::from_secs(3);
        while older.local_deadline() == seen {
            assert!(
                Instant::now() < end,
                "round {round}: the older lease was not renewed"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // Send the acquire so that the second beat from that renewal goes by about 275 ms
        // into its round trip.
        let beat = renewal_sent(&older) + 2 * HEARTBEAT;
        tokio::time::sleep_until((beat - Duration::from_millis(275)).into()).await;
        let sent = Instant::now();
        let lease = quota.try_acquire(&format!("new{round}")).await.unwrap();
        let adopted = sent.elapsed();
        let lost = tokio::time::timeout(Duration::from_millis(1500), lease.lost()).await;
        eprintln!(
            "round {round}: acquire round trip {adopted:?}, beat {:?} after it was sent, lost: {:?}",
            beat.saturating_duration_since(sent),
            lost.as_ref().ok()
        );
        assert!(
            lost.is_err(),
            "round {round}: a new lease on a healthy link was lost: {lost:?}"
        );
        assert!(older.is_held(), "round {round}: the older lease was lost");
        drop(lease);
    }
}

/// A lease adopted between two beats of the renewal task, whose admission round trip was long:
/// its local deadline (sent + ttl − margin) may come before the task's next planned wake-up, and
/// `lost()` must still fire at it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_fires_at_the_local_deadline_of_a_lease_adopted_between_beats() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let backend = common::connect_with_call_timeout(&proxy.url(), Duration::from_secs(2)).await;
    let quota = Quota::builder(common::unique("late-lost"))
        .limit(50)
        .ttl(Duration::from_secs(1))
        .heartbeat(Duration::from_millis(900))
        .events(false)
        .backend(backend)
        .build()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(25);
    let mut worst = Duration::ZERO;
    for round in 0..8u64 {
        if Instant::now() > end {
            break;
        }
        proxy.set_latency(Duration::from_millis(250));
        let lease = quota.try_acquire(&format!("t{round}")).await.unwrap();
        // No renewal gets through from now on: lost() must fire at the local deadline.
        proxy.stall(true);
        let deadline = lease.local_deadline();
        let reason = tokio::time::timeout(Duration::from_secs(3), lease.lost()).await;
        let at = Instant::now();
        proxy.stall(false);
        proxy.set_latency(Duration::ZERO);
        assert!(reason.is_ok(), "round {round}: lost() never fired");
        let late = at.saturating_duration_since(deadline);
        eprintln!("round {round}: lost() {late:?} after the local deadline ({reason:?})");
        worst = worst.max(late);
        drop(lease);
        if worst > Duration::from_millis(200) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(137 * round % 900)).await;
    }
    // Two thread wake-ups apart from the deadline on a busy machine; the bug this guards
    // against fires up to a whole heartbeat (900 ms) late.
    assert!(
        worst <= Duration::from_millis(200),
        "lost() fired {worst:?} after the local deadline"
    );
}

/// More than one renewal call's worth (5000) of leases: each call's answers are applied as they
/// come, whatever becomes of the others. Here every lease is gone in Redis; the holders told so
/// stop at once instead of running to their local deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_split_in_batches_keeps_what_the_first_batch_learned() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let backend = common::connect_with_call_timeout(&proxy.url(), Duration::from_secs(3)).await;
    let name = common::unique("split");
    let quota = Quota::builder(name.clone())
        .limit(10_000)
        .ttl(Duration::from_secs(2))
        // Renewals every 200 ms: the last one acknowledged before the leases vanish was sent at
        // most 250 ms before, so the local deadline is at least 1.7 s away when they do.
        .heartbeat(Duration::from_millis(200))
        .events(false)
        .backend(backend)
        .build()
        .unwrap();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..5001 {
        let quota = quota.clone();
        set.spawn(async move { quota.try_acquire(&format!("t{i}")).await });
    }
    let mut leases = Vec::new();
    while let Some(lease) = set.join_next().await {
        leases.push(lease.unwrap().unwrap());
    }
    assert_eq!(leases.len(), 5001);
    // Each script call now takes 1 s: the first batch's answer comes about 1.2 s after the
    // leases vanish, well before the local deadline (at least 1.7 s); waiting for the second
    // call as well (2 s) would outlast it.
    proxy.set_latency(Duration::from_millis(500));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let keys = leasehold::QuotaKeys::new(&name).unwrap();
    server.command(&["DEL", &keys.leases, &keys.holders]);
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end && leases.iter().any(|l| l.lost_reason().is_none()) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let expired = leases
        .iter()
        .filter(|l| l.lost_reason() == Some(LostReason::Expired))
        .count();
    let local = leases
        .iter()
        .filter(|l| l.lost_reason() == Some(LostReason::LocalDeadline))
        .count();
    proxy.set_latency(Duration::ZERO);
    eprintln!("expired {expired}, local deadline {local}");
    assert!(
        expired >= 5000,
        "the first batch answered `gone` for 5000 leases, yet only {expired} were marked \
         expired ({local} ran on to their local deadline)"
    );
}

/// The longest cancel marker ttl a quota accepts still refuses the task on the memory backend
/// (its clock arithmetic does not overflow), and a longer one is refused by the builder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_cancel_with_the_longest_marker_ttl_still_refuses_the_task() {
    let too_long = Quota::builder(common::unique("marker"))
        .limit(1)
        .ttl(Duration::from_secs(1))
        .cancel_marker_ttl(Duration::MAX)
        .build();
    assert!(
        matches!(too_long, Err(Error::Misconfigured(_))),
        "{too_long:?}"
    );
    let quota = Quota::builder(common::unique("marker"))
        .limit(1)
        .ttl(Duration::from_secs(1))
        .cancel_marker_ttl(leasehold::MAX_CANCEL_MARKER_TTL)
        .backend(MemoryBackend::new())
        .build()
        .unwrap();
    let cancel = tokio::spawn(async move {
        quota.cancel("x", "stop").await.unwrap();
        quota.try_acquire("x").await.map(|_| ())
    })
    .await;
    assert!(
        matches!(cancel, Ok(Err(Error::Cancelled(_)))),
        "cancel then acquire: {cancel:?}"
    );
}

/// The server counts in whole milliseconds (its clock read rounded down, the ttl's fraction of a
/// millisecond dropped): with no safety margin at all, the holder's local deadline still never
/// outlives the backend's deadline. Memory backend, renewals cut off, ttl 60.9 ms; another
/// caller tries from just before the holder's local deadline until it passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_safety_margin_the_local_deadline_still_comes_first() {
    let backend = std::sync::Arc::new(common::switchable::Switchable::default());
    let quota = |name: &str| {
        Quota::builder(name)
            .limit(1)
            .ttl(Duration::from_micros(60_900))
            .heartbeat(Duration::from_millis(20))
            .safety_margin(Duration::ZERO)
            .events(false)
            .shared_backend(backend.clone())
            .build()
            .unwrap()
    };
    let mut early = 0;
    // Rounds in which some attempt was answered while the holder still held: only those test
    // anything (a round whose first answer came after the local deadline checks nothing).
    let mut tried_while_held = 0;
    for round in 0..40 {
        let name = format!("no-margin-{round}");
        let (holder_side, other_side) = (quota(&name), quota(&name));
        backend.set_renewals_down(false);
        let held = holder_side.try_acquire("a").await.unwrap();
        backend.set_renewals_down(true);
        let until = held.local_deadline();
        tokio::time::sleep_until((until - Duration::from_millis(3)).into()).await;
        let mut tried = false;
        loop {
            let admitted = other_side.try_acquire("b").await.is_ok();
            // What `is_held` compares, read after the answer.
            let still_held = Instant::now() < until;
            if still_held && !tried {
                tried = true;
                tried_while_held += 1;
            }
            if admitted && still_held {
                early += 1;
                eprintln!(
                    "round {round}: b admitted {:?} before a's local deadline",
                    until - Instant::now()
                );
            }
            if admitted || !still_held {
                break;
            }
        }
    }
    println!("{tried_while_held} of 40 rounds tried while the lease was held");
    assert_eq!(
        early, 0,
        "{early} of 40 rounds admitted another while the holder held"
    );
    assert!(
        tried_while_held >= 20,
        "only {tried_while_held} of 40 rounds had an attempt answered while the lease was held"
    );
}

/// Renewals racing releases in a tight loop (the fault scenarios' F22): two workers (each its
/// own connection) of 2 tasks on a limit of 4, a 60 ms ttl renewed every 15 ms, 1000 admissions
/// held 0–20 ms (across renewals or between them) and released or dropped, every tenth ask given
/// up after 1 ms. No renewal may outlive a release: once `release` returned, its task id never
/// shows in Redis again, and the lease says `Released`, not lost. Redis never counts more than
/// the limit, every admission has its own token, and nothing is left once both workers let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_racing_releases_in_a_tight_loop_leave_nothing_behind() {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
    use std::sync::{Arc, Mutex};

    let server = Arc::new(RedisServer::start());
    let name = common::unique("race");
    let mut workers = Vec::new();
    for _ in 0..2 {
        let backend = common::connect(&server.url()).await;
        let quota = common::quota_with(backend, &name, 4, Duration::from_millis(60))
            .heartbeat(Duration::from_millis(15))
            .build()
            .unwrap();
        workers.push(quota);
    }
    let leases_key = format!("leasehold:{{{name}}}:leases");
    let holders_key = format!("leasehold:{{{name}}}:holders");
    // Task ids whose `release` returned: none may show in Redis afterwards.
    let released = Arc::new(Mutex::new(HashSet::<String>::new()));
    let done = Arc::new(AtomicBool::new(false));
    let most = Arc::new(AtomicI64::new(0));
    let reappeared = Arc::new(Mutex::new(Vec::<String>::new()));
    let sampler = {
        let (server, done, most) = (server.clone(), done.clone(), most.clone());
        let (released, reappeared, key) =
            (released.clone(), reappeared.clone(), leases_key.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                // Read before the members: an id released after this read may still show.
                let gone = released.lock().unwrap().clone();
                let members = match server.command(&["ZRANGE", &key, "0", "-1"]) {
                    leasehold_testkit::Reply::Array(v) => v,
                    _ => Vec::new(),
                };
                most.fetch_max(members.len() as i64, Ordering::SeqCst);
                for member in members.iter().filter_map(|m| m.as_string()) {
                    if gone.contains(&member) {
                        reappeared.lock().unwrap().push(member);
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let (lost, not_released, given_up) = (
        Arc::new(AtomicI64::new(0)),
        Arc::new(AtomicI64::new(0)),
        Arc::new(AtomicI64::new(0)),
    );
    let tasks: Vec<_> = (0..4u64)
        .map(|t| {
            let quota = workers[(t % 2) as usize].clone();
            let (tokens, released) = (tokens.clone(), released.clone());
            let (lost, not_released, given_up) =
                (lost.clone(), not_released.clone(), given_up.clone());
            tokio::spawn(async move {
                for i in 0..250u64 {
                    let id = format!("t{t}-{i}");
                    if i % 10 == 9 {
                        // Given up at once: a slot a late reply took is let go in the background.
                        if quota
                            .acquire_timeout(&id, Duration::from_millis(1))
                            .await
                            .is_err()
                        {
                            given_up.fetch_add(1, Ordering::SeqCst);
                            continue;
                        }
                    }
                    let lease = quota
                        .acquire_timeout(&id, Duration::from_secs(5))
                        .await
                        .unwrap();
                    tokens.lock().unwrap().push(lease.fencing_token());
                    // 0–20 ms: some end before the first renewal, some after a few.
                    tokio::time::sleep(Duration::from_millis((i * 7 + t) % 21)).await;
                    if !lease.is_held() {
                        // A renewal late under load: the lease ended at its local deadline.
                        lost.fetch_add(1, Ordering::SeqCst);
                        continue;
                    }
                    if i % 3 == 0 {
                        drop(lease);
                        continue;
                    }
                    lease.release().await.unwrap();
                    released.lock().unwrap().insert(id);
                    // Its local deadline may have passed just before the release, under load.
                    let ended_on_time = lease.lost_reason() == Some(LostReason::LocalDeadline)
                        && lease.local_deadline() <= std::time::Instant::now();
                    if lease.lost_reason() != Some(LostReason::Released) && !ended_on_time {
                        not_released.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("the loop did not finish")
            .unwrap();
    }
    for quota in &workers {
        quota.flush().await;
    }
    // Nothing left: every release and drop reached Redis, and no renewal re-added a lease.
    let left = common::eventually(Duration::from_secs(1), || {
        server.command(&["ZCARD", &leases_key]).as_int() == Some(0)
            && server.command(&["HLEN", &holders_key]).as_int() == Some(0)
    })
    .await;
    done.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    let tokens = tokens.lock().unwrap();
    let distinct: HashSet<_> = tokens.iter().collect();
    let most = most.load(Ordering::SeqCst);
    let reappeared = reappeared.lock().unwrap();
    println!(
        "{} admissions ({} asks given up), {} released and checked, most held at once in Redis \
         {most}, {} ended by their local deadline",
        tokens.len(),
        given_up.load(Ordering::SeqCst),
        released.lock().unwrap().len(),
        lost.load(Ordering::SeqCst)
    );
    assert!(
        reappeared.is_empty(),
        "back in Redis after their release returned: {reappeared:?}"
    );
    assert_eq!(
        not_released.load(Ordering::SeqCst),
        0,
        "a released lease said another reason"
    );
    assert!(
        left,
        "leases left in Redis after both workers let go of all of them"
    );
    assert_eq!(distinct.len(), tokens.len(), "a fencing token issued twice");
    assert!(tokens.len() >= 900, "only {} admissions", tokens.len());
    assert!(most <= 4, "Redis counted {most} leases on a limit of 4");
}
