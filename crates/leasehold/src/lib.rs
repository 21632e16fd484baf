//! # leasehold
//!
//! One global concurrency quota for a whole fleet of worker processes, kept in Redis as named,
//! expiring, heartbeat-renewed leases.
//!
//! A counter (`INCR` to take, `DECR` to give back) rots in production: a process that dies
//! between the two leaks its slot forever, a lost reply leaves the caller unsure whether it
//! holds one, and a double release drives the count below zero. leasehold gives every hold a
//! name (the task id) and a deadline: a sorted set per quota, one atomic script to admit,
//! renewals that extend only a lease that still exists, and a release that can only ever remove
//! its own lease.
//!
//! ```
//! use std::time::Duration;
//! use leasehold::{Quota, Error};
//!
//! # #[tokio::main] async fn main() -> Result<(), Error> {
//! // The embedded backend; use `.backend(RedisBackend::connect(url).await?)` for a fleet.
//! let quota = Quota::builder("llm-api")
//!     .limit(8)
//!     .ttl(Duration::from_secs(10))
//!     .build()?;
//!
//! let lease = quota.acquire_timeout("request-42", Duration::from_secs(30)).await?;
//! tokio::select! {
//!     _ = tokio::time::sleep(Duration::from_millis(10)) => { /* call the upstream */ }
//!     reason = lease.lost() => return Err(Error::LeaseLost(reason)),
//! }
//! lease.release().await?;
//! # Ok(()) }
//! ```
//!
//! The wire protocol (keys, scripts, channel) is documented in `docs/PROTOCOL.md`.

#![warn(missing_docs)]

mod admissions;
pub mod backend;
mod breaker;
mod config;
#[doc(hidden)]
pub mod debug;
mod error;
mod events;
mod heartbeat;
mod keys;
mod lease;
mod pending;
mod quota;
mod runtime;
mod task_turns;
mod waiters;

pub use backend::memory::MemoryBackend;
pub use backend::redis::{RedisBackend, RedisOptions};
pub use backend::{Backend, LimitUpdate, VersionedLimit};
pub use breaker::{BreakerConfig, BreakerMode};
pub use config::{
    BackendDownPolicy, QuotaBuilder, MAX_CANCEL_MARKER_TTL, MAX_TTL, MIN_HEARTBEAT, MIN_TTL,
};
pub use error::{Error, FullCause, LostReason, Misconfiguration, Result, Unavailable};
pub use keys::{
    validate_cancel_reason, validate_task_id, QuotaKeys, MAX_CANCEL_REASON_BYTES, MAX_LIMIT,
    MAX_LIMIT_VERSION, MAX_QUOTA_NAME_BYTES, MAX_TASK_ID_BYTES, PROTOCOL_VERSION,
};
pub use lease::Lease;
pub use quota::{Holder, Quota, Status};

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
