//! One-way delay (field notes F4): a healthy holder whose requests reach Redis 1.5 × ttl late
//! while replies travel normally. It must give its lease up at its own local deadline, counted
//! from when its last acknowledged renewal was *sent*, before the server reaps the lease and
//! admits someone else; and the renewals that arrive after that must not bring it back.
//!
//! And a late acquire (F16): a worker gives up on an acquire still on its way to Redis, the task
//! is retried on another connection, run and released, and only then does the first acquire land
//! and admit the task again: a lease nobody runs. It must count against the limit like any
//! lease (never a slot too many), and be gone at once when its reply reaches the worker that
//! gave up, or within one ttl when that reply is lost.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::proxied::connect_through;
use leasehold::{Backend, Error, LostReason, Quota, QuotaKeys, RedisBackend};
use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::{RedisServer, Reply};

const QUOTA: &str = "oneway";
const LEASES_KEY: &str = "leasehold:{oneway}:leases";
const TTL: Duration = Duration::from_millis(1000);
const SUCCESSOR_TTL: Duration = Duration::from_secs(20);
/// Five times the default (ttl / 20): the test compares instants taken by different tasks on a
/// loaded 2-core machine, and the margin is the gap between the holder's deadline and the
/// server's, so it is the room those instants get.
const MARGIN: Duration = Duration::from_millis(250);
/// Far above the delayed round trip (1.5 s): no call is cut by the backend's own timeout, so the
/// connection is never judged wedged and replaced, and the late renewals reach the server on
/// the connection they were sent on. Each renewal is still bounded by its lease's local
/// deadline (ttl − margin from its send), which is what fences the holder.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// `ZCARD` of the leases key, sampled until stopped (at most 60 s), keeping the largest.
struct ZcardWatch {
    stop: Arc<AtomicBool>,
    max: Arc<AtomicU64>,
    samples: Arc<AtomicU64>,
    thread: Option<thread::JoinHandle<()>>,
}

impl ZcardWatch {
    fn start(server: &Arc<RedisServer>) -> ZcardWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let max = Arc::new(AtomicU64::new(0));
        let samples = Arc::new(AtomicU64::new(0));
        let thread = {
            let (server, stop, max, samples) =
                (server.clone(), stop.clone(), max.clone(), samples.clone());
            thread::spawn(move || {
                let end = Instant::now() + Duration::from_secs(60);
                while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                    let n = server.command(&["ZCARD", LEASES_KEY]).as_int().unwrap();
                    max.fetch_max(n as u64, Ordering::Relaxed);
                    samples.fetch_add(1, Ordering::Relaxed);
                    thread::sleep(Duration::from_millis(5));
                }
            })
        };
        ZcardWatch {
            stop,
            max,
            samples,
            thread: Some(thread),
        }
    }

    /// Stops sampling; returns the largest count seen and how many samples were taken.
    fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().expect("the ZCARD watcher panicked");
        }
        (
            self.max.load(Ordering::Relaxed),
            self.samples.load(Ordering::Relaxed),
        )
    }
}

/// Calls to `EVALSHA` the server executed so far (every leasehold script runs through it).
fn evalsha_calls(server: &RedisServer) -> u64 {
    let info = match server.command(&["INFO", "commandstats"]) {
        Reply::Bulk(bytes) => String::from_utf8(bytes).unwrap(),
        other => panic!("INFO replied {other:?}"),
    };
    info.lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse().unwrap())
}

fn members(server: &RedisServer) -> Vec<String> {
    match server.command(&["ZRANGE", LEASES_KEY, "0", "-1"]) {
        Reply::Array(items) => items.iter().map(|item| item.as_string().unwrap()).collect(),
        other => panic!("ZRANGE replied {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_requests_arrive_late_fences_itself_before_the_server_reaps_it() {
    let server = Arc::new(RedisServer::start());
    let proxy = FaultProxy::start(server.port());
    let holder_backend = connect_through(&proxy, CALL_TIMEOUT).await;
    let holder_quota = Quota::builder(QUOTA)
        .limit(1)
        .ttl(TTL)
        .safety_margin(MARGIN)
        .backend(holder_backend.clone())
        .build()
        .unwrap();
    // The successor talks to the server directly: its view is the server's. Its own lease is
    // long and renewed rarely, so that no renewal of its own runs while the test counts the
    // holder's late ones.
    let direct = RedisBackend::connect(&server.url()).await.unwrap();
    let successor_quota = Quota::builder(QUOTA)
        .limit(1)
        .ttl(SUCCESSOR_TTL)
        .heartbeat(SUCCESSOR_TTL * 9 / 10)
        .backend(direct.clone())
        .build()
        .unwrap();

    let watch = ZcardWatch::start(&server);
    let holder = holder_quota.try_acquire("holder").await.unwrap();
    let token = holder.fencing_token();
    // Loads the snapshot script now, so that the barrier below is one call.
    holder_quota.status().await.unwrap();
    let lost = {
        let holder = holder.clone();
        tokio::spawn(async move {
            let reason = holder.lost().await;
            (reason, Instant::now())
        })
    };
    // At least one renewal goes through before the fault.
    tokio::time::sleep(TTL / 2 + TTL / 10).await;
    assert!(holder.is_held());
    // The fault starts right after a renewal was answered, so that none is in flight while it
    // starts (the next is a heartbeat away) and the holder's deadline is the one read here.
    let answered = holder.local_deadline();
    let watching = Instant::now() + TTL;
    while holder.local_deadline() == answered && Instant::now() < watching {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_ne!(holder.local_deadline(), answered, "no renewal within a ttl");

    let delay = TTL * 3 / 2;
    proxy.set_latency_to_server(delay);
    let delayed_at = Instant::now();
    let deadline_before = holder.local_deadline();

    // The server's view: the slot frees when the lease's server deadline passes.
    let end = delayed_at + Duration::from_secs(15);
    let (successor, admit_sent, admit_replied) = loop {
        assert!(
            Instant::now() < end,
            "the successor was never admitted (the lease was never reaped)"
        );
        let sent = Instant::now();
        match successor_quota.try_acquire("successor").await {
            Ok(lease) => break (lease, sent, Instant::now()),
            Err(Error::Full { .. }) => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(e) => panic!("successor: {e:?}"),
        }
    };
    let calls_after_admission = evalsha_calls(&server);
    let (reason, lost_at) = tokio::time::timeout(Duration::from_secs(10), lost)
        .await
        .expect("the holder reported no loss")
        .unwrap();
    let fence = holder.local_deadline();
    let since = |at: Instant| at.saturating_duration_since(delayed_at);
    println!(
        "after the one-way delay began: holder's local deadline {:?}, lost reported {:?} \
         ({reason}), successor admitted between {:?} and {:?}",
        since(fence),
        since(lost_at),
        since(admit_sent),
        since(admit_replied),
    );
    assert_eq!(reason, LostReason::LocalDeadline);
    assert!(!holder.is_held());
    // No renewal sent after the delay began was acknowledged: the fence is the deadline the
    // holder already had, counted from a send before the delay.
    assert_eq!(fence, deadline_before);
    assert!(fence < delayed_at + TTL, "counted from a send, not a reply");
    // The holder stopped before the server could admit anyone: the successor's successful
    // attempt was only sent after the holder's deadline and after its loss was reported.
    assert!(fence < admit_sent, "fenced after the server admitted");
    assert!(
        lost_at < admit_sent,
        "lost reported after the server admitted"
    );

    // The renewals the holder sent during the delay are still on their way. Lifting the delay
    // does not let later requests overtake them, so the reply to one more call on the holder's
    // connection means the server has run all of them.
    proxy.set_latency_to_server(Duration::ZERO);
    holder_quota.status().await.unwrap();
    let late_calls = evalsha_calls(&server) - calls_after_admission - 1;
    println!("{late_calls} renewal call(s) reached the server after the successor's admission");
    assert!(
        late_calls >= 1,
        "no renewal arrived late: the test did not provoke F4"
    );
    assert_eq!(
        holder_backend.connection_rebuilds(),
        0,
        "the late renewals went out on the connection they were sent on"
    );
    assert_eq!(members(&server), vec!["successor".to_string()]);
    assert!(successor.is_held());

    // What such a late renewal is answered, asked again directly: the lease is gone.
    let keys = QuotaKeys::new(QUOTA).unwrap();
    let reply = direct
        .renew(&keys, TTL, "", &[("holder".to_string(), token)])
        .await
        .unwrap();
    assert_eq!(reply.outcomes, vec![leasehold::backend::RenewOutcome::Gone]);
    assert_eq!(members(&server), vec!["successor".to_string()]);

    successor.release().await.unwrap();
    holder.release().await.unwrap();
    let (max, samples) = watch.finish();
    println!("ZCARD of the leases key: at most {max} over {samples} samples");
    assert!(samples >= 10, "{samples}");
    assert_eq!(max, 1, "the quota never counted more than its limit");
    assert_eq!(members(&server), Vec::<String>::new());
}

/// The ttl of the late-acquire tests (F16).
const LATE_TTL: Duration = Duration::from_millis(1500);
/// How late the first acquire reaches Redis: long after its worker gave up (100 ms) and the
/// retry was released, well inside a ttl.
const REQUEST_DELAY: Duration = Duration::from_millis(600);

/// F16's setup, returned once the retry is released while the first acquire is still on its way.
struct LateAcquire {
    server: Arc<RedisServer>,
    proxy: FaultProxy,
    /// The worker that gave up on the first acquire; it talks through `proxy`.
    gave_up: Quota,
    /// Where the task was retried: another connection, direct to the server.
    retry: Quota,
    retried_token: u64,
}

impl LateAcquire {
    /// A worker's acquire of `job` is delayed on its way to Redis by [`REQUEST_DELAY`] (and its
    /// reply on the way back by `reply_delay`); the worker gives up after 100 ms; the task is
    /// retried on another connection, admitted and released.
    async fn retried_and_released_before_the_first_acquire_lands(reply_delay: Duration) -> Self {
        let server = Arc::new(RedisServer::start());
        let proxy = FaultProxy::start(server.port());
        let quota_on = |backend: RedisBackend| {
            Quota::builder(QUOTA)
                .limit(1)
                .ttl(LATE_TTL)
                .backend(backend)
                .build()
                .unwrap()
        };
        let gave_up = quota_on(connect_through(&proxy, CALL_TIMEOUT).await);
        let retry = quota_on(RedisBackend::connect(&server.url()).await.unwrap());
        common::warm_up(&gave_up).await;
        common::warm_up(&retry).await;
        proxy.set_latency_each_way(REQUEST_DELAY, reply_delay);
        let err = gave_up
            .acquire_timeout("job", Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::TimedOut {
                    answered: false,
                    ..
                }
            ),
            "{err:?}"
        );
        let lease = retry.try_acquire("job").await.unwrap();
        let retried_token = lease.fencing_token();
        lease.release().await.unwrap();
        assert!(members(&server).is_empty(), "{:?}", members(&server));
        LateAcquire {
            server,
            proxy,
            gave_up,
            retry,
            retried_token,
        }
    }

    /// Waits (at most 3 s) for the first acquire to land and admit `job` again; returns when
    /// it was seen, and checks that it is a new admission, with a later token than the retry's.
    async fn zombie_landed(&self) -> Instant {
        let end = Instant::now() + Duration::from_secs(3);
        while !members(&self.server).iter().any(|m| m == "job") {
            assert!(Instant::now() < end, "the delayed acquire never landed");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let landed = Instant::now();
        let holder = self
            .server
            .command(&["HGET", "leasehold:{oneway}:holders", "job"])
            .as_string()
            .expect("the zombie's holder record");
        let token: u64 = holder.split(':').next().unwrap().parse().unwrap();
        assert!(
            token > self.retried_token,
            "{token} after {}",
            self.retried_token
        );
        landed
    }
}

/// The worker that gave up still reads the late reply on its connection: it finds an admission
/// nobody waits for and releases it at once (PROTOCOL.md §6, duty 7). Until then the zombie holds
/// the one slot, and nobody else gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_that_lands_after_its_retry_was_released_is_released_by_its_late_reply() {
    let late =
        LateAcquire::retried_and_released_before_the_first_acquire_lands(Duration::ZERO).await;
    let watch = ZcardWatch::start(&late.server);
    let landed = late.zombie_landed().await;
    assert!(matches!(
        late.retry.try_acquire("other").await,
        Err(Error::Full { .. })
    ));
    let end = landed + LATE_TTL;
    while members(&late.server).iter().any(|m| m == "job") {
        // Before its ttl only a release removes it: an expired lease stays until a call reaps it.
        assert!(
            Instant::now() < end,
            "the zombie was not released by its late reply"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let lived = landed.elapsed();
    println!("the zombie lived {lived:?} (its release travels the delayed direction too)");
    let (max, samples) = watch.finish();
    assert_eq!(max, 1, "at most one lease at a time ({samples} samples)");
    assert!(late.gave_up.status().await.unwrap().holders.is_empty());
    late.retry.try_acquire("other").await.unwrap();
    drop(late.proxy);
}

/// The late reply is lost (its connection closed while it was on its way back): nobody learns of
/// the zombie, which holds its slot until its ttl runs out, and no longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_that_lands_after_its_retry_was_released_and_whose_reply_is_lost_expires_in_a_ttl(
) {
    let late =
        LateAcquire::retried_and_released_before_the_first_acquire_lands(Duration::from_secs(10))
            .await;
    let watch = ZcardWatch::start(&late.server);
    let landed = late.zombie_landed().await;
    late.proxy.drop_connections();
    late.proxy.set_latency(Duration::ZERO);
    let mut full = 0;
    let admitted = loop {
        match late.retry.try_acquire("other").await {
            Ok(lease) => break (landed.elapsed(), lease),
            Err(Error::Full { .. }) => full += 1,
            Err(e) => panic!("{e:?}"),
        }
        assert!(
            landed.elapsed() < LATE_TTL * 2,
            "the zombie outlived two ttls"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (after, lease) = admitted;
    println!(
        "another task admitted {after:?} after the zombie landed ({full} attempts full before)"
    );
    // The zombie's deadline is one ttl after it landed (by the server's clock); the attempts
    // come every 20 ms.
    assert!(after >= LATE_TTL - Duration::from_millis(100), "{after:?}");
    assert!(after <= LATE_TTL + Duration::from_millis(300), "{after:?}");
    let (max, samples) = watch.finish();
    assert_eq!(max, 1, "at most one lease at a time ({samples} samples)");
    lease.release().await.unwrap();
    assert!(late.gave_up.status().await.unwrap().holders.is_empty());
}
