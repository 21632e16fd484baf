//! The connection's life: building it, replacing one that stopped answering, keeping a
//! subscribed but idle one alive, and routing its pushes to the quotas.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{PushInfo, PushKind, Value};
use tokio::sync::mpsc;

use super::errors::map_error;
use super::{Inner, RedisBackend, RedisOptions};
use crate::backend::{parse_event, QuotaEvent};
use crate::error::{Error, Result, Unavailable};

/// One `PING` after a round of call timeouts: an answer clears the connection, silence counts
/// one more round (see `link.rs`). Boxed: it is a call, and a call may start a probe.
pub(super) fn probe(
    backend: RedisBackend,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let _ = backend.call_raw(redis::cmd("PING")).await;
    })
}

pub(super) fn no_connection_within(timeout: Duration) -> Error {
    Error::unavailable(
        Unavailable::NoConnection,
        format!("no connection within {timeout:?}"),
    )
}

/// Where every connection manager of a backend sends its pushes, each tagged with the link
/// generation the manager serves (`Link::generation`): a manager replaced by a rebuild may still
/// report its own disconnections and resubscriptions, which are not the current connection's.
pub(super) type PushSink = mpsc::UnboundedSender<(u64, PushInfo)>;

/// The settings of every connection of a backend: the first and its replacements, each made
/// for the link generation `generation`.
pub(super) async fn new_manager(
    client: &redis::Client,
    options: &RedisOptions,
    pushes: &PushSink,
    generation: u64,
) -> Result<ConnectionManager> {
    let timeout = options.call_timeout;
    // Two connection attempts per reconnection, 50–100 ms apart: a call made while redis-rs
    // retries waits for all of them (6–13 s with its defaults; the call timeout cut it short,
    // as "no reply"), so a refused port cost every call its whole timeout before the
    // short-circuit opened. Now a refusal is known within about 0.1 s (`on_link` tries once
    // more when the refusal it sees is a moment old), and the next call, a renewal's retry, a
    // waiter's poll or the keep-alive ping reconnects. The second attempt is for a server that
    // is going away as the first one connects (killed, restarting): that attempt ends in a
    // reset, which no call could tell from a command cut short, so none retries it.
    tokio::time::timeout(
        timeout,
        ConnectionManager::new_with_config(
            client.clone(),
            manager_config(options, pushes, generation),
        ),
    )
    .await
    .map_err(|_| no_connection_within(timeout))?
    .map_err(|e| map_error(e, ""))
}

/// A connection with the settings of [`new_manager`], made by its first call
/// (`RedisBackend::connect_lazy`). Call it on the leasehold runtime, which runs its tasks.
pub(super) fn new_lazy_manager(
    client: &redis::Client,
    options: &RedisOptions,
    pushes: &PushSink,
) -> Result<ConnectionManager> {
    ConnectionManager::new_lazy_with_config(client.clone(), manager_config(options, pushes, 0))
        .map_err(|e| map_error(e, ""))
}

fn manager_config(
    options: &RedisOptions,
    pushes: &PushSink,
    generation: u64,
) -> ConnectionManagerConfig {
    let pushes = pushes.clone();
    ConnectionManagerConfig::new()
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(50))
        .set_connection_timeout(Some(options.connect_timeout))
        .set_response_timeout(Some(options.call_timeout))
        .set_push_sender(move |push| pushes.send((generation, push)))
        .set_automatic_resubscription()
}

/// Replaces a connection that stopped answering, or whose handshake was refused (see
/// `link.rs`; `why` says which, for the log): connects anew, swaps the new
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
pub(super) fn rebuild(
    inner: Arc<Inner>,
    why: &'static str,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let rounds = inner.link.rounds();
        tracing::warn!(
            rounds,
            call_timeout = ?inner.options.call_timeout,
            "redis connection {why}: replacing it"
        );
        // Rebuilds run one at a time: the new connection's generation is the next one.
        let generation = inner.link.generation() + 1;
        let conn = match new_manager(&inner.client, &inner.options, &inner.pushes, generation).await
        {
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
            .on_link("", |mut conn| {
                let names = &names;
                async move { conn.subscribe(names).await }
            })
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
pub(super) const KEEP_ALIVE: Duration = Duration::from_secs(1);

/// Pings the connection when a second went by without an answered call while some quota
/// listens, until the backend is dropped.
///
/// After a disconnection redis-rs makes two connection attempts (`new_manager`), then
/// reconnects only when a call is sent. A process that only holds local leases sends none, and
/// its subscription, the only way such a lease hears of a cancel, would stay dead with Redis
/// back. Unlimited retries inside redis-rs would instead outlive a dropped backend for as long
/// as Redis stays away. A busy connection needs no ping: its own calls reconnect it.
pub(super) async fn keep_subscriptions_alive(inner: Weak<Inner>) {
    loop {
        tokio::time::sleep(KEEP_ALIVE).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        forget_unconfirmed_resubscriptions(&inner).await;
        let owed = !inner.unsubscribes_owed().is_empty();
        if owed {
            let _one_at_a_time = inner.subscribing.lock().await;
            let backend = RedisBackend {
                inner: inner.clone(),
            };
            backend.unsubscribe_quietly(&[]).await;
        }
        let recently = Instant::now().checked_sub(KEEP_ALIVE);
        if inner.channels().is_empty() || recently.is_some_and(|at| inner.link.answered_since(at)) {
            continue;
        }
        let backend = RedisBackend { inner };
        let _ = backend.call_raw(redis::cmd("PING")).await;
    }
}

/// Ends the subscriptions redis-rs did not make again after a reconnect (see
/// `resubscription.rs`): dropping a channel's sender ends its quota's listener, and the quota
/// subscribes again itself, which sees and logs a refusal and retries it later.
///
/// Each is also unsubscribed, under the subscribe lock so that its quota's own SUBSCRIBE comes
/// after: redis-rs keeps every channel it once saw confirmed, and sends them all in one SUBSCRIBE
/// at its next reconnect, which an ACL refuses whole for one refused channel. (Redis checks no
/// channel rights for UNSUBSCRIBE.) A channel refused without ever being confirmed is not on
/// that list.
async fn forget_unconfirmed_resubscriptions(inner: &Arc<Inner>) {
    if !inner.resubscriptions().awaited() {
        return;
    }
    // Read under the lock: a subscribe (or a rebuild's) that held it may have just confirmed
    // one of them on the current connection.
    let _one_at_a_time = inner.subscribing.lock().await;
    let lost = inner.resubscriptions().unconfirmed(
        |since| inner.link.answered_since(since),
        KEEP_ALIVE,
        Instant::now(),
    );
    let lost: Vec<String> = {
        let mut channels = inner.channels();
        lost.into_iter()
            .filter(|name| channels.remove(name).is_some())
            .collect()
    };
    if lost.is_empty() {
        return;
    }
    tracing::warn!(
        ?lost,
        "channels not confirmed subscribed after a reconnect (refused, or the reconnection \
         failed): their quotas subscribe again themselves"
    );
    RedisBackend {
        inner: inner.clone(),
    }
    .unsubscribe_quietly(&lost)
    .await;
}

/// Routes RESP3 push messages to the quota whose channel they came from.
pub(super) async fn dispatch_pushes(
    inner: Weak<Inner>,
    mut pushes: mpsc::UnboundedReceiver<(u64, PushInfo)>,
) {
    while let Some((generation, push)) = pushes.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        // A replaced connection's own disconnection and resubscriptions say nothing of the
        // current one's subscriptions; its messages are still delivered.
        let current = || generation == inner.link.generation();
        if push.kind == PushKind::Disconnection {
            if !current() {
                continue;
            }
            let dropped: Vec<String> = inner.channels().keys().cloned().collect();
            inner
                .resubscriptions()
                .disconnected(dropped, Instant::now());
            continue;
        }
        let channel = match push.data.first() {
            Some(Value::BulkString(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
            _ => continue,
        };
        let event = match push.kind {
            PushKind::Message => match push.data.get(1) {
                Some(Value::BulkString(payload)) => {
                    match parse_event(&String::from_utf8_lossy(payload)) {
                        Some(event) => event,
                        None => continue,
                    }
                }
                _ => continue,
            },
            PushKind::Subscribe => {
                if current() {
                    inner.resubscriptions().confirmed(&channel);
                }
                QuotaEvent::Resubscribed
            }
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
pub(super) fn tcp_settings(call_timeout: Duration) -> redis::io::tcp::TcpSettings {
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
