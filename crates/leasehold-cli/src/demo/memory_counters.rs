//! A minimal in-process stand-in for the Redis commands the naive counters use: `INCR`, `DECR`,
//! `PEXPIRE ... NX`, `GET` and `DEL`, with the same semantics (a missing key counts as 0, an
//! expired key is gone, `INCR` on a missing key creates it without expiry).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
struct Entry {
    value: i64,
    expires_at: Option<Instant>,
}

/// Integer keys in memory, for the counter columns when no Redis is given.
#[derive(Debug, Default)]
pub struct MemoryCounters {
    keys: Mutex<HashMap<String, Entry>>,
}

impl MemoryCounters {
    /// Runs `f` on the live entry of `key` (expired entries are dropped first, as Redis does on
    /// access).
    fn with_entry<T>(&self, key: &str, f: impl FnOnce(&mut Option<Entry>) -> T) -> T {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        let mut entry = keys
            .get(key)
            .copied()
            .filter(|e| e.expires_at.is_none_or(|at| at > Instant::now()));
        let out = f(&mut entry);
        match entry {
            Some(e) => keys.insert(key.to_owned(), e),
            None => keys.remove(key),
        };
        out
    }

    fn add(&self, key: &str, delta: i64) -> i64 {
        self.with_entry(key, |entry| {
            let e = entry.get_or_insert(Entry {
                value: 0,
                expires_at: None,
            });
            e.value += delta;
            e.value
        })
    }

    /// `INCR key`: the new value.
    pub fn incr(&self, key: &str) -> i64 {
        self.add(key, 1)
    }

    /// `DECR key`: the new value (a missing key becomes -1, as in Redis).
    pub fn decr(&self, key: &str) -> i64 {
        self.add(key, -1)
    }

    /// `PEXPIRE key ttl NX`: sets an expiry only on an existing key that has none.
    pub fn expire_nx(&self, key: &str, ttl: Duration) -> bool {
        self.with_entry(key, |entry| match entry {
            Some(e) if e.expires_at.is_none() => {
                e.expires_at = Some(Instant::now() + ttl);
                true
            }
            _ => false,
        })
    }

    /// `GET key` as an integer, 0 when missing.
    pub fn get(&self, key: &str) -> i64 {
        self.with_entry(key, |entry| entry.map_or(0, |e| e.value))
    }

    /// `DEL key`.
    pub fn del(&self, key: &str) {
        self.with_entry(key, |entry| *entry = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_like_redis_integer_keys() {
        let c = MemoryCounters::default();
        assert_eq!(c.get("k"), 0);
        assert!(
            !c.expire_nx("k", Duration::from_secs(1)),
            "no key, no expiry"
        );
        assert_eq!(c.incr("k"), 1);
        assert_eq!(c.incr("k"), 2);
        assert_eq!(c.decr("k"), 1);
        c.del("k");
        assert_eq!(c.decr("k"), -1, "DECR on a missing key goes below zero");
    }

    #[test]
    fn an_expired_key_restarts_from_zero() {
        let c = MemoryCounters::default();
        c.incr("k");
        c.incr("k");
        assert!(c.expire_nx("k", Duration::from_millis(30)));
        assert!(
            !c.expire_nx("k", Duration::from_secs(60)),
            "NX keeps the first expiry"
        );
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(c.get("k"), 0);
        assert_eq!(c.incr("k"), 1);
        assert!(
            c.expire_nx("k", Duration::from_secs(60)),
            "a new key takes an expiry"
        );
    }
}
