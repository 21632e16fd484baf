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
