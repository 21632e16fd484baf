//! `leasehold run` and its command as one job: the command never runs on after `leasehold run`
//! died or stopped, reads the terminal when run in the foreground, and keeps `nohup`'s SIGHUP.
//! Every wait is bounded in time.

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::terminal::{InTerminal, Shown};
use common::*;
use leasehold_testkit::RedisServer;

/// The state letter of process `pid` (`R`, `S`, `T`, ...), `None` once it is gone or a zombie.
fn state(pid: i32) -> Option<char> {
    proc_stat(pid)?.chars().next().filter(|&c| c != 'Z')
}

/// Waits (bounded) until `pid` is in a state `want` accepts.
fn wait_state(pid: i32, what: &str, want: impl Fn(Option<char>) -> bool) {
    let end = Instant::now() + Duration::from_secs(5);
    while !want(state(pid)) {
        assert!(
            Instant::now() < end,
            "process {pid} never became {what}: {:?} [{}]",
            stat_line(pid),
            signal_status(pid)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The state and signal masks of `/proc/<pid>/status`, for a failure message: a process that
/// should have stopped and did not may have the stop blocked, or be stuck in state D.
fn signal_status(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("Sig") || l.starts_with("State"))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// `/proc/<pid>/stat` after the command name (state, parent, group, session, tty, terminal's
/// foreground group, ...), for a failure message.
fn stat_line(pid: i32) -> Option<String> {
    Some(proc_stat(pid)?.chars().take(40).collect())
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a pid this test started; no memory involved.
    unsafe { libc::kill(pid, sig) };
}

/// A `leasehold run` (limit 1) whose command appends a line to `ticks` every 50 ms and has
/// written its pid to `pidfile`; returns the run and the command's pid once it holds the slot.
fn ticking_run(server: &RedisServer, quota: &str, ttl: &str, dir: &Path) -> (Reaped, i32) {
    let pidfile = dir.join("pid");
    let ticks = dir.join("ticks");
    let script = format!(
        "echo $$ > {}; i=0; while [ $i -lt 100 ]; do echo $i >> {}; i=$((i+1)); sleep 0.05; done",
        pidfile.display(),
        ticks.display()
    );
    let run = leasehold(&server.url(), quota)
        .args(["run", "--limit", "1", "--ttl", ttl, "--task-id", "ticker"])
        // bash, not sh: Debian's sh (dash) starts `sleep` with vfork(), and a SIGTSTP to the
        // group that lands while dash waits in vfork (state D, signals blocked) stops only the
        // child; dash itself never stops, so its parent never sees a stop, with or without
        // leasehold (an interactive shell running `sh -c` would hang the same way). Under load
        // the window is wide enough to be hit in 7 of 40 runs. bash starts children with fork().
        .args(["--", "bash", "-c", &script])
        .stderr(Stdio::null())
        .spawn_reaped();
    wait_held(server, quota, "ticker");
    (run, pid_from(&pidfile))
}

fn ticks(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("ticks"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// Another run on the same quota (limit 1) that only tries once: 0 if it got the slot.
fn try_the_slot(server: &RedisServer, quota: &str) -> i32 {
    try_once(&server.url(), quota, &["--limit", "1"])
        .status
        .code()
        .unwrap()
}

#[test]
fn a_sigkilled_run_takes_its_command_with_it() {
    let server = RedisServer::start();
    let dir = TempDir::new("leasehold-supervision-kill");
    let (mut run, command) = ticking_run(&server, "orphan", "1s", &dir);
    run.kill().unwrap(); // SIGKILL: no handler runs in `leasehold run`
    run.wait().unwrap();
    // The lease expires one ttl (1 s) after its last renewal: then another run gets the slot.
    let end = Instant::now() + Duration::from_secs(10);
    while try_the_slot(&server, "orphan") != 0 {
        assert!(Instant::now() < end, "the slot never freed");
        std::thread::sleep(Duration::from_millis(50));
    }
    // By the time the next holder got the slot, the command was gone (no more ticks possible).
    assert_eq!(
        state(command),
        None,
        "the command ran on beside the next holder"
    );
}

#[test]
fn a_stop_of_the_run_stops_its_command_and_a_lease_lost_meanwhile_ends_it() {
    let server = RedisServer::start();
    let dir = TempDir::new("leasehold-supervision-stop");
    let (mut run, command) = ticking_run(&server, "stop", "1s", &dir);
    signal(run.id() as i32, libc::SIGTSTP); // what Ctrl-Z sends
    wait_state(run.id() as i32, "stopped", |s| s == Some('T'));
    wait_state(command, "stopped", |s| s == Some('T'));
    let stopped_at = ticks(&dir);
    std::thread::sleep(Duration::from_millis(1500)); // longer than the ttl: the lease is gone
    assert_eq!(
        ticks(&dir),
        stopped_at,
        "the command ran while the job was stopped"
    );
    assert_eq!(
        try_the_slot(&server, "stop"),
        0,
        "the expired lease's slot is free"
    );
    signal(run.id() as i32, libc::SIGCONT); // `fg`
    assert_eq!(
        wait_exit(&mut run, Duration::from_secs(10)),
        79,
        "lease lost"
    );
    wait_state(command, "gone", |s| s.is_none());
    assert_eq!(
        ticks(&dir),
        stopped_at,
        "the command ran again without a lease"
    );
}

/// A cancel sent while the job is stopped (Ctrl-Z) is a cancel, exit 80, whether the stop was
/// short or outlasted the lease: the lease's loss to the stop must not hide it (exit 79 would
/// tell a wrapper the task is worth running again).
#[test]
fn a_task_cancelled_while_its_job_is_stopped_exits_80_after_a_short_or_a_long_stop() {
    let server = RedisServer::start();
    for (ttl, stop) in [("5s", 300), ("1s", 1500)] {
        let quota = format!("cancel-stopped-{ttl}");
        let dir = TempDir::new("leasehold-supervision-cancel");
        let (mut run, command) = ticking_run(&server, &quota, ttl, &dir);
        signal(run.id() as i32, libc::SIGTSTP);
        wait_state(run.id() as i32, "stopped", |s| s == Some('T'));
        wait_state(command, "stopped", |s| s == Some('T'));
        let cancelled = run_cli(&server.url(), &quota, ["cancel", "ticker"]);
        assert_eq!(cancelled.status.code(), Some(0), "{}", stderr(&cancelled));
        std::thread::sleep(Duration::from_millis(stop));
        signal(run.id() as i32, libc::SIGCONT);
        assert_eq!(
            wait_exit(&mut run, Duration::from_secs(10)),
            80,
            "cancelled during a {stop} ms stop with ttl {ttl}"
        );
        wait_state(command, "gone", |s| s.is_none());
    }
}

#[test]
fn a_short_stop_of_the_command_stops_the_run_and_both_go_on_when_continued() {
    let server = RedisServer::start();
    let dir = TempDir::new("leasehold-supervision-short");
    let (mut run, command) = ticking_run(&server, "short", "5s", &dir);
    // Ctrl-Z with the command in the terminal's foreground reaches the command's group only.
    signal(-command, libc::SIGTSTP);
    wait_state(run.id() as i32, "stopped", |s| s == Some('T'));
    let stopped_at = ticks(&dir);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(ticks(&dir), stopped_at);
    signal(run.id() as i32, libc::SIGCONT); // `fg` continues the job leader's group
    let end = Instant::now() + Duration::from_secs(5);
    while ticks(&dir) <= stopped_at {
        assert!(Instant::now() < end, "the command was not continued");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(wait_exit(&mut run, Duration::from_secs(15)), 0);
    assert_eq!(ticks(&dir), 100, "the command ran to its end");
}

#[test]
fn sighup_ignored_by_nohup_stays_ignored() {
    let server = RedisServer::start();
    let mut cmd = leasehold(&server.url(), "nohup");
    cmd.args(["run", "--limit", "1", "--task-id", "n", "--", "sleep", "1"]);
    // SAFETY: signal(2) between fork and exec, as `nohup` does before it executes.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut run = cmd.spawn_reaped();
    wait_held(&server, "nohup", "n");
    signal(run.id() as i32, libc::SIGHUP);
    assert_eq!(
        wait_exit(&mut run, Duration::from_secs(10)),
        0,
        "the hangup reached the command"
    );
}

/// Runs `leasehold run` as a foreground job of its own in a fresh terminal, typing into that
/// terminal.
#[test]
fn a_command_run_in_the_foreground_reads_the_terminal() {
    let server = RedisServer::start();
    let mut run = leasehold(&server.url(), "tty");
    run.args(["run", "--limit", "1", "--task-id", "reader", "--"])
        .args(["sh", "-c", "read x; echo got:$x"]);
    let mut terminal = InTerminal::spawn(run);
    terminal.type_in(b"hello\n");
    let shown = terminal.wait(Duration::from_secs(15));
    assert!(shown.text.contains("got:hello"), "{:?}", shown.text);
    assert_eq!(shown.status.code(), Some(0), "{:?}", shown.text);
}

#[test]
fn processes_the_command_left_behind_end_before_the_slot_is_released() {
    let server = RedisServer::start();
    let dir = TempDir::new("leasehold-supervision-leftover");
    let pidfile = dir.join("pid");
    let script = format!("sleep 60 & echo $! > {}; exit 0", pidfile.display());
    let out = run_cli(
        &server.url(),
        "leftover",
        [
            "run", "--limit", "1", "--grace", "1s", "--", "sh", "-c", &script,
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let pid = pid_from(&pidfile);
    wait_state(pid, "gone", |s| s.is_none());
}

#[test]
fn a_lease_lost_with_redis_gone_ends_the_command_with_one_error_line() {
    let mut server = RedisServer::start();
    let run = leasehold(&server.url(), "gone")
        .args(["run", "--limit", "1", "--ttl", "1s", "--task-id", "g"])
        .args(["--", "sleep", "60"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn_reaped();
    wait_held(&server, "gone", "g");
    server.kill();
    let out = wait_output(run, Duration::from_secs(15));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(79), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err:?}");
    assert!(err.contains("local deadline"), "{err}");
}

/// A lease lost while Redis stalls (paused: it keeps the connection but answers nothing): the
/// command is stopped at the local deadline, and `leasehold run` exits soon after, not after a
/// call timeout spent on the best-effort release and another on a look at the cancel marker,
/// neither of which Redis can answer (about 2 s in all before).
#[test]
fn a_lease_lost_while_redis_is_paused_exits_soon_after_the_loss() {
    let server = RedisServer::start();
    let dir = TempDir::new("leasehold-supervision-paused");
    let pidfile = dir.join("pid");
    let script = format!("echo $$ > {}; exec sleep 30", pidfile.display());
    let mut run = leasehold(&server.url(), "paused-loss")
        .args(["run", "--limit", "1", "--ttl", "2s", "--task-id", "p"])
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn_reaped();
    wait_held(&server, "paused-loss", "p");
    let command = pid_from(&pidfile);
    server.pause();
    let paused = Instant::now();
    // The local deadline passes within the ttl: the command gets SIGTERM and ends at once.
    wait_state(command, "gone", |s| s.is_none());
    let lost = Instant::now();
    let code = wait_exit(&mut run, Duration::from_secs(10));
    let exited = lost.elapsed();
    server.resume();
    let err = take_stderr(&mut run);
    println!(
        "lost {:?} after the pause, exited {exited:?} after the loss",
        lost - paused
    );
    assert_eq!(code, 79, "{err}");
    assert!(err.contains("local deadline"), "{err}");
    assert!(
        exited < Duration::from_millis(1200),
        "exited {exited:?} after the loss"
    );
}

/// `(process group, terminal's foreground group)` as a command showed them from
/// `/proc/self/stat` (fields 5 and 8).
fn groups_seen(shown: &Shown) -> (i64, i64) {
    let line = shown
        .text
        .lines()
        .find(|l| l.contains(") "))
        .unwrap_or_else(|| panic!("no stat line in {:?}", shown.text));
    let fields: Vec<i64> = line[line.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .skip(1)
        .take(5)
        .map(|f| f.parse().unwrap())
        .collect();
    // After the state: ppid, pgrp, session, tty_nr, tpgid.
    (fields[1], fields[4])
}

/// `sh -c line`, where `$RUN` is `leasehold` on `server`'s quota `quota`.
fn shell_running(server: &RedisServer, quota: &str, line: &str) -> std::process::Command {
    let mut shell = std::process::Command::new("sh");
    shell
        .args(["-c", line])
        .env("RUN", env!("CARGO_BIN_EXE_leasehold"))
        .env("LEASEHOLD_REDIS_URL", server.url())
        .env("LEASEHOLD_QUOTA", quota);
    shell
}

/// The groups a `leasehold run` command sees when started by `sh -c shell_line` in a terminal,
/// where `$RUN` is that run.
fn groups_under_a_shell(server: &RedisServer, shell_line: &str) -> (i64, i64) {
    let shell = shell_running(server, "tpgid", shell_line);
    groups_seen(&InTerminal::spawn(shell).wait(Duration::from_secs(15)))
}

/// A foreground job of its own gets the terminal handed to its command; a stage of a pipeline
/// or a command of a script does not (the others share its group and would lose the terminal).
#[test]
fn the_terminal_goes_to_the_command_only_when_the_run_is_alone_in_the_foreground() {
    let server = RedisServer::start();
    let mut run = leasehold(&server.url(), "tpgid");
    run.args(["run", "--limit", "2", "--", "cat", "/proc/self/stat"]);
    let (group, foreground) = groups_seen(&InTerminal::spawn(run).wait(Duration::from_secs(15)));
    assert_eq!(
        group, foreground,
        "a foreground job of its own hands the terminal over"
    );
    let stat = "run --limit 2 -- cat /proc/self/stat";
    let (group, foreground) = groups_under_a_shell(&server, &format!("$RUN {stat} | cat"));
    assert_ne!(group, foreground, "a pipeline stage keeps out");
    let (group, foreground) = groups_under_a_shell(&server, &format!("$RUN {stat}; true"));
    assert_ne!(group, foreground, "a command of a script keeps out");
}

/// A command of a script or a pipeline stage runs in the background of the terminal, which
/// stays with the group the run shares. Reading the terminal fails there instead of stopping
/// the command (which no `fg` could bring to the foreground, and which hung the script); its
/// writes go through even with `stty tostop`.
#[test]
fn a_command_kept_out_of_the_terminal_cannot_hang_on_it() {
    let server = RedisServer::start();
    for line in [
        "$RUN run --limit 1 -- sh -c 'read x; echo read:$?'; echo after:$?",
        "stty tostop; $RUN run --limit 1 -- sh -c 'echo wrote; read x; echo read:$?' | cat; echo after:$?",
    ] {
        let mut terminal = InTerminal::spawn(shell_running(&server, "kept-out", line));
        terminal.type_in(b"typed\n");
        let shown = terminal.wait(Duration::from_secs(15));
        let text = &shown.text;
        assert!(!text.contains("read:0"), "{line}: the read succeeded: {text:?}");
        assert!(text.contains("read:"), "{line}: {text:?}");
        assert!(text.contains("after:"), "{line}: the script did not go on: {text:?}");
        if line.contains("wrote") {
            assert!(text.contains("wrote"), "{line}: {text:?}");
        }
        assert_eq!(holders(&server, "kept-out"), 0, "{line}: the slot stayed held");
    }
}

/// Which of SIGTTIN and SIGTTOU the command ignores, as `leasehold run` started by `sh -c line`
/// in a terminal shows it (`grep SigIgn /proc/self/status` as the command).
fn terminal_stops_ignored(server: &RedisServer, line: &str) -> (bool, bool) {
    let shown =
        InTerminal::spawn(shell_running(server, "sigign", line)).wait(Duration::from_secs(15));
    let mask = shown
        .text
        .lines()
        .find_map(|l| l.trim().strip_prefix("SigIgn:"))
        .map(|m| u64::from_str_radix(m.trim(), 16).unwrap())
        .unwrap_or_else(|| panic!("{line}: no SigIgn line in {:?}", shown.text));
    let ignored = |sig: i32| mask & (1 << (sig - 1)) != 0;
    (ignored(libc::SIGTTIN), ignored(libc::SIGTTOU))
}

/// Only a command kept out of the terminal for good (a stage of a pipeline, a command of a
/// script) ignores the terminal's stops; a run that is a job of its own in the background (`&`
/// with job control) leaves them to job control: a read stops the job, and `fg` hands the
/// terminal over.
#[test]
fn only_a_command_no_fg_can_reach_ignores_the_terminals_stops() {
    let server = RedisServer::start();
    let show = "run --limit 1 -- grep SigIgn /proc/self/status";
    assert_eq!(
        terminal_stops_ignored(&server, &format!("$RUN {show}; true")),
        (true, true),
        "a command of a script"
    );
    assert_eq!(
        terminal_stops_ignored(&server, &format!("set -m; $RUN {show} & wait")),
        (false, false),
        "a background job of its own"
    );
}

/// `leasehold run` ignores SIGTTOU (a background write with `stty tostop` would stop it, or
/// caught, spin), and its command gets the default back.
#[test]
fn sigttou_stops_neither_the_run_nor_is_it_ignored_by_the_command() {
    let server = RedisServer::start();
    let dir = TempDir::new("leasehold-supervision-ttou");
    let (mut run, command) = ticking_run(&server, "ttou", "5s", &dir);
    let ignored = |pid: i32| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let mask = status
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:"))
            .map(|m| u64::from_str_radix(m.trim(), 16).unwrap())
            .unwrap();
        mask & (1 << (libc::SIGTTOU - 1)) != 0
    };
    assert!(ignored(run.id() as i32));
    assert!(!ignored(command));
    signal(run.id() as i32, libc::SIGTTOU);
    // A run that SIGTTOU had stopped would leave SIGTERM pending and never exit: exiting by the
    // forwarded SIGTERM, like its command, shows it was not stopped.
    signal(run.id() as i32, libc::SIGTERM);
    assert_eq!(wait_exit(&mut run, Duration::from_secs(10)), 128 + 15);
    wait_state(command, "gone", |s| s.is_none());
}

/// A command that holds the terminal and stops itself (bash's `suspend`, a wrapper passing on a
/// stop) stops the job: else the terminal's shell could never get it back, and the slot would
/// be held for nothing.
#[test]
fn a_command_holding_the_terminal_that_stops_itself_stops_the_run() {
    let server = RedisServer::start();
    let dir = TempDir::new("leasehold-supervision-selfstop");
    let pidfile = dir.join("pid");
    let mut run = leasehold(&server.url(), "selfstop");
    run.args(["run", "--limit", "1", "--", "sh", "-c"])
        .arg(format!(
            "echo $$ > {}; kill -STOP $$; echo resumed",
            pidfile.display()
        ));
    let mut terminal = InTerminal::spawn(run);
    let command = pid_from(&pidfile);
    let runner = terminal.id();
    wait_state(runner, "stopped with its command", |s| s == Some('T'));
    assert_eq!(state(command), Some('T'), "the command stopped itself");
    // The shell's `fg` continues the job's group, the run; never the command itself: continuing
    // it is the run's job. Again until the run ends (bounded), in case a continue came before
    // the run's own stop.
    let end = Instant::now() + Duration::from_secs(10);
    while !terminal.ended() && Instant::now() < end {
        signal(runner, libc::SIGCONT);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        terminal.ended(),
        "the run never ended: run {:?}, command {:?}",
        stat_line(runner),
        stat_line(command)
    );
    let shown = terminal.wait(Duration::from_secs(1));
    assert!(shown.text.contains("resumed"), "{:?}", shown.text);
}

/// Ctrl-Z, `bg`, then `fg` in an interactive shell: after `fg` the command holds the terminal
/// again (docs/CLI.md: "after `fg`, COMMAND gets the terminal again"), so a read of the
/// terminal gets the typed line instead of stopping the job once more (found by review: the
/// shell said "Stopped" right after `fg`, and ran the typed line itself).
#[test]
fn after_ctrl_z_bg_and_fg_the_command_gets_the_terminal_again() {
    let server = RedisServer::start();
    let mut shell = std::process::Command::new("bash");
    shell
        .args(["--norc", "--noprofile", "-i"])
        .env("RUN", env!("CARGO_BIN_EXE_leasehold"))
        .env("LEASEHOLD_REDIS_URL", server.url())
        .env("LEASEHOLD_QUOTA", "bgfg")
        .env("PS1", "$ ");
    let mut terminal = InTerminal::spawn(shell);
    terminal.type_in(
        b"$RUN run --limit 1 --task-id bgfg -- bash -c 'sleep 2; read -p ask: x; echo got:$x'\n",
    );
    wait_held(&server, "bgfg", "bgfg");
    std::thread::sleep(Duration::from_millis(300));
    terminal.type_in(b"\x1a"); // Ctrl-Z
    std::thread::sleep(Duration::from_millis(500));
    terminal.type_in(b"bg\n");
    std::thread::sleep(Duration::from_millis(500));
    terminal.type_in(b"fg\n");
    std::thread::sleep(Duration::from_millis(3000)); // the command now waits in `read`
    terminal.type_in(b"bob\n");
    std::thread::sleep(Duration::from_millis(1000));
    terminal.type_in(b"exit\n");
    std::thread::sleep(Duration::from_millis(300));
    terminal.type_in(b"exit\n"); // a second time if bash said "There are stopped jobs."
    let shown = terminal.wait(Duration::from_secs(15));
    assert!(
        shown.text.contains("got:bob"),
        "the command did not get the terminal back after bg + fg: {:?}",
        shown.text
    );
}
