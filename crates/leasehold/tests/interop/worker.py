#!/usr/bin/python3
"""Python leasehold worker for interop tests (client: leasehold_client.py, from PROTOCOL.md).

Usage (argument order fixed; URL like redis://127.0.0.1:PORT[/DB]):
  worker.py hammer URL QUOTA LIMIT TTL_MS RUN_MS HOLD_US
      for RUN_MS: acquire (waiting) task `py{pid}-{i}`, hold HOLD_US, release;
      prints `hold START_NS END_NS TOKEN` per cycle (time.monotonic_ns = CLOCK_MONOTONIC),
      followed by ` lost REASON` if the lease was lost during the hold. Exit 0.
  worker.py try URL QUOTA LIMIT TTL_MS TASK_ID
      one attempt: `acquired TOKEN`, then renews until stdin closes or a line `release`
      arrives, then `released`; if the lease is lost first: `lost REASON`, then `released`.
      Otherwise one of `full`, `quarantined MS`, `cancelled REASON...`.
  worker.py hold URL QUOTA LIMIT TTL_MS TASK_ID HOLD_MS
      acquire (waiting), `acquired TOKEN`, hold HOLD_MS while renewing; `lost REASON` as soon
      as the lease is lost, else `held`; then release and `done`.
      (`cancelled REASON...` if the acquire itself is refused as cancelled.)
  worker.py cancel URL QUOTA LIMIT TTL_MS TASK_ID [REASON]
      cancel the task (PROTOCOL.md 5.6; marker ttl max(1 h + ttl, 2 ttl), reason default
      `interop`); prints `cancelled held` if it held a live lease, else `cancelled not-held`.
  worker.py status URL QUOTA LIMIT TTL_MS
      one line per live lease `holder TASK_ID TOKEN DEADLINE_MS` (earliest deadline first),
      then `limit N` (the stored limit, 0 if none is stored).

REASON words: expired (renew code 0), superseded (renew code 2), cancelled (renew code 3 or a
`cancelled:` message), released (a `released:` message for our lease: released elsewhere),
local_deadline (no acknowledged renewal before the local deadline), renewal_refused.

Settings: limit version 0; heartbeat ttl/3 (PROTOCOL.md duty 3's default); margin
max(ttl/20, 10 ms); poll 250 ms (or $LEASEHOLD_POLL_MS) jittered 0.5-1.5x; call timeout 1 s.
Exit codes: 0 ok, 2 usage, 69 backend unavailable, 78 misconfigured (limit mismatch), 75 timeout.
"""

import os
import select
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import leasehold_client as lh  # noqa: E402


def out(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def text(b):
    return b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b)


def hammer(q, run_ms, hold_us):
    end = time.monotonic() + run_ms / 1000
    i = 0
    while True:
        left = end - time.monotonic()
        if left <= 0:
            break
        tid = f"py{os.getpid()}-{i}"
        i += 1
        try:
            lease = q.acquire(tid, timeout=left)
        except lh.TimedOut:
            break
        start = time.monotonic_ns()
        time.sleep(hold_us / 1e6)
        stop = time.monotonic_ns()
        held = lease.is_held()
        lease.release()
        out(f"hold {start} {stop} {lease.token}" + ("" if held else f" lost {lease.lost_reason}"))
    return 0


def try_mode(q, tid):
    try:
        lease = q.try_acquire(tid)
    except lh.Full as f:
        out("full" if f.cause == "full" else f"quarantined {f.quarantine_left_ms}")
        return 0
    except lh.Cancelled as c:
        out(f"cancelled {c.reason}")
        return 0
    out(f"acquired {lease.token}")
    fd = sys.stdin.fileno()
    buf = b""
    while True:
        reason = lease.wait_lost(0)
        if reason is not None:
            out(f"lost {reason}")
            break
        r, _, _ = select.select([fd], [], [], 0.05)
        if r:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            lines = (buf + chunk).split(b"\n")
            buf = lines[-1]
            if any(line.strip() == b"release" for line in lines[:-1]):
                break
    lease.release()
    out("released")
    return 0


def hold(q, tid, hold_ms):
    try:
        lease = q.acquire(tid)
    except lh.Cancelled as c:
        out(f"cancelled {c.reason}")
        return 0
    out(f"acquired {lease.token}")
    reason = lease.wait_lost(hold_ms / 1000)
    out(f"lost {reason}" if reason is not None else "held")
    lease.release()
    out("done")
    return 0


def cancel(q, tid, reason):
    held = q.cancel(tid, reason)
    out("cancelled held" if held else "cancelled not-held")
    return 0


def status(q):
    s = q.snapshot()
    for tid, token, _acquired, deadline in s["leases"]:
        out(f"holder {text(tid)} {token} {deadline}")
    out(f"limit {s['limit']}")
    return 0


def main(argv):
    if len(argv) < 6:
        sys.stderr.write(__doc__)
        return 2
    mode, url, quota, limit, ttl = argv[1], argv[2], argv[3], int(argv[4]), int(argv[5])
    rest = argv[6:]
    need = {"hammer": 2, "try": 1, "hold": 2, "cancel": 1, "status": 0}
    if mode not in need or len(rest) < need[mode]:
        sys.stderr.write(__doc__)
        return 2
    # A test that must tell a wake-up by event from one by poll sets a long poll here.
    poll_ms = int(os.environ.get("LEASEHOLD_POLL_MS", "250"))
    q = lh.Quota(url, quota, limit, ttl, poll_ms=poll_ms,
                 subscribe=mode in ("hammer", "try", "hold"))
    try:
        if mode == "hammer":
            return hammer(q, int(rest[0]), int(rest[1]))
        if mode == "try":
            return try_mode(q, rest[0])
        if mode == "hold":
            return hold(q, rest[0], int(rest[1]))
        if mode == "cancel":
            return cancel(q, rest[0], rest[1] if len(rest) > 1 else "interop")
        return status(q)
    except lh.Misconfigured as e:
        sys.stderr.write(f"misconfigured: {e}\n")
        return 78
    except lh.BackendUnavailable as e:
        sys.stderr.write(f"backend unavailable: {e}\n")
        return 69
    except lh.TimedOut as e:
        sys.stderr.write(f"timed out: {e}\n")
        return 75
    finally:
        q.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
