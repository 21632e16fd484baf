//! The thundering herd (the field notes' F28): many waiters in many processes on a full quota.
//! A release must wake about one attempt per process, not every waiter; waiting costs a bounded
//! number of attempts; and a Redis restart must not turn into a storm of connections. Eight
//! backends (eight connections, as eight processes would have) share one private redis-server.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::counting::Counting;
use leasehold::{Backend, Quota, RedisBackend};
use leasehold_testkit::RedisServer;

const PROCESSES: usize = 8;
const WAITERS: usize = 5;

/// `PROCESSES` handles of one quota of limit 1, each on its own connection, counting attempts.
async fn fleet(server: &RedisServer, poll: Duration) -> Vec<(Quota, Arc<Counting>)> {
    let mut fleet = Vec::new();
    for _ in 0..PROCESSES {
        let backend: Arc<dyn Backend> =
            Arc::new(RedisBackend::connect(&server.url()).await.unwrap());
        let counting = Counting::new(backend);
        let quota = Quota::builder("herd")
            .limit(1)
            .ttl(Duration::from_secs(10))
            .poll_interval(poll)
            .shared_backend(counting.clone() as Arc<dyn Backend>)
            .build()
            .unwrap();
        fleet.push((quota, counting));
    }
    fleet
}

fn attempts(fleet: &[(Quota, Arc<Counting>)]) -> u64 {
    fleet.iter().map(|(_, c)| c.attempts()).sum()
}

/// 40 waiters in 8 processes on a full quota of 1: one release wakes one attempt per process
/// (each process's head waiter, one of which wins), not all 40.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_one_attempt_per_process_not_every_waiter() {
    let server = RedisServer::start();
    // Polls far apart: what follows a release is its wake-ups.
    let fleet = fleet(&server, Duration::from_secs(5)).await;
    let holder = fleet[0].0.try_acquire("holder").await.unwrap();
    let mut waiters = Vec::new();
    for (p, (quota, _)) in fleet.iter().enumerate() {
        for w in 0..WAITERS {
            let quota = quota.clone();
            waiters.push(tokio::spawn(async move {
                quota
                    .acquire_timeout(&format!("p{p}-w{w}"), Duration::from_secs(30))
                    .await
            }));
        }
        // In line. (Not "each refused once": behind its head, a waiter is asked only at its
        // process's shared poll, up to a ttl away, unless a subscription made meanwhile
        // re-checks them all, which the holder's process had made before.)
        let in_line = || quota.debug_sizes().waiters == WAITERS;
        assert!(
            common::eventually(Duration::from_secs(10), in_line).await,
            "waiters not in line"
        );
    }
    // Steady waiting, then one release.
    let before = attempts(&fleet);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let steady = attempts(&fleet) - before;
    let released_at = attempts(&fleet);
    holder.release().await.unwrap();
    let served = common::eventually(Duration::from_secs(3), || {
        waiters.iter().any(|w| w.is_finished())
    })
    .await;
    assert!(served, "no waiter served after the release");
    // Time for every process's wake-up to have come and gone.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let after_release = attempts(&fleet) - released_at;
    let admitted = waiters.iter().filter(|w| w.is_finished()).count();
    println!(
        "{} waiters in {PROCESSES} processes: {steady} attempts in 2 s of waiting, \
         {after_release} from one release to 400 ms after its waiter was served, {admitted} admitted",
        PROCESSES * WAITERS
    );
    assert_eq!(admitted, 1, "one slot freed, {admitted} waiters admitted");
    // One head waiter per process, and a poll or two: a wake-everyone would be 40.
    assert!(
        after_release <= 2 * PROCESSES as u64,
        "{after_release} attempts after one release"
    );
    assert!(
        steady <= 4 * PROCESSES as u64,
        "{steady} attempts in 2 s of waiting"
    );
    for waiter in waiters {
        waiter.abort();
    }
}

/// All eight connected when Redis restarts: each reconnects a few times at most, not in a loop,
/// and the script calls after the restart stay near their rate before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_is_no_reconnection_storm() {
    let mut server = RedisServer::start();
    let fleet = fleet(&server, Duration::from_millis(250)).await;
    let _holder = fleet[0].0.try_acquire("holder").await.unwrap();
    let mut waiters = Vec::new();
    for (p, (quota, _)) in fleet.iter().enumerate() {
        let quota = quota.clone();
        waiters.push(tokio::spawn(async move {
            quota
                .acquire_timeout(&format!("p{p}"), Duration::from_secs(30))
                .await
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let scripts = |server: &RedisServer| {
        common::calls_of(server, "evalsha") + common::calls_of(server, "eval")
    };
    let before = scripts(&server);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let steady = scripts(&server) - before;
    server.restart();
    // A fresh server counts from 0.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = scripts(&server);
    let stats = server.command(&["INFO", "stats"]);
    let connections: u64 = stats
        .as_string()
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("total_connections_received:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("INFO stats has total_connections_received");
    println!(
        "{PROCESSES} clients: {connections} connections received in the 4 s after the restart \
         (the test's own included); script calls {steady} in 2 s before it, {after} in 4 s after"
    );
    // The test's own INFO connections count too.
    assert!(
        connections <= 3 * PROCESSES as u64 + 3,
        "{connections} connections in 4 s from {PROCESSES} clients"
    );
    // The same 4 s at the rate before, twice over, plus a first call per client.
    assert!(
        after <= 4 * steady + PROCESSES as u64,
        "{after} script calls in 4 s after the restart, {steady} in 2 s before"
    );
    for waiter in waiters {
        waiter.abort();
    }
}
