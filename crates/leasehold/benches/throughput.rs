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
//!    admission (from `INFO commandstats`);
//! 4. a summary table, and the same figures as one `BENCH_JSON {...}` line for tooling.
//!
//! Targets are reported as PASS/MISS; a miss does not fail the run. Metric definitions are in
//! `docs/BENCHMARKS.md`.
//!
//! Run: `cargo bench -p leasehold --bench throughput`. Each measurement lasts
//! `LEASEHOLD_BENCH_SECS` seconds (default 3) after a 0.5 s warm-up; the default run takes
//! about 30 s.

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

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn verdict(pass: bool) -> &'static str {
    if pass {
        "PASS"
    } else {
        "MISS"
    }
}

/// The time frame of one phase: warm-up from `start`, measured window `[from, end]`.
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

/// Process CPU, Redis CPU and Redis command statistics at one instant.
struct Probe {
    at: Instant,
    client_cpu: f64,
    redis_cpu: f64,
    /// Command name (without `cmdstat_`) -> (calls, usec).
    commands: HashMap<String, (u64, u64)>,
}

/// CPU time (user + system) of this whole process, every thread included, in seconds.
fn process_cpu_secs() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage only writes into the struct it is given, which is large enough.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return 0.0;
    }
    // SAFETY: getrusage returned 0, so it filled the struct (and it started zeroed anyway).
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
    Probe {
        at: Instant::now(),
        client_cpu: process_cpu_secs(),
        redis_cpu,
        commands,
    }
}

/// What happened on the Redis server and in this process between two probes.
struct Usage {
    wall: f64,
    client_cpu: f64,
    redis_cpu: f64,
    commands: HashMap<String, (u64, u64)>,
}

impl Usage {
    fn between(before: &Probe, after: &Probe) -> Usage {
        let commands = after
            .commands
            .iter()
            .map(|(name, &(calls, usec))| {
                let (c0, u0) = before.commands.get(name).copied().unwrap_or((0, 0));
                (name.clone(), (calls - c0, usec - u0))
            })
            .filter(|(_, (calls, _))| *calls > 0)
            .collect();
        Usage {
            wall: (after.at - before.at).as_secs_f64(),
            client_cpu: after.client_cpu - before.client_cpu,
            redis_cpu: after.redis_cpu - before.redis_cpu,
            commands,
        }
    }

    fn calls(&self, name: &str) -> u64 {
        self.commands.get(name).map_or(0, |c| c.0)
    }

    fn usec(&self, name: &str) -> u64 {
        self.commands.get(name).map_or(0, |c| c.1)
    }

    /// Script invocations: EVALSHA + EVAL (+ SCRIPT LOAD, a round trip too).
    fn script_calls(&self) -> u64 {
        self.calls("evalsha") + self.calls("eval") + self.calls("script|load")
    }

    /// Commands clients sent (commands run inside scripts are left out).
    fn client_commands(&self) -> u64 {
        self.commands
            .iter()
            .filter(|(name, _)| {
                matches!(
                    name.as_str(),
                    "evalsha"
                        | "eval"
                        | "script|load"
                        | "incr"
                        | "decr"
                        | "ping"
                        | "subscribe"
                        | "hello"
                        | "client|setinfo"
                )
            })
            .map(|(_, (calls, _))| calls)
            .sum()
    }
}

/// Result of one closed-loop throughput phase.
struct Throughput {
    /// Cycles completed inside the measured window, per second.
    per_sec: f64,
    /// Cycle latency of the cycles completed inside the window, µs.
    latency: Histogram<u64>,
    /// Cycles completed during the whole phase (warm-up and drain included).
    total_cycles: u64,
    errors: u64,
    usage: Usage,
}

impl Throughput {
    fn cpu_us_per_cycle(&self, cpu: f64) -> f64 {
        cpu * 1e6 / self.total_cycles.max(1) as f64
    }

    fn json(&self) -> Value {
        json!({
            "cycles_per_sec": self.per_sec.round(),
            "p50_us": self.latency.value_at_quantile(0.5),
            "p99_us": self.latency.value_at_quantile(0.99),
            "errors": self.errors,
            "client_cpu_us_per_cycle": round2(self.cpu_us_per_cycle(self.usage.client_cpu)),
            "redis_cpu_us_per_cycle": round2(self.cpu_us_per_cycle(self.usage.redis_cpu)),
            "client_cores_busy": round2(self.usage.client_cpu / self.usage.wall),
            "redis_cores_busy": round2(self.usage.redis_cpu / self.usage.wall),
            "redis_calls_per_cycle":
                round2(self.usage.client_commands() as f64 / self.total_cycles.max(1) as f64),
        })
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Runs `cycle(task, i)` in a closed loop on `tasks` concurrent tasks for the warm-up plus the
/// measured window, counting the cycles that complete inside the window.
fn closed_loop<F, Fut>(
    rt: &tokio::runtime::Runtime,
    server: &RedisServer,
    tasks: usize,
    measure: Duration,
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
    Throughput {
        per_sec: in_window as f64 / window.secs(),
        latency,
        total_cycles,
        errors,
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

/// One contended cycle as seen by its task.
struct Cycle {
    /// `acquire_timeout` called.
    asked: Instant,
    /// Lease returned.
    admitted: Instant,
    /// Hold (sleep) over.
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
                    let (mut wait_started_in_window, mut timeouts, mut errors) =
                        (Vec::new(), 0u64, 0u64);
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
                                    wait_started_in_window.push(admitted - asked);
                                }
                                tokio::time::sleep(NOMINAL_HOLD).await;
                                let held = Instant::now();
                                let result = lease.release().await;
                                let released = Instant::now();
                                if let Err(e) = result {
                                    eprintln!("contended release failed: {e}");
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
                                    wait_started_in_window.push(ACQUIRE_TIMEOUT);
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
                    (cycles, wait_started_in_window, timeouts, errors)
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
        if let Some(r) = latest_before(&release_done, c.admitted, c.asked) {
            waited_admissions += 1;
            wake.saturating_record(micros(c.admitted - r));
        }
        if let Some(r) = latest_before(&release_called, c.admitted, c.asked) {
            wake_from_release_call.saturating_record(micros(c.admitted - r));
        }
    }
    let n = admissions_total.max(1) as u32;
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

fn main() {
    let secs = std::env::var("LEASEHOLD_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(DEFAULT_SECS);
    let measure = Duration::from_secs_f64(secs);
    let started = Instant::now();

    let server = RedisServer::start();
    let server_info = info(&server, "server");
    let redis_version = server_info
        .get("redis_version")
        .cloned()
        .unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let url = server.url();
    let backend = rt
        .block_on(RedisBackend::connect(&url))
        .unwrap_or_else(|e| panic!("cannot connect to the private redis at {url}: {e}"));
    println!(
        "leasehold throughput benchmark: redis-server {redis_version} at {url}, {cpus} CPUs, \
         tokio multi-thread ({cpus} workers), {secs} s per measurement after {} ms warm-up",
        WARMUP.as_millis()
    );

    if std::env::var("DIAG").is_ok() {
        diag(&rt, &backend);
        return;
    }
    // 1 + 2: uncontended leasehold and the naive counter floor, interleaved per level.
    let mut levels = Vec::new();
    for &tasks in &LEVELS {
        let quota = Quota::builder(format!("bench-{}-uncontended-{tasks}", std::process::id()))
            .limit(UNCONTENDED_LIMIT)
            .ttl(TTL)
            .backend(backend.clone())
            .build()
            .expect("valid quota");
        let lh = closed_loop(&rt, &server, tasks, measure, move |task, i| {
            let quota = quota.clone();
            async move {
                let lease = quota.acquire(&format!("t{task}-{i}")).await?;
                lease.release().await
            }
        });
        let key = format!("bench-{}-floor-{tasks}", std::process::id());
        let floor_backend = backend.clone();
        let floor = closed_loop(&rt, &server, tasks, measure, move |_, _| {
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
        });
        let ratio = lh.per_sec / floor.per_sec.max(f64::MIN_POSITIVE);
        println!(
            "uncontended {tasks:>2} tasks: leasehold {:>8.0} cycles/s (p50 {:.3} ms, p99 {:.3} ms) \
             | floor INCR+DECR {:>8.0} cycles/s (p50 {:.3} ms, p99 {:.3} ms) | ratio {ratio:.3}",
            lh.per_sec,
            ms(lh.latency.value_at_quantile(0.5)),
            ms(lh.latency.value_at_quantile(0.99)),
            floor.per_sec,
            ms(floor.latency.value_at_quantile(0.5)),
            ms(floor.latency.value_at_quantile(0.99)),
        );
        println!(
            "    cpu per cycle: leasehold client {:.1} µs + redis {:.1} µs, {:.2} redis calls; \
             floor client {:.1} µs + redis {:.1} µs, {:.2} redis calls",
            lh.cpu_us_per_cycle(lh.usage.client_cpu),
            lh.cpu_us_per_cycle(lh.usage.redis_cpu),
            lh.usage.client_commands() as f64 / lh.total_cycles.max(1) as f64,
            floor.cpu_us_per_cycle(floor.usage.client_cpu),
            floor.cpu_us_per_cycle(floor.usage.redis_cpu),
            floor.usage.client_commands() as f64 / floor.total_cycles.max(1) as f64,
        );
        if lh.errors + floor.errors > 0 {
            println!(
                "    errors: leasehold {}, floor {}",
                lh.errors, floor.errors
            );
        }
        dump(&lh.usage);
        dump(&floor.usage);
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
    // Each acquire script calls ZRANGEBYSCORE exactly once (release and renew never do), and
    // every admission is released exactly once.
    let acquire_calls = c.usage.calls("zrangebyscore");
    let acquire_per_admission = acquire_calls as f64 / admissions;
    let other_scripts = c
        .usage
        .script_calls()
        .saturating_sub(acquire_calls + c.admissions_total);
    let failed_attempts_per_sec = acquire_calls.saturating_sub(c.admissions_total) as f64
        / c.usage.wall.max(f64::MIN_POSITIVE);
    let evalsha_us = c.usage.usec("evalsha") as f64 / c.usage.calls("evalsha").max(1) as f64;
    let wait_p99 = ms(c.wait.value_at_quantile(0.99));
    let wake_p50 = ms(c.wake.value_at_quantile(0.5));
    println!(
        "contended (limit {CONTENDED_LIMIT}, {CONTENDED_TASKS} tasks, hold {:?}): {:.0} cycles/s \
         = {:.3} of limit/nominal hold ({nominal_rate:.0}/s), {:.3} of limit/measured hold \
         ({measured_rate:.0}/s, mean hold {:.3} ms); mean admission→release-done {:.3} ms \
         (limit/that = {occupancy_rate:.0}/s)",
        NOMINAL_HOLD,
        c.per_sec,
        frac_nominal,
        frac_measured,
        c.mean_hold.as_secs_f64() * 1e3,
        c.mean_occupancy.as_secs_f64() * 1e3,
    );
    println!(
        "    acquire wait p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms ({} waits, {} timeouts, {} errors)",
        ms(c.wait.value_at_quantile(0.5)),
        wait_p99,
        ms(c.wait.max()),
        c.wait.len(),
        c.timeouts,
        c.errors
    );
    println!(
        "    wake-up release-done→admission p50 {:.3} ms, p99 {:.3} ms ({} waited admissions); \
         from release call: p50 {:.3} ms, p99 {:.3} ms",
        wake_p50,
        ms(c.wake.value_at_quantile(0.99)),
        c.waited_admissions,
        ms(c.wake_from_release_call.value_at_quantile(0.5)),
        ms(c.wake_from_release_call.value_at_quantile(0.99)),
    );
    println!(
        "    redis: {} script calls for {} admissions = {scripts_per_admission:.2} per admission \
         (floor 2.0: one acquire + one release); acquire scripts {acquire_per_admission:.2} per \
         admission ({failed_attempts_per_sec:.0} failed attempts/s), other scripts {other_scripts}; \
         {evalsha_us:.1} µs redis time per EVALSHA",
        c.usage.script_calls(),
        c.admissions_total
    );
    println!(
        "    cpu: client {:.2} cores, redis {:.2} cores busy",
        c.usage.client_cpu / c.usage.wall,
        c.usage.redis_cpu / c.usage.wall
    );

    // 4: summary.
    let mut targets = Vec::new();
    let (_, _, _, ratio64) = levels
        .iter()
        .find(|(t, ..)| *t == 64)
        .expect("64 is a level");
    targets.push((
        "uncontended ratio leasehold/floor at 64 tasks",
        format!("{ratio64:.3}"),
        format!(">= {TARGET_RATIO_64}"),
        *ratio64 >= TARGET_RATIO_64,
    ));
    targets.push((
        "contended cycles/s / (limit/nominal hold)",
        format!("{frac_nominal:.3}"),
        format!(">= {TARGET_CONTENDED_FRACTION}"),
        frac_nominal >= TARGET_CONTENDED_FRACTION,
    ));
    targets.push((
        "contended cycles/s / (limit/measured hold)",
        format!("{frac_measured:.3}"),
        format!(">= {TARGET_CONTENDED_FRACTION}"),
        frac_measured >= TARGET_CONTENDED_FRACTION,
    ));
    targets.push((
        "contended acquire-wait p99 (ms)",
        format!("{wait_p99:.3}"),
        format!("<= {TARGET_WAIT_P99_MS}"),
        wait_p99 <= TARGET_WAIT_P99_MS,
    ));
    targets.push((
        "contended wake-up p50 (ms)",
        format!("{wake_p50:.3}"),
        format!("<= {TARGET_WAKE_P50_MS}"),
        wake_p50 <= TARGET_WAKE_P50_MS,
    ));

    println!();
    println!("| tasks | leasehold cycles/s | floor INCR+DECR cycles/s | ratio |");
    println!("|---:|---:|---:|---:|");
    for (tasks, lh, floor, ratio) in &levels {
        println!(
            "| {tasks} | {:.0} | {:.0} | {ratio:.3} |",
            lh.per_sec, floor.per_sec
        );
    }
    println!();
    println!("| contended metric | value |");
    println!("|---|---:|");
    for (name, value) in [
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
            "acquire wait p50 (ms)",
            format!("{:.3}", ms(c.wait.value_at_quantile(0.5))),
        ),
        ("acquire wait p99 (ms)", format!("{wait_p99:.3}")),
        ("acquire wait max (ms)", format!("{:.3}", ms(c.wait.max()))),
        ("wake-up p50 (ms)", format!("{wake_p50:.3}")),
        (
            "wake-up p99 (ms)",
            format!("{:.3}", ms(c.wake.value_at_quantile(0.99))),
        ),
        (
            "script calls per admission",
            format!("{scripts_per_admission:.2}"),
        ),
        (
            "acquire scripts per admission",
            format!("{acquire_per_admission:.2}"),
        ),
    ] {
        println!("| {name} | {value} |");
    }
    println!();
    println!("| target | value | goal | result |");
    println!("|---|---:|---:|---|");
    for (name, value, goal, pass) in &targets {
        println!("| {name} | {value} | {goal} | {} |", verdict(*pass));
    }

    let report = json!({
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
            "acquire_scripts_per_admission": round3(acquire_per_admission),
            "failed_attempts_per_sec": failed_attempts_per_sec.round(),
            "other_script_calls": other_scripts,
            "redis_us_per_evalsha": round2(evalsha_us),
            "client_cores_busy": round2(c.usage.client_cpu / c.usage.wall),
            "redis_cores_busy": round2(c.usage.redis_cpu / c.usage.wall),
        },
        "targets": targets.iter().map(|(name, value, goal, pass)| json!({
            "name": name, "value": value, "goal": goal, "pass": pass,
        })).collect::<Vec<_>>(),
    });
    println!();
    println!("BENCH_JSON {report}");
    println!("(total run time {:.1} s)", started.elapsed().as_secs_f64());
}
#[allow(dead_code)]
fn dump(u: &Usage) {
    let mut v: Vec<_> = u.commands.iter().collect();
    v.sort();
    eprintln!("{v:?}");
}
#[allow(dead_code)]
fn diag(rt: &tokio::runtime::Runtime, backend: &RedisBackend) {
    let quota = Quota::builder("diag")
        .limit(10000)
        .ttl(TTL)
        .backend(backend.clone())
        .build()
        .unwrap();
    let backend = backend.clone();
    rt.block_on(async move {
        tokio::spawn(async move {
            let (mut a, mut r, mut f, mut p) = (histogram(), histogram(), histogram(), histogram());
            for i in 0..3000 {
                let t0 = Instant::now();
                let lease = quota.acquire(&format!("d{i}")).await.unwrap();
                let t1 = Instant::now();
                lease.release().await.unwrap();
                let t2 = Instant::now();
                backend
                    .call::<i64>(redis::cmd("INCR").arg("x").clone())
                    .await
                    .unwrap();
                let t3 = Instant::now();
                let _ = quota.try_acquire(&format!("e{i}")).await.unwrap();
                let t4 = Instant::now();
                a.saturating_record(micros(t1 - t0));
                r.saturating_record(micros(t2 - t1));
                f.saturating_record(micros(t3 - t2));
                p.saturating_record(micros(t4 - t3));
            }
            for (n, h) in [
                ("acquire", a),
                ("release", r),
                ("incr", f),
                ("try_acquire+drop", p),
            ] {
                eprintln!(
                    "{n}: p10 {} p50 {} p90 {} p99 {}",
                    h.value_at_quantile(0.1),
                    h.value_at_quantile(0.5),
                    h.value_at_quantile(0.9),
                    h.value_at_quantile(0.99)
                );
            }
        })
        .await
        .unwrap()
    });
}
