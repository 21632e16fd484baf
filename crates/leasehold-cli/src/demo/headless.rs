//! `leasehold demo --headless`: the experiment without a browser, for CI and terminals.

use std::time::Duration;

use leasehold::Result;

use super::experiment::{Experiment, Frame};
use super::params::Params;
use super::store::Store;

/// Extra wait after the drain's ttl + heartbeat, for the last renewal call and one sample.
const DRAIN_MARGIN: Duration = Duration::from_millis(300);

/// What a headless run saw: only what the summary needs, so that memory does not grow with
/// `--duration`.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The settings.
    pub params: Params,
    /// How long tasks were submitted.
    pub duration: Duration,
    /// How long the run waited after the last task ended.
    pub drain: Duration,
    /// The sample taken at the end, after the drain (its totals cover the whole run).
    pub last: Frame,
}

/// The wait after the last task ended: long enough for every crashed lease to expire (one ttl
/// after its last renewal, itself at most one heartbeat before the crash) and for the TTL
/// counter's key to expire.
pub fn drain(params: &Params) -> Duration {
    params.scaled_ttl() + params.scaled_heartbeat() + DRAIN_MARGIN
}

/// Submits tasks for `duration`, lets the tasks in flight end, waits [`drain`], and returns the
/// last sample. Every sample, the last one included, is shown to `watch` as it is taken (the
/// tests check the whole series; the command line keeps none).
pub async fn run(
    params: Params,
    store: &Store,
    duration: Duration,
    mut watch: impl FnMut(&Frame),
) -> Result<Outcome> {
    let experiment = Experiment::new(params.clone(), store).await?;
    experiment.clock().run();
    let drain = drain(&params);
    let driven = async {
        experiment.drive(Some(duration)).await;
        tokio::time::sleep(drain).await;
        let last = experiment.sample().await;
        experiment.stop();
        last
    };
    let ((), last) = tokio::join!(
        experiment.sample_until_stopped(|frame| watch(&frame)),
        driven
    );
    watch(&last);
    Ok(Outcome {
        params,
        duration,
        drain,
        last,
    })
}
