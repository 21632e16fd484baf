//! The scripts refuse malformed arguments (a foreign or buggy client) before they write anything
//! (PROTOCOL.md §2, §5.1): nothing a bad call sends is stored, a stale call with a bad ttl does
//! not use up its epoch's one quarantine, and tokens stay exact. Foreign values in the quota's
//! keys are refused the same way (a quarantine key of another type).

use std::time::Duration;

use leasehold::backend::{AcquireReply, LeaseRecord, RenewOutcome};
use leasehold::{Backend, Error, Misconfiguration, QuotaKeys, RedisBackend, VersionedLimit};
use leasehold_testkit::{RedisServer, Reply};

mod common;
use common::scripts::{
    acquire_args, eval, key, renew_args, run, CANCEL_LUA, RELEASE_LUA, SET_LIMIT_LUA,
};

/// 2^53 - 1: the largest token, seq, limit version and ttl a script takes.
const MAX: &str = "9007199254740991";

/// Every key of the server with its serialized value, in order: what a refused call must leave
/// exactly as it was (TTLs aside, which `DUMP` does not carry).
fn dataset(server: &RedisServer) -> Vec<(Vec<u8>, Vec<u8>)> {
    let Reply::Array(names) = server.command(&["KEYS", "*"]) else {
        panic!("KEYS did not answer an array")
    };
    let mut names: Vec<Vec<u8>> = names
        .into_iter()
        .map(|n| match n {
            Reply::Bulk(b) => b,
            other => panic!("a key name: {other:?}"),
        })
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let text = String::from_utf8(name.clone()).unwrap();
            match server.command(&["DUMP", &text]) {
                Reply::Bulk(dump) => (name, dump),
                other => panic!("DUMP {text}: {other:?}"),
            }
        })
        .collect()
}

fn code_of_first_answer(reply: &Reply) -> i64 {
    match reply {
        Reply::Array(items) => items[3].as_int().expect("an acquire code"),
        other => panic!("not an acquire reply: {other:?}"),
    }
}

#[test]
fn malformed_arguments_are_refused_and_change_nothing() {
    let server = RedisServer::start();
    let q = "args";
    // A quota with a lease, an epoch and a stored limit, as any client leaves it.
    let first = run(
        &server,
        &acquire_args(q, ["10000", "2", "", "0", "0", "0"], &["a"]),
    );
    assert_eq!(code_of_first_answer(&first), 1, "{first:?}");
    let Reply::Array(items) = &first else {
        unreachable!()
    };
    let epoch = items[0].as_string().expect("the epoch id");
    // A stale caller (an epoch the server does not have) is the path that used to write before
    // it read its arguments: the quarantine's `detected_ms`, re-registered leases, the fence.
    let stale = "1.1";

    let mut calls: Vec<(&str, Vec<String>)> = Vec::new();
    for ttl in ["0", "-5", "1.5", "1e3", "", "9007199254740992"] {
        calls.push((
            "acquire ttl",
            acquire_args(q, [ttl, "2", stale, "0", "0", "0"], &["b"]),
        ));
        calls.push((
            "renew ttl",
            renew_args(q, [ttl, stale, "0", "0"], &["c", "7"]),
        ));
    }
    for limit in ["0", "1000001", "2.5", "02", "x"] {
        calls.push((
            "acquire limit",
            acquire_args(q, ["10000", limit, stale, "0", "0", "0"], &["b"]),
        ));
    }
    for number in [
        "-1",
        "2.5",
        "1e3",
        "9007199254740992",
        "99999999999999999999",
        "00",
    ] {
        calls.push((
            "acquire limit version",
            acquire_args(q, ["10000", "2", stale, number, "0", "0"], &["b"]),
        ));
        calls.push((
            "acquire seq",
            acquire_args(q, ["10000", "2", stale, "0", number, "0"], &["b"]),
        ));
        calls.push((
            "acquire highest token",
            acquire_args(q, ["10000", "2", stale, "0", "0", number], &["b"]),
        ));
        calls.push((
            "renew highest token",
            renew_args(q, ["10000", stale, "0", number], &["c", "7"]),
        ));
        calls.push((
            "renew token",
            renew_args(q, ["10000", stale, "0", "0"], &["c", number]),
        ));
    }
    calls.push((
        "renew token",
        renew_args(q, ["10000", stale, "0", "0"], &["c", "abc"]),
    ));
    calls.push((
        "renew zero token",
        renew_args(q, ["10000", stale, "0", "0"], &["c", "0"]),
    ));
    calls.push((
        "renew without a token",
        renew_args(q, ["10000", stale, "0", "0"], &["c"]),
    ));
    calls.push((
        "acquire without task ids",
        acquire_args(q, ["10000", "2", stale, "0", "0", "0"], &[]),
    ));
    for (limit, version) in [("0", "1"), ("1e3", "1"), ("3", "-1"), ("3", "2.5")] {
        calls.push((
            "set_limit",
            eval(SET_LIMIT_LUA, q, &["limit"], &[], &[limit, version]),
        ));
    }
    let release = |args: &[&str]| {
        let channel = key(q, "events");
        let all = [&[channel.as_str()][..], args].concat();
        eval(RELEASE_LUA, q, &["leases", "holders", "waiting"], &[], &all)
    };
    calls.push(("release without pairs", release(&[])));
    calls.push(("release of half a pair", release(&["a"])));
    calls.push(("release of a pair and a half", release(&["a", "1", "b"])));
    let too_many: Vec<String> = (0..1001)
        .flat_map(|i| [format!("x{i}"), "1".into()])
        .collect();
    let too_many: Vec<&str> = too_many.iter().map(String::as_str).collect();
    calls.push(("release of 1001 pairs", release(&too_many)));
    // Past their bounds the scripts would fail on Lua's stack partway, after a stale caller's
    // epoch writes (8000 pairs for renew; acquire took any number, failing from about 8000).
    let ids: Vec<String> = (0..1001).map(|i| format!("y{i}")).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    calls.push((
        "acquire of 1001 task ids",
        acquire_args(q, ["10000", "2", stale, "0", "0", "0"], &ids),
    ));
    let pairs: Vec<String> = (0..5001)
        .flat_map(|i| [format!("z{i}"), "1".into()])
        .collect();
    let pairs: Vec<&str> = pairs.iter().map(String::as_str).collect();
    calls.push((
        "renew of 5001 pairs",
        renew_args(q, ["10000", stale, "0", "0"], &pairs),
    ));
    let channel = key(q, "events");
    for ttl in ["0", "-5", "1.5", "1e3", "", "01", "9007199254740992"] {
        calls.push((
            "cancel marker ttl",
            eval(
                CANCEL_LUA,
                q,
                &["leases"],
                &["a"],
                &["a", "why", ttl, &channel],
            ),
        ));
    }
    calls.push((
        "cancel without a channel",
        eval(CANCEL_LUA, q, &["leases"], &["a"], &["a", "why", "1000"]),
    ));

    let before = dataset(&server);
    for (what, call) in &calls {
        let reply = run(&server, call);
        match &reply {
            Reply::Error(e) => assert!(
                e.starts_with("LEASEHOLD invalid"),
                "{what}: refused, but not as a bad argument: {e}"
            ),
            other => {
                // The long calls would print thousands of arguments and answers.
                let answer: String = format!("{other:?}").chars().take(300).collect();
                panic!(
                    "{what} with {:?} was answered {answer}",
                    &call[3..call.len().min(13)]
                )
            }
        }
        assert_eq!(dataset(&server), before, "{what} changed the dataset");
    }
    println!("{} malformed calls refused, dataset unchanged", calls.len());

    // The stale calls above did not use up the epoch's one quarantine: the first well-formed
    // stale call still starts it, and admissions pause.
    let valid = run(
        &server,
        &acquire_args(q, ["10000", "2", stale, "0", "0", "0"], &["b"]),
    );
    assert_eq!(
        code_of_first_answer(&valid),
        4,
        "a well-formed stale call quarantines: {valid:?}"
    );
    assert!(epoch != stale);
}

/// Admits `id` in a quota of `limit` 3 (version 0) and ttl 10 s; panics unless it is a new
/// admission.
async fn admit(backend: &dyn Backend, keys: &QuotaKeys, id: &str) -> LeaseRecord {
    let reply = backend
        .acquire_with_limit(keys, id, TTL, LIMIT)
        .await
        .unwrap();
    match reply {
        AcquireReply::Acquired(lease) => lease,
        other => panic!("{id} is not admitted: {other:?}"),
    }
}

const TTL: Duration = Duration::from_secs(10);
const LIMIT: VersionedLimit = VersionedLimit {
    limit: 3,
    version: 0,
};

#[tokio::test]
async fn the_client_hears_a_refused_argument_as_a_protocol_misconfiguration() {
    let server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let keys = QuotaKeys::new("refused").unwrap();
    let lease = admit(&backend, &keys, "a").await;
    // `Backend::renew` is public: a token no admission gave (above 2^53 - 1) is refused whole.
    let refused = backend
        .renew(&keys, TTL, &lease.epoch, &[("a".into(), u64::MAX)])
        .await;
    assert!(
        matches!(
            &refused,
            Err(Error::Misconfigured(Misconfiguration::Protocol(m))) if m.contains("invalid token")
        ),
        "{refused:?}"
    );
    let renewed = backend
        .renew(&keys, TTL, &lease.epoch, &[("a".into(), lease.token)])
        .await
        .unwrap();
    assert!(
        matches!(renewed.outcomes[..], [RenewOutcome::Renewed { .. }]),
        "the lease is untouched: {renewed:?}"
    );

    // The fence at its largest: no token is left to give, and nobody is admitted.
    server.command(&["SET", &key("refused", "fence"), MAX]);
    let exhausted = backend.acquire_with_limit(&keys, "b", TTL, LIMIT).await;
    assert!(
        matches!(
            &exhausted,
            Err(Error::Misconfigured(Misconfiguration::Protocol(m))) if m.contains("exhausted")
        ),
        "{exhausted:?}"
    );
    assert_eq!(
        server
            .command(&["ZCARD", &key("refused", "leases")])
            .as_int(),
        Some(1),
        "b took no slot"
    );
    assert_eq!(
        server
            .command(&["GET", &key("refused", "fence")])
            .as_string()
            .as_deref(),
        Some(MAX),
        "the fence did not move"
    );
}

#[tokio::test]
async fn a_cancel_marker_of_another_type_fails_no_renewal() {
    let server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let keys = QuotaKeys::new("marker").unwrap();
    let mut leases = Vec::new();
    for id in ["a", "b"] {
        leases.push(admit(&backend, &keys, id).await);
    }
    // Written from outside: b's marker key holds a hash. Acquire reads markers with MGET, which
    // sees no marker there; renew does the same, instead of failing a and b alike (WRONGTYPE).
    server.command(&["HSET", &key("marker", "cancel:b"), "x", "1"]);
    let pairs: Vec<(String, u64)> = leases
        .iter()
        .map(|l| (l.task_id.clone(), l.token))
        .collect();
    let renewed = backend
        .renew(&keys, TTL, &leases[0].epoch, &pairs)
        .await
        .unwrap();
    assert!(
        matches!(
            renewed.outcomes[..],
            [RenewOutcome::Renewed { .. }, RenewOutcome::Renewed { .. }]
        ),
        "{renewed:?}"
    );
    let again = backend
        .acquire_with_limit(&keys, "b", TTL, LIMIT)
        .await
        .unwrap();
    assert!(matches!(again, AcquireReply::Held(_)), "{again:?}");
}

/// The quarantine is read by its TTL, which a key of any type has. A foreign hash there, with a
/// TTL, is WRONGTYPE for a stale renewal too: it does not read as a quarantine in force, so it
/// re-registers nothing.
#[test]
fn a_quarantine_key_of_another_type_re_registers_nothing() {
    let server = RedisServer::start();
    let q = "foreign-quarantine";
    let first = run(
        &server,
        &acquire_args(q, ["10000", "3", "", "0", "0", "0"], &["a"]),
    );
    assert_eq!(code_of_first_answer(&first), 1, "{first:?}");
    // This epoch's loss was already detected, so the stale call below starts no quarantine of
    // its own (which would overwrite the foreign key).
    server.command(&["HSET", &key(q, "epoch"), "detected_ms", "1"]);
    server.command(&["HSET", &key(q, "quarantine"), "x", "1"]);
    server.command(&["PEXPIRE", &key(q, "quarantine"), "60000"]);
    // A renewal from an earlier epoch, for a lease this store does not have.
    let stale = run(
        &server,
        &renew_args(q, ["10000", "1.1", "0", "0"], &["ghost", "7"]),
    );
    match &stale {
        Reply::Error(e) => assert!(e.contains("WRONGTYPE"), "{e}"),
        other => panic!("a stale renewal on a foreign quarantine key answered {other:?}"),
    }
    let score = server.command(&["ZSCORE", &key(q, "leases"), "ghost"]);
    assert_eq!(score, Reply::Nil, "ghost was re-registered");
}

/// A client of `server` and an in-memory backend, by name: the same calls go to each.
async fn both_backends(server: &RedisServer) -> [(&'static str, std::sync::Arc<dyn Backend>); 2] {
    let redis = RedisBackend::connect(&server.url()).await.unwrap();
    [
        ("redis", std::sync::Arc::new(redis)),
        (
            "memory",
            std::sync::Arc::new(leasehold::MemoryBackend::new()),
        ),
    ]
}

#[tokio::test]
async fn both_backends_refuse_a_token_no_admission_gives() {
    let server = RedisServer::start();
    let keys = QuotaKeys::new("tokens").unwrap();
    for (name, backend) in both_backends(&server).await {
        let lease = admit(backend.as_ref(), &keys, "a").await;
        for token in [0, 1 << 53, u64::MAX] {
            let refused = backend
                .renew(&keys, TTL, &lease.epoch, &[("a".into(), token)])
                .await;
            assert!(
                matches!(
                    &refused,
                    Err(Error::Misconfigured(Misconfiguration::Protocol(_)))
                ),
                "{name}, token {token}: {refused:?}"
            );
        }
        let renewed = backend
            .renew(&keys, TTL, &lease.epoch, &[("a".into(), lease.token)])
            .await
            .unwrap();
        assert!(
            matches!(renewed.outcomes[..], [RenewOutcome::Renewed { .. }]),
            "{name}: {renewed:?}"
        );
    }
}

/// Out-of-range arguments through the `Backend` trait (a `Quota` checks them first): the memory
/// backend refuses what the scripts refuse, as a misconfiguration, and changes nothing. Found by
/// review: it admitted with a ttl of 0 (a lease dead at birth), stored a limit of 0, and panicked
/// on a ttl of `Duration::MAX` after taking a token.
#[tokio::test]
async fn both_backends_refuse_out_of_range_ttls_and_limits() {
    let server = RedisServer::start();
    let keys = QuotaKeys::new("ranges").unwrap();
    let limit = |limit| VersionedLimit { limit, version: 0 };
    for (name, backend) in both_backends(&server).await {
        for (what, ttl, limit) in [
            ("ttl 0", Duration::ZERO, limit(2)),
            ("ttl Duration::MAX", Duration::MAX, limit(2)),
            ("limit 0", TTL, limit(0)),
        ] {
            let refused = backend.acquire_with_limit(&keys, "a", ttl, limit).await;
            assert!(
                matches!(&refused, Err(Error::Misconfigured(_))),
                "{name}, {what}: {refused:?}"
            );
        }
        let refused = backend.set_limit(&keys, 0, None).await;
        assert!(
            matches!(&refused, Err(Error::Misconfigured(_))),
            "{name}, set_limit 0: {refused:?}"
        );
        // Nothing was taken: the first admission gets token 1.
        let lease = admit(backend.as_ref(), &keys, "b").await;
        assert_eq!(lease.token, 1, "{name}");
    }
}
