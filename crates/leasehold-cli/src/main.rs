//! `leasehold`: the command line of the leasehold library. See `leasehold --help` and
//! docs/CLI.md.

/// `eprintln!` that ignores a stderr nobody reads any more (a log collector that died,
/// `2>&1 | head -1`): `eprintln!` would panic, and every documented exit code would become a
/// panic's 101 (found by review).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod cli;
mod demo;
mod exit;
mod job;
mod output;
mod run;
mod status;

use std::time::Duration;

use clap::Parser;

use leasehold::backend::{LimitUpdate, VersionedLimit};
use leasehold::{
    validate_cancel_reason, validate_task_id, Error, Misconfiguration, Quota, RedisBackend,
};

use cli::{Cli, Command};
use exit::Failure;

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            // One line, not clap's page of usage: scripts log stderr. The error's own lines
            // (e.g. which arguments are missing) come before the usage and are kept.
            let text = e.to_string();
            let error: Vec<&str> = text
                .lines()
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            let error = error.join(" ");
            let error = error.strip_prefix("error: ").unwrap_or(&error);
            let error = if error.is_empty() {
                "invalid arguments"
            } else {
                error
            };
            fail(Failure::new(
                exit::USAGE,
                format!("{error} (see leasehold --help)"),
            ))
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => fail(Failure::new(exit::SOFTWARE, format!("cannot start: {e}"))),
    };
    match runtime.block_on(dispatch(cli)) {
        Ok(code) => std::process::exit(code),
        Err(failure) => fail(failure),
    }
}

fn fail(failure: Failure) -> ! {
    let line = failure.one_line();
    if !line.is_empty() {
        say!("leasehold: {line}");
    }
    std::process::exit(failure.code)
}

async fn dispatch(cli: Cli) -> Result<i32, Failure> {
    // The demo brings its own quota and needs no Redis.
    if let Command::Demo(args) = cli.command {
        return demo::run(args, cli.redis).await;
    }
    let verb = match &cli.command {
        Command::Run(_) => "run",
        Command::Status(_) => "status",
        Command::Cancel(_) => "cancel",
        Command::Release(_) => "release",
        Command::Limit(_) => "limit",
        Command::Demo(_) => unreachable!("dispatched above"),
    };
    let name = cli.quota.clone().ok_or_else(|| {
        Failure::new(
            exit::USAGE,
            format!("`leasehold {verb}` needs --quota NAME (or LEASEHOLD_QUOTA)"),
        )
    })?;
    let url = cli.redis.clone().ok_or_else(|| {
        Failure::new(
            exit::USAGE,
            format!(
                "`leasehold {verb}` needs --redis URL (or LEASEHOLD_REDIS_URL): without Redis \
                 the quota would exist only inside this one process"
            ),
        )
    })?;
    // Everything the user typed is checked before the first network call: bad input is exit 78
    // whether or not Redis can be reached.
    let base = |limit: u64| Quota::builder(name.clone()).limit(limit);
    let settings = match &cli.command {
        Command::Run(args) => {
            if let Some(id) = &args.task_id {
                validate_task_id(id)?;
            }
            let b = base(args.limit)
                .limit_version(args.limit_version)
                .ttl(args.ttl);
            match args.heartbeat {
                Some(every) => b.heartbeat(every),
                None => b,
            }
        }
        // Only shown when Redis stores no limit; 1 is a placeholder when unknown.
        Command::Status(args) => base(args.limit.unwrap_or(1)),
        Command::Cancel(args) => {
            validate_task_id(&args.task_id)?;
            validate_cancel_reason(&args.reason)?;
            base(1).ttl(args.ttl)
        }
        Command::Release(args) => {
            validate_task_id(&args.task_id)?;
            base(1).ttl(Duration::from_secs(10))
        }
        // The new limit and version are checked here like a run's.
        Command::Limit(args) => base(args.limit).limit_version(args.limit_version.unwrap_or(0)),
        Command::Demo(_) => unreachable!("dispatched above"),
    };
    settings.check()?;
    let backend = RedisBackend::connect(&url).await?;
    let quota = settings.backend(backend).build()?;
    match cli.command {
        Command::Run(args) => run::run(quota, args, cli.verbose).await,
        Command::Status(args) => status::print(&quota, args.limit.is_some(), args.json).await,
        Command::Cancel(args) => {
            let held = quota.cancel(&args.task_id, &args.reason).await?;
            output::tell(&format!(
                "{}: cancel marker written{}\n",
                args.task_id,
                if held {
                    "; it held a lease"
                } else {
                    "; it held no lease (queued or not started)"
                }
            ));
            Ok(0)
        }
        Command::Demo(_) => unreachable!("dispatched above"),
        Command::Limit(args) => {
            let limit = quota.limit();
            let key = leasehold::QuotaKeys::new(quota.name())?.limit;
            // The library's refusals speak of `set_limit`; here the limit and version came from
            // the command line.
            let update = match quota.set_limit(limit, args.limit_version).await {
                Err(Error::Misconfigured(Misconfiguration::LimitVersionTaken {
                    asked,
                    stored,
                    version,
                })) => {
                    return Err(Failure::new(
                        exit::CONFIG,
                        format!(
                            "limit mismatch: limit {asked} asked at version {version}, but the \
                             quota stores limit {stored} under that version; {}",
                            higher_version(version, &key)
                        ),
                    ))
                }
                // A limit kept at the last version: said below, as any kept limit.
                Err(Error::Misconfigured(Misconfiguration::LimitVersionsExhausted {
                    stored,
                    ..
                })) => LimitUpdate::Kept(VersionedLimit {
                    limit: stored,
                    version: leasehold::MAX_LIMIT_VERSION,
                }),
                other => other?,
            };
            match update {
                LimitUpdate::Stored(now) => {
                    output::tell(&format!(
                        "limit {} (version {}) stored; runs admit against it from their next \
                         acquire\n",
                        now.limit, now.version
                    ));
                    Ok(0)
                }
                // The same command again: nothing to do. (The same N at an older version was
                // refused, like any older version.)
                LimitUpdate::Kept(stored)
                    if stored.limit == limit && args.limit_version == Some(stored.version) =>
                {
                    output::tell(&format!(
                        "limit {} (version {}) already stored\n",
                        stored.limit, stored.version
                    ));
                    Ok(0)
                }
                LimitUpdate::Kept(stored) | LimitUpdate::Mismatch(stored) => Err(Failure::new(
                    exit::CONFIG,
                    format!(
                        "not changed: limit {} is stored at version {}; {}",
                        stored.limit,
                        stored.version,
                        higher_version(stored.version, &key)
                    ),
                )),
                other => Err(Failure::new(
                    exit::SOFTWARE,
                    format!("unexpected answer of this library version: {other:?}"),
                )),
            }
        }
        Command::Release(args) => {
            if quota.force_release(&args.task_id).await? {
                output::tell(&format!("{}: released\n", args.task_id));
                Ok(0)
            } else {
                output::tell(&format!("{}: held no lease\n", args.task_id));
                Ok(exit::NOT_HELD)
            }
        }
    }
}

/// What changes a limit stored at `version`: a higher `--limit-version`, or, at the last version,
/// deleting the quota's limit key `key` (docs/PROTOCOL.md §3).
fn higher_version(version: u64, key: &str) -> String {
    if version < leasehold::MAX_LIMIT_VERSION {
        return format!("pass a --limit-version above {version} to change the limit");
    }
    format!(
        "no version is above it: to change the limit, delete the quota's limit key {key:?} in \
         Redis; the next run or `leasehold limit` then stores one again"
    )
}
