//! leasehold's own small runtime, on a dedicated thread.
//!
//! Renewals and all Redis I/O run here, so an application that blocks its own runtime for a
//! while (a CPU-bound task, a blocking call on an async thread) cannot starve the heartbeat: an
//! unhealthy event loop must not be the first thing to kill a lease.

use std::future::Future;
use std::sync::OnceLock;

use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::error::{Error, Result, Unavailable};

static HANDLE: OnceLock<Handle> = OnceLock::new();
static THREAD: OnceLock<std::thread::ThreadId> = OnceLock::new();

/// The handle of the process-wide leasehold runtime, started on first use.
pub(crate) fn handle() -> &'static Handle {
    HANDLE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("leasehold-runtime")
            .build()
            .expect("leasehold: cannot build its runtime");
        let handle = runtime.handle().clone();
        let thread = std::thread::Builder::new()
            .name("leasehold-runtime".into())
            .spawn(move || runtime.block_on(std::future::pending::<()>()))
            .expect("leasehold: cannot spawn its runtime thread");
        let _ = THREAD.set(thread.thread().id());
        handle
    })
}

/// Spawns `fut` on the leasehold runtime.
pub(crate) fn spawn<F>(fut: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    handle().spawn(fut)
}

/// True on the leasehold runtime's own thread.
fn on_leasehold_thread() -> bool {
    THREAD.get() == Some(&std::thread::current().id())
}

/// Runs `fut` on the leasehold runtime and waits for it from any runtime. Already there (a
/// renewal, an admission attempt), it runs in place: a spawn would only add a hop.
pub(crate) async fn run<T, F>(fut: F) -> Result<T>
where
    F: Future<Output = Result<T>> + Send + 'static,
    T: Send + 'static,
{
    if on_leasehold_thread() {
        return fut.await;
    }
    finish(fut).await
}

/// Runs `fut` on the leasehold runtime and waits for it; it runs to its end even if the caller
/// stops waiting.
pub(crate) async fn finish<T, F>(fut: F) -> Result<T>
where
    F: Future<Output = Result<T>> + Send + 'static,
    T: Send + 'static,
{
    spawn(fut).await.map_err(|e| {
        Error::unavailable(
            Unavailable::NoReply,
            format!("leasehold runtime task failed: {e}"),
        )
    })?
}
