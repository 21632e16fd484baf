//! The embedded backend: the same semantics as Redis, inside one process.
//!
//! For single-process use, tests and the demo. Its clock is monotonic (a wall-clock reading
//! taken once, advanced by `Instant`), so it plays the role of the Redis server's `TIME`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use tokio::sync::broadcast;

use super::{
    AcquireReply, Backend, LeaseRecord, LimitUpdate, QuotaEvent, RenewOutcome, RenewReply,
    Snapshot, VersionedLimit,
};
use crate::error::{Misconfiguration, Result};
use crate::keys::{QuotaKeys, MAX_LIMIT, MAX_LIMIT_VERSION, MAX_SCRIPT_INTEGER};

/// How often every quota's expired cancel markers are dropped, in backend ms.
const MARKER_SWEEP_MS: u64 = 1_000;

/// Capacity of each quota's event channel; a slow receiver loses old events (at most once).
const EVENT_CAPACITY: usize = 1024;

/// Leases kept in this process's memory.
#[derive(Debug)]
pub struct MemoryBackend {
    epoch_ms: u64,
    started: Instant,
    quotas: Mutex<HashMap<String, QuotaState>>,
    /// Quota name -> sender of that quota's events, while some handle may listen. Apart from the
    /// quotas' state, which is kept for good (as Redis keeps a quota's fence, limit and epoch):
    /// each channel holds a buffer of [`EVENT_CAPACITY`] events (about 70 kB), which quota
    /// names that come and go (one per tenant) would otherwise keep for the backend's life, that
    /// of the process for the embedded one. Let go when nobody listens (see `subscribe`), as
    /// the Redis backend lets go of its subscriptions. Locked after `quotas` when both are.
    channels: Mutex<HashMap<String, broadcast::Sender<QuotaEvent>>>,
    /// When every quota's expired cancel markers are dropped next (backend ms): a quota that
    /// goes idle is never acquired or cancelled again, and kept them for good (found by review).
    next_marker_sweep_ms: AtomicU64,
    /// The quotas that may hold cancel markers: the sweep visits these only, not every quota
    /// state ever made (found by review: 30 ms stalls at 100 000 quotas). Locked after `quotas`.
    marked: Mutex<HashSet<String>>,
}

/// Epochs, as the Redis protocol keeps them: the store's (lost with the data) and the one its
/// client last saw (kept by the client; renewals bring their leases' own), so that a
/// [`MemoryBackend::wipe`] is detected the same way.
#[derive(Debug, Default)]
struct Epochs {
    next: u64,
    store: Option<u64>,
    seen: String,
    /// The highest fencing token acquire replies gave the client, in any epoch (client side:
    /// kept by a wipe); a stale call raises the store's fence to it.
    highest_token: u64,
    loss_detected: bool,
    quarantine_until_ms: u64,
}

impl Epochs {
    /// The store's epoch as the protocol sends it: an opaque id, empty while there is none.
    fn id(&self) -> String {
        self.store.map(|e| e.to_string()).unwrap_or_default()
    }

    /// The store's side of a call that carries the client's epoch `sent`: creates an epoch if
    /// the store lost it, and starts the quarantine once per epoch if `sent` is stale. Returns
    /// whether it was stale.
    fn check(&mut self, sent: &str, now: u64, ttl_ms: u64) -> bool {
        let stale = !sent.is_empty() && sent != self.id();
        if self.store.is_none() {
            self.next += 1;
            self.store = Some(self.next);
            self.loss_detected = false;
        }
        if stale && !self.loss_detected {
            self.loss_detected = true;
            self.quarantine_until_ms = now + ttl_ms;
        }
        stale
    }
}

#[derive(Debug, Default)]
struct QuotaState {
    fence: u64,
    leases: HashMap<String, Stored>,
    /// Cancel markers: task id -> (reason, expiry in backend ms).
    cancelled: HashMap<String, (String, u64)>,
    epochs: Epochs,
    /// The stored limit, as the Redis protocol keeps it in its `limit` key.
    limit: Option<VersionedLimit>,
}

impl QuotaState {
    /// The epoch bookkeeping of an acquire or renew call that carries the client's epoch
    /// `sent`, as the scripts do it: the store's side (`Epochs::check`), a stale call's raise of
    /// the fence to the highest token the client has seen, and the client's side (the epoch it
    /// sees in the reply). Returns whether the call was stale.
    fn epoch_call(&mut self, sent: &str, now: u64, ttl_ms: u64) -> bool {
        let stale = self.epochs.check(sent, now, ttl_ms);
        if stale {
            self.fence = self.fence.max(self.epochs.highest_token);
        }
        self.epochs.seen = self.epochs.id();
        stale
    }

    /// Settles the stored limit with a caller's, by the protocol's rule (acquire and set_limit
    /// alike): the first one, or a higher version, is stored; a lower version, or the same one
    /// again, keeps the stored one; the same version with another limit is a mismatch.
    fn settle_limit(&mut self, sent: VersionedLimit) -> LimitUpdate {
        match self.limit {
            Some(stored) if stored.version > sent.version || stored == sent => {
                LimitUpdate::Kept(stored)
            }
            Some(stored) if stored.version == sent.version => LimitUpdate::Mismatch(stored),
            _ => {
                self.limit = Some(sent);
                LimitUpdate::Stored(sent)
            }
        }
    }

    /// Drops the markers that expired: once per acquire or cancel, not once per lease of a
    /// renewal, so that an idle quota's markers do not pile up either.
    fn prune_markers(&mut self, now: u64) {
        // Redis keeps a key with a TTL up to its expiry millisecond included.
        self.cancelled.retain(|_, (_, until)| *until >= now);
    }

    fn cancel_reason(&mut self, task_id: &str, now: u64) -> Option<String> {
        // Redis keeps a key with a TTL up to its expiry millisecond included. One lookup: a
        // renewal asks once per lease (a scan of every marker each time cost 0.7 s for 5000
        // leases and 10 000 markers, found by review); acquires and `cancel` prune the rest.
        match self.cancelled.get(task_id) {
            Some((reason, expires)) if *expires >= now => Some(reason.clone()),
            Some(_) => {
                self.cancelled.remove(task_id);
                None
            }
            None => None,
        }
    }
}

/// A ttl the scripts take (1 ms to 2^53 − 1 ms), in ms: what the Redis backend refuses, this one
/// refuses too (callers of the trait, not `Quota`, which checks first), rather than answering
/// with a deadline of now or overflowing.
fn checked_ttl(ttl: Duration) -> Result<u64> {
    match u64::try_from(ttl.as_millis()) {
        Ok(ms) if (1..=MAX_SCRIPT_INTEGER).contains(&ms) => Ok(ms),
        _ => Err(Misconfiguration::Protocol(format!("LEASEHOLD invalid ttl: {ttl:?}")).into()),
    }
}

/// A limit the scripts take (1 to [`MAX_LIMIT`]), and its version if given (at most
/// [`MAX_LIMIT_VERSION`]).
fn checked_limit(limit: u32, version: Option<u64>) -> Result<()> {
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(Misconfiguration::Protocol(format!("LEASEHOLD invalid limit: {limit}")).into());
    }
    match version.filter(|v| *v > MAX_LIMIT_VERSION) {
        Some(version) => Err(Misconfiguration::InvalidLimitVersion(version).into()),
        None => Ok(()),
    }
}

#[derive(Debug, Clone, Copy)]
struct Stored {
    token: u64,
    acquired_at_ms: u64,
    deadline_ms: u64,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBackend {
    /// An empty backend.
    pub fn new() -> Self {
        let epoch_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        MemoryBackend {
            epoch_ms,
            started: Instant::now(),
            quotas: Mutex::new(HashMap::new()),
            channels: Mutex::new(HashMap::new()),
            next_marker_sweep_ms: AtomicU64::new(0),
            marked: Mutex::new(HashSet::new()),
        }
    }

    /// Forgets every lease and fencing counter, as a Redis restart without persistence does. For
    /// fault-injection tests and demonstrations.
    pub fn wipe(&self) {
        let mut quotas = self.quotas.lock().unwrap_or_else(|e| e.into_inner());
        for state in quotas.values_mut() {
            state.leases.clear();
            state.cancelled.clear();
            state.fence = 0;
            state.epochs.store = None;
            state.epochs.quarantine_until_ms = 0;
            state.limit = None;
        }
    }

    /// How many entries this backend stores right now, for leak tests. Not part of the API.
    #[doc(hidden)]
    pub fn debug_sizes(&self) -> crate::debug::MemorySizes {
        let quotas = self.quotas.lock().unwrap_or_else(|e| e.into_inner());
        crate::debug::MemorySizes {
            quotas: quotas.len(),
            event_channels: self.channels().len(),
            leases: quotas.values().map(|q| q.leases.len()).sum(),
            cancel_markers: quotas.values().map(|q| q.cancelled.len()).sum(),
        }
    }

    fn channels(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, broadcast::Sender<QuotaEvent>>> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Announces `event` to the quota's listeners, if any.
    fn announce(&self, name: &str, event: QuotaEvent) {
        if let Some(sender) = self.channels().get(name) {
            let _ = sender.send(event);
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch_ms + self.started.elapsed().as_millis() as u64
    }

    fn with_quota<T>(&self, name: &str, f: impl FnOnce(&mut QuotaState, u64) -> T) -> T {
        let (mut quotas, now) = self.quotas_now();
        f(quotas.entry(name.to_owned()).or_default(), now)
    }

    /// Like [`with_quota`](Self::with_quota) for a call that writes nothing (a read, a release
    /// that finds nothing): a quota never written is not made, and `absent` answers instead, as
    /// Redis answers from keys that do not exist (found by review: 10 000 status reads of
    /// distinct names kept 10 000 quota states).
    fn reading_quota<T>(
        &self,
        name: &str,
        absent: impl FnOnce(u64) -> T,
        f: impl FnOnce(&mut QuotaState, u64) -> T,
    ) -> T {
        let (mut quotas, now) = self.quotas_now();
        match quotas.get_mut(name) {
            Some(state) => f(state, now),
            None => absent(now),
        }
    }

    /// The quotas, locked, and the backend's time; expired cancel markers of every quota are
    /// dropped first, at most once a second, as Redis expires them by their TTL.
    fn quotas_now(&self) -> (std::sync::MutexGuard<'_, HashMap<String, QuotaState>>, u64) {
        let mut quotas = self.quotas.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.now_ms();
        if now >= self.next_marker_sweep_ms.load(Ordering::Relaxed) {
            let mut marked = self.marked.lock().unwrap_or_else(|e| e.into_inner());
            marked.retain(|name| match quotas.get_mut(name) {
                Some(state) => {
                    state.prune_markers(now);
                    !state.cancelled.is_empty()
                }
                None => false,
            });
            self.next_marker_sweep_ms
                .store(now + MARKER_SWEEP_MS, Ordering::Relaxed);
        }
        (quotas, now)
    }
}

fn record(task_id: &str, s: Stored, now_ms: u64, epoch: String) -> LeaseRecord {
    LeaseRecord {
        task_id: task_id.to_owned(),
        token: s.token,
        acquired_at_ms: s.acquired_at_ms,
        deadline_ms: s.deadline_ms,
        now_ms,
        epoch,
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    async fn acquire_with_limit(
        &self,
        keys: &QuotaKeys,
        task_id: &str,
        ttl: Duration,
        limit: VersionedLimit,
    ) -> Result<AcquireReply> {
        let ttl_ms = checked_ttl(ttl)?;
        checked_limit(limit.limit, Some(limit.version))?;
        self.with_quota(&keys.name, |q, now| {
            let seen = std::mem::take(&mut q.epochs.seen);
            q.epoch_call(&seen, now, ttl_ms);
            // Settled first, as the script does once per call: whatever the answer, a higher
            // version is stored, and cancelled or held ids are answered whatever the limits say.
            let settled = q.settle_limit(limit);
            // Reaped before any answer, as the script does once per call: an acquire answered
            // "cancelled" reaps too.
            q.leases.retain(|_, s| s.deadline_ms > now);
            q.prune_markers(now);
            if let Some(reason) = q.cancel_reason(task_id, now) {
                return Ok(AcquireReply::Cancelled { reason });
            }
            if let Some(s) = q.leases.get_mut(task_id) {
                s.deadline_ms = s.deadline_ms.max(now + ttl_ms);
                q.epochs.highest_token = q.epochs.highest_token.max(s.token);
                return Ok(AcquireReply::Held(record(task_id, *s, now, q.epochs.id())));
            }
            let limit = match settled {
                LimitUpdate::Stored(limit) | LimitUpdate::Kept(limit) => limit.limit,
                LimitUpdate::Mismatch(stored) => return Ok(AcquireReply::LimitMismatch { stored }),
            };
            if q.epochs.quarantine_until_ms > now {
                return Ok(AcquireReply::Quarantined {
                    remaining_ms: q.epochs.quarantine_until_ms - now,
                });
            }
            if q.leases.len() < limit as usize {
                if q.fence >= MAX_SCRIPT_INTEGER {
                    // As the script refuses it: tokens past 2^53 - 1 could not be told apart
                    // (found by review: the token was issued, and its renewal refused).
                    return Err(Misconfiguration::Protocol(
                        "LEASEHOLD fencing tokens exhausted".into(),
                    )
                    .into());
                }
                q.fence += 1;
                let s = Stored {
                    token: q.fence,
                    acquired_at_ms: now,
                    deadline_ms: now + ttl_ms,
                };
                q.leases.insert(task_id.to_owned(), s);
                q.epochs.highest_token = q.epochs.highest_token.max(s.token);
                return Ok(AcquireReply::Acquired(record(
                    task_id,
                    s,
                    now,
                    q.epochs.id(),
                )));
            }
            let earliest = q.leases.values().map(|s| s.deadline_ms).min();
            Ok(AcquireReply::Full {
                now_ms: now,
                earliest_deadline_ms: earliest.unwrap_or(now),
            })
        })
    }

    async fn renew(
        &self,
        keys: &QuotaKeys,
        ttl: Duration,
        epoch: &str,
        leases: &[(String, u64)],
    ) -> Result<RenewReply> {
        // As renew.lua: a token no admission can have given (0, or above 2^53 - 1, where the
        // scripts' numbers stop being exact) fails the whole call before anything changes.
        if let Some((id, token)) = leases
            .iter()
            .find(|(_, t)| *t == 0 || *t > MAX_SCRIPT_INTEGER)
        {
            return Err(Misconfiguration::Protocol(format!(
                "LEASEHOLD invalid token for {id:?}: {token}"
            ))
            .into());
        }
        let ttl_ms = checked_ttl(ttl)?;
        Ok(self.with_quota(&keys.name, |q, now| {
            let stale = q.epoch_call(epoch, now, ttl_ms);
            let reregister = stale && q.epochs.quarantine_until_ms > now;
            let outcomes = leases
                .iter()
                .map(|(id, token)| {
                    let cancelled = q.cancel_reason(id, now);
                    let room = || {
                        let live = q.leases.values().filter(|s| s.deadline_ms > now).count();
                        q.limit.is_none_or(|l| live < l.limit as usize)
                    };
                    if reregister && !q.leases.contains_key(id) && room() {
                        // Forgotten by the loss, not expired: the holder re-registers, up to
                        // the limit (leases admitted before the loss was seen keep theirs).
                        q.fence = q.fence.max(*token);
                        let s = Stored {
                            token: *token,
                            acquired_at_ms: now,
                            deadline_ms: now + ttl_ms,
                        };
                        q.leases.insert(id.clone(), s);
                    }
                    match q.leases.get_mut(id) {
                        Some(s) if s.deadline_ms <= now => {
                            q.leases.remove(id);
                            RenewOutcome::Gone
                        }
                        Some(s) if s.token != *token => RenewOutcome::Superseded,
                        Some(_) if cancelled.is_some() => RenewOutcome::Cancelled {
                            reason: cancelled.unwrap_or_default(),
                        },
                        Some(s) => {
                            s.deadline_ms = s.deadline_ms.max(now + ttl_ms);
                            RenewOutcome::Renewed {
                                deadline_ms: s.deadline_ms,
                            }
                        }
                        None => RenewOutcome::Gone,
                    }
                })
                .collect();
            RenewReply {
                epoch: q.epochs.id(),
                outcomes,
            }
        }))
    }

    async fn set_limit(
        &self,
        keys: &QuotaKeys,
        limit: u32,
        version: Option<u64>,
    ) -> Result<LimitUpdate> {
        checked_limit(limit, version)?;
        Ok(self.with_quota(&keys.name, |q, _now| {
            let version = match (version, q.limit) {
                (Some(version), _) => version,
                // No version above the largest: the stored one stays, as in the script
                // (`Quota::set_limit` reports it as LimitVersionsExhausted).
                (None, Some(stored)) if stored.version >= MAX_LIMIT_VERSION => {
                    return LimitUpdate::Kept(stored);
                }
                (None, stored) => stored.map_or(1, |l| l.version + 1),
            };
            q.settle_limit(VersionedLimit { limit, version })
        }))
    }

    async fn release(&self, keys: &QuotaKeys, task_id: &str, token: Option<u64>) -> Result<bool> {
        Ok(self.reading_quota(
            &keys.name,
            |_| false,
            |q, _now| {
                let Some(s) = q.leases.get(task_id) else {
                    return false;
                };
                if token.is_some_and(|t| t != s.token) {
                    return false;
                }
                let token = s.token;
                q.leases.remove(task_id);
                // Every release is announced: an in-process event costs nothing, where the Redis
                // backend announces only while someone waits (PROTOCOL.md §5.4). Events are hints
                // either way; renewals report the same facts.
                self.announce(
                    &keys.name,
                    QuotaEvent::Released {
                        task_id: task_id.to_owned(),
                        token,
                    },
                );
                true
            },
        ))
    }

    async fn cancel(
        &self,
        keys: &QuotaKeys,
        task_id: &str,
        reason: &str,
        marker_ttl: Duration,
    ) -> Result<bool> {
        Ok(self.with_quota(&keys.name, |q, now| {
            // At least 1 ms, as the Redis backend sends it.
            let marker_ms = marker_ttl.as_millis().clamp(1, u128::from(u64::MAX)) as u64;
            let expires = now.saturating_add(marker_ms);
            q.prune_markers(now);
            q.cancelled
                .insert(task_id.to_owned(), (reason.to_owned(), expires));
            self.marked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(keys.name.clone());
            self.announce(
                &keys.name,
                QuotaEvent::Cancelled {
                    task_id: task_id.to_owned(),
                    reason: reason.to_owned(),
                },
            );
            q.leases.get(task_id).is_some_and(|s| s.deadline_ms > now)
        }))
    }

    async fn cancel_reason(&self, keys: &QuotaKeys, task_id: &str) -> Result<Option<String>> {
        Ok(self.reading_quota(&keys.name, |_| None, |q, now| q.cancel_reason(task_id, now)))
    }

    async fn snapshot(&self, keys: &QuotaKeys) -> Result<Snapshot> {
        let absent = |now_ms| Snapshot {
            now_ms,
            holders: Vec::new(),
            limit: None,
            quarantine_left_ms: 0,
        };
        Ok(self.reading_quota(&keys.name, absent, |q, now| {
            let mut holders: Vec<LeaseRecord> = q
                .leases
                .iter()
                .filter(|(_, s)| s.deadline_ms > now)
                .map(|(id, s)| record(id, *s, now, String::new()))
                .collect();
            holders.sort_by(|a, b| (a.deadline_ms, &a.task_id).cmp(&(b.deadline_ms, &b.task_id)));
            Snapshot {
                now_ms: now,
                holders,
                limit: q.limit,
                quarantine_left_ms: q.epochs.quarantine_until_ms.saturating_sub(now),
            }
        }))
    }

    /// What a client keeps of the quota (the epoch it saw, the highest token it was given) goes,
    /// as the Redis backend's does: a later handle starts afresh, as a new process would (found
    /// by review: after a `wipe`, a new handle's first acquire was answered "quarantined").
    fn forget(&self, keys: &QuotaKeys) {
        let mut quotas = self.quotas.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(state) = quotas.get_mut(&keys.name) {
            state.epochs.seen.clear();
            state.epochs.highest_token = 0;
        }
    }

    async fn subscribe(&self, keys: &QuotaKeys) -> Result<broadcast::Receiver<QuotaEvent>> {
        let mut channels = self.channels();
        if let Some(sender) = channels.get(&keys.name) {
            return Ok(sender.subscribe());
        }
        // Channels nobody listens to any more (every handle of their quota was dropped) go now,
        // with their buffers: a quota that listens again gets a new one.
        channels.retain(|_, sender| sender.receiver_count() > 0);
        let (sender, receiver) = broadcast::channel(EVENT_CAPACITY);
        channels.insert(keys.name.clone(), sender);
        Ok(receiver)
    }
}
