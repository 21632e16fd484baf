//! The short-circuit: after consecutive backend failures, stop calling the backend for a
//! cool-down, so callers are answered at once instead of each waiting out a timeout.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::Rng;

/// The circuit's state, as [`Quota::breaker_mode`](crate::Quota::breaker_mode) reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BreakerMode {
    /// Calls go to the backend.
    Closed,
    /// The backend failed repeatedly: acquires are answered by the
    /// [`BackendDownPolicy`](crate::BackendDownPolicy) without any network I/O until the
    /// cool-down ends.
    Open,
    /// The cool-down ended: one probe call goes to the backend; its outcome closes or reopens
    /// the circuit.
    HalfOpen,
}

/// When the circuit opens and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive rounds of transient failures (errors or timeouts) that open the circuit.
    /// Default 3. A round is a failure and the calls already under way when it was seen, so one
    /// failed batch, or one blip seen by many calls, counts once. Against a backend that stops
    /// answering (a partition), the circuit opens after about this many call timeouts (3 s by
    /// default); against one that refuses connections, after as many quick failures.
    pub failures_to_open: u32,
    /// How long the circuit stays open before a probe, jittered between half and one and a half
    /// of it so that a fleet does not reconnect in lockstep. Default 1 s. Acquires are answered
    /// by the backend-down policy until the probe succeeds: up to 1.5 × this after the backend
    /// is back (a renewal that gets through closes the circuit sooner). At most
    /// [`MAX_TTL`](crate::MAX_TTL).
    pub cool_down: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures_to_open: 3,
            cool_down: Duration::from_secs(1),
        }
    }
}

/// What the breaker allows for the next call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Permit {
    /// Call the backend.
    Call,
    /// Do not call: the circuit is open (or a probe is already out).
    Reject,
}

#[derive(Debug)]
pub(crate) struct Breaker {
    config: BreakerConfig,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    failures: u32,
    /// When the last counted failure was seen.
    failed_at: Option<Instant>,
    open_until: Option<Instant>,
    probing: bool,
}

impl Breaker {
    pub(crate) fn new(config: BreakerConfig) -> Self {
        Breaker {
            config,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn mode(&self) -> BreakerMode {
        self.mode_at(Instant::now())
    }

    /// [`mode`](Self::mode) as of `now`.
    fn mode_at(&self, now: Instant) -> BreakerMode {
        let state = self.lock();
        match state.open_until {
            None => BreakerMode::Closed,
            Some(until) if now < until => BreakerMode::Open,
            Some(_) => BreakerMode::HalfOpen,
        }
    }

    /// Whether the next call may go to the backend. After the cool-down, exactly one caller
    /// gets through as the probe.
    pub(crate) fn permit(&self) -> Permit {
        self.permit_at(Instant::now())
    }

    /// [`permit`](Self::permit) as of `now`.
    fn permit_at(&self, now: Instant) -> Permit {
        let mut state = self.lock();
        match state.open_until {
            None => Permit::Call,
            Some(until) if now < until || state.probing => Permit::Reject,
            Some(_) => {
                state.probing = true;
                Permit::Call
            }
        }
    }

    /// A call was answered; returns whether that closed an open (or half-open) circuit.
    pub(crate) fn success(&self) -> bool {
        let mut state = self.lock();
        let was_open = state.open_until.is_some();
        if was_open {
            tracing::info!("backend answers again: circuit closed");
        }
        *state = State::default();
        was_open
    }

    /// A call sent at `sent` failed transiently. Calls already under way when the previous
    /// failure was seen do not count again: one failed batch (or one blip seen by many concurrent
    /// calls) is one failure, so only consecutive rounds of failures open the circuit.
    pub(crate) fn failure(&self, sent: Instant) {
        self.failure_at(sent, Instant::now())
    }

    /// [`failure`](Self::failure), seen at `now`.
    fn failure_at(&self, sent: Instant, now: Instant) {
        let mut state = self.lock();
        if state.failed_at.is_some_and(|at| sent < at) {
            return;
        }
        state.failed_at = Some(now);
        state.failures += 1;
        if state.probing || state.failures >= self.config.failures_to_open {
            if state.open_until.is_none() {
                tracing::warn!(failures = state.failures, "backend failing: circuit open");
            }
            let jittered = self
                .config
                .cool_down
                .mul_f64(rand::rng().random_range(0.5..1.5));
            state.open_until = Some(now + jittered);
            state.probing = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_and_probes_once_after_the_cool_down() {
        let cool_down = Duration::from_millis(200);
        let b = Breaker::new(BreakerConfig {
            failures_to_open: 2,
            cool_down,
        });
        // Explicit instants: the cool-down is jittered within [0.5, 1.5) x, so just below half
        // of it the circuit is surely open, and at 1.5 x it is surely over.
        let surely_open = cool_down / 2 - Duration::from_millis(1);
        let surely_over = cool_down * 3 / 2;
        let t0 = Instant::now();
        b.failure_at(t0, t0);
        assert_eq!(b.mode_at(t0), BreakerMode::Closed);
        b.success(); // not consecutive
        let t1 = t0 + Duration::from_millis(1);
        b.failure_at(t1, t1);
        let t2 = t1 + Duration::from_millis(1);
        b.failure_at(t2, t2);
        assert_eq!(b.mode_at(t2), BreakerMode::Open);
        assert_eq!(b.permit_at(t2), Permit::Reject);
        assert_eq!(b.mode_at(t2 + surely_open), BreakerMode::Open);
        assert_eq!(b.permit_at(t2 + surely_open), Permit::Reject);
        let t3 = t2 + surely_over;
        assert_eq!(b.mode_at(t3), BreakerMode::HalfOpen);
        assert_eq!(b.permit_at(t3), Permit::Call, "one probe");
        assert_eq!(b.permit_at(t3), Permit::Reject, "only one");
        let t4 = t3 + Duration::from_millis(1);
        b.failure_at(t3, t4); // the probe failed
        assert_eq!(b.mode_at(t4), BreakerMode::Open);
        assert_eq!(b.permit_at(t4 + surely_open), Permit::Reject);
        let t5 = t4 + surely_over;
        assert_eq!(b.permit_at(t5), Permit::Call);
        b.success();
        assert_eq!(b.mode_at(t5), BreakerMode::Closed);
        assert_eq!(b.permit_at(t5), Permit::Call);
    }

    #[test]
    fn calls_under_way_when_a_failure_is_seen_count_as_that_one_failure() {
        let b = Breaker::new(BreakerConfig {
            failures_to_open: 2,
            cool_down: Duration::from_secs(1),
        });
        // Three calls of one batch, sent together, fail together.
        let sent = Instant::now();
        b.failure(sent);
        b.failure(sent);
        b.failure(sent);
        assert_eq!(b.mode(), BreakerMode::Closed, "one round of failures");
        // A call sent after that failure was seen fails too: a second round.
        b.failure(Instant::now());
        assert_eq!(b.mode(), BreakerMode::Open);
    }
}
