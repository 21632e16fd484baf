//! Renewal: one task per quota on the leasehold runtime renews every live lease of the quota in
//! this process with one backend call per heartbeat interval, and fires `lost` at each lease's
//! local deadline when renewals cannot get through.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use tokio::time::sleep_until;

use crate::backend::RenewOutcome;
use crate::error::{Error, LostReason};
use crate::lease::LeaseInner;
use crate::quota::Shared;
use crate::runtime;

pub(crate) fn start(shared: &Arc<Shared>) {
    let changed = shared.registry_changed.clone();
    runtime::spawn(run(Arc::downgrade(shared), changed));
}

async fn run(shared: Weak<Shared>, changed: Arc<tokio::sync::Notify>) {
    let in_flight = Arc::new(AtomicBool::new(false));
    let mut next_beat = Instant::now();
    loop {
        let wake_at = {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let now = Instant::now();
            let leases = shared.leases();
            for lease in &leases {
                if now >= lease.local_deadline() {
                    lease.mark_lost(LostReason::LocalDeadline);
                }
            }
            if now >= next_beat {
                next_beat = now + shared.config.heartbeat;
                let live: Vec<_> = leases.iter().filter(|l| !l.is_lost()).cloned().collect();
                if !live.is_empty() && !in_flight.swap(true, Ordering::AcqRel) {
                    let flag = in_flight.clone();
                    let shared = shared.clone();
                    runtime::spawn(async move {
                        renew(&shared, live).await;
                        flag.store(false, Ordering::Release);
                    });
                }
            }
            leases
                .iter()
                .filter(|l| !l.is_lost())
                .map(|l| l.local_deadline())
                .fold(next_beat, Instant::min)
        };
        tokio::select! {
            _ = sleep_until(wake_at.into()) => {}
            _ = changed.notified() => {}
        }
    }
}

async fn renew(shared: &Shared, leases: Vec<Arc<LeaseInner>>) {
    let pairs: Vec<(String, u64)> = leases
        .iter()
        .map(|l| (l.task_id.clone(), l.token))
        .collect();
    let sent = Instant::now();
    // Bounded below the interval too: a hung call must be over before the next beat, so that
    // beat retries instead of being skipped.
    let call = shared
        .backend
        .renew(&shared.keys, shared.config.ttl, &pairs);
    let bound = shared.config.heartbeat.mul_f64(0.8);
    let reply = match tokio::time::timeout(bound, call).await {
        Ok(reply) => reply,
        Err(_) => Err(Error::BackendUnavailable(format!(
            "no renewal reply within {bound:?}"
        ))),
    };
    shared.record_backend_result(&reply);
    let outcomes = match reply {
        Ok(outcomes) => outcomes,
        Err(e) => {
            tracing::warn!(quota = %shared.keys.name, leases = leases.len(), error = %e,
                "renewal failed; leases keep their local deadlines");
            return;
        }
    };
    for (lease, outcome) in leases.iter().zip(outcomes) {
        match outcome {
            RenewOutcome::Renewed { deadline_ms } => lease.renewed(deadline_ms, sent),
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
}
