//! A worker process for the chaos suite (`tests/chaos.rs`): it takes leases from a Redis-backed
//! quota, runs "protected work" under each, and keeps its own record of when that work actually
//! ran, independent of the library's state.
//!
//! ```text
//! chaos_worker url=URL quota=NAME limit=N ttl_ms=MS worker=K gen=G run_ms=MS
//!              hold_ms=MIN-MAX log=PATH quiet=PATH [seed=S] [policy=closed|open|degrade:N]
//! ```
//!
//! `policy` is the quota's [`BackendDownPolicy`] (default `closed`: fail closed).
//!
//! Loop until `run_ms` has passed: unless the file `quiet` exists, acquire the task id
//! `w{K}.{G}-{SEQ}` (SEQ counts up; a retry after an error or a timed-out wait keeps the same id,
//! which is the safe way to resolve an ambiguous acquire), work for a random time in `hold_ms`
//! in 20 ms chunks, stopping at once when the lease is lost or the task cancelled, then release.
//!
//! Every line appended to `log` (flushed at once; times are `CLOCK_MONOTONIC` nanoseconds,
//! comparable across processes on one machine):
//!
//! ```text
//! begin PID T                     the process started
//! start ID TOKEN T HOLD_MS        the lease was granted; protected work starts now (TOKEN 0:
//!                                 granted locally by the backend-down policy)
//! work ID START END OUTCOME       protected work ran from START to END; OUTCOME is completed,
//!                                 cancelled, or lost-<reason> (expired, local-deadline, ...)
//! cancel ID T                     the cancel was observed (lost() fired with Cancelled)
//! stale ID T                      the work finished while `is_held()` still said true although
//!                                 the lease's local deadline had passed (a library bug)
//! refused ID T                    the acquire was refused: the task was cancelled before it ran
//! error T KIND MESSAGE            a call failed (KIND: connect, acquire, release)
//! idle PHASE T                    the quiet file appeared (its content is PHASE); no new work
//! end T                           run_ms has passed
//! ```

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use leasehold::{BackendDownPolicy, Error, Lease, LostReason, Quota, RedisBackend};
use leasehold_testkit::monotonic_ns;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

/// Work runs in chunks of at most this long, checking the lease between them.
const CHUNK: Duration = Duration::from_millis(20);
/// How long one acquire waits before the worker looks at the quiet file again. Longer than the
/// backend's call timeout (1 s), so that an acquire during an outage ends with the
/// backend-down policy's answer rather than with this wait.
const ACQUIRE_WAIT: Duration = Duration::from_millis(1500);
/// Pause after a failed call, so a dead backend is not hammered.
const ERROR_BACKOFF: Duration = Duration::from_millis(50);
/// How often an idle (quiet) worker looks at the quiet file.
const QUIET_POLL: Duration = Duration::from_millis(20);

/// The command line, as `key=value` pairs.
struct Args {
    url: String,
    quota: String,
    limit: u64,
    ttl: Duration,
    worker: u32,
    generation: u32,
    run: Duration,
    hold_ms: (u64, u64),
    log: PathBuf,
    quiet: PathBuf,
    seed: u64,
    policy: BackendDownPolicy,
}

impl Args {
    fn parse() -> Args {
        let pairs: Vec<(String, String)> = std::env::args()
            .skip(1)
            .map(|a| match a.split_once('=') {
                Some((k, v)) => (k.to_owned(), v.to_owned()),
                None => panic!("argument {a:?} is not key=value; see the module doc"),
            })
            .collect();
        let get = |key: &str| -> String {
            pairs
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("missing argument {key}=...; see the module doc"))
        };
        let num = |key: &str| -> u64 {
            get(key)
                .parse()
                .unwrap_or_else(|e| panic!("argument {key}: {e}"))
        };
        let hold = get("hold_ms");
        let (lo, hi) = hold
            .split_once('-')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
            .filter(|(a, b)| a <= b)
            .unwrap_or_else(|| panic!("hold_ms={hold:?} is not MIN-MAX"));
        let optional = |key: &str| pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        let policy = match optional("policy").as_deref() {
            None | Some("closed") => BackendDownPolicy::FailClosed,
            Some("open") => BackendDownPolicy::FailOpen,
            Some(other) => match other.strip_prefix("degrade:").map(str::parse) {
                Some(Ok(share)) => BackendDownPolicy::DegradeLocal { share },
                _ => panic!("policy={other:?} is not closed, open or degrade:N"),
            },
        };
        let worker = num("worker") as u32;
        let generation = num("gen") as u32;
        Args {
            url: get("url"),
            quota: get("quota"),
            limit: num("limit"),
            ttl: Duration::from_millis(num("ttl_ms")),
            worker,
            generation,
            run: Duration::from_millis(num("run_ms")),
            hold_ms: (lo, hi),
            log: get("log").into(),
            quiet: get("quiet").into(),
            seed: optional("seed").and_then(|v| v.parse().ok()).unwrap_or(0)
                ^ (u64::from(worker) << 32 | u64::from(generation)),
            policy,
        }
    }
}

/// The append-only record; every line is written with one call and flushed.
struct Record(File);

impl Record {
    fn line(&mut self, text: String) {
        let line = text + "\n";
        self.0
            .write_all(line.as_bytes())
            .and_then(|()| self.0.flush())
            .unwrap_or_else(|e| panic!("cannot write the worker log: {e}"));
    }
}

fn one_line(e: &Error) -> String {
    e.to_string().replace(['\n', '\r'], " ")
}

// A wildcard arm keeps the worker building when the library adds a reason.
#[allow(unreachable_patterns)]
fn outcome(reason: &LostReason) -> &'static str {
    match reason {
        LostReason::Cancelled(_) => "cancelled",
        LostReason::Expired => "lost-expired",
        LostReason::ReleasedElsewhere => "lost-released-elsewhere",
        LostReason::Superseded => "lost-superseded",
        LostReason::LocalDeadline => "lost-local-deadline",
        LostReason::RenewalRefused(_) => "lost-renewal-refused",
        LostReason::Released => "lost-released",
        _ => "lost-other",
    }
}

/// Runs the protected work under `lease` for `hold`; returns the outcome, when the work stopped
/// (ns) and whether the library still called the lease held past its local deadline.
async fn work(lease: &Lease, hold: Duration) -> (&'static str, u128, bool) {
    let until = Instant::now() + hold;
    loop {
        if !lease.is_held() {
            let reason = lease.lost_reason().unwrap_or(LostReason::LocalDeadline);
            return (outcome(&reason), monotonic_ns(), false);
        }
        let now = Instant::now();
        if now >= until {
            let end = monotonic_ns();
            let stale = lease.is_held() && std::time::Instant::now() >= lease.local_deadline();
            return ("completed", end, stale);
        }
        tokio::select! {
            _ = tokio::time::sleep(CHUNK.min(until - now)) => {}
            reason = lease.lost() => return (outcome(&reason), monotonic_ns(), false),
        }
    }
}

async fn connect(args: &Args, record: &mut Record, end: Instant) -> Option<Quota> {
    while Instant::now() < end {
        match RedisBackend::connect(&args.url).await {
            Ok(backend) => {
                let quota = Quota::builder(args.quota.as_str())
                    .limit(args.limit)
                    .ttl(args.ttl)
                    .when_backend_down(args.policy)
                    .backend(backend)
                    .build()
                    .unwrap_or_else(|e| panic!("bad quota settings: {e}"));
                return Some(quota);
            }
            Err(e) => {
                record.line(format!("error {} connect {}", monotonic_ns(), one_line(&e)));
                tokio::time::sleep(ERROR_BACKOFF * 2).await;
            }
        }
    }
    None
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    let end = Instant::now() + args.run;
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.log)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", args.log.display()));
    let mut record = Record(file);
    record.line(format!("begin {} {}", std::process::id(), monotonic_ns()));
    let mut rng = StdRng::seed_from_u64(args.seed);
    let Some(quota) = connect(&args, &mut record, end).await else {
        record.line(format!("end {}", monotonic_ns()));
        return;
    };
    let mut seq = 0u64;
    let mut idle_in: Option<String> = None;
    while Instant::now() < end {
        if let Ok(phase) = std::fs::read_to_string(&args.quiet) {
            if idle_in.as_deref() != Some(phase.as_str()) {
                record.line(format!("idle {} {}", phase.trim(), monotonic_ns()));
                idle_in = Some(phase);
            }
            tokio::time::sleep(QUIET_POLL).await;
            continue;
        }
        idle_in = None;
        let id = format!("w{}.{}-{seq}", args.worker, args.generation);
        let lease = match quota.acquire_timeout(&id, ACQUIRE_WAIT).await {
            Ok(lease) => lease,
            Err(Error::TimedOut { .. }) => continue,
            Err(Error::Cancelled(_)) => {
                record.line(format!("refused {id} {}", monotonic_ns()));
                seq += 1;
                continue;
            }
            Err(e) => {
                record.line(format!("error {} acquire {}", monotonic_ns(), one_line(&e)));
                tokio::time::sleep(ERROR_BACKOFF).await;
                continue;
            }
        };
        let start = monotonic_ns();
        let hold_ms = rng.random_range(args.hold_ms.0..=args.hold_ms.1);
        let token = lease.fencing_token();
        record.line(format!("start {id} {token} {start} {hold_ms}"));
        let (outcome, stop, stale) = work(&lease, Duration::from_millis(hold_ms)).await;
        record.line(format!("work {id} {start} {stop} {outcome}"));
        if outcome == "cancelled" {
            record.line(format!("cancel {id} {stop}"));
        }
        if stale {
            record.line(format!("stale {id} {stop}"));
        }
        if let Err(e) = lease.release().await {
            record.line(format!("error {} release {}", monotonic_ns(), one_line(&e)));
        }
        seq += 1;
    }
    record.line(format!("end {}", monotonic_ns()));
}
