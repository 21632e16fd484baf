//! The three ways of counting slots that the experiment compares, each on real commands of the
//! chosen store: a counter, a counter whose key expires, and a leasehold quota.

use std::collections::HashSet;
use std::time::Duration;

use leasehold::{Error, Lease, Quota, Result};
use serde::Serialize;

use super::params::Params;
use super::store::{Counters, Store};

/// The counter's key (in Redis with `--redis`).
pub const COUNTER_KEY: &str = "leasehold-demo:{counter}:count";
/// The TTL counter's key.
pub const TTL_COUNTER_KEY: &str = "leasehold-demo:{ttl-counter}:count";
/// The lease column's quota name.
pub const QUOTA_NAME: &str = "demo";

/// Which semantics a column runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// `INCR` to take (undone by `DECR` when over the limit), `DECR` to give back.
    Counter,
    /// The same, plus an expiry on the key, set once per key lifetime.
    TtlCounter,
    /// A leasehold quota: named, expiring, renewed leases.
    Lease,
}

impl Kind {
    /// The three, in the page's column order.
    pub const ALL: [Kind; 3] = [Kind::Counter, Kind::TtlCounter, Kind::Lease];

    /// The name used in the summary, JSON and the page.
    pub fn id(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::TtlCounter => "ttl-counter",
            Kind::Lease => "lease",
        }
    }
}

/// A slot held by an admitted task.
pub enum Hold {
    /// One unit of a counter: anonymous, so nobody can tell whose it is.
    Counted,
    /// A lease of the real library, renewed in the background while it lives.
    Lease(Lease),
}

impl Hold {
    /// Resolves if the holder must stop because the slot is no longer its own (a lease that
    /// could not be renewed); a counted unit is never taken back.
    pub async fn lost(&self) {
        match self {
            Hold::Counted => std::future::pending().await,
            Hold::Lease(lease) => {
                lease.lost().await;
            }
        }
    }
}

/// What the limiter counts as taken right now.
#[derive(Debug, Clone)]
pub struct Observed {
    /// The count (counters: the key's value, which can be negative; lease: live holders).
    pub counted: i64,
    /// The task ids holding a slot, when the semantics knows them (only the lease does).
    pub holders: Option<HashSet<String>>,
}

/// One semantics, bound to its keys or quota.
pub enum Limiter {
    /// The counter and the TTL counter.
    Counter {
        /// Where the key lives.
        counters: Counters,
        /// The key.
        key: &'static str,
        /// The key's TTL (TTL counter only).
        expiry: Option<Duration>,
        /// The limit.
        limit: u32,
    },
    /// The real library.
    Lease(Quota),
}

/// A limit version newer than any earlier experiment's: the wall clock in milliseconds (well
/// below [`leasehold::MAX_LIMIT_VERSION`]), and above the last one of this process even if two
/// experiments start within a millisecond.
fn experiment_version() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let previous = LAST
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |last| {
            Some(now.max(last + 1))
        })
        .unwrap_or(0);
    now.max(previous + 1)
}

impl Limiter {
    /// The limiter of `kind` for an experiment with `params`.
    pub fn new(kind: Kind, store: &Store, counters: &Counters, params: &Params) -> Result<Self> {
        let counter = |key, expiry| Limiter::Counter {
            counters: counters.clone(),
            key,
            expiry,
            limit: params.limit,
        };
        Ok(match kind {
            Kind::Counter => counter(COUNTER_KEY, None),
            Kind::TtlCounter => counter(TTL_COUNTER_KEY, Some(params.scaled_ttl())),
            Kind::Lease => Limiter::Lease(
                store
                    .quota(QUOTA_NAME)
                    .limit(u64::from(params.limit))
                    // Redis keeps the quota's limit from earlier experiments and demo runs; each
                    // experiment's own limit must win, so it comes with a newer version.
                    .limit_version(experiment_version())
                    .ttl(params.scaled_ttl())
                    .build()?,
            ),
        })
    }

    /// Forgets every slot held, so an experiment starts from an empty limiter.
    pub async fn clear(&self) -> Result<()> {
        match self {
            Limiter::Counter { counters, key, .. } => counters.del(key).await,
            Limiter::Lease(quota) => {
                for holder in quota.status().await?.holders {
                    quota.force_release(&holder.task_id).await?;
                }
                Ok(())
            }
        }
    }

    /// One admission attempt for task `id`: a hold, or `None` when refused.
    pub async fn take(&self, id: &str) -> Result<Option<Hold>> {
        match self {
            Limiter::Counter {
                counters,
                key,
                expiry,
                limit,
            } => {
                let count = counters.incr(key).await?;
                if let Some(ttl) = expiry {
                    // Set once per key lifetime: refreshing it on every INCR would, under steady
                    // traffic, never let the key expire at all.
                    counters.expire_nx(key, *ttl).await?;
                }
                if count <= i64::from(*limit) {
                    return Ok(Some(Hold::Counted));
                }
                counters.decr(key).await?;
                Ok(None)
            }
            Limiter::Lease(quota) => match quota.try_acquire(id).await {
                Ok(lease) => Ok(Some(Hold::Lease(lease))),
                Err(Error::Full { .. }) => Ok(None),
                Err(e) => Err(e),
            },
        }
    }

    /// The task's normal end: the slot goes back.
    pub async fn give_back(&self, hold: Hold) -> Result<()> {
        match (self, hold) {
            (Limiter::Counter { counters, key, .. }, _) => counters.decr(key).await.map(|_| ()),
            (Limiter::Lease(_), Hold::Lease(lease)) => lease.release().await,
            (Limiter::Lease(_), Hold::Counted) => Ok(()),
        }
    }

    /// The task's crash: it stops without giving anything back. A counter unit simply stays
    /// counted; a lease stops being renewed (the library's `abandon`), so it expires one ttl
    /// after its last renewal.
    pub fn crash(&self, hold: Hold) {
        if let Hold::Lease(lease) = hold {
            lease.abandon();
        }
    }

    /// What the limiter counts as taken now.
    pub async fn observe(&self) -> Result<Observed> {
        match self {
            Limiter::Counter { counters, key, .. } => Ok(Observed {
                counted: counters.get(key).await?,
                holders: None,
            }),
            Limiter::Lease(quota) => {
                let holders: HashSet<String> = quota
                    .status()
                    .await?
                    .holders
                    .into_iter()
                    .map(|h| h.task_id)
                    .collect();
                Ok(Observed {
                    counted: holders.len() as i64,
                    holders: Some(holders),
                })
            }
        }
    }
}
