//! One run of the experiment: the schedule fed to the three columns, and their samples.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::Result;
use serde::Serialize;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::clock::Clock;
use super::params::Params;
use super::schedule::Schedule;
use super::semantics::{Kind, Limiter};
use super::store::Store;
use super::world::{Sample, World};

/// How often the columns are sampled (for the page, the summary and the recovery times, which
/// are therefore up to this much late).
pub const SAMPLE_EVERY: Duration = Duration::from_millis(100);
/// How long tasks in flight get to finish their call to the store once the experiment is
/// stopped: a few calls, each bounded by the backend's call timeout (1 s by default).
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The three columns at one instant.
#[derive(Debug, Clone, Serialize)]
pub struct Frame {
    /// Seconds since the experiment was built.
    pub t: f64,
    /// Seconds of running (unpaused) time: how far the schedule got.
    pub elapsed: f64,
    /// One sample per semantics, in [`Kind::ALL`] order.
    pub worlds: Vec<Sample>,
}

/// An experiment: three columns, one clock, one stop signal.
pub struct Experiment {
    params: Params,
    worlds: Vec<Arc<World>>,
    clock: Clock,
    stop: CancellationToken,
    born: Instant,
    run: u64,
}

impl Experiment {
    /// Builds the three limiters on `store` and empties them.
    pub async fn new(params: Params, store: &Store) -> Result<Self> {
        static RUNS: AtomicU64 = AtomicU64::new(0);
        let counters = store.counters();
        let mut worlds = Vec::new();
        for kind in Kind::ALL {
            let limiter = Limiter::new(kind, store, &counters, &params)?;
            limiter.clear().await?;
            worlds.push(Arc::new(World::new(kind, params.limit, limiter)));
        }
        Ok(Experiment {
            params,
            worlds,
            clock: Clock::default(),
            stop: CancellationToken::new(),
            born: Instant::now(),
            run: RUNS.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The schedule's clock (start, pause).
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Stops the schedule, the tasks in flight and the sampler.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Empties the limiters, after a stop, so nothing of this run stays in the store.
    pub async fn clear(&self) -> Result<()> {
        for world in &self.worlds {
            world.limiter().clear().await?;
        }
        Ok(())
    }

    /// Feeds the schedule to the three columns until `until` of running time (forever if
    /// `None`) or until stopped, then waits for the tasks in flight to end. When it returns, no
    /// task of this run is left: nothing of it can reach the store any more, so a [`clear`]
    /// after it is final.
    ///
    /// [`clear`]: Experiment::clear
    pub async fn drive(&self, until: Option<Duration>) {
        let mut tasks = JoinSet::new();
        for arrival in Schedule::new(&self.params) {
            if until.is_some_and(|u| arrival.at >= u) {
                break;
            }
            if !self.clock.reach(arrival.at, &self.stop).await {
                break;
            }
            while tasks.try_join_next().is_some() {}
            let id = format!("r{}-t{}", self.run, arrival.index);
            for world in &self.worlds {
                tasks.spawn(world.clone().serve(arrival, id.clone(), self.stop.clone()));
            }
        }
        // Every task ends within its hold (at most 1.5 × the mean) plus a few calls; after a
        // stop, within the call it is making. Each call is bounded by the backend's call
        // timeout, so the bounds only matter if that fails.
        let waiting = Instant::now();
        let natural = waiting + self.params.scaled_task() * 2 + Duration::from_secs(10);
        let mut deadline = natural;
        let mut stopped = false;
        loop {
            tokio::select! {
                joined = tasks.join_next() => if joined.is_none() { return },
                _ = self.stop.cancelled(), if !stopped => {
                    stopped = true;
                    deadline = deadline.min(Instant::now() + STOP_GRACE);
                }
                _ = tokio::time::sleep_until(deadline.into()) => break,
            }
        }
        // Aborted between two calls, a task may leave a unit counted (an INCR without its
        // DECR): say so rather than let it pass for a leak of the semantics.
        say!(
            "leasehold demo: {} tasks still running after {:?}; stopping them (the counts of \
             this run may include their slots)",
            tasks.len(),
            waiting.elapsed()
        );
        tasks.shutdown().await;
    }

    /// One sample of the three columns.
    pub async fn sample(&self) -> Frame {
        let mut worlds = Vec::with_capacity(self.worlds.len());
        for world in &self.worlds {
            worlds.push(world.sample().await);
        }
        Frame {
            t: self.born.elapsed().as_secs_f64(),
            elapsed: self.clock.elapsed().as_secs_f64(),
            worlds,
        }
    }

    /// Samples every [`SAMPLE_EVERY`] into `sink` until stopped.
    pub async fn sample_until_stopped(&self, mut sink: impl FnMut(Frame)) {
        let mut ticks = tokio::time::interval(SAMPLE_EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => sink(self.sample().await),
                _ = self.stop.cancelled() => return,
            }
        }
    }
}
