//! How a Redis error reaches the caller: transient, or a misconfiguration.

use redis::{ErrorKind, RedisError, ServerErrorKind};

use super::RedisBackend;
use crate::error::{Error, Misconfiguration, Unavailable};
use crate::keys::QuotaKeys;

/// Error codes with which a healthy server refuses for a while: a replica after a failover
/// (`READONLY`, `MASTERDOWN`), too few replicas for `min-replicas-to-write` (`NOREPLICAS`), memory
/// full under `noeviction` (`OOM`), a dataset still loading (`LOADING`), another script running
/// too long (`BUSY`), a cluster reconfiguring.
pub(super) const SERVER_BUSY_CODES: &[&str] = &[
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

/// `text` on one line: redis-rs words some errors (a parse error) over several, which breaks a
/// log line and the CLI's one-line messages.
pub(super) fn one_line(text: &str) -> String {
    text.split('\n')
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// Maps a redis-rs error to the operator's categories.
pub(super) fn map_error(e: RedisError, quota: &str) -> Error {
    let text = one_line(&e.to_string());
    let code = e.code().unwrap_or("");
    if code == "LEASEHOLD" {
        // A script refused its arguments (out of range, not plain decimal) or a foreign value
        // before writing anything, or ran out of fencing tokens: this client, or the data, breaks
        // the protocol. First: the text may quote a foreign value that reads like another error.
        return Misconfiguration::Protocol(text).into();
    }
    if code == "WRONGTYPE" || text.contains("WRONGTYPE") {
        return Misconfiguration::WrongType {
            quota: quota.to_owned(),
            detail: text,
        }
        .into();
    }
    // Inside a script Redis words an ACL refusal without the NOPERM code: "The user executing
    // the script can't run this command" (7.0, 7.1), "ACL failure in script" (7.2 on, Valkey).
    if code == "NOPERM"
        || text.contains("NOPERM")
        || text.contains("The user executing the script can't run")
        || text.contains("ACL failure in script")
    {
        return Misconfiguration::NoPermission(text).into();
    }
    if is_auth_refusal(&e, &text) {
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
    if is_hello_unknown(&e, &text) {
        return Misconfiguration::Protocol(format!(
            "the server does not know HELLO, so speaks no RESP3: leasehold needs Redis 7.0 or \
             later, or Valkey ({text})"
        ))
        .into();
    }
    if SERVER_BUSY_CODES.contains(&code) {
        // Checked before the script case: Redis reports these with the script's name when a
        // command inside it was refused, and they pass (a promotion, freed memory, a load done).
        return refuses_for_now(code, &text);
    }
    if text.contains("user_script") {
        // A script failed on data it did not expect (a key rewritten from outside): retrying
        // cannot help, and it is no reason to open the circuit.
        return Misconfiguration::Protocol(text).into();
    }
    if code == "ERR" && text.contains("unknown command") {
        // A command leasehold sends is renamed or disabled (`rename-command`), or a proxy does
        // not pass it on: it stays unknown, so retrying cannot help, and a backend-down policy
        // must not grant local leases for ever on a server that answers (found by review).
        return Misconfiguration::Protocol(format!(
            "the server does not know a command leasehold sends (renamed or disabled with \
             rename-command, or a proxy that does not pass it on?): {text}"
        ))
        .into();
    }
    if text.contains("invalid peer certificate") || text.contains("certificate verify failed") {
        return Misconfiguration::Tls(text).into();
    }
    if text.contains(SELECT_REFUSED) {
        // The handshake's SELECT of the URL's database. redis-rs keeps the server's text but not
        // its code, so the reason is read from the text.
        if text.contains("has no permissions to run") {
            // NOPERM: an ACL user without `+select`.
            return Misconfiguration::NoPermission(text).into();
        }
        if text.contains("is busy running") {
            // BUSY: another client's script ran past `busy-reply-threshold`; it ends or is killed.
            return refuses_for_now("BUSY", &text);
        }
        // The URL's database number does not exist on this server (`DB index is out of range`),
        // or the server takes no SELECT (a Cluster node): no retry can help.
        return Misconfiguration::InvalidUrl(text).into();
    }
    match e.kind() {
        ErrorKind::InvalidClientConfig => Misconfiguration::InvalidUrl(text).into(),
        // Bytes that are not RESP (a corrupted stream, or something other than Redis answering):
        // the outcome of the call is unknown, as after a timeout, and redis-rs reconnects (or,
        // when it was the answer to a handshake, the backend rebuilds: `refused_at_handshake`).
        ErrorKind::Parse => {
            Error::unavailable(Unavailable::NoReply, format!("connection broken: {text}"))
        }
        ErrorKind::UnexpectedReturnType => Misconfiguration::Protocol(text).into(),
        ErrorKind::Server(
            ServerErrorKind::CrossSlot | ServerErrorKind::Moved | ServerErrorKind::Ask,
        ) => Misconfiguration::Protocol(format!(
            "{text} (a Redis Cluster node: leasehold v1 needs a standalone server)"
        ))
        .into(),
        // A refused connection: the call was not sent (redis-rs sends nothing before it
        // connects). Any other I/O error may have come after the call left.
        _ if e.is_connection_refusal() => Error::unavailable(Unavailable::NoConnection, text),
        _ => Error::unavailable(Unavailable::NoReply, text),
    }
}

/// A refusal that passes (`SERVER_BUSY_CODES`), with its code.
fn refuses_for_now(code: &str, text: &str) -> Error {
    Error::unavailable(
        Unavailable::ServerRefused,
        format!("the server refuses for now ({code}): {text}"),
    )
}

/// How redis-rs words a refused SELECT of the URL's database, the only SELECT sent.
const SELECT_REFUSED: &str = "refused to switch database";

/// Refused credentials: NOAUTH, WRONGPASS, or redis-rs's own authentication failure.
fn is_auth_refusal(e: &RedisError, text: &str) -> bool {
    matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
        || text.contains("WRONGPASS")
        || text.contains("NOAUTH")
        || e.kind() == ErrorKind::AuthenticationFailed
}

/// The server answered the handshake's `HELLO 3` with "unknown command" (Redis before 6, or
/// HELLO renamed away). redis-rs recognizes only the backquoted wording of Redis 5.
fn is_hello_unknown(e: &RedisError, text: &str) -> bool {
    e.kind() == ErrorKind::RESP3NotSupported
        || (text.contains("unknown command") && text.contains("HELLO"))
}

/// True for the refusals that only a connection's handshake meets: refused credentials, a
/// refused SELECT of the URL's database (whatever the reason: an ACL without `+select`, a busy
/// script, too few databases), and a HELLO the server does not know. leasehold sends neither
/// AUTH, SELECT nor HELLO in calls of its own. redis-rs keeps such a failed connection until
/// an I/O error, which never comes, so the backend rebuilds it (`Link::handshake_failed`).
///
/// Also bytes that are not RESP: in a connection's handshake they mean something other than
/// Redis answered (a reconnection through a proxy moved elsewhere, a lazy backend's first
/// connection), which sticks the same way. Met mid-stream instead, the rebuild they start is
/// one more connection, spaced, beside redis-rs's own reconnection. (A reply cut short by a
/// closed connection is an I/O error, not this.)
pub(super) fn refused_at_handshake(e: &RedisError) -> bool {
    let text = e.to_string();
    is_auth_refusal(e, &text)
        || text.contains(SELECT_REFUSED)
        || is_hello_unknown(e, &text)
        || e.kind() == ErrorKind::Parse
}

impl RedisBackend {
    /// Names the keys of `quota` that hold another type than the protocol's, for an operator
    /// who was told WRONGTYPE by a script (which does not say which key). Off the hot path: runs
    /// only after such a refusal, within what is left of its call's timeout (`deadline`); `None`
    /// when it cannot tell (an ACL without `TYPE`, no answer in time, a cancel marker's
    /// `GET`, or every key as expected by now).
    pub(super) async fn wrong_typed_keys(
        &self,
        quota: &str,
        deadline: tokio::time::Instant,
    ) -> Option<String> {
        let keys = QuotaKeys::new(quota).ok()?;
        let expected = [
            (&keys.leases, "zset"),
            (&keys.holders, "hash"),
            (&keys.fence, "string"),
            (&keys.limit, "hash"),
            (&keys.epoch, "hash"),
            (&keys.quarantine, "string"),
            (&keys.waiting, "string"),
        ];
        let mut pipe = redis::pipe();
        for (key, _) in &expected {
            pipe.cmd("TYPE").arg(key.as_str());
        }
        let (mut conn, _) = self.inner.link.checkout();
        let types: Vec<String> = tokio::time::timeout_at(deadline, pipe.query_async(&mut conn))
            .await
            .ok()?
            .ok()?;
        let wrong: Vec<String> = expected
            .iter()
            .zip(&types)
            .filter(|((_, want), got)| got.as_str() != "none" && got.as_str() != *want)
            .map(|((key, want), got)| format!("{key} holds a {got}, not a {want}"))
            .collect();
        (!wrong.is_empty()).then(|| wrong.join("; "))
    }
}
