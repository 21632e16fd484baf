//! Work a quota handle leaves running in the background that other processes depend on: the
//! release of a dropped lease, an admission attempt whose caller may stop waiting (a late
//! admission is then given back). Counted so that [`Quota::flush`](crate::Quota::flush) can wait
//! for it before a process exits, when the leasehold runtime's tasks would die unsent.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// The count of background work under way, and a signal when it drops to zero.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    count: AtomicUsize,
    idle: Notify,
}

/// One piece of background work, counted until it is dropped.
#[derive(Debug)]
pub(crate) struct PendingWork(Arc<Pending>);

impl Pending {
    /// Counts one piece of work from now: call it before spawning, so that a `flush` that
    /// follows the caller's action sees it.
    pub(crate) fn start(self: &Arc<Self>) -> PendingWork {
        self.count.fetch_add(1, Ordering::AcqRel);
        PendingWork(self.clone())
    }

    /// Work under way now (see `Quota::debug_sizes`).
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Resolves once no work is under way.
    pub(crate) async fn finished(&self) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            // Registered before the count is read, so a drop to zero in between is not missed.
            idle.as_mut().enable();
            if self.count.load(Ordering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }
}

impl Drop for PendingWork {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn finished_waits_for_every_piece_of_work() {
        let pending = Arc::new(Pending::default());
        pending.finished().await; // nothing under way: at once
        let (a, b) = (pending.start(), pending.start());
        let waiting = tokio::spawn({
            let pending = pending.clone();
            async move { pending.finished().await }
        });
        drop(a);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "one piece is still under way");
        drop(b);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("finished once the last piece is done")
            .unwrap();
    }
}
