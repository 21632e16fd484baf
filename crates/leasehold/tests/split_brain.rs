//! Field notes F10: split brain. The old primary A is cut off from its replica B (the replication
//! link goes silent), B is promoted, and half the workers move to B while the other half stay on
//! A: two primaries accept writes. Without `min-replicas-to-write`, each side admits up to the
//! limit: two independent counts, up to 2 × limit, which only the two servers' counts together
//! show (the documented C2 violation, PROTOCOL.md §9.2). With `min-replicas-to-write 1` and
//! `min-replicas-max-lag 1` on A, A refuses writes once its replica's acknowledgements are
//! overdue: the minority side then admits nobody, and its holders, whose renewals A refuses too,
//! stop at their local deadlines. Admissions on A between the cut and its first refusal remain.

mod common;

use std::time::{Duration, Instant};

use common::proxied::connect_through;
use leasehold::{Error, Lease, LostReason, Quota, QuotaKeys, Unavailable};
use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::{RedisServer, Reply};

const QUOTA: &str = "split";
const LIMIT: u64 = 2;
const TTL: Duration = Duration::from_secs(3);
const HEARTBEAT: Duration = Duration::from_secs(1);
const CALL_TIMEOUT: Duration = Duration::from_millis(500);
/// How long the minority side keeps trying to admit after the cut: well past A's refusal, which
/// comes after `min-replicas-max-lag` (1 s) plus the replica's acknowledgement period (1 s).
const TRY_FOR: Duration = Duration::from_secs(4);

async fn quota_through(proxy: &FaultProxy) -> Quota {
    let backend = connect_through(proxy, CALL_TIMEOUT).await;
    Quota::builder(QUOTA)
        .limit(LIMIT)
        .ttl(TTL)
        .heartbeat(HEARTBEAT)
        .backend(backend)
        .build()
        .unwrap()
}

fn zcard(server: &RedisServer, key: &str) -> i64 {
    match server.command(&["ZCARD", key]) {
        Reply::Int(n) => n,
        other => panic!("ZCARD: {other:?}"),
    }
}

/// What the minority side (the workers left on A) saw after the cut.
struct Minority {
    /// When the replication link went silent.
    cut: Instant,
    /// Admitted on A, with the time since the cut.
    admitted: Vec<(Lease, Duration)>,
    /// A's first `NOREPLICAS` refusal, since the cut.
    first_refusal: Option<Duration>,
    /// Refused as full (every slot A knows of is taken).
    full: u32,
    /// Refused as unavailable: A's `NOREPLICAS`, or the open circuit breaker.
    unavailable: u32,
}

/// Splits the brain and returns both sides' admissions, with A and B (and their proxies) kept
/// alive by the caller.
async fn split(min_replicas: bool) -> (Minority, Vec<Lease>, RedisServer, RedisServer) {
    let keys = QuotaKeys::new(QUOTA).unwrap();
    let args: &[&str] = if min_replicas {
        &[
            "--min-replicas-to-write",
            "1",
            "--min-replicas-max-lag",
            "1",
        ]
    } else {
        &[]
    };
    let a = RedisServer::start_with(args);
    let link = FaultProxy::start(a.port());
    let b = RedisServer::start_replica_of(link.port(), &[]);
    let to_a = FaultProxy::start(a.port());
    let to_b = FaultProxy::start(a.port());
    let (left, right) = (quota_through(&to_a).await, quota_through(&to_b).await);
    if min_replicas {
        // A counts its replica as good once the replica's first acknowledgement arrives.
        let end = Instant::now() + Duration::from_secs(5);
        while !a
            .command(&["INFO", "replication"])
            .as_string()
            .is_some_and(|info| info.contains("min_slaves_good_slaves:1"))
        {
            assert!(Instant::now() < end, "A never counted its replica as good");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // Both sides start from the same replicated state (epoch and stored limit).
    left.try_acquire("warm-up")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let end = Instant::now() + Duration::from_secs(5);
    while b.command(&["EXISTS", &keys.epoch]) != Reply::Int(1) {
        assert!(Instant::now() < end, "the epoch never replicated");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // The cut: the replication link goes silent (both ends keep their sockets), B is promoted,
    // and the right half of the workers follows it while the left half stays on A.
    link.stall(true);
    let cut = Instant::now();
    assert!(b.command(&["REPLICAOF", "NO", "ONE"]).as_string().is_some());
    to_b.set_upstream(b.port());

    let mut majority = Vec::new();
    let mut minority = Minority {
        cut,
        admitted: Vec::new(),
        first_refusal: None,
        full: 0,
        unavailable: 0,
    };
    let mut n = 0;
    while cut.elapsed() < TRY_FOR {
        if (majority.len() as u64) < LIMIT {
            match right.try_acquire(&format!("b-{}", majority.len())).await {
                Ok(lease) => majority.push(lease),
                Err(Error::BackendUnavailable { .. }) => {}
                Err(e) => panic!("majority side: {e:?}"),
            }
        }
        match left.try_acquire(&format!("a-{n}")).await {
            Ok(lease) => {
                minority.admitted.push((lease, cut.elapsed()));
                n += 1;
            }
            Err(Error::Full { .. }) => minority.full += 1,
            Err(Error::BackendUnavailable { kind, detail, .. }) => {
                // NOREPLICAS first; then, after repeated refusals, the circuit breaker's own.
                if detail.contains("NOREPLICAS") {
                    assert_eq!(kind, Unavailable::ServerRefused, "{detail}");
                    minority.first_refusal.get_or_insert(cut.elapsed());
                }
                minority.unavailable += 1;
            }
            Err(e) => panic!("minority side: {e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The two independent counts, as a checker that can read both servers sees them.
    println!(
        "min-replicas {min_replicas}: A counts {}, B counts {} (limit {LIMIT})",
        zcard(&a, &keys.leases),
        zcard(&b, &keys.leases)
    );
    (minority, majority, a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_min_replicas_both_sides_admit_up_to_the_limit() {
    let keys = QuotaKeys::new(QUOTA).unwrap();
    let (minority, majority, a, b) = split(false).await;
    let at: Vec<Duration> = minority.admitted.iter().map(|(_, t)| *t).collect();
    println!(
        "minority admitted {} at {at:?} after the cut, then {} refusals as full; majority \
         admitted {}",
        at.len(),
        minority.full,
        majority.len()
    );
    assert_eq!(minority.first_refusal, None, "A never refuses");
    assert_eq!(minority.unavailable, 0);
    assert_eq!(minority.admitted.len() as u64, LIMIT);
    assert_eq!(majority.len() as u64, LIMIT);
    // Each server alone is within the limit; only both counts together show 2 × limit.
    assert_eq!(zcard(&a, &keys.leases) as u64, LIMIT);
    assert_eq!(zcard(&b, &keys.leases) as u64, LIMIT);
    for (lease, _) in &minority.admitted {
        assert!(lease.is_held(), "A renews its own: {}", lease.task_id());
    }
    assert!(majority.iter().all(Lease::is_held));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_min_replicas_the_minority_side_stops_admitting_and_its_holders_stop() {
    let (minority, majority, _a, _b) = split(true).await;
    let refusal = minority
        .first_refusal
        .expect("A refuses writes once its replica is overdue");
    let at: Vec<Duration> = minority.admitted.iter().map(|(_, t)| *t).collect();
    println!(
        "minority admitted {} at {at:?} after the cut; A refused from {refusal:?} after the cut \
         ({} refusals as full, {} as unavailable); majority admitted {}",
        at.len(),
        minority.full,
        minority.unavailable,
        majority.len()
    );
    // max-lag 1 s plus the replica's 1 s acknowledgement period, with slack for a loaded machine.
    assert!(refusal < Duration::from_millis(3500), "{refusal:?}");
    assert!(
        at.iter().all(|t| *t < refusal),
        "nothing is admitted on A once it refuses"
    );
    assert_eq!(majority.len() as u64, LIMIT);
    // A refuses the minority holders' renewals too: each stops at its local deadline, within a
    // ttl of its last renewal, which came before the refusal.
    for (lease, _) in &minority.admitted {
        let reason = tokio::time::timeout(TTL + Duration::from_secs(2), lease.lost())
            .await
            .unwrap_or_else(|_| panic!("{} kept running", lease.task_id()));
        assert_eq!(reason, LostReason::LocalDeadline, "{}", lease.task_id());
    }
    // A lease's local deadline is when its holder stopped: it was lost there, not later.
    let stopped: Vec<Duration> = minority
        .admitted
        .iter()
        .map(|(lease, _)| lease.local_deadline() - minority.cut)
        .collect();
    println!("the minority holders stopped {stopped:?} after the cut");
    assert!(majority.iter().all(Lease::is_held));
}
