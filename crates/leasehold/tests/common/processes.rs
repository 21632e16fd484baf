//! Worker processes for the multi-process tests: spawned, their stdout read line by line, and
//! the hold intervals they report checked for overlap.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The Rust worker, `examples/worker.rs`: built beside the test binaries (by `cargo test`, or
/// here, by the first test that needs it).
pub fn worker_path() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().unwrap();
            let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
            let path = profile_dir.join("examples").join("worker");
            // `cargo test` builds examples, `cargo test --test processes` does not, and an old
            // binary may be left from an earlier build: cargo rebuilds it only if it is stale.
            // `--workspace`, as `cargo test --workspace` resolves features: with `-p leasehold`
            // the dependencies' features differ, and tokio, redis and leasehold were rebuilt in
            // the middle of the run (30-90 s of CI; found by review).
            let mut build = Command::new(env!("CARGO"));
            build.args(["build", "-q", "--workspace", "--example", "worker"]);
            if profile_dir.ends_with("release") {
                build.arg("--release");
            }
            let status = build
                .status()
                .expect("run cargo to build the worker example");
            assert!(
                status.success() && path.exists(),
                "cannot build {}",
                path.display()
            );
            path
        })
        .clone()
}

/// A running worker whose stdout lines arrive on a channel.
pub struct Worker {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
}

impl Worker {
    pub fn spawn(prefix: &[&str], args: &[String]) -> Worker {
        Worker::spawn_with_env(prefix, &[], args)
    }

    /// Like [`Worker::spawn`], with extra environment variables (a wall-clock shim, say); its
    /// stdin is a pipe the test may write to (`tick` mode reads "release" there).
    pub fn spawn_with_env(prefix: &[&str], env: &[(String, OsString)], args: &[String]) -> Worker {
        let mut cmd = if prefix.is_empty() {
            Command::new(worker_path())
        } else {
            let mut c = Command::new(prefix[0]);
            c.args(&prefix[1..]).arg(worker_path());
            c
        };
        cmd.args(args)
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .envs(env.iter().map(|(k, v)| (k, v)));
        Worker::spawn_command(cmd)
    }

    /// Runs `cmd` (any worker program speaking the same line protocol on stdout) with its stdin
    /// a pipe and its stdout read line by line.
    pub fn spawn_command(mut cmd: Command) -> Worker {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn worker");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Worker { child, lines }
    }

    pub fn next_line(&self, within: Duration) -> String {
        self.lines
            .recv_timeout(within)
            .unwrap_or_else(|e| panic!("no line from worker within {within:?}: {e}"))
    }

    pub fn wait(mut self, within: Duration) -> Vec<String> {
        let end = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "worker failed: {status}");
                break;
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                panic!("worker did not finish within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // The worker has exited, but the thread that reads its stdout may not have passed the
        // last lines on yet (on a loaded machine it often had not): read on until it reaches
        // the end of the pipe, which the exit closed. Bounded, should something else hold the
        // pipe open.
        let mut lines = Vec::new();
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            match self
                .lines
                .recv_timeout(end.saturating_duration_since(Instant::now()))
            {
                Ok(line) => lines.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => break lines,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("the worker's stdout stayed open 10 s after it exited: {lines:?}")
                }
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn args(parts: &[&dyn ToString]) -> Vec<String> {
    parts.iter().map(|p| p.to_string()).collect()
}

/// The largest number of intervals open at one instant (an end at t closes before a start at t).
pub fn max_overlap(intervals: &[(u128, u128)]) -> usize {
    let mut edges: Vec<(u128, i32)> = Vec::new();
    for &(start, end) in intervals {
        edges.push((start, 1));
        edges.push((end, -1));
    }
    edges.sort();
    let (mut open, mut max) = (0i32, 0i32);
    for (_, delta) in edges {
        open += delta;
        max = max.max(open);
    }
    max as usize
}

/// The `hold START_NS END_NS` lines of a worker's output, as intervals.
pub fn hold_intervals(lines: &[String]) -> Vec<(u128, u128)> {
    lines
        .iter()
        .filter_map(|line| line.strip_prefix("hold "))
        .map(|rest| {
            let mut parts = rest.split_whitespace().map(|n| {
                n.parse::<u128>()
                    .unwrap_or_else(|e| panic!("{rest:?}: {e}"))
            });
            (parts.next().unwrap(), parts.next().unwrap())
        })
        .collect()
}
