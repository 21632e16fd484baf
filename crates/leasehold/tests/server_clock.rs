//! Field-notes scenario F14: the Redis host's wall clock steps while leases are held.
//!
//! Deadlines are Redis `TIME` milliseconds (PROTOCOL.md §4), so a step of the server's clock
//! shifts every stored deadline by the step (§9.3). These tests step the clock of a private
//! redis-server with [`ServerClock`] and measure what that costs: forward, every lease expires at
//! once and the quota runs over its limit until the old holders' next renewal tells them their
//! lease is gone; backward, nobody is over-admitted, live holders renew as usual, and a crashed
//! holder's slot comes back `ttl + step` after its last renewal instead of `ttl`.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use leasehold::backend::AcquireReply;
use leasehold::{Backend, LostReason, Quota, QuotaKeys, RedisBackend};
use leasehold_testkit::{RedisServer, Reply, ServerClock};

const TTL: Duration = Duration::from_millis(1000);
const LIMIT: u64 = 2;

async fn quota_on(server: &RedisServer, name: &str) -> Quota {
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    Quota::builder(name)
        .limit(LIMIT)
        .ttl(TTL)
        .backend(backend)
        .build()
        .unwrap()
}

/// The server's `TIME` in milliseconds.
fn server_ms(server: &RedisServer) -> i64 {
    let Reply::Array(parts) = server.command(&["TIME"]) else {
        panic!("TIME is not an array");
    };
    let part = |i: usize| -> i64 { parts[i].as_string().unwrap().parse().unwrap() };
    part(0) * 1000 + part(1) / 1000
}

fn own_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn leases_key(name: &str) -> String {
    format!("leasehold:{{{name}}}:leases")
}

fn zcard(server: &RedisServer, name: &str) -> i64 {
    server
        .command(&["ZCARD", &leases_key(name)])
        .as_int()
        .unwrap()
}

/// A lease's stored deadline (its score), `None` once it is gone.
fn score(server: &RedisServer, name: &str, id: &str) -> Option<i64> {
    server
        .command(&["ZSCORE", &leases_key(name), id])
        .as_string()
        .map(|s| s.parse().unwrap())
}

/// A private redis-server on a clock the test can step, in step with ours to start with.
fn clocked_server() -> (ServerClock, RedisServer) {
    let clock = ServerClock::new();
    let server = RedisServer::start_with_env(&clock.env(), &[]);
    assert!((server_ms(&server) - own_ms()).abs() < 1000);
    (clock, server)
}

/// Steps the server's clock to `offset_ms` and proves the step took effect: a test that stepped
/// nothing would show nothing. Returns the instant of the step.
fn step(clock: &ServerClock, server: &RedisServer, offset_ms: i64) -> Instant {
    let before = server_ms(server);
    clock.set_offset_ms(offset_ms);
    let stepped = Instant::now();
    let after = server_ms(server);
    let moved = after - before;
    println!("server TIME moved by {moved} ms (step {offset_ms} ms)");
    // The two TIME calls are a few ms apart; a loaded machine may stretch that, never by 500 ms
    // in the step's direction.
    assert!(
        (moved - offset_ms).abs() < 500,
        "the server's clock moved by {moved} ms, not by the {offset_ms} ms step"
    );
    assert!((after - own_ms() - offset_ms).abs() < 1000);
    stepped
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_step_expires_every_lease_and_the_overrun_ends_at_the_next_renewal() {
    let (clock, server) = clocked_server();
    let name = "forward";
    let old = quota_on(&server, name).await;
    // The renewal task beats from the quota's creation on, every heartbeat.
    let beats_from = Instant::now();
    let other = quota_on(&server, name).await;
    let heartbeat = old.heartbeat();
    let holders: Vec<Arc<_>> = vec![
        Arc::new(old.try_acquire("old-1").await.unwrap()),
        Arc::new(old.try_acquire("old-2").await.unwrap()),
    ];
    // A few renewals first, so that the step hits leases in their steady state, a quarter of a
    // heartbeat after a beat: that beat's renewal has landed before the step, and the next one,
    // which finds the leases gone, comes about 3/4 of a heartbeat after it. (Right after a beat
    // the window would be a whole heartbeat.)
    tokio::time::sleep_until((beats_from + 3 * heartbeat + heartbeat / 4).into()).await;
    assert!(holders.iter().all(|l| l.is_held()));
    assert!(matches!(
        other.try_acquire("refused").await,
        Err(leasehold::Error::Full { .. })
    ));
    let watchers: Vec<_> = holders
        .iter()
        .map(|lease| {
            let lease = lease.clone();
            tokio::spawn(async move {
                let reason = tokio::time::timeout(Duration::from_secs(10), lease.lost()).await;
                (reason, Instant::now())
            })
        })
        .collect();

    // Ten ttls ahead: every stored deadline is now in the past.
    let stepped = step(&clock, &server, 10 * TTL.as_millis() as i64);
    let newcomers = [
        other.try_acquire("new-1").await.unwrap(),
        other.try_acquire("new-2").await.unwrap(),
    ];
    let admitted = Instant::now();
    let old_running = holders.iter().filter(|l| l.is_held()).count();
    println!(
        "2 admitted {:?} after the step; {old_running} old holders still believed they held",
        admitted - stepped
    );
    // Old holders still run: the quota is over its limit until their next renewal, about 3/4
    // of a heartbeat after the step. (On a slow machine that renewal may already have told one
    // it is gone: then it lost with `Expired`, as checked below.)
    for lease in holders.iter().filter(|l| !l.is_held()) {
        assert_eq!(lease.lost_reason(), Some(LostReason::Expired));
    }
    // The server counts only the newcomers: the over-limit is the old holders not knowing yet.
    assert_eq!(zcard(&server, name), LIMIT as i64);

    let mut last_lost = stepped;
    for (i, watcher) in watchers.into_iter().enumerate() {
        let (reason, at) = watcher.await.unwrap();
        let reason = reason.unwrap_or_else(|_| panic!("old-{} never reported its loss", i + 1));
        println!(
            "old-{} lost ({reason:?}) {:?} after the step",
            i + 1,
            at - stepped
        );
        // The renewal found the lease gone (renew never re-creates one): not the local deadline.
        assert_eq!(reason, LostReason::Expired);
        // At most one heartbeat until the next renewal, plus its round trip; generous margins
        // for a loaded 2-core machine. (The local deadline, ttl − margin after the last
        // acknowledged renewal, would have stopped it anyway.)
        assert!(
            at - stepped < heartbeat + Duration::from_millis(700),
            "old-{} ran {:?} past the step (heartbeat {heartbeat:?})",
            i + 1,
            at - stepped
        );
        last_lost = last_lost.max(at);
    }
    let over = last_lost.saturating_duration_since(admitted);
    println!(
        "over the limit ({} running, limit {LIMIT}) for {over:?}: from the admissions to the last \
         old holder's loss; step to last loss {:?}; heartbeat {heartbeat:?}",
        old_running + newcomers.len(),
        last_lost - stepped
    );
    assert!(holders.iter().all(|l| !l.is_held()));

    // The newcomers are ordinary leases on the stepped clock: renewed, not lost.
    tokio::time::sleep(3 * heartbeat).await;
    assert!(newcomers.iter().all(|l| l.is_held()));
    assert_eq!(zcard(&server, name), LIMIT as i64);
    for lease in &newcomers {
        lease.release().await.unwrap();
    }
    assert_eq!(zcard(&server, name), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backward_step_over_admits_nobody_and_delays_a_crashed_holders_slot_by_the_step() {
    let (clock, server) = clocked_server();
    let name = "backward";
    let keys = QuotaKeys::new(name).unwrap();
    let quota = quota_on(&server, name).await;
    let heartbeat = quota.heartbeat();
    let raw = RedisBackend::connect(&server.url()).await.unwrap();
    let live = quota.try_acquire("live").await.unwrap();
    tokio::time::sleep(2 * heartbeat).await;

    // A holder that crashes right after its admission: nothing ever renews it.
    let crash_sent = Instant::now();
    let reply = raw
        .acquire(&keys, "crashed", TTL, LIMIT as u32)
        .await
        .unwrap();
    assert!(matches!(reply, AcquireReply::Acquired(_)), "{reply:?}");
    let step_ms = 3 * TTL.as_millis() as i64;
    let stepped = step(&clock, &server, -step_ms);
    let live_score = score(&server, name, "live").unwrap();

    // Probe for the crashed holder's slot every 50 ms, checking the live holder as we go.
    let end = crash_sent + TTL + Duration::from_millis(step_ms as u64) + Duration::from_secs(3);
    let mut flat_checked = 0;
    let reclaimed = loop {
        assert!(
            Instant::now() < end,
            "the crashed holder's slot never came back"
        );
        let sent = Instant::now();
        let reply = raw
            .acquire(&keys, "probe", TTL, LIMIT as u32)
            .await
            .unwrap();
        match reply {
            AcquireReply::Acquired(_) => break sent,
            AcquireReply::Full { .. } => {}
            other => panic!("probe answered {other:?}"),
        }
        assert!(
            live.is_held(),
            "the live holder lost its lease: {:?}",
            live.lost_reason()
        );
        // The client's own deadline is monotonic and never inherits the stepped server's.
        assert!(live.local_deadline() <= Instant::now() + TTL);
        assert!(zcard(&server, name) <= LIMIT as i64);
        // renew.lua keeps max(stored, now + ttl): while the stored deadline is ahead of the
        // stepped clock's now + ttl, renewals leave it where it is.
        let now = server_ms(&server);
        let current = score(&server, name, "live").unwrap();
        if now + (TTL.as_millis() as i64) < live_score - 100 {
            assert_eq!(current, live_score, "renewal moved the deadline back");
            flat_checked += 1;
        }
        assert!(current >= live_score, "the deadline moved backwards");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let delay = reclaimed - crash_sent;
    println!(
        "crashed holder's slot reclaimed {delay:?} after its admission (ttl {TTL:?}, step \
         {step_ms} ms; {:?} after the step); stored deadline of the live holder unchanged in \
         {flat_checked} samples",
        reclaimed - stepped
    );
    assert!(flat_checked > 0);
    // Its deadline is ttl after its admission in server time, which the step moved back: the
    // slot cannot come back before ttl + step, and comes back soon after.
    let expected = TTL + Duration::from_millis(step_ms as u64);
    assert!(
        delay + Duration::from_millis(50) >= expected,
        "reclaimed after {delay:?}, before ttl + step"
    );
    assert!(
        delay < expected + Duration::from_millis(1000),
        "reclaimed after {delay:?}"
    );
    // The probe took the crashed holder's slot, not a third one.
    assert_eq!(score(&server, name, "crashed"), None);
    assert_eq!(zcard(&server, name), LIMIT as i64);

    // Once the stepped clock catches up with the old deadline, renewals move it again.
    tokio::time::sleep(3 * heartbeat).await;
    assert!(live.is_held());
    let later = score(&server, name, "live").unwrap();
    assert!(
        later > live_score,
        "renewals never moved the deadline again"
    );
    assert!(later <= server_ms(&server) + TTL.as_millis() as i64);
    live.release().await.unwrap();
}
