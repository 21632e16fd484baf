//! Helpers shared by the command-line tests: the built binary against a private redis-server,
//! every wait bounded in time.
#![allow(dead_code)] // each test file uses its own subset

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use leasehold_testkit::RedisServer;
pub use leasehold_testkit::{Reaped, SpawnReaped, TempDir};

pub mod terminal;

pub fn leasehold(url: &str, quota: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasehold"));
    cmd.env("LEASEHOLD_REDIS_URL", url)
        .env("LEASEHOLD_QUOTA", quota)
        .stdin(Stdio::null());
    // The default disposition for the signals the tests send, whatever the test run inherited:
    // a suite started with `&` from a non-interactive shell (no job control) has SIGINT and
    // SIGQUIT ignored, and under `nohup` SIGHUP too. `leasehold run` keeps a signal it
    // inherited as ignored ignored (as it should), so a test that interrupts it would wait for
    // an exit that never comes. A test that wants one ignored sets it in its own `pre_exec`,
    // which runs after this one.
    // SAFETY: signal(2) between fork and exec is async-signal-safe and allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGHUP] {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    cmd
}

pub fn output(mut cmd: Command) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    wait_output(cmd.spawn_reaped(), Duration::from_secs(30))
}

/// Runs `leasehold ARGS` against `url` and `quota` to the end (bounded) and returns its output.
pub fn run_cli<I, S>(url: &str, quota: &str, args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut cmd = leasehold(url, quota);
    cmd.args(args);
    output(cmd)
}

/// Runs `leasehold run RUN_ARGS --wait 0 -- true`: one try for a slot, no waiting.
pub fn try_once(url: &str, quota: &str, run_args: &[&str]) -> Output {
    let mut cmd = leasehold(url, quota);
    cmd.arg("run")
        .args(run_args)
        .args(["--wait", "0", "--", "true"]);
    output(cmd)
}

/// Starts `leasehold run RUN_ARGS --task-id TASK -- COMMAND` in the background and returns it
/// once `task` holds its lease (see [`wait_held`]).
pub fn spawn_holder(
    server: &RedisServer,
    quota: &str,
    run_args: &[&str],
    task: &str,
    command: &[&str],
) -> Reaped {
    let child = leasehold(&server.url(), quota)
        .arg("run")
        .args(run_args)
        .args(["--task-id", task, "--"])
        .args(command)
        // Read by the tests that check what it says; a few lines fit in the pipe's buffer.
        .stderr(Stdio::piped())
        .spawn_reaped();
    wait_held(server, quota, task);
    child
}

/// The key the acquire script sets when it refuses a run: someone is waiting in `quota`.
fn waiting_key(quota: &str) -> String {
    format!("leasehold:{{{quota}}}:waiting")
}

/// Starts `cmd`, a `leasehold run` that will find `quota` full, and returns it once Redis has
/// refused its first attempt (bounded): it has connected and is waiting, so a fault injected
/// now meets it connected and mid-wait. Only for a quota nobody else is refused in meanwhile.
pub fn spawn_refused(server: &RedisServer, quota: &str, cmd: &mut Command) -> Reaped {
    let key = waiting_key(quota);
    server.command(&["DEL", &key]);
    let mut child = cmd.spawn_reaped();
    let end = Instant::now() + Duration::from_secs(10);
    while server.command(&["EXISTS", &key]).as_int() != Some(1) {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("leasehold ended ({status}) before Redis refused it");
        }
        assert!(
            Instant::now() < end,
            "Redis saw no refused attempt in {quota} within 10 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

/// What a child spawned with a piped stderr wrote there, once it has exited.
pub fn take_stderr(child: &mut Child) -> String {
    let mut text = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut text).unwrap();
    text
}

/// Waits (bounded) for `child` to end and returns its output; on a timeout, the panic drops
/// (kills and reaps) it.
pub fn wait_output(mut child: Reaped, within: Duration) -> Output {
    let end = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() <= end,
            "leasehold did not finish within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child.into_inner().wait_with_output().unwrap()
}

/// The code a shell reports for `status`: the exit code, or 128 + N for a death by signal N.
pub fn shell_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => unreachable!("a process that ended has a code or a signal"),
    }
}

/// Waits (bounded) for `child` to end; returns what a shell would report (see [`shell_code`]).
pub fn wait_exit(child: &mut Child, within: Duration) -> i32 {
    let end = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return shell_code(status);
        }
        assert!(
            Instant::now() < end,
            "leasehold did not exit within {within:?}; its processes: {}",
            process_tree(child.id() as i32)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `pid` and its descendants as `pid (comm) state`, for a failure message: what a run that did
/// not end was waiting for.
fn process_tree(pid: i32) -> String {
    let parent_of = |p: i32| -> Option<i32> { proc_stat(p)?.split(' ').nth(1)?.parse().ok() };
    let all: Vec<i32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(all.iter().filter(|p| parent_of(**p) == Some(parent)));
        i += 1;
    }
    let describe = |p: i32| -> Option<String> {
        let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).ok()?;
        let state = proc_stat(p)?.split(' ').next()?.to_owned();
        Some(format!("{p} ({}) {state}", comm.trim()))
    };
    tree.into_iter()
        .filter_map(describe)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Waits until `task` holds a lease in `quota`.
pub fn wait_held(server: &RedisServer, quota: &str, task: &str) {
    let key = format!("leasehold:{{{quota}}}:leases");
    let end = Instant::now() + Duration::from_secs(10);
    while server
        .command(&["ZSCORE", &key, task])
        .as_string()
        .is_none()
    {
        assert!(Instant::now() < end, "{task} never acquired");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `/proc/<pid>/stat` after the command name: state, parent, group, session, tty, the
/// terminal's foreground group, ... `None` once the process is gone (a zombie is still there).
pub fn proc_stat(pid: i32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat[stat.rfind(')')? + 2..].to_owned())
}

/// The pid a command wrote to `pidfile`, once it has (bounded).
pub fn pid_from(pidfile: &Path) -> i32 {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(pid) = std::fs::read_to_string(pidfile)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return pid;
        }
        assert!(Instant::now() < end, "the command never started");
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn holders(server: &RedisServer, quota: &str) -> i64 {
    server
        .command(&["ZCARD", &format!("leasehold:{{{quota}}}:leases")])
        .as_int()
        .unwrap()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}
