//! Throughput and contention benchmark of leasehold on Redis.
//!
//! It starts its own private `redis-server` (through `leasehold-testkit`, never a pre-existing
//! one), drives it from a multi-thread tokio runtime and, in one run, measures:
//!
//! 1. uncontended `acquire` + `release` cycles/s at 1, 16 and 64 concurrent tasks (limit 10 000,
//!    a unique task id per cycle);
//! 2. the naive counter floor at the same concurrency (`INCR` then `DECR` of one key, sent through
//!    [`RedisBackend::call`], the very client path leasehold's own calls take), and the ratio
//!    leasehold / floor per level;
//! 3. contention: limit 10, 64 tasks each holding ~1 ms: cycles/s against limit / hold,
//!    acquire-wait percentiles, release-to-admission wake-up latency and Redis calls per
//!    admission (from `INFO commandstats`, which also gives the commands run inside the scripts);
//! 4. a summary table, and the same figures as one `BENCH_JSON {...}` line for tooling.
//!
//! Every phase also reports where the CPU went (this process split by thread, the Redis server,
//! the rest of the machine, hypervisor steal), because client and server share the machine.
//! Targets are reported as PASS/MISS; a miss does not fail the run. Metric definitions are in
//! `docs/BENCHMARKS.md`.
//!
//! Run: `cargo bench -p leasehold --bench throughput`. Each measurement lasts
//! `LEASEHOLD_BENCH_SECS` seconds (default 3) after a 0.5 s warm-up; the default run takes
//! about 30 s. `LEASEHOLD_BENCH_REDIS_ARGS` adds command-line arguments to the private
//! redis-server (server settings to compare).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use leasehold::{Error, Quota, RedisBackend};
use leasehold_testkit::{RedisServer, Reply};
use serde_json::{json, Value};

/// Concurrency levels of the uncontended phases.
const LEVELS: [usize; 3] = [1, 16, 64];
/// Warm-up before every measured window; cycles in it are not counted as throughput.
const WARMUP: Duration = Duration::from_millis(500);
/// Default measured window; `LEASEHOLD_BENCH_SECS` overrides it.
const DEFAULT_SECS: f64 = 3.0;
/// Limit of the uncontended quotas: never reached.
const UNCONTENDED_LIMIT: u64 = 10_000;
/// Contention phase: limit, tasks and nominal hold.
const CONTENDED_LIMIT: u64 = 10;
const CONTENDED_TASKS: usize = 64;
const NOMINAL_HOLD: Duration = Duration::from_millis(1);
/// Bound on one contended acquire; a timed-out acquire is counted and reported.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// Lease ttl of every quota (long enough that nothing expires during a phase).
const TTL: Duration = Duration::from_secs(10);
/// Largest value the histograms keep, in microseconds (60 s).
const HIST_MAX_US: u64 = 60_000_000;
/// How long the end of a phase may take (tasks finishing their last cycle) before it is aborted.
const DRAIN_LIMIT: Duration = Duration::from_secs(15);

const TARGET_RATIO_64: f64 = 0.7;
const TARGET_CONTENDED_FRACTION: f64 = 0.9;
const TARGET_WAIT_P99_MS: f64 = 20.0;
const TARGET_WAKE_P50_MS: f64 = 0.5;

fn histogram() -> Histogram<u64> {
    Histogram::new_with_max(HIST_MAX_US, 3).expect("valid histogram bounds")
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Microseconds to milliseconds.
fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn verdict(pass: bool) -> &'static str {
    if pass {
        "PASS"
    } else {
        "MISS"
    }
}

/// The time frame of one phase: warm-up from its start, then the measured window `[from, end]`.
#[derive(Clone, Copy)]
struct Window {
    from: Instant,
    end: Instant,
}

impl Window {
    fn new(measure: Duration) -> Window {
        let start = Instant::now();
        Window {
            from: start + WARMUP,
            end: start + WARMUP + measure,
        }
    }

    fn contains(&self, t: Instant) -> bool {
        t >= self.from && t <= self.end
    }

    fn secs(&self) -> f64 {
        (self.end - self.from).as_secs_f64()
    }
}

// ---------------------------------------------------------------------------------------------
// Where the CPU goes: this process (by thread), the Redis server, the machine, steal.
// ---------------------------------------------------------------------------------------------

/// Clock ticks per second of `/proc` CPU counters.
fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

/// CPU seconds (user + system) of this process's live threads, summed by thread name.
fn thread_cpu() -> HashMap<String, f64> {
    let mut out = HashMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    let ticks = clock_ticks();
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // "tid (comm) state ppid ... utime stime ...": the name may hold spaces and parentheses.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_owned();
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // After the name: state is field 3 of stat(5), utime field 14, stime field 15.
        let num = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
        if let (Some(user), Some(system)) = (num(11), num(12)) {
            *out.entry(name).or_insert(0.0) += (user + system) / ticks;
        }
    }
    out
}

/// Machine-wide (busy, steal) CPU seconds since boot, from the first line of `/proc/stat`.
fn machine_cpu() -> (f64, f64) {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return (0.0, 0.0);
    };
    let fields: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let at = |i: usize| fields.get(i).copied().unwrap_or(0.0);
    // user nice system idle iowait irq softirq steal ...
    let busy = at(0) + at(1) + at(2) + at(5) + at(6);
    (busy / clock_ticks(), at(7) / clock_ticks())
}

/// CPU time (user + system) of this whole process, every thread included, in seconds.
fn process_cpu_secs() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage only writes into the struct it is given, which is large enough.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return 0.0;
    }
    // SAFETY: getrusage returned 0, so it filled the struct (which started zeroed anyway).
    let usage = unsafe { usage.assume_init() };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// The `field:value` lines of an `INFO` reply.
fn info(server: &RedisServer, section: &str) -> HashMap<String, String> {
    let reply = server.command(&["INFO", section]);
    let text = match &reply {
        Reply::Bulk(_) | Reply::Status(_) => reply.as_string().unwrap_or_default(),
        other => panic!("INFO {section} replied {other:?}"),
    };
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

/// Process CPU, Redis CPU, machine CPU and Redis command statistics at one instant.
struct Probe {
    at: Instant,
    client_cpu: f64,
    threads: HashMap<String, f64>,
    redis_cpu: f64,
    machine_busy: f64,
    machine_steal: f64,
    /// Command name (without `cmdstat_`) -> (calls, usec).
    commands: HashMap<String, (u64, u64)>,
}

fn probe(server: &RedisServer) -> Probe {
    let cpu = info(server, "cpu");
    let num = |k: &str| {
        cpu.get(k)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let redis_cpu = num("used_cpu_user") + num("used_cpu_sys");
    let commands = info(server, "commandstats")
        .into_iter()
        .filter_map(|(k, v)| {
            let name = k.strip_prefix("cmdstat_")?.to_owned();
            let field = |f: &str| {
                v.split(',')
                    .find_map(|kv| kv.strip_prefix(f)?.strip_prefix('='))
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            Some((name, (field("calls"), field("usec"))))
        })
        .collect();
    let (machine_busy, machine_steal) = machine_cpu();
    Probe {
        at: Instant::now(),
        client_cpu: process_cpu_secs(),
        threads: thread_cpu(),
        redis_cpu,
        machine_busy,
        machine_steal,
        commands,
    }
}

/// What happened on the Redis server, in this process and on the machine between two probes.
/// CPU figures are in cores (CPU seconds per wall second).
struct Usage {
    wall: f64,
    client: f64,
    leasehold_runtime: f64,
    tokio_workers: f64,
    redis: f64,
    others: f64,
    steal: f64,
    /// Command -> (calls, usec) during the phase. Commands run inside scripts count too.
    commands: HashMap<String, (u64, u64)>,
}

impl Usage {
    fn between(before: &Probe, after: &Probe) -> Usage {
        let wall = (after.at - before.at).as_secs_f64().max(1e-9);
        let thread = |prefix: &str| {
            after
                .threads
                .iter()
                .filter(|(name, _)| name.starts_with(prefix))
                .map(|(name, cpu)| cpu - before.threads.get(name).copied().unwrap_or(0.0))
                .sum::<f64>()
                / wall
        };
        let commands = after
            .commands
            .iter()
            .map(|(name, &(calls, usec))| {
                let (c0, u0) = before.commands.get(name).copied().unwrap_or((0, 0));
                (
                    name.clone(),
                    (calls.saturating_sub(c0), usec.saturating_sub(u0)),
                )
            })
            .filter(|(_, (calls, _))| *calls > 0)
            .collect();
        let client = (after.client_cpu - before.client_cpu) / wall;
        let redis = (after.redis_cpu - before.redis_cpu) / wall;
        let busy = (after.machine_busy - before.machine_busy) / wall;
        Usage {
            wall,
            client,
            // Linux truncates thread names to 15 bytes: "leasehold-runtime" reads "leasehold-runti".
            leasehold_runtime: thread("leasehold-run"),
            tokio_workers: thread("tokio-runtime-w") + thread("tokio-rt-worker"),
            redis,
            others: (busy - client - redis).max(0.0),
            steal: (after.machine_steal - before.machine_steal) / wall,
            commands,
        }
    }

    fn calls(&self, name: &str) -> u64 {
        self.commands.get(name).map_or(0, |c| c.0)
    }

    /// Redis-side µs per call of `names` together (time inside the command, scripts' inner
    /// commands included, as `INFO commandstats` reports it).
    fn usec_per_call(&self, names: &[&str]) -> f64 {
        let (calls, usec) = names
            .iter()
            .filter_map(|n| self.commands.get(*n))
            .fold((0, 0), |(c, u), &(c1, u1)| (c + c1, u + u1));
        usec as f64 / calls.max(1) as f64
    }

    /// Script invocations: EVALSHA + EVAL (+ SCRIPT LOAD, a round trip too).
    fn script_calls(&self) -> u64 {
        self.calls("evalsha") + self.calls("eval") + self.calls("script|load")
    }

    fn describe(&self) -> String {
        format!(
            "client {:.2} (leasehold-runtime thread {:.2}, tokio workers {:.2}), redis-server {:.2}, \
             other processes {:.2}, steal {:.2}",
            self.client,
            self.leasehold_runtime,
            self.tokio_workers,
            self.redis,
            self.others,
            self.steal
        )
    }

    fn json(&self) -> Value {
        json!({
            "client": round2(self.client),
            "leasehold_runtime_thread": round2(self.leasehold_runtime),
            "tokio_workers": round2(self.tokio_workers),
            "redis_server": round2(self.redis),
            "other_processes": round2(self.others),
            "steal": round2(self.steal),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Uncontended closed loops.
// ---------------------------------------------------------------------------------------------

/// Result of one closed-loop throughput phase.
struct Throughput {
    /// Cycles completed inside the measured window, per second.
    per_sec: f64,
    /// Latency of the cycles completed inside the window, µs.
    latency: Histogram<u64>,
    /// Cycles completed during the whole phase (warm-up and drain included).
    total_cycles: u64,
    errors: u64,
    usage: Usage,
    /// Client commands per cycle (scripts for leasehold, INCR + DECR for the floor).
    calls_per_cycle: f64,
    /// Redis-side µs per client command.
    redis_us_per_call: f64,
    /// Commands run inside the client's commands (scripts): (name, calls per cycle, µs per
    /// cycle), most expensive first.
    inner: Vec<(String, f64, f64)>,
}

impl Throughput {
    /// CPU µs per cycle over the whole phase, for a figure in cores.
    fn us_per_cycle(&self, cores: f64) -> f64 {
        cores * self.usage.wall * 1e6 / self.total_cycles.max(1) as f64
    }

    fn json(&self) -> Value {
        json!({
            "cycles_per_sec": self.per_sec.round(),
            "p50_ms": ms(self.latency.value_at_quantile(0.5)),
            "p99_ms": ms(self.latency.value_at_quantile(0.99)),
            "errors": self.errors,
            "redis_calls_per_cycle": round2(self.calls_per_cycle),
            "redis_us_per_call": round2(self.redis_us_per_call),
            "client_cpu_us_per_cycle": round2(self.us_per_cycle(self.usage.client)),
            "redis_cpu_us_per_cycle": round2(self.us_per_cycle(self.usage.redis)),
            "cores": self.usage.json(),
            "inside_scripts_per_cycle": self.inner.iter()
                .map(|(name, calls, us)| (name.clone(), json!({"calls": round2(*calls), "us": round2(*us)})))
                .collect::<serde_json::Map<_, _>>(),
        })
    }

    fn describe(&self) -> String {
        let mut text = format!(
            "{:.2} calls/cycle, {:.1} µs in redis per call; cpu per cycle: client {:.1} µs, \
             redis {:.1} µs; cores: {}",
            self.calls_per_cycle,
            self.redis_us_per_call,
            self.us_per_cycle(self.usage.client),
            self.us_per_cycle(self.usage.redis),
            self.usage.describe()
        );
        if !self.inner.is_empty() {
            let inner: Vec<String> = self
                .inner
                .iter()
                .map(|(name, calls, us)| format!("{name} {calls:.2}× {us:.2} µs"))
                .collect();
            text.push_str(&format!(
                "\n               inside scripts, per cycle: {}",
                inner.join(", ")
            ));
        }
        text
    }
}

/// Runs `cycle(task, i)` in a closed loop on `tasks` concurrent tasks for the warm-up plus the
/// measured window, counting the cycles that complete inside the window. `calls` names the
/// client commands one cycle sends.
fn closed_loop<F, Fut>(
    rt: &tokio::runtime::Runtime,
    server: &RedisServer,
    tasks: usize,
    measure: Duration,
    calls: &[&str],
    cycle: F,
) -> Throughput
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), Error>> + Send + 'static,
{
    let before = probe(server);
    let cycle = Arc::new(cycle);
    let window = Window::new(measure);
    let per_task = rt.block_on(async {
        let handles: Vec<_> = (0..tasks)
            .map(|task| {
                let cycle = cycle.clone();
                tokio::spawn(async move {
                    let mut latency = histogram();
                    let (mut in_window, mut total, mut errors) = (0u64, 0u64, 0u64);
                    let mut i = 0u64;
                    loop {
                        let t0 = Instant::now();
                        if t0 >= window.end {
                            break;
                        }
                        let result = cycle(task, i).await;
                        i += 1;
                        let t1 = Instant::now();
                        if let Err(e) = result {
                            if errors == 0 {
                                eprintln!("task {task}: cycle failed: {e}");
                            }
                            errors += 1;
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                        total += 1;
                        if window.contains(t1) {
                            in_window += 1;
                            latency.saturating_record(micros(t1 - t0));
                        }
                    }
                    (in_window, total, errors, latency)
                })
            })
            .collect();
        join_bounded(handles, window.end + DRAIN_LIMIT).await
    });
    let usage = Usage::between(&before, &probe(server));
    let mut latency = histogram();
    let (mut in_window, mut total_cycles, mut errors) = (0, 0, 0);
    for (w, t, e, h) in per_task {
        in_window += w;
        total_cycles += t;
        errors += e;
        latency.add(&h).expect("same histogram bounds");
    }
    let sent: u64 = calls.iter().map(|c| usage.calls(c)).sum();
    let cycles = total_cycles.max(1) as f64;
    let mut inner: Vec<(String, f64, f64)> = usage
        .commands
        .iter()
        .filter(|(name, _)| {
            !calls.contains(&name.as_str()) && !matches!(name.as_str(), "info" | "script|load")
        })
        .map(|(name, &(n, usec))| (name.clone(), n as f64 / cycles, usec as f64 / cycles))
        .collect();
    inner.sort_by(|a, b| b.2.total_cmp(&a.2));
    Throughput {
        inner,
        per_sec: in_window as f64 / window.secs(),
        latency,
        total_cycles,
        errors,
        calls_per_cycle: sent as f64 / total_cycles.max(1) as f64,
        redis_us_per_call: usage.usec_per_call(calls),
        usage,
    }
}

/// Joins every task, aborting those still running at `deadline` (reported, then skipped).
async fn join_bounded<T: Send + 'static>(
    handles: Vec<tokio::task::JoinHandle<T>>,
    deadline: Instant,
) -> Vec<T> {
    let mut out = Vec::with_capacity(handles.len());
    for mut handle in handles {
        match tokio::time::timeout_at(deadline.into(), &mut handle).await {
            Ok(Ok(value)) => out.push(value),
            Ok(Err(e)) => eprintln!("benchmark task failed: {e}"),
            Err(_) => {
                eprintln!("benchmark task still running after the drain limit; aborted");
                handle.abort();
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Contention.
// ---------------------------------------------------------------------------------------------

/// One contended cycle as seen by its task.
struct Cycle {
    /// `acquire_timeout` called.
    asked: Instant,
    /// Lease returned to the task.
    admitted: Instant,
    /// Hold (sleep) over, `release` called.
    held: Instant,
    /// `release().await` returned.
    released: Instant,
}

struct Contended {
    per_sec: f64,
    admissions_total: u64,
    mean_hold: Duration,
    mean_occupancy: Duration,
    wait: Histogram<u64>,
    wake: Histogram<u64>,
    wake_from_release_call: Histogram<u64>,
    waited_admissions: u64,
    timeouts: u64,
    errors: u64,
    usage: Usage,
}

/// The holder's work: `NOMINAL_HOLD`, kept precisely. tokio's timer wheel ticks every 1 ms and
/// rounds a sleep up, so `tokio::time::sleep(1 ms)` held 2.1 to 2.35 ms on average here and lined
/// all holders up on the same ticks. A blocking-pool thread's `std::thread::sleep`, with the hop
/// back to the task, holds 1.15 to 1.32 ms here.
async fn hold() {
    tokio::task::spawn_blocking(|| std::thread::sleep(NOMINAL_HOLD))
        .await
        .expect("the hold thread does not panic");
}

fn contended(
    rt: &tokio::runtime::Runtime,
    server: &RedisServer,
    backend: &RedisBackend,
    measure: Duration,
) -> Contended {
    let quota = Quota::builder(format!("bench-{}-contended", std::process::id()))
        .limit(CONTENDED_LIMIT)
        .ttl(TTL)
        .backend(backend.clone())
        .build()
        .expect("valid quota");
    let before = probe(server);
    let window = Window::new(measure);
    let per_task = rt.block_on(async {
        let handles: Vec<_> = (0..CONTENDED_TASKS)
            .map(|task| {
                let quota = quota.clone();
                tokio::spawn(async move {
                    let mut cycles = Vec::new();
                    // Waits of the acquires that started inside the window, however they ended.
                    let mut waits = Vec::new();
                    let (mut timeouts, mut errors) = (0u64, 0u64);
                    let mut i = 0u64;
                    loop {
                        let asked = Instant::now();
                        if asked >= window.end {
                            break;
                        }
                        let id = format!("c{task}-{i}");
                        i += 1;
                        match quota.acquire_timeout(&id, ACQUIRE_TIMEOUT).await {
                            Ok(lease) => {
                                let admitted = Instant::now();
                                if window.contains(asked) {
                                    waits.push(admitted - asked);
                                }
                                hold().await;
                                let held = Instant::now();
                                let result = lease.release().await;
                                let released = Instant::now();
                                if let Err(e) = result {
                                    if errors == 0 {
                                        eprintln!("contended release failed: {e}");
                                    }
                                    errors += 1;
                                }
                                cycles.push(Cycle {
                                    asked,
                                    admitted,
                                    held,
                                    released,
                                });
                            }
                            Err(Error::TimedOut { .. }) => {
                                if window.contains(asked) {
                                    waits.push(ACQUIRE_TIMEOUT);
                                }
                                timeouts += 1;
                            }
                            Err(e) => {
                                if errors == 0 {
                                    eprintln!("contended acquire failed: {e}");
                                }
                                errors += 1;
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                        }
                    }
                    (cycles, waits, timeouts, errors)
                })
            })
            .collect();
        join_bounded(handles, window.end + DRAIN_LIMIT).await
    });
    let usage = Usage::between(&before, &probe(server));
    drop(quota);

    let mut cycles = Vec::new();
    let mut wait = histogram();
    let (mut timeouts, mut errors) = (0, 0);
    for (c, waits, t, e) in per_task {
        cycles.extend(c);
        for w in waits {
            wait.saturating_record(micros(w));
        }
        timeouts += t;
        errors += e;
    }
    let admissions_total = cycles.len() as u64;
    let mut release_done: Vec<Instant> = cycles.iter().map(|c| c.released).collect();
    release_done.sort_unstable();
    let mut release_called: Vec<Instant> = cycles.iter().map(|c| c.held).collect();
    release_called.sort_unstable();
    // The latest instant of `sorted` strictly before `t`, if it is after `after`.
    let latest_before = |sorted: &[Instant], t: Instant, after: Instant| {
        let idx = sorted.partition_point(|&r| r < t);
        idx.checked_sub(1).map(|i| sorted[i]).filter(|&r| r > after)
    };
    let (mut wake, mut wake_from_release_call) = (histogram(), histogram());
    let mut waited_admissions = 0;
    let (mut completed, mut hold_sum, mut occupancy_sum) = (0u64, Duration::ZERO, Duration::ZERO);
    for c in &cycles {
        if window.contains(c.released) {
            completed += 1;
        }
        hold_sum += c.held - c.admitted;
        occupancy_sum += c.released - c.admitted;
        if !window.contains(c.admitted) {
            continue;
        }
        // An admission "had to wait" when a release completed while it was asking; its wake-up
        // is measured from the latest such release.
        if let Some(r) = latest_before(&release_done, c.admitted, c.asked) {
            waited_admissions += 1;
            wake.saturating_record(micros(c.admitted - r));
        }
        if let Some(r) = latest_before(&release_called, c.admitted, c.asked) {
            wake_from_release_call.saturating_record(micros(c.admitted - r));
        }
    }
    let n = u32::try_from(admissions_total.max(1)).unwrap_or(u32::MAX);
    Contended {
        per_sec: completed as f64 / window.secs(),
        admissions_total,
        mean_hold: hold_sum / n,
        mean_occupancy: occupancy_sum / n,
        wait,
        wake,
        wake_from_release_call,
        waited_admissions,
        timeouts,
        errors,
        usage,
    }
}

/// `git describe`-like revision of the workspace, with `+dirty` when files differ from HEAD.
fn revision() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(env!("CARGO_MANIFEST_DIR"))
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(rev) => match git(&["status", "--porcelain", "--untracked-files=no"]) {
            Some(s) if !s.is_empty() => format!("{rev}+dirty"),
            _ => rev,
        },
        None => "unknown".into(),
    }
}

fn main() {
    let secs = std::env::var("LEASEHOLD_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(DEFAULT_SECS);
    let measure = Duration::from_secs_f64(secs);
    let started = Instant::now();

    // Server settings to compare, e.g. "--zset-max-listpack-entries 0" (docs/BENCHMARKS.md).
    let redis_args = std::env::var("LEASEHOLD_BENCH_REDIS_ARGS").unwrap_or_default();
    let redis_args: Vec<&str> = redis_args.split_whitespace().collect();
    let server = RedisServer::start_with(&redis_args);
    let redis_version = info(&server, "server")
        .get("redis_version")
        .cloned()
        .unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let rev = revision();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let url = server.url();
    let backend = rt
        .block_on(RedisBackend::connect(&url))
        .unwrap_or_else(|e| panic!("cannot connect to the private redis at {url}: {e}"));
    println!(
        "leasehold throughput benchmark @ {rev}: private redis-server {redis_version} at {url} \
         (extra arguments: {redis_args:?}), {cpus} CPUs, tokio multi-thread runtime ({cpus} \
         workers), {secs} s per measurement after {} ms warm-up",
        WARMUP.as_millis()
    );

    // 1 + 2: uncontended leasehold and the naive counter floor, interleaved per level.
    let mut levels = Vec::new();
    for &tasks in &LEVELS {
        let quota = Quota::builder(format!("bench-{}-uncontended-{tasks}", std::process::id()))
            .limit(UNCONTENDED_LIMIT)
            .ttl(TTL)
            .backend(backend.clone())
            .build()
            .expect("valid quota");
        let lh = closed_loop(
            &rt,
            &server,
            tasks,
            measure,
            &["evalsha", "eval", "script|load"],
            move |task, i| {
                let quota = quota.clone();
                async move {
                    let lease = quota.acquire(&format!("t{task}-{i}")).await?;
                    lease.release().await
                }
            },
        );
        let key = format!("bench-{}-floor-{tasks}", std::process::id());
        let floor_backend = backend.clone();
        let floor = closed_loop(
            &rt,
            &server,
            tasks,
            measure,
            &["incr", "decr"],
            move |_, _| {
                let backend = floor_backend.clone();
                let key = key.clone();
                async move {
                    backend
                        .call::<i64>(redis::cmd("INCR").arg(&key).clone())
                        .await?;
                    backend
                        .call::<i64>(redis::cmd("DECR").arg(&key).clone())
                        .await?;
                    Ok(())
                }
            },
        );
        let ratio = lh.per_sec / floor.per_sec.max(f64::MIN_POSITIVE);
        println!(
            "uncontended {tasks:>2} tasks: leasehold {:>6.0} cycles/s (p50 {:.3} ms, p99 {:.3} ms) \
             | floor INCR+DECR {:>6.0} cycles/s (p50 {:.3} ms, p99 {:.3} ms) | ratio {ratio:.3}",
            lh.per_sec,
            ms(lh.latency.value_at_quantile(0.5)),
            ms(lh.latency.value_at_quantile(0.99)),
            floor.per_sec,
            ms(floor.latency.value_at_quantile(0.5)),
            ms(floor.latency.value_at_quantile(0.99)),
        );
        println!("    leasehold: {}", lh.describe());
        println!("    floor:     {}", floor.describe());
        if lh.errors + floor.errors > 0 {
            println!(
                "    errors: leasehold {}, floor {}",
                lh.errors, floor.errors
            );
        }
        levels.push((tasks, lh, floor, ratio));
    }

    // 3: contention.
    let c = contended(&rt, &server, &backend, measure);
    let limit = CONTENDED_LIMIT as f64;
    let nominal_rate = limit / NOMINAL_HOLD.as_secs_f64();
    let measured_rate = limit / c.mean_hold.as_secs_f64().max(f64::MIN_POSITIVE);
    let occupancy_rate = limit / c.mean_occupancy.as_secs_f64().max(f64::MIN_POSITIVE);
    let frac_nominal = c.per_sec / nominal_rate;
    let frac_measured = c.per_sec / measured_rate;
    let admissions = c.admissions_total.max(1) as f64;
    let scripts_per_admission = c.usage.script_calls() as f64 / admissions;
    // One script call carries many attempts (or releases), so attempts that found the quota full
    // are not visible here. Every acquire call runs ZRANGEBYSCORE exactly once and every release
    // call EXISTS exactly once; no other script runs either. What remains is renewals.
    let acquire_calls = c.usage.calls("zrangebyscore");
    let acquire_per_admission = acquire_calls as f64 / admissions;
    let release_calls = c.usage.calls("exists");
    let other_scripts = c
        .usage
        .script_calls()
        .saturating_sub(acquire_calls + release_calls);
    let evalsha_us = c.usage.usec_per_call(&["evalsha"]);
    let wait_p99 = ms(c.wait.value_at_quantile(0.99));
    let wake_p50 = ms(c.wake.value_at_quantile(0.5));
    println!(
        "contended (limit {CONTENDED_LIMIT}, {CONTENDED_TASKS} tasks, hold {NOMINAL_HOLD:?}): \
         {:.0} cycles/s = {frac_nominal:.3} of limit/nominal hold ({nominal_rate:.0}/s), \
         {frac_measured:.3} of limit/measured hold ({measured_rate:.0}/s, mean hold {:.3} ms)",
        c.per_sec,
        c.mean_hold.as_secs_f64() * 1e3,
    );
    // Each slot turns over every limit / (cycles/s): the hold, the release call, and the
    // hand-over to the next holder (release done → next admission, the rest).
    let slot_cycle_ms = limit / c.per_sec.max(f64::MIN_POSITIVE) * 1e3;
    let hold_ms = c.mean_hold.as_secs_f64() * 1e3;
    let release_ms = (c.mean_occupancy - c.mean_hold).as_secs_f64() * 1e3;
    let handover_ms = slot_cycle_ms - c.mean_occupancy.as_secs_f64() * 1e3;
    println!(
        "    mean admission→release done {:.3} ms (limit / that = {occupancy_rate:.0}/s); \
         slot turnover {slot_cycle_ms:.3} ms = hold {hold_ms:.3} + release call {release_ms:.3} \
         + hand-over {handover_ms:.3}",
        c.mean_occupancy.as_secs_f64() * 1e3,
    );
    println!(
        "    acquire wait p50 {:.3} ms, p99 {wait_p99:.3} ms, max {:.3} ms \
         ({} acquires started in the window, {} timeouts, {} errors)",
        ms(c.wait.value_at_quantile(0.5)),
        ms(c.wait.max()),
        c.wait.len(),
        c.timeouts,
        c.errors
    );
    println!(
        "    wake-up release done→admission p50 {wake_p50:.3} ms, p99 {:.3} ms \
         ({} admissions that waited); from release call: p50 {:.3} ms, p99 {:.3} ms",
        ms(c.wake.value_at_quantile(0.99)),
        c.waited_admissions,
        ms(c.wake_from_release_call.value_at_quantile(0.5)),
        ms(c.wake_from_release_call.value_at_quantile(0.99)),
    );
    println!(
        "    redis: {} script calls for {} admissions = {scripts_per_admission:.2} per admission \
         (2.0 without batching: one acquire + one release); acquire calls \
         {acquire_per_admission:.2} per admission, release calls {:.2}; other scripts \
         {other_scripts}; {evalsha_us:.1} µs in redis per EVALSHA",
        c.usage.script_calls(),
        c.admissions_total,
        release_calls as f64 / admissions,
    );
    println!("    cores: {}", c.usage.describe());

    // 4: summary.
    let ratio64 = levels
        .iter()
        .find(|(t, ..)| *t == 64)
        .map_or(0.0, |(.., r)| *r);
    let targets = [
        (
            "uncontended ratio leasehold/floor at 64 tasks",
            ratio64,
            format!(">= {TARGET_RATIO_64}"),
            ratio64 >= TARGET_RATIO_64,
        ),
        (
            "contended cycles/s / (limit/nominal hold)",
            frac_nominal,
            format!(">= {TARGET_CONTENDED_FRACTION}"),
            frac_nominal >= TARGET_CONTENDED_FRACTION,
        ),
        (
            "contended cycles/s / (limit/measured hold)",
            frac_measured,
            format!(">= {TARGET_CONTENDED_FRACTION}"),
            frac_measured >= TARGET_CONTENDED_FRACTION,
        ),
        (
            "contended acquire-wait p99 (ms)",
            wait_p99,
            format!("<= {TARGET_WAIT_P99_MS}"),
            wait_p99 <= TARGET_WAIT_P99_MS,
        ),
        (
            "contended wake-up p50 (ms)",
            wake_p50,
            format!("<= {TARGET_WAKE_P50_MS}"),
            wake_p50 <= TARGET_WAKE_P50_MS,
        ),
    ];

    println!();
    println!("| tasks | leasehold cycles/s | p50 / p99 ms | floor INCR+DECR cycles/s | p50 / p99 ms | ratio |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for (tasks, lh, floor, ratio) in &levels {
        println!(
            "| {tasks} | {:.0} | {:.2} / {:.2} | {:.0} | {:.2} / {:.2} | {ratio:.3} |",
            lh.per_sec,
            ms(lh.latency.value_at_quantile(0.5)),
            ms(lh.latency.value_at_quantile(0.99)),
            floor.per_sec,
            ms(floor.latency.value_at_quantile(0.5)),
            ms(floor.latency.value_at_quantile(0.99)),
        );
    }
    println!();
    println!(
        "| contended (limit {CONTENDED_LIMIT}, {CONTENDED_TASKS} tasks, ~1 ms hold) | value |"
    );
    println!("|---|---:|");
    let rows = [
        ("cycles/s", format!("{:.0}", c.per_sec)),
        (
            "mean measured hold (ms)",
            format!("{:.3}", c.mean_hold.as_secs_f64() * 1e3),
        ),
        (
            "fraction of limit/nominal hold",
            format!("{frac_nominal:.3}"),
        ),
        (
            "fraction of limit/measured hold",
            format!("{frac_measured:.3}"),
        ),
        (
            "acquire wait p50 / p99 / max (ms)",
            format!(
                "{:.2} / {:.2} / {:.2}",
                ms(c.wait.value_at_quantile(0.5)),
                wait_p99,
                ms(c.wait.max())
            ),
        ),
        (
            "wake-up p50 / p99 (ms)",
            format!("{wake_p50:.3} / {:.3}", ms(c.wake.value_at_quantile(0.99))),
        ),
        (
            "script calls per admission (2.0 without batching)",
            format!("{scripts_per_admission:.2}"),
        ),
        (
            "acquire calls per admission",
            format!("{acquire_per_admission:.2}"),
        ),
    ];
    for (name, value) in rows {
        println!("| {name} | {value} |");
    }
    println!();
    println!("| target | value | goal | result |");
    println!("|---|---:|---:|---|");
    for (name, value, goal, pass) in &targets {
        println!("| {name} | {value:.3} | {goal} | {} |", verdict(*pass));
    }

    let report = json!({
        "revision": rev,
        "redis_version": redis_version,
        "cpus": cpus,
        "secs": secs,
        "uncontended": levels.iter().map(|(tasks, lh, floor, ratio)| json!({
            "tasks": tasks,
            "leasehold": lh.json(),
            "floor": floor.json(),
            "ratio": round3(*ratio),
        })).collect::<Vec<_>>(),
        "contended": {
            "limit": CONTENDED_LIMIT,
            "tasks": CONTENDED_TASKS,
            "nominal_hold_ms": NOMINAL_HOLD.as_secs_f64() * 1e3,
            "mean_hold_ms": round3(c.mean_hold.as_secs_f64() * 1e3),
            "mean_admission_to_release_done_ms": round3(c.mean_occupancy.as_secs_f64() * 1e3),
            "slot_turnover_ms": round3(slot_cycle_ms),
            "mean_release_call_ms": round3(release_ms),
            "mean_handover_ms": round3(handover_ms),
            "cycles_per_sec": c.per_sec.round(),
            "fraction_of_nominal": round3(frac_nominal),
            "fraction_of_measured": round3(frac_measured),
            "wait_p50_ms": ms(c.wait.value_at_quantile(0.5)),
            "wait_p99_ms": wait_p99,
            "wait_max_ms": ms(c.wait.max()),
            "wake_p50_ms": wake_p50,
            "wake_p99_ms": ms(c.wake.value_at_quantile(0.99)),
            "wake_from_release_call_p50_ms": ms(c.wake_from_release_call.value_at_quantile(0.5)),
            "wake_from_release_call_p99_ms": ms(c.wake_from_release_call.value_at_quantile(0.99)),
            "waited_admissions": c.waited_admissions,
            "admissions_total": c.admissions_total,
            "timeouts": c.timeouts,
            "errors": c.errors,
            "script_calls_per_admission": round3(scripts_per_admission),
            "acquire_calls_per_admission": round3(acquire_per_admission),
            "release_calls_per_admission": round3(release_calls as f64 / admissions),
            "other_script_calls": other_scripts,
            "redis_us_per_evalsha": round2(evalsha_us),
            "cores": c.usage.json(),
        },
        "targets": targets.iter().map(|(name, value, goal, pass)| json!({
            "name": name, "value": round3(*value), "goal": goal, "pass": pass,
        })).collect::<Vec<_>>(),
    });
    println!();
    println!("BENCH_JSON {report}");
    println!("(total run time {:.1} s)", started.elapsed().as_secs_f64());
}
