//! Synchronous test harness for `leasehold` integration tests and benchmarks.
//!
//! It provides:
//!
//! * [`RedisServer`]: a private `redis-server` process (no persistence) on a
//!   free loopback port, with helpers to kill, restart, pause (SIGSTOP) and
//!   resume (SIGCONT) it, stopped and cleaned up on drop;
//! * [`ServerClock`]: a wall clock a test can step under a running server;
//! * [`Reply`] and [`RedisServer::command`]: a tiny blocking RESP2 client to
//!   inspect or prepare server state without an async runtime;
//! * [`RedisServer::start_replica_of`]: a replica, for failovers;
//! * [`proxy::FaultProxy`]: a TCP proxy in front of a server with switchable faults
//!   (latency, stall, dropped connections, partition, lost Pub/Sub deliveries, wedged
//!   connections, a switchable upstream);
//! * [`free_port`] and [`temp_dir`]: small helpers; [`TempDir`] and [`Reaped`]: guards that
//!   remove a directory and kill a child process when a test ends, a panic included.
//!
//! The `redis-server` binary is taken from `PATH`, or from the
//! `LEASEHOLD_REDIS_SERVER` environment variable when it is set.
//!
//! ```
//! use leasehold_testkit::{RedisServer, Reply};
//!
//! let server = RedisServer::start();
//! assert_eq!(server.command(&["SET", "k", "v"]), Reply::Status("OK".into()));
//! assert_eq!(server.command(&["GET", "k"]).as_string().as_deref(), Some("v"));
//! println!("connect your client to {}", server.url());
//! ```

#![warn(missing_docs)]

use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

mod clock;
mod guards;
pub mod proxy;
mod resp;
mod server;

pub use clock::ServerClock;
pub use guards::{Reaped, SpawnReaped, TempDir};
pub use resp::Reply;
pub use server::{RedisServer, REDIS_SERVER_ENV};

/// A TCP port on 127.0.0.1 that was free when asked, below the kernel's ephemeral range where
/// that range leaves room (ports 10000 and up).
///
/// Not an ephemeral port: those are the source ports of outgoing connections, so while a server
/// picked one and is down for [`RedisServer::restart`], any connection made meanwhile (the
/// client under test reconnecting, another test) may take it, and the restart then fails.
/// Another process may still take the port before it is used; [`RedisServer::start`] copes with
/// that by retrying.
pub fn free_port() -> u16 {
    const LOWEST: u16 = 10_000;
    let below = ephemeral_ports_start().unwrap_or(32_768);
    if below > LOWEST + 1_000 {
        let span = u64::from(below - LOWEST);
        for _ in 0..100 {
            let port = LOWEST + (random() % span) as u16;
            if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
                return port;
            }
        }
    }
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or_else(|e| panic!("could not bind 127.0.0.1:0 to find a free port: {e}"))
}

/// The first port of the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), if readable.
fn ephemeral_ports_start() -> Option<u16> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    range.split_whitespace().next()?.parse().ok()
}

/// A random number, different in each call and each process (no crate needed for a port pick).
fn random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(CALLS.fetch_add(1, Ordering::Relaxed));
    hasher.write_u32(std::process::id());
    hasher.write_u128(monotonic_ns());
    hasher.finish()
}

/// `CLOCK_MONOTONIC` in nanoseconds: unlike `Instant`, comparable across the processes of one
/// machine, so that worker processes can log intervals a test lines up.
pub fn monotonic_ns() -> u128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128
}

/// Path of a fresh, empty directory under [`std::env::temp_dir`], named
/// `PREFIX-PID-COUNTER-NANOS`; the caller removes it.
pub fn temp_dir(prefix: &str) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    for _ in 0..100 {
        let count = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path =
            std::env::temp_dir().join(format!("{prefix}-{}-{count}-{nanos}", std::process::id()));
        match std::fs::create_dir(&path) {
            Ok(()) => return path,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => panic!("could not create temp dir {}: {e}", path.display()),
        }
    }
    panic!("could not create a unique temp dir for prefix {prefix:?}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_bindable_and_outside_the_ephemeral_range() {
        let start = ephemeral_ports_start().unwrap_or(32_768);
        for _ in 0..20 {
            let port = free_port();
            assert!(port >= 10_000, "port {port}");
            if start > 11_000 {
                assert!(
                    port < start,
                    "port {port} is in the ephemeral range from {start}"
                );
            }
            TcpListener::bind((Ipv4Addr::LOCALHOST, port)).expect("the port is free");
        }
    }

    #[test]
    fn temp_dirs_are_fresh_and_distinct() {
        let a = temp_dir("leasehold-testkit-unit");
        let b = temp_dir("leasehold-testkit-unit");
        assert_ne!(a, b);
        assert!(a.is_dir() && b.is_dir());
        assert_eq!(std::fs::read_dir(&a).unwrap().count(), 0);
        std::fs::remove_dir_all(a).unwrap();
        std::fs::remove_dir_all(b).unwrap();
    }
}
