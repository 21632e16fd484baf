//! The experiment's claims, checked on a real, seeded, short headless run in memory: the
//! counter leaks to zero for good, the TTL counter over-admits, the lease never exceeds its
//! limit and gets every crashed slot back within ttl + one heartbeat.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use leasehold::RedisBackend;
use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::RedisServer;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::controller::{Controller, Refusal};
use super::experiment::{Frame, SAMPLE_EVERY};
use super::headless::{self, Outcome};
use super::params::{Params, MAX_SEED};
use super::schedule::Arrival;
use super::semantics::{Kind, Limiter, COUNTER_KEY, TTL_COUNTER_KEY};
use super::server;
use super::store::Store;
use super::world::{Sample, World, MAX_PENDING};

/// Short tasks and a high crash rate, so that 5 s show everything; the ttl stays well above
/// scheduling noise on a loaded 2-core CI machine.
fn params() -> Params {
    Params {
        limit: 4,
        crash_probability: 0.3,
        ttl_ms: 500,
        task_ms: 200,
        speed: 1.0,
        seed: 3,
    }
}

/// Slack on top of ttl + heartbeat: one sampling period (a recovery is seen at the next sample)
/// plus scheduling delay of the sampler on a busy machine.
const RECOVERY_TOLERANCE: Duration = Duration::from_millis(500);

/// One run shared by the tests below (they check different columns of the same run), with
/// every sample it took.
fn outcome() -> &'static (Outcome, Vec<Frame>) {
    static RUN: OnceLock<(Outcome, Vec<Frame>)> = OnceLock::new();
    RUN.get_or_init(|| {
        let runtime = tokio::runtime::Runtime::new().expect("a runtime");
        let mut frames = Vec::new();
        let outcome = runtime
            .block_on(headless::run(
                params(),
                &Store::Memory,
                Duration::from_secs(5),
                |frame| frames.push(frame.clone()),
            ))
            .expect("the memory store does not fail");
        (outcome, frames)
    })
}

fn column(frame: &Frame, kind: Kind) -> &Sample {
    frame
        .worlds
        .iter()
        .find(|s| s.kind == kind)
        .expect("every frame has the three columns")
}

fn series(kind: Kind) -> Vec<&'static Sample> {
    outcome().1.iter().map(|f| column(f, kind)).collect()
}

#[test]
fn the_counter_leaks_to_zero_and_stays_there() {
    let p = params();
    let samples = series(Kind::Counter);
    assert!(
        samples.len() as u32 >= (5000 / SAMPLE_EVERY.as_millis() as u32) / 2,
        "the sampler ran"
    );
    let full = samples
        .iter()
        .position(|s| s.crashed == p.limit)
        .expect("crashed tasks came to hold every slot of the counter");
    assert!(
        samples[full..].iter().all(|s| s.available == 0),
        "once every slot leaked, nothing came back"
    );
    let last = samples.last().unwrap();
    assert_eq!(last.running, 0, "every task ended");
    assert_eq!(last.counted, i64::from(p.limit), "the count is all leaks");
    assert_eq!(last.tally.recovered, 0);
    assert!(
        last.tally.refused > last.tally.admitted,
        "a dead counter refuses"
    );
}

#[test]
fn the_ttl_counter_over_admits() {
    let p = params();
    let last = column(&outcome().0.last, Kind::TtlCounter);
    assert!(last.tally.over_admitted >= 1, "{last:?}");
    assert!(last.tally.peak_running > p.limit, "{last:?}");
    assert!(
        series(Kind::TtlCounter)
            .iter()
            .any(|s| i64::from(s.running) > i64::from(p.limit) || s.counted < 0),
        "a sample shows the damage: more tasks running than the limit, or a negative count"
    );
}

#[test]
fn the_lease_never_exceeds_the_limit_and_recovers_every_crash() {
    let p = params();
    let samples = series(Kind::Lease);
    assert!(samples.iter().all(|s| s.running <= p.limit));
    let last = samples.last().unwrap();
    assert_eq!(last.tally.over_admitted, 0);
    assert!(last.tally.peak_running <= p.limit);
    assert_eq!(last.tally.lost, 0, "no lease was lost to a missed renewal");
    assert_eq!(last.tally.errors, 0);
    assert!(
        last.tally.crashes >= 3,
        "the run must crash tasks to mean anything"
    );
    assert_eq!(last.crashed, 0, "no crashed slot is still held at the end");
    assert_eq!(last.tally.recovered, last.tally.crashes);
    let bound = p.scaled_ttl() + p.scaled_heartbeat() + RECOVERY_TOLERANCE;
    let worst = Duration::from_millis(last.tally.max_recovery_ms.expect("crashes recovered"));
    assert!(
        worst <= bound,
        "a crashed slot took {worst:?} to come back (bound {bound:?})"
    );
    assert_eq!(last.counted, 0, "the quota is empty at the end");
}

#[test]
fn the_three_columns_got_the_same_tasks() {
    let last = &outcome().0.last;
    let submitted: Vec<u64> = last
        .worlds
        .iter()
        .map(|s| s.tally.admitted + s.tally.refused + s.tally.errors + s.tally.shed)
        .collect();
    assert!(last.worlds.iter().all(|s| s.tally.shed == 0), "{last:?}");
    assert!(submitted[0] > 0);
    assert!(
        submitted.iter().all(|&n| n == submitted[0]),
        "{submitted:?}"
    );
}

#[test]
fn a_headless_outcome_keeps_only_the_last_frame() {
    let (outcome, frames) = outcome();
    // Every sample went to the watcher; the outcome (what `--headless` keeps, however long
    // `--duration` is) holds the final one only.
    assert!(frames.len() >= 25, "{} samples", frames.len());
    let last = frames.last().expect("samples");
    assert_eq!(
        outcome.last.t, last.t,
        "the outcome's frame is the final sample"
    );
    assert!(outcome.last.worlds.iter().all(|w| w.running == 0));
}

#[test]
fn a_tiny_speed_or_a_huge_duration_is_refused_not_a_panic() {
    let bad = [
        Params {
            speed: 1e-300,
            ..params()
        },
        Params {
            speed: f64::INFINITY,
            ..params()
        },
        Params {
            ttl_ms: u64::MAX,
            speed: 0.5,
            ..params()
        },
        Params {
            task_ms: u64::MAX,
            speed: 0.5,
            ..params()
        },
    ];
    for p in bad {
        let verdict = std::panic::catch_unwind(|| p.validate());
        assert!(matches!(verdict, Ok(Err(_))), "{p:?}: {verdict:?}");
    }
    let too_long = Params {
        task_ms: 10 * 60 * 1000 + 1,
        speed: 1.0,
        ..params()
    };
    let e = too_long.validate().unwrap_err();
    assert!(e.contains("at most") || e.contains("and 10m"), "{e}");
    // The bound the message states is the bound applied.
    let ten_minutes = Params {
        task_ms: 10 * 60 * 1000,
        ttl_ms: 2000,
        ..params()
    };
    assert_eq!(ten_minutes.validate(), Ok(()));
}

#[test]
fn seeds_the_page_cannot_read_exactly_are_refused() {
    let max = Params {
        seed: MAX_SEED,
        ..params()
    };
    assert_eq!(max.validate(), Ok(()));
    assert_eq!(
        MAX_SEED as f64 as u64, MAX_SEED,
        "exact as a JavaScript number"
    );
    let over = Params {
        seed: MAX_SEED + 1,
        ..params()
    };
    assert!(over.validate().is_err());
}

#[test]
fn a_schedule_faster_than_a_column_serves_is_refused() {
    // 0.8 × 50 × 10 / 100 ms = 4000 tasks/s: the audit's runaway backlog on Redis.
    let runaway = Params {
        limit: 50,
        speed: 10.0,
        task_ms: 100,
        ..params()
    };
    let e = runaway.validate().unwrap_err();
    assert!(e.contains("4000 tasks/s"), "{e}");
    let at_the_cap = Params {
        task_ms: 800,
        ..runaway
    };
    assert_eq!(at_the_cap.validate(), Ok(()));
}

/// A counter column on a Redis reached through `proxy`.
async fn counter_world(proxy: &FaultProxy, limit: u32) -> Arc<World> {
    let store = Store::Redis(RedisBackend::connect(&proxy.url()).await.expect("connect"));
    let p = Params { limit, ..params() };
    let limiter = Limiter::new(Kind::Counter, &store, &store.counters(), &p).expect("limiter");
    limiter.clear().await.expect("clear");
    Arc::new(World::new(Kind::Counter, limit, limiter))
}

fn arrival(index: u64) -> Arrival {
    Arrival {
        index,
        at: Duration::ZERO,
        hold: Duration::from_secs(30),
        crash: false,
    }
}

/// Serves arrivals `indices` (task ids `t{i}`) on `world`, each as its own tokio task.
fn serve_all(
    world: &Arc<World>,
    indices: std::ops::Range<u64>,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    indices
        .map(|i| {
            tokio::spawn(
                world
                    .clone()
                    .serve(arrival(i), format!("t{i}"), stop.clone()),
            )
        })
        .collect()
}

/// Waits (bounded, 5 s each) for the served tasks to return after their stop; none panicked.
async fn join_stopped(tasks: Vec<tokio::task::JoinHandle<()>>) {
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("a stopped task returns")
            .expect("no panic");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sample_does_not_wait_for_the_admissions_in_flight() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let world = counter_world(&proxy, 50).await;
    // Each call now takes 200 ms, and the column admits one task at a time: 1.6 s for eight.
    proxy.set_latency(Duration::from_millis(100));
    let stop = CancellationToken::new();
    let tasks = serve_all(&world, 0..8, &stop);
    // Wait (bounded) until an admission is in flight: Redis counted an INCR whose reply the
    // world has not seen yet. Redis is read first (straight, not through the proxy), so the
    // admission was still on its way when the tally was read. At most one admission is done
    // then: six or more, 1.2 s, are still to come.
    let end = Instant::now() + Duration::from_secs(10);
    let in_flight = loop {
        let counted = tokio::task::block_in_place(|| server.command(&["GET", COUNTER_KEY]))
            .as_string()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        let admitted = world.tally().admitted;
        if counted > admitted && admitted <= 1 {
            break admitted;
        }
        assert!(
            Instant::now() < end && admitted <= 1,
            "no admission seen in flight: Redis counted {counted}, {:?}",
            world.tally()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let asked = Instant::now();
    let sample = tokio::time::timeout(Duration::from_secs(10), world.sample())
        .await
        .expect("a sample within 10 s");
    let took = asked.elapsed();
    // Not queued: the sample's own call, 200 ms. Queued behind the admissions: 1.4 s or more
    // (the six or more still to come, then its own call). 1 s leaves 800 ms for a loaded
    // machine and is still 400 ms short of queueing.
    assert!(
        took < Duration::from_secs(1),
        "the sample took {took:?}: it queued behind the admissions ({sample:?})"
    );
    assert!(
        sample.tally.admitted < 8,
        "the sample saw all 8 admitted: it waited for them ({in_flight} were at its start)"
    );
    let end = Instant::now() + Duration::from_secs(10);
    while world.tally().admitted < 8 {
        assert!(Instant::now() < end, "{:?}", world.tally());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Nor does the end of a task: a stop ends the eight at once, with no call.
    stop.cancel();
    join_stopped(tasks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_sheds_arrivals_beyond_its_pending_bound_and_counts_them() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let world = counter_world(&proxy, 1000).await;
    let extra = 5;
    proxy.stall(true);
    let stop = CancellationToken::new();
    let tasks = serve_all(&world, 0..(MAX_PENDING + extra) as u64, &stop);
    let end = Instant::now() + Duration::from_secs(10);
    while world.tally().shed < extra as u64 {
        assert!(Instant::now() < end, "{:?}", world.tally());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.stall(false);
    while world.tally().admitted + world.tally().refused + world.tally().errors < MAX_PENDING as u64
    {
        assert!(Instant::now() < end, "{:?}", world.tally());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let tally = world.tally();
    assert_eq!(tally.shed, extra as u64, "{tally:?}");
    assert_eq!(tally.admitted, MAX_PENDING as u64, "{tally:?}");
    stop.cancel();
    join_stopped(tasks).await;
}

/// Waits (bounded) until the controller's phase is `phase`.
async fn wait_phase(c: &Controller, phase: &str) {
    let end = Instant::now() + Duration::from_secs(10);
    while c.phase() != phase {
        assert!(Instant::now() < end, "still {} (not {phase})", c.phase());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_whose_request_is_dropped_still_goes_idle() {
    let server = RedisServer::start();
    let store = Store::Redis(RedisBackend::connect(&server.url()).await.unwrap());
    let c = Arc::new(Controller::new(store, params()));
    c.start(params()).await.expect("starts");
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.pause();
    // The request goes away half-way (a closed tab, a client that gave up) while the store is
    // slow to answer.
    let cut = tokio::time::timeout(Duration::from_millis(100), c.reset(params())).await;
    server.resume();
    assert!(cut.is_err(), "the reset was cut short");
    wait_phase(&c, "idle").await;
    // The old run was cleared away, and nothing of it lands afterwards.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for key in [COUNTER_KEY, TTL_COUNTER_KEY] {
        assert_eq!(server.command(&["GET", key]).as_string(), None, "{key}");
    }
    let leases = server.command(&["ZCARD", "leasehold:{demo}:leases"]);
    assert_eq!(leases.as_int(), Some(0));
    // And the demo starts again.
    c.start(params()).await.expect("starts again");
    assert_eq!(c.phase(), "running");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_whose_store_fails_still_goes_idle() {
    let mut server = RedisServer::start();
    let store = Store::Redis(RedisBackend::connect(&server.url()).await.unwrap());
    let c = Arc::new(Controller::new(store, params()));
    c.start(params()).await.expect("starts");
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.kill();
    let reset = tokio::time::timeout(Duration::from_secs(30), c.reset(params()))
        .await
        .expect("a reset ends within 30 s");
    assert!(matches!(reset, Err(Refusal::Store(_))), "{reset:?}");
    assert_eq!(c.phase(), "idle");
}

#[tokio::test]
async fn a_page_that_falls_behind_starts_over_from_a_hello() {
    use futures_util::StreamExt;
    let c = Arc::new(Controller::new(Store::Memory, params()));
    let mut events = Box::pin(server::stream_of(c.clone()));
    let name = |e: &axum::response::sse::Event| format!("{e:?}");
    let first = events.next().await.expect("a hello").unwrap();
    assert!(name(&first).contains("event: hello"), "{first:?}");
    // More messages than the channel keeps: a reset among them could be lost.
    c.flood(1000);
    let next = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .expect("an event")
        .expect("the stream goes on")
        .unwrap();
    assert!(name(&next).contains("event: hello"), "{next:?}");
}

/// One HTTP/1.1 request to the demo at `addr`; the status code and the body.
async fn http(addr: std::net::SocketAddr, path: &str, body: &Value) -> (u16, String) {
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: demo\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        std::io::Result::Ok(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .expect("an answer within 10 s")
        .unwrap_or_default();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_refuses_bad_speeds_and_seeds_with_400_and_keeps_serving() {
    let c = Arc::new(Controller::new(Store::Memory, params()));
    let listener = server::bind(0).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = tokio::spawn(async move { axum::serve(listener, server::router(c)).await });
    let valid = serde_json::to_value(params()).unwrap();
    let with = |key: &str, value: Value| {
        let mut p = valid.clone();
        p[key] = value;
        p
    };
    for path in ["/api/start", "/api/reset"] {
        for bad in [
            with("speed", serde_json::json!(1e-300)),
            with("seed", serde_json::json!(MAX_SEED + 1)),
        ] {
            let (status, body) = http(addr, path, &bad).await;
            assert_eq!(status, 400, "{path} {bad}: {body}");
            assert!(!body.is_empty() && !body.contains('\n'), "one line: {body}");
        }
    }
    let (status, body) = http(addr, "/api/start", &valid).await;
    assert_eq!(status, 200, "still serving: {body}");
    let state: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(state["phase"], "running");
    served.abort();
}
