//! Redis clients that reach their server through a [`FaultProxy`].

use std::time::Duration;

use leasehold::{RedisBackend, RedisOptions};
use leasehold_testkit::proxy::FaultProxy;

/// A new Redis client of the server behind `proxy`, whose calls and connects both time out
/// after `timeout`.
pub async fn connect_through(proxy: &FaultProxy, timeout: Duration) -> RedisBackend {
    RedisBackend::connect_with(
        &proxy.url(),
        RedisOptions {
            call_timeout: timeout,
            connect_timeout: timeout,
            ..RedisOptions::default()
        },
    )
    .await
    .unwrap()
}
