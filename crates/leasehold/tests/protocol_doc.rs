//! docs/PROTOCOL.md is the contract other clients are written from: what it states about the
//! script texts must be what the library sends.

mod common;

use common::scripts::{
    ACQUIRE_LUA, CANCEL_LUA, RELEASE_LUA, RENEW_LUA, SET_LIMIT_LUA, SNAPSHOT_LUA,
};
use leasehold_testkit::RedisServer;

const PROTOCOL: &str = include_str!("../../../docs/PROTOCOL.md");

/// The SHA1 §1's table gives for `script`.
fn documented_sha1(script: &str) -> String {
    let row = PROTOCOL
        .lines()
        .find(|line| line.starts_with(&format!("| `{script}`")))
        .unwrap_or_else(|| panic!("PROTOCOL.md §1 has no SHA1 row for {script}"));
    let sha = row
        .split('`')
        .rev()
        .nth(1)
        .unwrap_or_else(|| panic!("no SHA1 in {row:?}"));
    assert_eq!(sha.len(), 40, "{row:?}");
    sha.to_owned()
}

/// A client in another language checks its copy of the scripts against §1's table; the table
/// must name the texts the library sends, as Redis hashes them.
#[test]
fn the_documented_sha1s_are_those_of_the_scripts_the_library_sends() {
    let server = RedisServer::start();
    let scripts = [
        ("acquire", ACQUIRE_LUA),
        ("renew", RENEW_LUA),
        ("set_limit", SET_LIMIT_LUA),
        ("release", RELEASE_LUA),
        ("cancel", CANCEL_LUA),
        ("snapshot", SNAPSHOT_LUA),
    ];
    for (name, text) in scripts {
        let loaded = server
            .command(&["SCRIPT", "LOAD", text])
            .as_string()
            .unwrap_or_else(|| panic!("SCRIPT LOAD of {name} failed"));
        assert_eq!(
            documented_sha1(name),
            loaded,
            "PROTOCOL.md §1 gives another SHA1 for {name}: update its table"
        );
    }
}

/// The same from the library's side: on a fresh server, what a `RedisBackend` loads as it
/// connects, and `set_limit` at its first call, is exactly what §1's table names (the test above
/// builds the texts itself, and would miss a change in how the library builds them).
#[tokio::test]
async fn the_scripts_the_library_loads_are_the_documented_ones() {
    let server = RedisServer::start();
    server.command(&["SCRIPT", "FLUSH"]);
    let backend = common::connect(&server.url()).await;
    let quota = common::quota_with(backend, "doc", 1, std::time::Duration::from_secs(10))
        .build()
        .unwrap();
    let lease = quota.try_acquire("t").await.unwrap();
    lease.release().await.unwrap();
    quota.set_limit(2, None).await.unwrap();
    for name in [
        "acquire",
        "renew",
        "set_limit",
        "release",
        "cancel",
        "snapshot",
    ] {
        let sha = documented_sha1(name);
        let exists = server.command(&["SCRIPT", "EXISTS", &sha]);
        let loaded = match &exists {
            leasehold_testkit::Reply::Array(flags) => flags.first().and_then(|f| f.as_int()),
            _ => None,
        };
        assert_eq!(
            loaded,
            Some(1),
            "the library never loaded the script PROTOCOL.md §1 names for {name} ({sha}): \
             {exists:?}"
        );
    }
}
