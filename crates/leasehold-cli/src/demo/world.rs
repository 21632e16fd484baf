//! One column of the experiment: a semantics, the tasks it admitted, and what it saw.
//!
//! Admissions, ends and samples of one column are serialised by one lock, so that the number
//! of running tasks and the limiter's count are always read as a consistent pair: a sample
//! never catches a task between its `INCR` and its start, which would show a leak or an
//! over-admission that never happened.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::schedule::Arrival;
use super::semantics::{Kind, Limiter, Observed};

/// Running totals of one column.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Tally {
    /// Tasks admitted.
    pub admitted: u64,
    /// Tasks refused.
    pub refused: u64,
    /// Admissions that made the number of running tasks exceed the limit.
    pub over_admitted: u64,
    /// Most tasks running at once.
    pub peak_running: u32,
    /// Admitted tasks that crashed.
    pub crashes: u64,
    /// Crashed tasks whose slot the limiter stopped counting.
    pub recovered: u64,
    /// Longest time from a crash to the first sample that no longer counted its slot.
    pub max_recovery_ms: Option<u64>,
    /// Lowest available capacity seen by a sample (the limit minus the count).
    pub min_available: Option<i64>,
    /// Tasks stopped early because their lease was lost (never expected here).
    pub lost: u64,
    /// Backend calls that failed.
    pub errors: u64,
}

/// One column at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// Which semantics.
    pub kind: Kind,
    /// Admitted tasks running now: the real concurrency.
    pub running: u32,
    /// Crashed tasks whose slot is still counted as taken.
    pub crashed: u32,
    /// The limiter's count (a counter key's value, or the number of live leases).
    pub counted: i64,
    /// What the limiter would still admit: the limit minus the count.
    pub available: i64,
    /// Totals so far.
    #[serde(flatten)]
    pub tally: Tally,
}

#[derive(Debug, Default)]
struct State {
    running: u32,
    last_counted: i64,
    tally: Tally,
    /// Crashed tasks still counted, oldest first, with the instant of the crash.
    crashed: VecDeque<(String, Instant)>,
    error_shown: bool,
}

impl State {
    fn error(&mut self, kind: Kind, e: leasehold::Error) {
        self.tally.errors += 1;
        if !std::mem::replace(&mut self.error_shown, true) {
            eprintln!(
                "leasehold demo: {}: {e} (further errors are only counted)",
                kind.id()
            );
        }
    }

    fn recovered(&mut self, crashed_at: Instant, now: Instant) {
        let ms = now.duration_since(crashed_at).as_millis() as u64;
        self.tally.recovered += 1;
        self.tally.max_recovery_ms = Some(self.tally.max_recovery_ms.unwrap_or(0).max(ms));
    }

    /// Settles which crashed slots came back, from what the limiter counts now.
    fn reclaim(&mut self, observed: &Observed, now: Instant) {
        let still: Vec<bool> = match &observed.holders {
            // The lease knows its holders by name: a crashed task is back when its id is gone.
            Some(ids) => self
                .crashed
                .iter()
                .map(|(id, _)| ids.contains(id))
                .collect(),
            // A counter is anonymous: whatever it counts beyond the running tasks is what the
            // crashed ones still hold, and when that shrinks the oldest crashes count as back.
            None => {
                let phantom = (observed.counted - i64::from(self.running)).max(0) as usize;
                let gone = self.crashed.len().saturating_sub(phantom);
                (0..self.crashed.len()).map(|i| i >= gone).collect()
            }
        };
        let mut keep = still.into_iter();
        let mut back = Vec::new();
        self.crashed.retain(|(_, at)| {
            let kept = keep.next().unwrap_or(true);
            if !kept {
                back.push(*at);
            }
            kept
        });
        for at in back {
            self.recovered(at, now);
        }
    }
}

/// One semantics and the tasks it runs.
pub struct World {
    kind: Kind,
    limit: u32,
    limiter: Limiter,
    state: Mutex<State>,
}

impl World {
    /// A column for `kind` on `limiter`.
    pub fn new(kind: Kind, limit: u32, limiter: Limiter) -> Self {
        World {
            kind,
            limit,
            limiter,
            state: Mutex::new(State::default()),
        }
    }

    /// The limiter, to clear it.
    pub fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    /// Runs task `id` of `arrival`: asks for a slot, holds it, then gives it back or crashes.
    /// Returns early, giving nothing back, when `stop` fires (the experiment was reset).
    pub async fn serve(self: Arc<Self>, arrival: Arrival, id: String, stop: CancellationToken) {
        let hold = {
            let mut state = self.state.lock().await;
            match self.limiter.take(&id).await {
                Ok(Some(hold)) => {
                    state.running += 1;
                    state.tally.admitted += 1;
                    if state.running > self.limit {
                        state.tally.over_admitted += 1;
                    }
                    state.tally.peak_running = state.tally.peak_running.max(state.running);
                    hold
                }
                Ok(None) => {
                    state.tally.refused += 1;
                    return;
                }
                Err(e) => {
                    state.error(self.kind, e);
                    return;
                }
            }
        };
        let lost = tokio::select! {
            _ = tokio::time::sleep(arrival.hold) => false,
            _ = hold.lost() => true,
            _ = stop.cancelled() => return,
        };
        let mut state = self.state.lock().await;
        state.running -= 1;
        if lost {
            state.tally.lost += 1;
        } else if arrival.crash {
            state.tally.crashes += 1;
            self.limiter.crash(hold);
            state.crashed.push_back((id, Instant::now()));
        } else if let Err(e) = self.limiter.give_back(hold).await {
            state.error(self.kind, e);
        }
    }

    /// Reads the limiter and the running tasks as one consistent sample.
    pub async fn sample(&self) -> Sample {
        let mut state = self.state.lock().await;
        match self.limiter.observe().await {
            Ok(observed) => {
                state.reclaim(&observed, Instant::now());
                state.last_counted = observed.counted;
                let available = i64::from(self.limit) - observed.counted;
                let min = state
                    .tally
                    .min_available
                    .map_or(available, |m| m.min(available));
                state.tally.min_available = Some(min);
            }
            Err(e) => state.error(self.kind, e),
        }
        Sample {
            kind: self.kind,
            running: state.running,
            crashed: state.crashed.len() as u32,
            counted: state.last_counted,
            available: i64::from(self.limit) - state.last_counted,
            tally: state.tally.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::time::Duration;

    fn state_with_crashes(ids: &[&str], at: Instant) -> State {
        State {
            crashed: ids.iter().map(|id| (id.to_string(), at)).collect(),
            ..State::default()
        }
    }

    #[test]
    fn a_lease_is_back_when_its_id_is_gone() {
        let t0 = Instant::now();
        let mut s = state_with_crashes(&["a", "b", "c"], t0);
        let holders: HashSet<String> = ["b".to_string(), "x".to_string()].into();
        let observed = Observed {
            counted: 2,
            holders: Some(holders),
        };
        s.reclaim(&observed, t0 + Duration::from_millis(700));
        assert_eq!(
            s.crashed
                .iter()
                .map(|(id, _)| id.as_str())
                .collect::<Vec<_>>(),
            ["b"]
        );
        assert_eq!(s.tally.recovered, 2);
        assert_eq!(s.tally.max_recovery_ms, Some(700));
    }

    #[test]
    fn a_counter_gives_back_the_oldest_crashes_when_its_count_shrinks() {
        let t0 = Instant::now();
        let mut s = state_with_crashes(&["a", "b", "c"], t0);
        s.running = 4;
        // 4 running + 3 crashed = 7 counted: nothing came back.
        s.reclaim(
            &Observed {
                counted: 7,
                holders: None,
            },
            t0,
        );
        assert_eq!(s.crashed.len(), 3);
        // The key expired and was re-created by one INCR: the count no longer covers any crash.
        s.reclaim(
            &Observed {
                counted: 1,
                holders: None,
            },
            t0 + Duration::from_secs(2),
        );
        assert!(s.crashed.is_empty());
        assert_eq!(s.tally.recovered, 3);
        assert_eq!(s.tally.max_recovery_ms, Some(2000));
    }
}
