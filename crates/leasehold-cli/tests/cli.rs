//! The built `leasehold` binary, as separate processes, against a private redis-server.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::*;
use leasehold_testkit::{free_port, RedisServer};

#[test]
fn ten_runs_on_limit_three_never_overlap_more_than_three() {
    let server = RedisServer::start();
    let dir = TempDir::new("leasehold-cli-overlap");
    let log = dir.join("log");
    let script = format!(
        r#"echo "$LEASEHOLD_TASK_ID start $(date +%s%N)" >> {0}; sleep 0.3; echo "$LEASEHOLD_TASK_ID end $(date +%s%N)" >> {0}"#,
        log.display()
    );
    let runs: Vec<Reaped> = (0..10)
        .map(|_| {
            leasehold(&server.url(), "overlap")
                .args([
                    "run", "--limit", "3", "--ttl", "3s", "--", "sh", "-c", &script,
                ])
                .spawn_reaped()
        })
        .collect();
    for mut run in runs {
        assert_eq!(wait_exit(&mut run, Duration::from_secs(30)), 0);
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let mut edges: Vec<(u128, i32)> = text
        .lines()
        .map(|line| {
            let parts: Vec<&str> = line.split_whitespace().collect();
            let delta = if parts[1] == "start" { 1 } else { -1 };
            (parts[2].parse().unwrap(), delta)
        })
        .collect();
    assert_eq!(edges.len(), 20, "all 10 commands ran to the end:\n{text}");
    edges.sort();
    let (mut open, mut max) = (0, 0);
    for (_, delta) in edges {
        open += delta;
        max = max.max(open);
    }
    println!("10 runs, limit 3: maximum overlap {max}");
    assert!(max <= 3, "{max} commands ran at once");
    // Ten 0.3 s commands started together: the limit was reached, so runs did wait for slots
    // (else the bound above showed nothing).
    assert_eq!(max, 3, "the runs never contended for the slots");
}

#[test]
fn the_commands_exit_code_propagates_and_a_full_quota_exits_75_at_once() {
    let server = RedisServer::start();
    let out = run_cli(
        &server.url(),
        "codes",
        ["run", "--limit", "1", "--", "sh", "-c", "exit 7"],
    );
    assert_eq!(out.status.code(), Some(7));
    let out = run_cli(
        &server.url(),
        "codes",
        ["run", "--limit", "1", "--", "sh", "-c", "kill -KILL $$"],
    );
    // Like a shell (128 + 9), and like the command: `leasehold run` ends by the same signal, so
    // a script or a loop sees what it would have seen without it.
    assert_eq!(
        out.status.signal(),
        Some(9),
        "killed by SIGKILL, like its command"
    );
    assert_eq!(shell_code(out.status), 128 + 9);
    let holder = spawn_holder(
        &server,
        "codes",
        &["--limit", "1"],
        "holder",
        &["sleep", "30"],
    );
    let started = Instant::now();
    let out = try_once(&server.url(), "codes", &["--limit", "1"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(started.elapsed() < Duration::from_secs(2));
    let out = run_cli(
        &server.url(),
        "codes",
        ["run", "--limit", "1", "--wait", "300ms", "--", "true"],
    );
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    drop(holder);
}

#[test]
fn a_sigkilled_run_and_its_command_free_the_slot_one_ttl_later() {
    let server = RedisServer::start();
    let dir = TempDir::new("leasehold-cli-kill");
    let pidfile = dir.join("pid");
    let mut victim = spawn_holder(
        &server,
        "kill",
        &["--limit", "1", "--ttl", "1s"],
        "victim",
        &[
            "sh",
            "-c",
            &format!("echo $$ > {}; exec sleep 60", pidfile.display()),
        ],
    );
    std::thread::sleep(Duration::from_millis(500)); // a renewal went through
    let child_pid = pid_from(&pidfile);
    victim.kill().unwrap(); // SIGKILL leasehold run: no release, no renewal
    victim.wait().unwrap();
    // SAFETY: kill(2) on the child's pid; no memory involved.
    unsafe { libc::kill(child_pid, libc::SIGKILL) };
    let killed = Instant::now();
    let out = run_cli(
        &server.url(),
        "kill",
        ["run", "--limit", "1", "--ttl", "1s", "--", "true"],
    );
    let reuse = killed.elapsed();
    println!("slot of a SIGKILLed `leasehold run` reused after {reuse:?} (ttl 1s)");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(reuse < Duration::from_secs(3), "{reuse:?}");
}

/// Runs `command` under `leasehold run` with task id `job`, cancels the task once the command
/// runs (once `ready` exists, when given: a command that sets a trap first says so), and returns
/// the exit code and how long the exit took after the cancel.
fn cancel_run(
    server: &RedisServer,
    quota: &str,
    command: &[&str],
    grace: &str,
    ready: Option<&std::path::Path>,
) -> (i32, Duration) {
    let mut run = leasehold(&server.url(), quota)
        .args([
            "run",
            "--limit",
            "1",
            "--task-id",
            "job",
            "--grace",
            grace,
            "--",
        ])
        .args(command)
        .stderr(Stdio::null())
        .spawn_reaped();
    wait_held(server, quota, "job");
    match ready {
        Some(ready) => {
            let end = Instant::now() + Duration::from_secs(10);
            while !ready.exists() {
                assert!(Instant::now() < end, "the command never said it was ready");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        None => std::thread::sleep(Duration::from_millis(200)), // let the command start
    }
    let cancelled = Instant::now();
    let out = run_cli(&server.url(), quota, ["cancel", "job", "--reason", "test"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let code = wait_exit(&mut run, Duration::from_secs(15));
    (code, cancelled.elapsed())
}

#[test]
fn cancel_from_another_process_stops_the_command() {
    let server = RedisServer::start();
    let (code, took) = cancel_run(&server, "cancel", &["sleep", "60"], "5s", None);
    println!("cancel to `leasehold run` exit (command obeys SIGTERM): {took:?}");
    assert_eq!(code, 80);
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(holders(&server, "cancel"), 0, "the slot was released");

    // The trap in place before the cancel: a SIGTERM before it would end the shell at once.
    let dir = TempDir::new("leasehold-cli-stubborn");
    let ready = dir.join("ready");
    let script = format!(
        "trap '' TERM; touch {}; while true; do sleep 0.1; done",
        ready.display()
    );
    let stubborn = ["sh", "-c", &script];
    let (code, took) = cancel_run(&server, "cancel2", &stubborn, "1s", Some(&ready));
    println!("cancel to exit (command ignores SIGTERM, grace 1s): {took:?}");
    assert_eq!(code, 80);
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(4),
        "{took:?}"
    );
    assert_eq!(holders(&server, "cancel2"), 0);
}

#[test]
fn sigterm_to_run_is_forwarded_and_the_slot_released_after_the_command_exits() {
    let server = RedisServer::start();
    let mut run = spawn_holder(&server, "term", &["--limit", "1"], "t", &["sleep", "60"]);
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: kill(2) on our child's pid.
    unsafe { libc::kill(run.id() as i32, libc::SIGTERM) };
    assert_eq!(wait_exit(&mut run, Duration::from_secs(10)), 128 + 15);
    assert_eq!(holders(&server, "term"), 0);
}

#[test]
fn status_shows_holders_as_a_table_and_as_json() {
    let server = RedisServer::start();
    let mut run = spawn_holder(
        &server,
        "st",
        &["--limit", "2"],
        "visible",
        &["sleep", "30"],
    );
    let table = run_cli(&server.url(), "st", ["status", "--limit", "2"]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("1 held, limit 2 (version 0), free 1"),
        "{text}"
    );
    assert!(text.contains("visible"), "{text}");
    let json = run_cli(&server.url(), "st", ["status", "--json"]);
    let doc: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(doc["held"], 1);
    assert_eq!(doc["holders"][0]["task_id"], "visible");
    // Without --limit: the limit Redis stores.
    assert_eq!(
        (doc["limit"].as_u64(), doc["free"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(doc["limit_version"], 0);
    assert!(doc["holders"][0]["fencing_token"].as_u64().unwrap() >= 1);
    let released = run_cli(&server.url(), "st", ["release", "visible"]);
    assert_eq!(released.status.code(), Some(0));
    assert_eq!(
        wait_exit(&mut run, Duration::from_secs(10)),
        79,
        "lease lost: released elsewhere"
    );
    assert_eq!(
        take_stderr(&mut run).trim(),
        "leasehold: lease released elsewhere; the command was stopped"
    );
}

/// A waiting run rides out a Redis pause shorter than the holders' ttl, as the holders do,
/// instead of giving up with exit 69.
#[test]
fn a_waiting_run_keeps_waiting_through_a_short_redis_outage() {
    let server = RedisServer::start();
    let mut holder = spawn_holder(
        &server,
        "blip",
        &["--limit", "1", "--ttl", "10s"],
        "holder",
        &["sleep", "4"],
    );
    let mut waiter = spawn_refused(
        &server,
        "blip",
        leasehold(&server.url(), "blip")
            .args(["run", "--limit", "1", "--wait", "60s", "--", "true"])
            .stderr(Stdio::piped()),
    );
    std::thread::sleep(Duration::from_millis(300));
    server.pause();
    std::thread::sleep(Duration::from_millis(2500));
    server.resume();
    assert_eq!(wait_exit(&mut holder, Duration::from_secs(20)), 0);
    let code = wait_exit(&mut waiter, Duration::from_secs(20));
    let said = take_stderr(&mut waiter);
    assert_eq!(code, 0, "the waiter ran once the holder was done: {said}");
}

/// A wait that runs out while Redis does not answer (paused, as a partition looks) is Redis
/// unavailable, exit 69, even when the attempt out at that moment was still waiting on its call
/// timeout; once Redis answers again, a full quota is exit 75 naming the whole wait.
#[test]
fn a_wait_that_runs_out_during_an_outage_exits_69_and_after_it_75() {
    let server = RedisServer::start();
    let holder = spawn_holder(
        &server,
        "paused",
        &["--limit", "1", "--ttl", "30s"],
        "holder",
        &["sleep", "30"],
    );
    let waiter = |wait: &str| {
        let mut cmd = leasehold(&server.url(), "paused");
        cmd.args(["run", "--limit", "1", "--wait", wait, "--", "true"])
            .stderr(Stdio::piped());
        cmd
    };
    // Paused early in the wait, and within its last call timeout (no attempt failed before the
    // wait ran out).
    for (wait, pause_after) in [("2s", 300), ("3s", 2300)] {
        // Connected and refused once before the pause: a run that cannot connect at all is
        // another case (69 at once, "unreachable" at connect).
        let mut run = spawn_refused(&server, "paused", &mut waiter(wait));
        std::thread::sleep(Duration::from_millis(pause_after));
        server.pause();
        let code = wait_exit(&mut run, Duration::from_secs(20));
        server.resume();
        let text = take_stderr(&mut run);
        assert_eq!(code, 69, "--wait {wait}: {text}");
        assert!(text.contains("ran out"), "{text}");
    }
    let mut run = waiter("1s").spawn_reaped();
    std::thread::sleep(Duration::from_millis(200));
    server.pause();
    std::thread::sleep(Duration::from_millis(400));
    server.resume();
    let code = wait_exit(&mut run, Duration::from_secs(20));
    let text = take_stderr(&mut run);
    assert_eq!(code, 75, "{text}");
    assert!(text.contains("within 1s"), "{text}");
    drop(holder);
}

#[test]
fn status_shows_the_quarantine_after_redis_lost_the_quota() {
    let server = RedisServer::start();
    // A quarantine of one ttl, 30 s: far longer than the two status calls below take even on a
    // slow machine, so it is still on when they look.
    let quarantine = Duration::from_secs(30);
    let run = spawn_holder(
        &server,
        "lost",
        &["--limit", "2", "--ttl", "30s", "--heartbeat", "200ms"],
        "survivor",
        &["sleep", "60"],
    );
    server.command(&["FLUSHALL"]);
    // The holder's next renewal finds its lease gone with the epoch it knew: it re-registers
    // and starts the quarantine.
    wait_held(&server, "lost", "survivor");
    let json = run_cli(&server.url(), "lost", ["status", "--json", "--limit", "2"]);
    let doc: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let left = doc["quarantine_ms"].as_u64();
    assert!(
        left.is_some_and(|ms| ms > 0 && ms <= quarantine.as_millis() as u64),
        "{doc}"
    );
    assert_eq!(
        (doc["held"].as_u64(), doc["free"].as_u64()),
        (Some(1), Some(0)),
        "the quarantine holds the slot Redis forgot: {doc}"
    );
    let table = run_cli(&server.url(), "lost", ["status", "--limit", "2"]);
    let text = String::from_utf8_lossy(&table.stdout);
    println!("{text}");
    assert!(
        text.contains("1 held, limit 2") && text.contains(", free 0"),
        "{text}"
    );
    assert!(text.contains("quarantined for "), "{text}");
    drop(run);
}

#[test]
fn bad_input_gets_one_line_and_a_non_zero_exit_never_a_panic() {
    let server = RedisServer::start_with(&["--requirepass", "pw"]);
    let port = server.port();
    let good = format!("redis://:pw@127.0.0.1:{port}/");
    let cases: Vec<(Vec<String>, i32)> = vec![
        (
            vec![
                "run".into(),
                "--limit".into(),
                "1".into(),
                "--bogus".into(),
                "--".into(),
                "true".into(),
            ],
            2,
        ),
        (
            vec![
                "run".into(),
                "--limit".into(),
                "0".into(),
                "--".into(),
                "true".into(),
            ],
            78,
        ),
        (
            vec![
                "run".into(),
                "--limit".into(),
                "-1".into(),
                "--".into(),
                "true".into(),
            ],
            2,
        ),
        (
            vec!["--redis".into(), "not a url".into(), "status".into()],
            78,
        ),
        (
            vec![
                "--redis".into(),
                format!("redis://127.0.0.1:{}/", free_port()),
                "status".into(),
            ],
            69,
        ),
        (
            vec![
                "--redis".into(),
                format!("redis://:wrong@127.0.0.1:{port}/"),
                "status".into(),
            ],
            78,
        ),
        (
            vec![
                "--redis".into(),
                format!("redis://127.0.0.1:{port}/"),
                "status".into(),
            ],
            78,
        ),
        (vec!["--quota".into(), "a{b}".into(), "status".into()], 78),
        (
            vec![
                "run".into(),
                "--limit".into(),
                "1".into(),
                "--".into(),
                "/no/such/command".into(),
            ],
            127,
        ),
    ];
    for (args, code) in cases {
        let out = run_cli(&good, "bad", &args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: one line, got {err:?}"
        );
        assert!(err.starts_with("leasehold: "), "{args:?}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("backtrace"),
            "{err}"
        );
    }
    let no_redis = output({
        let mut c = Command::new(env!("CARGO_BIN_EXE_leasehold"));
        c.args(["status", "--quota", "q"])
            .env_remove("LEASEHOLD_REDIS_URL");
        c
    });
    assert_eq!(no_redis.status.code(), Some(2));
    assert!(
        stderr(&no_redis).contains("needs --redis"),
        "{}",
        stderr(&no_redis)
    );
}

#[test]
fn a_command_that_cannot_start_leaves_no_slot_held() {
    let server = RedisServer::start();
    let url = server.url();
    let dir = TempDir::new("leasehold-cli-unstartable");
    // A file without execute permission (not a system file: their modes vary by machine).
    let plain = dir.join("not-executable");
    std::fs::write(&plain, "echo ran\n").unwrap();
    let plain = plain.to_str().unwrap();
    for (command, code) in [("/no/such/command", 127), (plain, 126)] {
        let out = run_cli(
            &url,
            "unstartable",
            ["run", "--limit", "1", "--ttl", "30s", "--", command],
        );
        assert_eq!(out.status.code(), Some(code), "{command}: {}", stderr(&out));
        assert_eq!(
            holders(&server, "unstartable"),
            0,
            "{command}: the slot stayed held after the run exited"
        );
    }
}

#[test]
fn a_signal_while_waiting_leaves_no_late_admission_behind() {
    let server = RedisServer::start();
    let url = server.url();
    let quota = "interrupted";
    let run_sleep = ["run", "--limit", "1", "--ttl", "30s", "--", "sleep", "30"];
    let mut holder = leasehold(&url, quota);
    holder
        .args(["run", "--task-id", "holder"])
        .args(&run_sleep[1..]);
    let mut holder = holder.spawn_reaped();
    // Its signal handlers are in place once it holds the slot.
    wait_held(&server, quota, "holder");
    let mut waiters = Vec::new();
    // Several waiters, interrupted at different moments after the slot frees: some may have an
    // admission on its way when the signal lands.
    for _ in 0..4 {
        let mut waiter = leasehold(&url, quota);
        waiter.args(run_sleep).stderr(Stdio::null());
        waiters.push(waiter.spawn_reaped());
    }
    std::thread::sleep(Duration::from_millis(500));
    unsafe { libc::kill(holder.id() as i32, libc::SIGTERM) };
    wait_exit(&mut holder, Duration::from_secs(10));
    for waiter in &mut waiters {
        std::thread::sleep(Duration::from_millis(2));
        unsafe { libc::kill(waiter.id() as i32, libc::SIGINT) };
    }
    for mut waiter in waiters {
        let code = wait_exit(&mut waiter, Duration::from_secs(10));
        // 130 either way: interrupted while waiting, or its command got the forwarded SIGINT.
        assert_eq!(code, 130, "interrupted while waiting, or its command was");
    }
    assert_eq!(
        holders(&server, quota),
        0,
        "an interrupted run left a slot held"
    );
}

/// Bad input is refused before any network call: the same exit 78 with Redis up or down.
#[test]
fn bad_input_is_refused_before_connecting() {
    let refused = format!("redis://127.0.0.1:{}/", free_port());
    let too_new = (leasehold::MAX_LIMIT_VERSION + 1).to_string();
    let long_reason = "r".repeat(leasehold::MAX_CANCEL_REASON_BYTES + 1);
    let cases: [&[&str]; 8] = [
        &["run", "--limit", "0", "--", "true"],
        &[
            "run",
            "--limit",
            "1",
            "--limit-version",
            &too_new,
            "--",
            "true",
        ],
        &["run", "--limit", "1", "--ttl", "1ms", "--", "true"],
        &["run", "--limit", "1", "--task-id", "", "--", "true"],
        &["cancel", ""],
        &["cancel", "t", "--reason", &long_reason],
        &["release", ""],
        &["--quota", "a{b", "status"],
    ];
    for args in cases {
        let out = run_cli(&refused, "q", args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(78), "{args:?}: {err}");
        assert!(!err.contains("unavailable"), "{args:?}: {err}");
    }
}

/// Errors stay one line (a server that is not Redis answers with several), and a URL's
/// password never reaches the terminal, in an error or in the help.
#[test]
fn errors_are_one_line_and_never_show_a_password() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let not_redis = std::thread::spawn(move || {
        // Answer one connection like a web server would, then stop.
        if let Ok((mut socket, _)) = listener.accept() {
            use std::io::Write;
            let _ =
                socket.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\n<html>\n<p>no</p>\n</html>\n");
        }
    });
    let out = run_cli(&format!("redis://127.0.0.1:{port}/"), "q", ["status"]);
    let err = stderr(&out);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err:?}");
    not_redis.join().unwrap();

    let out = run_cli(
        &format!("redis://admin:s3cret@127.0.0.1:{}/x", free_port()),
        "q",
        ["status"],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(78), "{err}");
    assert!(!err.contains("s3cret"), "{err}");
    assert!(err.contains("admin:***@"), "{err}");
    // A mistyped scheme: nothing tells the user-info apart, so all of it is hidden.
    for url in ["redis//:s3cret@127.0.0.1:1/", "s3cret@127.0.0.1:1"] {
        let out = run_cli(url, "q", ["status"]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(78), "{err}");
        assert!(!err.contains("s3cret") && err.contains("***@"), "{err}");
    }

    // Help shows that the variable exists, never its value.
    for help in [&["--help"][..], &["status", "-h"][..]] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .args(help)
            .env("LEASEHOLD_REDIS_URL", "redis://admin:s3cret@127.0.0.1:1/")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{text}");
        assert!(text.contains("LEASEHOLD_REDIS_URL"), "{text}");
        assert!(!text.contains("s3cret"), "{help:?}: {text}");
    }
}

/// A closed or full stdout is an error line and an exit code, never a panic; a release that
/// took effect still exits 0.
#[test]
fn output_that_cannot_be_written_is_reported_not_panicked() {
    let server = RedisServer::start();
    let full = || Stdio::from(std::fs::File::create("/dev/full").unwrap());

    let mut status = leasehold(&server.url(), "out");
    status.arg("status").stdout(full()).stderr(Stdio::piped());
    let out = wait_output(status.spawn_reaped(), Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(74), "{}", stderr(&out));
    assert_eq!(
        stderr(&out).trim_end().lines().count(),
        1,
        "{}",
        stderr(&out)
    );

    // The reader went away before anything was written, as with `| head -0`.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut closed = leasehold(&server.url(), "out");
    closed.arg("status").stdout(writer).stderr(Stdio::piped());
    let out = wait_output(closed.spawn_reaped(), Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(74));
    assert_eq!(stderr(&out), "", "a closed pipe is not worth a message");

    server.command(&["ZADD", "leasehold:{out}:leases", "99999999999999", "h"]);
    server.command(&["HSET", "leasehold:{out}:holders", "h", "7:0"]);
    let mut release = leasehold(&server.url(), "out");
    release
        .args(["release", "h"])
        .stdout(full())
        .stderr(Stdio::piped());
    let out = wait_output(release.spawn_reaped(), Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stderr(&out).contains("cannot write"), "{}", stderr(&out));
    assert_eq!(holders(&server, "out"), 0);
}

/// F29 on the command line: Redis keeps one limit per quota; a higher --limit-version replaces it,
/// a lower one runs under it, and the same version with another limit exits 78, taking no slot.
#[test]
fn limit_versions_decide_the_limit_and_a_mismatch_exits_78() {
    let server = RedisServer::start();
    let mut holder = spawn_holder(
        &server,
        "lv",
        &["--limit", "2", "--limit-version", "1"],
        "a",
        &["sleep", "30"],
    );
    let mismatch = try_once(
        &server.url(),
        "lv",
        &["--limit", "3", "--limit-version", "1"],
    );
    let err = stderr(&mismatch);
    assert_eq!(mismatch.status.code(), Some(78), "{err}");
    assert!(err.contains("limit mismatch"), "{err}");
    // In the command line's words: what was asked, and which flag changes it.
    assert!(err.contains("limit 3 asked"), "{err}");
    assert!(err.contains("--limit-version above 1"), "{err}");
    assert!(!err.contains("handle"), "{err}");
    assert_eq!(holders(&server, "lv"), 1, "the refused run took no slot");
    // An older version runs under the stored limit 2, not its own 1 (which is full).
    let older = try_once(&server.url(), "lv", &["--limit", "1"]);
    assert_eq!(older.status.code(), Some(0), "{}", stderr(&older));
    let json = run_cli(&server.url(), "lv", ["status", "--json"]);
    let doc: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(
        (doc["limit"].as_u64(), doc["limit_version"].as_u64()),
        (Some(2), Some(1))
    );
    // A higher version lowers it to 1 for everyone: the holder keeps its slot, nobody else runs.
    let lower = try_once(
        &server.url(),
        "lv",
        &["--limit", "1", "--limit-version", "2"],
    );
    assert_eq!(lower.status.code(), Some(75), "{}", stderr(&lower));
    let older = try_once(
        &server.url(),
        "lv",
        &["--limit", "2", "--limit-version", "1"],
    );
    assert_eq!(older.status.code(), Some(75), "{}", stderr(&older));
    assert_eq!(
        holders(&server, "lv"),
        1,
        "lowering the limit evicted nobody"
    );
    let table = run_cli(&server.url(), "lv", ["status"]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("1 held, limit 1 (version 2), free 0"),
        "{text}"
    );
    // SAFETY: kill(2) on our child's pid.
    unsafe { libc::kill(holder.id() as i32, libc::SIGTERM) };
    wait_exit(&mut holder, Duration::from_secs(10));
}

#[test]
fn limit_changes_the_stored_limit_for_every_run_and_refuses_a_version_not_above_it() {
    let server = RedisServer::start();
    let mut holder = spawn_holder(&server, "ops", &["--limit", "3"], "a", &["sleep", "30"]);
    let set = run_cli(&server.url(), "ops", ["limit", "1"]);
    assert_eq!(set.status.code(), Some(0), "{}", stderr(&set));
    let said = String::from_utf8_lossy(&set.stdout);
    assert!(said.contains("limit 1 (version 1) stored"), "{said}");
    // Runs built with --limit 3 (version 0) now admit against 1: full, and the holder stays.
    let full = try_once(&server.url(), "ops", &["--limit", "3"]);
    assert_eq!(full.status.code(), Some(75), "{}", stderr(&full));
    assert_eq!(holders(&server, "ops"), 1);
    // The same command again is a no-op; a version not above the stored one changes nothing.
    let again = run_cli(&server.url(), "ops", ["limit", "1", "--limit-version", "1"]);
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    let stale = run_cli(&server.url(), "ops", ["limit", "5", "--limit-version", "1"]);
    assert_eq!(stale.status.code(), Some(78), "{}", stderr(&stale));
    assert!(
        stderr(&stale).contains(
            "limit mismatch: limit 5 asked at version 1, but the quota stores limit 1 under that \
             version; pass a --limit-version above 1"
        ),
        "{}",
        stderr(&stale)
    );
    let lower = run_cli(&server.url(), "ops", ["limit", "5", "--limit-version", "0"]);
    assert_eq!(lower.status.code(), Some(78), "{}", stderr(&lower));
    assert!(
        stderr(&lower).contains("not changed: limit 1 is stored at version 1"),
        "{}",
        stderr(&lower)
    );
    // The same N at an older version is refused like any older version, not a no-op.
    let older_same = run_cli(&server.url(), "ops", ["limit", "1", "--limit-version", "0"]);
    assert_eq!(
        older_same.status.code(),
        Some(78),
        "{}",
        stderr(&older_same)
    );
    let bad = run_cli(&server.url(), "ops", ["limit", "0"]);
    assert_eq!(bad.status.code(), Some(78), "{}", stderr(&bad));
    // Raised to 2 (version 2): one more run gets a slot.
    let raised = run_cli(&server.url(), "ops", ["limit", "2"]);
    assert!(String::from_utf8_lossy(&raised.stdout).contains("limit 2 (version 2) stored"));
    let runs = try_once(&server.url(), "ops", &["--limit", "3"]);
    assert_eq!(runs.status.code(), Some(0), "{}", stderr(&runs));
    // SAFETY: kill(2) on our child's pid.
    unsafe { libc::kill(holder.id() as i32, libc::SIGTERM) };
    wait_exit(&mut holder, Duration::from_secs(10));
}

/// Versions end at 2^53 − 1: `leasehold limit N` (the next version) then has none to take. It
/// exits 78 and says how to get out (delete the limit key), not "pass a higher --limit-version",
/// which no version can be.
#[test]
fn limit_at_the_last_version_says_that_only_deleting_the_limit_key_changes_it() {
    let server = RedisServer::start();
    let top = leasehold::MAX_LIMIT_VERSION.to_string();
    let set = run_cli(
        &server.url(),
        "last",
        ["limit", "9", "--limit-version", &top],
    );
    assert_eq!(set.status.code(), Some(0), "{}", stderr(&set));
    let key = "leasehold:{last}:limit";
    for args in [
        vec!["limit", "10"],
        vec!["limit", "10", "--limit-version", "5"],
    ] {
        let refused = run_cli(&server.url(), "last", &args);
        let err = stderr(&refused);
        assert_eq!(refused.status.code(), Some(78), "{args:?}: {err}");
        assert!(
            err.contains(&format!("not changed: limit 9 is stored at version {top}"))
                && err.contains("no version is above it")
                && err.contains(key),
            "{args:?}: {err}"
        );
        assert!(!err.contains("above 9007199254740991"), "{args:?}: {err}");
    }
    let json = run_cli(&server.url(), "last", ["status", "--json"]);
    let doc: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(doc["limit"], 9, "nothing changed");
    // The way out it gives.
    server.command(&["DEL", key]);
    let set = run_cli(&server.url(), "last", ["limit", "10"]);
    assert!(
        String::from_utf8_lossy(&set.stdout).contains("limit 10 (version 1) stored"),
        "{}",
        stderr(&set)
    );
}

/// A cancelled command that is a wrapper (a shell that runs the real worker) dies of SIGTERM at
/// once; the worker in its group got the same SIGTERM and is shutting down. docs/CLI.md: the
/// group "gets SIGTERM, then SIGKILL after `--grace`": the worker gets its grace too, not a
/// SIGKILL the moment the wrapper is gone (found by review: killed 21 ms after the cancel).
#[test]
fn a_cancelled_wrappers_worker_gets_its_grace_before_sigkill() {
    let server = RedisServer::start();
    let dir = TempDir::new("leasehold-cli-grace");
    let (done, ready) = (dir.join("done"), dir.join("ready"));
    let worker = format!(
        "trap 'sleep 1; echo clean > {}; exit 0' TERM; touch {}; while :; do sleep 0.1; done",
        done.display(),
        ready.display()
    );
    // The outer shell traps nothing: SIGTERM ends it at once, as most wrappers.
    let wrapper = format!("bash -c \"{worker}\"; echo after");
    let (code, took) = cancel_run(
        &server,
        "grace-wrap",
        &["sh", "-c", &wrapper],
        "5s",
        Some(&ready),
    );
    assert_eq!(code, 80);
    println!("leasehold run exited {took:?} after the cancel");
    assert!(
        done.exists(),
        "the worker was killed {took:?} after the cancel, before its 1 s shutdown, with \
         --grace 5s"
    );
}

/// A stderr nobody reads any more (a log collector that died, `2>&1 | head -1`) does not change
/// the documented exit code: `leasehold run --wait 0` on a full quota is 75, not a panic's 101
/// (found by review).
#[test]
fn a_closed_stderr_keeps_the_documented_exit_code() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let server = RedisServer::start();
    let mut holder = spawn_holder(&server, "epipe", &["--limit", "1"], "h", &["sleep", "30"]);
    let mut fds = [0; 2];
    // SAFETY: pipe(2) writes two new descriptors into `fds`.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both are fresh descriptors that nothing else owns.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read); // every write to `write` now fails with EPIPE
    let mut run = leasehold(&server.url(), "epipe")
        .args(["run", "--limit", "1", "--wait", "0", "--", "true"])
        .stderr(Stdio::from(write))
        .spawn_reaped();
    let code = wait_exit(&mut run, Duration::from_secs(10));
    let _ = holder.kill();
    assert_eq!(code, 75, "full quota, one try, stderr closed");
}
