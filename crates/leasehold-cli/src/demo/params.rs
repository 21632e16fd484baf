//! The experiment's settings, as the command line and the page's controls give them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Largest limit the page can draw as a grid of squares and still be read.
pub const MAX_LIMIT: u32 = 50;
/// Fastest speed-up: beyond it the scaled ttl of the default settings nears the library's
/// minimum and timer jitter starts to dominate what the page shows.
pub const MAX_SPEED: f64 = 10.0;

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
    /// Checks the settings; the error says which one is wrong and why.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_LIMIT).contains(&self.limit) {
            return Err(format!("limit must be between 1 and {MAX_LIMIT}"));
        }
        if !(0.0..=1.0).contains(&self.crash_probability) {
            return Err("crash probability must be between 0 and 1".into());
        }
        if !(self.speed > 0.0 && self.speed <= MAX_SPEED) {
            return Err(format!("speed must be above 0 and at most {MAX_SPEED}"));
        }
        if self.scaled_ttl() < leasehold::MIN_TTL || self.ttl() > leasehold::MAX_TTL {
            return Err(format!(
                "ttl / speed must be at least {:?} (the library's minimum) and the ttl at most {:?}",
                leasehold::MIN_TTL,
                leasehold::MAX_TTL
            ));
        }
        if self.scaled_task() < Duration::from_millis(10) || self.task() > Duration::from_secs(600)
        {
            return Err("task duration / speed must be at least 10ms, and at most 10m".into());
        }
        Ok(())
    }

    /// The ttl as chosen.
    pub fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms)
    }

    /// The mean task duration as chosen.
    pub fn task(&self) -> Duration {
        Duration::from_millis(self.task_ms)
    }

    /// The ttl the quota and the counter key really get.
    pub fn scaled_ttl(&self) -> Duration {
        self.ttl().div_f64(self.speed)
    }

    /// The mean hold the schedule really uses.
    pub fn scaled_task(&self) -> Duration {
        self.task().div_f64(self.speed)
    }

    /// The lease renewal interval: the library's default, ttl / 3.
    pub fn scaled_heartbeat(&self) -> Duration {
        self.scaled_ttl() / 3
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
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?} should be refused");
        }
    }
}
