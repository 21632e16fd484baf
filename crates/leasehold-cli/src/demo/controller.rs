//! The live experiment behind the page: start, pause, reset, and the stream of samples that
//! every open page receives.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

use super::experiment::{Experiment, SAMPLE_EVERY};
use super::params::Params;
use super::store::Store;

/// Samples kept for a page that opens mid-run: a little more than the charts' 40 s window.
const HISTORY: usize = (45_000 / SAMPLE_EVERY.as_millis()) as usize;
/// Messages a slow page may fall behind by before it starts over from a fresh hello.
const CHANNEL: usize = 256;

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

/// Why a control was not carried out.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// The settings are out of range (the page's fault: HTTP 400).
    Invalid(String),
    /// The store failed (HTTP 503). After a reset the experiment is stopped and idle anyway.
    Store(String),
}

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
    /// Recent frames, the current state, and the channel they go out on, under one lock so that
    /// a page that subscribes gets each message exactly once (from the hello or from the
    /// channel), and never waits for a start or a reset in progress.
    feed: Arc<Mutex<Feed>>,
}

struct Feed {
    history: VecDeque<Arc<str>>,
    /// The latest state, as a page that opens now gets it.
    state: Value,
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

fn state_of(store: &Store, inner: &Inner, reset: bool) -> Value {
    json!({
        "phase": inner.phase,
        "params": inner.params,
        "store": store.label(),
        "scaled_ttl_ms": inner.params.scaled_ttl().as_millis() as u64,
        "heartbeat_ms": inner.params.scaled_heartbeat().as_millis() as u64,
        "reset": reset,
    })
}

/// Waits for a control run as its own task: a request dropped half-way (a closed tab, a client
/// that gave up) must not leave the experiment half started or half reset.
async fn detached<T>(work: JoinHandle<Result<T, Refusal>>) -> Result<T, Refusal> {
    work.await
        .unwrap_or_else(|e| Err(Refusal::Store(format!("the demo failed: {e}"))))
}

impl Controller {
    /// An idle controller with `params` on `store`.
    pub fn new(store: Store, params: Params) -> Self {
        let inner = Inner {
            params,
            phase: Phase::Idle,
            live: None,
        };
        let state = state_of(&store, &inner, false);
        Controller {
            store,
            inner: tokio::sync::Mutex::new(inner),
            feed: Arc::new(Mutex::new(Feed {
                history: VecDeque::new(),
                state,
                sender: broadcast::channel(CHANNEL).0,
            })),
        }
    }

    fn feed(&self) -> std::sync::MutexGuard<'_, Feed> {
        self.feed.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn announce(&self, inner: &Inner, reset: bool) -> Value {
        let state = state_of(&self.store, inner, reset);
        let mut feed = self.feed();
        feed.state = state_of(&self.store, inner, false);
        feed.send("state", state.to_string().into());
        state
    }

    /// The first message for a new page (the state and recent frames) and the channel of
    /// what follows. Also how a page that fell behind starts over.
    pub fn subscribe(&self) -> (String, broadcast::Receiver<Message>) {
        let feed = self.feed();
        // The frames are JSON already: splice them in rather than parse them again.
        let history: Vec<&str> = feed.history.iter().map(|f| &**f).collect();
        let hello = format!(
            r#"{{"state":{},"history":[{}]}}"#,
            feed.state,
            history.join(",")
        );
        (hello, feed.sender.subscribe())
    }

    /// Starts with `params` from idle, or resumes after a pause.
    pub async fn start(self: &Arc<Self>, params: Params) -> Result<Value, Refusal> {
        let this = self.clone();
        detached(tokio::spawn(async move { this.start_now(params).await })).await
    }

    async fn start_now(&self, params: Params) -> Result<Value, Refusal> {
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
                params.validate().map_err(Refusal::Invalid)?;
                let experiment = Experiment::new(params.clone(), &self.store)
                    .await
                    .map_err(|e| Refusal::Store(e.to_string()))?;
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

    /// Stops the run, empties the store and goes idle with `params`. Idle it goes even if the
    /// store cannot be emptied (the error says so; the next start empties it again).
    pub async fn reset(self: &Arc<Self>, params: Params) -> Result<Value, Refusal> {
        params.validate().map_err(Refusal::Invalid)?;
        let this = self.clone();
        detached(tokio::spawn(async move { this.reset_now(params).await })).await
    }

    async fn reset_now(&self, params: Params) -> Result<Value, Refusal> {
        // The lock is held to the end, so that no start can build on the store before the old
        // run has stopped and been cleared away.
        let mut inner = self.inner.lock().await;
        let stopped = match inner.live.take() {
            Some(live) => stop(live, true).await,
            None => Ok(()),
        };
        self.feed().history.clear();
        inner.params = params;
        inner.phase = Phase::Idle;
        let state = self.announce(&inner, true);
        stopped.map(|()| state).map_err(|e| {
            Refusal::Store(format!(
                "stopped, but the store could not be emptied (the next Start tries again): {e}"
            ))
        })
    }

    /// Stops the run at exit. The store is left as it is, so its keys can be inspected.
    pub async fn shutdown(&self) {
        let mut inner = self.inner.lock().await;
        if let Some(live) = inner.live.take() {
            let _ = stop(live, false).await;
        }
    }

    /// Where the experiment stands.
    #[cfg(test)]
    pub fn phase(&self) -> Value {
        self.feed().state["phase"].clone()
    }

    /// Sends `count` made-up frames to the pages, as a fast run would.
    #[cfg(test)]
    pub fn flood(&self, count: usize) {
        let mut feed = self.feed();
        for _ in 0..count {
            feed.send("frame", r#"{"t":0,"elapsed":0,"worlds":[]}"#.into());
        }
    }
}

/// Stops a run and waits for its tasks (the driver bounds that wait itself: in-flight calls
/// finish, or are aborted after a grace), then empties its limiters if `clear`. The clear comes
/// only after every task has returned, so nothing of the old run lands after it.
async fn stop(live: Live, clear: bool) -> leasehold::Result<()> {
    live.experiment.stop();
    let _ = live.driver.await;
    let _ = live.sampler.await;
    if clear {
        live.experiment.clear().await?;
    }
    Ok(())
}
