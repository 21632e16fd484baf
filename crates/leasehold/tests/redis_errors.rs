//! How Redis failures are classified: a condition that passes (a connection cut mid-reply, a
//! failing background save) is transient, so the backend-down policy and the short-circuit
//! apply; it is never reported as misconfiguration. Private redis-servers; every loop bounded.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::{Backend, Error, QuotaKeys, RedisBackend};
use leasehold_testkit::RedisServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A TCP proxy to `upstream` that, once `cut` is set, forwards only the first half of the next
/// chunk the server sends and then closes the connection, as a server killed or a link closed
/// in the middle of a reply does.
async fn truncating_proxy(upstream: u16, cut: Arc<AtomicBool>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else {
                continue;
            };
            let cut = cut.clone();
            tokio::spawn(async move {
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                });
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = match from_server.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if n > 8 && cut.swap(false, Ordering::SeqCst) {
                        let _ = to_client.write_all(&buf[..n / 2]).await;
                        let _ = to_client.shutdown().await;
                        break;
                    }
                    if to_client.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                up.abort();
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_cut_by_a_closed_connection_is_transient_not_misconfiguration() {
    let server = RedisServer::start();
    let cut = Arc::new(AtomicBool::new(false));
    let port = truncating_proxy(server.port(), cut.clone()).await;
    let backend = RedisBackend::connect(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap();
    let keys = QuotaKeys::new("cut").unwrap();
    let ttl = Duration::from_secs(5);
    backend.acquire(&keys, "warm", ttl, 10).await.unwrap();
    cut.store(true, Ordering::SeqCst);
    let err = backend
        .acquire(&keys, "cut-short", ttl, 10)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::BackendUnavailable { .. }),
        "a connection closed mid-reply must be transient, got {err:?}"
    );
    // The connection is replaced: the next call goes through.
    backend.acquire(&keys, "after-cut", ttl, 10).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_background_save_misconf_is_transient_not_misconfiguration() {
    let server = RedisServer::start_with(&["--save", "3600 1", "--dbfilename", "blocked.rdb"]);
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let keys = QuotaKeys::new("misconf").unwrap();
    let ttl = Duration::from_secs(5);
    backend.acquire(&keys, "warm", ttl, 10).await.unwrap();
    // The RDB file cannot be written (its name is taken by a non-empty directory, as a full or
    // read-only disk would refuse it): the BGSAVE fails and, with a save point configured,
    // Redis refuses writes with MISCONF until a save succeeds again.
    let dir = match server.command(&["CONFIG", "GET", "dir"]) {
        leasehold_testkit::Reply::Array(items) => items[1].as_string().unwrap(),
        other => panic!("{other:?}"),
    };
    let blocker = std::path::Path::new(&dir).join("blocked.rdb");
    std::fs::create_dir_all(blocker.join("x")).unwrap();
    server.command(&["BGSAVE"]);
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let info = server
            .command(&["INFO", "persistence"])
            .as_string()
            .unwrap();
        if info.contains("rdb_last_bgsave_status:err") {
            break;
        }
        assert!(Instant::now() < end, "BGSAVE did not fail: {info}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let err = backend
        .acquire(&keys, "during-misconf", ttl, 10)
        .await
        .unwrap_err();
    let _ = std::fs::remove_dir_all(&blocker);
    assert!(err.to_string().contains("MISCONF"), "{err}");
    assert!(
        matches!(err, Error::BackendUnavailable { .. }),
        "MISCONF passes once the disk is back: transient, got {err:?}"
    );
}

/// Something else listens on the port (an HTTP server, here): a misconfiguration, said on one
/// line (redis-rs's parse errors span several, which a log line or the CLI's one-line errors
/// would break).
#[tokio::test]
async fn a_peer_that_does_not_speak_redis_is_misconfiguration_on_one_line() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut peer, _)) = listener.accept().await {
            let mut request = [0u8; 512];
            let _ = peer.read(&mut request).await;
            let _ = peer
                .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                .await;
        }
    });
    let started = Instant::now();
    let err = RedisBackend::connect(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    let text = err.to_string();
    println!("{:?}: {text}", started.elapsed());
    assert!(
        matches!(
            err,
            Error::Misconfigured(leasehold::Misconfiguration::Protocol(_))
        ),
        "{err:?}"
    );
    assert!(!text.contains('\n'), "{text:?}");
}

/// F24's `MASTERDOWN`: a replica that lost its master and is told not to serve stale data
/// refuses commands (and, inside a script, every command of it) until the link is back. A
/// quota pointed at it (a failover tool that moved the clients before promoting it) is
/// unavailable, never full and never misconfigured, and works once the replica is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_without_its_master_is_unavailable_never_full_until_promoted() {
    let mut master = RedisServer::start();
    let replica =
        RedisServer::start_replica_of(master.port(), &["--replica-serve-stale-data", "no"]);
    let backend = RedisBackend::connect(&replica.url()).await.unwrap();
    let keys = QuotaKeys::new("masterdown").unwrap();
    let ttl = Duration::from_secs(5);
    master.kill();
    let end = Instant::now() + Duration::from_secs(10);
    while !replica
        .command(&["INFO", "replication"])
        .as_string()
        .unwrap_or_default()
        .contains("master_link_status:down")
    {
        assert!(Instant::now() < end, "the replica never saw its master go");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for id in ["a", "b", "c"] {
        let err = backend.acquire(&keys, id, ttl, 1).await.unwrap_err();
        println!("acquire {id} on the masterless replica: {err}");
        assert!(err.to_string().contains("MASTERDOWN"), "{err}");
        assert!(
            matches!(err, Error::BackendUnavailable { .. }),
            "MASTERDOWN passes with the link or a promotion: transient, got {err:?}"
        );
    }
    replica.command(&["REPLICAOF", "NO", "ONE"]);
    backend.acquire(&keys, "a", ttl, 1).await.unwrap();
    assert_eq!(replica.command(&["ZCARD", &keys.leases]).as_int(), Some(1));
}

/// A command leasehold sends that the server does not know (here `EVALSHA`, disabled with
/// `rename-command`) is a misconfiguration, never a passing outage: retrying cannot help, and a
/// backend-down policy would otherwise grant local leases for as long as the server answers.
/// Found by review: it was transient.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_command_is_misconfiguration_not_an_outage() {
    let server = RedisServer::start_with(&["--rename-command", "EVALSHA", ""]);
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let keys = QuotaKeys::new("unknown").unwrap();
    let err = backend
        .acquire(&keys, "a", Duration::from_secs(5), 1)
        .await
        .unwrap_err();
    println!("{err}");
    assert!(err.to_string().contains("unknown command"), "{err}");
    assert!(
        matches!(err, Error::Misconfigured(_)),
        "an unknown command stays unknown: {err:?}"
    );
}

/// Writes `task_id`'s cancel marker of quota `name` with the reason `lua_expr`, a Lua expression,
/// so that it may hold bytes that are not UTF-8 (the scripts store whatever a client sends).
fn write_marker(server: &RedisServer, name: &str, task_id: &str, lua_expr: &str) {
    let keys = QuotaKeys::new(name).unwrap();
    let script = format!("redis.call('SET', KEYS[1], {lua_expr}, 'PX', 600000) return 1");
    let reply = server.command(&["EVAL", &script, "1", &keys.cancel(task_id)]);
    assert_eq!(reply.as_int(), Some(1), "{reply:?}");
}

/// A cancel reason that is not UTF-8 is a reason like any other, read lossily as the scripts'
/// replies are. It was read through redis-rs's conversion to `String`, whose failure is a
/// `Parse` error: reported as a broken connection (`NoReply`), and the connection rebuilt.
#[tokio::test]
async fn a_cancel_reason_that_is_not_utf8_is_read_not_taken_for_an_outage() {
    let server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let quota = leasehold::Quota::builder("marker")
        .limit(1)
        .backend(backend.clone())
        .build()
        .unwrap();
    write_marker(&server, "marker", "t", "'stop ' .. string.char(255)");
    let rebuilds_before = backend.connection_rebuilds();
    let read = quota.cancel_reason("t").await;
    assert_eq!(read.unwrap().as_deref(), Some("stop \u{fffd}"));
    // The acquire path reads the same marker alike.
    match quota.try_acquire("t").await {
        Err(Error::Cancelled(reason)) => assert_eq!(reason, "stop \u{fffd}"),
        other => panic!("expected cancelled, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        backend.connection_rebuilds(),
        rebuilds_before,
        "an answered GET made the backend replace its connection"
    );
}

/// The same marker over a local lease (granted while Redis was down): its watcher's reads of the
/// marker failed as outages, so the short-circuit opened again and again while Redis was healthy
/// (and the policy then admitted past the limit), and the lease never heard of its cancel.
#[tokio::test]
async fn a_local_lease_hears_a_cancel_reason_that_is_not_utf8() {
    let mut server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let quota = leasehold::Quota::builder("local")
        .limit(1)
        .ttl(Duration::from_secs(2))
        .when_backend_down(leasehold::BackendDownPolicy::FailOpen)
        .backend(backend)
        .build()
        .unwrap();
    server.kill();
    let lease = quota.try_acquire("t").await.unwrap();
    assert!(lease.is_local());
    server.restart();
    write_marker(&server, "local", "t", "'stop ' .. string.char(255)");
    let heard = tokio::time::timeout(Duration::from_secs(8), lease.lost()).await;
    assert_eq!(
        heard.map(|r| r.to_string()).ok(),
        Some(leasehold::LostReason::Cancelled("stop \u{fffd}".into()).to_string()),
        "the cancelled local lease was never told"
    );
    assert_eq!(quota.breaker_mode(), leasehold::BreakerMode::Closed);
    // Redis answers: the quota's limit holds again, no local grant.
    let u = quota.try_acquire("u").await.unwrap();
    assert!(!u.is_local());
    assert!(matches!(
        quota.try_acquire("v").await,
        Err(Error::Full { .. })
    ));
}
