//! Field notes F9: a failover to a lagging replica. The replica misses the latest admissions
//! (its replication link is stalled), is promoted, and the clients' proxy moves to it. The
//! epoch survives on the replica, so the loss is partial and undetected (PROTOCOL.md §8, §9.2):
//! the test measures the damage the protocol promises to bound instead. Holders whose leases the
//! replica lost hear it at their next renewal (lost as expired); until then, new admissions on
//! the replica run beside them over the limit. Holders whose leases the replica has keep them.
//! Tokens issued on the replica repeat tokens issued on the old primary.

mod common;

use std::time::{Duration, Instant};

use common::proxied::connect_through;
use leasehold::{Error, Lease, LostReason, Quota, QuotaKeys};
use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::{RedisServer, Reply};

const QUOTA: &str = "failover";
const LIMIT: u64 = 4;
/// Long against the heartbeat, so that a lease the replica has outlives any reconnect.
const TTL: Duration = Duration::from_secs(3);
/// What bounds the over-admission: the lost holders hear it at their next renewal.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// Short, so that a call stuck on the closed connection gives up quickly; far above a loopback
/// round trip on a loaded 2-core machine.
const CALL_TIMEOUT: Duration = Duration::from_millis(500);
/// Allowance, on top of one heartbeat, for a round trip, the reconnect and a loaded machine.
const SLACK: Duration = Duration::from_millis(1500);

/// The members of a quota's lease set on one server, sorted.
fn leases_on(server: &RedisServer, keys: &QuotaKeys) -> Vec<String> {
    let mut members: Vec<String> = match server.command(&["ZRANGE", &keys.leases, "0", "-1"]) {
        Reply::Array(items) => items.iter().filter_map(Reply::as_string).collect(),
        other => panic!("ZRANGE: {other:?}"),
    };
    members.sort();
    members
}

fn hash_on(server: &RedisServer, key: &str) -> Vec<String> {
    match server.command(&["HGETALL", key]) {
        Reply::Array(items) => items.iter().filter_map(Reply::as_string).collect(),
        other => panic!("HGETALL {key}: {other:?}"),
    }
}

/// Retries `try_acquire` through the reconnect after the failover, within 10 s.
async fn admit(quota: &Quota, task_id: &str) -> Lease {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        match quota.try_acquire(task_id).await {
            Ok(lease) => return lease,
            Err(Error::BackendUnavailable(_)) if Instant::now() < end => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("{task_id}: {e:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_lagging_replica_over_admits_until_the_next_heartbeat_at_most() {
    let keys = QuotaKeys::new(QUOTA).unwrap();
    let mut primary = RedisServer::start();
    // The replication link goes through a proxy, so that it can be stalled: the replica lags.
    let link = FaultProxy::start(primary.port());
    let replica = RedisServer::start_replica_of(link.port(), &[]);
    let proxy = FaultProxy::start(primary.port());
    let backend = connect_through(&proxy, CALL_TIMEOUT).await;
    let quota = Quota::builder(QUOTA)
        .limit(LIMIT)
        .ttl(TTL)
        .heartbeat(HEARTBEAT)
        .backend(backend.clone())
        .build()
        .unwrap();

    let kept = [
        quota.try_acquire("kept-a").await.unwrap(),
        quota.try_acquire("kept-b").await.unwrap(),
    ];
    let end = Instant::now() + Duration::from_secs(5);
    while leases_on(&replica, &keys) != ["kept-a", "kept-b"] {
        assert!(Instant::now() < end, "the first leases never replicated");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    link.stall(true);
    let lost = [
        quota.try_acquire("lost-a").await.unwrap(),
        quota.try_acquire("lost-b").await.unwrap(),
    ];
    let lost_tokens: Vec<u64> = lost.iter().map(Lease::fencing_token).collect();
    // The replica really lags: it lacks the leases and the fence increments the primary has.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        leases_on(&primary, &keys),
        ["kept-a", "kept-b", "lost-a", "lost-b"]
    );
    assert_eq!(leases_on(&replica, &keys), ["kept-a", "kept-b"]);
    let fence_primary = primary.command(&["GET", &keys.fence]).as_string();
    let fence_replica = replica.command(&["GET", &keys.fence]).as_string();
    println!(
        "fence: primary {fence_primary:?}, replica {fence_replica:?}; lost tokens {lost_tokens:?}"
    );
    assert_ne!(fence_primary, fence_replica);
    // The epoch survives on the replica: nothing can tell the partial loss from no loss.
    let epoch = hash_on(&primary, &keys.epoch);
    assert!(!epoch.is_empty());
    assert_eq!(hash_on(&replica, &keys.epoch), epoch);

    // The worst phase: fail over just after a renewal, so the lost holders' next one is a whole
    // heartbeat away. Renewals are batched per quota, so one lease's new deadline shows it.
    let renewed_before = kept[0].deadline();
    let end = Instant::now() + HEARTBEAT * 3;
    while kept[0].deadline() == renewed_before {
        assert!(
            Instant::now() < end,
            "no renewal within {:?}",
            HEARTBEAT * 3
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // The failover. Clients reconnect to the replica first, before it is promoted (as through a
    // moved VIP): it refuses writes, which is an outage, never "full" (field notes G12).
    primary.kill();
    let failover = Instant::now();
    proxy.set_upstream(replica.port());
    match quota.try_acquire("early").await {
        Err(Error::BackendUnavailable(text)) => {
            println!("before the promotion: {text}");
        }
        other => panic!("a replica's refusal is an outage: {other:?}"),
    }
    assert!(replica
        .command(&["REPLICAOF", "NO", "ONE"])
        .as_string()
        .is_some());
    let promoted = Instant::now();

    // The promoted replica admits at once beside the holders it lost (no quarantine: same epoch).
    let new = [admit(&quota, "new-a").await, admit(&quota, "new-b").await];
    let admitted = promoted.elapsed();
    let over_limit_from = Instant::now();
    let running_then = kept
        .iter()
        .chain(&lost)
        .chain(&new)
        .filter(|l| l.is_held())
        .count();
    let mut new_tokens: Vec<u64> = new.iter().map(Lease::fencing_token).collect();
    new_tokens.sort_unstable();
    println!(
        "promoted {:?} after the failover; new admissions {admitted:?} after the promotion, \
         tokens {new_tokens:?}; holders believing they run: {running_then}",
        promoted - failover
    );
    // The fence increments of the lost admissions are lost too: the tokens repeat.
    assert_eq!(
        new_tokens, lost_tokens,
        "tokens issued on the replica repeat"
    );

    // Each lost holder hears it at its next renewal on the replica.
    for lease in &lost {
        let reason = tokio::time::timeout(HEARTBEAT * 2 + SLACK, lease.lost())
            .await
            .unwrap_or_else(|_| panic!("{} never heard of its loss", lease.task_id()));
        assert_eq!(reason, LostReason::Expired, "{}", lease.task_id());
    }
    let heard = promoted.elapsed();
    let over_limit = over_limit_from.elapsed();
    println!(
        "lost holders heard it {heard:?} after the promotion ({:?} after the failover); \
         over the limit ({running_then} of {LIMIT}) for at most {over_limit:?}; heartbeat \
         {HEARTBEAT:?}, {} connection rebuild(s)",
        failover.elapsed(),
        backend.connection_rebuilds()
    );
    assert!(heard < HEARTBEAT + SLACK, "{heard:?}");

    // The holders the replica has keep their leases: past the local deadline they had at the
    // failover, they still hold, renewed on the replica.
    tokio::time::sleep_until((failover + TTL + Duration::from_millis(500)).into()).await;
    for lease in kept.iter().chain(&new) {
        assert!(lease.is_held(), "{}", lease.task_id());
    }
    assert_eq!(
        leases_on(&replica, &keys),
        ["kept-a", "kept-b", "new-a", "new-b"]
    );
    let status = quota.status().await.unwrap();
    assert_eq!(status.holders.len(), LIMIT as usize);
    for lease in kept.iter().chain(&new) {
        lease.release().await.unwrap();
    }
}
