//! Fixtures shared by the integration tests: one quota backend per test, either in memory or on
//! a private redis-server that the test owns.

#![allow(dead_code)]

pub mod counting;
pub mod processes;
pub mod proxied;
pub mod scripts;
pub mod switchable;
pub mod waiting;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::{
    Backend, Lease, MemoryBackend, Quota, QuotaBuilder, QuotaKeys, RedisBackend, RedisOptions,
};
use leasehold_testkit::RedisServer;

/// A backend for one test, and the server behind it if any.
pub struct Fixture {
    pub backend: Arc<dyn Backend>,
    pub memory: Option<Arc<MemoryBackend>>,
    pub server: Option<RedisServer>,
    pub name: String,
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

impl Fixture {
    pub async fn memory() -> Fixture {
        let memory = Arc::new(MemoryBackend::new());
        Fixture {
            backend: memory.clone(),
            memory: Some(memory),
            server: None,
            name: unique("mem"),
        }
    }

    pub async fn redis() -> Fixture {
        let server = RedisServer::start();
        let backend = RedisBackend::connect(&server.url())
            .await
            .expect("connect to the test redis-server");
        Fixture {
            backend: Arc::new(backend),
            memory: None,
            server: Some(server),
            name: unique("redis"),
        }
    }

    /// A second, independent client of the same store: another "process" as far as
    /// subscriptions and connections go (the memory backend is shared in-process).
    pub async fn second_client(&self) -> Arc<dyn Backend> {
        match &self.server {
            Some(server) => Arc::new(RedisBackend::connect(&server.url()).await.unwrap()),
            None => self.backend.clone(),
        }
    }

    pub fn keys(&self) -> QuotaKeys {
        QuotaKeys::new(&self.name).unwrap()
    }

    pub fn builder(&self, limit: u64, ttl: Duration) -> QuotaBuilder {
        Quota::builder(self.name.clone())
            .limit(limit)
            .ttl(ttl)
            .shared_backend(self.backend.clone())
    }

    pub fn quota(&self, limit: u64, ttl: Duration) -> Quota {
        self.builder(limit, ttl).build().unwrap()
    }

    /// Removes every lease without announcing it, as a restart without persistence does.
    pub fn wipe(&self) {
        match (&self.memory, &self.server) {
            (Some(memory), _) => memory.wipe(),
            (_, Some(server)) => {
                server.command(&["FLUSHALL"]);
            }
            _ => unreachable!("a fixture has a memory backend or a server"),
        }
    }
}

pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// How many clients subscribe to `channel` on `server` (`PUBSUB NUMSUB`).
pub fn subscribers(server: &RedisServer, channel: &str) -> i64 {
    match server.command(&["PUBSUB", "NUMSUB", channel]) {
        leasehold_testkit::Reply::Array(v) => v.get(1).and_then(|n| n.as_int()).unwrap_or(0),
        _ => 0,
    }
}

/// Polls `check` every 10 ms until it is true or `within` passes; returns whether it became true.
pub async fn eventually(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    check()
}

/// Declares each scenario once per backend: `mod memory_backend` and `mod redis_backend`.
#[macro_export]
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod memory_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::common::Fixture::memory().await).await
                }
            )*
        }
        mod redis_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::common::Fixture::redis().await).await
                }
            )*
        }
    };
}

/// A quota builder on `backend`.
pub fn quota_with(
    backend: Arc<dyn Backend>,
    name: &str,
    limit: u64,
    ttl: Duration,
) -> QuotaBuilder {
    Quota::builder(name)
        .limit(limit)
        .ttl(ttl)
        .shared_backend(backend)
}

/// A new Redis client of `url`.
pub async fn connect(url: &str) -> Arc<dyn Backend> {
    Arc::new(RedisBackend::connect(url).await.unwrap())
}

/// A new Redis client of `url` whose calls time out after `call_timeout`.
pub async fn connect_with_call_timeout(url: &str, call_timeout: Duration) -> RedisBackend {
    let options = RedisOptions {
        call_timeout,
        ..RedisOptions::default()
    };
    RedisBackend::connect_with(url, options).await.unwrap()
}

/// How many times the server ran `command` (lower case, e.g. `evalsha`), from `INFO
/// commandstats`.
pub fn calls_of(server: &RedisServer, command: &str) -> u64 {
    command_stat(server, command, "calls")
}

/// How many calls of `command` the server refused (the ACL, ...), from `INFO commandstats`.
pub fn rejected_calls_of(server: &RedisServer, command: &str) -> u64 {
    command_stat(server, command, "rejected_calls")
}

/// One field of `command`'s line in `INFO commandstats` (0 before its first call).
fn command_stat(server: &RedisServer, command: &str, field: &str) -> u64 {
    let info = server
        .command(&["INFO", "commandstats"])
        .as_string()
        .unwrap();
    let prefix = format!("cmdstat_{command}:");
    let field = format!("{field}=");
    info.lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()))
        .and_then(|stats| {
            stats
                .split(',')
                .find_map(|f| f.strip_prefix(field.as_str()))
        })
        .map_or(0, |n| n.trim().parse().unwrap())
}

/// One acquire and release, so that the scripts are loaded and the events subscribed.
pub async fn warm_up(quota: &Quota) {
    quota
        .try_acquire("warm")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// The task ids that hold a lease of `quota`, from the backend.
pub async fn holder_ids(quota: &Quota) -> Vec<String> {
    let holders = quota.status().await.unwrap().holders;
    holders.into_iter().map(|h| h.task_id).collect()
}

/// Releases `holder`, then waits at most `within` for `waiter` to be served; returns its lease
/// and how long after the release it came.
pub async fn release_then_served(
    holder: &Lease,
    waiter: tokio::task::JoinHandle<leasehold::Result<Lease>>,
    within: Duration,
) -> (Lease, Duration) {
    let released = Instant::now();
    holder.release().await.unwrap();
    let lease = tokio::time::timeout(within, waiter)
        .await
        .unwrap_or_else(|_| panic!("the waiter was not served within {within:?} of the release"))
        .unwrap()
        .unwrap();
    (lease, released.elapsed())
}

/// The kind of an [`Error::BackendUnavailable`](leasehold::Error::BackendUnavailable), or `None`
/// for any other error.
pub fn unavailable_kind(err: &leasehold::Error) -> Option<leasehold::Unavailable> {
    match err {
        leasehold::Error::BackendUnavailable { kind, .. } => Some(*kind),
        _ => None,
    }
}
