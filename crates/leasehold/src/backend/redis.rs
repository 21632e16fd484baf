//! The Redis backend: protocol v1 (docs/PROTOCOL.md) over one multiplexed RESP3 connection.
//!
//! One `ConnectionManager` per backend carries every command and the Pub/Sub subscriptions
//! (RESP3 push), reconnects by itself and resubscribes after a reconnect. All I/O runs on the
//! leasehold runtime (see `runtime.rs`), and every call has its own timeout: a call made while
//! the link is down would otherwise wait for the manager's whole reconnect budget. A connection
//! that stops answering without breaking (wedged above TCP) is replaced by the backend itself
//! after a few rounds of call timeouts (`link.rs`, `rebuild`).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, IntoConnectionInfo, ProtocolVersion, PushInfo, PushKind, RedisError};
use redis::{Script, ServerErrorKind, Value};
use tokio::sync::{broadcast, mpsc};

mod link;

use self::link::{Link, Next};
use super::batch::Batcher;
use super::redacted_url::redacted;
use super::{
    AcquireReply, Backend, LeaseRecord, LimitUpdate, QuotaEvent, RenewOutcome, RenewReply,
    Snapshot, VersionedLimit, RENEW_BATCH,
};
use crate::error::{Error, Misconfiguration, Result};
use crate::keys::QuotaKeys;
use crate::runtime;

static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/acquire.lua")));
static RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/renew.lua")));
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/release.lua")));
static CANCEL: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/cancel.lua")));
static SNAPSHOT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/snapshot.lua")));
static SET_LIMIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/set_limit.lua")));

/// Capacity of each quota's event channel; a slow receiver loses old events (at most once).
const EVENT_CAPACITY: usize = 1024;

/// Options of a [`RedisBackend`].
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Bound on every single Redis call, connection set-up included. Default 1 s.
    pub call_timeout: Duration,
    /// Bound on one attempt to open a TCP/TLS connection. Default 1 s.
    pub connect_timeout: Duration,
    /// For `rediss://` servers whose certificate is signed by a private CA: that CA, in PEM.
    /// `None` trusts the system's root certificates.
    pub tls_root_cert: Option<Vec<u8>>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            call_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
            tls_root_cert: None,
        }
    }
}

/// Leases kept in Redis (or Valkey), shared by every process that uses the same server.
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    /// The connection calls go through, replaced when it stops answering.
    link: Link<ConnectionManager>,
    /// What a replacement connection is built from.
    client: redis::Client,
    /// Every connection's pushes go to the one `dispatch_pushes` task.
    push_tx: mpsc::UnboundedSender<PushInfo>,
    options: RedisOptions,
    /// Channel name -> sender of that quota's events, once its SUBSCRIBE is confirmed.
    channels: Mutex<HashMap<String, broadcast::Sender<QuotaEvent>>>,
    /// The database number of the URL. Pub/Sub ignores databases, so quotas of one name in two
    /// databases of one server announce on channels of their own (PROTOCOL.md §3).
    db: i64,
    /// Held by the subscribe in progress, and by a rebuild while it resubscribes.
    subscribing: tokio::sync::Mutex<()>,
    /// Quota name -> the latest epoch any reply reported, the highest seq seen in it, and the
    /// highest fencing token seen: what acquire sends, so the server can tell that it lost the
    /// quota's state, all of it or its latest writes, and issue tokens above the lost ones
    /// (protocol, "Dataset loss"). Renewals send their leases' own epoch instead.
    epochs: Mutex<HashMap<String, SeenEpoch>>,
    /// Admission attempts that share script calls: per quota, then per (ttl in ms, limit and
    /// limit version).
    acquires: Mutex<HashMap<String, AcquireQueues>>,
    /// Releases `(task id, token or "*")` that share script calls, per quota.
    releases: Mutex<HashMap<String, Arc<Queue<ReleaseBatcher>>>>,
}

impl Inner {
    /// Drops the per-name state (the epoch seen, the batching queues) of a quota this process
    /// no longer uses. A call still under way keeps its own queue and ends as it would have.
    fn forget_quota(&self, name: &str) {
        // One map at a time: no other path holds two of these locks.
        fn remove<V>(map: &Mutex<HashMap<String, V>>, name: &str) {
            map.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
        }
        remove(&self.epochs, name);
        remove(&self.acquires, name);
        remove(&self.releases, name);
    }

    /// The channel of the quota of `keys` in this backend's database: `keys.events` in database
    /// 0, `keys.events` + `:db<N>` in database N.
    fn channel(&self, keys: &QuotaKeys) -> String {
        match self.db {
            0 => keys.events.clone(),
            db => format!("{}:db{db}", keys.events),
        }
    }

    /// Channel name -> sender of that quota's events.
    fn channels(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, broadcast::Sender<QuotaEvent>>> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Admission attempts (task ids) of one quota, ttl, limit and limit version, sent together.
type AcquireBatcher = Batcher<String, AcquireReply>;

/// Releases `(task id, token or "*")` of one quota, sent together.
type ReleaseBatcher = Batcher<(String, String), bool>;

/// The admission queues of one quota, by (ttl in ms, limit and limit version).
type AcquireQueues = HashMap<(u128, VersionedLimit), Arc<Queue<AcquireBatcher>>>;

/// The calls of one kind for one quota waiting to be sent, with the quota's keys (so that a call
/// copies no key names until its batch is built).
struct Queue<B> {
    keys: Arc<QuotaKeys>,
    batcher: Arc<B>,
}

/// Most admission attempts, or releases, sent in one script call. A full batch runs in well under
/// a millisecond of Redis time.
const CALL_BATCH: usize = 128;

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

impl RedisBackend {
    /// Connects to `url` (`redis://[user:password@]host:port[/db]` or `rediss://...`) with the
    /// default options.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, RedisOptions::default()).await
    }

    /// Connects to `url` with `options`. Fails with [`Error::BackendUnavailable`] when the server
    /// cannot be reached within the call timeout, and with [`Error::Misconfigured`] when the URL
    /// or the credentials are wrong.
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<Self> {
        // rustls panics at the first TLS connect unless a process-wide provider is chosen.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let info = url
            .into_connection_info()
            .map_err(|e| Misconfiguration::InvalidUrl(format!("{:?}: {e}", redacted(url))))?;
        let db = info.redis_settings().db();
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let info = info
            .set_redis_settings(settings)
            .set_tcp_settings(tcp_settings(options.call_timeout));
        let client = match &options.tls_root_cert {
            None => redis::Client::open(info),
            Some(ca) => redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(ca.clone()),
                },
            ),
        }
        .map_err(|e| Misconfiguration::InvalidUrl(format!("{:?}: {e}", redacted(url))))?;
        let timeout = options.call_timeout;
        let connect_options = options.clone();
        runtime::run(async move {
            // One plain connection first: the manager retries every failure, so a wrong password
            // would only show as a timeout there.
            tokio::time::timeout(timeout, client.get_multiplexed_async_connection())
                .await
                .map_err(|_| no_connection_within(timeout))?
                .map_err(|e| match e.kind() {
                    // Garbage in answer to the handshake: something else listens there.
                    ErrorKind::Parse => Misconfiguration::Protocol(format!(
                        "the server does not answer like Redis: {e}"
                    ))
                    .into(),
                    _ => map_error(e, ""),
                })?;
            let (push_tx, push_rx) = mpsc::unbounded_channel();
            let conn = new_manager(&client, &connect_options, &push_tx).await?;
            let inner = Arc::new(Inner {
                link: Link::new(conn, connect_options.call_timeout),
                client,
                push_tx,
                options: connect_options,
                channels: Mutex::new(HashMap::new()),
                db,
                subscribing: tokio::sync::Mutex::new(()),
                epochs: Mutex::new(HashMap::new()),
                acquires: Mutex::new(HashMap::new()),
                releases: Mutex::new(HashMap::new()),
            });
            tokio::spawn(dispatch_pushes(Arc::downgrade(&inner), push_rx));
            tokio::spawn(keep_subscriptions_alive(Arc::downgrade(&inner)));
            let backend = RedisBackend { inner };
            // Surface authentication and permission problems now, not at the first acquire.
            backend.call_raw(redis::cmd("PING")).await?;
            // Load every script now: a first renewal that has to go EVALSHA, NOSCRIPT, SCRIPT
            // LOAD, EVALSHA takes three round trips, which a slow link may not fit in a ttl.
            for script in [&*ACQUIRE, &*RENEW, &*RELEASE, &*CANCEL, &*SNAPSHOT] {
                backend
                    .on_link(
                        "",
                        |mut conn| async move { script.load_async(&mut conn).await },
                    )
                    .await?;
            }
            Ok(backend)
        })
        .await
        .map_err(|e| match e {
            // Say which server: a process may use several.
            Error::BackendUnavailable(why) => {
                // A server without TLS never answers a TLS handshake: the client times out,
                // which looks like any unreachable server.
                let hint = match url.starts_with("rediss://") {
                    true => " (if the server does not speak TLS, use redis://)",
                    false => "",
                };
                Error::BackendUnavailable(format!("{}: {why}{hint}", redacted(url)))
            }
            other => other,
        })
    }

    /// Sends one raw command through the backend's connection, with the call timeout. Meant for
    /// tools and benchmarks that need the same client path as leasehold's own calls.
    pub async fn call<T: redis::FromRedisValue + Send + 'static>(
        &self,
        cmd: redis::Cmd,
    ) -> Result<T> {
        let this = self.clone();
        runtime::run(async move {
            let value = this.call_raw(cmd).await?;
            redis::from_redis_value(value)
                .map_err(|e| Misconfiguration::Protocol(e.to_string()).into())
        })
        .await
    }

    async fn call_raw(&self, cmd: redis::Cmd) -> Result<Value> {
        self.on_link("", |mut conn| async move {
            cmd.query_async::<Value>(&mut conn).await
        })
        .await
    }

    /// Connections built to replace one that stopped answering, since this backend connected
    /// (attempts that could not connect included). For tests and diagnostics.
    #[doc(hidden)]
    pub fn connection_rebuilds(&self) -> u64 {
        self.inner.link.rebuilds()
    }

    /// Runs `call` on the current connection with the call timeout, mapping errors for the
    /// quota `quota`; its outcome feeds the wedge detection.
    async fn on_link<T, F, Fut>(&self, quota: &str, call: F) -> Result<T>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let (conn, ticket) = self.inner.link.checkout();
        let timeout = self.inner.options.call_timeout;
        let result = tokio::time::timeout(timeout, call(conn)).await;
        let timed_out = match &result {
            Err(_) => true,
            // redis-rs's own response timeout (the same duration) may fire first.
            Ok(Err(e)) if e.is_timeout() => true,
            // A broken connection is redis-rs's to replace: neither an answer nor a wedge.
            Ok(Err(e)) if e.is_unrecoverable_error() || e.is_io_error() => false,
            Ok(_) => {
                self.inner.link.replied(ticket);
                false
            }
        };
        if timed_out {
            match self.inner.link.timed_out(ticket) {
                Next::Nothing => {}
                Next::Probe => {
                    runtime::spawn(probe(self.clone()));
                }
                Next::Rebuild => {
                    runtime::spawn(rebuild(self.inner.clone()));
                }
            }
        }
        match result {
            Ok(result) => result.map_err(|e| map_error(e, quota)),
            Err(_) => Err(Error::BackendUnavailable(format!(
                "no reply from redis within {timeout:?}"
            ))),
        }
    }

    async fn invoke(
        &self,
        quota: String,
        script: &'static Script,
        keys: Vec<String>,
        args: Vec<String>,
    ) -> Result<Vec<Value>> {
        let this = self.clone();
        runtime::run(async move {
            let mut invocation = script.prepare_invoke();
            for key in &keys {
                invocation.key(key);
            }
            for arg in &args {
                invocation.arg(arg);
            }
            this.on_link(&quota, |mut conn| async move {
                invocation.invoke_async::<Vec<Value>>(&mut conn).await
            })
            .await
        })
        .await
    }
}

/// One `PING` after a round of call timeouts: an answer clears the connection, silence counts
/// one more round (see `link.rs`). Boxed: it is a call, and a call may start a probe.
fn probe(backend: RedisBackend) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let _ = backend.call_raw(redis::cmd("PING")).await;
    })
}

fn no_connection_within(timeout: Duration) -> Error {
    Error::BackendUnavailable(format!("no connection within {timeout:?}"))
}

/// The settings of every connection of a backend: the first and its replacements.
async fn new_manager(
    client: &redis::Client,
    options: &RedisOptions,
    push_tx: &mpsc::UnboundedSender<PushInfo>,
) -> Result<ConnectionManager> {
    let timeout = options.call_timeout;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(options.connect_timeout))
        .set_response_timeout(Some(options.call_timeout))
        .set_push_sender(push_tx.clone())
        .set_automatic_resubscription();
    tokio::time::timeout(
        timeout,
        ConnectionManager::new_with_config(client.clone(), config),
    )
    .await
    .map_err(|_| no_connection_within(timeout))?
    .map_err(|e| map_error(e, ""))
}

/// Replaces a connection that stopped answering (see `link.rs`): connects anew, swaps the new
/// connection in for every later call, and subscribes it to every quota channel the old one
/// carried.
///
/// The old connection is only let go, not closed: each call under way on it holds its own
/// handle and ends as it would have (its reply, or its call timeout), after which the connection
/// closes. So a rebuild loses no reply that would have come in time. A request the wedge let
/// through whose reply never comes is the ambiguous outcome of any call timeout, handled as
/// before: an acquire that admitted the task returns `BackendUnavailable`, no handle adopts the
/// lease, nobody renews it, and Redis reaps it one ttl later; a retry of the same task id
/// meanwhile comes back `held` and takes it over (PROTOCOL.md §6, duty 7). The orphan cleanup of
/// `Quota::acquire_timeout` is for replies that do arrive after the caller gave up, and is not
/// involved.
///
/// Boxed: its resubscription is a call, and a call may start a rebuild.
fn rebuild(inner: Arc<Inner>) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let rounds = inner.link.rounds();
        tracing::warn!(
            rounds,
            call_timeout = ?inner.options.call_timeout,
            "redis connection not answering: replacing it"
        );
        let conn = match new_manager(&inner.client, &inner.options, &inner.push_tx).await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "no replacement redis connection; retrying later");
                inner.link.rebuild_failed();
                return;
            }
        };
        // Calls move to the new connection at once; the subscriptions follow under the subscribe
        // lock, so a subscribe either finished before (its channel is resubscribed here) or runs
        // after, on the new connection.
        inner.link.swap(conn);
        let _one_at_a_time = inner.subscribing.lock().await;
        let names: Vec<String> = inner.channels().keys().cloned().collect();
        if names.is_empty() {
            tracing::info!("redis connection replaced");
            return;
        }
        let backend = RedisBackend {
            inner: inner.clone(),
        };
        let subscribed = backend
            .on_link("", |mut conn| async move { conn.subscribe(&names).await })
            .await;
        match subscribed {
            // Each confirmation arrives as a push, which `dispatch_pushes` turns into
            // `QuotaEvent::Resubscribed`: waiters re-check what the wedge kept from them.
            Ok(()) => tracing::info!("redis connection replaced and resubscribed"),
            Err(e) => {
                // Closing every quota's event channel ends its listener, and the quota subscribes
                // again at its next acquire or waiter round; meanwhile waiting runs on timers and
                // polls, as without events.
                tracing::warn!(error = %e, "redis connection replaced, resubscribing failed");
                inner.channels().clear();
            }
        }
    })
}

/// How often a backend with subscriptions and nothing else to say pings its connection.
const KEEP_ALIVE: Duration = Duration::from_secs(1);

/// Pings the connection when a second went by without an answered call while some quota
/// listens, until the backend is dropped.
///
/// After a disconnection redis-rs retries a few times (about 6 s), then reconnects only when a
/// call is sent. A process that only holds local leases sends none, and its subscription, the
/// only way such a lease hears of a cancel, would stay dead with Redis back. Unlimited retries
/// inside redis-rs would instead outlive a dropped backend for as long as Redis stays away. A
/// busy connection needs no ping: its own calls reconnect it.
async fn keep_subscriptions_alive(inner: Weak<Inner>) {
    loop {
        tokio::time::sleep(KEEP_ALIVE).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let recently = Instant::now().checked_sub(KEEP_ALIVE);
        if inner.channels().is_empty() || recently.is_some_and(|at| inner.link.answered_since(at)) {
            continue;
        }
        let backend = RedisBackend { inner };
        let _ = backend.call_raw(redis::cmd("PING")).await;
    }
}

/// Routes RESP3 push messages to the quota whose channel they came from.
async fn dispatch_pushes(inner: Weak<Inner>, mut pushes: mpsc::UnboundedReceiver<PushInfo>) {
    while let Some(push) = pushes.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        let channel = match push.data.first() {
            Some(Value::BulkString(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
            _ => continue,
        };
        let event = match push.kind {
            PushKind::Message => match push.data.get(1) {
                Some(Value::BulkString(payload)) => {
                    match super::parse_event(&String::from_utf8_lossy(payload)) {
                        Some(event) => event,
                        None => continue,
                    }
                }
                _ => continue,
            },
            PushKind::Subscribe => QuotaEvent::Resubscribed,
            _ => continue,
        };
        let channels = inner.channels();
        if let Some(sender) = channels.get(&channel) {
            let _ = sender.send(event);
        }
    }
}

/// The client socket's settings. Keepalive probes and a user timeout (data unacknowledged for a
/// few call timeouts) make a connection to a host that vanished (no RST: a power loss, a NAT or
/// firewall that forgot the flow) fail, so redis-rs replaces it, instead of every call timing
/// out until the kernel gives up (about 15 minutes).
///
/// Nagle's algorithm stays on (redis-rs's default): calls of many tasks share one pipelined
/// connection, and `TCP_NODELAY` turned each into its own packet. Measured with the throughput
/// benchmark at 64 tasks: the INCR/DECR floor fell from 66.7 k to 40.6 k cycles/s and leasehold
/// from 33.3 k to 25.4 k.
fn tcp_settings(call_timeout: Duration) -> redis::io::tcp::TcpSettings {
    use redis::io::tcp::{socket2::TcpKeepalive, TcpSettings};
    let dead_after = (call_timeout * 3).max(Duration::from_secs(3));
    let keepalive = TcpKeepalive::new()
        .with_time(Duration::from_secs(5))
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    TcpSettings::default()
        .set_keepalive(keepalive)
        .set_user_timeout(dead_after)
}

/// Error codes with which a healthy server refuses for a while: a replica after a failover
/// (`READONLY`, `MASTERDOWN`), too few replicas for `min-replicas-to-write` (`NOREPLICAS`), memory
/// full under `noeviction` (`OOM`), a dataset still loading (`LOADING`), another script running
/// too long (`BUSY`), a cluster reconfiguring.
const SERVER_BUSY_CODES: &[&str] = &[
    "READONLY",
    "MASTERDOWN",
    "NOREPLICAS",
    "OOM",
    "LOADING",
    "BUSY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    // Persistence failing (a full or read-only disk): writes are refused until a save succeeds.
    "MISCONF",
];

/// Maps a redis-rs error to the operator's categories.
fn map_error(e: RedisError, quota: &str) -> Error {
    let text = e.to_string();
    let code = e.code().unwrap_or("");
    if code == "WRONGTYPE" || text.contains("WRONGTYPE") {
        return Misconfiguration::WrongType {
            quota: quota.to_owned(),
            detail: text,
        }
        .into();
    }
    if code == "NOPERM" || text.contains("NOPERM") {
        return Misconfiguration::NoPermission(text).into();
    }
    if matches!(code, "NOAUTH" | "WRONGPASS")
        || text.contains("WRONGPASS")
        || text.contains("NOAUTH")
        || e.kind() == ErrorKind::AuthenticationFailed
    {
        // Redis words a missing password in protocol terms (HELLO AUTH); say where it goes.
        if text.contains("NOAUTH") {
            return Misconfiguration::Auth(format!(
                "the server requires a password: give it in the URL, \
                 redis://:PASSWORD@host:port/ or redis://USER:PASSWORD@host:port/ ({text})"
            ))
            .into();
        }
        return Misconfiguration::Auth(text).into();
    }
    if SERVER_BUSY_CODES.contains(&code) {
        // Checked before the script case: Redis reports these with the script's name when a
        // command inside it was refused, and they pass (a promotion, freed memory, a load done).
        return Error::BackendUnavailable(format!("the server refuses for now ({code}): {text}"));
    }
    if text.contains("user_script") {
        // A script failed on data it did not expect (a key rewritten from outside): retrying
        // cannot help, and it is no reason to open the circuit.
        return Misconfiguration::Protocol(text).into();
    }
    if text.contains("invalid peer certificate") || text.contains("certificate verify failed") {
        return Misconfiguration::Tls(text).into();
    }
    if text.contains("DB index is out of range") || text.contains("refused to switch database") {
        // The URL's database number does not exist on this server: no retry can help.
        return Misconfiguration::InvalidUrl(text).into();
    }
    match e.kind() {
        ErrorKind::InvalidClientConfig => Misconfiguration::InvalidUrl(text).into(),
        // A broken byte stream, e.g. a reply cut short by a connection closed mid-frame: the
        // outcome of the call is unknown, as after a timeout, and redis-rs reconnects.
        ErrorKind::Parse => Error::BackendUnavailable(format!("connection broken: {text}")),
        ErrorKind::UnexpectedReturnType => Misconfiguration::Protocol(text).into(),
        ErrorKind::Server(
            ServerErrorKind::CrossSlot | ServerErrorKind::Moved | ServerErrorKind::Ask,
        ) => Misconfiguration::Protocol(format!(
            "{text} (a Redis Cluster node: leasehold v1 needs a standalone server)"
        ))
        .into(),
        _ => Error::BackendUnavailable(text),
    }
}

fn int(v: Option<&Value>) -> Result<u64> {
    match v {
        Some(Value::Int(i)) if *i >= 0 => Ok(*i as u64),
        other => {
            Err(Misconfiguration::Protocol(format!("expected an integer, got {other:?}")).into())
        }
    }
}

fn text(v: Option<&Value>) -> Result<String> {
    match v {
        Some(Value::BulkString(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
        Some(Value::SimpleString(s)) => Ok(s.clone()),
        other => {
            Err(Misconfiguration::Protocol(format!("expected a string, got {other:?}")).into())
        }
    }
}

/// A stored limit from the two values `limit, version` a script replies.
fn versioned_limit(values: &[Value]) -> Result<VersionedLimit> {
    let limit = int(values.first())?;
    Ok(VersionedLimit {
        limit: u32::try_from(limit).map_err(|_| {
            Misconfiguration::Protocol(format!("a limit out of range was replied: {limit}"))
        })?,
        version: int(values.get(1))?,
    })
}

/// A lease from the four values `token, acquired_ms, deadline_ms` (after the code) of an acquire
/// answer, in the reply's epoch.
fn lease_record(
    task_id: String,
    answer: &[Value],
    now_ms: u64,
    epoch: &str,
) -> Result<LeaseRecord> {
    Ok(LeaseRecord {
        task_id,
        token: int(answer.get(1))?,
        acquired_at_ms: int(answer.get(2))?,
        deadline_ms: int(answer.get(3))?,
        now_ms,
        epoch: epoch.to_owned(),
    })
}

/// The latest epoch of a quota a reply reported, and the highest `seq` (the count of acquire and
/// renew calls that changed a lease in that epoch) any reply reported in it.
#[derive(Debug, Clone, Default)]
struct SeenEpoch {
    id: String,
    seq: u64,
    /// The highest fencing token of the quota an acquire reply gave, in any epoch: a new epoch
    /// keeps it, since tokens issued after a loss must exceed it. (Not the tokens a renewal
    /// sends: `Backend::renew` is public, and a wrong token must not raise the fence.)
    highest_token: u64,
}

/// What a reply's epoch told about the one tracked.
#[derive(Debug, PartialEq, Eq)]
enum Observed {
    /// The tracked epoch; its seq is kept at the highest seen.
    Same,
    /// A later epoch than `after` (empty when none was tracked) is now tracked.
    NewEpoch { after: String },
    /// An earlier epoch: a reply that was overtaken by one from after a loss. Ignored, so the
    /// next call does not report an epoch the server already replaced.
    Earlier,
}

impl SeenEpoch {
    /// Takes in the epoch `id` and `seq` of a reply. Epoch ids only grow (PROTOCOL.md §3), so an
    /// earlier one is a late reply and never tracked.
    fn observe(&mut self, id: &str, seq: u64) -> Observed {
        if self.id == id {
            self.seq = self.seq.max(seq);
            return Observed::Same;
        }
        if let (Some(tracked), Some(new)) = (epoch_stamp(&self.id), epoch_stamp(id)) {
            if new < tracked {
                return Observed::Earlier;
            }
        }
        let after = std::mem::replace(&mut self.id, id.to_owned());
        self.seq = seq;
        Observed::NewEpoch { after }
    }
}

/// `<seconds>.<microseconds>` of an epoch id, in order; `None` for an id of another form (those
/// are never compared).
fn epoch_stamp(id: &str) -> Option<(u64, u64)> {
    let (seconds, micros) = id.split_once('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(seconds) || !digits(micros) {
        return None;
    }
    Some((seconds.parse().ok()?, micros.parse().ok()?))
}

impl RedisBackend {
    /// The latest epoch of `quota` any reply reported (`''` before any), with its seq.
    fn seen_epoch(&self, quota: &str) -> SeenEpoch {
        let epochs = self.inner.epochs.lock().unwrap_or_else(|e| e.into_inner());
        epochs.get(quota).cloned().unwrap_or_default()
    }

    /// What a renewal of leases confirmed in `epoch` sends of `quota`: the highest seq seen in
    /// that epoch (0 if it is not the latest), and the highest token seen.
    fn seen_for_renewal(&self, quota: &str, epoch: &str) -> (u64, u64) {
        let epochs = self.inner.epochs.lock().unwrap_or_else(|e| e.into_inner());
        epochs.get(quota).map_or((0, 0), |seen| {
            let seq = if seen.id == epoch { seen.seq } else { 0 };
            (seq, seen.highest_token)
        })
    }

    /// Records the epoch and seq a reply reported, and the highest fencing token it gave (0
    /// for none: renewals give none).
    fn saw_reply(&self, quota: &str, epoch: &str, seq: u64, highest_token: u64) {
        let mut epochs = self.inner.epochs.lock().unwrap_or_else(|e| e.into_inner());
        let known = epochs.entry(quota.to_owned()).or_default();
        known.highest_token = known.highest_token.max(highest_token);
        match known.observe(epoch, seq) {
            Observed::NewEpoch { after } if !after.is_empty() => tracing::warn!(
                quota,
                epoch,
                "the quota's state was lost, all or in part (new epoch)"
            ),
            _ => {}
        }
    }

    /// One renew call for at most [`RENEW_BATCH`] leases, sent with the epoch `epoch`.
    async fn renew_batch(
        &self,
        keys: &QuotaKeys,
        ttl: Duration,
        epoch: &str,
        leases: &[(String, u64)],
    ) -> Result<RenewReply> {
        let mut args = Vec::with_capacity(4 + 2 * leases.len());
        args.push(ttl.as_millis().to_string());
        args.push(epoch.to_owned());
        let (seq, highest_token) = self.seen_for_renewal(&keys.name, epoch);
        args.push(seq.to_string());
        args.push(highest_token.to_string());
        for (id, token) in leases {
            args.push(id.clone());
            args.push(token.to_string());
        }
        let mut renew_keys = vec![
            keys.leases.clone(),
            keys.holders.clone(),
            keys.fence.clone(),
            keys.epoch.clone(),
            keys.quarantine.clone(),
            keys.limit.clone(),
        ];
        renew_keys.extend(leases.iter().map(|(id, _)| keys.cancel(id)));
        let reply = self
            .invoke(keys.name.clone(), &RENEW, renew_keys, args)
            .await?;
        if reply.len() != 3 + 2 * leases.len() {
            return Err(Misconfiguration::Protocol(format!(
                "renew replied {} values for {} leases",
                reply.len(),
                leases.len()
            ))
            .into());
        }
        let outcomes = reply[3..]
            .chunks(2)
            .map(|pair| match int(pair.first())? {
                1 => Ok(RenewOutcome::Renewed {
                    deadline_ms: int(pair.get(1))?,
                }),
                2 => Ok(RenewOutcome::Superseded),
                3 => Ok(RenewOutcome::Cancelled {
                    reason: text(pair.get(1))?,
                }),
                _ => Ok(RenewOutcome::Gone),
            })
            .collect::<Result<Vec<_>>>()?;
        let epoch = text(reply.get(1))?;
        self.saw_reply(&keys.name, &epoch, int(reply.get(2))?, 0);
        Ok(RenewReply { epoch, outcomes })
    }
}

impl RedisBackend {
    /// One acquire call for `ids`, served in order; one answer per id.
    async fn acquire_batch(
        &self,
        keys: &QuotaKeys,
        ttl: Duration,
        limit: VersionedLimit,
        ids: Vec<String>,
    ) -> Result<Vec<AcquireReply>> {
        let mut script_keys = Vec::with_capacity(7 + ids.len());
        script_keys.extend([
            keys.leases.clone(),
            keys.holders.clone(),
            keys.fence.clone(),
            keys.epoch.clone(),
            keys.quarantine.clone(),
            keys.waiting.clone(),
            keys.limit.clone(),
        ]);
        script_keys.extend(ids.iter().map(|id| keys.cancel(id)));
        let seen = self.seen_epoch(&keys.name);
        let mut args = Vec::with_capacity(6 + ids.len());
        args.extend([
            ttl.as_millis().to_string(),
            limit.limit.to_string(),
            seen.id,
            limit.version.to_string(),
            seen.seq.to_string(),
            seen.highest_token.to_string(),
        ]);
        args.extend(ids.iter().cloned());
        let reply = self
            .invoke(keys.name.clone(), &ACQUIRE, script_keys, args)
            .await?;
        if reply.len() != 3 + 4 * ids.len() {
            return Err(Misconfiguration::Protocol(format!(
                "acquire replied {} values for {} task ids",
                reply.len(),
                ids.len()
            ))
            .into());
        }
        let now_ms = int(reply.get(1))?;
        let epoch = text(reply.first())?;
        let seq = int(reply.get(2))?;
        let answers = ids
            .into_iter()
            .zip(reply[3..].chunks(4))
            .map(|(id, answer)| match int(answer.first())? {
                1 => Ok(AcquireReply::Acquired(lease_record(
                    id, answer, now_ms, &epoch,
                )?)),
                2 => Ok(AcquireReply::Held(lease_record(
                    id, answer, now_ms, &epoch,
                )?)),
                3 => Ok(AcquireReply::Cancelled {
                    reason: text(answer.get(1))?,
                }),
                4 => Ok(AcquireReply::Quarantined {
                    remaining_ms: int(answer.get(1))?,
                }),
                0 => Ok(AcquireReply::Full {
                    earliest_deadline_ms: int(answer.get(1))?,
                    now_ms,
                }),
                5 => Ok(AcquireReply::LimitMismatch {
                    stored: versioned_limit(&answer[1..])?,
                }),
                other => Err(Misconfiguration::Protocol(format!("acquire replied {other}")).into()),
            })
            .collect::<Result<Vec<_>>>();
        // One look at the per-name state per call: this is the admission path.
        let highest_token = answers.as_ref().map_or(0, |answers| {
            answers
                .iter()
                .filter_map(|answer| match answer {
                    AcquireReply::Acquired(lease) | AcquireReply::Held(lease) => Some(lease.token),
                    _ => None,
                })
                .max()
                .unwrap_or(0)
        });
        self.saw_reply(&keys.name, &epoch, seq, highest_token);
        answers
    }

    /// One release call for `leases` (task id, token or `*`); whether each was removed.
    async fn release_batch(
        &self,
        keys: &QuotaKeys,
        leases: Vec<(String, String)>,
    ) -> Result<Vec<bool>> {
        let mut args = Vec::with_capacity(1 + 2 * leases.len());
        args.push(self.inner.channel(keys));
        for (id, token) in &leases {
            args.push(id.clone());
            args.push(token.clone());
        }
        let reply = self
            .invoke(
                keys.name.clone(),
                &RELEASE,
                vec![
                    keys.leases.clone(),
                    keys.holders.clone(),
                    keys.waiting.clone(),
                ],
                args,
            )
            .await?;
        if reply.len() != leases.len() {
            return Err(Misconfiguration::Protocol(format!(
                "release replied {} values for {} leases",
                reply.len(),
                leases.len()
            ))
            .into());
        }
        reply.iter().map(|v| Ok(int(Some(v))? == 1)).collect()
    }
}

#[async_trait]
impl Backend for RedisBackend {
    fn identity(&self) -> usize {
        // Clones share `inner`: one connection, one set of batches.
        Arc::as_ptr(&self.inner).cast::<()>() as usize
    }

    async fn acquire_with_limit(
        &self,
        keys: &QuotaKeys,
        task_id: &str,
        ttl: Duration,
        limit: VersionedLimit,
    ) -> Result<AcquireReply> {
        let queue = {
            let mut acquires = self
                .inner
                .acquires
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let by_settings = match acquires.get_mut(keys.name.as_str()) {
                Some(found) => found,
                None => acquires.entry(keys.name.clone()).or_default(),
            };
            by_settings
                .entry((ttl.as_millis(), limit))
                .or_insert_with(|| {
                    Arc::new(Queue {
                        keys: Arc::new(keys.clone()),
                        batcher: Arc::new(Batcher::new(CALL_BATCH)),
                    })
                })
                .clone()
        };
        let (this, batch_keys) = (self.clone(), queue.keys.clone());
        queue
            .batcher
            .submit(task_id.to_owned(), move |ids| {
                let (this, keys) = (this.clone(), batch_keys.clone());
                async move { this.acquire_batch(&keys, ttl, limit, ids).await }
            })
            .await
    }

    async fn renew(
        &self,
        keys: &QuotaKeys,
        ttl: Duration,
        epoch: &str,
        leases: &[(String, u64)],
    ) -> Result<RenewReply> {
        // Every batch carries the caller's epoch, the one its leases were confirmed in: a first
        // batch that learns of a loss must not keep the later ones from re-registering.
        let mut renewed = RenewReply {
            epoch: epoch.to_owned(),
            outcomes: Vec::with_capacity(leases.len()),
        };
        for batch in leases.chunks(RENEW_BATCH) {
            let reply = self.renew_batch(keys, ttl, epoch, batch).await?;
            renewed.epoch = reply.epoch;
            renewed.outcomes.extend(reply.outcomes);
        }
        Ok(renewed)
    }

    async fn set_limit(
        &self,
        keys: &QuotaKeys,
        limit: u32,
        version: Option<u64>,
    ) -> Result<LimitUpdate> {
        let version = version.map(|v| v.to_string()).unwrap_or_default();
        let reply = self
            .invoke(
                keys.name.clone(),
                &SET_LIMIT,
                vec![keys.limit.clone()],
                vec![limit.to_string(), version],
            )
            .await?;
        let limit = versioned_limit(reply.get(1..).unwrap_or_default())?;
        match int(reply.first())? {
            1 => Ok(LimitUpdate::Stored(limit)),
            0 => Ok(LimitUpdate::Kept(limit)),
            5 => Ok(LimitUpdate::Mismatch(limit)),
            other => Err(Misconfiguration::Protocol(format!("set_limit replied {other}")).into()),
        }
    }

    async fn release(&self, keys: &QuotaKeys, task_id: &str, token: Option<u64>) -> Result<bool> {
        let token = token.map_or_else(|| "*".to_owned(), |t| t.to_string());
        let queue = {
            let mut releases = self
                .inner
                .releases
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            match releases.get(keys.name.as_str()) {
                Some(found) => found.clone(),
                None => releases
                    .entry(keys.name.clone())
                    .or_insert_with(|| {
                        Arc::new(Queue {
                            keys: Arc::new(keys.clone()),
                            batcher: Arc::new(Batcher::new(CALL_BATCH)),
                        })
                    })
                    .clone(),
            }
        };
        let (this, batch_keys) = (self.clone(), queue.keys.clone());
        queue
            .batcher
            .submit((task_id.to_owned(), token), move |leases| {
                let (this, keys) = (this.clone(), batch_keys.clone());
                async move { this.release_batch(&keys, leases).await }
            })
            .await
    }

    async fn cancel(
        &self,
        keys: &QuotaKeys,
        task_id: &str,
        reason: &str,
        marker_ttl: Duration,
    ) -> Result<bool> {
        let reply = self
            .invoke(
                keys.name.clone(),
                &CANCEL,
                vec![keys.leases.clone(), keys.cancel(task_id)],
                vec![
                    task_id.to_owned(),
                    reason.to_owned(),
                    marker_ttl.as_millis().max(1).to_string(),
                    self.inner.channel(keys),
                ],
            )
            .await?;
        Ok(int(reply.first())? == 1)
    }

    async fn cancel_reason(&self, keys: &QuotaKeys, task_id: &str) -> Result<Option<String>> {
        let key = keys.cancel(task_id);
        self.on_link(&keys.name, |mut conn| async move {
            redis::cmd("GET")
                .arg(key)
                .query_async::<Option<String>>(&mut conn)
                .await
        })
        .await
    }

    async fn snapshot(&self, keys: &QuotaKeys) -> Result<Snapshot> {
        let reply = self
            .invoke(
                keys.name.clone(),
                &SNAPSHOT,
                vec![
                    keys.leases.clone(),
                    keys.holders.clone(),
                    keys.limit.clone(),
                    keys.quarantine.clone(),
                ],
                vec![],
            )
            .await?;
        let now_ms = int(reply.first())?;
        if reply.len() < 4 || (reply.len() - 4) % 4 != 0 {
            return Err(Misconfiguration::Protocol(format!(
                "snapshot replied {} values",
                reply.len()
            ))
            .into());
        }
        let limit = match int(reply.get(1))? {
            0 => None,
            _ => Some(versioned_limit(&reply[1..])?),
        };
        let quarantine_left_ms = int(reply.get(3))?;
        let holders = reply[4..]
            .chunks(4)
            .map(|c| {
                Ok(LeaseRecord {
                    task_id: text(c.first())?,
                    token: int(c.get(1))?,
                    acquired_at_ms: int(c.get(2))?,
                    deadline_ms: int(c.get(3))?,
                    now_ms,
                    epoch: String::new(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Snapshot {
            now_ms,
            holders,
            limit,
            quarantine_left_ms,
        })
    }

    fn forget(&self, keys: &QuotaKeys) {
        self.inner.forget_quota(&keys.name);
    }

    async fn subscribe(&self, keys: &QuotaKeys) -> Result<broadcast::Receiver<QuotaEvent>> {
        let this = self.clone();
        let channel = self.inner.channel(keys);
        // One subscribe at a time, each run to its end on leasehold's runtime whoever stops
        // waiting: a caller that finds the channel's sender knows its SUBSCRIBE was confirmed,
        // since a failed one removes the sender before the next caller looks. (Handing out a
        // receiver while the first SUBSCRIBE was still in flight let its failure close that
        // receiver under a caller told it was subscribed.)
        runtime::finish(async move {
            let _one_at_a_time = this.inner.subscribing.lock().await;
            if let Some(sender) = this.inner.channels().get(&channel) {
                return Ok(sender.subscribe());
            }
            // Channels nobody listens to any more (every handle of their quota was dropped) are
            // let go now, so per-tenant quotas that come and go do not pile up subscriptions
            // (and resubscriptions after each reconnect) for the backend's whole life.
            let unheard: Vec<String> = {
                let mut channels = this.inner.channels();
                let unheard: Vec<String> = channels
                    .iter()
                    .filter(|(_, sender)| sender.receiver_count() == 0)
                    .map(|(name, _)| name.clone())
                    .collect();
                for name in &unheard {
                    channels.remove(name);
                }
                unheard
            };
            // Only the subscription goes: a handle of the quota may still live without listening
            // (events off, or not waiting yet), and keeps its per-name state. That state goes
            // with the quota's last handle (`Backend::forget`).
            if !unheard.is_empty() {
                // Best effort: a failure leaves them subscribed, and their messages unrouted.
                let _ = this
                    .on_link(
                        "",
                        |mut conn| async move { conn.unsubscribe(&unheard).await },
                    )
                    .await;
            }
            // In place before the SUBSCRIBE, so the first messages after it find their way.
            let (sender, receiver) = broadcast::channel(EVENT_CAPACITY);
            this.inner.channels().insert(channel.clone(), sender);
            let name = channel.clone();
            let result = this
                .on_link("", |mut conn| async move { conn.subscribe(&name).await })
                .await;
            if let Err(e) = result {
                // Let the next caller try again.
                this.inner.channels().remove(&channel);
                return Err(e);
            }
            Ok(receiver)
        })
        .await
    }
}

#[cfg(test)]
mod forget_tests;

#[cfg(test)]
mod tests {
    use super::{epoch_stamp, Observed, SeenEpoch};

    #[test]
    fn a_late_reply_from_an_earlier_epoch_does_not_move_the_tracked_one_back() {
        let mut seen = SeenEpoch::default();
        assert_eq!(
            seen.observe("1796225334.152102", 7),
            Observed::NewEpoch {
                after: String::new()
            }
        );
        assert_eq!(seen.observe("1796225334.152102", 5), Observed::Same);
        assert_eq!(seen.seq, 7, "the highest seq is kept");
        // A loss: the next reply reports a later epoch, seq counted again from there.
        assert_eq!(
            seen.observe("1796225340.9", 1),
            Observed::NewEpoch {
                after: "1796225334.152102".into()
            }
        );
        // A reply sent before the loss arrives last: ignored.
        assert_eq!(seen.observe("1796225334.152102", 9), Observed::Earlier);
        assert_eq!((seen.id.as_str(), seen.seq), ("1796225340.9", 1));
    }

    #[test]
    fn epoch_ids_compare_by_time_not_as_text() {
        // Microseconds are not zero-padded: 9 µs is earlier than 152102 µs.
        assert!(epoch_stamp("1796225334.9") < epoch_stamp("1796225334.152102"));
        assert!(epoch_stamp("1796225335.0") > epoch_stamp("1796225334.999999"));
        assert_eq!(epoch_stamp("not-an-epoch"), None);
        assert_eq!(epoch_stamp("1.-2"), None);
        // Ids of another form are tracked as they come.
        let mut seen = SeenEpoch::default();
        seen.observe("1796225334.9", 1);
        assert_eq!(
            seen.observe("restored", 1),
            Observed::NewEpoch {
                after: "1796225334.9".into()
            }
        );
    }
}
