//! The fault proxy against a real redis-server: traffic passes, and each fault does what it says
//! while connections are open.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::time::{Duration, Instant};

use leasehold_testkit::proxy::FaultProxy;
use leasehold_testkit::RedisServer;

/// A raw client connection with a small RESP encoder; replies are read as raw bytes.
struct Client {
    stream: TcpStream,
}

impl Client {
    fn connect(port: u16) -> Client {
        let stream =
            TcpStream::connect_timeout(&(Ipv4Addr::LOCALHOST, port).into(), Duration::from_secs(2))
                .expect("connect to the proxy");
        stream
            .set_write_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        Client { stream }
    }

    fn send(&mut self, args: &[&[u8]]) {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for arg in args {
            out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            out.extend_from_slice(arg);
            out.extend_from_slice(b"\r\n");
        }
        self.stream.write_all(&out).expect("write to the proxy");
    }

    /// Reads until the bytes received end with `expected`, or `within` passes; returns what
    /// was read and whether the connection was closed.
    fn read_until(&mut self, expected: &[u8], within: Duration) -> (Vec<u8>, bool) {
        let end = Instant::now() + within;
        let mut got = Vec::new();
        let mut buf = [0u8; 64 * 1024];
        while !got.ends_with(expected) {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return (got, false);
            }
            self.stream.set_read_timeout(Some(left)).unwrap();
            match self.stream.read(&mut buf) {
                Ok(0) => return (got, true),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => return (got, true),
            }
        }
        (got, false)
    }

    /// Reads exactly `len` bytes within `within`, or panics.
    fn read_len(&mut self, len: usize, within: Duration) -> Vec<u8> {
        let end = Instant::now() + within;
        let mut got = vec![0u8; len];
        let mut filled = 0;
        while filled < len {
            let left = end.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "only {filled} of {len} bytes within {within:?}"
            );
            self.stream.set_read_timeout(Some(left)).unwrap();
            match self.stream.read(&mut got[filled..]) {
                Ok(0) => panic!("closed after {filled} of {len} bytes"),
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("read failed after {filled} of {len} bytes: {e}"),
            }
        }
        got
    }

    /// PING and wait for PONG; returns the round-trip time.
    fn ping(&mut self, within: Duration) -> Duration {
        self.ping_reading(within).0
    }

    /// PING and wait for PONG; returns the round-trip time and every byte read until PONG.
    fn ping_reading(&mut self, within: Duration) -> (Duration, Vec<u8>) {
        let start = Instant::now();
        self.send(&[b"PING"]);
        let (got, closed) = self.read_until(b"+PONG\r\n", within);
        assert!(
            got.ends_with(b"+PONG\r\n"),
            "no PONG within {within:?} (closed: {closed}, got {:?})",
            String::from_utf8_lossy(&got)
        );
        (start.elapsed(), got)
    }
}

#[test]
fn traffic_passes_unchanged_in_both_directions() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    assert_eq!(proxy.url(), format!("redis://127.0.0.1:{}/", proxy.port()));
    let mut client = Client::connect(proxy.port());
    client.ping(Duration::from_secs(2));
    // A value larger than any single read, with every byte value, to check ordering.
    let value: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    client.send(&[b"SET", b"big", &value]);
    client.read_until(b"+OK\r\n", Duration::from_secs(5));
    client.send(&[b"GET", b"big"]);
    let header = format!("${}\r\n", value.len()).into_bytes();
    let expected = [header.as_slice(), &value, b"\r\n"].concat();
    let got = client.read_len(expected.len(), Duration::from_secs(5));
    assert!(
        got == expected,
        "GET through the proxy returned other bytes"
    );
    assert_eq!(proxy.connections(), 1);
    assert_eq!(proxy.accepted(), 1);
}

#[test]
fn latency_is_added_in_each_direction() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut client = Client::connect(proxy.port());
    let base = client.ping(Duration::from_secs(2));
    proxy.set_latency(Duration::from_millis(100));
    let slow = client.ping(Duration::from_secs(2));
    proxy.set_latency(Duration::ZERO);
    let fast = client.ping(Duration::from_secs(2));
    println!("PING round trip: {base:?} plain, {slow:?} with 100 ms each way, {fast:?} after");
    assert!(slow >= Duration::from_millis(200), "{slow:?}");
    assert!(slow < Duration::from_millis(600), "{slow:?}");
    assert!(fast < Duration::from_millis(100), "{fast:?}");
}

#[test]
fn latency_can_be_set_for_each_direction_alone() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    // A second, plain connection straight to the server shows when the delayed request lands.
    let mut direct = Client::connect(server.port());
    let mut client = Client::connect(proxy.port());
    client.ping(Duration::from_secs(2));

    // Requests late, replies on time: the write lands at the server only after the delay. One
    // second leaves a loaded machine room: the direct EXISTS must come back inside it, and one
    // delayed direction must stay clear of two (2 s).
    let delay = Duration::from_secs(1);
    proxy.set_latency_to_server(delay);
    let sent = Instant::now();
    client.send(&[b"SET", b"oneway", b"1"]);
    direct.send(&[b"EXISTS", b"oneway"]);
    let (early, _) = direct.read_until(b"\r\n", Duration::from_secs(2));
    assert_eq!(
        early, b":0\r\n",
        "the delayed request reached the server early"
    );
    let (got, closed) = client.read_until(b"+OK\r\n", Duration::from_secs(5));
    let up = sent.elapsed();
    assert!(got.ends_with(b"+OK\r\n"), "closed: {closed}, got {got:?}");
    direct.send(&[b"EXISTS", b"oneway"]);
    let (late, _) = direct.read_until(b"\r\n", Duration::from_secs(2));
    assert_eq!(late, b":1\r\n");

    // Lowering the delay lets no later request overtake one still held.
    client.send(&[b"SET", b"order", b"first"]);
    proxy.set_latency_to_server(Duration::ZERO);
    client.send(&[b"SET", b"order", b"second"]);
    client.read_until(b"+OK\r\n+OK\r\n", Duration::from_secs(5));
    direct.send(&[b"GET", b"order"]);
    let (order, _) = direct.read_until(b"second\r\n", Duration::from_secs(2));
    assert_eq!(order, b"$6\r\nsecond\r\n");

    // Replies late, requests on time.
    proxy.set_latency_to_client(delay);
    let down = client.ping(Duration::from_secs(5));
    proxy.set_latency_each_way(Duration::ZERO, Duration::ZERO);
    let fast = client.ping(Duration::from_secs(2));
    println!("round trips: {up:?} requests delayed, {down:?} replies delayed, {fast:?} after");
    for one_way in [up, down] {
        assert!(one_way >= delay, "{one_way:?}");
        assert!(one_way < 2 * delay, "one direction only: {one_way:?}");
    }
    assert!(fast < Duration::from_millis(300), "{fast:?}");
}

#[test]
fn stall_holds_the_bytes_then_delivers_them() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut client = Client::connect(proxy.port());
    client.ping(Duration::from_secs(2));
    proxy.stall(true);
    client.send(&[b"PING"]);
    let (got, closed) = client.read_until(b"+PONG\r\n", Duration::from_millis(400));
    assert!(
        got.is_empty() && !closed,
        "a stalled link carries nothing and stays open"
    );
    assert_eq!(proxy.connections(), 1);
    let stalled = Instant::now();
    proxy.stall(false);
    let (got, _) = client.read_until(b"+PONG\r\n", Duration::from_secs(2));
    assert_eq!(got, b"+PONG\r\n", "the held PING is delivered on resume");
    assert!(stalled.elapsed() < Duration::from_millis(500));
}

#[test]
fn drop_connections_closes_them_and_new_ones_work() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut client = Client::connect(proxy.port());
    client.ping(Duration::from_secs(2));
    let before = server.command(&["CLIENT", "LIST"]).as_string().unwrap();
    proxy.drop_connections();
    assert_eq!(proxy.connections(), 0);
    let (_, closed) = client.read_until(b"never", Duration::from_secs(2));
    assert!(closed, "the client side is closed");
    let mut again = Client::connect(proxy.port());
    again.ping(Duration::from_secs(2));
    // The upstream side was closed too: the server does not keep the old connection.
    let deadline = Instant::now() + Duration::from_secs(2);
    let after = loop {
        let list = server.command(&["CLIENT", "LIST"]).as_string().unwrap();
        if list.lines().count() <= before.lines().count() || Instant::now() > deadline {
            break list;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(after.lines().count(), before.lines().count(), "{after}");
}

#[test]
fn set_upstream_closes_current_connections_and_sends_new_ones_to_the_new_server() {
    let first = RedisServer::start();
    let second = RedisServer::start();
    first.command(&["SET", "who", "first"]);
    second.command(&["SET", "who", "second"]);
    let proxy = FaultProxy::start(first.port());
    assert_eq!(proxy.upstream_port(), first.port());
    let mut client = Client::connect(proxy.port());
    client.send(&[b"GET", b"who"]);
    client.read_until(b"$5\r\nfirst\r\n", Duration::from_secs(2));
    // A fault switched on before the move stays on after it.
    proxy.set_latency(Duration::from_millis(50));

    proxy.set_upstream(second.port());
    assert_eq!(proxy.upstream_port(), second.port());
    assert_eq!(proxy.connections(), 0);
    let (_, closed) = client.read_until(b"never", Duration::from_secs(2));
    assert!(closed, "the connection to the old server is closed");
    let mut again = Client::connect(proxy.port());
    let start = Instant::now();
    again.send(&[b"GET", b"who"]);
    let (got, _) = again.read_until(b"$6\r\nsecond\r\n", Duration::from_secs(2));
    assert!(
        got.ends_with(b"$6\r\nsecond\r\n"),
        "a new connection reaches the new server: {:?}",
        String::from_utf8_lossy(&got)
    );
    assert!(
        start.elapsed() >= Duration::from_millis(100),
        "latency kept"
    );
    assert_eq!(proxy.accepted(), 2);
}

#[test]
fn wedge_silences_the_open_connections_for_good_and_new_ones_work() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut old = Client::connect(proxy.port());
    old.ping(Duration::from_secs(2));
    assert_eq!(proxy.wedge_connections(), 1);
    // The request is accepted but never reaches the server: the key is never set.
    old.send(&[b"SET", b"wedged", b"1"]);
    let (got, closed) = old.read_until(b"+OK\r\n", Duration::from_millis(400));
    assert!(
        got.is_empty() && !closed,
        "a wedged link answers nothing and stays open"
    );
    assert_eq!(server.command(&["EXISTS", "wedged"]).as_int(), Some(0));
    let mut new = Client::connect(proxy.port());
    new.ping(Duration::from_secs(2));
    // Nothing comes back on the old one later either, unlike a stall.
    let (got, _) = old.read_until(b"+OK\r\n", Duration::from_millis(300));
    assert!(got.is_empty(), "{got:?}");
    assert_eq!(proxy.connections(), 2);
    // Closing the wedged connection ends it on the proxy too.
    drop(old);
    let deadline = Instant::now() + Duration::from_secs(2);
    while proxy.connections() > 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(proxy.connections(), 1);
    new.ping(Duration::from_secs(2));
}

#[test]
fn partition_closes_current_and_new_connections_until_healed() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut client = Client::connect(proxy.port());
    client.ping(Duration::from_secs(2));
    proxy.partition(true);
    let (_, closed) = client.read_until(b"never", Duration::from_secs(2));
    assert!(closed, "the open connection is cut");
    let mut during = Client::connect(proxy.port());
    during.send(&[b"PING"]);
    let (got, closed) = during.read_until(b"+PONG\r\n", Duration::from_secs(2));
    assert!(
        got.is_empty() && closed,
        "a new connection is closed at once"
    );
    assert_eq!(proxy.connections(), 0);
    proxy.partition(false);
    Client::connect(proxy.port()).ping(Duration::from_secs(2));
    assert_eq!(proxy.accepted(), 3);
}

#[test]
fn drop_pushes_loses_messages_but_keeps_the_subscription() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut subscriber = Client::connect(proxy.port());
    subscriber.send(&[b"HELLO", b"3"]);
    subscriber.read_until(b"\r\n", Duration::from_secs(2));
    // Drain the rest of the HELLO map with a PING marker.
    subscriber.ping(Duration::from_secs(2));
    proxy.drop_pushes(true);
    subscriber.send(&[b"SUBSCRIBE", b"ch"]);
    let (got, _) = subscriber.read_until(b":1\r\n", Duration::from_secs(2));
    assert!(got.ends_with(b":1\r\n"), "subscription confirmed");
    let publish = |text: &str| {
        let receivers = server.command(&["PUBLISH", "ch", text]).as_int();
        assert_eq!(receivers, Some(1), "the server delivers to the subscriber");
    };
    publish("lost");
    // Replies come in order: had the message passed, it would arrive before this PONG.
    let (_, got) = subscriber.ping_reading(Duration::from_secs(2));
    assert_eq!(got, b"+PONG\r\n", "the message was dropped");
    proxy.drop_pushes(false);
    publish("kept");
    let (got, _) = subscriber.read_until(b"kept\r\n", Duration::from_secs(2));
    assert!(got.starts_with(b">3\r\n$7\r\nmessage\r\n"), "{got:?}");
}

#[test]
fn drop_closes_everything_promptly() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let port = proxy.port();
    let mut client = Client::connect(port);
    client.ping(Duration::from_secs(2));
    proxy.stall(true);
    client.send(&[b"PING"]);
    let start = Instant::now();
    drop(proxy);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    let (_, closed) = client.read_until(b"never", Duration::from_secs(2));
    assert!(closed, "connections end with the proxy");
    let refused = TcpStream::connect_timeout(
        &(Ipv4Addr::LOCALHOST, port).into(),
        Duration::from_millis(500),
    );
    assert!(refused.is_err(), "the listener is closed");
}
