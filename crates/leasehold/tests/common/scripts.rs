//! The protocol's scripts run by hand (`EVAL`), as a client in another language would send
//! them: their texts as the library builds them (PROTOCOL.md §5.1) and their calls' keys.

use leasehold_testkit::{RedisServer, Reply};

/// common.lua, then the script `file`: what the library sends for acquire, renew and set_limit
/// (its `after_common!`).
macro_rules! after_common {
    ($file:literal) => {
        concat!(
            include_str!("../../src/scripts/common.lua"),
            include_str!(concat!("../../src/scripts/", $file))
        )
    };
}

pub const ACQUIRE_LUA: &str = after_common!("acquire.lua");
pub const RENEW_LUA: &str = after_common!("renew.lua");
pub const SET_LIMIT_LUA: &str = after_common!("set_limit.lua");
pub const RELEASE_LUA: &str = include_str!("../../src/scripts/release.lua");
pub const CANCEL_LUA: &str = include_str!("../../src/scripts/cancel.lua");
pub const SNAPSHOT_LUA: &str = include_str!("../../src/scripts/snapshot.lua");

/// The key `suffix` of `quota`.
pub fn key(quota: &str, suffix: &str) -> String {
    format!("leasehold:{{{quota}}}:{suffix}")
}

/// `EVAL <script>` for `quota`: its keys named by `suffixes`, then the cancel markers of
/// `marked` task ids, then `args`.
pub fn eval(
    script: &str,
    quota: &str,
    suffixes: &[&str],
    marked: &[&str],
    args: &[&str],
) -> Vec<String> {
    let keys: Vec<String> = suffixes
        .iter()
        .map(|s| key(quota, s))
        .chain(marked.iter().map(|id| key(quota, &format!("cancel:{id}"))))
        .collect();
    let mut all = vec!["EVAL".to_owned(), script.to_owned(), keys.len().to_string()];
    all.extend(keys);
    all.extend(args.iter().map(|s| s.to_string()));
    all
}

/// An acquire of `ids` with the six fixed arguments `args` (ttl, limit, epoch, limit version,
/// seq, highest token).
pub fn acquire_args(quota: &str, args: [&str; 6], ids: &[&str]) -> Vec<String> {
    let suffixes = [
        "leases",
        "holders",
        "fence",
        "epoch",
        "quarantine",
        "waiting",
        "limit",
    ];
    eval(
        ACQUIRE_LUA,
        quota,
        &suffixes,
        ids,
        &[&args[..], ids].concat(),
    )
}

/// A renewal of the (task id, token) `pairs` with the four fixed arguments `args` (ttl, epoch,
/// seq, highest token).
pub fn renew_args(quota: &str, args: [&str; 4], pairs: &[&str]) -> Vec<String> {
    let suffixes = ["leases", "holders", "fence", "epoch", "quarantine", "limit"];
    let ids: Vec<&str> = pairs.chunks(2).map(|pair| pair[0]).collect();
    eval(
        RENEW_LUA,
        quota,
        &suffixes,
        &ids,
        &[&args[..], pairs].concat(),
    )
}

/// Sends a command built by the functions above.
pub fn run(server: &RedisServer, args: &[String]) -> Reply {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    server.command(&args)
}
