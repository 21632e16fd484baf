//! A private `redis-server` child process, controlled with signals.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::sleep;
use std::time::{Duration, Instant};

use crate::resp::{exchange, Reply};
use crate::{free_port, temp_dir};

/// Environment variable that overrides the `redis-server` binary to run.
pub const REDIS_SERVER_ENV: &str = "LEASEHOLD_REDIS_SERVER";

/// How long a (re)started server has to answer PING.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `restart` keeps retrying when the old port cannot be bound yet.
const REBIND_TIMEOUT: Duration = Duration::from_secs(5);
/// Default timeout of one command round trip.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
/// Timeout of one readiness PING.
const PING_TIMEOUT: Duration = Duration::from_millis(500);
/// How often readiness is polled.
const POLL: Duration = Duration::from_millis(20);
/// How long `pause`/`resume` wait for the kernel to report the new state.
const SIGNAL_SETTLE: Duration = Duration::from_secs(1);
/// Attempts of `start` (first try plus retries on a new port).
const START_ATTEMPTS: usize = 4;
/// Line redis writes to its log once it listens.
const READY_LINE: &str = "Ready to accept connections";

/// A private redis-server process on a free loopback port, stopped on drop.
///
/// The server runs without persistence (`--save "" --appendonly no`) in its
/// own temporary directory, which is removed on drop together with the log.
#[derive(Debug)]
pub struct RedisServer {
    binary: OsString,
    port: u16,
    extra_args: Vec<String>,
    env: Vec<(OsString, OsString)>,
    dir: PathBuf,
    child: Option<Child>,
    pid: u32,
    paused: AtomicBool,
}

/// Why one launch attempt failed.
struct LaunchFailure {
    /// The process exited by itself (for example: port already taken), so
    /// trying again may help; otherwise (no binary, no answer) it cannot.
    exited: bool,
    message: String,
}

impl RedisServer {
    /// Starts `redis-server` with no persistence on 127.0.0.1 and a free
    /// port; blocks until it answers PING (at most 10 s, then panics).
    ///
    /// The binary is `redis-server` from `PATH`, or the value of the
    /// `LEASEHOLD_REDIS_SERVER` environment variable when set. Panics with a
    /// hint to run `scripts/test` or `apt-get install redis-server` when the
    /// binary is missing.
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// Same as [`RedisServer::start`], with extra command-line arguments
    /// appended (for example `["--requirepass", "secret"]`).
    ///
    /// If the server exits early (typically because another process took the
    /// port between [`free_port`] and the bind), it is retried up to 3 times
    /// on a new free port.
    pub fn start_with(args: &[&str]) -> RedisServer {
        Self::start_with_env::<&str, &str>(&[], args)
    }

    /// Same as [`RedisServer::start_with`], with extra environment variables for the server
    /// process (for example [`ServerClock::env`](crate::ServerClock::env), to step its wall
    /// clock). [`RedisServer::restart`] passes them again.
    pub fn start_with_env<K, V>(env: &[(K, V)], args: &[&str]) -> RedisServer
    where
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        let binary = redis_binary();
        let dir = temp_dir("leasehold-redis");
        let extra_args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let env: Vec<(OsString, OsString)> = env
            .iter()
            .map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned()))
            .collect();
        let mut failures = Vec::new();
        for _ in 0..START_ATTEMPTS {
            let port = free_port();
            match launch(&binary, port, &dir, &extra_args, &env, Ready::Serving) {
                Ok(child) => {
                    return RedisServer {
                        binary,
                        port,
                        pid: child.id(),
                        extra_args,
                        env,
                        dir,
                        child: Some(child),
                        paused: AtomicBool::new(false),
                    };
                }
                Err(failure) => {
                    let retry = failure.exited;
                    failures.push(format!("port {port}: {}", failure.message));
                    if !retry {
                        break;
                    }
                }
            }
        }
        let _ = fs::remove_dir_all(&dir);
        panic!(
            "could not start redis-server {:?} with extra args {:?}:\n{}",
            binary,
            extra_args,
            failures.join("\n")
        );
    }

    /// Starts a replica of the server on `127.0.0.1:master_port` (a [`RedisServer`] or a
    /// [`FaultProxy`](crate::proxy::FaultProxy) in front of one, so that the replication link
    /// can be stalled or cut), with the extra arguments of [`RedisServer::start_with`]; blocks
    /// until its first sync is done (`master_link_status:up`, at most 10 s, then panics).
    ///
    /// First sets `repl-diskless-sync-delay 0` on the master: its default (5 s, waiting for
    /// more replicas to share one transfer) would delay every first sync by 5 s.
    ///
    /// Promote it with `command(&["REPLICAOF", "NO", "ONE"])`. [`RedisServer::restart`] starts
    /// it as a replica again.
    pub fn start_replica_of(master_port: u16, args: &[&str]) -> RedisServer {
        let master = SocketAddr::from((Ipv4Addr::LOCALHOST, master_port));
        let set = exchange(
            master,
            &[&["CONFIG", "SET", "repl-diskless-sync-delay", "0"]],
            COMMAND_TIMEOUT,
        );
        match set.as_deref() {
            Ok([Reply::Status(_)]) => {}
            other => panic!("CONFIG SET repl-diskless-sync-delay 0 on {master} failed: {other:?}"),
        }
        let port = master_port.to_string();
        let mut all = vec!["--replicaof", "127.0.0.1", port.as_str()];
        all.extend_from_slice(args);
        let replica = Self::start_with(&all);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let info = replica
                .try_command(&["INFO", "replication"])
                .ok()
                .and_then(|reply| reply.as_string())
                .unwrap_or_default();
            if info.contains("master_link_status:up") {
                return replica;
            }
            if Instant::now() >= deadline {
                panic!(
                    "replica on port {} of 127.0.0.1:{master_port} did not sync within \
                     {READY_TIMEOUT:?}; INFO replication:\n{info}",
                    replica.port
                );
            }
            sleep(POLL);
        }
    }

    /// The TCP port the server listens on (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of the server, `redis://127.0.0.1:PORT/`.
    ///
    /// It never contains a password, even if one is configured.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The process id of the current (or, after [`RedisServer::kill`], the
    /// last) server process.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether a server process is currently running (not killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Sends SIGKILL to the server and waits for it to exit. Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            if self.paused.swap(false, Ordering::SeqCst) {
                // Not needed for SIGKILL, but leaves no stopped process behind.
                let _ = send_signal(child.id(), libc::SIGCONT);
            }
            // Errors only mean it has already exited; `wait` reaps it.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port with the same arguments.
    ///
    /// The data is lost (no persistence). Kills the running server first if
    /// there is one. Retries binding the port for up to 5 s, then blocks
    /// until PING answers (at most 10 s); panics on failure.
    pub fn restart(&mut self) {
        self.relaunch(Ready::Serving);
    }

    /// Like [`RedisServer::restart`], but returns as soon as the new process answers `PING`
    /// with `LOADING`: it is still loading its dataset from disk, and refuses commands until it
    /// is done. Anything the test does next happens during the load.
    ///
    /// For a load slow enough to be seen, start the server with a dataset on disk (`SAVE`
    /// before the restart, with the default `--save ""` nothing is saved by itself) and with
    /// `--key-load-delay <µs per key>` and `--loading-process-events-interval-bytes 1024`
    /// (without the latter Redis answers nobody while it loads a small file). Panics if the
    /// server is serving before it was seen loading, or after 10 s.
    pub fn restart_loading(&mut self) {
        self.relaunch(Ready::Loading);
    }

    fn relaunch(&mut self, ready: Ready) {
        self.kill();
        let deadline = Instant::now() + REBIND_TIMEOUT;
        loop {
            match launch(
                &self.binary,
                self.port,
                &self.dir,
                &self.extra_args,
                &self.env,
                ready,
            ) {
                Ok(child) => {
                    self.pid = child.id();
                    self.child = Some(child);
                    return;
                }
                Err(failure) if failure.exited && Instant::now() < deadline => {
                    sleep(Duration::from_millis(100));
                }
                Err(failure) => panic!(
                    "could not restart redis-server on port {}: {}",
                    self.port, failure.message
                ),
            }
        }
    }

    /// Sends SIGSTOP to the server: it keeps its connections but stops
    /// answering until [`RedisServer::resume`].
    ///
    /// Panics if the server is not running.
    pub fn pause(&self) {
        let pid = self.running_pid("pause");
        send_signal(pid, libc::SIGSTOP)
            .unwrap_or_else(|e| panic!("SIGSTOP to redis-server pid {pid} failed: {e}"));
        self.paused.store(true, Ordering::SeqCst);
        wait_for_state(pid, true);
    }

    /// Sends SIGCONT to the server, undoing [`RedisServer::pause`].
    ///
    /// Panics if the server is not running.
    pub fn resume(&self) {
        let pid = self.running_pid("resume");
        send_signal(pid, libc::SIGCONT)
            .unwrap_or_else(|e| panic!("SIGCONT to redis-server pid {pid} failed: {e}"));
        self.paused.store(false, Ordering::SeqCst);
        wait_for_state(pid, false);
    }

    /// Sends one command and returns the reply; panics on an I/O error or
    /// after 5 s without an answer.
    ///
    /// Uses a fresh connection each time. If the server has a password, use
    /// [`RedisServer::command_auth`].
    pub fn command(&self, args: &[&str]) -> Reply {
        self.try_command(args).unwrap_or_else(|e| {
            panic!(
                "redis command {:?} to 127.0.0.1:{} failed: {e}",
                args.first(),
                self.port
            )
        })
    }

    /// Sends one command over a fresh connection and returns the reply, or
    /// the I/O error (timeout after 5 s, connection refused, ...).
    pub fn try_command(&self, args: &[&str]) -> io::Result<Reply> {
        self.try_command_timeout(args, COMMAND_TIMEOUT)
    }

    /// Same as [`RedisServer::try_command`] with a custom timeout covering
    /// the connect, the write and the whole reply.
    pub fn try_command_timeout(&self, args: &[&str], timeout: Duration) -> io::Result<Reply> {
        check_args(args)?;
        let mut replies = exchange(self.addr(), &[args], timeout)?;
        Ok(replies.remove(0))
    }

    /// Like [`RedisServer::command`], but first sends `AUTH user password`
    /// on the same connection (use user `default` for `--requirepass`).
    ///
    /// If AUTH fails, its error reply is returned instead of the command's.
    pub fn command_auth(&self, user: &str, password: &str, args: &[&str]) -> Reply {
        let result = check_args(args).and_then(|()| {
            exchange(
                self.addr(),
                &[&["AUTH", user, password], args],
                COMMAND_TIMEOUT,
            )
        });
        let mut replies = result.unwrap_or_else(|e| {
            panic!(
                "redis command {:?} (authenticated as {user:?}) to 127.0.0.1:{} failed: {e}",
                args.first(),
                self.port
            )
        });
        let reply = replies.pop().expect("one reply per command");
        let auth = replies.pop().expect("one reply per command");
        if matches!(auth, Reply::Error(_)) {
            auth
        } else {
            reply
        }
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    fn running_pid(&self, what: &str) -> u32 {
        match &self.child {
            Some(child) => child.id(),
            None => panic!(
                "cannot {what} redis-server on port {}: it is not running",
                self.port
            ),
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn check_args(args: &[&str]) -> io::Result<()> {
    if args.is_empty() {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "empty redis command",
        ))
    } else {
        Ok(())
    }
}

fn redis_binary() -> OsString {
    match std::env::var_os(REDIS_SERVER_ENV) {
        Some(path) if !path.is_empty() => path,
        _ => OsString::from("redis-server"),
    }
}

fn log_path(dir: &Path) -> PathBuf {
    dir.join("redis.log")
}

/// The last lines of the server log, for error messages.
fn log_tail(dir: &Path) -> String {
    match fs::read_to_string(log_path(dir)) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            let start = lines.len().saturating_sub(15);
            if lines.is_empty() {
                "(redis.log is empty)".to_owned()
            } else {
                format!("redis.log ends with:\n{}", lines[start..].join("\n"))
            }
        }
        Err(e) => format!(
            "(no redis.log: {e}; an invalid argument would be reported on stderr, \
             which is discarded)"
        ),
    }
}

/// What [`launch`] waits for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ready {
    /// The server answers `PING` (its dataset loaded).
    Serving,
    /// The server answers `PING` with `LOADING`.
    Loading,
}

/// Spawns one server on `port` and waits until it is ready.
fn launch(
    binary: &OsString,
    port: u16,
    dir: &Path,
    extra_args: &[String],
    env: &[(OsString, OsString)],
    ready: Ready,
) -> Result<Child, LaunchFailure> {
    let log = log_path(dir);
    // A fresh log, so that a "ready" line always comes from this process.
    let _ = fs::remove_file(&log);
    let mut command = Command::new(binary);
    command
        .arg("--port")
        .arg(port.to_string())
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(&log)
        .args(["--daemonize", "no", "--protected-mode", "yes"])
        .args(extra_args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(LaunchFailure {
                exited: false,
                message: format!(
                    "redis-server binary {binary:?} not found ({e}). Run `scripts/test` \
                     (which installs it) or `apt-get install redis-server`, or set \
                     {REDIS_SERVER_ENV} to the path of a redis-server binary."
                ),
            })
        }
        Err(e) => {
            return Err(LaunchFailure {
                exited: false,
                message: format!("could not spawn redis-server binary {binary:?}: {e}"),
            })
        }
    };
    // With a user-chosen log file the "ready" line cannot be checked.
    let check_log = !extra_args.iter().any(|a| a == "--logfile");
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return Err(LaunchFailure {
                    exited: true,
                    message: format!("redis-server exited early ({status}); {}", log_tail(dir)),
                })
            }
            Ok(None) => {}
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(LaunchFailure {
                    exited: false,
                    message: format!("could not poll redis-server: {e}"),
                });
            }
        }
        // The log proves that *this* process bound the port, so the PING
        // cannot be answered by some other server that took it.
        let log_ready =
            !check_log || fs::read_to_string(&log).is_ok_and(|text| text.contains(READY_LINE));
        match ready {
            Ready::Serving if log_ready && answers_ping(addr) => return Ok(child),
            Ready::Loading if answers_loading(addr) => return Ok(child),
            Ready::Loading if check_log && log_ready => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(LaunchFailure {
                    exited: false,
                    message: "redis-server was serving before it was seen loading: give it a \
                              bigger dataset or a longer --key-load-delay"
                        .to_owned(),
                });
            }
            _ => {}
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(LaunchFailure {
                exited: false,
                message: format!(
                    "redis-server did not answer PING within {READY_TIMEOUT:?}; {}",
                    log_tail(dir)
                ),
            });
        }
        sleep(POLL);
    }
}

/// Whether the server answers PING with `LOADING` (it is loading its dataset).
fn answers_loading(addr: SocketAddr) -> bool {
    exchange(addr, &[&["PING"]], PING_TIMEOUT)
        .is_ok_and(|replies| replies[0].is_error_starting_with("LOADING"))
}

/// Whether the server answers PING (PONG, or NOAUTH when a password is set).
fn answers_ping(addr: SocketAddr) -> bool {
    match exchange(addr, &[&["PING"]], PING_TIMEOUT) {
        Ok(replies) => match &replies[0] {
            Reply::Status(s) => s == "PONG",
            reply => reply.is_error_starting_with("NOAUTH"),
        },
        Err(_) => false,
    }
}

fn send_signal(pid: u32, signal: libc::c_int) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    // SAFETY: kill(2) has no memory-safety preconditions; `pid` is our own,
    // not yet reaped child, so it cannot name an unrelated process.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Waits (bounded) until /proc reports the process as stopped or not.
/// Does nothing where /proc is unavailable.
fn wait_for_state(pid: u32, stopped: bool) {
    let deadline = Instant::now() + SIGNAL_SETTLE;
    while Instant::now() < deadline {
        match process_stopped(pid) {
            Some(state) if state != stopped => sleep(Duration::from_millis(2)),
            _ => return,
        }
    }
}

/// Whether the process is stopped, from `/proc/PID/stat` (`None` if unknown).
fn process_stopped(pid: u32) -> Option<bool> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The state follows the command name, which is in parentheses.
    let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
    Some(state == 'T')
}
