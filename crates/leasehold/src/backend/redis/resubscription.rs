//! Checks redis-rs's own resubscriptions.
//!
//! After it reconnects, redis-rs subscribes the new connection to every channel the old one
//! carried, and ignores a refusal (an ACL that denies the channel now): the quota would go on
//! believing it listens, and hear nothing for the life of the process, even once the channel is
//! allowed again. So every channel a disconnection drops must be confirmed (a `subscribe` push)
//! once the new connection answers; one that is not ends its quota's subscription, and the
//! quota subscribes again itself, where a refusal is seen, logged and retried.

use std::collections::HashSet;
use std::time::{Duration, Instant};

/// Channels dropped by a disconnection whose resubscription is not confirmed yet.
#[derive(Debug, Default)]
pub(super) struct Resubscriptions {
    pending: HashSet<String>,
    /// When the latest disconnection was seen.
    since: Option<Instant>,
    /// When a call sent after that disconnection was first seen answered.
    answered_at: Option<Instant>,
}

impl Resubscriptions {
    /// A connection dropped, and `channels` with it.
    pub(super) fn disconnected(
        &mut self,
        channels: impl IntoIterator<Item = String>,
        now: Instant,
    ) {
        self.pending.extend(channels);
        self.since = Some(now);
        self.answered_at = None;
    }

    /// Whether some channel still awaits its confirmation.
    pub(super) fn awaited(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The server confirmed a subscription to `channel`.
    pub(super) fn confirmed(&mut self, channel: &str) {
        self.pending.remove(channel);
    }

    /// The channels whose resubscription failed: still unconfirmed `grace` after a call sent
    /// after the disconnection was answered (`answered_since`). redis-rs resubscribes before it
    /// hands the new connection to any call, so by then each confirmation has had its time.
    pub(super) fn unconfirmed(
        &mut self,
        answered_since: impl FnOnce(Instant) -> bool,
        grace: Duration,
        now: Instant,
    ) -> Vec<String> {
        let Some(since) = self.since else {
            return Vec::new();
        };
        if self.pending.is_empty() {
            self.since = None;
            return Vec::new();
        }
        match self.answered_at {
            None => {
                if answered_since(since) {
                    self.answered_at = Some(now);
                }
                Vec::new()
            }
            Some(at) if now.duration_since(at) >= grace => {
                self.since = None;
                self.answered_at = None;
                self.pending.drain().collect()
            }
            Some(_) => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(1);

    fn channels(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn confirmed_channels_are_never_reported() {
        let mut r = Resubscriptions::default();
        let t0 = Instant::now();
        r.disconnected(channels(&["a", "b"]), t0);
        r.confirmed("a");
        r.confirmed("b");
        assert!(r.unconfirmed(|_| true, GRACE, t0).is_empty());
        assert!(r.unconfirmed(|_| true, GRACE, t0 + GRACE * 5).is_empty());
        assert!(r.since.is_none(), "nothing left to watch");
    }

    #[test]
    fn an_unconfirmed_channel_is_reported_a_grace_after_the_first_answer_and_once() {
        let mut r = Resubscriptions::default();
        let t0 = Instant::now();
        r.disconnected(channels(&["a", "b"]), t0);
        r.confirmed("a");
        // No answer yet: the server may still be down, however long it takes.
        assert!(r.unconfirmed(|_| false, GRACE, t0 + GRACE * 30).is_empty());
        let answered = t0 + GRACE * 31;
        assert!(r.unconfirmed(|_| true, GRACE, answered).is_empty());
        assert!(r
            .unconfirmed(|_| true, GRACE, answered + GRACE / 2)
            .is_empty());
        assert_eq!(r.unconfirmed(|_| true, GRACE, answered + GRACE), ["b"]);
        assert!(r
            .unconfirmed(|_| true, GRACE, answered + GRACE * 3)
            .is_empty());
    }

    #[test]
    fn a_later_disconnection_waits_for_an_answer_after_it() {
        let mut r = Resubscriptions::default();
        let t0 = Instant::now();
        r.disconnected(channels(&["a"]), t0);
        assert!(r.unconfirmed(|_| true, GRACE, t0).is_empty());
        let t1 = t0 + GRACE / 2;
        r.disconnected(channels(&["b"]), t1);
        // Answered before the second disconnection only.
        assert!(r
            .unconfirmed(|at| at < t1, GRACE, t0 + GRACE * 2)
            .is_empty());
        assert!(r
            .unconfirmed(|at| at < t1, GRACE, t0 + GRACE * 4)
            .is_empty());
        assert!(r.unconfirmed(|_| true, GRACE, t0 + GRACE * 5).is_empty());
        let mut lost = r.unconfirmed(|_| true, GRACE, t0 + GRACE * 6);
        lost.sort();
        assert_eq!(lost, ["a", "b"]);
    }
}
