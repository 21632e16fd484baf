//! `leasehold demo --headless`, as a user runs it: the summary table in memory, the JSON
//! summary against a private redis-server, and the demo's usage errors.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use leasehold_testkit::RedisServer;
use serde_json::Value;

/// Fast settings that show all three behaviours within a few seconds (see docs/DEMO.md).
const FAST: &[&str] = &[
    "--limit",
    "4",
    "--crash-probability",
    "0.3",
    "--ttl",
    "500ms",
    "--task-duration",
    "200ms",
    "--seed",
    "3",
];
/// Slack on top of ttl + heartbeat for a crashed lease to be seen gone: one 100 ms sampling
/// period plus scheduling delay on a busy 2-core machine (docs/DEMO.md). What it guards is a
/// slot that comes back about one ttl after the crash, not never or a ttl later; the tight
/// figure is the demo's to show, not a test's to time.
const RECOVERY_TOLERANCE_MS: u64 = 500;

fn demo(args: &[&str]) -> Output {
    demo_with_env(args, None)
}

/// `leasehold demo ARGS`, with `LEASEHOLD_REDIS_URL` set to `redis_env` if given.
fn demo_with_env(args: &[&str], redis_env: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_leasehold"));
    command.arg("demo").args(args).env_remove("LEASEHOLD_QUOTA");
    match redis_env {
        Some(url) => command.env("LEASEHOLD_REDIS_URL", url),
        None => command.env_remove("LEASEHOLD_REDIS_URL"),
    };
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn leasehold demo");
    let end = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("poll the demo").is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            panic!("leasehold demo did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("the demo's output")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_summary_table_shows_the_leak_and_the_healing() {
    let out = demo(&[&["--headless", "--duration", "5s"], FAST].concat());
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    let row = |name: &str| -> Vec<String> {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} row in:\n{text}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    assert!(text.contains("TIME TO RECOVER"), "{text}");
    // SEMANTICS ADMITTED REFUSED OVER-ADMITTED PEAK CRASHED LEAKED COUNT MIN-AVAILABLE RECOVER
    let counter = row("counter");
    assert_eq!(counter[6], "4", "every slot leaked: {counter:?}");
    assert_eq!(counter[8], "0", "nothing left to admit: {counter:?}");
    assert_eq!(counter[9], "never");
    let lease = row("lease");
    assert_eq!(lease[3], "0", "the lease never over-admits: {lease:?}");
    assert!(lease[4].parse::<u32>().unwrap() <= 4, "{lease:?}");
    assert_eq!(lease[6], "0", "no lease leaks: {lease:?}");
    assert!(lease[9].ends_with('s'), "the lease recovered: {lease:?}");
    assert_eq!(row("ttl-counter").len(), 10, "a full ttl-counter row");
}

#[test]
fn against_redis_the_counters_are_real_keys_and_the_lease_a_real_quota() {
    let server = RedisServer::start();
    let url = server.url();
    let out = demo(
        &[
            &["--redis", &url, "--headless", "--json", "--duration", "5s"],
            FAST,
        ]
        .concat(),
    );
    assert!(out.status.success(), "{out:?}");
    let summary: Value = serde_json::from_str(&stdout(&out)).expect("one JSON object");
    assert_eq!(summary["store"], "redis");
    let column = |name: &str| -> &Value {
        summary["semantics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["semantics"] == name)
            .unwrap_or_else(|| panic!("no {name} in {summary}"))
    };
    let int = |v: &Value| v.as_i64().unwrap_or_else(|| panic!("not an integer: {v}"));

    let counter = column("counter");
    assert_eq!(int(&counter["leaked_at_end"]), 4, "{counter}");
    // A refused INCR counts for one round trip before its DECR, and a sample may see it.
    assert!(
        (-1..=0).contains(&int(&counter["min_available"])),
        "{counter}"
    );
    assert!(counter["time_to_recover_ms"].is_null());
    // The leak is in Redis itself, for anyone to see with redis-cli.
    let key = server.command(&["GET", "leasehold-demo:{counter}:count"]);
    assert_eq!(key.as_string().as_deref(), Some("4"));

    let ttl_counter = column("ttl-counter");
    assert!(int(&ttl_counter["over_admitted"]) >= 1, "{ttl_counter}");
    assert!(int(&ttl_counter["peak_running"]) > 4, "{ttl_counter}");

    let lease = column("lease");
    assert_eq!(int(&lease["over_admitted"]), 0, "{lease}");
    assert!(int(&lease["peak_running"]) <= 4);
    assert!(
        int(&lease["crashes"]) >= 3,
        "the run must crash tasks: {lease}"
    );
    assert_eq!(int(&lease["leaked_at_end"]), 0);
    let bound = 500 + int(&summary["heartbeat_ms"]) as u64 + RECOVERY_TOLERANCE_MS;
    let worst = int(&lease["time_to_recover_ms"]) as u64;
    assert!(
        worst <= bound,
        "a crashed lease took {worst} ms (bound {bound} ms)"
    );
    let leases = server.command(&["ZCARD", "leasehold:{demo}:leases"]);
    assert_eq!(
        leases.as_int(),
        Some(0),
        "the quota `demo` is empty at the end"
    );
}

#[test]
fn bad_settings_are_usage_errors() {
    for args in [
        &["--headless", "--limit", "0"][..],
        &["--headless", "--crash-probability", "2"],
        &["--json"],
    ] {
        let out = demo(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("leasehold: "), "{args:?}: {err}");
    }
}

#[test]
fn out_of_range_speed_seed_and_rate_are_one_line_usage_errors() {
    for (args, says) in [
        // It used to panic in a Duration conversion (exit 101).
        (
            &["--headless", "--speed", "1e-300"][..],
            "speed must be between",
        ),
        (
            &["--headless", "--ttl", "1000000000000s", "--speed", "0.5"],
            "ttl / speed",
        ),
        // The page could not show it exactly.
        (
            &["--headless", "--seed", "9007199254740992"],
            "seed must be at most",
        ),
        // 4000 tasks/s: on Redis it used to pile up tasks and memory without bound.
        (
            &[
                "--headless",
                "--duration",
                "5s",
                "--limit",
                "50",
                "--speed",
                "10",
                "--task-duration",
                "100ms",
            ],
            "4000 tasks/s",
        ),
    ] {
        let out = demo(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with("leasehold: demo: "), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
    }
}

#[test]
fn the_demo_ignores_leasehold_redis_url() {
    let server = RedisServer::start();
    // What a real `leasehold run --quota demo` and an earlier demo left there.
    server.command(&["SET", "leasehold-demo:{counter}:count", "7"]);
    server.command(&["ZADD", "leasehold:{demo}:leases", "1", "a-real-task"]);
    let out = demo_with_env(
        &["--headless", "--json", "--duration", "1s"],
        Some(&server.url()),
    );
    assert!(out.status.success(), "{out:?}");
    let summary: Value = serde_json::from_str(&stdout(&out)).expect("one JSON object");
    assert_eq!(summary["store"], "memory", "{summary}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ignoring LEASEHOLD_REDIS_URL"), "{err}");
    let key = server.command(&["GET", "leasehold-demo:{counter}:count"]);
    assert_eq!(
        key.as_string().as_deref(),
        Some("7"),
        "the key was left alone"
    );
    let leases = server.command(&["ZCARD", "leasehold:{demo}:leases"]);
    assert_eq!(leases.as_int(), Some(1), "the quota `demo` was left alone");
}

#[test]
fn at_the_highest_accepted_rate_the_columns_keep_up_on_redis() {
    let server = RedisServer::start();
    let url = server.url();
    // 0.8 × 50 × 10 / 800 ms = 500 tasks/s, the most the demo accepts.
    let args = [
        "--redis",
        &url,
        "--headless",
        "--json",
        "--duration",
        "3s",
        "--limit",
        "50",
        "--speed",
        "10",
        "--task-duration",
        "800ms",
        "--ttl",
        "2s",
    ];
    let began = Instant::now();
    let out = demo(&args);
    let took = began.elapsed();
    assert!(out.status.success(), "{out:?}");
    // 3 s of tasks, their last holds (at most 120 ms), the drain (about 0.6 s) and the start:
    // no backlog drags the run on.
    assert!(took < Duration::from_secs(15), "the run took {took:?}");
    let summary: Value = serde_json::from_str(&stdout(&out)).expect("one JSON object");
    let columns = summary["semantics"].as_array().expect("columns");
    let int = |c: &Value, k: &str| c[k].as_u64().unwrap_or_else(|| panic!("{k} in {c}"));
    let submitted: Vec<u64> = columns
        .iter()
        .map(|c| int(c, "admitted") + int(c, "refused") + int(c, "shed"))
        .collect();
    assert!(
        submitted.iter().all(|&n| n == submitted[0]),
        "the columns got the same tasks: {submitted:?}"
    );
    // About 1500 in 3 s; a busy machine may start fewer, and a backlog would show as more.
    assert!(
        (750..=2000).contains(&submitted[0]),
        "about 1500 tasks in 3 s: {submitted:?}"
    );
    for c in columns {
        // Queueing once showed 681 tasks running on a TTL counter of limit 50.
        assert!(int(c, "peak_running") <= 150, "{c}");
        if c["semantics"] == "lease" {
            assert!(int(c, "peak_running") <= 50, "{c}");
        }
    }
}
