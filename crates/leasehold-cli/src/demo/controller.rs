//! The live experiment behind the page: start, pause, reset, and the stream of samples that
//! every open page receives.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

use super::experiment::{Experiment, SAMPLE_EVERY};
use super::params::Params;
use super::store::Store;

/// Samples kept for a page that opens mid-run: a little more than the charts' 40 s window.
const HISTORY: usize = (45_000 / SAMPLE_EVERY.as_millis()) as usize;
/// Messages a slow page may fall behind by before it skips some.
const CHANNEL: usize = 256;
/// Longest wait for a stopped run's tasks to end before its state is cleared.
const STOP_BOUND: Duration = Duration::from_secs(15);

/// Where the experiment stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Not started since the last reset.
    Idle,
    /// Tasks are being submitted.
    Running,
    /// No new tasks; those in flight carry on.
    Paused,
}

/// One server-sent event: its name and its JSON data.
pub type Message = (&'static str, Arc<str>);

struct Live {
    experiment: Arc<Experiment>,
    driver: JoinHandle<()>,
    sampler: JoinHandle<()>,
}

struct Inner {
    params: Params,
    phase: Phase,
    live: Option<Live>,
}

/// Owns the experiment and fans its samples out to the pages.
pub struct Controller {
    store: Store,
    inner: tokio::sync::Mutex<Inner>,
    /// Recent frames, and the channel they go out on, under one lock so that a page that
    /// subscribes gets each frame exactly once (from the history or from the channel).
    feed: Arc<Mutex<Feed>>,
}

struct Feed {
    history: VecDeque<Arc<str>>,
    sender: broadcast::Sender<Message>,
}

impl Feed {
    fn send(&mut self, name: &'static str, data: Arc<str>) {
        if name == "frame" {
            if self.history.len() == HISTORY {
                self.history.pop_front();
            }
            self.history.push_back(data.clone());
        }
        // No page open is not an error.
        let _ = self.sender.send((name, data));
    }
}

impl Controller {
    /// An idle controller with `params` on `store`.
    pub fn new(store: Store, params: Params) -> Self {
        Controller {
            store,
            inner: tokio::sync::Mutex::new(Inner {
                params,
                phase: Phase::Idle,
                live: None,
            }),
            feed: Arc::new(Mutex::new(Feed {
                history: VecDeque::new(),
                sender: broadcast::channel(CHANNEL).0,
            })),
        }
    }

    fn feed(&self) -> std::sync::MutexGuard<'_, Feed> {
        self.feed.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn state(&self, inner: &Inner, reset: bool) -> Value {
        json!({
            "phase": inner.phase,
            "params": inner.params,
            "store": self.store.label(),
            "scaled_ttl_ms": inner.params.scaled_ttl().as_millis() as u64,
            "heartbeat_ms": inner.params.scaled_heartbeat().as_millis() as u64,
            "reset": reset,
        })
    }

    fn announce(&self, inner: &Inner, reset: bool) -> Value {
        let state = self.state(inner, reset);
        self.feed().send("state", state.to_string().into());
        state
    }

    /// The first message for a new page (the state and recent frames) and the channel of
    /// what follows.
    pub async fn subscribe(&self) -> (String, broadcast::Receiver<Message>) {
        let inner = self.inner.lock().await;
        let state = self.state(&inner, false);
        let feed = self.feed();
        // The frames are JSON already: splice them in rather than parse them again.
        let history: Vec<&str> = feed.history.iter().map(|f| &**f).collect();
        let hello = format!(r#"{{"state":{state},"history":[{}]}}"#, history.join(","));
        (hello, feed.sender.subscribe())
    }

    /// Starts with `params` from idle, or resumes after a pause.
    pub async fn start(&self, params: Params) -> Result<Value, String> {
        let mut inner = self.inner.lock().await;
        match inner.phase {
            Phase::Running => {}
            Phase::Paused => {
                if let Some(live) = &inner.live {
                    live.experiment.clock().run();
                }
                inner.phase = Phase::Running;
            }
            Phase::Idle => {
                params.validate()?;
                let experiment = Experiment::new(params.clone(), &self.store)
                    .await
                    .map_err(|e| e.to_string())?;
                let experiment = Arc::new(experiment);
                experiment.clock().run();
                let driver = {
                    let experiment = experiment.clone();
                    tokio::spawn(async move { experiment.drive(None).await })
                };
                let sampler = {
                    let (experiment, feed) = (experiment.clone(), self.feed.clone());
                    tokio::spawn(async move {
                        experiment
                            .sample_until_stopped(|frame| {
                                let data = serde_json::to_string(&frame).unwrap_or_default();
                                let mut feed = feed.lock().unwrap_or_else(|e| e.into_inner());
                                feed.send("frame", data.into());
                            })
                            .await
                    })
                };
                inner.params = params;
                inner.live = Some(Live {
                    experiment,
                    driver,
                    sampler,
                });
                inner.phase = Phase::Running;
            }
        }
        Ok(self.announce(&inner, false))
    }

    /// Stops submitting tasks; tasks in flight and their leases carry on.
    pub async fn pause(&self) -> Value {
        let mut inner = self.inner.lock().await;
        if inner.phase == Phase::Running {
            if let Some(live) = &inner.live {
                live.experiment.clock().pause();
            }
            inner.phase = Phase::Paused;
        }
        self.announce(&inner, false)
    }

    /// Stops the run, empties the store and goes idle with `params`.
    pub async fn reset(&self, params: Params) -> Result<Value, String> {
        params.validate()?;
        let mut inner = self.inner.lock().await;
        if let Some(live) = inner.live.take() {
            stop(live, true).await.map_err(|e| e.to_string())?;
        }
        self.feed().history.clear();
        inner.params = params;
        inner.phase = Phase::Idle;
        Ok(self.announce(&inner, true))
    }

    /// Stops the run at exit. The store is left as it is, so its keys can be inspected.
    pub async fn shutdown(&self) {
        let mut inner = self.inner.lock().await;
        if let Some(live) = inner.live.take() {
            let _ = stop(live, false).await;
        }
    }
}

/// Stops a run and waits (bounded) for its tasks; empties its limiters if `clear`.
async fn stop(live: Live, clear: bool) -> leasehold::Result<()> {
    live.experiment.stop();
    let ended = tokio::time::timeout(STOP_BOUND, async {
        let _ = live.driver.await;
        let _ = live.sampler.await;
    })
    .await;
    if ended.is_err() {
        eprintln!("leasehold demo: the previous run did not stop within {STOP_BOUND:?}");
    }
    if clear {
        live.experiment.clear().await?;
    }
    Ok(())
}
