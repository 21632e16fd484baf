//! A second implementation of the protocol, in Python, runs beside the crate on one quota.
//!
//! `tests/interop/leasehold_client.py` was written from docs/PROTOCOL.md and the Lua scripts
//! alone, by someone who had not read the crate's Rust code: it tests the document's claim that a
//! client written to it interoperates with the crate. Its worker, `tests/interop/worker.py`,
//! speaks the line protocol of `examples/worker.rs` (see the module docs of both). Python comes
//! from `$LEASEHOLD_PYTHON`, else the first of `python3` and `/usr/bin/python3` that can import
//! redis-py (Debian's `python3-redis`; scripts/test installs it).

mod common;

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::processes::{args, hold_intervals, max_overlap, Worker};
use leasehold::{Quota, RedisBackend};
use leasehold_testkit::RedisServer;

/// An interpreter that can import redis-py.
fn python() -> PathBuf {
    static FOUND: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    FOUND
        .get_or_init(|| {
            let candidates: Vec<PathBuf> = match std::env::var_os("LEASEHOLD_PYTHON") {
                Some(chosen) => vec![chosen.into()],
                None => vec!["python3".into(), "/usr/bin/python3".into()],
            };
            candidates
                .iter()
                .find(|python| {
                    Command::new(python)
                        .args(["-c", "import redis"])
                        .output()
                        .is_ok_and(|out| out.status.success())
                })
                .unwrap_or_else(|| {
                    panic!(
                        "none of {candidates:?} imports redis-py; install it (Debian: apt-get \
                         install python3-redis) or set LEASEHOLD_PYTHON; scripts/test does this"
                    )
                })
                .clone()
        })
        .clone()
}

/// The Python worker, with `env` set (`LEASEHOLD_POLL_MS`, say).
fn python_worker(env: &[(&str, &str)], args: &[String]) -> Worker {
    let mut cmd = Command::new(python());
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/interop/worker.py"
    ))
    .args(args)
    .envs(env.iter().copied());
    Worker::spawn_command(cmd)
}

/// Every process of a test runs with this lease ttl: the clients of a quota share one.
const TTL_MS: u64 = 3000;

/// The arguments of a worker of either language (the same line protocol): `mode` on `quota`
/// of `limit` on `server`, ttl [`TTL_MS`], then the mode's own.
fn command(
    mode: &str,
    server: &RedisServer,
    quota: &str,
    limit: impl ToString,
    rest: &[&dyn ToString],
) -> Vec<String> {
    let mut all = args(&[&mode, &server.url(), &quota, &limit.to_string(), &TTL_MS]);
    all.extend(rest.iter().map(|part| part.to_string()));
    all
}

/// Reads the worker's next line (within 10 s), which must be `acquired TOKEN`; returns TOKEN.
fn acquired(worker: &Worker) -> String {
    let line = worker.next_line(Duration::from_secs(10));
    assert!(line.starts_with("acquired "), "{line}");
    line["acquired ".len()..].to_owned()
}

/// The fencing tokens of `hold START END TOKEN` lines.
fn tokens(lines: &[String]) -> Vec<u64> {
    lines
        .iter()
        .filter(|line| line.starts_with("hold "))
        .map(|line| {
            line.split_whitespace()
                .nth(3)
                .and_then(|t| t.parse().ok())
                .unwrap_or_else(|| panic!("no token in {line:?}"))
        })
        .collect()
}

/// A quota of the crate in this process, on `server`, whose waiters poll only every 10 s: a
/// waiter served sooner was woken by an event (or by its subscription's re-check).
fn rust_quota(rt: &tokio::runtime::Runtime, server: &RedisServer, name: &str, limit: u64) -> Quota {
    rt.block_on(async {
        Quota::builder(name)
            .limit(limit)
            .ttl(Duration::from_millis(TTL_MS))
            .poll_interval(Duration::from_secs(10))
            .backend(RedisBackend::connect(&server.url()).await.unwrap())
            .build()
            .unwrap()
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Three Rust and three Python processes hammer one quota of limit 3: never more than 3 holds at
/// once, and every admission, whichever side made it, took the next token of one sequence.
#[test]
fn rust_and_python_processes_keep_one_limit_and_one_token_sequence() {
    let server = RedisServer::start();
    let limit = 3;
    let hammer = command("hammer", &server, "mixed", limit, &[&3000, &2000]);
    let rust: Vec<Worker> = (0..3).map(|_| Worker::spawn(&[], &hammer)).collect();
    let python: Vec<Worker> = (0..3).map(|_| python_worker(&[], &hammer)).collect();
    let (mut intervals, mut all_tokens, mut per_process) = (Vec::new(), Vec::new(), Vec::new());
    for (side, worker) in rust
        .into_iter()
        .map(|w| ("rust", w))
        .chain(python.into_iter().map(|w| ("python", w)))
    {
        let lines = worker.wait(Duration::from_secs(60));
        let lost: Vec<&String> = lines.iter().filter(|l| l.contains(" lost")).collect();
        assert!(
            lost.is_empty(),
            "{side} lost leases while holding: {lost:?}"
        );
        let holds = hold_intervals(&lines);
        per_process.push((side, holds.len()));
        intervals.extend(holds);
        all_tokens.extend(tokens(&lines));
    }
    let max = max_overlap(&intervals);
    let fence: u64 = server
        .command(&["GET", "leasehold:{mixed}:fence"])
        .as_string()
        .and_then(|f| f.parse().ok())
        .expect("the fence is a number");
    println!(
        "{} holds ({per_process:?}), max overlap {max} at limit {limit}, fence {fence}",
        intervals.len()
    );
    assert!(
        max <= limit,
        "the fleet held {max} slots at once, limit {limit}"
    );
    assert_eq!(max, limit, "the test applied real contention");
    assert!(per_process.iter().all(|&(_, n)| n > 0), "{per_process:?}");
    let distinct: HashSet<u64> = all_tokens.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        all_tokens.len(),
        "a fencing token was issued twice"
    );
    assert_eq!(
        distinct,
        (1..=fence).collect::<HashSet<u64>>(),
        "each admission took the next token, on either side"
    );
}

/// On a quota of limit 1, a Rust release hands the slot to a waiting Python process, and that
/// process's release hands it back to a Rust waiter, each woken by the other's release event:
/// both sides poll only every 10 s and the leases live 3 s.
#[test]
fn a_release_on_one_side_wakes_a_waiter_on_the_other() {
    let server = RedisServer::start();
    let rt = runtime();
    let quota = rust_quota(&rt, &server, "handover", 1);
    let first = rt.block_on(quota.try_acquire("rust-first")).unwrap();
    let python = python_worker(
        &[("LEASEHOLD_POLL_MS", "10000")],
        &command("hold", &server, "handover", 1, &[&"python", &800]),
    );
    // The Python waiter was refused (the `waiting` key is set) and is subscribed beside this
    // process: only then does the release below show a hand-over by event (a waiter that came
    // late would just take the free slot).
    let channel = "leasehold:{handover}:events";
    let waiting = "leasehold:{handover}:waiting";
    rt.block_on(common::eventually(Duration::from_secs(10), || {
        server.command(&["EXISTS", waiting]).as_int() == Some(1)
            && common::subscribers(&server, channel) >= 2
    }))
    .then_some(())
    .expect("the Python waiter never waited subscribed");
    let released = Instant::now();
    rt.block_on(first.release()).unwrap();
    acquired(&python);
    let to_python = released.elapsed();

    let waiter = {
        let quota = quota.clone();
        rt.spawn(async move {
            let lease = quota.acquire("rust-second").await.unwrap();
            (Instant::now(), lease)
        })
    };
    assert_eq!(python.next_line(Duration::from_secs(10)), "held");
    let python_releasing = Instant::now();
    let (admitted, second) = rt.block_on(waiter).unwrap();
    let to_rust = admitted.saturating_duration_since(python_releasing);
    assert_eq!(python.next_line(Duration::from_secs(10)), "done");
    println!("hand-over Rust → Python {to_python:?}, Python → Rust {to_rust:?}");
    for (way, took) in [("Rust → Python", to_python), ("Python → Rust", to_rust)] {
        assert!(
            took < Duration::from_secs(2),
            "{way} took {took:?}: not woken by the release event (poll 10 s, ttl 3 s)"
        );
    }
    rt.block_on(second.release()).unwrap();
}

/// A cancel written by either side reaches a holder of the other: the holder stops with the
/// cancel as its reason (by message, or at the latest by its next renewal, 1 s).
#[test]
fn a_cancel_from_either_side_stops_a_holder_of_the_other() {
    let server = RedisServer::start();
    let rt = runtime();
    let quota = rust_quota(&rt, &server, "cancels", 2);

    let rust_holder = Worker::spawn(
        &[],
        &command("hold", &server, "cancels", 2, &[&"rust-task", &30_000]),
    );
    acquired(&rust_holder);
    let canceller = python_worker(
        &[],
        &command(
            "cancel",
            &server,
            "cancels",
            2,
            &[&"rust-task", &"stop now"],
        ),
    );
    let sent = Instant::now();
    assert_eq!(
        canceller.wait(Duration::from_secs(10)),
        vec!["cancelled held"]
    );
    let line = rust_holder.next_line(Duration::from_secs(5));
    let rust_stopped = sent.elapsed();
    assert!(
        line.starts_with("lost") && line.contains("cancelled") && line.contains("stop now"),
        "{line}"
    );

    let python_holder = python_worker(
        &[],
        &command("hold", &server, "cancels", 2, &[&"python-task", &30_000]),
    );
    acquired(&python_holder);
    let sent = Instant::now();
    assert!(rt
        .block_on(quota.cancel("python-task", "from rust"))
        .unwrap());
    assert_eq!(
        python_holder.next_line(Duration::from_secs(5)),
        "lost cancelled"
    );
    let python_stopped = sent.elapsed();
    println!(
        "cancel Python → Rust holder {rust_stopped:?}, Rust → Python holder {python_stopped:?}"
    );
    assert_eq!(python_holder.next_line(Duration::from_secs(5)), "done");
    // Neither task can be admitted again while its marker lives, on either side.
    assert!(matches!(
        rt.block_on(quota.try_acquire("python-task")),
        Err(leasehold::Error::Cancelled(reason)) if reason == "from rust"
    ));
}

/// Each side's status lists the other's holders with their tokens, and a Python holder killed
/// with SIGKILL gives its slot to a Rust caller one ttl after its last renewal.
#[test]
fn status_shows_both_sides_and_a_killed_python_holder_is_reclaimed() {
    let server = RedisServer::start();
    let rt = runtime();
    let quota = rust_quota(&rt, &server, "shared", 2);
    let rust_lease = rt.block_on(quota.try_acquire("rust-holder")).unwrap();
    let mut python_holder = python_worker(
        &[],
        &command("try", &server, "shared", 2, &[&"python-holder"]),
    );
    let python_token: u64 = acquired(&python_holder).parse().unwrap();

    let status = rt.block_on(quota.status()).unwrap();
    let seen: HashSet<(String, u64)> = status
        .holders
        .iter()
        .map(|h| (h.task_id.clone(), h.fencing_token))
        .collect();
    let expected: HashSet<(String, u64)> = [
        ("rust-holder".to_owned(), rust_lease.fencing_token()),
        ("python-holder".to_owned(), python_token),
    ]
    .into();
    assert_eq!(seen, expected, "the crate's status");
    let lines = python_worker(&[], &command("status", &server, "shared", 2, &[]))
        .wait(Duration::from_secs(10));
    let listed: HashSet<(String, u64)> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("holder "))
        .map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            (parts[0].to_owned(), parts[1].parse().unwrap())
        })
        .collect();
    assert_eq!(listed, expected, "the Python status: {lines:?}");
    assert!(lines.contains(&"limit 2".to_owned()), "{lines:?}");

    // At least one renewal (heartbeat 1 s) went through before the kill.
    std::thread::sleep(Duration::from_millis(1200));
    python_holder.child.kill().unwrap();
    python_holder.child.wait().unwrap();
    let killed = Instant::now();
    let give_up = killed + Duration::from_secs(10);
    let reclaimed = rt.block_on(async {
        loop {
            match quota.try_acquire("rust-next").await {
                Ok(lease) => break lease,
                Err(leasehold::Error::Full { .. }) if Instant::now() < give_up => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                Err(e) => panic!("the killed holder's slot never came back: {e:?}"),
            }
        }
    });
    let after = killed.elapsed();
    println!("a SIGKILLed Python holder's slot came back {after:?} after the kill (ttl 3 s)");
    assert!(after <= Duration::from_millis(3000 + 500), "{after:?}");
    assert!(reclaimed.fencing_token() > python_token);
    rt.block_on(async {
        reclaimed.release().await.unwrap();
        rust_lease.release().await.unwrap();
    });
}
