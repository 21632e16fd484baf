//! The schedule's clock: it runs only while the experiment runs, so a pause stops new tasks
//! from arriving (tasks already admitted, and their leases, carry on in real time).

use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, Default)]
struct Reading {
    /// Running time accumulated before the current run.
    banked: Duration,
    /// When the current run began; `None` while paused.
    since: Option<Instant>,
}

impl Reading {
    fn elapsed(&self) -> Duration {
        self.banked + self.since.map_or(Duration::ZERO, |s| s.elapsed())
    }
}

/// A pausable stopwatch that tasks can wait on.
#[derive(Debug)]
pub struct Clock {
    reading: watch::Sender<Reading>,
}

impl Default for Clock {
    fn default() -> Self {
        Clock {
            reading: watch::channel(Reading::default()).0,
        }
    }
}

impl Clock {
    /// Running time so far.
    pub fn elapsed(&self) -> Duration {
        self.reading.borrow().elapsed()
    }

    /// Starts or resumes.
    pub fn run(&self) {
        self.reading.send_modify(|r| {
            r.since.get_or_insert_with(Instant::now);
        });
    }

    /// Pauses, banking the time run so far.
    pub fn pause(&self) {
        self.reading.send_modify(|r| {
            if let Some(since) = r.since.take() {
                r.banked += since.elapsed();
            }
        });
    }

    /// Waits until the running time reaches `at`; false if `stop` fired first.
    pub async fn reach(&self, at: Duration, stop: &CancellationToken) -> bool {
        let mut changes = self.reading.subscribe();
        loop {
            let reading = *changes.borrow_and_update();
            let left = at.saturating_sub(reading.elapsed());
            if reading.since.is_some() && left.is_zero() {
                return true;
            }
            // While paused, only a change of state (or a stop) can move us on.
            let wake = async {
                match reading.since {
                    Some(_) => tokio::time::sleep(left).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = wake => {}
                changed = changes.changed() => if changed.is_err() { return false },
                _ = stop.cancelled() => return false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_paused_clock_holds_arrivals_back() {
        let clock = std::sync::Arc::new(Clock::default());
        let stop = CancellationToken::new();
        clock.run();
        assert!(clock.reach(Duration::from_millis(20), &stop).await);
        clock.pause();
        let banked = clock.elapsed();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(clock.elapsed(), banked, "no time passes while paused");
        let waiter = {
            let (clock, stop) = (clock.clone(), stop.clone());
            tokio::spawn(
                async move { clock.reach(banked + Duration::from_millis(30), &stop).await },
            )
        };
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(!waiter.is_finished(), "reached a time while paused");
        let resumed = Instant::now();
        clock.run();
        assert!(waiter.await.unwrap());
        assert!(resumed.elapsed() >= Duration::from_millis(25));
        stop.cancel();
        assert!(!clock.reach(Duration::from_secs(3600), &stop).await);
    }
}
