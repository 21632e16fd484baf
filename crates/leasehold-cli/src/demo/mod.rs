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

/// Runs `leasehold demo` with `args`, on Redis at `redis` if it was given as `--redis` on the
/// command line (see [`redis_from_command_line`]).
pub async fn run(args: DemoArgs, redis: Option<String>) -> Result<i32, Failure> {
    // Saturated, not truncated: a huge duration must be refused by `validate`, not wrap round
    // to a small one that passes.
    let millis = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let params = Params {
        limit: args.limit,
        crash_probability: args.crash_probability,
        ttl_ms: millis(args.ttl),
        task_ms: millis(args.task_duration),
        speed: args.speed,
        seed: args.seed,
    };
    params
        .validate()
        .map_err(|e| Failure::new(exit::USAGE, format!("demo: {e}")))?;
    let store = match redis_from_command_line(redis) {
        Some(url) => Store::Redis(RedisBackend::connect(&url).await?),
        None => Store::Memory,
    };
    if args.headless {
        let outcome = headless::run(params, &store, args.duration, |_| {}).await?;
        if args.json {
            output::print(&format!("{}\n", summary::json(&outcome, store.label())))?;
        } else {
            output::print(&summary::table(&outcome, store.label()))?;
        }
        return Ok(0);
    }
    serve(params, store, args.port).await
}

/// `redis`, the global `--redis` value, if it was typed on the command line; `None` if it came
/// from `LEASEHOLD_REDIS_URL`. On Redis the demo empties its keys and force-releases every lease
/// of the quota `demo`, so it must never land on a real Redis just because the environment
/// names one (for the other commands): the docs promise memory unless `--redis` is given.
fn redis_from_command_line(redis: Option<String>) -> Option<String> {
    use clap::parser::ValueSource;
    use clap::{ArgMatches, CommandFactory};
    redis.as_ref()?;
    // The parse that gave `redis` succeeded, so this one does too; its value sources say where
    // the value came from (a global option typed after `demo` is recorded there).
    let typed = |m: &ArgMatches| m.value_source("redis") == Some(ValueSource::CommandLine);
    let on_line = crate::cli::Cli::command()
        .try_get_matches()
        .is_ok_and(|m| typed(&m) || m.subcommand_matches("demo").is_some_and(typed));
    if !on_line {
        // On stderr: stdout may be the JSON summary.
        say!(
            "leasehold demo: ignoring LEASEHOLD_REDIS_URL and running in memory (pass --redis URL \
             to run on Redis, where the demo empties its keys and the quota `demo`)"
        );
        return None;
    }
    redis
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
