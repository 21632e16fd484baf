//! One column of the experiment: a semantics, the tasks it admitted, and what it saw.
//!
//! A column admits one task at a time, as one well-behaved client would (a fleet racing its
//! `INCR`s would only make the counters look worse). Its bookkeeping sits behind a plain mutex
//! that is never held across a call to the store: a slow admission must not hold up the end of
//! another task or a sample (on Redis that once queued every later task behind it, without
//! bound). Instead, the order of the steps keeps a sample honest: a task counts as running only
//! after the limiter counted its slot, and stops counting as running before it gives the slot
//! back, so a sample never sees a running task on a slot that the limiter no longer counts
//! (which would look like a crashed slot coming back). The other way round (a slot counted for a
//! task not yet, or no longer, running) only delays the moment a crashed slot is seen back, by
//! one call.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use serde::Serialize;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::schedule::Arrival;
use super::semantics::{Kind, Limiter, Observed};

/// Admissions a column may have waiting for their turn or for the store at once. An arrival
/// beyond it is shed (counted, not submitted) rather than queued: a store that falls behind the
/// schedule would otherwise pile up tasks, and memory, without end. The schedule's rate is
/// capped ([`super::params::MAX_ARRIVALS_PER_SEC`]) so that a healthy store sheds nothing; at
/// that rate this is about half a second of a stalled store.
pub const MAX_PENDING: usize = 256;

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
    /// Arrivals not submitted because [`MAX_PENDING`] admissions were already waiting for the
    /// store: this column did not get those tasks (0 unless the store falls behind).
    pub shed: u64,
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
    /// The fewest tasks running since the current sample began to read the limiter.
    low_water: u32,
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
            say!(
                "leasehold demo: {}: {e} (further errors are only counted)",
                kind.id()
            );
        }
    }

    /// A task ended (normally, by a crash, or by losing its lease).
    fn ended(&mut self) {
        self.running -= 1;
        self.low_water = self.low_water.min(self.running);
    }

    fn recovered(&mut self, crashed_at: Instant, now: Instant) {
        let ms = now.duration_since(crashed_at).as_millis() as u64;
        self.tally.recovered += 1;
        self.tally.max_recovery_ms = Some(self.tally.max_recovery_ms.unwrap_or(0).max(ms));
    }

    /// Settles which crashed slots came back, from what the limiter counts now. `running` is a
    /// number of tasks whose slots `observed` certainly includes: the fewest running while the
    /// limiter was read.
    fn reclaim(&mut self, observed: &Observed, running: u32, now: Instant) {
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
                let phantom = (observed.counted - i64::from(running)).max(0) as usize;
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
    /// Permits for admissions waiting for the store ([`MAX_PENDING`]).
    pending: Semaphore,
    /// One admission at a time; ends and samples never wait for it.
    admitting: tokio::sync::Mutex<()>,
    /// One sample at a time, so that each has the low-water mark to itself.
    sampling: tokio::sync::Mutex<()>,
}

impl World {
    /// A column for `kind` on `limiter`.
    pub fn new(kind: Kind, limit: u32, limiter: Limiter) -> Self {
        World {
            kind,
            limit,
            limiter,
            state: Mutex::new(State::default()),
            pending: Semaphore::new(MAX_PENDING),
            admitting: tokio::sync::Mutex::new(()),
            sampling: tokio::sync::Mutex::new(()),
        }
    }

    /// The limiter, to clear it.
    pub fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    /// The bookkeeping, for a moment: never held across an `.await`.
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs task `id` of `arrival`: asks for a slot, holds it, then gives it back or crashes.
    /// When `stop` fires (the experiment was reset), a task not yet started does nothing and a
    /// task holding a slot returns at once without giving it back; a call to the store under
    /// way is finished, so that once every task has returned nothing of this run is still on
    /// its way to the store.
    pub async fn serve(self: Arc<Self>, arrival: Arrival, id: String, stop: CancellationToken) {
        if stop.is_cancelled() {
            return;
        }
        let Ok(permit) = self.pending.try_acquire() else {
            self.state().tally.shed += 1;
            return;
        };
        let taken = {
            let _turn = self.admitting.lock().await;
            // A reset while this task waited its turn: it never reaches the store.
            if stop.is_cancelled() {
                return;
            }
            self.limiter.take(&id).await
        };
        drop(permit);
        let hold = {
            let mut state = self.state();
            match taken {
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
        {
            let mut state = self.state();
            state.ended();
            if lost {
                state.tally.lost += 1;
                return;
            }
            if arrival.crash {
                state.tally.crashes += 1;
                self.limiter.crash(hold);
                state.crashed.push_back((id, Instant::now()));
                return;
            }
        }
        if let Err(e) = self.limiter.give_back(hold).await {
            self.state().error(self.kind, e);
        }
    }

    /// The totals so far, without a call to the store.
    #[cfg(test)]
    pub fn tally(&self) -> Tally {
        self.state().tally.clone()
    }

    /// Reads the limiter and the running tasks as one consistent sample.
    pub async fn sample(&self) -> Sample {
        let _one_at_a_time = self.sampling.lock().await;
        {
            let mut state = self.state();
            state.low_water = state.running;
        }
        let observed = self.limiter.observe().await;
        let mut state = self.state();
        match observed {
            Ok(observed) => {
                let running = state.low_water;
                state.reclaim(&observed, running, Instant::now());
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
        s.reclaim(&observed, 0, t0 + Duration::from_millis(700));
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
        // 4 running + 3 crashed = 7 counted: nothing came back.
        s.reclaim(
            &Observed {
                counted: 7,
                holders: None,
            },
            4,
            t0,
        );
        assert_eq!(s.crashed.len(), 3);
        // The key expired and was re-created by one INCR: the count no longer covers any crash.
        s.reclaim(
            &Observed {
                counted: 1,
                holders: None,
            },
            4,
            t0 + Duration::from_secs(2),
        );
        assert!(s.crashed.is_empty());
        assert_eq!(s.tally.recovered, 3);
        assert_eq!(s.tally.max_recovery_ms, Some(2000));
    }
}
