//! The per-quota listener of release events: it wakes waiters, and tells a holder at once when
//! its lease was released by someone else.
//!
//! Events are only a fast path (Pub/Sub delivers at most once): waiters also have timers and
//! polls, and holders learn the same facts from their next renewal.

use std::sync::Weak;

use tokio::sync::broadcast::{self, error::RecvError};

use crate::backend::QuotaEvent;
use crate::error::LostReason;
use crate::quota::Shared;

pub(crate) async fn listen(shared: Weak<Shared>, mut events: broadcast::Receiver<QuotaEvent>) {
    loop {
        let event = events.recv().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match event {
            Ok(QuotaEvent::Released { task_id, token }) => {
                if let Some(lease) = shared.lease(&task_id).filter(|l| l.token == token) {
                    shared.tell_lost(lease, LostReason::ReleasedElsewhere);
                }
                shared.slot_freed();
            }
            Ok(QuotaEvent::Cancelled { task_id, reason }) => {
                // A local lease is never renewed: the message (or a marker read when the
                // subscription is made again) is its only way to learn.
                let held = [shared.lease(&task_id), shared.local_lease_of(&task_id)];
                for lease in held.into_iter().flatten() {
                    shared.tell_lost(lease, LostReason::Cancelled(reason.clone()));
                }
                // A waiter for that task must learn it too: its next attempt says so.
                shared.recheck_task(&task_id);
            }
            Ok(QuotaEvent::Resubscribed) | Err(RecvError::Lagged(_)) => {
                shared.recheck_missed_events()
            }
            Err(RecvError::Closed) => {
                shared.stopped_listening();
                return;
            }
        }
    }
}
