//! Server-side incidents an operator meets on a real Redis, run against the library: `DEBUG
//! SLEEP` spikes, `allkeys-*` eviction of the quota's keys, `CLIENT KILL TYPE pubsub`, `SCRIPT
//! FLUSH` while leases are held, and `CONFIG SET timeout 1`. Each test asserts what matters to
//! the fleet: never more believed holders than the limit (beyond a documented, bounded window),
//! a holder never believes it holds a lease Redis gave away, and errors are typed (transient,
//! never misconfiguration). Private redis-servers on loopback; every wait is bounded.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::counting::Counting;
use common::{connect, connect_with_call_timeout, eventually, quota_with, subscribers, unique};
use leasehold::{Backend, BreakerMode, Error, FullCause, Lease, Quota, QuotaKeys};
use leasehold_testkit::{RedisServer, Reply};

/// Whether Redis holds `lease` as this holder believes: its id in `leases` with a deadline in
/// the future of the server's clock, and its token in `holders`.
fn redis_holds(server: &RedisServer, keys: &QuotaKeys, lease: &Lease) -> bool {
    let now_ms = match server.command(&["TIME"]) {
        Reply::Array(v) => {
            let s: u64 = v[0].as_string().unwrap().parse().unwrap();
            let us: u64 = v[1].as_string().unwrap().parse().unwrap();
            s * 1000 + us / 1000
        }
        other => panic!("TIME answered {other:?}"),
    };
    let score = server
        .command(&["ZSCORE", &keys.leases, lease.task_id()])
        .as_string()
        .and_then(|s| s.parse::<f64>().ok());
    let meta = server
        .command(&["HGET", &keys.holders, lease.task_id()])
        .as_string();
    let token_matches = meta
        .is_some_and(|m| m.split(':').next() == Some(lease.fencing_token().to_string().as_str()));
    score.is_some_and(|s| s as u64 > now_ms) && token_matches
}

/// Fails the test on an error that says "misconfigured": an incident of the server is never
/// the operator's configuration.
/// Whether both processes of a test subscribe the quota's channel within `within`.
async fn both_subscribed(server: &RedisServer, keys: &QuotaKeys, within: Duration) -> bool {
    eventually(within, || subscribers(server, &keys.events) == 2).await
}

/// Until the waiter of `waiter_backend` was refused once (it is in line) and both processes
/// subscribe the quota's channel.
async fn waiting_and_subscribed(server: &RedisServer, keys: &QuotaKeys, waiter_backend: &Counting) {
    assert!(
        waiter_backend
            .all_refused(&["waiter"], Duration::from_secs(3))
            .await
    );
    assert!(
        both_subscribed(server, keys, Duration::from_secs(3)).await,
        "both processes subscribe"
    );
}

/// Releases `lease` and waits (bounded by `within`) for `waiter`: the lease it got, how long
/// after the release it got it, and what else the waiter returned.
async fn released_to_waiter<T>(
    lease: Lease,
    waiter: tokio::task::JoinHandle<(leasehold::Result<Lease>, Instant, T)>,
    within: Duration,
) -> (Lease, Duration, T) {
    let released = Instant::now();
    lease.release().await.unwrap();
    let (acquired, woken, rest) = tokio::time::timeout(within, waiter).await.unwrap().unwrap();
    let acquired = acquired.expect("the waiter gets the released slot");
    (acquired, woken - released, rest)
}

/// A waiter whose polls are seconds apart was admitted `wake` after a release: by the release
/// message, not by a poll.
fn assert_woken_by_the_event(wake: Duration) {
    assert!(
        wake < Duration::from_millis(1500),
        "waiter woke {wake:?} after the release: by its poll, not by the event"
    );
}

fn transient_or_full(err: &Error, during: &str) {
    assert!(
        err.is_transient(),
        "{during}: expected a transient error, got {err:?}"
    );
}

/// `DEBUG SLEEP secs` on a blocking thread: the server answers nobody meanwhile.
fn sleep_server(server: &Arc<RedisServer>, secs: f64) -> tokio::task::JoinHandle<()> {
    let server = server.clone();
    tokio::task::spawn_blocking(move || {
        let secs = format!("{secs}");
        let reply = server
            .try_command_timeout(&["DEBUG", "SLEEP", &secs], Duration::from_secs(10))
            .unwrap();
        assert_eq!(reply, Reply::Status("OK".into()));
    })
}

/// Runs one `DEBUG SLEEP` spike while a contender (another process) tries to take a slot every
/// 50 ms; returns the contender's errors. Panics if the contender is ever admitted while both
/// holders still hold, or on a misconfiguration.
async fn spike(
    server: &Arc<RedisServer>,
    secs: f64,
    holders: &[Lease],
    contender: &Quota,
) -> Vec<Error> {
    let sleeping = sleep_server(server, secs);
    let mut errors = Vec::new();
    let mut attempt = 0;
    while !sleeping.is_finished() {
        attempt += 1;
        match contender.try_acquire(&format!("contender-{attempt}")).await {
            Ok(lease) => panic!(
                "admitted {} during a {secs} s spike while {} of 2 holders hold",
                lease.task_id(),
                holders.iter().filter(|l| l.is_held()).count()
            ),
            Err(Error::Full { .. }) => {}
            Err(e) => {
                transient_or_full(&e, "during DEBUG SLEEP");
                errors.push(e);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sleeping.await.unwrap();
    errors
}

/// Waits (bounded) until the contender's acquire is answered by Redis again: `Full` for lack of
/// a slot, not the short-circuit's `BackendUnavailable`. Returns how long that took.
async fn answered_again(contender: &Quota, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        match contender.try_acquire("after-spike").await {
            Err(Error::Full {
                cause: FullCause::NoSlot,
                ..
            }) => return start.elapsed(),
            Ok(lease) => panic!("admitted {} while both slots are held", lease.task_id()),
            Err(e) => transient_or_full(&e, "after DEBUG SLEEP"),
        }
        assert!(
            start.elapsed() < within,
            "acquires still not answered by Redis {:?} after the spike (breaker {:?})",
            start.elapsed(),
            contender.breaker_mode()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct SleepSetup {
    server: Arc<RedisServer>,
    keys: QuotaKeys,
    holders_quota: Quota,
    holders: Vec<Lease>,
    contender: Quota,
}

/// Limit 2, ttl 6 s (heartbeat 2 s), call timeout 800 ms for both processes; two holders.
async fn sleep_setup() -> SleepSetup {
    let server = Arc::new(RedisServer::start_with(&["--enable-debug-command", "yes"]));
    let name = unique("sleep");
    let ttl = Duration::from_secs(6);
    let call_timeout = Duration::from_millis(800);
    let a: Arc<dyn Backend> =
        Arc::new(connect_with_call_timeout(&server.url(), call_timeout).await);
    let b: Arc<dyn Backend> =
        Arc::new(connect_with_call_timeout(&server.url(), call_timeout).await);
    let holders_quota = quota_with(a, &name, 2, ttl).build().unwrap();
    let contender = quota_with(b, &name, 2, ttl).build().unwrap();
    let holders = vec![
        holders_quota.try_acquire("holder-1").await.unwrap(),
        holders_quota.try_acquire("holder-2").await.unwrap(),
    ];
    SleepSetup {
        server,
        keys: QuotaKeys::new(&name).unwrap(),
        holders_quota,
        holders,
        contender,
    }
}

fn assert_still_held(s: &SleepSetup, after: &str) {
    for lease in &s.holders {
        assert_eq!(lease.lost_reason(), None, "{after}: {}", lease.task_id());
        assert!(lease.is_held(), "{after}: {}", lease.task_id());
        assert!(
            redis_holds(&s.server, &s.keys, lease),
            "{after}: {} believes it holds, Redis does not",
            lease.task_id()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_debug_sleep_spikes_lose_no_lease_and_open_no_short_circuit() {
    let s = sleep_setup().await;
    for secs in [0.3, 0.3, 0.3] {
        let errors = spike(&s.server, secs, &s.holders, &s.contender).await;
        // Shorter than the call timeout: calls are only slower.
        assert!(errors.is_empty(), "{secs} s spike: {errors:?}");
        assert_eq!(s.contender.breaker_mode(), BreakerMode::Closed);
        assert_eq!(s.holders_quota.breaker_mode(), BreakerMode::Closed);
        assert_still_held(&s, &format!("after a {secs} s spike"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // One second: above the call timeout, calls in it time out (transient).
    let errors = spike(&s.server, 1.0, &s.holders, &s.contender).await;
    let back = answered_again(&s.contender, Duration::from_secs(4)).await;
    println!(
        "1 s spike: {} contender errors ({:?}), answered again {back:?} after it",
        errors.len(),
        errors.first().map(|e| e.to_string())
    );
    assert_still_held(&s, "after a 1 s spike");
    for lease in &s.holders {
        lease.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debug_sleep_longer_than_the_call_timeout_but_shorter_than_the_ttl_loses_no_lease() {
    let s = sleep_setup().await;
    // Let the spike start just after a renewal was acknowledged, the usual phase; the spike
    // (2.5 s) is longer than three call timeouts (the wedge detector's bound, 2.4 s), shorter
    // than what the holders' last renewal grants (ttl 6 s − margin 0.3 s).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let errors = spike(&s.server, 2.5, &s.holders, &s.contender).await;
    let back = answered_again(&s.contender, Duration::from_secs(4)).await;
    println!(
        "2.5 s spike: {} contender errors, answered again {back:?} after it ({:?} after its \
         start); holders' breaker {:?}",
        errors.len(),
        started.elapsed(),
        s.holders_quota.breaker_mode()
    );
    assert!(!errors.is_empty(), "calls in a 2.5 s spike must time out");
    assert_still_held(&s, "after a 2.5 s spike");
    // And the holders keep renewing past the deadline their last pre-spike renewal gave.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_still_held(&s, "2.5 s after a 2.5 s spike");
}

/// The quota's keys are evicted by `allkeys-random` (README: use `noeviction`). Whatever goes,
/// a blind process admitting beside the old holders must be over the limit for at most about
/// one heartbeat, and afterwards every lease believed held is held in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allkeys_eviction_of_the_quota_over_admits_for_at_most_about_one_heartbeat() {
    let server = RedisServer::start_with(&["--maxmemory-policy", "allkeys-random"]);
    let name = unique("evicted");
    let keys = QuotaKeys::new(&name).unwrap();
    let ttl = Duration::from_secs(3); // heartbeat 1 s
    let limit = 2;
    let a = quota_with(connect(&server.url()).await, &name, limit, ttl)
        .build()
        .unwrap();
    let held = [
        a.try_acquire("old-1").await.unwrap(),
        a.try_acquire("old-2").await.unwrap(),
    ];
    let used: u64 = server
        .command(&["INFO", "memory"])
        .as_string()
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    server.command(&["CONFIG", "SET", "maxmemory", &(used + 300_000).to_string()]);
    let junk = "x".repeat(20_000);
    let fill = Instant::now();
    let mut i = 0;
    while server.command(&["EXISTS", &keys.leases]).as_int() == Some(1) {
        assert!(
            fill.elapsed() < Duration::from_secs(3),
            "the leases key survived {i} junk writes"
        );
        i += 1;
        server.command(&["SET", &format!("junk:{i}"), &junk]);
    }
    server.command(&["CONFIG", "SET", "maxmemory", "0"]);
    let evicted_at = Instant::now();
    let gone: Vec<&str> = [
        ("leases", &keys.leases),
        ("holders", &keys.holders),
        ("fence", &keys.fence),
        ("epoch", &keys.epoch),
        ("limit", &keys.limit),
    ]
    .into_iter()
    .filter(|(_, k)| server.command(&["EXISTS", k]).as_int() == Some(0))
    .map(|(n, _)| n)
    .collect();
    // A process that never saw the quota before the eviction (a new worker) tries to take both
    // slots while the old holders run.
    let b = quota_with(connect(&server.url()).await, &name, limit, ttl)
        .build()
        .unwrap();
    let mut taken: Vec<Lease> = Vec::new();
    let mut over_until = None;
    let mut most = 0;
    let mut next = 0;
    let watch = Duration::from_millis(3500);
    while evicted_at.elapsed() < watch {
        if taken.iter().filter(|l| l.is_held()).count() < limit as usize {
            next += 1;
            match b.try_acquire(&format!("new-{next}")).await {
                Ok(lease) => taken.push(lease),
                Err(Error::Full { .. }) => {}
                Err(e) => panic!("after an eviction: {e:?}"),
            }
        }
        let believed = held.iter().filter(|l| l.is_held()).count()
            + taken.iter().filter(|l| l.is_held()).count();
        most = most.max(believed);
        if believed > limit as usize {
            over_until = Some(evicted_at.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let old_tokens: Vec<u64> = held.iter().map(|l| l.fencing_token()).collect();
    let new_tokens: Vec<u64> = taken.iter().map(|l| l.fencing_token()).collect();
    println!(
        "{i} junk writes evicted {gone:?}; believed holders at most {most} on {limit}, over the \
         limit until {over_until:?} after the eviction; old holders {:?} tokens {old_tokens:?}, \
         new admissions tokens {new_tokens:?}",
        held.iter().map(|l| l.lost_reason()).collect::<Vec<_>>()
    );
    // Bounded: one heartbeat (1 s) plus generous slack for a noisy machine.
    if let Some(until) = over_until {
        assert!(
            until < Duration::from_millis(2500),
            "over the limit until {until:?} after the eviction"
        );
    }
    for lease in held.iter().chain(taken.iter()).filter(|l| l.is_held()) {
        assert!(
            redis_holds(&server, &keys, lease),
            "{} (token {}) believes it holds, Redis does not",
            lease.task_id(),
            lease.fencing_token()
        );
    }
    // Among the leases believed held now, no two share a fencing token.
    let mut live: Vec<u64> = held
        .iter()
        .chain(taken.iter())
        .filter(|l| l.is_held())
        .map(|l| l.fencing_token())
        .collect();
    live.sort_unstable();
    let n = live.len();
    live.dedup();
    assert_eq!(live.len(), n, "live leases share a fencing token");
}

/// `CLIENT KILL TYPE pubsub` closes leasehold's only connection in each process (commands and
/// subscriptions share it): leases survive, and a waiter is still woken by the release message,
/// not by its poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kill_type_pubsub_keeps_leases_and_waiters_are_still_woken_by_events() {
    let server = RedisServer::start();
    let name = unique("killed");
    let keys = QuotaKeys::new(&name).unwrap();
    let ttl = Duration::from_secs(6); // heartbeat 2 s
    let holder_backend = Counting::new(connect(&server.url()).await);
    let holder_quota = quota_with(holder_backend.clone(), &name, 1, ttl)
        .build()
        .unwrap();
    let waiter_backend = Counting::new(connect(&server.url()).await);
    // Polls 2.5–7.5 s apart (capped by the holder's deadline, 4–6 s away): a wake within 1.5 s
    // of the release is the release message.
    let waiter_quota = quota_with(waiter_backend.clone(), &name, 1, ttl)
        .poll_interval(Duration::from_secs(5))
        .build()
        .unwrap();
    let lease = holder_quota.try_acquire("holder").await.unwrap();
    let waiter = tokio::spawn(async move {
        let lease = waiter_quota
            .acquire_timeout("waiter", Duration::from_secs(12))
            .await;
        (lease, Instant::now(), waiter_quota)
    });
    waiting_and_subscribed(&server, &keys, &waiter_backend).await;
    let killed = server
        .command(&["CLIENT", "KILL", "TYPE", "pubsub"])
        .as_int();
    assert_eq!(
        killed,
        Some(2),
        "each process's one connection is a pub/sub client"
    );
    let resubscribed = Instant::now();
    assert!(
        both_subscribed(&server, &keys, Duration::from_secs(4)).await,
        "both processes subscribe again"
    );
    let resubscribed = resubscribed.elapsed();
    // The holder renews on its new connection past the deadline its last renewal gave.
    let renewals = holder_backend.renewals();
    assert!(
        eventually(Duration::from_secs(5), || holder_backend.renewals()
            > renewals)
        .await,
        "the holder renews after the kill"
    );
    assert!(
        eventually(Duration::from_secs(2), || redis_holds(
            &server, &keys, &lease
        ))
        .await,
        "the holder's lease is in Redis"
    );
    assert_eq!(lease.lost_reason(), None);
    let refusals = waiter_backend.refused("waiter");
    let (acquired, wake, _quota) = released_to_waiter(lease, waiter, Duration::from_secs(10)).await;
    println!(
        "resubscribed {resubscribed:?} after the kill; waiter admitted {wake:?} after the \
         release ({} refusals before it)",
        refusals
    );
    assert!(acquired.is_held());
    assert_woken_by_the_event(wake);
    acquired.release().await.unwrap();
}

/// `SCRIPT FLUSH` again and again while leases are held: renewals reload the scripts
/// (NOSCRIPT) and go on; nothing is reported lost or misconfigured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_while_holding_leases_keeps_them_renewed() {
    let server = RedisServer::start();
    let name = unique("flushed");
    let keys = QuotaKeys::new(&name).unwrap();
    let ttl = Duration::from_millis(1500); // heartbeat 500 ms
    let backend = Counting::new(connect(&server.url()).await);
    let quota = quota_with(backend.clone(), &name, 2, ttl).build().unwrap();
    let held = [
        quota.try_acquire("a").await.unwrap(),
        quota.try_acquire("b").await.unwrap(),
    ];
    let first_deadline = held[0].deadline();
    let renewals = backend.renewals();
    let start = Instant::now();
    let mut flushes = 0;
    // Three ttls, a flush every 150 ms: every renewal meets an empty script cache.
    while start.elapsed() < ttl * 3 {
        server.command(&["SCRIPT", "FLUSH"]);
        flushes += 1;
        match quota.try_acquire("third").await {
            Err(Error::Full {
                cause: FullCause::NoSlot,
                ..
            }) => {}
            other => panic!("a third task on 2 slots after SCRIPT FLUSH: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    println!(
        "{flushes} flushes; {} renewals; deadline moved {:?}",
        backend.renewals() - renewals,
        held[0].deadline().duration_since(first_deadline).unwrap()
    );
    assert!(backend.renewals() - renewals >= 4);
    for lease in &held {
        assert_eq!(lease.lost_reason(), None);
        assert!(redis_holds(&server, &keys, lease));
    }
    held[0].release().await.unwrap();
    server.command(&["SCRIPT", "FLUSH"]);
    quota
        .try_acquire("third")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// `CONFIG SET timeout 1` reaps connections idle for over a second: a quota without events
/// (its connection not a subscriber) between heartbeats, and an idle process between jobs.
/// Leases survive, and the first call after an idle spell must not fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connection_reaping_loses_no_lease_and_fails_no_call() {
    let server = RedisServer::start();
    server.command(&["CONFIG", "SET", "timeout", "1"]);
    let name = unique("reaped");
    let keys = QuotaKeys::new(&name).unwrap();
    let ttl = Duration::from_millis(4500); // heartbeat 1.5 s: idle over 1 s between beats
    let backend = Counting::new(connect(&server.url()).await);
    let quota = quota_with(backend.clone(), &name, 1, ttl)
        .events(false)
        .build()
        .unwrap();
    let lease = quota.try_acquire("holder").await.unwrap();
    let renewals = backend.renewals();
    let connections = connections_received(&server);
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let reconnects = connections_received(&server) - connections;
    println!(
        "{} renewals in 3.2 s, {reconnects} new connections (the server reaped the idle one); \
         lost {:?}",
        backend.renewals() - renewals,
        lease.lost_reason()
    );
    assert!(reconnects >= 1, "the server's timeout reaped no connection");
    assert_eq!(lease.lost_reason(), None);
    assert!(redis_holds(&server, &keys, &lease));
    lease.release().await.unwrap();
    // Idle: no lease, no call for over the server's timeout; the next call must be answered.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let connections = connections_received(&server);
    match quota.try_acquire("after-idle").await {
        Ok(lease) => lease.release().await.unwrap(),
        Err(e) => panic!("first call after an idle spell: {e:?}"),
    }
    assert!(
        connections_received(&server) > connections,
        "the idle connection was reaped"
    );
}

fn connections_received(server: &RedisServer) -> u64 {
    server
        .command(&["INFO", "stats"])
        .as_string()
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("total_connections_received:"))
        .unwrap()
        .trim()
        .parse::<u64>()
        .unwrap()
        // Not counting this very INFO's own connection.
        - 1
}

/// A `DEBUG SLEEP` long enough for the wedge detector to replace the connection (three call
/// timeouts) while a waiter waits: afterwards the holder still holds, and the waiter is still
/// woken by the release message (the replacement, made while the server slept, subscribed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_still_woken_by_events_after_a_debug_sleep_replaced_the_connection() {
    let server = Arc::new(RedisServer::start_with(&["--enable-debug-command", "yes"]));
    let name = unique("sleep-wait");
    let keys = QuotaKeys::new(&name).unwrap();
    let ttl = Duration::from_secs(6); // heartbeat 2 s
    let options = leasehold::RedisOptions {
        call_timeout: Duration::from_millis(400),
        connect_timeout: Duration::from_millis(400),
        ..Default::default()
    };
    let holder_redis = leasehold::RedisBackend::connect_with(&server.url(), options.clone())
        .await
        .unwrap();
    let waiter_redis = leasehold::RedisBackend::connect_with(&server.url(), options)
        .await
        .unwrap();
    let holder_quota = quota_with(Arc::new(holder_redis.clone()), &name, 1, ttl)
        .build()
        .unwrap();
    let waiter_backend = Counting::new(Arc::new(waiter_redis.clone()));
    let waiter_quota = quota_with(waiter_backend.clone(), &name, 1, ttl)
        .poll_interval(Duration::from_secs(5))
        .build()
        .unwrap();
    let lease = holder_quota.try_acquire("holder").await.unwrap();
    // Waiting is for a slot, not for the backend (`Quota::acquire`): an attempt of the wait
    // that meets the spike fails at its call timeout, and the caller waits again.
    let waiter = tokio::spawn(async move {
        let end = Instant::now() + Duration::from_secs(15);
        let mut transient = 0;
        let lease = loop {
            match waiter_quota
                .acquire_timeout("waiter", end - Instant::now())
                .await
            {
                Err(Error::BackendUnavailable { .. }) if Instant::now() < end => transient += 1,
                other => break other,
            }
        };
        (lease, Instant::now(), (waiter_quota, transient))
    });
    waiting_and_subscribed(&server, &keys, &waiter_backend).await;
    sleep_server(&server, 3.5).await.unwrap();
    let woke = Instant::now();
    // Both processes are subscribed again, and the holder renewed after the spike.
    assert!(
        both_subscribed(&server, &keys, Duration::from_secs(4)).await,
        "subscribed again after the spike: {}",
        subscribers(&server, &keys.events)
    );
    assert!(
        eventually(Duration::from_secs(4), || redis_holds(
            &server, &keys, &lease
        ))
        .await,
        "the holder's lease is in Redis"
    );
    assert_eq!(lease.lost_reason(), None);
    let resubscribed = woke.elapsed();
    let (acquired, wake, (_quota, transient)) =
        released_to_waiter(lease, waiter, Duration::from_secs(12)).await;
    println!(
        "connection rebuilds: holder {}, waiter {}; both subscribed {resubscribed:?} after the \
         spike; waiter admitted {wake:?} after the release; {transient} waits ended \
         BackendUnavailable by the spike",
        holder_redis.connection_rebuilds(),
        waiter_redis.connection_rebuilds()
    );
    assert_woken_by_the_event(wake);
    acquired.release().await.unwrap();
}

/// An `allkeys-*` policy may evict the `fence` counter alone (two of the three eviction runs
/// above took it). No loss is detected (the epoch stands), so the cap and every holder's view
/// must survive as they are, and new admissions, even by a process that never saw a token, must
/// go on above the live leases' tokens (PROTOCOL.md §5.2 step 8) instead of restarting at 1
/// beside leases that hold the same tokens for as long as both live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_only_the_fence_keeps_the_cap_every_holder_and_unique_tokens() {
    let server = RedisServer::start();
    let name = unique("fence-evicted");
    let keys = QuotaKeys::new(&name).unwrap();
    let ttl = Duration::from_millis(1500);
    let a = quota_with(connect(&server.url()).await, &name, 4, ttl)
        .build()
        .unwrap();
    let old = [
        a.try_acquire("old-1").await.unwrap(),
        a.try_acquire("old-2").await.unwrap(),
    ];
    // What an eviction of that one key does.
    assert_eq!(server.command(&["DEL", &keys.fence]).as_int(), Some(1));
    let b = quota_with(connect(&server.url()).await, &name, 4, ttl)
        .build()
        .unwrap();
    let new = [
        b.try_acquire("new-1").await.unwrap(),
        b.try_acquire("new-2").await.unwrap(),
    ];
    assert!(matches!(
        b.try_acquire("new-3").await,
        Err(Error::Full {
            cause: FullCause::NoSlot,
            ..
        })
    ));
    // Two ttls later every lease is still held, and Redis agrees with each holder.
    tokio::time::sleep(ttl * 2).await;
    for lease in old.iter().chain(new.iter()) {
        assert_eq!(lease.lost_reason(), None, "{}", lease.task_id());
        assert!(redis_holds(&server, &keys, lease), "{}", lease.task_id());
    }
    let old_tokens: Vec<u64> = old.iter().map(|l| l.fencing_token()).collect();
    let new_tokens: Vec<u64> = new.iter().map(|l| l.fencing_token()).collect();
    println!("live after two ttls: old tokens {old_tokens:?}, new tokens {new_tokens:?}");
    let highest_old = old_tokens.iter().max().copied().unwrap();
    assert!(
        new_tokens.iter().all(|t| *t > highest_old),
        "new tokens {new_tokens:?} repeat or precede the live ones {old_tokens:?}"
    );
    // And the fence stores the highest token issued again.
    let stored = server.command(&["GET", &keys.fence]).as_string();
    assert_eq!(
        stored.as_deref(),
        Some(new_tokens.iter().max().unwrap().to_string().as_str())
    );
}
