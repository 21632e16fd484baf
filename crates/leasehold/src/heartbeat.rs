//! Renewal: one task per quota on the leasehold runtime renews every live lease of the quota in
//! this process with one backend call per heartbeat interval, and fires `lost` at each lease's
//! local deadline when renewals cannot get through.

use std::sync::{Arc, Weak};
use std::time::Instant;

use tokio::time::sleep_until;
use tokio_util::sync::CancellationToken;

use crate::backend::RenewOutcome;
use crate::error::{Error, LostReason};
use crate::lease::LeaseInner;
use crate::quota::Shared;
use crate::runtime;

pub(crate) fn start(shared: &Arc<Shared>) {
    let stop = shared.shutdown.clone();
    runtime::spawn(run(Arc::downgrade(shared), stop));
}

async fn run(shared: Weak<Shared>, stop: CancellationToken) {
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
                if !live.is_empty() {
                    // Beats may overlap when round trips outlast the interval: renewals are
                    // idempotent and deadlines only move forward, and each is bounded by its
                    // leases' local deadline, so at most about ttl / heartbeat are in flight.
                    let shared = shared.clone();
                    runtime::spawn(async move { renew(&shared, live).await });
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
            _ = stop.cancelled() => return,
        }
    }
}

async fn renew(shared: &Shared, leases: Vec<Arc<LeaseInner>>) {
    let pairs: Vec<(String, u64)> = leases
        .iter()
        .map(|l| (l.task_id.clone(), l.token))
        .collect();
    let sent = Instant::now();
    // A reply is of use until the local deadline it would grant (sent + ttl − margin) has
    // passed. Up to then a slow reply still counts: a link whose round trips outlast the
    // heartbeat must keep its leases.
    let call = shared
        .backend
        .renew(&shared.keys, shared.config.ttl, &pairs);
    let bound = shared.config.local_deadline(sent) - sent;
    let reply = match tokio::time::timeout(bound, call).await {
        Ok(reply) => reply,
        Err(_) => Err(Error::BackendUnavailable(format!(
            "no renewal reply within {bound:?}"
        ))),
    };
    shared.record_backend_result(&reply, sent);
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
