//! The fleet under test: one private redis-server, and per worker slot one `FaultProxy` and one
//! `chaos_worker` process (respawned with a new generation after a kill).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::{temp_dir, RedisServer};

use super::model::{now_ns, Kill};
use super::record::{parse, WorkerLog};

/// What every worker is started with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Worker processes.
    pub workers: usize,
    /// The quota's limit.
    pub limit: u64,
    /// The lease ttl.
    pub ttl: Duration,
    /// Range of one piece of protected work, in ms.
    pub hold_ms: (u64, u64),
    /// Seed for the workers' work lengths.
    pub seed: u64,
}

/// A worker slot's current process.
struct Proc {
    child: Child,
    generation: u32,
    stopped: bool,
}

/// A worker's work in progress, from its log.
#[derive(Debug, Clone)]
pub struct Holder {
    /// Worker slot.
    pub worker: usize,
    /// Task id.
    pub id: String,
    /// Planned work left, in ms, at the time of reading.
    pub remaining_ms: i64,
    /// How long it has been working, in ms, at the time of reading (its lease was granted
    /// just before it started).
    pub elapsed_ms: i64,
}

/// The redis-server, the proxies and the worker processes; all stopped on drop.
pub struct Fleet {
    /// The server every proxy forwards to.
    pub server: RedisServer,
    /// One proxy per worker slot.
    pub proxies: Vec<FaultProxy>,
    /// The workers' settings.
    pub settings: Settings,
    /// The quota's name.
    pub quota: String,
    dir: PathBuf,
    procs: Vec<Proc>,
    /// Every incarnation ever started: (slot, generation, log path).
    logs: Vec<(usize, u32, PathBuf)>,
    /// Every SIGKILL sent to a worker.
    pub kills: Vec<Kill>,
    /// The workers' backend-down policy (`closed`, `open`, `degrade:N`).
    policy: String,
}

/// How long a run of the worker may last; the test stops them long before.
const WORKER_RUN: Duration = Duration::from_secs(3600);
/// Bound on waiting for every worker to go quiet.
const QUIET_TIMEOUT: Duration = Duration::from_secs(15);

fn worker_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir");
    let path = profile_dir.join("examples").join("chaos_worker");
    if !path.exists() {
        // `cargo test --workspace` builds the examples, `cargo test --test chaos` does not:
        // build it now. With `--workspace`, as CI's `cargo test --workspace` resolves features:
        // `-p leasehold` unifies them differently and rebuilt tokio, redis and leasehold in the
        // middle of the test run.
        let mut build = Command::new(env!("CARGO"));
        build.args(["build", "--workspace", "--example", "chaos_worker"]);
        if profile_dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo to build chaos_worker");
        assert!(
            status.success() && path.exists(),
            "cannot build {}",
            path.display()
        );
    }
    path
}

fn signal(child: &Child, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id()).expect("pid fits");
    // SAFETY: kill(2) on our own child, which is not reaped yet.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "signal {sig} to worker {pid} failed");
}

impl Fleet {
    /// Starts the server, the proxies and the workers.
    pub fn start(settings: Settings) -> Fleet {
        let server = RedisServer::start();
        let proxies = (0..settings.workers)
            .map(|_| FaultProxy::start(server.port()))
            .collect();
        let mut fleet = Fleet {
            server,
            proxies,
            quota: "chaos".into(),
            dir: temp_dir("leasehold-chaos"),
            procs: Vec::new(),
            logs: Vec::new(),
            kills: Vec::new(),
            policy: "closed".into(),
            settings,
        };
        for worker in 0..fleet.settings.workers {
            let proc = fleet.spawn(worker, 0);
            fleet.procs.push(proc);
        }
        fleet
    }

    fn quiet_file(&self) -> PathBuf {
        self.dir.join("quiet")
    }

    fn spawn(&mut self, worker: usize, generation: u32) -> Proc {
        let log = self.dir.join(format!("w{worker}.{generation}.log"));
        let s = &self.settings;
        let args = [
            format!("url={}", self.proxies[worker].url()),
            format!("quota={}", self.quota),
            format!("limit={}", s.limit),
            format!("ttl_ms={}", s.ttl.as_millis()),
            format!("worker={worker}"),
            format!("gen={generation}"),
            format!("run_ms={}", WORKER_RUN.as_millis()),
            format!("hold_ms={}-{}", s.hold_ms.0, s.hold_ms.1),
            format!("log={}", log.display()),
            format!("quiet={}", self.quiet_file().display()),
            format!("seed={}", s.seed),
            format!("policy={}", self.policy),
        ];
        let child = Command::new(worker_path())
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn chaos_worker");
        self.logs.push((worker, generation, log));
        Proc {
            child,
            generation,
            stopped: false,
        }
    }

    /// SIGKILLs the worker in `slot` and starts its next generation; returns the kill.
    pub fn kill_and_respawn(&mut self, slot: usize) -> Kill {
        let proc = &mut self.procs[slot];
        let _ = proc.child.kill();
        let _ = proc.child.wait();
        let kill = Kill {
            worker: slot,
            generation: proc.generation,
            at: now_ns(),
        };
        self.kills.push(kill);
        let next = self.spawn(slot, kill.generation + 1);
        self.procs[slot] = next;
        kill
    }

    /// Replaces every worker by a new generation with the backend-down `policy`. Call it while
    /// the fleet is quiet, so that no one is killed while holding.
    pub fn respawn_all(&mut self, policy: &str) {
        self.policy = policy.into();
        for slot in 0..self.procs.len() {
            self.kill_and_respawn(slot);
        }
    }

    /// SIGSTOPs the worker in `slot`.
    pub fn pause(&mut self, slot: usize) {
        signal(&self.procs[slot].child, libc::SIGSTOP);
        self.procs[slot].stopped = true;
    }

    /// SIGCONTs the worker in `slot`.
    pub fn resume(&mut self, slot: usize) {
        signal(&self.procs[slot].child, libc::SIGCONT);
        self.procs[slot].stopped = false;
    }

    /// Every incarnation's log, as written so far.
    pub fn logs(&self) -> Vec<WorkerLog> {
        self.logs
            .iter()
            .map(|(worker, generation, path)| WorkerLog {
                worker: *worker,
                generation: *generation,
                lines: read(path),
            })
            .collect()
    }

    /// The current incarnation's log of each slot.
    fn current_logs(&self) -> Vec<WorkerLog> {
        let current: Vec<(usize, u32)> = self
            .procs
            .iter()
            .enumerate()
            .map(|(slot, p)| (slot, p.generation))
            .collect();
        self.logs()
            .into_iter()
            .filter(|l| current.contains(&(l.worker, l.generation)))
            .collect()
    }

    /// Workers of the current generation that are working now, most planned work left first.
    pub fn holders(&self) -> Vec<Holder> {
        let now = now_ns();
        let mut holders: Vec<Holder> = self
            .current_logs()
            .into_iter()
            .filter_map(|log| {
                let (id, start, hold_ms) = log.working()?;
                let elapsed_ms = ((now.saturating_sub(start)) / 1_000_000) as i64;
                Some(Holder {
                    worker: log.worker,
                    id,
                    remaining_ms: hold_ms as i64 - elapsed_ms,
                    elapsed_ms,
                })
            })
            .collect();
        holders.sort_by_key(|h| -h.remaining_ms);
        holders
    }

    /// Waits (bounded) for a worker not in `busy` that is working with at least `min_left_ms`
    /// of planned work left.
    pub fn wait_for_holder(
        &self,
        min_left_ms: i64,
        busy: &[usize],
        within: Duration,
    ) -> Option<Holder> {
        self.wait_for_holders(1, within, |h| {
            h.remaining_ms >= min_left_ms && !busy.contains(&h.worker)
        })
        .into_iter()
        .next()
    }

    /// Waits (bounded; one look at least) until `want` workers of the current generation that
    /// `fit` are working; returns those of the last look, most planned work left first: fewer
    /// than `want`, or none, when time ran out.
    pub fn wait_for_holders(
        &self,
        want: usize,
        within: Duration,
        fit: impl Fn(&Holder) -> bool,
    ) -> Vec<Holder> {
        let end = Instant::now() + within;
        loop {
            let found: Vec<Holder> = self.holders().into_iter().filter(|h| fit(h)).collect();
            if found.len() >= want || Instant::now() >= end {
                return found;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Lets the workers take new work.
    pub fn go(&self) {
        let _ = std::fs::remove_file(self.quiet_file());
    }

    /// Tells the workers to take no new work, and waits (bounded) until each one is idle.
    pub fn quiet(&self, phase: &str) {
        let tmp = self.dir.join("quiet.tmp");
        std::fs::write(&tmp, phase).expect("write the quiet file");
        std::fs::rename(&tmp, self.quiet_file()).expect("publish the quiet file");
        let end = Instant::now() + QUIET_TIMEOUT;
        loop {
            let logs = self.current_logs();
            let busy: Vec<usize> = logs
                .iter()
                .filter(|l| !l.idle_for(phase))
                .map(|l| l.worker)
                .collect();
            if busy.is_empty() {
                return;
            }
            assert!(
                Instant::now() < end,
                "workers {busy:?} did not go quiet within {QUIET_TIMEOUT:?} in phase {phase}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Keeps `text` beside the worker logs (kept with `LEASEHOLD_CHAOS_KEEP_LOGS=1`).
    pub fn note(&self, name: &str, text: &str) {
        let _ = std::fs::write(self.dir.join(name), text);
    }

    /// Runs `f` on every proxy.
    pub fn each_proxy(&self, f: impl Fn(&FaultProxy)) {
        self.proxies.iter().for_each(f);
    }
}

fn read(path: &Path) -> Vec<super::record::Line> {
    match std::fs::read_to_string(path) {
        // A line being written may be cut; the worker writes whole lines, so keep whole ones.
        Ok(text) => match text.rfind('\n') {
            Some(end) => parse(&text[..=end]),
            None => Vec::new(),
        },
        Err(_) => Vec::new(),
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for proc in &mut self.procs {
            if proc.stopped {
                let _ = signal_quietly(&proc.child, libc::SIGCONT);
            }
            let _ = proc.child.kill();
            let _ = proc.child.wait();
        }
        if std::env::var_os("LEASEHOLD_CHAOS_KEEP_LOGS").is_some() {
            eprintln!("chaos: worker logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn signal_quietly(child: &Child, sig: libc::c_int) -> bool {
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        return false;
    };
    // SAFETY: kill(2) on our own child, which is not reaped yet.
    unsafe { libc::kill(pid, sig) == 0 }
}
