//! `RedisBackend::connect_lazy`: a worker can start while Redis is down. Its quotas answer by
//! their backend-down policy meanwhile, and once Redis is up they admit in Redis and hear its
//! events, with no restart of the process.

mod common;

use std::time::{Duration, Instant};

use leasehold::{
    BackendDownPolicy, Error, FullCause, Misconfiguration, Quota, RedisBackend, RedisOptions,
};
use leasehold_testkit::RedisServer;

/// Retries `try_acquire` while Redis cannot answer, for at most 10 s: until it is answered in
/// Redis. A local lease (the policy's, while the short-circuit opened by the outage cools down)
/// is given back at once.
async fn acquire_once_redis_answers(quota: &Quota, task_id: &str) -> leasehold::Lease {
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        match quota.try_acquire(task_id).await {
            Ok(lease) if lease.is_local() && Instant::now() < give_up => {
                lease.release().await.unwrap();
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Ok(lease) => break lease,
            Err(Error::BackendUnavailable { .. }) if Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{task_id}: {e:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_while_redis_is_down_admits_by_its_policy_then_in_redis() {
    let mut server = RedisServer::start();
    server.kill();

    let started = Instant::now();
    let backend = RedisBackend::connect_lazy(&server.url(), RedisOptions::default())
        .await
        .expect("no I/O: Redis being down does not matter yet");
    let connected_in = started.elapsed();
    assert!(
        RedisBackend::connect(&server.url()).await.is_err(),
        "connect, by contrast, needs Redis"
    );
    let quota = |name: &str, policy: BackendDownPolicy| {
        Quota::builder(name)
            .limit(1)
            // A waiter served sooner than its poll and its ttl was woken by a release event.
            .ttl(Duration::from_secs(10))
            .poll_interval(Duration::from_secs(10))
            .when_backend_down(policy)
            .backend(backend.clone())
            .build()
            .unwrap()
    };
    let degraded = quota("degraded", BackendDownPolicy::DegradeLocal { share: 1 });
    let closed = quota("closed", BackendDownPolicy::FailClosed);

    let local = degraded.try_acquire("during-the-outage").await.unwrap();
    assert!(local.is_local());
    assert!(matches!(
        degraded.try_acquire("another").await,
        Err(Error::Full {
            cause: FullCause::LocalShareUsed,
            ..
        })
    ));
    assert!(matches!(
        closed.try_acquire("refused").await,
        Err(Error::BackendUnavailable { .. })
    ));
    local.release().await.unwrap();

    server.restart();
    let restarted = Instant::now();
    let holder = acquire_once_redis_answers(&closed, "holder").await;
    let admitted_after = restarted.elapsed();
    assert!(!holder.is_local());
    assert_eq!(holder.fencing_token(), 1);
    assert!(
        server
            .command(&["HGET", "leasehold:{closed}:holders", "holder"])
            .as_string()
            .is_some(),
        "the lease is in Redis"
    );
    let in_redis = acquire_once_redis_answers(&degraded, "in-redis").await;
    assert!(!in_redis.is_local());

    // Events: a waiter is woken by the holder's release, not by its poll or its ttl (10 s). The
    // subscription failed during the outage; it is made again at most a second after that.
    let waiter = {
        let closed = closed.clone();
        tokio::spawn(async move { closed.acquire("waiter").await })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (served, woken_after) =
        common::release_then_served(&holder, waiter, Duration::from_secs(5)).await;
    println!(
        "connect_lazy returned in {connected_in:?}; first admission in Redis {admitted_after:?} \
         after the restart; waiter served {woken_after:?} after a release"
    );
    assert!(
        connected_in < Duration::from_millis(500),
        "{connected_in:?}"
    );
    assert!(woken_after < Duration::from_secs(2), "{woken_after:?}");
    served.release().await.unwrap();
    in_redis.release().await.unwrap();
}

#[tokio::test]
async fn connect_lazy_still_refuses_a_bad_url_at_once() {
    let refused = RedisBackend::connect_lazy("redis://127.0.0.1:notaport/", Default::default())
        .await
        .map(|_| ());
    assert!(
        matches!(
            refused,
            Err(Error::Misconfigured(Misconfiguration::InvalidUrl(_)))
        ),
        "{refused:?}"
    );
}
