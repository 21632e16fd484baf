//! The workload: when tasks arrive, how long each holds its slot, and which ones crash, drawn
//! once from a seed so that all three semantics get exactly the same tasks.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::params::Params;

/// How busy the workers keep the limit: arrivals are spaced so that, if every task were
/// admitted, 80 % of the slots would be held on average. Below 1 so that a healthy limiter
/// admits nearly everything, and the refusals seen are the ones a broken count causes.
pub const OFFERED_LOAD: f64 = 0.8;

/// One task, as submitted to each of the three semantics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    /// Its number in the schedule, from 0.
    pub index: u64,
    /// When it is submitted, from the start of the experiment (running time only).
    pub at: Duration,
    /// How long it holds its slot once admitted.
    pub hold: Duration,
    /// True if it crashes at the end of its hold instead of giving the slot back.
    pub crash: bool,
}

/// The endless, seeded sequence of arrivals: a Poisson process of tasks with uniformly
/// distributed holds between half and one and a half of the mean.
#[derive(Debug)]
pub struct Schedule {
    rng: StdRng,
    next_index: u64,
    clock: Duration,
    mean_gap: Duration,
    mean_hold: Duration,
    crash_probability: f64,
}

impl Schedule {
    /// The schedule of `params`, in scaled (real) time.
    pub fn new(params: &Params) -> Self {
        let mean_hold = params.scaled_task();
        Schedule {
            rng: StdRng::seed_from_u64(params.seed),
            next_index: 0,
            clock: Duration::ZERO,
            mean_gap: mean_hold.div_f64(OFFERED_LOAD * f64::from(params.limit)),
            mean_hold,
            crash_probability: params.crash_probability,
        }
    }
}

impl Iterator for Schedule {
    type Item = Arrival;

    fn next(&mut self) -> Option<Arrival> {
        // Draw in a fixed order so one seed always yields the same tasks.
        let gap: f64 = self.rng.random();
        let hold: f64 = self.rng.random();
        let crash: f64 = self.rng.random();
        // Exponential gaps: -ln(1 - u) is never infinite for u in [0, 1).
        self.clock += self.mean_gap.mul_f64(-(1.0 - gap).ln());
        let arrival = Arrival {
            index: self.next_index,
            at: self.clock,
            hold: self.mean_hold.mul_f64(0.5 + hold),
            crash: crash < self.crash_probability,
        };
        self.next_index += 1;
        Some(arrival)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(seed: u64) -> Params {
        Params {
            limit: 10,
            crash_probability: 0.1,
            ttl_ms: 2000,
            task_ms: 1000,
            speed: 1.0,
            seed,
        }
    }

    #[test]
    fn one_seed_one_schedule() {
        let a: Vec<_> = Schedule::new(&params(7)).take(200).collect();
        let b: Vec<_> = Schedule::new(&params(7)).take(200).collect();
        let c: Vec<_> = Schedule::new(&params(8)).take(200).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
    }

    #[test]
    fn workload_matches_the_settings() {
        let p = params(3);
        let tasks: Vec<_> = Schedule::new(&p).take(20_000).collect();
        let span = tasks.last().unwrap().at.as_secs_f64();
        let held: f64 = tasks.iter().map(|a| a.hold.as_secs_f64()).sum();
        let load = held / span / f64::from(p.limit);
        assert!((load - OFFERED_LOAD).abs() < 0.04, "offered load {load}");
        let crashes = tasks.iter().filter(|a| a.crash).count() as f64 / tasks.len() as f64;
        assert!(
            (crashes - p.crash_probability).abs() < 0.01,
            "crash share {crashes}"
        );
        assert!(tasks
            .iter()
            .all(|a| a.hold >= p.task() / 2 && a.hold < p.task() * 3 / 2));
    }
}
