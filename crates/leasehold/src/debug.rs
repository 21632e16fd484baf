//! Sizes of what leasehold keeps in memory, for the leak tests (`tests/long_run.rs`): how many
//! entries each map, set and queue holds right now. Not part of the API: names and fields may
//! change with any release.

/// What this process keeps for one quota (and its other handles on the same backend), from
/// [`Quota::debug_sizes`](crate::Quota::debug_sizes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QuotaSizes {
    /// Leases in the registry, by task id (live, or dropped and not forgotten yet).
    pub registry: usize,
    /// Leases granted by the backend-down policy, by task id.
    pub local: usize,
    /// Task ids with an admission attempt under way whose caller still waits.
    pub attempts: usize,
    /// Task ids with a turn taken or waited for.
    pub turns: usize,
    /// Releases that got no answer, by task id.
    pub unanswered_releases: usize,
    /// Callers waiting for a slot, through this handle and its clones.
    pub waiters: usize,
    /// Background work under way (releases, attempts, renewals), as `flush` counts it.
    pub pending_work: usize,
    /// Quotas (name and backend) the process keeps admissions for, all backends together: live
    /// ones, and dropped ones not pruned yet (pruned when the next quota is built).
    pub known_quotas: usize,
}

/// What a [`MemoryBackend`](crate::MemoryBackend) stores, from
/// [`MemoryBackend::debug_sizes`](crate::MemoryBackend::debug_sizes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemorySizes {
    /// Quota names with stored state (fence, limit, epoch: kept for good, as Redis keeps them).
    pub quotas: usize,
    /// Event channels, each with a buffer of its own.
    pub event_channels: usize,
    /// Leases stored, expired ones not reaped yet included, all quotas together.
    pub leases: usize,
    /// Cancel markers stored, expired ones not pruned yet included, all quotas together.
    pub cancel_markers: usize,
}

/// What a [`RedisBackend`](crate::RedisBackend) keeps per quota name, from
/// [`RedisBackend::debug_sizes`](crate::RedisBackend::debug_sizes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RedisSizes {
    /// Subscribed channels, with their event senders.
    pub channels: usize,
    /// Quota names with a tracked epoch.
    pub epochs: usize,
    /// Quota names with admission queues.
    pub acquire_queues: usize,
    /// Quota names with a release queue.
    pub release_queues: usize,
}
