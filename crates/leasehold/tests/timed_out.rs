//! `acquire_timeout` that runs out says why: no slot (an attempt was answered "full"), or no
//! answer at all (a stalled backend, when the wait is shorter than a call timeout). An operator
//! who reads "no slot" raises the limit; that must only happen when the quota is full.

use std::sync::Arc;
use std::time::Duration;

use leasehold::{Backend, Error, MemoryBackend, Quota, RedisBackend, RedisOptions};
use leasehold_testkit::RedisServer;

#[tokio::test]
async fn a_wait_that_runs_out_tells_a_full_quota_from_a_stalled_backend() {
    let server = RedisServer::start();
    let options = RedisOptions {
        call_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let backend = RedisBackend::connect_with(&server.url(), options)
        .await
        .unwrap();
    let quota = Quota::builder("stalled")
        .limit(1)
        .ttl(Duration::from_secs(30))
        .backend(backend)
        .build()
        .unwrap();

    // Full: the holder keeps the one slot, the waiter's attempts are answered "no slot".
    let holder = quota.try_acquire("holder").await.unwrap();
    let full = quota
        .acquire_timeout("waiter", Duration::from_millis(300))
        .await;
    match &full {
        Err(e @ Error::TimedOut { answered, .. }) => {
            assert!(*answered, "{e}");
            assert!(e.to_string().starts_with("no slot in quota"), "{e}");
        }
        other => panic!("expected a timeout: {other:?}"),
    }
    holder.release().await.unwrap();

    // Stalled: a free slot, but Redis answers nothing before the wait (shorter than the call
    // timeout) runs out.
    server.pause();
    let stalled = quota
        .acquire_timeout("waiter", Duration::from_millis(300))
        .await;
    server.resume();
    match &stalled {
        Err(e @ Error::TimedOut { answered, .. }) => {
            assert!(!answered, "{e}");
            assert!(e.to_string().starts_with("no answer for quota"), "{e}");
        }
        other => panic!("expected a timeout: {other:?}"),
    }
    // Redis answers again: the attempt that was out when the wait ended admitted "waiter" late,
    // and that admission, which nobody took, was given back; the slot is free.
    quota.flush().await;
    let later = quota
        .acquire_timeout("another", Duration::from_secs(5))
        .await;
    assert!(later.is_ok(), "{later:?}");
}

/// Only the head of a handle's line of waiters attempts; the others wait behind it, polling
/// rarely. A waiter that runs out of time there without an answer of its own still says "no
/// slot" when the backend answered the attempts of those ahead (before, two of three such
/// waiters said "no answer ... the backend is slow or unreachable" of a healthy backend).
#[tokio::test]
async fn waiters_in_line_that_run_out_say_no_slot_when_those_ahead_were_answered() {
    let server = RedisServer::start();
    let backends: Vec<(&str, Arc<dyn Backend>)> = vec![
        ("memory", Arc::new(MemoryBackend::new())),
        (
            "redis",
            Arc::new(RedisBackend::connect(&server.url()).await.unwrap()),
        ),
    ];
    for (name, backend) in backends {
        let quota = Quota::builder("line")
            .shared_backend(backend)
            .limit(1)
            .ttl(Duration::from_secs(30))
            .build()
            .unwrap();
        let holder = quota.try_acquire("holder").await.unwrap();
        let mut waiters = Vec::new();
        for i in 0..3 {
            let quota = quota.clone();
            waiters.push(tokio::spawn(async move {
                quota
                    .acquire_timeout(&format!("waiter-{i}"), Duration::from_secs(1))
                    .await
            }));
            tokio::time::sleep(Duration::from_millis(20)).await; // in this order
        }
        for (i, waiter) in waiters.into_iter().enumerate() {
            match waiter.await.unwrap() {
                Err(e @ Error::TimedOut { answered, .. }) => {
                    assert!(answered, "{name}, waiter {i}: {e}");
                    assert!(e.to_string().starts_with("no slot in quota"), "{e}");
                }
                other => panic!("{name}, waiter {i}: expected a timeout: {other:?}"),
            }
        }
        holder.release().await.unwrap();
    }
}

/// Admissions answered during a wait are no "no slot": on a slow link to a quota with free
/// slots, a wait that runs out before its own answer says "no answer", even when another task's
/// admission came back meanwhile (before, any answer of the handle counted).
#[tokio::test]
async fn an_admission_answered_during_a_wait_does_not_make_it_say_no_slot() {
    let server = RedisServer::start();
    let proxy = leasehold_testkit::proxy::FaultProxy::start(server.port());
    let backend = RedisBackend::connect(&proxy.url()).await.unwrap();
    let quota = Quota::builder("free")
        .limit(10)
        .ttl(Duration::from_secs(30))
        .backend(backend)
        .build()
        .unwrap();
    proxy.set_latency_each_way(Duration::from_millis(100), Duration::from_millis(100));
    let other = {
        let quota = quota.clone();
        tokio::spawn(async move { quota.try_acquire("other").await })
    };
    tokio::time::sleep(Duration::from_millis(120)).await;
    // "other" is answered about 200 ms after it was sent, inside this wait of 150 ms.
    let waited = quota
        .acquire_timeout("waiter", Duration::from_millis(150))
        .await;
    match &waited {
        Err(e @ Error::TimedOut { answered, .. }) => {
            assert!(!answered, "{e}");
            assert!(e.to_string().starts_with("no answer for quota"), "{e}");
        }
        other => panic!("expected a timeout: {other:?}"),
    }
    assert!(other.await.unwrap().is_ok(), "the other task was admitted");
}
