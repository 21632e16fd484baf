//! Redis down: the backend-down policies, the short-circuit, holders through a short outage, and
//! dataset loss on a real restart without persistence.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::counting::Counting;
use common::{eventually, subscribers};
use leasehold::{
    BackendDownPolicy, BreakerConfig, BreakerMode, Error, Lease, LostReason, Quota, RedisBackend,
    RedisOptions, Unavailable,
};
use leasehold_testkit::RedisServer;

const TTL: Duration = Duration::from_millis(1000);

async fn quota(server: &RedisServer, name: &str, policy: BackendDownPolicy) -> Quota {
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    Quota::builder(name)
        .limit(2)
        .ttl(TTL)
        .when_backend_down(policy)
        .breaker(BreakerConfig {
            failures_to_open: 2,
            cool_down: Duration::from_millis(400),
        })
        .backend(backend)
        .build()
        .unwrap()
}

/// Calls `try_acquire` until the circuit opens (bounded).
async fn open_the_circuit(quota: &Quota) {
    let end = Instant::now() + Duration::from_secs(10);
    while quota.breaker_mode() != BreakerMode::Open {
        assert!(Instant::now() < end, "the circuit never opened");
        let _ = quota.try_acquire("probe").await;
    }
}

/// Kills `server` and takes a local lease for `task` once the circuit is open.
async fn granted_locally(server: &mut RedisServer, quota: &Quota, task: &str) -> Lease {
    server.kill();
    open_the_circuit(quota).await;
    let lease = quota.try_acquire(task).await.unwrap();
    assert!(lease.is_local());
    lease
}

/// Another process cancels `task` of quota `name`, and `lease` must hear it within `within`.
async fn cancel_reaches(
    server: &RedisServer,
    name: &str,
    task: &str,
    lease: &Lease,
    within: Duration,
) {
    let operator = Quota::builder(name)
        .limit(2)
        .ttl(TTL)
        .backend(RedisBackend::connect(&server.url()).await.unwrap())
        .build()
        .unwrap();
    operator.cancel(task, "operator stop").await.unwrap();
    let heard = tokio::time::timeout(within, lease.lost()).await;
    assert_eq!(heard, Ok(LostReason::Cancelled("operator stop".into())));
}

#[tokio::test]
async fn fail_closed_refuses_at_once_once_the_circuit_is_open_and_recovers() {
    let mut server = RedisServer::start();
    let quota = quota(&server, "closed", BackendDownPolicy::FailClosed).await;
    quota
        .try_acquire("before")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    server.kill();
    let first = Instant::now();
    let err = quota.try_acquire("t").await.unwrap_err();
    println!(
        "first refusal while Redis is down took {:?}",
        first.elapsed()
    );
    // Sent on the dead link (no reply) or refused at a reconnect: never the short-circuit yet.
    assert!(
        matches!(err, Error::BackendUnavailable { kind, .. } if kind != Unavailable::ShortCircuit),
        "{err:?}"
    );
    open_the_circuit(&quota).await;
    let mut worst = Duration::ZERO;
    for i in 0..100 {
        let asked = Instant::now();
        let err = quota.try_acquire(&format!("t{i}")).await.unwrap_err();
        worst = worst.max(asked.elapsed());
        assert_eq!(
            common::unavailable_kind(&err),
            Some(Unavailable::ShortCircuit),
            "{err:?}"
        );
    }
    println!("refusals with the circuit open: worst {worst:?} over 100 calls");
    // A call on the dead link waits for its 1 s timeout (the first refusal above); these never
    // touch the network. The bound leaves a loaded machine room to deschedule the loop.
    assert!(
        worst < Duration::from_millis(300),
        "no network wait: {worst:?}"
    );
    assert_eq!(quota.local_leases(), 0, "fail closed admits nothing");

    server.restart();
    let end = Instant::now() + Duration::from_secs(15);
    let lease = loop {
        match quota.try_acquire("after").await {
            Ok(lease) => break lease,
            // Down, then quarantined: this client saw the epoch the restart erased.
            Err(Error::BackendUnavailable { .. } | Error::Full { .. }) if Instant::now() < end => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    assert!(!lease.is_local());
    assert_eq!(quota.breaker_mode(), BreakerMode::Closed);
}

/// A port that refuses connections is known at once: no call waits for its timeout (3 s here),
/// the error says "refused", and the short-circuit opens after as many quick failures. When
/// Redis is back, the first call goes through: the connection attempt that failed a moment
/// earlier is not what it sees.
#[tokio::test]
async fn a_refused_connection_is_refused_at_once_and_the_first_call_after_it_goes_through() {
    let mut server = RedisServer::start();
    let options = RedisOptions {
        call_timeout: Duration::from_secs(3),
        ..RedisOptions::default()
    };
    let quota = Quota::builder("refused")
        .limit(2)
        .ttl(TTL)
        .breaker(BreakerConfig {
            failures_to_open: 3,
            cool_down: Duration::from_secs(30),
        })
        .backend(
            RedisBackend::connect_with(&server.url(), options)
                .await
                .unwrap(),
        )
        .build()
        .unwrap();
    drop(quota.try_acquire("before").await.unwrap());
    quota.flush().await;
    server.kill();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut took = Vec::new();
    while quota.breaker_mode() != BreakerMode::Open {
        assert!(took.len() < 3, "still closed after 3 refusals");
        let asked = Instant::now();
        let err = quota.try_acquire("t").await.unwrap_err();
        took.push(asked.elapsed());
        assert!(
            matches!(&err, Error::BackendUnavailable { kind: Unavailable::NoConnection, detail, .. }
                if detail.contains("refused")),
            "{err:?}"
        );
    }
    println!("refusals until the circuit opened: {took:?}");
    // Each used to wait out the call timeout (3 s); a generous bound for a loaded machine.
    assert!(
        took.iter().all(|t| *t < Duration::from_millis(750)),
        "{took:?}"
    );
    server.restart();
    // `status` does not go through the short-circuit: it shows the link itself.
    let asked = Instant::now();
    let status = quota.status().await;
    println!("first call after the restart: {:?}", asked.elapsed());
    assert!(status.is_ok(), "{status:?}");
}

/// A renewal that fails at once (here: refused while Redis restarts) is tried again a quarter
/// second later, not a heartbeat later: a restart that spans two beats but ends before the local
/// deadline keeps the lease (re-registered after the loss of the data, PROTOCOL.md §8).
#[tokio::test]
async fn a_holder_keeps_its_lease_through_a_restart_that_spans_two_heartbeats() {
    let mut server = RedisServer::start();
    let ttl = Duration::from_secs(3); // heartbeat 1 s, margin 150 ms
    let quota = Quota::builder("restarted")
        .limit(2)
        .ttl(ttl)
        .backend(RedisBackend::connect(&server.url()).await.unwrap())
        .build()
        .unwrap();
    let lease = quota.try_acquire("steady").await.unwrap();
    // Right after a confirmed renewal: its local deadline is about ttl − margin away.
    let first = lease.local_deadline();
    assert!(
        eventually(Duration::from_secs(5), || lease.local_deadline() != first).await,
        "no renewal"
    );
    let local_deadline = lease.local_deadline();
    server.kill();
    let killed = Instant::now();
    // Down past the next two beats (about 1 s and 2 s after that renewal was sent).
    tokio::time::sleep(Duration::from_millis(2100)).await;
    server.restart();
    let back = killed.elapsed();
    assert!(
        eventually(Duration::from_secs(3), || {
            lease.local_deadline() != local_deadline || !lease.is_held()
        })
        .await,
        "neither renewed nor lost"
    );
    println!(
        "down {back:?}; renewed {:?} after the kill, {:?} before the local deadline",
        killed.elapsed(),
        local_deadline.saturating_duration_since(Instant::now())
    );
    assert!(lease.is_held(), "{:?}", lease.lost_reason());
    tokio::time::sleep(ttl).await;
    assert!(lease.is_held(), "{:?}", lease.lost_reason());
}

/// The quick retry backs off: renewals refused at once are tried again 250 ms, 500 ms, ...
/// after each other, up to a quarter heartbeat, not every 250 ms until the local deadline.
#[tokio::test]
async fn renewals_refused_at_once_are_retried_backing_off() {
    let mut server = RedisServer::start();
    let counting = Counting::new(Arc::new(
        RedisBackend::connect(&server.url()).await.unwrap(),
    ));
    let ttl = Duration::from_secs(10); // heartbeat 3.33 s
    let quota = Quota::builder("backoff")
        .limit(1)
        .ttl(ttl)
        .shared_backend(counting.clone())
        .build()
        .unwrap();
    let lease = quota.try_acquire("held").await.unwrap();
    server.kill();
    let before = counting.renewals();
    // The beat at 3.33 s, then retries about 0.25 s, then 0.5 s and 0.83 s (a quarter
    // heartbeat) after each failure, each call taking up to about 0.15 s (two connection
    // attempts): 4 calls by 6 s. A retry every 250 ms would make about 7, no retry 1.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let calls = counting.renewals() - before;
    println!("renew calls in the 6 s after the kill: {calls}");
    assert!((3..=5).contains(&calls), "{calls}");
    assert!(lease.is_held());
}

/// The quick retries keep the regular beats' cadence: those still count toward the
/// short-circuit, so a process that only renews sees it open during an outage, as before the
/// retries (a retry beat that restarted the cadence kept it closed for good).
#[tokio::test]
async fn renewals_alone_open_the_short_circuit_during_an_outage() {
    let mut server = RedisServer::start();
    let quota = Quota::builder("renewing-only")
        .limit(1)
        .ttl(Duration::from_secs(6))
        .heartbeat(Duration::from_secs(1))
        .breaker(BreakerConfig {
            failures_to_open: 3,
            cool_down: Duration::from_secs(30),
        })
        .backend(RedisBackend::connect(&server.url()).await.unwrap())
        .build()
        .unwrap();
    let lease = quota.try_acquire("held").await.unwrap();
    server.kill();
    let killed = Instant::now();
    assert!(
        eventually(Duration::from_secs(5), || quota.breaker_mode()
            == BreakerMode::Open)
        .await,
        "still {:?} 5 s into the outage",
        quota.breaker_mode()
    );
    println!("opened {:?} after the kill", killed.elapsed());
    assert!(lease.is_held(), "{:?}", lease.lost_reason());
}

/// A connection whose handshake fails (the password was rotated and its reconnection refused)
/// is rebuilt, spaced: redis-rs tries again only after I/O errors, so the backend would refuse
/// every call until the process restarts, even once the password is right again.
#[tokio::test]
async fn a_connection_refused_at_its_handshake_recovers_once_the_password_is_right() {
    let server = RedisServer::start_with(&["--requirepass", "pw1"]);
    let url = format!("redis://:pw1@127.0.0.1:{}/", server.port());
    let options = RedisOptions {
        call_timeout: Duration::from_millis(300),
        ..RedisOptions::default()
    };
    let quota = Quota::builder("rotated")
        .limit(2)
        .ttl(TTL)
        .backend(RedisBackend::connect_with(&url, options).await.unwrap())
        .build()
        .unwrap();
    drop(quota.try_acquire("before").await.unwrap());
    quota.flush().await;
    server.command_auth("default", "pw1", &["CONFIG", "SET", "requirepass", "pw2"]);
    for kind in ["normal", "pubsub"] {
        server.command_auth("default", "pw2", &["CLIENT", "KILL", "TYPE", kind]);
    }
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        match quota.try_acquire("during").await {
            Err(Error::Misconfigured(leasehold::Misconfiguration::Auth(_))) => break,
            other => {
                assert!(Instant::now() < end, "never refused: {other:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    server.command_auth("default", "pw2", &["CONFIG", "SET", "requirepass", "pw1"]);
    let fixed = Instant::now();
    let end = fixed + Duration::from_secs(10);
    loop {
        match quota.try_acquire("after").await {
            Ok(_) => break,
            Err(e) => {
                assert!(
                    Instant::now() < end,
                    "still failing 10 s after the fix: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    println!(
        "admitted {:?} after the password was right again",
        fixed.elapsed()
    );
}

#[tokio::test]
async fn fail_open_admits_everyone_locally_while_redis_is_down() {
    let mut server = RedisServer::start();
    let quota = quota(&server, "open", BackendDownPolicy::FailOpen).await;
    server.kill();
    let mut leases = Vec::new();
    for i in 0..5 {
        let lease = quota.try_acquire(&format!("t{i}")).await.unwrap();
        assert!(lease.is_local() && lease.fencing_token() == 0);
        leases.push(lease);
    }
    assert_eq!(
        quota.local_leases(),
        5,
        "beyond the limit of 2: the storm goes downstream"
    );
    for lease in &leases {
        lease.release().await.unwrap();
    }
    assert_eq!(quota.local_leases(), 0);
}

#[tokio::test]
async fn degrade_local_admits_up_to_its_share_while_redis_is_down() {
    let mut server = RedisServer::start();
    let quota = quota(
        &server,
        "degrade",
        BackendDownPolicy::DegradeLocal { share: 2 },
    )
    .await;
    server.kill();
    let a = quota.try_acquire("a").await.unwrap();
    let b = quota.try_acquire("b").await.unwrap();
    assert!(a.is_local() && b.is_local());
    let full = quota.try_acquire("c").await.unwrap_err();
    assert!(
        matches!(
            full,
            Error::Full {
                cause: leasehold::FullCause::LocalShareUsed,
                ..
            }
        ),
        "{full:?}"
    );
    assert!(
        full.to_string().contains("backend is unavailable"),
        "{full}"
    );
    drop(a);
    let c = quota.try_acquire("c").await.unwrap();
    assert!(c.is_local());
    assert_eq!(quota.local_leases(), 2);
}

#[tokio::test]
async fn a_holder_keeps_its_lease_through_an_outage_shorter_than_the_ttl() {
    let server = RedisServer::start();
    let quota = quota(&server, "blip", BackendDownPolicy::FailClosed).await;
    let lease = quota.try_acquire("steady").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.pause();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.resume();
    tokio::time::sleep(TTL * 2).await;
    assert!(lease.is_held(), "{:?}", lease.lost_reason());
    let status = quota.status().await.unwrap();
    assert_eq!(status.holders.len(), 1);
}

#[tokio::test]
async fn a_restart_without_persistence_quarantines_admissions_for_one_ttl() {
    let mut server = RedisServer::start();
    let holders = quota(&server, "restart", BackendDownPolicy::FailClosed).await;
    let a = holders.try_acquire("a").await.unwrap();
    let b = holders.try_acquire("b").await.unwrap();
    server.restart(); // every lease, the fence and the epoch are gone
    let restarted = Instant::now();
    // A process that never saw the old epoch arrives; the old holders renew meanwhile.
    let newcomer = quota(&server, "restart", BackendDownPolicy::FailClosed).await;
    let end = Instant::now() + Duration::from_secs(10);
    while holders.status().await.map(|s| s.holders.len()).unwrap_or(0) < 2 {
        assert!(Instant::now() < end, "the old holders never re-registered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(a.is_held() && b.is_held());
    assert!(matches!(
        newcomer.try_acquire("c").await,
        Err(Error::Full { .. })
    ));
    drop(a);
    // A slot is free, but the quarantine holds it back until one ttl after the loss was seen.
    let c = newcomer
        .acquire_timeout("c", Duration::from_secs(5))
        .await
        .unwrap();
    let waited = restarted.elapsed();
    println!("first new admission {waited:?} after the restart (ttl {TTL:?})");
    assert!(waited >= TTL, "{waited:?}");
    assert!(c.fencing_token() > b.fencing_token());
    assert_eq!(newcomer.status().await.unwrap().holders.len(), 2);
}

#[tokio::test]
async fn renewals_slower_than_the_heartbeat_but_inside_the_ttl_keep_the_lease() {
    let server = RedisServer::start();
    let proxy = leasehold_testkit::proxy::FaultProxy::start(server.port());
    let backend = RedisBackend::connect(&proxy.url()).await.unwrap();
    let quota = Quota::builder("slow-link")
        .limit(1)
        // Heartbeat 333 ms, under the 400 ms round trip below; a ttl long enough that the
        // renewal sent a heartbeat later is answered well inside the deadline of the one before.
        .ttl(TTL * 3)
        .heartbeat(TTL / 3)
        .backend(backend)
        .build()
        .unwrap();
    let lease = quota.try_acquire("far").await.unwrap();
    // Each chunk is delayed both ways: a round trip takes about twice this, above the
    // heartbeat interval but well inside the ttl.
    proxy.set_latency(Duration::from_millis(200));
    tokio::time::sleep(TTL * 3).await;
    assert!(lease.is_held(), "{:?}", lease.lost_reason());
    proxy.set_latency(Duration::ZERO);
    assert_eq!(quota.status().await.unwrap().holders.len(), 1);
}

#[tokio::test]
async fn an_open_circuit_answers_at_once_even_before_the_first_subscription() {
    let mut server = RedisServer::start();
    // Never used while Redis was up: its first acquires would also subscribe to events.
    let quota = quota(
        &server,
        "never-subscribed",
        BackendDownPolicy::DegradeLocal { share: 100 },
    )
    .await;
    server.kill();
    open_the_circuit(&quota).await;
    let mut worst = Duration::ZERO;
    for i in 0..20 {
        let asked = Instant::now();
        let lease = quota.try_acquire(&format!("t{i}")).await.unwrap();
        worst = worst.max(asked.elapsed());
        assert!(lease.is_local());
        if quota.breaker_mode() != BreakerMode::Open {
            break; // the cool-down ended: the next call is a probe, with network I/O
        }
    }
    println!("local admissions with the circuit open: worst {worst:?}");
    // As above: a network call would wait for its 1 s timeout.
    assert!(
        worst < Duration::from_millis(300),
        "no network wait: {worst:?}"
    );
}

/// A local lease (granted while Redis was down) hears of a cancel only by message. After a long
/// outage (redis-rs makes two connection attempts when the link drops, then none until a call),
/// the connection must still come back by itself, subscription included, although this process
/// sends no call at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_lease_hears_a_cancel_after_a_long_outage() {
    let mut server = RedisServer::start();
    let quota = quota(&server, "long-outage", BackendDownPolicy::FailOpen).await;
    // Subscribed while Redis is up.
    common::warm_up(&quota).await;
    let channel = "leasehold:{long-outage}:events";
    assert!(
        eventually(Duration::from_secs(2), || subscribers(&server, channel)
            == 1)
        .await
    );
    server.kill();
    open_the_circuit(&quota).await;
    let lease = quota.try_acquire("job").await.unwrap();
    assert!(lease.is_local());
    tokio::time::sleep(Duration::from_secs(10)).await;
    server.restart();
    let back = Instant::now();
    assert!(
        eventually(Duration::from_secs(5), || subscribers(&server, channel)
            == 1)
        .await,
        "the subscription never came back with Redis"
    );
    println!("resubscribed {:?} after Redis came back", back.elapsed());
    cancel_reaches(
        &server,
        "long-outage",
        "job",
        &lease,
        Duration::from_secs(2),
    )
    .await;
}

/// The same when the quota never subscribed: its first acquire came during the outage. Nothing
/// else of this process calls Redis (a local lease is not renewed), so the quota itself must
/// keep trying to subscribe while it holds local leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_lease_granted_before_the_first_subscription_hears_a_cancel() {
    let mut server = RedisServer::start();
    let quota = quota(&server, "first-in-outage", BackendDownPolicy::FailOpen).await;
    let lease = granted_locally(&mut server, &quota, "job").await;
    server.restart();
    let back = Instant::now();
    let channel = "leasehold:{first-in-outage}:events";
    assert!(
        eventually(Duration::from_secs(5), || subscribers(&server, channel)
            == 1)
        .await,
        "never subscribed after Redis came back"
    );
    println!("subscribed {:?} after Redis came back", back.elapsed());
    cancel_reaches(
        &server,
        "first-in-outage",
        "job",
        &lease,
        Duration::from_secs(2),
    )
    .await;
}

/// A cancel sent after Redis came back but before the quota subscribed again went unheard: on
/// subscribing, the quota reads the markers of its local leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_sent_before_the_local_leases_quota_subscribed_again_is_heard() {
    let mut server = RedisServer::start();
    let quota = quota(&server, "cancel-unheard", BackendDownPolicy::FailOpen).await;
    let lease = granted_locally(&mut server, &quota, "job").await;
    server.restart();
    // Sent at once: the quota has not subscribed yet (its retry comes within a second).
    let operator = Quota::builder("cancel-unheard")
        .limit(2)
        .ttl(TTL)
        .backend(RedisBackend::connect(&server.url()).await.unwrap())
        .build()
        .unwrap();
    let channel = "leasehold:{cancel-unheard}:events";
    assert_eq!(
        subscribers(&server, channel),
        0,
        "the quota subscribed again before the cancel: its message would be heard"
    );
    operator.cancel("job", "operator stop").await.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(5), lease.lost()).await;
    assert_eq!(heard, Ok(LostReason::Cancelled("operator stop".into())));
}
