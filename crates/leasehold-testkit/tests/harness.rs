//! Integration tests of the harness against a real `redis-server`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use leasehold_testkit::{RedisServer, Reply, ServerClock};

fn pong() -> Reply {
    Reply::Status("PONG".into())
}

fn ok() -> Reply {
    Reply::Status("OK".into())
}

#[test]
fn start_answers_ping() {
    let server = RedisServer::start();
    assert_eq!(server.command(&["PING"]), pong());
    assert_eq!(
        server.url(),
        format!("redis://127.0.0.1:{}/", server.port())
    );
    assert!(server.is_running());
    assert_ne!(server.pid(), 0);
}

#[test]
fn set_get_roundtrip_and_reply_kinds() {
    let server = RedisServer::start();
    assert_eq!(server.command(&["SET", "key", "va\r\nlue"]), ok());
    assert_eq!(
        server.command(&["GET", "key"]),
        Reply::Bulk(b"va\r\nlue".to_vec())
    );
    assert_eq!(server.command(&["GET", "missing"]), Reply::Nil);
    assert_eq!(server.command(&["INCR", "n"]).as_int(), Some(1));
    assert_eq!(server.command(&["INCRBY", "n", "41"]).as_int(), Some(42));
    assert!(matches!(
        server.command(&["NOSUCHCOMMAND"]),
        Reply::Error(e) if e.starts_with("ERR")
    ));
    assert_eq!(
        server.command(&["EVAL", "return {1, {'x', 2}}", "0"]),
        Reply::Array(vec![
            Reply::Int(1),
            Reply::Array(vec![Reply::Bulk(b"x".to_vec()), Reply::Int(2)]),
        ])
    );
}

#[test]
fn servers_are_independent() {
    let a = RedisServer::start();
    let b = RedisServer::start();
    assert_ne!(a.port(), b.port());
    assert_eq!(a.command(&["SET", "k", "a"]), ok());
    assert_eq!(b.command(&["GET", "k"]), Reply::Nil);
}

#[test]
fn kill_makes_commands_fail_and_is_idempotent() {
    let mut server = RedisServer::start();
    assert_eq!(server.command(&["PING"]), pong());
    server.kill();
    assert!(!server.is_running());
    assert!(server.try_command(&["PING"]).is_err());
    server.kill();
    assert!(server.try_command(&["PING"]).is_err());
}

#[test]
#[should_panic(expected = "failed")]
fn command_panics_when_server_is_gone() {
    let mut server = RedisServer::start();
    server.kill();
    server.command(&["PING"]);
}

#[test]
fn restart_keeps_port_and_loses_data() {
    let mut server = RedisServer::start();
    let port = server.port();
    let old_pid = server.pid();
    assert_eq!(server.command(&["SET", "key", "value"]), ok());

    server.restart();
    assert_eq!(server.port(), port);
    assert_ne!(server.pid(), old_pid);
    assert_eq!(server.command(&["PING"]), pong());
    assert_eq!(server.command(&["GET", "key"]), Reply::Nil);

    // Also after an explicit kill.
    server.kill();
    assert!(server.try_command(&["PING"]).is_err());
    server.restart();
    assert_eq!(server.port(), port);
    assert_eq!(server.command(&["PING"]), pong());
}

#[test]
fn pause_blocks_replies_until_resume() {
    let server = RedisServer::start();
    server.pause();
    let begin = Instant::now();
    let result = server.try_command_timeout(&["PING"], Duration::from_millis(300));
    assert!(result.is_err(), "paused server answered: {result:?}");
    assert!(
        begin.elapsed() < Duration::from_secs(3),
        "timeout not honoured"
    );
    server.resume();
    assert_eq!(server.command(&["PING"]), pong());
}

#[test]
fn drop_of_paused_server_does_not_hang() {
    let server = RedisServer::start();
    server.pause();
    let begin = Instant::now();
    drop(server);
    assert!(begin.elapsed() < Duration::from_secs(5));
}

#[test]
fn requirepass_needs_auth() {
    let mut server = RedisServer::start_with(&["--requirepass", "pw"]);
    assert!(
        server.command(&["PING"]).is_error_starting_with("NOAUTH"),
        "expected NOAUTH"
    );
    assert_eq!(server.command_auth("default", "pw", &["PING"]), pong());
    assert!(matches!(
        server.command_auth("default", "wrong", &["PING"]),
        Reply::Error(e) if e.starts_with("WRONGPASS")
    ));
    // The URL never carries the password.
    assert!(!server.url().contains("pw"));

    // restart keeps the extra arguments.
    server.restart();
    assert!(server.command(&["PING"]).is_error_starting_with("NOAUTH"));
    assert_eq!(server.command_auth("default", "pw", &["PING"]), pong());
}

#[test]
fn drop_removes_the_temp_dir() {
    let server = RedisServer::start();
    let dir = match server.command(&["CONFIG", "GET", "dir"]) {
        Reply::Array(items) if items.len() == 2 => {
            PathBuf::from(items[1].as_string().expect("dir is a bulk string"))
        }
        other => panic!("unexpected CONFIG GET reply: {other:?}"),
    };
    assert!(dir.join("redis.log").is_file(), "{}", dir.display());
    drop(server);
    assert!(!dir.exists(), "{} still exists", dir.display());
}

#[test]
fn empty_command_is_rejected() {
    let server = RedisServer::start();
    let err = server.try_command(&[]).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}

#[test]
fn restart_waits_for_the_port_to_be_free() {
    let mut server = RedisServer::start();
    server.kill();
    // Someone else holds the port for a while: restart retries the bind.
    let squatter = std::net::TcpListener::bind(("127.0.0.1", server.port()))
        .expect("port is free right after kill");
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(700));
        drop(squatter);
    });
    let begin = Instant::now();
    server.restart();
    release.join().unwrap();
    assert!(begin.elapsed() >= Duration::from_millis(500));
    assert_eq!(server.command(&["PING"]), pong());
}

/// The server's `TIME` in milliseconds.
fn server_ms(server: &RedisServer) -> i64 {
    let Reply::Array(parts) = server.command(&["TIME"]) else {
        panic!("TIME is not an array");
    };
    let part = |i: usize| -> i64 { parts[i].as_string().unwrap().parse().unwrap() };
    part(0) * 1000 + part(1) / 1000
}

#[test]
fn server_clock_steps_the_servers_time_and_survives_a_restart() {
    let clock = ServerClock::new();
    let mut server = RedisServer::start_with_env(&clock.env(), &[]);
    let own_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    assert!((server_ms(&server) - own_ms()).abs() < 1000);
    clock.set_offset_ms(3_600_000);
    assert!((server_ms(&server) - own_ms() - 3_600_000).abs() < 1000);
    clock.set_offset_ms(-90_500);
    assert!((server_ms(&server) - own_ms() + 90_500).abs() < 1000);
    server.restart();
    assert!((server_ms(&server) - own_ms() + 90_500).abs() < 1000);
    // Lua scripts read the same clock, and keys expire by it.
    let Reply::Array(parts) = server.command(&["EVAL", "return redis.call('TIME')", "0"]) else {
        panic!("TIME from a script is not an array");
    };
    let script_s: i64 = parts[0].as_string().unwrap().parse().unwrap();
    assert!((script_s * 1000 - own_ms() + 90_500).abs() < 2000);
    assert_eq!(server.command(&["SET", "k", "v", "PX", "5000"]), ok());
    clock.set_offset_ms(-90_500 + 10_000);
    assert_eq!(server.command(&["GET", "k"]), Reply::Nil);
}

#[test]
fn a_replica_follows_its_master_refuses_writes_and_can_be_promoted() {
    let master = RedisServer::start();
    master.command(&["SET", "before", "1"]);
    let replica = RedisServer::start_replica_of(master.port(), &[]);
    // The first sync is done when start_replica_of returns.
    assert_eq!(
        replica.command(&["GET", "before"]).as_string().as_deref(),
        Some("1")
    );
    master.command(&["SET", "after", "2"]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while replica.command(&["GET", "after"]).as_string().is_none() {
        assert!(Instant::now() < deadline, "the write never replicated");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(replica
        .command(&["SET", "x", "1"])
        .is_error_starting_with("READONLY"));
    assert_eq!(replica.command(&["REPLICAOF", "NO", "ONE"]), ok());
    assert_eq!(replica.command(&["SET", "x", "1"]), ok());
}
