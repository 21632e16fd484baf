//! The fence counter lost without the holders (an `allkeys-*` eviction, a `DEL`): whichever call
//! meets the missing fence first, the tokens issued next go on above every token still in
//! `holders` (PROTOCOL.md §5.2 step 8), never below. Raw script calls on a private redis-server,
//! so that each path (a current acquire, a stale acquire, a stale renew) is driven on purpose.

mod common;

use std::time::Duration;

use common::scripts::{acquire_args, key, renew_args, run};
use leasehold_testkit::{RedisServer, Reply};

/// The values of an acquire or renew reply.
fn items(reply: &Reply) -> &[Reply] {
    match reply {
        Reply::Array(items) => items,
        other => panic!("not a script answer: {other:?}"),
    }
}

/// Admits `ids` on a new quota `q` (limit 10): returns the epoch id; the tokens are 1, 2, ...
fn admit(server: &RedisServer, q: &str, ids: &[&str]) -> String {
    let reply = run(
        server,
        &acquire_args(q, ["10000", "10", "", "0", "0", "0"], ids),
    );
    let items = items(&reply);
    for (k, id) in ids.iter().enumerate() {
        assert_eq!(items[3 + 4 * k].as_int(), Some(1), "{id}: {reply:?}");
        assert_eq!(
            items[4 + 4 * k].as_int(),
            Some(k as i64 + 1),
            "{id}: {reply:?}"
        );
    }
    items[0].as_string().expect("the epoch id")
}

/// The token of the first id of an acquire answered "acquired".
fn admitted_token(reply: &Reply) -> i64 {
    let items = items(reply);
    assert_eq!(items[3].as_int(), Some(1), "not admitted: {reply:?}");
    items[4].as_int().unwrap()
}

/// A stale caller (an epoch id the quota never had) quarantines the quota once, for 100 ms;
/// waits until that is over, so the next stale call of the test is admitted.
fn quarantine_once(server: &RedisServer, q: &str) {
    let reply = run(
        server,
        &acquire_args(q, ["100", "10", "1.1", "0", "0", "0"], &["x"]),
    );
    assert_eq!(items(&reply)[3].as_int(), Some(4), "quarantined: {reply:?}");
    std::thread::sleep(Duration::from_millis(200));
}

/// Admits `a` to `d` (tokens 1 to 4) on a new quota `q`, ends a stale caller's quarantine, then
/// deletes the fence: the holders stay. Returns the epoch id.
fn four_holders_and_a_lost_fence_after_a_quarantine(server: &RedisServer, q: &str) -> String {
    let epoch = admit(server, q, &["a", "b", "c", "d"]);
    quarantine_once(server, q);
    server.command(&["DEL", &key(q, "fence")]);
    epoch
}

#[test]
fn a_current_acquire_goes_on_above_the_holders_when_the_fence_and_leases_are_gone() {
    let server = RedisServer::start();
    let q = "fence-and-leases";
    let epoch = admit(&server, q, &["a", "b"]);
    server.command(&["DEL", &key(q, "fence"), &key(q, "leases")]);
    let reply = run(
        &server,
        &acquire_args(q, ["10000", "10", &epoch, "0", "0", "0"], &["c"]),
    );
    assert_eq!(
        admitted_token(&reply),
        3,
        "holders a and b hold tokens 1 and 2"
    );
}

#[test]
fn a_stale_acquire_that_saw_fewer_tokens_goes_on_above_the_holders() {
    let server = RedisServer::start();
    let q = "stale-acquire";
    four_holders_and_a_lost_fence_after_a_quarantine(&server, q);
    // A stale caller that saw tokens up to 2 only.
    let reply = run(
        &server,
        &acquire_args(q, ["10000", "10", "1.1", "0", "0", "2"], &["y"]),
    );
    assert_eq!(
        admitted_token(&reply),
        5,
        "holders a to d hold tokens 1 to 4"
    );
}

#[test]
fn a_stale_renewal_that_saw_fewer_tokens_leaves_the_fence_above_the_holders() {
    let server = RedisServer::start();
    let q = "stale-renew";
    let epoch = four_holders_and_a_lost_fence_after_a_quarantine(&server, q);
    let renewed = run(
        &server,
        &renew_args(q, ["10000", "1.1", "0", "2"], &["b", "2"]),
    );
    assert_eq!(
        items(&renewed)[3].as_int(),
        Some(1),
        "b renewed: {renewed:?}"
    );
    assert_eq!(
        server
            .command(&["GET", &key(q, "fence")])
            .as_string()
            .as_deref(),
        Some("4")
    );
    let reply = run(
        &server,
        &acquire_args(q, ["10000", "10", &epoch, "0", "0", "4"], &["z"]),
    );
    assert_eq!(admitted_token(&reply), 5);
}

#[test]
fn a_new_quota_still_starts_at_one_and_a_foreign_holder_value_is_no_token() {
    let server = RedisServer::start();
    let q = "new";
    admit(&server, q, &["a"]);
    let q = "foreign-holders";
    admit(&server, q, &["a"]);
    server.command(&["HSET", &key(q, "holders"), "junk", "1e9:0", "junk2", "nope"]);
    server.command(&["DEL", &key(q, "fence")]);
    let epoch = server
        .command(&["HGET", &key(q, "epoch"), "id"])
        .as_string()
        .unwrap();
    let reply = run(
        &server,
        &acquire_args(q, ["10000", "10", &epoch, "0", "0", "0"], &["b"]),
    );
    assert_eq!(admitted_token(&reply), 2, "only a's token 1 counts");
}
