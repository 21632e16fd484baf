//! Field notes F9: a failover to a lagging replica. The replica misses the latest admissions and
//! renewals (its replication link is stalled), is promoted, and the clients' proxy moves to it.
//! The epoch survives on the replica, but its `seq` is behind what the clients saw (PROTOCOL.md
//! §8): the first call of a client that saw the lost writes detects the partial loss, and the
//! replica then quarantines admissions while the lost holders re-register, up to the limit. A
//! client that saw none of them cannot detect anything; if it is first, it is admitted at once
//! beside the holders the replica lost, and those stop at their next renewal (no room is left for
//! them to re-register).

mod common;

use std::time::{Duration, Instant};

use common::proxied::connect_through;
use leasehold::{Error, Lease, LostReason, Quota, QuotaKeys, RedisBackend};
use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::{RedisServer, Reply};

const QUOTA: &str = "failover";
const LIMIT: u64 = 4;
/// Long against the heartbeat, so that a lease the replica has outlives any reconnect.
const TTL: Duration = Duration::from_secs(3);
/// What bounds the over-admission when the loss is not detected first: the lost holders hear it
/// at their next renewal.
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

/// A field of a hash on one server.
fn field_on(server: &RedisServer, key: &str, field: &str) -> Option<String> {
    server.command(&["HGET", key, field]).as_string()
}

/// The first answer to `try_acquire` that is not an outage (the reconnect after the failover),
/// within 10 s.
async fn first_answer(quota: &Quota, task_id: &str) -> Result<Lease, Error> {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        match quota.try_acquire(task_id).await {
            Err(Error::BackendUnavailable { .. }) if Instant::now() < end => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            other => return other,
        }
    }
}

fn quota_on(backend: &RedisBackend) -> Quota {
    Quota::builder(QUOTA)
        .limit(LIMIT)
        .ttl(TTL)
        .heartbeat(HEARTBEAT)
        .backend(backend.clone())
        .build()
        .unwrap()
}

/// Two holders the replica has, two it lost, a promoted replica behind the clients' proxy.
struct FailedOver {
    keys: QuotaKeys,
    replica: RedisServer,
    proxy: FaultProxy,
    backend: RedisBackend,
    quota: Quota,
    kept: [Lease; 2],
    lost: [Lease; 2],
    /// The epoch id before the failover (the replica has it too).
    epoch: String,
    failover: Instant,
    promoted: Instant,
}

/// Builds [`FailedOver`]: the lost holders were admitted while replication was stalled, and
/// the failover comes just after a renewal, so the lost holders' next one is a whole heartbeat
/// away (the worst phase when nothing detects the loss).
async fn fail_over_to_a_lagging_replica() -> FailedOver {
    let keys = QuotaKeys::new(QUOTA).unwrap();
    let mut primary = RedisServer::start();
    // The replication link goes through a proxy, so that it can be stalled: the replica lags.
    let link = FaultProxy::start(primary.port());
    let replica = RedisServer::start_replica_of(link.port(), &[]);
    let proxy = FaultProxy::start(primary.port());
    let backend = connect_through(&proxy, CALL_TIMEOUT).await;
    let quota = quota_on(&backend);

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
    // Fail over just after a renewal. Renewals are batched per quota, so one lease's new
    // deadline shows it.
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
    // The replica really lags: it lacks the leases, the fence increments and the calls (`seq`)
    // the primary has, under the same epoch.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        leases_on(&primary, &keys),
        ["kept-a", "kept-b", "lost-a", "lost-b"]
    );
    assert_eq!(leases_on(&replica, &keys), ["kept-a", "kept-b"]);
    let fence_primary = primary.command(&["GET", &keys.fence]).as_string();
    let fence_replica = replica.command(&["GET", &keys.fence]).as_string();
    let seq_primary = field_on(&primary, &keys.epoch, "seq");
    let seq_replica = field_on(&replica, &keys.epoch, "seq");
    println!(
        "fence: primary {fence_primary:?}, replica {fence_replica:?}; seq: primary \
         {seq_primary:?}, replica {seq_replica:?}"
    );
    assert_ne!(fence_primary, fence_replica);
    assert_ne!(seq_primary, seq_replica);
    let epoch = field_on(&primary, &keys.epoch, "id").expect("an epoch");
    assert_eq!(field_on(&replica, &keys.epoch, "id").as_ref(), Some(&epoch));

    // The failover. Clients reconnect to the replica first, before it is promoted (as through a
    // moved VIP): it refuses writes, which is an outage, never "full" (field notes G12).
    primary.kill();
    let failover = Instant::now();
    proxy.set_upstream(replica.port());
    match quota.try_acquire("early").await {
        Err(e @ Error::BackendUnavailable { .. }) => println!("before the promotion: {e}"),
        other => panic!("a replica's refusal is an outage: {other:?}"),
    }
    assert!(replica
        .command(&["REPLICAOF", "NO", "ONE"])
        .as_string()
        .is_some());
    let promoted = Instant::now();
    FailedOver {
        keys,
        replica,
        proxy,
        backend,
        quota,
        kept,
        lost,
        epoch,
        failover,
        promoted,
    }
}

/// The client that saw the lost writes is the first to call the promoted replica: it detects
/// the partial loss, admissions pause for one ttl, the lost holders re-register, and the quota
/// never runs over its limit. Tokens issued after the quarantine exceed every lost one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_lagging_replica_is_detected_and_the_lost_holders_re_register() {
    let f = fail_over_to_a_lagging_replica().await;
    let answer = first_answer(&f.quota, "new").await;
    let detected = f.promoted.elapsed();
    assert!(
        matches!(answer, Err(Error::Full { .. })),
        "the first admission on the promoted replica is refused (quarantine): {answer:?}"
    );
    let epoch_after = field_on(&f.replica, &f.keys.epoch, "id").expect("an epoch");
    assert_ne!(epoch_after, f.epoch, "the partial loss made a new epoch");

    // Within a heartbeat every lost holder's renewal re-registers its lease; the quota never
    // counts or runs more than its limit meanwhile.
    let end = Instant::now() + HEARTBEAT + SLACK;
    let mut reregistered_after = None;
    while Instant::now() < end {
        let on_replica = leases_on(&f.replica, &f.keys);
        assert!(on_replica.len() <= LIMIT as usize, "{on_replica:?}");
        let running = f.kept.iter().chain(&f.lost).filter(|l| l.is_held()).count();
        assert!(running <= LIMIT as usize);
        if reregistered_after.is_none() && on_replica.len() == LIMIT as usize {
            reregistered_after = Some(f.promoted.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reregistered_after = reregistered_after.expect("the lost holders never re-registered");
    assert_eq!(
        leases_on(&f.replica, &f.keys),
        ["kept-a", "kept-b", "lost-a", "lost-b"]
    );
    for lease in f.kept.iter().chain(&f.lost) {
        assert!(
            lease.is_held(),
            "{}: {:?}",
            lease.task_id(),
            lease.lost_reason()
        );
    }

    // After the quarantine the four leases count: full, until one is released; the next token
    // exceeds every token the lost holders hold.
    tokio::time::sleep_until((f.promoted + TTL + Duration::from_millis(200)).into()).await;
    assert!(matches!(
        f.quota.try_acquire("new").await,
        Err(Error::Full { .. })
    ));
    f.lost[0].release().await.unwrap();
    let new = f.quota.try_acquire("new").await.unwrap();
    let lost_tokens: Vec<u64> = f.lost.iter().map(Lease::fencing_token).collect();
    assert!(
        lost_tokens.iter().all(|&t| new.fencing_token() > t),
        "token {} after lost tokens {lost_tokens:?}",
        new.fencing_token()
    );
    println!(
        "promoted {:?} after the failover; loss detected by the first call, {detected:?} after \
         the promotion; the lost holders re-registered {reregistered_after:?} after it; never \
         more than {LIMIT} running; token after the quarantine {} (lost tokens {lost_tokens:?}); \
         {} connection rebuild(s)",
        f.promoted - f.failover,
        new.fencing_token(),
        f.backend.connection_rebuilds()
    );
    for lease in f.kept.iter().chain([&f.lost[1], &new]) {
        lease.release().await.unwrap();
    }
}

/// A client that saw none of the lost writes (started after them) is the first to call the
/// promoted replica: it cannot detect the loss and is admitted at once beside the holders the
/// replica lost. Whether or not the other client's next call then detects the loss, no room is
/// left for the lost holders: each hears at its next renewal that its lease is gone, so the
/// over-admission lasts at most about one heartbeat. Tokens issued on the replica repeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_blind_to_the_lost_writes_is_admitted_first_and_the_lost_holders_stop() {
    let f = fail_over_to_a_lagging_replica().await;
    let blind_backend = connect_through(&f.proxy, CALL_TIMEOUT).await;
    let blind = quota_on(&blind_backend);
    let new = [
        first_answer(&blind, "new-a").await.unwrap(),
        first_answer(&blind, "new-b").await.unwrap(),
    ];
    let admitted = f.promoted.elapsed();
    let over_limit_from = Instant::now();
    let running_then = f
        .kept
        .iter()
        .chain(&f.lost)
        .chain(&new)
        .filter(|l| l.is_held())
        .count();
    let mut new_tokens: Vec<u64> = new.iter().map(Lease::fencing_token).collect();
    new_tokens.sort_unstable();
    let lost_tokens: Vec<u64> = f.lost.iter().map(Lease::fencing_token).collect();
    assert_eq!(
        new_tokens, lost_tokens,
        "tokens issued on the replica repeat"
    );

    for lease in &f.lost {
        let reason = tokio::time::timeout(HEARTBEAT * 2 + SLACK, lease.lost())
            .await
            .unwrap_or_else(|_| panic!("{} never heard of its loss", lease.task_id()));
        assert_eq!(reason, LostReason::Expired, "{}", lease.task_id());
    }
    let heard = f.promoted.elapsed();
    let over_limit = over_limit_from.elapsed();
    let detected = field_on(&f.replica, &f.keys.epoch, "id").as_ref() != Some(&f.epoch);
    println!(
        "blind client admitted {admitted:?} after the promotion, tokens {new_tokens:?}; \
         holders believing they run: {running_then}; lost holders heard it {heard:?} after the \
         promotion: over the limit for at most {over_limit:?}; loss detected later: {detected}"
    );
    assert!(heard < HEARTBEAT + SLACK, "{heard:?}");

    // The holders the replica has keep their leases, renewed on it.
    tokio::time::sleep_until((f.failover + TTL + Duration::from_millis(500)).into()).await;
    for lease in f.kept.iter().chain(&new) {
        assert!(lease.is_held(), "{}", lease.task_id());
    }
    assert_eq!(
        leases_on(&f.replica, &f.keys),
        ["kept-a", "kept-b", "new-a", "new-b"]
    );
    for lease in f.kept.iter().chain(&new) {
        lease.release().await.unwrap();
    }
}
