"""A leasehold protocol v1 client in Python, written from docs/PROTOCOL.md alone.

It exists to test the claim that a client written to that document interoperates with the Rust
crate on the same quota at the same time. It follows the revision whose script SHA1s are listed
in PROTOCOL.md section 1 (checked at import, see EXPECTED_SHA1).

Runs on Python 3.11 with redis-py 4.3.4 (Debian python3-redis), RESP2: the Pub/Sub subscription
uses its own connection (PROTOCOL.md section 5.1).

    q = Quota("redis://127.0.0.1:6379/0", "llm", limit=3, ttl_ms=3000)
    lease = q.acquire("job-1", timeout=30)     # waits; q.try_acquire(...) makes one attempt
    ... work, checking lease.is_held() / lease.lost_event ...
    lease.release()
    q.close()

Client duties (PROTOCOL.md section 6) and what this module does about them:
  1 validate names, ids, limit, version, ttl; code 5 -> LimitMismatch ......... done
  2 bound every call (1 s socket + connect timeout) .............................. done; redis-py
    closes a connection after a timeout, so a silent connection is replaced at the first timeout
    (stricter than the reference's 3 rounds); the Pub/Sub connection is PINGed and replaced
  3 one renew call per quota per heartbeat (ttl/3), grouped by epoch, brought forward for a new
    lease (due one heartbeat after its acquire was *sent*), quick retry 250 ms doubling up to
    heartbeat/4 after an immediate failure, none after a timeout ..................... done
    (renewals are sent one at a time, never overlapping; at most 5000 leases per call)
  4 local monotonic deadline, margin max(ttl/20, 10 ms) ........................... done
  5 stop on renew 0/2 (no release), on 3 / cancelled: message (release) ............ done
  6 release with the token ..................................................... done
  7 orphan grace for abandoned acquires ...................................... SKIPPED: calls
    are synchronous, nobody abandons one; a timed-out attempt is retried with the same id by the
    waiting acquire (idempotent), which adopts the lease
  8 a task's acquire and release never overlap (one lock per task id); an admission whose
    release went unanswered is released again and re-acquired when it comes back held with
    that token within two ttls ................................................. done
  9 Pub/Sub as a hint, waiter timer + jittered poll, re-check on (re)subscription .... done
    (poll 0.5-1.5 x 250 ms for every waiter; SKIPPED: the 4 x poll for non-oldest waiters)
 10 no admission without a reply; backend-down policy ...................... fail closed only
    (SKIPPED: FailOpen/DegradeLocal local leases, short-circuit)
 11 keys changed through the scripts only ........................................ done
 12 epoch / seq / highest token tracking, per-lease confirmed epoch ................. done
"""

import hashlib
import os
import random
import threading
import time
import unicodedata

import redis

PROTOCOL_VERSION = 1
MAX = 2**53 - 1

SCRIPTS_DIR = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "scripts")
)

# PROTOCOL.md section 1, the revision this client follows.
EXPECTED_SHA1 = {
    "acquire": "e6eec668dc17990e0d9c8fee874188b635ddbb0e",
    "renew": "463f9d899e44609f8ef9b14de7612defd4b3c61d",
    "set_limit": "a3cce64459b1687821aa2fcb05744a4ee39904f8",
    "release": "71827370b0b92800cbd7a10d75c6c2216e1ecd08",
    "cancel": "1e9757999a8ca30a7d1e393be6b839c81b47e5fb",
    "snapshot": "d75a00cb9c2220a42fe39757f775c77483dcb875",
}


# ---------------------------------------------------------------------------------------------
# Errors (named after the reference's, PROTOCOL.md section 5.1)


class LeaseholdError(Exception):
    pass


class Misconfigured(LeaseholdError):
    """A configuration or protocol error: retrying will not help."""


class LimitMismatch(Misconfigured):
    def __init__(self, configured, version, stored_limit, stored_version):
        super().__init__(
            f"limit mismatch: configured {configured} at version {version}, "
            f"stored {stored_limit} at version {stored_version}"
        )
        self.stored_limit, self.stored_version = stored_limit, stored_version


class BackendUnavailable(LeaseholdError):
    """Transient: retrying may help. After a timeout the call's outcome is unknown."""


class Full(LeaseholdError):
    def __init__(self, cause, now_ms=0, earliest_deadline_ms=0, quarantine_left_ms=0):
        super().__init__(cause)
        self.cause = cause  # "full" or "quarantined"
        self.now_ms = now_ms
        self.earliest_deadline_ms = earliest_deadline_ms
        self.quarantine_left_ms = quarantine_left_ms


class Cancelled(LeaseholdError):
    def __init__(self, reason):
        super().__init__(f"cancelled: {reason!r}")
        self.reason = reason


class TimedOut(LeaseholdError):
    pass


_MISCONFIG_PREFIXES = ("WRONGTYPE", "NOPERM", "NOAUTH", "WRONGPASS", "MOVED", "ASK", "CROSSSLOT",
                       "LEASEHOLD")


def classify(exc):
    """Map a redis-py exception to Misconfigured or BackendUnavailable (the table of 5.1)."""
    if isinstance(exc, LeaseholdError):
        return exc
    if isinstance(exc, (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError)):
        return Misconfigured(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, (redis.exceptions.TimeoutError, redis.exceptions.ConnectionError)):
        # includes BusyLoadingError (LOADING); the outcome of the call is unknown
        return BackendUnavailable(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, redis.exceptions.ResponseError):
        msg = str(exc)
        # redis-py strips a leading "ERR " (and "READONLY ", "NOSCRIPT " ...) from the message.
        if msg.startswith(_MISCONFIG_PREFIXES) or "user_script" in msg:
            return Misconfigured(msg)
        return BackendUnavailable(f"{type(exc).__name__}: {msg}")  # BUSY, READONLY, OOM, ...
    return BackendUnavailable(f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------------------
# Scripts (PROTOCOL.md 5.1: acquire, renew and set_limit are common.lua + their own file)


class Script:
    def __init__(self, name, text):
        self.name, self.text = name, text
        self.sha1 = hashlib.sha1(text).hexdigest()

    def __call__(self, conn, keys, args):
        try:
            try:
                return conn.evalsha(self.sha1, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                # EVALSHA fails before running anything: loading and repeating is safe.
                conn.script_load(self.text)
                return conn.evalsha(self.sha1, len(keys), *keys, *args)
        except Exception as exc:  # noqa: BLE001 - mapped to the two error kinds
            raise classify(exc) from exc


def _load_scripts(directory=SCRIPTS_DIR):
    def read(name):
        with open(os.path.join(directory, name + ".lua"), "rb") as f:
            return f.read()

    common = read("common")
    scripts = {}
    for name in ("acquire", "renew", "set_limit"):
        scripts[name] = Script(name, common + read(name))
    for name in ("release", "cancel", "snapshot"):
        scripts[name] = Script(name, read(name))
    for name, script in scripts.items():
        if script.sha1 != EXPECTED_SHA1[name]:
            raise Misconfigured(
                f"script {name}: SHA1 {script.sha1} is not this client's revision "
                f"({EXPECTED_SHA1[name]}); PROTOCOL.md may have changed"
            )
    return scripts


SCRIPTS = _load_scripts()


# ---------------------------------------------------------------------------------------------
# Validation (PROTOCOL.md section 2)


def _to_bytes(s):
    return s if isinstance(s, bytes) else str(s).encode("utf-8")


def _no_cc(text, what):
    for ch in text:
        if unicodedata.category(ch) == "Cc":
            raise Misconfigured(f"invalid {what}: control character U+{ord(ch):04X}")


def _utf8(value, what, least, most):
    """`value` as bytes, and as text: least to most bytes of UTF-8."""
    b = _to_bytes(value)
    if not least <= len(b) <= most:
        raise Misconfigured(f"invalid {what}: {least} to {most} bytes")
    try:
        return b, b.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Misconfigured(f"invalid {what}: not UTF-8") from e


def check_quota_name(name):
    b, text = _utf8(name, "quota name", 1, 256)
    if "{" in text or "}" in text:
        raise Misconfigured("invalid quota name: no { or }")
    _no_cc(text, "quota name")
    return b


def check_task_id(task_id):
    b, text = _utf8(task_id, "task id", 1, 1024)
    _no_cc(text, "task id")
    return b


def check_reason(reason):
    # PROTOCOL.md section 2: 0 to 1024 bytes of UTF-8, anything else allowed.
    b, _ = _utf8(reason, "cancel reason", 0, 1024)
    return b


def _check_int(v, least, most, what):
    if not isinstance(v, int) or isinstance(v, bool) or not least <= v <= most:
        raise Misconfigured(f"invalid {what}: {v!r} (want an integer from {least} to {most})")
    return v


def _dec(n):
    """Plain decimal: digits only, no sign, no leading zero, no exponent."""
    return b"%d" % n


def parse_epoch_id(eid):
    """(seconds, microseconds) of an epoch id `<s>.<us>`, or None for another form."""
    try:
        s, u = eid.split(b".")
    except (ValueError, AttributeError):
        return None
    if not (s.isdigit() and u.isdigit()):
        return None
    return int(s), int(u)


def parse_event(payload):
    """('released', token, task_id) | ('cancelled', task_id, reason) | None (ignored, 3 and 9)."""
    if payload.startswith(b"released:"):
        rest = payload[len(b"released:"):]
        token, sep, task_id = rest.partition(b":")
        if not sep or not token.isdigit() or not task_id:
            return None
        return ("released", int(token), task_id)
    if payload.startswith(b"cancelled:"):
        rest = payload[len(b"cancelled:"):]
        length, sep, rest = rest.partition(b":")
        if not sep or not length.isdigit():
            return None
        n = int(length)
        if n < 1 or len(rest) < n + 1 or rest[n:n + 1] != b":":
            return None
        return ("cancelled", rest[:n], rest[n + 1:])
    return None  # unknown payloads MUST be ignored (section 1)


# ---------------------------------------------------------------------------------------------
# Leases


class Lease:
    """A lease held by this process. Reasons for loss (one word each):
    expired (renew code 0), superseded (renew code 2), cancelled (renew/acquire code 3 or a
    cancelled: message), released (a released: message from someone else: ReleasedElsewhere),
    local_deadline (no acknowledged renewal in time), renewal_refused (local deadline passed while
    the latest renewal was refused by a misconfiguration), released_here (this process released).
    """

    def __init__(self, quota, task_id, token, acquired_at_ms, deadline_ms, epoch, t_send, ttl_ms):
        self.quota = quota
        self.task_id = task_id
        self.token = token
        self.acquired_at_ms = acquired_at_ms
        self.deadline_ms = deadline_ms  # server time; never compared with a local clock
        self.epoch = epoch  # epoch it was last confirmed in (duty 12)
        self.confirmed_send = t_send  # send time of the call that confirmed it last
        self.ttl_ms = ttl_ms
        self.local_deadline = t_send + quota._grant_ns(ttl_ms)  # monotonic ns
        self.lost_reason = None
        self.cancel_reason = None
        self.lost_event = threading.Event()
        self.release_sent = False
        self.renewal_refused = False

    @property
    def fencing_token(self):
        return self.token

    def is_held(self):
        return self.lost_reason is None and time.monotonic_ns() < self.local_deadline

    def wait_lost(self, timeout):
        """Wait up to timeout s; returns the loss reason or None. Checks the local deadline itself."""
        end = time.monotonic() + timeout
        while True:
            if self.lost_reason is not None:
                return self.lost_reason
            if time.monotonic_ns() >= self.local_deadline:
                self.quota._mark_lost(self, self.quota._local_deadline_reason(self))
                return self.lost_reason
            left = end - time.monotonic()
            if left <= 0:
                return None
            wake_in = (self.local_deadline - time.monotonic_ns()) / 1e9
            self.lost_event.wait(max(0.0, min(left, wake_in)))

    def release(self):
        return self.quota.release(self)


# ---------------------------------------------------------------------------------------------
# The quota handle


class Quota:
    def __init__(self, url, name, limit, ttl_ms, limit_version=0, heartbeat_ms=None,
                 margin_ms=None, poll_ms=250, call_timeout=1.0, cancel_marker_ttl_ms=None,
                 subscribe=True):
        self.name = check_quota_name(name)
        self.limit = _check_int(limit, 1, 1_000_000, "limit")
        self.limit_version = _check_int(limit_version, 0, MAX, "limit version")
        self.ttl_ms = _check_int(ttl_ms, 1, MAX, "ttl")
        # Duty 4: margin defaults to max(ttl/20, 10 ms) and must be below ttl/2.
        # PROTOCOL.md duty 4: ttl/20 as an exact fraction (not rounded to whole ms).
        self.margin_ms = max(ttl_ms / 20, 10) if margin_ms is None else margin_ms
        if not 0 <= self.margin_ms < ttl_ms / 2:
            raise Misconfigured("margin must be below ttl/2")
        # Duty 3: default heartbeat ttl/3; > 0 and < ttl - 1 ms - margin.
        self.heartbeat_ms = ttl_ms / 3 if heartbeat_ms is None else heartbeat_ms
        if not 0 < self.heartbeat_ms < ttl_ms - 1 - self.margin_ms:
            raise Misconfigured("heartbeat must be > 0 and < ttl - 1 ms - margin")
        self.poll_ms = poll_ms
        # Section 3: the reference keeps a marker 1 h + ttl, or two ttls when that is longer.
        self.cancel_marker_ttl_ms = (max(3_600_000 + ttl_ms, 2 * ttl_ms)
                                     if cancel_marker_ttl_ms is None else cancel_marker_ttl_ms)
        self.redis = redis.Redis.from_url(url, socket_timeout=call_timeout,
                                          socket_connect_timeout=call_timeout)
        self.db = int(self.redis.connection_pool.connection_kwargs.get("db", 0) or 0)

        p = b"leasehold:{" + self.name + b"}:"
        self.k_leases, self.k_holders, self.k_fence = p + b"leases", p + b"holders", p + b"fence"
        self.k_epoch, self.k_quarantine = p + b"epoch", p + b"quarantine"
        self.k_waiting, self.k_limit = p + b"waiting", p + b"limit"
        self.channel = p + b"events" + (b"" if self.db == 0 else b":db%d" % self.db)

        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # waiters and the heartbeat wait on it
        self._wake_gen = 0  # bumped on every released: message and (re)subscription
        # duty 12, per key set (this handle = one server, one database, one quota)
        self._epoch = None  # latest epoch id seen (bytes), None before the first reply
        self._seq = 0  # highest seq seen in self._epoch
        self._highest_token = 0  # highest token seen in acquire replies, across epochs
        self._leases = {}  # task id -> Lease
        self._pending_releases = {}  # (task id, token) -> count of releases sent, unanswered
        self._unanswered_releases = {}  # task id -> (token, monotonic ns): duty 8
        self._task_locks = {}  # task id -> Lock: a task's acquire and release never overlap
        self._next_beat = None  # monotonic ns of the next renewal round
        self._closed = False
        self.events = []  # (monotonic ns, parsed event) for tests; bounded below

        self._hb = threading.Thread(target=self._heartbeat_loop, name="leasehold-heartbeat",
                                    daemon=True)
        self._hb.start()
        self._sub = None
        self.subscribed = threading.Event()
        if subscribe:
            self._sub = threading.Thread(target=self._subscriber_loop, name="leasehold-pubsub",
                                         daemon=True)
            self._sub.start()

    # -- keys and small helpers ---------------------------------------------------------------

    def marker_key(self, task_id):
        return b"leasehold:{" + self.name + b"}:cancel:" + task_id

    def _grant_ns(self, ttl_ms):
        """Duty 4: an acknowledged call sent at t_send keeps the lease until t_send + this."""
        return int((ttl_ms - 1 - self.margin_ms) * 1_000_000)

    def _task_lock(self, task_id):
        with self._lock:
            return self._task_locks.setdefault(task_id, threading.Lock())

    def _observe(self, epoch, seq):
        """Duty 12: track the latest epoch id and the highest seq seen in it (lock held)."""
        if self._epoch is None or epoch == self._epoch:
            if self._epoch is None:
                self._epoch, self._seq = epoch, seq
            else:
                self._seq = max(self._seq, seq)
            return
        new, old = parse_epoch_id(epoch), parse_epoch_id(self._epoch)
        if new is None or old is None or new > old:
            self._epoch, self._seq = epoch, seq
        # else: an earlier id is a late reply from before a loss: ignored

    def _mark_lost(self, lease, reason, cancel_reason=None):
        with self._lock:
            if lease.lost_reason is not None:
                return
            lease.lost_reason = reason
            if cancel_reason is not None:
                lease.cancel_reason = cancel_reason
            if reason in ("expired", "superseded"):
                # Duty 5: lost; do not release it.
                if self._leases.get(lease.task_id) is lease:
                    del self._leases[lease.task_id]
            lease.lost_event.set()
            self._cond.notify_all()

    def _local_deadline_reason(self, lease):
        return "renewal_refused" if lease.renewal_refused else "local_deadline"

    # -- acquire ------------------------------------------------------------------------------

    def try_acquire(self, task_id):
        """One attempt. Returns a Lease; raises Full (cause full/quarantined), Cancelled,
        LimitMismatch, Misconfigured or BackendUnavailable."""
        tid = check_task_id(task_id)
        with self._task_lock(tid):
            with self._lock:
                existing = self._leases.get(tid)
                if existing is not None and existing.is_held() and not existing.release_sent:
                    # One task id holds one slot in the process (duty 10's last rule): its lease.
                    return existing
            lease = self._acquire_call(tid)
            with self._lock:
                un = self._unanswered_releases.get(tid)
            if un is not None:
                token, when = un
                if (lease.token == token
                        and time.monotonic_ns() - when < 2 * self.ttl_ms * 1_000_000):
                    # Duty 8: never hand out an admission whose release went unanswered: a
                    # late copy of that release may still remove it. Release again, acquire
                    # afresh (a new token).
                    self._release_call(lease, lease.token)
                    with self._lock:
                        self._unanswered_releases.pop(tid, None)
                    lease = self._acquire_call(tid)
                else:
                    with self._lock:
                        self._unanswered_releases.pop(tid, None)
            return lease

    def _acquire_call(self, tid):
        with self._lock:
            epoch = self._epoch or b""
            seq = self._seq if self._epoch is not None else 0
            highest = self._highest_token
        keys = [self.k_leases, self.k_holders, self.k_fence, self.k_epoch, self.k_quarantine,
                self.k_waiting, self.k_limit, self.marker_key(tid)]
        args = [_dec(self.ttl_ms), _dec(self.limit), epoch, _dec(self.limit_version), _dec(seq),
                _dec(highest), tid]
        t_send = time.monotonic_ns()
        reply = SCRIPTS["acquire"](self.redis, keys, args)
        if (not isinstance(reply, list) or len(reply) != 7 or not isinstance(reply[0], bytes)
                or not all(isinstance(x, int) for x in reply[1:4])):
            raise Misconfigured(f"acquire: reply of the wrong shape: {reply!r}")
        r_epoch, now_ms, r_seq, code, a, b, c = reply
        with self._lock:
            self._observe(r_epoch, r_seq)
            if code in (1, 2):
                self._highest_token = max(self._highest_token, a)
                lease = Lease(self, tid, a, b, c, r_epoch, t_send, self.ttl_ms)
                old = self._leases.get(tid)
                if old is not None and old.token == a and old.lost_reason is None:
                    # the same admission (e.g. adopting after a timed-out attempt): keep one object
                    old.local_deadline = max(old.local_deadline, lease.local_deadline)
                    if t_send > old.confirmed_send:
                        old.epoch, old.confirmed_send = r_epoch, t_send
                    old.deadline_ms = max(old.deadline_ms, c)
                    return old
                self._leases[tid] = lease
                # Duty 3: first renewal one heartbeat after the acquire was *sent*.
                due = t_send + int(self.heartbeat_ms * 1_000_000)
                if self._next_beat is None or due < self._next_beat:
                    self._next_beat = due
                self._cond.notify_all()
                return lease
        if code == 0:
            raise Full("full", now_ms=now_ms, earliest_deadline_ms=a)
        if code == 3:
            raise Cancelled(a.decode("utf-8", "replace") if isinstance(a, bytes) else a)
        if code == 4:
            raise Full("quarantined", now_ms=now_ms, quarantine_left_ms=a)
        if code == 5:
            raise LimitMismatch(self.limit, self.limit_version, a, b)
        raise Misconfigured(f"acquire: unknown code {code!r}")

    def acquire(self, task_id, timeout=None):
        """Wait for a slot: Pub/Sub release events, a timer to the earliest deadline of a full
        reply, and a jittered poll (duty 9). Transient failures are retried with the same id
        (idempotent) until the timeout, then BackendUnavailable is raised."""
        end = None if timeout is None else time.monotonic() + timeout
        last_error = None
        while True:
            with self._lock:
                gen = self._wake_gen
            poll = random.uniform(0.5, 1.5) * self.poll_ms
            try:
                return self.try_acquire(task_id)
            except Full as f:
                last_error = f
                if f.cause == "quarantined":
                    wait_ms = f.quarantine_left_ms + 1
                else:
                    # expiries are never announced: retry by the expiry hint + 1 ms, and within
                    # the ttl (keeps the waiting marker alive), and at the jittered poll.
                    hint = f.earliest_deadline_ms - f.now_ms + 1
                    wait_ms = max(1, min(poll, hint, self.ttl_ms))
            except BackendUnavailable as e:
                last_error = e
                wait_ms = poll
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                if isinstance(last_error, BackendUnavailable):
                    raise last_error
                raise TimedOut(f"acquire {task_id!r}: no slot within {timeout} s")
            wait_s = wait_ms / 1000 if left is None else min(wait_ms / 1000, left)
            quarantined = isinstance(last_error, Full) and last_error.cause == "quarantined"
            with self._cond:
                w_end = time.monotonic() + wait_s
                # a release event or a (re)subscription wakes the waiter, except in a quarantine
                while (quarantined or self._wake_gen == gen) and not self._closed:
                    r = w_end - time.monotonic()
                    if r <= 0:
                        break
                    self._cond.wait(r)

    # -- release / cancel / snapshot ----------------------------------------------------------

    def release(self, lease):
        """Token-guarded release. Returns True if Redis removed the lease. A lease lost as
        expired/superseded is not sent (duty 5). Raises BackendUnavailable if unanswered."""
        with self._task_lock(lease.task_id):
            with self._lock:
                if lease.lost_reason in ("expired", "superseded") or lease.release_sent:
                    if self._leases.get(lease.task_id) is lease:
                        del self._leases[lease.task_id]
                    return False
                lease.release_sent = True  # no renewal carries it any more (duty 3)
            try:
                removed = self._release_call(lease, lease.token)
            except BackendUnavailable:
                with self._lock:
                    self._unanswered_releases[lease.task_id] = (lease.token, time.monotonic_ns())
                    if self._leases.get(lease.task_id) is lease:
                        del self._leases[lease.task_id]
                self._mark_lost(lease, "released_here")
                raise
            with self._lock:
                if self._leases.get(lease.task_id) is lease:
                    del self._leases[lease.task_id]
            self._mark_lost(lease, "released_here")
            return removed

    def _release_call(self, lease, token):
        key = (lease.task_id, token)
        with self._lock:
            self._pending_releases[key] = self._pending_releases.get(key, 0) + 1
        try:
            reply = SCRIPTS["release"](self.redis, [self.k_leases, self.k_holders, self.k_waiting],
                                       [self.channel, lease.task_id, _dec(token)])
        finally:
            with self._lock:
                n = self._pending_releases.pop(key) - 1
                if n:
                    self._pending_releases[key] = n
        if not isinstance(reply, list) or len(reply) != 1:
            raise Misconfigured(f"release: reply of the wrong shape: {reply!r}")
        return reply[0] == 1

    def force_release(self, task_id):
        """The operator's release (`*`)."""
        tid = check_task_id(task_id)
        reply = SCRIPTS["release"](self.redis, [self.k_leases, self.k_holders, self.k_waiting],
                                   [self.channel, tid, b"*"])
        return reply[0] == 1

    def cancel(self, task_id, reason):
        """Cancel a task, held or not (5.6). True if it held a live lease."""
        tid, rb = check_task_id(task_id), check_reason(reason)
        reply = SCRIPTS["cancel"](self.redis, [self.k_leases, self.marker_key(tid)],
                                  [tid, rb, _dec(self.cancel_marker_ttl_ms), self.channel])
        if not isinstance(reply, list) or len(reply) != 1 or reply[0] not in (0, 1):
            raise Misconfigured(f"cancel: reply of the wrong shape: {reply!r}")
        return reply[0] == 1

    def cancel_reason(self, task_id):
        """GET the marker: the reason while the task is cancelled, else None (5.6)."""
        try:
            return self.redis.get(self.marker_key(check_task_id(task_id)))
        except Exception as exc:  # noqa: BLE001
            raise classify(exc) from exc

    def snapshot(self):
        """dict(now_ms, limit, version, quarantine_left_ms, leases=[(id, token, acq, deadline)])."""
        r = SCRIPTS["snapshot"](self.redis,
                                [self.k_leases, self.k_holders, self.k_limit, self.k_quarantine], [])
        if not isinstance(r, list) or len(r) < 4 or (len(r) - 4) % 4:
            raise Misconfigured(f"snapshot: reply of the wrong shape: {r!r}")
        leases = [tuple(r[i:i + 4]) for i in range(4, len(r), 4)]
        return {"now_ms": r[0], "limit": r[1], "version": r[2], "quarantine_left_ms": r[3],
                "leases": leases}

    status = snapshot

    def set_limit(self, limit, version=None):
        _check_int(limit, 1, 1_000_000, "limit")
        v = b"" if version is None else _dec(_check_int(version, 0, MAX, "limit version"))
        return SCRIPTS["set_limit"](self.redis, [self.k_limit], [_dec(limit), v])

    # -- heartbeat ----------------------------------------------------------------------------

    def _heartbeat_loop(self):
        retry_ms = None  # quick retry delay after an immediate failure (duty 3)
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic_ns()
                    # stop believing in leases whose local deadline passed (duty 4)
                    for lease in list(self._leases.values()):
                        if lease.lost_reason is None and now >= lease.local_deadline:
                            self._mark_lost(lease, self._local_deadline_reason(lease))
                    live = [l for l in self._leases.values()
                            if l.lost_reason is None and not l.release_sent]
                    if not live:
                        self._next_beat = None
                        self._cond.wait(1.0)
                        continue
                    if self._next_beat is None:
                        self._next_beat = now + int(self.heartbeat_ms * 1_000_000)
                    wake = min([self._next_beat] + [l.local_deadline for l in live])
                    if now >= self._next_beat:
                        break
                    self._cond.wait(max(0.0005, (wake - now) / 1e9))
                # Duty 3: one call per epoch present among the leases (normally one).
                by_epoch = {}
                for lease in live:
                    by_epoch.setdefault(lease.epoch, []).append(lease)
            t_round = time.monotonic_ns()
            failed, timed_out = False, False
            # The script takes at most 5000 pairs (PROTOCOL.md section 5.3).
            calls = [(epoch, leases[i:i + 5000])
                     for epoch, leases in by_epoch.items()
                     for i in range(0, len(leases), 5000)]
            for epoch, leases in calls:
                try:
                    self._renew_call(epoch, leases)
                except BackendUnavailable as e:
                    failed = True
                    timed_out = timed_out or "Timeout" in str(e)
                except Misconfigured:
                    failed = True  # a refusal grants nothing; holders stop at local deadline
                    for lease in leases:
                        lease.renewal_refused = True
            with self._lock:
                hb_ns = int(self.heartbeat_ms * 1_000_000)
                if failed and not timed_out:
                    retry_ms = (min(250, self.heartbeat_ms / 4) if retry_ms is None
                                else min(retry_ms * 2, self.heartbeat_ms / 4))
                    self._next_beat = time.monotonic_ns() + int(retry_ms * 1_000_000)
                else:
                    retry_ms = None
                    nb = t_round + hb_ns
                    # a lease admitted during this round may already have brought it forward
                    if self._next_beat is None or self._next_beat <= t_round:
                        self._next_beat = nb
                    else:
                        self._next_beat = min(self._next_beat, nb)

    def _renew_call(self, epoch, leases):
        with self._lock:
            # Never carry a lease whose local deadline passed or that a reply ended (duty 3).
            now = time.monotonic_ns()
            leases = [l for l in leases
                      if l.lost_reason is None and not l.release_sent and now < l.local_deadline]
            if not leases:
                return
            seq = self._seq if (self._epoch is not None and epoch == self._epoch) else 0
            highest = self._highest_token
        keys = [self.k_leases, self.k_holders, self.k_fence, self.k_epoch, self.k_quarantine,
                self.k_limit] + [self.marker_key(l.task_id) for l in leases]
        args = [_dec(self.ttl_ms), epoch or b"", _dec(seq), _dec(highest)]
        for l in leases:
            args += [l.task_id, _dec(l.token)]
        t_send = time.monotonic_ns()
        reply = SCRIPTS["renew"](self.redis, keys, args)
        if (not isinstance(reply, list) or len(reply) != 3 + 2 * len(leases)
                or not isinstance(reply[0], int) or not isinstance(reply[1], bytes)):
            raise Misconfigured(f"renew: reply of the wrong shape: {reply!r}")
        now_ms, r_epoch, r_seq = reply[0], reply[1], reply[2]
        lost = []
        with self._lock:
            self._observe(r_epoch, r_seq)
            arrived = time.monotonic_ns()
            for i, lease in enumerate(leases):
                code, value = reply[3 + 2 * i], reply[4 + 2 * i]
                lease.renewal_refused = False
                if lease.lost_reason is not None or lease.release_sent:
                    continue
                if code == 1:
                    if arrived >= lease.local_deadline:
                        # a late answer does not revive the lease (duty 4)
                        lost.append((lease, self._local_deadline_reason(lease), None))
                        continue
                    lease.local_deadline = max(lease.local_deadline,
                                               t_send + self._grant_ns(self.ttl_ms))
                    lease.deadline_ms = max(lease.deadline_ms, value)
                    if t_send > lease.confirmed_send:
                        lease.epoch, lease.confirmed_send = r_epoch, t_send
                elif code == 2:
                    lost.append((lease, "superseded", None))
                elif code == 3:
                    lost.append((lease, "cancelled", value))
                else:  # 0, or unknown codes treated as 0 (5.3)
                    lost.append((lease, "expired", None))
        for lease, reason, why in lost:
            self._mark_lost(lease, reason, why)

    # -- Pub/Sub ------------------------------------------------------------------------------

    def _on_message(self, payload):
        ev = parse_event(payload)
        if ev is None:
            return
        with self._lock:
            if len(self.events) < 100000:
                self.events.append((time.monotonic_ns(), ev))
            if ev[0] == "released":
                _, token, tid = ev
                lease = self._leases.get(tid)
                # ignore the announcement of our own release not yet answered (duty 9)
                if (lease is not None and lease.token == token and lease.lost_reason is None
                        and (tid, token) not in self._pending_releases and not lease.release_sent):
                    lost = lease
                else:
                    lost = None
                self._wake_gen += 1
                self._cond.notify_all()
            else:
                _, tid, reason = ev
                lease = self._leases.get(tid)
                lost = None
                if lease is not None and lease.lost_reason is None and not lease.release_sent:
                    self._mark_lost(lease, "cancelled", reason)
                self._wake_gen += 1  # a waiter for this id re-tries and gets code 3
                self._cond.notify_all()
        if lost is not None:
            self._mark_lost(lost, "released")

    def _on_subscribed(self):
        """Every (re)subscription re-checks: wake waiters, read held leases' cancel markers."""
        with self._lock:
            self._wake_gen += 1
            self._cond.notify_all()
            held = [l for l in self._leases.values() if l.lost_reason is None]
        if held:
            try:
                reasons = self.redis.mget([self.marker_key(l.task_id) for l in held])
            except Exception:  # noqa: BLE001 - the next renewal tells anyway
                return
            for lease, why in zip(held, reasons):
                if why is not None:
                    self._mark_lost(lease, "cancelled", why)

    def _subscriber_loop(self):
        backoff = 0.1
        while not self._closed:
            ps = None
            try:
                ps = self.redis.pubsub()
                ps.subscribe(self.channel)
                confirmed = False
                end = time.monotonic() + 2.0
                while not confirmed and time.monotonic() < end and not self._closed:
                    m = ps.get_message(timeout=0.2)
                    if m and m["type"] == "subscribe":
                        confirmed = True
                if not confirmed:
                    raise redis.exceptions.TimeoutError("no subscribe confirmation")
                self.subscribed.set()
                self._on_subscribed()
                backoff = 0.1
                last_rx, ping_sent = time.monotonic(), None
                while not self._closed:
                    m = ps.get_message(timeout=0.2)
                    now = time.monotonic()
                    if m is not None:
                        last_rx, ping_sent = now, None
                        if m["type"] == "message":
                            self._on_message(m["data"])
                    elif ping_sent is None and now - last_rx > 5.0:
                        ps.ping()  # a silent connection is replaced (duty 2)
                        ping_sent = now
                    elif ping_sent is not None and now - ping_sent > 2.0:
                        raise redis.exceptions.TimeoutError("pubsub ping unanswered")
            except Exception:  # noqa: BLE001 - reconnect and resubscribe
                self.subscribed.clear()
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                if ps is not None:
                    try:
                        ps.close()
                    except Exception:  # noqa: BLE001
                        pass

    def close(self):
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._hb.join(timeout=3)
        if self._sub is not None:
            self._sub.join(timeout=3)
        self.redis.close()
