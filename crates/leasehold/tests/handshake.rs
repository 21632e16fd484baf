//! A reconnection whose handshake the server refuses for another reason than credentials (those:
//! `outage.rs`, `a_connection_refused_at_its_handshake_recovers_once_the_password_is_right`):
//! the backend says why, in the operator's terms, and answers again once the cause is gone,
//! without a process restart. redis-rs replaces a connection only after an I/O error, and a
//! refused handshake is none: each of these refusals stuck for good before the backend rebuilt
//! such connections. Private redis-servers on loopback; every loop bounded in time.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use leasehold::{Error, Misconfiguration, RedisBackend, RedisOptions, Unavailable};
use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::RedisServer;

/// Rebuilds are spaced in call timeouts (at least four): a short one keeps the tests short.
const CALL_TIMEOUT: Duration = Duration::from_millis(300);

fn options() -> RedisOptions {
    RedisOptions {
        call_timeout: CALL_TIMEOUT,
        connect_timeout: CALL_TIMEOUT,
        ..RedisOptions::default()
    }
}

async fn connect(url: &str) -> RedisBackend {
    RedisBackend::connect_with(url, options()).await.unwrap()
}

async fn ping(backend: &RedisBackend) -> Result<String, Error> {
    backend.call::<String>(redis::cmd("PING")).await
}

/// How long the cause lasts once a call met it: long enough for a rebuild to fail on it, so the
/// recovery waits for the spacing of rebuilds as it would after a longer cause.
const CAUSE_LASTS: Duration = Duration::from_secs(1);

/// Calls until one fails as `expected` says (the reconnection met the cause; the first calls
/// may see the old connection break instead, and it panics after 5 s), then for
/// [`CAUSE_LASTS`] more, each refused the same way.
async fn refused(backend: &RedisBackend, expected: impl Fn(&Error) -> bool) -> Error {
    let end = Instant::now() + Duration::from_secs(5);
    let err = loop {
        match ping(backend).await {
            Err(e) if expected(&e) => break e,
            other => {
                assert!(Instant::now() < end, "never refused as expected: {other:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let end = Instant::now() + CAUSE_LASTS;
    while Instant::now() < end {
        match ping(backend).await {
            Err(e) if expected(&e) => {}
            other => panic!("refused, then {other:?} with the cause still there"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    err
}

/// Calls every 20 ms until one is answered; returns how long that took. Panics after 10 s:
/// a refusal that stuck.
async fn recovered(backend: &RedisBackend, cause: &str) -> Duration {
    let fixed = Instant::now();
    loop {
        match ping(backend).await {
            Ok(_) => break,
            Err(e) => assert!(
                fixed.elapsed() < Duration::from_secs(10),
                "still refused 10 s after {cause}: {e:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = fixed.elapsed();
    let rebuilds = backend.connection_rebuilds();
    println!("answered {took:?} after {cause} ({rebuilds} connections built)");
    took
}

/// An ACL user that loses `select` while its URL names database 1: every reconnection is
/// refused at its SELECT, NOPERM.
#[tokio::test]
async fn a_reconnection_whose_select_the_acl_refuses_recovers_once_select_is_granted() {
    let server = RedisServer::start();
    server.command(&["ACL", "SETUSER", "lh", "on", ">lh-pw", "~*", "&*", "+@all"]);
    let backend = connect(&format!("redis://lh:lh-pw@127.0.0.1:{}/1", server.port())).await;
    ping(&backend).await.unwrap();
    server.command(&["ACL", "SETUSER", "lh", "-select"]);
    server.command(&["CLIENT", "KILL", "USER", "lh"]);
    let err = refused(&backend, |e| {
        matches!(e, Error::Misconfigured(Misconfiguration::NoPermission(_)))
    })
    .await;
    assert!(err.to_string().contains("'select'"), "{err}");
    server.command(&["ACL", "SETUSER", "lh", "+select"]);
    recovered(&backend, "SELECT was granted again").await;
}

/// A reconnection while another client's script runs past `busy-reply-threshold`: the server
/// answers HELLO but refuses SELECT with BUSY, which passes once the script ends.
#[tokio::test]
async fn a_reconnection_refused_by_a_busy_script_recovers_once_the_script_is_killed() {
    let server = RedisServer::start_with(&["--busy-reply-threshold", "100"]);
    let proxy = FaultProxy::start(server.port());
    let backend = connect(&format!("redis://127.0.0.1:{}/1", proxy.port())).await;
    ping(&backend).await.unwrap();
    let port = server.port();
    let script = std::thread::spawn(move || {
        let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        conn.write_all(b"EVAL \"while true do end\" 0\r\n").unwrap();
        let mut reply = [0u8; 256];
        let n = conn.read(&mut reply).unwrap_or(0);
        String::from_utf8_lossy(&reply[..n]).into_owned()
    });
    let end = Instant::now() + Duration::from_secs(5);
    while !server.command(&["PING"]).is_error_starting_with("BUSY") {
        assert!(
            Instant::now() < end,
            "the script never made the server busy"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.drop_connections();
    let err = refused(&backend, |e| {
        matches!(e, Error::BackendUnavailable { kind: Unavailable::ServerRefused, detail, .. }
                if detail.contains("BUSY"))
    })
    .await;
    assert!(err.is_transient(), "{err:?}");
    assert!(server.command(&["SCRIPT", "KILL"]).as_string().is_some());
    recovered(&backend, "the script was killed").await;
    let ended = script.join().unwrap();
    assert!(ended.contains("Script killed"), "{ended}");
}

/// The connection moves (a failover, a virtual IP) to a server that refuses the handshake, then
/// back: `args` start that server, `expected` is what the backend says meanwhile.
async fn reconnected_to_a_refusing_server(
    args: &[&str],
    url_db: u8,
    expected: impl Fn(&Error) -> bool,
) {
    let good = RedisServer::start();
    let refusing = RedisServer::start_with(args);
    let proxy = FaultProxy::start(good.port());
    let backend = connect(&format!("redis://127.0.0.1:{}/{url_db}", proxy.port())).await;
    ping(&backend).await.unwrap();
    proxy.set_upstream(refusing.port());
    let err = refused(&backend, expected).await;
    assert!(!err.is_transient(), "{err:?}");
    proxy.set_upstream(good.port());
    recovered(&backend, "the connection was moved back").await;
}

/// The URL names database 1 of a server configured with one database: SELECT 1 is out of range.
#[tokio::test]
async fn a_reconnection_to_a_server_without_the_urls_database_recovers_when_moved_back() {
    reconnected_to_a_refusing_server(&["--databases", "1"], 1, |e| {
        matches!(e, Error::Misconfigured(Misconfiguration::InvalidUrl(why))
            if why.contains("out of range"))
    })
    .await;
}

/// A server that does not know HELLO (here renamed away; Redis before 6 says it too): no RESP3.
#[tokio::test]
async fn a_reconnection_to_a_server_without_hello_recovers_when_moved_back() {
    reconnected_to_a_refusing_server(&["--rename-command", "HELLO", ""], 0, |e| {
        matches!(e, Error::Misconfigured(Misconfiguration::Protocol(why)) if why.contains("HELLO"))
    })
    .await;
}

/// A listener that answers every connection like a web server, not like Redis, and keeps it
/// open; it stops when dropped (or after a minute).
struct NotRedis {
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NotRedis {
    fn start() -> NotRedis {
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let end = Instant::now() + Duration::from_secs(60);
            let mut open = Vec::new();
            while !stopped.load(Ordering::Acquire) && Instant::now() < end {
                match listener.accept() {
                    Ok((mut conn, _)) => {
                        let _ = conn.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
                        open.push(conn);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        NotRedis {
            port,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for NotRedis {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The connection moves to something that is not Redis (it answers HTTP), then back: calls
/// fail as a broken connection meanwhile, and answer again once moved back. The answer that
/// does not parse came to the reconnection's handshake, where redis-rs keeps it for every call;
/// it stuck for good before such a connection was rebuilt.
#[tokio::test]
async fn a_reconnection_to_something_other_than_redis_recovers_when_moved_back() {
    let good = RedisServer::start();
    let not_redis = NotRedis::start();
    let proxy = FaultProxy::start(good.port());
    let backend = connect(&proxy.url()).await;
    ping(&backend).await.unwrap();
    proxy.set_upstream(not_redis.port);
    refused(&backend, |e| matches!(e, Error::BackendUnavailable { .. })).await;
    proxy.set_upstream(good.port());
    recovered(&backend, "the connection was moved back").await;
}

/// The same for a backend connected lazily whose first connection meets something other than
/// Redis.
#[tokio::test]
async fn a_lazy_backend_whose_first_connection_is_not_to_redis_recovers_when_moved() {
    let good = RedisServer::start();
    let not_redis = NotRedis::start();
    let proxy = FaultProxy::start(not_redis.port);
    let backend = RedisBackend::connect_lazy(&proxy.url(), options())
        .await
        .unwrap();
    refused(&backend, |e| matches!(e, Error::BackendUnavailable { .. })).await;
    proxy.set_upstream(good.port());
    recovered(&backend, "the connection was moved to Redis").await;
}
