//! Where the experiment keeps its state: in this process, or in a real Redis so that the keys
//! can be watched with `redis-cli`.

use std::sync::Arc;

use leasehold::{MemoryBackend, Quota, QuotaBuilder, RedisBackend, Result};

use super::memory_counters::MemoryCounters;

/// The demo's backend, chosen once per `leasehold demo` process.
#[derive(Debug, Clone)]
pub enum Store {
    /// Everything in this process: a fresh lease backend and counters for every experiment.
    Memory,
    /// Everything in one Redis: the counter keys and a real leasehold quota.
    Redis(RedisBackend),
}

impl Store {
    /// "memory" or "redis", for the page and the summary.
    pub fn label(&self) -> &'static str {
        match self {
            Store::Memory => "memory",
            Store::Redis(_) => "redis",
        }
    }

    /// Counters for one experiment: fresh ones in memory, the shared server with Redis.
    pub fn counters(&self) -> Counters {
        match self {
            Store::Memory => Counters::Memory(Arc::new(MemoryCounters::default())),
            Store::Redis(redis) => Counters::Redis(redis.clone()),
        }
    }

    /// A quota builder on this store: the library's own memory backend (fresh, so a reset
    /// starts empty) or the Redis backend.
    pub fn quota(&self, name: &str) -> QuotaBuilder {
        let builder = Quota::builder(name);
        match self {
            Store::Memory => builder.backend(MemoryBackend::new()),
            Store::Redis(redis) => builder.backend(redis.clone()),
        }
    }
}

/// The integer keys of the two counter semantics.
#[derive(Debug, Clone)]
pub enum Counters {
    /// In-process keys.
    Memory(Arc<MemoryCounters>),
    /// Real `INCR`/`DECR`/`PEXPIRE` on the Redis server, through leasehold's own connection.
    Redis(RedisBackend),
}

impl Counters {
    async fn redis_int(redis: &RedisBackend, cmd: &str, key: &str) -> Result<i64> {
        redis.call::<i64>(redis::cmd(cmd).arg(key).clone()).await
    }

    /// `INCR key`.
    pub async fn incr(&self, key: &str) -> Result<i64> {
        match self {
            Counters::Memory(m) => Ok(m.incr(key)),
            Counters::Redis(r) => Self::redis_int(r, "INCR", key).await,
        }
    }

    /// `DECR key`.
    pub async fn decr(&self, key: &str) -> Result<i64> {
        match self {
            Counters::Memory(m) => Ok(m.decr(key)),
            Counters::Redis(r) => Self::redis_int(r, "DECR", key).await,
        }
    }

    /// `PEXPIRE key ttl NX`: an expiry for a key that has none (needs Redis 7.0).
    pub async fn expire_nx(&self, key: &str, ttl: std::time::Duration) -> Result<()> {
        match self {
            Counters::Memory(m) => {
                m.expire_nx(key, ttl);
                Ok(())
            }
            Counters::Redis(r) => {
                let mut cmd = redis::cmd("PEXPIRE");
                cmd.arg(key).arg(ttl.as_millis() as u64).arg("NX");
                r.call::<i64>(cmd).await.map(|_| ())
            }
        }
    }

    /// `GET key` as an integer, 0 when the key is missing.
    pub async fn get(&self, key: &str) -> Result<i64> {
        match self {
            Counters::Memory(m) => Ok(m.get(key)),
            Counters::Redis(r) => {
                let value = r.call::<Option<i64>>(redis::cmd("GET").arg(key).clone());
                Ok(value.await?.unwrap_or(0))
            }
        }
    }

    /// `DEL key`.
    pub async fn del(&self, key: &str) -> Result<()> {
        match self {
            Counters::Memory(m) => {
                m.del(key);
                Ok(())
            }
            Counters::Redis(r) => Self::redis_int(r, "DEL", key).await.map(|_| ()),
        }
    }
}
