//! Separate OS processes against one private redis-server: the fleet-wide limit holds, a killed
//! holder's slot comes back one ttl later, client clocks play no part (skewed, or stepped under
//! a holder mid-lease), and a holder paused past its cancel marker's ttl does no work once
//! resumed.
//!
//! The worker is `examples/worker.rs` (`common::processes::worker_path`).

mod common;

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::processes::{args, hold_intervals, max_overlap, Worker};

use leasehold_testkit::{monotonic_ns, RedisServer, Reply, ServerClock};

/// A quota of limit 1 on `server` for the test itself to acquire in, built on `rt` after
/// `configure` adds any further settings.
fn own_quota(
    rt: &tokio::runtime::Runtime,
    server: &RedisServer,
    name: &str,
    ttl: Duration,
    configure: impl FnOnce(leasehold::QuotaBuilder) -> leasehold::QuotaBuilder,
) -> leasehold::Quota {
    rt.block_on(async {
        let backend = leasehold::RedisBackend::connect(&server.url())
            .await
            .unwrap();
        configure(
            leasehold::Quota::builder(name)
                .limit(1)
                .ttl(ttl)
                .backend(backend),
        )
        .build()
        .unwrap()
    })
}

/// Retries `try_acquire` every 20 ms while the quota is full, for at most 15 s: until a slot
/// held by a worker that can no longer release it (`slot` names it) comes back.
async fn acquire_once_freed(
    quota: &leasehold::Quota,
    task_id: &str,
    slot: &str,
) -> leasehold::Lease {
    let give_up = Instant::now() + Duration::from_secs(15);
    loop {
        match quota.try_acquire(task_id).await {
            Ok(lease) => break lease,
            Err(leasehold::Error::Full { .. }) if Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("{slot} never came back: {e:?}"),
        }
    }
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
        let holds = hold_intervals(&worker.wait(Duration::from_secs(60)));
        per_process.push(holds.len());
        intervals.extend(holds);
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

/// A process that drops its lease and exits at once leaves the slot taken for a whole ttl
/// unless it awaits `Quota::flush` first: the release runs on leasehold's thread, which dies
/// with the process. With `flush`, no lease is left behind, every time.
#[test]
fn a_process_that_flushes_before_exiting_leaves_no_lease_behind() {
    let server = RedisServer::start();
    let leftovers = |quota: &str, flush: &str| -> usize {
        for i in 0..6 {
            let id = format!("task-{i}");
            let worker = Worker::spawn(
                &[],
                &args(&[&"drop", &server.url(), &quota, &100, &30_000, &id, &flush]),
            );
            let line = worker.next_line(Duration::from_secs(20));
            assert!(line.starts_with("acquired"), "{line}");
            worker.wait(Duration::from_secs(20));
        }
        let key = format!("leasehold:{{{quota}}}:leases");
        let held = server.command(&["ZCARD", &key]);
        held.as_int().unwrap_or_else(|| panic!("ZCARD: {held:?}")) as usize
    };
    let unflushed = leftovers("dropped", "no");
    println!("without flush: {unflushed} of 6 dropped leases left held after exit");
    // The control: without flush, exit races the release on leasehold's thread, and the release
    // won only about 1 in 6 times when measured (4 to 6 of 6 left held): all six winning is
    // about 1 in 50 000. Without it, the assertion below would show nothing about flush.
    assert!(
        unflushed > 0,
        "without flush every dropped lease was released anyway: the control shows nothing"
    );
    assert_eq!(leftovers("flushed", "flush"), 0, "leases left after flush");
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

/// Real (unshifted) wall clock of the test process, ms since the Unix epoch.
fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The server's `TIME` and the score (stored deadline) of `task` in `key`, read in one script so
/// that no renewal falls between the two.
fn server_now_and_score(server: &RedisServer, key: &str, task: &str) -> (i64, Option<i64>) {
    let script = "local t = redis.call('TIME') \
                  return {t[1], t[2], redis.call('ZSCORE', KEYS[1], ARGV[1])}";
    let Reply::Array(parts) = server.command(&["EVAL", script, "1", key, task]) else {
        panic!("the TIME/ZSCORE script did not return an array");
    };
    let int = |i: usize| -> i64 { parts[i].as_string().unwrap().parse().unwrap() };
    let now = int(0) * 1000 + int(1) / 1000;
    let score = parts
        .get(2)
        .and_then(Reply::as_string)
        .map(|s| s.parse::<f64>().unwrap() as i64);
    (now, score)
}

/// One `tick` line of a worker.
struct Tick {
    mono_ns: u128,
    wall_ms: i64,
    left_ms: i64,
    deadline_ms: i64,
}

fn parse_tick(line: &str) -> Option<Tick> {
    let mut parts = line.strip_prefix("tick ")?.split_whitespace();
    Some(Tick {
        mono_ns: parts.next()?.parse().ok()?,
        wall_ms: parts.next()?.parse().ok()?,
        left_ms: parts.next()?.parse().ok()?,
        deadline_ms: parts.next()?.parse().ok()?,
    })
}

/// How the stepped holder's lease ends.
#[derive(Clone, Copy, PartialEq, Debug)]
enum End {
    Release,
    Kill,
}

/// Starts a `tick` worker (a tick every `tick_ms`) with `clock`'s shim loaded, and returns it once
/// it holds `task` in `quota` (limit 1), with the offset that turns its CLOCK_MONOTONIC stamps
/// into true wall-clock ms: this process's clock is not shifted, and both clocks advance alike
/// over a few seconds.
fn start_clocked_holder(
    clock: &ServerClock,
    server: &RedisServer,
    quota: &str,
    ttl_ms: i64,
    task: &str,
    tick_ms: u64,
) -> (Worker, i64) {
    let worker = Worker::spawn_with_env(
        &[],
        &clock.env(),
        &args(&[&"tick", &server.url(), &quota, &1, &ttl_ms, &task, &tick_ms]),
    );
    let first = worker.next_line(Duration::from_secs(10));
    assert!(first.starts_with("acquired"), "{first}");
    (worker, wall_ms() - (monotonic_ns() / 1_000_000) as i64)
}

/// Checks a holder's ticks: its local deadline is monotonic (still ahead, never more than a ttl
/// ahead), and the deadline it holds from the server is server time (ahead of the true time by
/// at most a ttl, 100 ms slack for two clock reads in the worker and one here) and never goes
/// back, from `last_deadline` on. Returns each tick's wall-clock skew from the true time, and
/// how many renewals the ticks show. `context` starts the failure messages.
fn check_ticks(
    ticks: &[&Tick],
    base_ms: i64,
    ttl_ms: i64,
    last_deadline: &mut i64,
    context: &str,
) -> (Vec<i64>, usize) {
    let mut skews = Vec::new();
    let mut renewals = 0;
    for tick in ticks {
        let true_ms = (tick.mono_ns / 1_000_000) as i64 + base_ms;
        skews.push(tick.wall_ms - true_ms);
        assert!(
            tick.left_ms > 0 && tick.left_ms <= ttl_ms,
            "{context}: local deadline {} ms ahead (ttl {ttl_ms})",
            tick.left_ms
        );
        let ahead = tick.deadline_ms - true_ms;
        assert!(
            (-100..=ttl_ms + 100).contains(&ahead),
            "{context}: the lease's deadline is {ahead} ms ahead of true time"
        );
        assert!(tick.deadline_ms >= *last_deadline, "the deadline went back");
        renewals += usize::from(tick.deadline_ms > *last_deadline && *last_deadline != 0);
        *last_deadline = tick.deadline_ms;
    }
    (skews, renewals)
}

/// Checks `(server now, stored deadline)` samples: renewed by server time, the stored deadline
/// never goes back, never expires and is never more than a ttl ahead. Returns how many times it
/// moved, and its margins ahead of the server's time.
fn check_samples(samples: &[(i64, i64)], ttl_ms: i64, context: &str) -> (usize, Vec<i64>) {
    let mut moves = 0;
    for pair in samples.windows(2) {
        assert!(pair[1].1 >= pair[0].1, "the stored deadline went back");
        moves += usize::from(pair[1].1 > pair[0].1);
    }
    let margins: Vec<i64> = samples.iter().map(|(now, score)| score - now).collect();
    for &margin in &margins {
        assert!(
            margin > 0 && margin <= ttl_ms,
            "{context}: the stored deadline is {margin} ms ahead of server time"
        );
    }
    (moves, margins)
}

/// Asks a `tick` worker holding `quota`'s only slot to release (its lines go to `lines`), checks
/// the lease left Redis, and that a single try by another process then gets the slot at once.
/// Returns the time from the release to that admission.
fn release_then_probe(
    mut worker: Worker,
    server: &RedisServer,
    quota: &str,
    ttl_ms: i64,
    lines: &mut Vec<String>,
) -> Duration {
    let stdin = worker.child.stdin.as_mut().unwrap();
    stdin.write_all(b"release\n").unwrap();
    stdin.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        assert!(Instant::now() < deadline, "no release: {lines:?}");
        let line = worker.next_line(Duration::from_secs(10));
        assert!(!line.starts_with("lost"), "{line}; {lines:?}");
        let released = line == "released";
        lines.push(line);
        if released {
            break;
        }
    }
    let released_at = Instant::now();
    let leases_key = format!("leasehold:{{{quota}}}:leases");
    assert_eq!(
        server.command(&["ZCARD", &leases_key]).as_int(),
        Some(0),
        "the released lease is still stored"
    );
    // One attempt, no waiting: the slot is free the moment the release is acknowledged.
    let probe = Worker::spawn(
        &[],
        &args(&[&"try", &server.url(), &quota, &1, &ttl_ms, &"next"]),
    );
    let reply = probe.wait(Duration::from_secs(10));
    assert!(
        reply.len() == 1 && reply[0].starts_with("acquired"),
        "a single try after the release: {reply:?}"
    );
    let after = released_at.elapsed();
    assert_eq!(
        worker.wait(Duration::from_secs(10)),
        vec!["done".to_string()]
    );
    after
}

/// F13: the holder's own wall clock is stepped +1 h, then −2 h, then back (+1 h to the true
/// clock before a release, +2 h to an hour ahead before a SIGKILL) while it holds a lease (ttl
/// 1 s, so about three renewals a second), through about nine ttl in all. Nothing in the
/// lease may notice: deadlines are the server's `TIME` and the holder's are monotonic. A design
/// that read the client clock would show it here: a forward step would write deadlines an hour
/// away (a crashed holder's slot taken for an hour), a backward step would make the holder's
/// own lease look an hour stale.
fn client_clock_stepped_mid_lease(end: End) {
    const TTL_MS: i64 = 1000;
    const HOUR_MS: i64 = 3_600_000;
    // Loaded into the worker only: the server keeps the true clock.
    let clock = ServerClock::new();
    let server = RedisServer::start();
    let quota_name = match end {
        End::Release => "f13-release",
        End::Kill => "f13-kill",
    };
    let leases_key = format!("leasehold:{{{quota_name}}}:leases");
    let task = "stepped";
    // Released at the true offset; killed an hour ahead, where a client-clock deadline would
    // keep the slot for an hour.
    let final_offset_ms = match end {
        End::Release => 0,
        End::Kill => HOUR_MS,
    };
    let phases: [(i64, u64); 4] = [
        (0, 1500),
        (HOUR_MS, 3000),
        (-HOUR_MS, 3000),
        (final_offset_ms, 1500),
    ];
    let (mut worker, base_ms) = start_clocked_holder(&clock, &server, quota_name, TTL_MS, task, 50);

    let mut lines: Vec<String> = Vec::new();
    // Per phase: (monotonic ns just before the step, just after).
    let mut steps: Vec<(u128, u128)> = Vec::new();
    // (phase, server now, stored deadline)
    let mut samples: Vec<(usize, i64, i64)> = Vec::new();
    for (phase, &(offset_ms, run_ms)) in phases.iter().enumerate() {
        let before = monotonic_ns();
        clock.set_offset_ms(offset_ms);
        steps.push((before, monotonic_ns()));
        let phase_end = Instant::now() + Duration::from_millis(run_ms);
        while Instant::now() < phase_end {
            let (now, score) = server_now_and_score(&server, &leases_key, task);
            lines.extend(worker.lines.try_iter());
            let score = score.unwrap_or_else(|| {
                panic!("phase {phase} (offset {offset_ms} ms): the lease left Redis; {lines:?}")
            });
            samples.push((phase, now, score));
            assert!(
                !lines.iter().any(|l| l.starts_with("lost")),
                "phase {phase} (offset {offset_ms} ms): the worker lost its lease: {lines:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    // How the lease ends: the slot must come back exactly as it would without a step.
    let reclaim_report = match end {
        End::Release => {
            let released_after =
                release_then_probe(worker, &server, quota_name, TTL_MS, &mut lines);
            format!(
                "released; a single try_acquire by another process got the slot {} ms later",
                released_after.as_millis()
            )
        }
        End::Kill => {
            lines.extend(worker.lines.try_iter());
            // SIGKILL: no release, no more renewals.
            worker.child.kill().unwrap();
            worker.child.wait().unwrap();
            lines.extend(worker.lines.try_iter());
            let (killed_server_ms, score) = server_now_and_score(&server, &leases_key, task);
            let final_deadline =
                score.expect("the killed holder's lease is stored until it expires");
            let last_renewal = final_deadline - TTL_MS;
            let rt = tokio::runtime::Runtime::new().unwrap();
            let quota = own_quota(
                &rt,
                &server,
                quota_name,
                Duration::from_millis(TTL_MS as u64),
                |builder| builder,
            );
            let next = rt.block_on(acquire_once_freed(
                &quota,
                "next",
                "the killed holder's slot",
            ));
            let admitted = next
                .acquired_at()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_millis() as i64;
            let after_renewal = admitted - last_renewal;
            let report = format!(
                "SIGKILLed {} ms after its last renewal (server time); slot admitted to another \
                 holder {after_renewal} ms after that renewal (ttl {TTL_MS})",
                killed_server_ms - last_renewal
            );
            assert!(
                killed_server_ms < final_deadline,
                "the holder was alive when killed"
            );
            // Not before its deadline (the acquire reaps only expired leases) and not an hour
            // late: one ttl after the last renewal, plus the polling and a loaded machine.
            assert!(
                (TTL_MS..=TTL_MS + 1000).contains(&after_renewal),
                "{report}"
            );
            rt.block_on(next.release()).unwrap();
            report
        }
    };

    // The worker's own view, tick by tick.
    let ticks: Vec<Tick> = lines.iter().filter_map(|l| parse_tick(l)).collect();
    let phase_of = |mono: u128| -> Option<usize> {
        let i = steps.iter().rposition(|&(before, _)| before <= mono)?;
        // Between the two stamps the worker may have read either offset.
        (mono > steps[i].1).then_some(i)
    };
    let mut report = Vec::new();
    let mut last_deadline = 0;
    for (phase, &(offset_ms, _)) in phases.iter().enumerate() {
        let in_phase: Vec<&Tick> = ticks
            .iter()
            .filter(|t| phase_of(t.mono_ns) == Some(phase))
            .collect();
        // Proof the step reached the worker: a test that moved nothing must fail here.
        assert!(
            in_phase.len() >= 5,
            "phase {phase}: only {} ticks",
            in_phase.len()
        );
        let context = format!("phase {phase}");
        let (skews, renewals) =
            check_ticks(&in_phase, base_ms, TTL_MS, &mut last_deadline, &context);
        for &skew in &skews {
            assert!(
                (skew - offset_ms).abs() < 1000,
                "phase {phase}: the worker's wall clock is {skew} ms off, not {offset_ms}"
            );
        }
        assert!(
            renewals >= 2,
            "phase {phase}: the worker saw {renewals} renewals"
        );
        let phase_samples: Vec<(i64, i64)> = samples
            .iter()
            .filter(|s| s.0 == phase)
            .map(|s| (s.1, s.2))
            .collect();
        let (moves, margins) = check_samples(&phase_samples, TTL_MS, &context);
        assert!(
            moves >= 2,
            "phase {phase}: the stored deadline moved {moves} times"
        );
        let left: Vec<i64> = in_phase.iter().map(|t| t.left_ms).collect();
        report.push(format!(
            "offset {offset_ms:+} ms: {} ticks, worker clock off by {}..{} ms, local deadline \
             {}..{} ms ahead, {renewals} renewals seen by the worker; stored deadline moved {moves} \
             times in {} samples, {}..{} ms ahead of server time",
            in_phase.len(),
            skews.iter().min().unwrap(),
            skews.iter().max().unwrap(),
            left.iter().min().unwrap(),
            left.iter().max().unwrap(),
            margins.len(),
            margins.iter().min().unwrap(),
            margins.iter().max().unwrap(),
        ));
    }
    println!(
        "F13 {end:?}:\n  {}\n  {reclaim_report}",
        report.join("\n  ")
    );
    assert!(!lines.iter().any(|l| l.starts_with("lost")), "{lines:?}");
}

#[test]
fn a_client_clock_stepped_mid_lease_changes_nothing_then_release() {
    client_clock_stepped_mid_lease(End::Release);
}

#[test]
fn a_client_clock_stepped_mid_lease_changes_nothing_then_sigkill() {
    client_clock_stepped_mid_lease(End::Kill);
}

/// F13, the strobe (Jepsen's `strobe`): the holder's own wall clock jumps between an hour ahead
/// and an hour behind, after pseudo-random gaps of 1–100 ms, for four ttl while it holds a lease
/// (ttl 1 s). Nothing in the lease may notice: no loss, no renewal missed, no deadline moved by
/// the jumps, and the slot is free the moment it is released. The seed is printed.
#[test]
fn a_client_clock_strobed_mid_lease_changes_nothing() {
    use rand::{Rng, SeedableRng};
    const TTL_MS: i64 = 1000;
    const HOUR_MS: i64 = 3_600_000;
    const STROBE: Duration = Duration::from_secs(4);
    let clock = ServerClock::new();
    let server = RedisServer::start();
    let quota_name = "f13-strobe";
    let leases_key = format!("leasehold:{{{quota_name}}}:leases");
    let task = "strobed";
    let seed = wall_ms() as u64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (worker, base_ms) = start_clocked_holder(&clock, &server, quota_name, TTL_MS, task, 20);

    let mut lines: Vec<String> = Vec::new();
    // (server now, stored deadline), about every 50 ms.
    let mut samples: Vec<(i64, i64)> = Vec::new();
    let mut jumps = 0u32;
    let end = Instant::now() + STROBE;
    let mut next_sample = Instant::now();
    while Instant::now() < end {
        jumps += 1;
        clock.set_offset_ms(if jumps % 2 == 1 { HOUR_MS } else { -HOUR_MS });
        std::thread::sleep(Duration::from_millis(rng.random_range(1..=100)));
        if Instant::now() >= next_sample {
            next_sample += Duration::from_millis(50);
            let (now, score) = server_now_and_score(&server, &leases_key, task);
            lines.extend(worker.lines.try_iter());
            let score = score.unwrap_or_else(|| panic!("the lease left Redis; {lines:?}"));
            samples.push((now, score));
        }
        assert!(
            !lines.iter().any(|l| l.starts_with("lost")),
            "seed {seed}: the worker lost its lease: {lines:?}"
        );
    }
    clock.set_offset_ms(0);
    lines.extend(worker.lines.try_iter());

    release_then_probe(worker, &server, quota_name, TTL_MS, &mut lines);

    // The worker's view: its clock really jumped both ways, and nothing else moved.
    let ticks: Vec<Tick> = lines.iter().filter_map(|l| parse_tick(l)).collect();
    let all: Vec<&Tick> = ticks.iter().collect();
    let context = format!("seed {seed}");
    let (skews, renewals) = check_ticks(&all, base_ms, TTL_MS, &mut 0, &context);
    let near = |offset: i64| {
        skews
            .iter()
            .filter(|&&skew| (skew - offset).abs() < 1000)
            .count()
    };
    let (ahead_seen, behind_seen) = (near(HOUR_MS), near(-HOUR_MS));
    // Proof the strobe reached the worker: a run that moved nothing fails here.
    assert!(
        ahead_seen >= 10 && behind_seen >= 10,
        "seed {seed}: {ahead_seen} ticks an hour ahead, {behind_seen} an hour behind"
    );
    // About three a second for four seconds; a loaded machine may merge a few.
    assert!(renewals >= 8, "seed {seed}: {renewals} renewals seen");
    let (moves, margins) = check_samples(&samples, TTL_MS, &context);
    assert!(
        moves >= 8,
        "seed {seed}: the stored deadline moved {moves} times"
    );
    println!(
        "F13 strobe (seed {seed}): {jumps} jumps of two hours in {STROBE:?}; {} ticks, {ahead_seen} \
         an hour ahead, {behind_seen} an hour behind; {renewals} renewals seen by the worker; \
         stored deadline moved {moves} times in {} samples, {}..{} ms ahead of server time; \
         released, and a single try by another process got the slot",
        ticks.len(),
        samples.len(),
        margins.iter().min().unwrap(),
        margins.iter().max().unwrap(),
    );
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
/// stop anyway (its local deadline passed: the F3 path), commit no work after SIGCONT,
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
    let quota = own_quota(
        &rt,
        &server,
        quota_name,
        Duration::from_millis(ttl_ms),
        |builder| builder.cancel_marker_ttl(Duration::from_millis(marker_ttl_ms)),
    );
    let held = rt.block_on(quota.cancel("victim", "f20")).unwrap();
    assert!(
        held,
        "the stopped holder's lease was still there when cancelled"
    );
    assert_eq!(server.command(&["EXISTS", &marker_key]).as_int(), Some(1));

    // The slot comes back once the stopped holder's lease expires.
    let other = rt.block_on(acquire_once_freed(
        &quota,
        "other",
        "the slot of the stopped holder",
    ));
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
