//! The experiment's settings, as the command line and the page's controls give them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::schedule::OFFERED_LOAD;

/// Largest limit the page can draw as a grid of squares and still be read.
pub const MAX_LIMIT: u32 = 50;
/// Fastest speed-up: beyond it the scaled ttl of the default settings nears the library's
/// minimum and timer jitter starts to dominate what the page shows.
pub const MAX_SPEED: f64 = 10.0;
/// Slowest slow motion: enough to watch one task at a time, and far from the durations that no
/// timer (or `Duration`) can hold.
pub const MIN_SPEED: f64 = 0.1;
/// Shortest scaled mean task: below it the schedule's timers are as long as their own jitter.
pub const MIN_TASK: Duration = Duration::from_millis(10);
/// Longest scaled mean task.
pub const MAX_TASK: Duration = Duration::from_secs(600);
/// Largest seed: 2^53 - 1, the largest integer the page's JavaScript reads exactly, so that a
/// seed shown or sent back by the page is the seed that ran.
pub const MAX_SEED: u64 = (1 << 53) - 1;
/// Most tasks submitted per second (to each column). Every arrival costs a column one to three
/// store calls; on Redis, with the renewals and the samples on top, a few thousand calls a
/// second keep the columns in step on a small machine, while a faster schedule would only
/// measure how far they fall behind (see [`super::world::MAX_PENDING`]).
pub const MAX_ARRIVALS_PER_SEC: f64 = 500.0;

/// One experiment's settings. Durations are the unscaled ones the user chose; the `scaled_*`
/// methods give what actually runs, since `speed` divides every duration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Params {
    /// Slots shared by all tasks.
    pub limit: u32,
    /// Chance that a task crashes at its end instead of giving its slot back.
    pub crash_probability: f64,
    /// Lease ttl, also the counter key's TTL in the TTL counter.
    pub ttl_ms: u64,
    /// Mean time a task holds its slot.
    pub task_ms: u64,
    /// Time-lapse factor: every duration (arrivals, holds, ttl) is divided by it.
    pub speed: f64,
    /// Seed of the task schedule: the same seed gives the same tasks and crashes.
    pub seed: u64,
}

impl Params {
    /// Checks the settings; the error says which one is wrong and why. Never panics, whatever
    /// the numbers: they come from the command line and from the page.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_LIMIT).contains(&self.limit) {
            return Err(format!("limit must be between 1 and {MAX_LIMIT}"));
        }
        if !(0.0..=1.0).contains(&self.crash_probability) {
            return Err("crash probability must be between 0 and 1".into());
        }
        if !(MIN_SPEED..=MAX_SPEED).contains(&self.speed) {
            return Err(format!("speed must be between {MIN_SPEED} and {MAX_SPEED}"));
        }
        if self.seed > MAX_SEED {
            return Err(format!(
                "seed must be at most {MAX_SEED} (2^53 - 1, the largest the page reads exactly)"
            ));
        }
        let (min_ttl, max_ttl) = (leasehold::MIN_TTL, leasehold::MAX_TTL);
        if !self
            .scale(self.ttl())
            .is_some_and(|t| (min_ttl..=max_ttl).contains(&t))
        {
            return Err(format!(
                "ttl / speed must be between {min_ttl:?} and {max_ttl:?} (the library's limits)"
            ));
        }
        if !self
            .scale(self.task())
            .is_some_and(|t| (MIN_TASK..=MAX_TASK).contains(&t))
        {
            return Err(format!(
                "task duration / speed must be between {MIN_TASK:?} and {}",
                humantime::format_duration(MAX_TASK)
            ));
        }
        let rate = self.arrivals_per_sec();
        if rate > MAX_ARRIVALS_PER_SEC {
            return Err(format!(
                "these settings submit {rate:.0} tasks/s ({OFFERED_LOAD} × limit × speed / task \
                 duration), more than the {MAX_ARRIVALS_PER_SEC} a column keeps up with: lower \
                 the limit or the speed, or lengthen the task duration"
            ));
        }
        Ok(())
    }

    /// `d` divided by the speed; `None` if no `Duration` holds the result.
    fn scale(&self, d: Duration) -> Option<Duration> {
        Duration::try_from_secs_f64(d.as_secs_f64() / self.speed).ok()
    }

    /// The ttl as chosen.
    pub fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms)
    }

    /// The mean task duration as chosen.
    pub fn task(&self) -> Duration {
        Duration::from_millis(self.task_ms)
    }

    /// The ttl the quota and the counter key really get (saturated, not a panic, on settings
    /// that [`Params::validate`] refuses).
    pub fn scaled_ttl(&self) -> Duration {
        self.scale(self.ttl()).unwrap_or(Duration::MAX)
    }

    /// The mean hold the schedule really uses.
    pub fn scaled_task(&self) -> Duration {
        self.scale(self.task()).unwrap_or(Duration::MAX)
    }

    /// The lease renewal interval: the library's default, ttl / 3.
    pub fn scaled_heartbeat(&self) -> Duration {
        self.scaled_ttl() / 3
    }

    /// Tasks submitted per second, in real time: the schedule keeps [`OFFERED_LOAD`] of the
    /// limit busy with tasks of the scaled mean duration.
    pub fn arrivals_per_sec(&self) -> f64 {
        OFFERED_LOAD * f64::from(self.limit) / self.scaled_task().as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Params {
        Params {
            limit: 10,
            crash_probability: 0.1,
            ttl_ms: 2000,
            task_ms: 1000,
            speed: 2.0,
            seed: 1,
        }
    }

    #[test]
    fn speed_divides_every_duration() {
        let p = params();
        assert_eq!(p.validate(), Ok(()));
        assert_eq!(p.scaled_ttl(), Duration::from_secs(1));
        assert_eq!(p.scaled_task(), Duration::from_millis(500));
        assert_eq!(
            p.scaled_heartbeat(),
            Duration::from_secs(1) / 3,
            "the library default"
        );
    }

    #[test]
    fn out_of_range_settings_are_refused() {
        let bad = [
            Params {
                limit: 0,
                ..params()
            },
            Params {
                limit: MAX_LIMIT + 1,
                ..params()
            },
            Params {
                crash_probability: 1.5,
                ..params()
            },
            Params {
                speed: 0.0,
                ..params()
            },
            Params {
                speed: f64::NAN,
                ..params()
            },
            Params {
                ttl_ms: 60,
                ..params()
            },
            Params {
                task_ms: 5,
                ..params()
            },
            Params {
                speed: MIN_SPEED / 2.0,
                ..params()
            },
            Params {
                seed: MAX_SEED + 1,
                ..params()
            },
            Params {
                limit: MAX_LIMIT,
                task_ms: 100,
                speed: MAX_SPEED,
                ..params()
            },
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?} should be refused");
        }
    }
}
