//! [`FaultProxy`]: a TCP proxy on 127.0.0.1 in front of a redis-server, with faults a test can
//! switch on and off while traffic flows.
//!
//! Plain std threads: one acceptor per proxy, and per client connection one thread per
//! direction. Every blocking call has a short timeout, so each thread notices a control change
//! or the proxy's shutdown within a few milliseconds, and dropping the proxy joins them all.
//!
//! ```
//! use std::time::Duration;
//! use leasehold_testkit::{proxy::FaultProxy, RedisServer};
//!
//! let server = RedisServer::start();
//! let proxy = FaultProxy::start(server.port());
//! // Point the client under test at redis://127.0.0.1:{proxy.port()}/, then:
//! proxy.set_latency(Duration::from_millis(100)); // each direction: +200 ms per round trip
//! proxy.set_latency_to_server(Duration::from_secs(1)); // requests late, replies on time
//! proxy.set_latency(Duration::ZERO);
//! proxy.partition(true);                          // this client is cut off from Redis
//! proxy.partition(false);
//! proxy.wedge_connections();                       // today's connections go silent for good
//! proxy.set_upstream(server.port());               // a failover: reconnect, to this port
//! assert_ne!(proxy.port(), server.port());
//! ```

mod pump;
mod push_filter;

use std::io;
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use pump::Direction;

/// How often the acceptor looks for a new connection or a shutdown.
const ACCEPT_TICK: Duration = Duration::from_millis(2);
/// Bound on connecting to the upstream server.
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A TCP proxy on a free 127.0.0.1 port that forwards to a redis-server port on 127.0.0.1,
/// with switchable faults. All controls take effect on the connections already open.
///
/// Dropping the proxy closes its listener and every connection and joins its threads.
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

/// The state shared by the proxy handle, its acceptor and its connection threads.
#[derive(Debug)]
struct Shared {
    /// The upstream port on 127.0.0.1; read once per connection, when it connects upstream.
    upstream_port: AtomicU16,
    faults: Faults,
    connections: Mutex<Vec<Connection>>,
    accepted: AtomicU64,
}

/// The switches, read by the forwarding threads on every step.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    latency_to_server_us: AtomicU64,
    latency_to_client_us: AtomicU64,
    stalled: AtomicBool,
    partitioned: AtomicBool,
    drop_pushes: AtomicBool,
    stopping: AtomicBool,
}

impl Faults {
    pub(crate) fn latency(&self, direction: Direction) -> Duration {
        let us = match direction {
            Direction::ToServer => &self.latency_to_server_us,
            Direction::ToClient => &self.latency_to_client_us,
        };
        Duration::from_micros(us.load(Ordering::Relaxed))
    }
    pub(crate) fn stalled(&self) -> bool {
        self.stalled.load(Ordering::Relaxed)
    }
    pub(crate) fn drop_pushes(&self) -> bool {
        self.drop_pushes.load(Ordering::Relaxed)
    }
    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }
}

/// One proxied client connection.
#[derive(Debug)]
struct Connection {
    client: TcpStream,
    /// Set by [`FaultProxy::wedge_connections`]: this connection forwards nothing any more.
    wedged: Arc<AtomicBool>,
    /// Set once the upstream connection is open.
    upstream: Arc<Mutex<Option<TcpStream>>>,
    closed: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Connection {
    fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let _ = self.client.shutdown(Shutdown::Both);
        if let Some(upstream) = lock(&self.upstream).as_ref() {
            let _ = upstream.shutdown(Shutdown::Both);
        }
    }
}

fn store_us(slot: &AtomicU64, latency: Duration) {
    let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
    slot.store(us, Ordering::Relaxed);
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl FaultProxy {
    /// Starts a proxy on a free 127.0.0.1 port forwarding to `127.0.0.1:upstream_port`.
    /// Panics if no listener can be bound.
    pub fn start(upstream_port: u16) -> FaultProxy {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap_or_else(|e| panic!("fault proxy: cannot bind 127.0.0.1:0: {e}"));
        listener
            .set_nonblocking(true)
            .unwrap_or_else(|e| panic!("fault proxy: cannot make the listener non-blocking: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("fault proxy: no local address: {e}"))
            .port();
        let shared = Arc::new(Shared {
            upstream_port: AtomicU16::new(upstream_port),
            faults: Faults::default(),
            connections: Mutex::new(Vec::new()),
            accepted: AtomicU64::new(0),
        });
        let acceptor = {
            let shared = shared.clone();
            thread::Builder::new()
                .name(format!("fault-proxy-{port}"))
                .spawn(move || accept_loop(listener, &shared))
                .unwrap_or_else(|e| panic!("fault proxy: cannot spawn its acceptor: {e}"))
        };
        FaultProxy {
            port,
            shared,
            acceptor: Some(acceptor),
        }
    }

    /// The port clients connect to (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of the proxied server, `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Delays every forwarded chunk by `latency`, in each direction: a request/reply round trip
    /// gets twice this. Chunks keep their order. `Duration::ZERO` turns it off; chunks already
    /// queued keep the delay they were given.
    pub fn set_latency(&self, latency: Duration) {
        self.set_latency_each_way(latency, latency);
    }

    /// Delays every chunk the client sends (requests) by `to_server` and every chunk the server
    /// sends (replies and pushes) by `to_client`: a one-way delay, such as a congested uplink,
    /// that a symmetric [`set_latency`](Self::set_latency) cannot model. Chunks keep their order
    /// within each direction, and a chunk keeps the delay it was given when it was read, so
    /// lowering a delay never lets a later chunk overtake an earlier one. `Duration::ZERO` turns
    /// a direction's delay off.
    pub fn set_latency_each_way(&self, to_server: Duration, to_client: Duration) {
        self.set_latency_to_server(to_server);
        self.set_latency_to_client(to_client);
    }

    /// Delays every chunk from the client to the server (requests) by `latency`, leaving the
    /// other direction as it is; see [`set_latency_each_way`](Self::set_latency_each_way).
    pub fn set_latency_to_server(&self, latency: Duration) {
        store_us(&self.shared.faults.latency_to_server_us, latency);
    }

    /// Delays every chunk from the server to the client (replies and pushes) by `latency`,
    /// leaving the other direction as it is; see
    /// [`set_latency_each_way`](Self::set_latency_each_way).
    pub fn set_latency_to_client(&self, latency: Duration) {
        store_us(&self.shared.faults.latency_to_client_us, latency);
    }

    /// Stops forwarding in both directions while keeping every socket open (a half-open link,
    /// a "blackhole"), or resumes it. Bytes already read are held and delivered on resume; new
    /// connections are accepted but carry nothing until then.
    pub fn stall(&self, stalled: bool) {
        self.shared.faults.stalled.store(stalled, Ordering::Relaxed);
    }

    /// Closes every current client connection (and its upstream side). New connections work.
    /// Returns when the connections' threads have ended.
    pub fn drop_connections(&self) {
        let connections = std::mem::take(&mut *lock(&self.shared.connections));
        for connection in &connections {
            connection.close();
        }
        for connection in connections {
            let _ = connection.thread.join();
        }
    }

    /// Cuts the proxied client off, or heals the cut: while partitioned, current connections
    /// are closed and new ones are closed as soon as they are accepted.
    pub fn partition(&self, partitioned: bool) {
        self.shared
            .faults
            .partitioned
            .store(partitioned, Ordering::Relaxed);
        if partitioned {
            self.drop_connections();
        }
    }

    /// Drops the Pub/Sub deliveries (RESP3 `message`, `pmessage` and `smessage` pushes) that the
    /// server sends, and forwards everything else, subscription confirmations included: the
    /// client stays subscribed and never hears a message.
    pub fn drop_pushes(&self, drop: bool) {
        self.shared
            .faults
            .drop_pushes
            .store(drop, Ordering::Relaxed);
    }

    /// Wedges every connection open now, for good: both directions keep reading (the client's
    /// writes are accepted, as by a proxy or load balancer that still acknowledges them) and
    /// forward nothing, bytes already held included, while the sockets stay open. Connections
    /// opened later forward normally: a connection wedged above TCP, the fault a client only
    /// escapes by opening a new connection. A wedged connection ends when either side closes
    /// it. Returns how many connections were wedged.
    pub fn wedge_connections(&self) -> usize {
        let mut connections = lock(&self.shared.connections);
        connections.retain(|c| !c.thread.is_finished());
        for connection in connections.iter() {
            connection.wedged.store(true, Ordering::Relaxed);
        }
        connections.len()
    }

    /// Sends every new connection to `127.0.0.1:upstream_port` from now on, and closes every
    /// current connection (returning when their threads have ended), as a failover's moved
    /// virtual IP or a Sentinel-driven reconnect would: a client sees its connections drop, and
    /// the ones it opens again reach the new server. Faults switched on stay on.
    pub fn set_upstream(&self, upstream_port: u16) {
        self.shared
            .upstream_port
            .store(upstream_port, Ordering::SeqCst);
        // A connection accepted before the store but still connecting may reach the old
        // upstream; closing after the store ends it too.
        self.drop_connections();
    }

    /// The port new connections are forwarded to (on 127.0.0.1).
    pub fn upstream_port(&self) -> u16 {
        self.shared.upstream_port.load(Ordering::SeqCst)
    }

    /// Client connections open right now.
    pub fn connections(&self) -> usize {
        let mut connections = lock(&self.shared.connections);
        connections.retain(|c| !c.thread.is_finished());
        connections.len()
    }

    /// Client connections accepted since the proxy started (including refused ones).
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.faults.stopping.store(true, Ordering::Relaxed);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        self.drop_connections();
    }
}

fn accept_loop(listener: TcpListener, shared: &Arc<Shared>) {
    while !shared.faults.stopping() {
        match listener.accept() {
            Ok((client, _)) => {
                shared.accepted.fetch_add(1, Ordering::Relaxed);
                if shared.faults.partitioned.load(Ordering::Relaxed) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                if let Err(e) = open(client, shared) {
                    eprintln!("fault proxy: dropped a connection: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(ACCEPT_TICK),
            Err(_) => thread::sleep(ACCEPT_TICK),
        }
    }
}

/// Registers an accepted client and starts its connection thread.
fn open(client: TcpStream, shared: &Arc<Shared>) -> io::Result<()> {
    client.set_nonblocking(false)?;
    client.set_nodelay(true)?;
    let upstream = Arc::new(Mutex::new(None));
    let closed = Arc::new(AtomicBool::new(false));
    let wedged = Arc::new(AtomicBool::new(false));
    // Held across the spawn, so that `drop_connections` (as in `set_upstream`) either finds
    // this connection in the list or runs wholly before its thread reads the upstream port.
    let mut connections = lock(&shared.connections);
    let thread = {
        let client = client.try_clone()?;
        let (upstream, closed, shared) = (upstream.clone(), closed.clone(), shared.clone());
        let links = Links {
            closed,
            wedged: wedged.clone(),
        };
        thread::Builder::new()
            .name("fault-proxy-conn".into())
            .spawn(move || run_connection(client, &upstream, &links, &shared))?
    };
    connections.retain(|c| !c.thread.is_finished());
    connections.push(Connection {
        client,
        wedged,
        upstream,
        closed,
        thread,
    });
    Ok(())
}

/// The switches of one connection, shared by its two directions.
#[derive(Debug, Clone)]
pub(crate) struct Links {
    pub(crate) closed: Arc<AtomicBool>,
    pub(crate) wedged: Arc<AtomicBool>,
}

/// Connects upstream, then forwards both directions until either side closes.
fn run_connection(
    client: TcpStream,
    upstream_slot: &Mutex<Option<TcpStream>>,
    links: &Links,
    shared: &Arc<Shared>,
) {
    let closed = &links.closed;
    let target = SocketAddr::from((
        Ipv4Addr::LOCALHOST,
        shared.upstream_port.load(Ordering::SeqCst),
    ));
    let upstream = match TcpStream::connect_timeout(&target, UPSTREAM_CONNECT_TIMEOUT) {
        Ok(upstream) => upstream,
        Err(_) => {
            let _ = client.shutdown(Shutdown::Both);
            return;
        }
    };
    let _ = upstream.set_nodelay(true);
    let clones = (
        client.try_clone(),
        upstream.try_clone(),
        upstream.try_clone(),
    );
    let (Ok(client_out), Ok(upstream_in), Ok(registered)) = clones else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    *lock(upstream_slot) = Some(registered);
    if closed.load(Ordering::Relaxed) {
        // drop_connections ran while we were connecting.
        let _ = upstream.shutdown(Shutdown::Both);
        let _ = client.shutdown(Shutdown::Both);
        return;
    }
    let backward = {
        let (links, shared) = (links.clone(), shared.clone());
        thread::Builder::new()
            .name("fault-proxy-down".into())
            .spawn(move || {
                pump::forward(
                    upstream_in,
                    client_out,
                    Direction::ToClient,
                    &links,
                    &shared.faults,
                )
            })
    };
    pump::forward(client, upstream, Direction::ToServer, links, &shared.faults);
    if let Ok(backward) = backward {
        let _ = backward.join();
    }
}
