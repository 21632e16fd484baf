//! `leasehold demo`: a counter, a counter with a key TTL and a leasehold quota share one limit
//! while simulated tasks crash; watch it live in a browser, or get a summary with `--headless`.
//! See docs/DEMO.md.

mod clock;
mod controller;
mod experiment;
mod headless;
mod memory_counters;
mod params;
mod schedule;
mod semantics;
mod server;
mod store;
mod summary;
mod world;

#[cfg(test)]
mod tests;

use std::sync::Arc;

use leasehold::RedisBackend;

use crate::cli::DemoArgs;
use crate::exit::{self, Failure};
use crate::output;
use controller::Controller;
use params::Params;
use store::Store;

/// Runs `leasehold demo` with `args`, on Redis at `redis` if given.
pub async fn run(args: DemoArgs, redis: Option<String>) -> Result<i32, Failure> {
    let params = Params {
        limit: args.limit,
        crash_probability: args.crash_probability,
        ttl_ms: args.ttl.as_millis() as u64,
        task_ms: args.task_duration.as_millis() as u64,
        speed: args.speed,
        seed: args.seed,
    };
    params
        .validate()
        .map_err(|e| Failure::new(exit::USAGE, format!("demo: {e}")))?;
    let store = match redis {
        Some(url) => Store::Redis(RedisBackend::connect(&url).await?),
        None => Store::Memory,
    };
    if args.headless {
        let outcome = headless::run(params, &store, args.duration).await?;
        if args.json {
            output::print(&format!("{}\n", summary::json(&outcome, store.label())))?;
        } else {
            output::print(&summary::table(&outcome, store.label()))?;
        }
        return Ok(0);
    }
    serve(params, store, args.port).await
}

async fn serve(params: Params, store: Store, port: u16) -> Result<i32, Failure> {
    let software =
        |what: &str, e: std::io::Error| Failure::new(exit::SOFTWARE, format!("{what}: {e}"));
    let listener = server::bind(port)
        .await
        .map_err(|e| software("cannot listen on 127.0.0.1", e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| software("cannot read the listening address", e))?;
    let label = store.label();
    let controller = Arc::new(Controller::new(store, params));
    output::tell(&format!(
        "leasehold demo: open {} (store: {label}; Ctrl-C to stop)\n",
        server::url(addr)
    ));
    let app = server::router(controller.clone());
    tokio::select! {
        served = axum::serve(listener, app) => served.map_err(|e| software("web server stopped", e))?,
        _ = tokio::signal::ctrl_c() => {}
    }
    controller.shutdown().await;
    Ok(0)
}
