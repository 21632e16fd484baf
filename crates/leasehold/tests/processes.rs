//! Separate OS processes against one private redis-server: the fleet-wide limit holds, a killed
//! holder's slot comes back one ttl later, client clocks play no part, and a holder paused past
//! its cancel marker's ttl does no work once resumed.
//!
//! The worker is `examples/worker.rs`, which `cargo test` builds beside the test binaries.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use leasehold_testkit::RedisServer;

fn worker_path() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = profile_dir.join("examples").join("worker");
    if !path.exists() {
        // `cargo test` builds examples, `cargo test --test processes` does not: build it now.
        let mut build = Command::new(env!("CARGO"));
        build.args(["build", "-p", "leasehold", "--example", "worker"]);
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
    }
    path
}

/// A running worker whose stdout lines arrive on a channel.
struct Worker {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Worker {
    fn spawn(prefix: &[&str], args: &[String]) -> Worker {
        let mut cmd = if prefix.is_empty() {
            Command::new(worker_path())
        } else {
            let mut c = Command::new(prefix[0]);
            c.args(&prefix[1..]).arg(worker_path());
            c
        };
        let mut child = cmd
            .args(args)
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
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

    fn next_line(&self, within: Duration) -> String {
        self.lines
            .recv_timeout(within)
            .unwrap_or_else(|e| panic!("no line from worker within {within:?}: {e}"))
    }

    fn wait(mut self, within: Duration) -> Vec<String> {
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
        self.lines.try_iter().collect()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn args(parts: &[&dyn ToString]) -> Vec<String> {
    parts.iter().map(|p| p.to_string()).collect()
}

/// The largest number of intervals open at one instant (an end at t closes before a start at t).
fn max_overlap(intervals: &[(u128, u128)]) -> usize {
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

#[test]
fn eight_processes_never_exceed_the_limit() {
    let server = RedisServer::start();
    let (processes, limit) = (8, 3);
    let workers: Vec<Worker> = (0..processes)
        .map(|_| {
            Worker::spawn(
                &[],
                &args(&[
                    &"hammer",
                    &server.url(),
                    &"fleet",
                    &limit,
                    &2000,
                    &3000,
                    &2000,
                ]),
            )
        })
        .collect();
    let mut intervals = Vec::new();
    let mut per_process = Vec::new();
    for worker in workers {
        let lines = worker.wait(Duration::from_secs(60));
        per_process.push(lines.len());
        for line in lines {
            let mut parts = line
                .split_whitespace()
                .skip(1)
                .map(|n| n.parse::<u128>().unwrap());
            intervals.push((parts.next().unwrap(), parts.next().unwrap()));
        }
    }
    let max = max_overlap(&intervals);
    println!(
        "{processes} processes, limit {limit}: {} holds ({per_process:?} per process), max overlap {max}",
        intervals.len()
    );
    assert!(
        max <= limit,
        "the fleet held {max} slots at once, limit {limit}"
    );
    assert_eq!(max, limit, "the test applied real contention");
    assert!(
        per_process.iter().all(|&n| n > 0),
        "every process got slots"
    );
}

#[test]
fn a_killed_holder_is_reclaimed_one_ttl_later_and_a_waiter_gets_the_slot() {
    let server = RedisServer::start();
    let ttl_ms = 1000;
    let holder = Worker::spawn(
        &[],
        &args(&[
            &"hold",
            &server.url(),
            &"kill",
            &1,
            &ttl_ms,
            &"victim",
            &60_000,
        ]),
    );
    assert!(holder
        .next_line(Duration::from_secs(10))
        .starts_with("acquired"));
    std::thread::sleep(Duration::from_millis(500)); // at least one renewal went through
    let mut holder = holder;
    holder.child.kill().unwrap(); // SIGKILL: no release, no more renewals
    holder.child.wait().unwrap();
    let killed = Instant::now();
    let waiter = Worker::spawn(
        &[],
        &args(&[&"hold", &server.url(), &"kill", &1, &ttl_ms, &"next", &10]),
    );
    let line = waiter.next_line(Duration::from_secs(10));
    let reuse = killed.elapsed();
    println!("slot of a SIGKILLed holder reused after {reuse:?} (ttl {ttl_ms} ms)");
    assert!(line.starts_with("acquired"), "{line}");
    assert!(reuse <= Duration::from_millis(ttl_ms + 1000), "{reuse:?}");
    assert_eq!(
        waiter.wait(Duration::from_secs(10)),
        vec!["held".to_string()]
    );
}

#[test]
fn client_clocks_an_hour_off_change_nothing() {
    assert!(
        Command::new("faketime").arg("--help").output().is_ok(),
        "this test needs faketime (scripts/test installs it)"
    );
    let server = RedisServer::start();
    let url = server.url();
    let ahead = ["faketime", "-f", "+1h"];
    let behind = ["faketime", "-f", "-1h"];
    // A holder with a true clock; ttl 1.5 s, held for 4 s through renewals.
    let holder = Worker::spawn(
        &[],
        &args(&[&"hold", &url, &"clock", &1, &1500, &"true", &4000]),
    );
    assert!(holder
        .next_line(Duration::from_secs(10))
        .starts_with("acquired"));
    for (skewed, offset_s) in [(&ahead, 3600i64), (&behind, -3600)] {
        // faketime must really move the worker's clock, or this test shows nothing.
        let clock = Worker::spawn(skewed, &args(&[&"clock", &url, &"clock", &1, &1500]));
        let line = clock.wait(Duration::from_secs(10));
        let worker_ms: i64 = line[0].strip_prefix("clock ").unwrap().parse().unwrap();
        let own_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        let skew_s = (worker_ms - own_ms) / 1000;
        assert!(
            (skew_s - offset_s).abs() < 60,
            "faketime {} moved the worker's clock by {skew_s} s",
            skewed[2]
        );
        let probe = Worker::spawn(
            skewed,
            &args(&[&"try", &url, &"clock", &1, &1500, &"skewed"]),
        );
        assert_eq!(
            probe.wait(Duration::from_secs(10)),
            vec!["full".to_string()],
            "a client with a clock {} did not evict a live lease",
            skewed[2]
        );
    }
    assert_eq!(
        holder.wait(Duration::from_secs(15)),
        vec!["held".to_string()]
    );

    // A holder an hour ahead renews by the server's clock: its deadline is never an hour away.
    let fast = Worker::spawn(
        &ahead,
        &args(&[&"hold", &url, &"clock", &1, &1500, &"fast", &2500]),
    );
    assert!(fast
        .next_line(Duration::from_secs(10))
        .starts_with("acquired"));
    std::thread::sleep(Duration::from_millis(1800));
    let time = server.command(&["TIME"]);
    let now_ms = match &time {
        leasehold_testkit::Reply::Array(parts) => {
            parts[0].as_string().unwrap().parse::<u64>().unwrap() * 1000
                + parts[1].as_string().unwrap().parse::<u64>().unwrap() / 1000
        }
        other => panic!("TIME replied {other:?}"),
    };
    let deadline: f64 = server
        .command(&["ZSCORE", "leasehold:{clock}:leases", "fast"])
        .as_string()
        .expect("the fast-clock holder still holds after more than one ttl")
        .parse()
        .unwrap();
    let ahead_ms = deadline as i64 - now_ms as i64;
    println!("fast-clock holder's deadline is {ahead_ms} ms ahead of server time (ttl 1500)");
    assert!((0..=1500).contains(&ahead_ms), "{ahead_ms}");
    assert_eq!(fast.wait(Duration::from_secs(15)), vec!["held".to_string()]);
}

/// Sends `signal` to `pid` and waits (at most 5 s) until /proc shows it stopped or not.
fn signal_and_settle(pid: u32, signal: libc::c_int, stopped: bool) {
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0);
    let end = Instant::now() + Duration::from_secs(5);
    while is_stopped(pid) != stopped {
        assert!(Instant::now() < end, "pid {pid} did not settle");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn is_stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name, which is in parentheses.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next())
        == Some('T')
}

/// One `work` step as the worker reported it.
struct Step {
    start: u128,
    end: u128,
    committed: bool,
}

/// F20: a holder SIGSTOPped, its task cancelled, and kept stopped past both the lease ttl and
/// the cancel marker's ttl, so that on resume neither the lease nor the marker exists. It must
/// stop at once anyway (its local deadline passed: the F3 path), commit no work after SIGCONT,
/// and its slot must have been free for someone else while it was stopped. `events` says
/// whether the holder listens to the quota's events: with them the cancel message waits in its
/// socket while it is stopped; without them the marker, gone by then, was its only way to hear.
fn holder_paused_past_the_marker_ttl(events: bool) {
    let server = RedisServer::start();
    let (ttl_ms, marker_ttl_ms) = (1000u64, 2000u64);
    let quota_name = if events { "f20-events" } else { "f20-quiet" };
    let leases_key = format!("leasehold:{{{quota_name}}}:leases");
    let marker_key = format!("leasehold:{{{quota_name}}}:cancel:victim");
    let mut holder = Worker::spawn(
        &[],
        &args(&[
            &"work",
            &server.url(),
            &quota_name,
            &1,
            &ttl_ms,
            &"victim",
            &marker_ttl_ms,
            &if events { "events" } else { "no-events" },
            &60_000,
        ]),
    );
    assert!(holder
        .next_line(Duration::from_secs(10))
        .starts_with("acquired"));
    let mut lines = Vec::new();
    // Working for a while (about half a ttl) before the pause.
    while lines.len() < 25 {
        lines.push(holder.next_line(Duration::from_secs(10)));
    }
    let pid = holder.child.id();
    signal_and_settle(pid, libc::SIGSTOP, true);
    let stopped_ns = leasehold_testkit::monotonic_ns();

    let rt = tokio::runtime::Runtime::new().unwrap();
    let quota = rt.block_on(async {
        let backend = leasehold::RedisBackend::connect(&server.url())
            .await
            .unwrap();
        leasehold::Quota::builder(quota_name)
            .limit(1)
            .ttl(Duration::from_millis(ttl_ms))
            .cancel_marker_ttl(Duration::from_millis(marker_ttl_ms))
            .backend(backend)
            .build()
            .unwrap()
    });
    let held = rt.block_on(quota.cancel("victim", "f20")).unwrap();
    assert!(
        held,
        "the stopped holder's lease was still there when cancelled"
    );
    assert_eq!(server.command(&["EXISTS", &marker_key]).as_int(), Some(1));

    // The slot comes back once the stopped holder's lease expires.
    let end = Instant::now() + Duration::from_secs(15);
    let other = rt.block_on(async {
        loop {
            match quota.try_acquire("other").await {
                Ok(lease) => break lease,
                Err(leasehold::Error::Full { .. }) if Instant::now() < end => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                Err(e) => panic!("the slot of the stopped holder never came back: {e:?}"),
            }
        }
    });
    let reclaimed_ms = (leasehold_testkit::monotonic_ns() - stopped_ns) / 1_000_000;
    assert!(is_stopped(pid), "reclaimed while the holder was stopped");

    // Past the marker ttl too: nothing in Redis tells the holder about the cancel any more.
    let end = Instant::now() + Duration::from_secs(15);
    while server.command(&["EXISTS", &marker_key]).as_int() != Some(0) {
        assert!(Instant::now() < end, "the cancel marker never expired");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(is_stopped(pid));
    let resumed_ns = leasehold_testkit::monotonic_ns();
    signal_and_settle(pid, libc::SIGCONT, false);

    loop {
        let line = holder.next_line(Duration::from_secs(10));
        let done = line == "done";
        lines.push(line);
        if done {
            break;
        }
    }
    let end = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = holder.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < end, "the holder did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "holder failed: {status}");
    let after_resume_ms = (leasehold_testkit::monotonic_ns() - resumed_ns) / 1_000_000;

    let steps: Vec<Step> = lines
        .iter()
        .filter_map(|line| {
            let mut parts = line.strip_prefix("step ")?.split_whitespace();
            Some(Step {
                start: parts.next()?.parse().ok()?,
                end: parts.next()?.parse().ok()?,
                committed: parts.next()? == "committed",
            })
        })
        .collect();
    let lost = lines
        .iter()
        .find_map(|line| line.strip_prefix("lost "))
        .unwrap_or_else(|| panic!("the holder reported no loss: {lines:?}"));
    let discarded = steps.iter().filter(|s| !s.committed).count();
    println!(
        "events {events}: slot reclaimed {reclaimed_ms} ms after SIGSTOP; after SIGCONT the \
         holder reported lost {lost} and exited within {after_resume_ms} ms; {} steps \
         committed, {discarded} discarded",
        steps.len() - discarded
    );
    assert!(!lines.iter().any(|line| line == "completed"));
    let expected = lost == "LocalDeadline"
        || lost == "Expired"
        || (events && lost.starts_with("Cancelled(\"f20\")"));
    assert!(expected, "lost {lost}");
    assert!(
        steps.iter().any(|s| s.committed),
        "it worked before the pause"
    );
    for step in &steps {
        assert!(
            step.start < stopped_ns,
            "a step started after the pause: {}",
            step.start
        );
        assert!(
            !(step.committed && step.end >= resumed_ns),
            "a step was committed after SIGCONT"
        );
    }
    assert!(discarded <= 1, "only the step the pause interrupted");
    // The resumed holder put nothing back: the slot is the other task's alone.
    assert_eq!(
        server.command(&["ZRANGE", &leases_key, "0", "-1"]),
        leasehold_testkit::Reply::Array(vec![leasehold_testkit::Reply::Bulk(b"other".to_vec())])
    );
    rt.block_on(other.release()).unwrap();
}

#[test]
fn a_holder_paused_past_the_marker_ttl_stops_on_resume() {
    holder_paused_past_the_marker_ttl(true);
}

#[test]
fn a_holder_paused_past_the_marker_ttl_without_events_stops_on_resume() {
    holder_paused_past_the_marker_ttl(false);
}
