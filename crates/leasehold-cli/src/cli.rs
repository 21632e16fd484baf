//! The command line, as clap sees it.

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// Run commands under one concurrency quota shared by a whole fleet, kept in Redis as named,
/// expiring, heartbeat-renewed leases.
///
/// Exit codes: see docs/CLI.md (75 = no slot within --wait, 79 = lease lost, 80 = cancelled,
/// 69 = Redis unavailable, 78 = misconfigured).
#[derive(Debug, Parser)]
#[command(name = "leasehold", version, propagate_version = true)]
pub struct Cli {
    /// Redis URL, e.g. redis://:password@127.0.0.1:6379/ or rediss://... Every command but
    /// `demo` needs it: without Redis a quota would exist only inside one process. `demo` takes
    /// it only from the command line, never from LEASEHOLD_REDIS_URL.
    #[arg(
        long,
        global = true,
        env = "LEASEHOLD_REDIS_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub redis: Option<String>,

    /// The quota's name: every process using the same name on the same Redis shares its limit.
    #[arg(long, global = true, env = "LEASEHOLD_QUOTA", value_name = "NAME")]
    pub quota: Option<String>,

    /// Say more on stderr (the task id and the fencing token of `run`).
    #[arg(short, long, global = true)]
    pub verbose: bool,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Acquire a slot, run COMMAND while renewing it, release it when COMMAND exits.
    ///
    /// COMMAND gets LEASEHOLD_QUOTA, LEASEHOLD_TASK_ID and LEASEHOLD_FENCING_TOKEN in its
    /// environment and runs in its own process group. leasehold exits with COMMAND's exit code
    /// (or ends by the signal that killed it). If the lease is lost or the task cancelled,
    /// COMMAND gets SIGTERM, then SIGKILL after --grace.
    Run(RunArgs),
    /// Show the holders of a quota.
    Status(StatusArgs),
    /// Cancel a task wherever it runs: its `leasehold run` terminates its command.
    Cancel(CancelArgs),
    /// Force-release a task's lease by id (operator use): its holder learns it has lost it.
    Release(ReleaseArgs),
    /// Change the quota's limit for every run, without a deploy (operator use): stored in
    /// Redis at a higher version, it applies from each run's next acquire; nobody is evicted.
    Limit(LimitArgs),
    /// Watch a counter, a counter with a key TTL and a lease quota share one limit while tasks
    /// crash: a live page on 127.0.0.1, or a summary table with --headless.
    ///
    /// Needs neither --quota nor --redis: without --redis everything runs in this process; with
    /// it, the counters are real keys and the lease column a real quota named `demo` there,
    /// which the demo empties. LEASEHOLD_REDIS_URL is ignored: only --redis on the command line
    /// moves the demo onto a Redis.
    Demo(DemoArgs),
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// How many tasks may run at once, fleet-wide.
    #[arg(long, value_name = "N")]
    pub limit: u64,
    /// The version of --limit: Redis keeps one limit per quota, and a run with a higher version
    /// replaces it for everyone; a lower one runs under the stored limit; the same version with
    /// another limit is refused (exit 78). Raise it whenever you change --limit.
    #[arg(long, default_value_t = 0, value_name = "V")]
    pub limit_version: u64,
    /// Lease time to live (50ms to 24h): a crashed holder's slot comes back this long after its
    /// last renewal.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// Renewal interval (default: ttl / 3). It must be shorter than what a renewal grants: the
    /// ttl less 1 ms and a safety margin (ttl / 20, at least 10 ms); one not shorter is refused
    /// (exit 78).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub heartbeat: Option<Duration>,
    /// How long to wait for a slot: 0 = one try, unset = forever.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub wait: Option<Duration>,
    /// The task id (default: a fresh UUIDv7). Cancel and release address tasks by it.
    #[arg(long, value_name = "ID")]
    pub task_id: Option<String>,
    /// Time between SIGTERM and SIGKILL when the command must stop.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub grace: Duration,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The limit to show when Redis stores none yet (no acquire since the quota was created or
    /// its data was lost); the stored limit is shown otherwise.
    #[arg(long, value_name = "N")]
    pub limit: Option<u64>,
}

#[derive(Debug, Args)]
pub struct CancelArgs {
    /// The task to cancel.
    pub task_id: String,
    /// Why; the holder sees it (at most 1024 bytes).
    #[arg(long, default_value = "cancelled by operator")]
    pub reason: String,
    /// The --ttl of the run that holds or waits for the task: the cancel marker is kept one
    /// hour plus this (two ttls when that is longer), so that a holder whose cancel message is
    /// lost still finds it at its next renewal.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub ttl: Duration,
}

#[derive(Debug, Args)]
pub struct LimitArgs {
    /// The new limit: how many tasks may run at once, fleet-wide.
    #[arg(value_name = "N")]
    pub limit: u64,
    /// Its version; default: one above the stored version. A version below the stored one, or
    /// the stored version with another limit, changes nothing (exit 78); the stored limit and
    /// version again is a no-op (exit 0).
    #[arg(long, value_name = "V")]
    pub limit_version: Option<u64>,
}

#[derive(Debug, Args)]
pub struct ReleaseArgs {
    /// The task whose lease to remove.
    pub task_id: String,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Port of the page on 127.0.0.1; a free port is used if this one is taken (0: any).
    #[arg(long, default_value_t = 7411)]
    pub port: u16,
    /// Slots shared by all tasks.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub limit: u32,
    /// Chance that a task crashes at its end instead of giving its slot back.
    #[arg(long, default_value_t = 0.1, value_name = "P")]
    pub crash_probability: f64,
    /// Lease ttl, also the TTL of the TTL counter's key.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// Mean time a task holds its slot (each holds between half and 1.5 times it).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub task_duration: Duration,
    /// Time-lapse factor: every duration, the ttl included, is divided by it (0.1 to 10; at
    /// most 500 tasks are submitted per second: 0.8 × limit × speed / task duration).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Seed of the task schedule: the same seed gives the same tasks and crashes (at most
    /// 2^53 - 1, so that the page shows it exactly).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Run without the page and print a summary per semantics.
    #[arg(long)]
    pub headless: bool,
    /// With --headless: how long tasks are submitted.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// With --headless: print the summary as JSON.
    #[arg(long, requires = "headless")]
    pub json: bool,
}
