//! `leasehold demo --headless`: the experiment without a browser, for CI and terminals.

use std::sync::Arc;
use std::time::Duration;

use leasehold::Result;

use super::experiment::{Experiment, Frame};
use super::params::Params;
use super::store::Store;

/// Extra wait after the drain's ttl + heartbeat, for the last renewal call and one sample.
const DRAIN_MARGIN: Duration = Duration::from_millis(300);

/// What a headless run saw.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The settings.
    pub params: Params,
    /// How long tasks were submitted.
    pub duration: Duration,
    /// How long the run waited after the last task ended.
    pub drain: Duration,
    /// Every sample, the last one taken after the drain.
    pub frames: Vec<Frame>,
}

impl Outcome {
    /// The sample taken at the end.
    pub fn last(&self) -> &Frame {
        self.frames
            .last()
            .expect("a run takes at least its final sample")
    }
}

/// The wait after the last task ended: long enough for every crashed lease to expire (one ttl
/// after its last renewal, itself at most one heartbeat before the crash) and for the TTL
/// counter's key to expire.
pub fn drain(params: &Params) -> Duration {
    params.scaled_ttl() + params.scaled_heartbeat() + DRAIN_MARGIN
}

/// Submits tasks for `duration`, lets the tasks in flight end, waits [`drain`], and returns the
/// samples.
pub async fn run(params: Params, store: &Store, duration: Duration) -> Result<Outcome> {
    let experiment = Arc::new(Experiment::new(params.clone(), store).await?);
    experiment.clock().run();
    let sampler = {
        let experiment = experiment.clone();
        tokio::spawn(async move {
            let mut frames = Vec::new();
            experiment
                .sample_until_stopped(|frame| frames.push(frame))
                .await;
            frames
        })
    };
    experiment.drive(Some(duration)).await;
    let drain = drain(&params);
    tokio::time::sleep(drain).await;
    let last = experiment.sample().await;
    experiment.stop();
    let mut frames = sampler.await.unwrap_or_default();
    frames.push(last);
    Ok(Outcome {
        params,
        duration,
        drain,
        frames,
    })
}
