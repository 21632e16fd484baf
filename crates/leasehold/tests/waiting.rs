//! Waiting for a slot, against a private redis-server (and a fault proxy): a waiter hears of the
//! releases that concern it however its wait began, after the connection comes back, and after
//! every handle of its quota is gone. Every loop is bounded in time.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::{BackendDownPolicy, BreakerConfig, BreakerMode, Error};
use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::RedisServer;

fn waiting_marker_exists(server: &RedisServer, name: &str) -> bool {
    let key = format!("leasehold:{{{name}}}:waiting");
    server.command(&["EXISTS", &key]).as_int() == Some(1)
}

/// A quota of limit 1 on a private redis-server whose slot `holder` holds through a direct
/// client, and a client of the same server through `proxy`, for the waiter under test.
struct Held {
    server: RedisServer,
    proxy: FaultProxy,
    name: String,
    holder: leasehold::Lease,
    _holders: leasehold::Quota,
}

impl Held {
    async fn start(prefix: &str, ttl: Duration) -> Held {
        let server = RedisServer::start();
        let proxy = FaultProxy::start(server.port());
        let name = common::unique(prefix);
        let holders = common::quota_with(common::connect(&server.url()).await, &name, 1, ttl)
            .build()
            .unwrap();
        let holder = holders.try_acquire("holder").await.unwrap();
        Held {
            server,
            proxy,
            name,
            holder,
            _holders: holders,
        }
    }

    /// A quota builder for the waiter's client, through the proxy.
    async fn waiter_quota(&self, ttl: Duration) -> leasehold::QuotaBuilder {
        common::quota_with(common::connect(&self.proxy.url()).await, &self.name, 1, ttl)
    }
}

/// A release announced while a newcomer's first attempt is out (its `full` reply on the way
/// back) must wake that newcomer, not nobody: otherwise it sleeps a whole poll (or expiry hint)
/// with the slot free. The window is widened here by a busy application runtime (which leasehold
/// tolerates); on a multi-thread runtime it is a plain race between the reply and the event.
#[test]
fn a_release_during_a_newcomers_first_attempt_wakes_it() {
    let ttl = Duration::from_secs(10);
    let server = RedisServer::start();
    let proxy = Arc::new(FaultProxy::start(server.port()));
    let name = common::unique("first-attempt");
    let main = tokio::runtime::Runtime::new().unwrap();
    let direct = main.block_on(common::connect(&server.url()));
    let holders = common::quota_with(direct, &name, 1, ttl).build().unwrap();
    let holder = main.block_on(holders.try_acquire("holder")).unwrap();

    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (warm_tx, warm_rx) = std::sync::mpsc::channel::<()>();
    let (marker_gone_tx, marker_gone_rx) = std::sync::mpsc::channel::<()>();
    let app = {
        let (proxy, name) = (proxy.clone(), name.clone());
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async move {
                    let backend = common::connect(&proxy.url()).await;
                    let waiters = common::quota_with(backend, &name, 1, ttl)
                        .poll_interval(Duration::from_secs(2))
                        .build()
                        .unwrap();
                    // Subscribed, scripts loaded; refused once (sets the waiting marker).
                    assert!(waiters.try_acquire("warm").await.is_err());
                    // The test removes that marker: only the attempt below writes it again.
                    warm_tx.send(()).unwrap();
                    marker_gone_rx.recv().unwrap();
                    proxy.set_latency(Duration::from_millis(60));
                    let started = Instant::now();
                    let w = tokio::spawn(async move {
                        waiters
                            .acquire_timeout("w", Duration::from_millis(1500))
                            .await
                    });
                    tokio::time::sleep(Duration::from_millis(20)).await; // attempt on the wire
                    go_tx.send(()).unwrap();
                    // Busy application runtime for a moment (CPU-bound work).
                    std::thread::sleep(Duration::from_millis(400));
                    let got = w.await.unwrap();
                    (got.map(|l| l.fencing_token()), started.elapsed())
                })
        })
    };
    warm_rx.recv().unwrap();
    server.command(&["DEL", &format!("leasehold:{{{name}}}:waiting")]);
    marker_gone_tx.send(()).unwrap();
    go_rx.recv().unwrap();
    // The waiter's acquire ran at Redis ~60 ms after it was sent (it wrote the waiting marker
    // again when it was refused): release after that, while its reply is on the way back.
    let end = Instant::now() + Duration::from_secs(5);
    while !waiting_marker_exists(&server, &name) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        waiting_marker_exists(&server, &name),
        "the waiter's first attempt reached Redis and was refused"
    );
    main.block_on(holder.release()).unwrap();
    let released_at = Instant::now();
    let (got, waited) = app.join().unwrap();
    println!(
        "waiter: {got:?} after {waited:?}; slot free since {:?} before the end",
        released_at.elapsed()
    );
    assert!(
        got.is_ok(),
        "the waiter timed out ({got:?}) although the slot was free for the last ~1.3 s of its 1.5 s"
    );
}

/// A waiter whose wait began while the circuit was open (so nothing subscribed then) subscribes
/// once Redis answers again, and hears releases instead of relying on its polls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_started_under_an_open_circuit_hears_releases_once_redis_is_back() {
    let ttl = Duration::from_secs(10);
    let held = Held::start("unsubscribed", ttl).await;
    let (server, proxy, name, holder) = (&held.server, &held.proxy, &held.name, &held.holder);
    let quota = held
        .waiter_quota(ttl)
        .await
        .poll_interval(Duration::from_secs(2))
        .when_backend_down(BackendDownPolicy::DegradeLocal { share: 1 })
        .breaker(BreakerConfig {
            failures_to_open: 1,
            cool_down: Duration::from_millis(300),
        })
        .build()
        .unwrap();
    proxy.partition(true);
    let local = quota.try_acquire("local").await.unwrap();
    assert!(local.is_local() && quota.breaker_mode() == BreakerMode::Open);
    let waiter = {
        let quota = quota.clone();
        tokio::spawn(async move { quota.acquire_timeout("w", Duration::from_secs(8)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    proxy.partition(false);
    // Wait until the waiter's probe was refused by Redis (it sets the waiting marker).
    server.command(&["DEL", &format!("leasehold:{{{name}}}:waiting")]);
    assert!(
        common::eventually(Duration::from_secs(5), || waiting_marker_exists(
            server, name
        ))
        .await,
        "the waiter never reached Redis"
    );
    // The marker is written before the probe's answer reaches the client and closes the circuit.
    assert!(
        common::eventually(Duration::from_secs(2), || quota.breaker_mode()
            == BreakerMode::Closed)
        .await,
        "the probe's answer closes the circuit"
    );
    holder.release().await.unwrap();
    let released = Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(8), waiter).await;
    let after = released.elapsed();
    println!("waiter admitted {after:?} after the release: {got:?}");
    assert!(matches!(got, Ok(Ok(Ok(_)))), "{got:?}");
    assert!(
        after < Duration::from_millis(500),
        "the release was announced, but the waiter only noticed it at its poll, {after:?} later"
    );
    drop(local);
}

/// A waiter hears of a release it missed while its connection was down: the resubscription after
/// the reconnect makes every waiter re-check at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_missed_during_a_reconnect_is_rechecked_after_resubscribing() {
    let ttl = Duration::from_secs(10);
    let held = Held::start("resub", ttl).await;
    let (server, proxy, name, holder) = (&held.server, &held.proxy, &held.name, &held.holder);
    let quota = held
        .waiter_quota(ttl)
        .await
        .poll_interval(Duration::from_secs(3))
        .build()
        .unwrap();
    let waiter = {
        let quota = quota.clone();
        tokio::spawn(async move { quota.acquire_timeout("w", Duration::from_secs(8)).await })
    };
    assert!(
        common::eventually(Duration::from_secs(2), || waiting_marker_exists(
            server, name
        ))
        .await
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "the waiter waits before the release");
    proxy.drop_pushes(true);
    holder.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The release's message was dropped (the proxy does not count what it drops): the waiter,
    // whose next poll is seconds away, did not hear of the free slot.
    assert!(
        !waiter.is_finished(),
        "the waiter heard the release although its message was to be dropped"
    );
    proxy.drop_pushes(false);
    let reconnect = Instant::now();
    proxy.drop_connections();
    let got = tokio::time::timeout(Duration::from_secs(8), waiter).await;
    let after = reconnect.elapsed();
    println!("waiter admitted {after:?} after the reconnect: {got:?}");
    assert!(matches!(got, Ok(Ok(Ok(_)))), "{got:?}");
    assert!(after < Duration::from_millis(1200), "{after:?}");
}

/// Every handle of a quota dropped while a lease, a waiter's attempt and an orphan exist: nothing
/// panics or hangs, the lease keeps being renewed while held and is released when dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_every_handle_keeps_leases_working_and_releases_them() {
    let ttl = Duration::from_millis(600);
    let server = RedisServer::start();
    let name = common::unique("dropped");
    let watcher = common::quota_with(common::connect(&server.url()).await, &name, 2, ttl)
        .build()
        .unwrap();
    let lease = {
        let quota = common::quota_with(common::connect(&server.url()).await, &name, 2, ttl)
            .build()
            .unwrap();
        let lease = quota.try_acquire("a").await.unwrap();
        let _b = quota.try_acquire("b").await.unwrap();
        // A waiter that gives up mid-wait, then the quota goes.
        let w = quota.acquire_timeout("c", Duration::from_millis(50)).await;
        assert!(matches!(w, Err(Error::TimedOut { .. })), "{w:?}");
        lease
    };
    // Past two ttls: still renewed.
    tokio::time::sleep(ttl * 2).await;
    assert!(lease.is_held(), "{:?}", lease.lost_reason());
    assert_eq!(common::holder_ids(&watcher).await, vec!["a".to_string()]);
    drop(lease);
    assert!(
        common::eventually(Duration::from_millis(300), || {
            server
                .command(&["ZCARD", &format!("leasehold:{{{name}}}:leases")])
                .as_int()
                == Some(0)
        })
        .await,
        "the dropped lease was not released"
    );
}

/// Waiters behind the head poll only as a safety net (a lost message, a cancel marker), and
/// together: the line of a process shares one jittered poll, whose attempts go out in one
/// script call. 40 idle waiters then cost Redis about what the head alone costs (a poll every
/// 0.5–1.5 × 250 ms, ≈ 16 calls in 4 s) plus one call per shared poll (≈ 4), not one call per
/// waiter per poll (≈ 4 each in 4 s, 150 and more in all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_behind_the_head_poll_together_not_each_on_its_own() {
    let ttl = Duration::from_secs(30);
    let held = Held::start("line-poll", ttl).await;
    let counting = common::counting::Counting::new(common::connect(&held.server.url()).await);
    let quota = common::quota_with(counting.clone(), &held.name, 1, ttl)
        .poll_interval(Duration::from_millis(250))
        .build()
        .unwrap();
    let ids: Vec<String> = (0..40).map(|i| format!("w{i}")).collect();
    let waiters: Vec<_> = ids
        .iter()
        .map(|id| {
            let (quota, id) = (quota.clone(), id.clone());
            tokio::spawn(async move { quota.acquire(&id).await?.release().await })
        })
        .collect();
    let all: Vec<&str> = ids.iter().map(String::as_str).collect();
    assert!(
        counting.all_refused(&all, Duration::from_secs(10)).await,
        "every waiter was refused once and is in line"
    );
    let before = common::calls_of(&held.server, "evalsha");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let calls = common::calls_of(&held.server, "evalsha") - before;
    println!("40 idle waiters: {calls} script calls in 4 s");
    assert!(
        waiters.iter().all(|w| !w.is_finished()),
        "the slot stayed held: every waiter still waits"
    );
    assert!(
        calls < 40,
        "{calls} script calls in 4 s for 40 idle waiters: they poll one by one"
    );
    // The line still moves: once the slot frees, each waiter in turn is admitted and releases.
    held.holder.release().await.unwrap();
    for waiter in waiters {
        let done = tokio::time::timeout(Duration::from_secs(10), waiter).await;
        assert!(matches!(done, Ok(Ok(Ok(())))), "{done:?}");
    }
}
