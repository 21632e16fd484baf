//! The quota epochs replies report, kept per quota: how a client tells that Redis lost a
//! quota's state, and what it sends so that the server can tell too (PROTOCOL.md §3, §8).

use super::RedisBackend;

/// The latest epoch of a quota a reply reported, and the highest `seq` (the count of acquire and
/// renew calls that changed a lease in that epoch) any reply reported in it.
#[derive(Debug, Clone, Default)]
pub(super) struct SeenEpoch {
    pub(super) id: String,
    pub(super) seq: u64,
    /// The highest fencing token of the quota an acquire reply gave, in any epoch: a new epoch
    /// keeps it, since tokens issued after a loss must exceed it. (Not the tokens a renewal
    /// sends: `Backend::renew` is public, and a wrong token must not raise the fence.)
    pub(super) highest_token: u64,
}

/// What a reply's epoch told about the one tracked.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Observed {
    /// The tracked epoch; its seq is kept at the highest seen.
    Same,
    /// A later epoch than `after` (empty when none was tracked) is now tracked.
    NewEpoch { after: String },
    /// An earlier epoch: a reply that was overtaken by one from after a loss. Ignored, so the
    /// next call does not report an epoch the server already replaced.
    Earlier,
}

impl SeenEpoch {
    /// Takes in the epoch `id` and `seq` of a reply. Epoch ids only grow (PROTOCOL.md §3), so an
    /// earlier one is a late reply and never tracked.
    pub(super) fn observe(&mut self, id: &str, seq: u64) -> Observed {
        if self.id == id {
            self.seq = self.seq.max(seq);
            return Observed::Same;
        }
        if let (Some(tracked), Some(new)) = (epoch_stamp(&self.id), epoch_stamp(id)) {
            if new < tracked {
                return Observed::Earlier;
            }
        }
        let after = std::mem::replace(&mut self.id, id.to_owned());
        self.seq = seq;
        Observed::NewEpoch { after }
    }
}

/// `<seconds>.<microseconds>` of an epoch id, in order; `None` for an id of another form (those
/// are never compared).
pub(super) fn epoch_stamp(id: &str) -> Option<(u64, u64)> {
    let (seconds, micros) = id.split_once('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(seconds) || !digits(micros) {
        return None;
    }
    Some((seconds.parse().ok()?, micros.parse().ok()?))
}

impl RedisBackend {
    /// The latest epoch of `quota` any reply reported (`''` before any), with its seq.
    pub(super) fn seen_epoch(&self, quota: &str) -> SeenEpoch {
        let epochs = self.inner.epochs.lock().unwrap_or_else(|e| e.into_inner());
        epochs.get(quota).cloned().unwrap_or_default()
    }

    /// What a renewal of leases confirmed in `epoch` sends of `quota`: the highest seq seen in
    /// that epoch (0 if it is not the latest), and the highest token seen.
    pub(super) fn seen_for_renewal(&self, quota: &str, epoch: &str) -> (u64, u64) {
        let epochs = self.inner.epochs.lock().unwrap_or_else(|e| e.into_inner());
        epochs.get(quota).map_or((0, 0), |seen| {
            let seq = if seen.id == epoch { seen.seq } else { 0 };
            (seq, seen.highest_token)
        })
    }

    /// Records the epoch and seq a reply reported, and the highest fencing token it gave (0
    /// for none: renewals give none).
    pub(super) fn saw_reply(&self, quota: &str, epoch: &str, seq: u64, highest_token: u64) {
        let mut epochs = self.inner.epochs.lock().unwrap_or_else(|e| e.into_inner());
        let known = epochs.entry(quota.to_owned()).or_default();
        known.highest_token = known.highest_token.max(highest_token);
        match known.observe(epoch, seq) {
            Observed::NewEpoch { after } if !after.is_empty() => tracing::warn!(
                quota,
                epoch,
                "the quota's state was lost, all or in part (new epoch)"
            ),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{epoch_stamp, Observed, SeenEpoch};

    #[test]
    fn a_late_reply_from_an_earlier_epoch_does_not_move_the_tracked_one_back() {
        let mut seen = SeenEpoch::default();
        assert_eq!(
            seen.observe("1796225334.152102", 7),
            Observed::NewEpoch {
                after: String::new()
            }
        );
        assert_eq!(seen.observe("1796225334.152102", 5), Observed::Same);
        assert_eq!(seen.seq, 7, "the highest seq is kept");
        // A loss: the next reply reports a later epoch, seq counted again from there.
        assert_eq!(
            seen.observe("1796225340.9", 1),
            Observed::NewEpoch {
                after: "1796225334.152102".into()
            }
        );
        // A reply sent before the loss arrives last: ignored.
        assert_eq!(seen.observe("1796225334.152102", 9), Observed::Earlier);
        assert_eq!((seen.id.as_str(), seen.seq), ("1796225340.9", 1));
    }

    #[test]
    fn epoch_ids_compare_by_time_not_as_text() {
        // Microseconds are not zero-padded: 9 µs is earlier than 152102 µs.
        assert!(epoch_stamp("1796225334.9") < epoch_stamp("1796225334.152102"));
        assert!(epoch_stamp("1796225335.0") > epoch_stamp("1796225334.999999"));
        assert_eq!(epoch_stamp("not-an-epoch"), None);
        assert_eq!(epoch_stamp("1.-2"), None);
        // Ids of another form are tracked as they come.
        let mut seen = SeenEpoch::default();
        seen.observe("1796225334.9", 1);
        assert_eq!(
            seen.observe("restored", 1),
            Observed::NewEpoch {
                after: "1796225334.9".into()
            }
        );
    }
}
