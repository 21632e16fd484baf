//! Foreign values in a quota's keys, systematically: every key of a quota (PROTOCOL.md §3) ×
//! a value of every other type (string, hash, list, set, zset; with and without a TTL) × every
//! public operation that touches it.
//!
//! The rule: a wrong-typed existing key of the quota that an operation needs is reported as
//! misconfiguration (`Misconfiguration::WrongType`), never as full, quarantined, cancelled,
//! timed out or a lost lease, and the failed call takes no slot or token and writes no half
//! lease. A key an operation does not read is ignored (it cannot tell), and a few keys are
//! overwritten or ignored by design (PROTOCOL.md says which): the waiting marker (`SET` replaces
//! it, release only asks whether it exists), the cancel marker (acquire and renew read it with
//! `MGET`, so a marker of another type is no marker; cancel's `SET` replaces it).
//!
//! Three cells broke the rule until the scripts were fixed: a foreign fence read as a full or a
//! quarantined quota (acquire answered those without reading it), and a cancel that failed on a
//! foreign `leases` key had already written its marker. Their tests below failed before.
//!
//! The matrix (W = WrongType, nothing written; - = key not read, works):
//!
//! | key        | acquire (new id)        | renewal                 | release | cancel | reason | set_limit | status         |
//! |------------|-------------------------|-------------------------|---------|--------|--------|-----------|----------------|
//! | leases     | W                       | W, stops at local dl.   | W       | W      | -      | -         | W              |
//! | holders    | W (cancelled id too)    | W, stops at local dl.   | W       | -      | -      | -         | W if a live lease, else - |
//! | fence      | W (full, quarantined too) | - (W when stale)      | -       | -      | -      | -         | -              |
//! | epoch      | W                       | W, stops at local dl.   | -       | -      | -      | -         | -              |
//! | quarantine | W (±TTL)                | - (W when stale)        | -       | -      | -      | -         | W (±TTL)       |
//! | waiting    | - / replaced by SET when refused | -              | EXISTS  | -      | -      | -         | -              |
//! | limit      | W                       | - (W when stale)        | -       | -      | -      | W         | W              |
//! | cancel:id  | no marker (MGET)        | no marker (MGET)        | -       | replaced by SET | W | -      | -              |

mod common;

use common::scripts::key;
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::backend::LimitUpdate;
use leasehold::{
    Backend, Error, FullCause, Lease, LostReason, Misconfiguration, Quota, RedisBackend,
};
use leasehold_testkit::{RedisServer, Reply};
use tokio::task::JoinSet;

/// The Redis types a key can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    String,
    Hash,
    List,
    Set,
    ZSet,
}

const KINDS: [Kind; 5] = [Kind::String, Kind::Hash, Kind::List, Kind::Set, Kind::ZSet];

/// The keys of a quota (PROTOCOL.md §3) and the type the protocol gives each. `cancel:t` is the
/// cancel marker of the task `t`.
const KEYS: [(&str, Kind); 8] = [
    ("leases", Kind::ZSet),
    ("holders", Kind::Hash),
    ("fence", Kind::String),
    ("epoch", Kind::Hash),
    ("quarantine", Kind::String),
    ("waiting", Kind::String),
    ("limit", Kind::Hash),
    ("cancel:t", Kind::String),
];

/// With and without a TTL: the quarantine and the waiting marker are read by their TTL.
const TTLS: [Option<u64>; 2] = [None, Some(60_000)];

/// Every foreign value a key of type `own` can hold: one cell per other type, with and without
/// a TTL.
fn foreign_values(own: Kind) -> Vec<(Kind, Option<u64>)> {
    KINDS
        .into_iter()
        .filter(|k| *k != own)
        .flat_map(|k| TTLS.into_iter().map(move |ttl| (k, ttl)))
        .collect()
}

/// Replaces the key `suffix` of `quota` with a value of type `kind` (and a TTL of `ttl` ms).
fn put_foreign(server: &RedisServer, quota: &str, suffix: &str, kind: Kind, ttl: Option<u64>) {
    let full = key(quota, suffix);
    server.command(&["DEL", &full]);
    let reply = match kind {
        Kind::String => server.command(&["SET", &full, "foreign"]),
        Kind::Hash => server.command(&["HSET", &full, "foreign", "1"]),
        Kind::List => server.command(&["RPUSH", &full, "foreign"]),
        Kind::Set => server.command(&["SADD", &full, "foreign"]),
        Kind::ZSet => server.command(&["ZADD", &full, "1", "foreign"]),
    };
    assert!(!matches!(reply, Reply::Error(_)), "{full}: {reply:?}");
    if let Some(ms) = ttl {
        server.command(&["PEXPIRE", &full, &ms.to_string()]);
    }
}

fn type_of(server: &RedisServer, quota: &str, suffix: &str) -> String {
    server
        .command(&["TYPE", &key(quota, suffix)])
        .as_string()
        .unwrap_or_default()
}

/// The names of `quota`'s keys, in order.
fn keys_of(server: &RedisServer, quota: &str) -> Vec<String> {
    let Reply::Array(names) = server.command(&["KEYS", &key(quota, "*")]) else {
        panic!("KEYS did not answer an array")
    };
    let mut names: Vec<String> = names.iter().filter_map(Reply::as_string).collect();
    names.sort();
    names
}

/// Deletes every key of `quota`: a loss of its state (the server is shared by cells that run
/// at once, so no `FLUSHALL`).
fn lose_state(server: &RedisServer, quota: &str) {
    for name in keys_of(server, quota) {
        server.command(&["DEL", &name]);
    }
}

/// Every key of `quota` with its serialized value, in order: what a refused call must leave as
/// it was.
fn dataset(server: &RedisServer, quota: &str) -> Vec<(String, Reply)> {
    keys_of(server, quota)
        .into_iter()
        .map(|name| {
            let dump = server.command(&["DUMP", &name]);
            (name, dump)
        })
        .collect()
}

fn holds(server: &RedisServer, quota: &str, task: &str) -> (bool, bool) {
    let in_leases = !matches!(
        server.command(&["ZSCORE", &key(quota, "leases"), task]),
        Reply::Nil | Reply::Error(_)
    );
    let in_holders = server
        .command(&["HEXISTS", &key(quota, "holders"), task])
        .as_int()
        == Some(1);
    (in_leases, in_holders)
}

#[track_caller]
fn assert_wrong_type<T: std::fmt::Debug>(cell: &str, result: leasehold::Result<T>) {
    match result {
        Err(Error::Misconfigured(Misconfiguration::WrongType { .. })) => {}
        other => panic!("{cell}: expected Misconfigured(WrongType), got {other:?}"),
    }
}

struct Setup {
    server: Arc<RedisServer>,
    backend: Arc<dyn Backend>,
    next: std::sync::atomic::AtomicUsize,
}

impl Setup {
    async fn new() -> Setup {
        let server = RedisServer::start();
        let backend = RedisBackend::connect(&server.url()).await.unwrap();
        Setup {
            server: Arc::new(server),
            backend: Arc::new(backend),
            next: Default::default(),
        }
    }

    /// A quota of its own for one cell.
    fn quota(&self, limit: u64, ttl: Duration) -> Quota {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Quota::builder(format!("fk-{n}"))
            .limit(limit)
            .ttl(ttl)
            .shared_backend(self.backend.clone())
            .build()
            .unwrap()
    }
}

const LONG: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Quota::try_acquire and Quota::acquire_timeout
// ---------------------------------------------------------------------------------------------

/// The keys acquire needs for a new task id (leases, holders, fence, epoch, quarantine, limit):
/// a foreign value in any of them fails the attempt with WrongType, with a slot free and with
/// the quota full, and the failed call changes nothing: no
/// slot, no token, no half lease. `acquire_timeout` answers the same at once, not `TimedOut`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_reports_every_wrong_typed_key_it_needs() {
    let setup = Setup::new().await;
    let server = &setup.server;
    for (suffix, own) in &KEYS[..] {
        if matches!(*suffix, "waiting" | "cancel:t") {
            continue; // ignored by design: `acquire_does_not_need_the_waiting_or_cancel_keys`
        }
        for (kind, ttl) in foreign_values(*own) {
            for full in [false, true] {
                let cell = format!("{suffix} = {kind:?} (ttl {ttl:?}), full: {full}");
                let quota = setup.quota(if full { 1 } else { 2 }, LONG);
                let name = quota.name().to_owned();
                quota.try_acquire("held").await.unwrap().abandon();
                put_foreign(server, &name, suffix, kind, ttl);
                let before = dataset(server, &name);
                assert_wrong_type(&cell, quota.try_acquire("new").await);
                assert_eq!(dataset(server, &name), before, "{cell}: try_acquire wrote");
                let asked = Instant::now();
                assert_wrong_type(
                    &cell,
                    quota.acquire_timeout("new", Duration::from_secs(2)).await,
                );
                assert!(
                    asked.elapsed() < Duration::from_secs(1),
                    "{cell}: acquire_timeout waited {:?}",
                    asked.elapsed()
                );
                assert_eq!(
                    dataset(server, &name),
                    before,
                    "{cell}: acquire_timeout wrote"
                );
                // Once the key is gone, nothing of the failed attempts shows: not held, and
                // the next admission's token is the next one (the fence never took one). (A
                // deleted epoch would start a quarantine: the next caller is stale.)
                if matches!(*suffix, "quarantine" | "limit") {
                    server.command(&["DEL", &key(&name, suffix)]);
                    assert_eq!(holds(server, &name, "new"), (false, false), "{cell}");
                    if !full {
                        let lease = quota.try_acquire("new").await.unwrap();
                        assert_eq!(lease.fencing_token(), 2, "{cell}: a token was taken");
                    }
                }
            }
        }
    }
}

/// Keys acquire reads without needing their type (PROTOCOL.md §5.2): the waiting marker is
/// only written when someone is refused (`SET` replaces a foreign value unless its TTL is
/// already longer than wanted, and release only asks whether it exists), and a cancel marker of
/// another type is no marker (`MGET`, step 4). Both are harmless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_does_not_need_the_waiting_or_cancel_keys() {
    let setup = Setup::new().await;
    let server = &setup.server;
    for (kind, ttl) in foreign_values(Kind::String) {
        // waiting, slot free: not read.
        let cell = format!("waiting = {kind:?} (ttl {ttl:?})");
        let quota = setup.quota(1, LONG);
        let name = quota.name().to_owned();
        put_foreign(server, &name, "waiting", kind, ttl);
        let lease = quota.try_acquire("t").await.unwrap();
        assert_eq!(lease.fencing_token(), 1, "{cell}");
        assert_eq!(
            type_of(server, &name, "waiting"),
            format!("{kind:?}").to_lowercase()
        );
        // waiting, full: a foreign value with a TTL shorter than wanted (2 × ttl = 20 s) or
        // none is replaced by the marker; one that lives longer stays and works as one.
        let err = quota.try_acquire("u").await.unwrap_err();
        assert!(
            matches!(
                err,
                Error::Full {
                    cause: FullCause::NoSlot,
                    ..
                }
            ),
            "{cell}: {err:?}"
        );
        let expected = match ttl {
            Some(ms) if ms >= 20_000 => format!("{kind:?}").to_lowercase(),
            _ => "string".to_owned(),
        };
        assert_eq!(type_of(server, &name, "waiting"), expected, "{cell}");
        lease.release().await.unwrap();

        // cancel marker: no marker, the task is admitted.
        let cell = format!("cancel:t = {kind:?} (ttl {ttl:?})");
        let quota = setup.quota(1, LONG);
        let name = quota.name().to_owned();
        put_foreign(server, &name, "cancel:t", kind, ttl);
        let lease = quota.try_acquire("t").await.unwrap();
        assert_eq!(lease.fencing_token(), 1, "{cell}");
        lease.release().await.unwrap();
    }
}

/// Acquire checks its keys before anything else, so a foreign value fails even the answers that
/// would not need it: `held` for a task that holds a live lease (a foreign fence), `cancelled`
/// for a cancelled task (foreign holders). Nothing is written, and the lease is still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_reports_a_foreign_key_even_for_a_held_or_cancelled_task() {
    let setup = Setup::new().await;
    let server = &setup.server;
    for (kind, ttl) in foreign_values(Kind::String) {
        let cell = format!("fence = {kind:?} (ttl {ttl:?}), task held");
        let quota = setup.quota(2, LONG);
        let name = quota.name().to_owned();
        let lease = quota.try_acquire("held").await.unwrap();
        put_foreign(server, &name, "fence", kind, ttl);
        let before = dataset(server, &name);
        assert_wrong_type(&cell, quota.try_acquire("held").await);
        assert_eq!(dataset(server, &name), before, "{cell}");
        assert!(lease.is_held(), "{cell}");
        assert_wrong_type(&cell, quota.try_acquire("new").await);
    }
    for (kind, ttl) in foreign_values(Kind::Hash) {
        let cell = format!("holders = {kind:?} (ttl {ttl:?}), task cancelled");
        let quota = setup.quota(2, LONG);
        let name = quota.name().to_owned();
        quota.try_acquire("held").await.unwrap().abandon();
        server.command(&["SET", &key(&name, "cancel:t"), "stop", "PX", "60000"]);
        put_foreign(server, &name, "holders", kind, ttl);
        let before = dataset(server, &name);
        assert_wrong_type(&cell, quota.try_acquire("t").await);
        assert_eq!(dataset(server, &name), before, "{cell}");
        assert_wrong_type(&cell, quota.try_acquire("new").await);
    }
}

/// A call that writes before it reads some keys (the first call ever creates the epoch; a stale
/// call, after a loss of the quota's data, records the loss; a higher limit version replaces
/// the stored limit; any call reaps expired leases) checks those keys first: a foreign
/// `leases`, `holders` or `limit` key fails it with nothing written. (These calls used to write, then fail: a stale one used up its epoch's one
/// quarantine.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_writes_first_writes_nothing_on_a_foreign_key() {
    let setup = Setup::new().await;
    let server = &setup.server;
    for (suffix, own) in [("leases", Kind::ZSet), ("holders", Kind::Hash)] {
        for (kind, ttl) in foreign_values(own) {
            let cell = format!("{suffix} = {kind:?} (ttl {ttl:?}), first call");
            let quota = setup.quota(2, LONG);
            let name = quota.name().to_owned();
            put_foreign(server, &name, suffix, kind, ttl);
            let before = dataset(server, &name);
            assert_wrong_type(&cell, quota.try_acquire("t").await);
            assert_eq!(dataset(server, &name), before, "{cell}");

            let cell = format!("{suffix} = {kind:?} (ttl {ttl:?}), stale call");
            let quota = setup.quota(2, LONG);
            let name = quota.name().to_owned();
            quota.try_acquire("held").await.unwrap().abandon();
            lose_state(server, &name);
            put_foreign(server, &name, suffix, kind, ttl);
            let before = dataset(server, &name);
            assert_wrong_type(&cell, quota.try_acquire("t").await);
            assert_eq!(dataset(server, &name), before, "{cell}");

            let cell = format!("{suffix} = {kind:?} (ttl {ttl:?}), higher limit version");
            let quota = setup.quota(2, LONG);
            let name = quota.name().to_owned();
            quota.try_acquire("held").await.unwrap().abandon();
            put_foreign(server, &name, suffix, kind, ttl);
            let newer = Quota::builder(&name)
                .limit(5)
                .limit_version(1)
                .ttl(LONG)
                .shared_backend(setup.backend.clone())
                .build()
                .unwrap();
            let before = dataset(server, &name);
            assert_wrong_type(&cell, newer.try_acquire("t").await);
            assert_eq!(dataset(server, &name), before, "{cell}");
        }
    }
    // Reaping writes too: an expired lease is left as it was when the limit is foreign.
    for (kind, ttl) in foreign_values(Kind::Hash) {
        let cell = format!("limit = {kind:?} (ttl {ttl:?}), an expired lease to reap");
        let quota = setup.quota(2, Duration::from_millis(100));
        let name = quota.name().to_owned();
        quota.try_acquire("expired").await.unwrap().abandon();
        tokio::time::sleep(Duration::from_millis(150)).await;
        put_foreign(server, &name, "limit", kind, ttl);
        let before = dataset(server, &name);
        assert_wrong_type(&cell, quota.try_acquire("t").await);
        assert_eq!(dataset(server, &name), before, "{cell}");
    }
}

/// A renewal from a caller that saw this epoch further along (a higher `seq` than stored: the
/// store went back, PROTOCOL.md §8) starts a new epoch and a quarantine, so it must check the
/// keys first, as a stale call does. It did not: a foreign `limit` failed it with `WRONGTYPE`,
/// and a fence that holds no token with a Lua error, after the new epoch id, the quarantine and
/// the fence were written (found by review). Raw script calls: a caller with this `seq` is one
/// whose store went back, which the quota's own calls cannot fake.
#[test]
fn a_renewal_that_finds_the_store_went_back_writes_nothing_on_a_foreign_key() {
    use common::scripts::{acquire_args, renew_args, run};
    let server = RedisServer::start();
    for (suffix, kind) in [("limit", Kind::String), ("fence", Kind::String)] {
        let q = format!("went-back-{suffix}");
        let first = run(
            &server,
            &acquire_args(&q, ["10000", "2", "", "0", "0", "0"], &["a"]),
        );
        let Reply::Array(items) = &first else {
            panic!("{first:?}")
        };
        let epoch = items[0].as_string().expect("the epoch id");
        assert_eq!(items[2].as_int(), Some(1), "seq after one admission");
        put_foreign(&server, &q, suffix, kind, None);
        let before = dataset(&server, &q);
        let reply = run(
            &server,
            &renew_args(&q, ["10000", &epoch, "5", "9"], &["a", "1"]),
        );
        let cell = format!("{suffix} = {kind:?}, renew that saw seq 5 of 1");
        match &reply {
            Reply::Error(e) => assert!(
                e.starts_with("WRONGTYPE") || e.starts_with("LEASEHOLD foreign value"),
                "{cell}: {e}"
            ),
            other => panic!("{cell}: answered {other:?}"),
        }
        assert_eq!(dataset(&server, &q), before, "{cell}: wrote before failing");
    }
}

/// With the quota full, acquire answers `full` (code 0) without needing the fence: it used to
/// read it only to admit, so a foreign fence read as a full quota (`try_acquire`: `Full`,
/// `acquire_timeout`: `TimedOut { answered: true }`). It now checks the fence first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_fence_is_wrong_type_even_when_the_quota_is_full() {
    let setup = Setup::new().await;
    let server = &setup.server;
    for (kind, ttl) in foreign_values(Kind::String) {
        let cell = format!("fence = {kind:?} (ttl {ttl:?}), full");
        let quota = setup.quota(1, LONG);
        let name = quota.name().to_owned();
        quota.try_acquire("held").await.unwrap().abandon();
        put_foreign(server, &name, "fence", kind, ttl);
        let tried = quota.try_acquire("new").await;
        let waited = quota
            .acquire_timeout("new", Duration::from_millis(300))
            .await;
        let cell = format!("{cell}: try_acquire {tried:?}, acquire_timeout {waited:?}");
        assert_wrong_type(&cell, tried);
        assert_wrong_type(&cell, waited);
    }
}

/// Likewise during a quarantine (PROTOCOL.md §8): a foreign fence used to read as `Full { cause:
/// Quarantined }` for the quarantine's length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_fence_is_wrong_type_even_during_a_quarantine() {
    let setup = Setup::new().await;
    let server = &setup.server;
    for (kind, ttl) in foreign_values(Kind::String) {
        let cell = format!("fence = {kind:?} (ttl {ttl:?}), quarantined");
        let quota = setup.quota(2, LONG);
        let name = quota.name().to_owned();
        quota.try_acquire("held").await.unwrap().abandon();
        // A quarantine as a stale caller starts it: the epoch id, with a TTL.
        let epoch = server
            .command(&["HGET", &key(&name, "epoch"), "id"])
            .as_string()
            .unwrap();
        server.command(&["SET", &key(&name, "quarantine"), &epoch, "PX", "60000"]);
        put_foreign(server, &name, "fence", kind, ttl);
        assert_wrong_type(&cell, quota.try_acquire("new").await);
    }
}

// ---------------------------------------------------------------------------------------------
// Renewal (heartbeat) and Lease::lost
// ---------------------------------------------------------------------------------------------

const RENEW_TTL: Duration = Duration::from_secs(1);

/// What a held lease's renewals make of a foreign key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Every renewal fails with WrongType: the holder stops at its local deadline, as in an
    /// outage, told `LostReason::RenewalRefused` with the refusal.
    StopsRefused,
    /// Renewals do not read the key: the lease lives on.
    Held,
}

/// The quota's state when the foreign value is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// As the holder left it.
    Kept,
    /// Lost (PROTOCOL.md §8): the next renewal is stale, starts the quarantine and reads the
    /// fence, the quarantine and the limit to re-register the lease.
    Lost,
    /// Lost, and the loss already detected by another caller (a later epoch with its
    /// `detected_ms`): the stale renewal starts no quarantine, only reads it.
    LostAndDetected,
}

async fn renewal_cell(
    server: Arc<RedisServer>,
    quota: Quota,
    (suffix, kind, ttl): (&'static str, Kind, Option<u64>),
    state: State,
    expect: Expect,
) {
    let cell = format!("{suffix} = {kind:?} (ttl {ttl:?}), state {state:?}");
    let name = quota.name().to_owned();
    let lease = quota.try_acquire("t").await.unwrap();
    if state != State::Kept {
        lose_state(&server, &name);
    }
    if state == State::LostAndDetected {
        server.command(&[
            "HSET",
            &key(&name, "epoch"),
            "id",
            "9999999999.0",
            "seq",
            "0",
            "detected_ms",
            "1",
        ]);
    }
    put_foreign(&server, &name, suffix, kind, ttl);
    let overwritten = Instant::now();
    match expect {
        Expect::StopsRefused => {
            let reason = tokio::time::timeout(RENEW_TTL * 3, lease.lost())
                .await
                .unwrap_or_else(|_| panic!("{cell}: the holder never stopped"));
            assert!(
                matches!(
                    &reason,
                    LostReason::RenewalRefused(Misconfiguration::WrongType { quota, .. })
                        if *quota == name
                ),
                "{cell}: {reason:?}"
            );
            // Not at the first failed renewal: at the local deadline, as in an outage.
            assert!(
                Instant::now() >= lease.local_deadline(),
                "{cell}: lost {:?} after the overwrite, before its local deadline",
                overwritten.elapsed()
            );
        }
        Expect::Held => {
            tokio::time::sleep(RENEW_TTL * 3 / 2).await;
            assert_eq!(lease.lost_reason(), None, "{cell}");
            assert!(lease.is_held(), "{cell}");
        }
    }
    if state == State::Lost {
        // The stale renewals failed before writing anything: no epoch was started (the loss
        // is recorded by the first call after the foreign value is gone).
        assert_eq!(type_of(&server, &name, "epoch"), "none", "{cell}");
    }
}

/// Renewal reads `epoch`, `leases` and `holders` on every call, the fence, the quarantine and
/// the limit only when the call is stale (after a loss of the quota's state), and the cancel
/// markers with `MGET` (a foreign type is no marker). A foreign value in a key it reads fails
/// every renewal of the quota with WrongType; the error is logged at error level (`renewal
/// refused`) and the holder stops at its local deadline, as if Redis were down (it stops before
/// the server's deadline), told `LostReason::RenewalRefused` with the WrongType refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renewals_fail_on_the_keys_they_read_and_the_holder_stops_at_its_local_deadline() {
    let setup = Setup::new().await;
    let mut cells = JoinSet::new();
    for (suffix, own) in KEYS {
        for (kind, ttl) in foreign_values(own) {
            let expect = match suffix {
                "epoch" | "leases" | "holders" => Expect::StopsRefused,
                _ => Expect::Held,
            };
            let quota = setup.quota(2, RENEW_TTL);
            cells.spawn(renewal_cell(
                setup.server.clone(),
                quota,
                (suffix, kind, ttl),
                State::Kept,
                expect,
            ));
        }
    }
    // After a loss: a foreign fence, quarantine, limit, leases or holders key fails the stale
    // renewal before it writes anything (PROTOCOL.md §5.2 step 1), so the lease is not
    // re-registered and its holder stops; the same when the loss was already detected by
    // another caller.
    for (suffix, state, expect) in [
        ("fence", State::Lost, Expect::StopsRefused),
        ("limit", State::Lost, Expect::StopsRefused),
        ("quarantine", State::Lost, Expect::StopsRefused),
        ("leases", State::Lost, Expect::StopsRefused),
        ("holders", State::Lost, Expect::StopsRefused),
        ("quarantine", State::LostAndDetected, Expect::StopsRefused),
    ] {
        let own = KEYS.iter().find(|(s, _)| *s == suffix).unwrap().1;
        for (kind, ttl) in foreign_values(own) {
            let quota = setup.quota(2, RENEW_TTL);
            cells.spawn(renewal_cell(
                setup.server.clone(),
                quota,
                (suffix, kind, ttl),
                state,
                expect,
            ));
        }
    }
    while let Some(done) = cells.join_next().await {
        done.unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Lease::release and Quota::force_release
// ---------------------------------------------------------------------------------------------

/// Release reads `holders` and `leases` (WrongType, nothing removed) and asks whether `waiting`
/// exists (any type: the release is announced, harmless); it reads no other key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_reports_wrong_typed_leases_and_holders_and_reads_nothing_else() {
    let setup = Setup::new().await;
    let server = &setup.server;
    for (suffix, own) in KEYS {
        for (kind, ttl) in foreign_values(own) {
            let cell = format!("{suffix} = {kind:?} (ttl {ttl:?})");
            let quota = setup.quota(3, LONG);
            let name = quota.name().to_owned();
            let lease: Lease = quota.try_acquire("h").await.unwrap();
            quota.try_acquire("g").await.unwrap().abandon();
            put_foreign(server, &name, suffix, kind, ttl);
            let before = dataset(server, &name);
            match suffix {
                "leases" | "holders" => {
                    assert_wrong_type(&cell, lease.release().await);
                    assert_wrong_type(&cell, quota.force_release("g").await);
                    assert_eq!(
                        dataset(server, &name),
                        before,
                        "{cell}: a failed release wrote"
                    );
                }
                _ => {
                    lease.release().await.unwrap();
                    assert!(quota.force_release("g").await.unwrap(), "{cell}");
                    for task in ["h", "g"] {
                        assert_eq!(holds(server, &name, task), (false, false), "{cell}");
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Quota::cancel and Quota::cancel_reason
// ---------------------------------------------------------------------------------------------

/// Cancel writes the marker with `SET` (a foreign value there is replaced: the cancel works)
/// and reads `leases`; `cancel_reason` reads the marker with `GET` (WrongType). Neither reads
/// any other key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_replaces_a_foreign_marker_and_cancel_reason_reports_it() {
    let setup = Setup::new().await;
    let server = &setup.server;
    for (suffix, own) in KEYS {
        for (kind, ttl) in foreign_values(own) {
            let cell = format!("{suffix} = {kind:?} (ttl {ttl:?})");
            let quota = setup.quota(2, LONG);
            let name = quota.name().to_owned();
            let _lease = quota.try_acquire("t").await.unwrap();
            put_foreign(server, &name, suffix, kind, ttl);
            match suffix {
                "cancel:t" => {
                    assert_wrong_type(&cell, quota.cancel_reason("t").await);
                    assert!(quota.cancel("t", "stop").await.unwrap(), "{cell}");
                    assert_eq!(
                        quota.cancel_reason("t").await.unwrap().as_deref(),
                        Some("stop"),
                        "{cell}"
                    );
                }
                "leases" => {
                    assert_eq!(quota.cancel_reason("t").await.unwrap(), None, "{cell}");
                    assert_wrong_type(&cell, quota.cancel("t", "stop").await);
                    assert_eq!(quota.cancel_reason("t").await.unwrap(), None, "{cell}");
                }
                _ => {
                    assert_eq!(quota.cancel_reason("t").await.unwrap(), None, "{cell}");
                    assert!(quota.cancel("t", "stop").await.unwrap(), "{cell}");
                    assert_eq!(
                        quota.cancel_reason("t").await.unwrap().as_deref(),
                        Some("stop"),
                        "{cell}"
                    );
                }
            }
        }
    }
}

/// A failed call changes nothing: cancel.lua used to write the marker before it read `leases`,
/// so with a foreign `leases` key the call failed with WrongType, yet the task was cancelled
/// (acquire refused it for the marker's life) and nothing was announced. It now reads first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_that_fails_on_a_foreign_leases_key_writes_no_marker() {
    let setup = Setup::new().await;
    let server = &setup.server;
    for (kind, ttl) in foreign_values(Kind::ZSet) {
        let cell = format!("leases = {kind:?} (ttl {ttl:?})");
        let quota = setup.quota(2, LONG);
        let name = quota.name().to_owned();
        put_foreign(server, &name, "leases", kind, ttl);
        let before = dataset(server, &name);
        assert_wrong_type(&cell, quota.cancel("t", "stop").await);
        assert_eq!(
            dataset(server, &name),
            before,
            "{cell}: the failed cancel wrote"
        );
        assert_eq!(quota.cancel_reason("t").await.unwrap(), None, "{cell}");
    }
}

// ---------------------------------------------------------------------------------------------
// Quota::set_limit and Quota::status
// ---------------------------------------------------------------------------------------------

/// set_limit reads only the `limit` key: WrongType there, with the foreign value left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_limit_reports_a_wrong_typed_limit_and_reads_nothing_else() {
    let setup = Setup::new().await;
    let server = &setup.server;
    for (suffix, own) in KEYS {
        for (kind, ttl) in foreign_values(own) {
            let cell = format!("{suffix} = {kind:?} (ttl {ttl:?})");
            let quota = setup.quota(2, LONG);
            let name = quota.name().to_owned();
            quota.try_acquire("t").await.unwrap().abandon();
            put_foreign(server, &name, suffix, kind, ttl);
            if suffix == "limit" {
                let before = dataset(server, &name);
                assert_wrong_type(&cell, quota.set_limit(3, None).await);
                assert_wrong_type(&cell, quota.set_limit(3, Some(7)).await);
                assert_eq!(dataset(server, &name), before, "{cell}");
            } else {
                let update = quota.set_limit(3, None).await.unwrap();
                assert!(
                    matches!(update, LimitUpdate::Stored(_)),
                    "{cell}: {update:?}"
                );
            }
        }
    }
}

/// status (snapshot.lua) reads `limit`, `leases`, `quarantine` (WrongType, with or without a
/// TTL: a foreign key is no quarantine) and `holders` (WrongType only when a live lease makes it
/// read the field: with no live lease the answer, an empty quota, is true); it does not read the
/// fence, the epoch, the waiting marker or cancel markers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_the_wrong_typed_keys_it_reads() {
    let setup = Setup::new().await;
    let server = &setup.server;
    for (suffix, own) in KEYS {
        for (kind, ttl) in foreign_values(own) {
            for live in [true, false] {
                let cell = format!("{suffix} = {kind:?} (ttl {ttl:?}), a live lease: {live}");
                let quota = setup.quota(2, LONG);
                let name = quota.name().to_owned();
                if live {
                    quota.try_acquire("t").await.unwrap().abandon();
                }
                put_foreign(server, &name, suffix, kind, ttl);
                let status = quota.status().await;
                match (suffix, live) {
                    ("limit" | "leases" | "quarantine", _) | ("holders", true) => {
                        assert_wrong_type(&cell, status)
                    }
                    _ => {
                        let status = status.unwrap_or_else(|e| panic!("{cell}: {e:?}"));
                        assert_eq!(status.quarantine, None, "{cell}");
                        assert_eq!(status.holders.len(), usize::from(live), "{cell}");
                    }
                }
            }
        }
    }
}
