//! F6 of the reliability field notes: Redis restarts with its data intact (AOF, `appendfsync
//! always`). Nothing was lost, so nothing may look lost: the leases survive the restart, no slot
//! is handed out twice, no client takes the restart for a dataset loss (no quarantine), and the
//! holders keep their leases through it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use leasehold::{Error, FullCause, LostReason, Quota, QuotaKeys, RedisBackend, Unavailable};
use leasehold_testkit::{RedisServer, Reply};

mod common;

const NAME: &str = "restart";
const TTL: Duration = Duration::from_secs(2);
/// How long the other client keeps trying after the restart: longer than one ttl, so that
/// leases whose renewals had stopped would have expired and been handed out inside it.
const WATCH: Duration = Duration::from_secs(3);
const ATTEMPT_EVERY: Duration = Duration::from_millis(50);
/// The ttl of the slow-load test: well above the load (1–3 s), so that no holder reaches its
/// local deadline during it however slow the machine.
const LOADING_TTL: Duration = Duration::from_secs(6);

async fn quota_on(server: &RedisServer, ttl: Duration) -> Quota {
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    Quota::builder(NAME)
        .limit(2)
        .ttl(ttl)
        .backend(backend)
        .build()
        .unwrap()
}

fn field(server: &RedisServer, key: &str, field: &str) -> Option<String> {
    server.command(&["HGET", key, field]).as_string()
}

fn score(server: &RedisServer, key: &str, member: &str) -> f64 {
    let reply = server.command(&["ZSCORE", key, member]);
    let text = reply
        .as_string()
        .unwrap_or_else(|| panic!("no score for {member}: {reply:?}"));
    text.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_the_data_intact_loses_nothing_and_admits_nobody_extra() {
    let mut server = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let keys = QuotaKeys::new(NAME).unwrap();
    let holders = quota_on(&server, TTL).await;
    let a = holders.try_acquire("a").await.unwrap();
    let b = holders.try_acquire("b").await.unwrap();
    // Another process, which has seen the quota's epoch before the restart: the one that would
    // take a changed state for a loss.
    let other = quota_on(&server, TTL).await;
    match other.try_acquire("c").await {
        Err(Error::Full {
            cause: FullCause::NoSlot,
            ..
        }) => {}
        other => panic!("before the restart: {other:?}"),
    }
    let epoch = field(&server, &keys.epoch, "id").expect("an epoch");
    let seq = field(&server, &keys.epoch, "seq");
    let score_a = score(&server, &keys.leases, "a");

    let killed = Instant::now();
    // SIGKILL, then the same port, the same directory and the same arguments: the AOF is replayed.
    tokio::task::block_in_place(|| server.restart());
    let down = killed.elapsed();
    let restarted = Instant::now();
    println!("restarted: down {down:?}");
    for (option, value) in [("appendonly", "yes"), ("appendfsync", "always")] {
        let reply = server.command(&["CONFIG", "GET", option]);
        let got = match &reply {
            Reply::Array(pair) => pair.get(1).and_then(Reply::as_string),
            _ => None,
        };
        assert_eq!(got.as_deref(), Some(value), "{option}: {reply:?}");
    }
    let zcard = server.command(&["ZCARD", &keys.leases]).as_int();
    println!("ZCARD after the restart: {zcard:?}");
    assert_eq!(zcard, Some(2), "the leases survived the restart");
    assert_eq!(field(&server, &keys.epoch, "id").as_ref(), Some(&epoch));
    assert_eq!(field(&server, &keys.epoch, "seq"), seq);

    let (mut attempts, mut full) = (0, 0);
    while restarted.elapsed() < WATCH {
        attempts += 1;
        match other.try_acquire(&format!("c{attempts}")).await {
            Err(Error::Full {
                cause: FullCause::NoSlot,
                ..
            }) => full += 1,
            Err(Error::Full {
                cause: FullCause::Quarantined { remaining },
                ..
            }) => panic!(
                "attempt {attempts}, {:?} after the restart: quarantined ({remaining:?} left), \
                 a loss detected where nothing was lost",
                restarted.elapsed()
            ),
            Ok(lease) => panic!(
                "attempt {attempts}, {:?} after the restart: admitted {} (token {}) while both \
                 slots are held",
                restarted.elapsed(),
                lease.task_id(),
                lease.fencing_token()
            ),
            Err(e) => panic!(
                "attempt {attempts}, {:?} after the restart: {e:?}",
                restarted.elapsed()
            ),
        }
        tokio::time::sleep(ATTEMPT_EVERY).await;
    }
    println!(
        "{full} of {attempts} attempts answered full (no slot) in the {WATCH:?} after the restart"
    );
    assert!(attempts >= 10, "only {attempts} attempts in {WATCH:?}");

    for lease in [&a, &b] {
        assert_eq!(lease.lost_reason(), None, "{} was lost", lease.task_id());
        assert!(lease.is_held(), "{}", lease.task_id());
    }
    // Renewed through the restart: the stored deadline moved on by more than the time watched
    // minus one ttl (it would have stayed put, and expired, without renewals).
    let moved = score(&server, &keys.leases, "a") - score_a;
    println!("a's stored deadline moved {moved} ms");
    assert!(moved >= (WATCH - TTL).as_millis() as f64, "{moved}");
    assert_eq!(field(&server, &keys.epoch, "id").as_ref(), Some(&epoch));
    assert_eq!(
        server.command(&["EXISTS", &keys.quarantine]).as_int(),
        Some(0)
    );
    let status = holders.status().await.unwrap();
    assert_eq!(status.holders.len(), 2);

    a.release().await.unwrap();
    b.release().await.unwrap();
    assert_eq!(server.command(&["ZCARD", &keys.leases]).as_int(), Some(0));
    drop(server);
}

/// F24's `LOADING`: the restarted server loads its dataset from disk and, until it is done,
/// refuses every command with `LOADING` (the connection handshake included). That is the backend
/// being unavailable for a while: never `Full`, never a misconfiguration, never a loss. Once the
/// dataset is loaded, the leases are all there and their holders carry on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_loads_its_dataset_slowly_is_unavailable_never_full_and_loses_nothing() {
    // 10 000 ballast keys at 100 µs each: a load of 1–3 s, during which Redis answers (with
    // `LOADING`) every 1 KiB of the file.
    let mut server = RedisServer::start_with(&[
        "--enable-debug-command",
        "yes",
        "--key-load-delay",
        "100",
        "--loading-process-events-interval-bytes",
        "1024",
    ]);
    server.command(&["DEBUG", "POPULATE", "10000", "ballast"]);
    let keys = QuotaKeys::new(NAME).unwrap();
    let holders = quota_on(&server, LOADING_TTL).await;
    let a = holders.try_acquire("a").await.unwrap();
    let b = holders.try_acquire("b").await.unwrap();
    let other = quota_on(&server, LOADING_TTL).await;
    assert!(matches!(
        other.try_acquire("c").await,
        Err(Error::Full {
            cause: FullCause::NoSlot,
            ..
        })
    ));
    let epoch = field(&server, &keys.epoch, "id").expect("an epoch");
    let score_a = score(&server, &keys.leases, "a");
    assert_eq!(server.command(&["SAVE"]).as_string().as_deref(), Some("OK"));

    tokio::task::block_in_place(|| server.restart_loading());
    let restarted = Instant::now();
    // Ask every 50 ms while the server loads; each answer is judged by what the server said to
    // a `PING` right after it, so an answer from after the load is not held against the load.
    let (mut during, mut loading_named) = (0, 0);
    let mut kinds: BTreeMap<String, u32> = BTreeMap::new();
    let loaded = loop {
        assert!(
            restarted.elapsed() < Duration::from_secs(15),
            "still loading after 15 s"
        );
        let answer = other.try_acquire("c").await;
        let still_loading = server
            .try_command(&["PING"])
            .is_ok_and(|reply| reply.is_error_starting_with("LOADING"));
        if !still_loading {
            break restarted.elapsed();
        }
        during += 1;
        match answer {
            Err(Error::BackendUnavailable { kind, detail, .. }) => {
                if detail.contains("LOADING") {
                    // Refused, not run: nothing of the attempt can have been admitted.
                    assert_eq!(kind, Unavailable::ServerRefused, "{detail}");
                    loading_named += 1;
                }
                let text: String = detail.chars().take(70).collect();
                *kinds.entry(format!("{kind}: {text}")).or_default() += 1;
            }
            other => panic!(
                "attempt {during}, {:?} into the load: {other:?}, not `BackendUnavailable`",
                restarted.elapsed()
            ),
        }
        tokio::time::sleep(ATTEMPT_EVERY).await;
    };
    println!(
        "loaded {loaded:?} after the restart: {during} attempts during the load, all \
         unavailable, {loading_named} of them saying LOADING"
    );
    for (kind, count) in &kinds {
        println!("  {count} × {kind}");
    }
    assert!(during >= 5, "only {during} attempts during the load");
    assert!(loading_named >= 1, "no answer named the load");

    // After the load: the same answers as after a quick restart (F6): both slots held, no
    // quarantine, the holders renewing. The short-circuit may refuse for its cool-down first.
    let mut answered_full = None;
    while restarted.elapsed() < loaded + Duration::from_secs(5) {
        match other.try_acquire("c").await {
            Err(Error::Full {
                cause: FullCause::NoSlot,
                ..
            }) => {
                answered_full = Some(restarted.elapsed() - loaded);
                break;
            }
            Err(Error::BackendUnavailable { .. }) => {}
            answer => panic!("after the load: {answer:?}"),
        }
        tokio::time::sleep(ATTEMPT_EVERY).await;
    }
    let answered_full = answered_full.expect("answered `Full` within 5 s of the load");
    println!("answered full (no slot) {answered_full:?} after the load");
    assert_eq!(server.command(&["ZCARD", &keys.leases]).as_int(), Some(2));
    assert_eq!(field(&server, &keys.epoch, "id").as_ref(), Some(&epoch));
    assert_eq!(
        server.command(&["EXISTS", &keys.quarantine]).as_int(),
        Some(0)
    );
    // Renewed after the load: a's stored deadline moves on (bounded by two heartbeats).
    let renewed = common::eventually(LOADING_TTL / 3 * 2, || {
        score(&server, &keys.leases, "a") > score_a
    })
    .await;
    assert!(renewed, "a was not renewed after the load");
    for lease in [&a, &b] {
        assert_eq!(lease.lost_reason(), None, "{} was lost", lease.task_id());
    }
    a.release().await.unwrap();
    let c = other.try_acquire("c").await.unwrap();
    assert!(c.fencing_token() > b.fencing_token());
    b.release().await.unwrap();
    c.release().await.unwrap();
}

/// F6 as the field notes provoke it: Redis is down for three ttls, then restarts with its data
/// intact. Its clock moved on, so every lease it kept looks expired and the first acquires take
/// every slot at once. That burst is safe only because the old holders stopped first, at their
/// own local deadlines during the outage: at no moment do more tasks believe they hold a slot
/// than the limit. Nobody is admitted during the outage, and the old holders' late releases
/// touch none of the new leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_of_three_ttls_ends_with_the_old_holders_stopped_before_anyone_is_admitted() {
    const OUTAGE_TTL: Duration = Duration::from_secs(1);
    let mut server = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let keys = QuotaKeys::new(NAME).unwrap();
    let holders = quota_on(&server, OUTAGE_TTL).await;
    let other = quota_on(&server, OUTAGE_TTL).await;
    let a = holders.try_acquire("a").await.unwrap();
    let b = holders.try_acquire("b").await.unwrap();
    let old_tokens = [a.fencing_token(), b.fencing_token()];
    assert!(matches!(
        other.try_acquire("c0").await,
        Err(Error::Full { .. })
    ));

    tokio::task::block_in_place(|| server.kill());
    let killed = Instant::now();
    let lost = {
        let (a, b) = (a.clone(), b.clone());
        tokio::spawn(async move {
            let (a_reason, b_reason) = tokio::join!(a.lost(), b.lost());
            ([a_reason, b_reason], killed.elapsed())
        })
    };
    let (mut attempts, mut unavailable) = (0, 0);
    while killed.elapsed() < OUTAGE_TTL * 3 {
        attempts += 1;
        match other.try_acquire(&format!("during-{attempts}")).await {
            Err(Error::BackendUnavailable { .. }) => unavailable += 1,
            answer => panic!("during the outage: {answer:?}"),
        }
        tokio::time::sleep(ATTEMPT_EVERY).await;
    }
    let (reasons, lost_after) = lost.await.unwrap();
    println!("both old holders lost {lost_after:?} after the kill: {reasons:?}");
    assert_eq!(
        reasons,
        [LostReason::LocalDeadline, LostReason::LocalDeadline]
    );
    // At their local deadlines: at most ttl − margin after the last renewal was sent, plus
    // timer slack on a loaded machine. What this test needs is that it comes before the restart.
    assert!(
        lost_after < OUTAGE_TTL + Duration::from_millis(250),
        "{lost_after:?}"
    );
    println!("{unavailable} of {attempts} attempts during the outage: unavailable");

    tokio::task::block_in_place(|| server.restart());
    let restarted = Instant::now();
    assert_eq!(
        server.command(&["ZCARD", &keys.leases]).as_int(),
        Some(2),
        "the AOF kept the old leases (expired by now)"
    );
    let c1 = loop {
        match other.try_acquire("c1").await {
            Ok(lease) => break lease,
            Err(Error::BackendUnavailable { .. }) => {}
            answer => panic!("after the restart: {answer:?}"),
        }
        assert!(restarted.elapsed() < Duration::from_secs(5), "no admission");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    println!(
        "first admission {:?} after the restart",
        restarted.elapsed()
    );
    let c2 = other.try_acquire("c2").await.unwrap();
    assert!(matches!(
        other.try_acquire("c3").await,
        Err(Error::Full {
            cause: FullCause::NoSlot,
            ..
        })
    ));
    for lease in [&c1, &c2] {
        assert!(
            old_tokens.iter().all(|&old| lease.fencing_token() > old),
            "token {} after {old_tokens:?}",
            lease.fencing_token()
        );
    }
    assert_eq!(
        server.command(&["EXISTS", &keys.quarantine]).as_int(),
        Some(0)
    );
    // The old holders let go now, as a worker that learnt it lost its leases does: their
    // token-guarded releases leave the new holders' leases alone.
    drop((a, b));
    holders.flush().await;
    let mut members = common::holder_ids(&other).await;
    members.sort();
    assert_eq!(members, ["c1", "c2"]);
    c1.release().await.unwrap();
    c2.release().await.unwrap();
}
