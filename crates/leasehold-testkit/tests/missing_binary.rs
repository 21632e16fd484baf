//! A missing `redis-server` binary gives an actionable panic message.
//!
//! This lives in its own test binary because it changes the process
//! environment.

use leasehold_testkit::{RedisServer, REDIS_SERVER_ENV};

#[test]
fn missing_binary_panics_with_install_hint() {
    std::env::set_var(REDIS_SERVER_ENV, "/nonexistent/leasehold/redis-server");
    let result = std::panic::catch_unwind(RedisServer::start);
    std::env::remove_var(REDIS_SERVER_ENV);
    let payload = result.expect_err("start must panic without a binary");
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default();
    assert!(message.contains("scripts/test"), "{message}");
    assert!(
        message.contains("apt-get install redis-server"),
        "{message}"
    );
}
