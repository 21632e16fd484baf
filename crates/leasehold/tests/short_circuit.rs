//! The short-circuit and the backend-down policies, against a private redis-server (and a fault
//! proxy): what counts as a failure, and what a policy's share is a share of. Every loop is
//! bounded in time.

mod common;

use std::time::Duration;

use leasehold::{
    BackendDownPolicy, BreakerConfig, BreakerMode, Error, Quota, RedisBackend, RedisOptions,
};
use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::RedisServer;

/// The short-circuit opens after `failures_to_open` consecutive failed *calls* (PROTOCOL §6.10).
/// Attempts that share one batched script call fail together and count as one failure: otherwise
/// one lost reply would open the circuit, and FailOpen would grant local leases while Redis is
/// healthy and the quota has free slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failed_batched_call_does_not_open_the_circuit() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let backend = RedisBackend::connect_with(
        &proxy.url(),
        RedisOptions {
            call_timeout: Duration::from_millis(300),
            ..RedisOptions::default()
        },
    )
    .await
    .unwrap();
    let name = common::unique("one-call");
    let quota = Quota::builder(name)
        .limit(10)
        .ttl(Duration::from_secs(2))
        .when_backend_down(BackendDownPolicy::FailClosed)
        .breaker(BreakerConfig {
            failures_to_open: 3,
            cool_down: Duration::from_secs(5),
        })
        .backend(backend)
        .build()
        .unwrap();
    quota
        .try_acquire("warm")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let before = common::evalsha_calls(&server);
    proxy.stall(true);
    let (a, b, c) = tokio::join!(
        quota.try_acquire("a"),
        quota.try_acquire("b"),
        quota.try_acquire("c")
    );
    proxy.stall(false);
    assert!(
        [&a, &b, &c]
            .iter()
            .all(|r| matches!(r, Err(Error::BackendUnavailable(_)))),
        "{a:?} {b:?} {c:?}"
    );
    // The held bytes reach the server on resume: count the script calls they made.
    assert!(
        common::eventually(Duration::from_secs(2), || common::evalsha_calls(&server)
            > before)
        .await
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let calls = common::evalsha_calls(&server) - before;
    println!(
        "three attempts went out in {calls} script call(s); breaker {:?}",
        quota.breaker_mode()
    );
    assert_eq!(
        calls, 1,
        "the attempts did not share a call; the test proves nothing"
    );
    assert_eq!(
        quota.breaker_mode(),
        BreakerMode::Closed,
        "one failed call (carrying three attempts) opened the circuit"
    );
    let after = quota.try_acquire("d").await;
    assert!(after.is_ok(), "Redis answers again, yet: {after:?}");
}

/// Same as above, with FailOpen: the consequence is a local lease, uncounted by Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failed_batched_call_grants_no_local_lease_once_redis_answers() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let backend = RedisBackend::connect_with(
        &proxy.url(),
        RedisOptions {
            call_timeout: Duration::from_millis(300),
            ..RedisOptions::default()
        },
    )
    .await
    .unwrap();
    let quota = Quota::builder(common::unique("fail-open"))
        .limit(10)
        .ttl(Duration::from_secs(2))
        .when_backend_down(BackendDownPolicy::FailOpen)
        .breaker(BreakerConfig {
            failures_to_open: 3,
            cool_down: Duration::from_secs(5),
        })
        .backend(backend)
        .build()
        .unwrap();
    quota
        .try_acquire("warm")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    proxy.stall(true);
    let (a, b, c) = tokio::join!(
        quota.try_acquire("a"),
        quota.try_acquire("b"),
        quota.try_acquire("c")
    );
    proxy.stall(false);
    // Local leases for the three, by policy (their one call failed): fine.
    drop((a, b, c));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let d = quota.try_acquire("d").await.unwrap();
    assert!(
        !d.is_local(),
        "Redis answers and has 7+ free slots, yet `d` got a local lease (breaker {:?})",
        quota.breaker_mode()
    );
}

/// `DegradeLocal { share }` grants up to `share` leases in this process, however many handles of
/// the quota (on one backend) grant them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn degrade_local_share_holds_across_handles_of_one_quota() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let backend = common::connect(&proxy.url()).await;
    let name = common::unique("share");
    let build = || {
        common::quota_with(backend.clone(), &name, 5, Duration::from_secs(2))
            .when_backend_down(BackendDownPolicy::DegradeLocal { share: 1 })
            .breaker(BreakerConfig {
                failures_to_open: 1,
                cool_down: Duration::from_secs(5),
            })
            .build()
            .unwrap()
    };
    let (one, two) = (build(), build());
    proxy.partition(true);
    let a = one.try_acquire("a").await;
    let b = two.try_acquire("b").await;
    let local = [&a, &b]
        .iter()
        .filter(|r| r.as_ref().is_ok_and(|l| l.is_local()))
        .count();
    println!(
        "local leases: {local} (handles say {} and {})",
        one.local_leases(),
        two.local_leases()
    );
    proxy.partition(false);
    assert!(
        local <= 1,
        "share 1, yet this process holds {local} local leases: {a:?} {b:?}"
    );
}
