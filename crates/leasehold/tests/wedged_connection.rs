//! A connection wedged above TCP (the proxy keeps the socket open and forwards nothing, while
//! new connections work) is replaced by the Redis backend: admissions resume, held leases keep
//! renewing, and the quota's Pub/Sub subscription follows to the new connection. A Redis that is
//! merely slow (replies inside the call timeout) replaces nothing.

mod common;

use std::time::{Duration, Instant};

use common::proxied::connect_through;
use leasehold::backend::QuotaEvent;
use leasehold::{Backend, Error, Quota, QuotaKeys};
use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::RedisServer;

/// Short, so that the three rounds of timeouts (about 0.9 s) pass quickly; far above a loopback
/// round trip, even on a loaded 2-core machine.
const CALL_TIMEOUT: Duration = Duration::from_millis(300);
/// Long against the rebuild: a lease renewed just before the wedge has ≈ 5.7 s of local
/// deadline, the rebuild needs ≈ 1 s, the next heartbeat (2 s) then renews on the new connection.
const TTL: Duration = Duration::from_secs(6);

/// Receives events until `wanted` matches one, within `within`.
async fn expect_event(
    events: &mut tokio::sync::broadcast::Receiver<QuotaEvent>,
    within: Duration,
    wanted: impl Fn(&QuotaEvent) -> bool,
) -> QuotaEvent {
    let end = Instant::now() + within;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, events.recv()).await {
            Ok(Ok(event)) if wanted(&event) => return event,
            Ok(Ok(_)) | Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => {}
            Ok(Err(e)) => panic!("event channel ended: {e}"),
            Err(_) => panic!("no such event within {within:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_connection_is_replaced_and_leases_admissions_and_events_go_on() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let backend = connect_through(&proxy, CALL_TIMEOUT).await;
    let quota = Quota::builder("wedge")
        .limit(2)
        .ttl(TTL)
        // Waiters must be woken by the release message, not by a poll.
        .poll_interval(Duration::from_secs(60))
        .backend(backend.clone())
        .build()
        .unwrap();
    let held = quota.try_acquire("held").await.unwrap();
    // The same channel the quota listens on: it sees what the quota's listener sees.
    let mut events = backend
        .subscribe(&QuotaKeys::new("wedge").unwrap())
        .await
        .unwrap();
    assert_eq!(backend.connection_rebuilds(), 0);
    let accepted_before = proxy.accepted();

    let wedged_at = Instant::now();
    assert!(proxy.wedge_connections() >= 1);
    let end = wedged_at + Duration::from_secs(20);
    let after = loop {
        match quota.try_acquire("after").await {
            Ok(lease) => break lease,
            Err(Error::BackendUnavailable { .. }) if Instant::now() < end => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("after {:?}: {e:?}", wedged_at.elapsed()),
        }
    };
    let recovered = wedged_at.elapsed();
    println!(
        "admitted again {recovered:?} after the wedge, {} rebuild(s)",
        backend.connection_rebuilds()
    );
    // Three rounds of 300 ms, the connect, then the short-circuit's cool-down (at most 1.5 s).
    assert!(recovered < Duration::from_secs(10), "{recovered:?}");
    assert!(backend.connection_rebuilds() >= 1);
    assert!(proxy.accepted() > accepted_before, "a new connection");

    // The confirmation of the resubscription reaches the quota's channel.
    expect_event(&mut events, Duration::from_secs(5), |e| {
        *e == QuotaEvent::Resubscribed
    })
    .await;

    // The lease held across the wedge lives past the local deadline it had when the wedge came:
    // it was renewed on the new connection.
    let past_old_deadline = wedged_at + TTL + Duration::from_millis(500);
    tokio::time::sleep_until(past_old_deadline.into()).await;
    assert!(
        held.is_held(),
        "the lease held across the wedge was renewed"
    );

    // Full now: a waiter is woken by the release message on the new subscription.
    let waiting = {
        let quota = quota.clone();
        tokio::spawn(async move { quota.acquire("waiter").await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "the quota is full");
    let released = Instant::now();
    after.release().await.unwrap();
    expect_event(
        &mut events,
        Duration::from_secs(5),
        |e| matches!(e, QuotaEvent::Released { task_id, .. } if task_id == "after"),
    )
    .await;
    let waiter = tokio::time::timeout(Duration::from_secs(3), waiting)
        .await
        .expect("the waiter was woken by the release, well before any poll or expiry")
        .unwrap()
        .unwrap();
    println!("waiter admitted {:?} after the release", released.elapsed());
    assert!(held.is_held());
    waiter.release().await.unwrap();
    held.release().await.unwrap();
    // One wedge, one rebuild: the new connection answered from then on.
    assert_eq!(backend.connection_rebuilds(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_redis_that_answers_within_the_call_timeout_replaces_nothing() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    // +300 ms per round trip against a 1.5 s call timeout: slow, never silent.
    let backend = connect_through(&proxy, Duration::from_millis(1500)).await;
    let quota = Quota::builder("slow")
        .limit(1)
        .ttl(TTL)
        .backend(backend.clone())
        .build()
        .unwrap();
    let held = quota.try_acquire("held").await.unwrap();
    let accepted_before = proxy.accepted();
    proxy.set_latency(Duration::from_millis(150));
    let end = Instant::now() + Duration::from_secs(6);
    let mut calls = 0;
    while Instant::now() < end {
        // Full (the slot is held): a full round trip through the slow link each time.
        match quota.try_acquire("other").await {
            Err(Error::Full { .. }) => calls += 1,
            Err(Error::BackendUnavailable { kind, detail, .. }) => {
                println!("a call failed ({kind}): {detail}")
            }
            other => panic!("{other:?}"),
        }
    }
    proxy.set_latency(Duration::ZERO);
    println!("{calls} slow calls");
    assert!(calls >= 3, "{calls}");
    assert!(held.is_held(), "renewals got through");
    assert_eq!(backend.connection_rebuilds(), 0, "slow is not wedged");
    assert_eq!(proxy.accepted(), accepted_before, "no new connection");
    held.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_slower_than_the_call_timeout_is_reconnected_to_rarely() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let backend = connect_through(&proxy, CALL_TIMEOUT).await;
    let quota = Quota::builder("slower")
        .limit(1)
        .ttl(TTL)
        .backend(backend.clone())
        .build()
        .unwrap();
    // +800 ms per round trip against 300 ms: every call times out, new connections too (their
    // handshake is as slow), just as if every connection were wedged.
    proxy.set_latency(Duration::from_millis(400));
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(8) {
        let _ = quota.try_acquire("t").await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rebuilds = backend.connection_rebuilds();
    println!("{rebuilds} rebuild attempts in 8 s");
    // Spacing 1.2 s, then 2.4 s, 4.8 s: at most three attempts in 8 s (the first needs about
    // 0.9 s of timeouts), never one per round.
    assert!((1..=3).contains(&rebuilds), "{rebuilds}");
    proxy.set_latency(Duration::ZERO);
}
