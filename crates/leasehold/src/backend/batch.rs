//! Automatic batching for one kind of backend call.
//!
//! Calls that arrive together go out together: the first call queued schedules a send on the
//! leasehold runtime, and that send, when it runs, takes every call queued by then (up to a
//! bound) into one script call. Nothing waits for a reply before it is sent, so one caller alone
//! goes out as fast as before, while a burst of callers shares a handful of script calls and
//! Redis runs each script's fixed part (time, epoch, reaping) and its Lua call machinery once per
//! batch instead of once per caller. Callers are sent in arrival order; each gets its own answer.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::error::{Error, Misconfiguration, Result, Unavailable};
use crate::runtime;

/// A queue of calls of one kind (one quota's admissions, or its releases) sent in batches.
pub(crate) struct Batcher<Req, Resp> {
    state: Mutex<State<Req, Resp>>,
    max_batch: usize,
}

struct State<Req, Resp> {
    queue: VecDeque<Pending<Req, Resp>>,
    /// A send is scheduled and has not taken the queue yet.
    scheduled: bool,
}

struct Pending<Req, Resp> {
    request: Req,
    reply: oneshot::Sender<Result<Resp>>,
}

impl<Req, Resp> std::fmt::Debug for Batcher<Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("max_batch", &self.max_batch)
            .finish_non_exhaustive()
    }
}

/// Armed (`Some`) while a scheduled send has not taken the queue yet.
struct Unsent<Req, Resp>(Option<Arc<Batcher<Req, Resp>>>);

impl<Req, Resp> Drop for Unsent<Req, Resp> {
    fn drop(&mut self) {
        if let Some(batcher) = self.0.take() {
            let mut state = batcher.state.lock().unwrap_or_else(|e| e.into_inner());
            state.scheduled = false;
            // Dropping the reply senders answers each caller "runtime stopped".
            state.queue.clear();
        }
    }
}

impl<Req: Send + 'static, Resp: Send + 'static> Batcher<Req, Resp> {
    /// A batcher that sends at most `max_batch` requests per call.
    pub(crate) fn new(max_batch: usize) -> Self {
        Batcher {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                scheduled: false,
            }),
            max_batch: max_batch.max(1),
        }
    }

    /// Queues `request` and waits for its answer. `send` performs one call for a batch of
    /// requests and answers each, in order; every `send` given to one batcher must be
    /// equivalent, since whichever schedules a send serves everything queued with it.
    ///
    /// Batches are sent from their own tasks on the leasehold runtime, so a caller that stops
    /// waiting never cancels a call that carries other callers' requests.
    pub(crate) async fn submit<F, Fut>(self: &Arc<Self>, request: Req, send: F) -> Result<Resp>
    where
        F: Fn(Vec<Req>) -> Fut + Send + Sync + Clone + 'static,
        Fut: Future<Output = Result<Vec<Resp>>> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let schedule = {
            let mut state = self.lock();
            state.queue.push_back(Pending { request, reply });
            !std::mem::replace(&mut state.scheduled, true)
        };
        if schedule {
            runtime::spawn(self.clone().send_batch(send));
        }
        answer.await.unwrap_or_else(|_| {
            Err(Error::unavailable(
                Unavailable::NoReply,
                "leasehold runtime stopped during a call",
            ))
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<Req, Resp>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes what is queued (after letting the tasks that are ready now queue theirs), schedules
    /// the next send if more is left, then sends the batch and answers each request.
    fn send_batch<F, Fut>(self: Arc<Self>, send: F) -> Pin<Box<dyn Future<Output = ()> + Send>>
    where
        F: Fn(Vec<Req>) -> Fut + Send + Sync + Clone + 'static,
        Fut: Future<Output = Result<Vec<Resp>>> + Send + 'static,
    {
        // Boxed: the future spawns its own kind.
        Box::pin(async move {
            // If this task is dropped before it takes the queue (the runtime shuts down), the
            // queued callers must hear of it and later calls must schedule a send again.
            let mut unsent = Unsent(Some(self.clone()));
            tokio::task::yield_now().await;
            unsent.0 = None;
            let batch: Vec<_> = {
                let mut state = self.lock();
                let n = state.queue.len().min(self.max_batch);
                let batch = state.queue.drain(..n).collect();
                if state.queue.is_empty() {
                    state.scheduled = false;
                } else {
                    runtime::spawn(self.clone().send_batch(send.clone()));
                }
                batch
            };
            let (requests, replies): (Vec<Req>, Vec<_>) =
                batch.into_iter().map(|p| (p.request, p.reply)).unzip();
            let asked = requests.len();
            match send(requests).await {
                Ok(answers) if answers.len() == asked => {
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(Ok(answer));
                    }
                }
                Ok(answers) => {
                    let e: Error = Misconfiguration::Protocol(format!(
                        "{} answers for {asked} requests in one call",
                        answers.len()
                    ))
                    .into();
                    for reply in replies {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
                Err(e) => {
                    for reply in replies {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    type Answers = std::pin::Pin<Box<dyn Future<Output = Result<Vec<u32>>> + Send>>;

    /// A fake call that records the batches it was given and answers each request doubled.
    fn doubler(
        calls: Arc<Mutex<Vec<Vec<u32>>>>,
    ) -> impl Fn(Vec<u32>) -> Answers + Send + Sync + Clone {
        move |batch: Vec<u32>| {
            let calls = calls.clone();
            Box::pin(async move {
                calls.lock().unwrap().push(batch.clone());
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(batch.into_iter().map(|x| x * 2).collect())
            })
        }
    }

    #[tokio::test]
    async fn a_burst_shares_calls_and_each_request_gets_its_own_answer() {
        let batcher = Arc::new(Batcher::new(64));
        let calls = Arc::new(Mutex::new(Vec::new()));
        let handles: Vec<_> = (0..50u32)
            .map(|i| {
                let batcher = batcher.clone();
                let send = doubler(calls.clone());
                tokio::spawn(async move { (i, batcher.submit(i, send).await) })
            })
            .collect();
        for handle in handles {
            let (i, answer) = handle.await.unwrap();
            assert_eq!(answer.unwrap(), i * 2);
        }
        let calls = calls.lock().unwrap();
        let sent: Vec<u32> = calls.iter().flatten().copied().collect();
        assert_eq!(sent.len(), 50, "every request sent exactly once");
        assert!(
            calls.len() * 2 <= 50,
            "50 concurrent requests went out in {} calls",
            calls.len()
        );
    }

    #[tokio::test]
    async fn requests_are_sent_in_the_order_they_were_queued() {
        let batcher = Arc::new(Batcher::new(3));
        let calls = Arc::new(Mutex::new(Vec::new()));
        let mut answers = Vec::new();
        // Submitted one after another from one task: the queue order is known.
        for i in 0..10u32 {
            let (batcher, send) = (batcher.clone(), doubler(calls.clone()));
            answers.push(tokio::spawn(async move { batcher.submit(i, send).await }));
            tokio::task::yield_now().await;
        }
        for (i, handle) in answers.into_iter().enumerate() {
            assert_eq!(handle.await.unwrap().unwrap(), i as u32 * 2);
        }
        let calls = calls.lock().unwrap();
        let sent: Vec<u32> = calls.iter().flatten().copied().collect();
        assert_eq!(sent, (0..10).collect::<Vec<_>>());
        assert!(calls.iter().all(|b| b.len() <= 3), "max_batch respected");
    }

    #[tokio::test]
    async fn a_failed_call_fails_every_request_it_carried_and_the_next_call_still_goes() {
        let batcher = Arc::new(Batcher::<u32, u32>::new(8));
        let attempts = Arc::new(AtomicUsize::new(0));
        let send = {
            let attempts = attempts.clone();
            move |batch: Vec<u32>| {
                let n = attempts.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n == 0 {
                        Err(Error::unavailable(Unavailable::NoConnection, "down"))
                    } else {
                        Ok(batch)
                    }
                }
            }
        };
        let first = batcher.submit(1, send.clone()).await;
        assert!(matches!(first, Err(Error::BackendUnavailable { .. })));
        assert_eq!(batcher.submit(2, send.clone()).await.unwrap(), 2);
        let short = batcher
            .submit(3, |_batch: Vec<u32>| async { Ok(Vec::new()) })
            .await;
        assert!(matches!(
            short,
            Err(Error::Misconfigured(Misconfiguration::Protocol(_)))
        ));
        assert!(!batcher.lock().scheduled, "no send left scheduled");
    }

    #[tokio::test]
    async fn a_send_dropped_before_it_took_the_queue_fails_the_queued_calls_and_rearms() {
        let batcher = Arc::new(Batcher::<u32, u32>::new(8));
        let (reply, answer) = oneshot::channel();
        {
            let mut state = batcher.lock();
            state.queue.push_back(Pending { request: 1, reply });
            state.scheduled = true;
        }
        // What the runtime does to a scheduled send when it shuts down.
        drop(Unsent(Some(batcher.clone())));
        assert!(answer.await.is_err(), "the queued caller hears of it");
        assert!(
            !batcher.lock().scheduled,
            "a later call schedules a send again"
        );
        let send = |batch: Vec<u32>| async move { Ok(batch) };
        assert_eq!(batcher.submit(2, send).await.unwrap(), 2);
    }
}
