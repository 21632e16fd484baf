//! Renewal: one task per quota on the leasehold runtime renews every live lease of the quota in
//! this process with one backend call per heartbeat interval (plus quick retries, backing off,
//! after a renewal that failed at once), and fires `lost` at each lease's local deadline when
//! renewals cannot get through. A lease whose acquire was sent before the
//! latest beat but adopted after it brings the next beat forward: a lease's first renewal goes
//! out one heartbeat after its acquire was sent (at once if the reply took longer), as if the
//! acquire had been a beat.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio::time::sleep_until;
use tokio_util::sync::CancellationToken;

use crate::backend::{RenewOutcome, RENEW_BATCH};
use crate::error::{Error, LostReason, Misconfiguration, Unavailable};
use crate::lease::{LeaseInner, ReleaseState};
use crate::quota::Shared;
use crate::runtime;

/// Wakes the renewal task early when a new lease is due for renewal before the wake-up it
/// planned (the lease's acquire round trip already used part of its heartbeat).
#[derive(Debug, Default)]
pub(crate) struct Alarm {
    notify: Notify,
    /// The planned wake-up; `None` while the task is working out the next one.
    planned: Mutex<Option<Instant>>,
    /// Beats in a row whose renewals failed at once (the retry's back-off), and the latest such
    /// beat: a beat's several calls (chunks, epochs) count once.
    quick_failures: Mutex<(u32, Option<Instant>)>,
}

impl Alarm {
    fn planned(&self) -> MutexGuard<'_, Option<Instant>> {
        self.planned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A renewal call of the beat at `beat` failed at once: how many beats in a row did so
    /// before it (0 for the first).
    fn quick_failure(&self, beat: Instant) -> u32 {
        let mut row = self
            .quick_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if row.1.is_none_or(|latest| beat > latest) {
            *row = (row.0.saturating_add(1), Some(beat));
        }
        row.0 - 1
    }

    /// A renewal call was answered: the back-off starts again.
    fn answered(&self) {
        *self
            .quick_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = (0, None);
    }

    /// A lease due for renewal at `at` was just registered.
    pub(crate) fn renewal_due(&self, at: Instant) {
        if self.planned().is_none_or(|planned| at < planned) {
            self.notify.notify_one();
        }
    }
}

/// How soon a renewal that failed at once is first tried again; each further quick failure in
/// a row doubles it, up to a quarter heartbeat (so a lease outlives an outage that ends a
/// quarter heartbeat before its local deadline, at no more than about five calls per beat).
/// A failure that took longer waits for the next beat.
const RENEWAL_RETRY: Duration = Duration::from_millis(250);

pub(crate) fn start(shared: &Arc<Shared>) {
    let stop = shared.shutdown.clone();
    let alarm = shared.alarm.clone();
    runtime::spawn(run(Arc::downgrade(shared), stop, alarm));
}

async fn run(shared: Weak<Shared>, stop: CancellationToken, alarm: Arc<Alarm>) {
    let mut next_beat = Instant::now();
    loop {
        // Cleared before the registry is read: a lease registered from now on rings the alarm
        // unless the plan set below already covers it.
        *alarm.planned() = None;
        let wake_at = {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            // Dropped after `leases`: a lease marked lost below whose holder drops it and
            // flushes at once is last dropped here, and its release must count (as in
            // `events::listen`).
            let _work = shared.admissions.pending.start();
            let now = Instant::now();
            let leases = shared.leases();
            for lease in &leases {
                if now >= lease.local_deadline() {
                    lease.mark_past_local_deadline();
                }
            }
            let any_due = leases.iter().any(|l| !l.is_lost() && now >= l.renew_due());
            // A beat brought forward (a new lease due, a retry) keeps the regular cadence and
            // reports its failures to nobody's short-circuit: the regular beats count as they
            // always did (so an outage still opens it), and retries every quarter heartbeat
            // must not open it on a blip by themselves.
            let regular = now >= next_beat;
            if regular || any_due {
                if regular {
                    next_beat = now + shared.config.heartbeat;
                }
                // Each call carries the epoch its leases were confirmed in: normally one for all,
                // two or more only around a loss of the quota's state, when leases admitted
                // before it must say so to re-register.
                let mut by_epoch: HashMap<Arc<str>, Vec<Arc<LeaseInner>>> = HashMap::new();
                for lease in leases.iter().filter(|l| !l.is_lost()) {
                    lease.renewing(next_beat);
                    by_epoch
                        .entry(lease.epoch())
                        .or_default()
                        .push(lease.clone());
                }
                // Beats may overlap when round trips outlast the interval: renewals are
                // idempotent and deadlines only move forward, and each is bounded by its
                // leases' local deadline, so at most about ttl / heartbeat are in flight. Past
                // one backend call's worth of leases, the calls go out side by side, each with
                // its own bound and its own answers.
                for (epoch, live) in by_epoch {
                    for chunk in live.chunks(RENEW_BATCH) {
                        // Weak: a lease dropped while its renewal is out is released at once,
                        // not when the reply comes (or never, when beats overlap on a slow link).
                        let (pairs, chunk) = chunk
                            .iter()
                            .map(|l| {
                                let pair = (l.task_id.clone(), l.token);
                                (pair, (Arc::downgrade(l), l.release.clone()))
                            })
                            .unzip();
                        let (shared, epoch) = (shared.clone(), epoch.clone());
                        // Counted for `Quota::flush`: a lease dropped meanwhile may need its
                        // release sent again once the reply is in (see `renew`).
                        let work = shared.admissions.pending.start();
                        runtime::spawn(async move {
                            let _work = work;
                            renew(&shared, &epoch, chunk, pairs, now, regular).await;
                        });
                    }
                }
            }
            leases
                .iter()
                .filter(|l| !l.is_lost())
                .map(|l| l.local_deadline().min(l.renew_due()))
                .fold(next_beat, Instant::min)
        };
        *alarm.planned() = Some(wake_at);
        tokio::select! {
            _ = sleep_until(wake_at.into()) => {}
            _ = alarm.notify.notified() => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// Renews `leases`, whose task ids and tokens are `pairs`, in one call; applies each answer to
/// the lease if it still lives.
async fn renew(
    shared: &Arc<Shared>,
    epoch: &str,
    leases: Vec<(Weak<LeaseInner>, Arc<ReleaseState>)>,
    pairs: Vec<(String, u64)>,
    beat: Instant,
    regular: bool,
) {
    let sent = Instant::now();
    // The call is bounded by the local deadline it would grant (sent + ttl − margin): a link
    // whose round trips outlast the heartbeat must keep its leases. A reply still only extends
    // a lease whose own local deadline has not passed yet.
    let call = shared
        .backend
        .renew(&shared.keys, shared.config.ttl, epoch, &pairs);
    let bound = shared.config.local_deadline(sent) - sent;
    let reply = match tokio::time::timeout(bound, call).await {
        Ok(reply) => reply,
        Err(_) => Err(Error::unavailable(
            Unavailable::NoReply,
            format!("no renewal reply within {bound:?}"),
        )),
    };
    if regular || reply.is_ok() {
        shared.record_backend_result(&reply, sent);
    }
    let reply = match reply {
        Ok(reply) => reply,
        Err(e) => {
            let refusal = match &e {
                _ if e.is_transient() => None,
                Error::Misconfigured(m) => Some(m.clone()),
                other => Some(Misconfiguration::Protocol(other.to_string())),
            };
            if refusal.is_none() {
                tracing::warn!(quota = %shared.keys.name, leases = leases.len(), error = %e,
                    "renewal failed; leases keep their local deadlines");
            } else {
                // Not an outage: retrying cannot help until an operator fixes it (a foreign key
                // in the quota's namespace, ACL rights...). The holders stop at their local
                // deadlines all the same, told `RenewalRefused` with the refusal.
                tracing::error!(quota = %shared.keys.name, leases = leases.len(), error = %e,
                    "renewal refused; leases will be lost at their local deadlines unless this is fixed");
            }
            // A failure that came at once (a refused connection while Redis restarts, LOADING,
            // READONLY during a failover) is tried again soon, backing off, not a heartbeat
            // later: a lease that waited a whole beat would survive an outage one heartbeat
            // shorter than its ttl allows. One that took longer (a timeout: Redis slow or
            // stalled) waits for the beat, adding no load to a struggling server.
            let quick = refusal.is_none() && sent.elapsed() < RENEWAL_RETRY;
            let retry_at = quick.then(|| {
                let row = shared.alarm.quick_failure(beat).min(16);
                let delay = RENEWAL_RETRY.saturating_mul(1 << row);
                Instant::now() + delay.min(shared.config.heartbeat / 4)
            });
            for lease in leases.iter().filter_map(|(lease, _)| lease.upgrade()) {
                // Only where this was the latest outcome: a later call may have renewed it.
                if let (true, Some(at)) = (lease.renewal_failed(sent, refusal.clone()), retry_at) {
                    lease.renew_by(at);
                }
            }
            if let Some(at) = retry_at {
                shared.alarm.renewal_due(at);
            }
            return;
        }
    };
    shared.alarm.answered();
    let mut released_but_renewed = Vec::new();
    for (((lease, release), pair), outcome) in leases.iter().zip(&pairs).zip(reply.outcomes) {
        if release.wants_release() {
            // Released (or dropped) meanwhile. If this renewal still found the lease (it
            // reached the backend first, or re-registered the lease after a loss of the
            // backend's state, PROTOCOL.md §8, which a cancel marker does not prevent), nobody
            // holds it now: release it again. An abandoned lease is left to expire, as
            // `abandon` promises.
            if matches!(
                outcome,
                RenewOutcome::Renewed { .. } | RenewOutcome::Cancelled { .. }
            ) {
                released_but_renewed.push(pair);
            }
            continue;
        }
        let Some(lease) = lease.upgrade() else {
            continue;
        };
        match outcome {
            RenewOutcome::Renewed { deadline_ms } => {
                lease.renewed(
                    deadline_ms,
                    sent,
                    shared.config.local_deadline(sent),
                    &reply.epoch,
                );
            }
            RenewOutcome::Gone => {
                lease.mark_lost(LostReason::Expired);
            }
            RenewOutcome::Superseded => {
                lease.mark_lost(LostReason::Superseded);
            }
            RenewOutcome::Cancelled { reason } => {
                lease.mark_lost(LostReason::Cancelled(reason));
            }
        }
    }
    for (task_id, token) in released_but_renewed {
        // Token-guarded, and skipped if a new handle took this admission over meanwhile.
        if let Err(e) = shared.release_in_backend(task_id, Some(*token)).await {
            tracing::warn!(quota = %shared.keys.name, %task_id, token, error = %e,
                "release of a lease renewed after its drop failed; it expires after its ttl");
        }
    }
}
