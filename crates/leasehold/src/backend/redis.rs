//! The Redis backend: protocol v1 (docs/PROTOCOL.md) over one multiplexed RESP3 connection.
//!
//! One `ConnectionManager` per backend carries every command and the Pub/Sub subscriptions
//! (RESP3 push), reconnects by itself (two attempts per disconnection, then two per call that
//! finds it down: `new_manager` in `connection.rs`) and resubscribes after a reconnect, which is
//! checked (`resubscription`): redis-rs ignores a refused resubscription. All I/O
//! runs on the leasehold runtime (see `runtime.rs`), and every call has its own timeout (a
//! connection attempt to a host that does not answer lasts up to the connect timeout). A
//! connection whose handshake is refused is rebuilt, spaced (`Link::handshake_failed`). A
//! connection that stops answering without breaking (wedged above TCP) is replaced by the
//! backend itself after a few rounds of call timeouts (`link.rs`, `rebuild` in `connection.rs`).
//!
//! The modules below: `calls` builds the batched script calls and reads their replies
//! (`replies`), `epochs` tracks the quota epochs replies report, `errors` sorts Redis errors into
//! transient and misconfiguration, `connection` builds, replaces and watches the connection,
//! `resubscription` finds the channels redis-rs failed to subscribe again after a reconnect.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use redis::{ErrorKind, IntoConnectionInfo, ProtocolVersion, PushInfo, Script, Value};
use tokio::sync::{broadcast, mpsc};

mod calls;
mod connection;
mod epochs;
mod errors;
mod link;
mod replies;
mod resubscription;

use self::connection::{
    dispatch_pushes, keep_subscriptions_alive, new_lazy_manager, new_manager, no_connection_within,
    probe, rebuild, tcp_settings, PushSink,
};
use self::epochs::SeenEpoch;
use self::errors::{map_error, one_line, refused_at_handshake};
use self::link::{Link, Next};
use self::replies::{int, text, versioned_limit};
use self::resubscription::Resubscriptions;
use super::batch::Batcher;
use super::redacted_url::redacted;
use super::{
    AcquireReply, Backend, LeaseRecord, LimitUpdate, QuotaEvent, RenewReply, Snapshot,
    VersionedLimit, RENEW_BATCH,
};
use crate::error::{Error, Misconfiguration, Result, Unavailable};
use crate::keys::QuotaKeys;
use crate::runtime;

/// A script that uses the functions of `common.lua`, which is sent before it in one body: a
/// script cannot call another (PROTOCOL.md §5).
macro_rules! after_common {
    ($file:literal) => {
        concat!(include_str!("../scripts/common.lua"), include_str!($file))
    };
}

static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(after_common!("../scripts/acquire.lua")));
static RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(after_common!("../scripts/renew.lua")));
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/release.lua")));
static CANCEL: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/cancel.lua")));
static SNAPSHOT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/snapshot.lua")));
static SET_LIMIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(after_common!("../scripts/set_limit.lua")));

/// Capacity of each quota's event channel; a slow receiver loses old events (at most once).
const EVENT_CAPACITY: usize = 1024;

/// Options of a [`RedisBackend`].
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Bound on every single Redis call, connection set-up included. Default 1 s; from 1 ms to
    /// [`MAX_TTL`](crate::MAX_TTL).
    pub call_timeout: Duration,
    /// Bound on one attempt to open a TCP/TLS connection. Default 1 s; from 1 ms to
    /// [`MAX_TTL`](crate::MAX_TTL).
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
    pushes: PushSink,
    options: RedisOptions,
    /// Channel name -> sender of that quota's events, once its SUBSCRIBE is confirmed.
    channels: Mutex<HashMap<String, broadcast::Sender<QuotaEvent>>>,
    /// The channels a disconnection dropped, until redis-rs's resubscription is confirmed.
    resubscriptions: Mutex<Resubscriptions>,
    /// The database number of the URL. Pub/Sub ignores databases, so quotas of one name in two
    /// databases of one server announce on channels of their own (PROTOCOL.md §3).
    db: i64,
    /// Held by the subscribe in progress, and by a rebuild while it resubscribes.
    subscribing: tokio::sync::Mutex<()>,
    /// Channels let go whose UNSUBSCRIBE got no answer (the link was down): redis-rs still
    /// subscribes them again at each reconnect, so they are asked again until one is answered.
    /// Changed under `subscribing`.
    unsubscribes_owed: Mutex<BTreeSet<String>>,
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

    fn unsubscribes_owed(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.unsubscribes_owed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn resubscriptions(&self) -> std::sync::MutexGuard<'_, Resubscriptions> {
        self.resubscriptions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
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
    /// default options. A URL that names a user without a password (`redis://worker@host/`)
    /// authenticates as that user with an empty password, which a `nopass` ACL user accepts.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, RedisOptions::default()).await
    }

    /// Connects to `url` with `options`. Fails with [`Error::BackendUnavailable`] when the server
    /// cannot be reached within the call timeout, and with [`Error::Misconfigured`] when the URL
    /// or the credentials are wrong.
    ///
    /// The server must answer once, here: a quota's
    /// [`BackendDownPolicy`](crate::BackendDownPolicy) applies to the calls of a built quota,
    /// not to this one. A worker that must start (and admit by `FailOpen` or `DegradeLocal`)
    /// while Redis is down connects with [`connect_lazy`](Self::connect_lazy) instead. Once
    /// connected, the backend reconnects by itself.
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<Self> {
        let (client, db) = client_for(url, &options)?;
        let timeout = options.call_timeout;
        runtime::run(async move {
            // One plain connection first, to tell what answers the handshake (a wrong password,
            // something else than Redis) before the manager is built.
            tokio::time::timeout(timeout, client.get_multiplexed_async_connection())
                .await
                .map_err(|_| no_connection_within(timeout))?
                .map_err(|e| match e.kind() {
                    // Garbage in answer to the handshake: something else listens there.
                    ErrorKind::Parse => Misconfiguration::Protocol(format!(
                        "the server does not answer like Redis: {}",
                        one_line(&e.to_string())
                    ))
                    .into(),
                    _ => map_error(e, ""),
                })?;
            let (pushes, push_rx) = mpsc::unbounded_channel();
            let conn = new_manager(&client, &options, &pushes, 0).await?;
            let backend = RedisBackend::assemble(conn, client, db, options, pushes, push_rx);
            // Surface authentication and permission problems now, not at the first acquire.
            backend.call_raw(redis::cmd("PING")).await?;
            // Load the scripts of the workers' calls now (`set_limit`, an operator's, is loaded
            // at its first call): a first renewal that has to go EVALSHA, NOSCRIPT, SCRIPT LOAD,
            // EVALSHA takes three round trips, which a slow link may not fit in a ttl.
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
            // Say which server: a process may use several. Whatever the call that failed (the
            // first connection, its PING, a script load), no backend was made, so no call of
            // the caller's ran: `NoConnection` (found by review: a connect that timed out inside
            // redis-rs read as `NoReply`).
            Error::BackendUnavailable { detail: why, .. } => {
                // A server without TLS never answers a TLS handshake: the client times out,
                // which looks like any unreachable server.
                let hint = match url.starts_with("rediss://") {
                    true => " (if the server does not speak TLS, use redis://)",
                    false => "",
                };
                Error::unavailable(
                    Unavailable::NoConnection,
                    format!("{}: {why}{hint}", redacted(url)),
                )
            }
            other => other,
        })
    }

    /// Like [`connect_with`](Self::connect_with), without waiting for the server: checks the
    /// URL and options, and returns at once. The connection is made by the first call, and made
    /// again by later ones while the server cannot be reached; until then each call fails as
    /// Redis being down does ([`Error::BackendUnavailable`], then the quotas' short-circuit),
    /// so a quota's [`BackendDownPolicy`](crate::BackendDownPolicy) answers. For a worker that
    /// must start, and admit by `FailOpen` or `DegradeLocal`, while Redis is down.
    ///
    /// What `connect_with` reports at once comes with the first calls instead: refused
    /// credentials as [`Error::Misconfigured`], something other than Redis listening (or a
    /// `rediss://` URL to a server without TLS) as [`Error::BackendUnavailable`], like Redis
    /// being down. The scripts are loaded by the first call of each (one more round trip).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> leasehold::Result<()> {
    /// use leasehold::{BackendDownPolicy, Quota, RedisBackend};
    ///
    /// // Nothing listens on this port: Redis is down as the worker starts.
    /// let backend = RedisBackend::connect_lazy("redis://127.0.0.1:1/", Default::default()).await?;
    /// let quota = Quota::builder("llm")
    ///     .limit(8)
    ///     .when_backend_down(BackendDownPolicy::DegradeLocal { share: 2 })
    ///     .backend(backend)
    ///     .build()?;
    /// let lease = quota.try_acquire("job-1").await?;
    /// assert!(lease.is_local()); // granted by the policy; Redis admits once it answers
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect_lazy(url: &str, options: RedisOptions) -> Result<Self> {
        let (client, db) = client_for(url, &options)?;
        runtime::run(async move {
            let (pushes, push_rx) = mpsc::unbounded_channel();
            let conn = new_lazy_manager(&client, &options, &pushes)?;
            Ok(RedisBackend::assemble(
                conn, client, db, options, pushes, push_rx,
            ))
        })
        .await
    }

    /// The backend around its first connection `conn`, with its background tasks started (on
    /// the leasehold runtime: call it there).
    fn assemble(
        conn: ConnectionManager,
        client: redis::Client,
        db: i64,
        options: RedisOptions,
        pushes: PushSink,
        push_rx: mpsc::UnboundedReceiver<(u64, PushInfo)>,
    ) -> RedisBackend {
        let inner = Arc::new(Inner {
            link: Link::new(conn, options.call_timeout),
            client,
            pushes,
            options,
            channels: Mutex::new(HashMap::new()),
            resubscriptions: Mutex::new(Resubscriptions::default()),
            db,
            subscribing: tokio::sync::Mutex::new(()),
            unsubscribes_owed: Mutex::new(BTreeSet::new()),
            epochs: Mutex::new(HashMap::new()),
            acquires: Mutex::new(HashMap::new()),
            releases: Mutex::new(HashMap::new()),
        });
        tokio::spawn(dispatch_pushes(Arc::downgrade(&inner), push_rx));
        tokio::spawn(keep_subscriptions_alive(Arc::downgrade(&inner)));
        RedisBackend { inner }
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
        let cmd = &cmd;
        self.on_link("", |mut conn| async move {
            cmd.query_async::<Value>(&mut conn).await
        })
        .await
    }

    /// Connections built to replace one that stopped answering or whose handshake was refused,
    /// since this backend connected (attempts that could not connect included). For tests and
    /// diagnostics.
    #[doc(hidden)]
    pub fn connection_rebuilds(&self) -> u64 {
        self.inner.link.rebuilds()
    }

    /// How many entries this backend keeps per quota name right now, for leak tests. Not part
    /// of the API.
    #[doc(hidden)]
    pub fn debug_sizes(&self) -> crate::debug::RedisSizes {
        fn len<V>(map: &Mutex<HashMap<String, V>>) -> usize {
            map.lock().unwrap_or_else(|e| e.into_inner()).len()
        }
        crate::debug::RedisSizes {
            channels: len(&self.inner.channels),
            epochs: len(&self.inner.epochs),
            acquire_queues: len(&self.inner.acquires),
            release_queues: len(&self.inner.releases),
        }
    }

    /// Unsubscribes the connection from `channels`, and from those an earlier call could not
    /// let go. A call that gets no answer leaves them owed, asked again at the next subscribe or
    /// keep-alive (found by review: a channel let go while the link was down stayed subscribed,
    /// and resubscribed at every reconnect, for the backend's whole life). Call it under the
    /// subscribe lock.
    pub(super) async fn unsubscribe_quietly(&self, channels: &[String]) {
        let asked: Vec<String> = {
            let mut owed = self.inner.unsubscribes_owed();
            owed.extend(channels.iter().cloned());
            owed.iter().cloned().collect()
        };
        if asked.is_empty() {
            return;
        }
        let list = &asked;
        let result = self
            .on_link("", |mut conn| async move { conn.unsubscribe(list).await })
            .await;
        match &result {
            Err(Error::BackendUnavailable { .. }) => {
                tracing::debug!(
                    channels = asked.len(),
                    "unsubscribe got no answer; asked again later"
                );
                return;
            }
            // An ACL without UNSUBSCRIBE: no retry can help, and subscriptions pile up for as
            // long as the process lives (the channels of every quota it ever used), which the
            // operator should hear of.
            Err(e) => tracing::warn!(
                channels = asked.len(),
                error = %e,
                "cannot unsubscribe from channels no quota listens to"
            ),
            Ok(()) => {}
        }
        let mut owed = self.inner.unsubscribes_owed();
        for name in &asked {
            owed.remove(name);
        }
    }

    /// Runs `call` on the current connection with the call timeout, mapping errors for the
    /// quota `quota`; its outcome feeds the wedge detection.
    ///
    /// A refused connection is tried once more, at once: a failed reconnection (two attempts,
    /// `new_manager`) is what every call sees until a call starts the next one, so the first
    /// refusal may be a moment old. Nothing was sent either time (a refusal comes from
    /// `connect`), so the call cannot run twice.
    async fn on_link<T, F, Fut>(&self, quota: &str, mut call: F) -> Result<T>
    where
        F: FnMut(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let timeout = self.inner.options.call_timeout;
        let started = tokio::time::Instant::now();
        let mut refused_before = false;
        let (result, ticket) = loop {
            let (conn, ticket) = self.inner.link.checkout();
            let result = tokio::time::timeout_at(started + timeout, call(conn)).await;
            match &result {
                Ok(Err(e)) if e.is_connection_refusal() && !refused_before => {
                    refused_before = true;
                }
                _ => break (result, ticket),
            }
        };
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
                    runtime::spawn(rebuild(self.inner.clone(), "not answering"));
                }
            }
        }
        let (handshake, error) = match result {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) => (refused_at_handshake(&e), map_error(e, quota)),
            Err(_) => {
                return Err(Error::unavailable(
                    Unavailable::NoReply,
                    format!("no reply from redis within {timeout:?}"),
                ))
            }
        };
        // A refusal only a handshake meets (credentials, the URL's database, HELLO) is the
        // connection's, and redis-rs reconnects only after I/O errors: without a rebuild it
        // would answer every call until the process restarts, even once the cause is gone.
        if handshake {
            if let Next::Rebuild = self.inner.link.handshake_failed(ticket) {
                runtime::spawn(rebuild(self.inner.clone(), "refused at its handshake"));
            }
        }
        match error {
            Error::Misconfigured(Misconfiguration::WrongType { quota, detail }) => {
                let detail = match self.wrong_typed_keys(&quota, started + timeout).await {
                    Some(wrong) => format!("{wrong} ({detail})"),
                    None => detail,
                };
                Err(Misconfiguration::WrongType { quota, detail }.into())
            }
            other => Err(other),
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
            let invocation = &invocation;
            this.on_link(&quota, |mut conn| async move {
                invocation.invoke_async::<Vec<Value>>(&mut conn).await
            })
            .await
        })
        .await
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
            let settings = (ttl.as_millis(), limit);
            if !by_settings.contains_key(&settings) {
                // The queues of other settings no call uses now go: handles built with a ttl
                // per job (or a limit per deploy) left one each for the process's life (found
                // by review). A caller holds its queue until answered, so none is in use here.
                by_settings.retain(|_, queue| Arc::strong_count(queue) > 1);
            }
            by_settings
                .entry(settings)
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
        for (i, batch) in leases.chunks(RENEW_BATCH).enumerate() {
            let reply = match self.renew_batch(keys, ttl, epoch, batch).await {
                Ok(reply) => reply,
                // The earlier batches ran: their leases are renewed in Redis, not confirmed here.
                Err(e) if i > 0 => return Err(e.after_a_call_ran()),
                Err(e) => return Err(e),
            };
            // One reply has one epoch: leases of an earlier batch confirmed in another one would
            // send the wrong epoch next time, and be answered gone instead of re-registering
            // (found by review). Unconfirmed, they keep their deadlines and are renewed again.
            if i > 0 && reply.epoch != renewed.epoch {
                // Both batches ran: the earlier leases are renewed in Redis, not confirmed here.
                return Err(Error::unavailable(
                    Unavailable::NoReply,
                    format!(
                        "the quota's epoch changed between renewal batches ({} then {})",
                        renewed.epoch, reply.epoch
                    ),
                ));
            }
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
        // On the leasehold runtime like every other call: a call that makes the connection (the
        // first of a lazy backend, or a reconnect) would otherwise leave its driver task on the
        // caller's runtime, where a blocked or idle application stalls every renewal (found by
        // review).
        let (this, name, key) = (self.clone(), keys.name.clone(), keys.cancel(task_id));
        runtime::run(async move {
            let key = &key;
            // Bytes, read as the acquire and renew scripts' replies are: a reason that is not
            // UTF-8 (any client may write one) failed redis-rs's conversion as a `Parse` error,
            // which reads as a broken stream: the call reported an outage and rebuilt the
            // connection, and a local lease's watcher kept the short-circuit open for as long
            // as the marker lived (found by review).
            let reason = this
                .on_link(&name, |mut conn| async move {
                    redis::cmd("GET")
                        .arg(key)
                        .query_async::<Option<Vec<u8>>>(&mut conn)
                        .await
                })
                .await?;
            Ok(reason.map(|bytes| String::from_utf8_lossy(&bytes).into_owned()))
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
            // Listened to again: no longer to be let go.
            this.inner.unsubscribes_owed().remove(&channel);
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
            this.unsubscribe_quietly(&unheard).await;
            // In place before the SUBSCRIBE, so the first messages after it find their way.
            let (sender, receiver) = broadcast::channel(EVENT_CAPACITY);
            this.inner.channels().insert(channel.clone(), sender);
            let name = &channel;
            let result = this
                .on_link("", |mut conn| async move { conn.subscribe(name).await })
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

/// The client for `url` with `options` (RESP3, the TCP settings, the TLS root), and the URL's
/// database number; no I/O.
fn client_for(url: &str, options: &RedisOptions) -> Result<(redis::Client, i64)> {
    // A zero timeout would read as an outage, and one near `Duration::MAX` overflows the
    // arithmetic on it (found by review: a panic in `connect_lazy`).
    for (what, timeout) in [
        ("call timeout", options.call_timeout),
        ("connect timeout", options.connect_timeout),
    ] {
        if timeout < Duration::from_millis(1) || timeout > crate::MAX_TTL {
            return Err(Misconfiguration::InvalidTiming(format!(
                "{what} {timeout:?} must be between 1ms and {:?}",
                crate::MAX_TTL
            ))
            .into());
        }
    }
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
    // redis-rs authenticates only when the URL has a password: `redis://worker@host/` ran as the
    // `default` user, with its rights instead of the worker's (found by review). An empty
    // password authenticates as the user named, which a `nopass` ACL user accepts and any other
    // refuses (`Misconfigured(Auth)`).
    let settings = match (settings.username(), settings.password()) {
        (Some(_), None) => settings.set_password(""),
        _ => settings,
    };
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
    Ok((client, db))
}

#[cfg(test)]
mod forget_tests;
