//! The connection the Redis backend's calls go through, and when to replace it.
//!
//! redis-rs replaces a connection only when it is closed or broken. A connection wedged above
//! TCP (a proxy or load balancer that accepts bytes and forwards nothing, while new connections
//! would work) is neither: every call on it times out, and it would stay in use until the wedge
//! clears. So the backend counts call timeouts per connection, and after
//! [`ROUNDS_TO_REBUILD`] consecutive rounds of them with no reply in between it builds a new
//! connection and swaps it in (see `rebuild` in `connection.rs`). Each round short of that sends
//! a probe (`PING`) on the connection, so the rounds come one call timeout apart however sparse
//! the application's own calls are.
//!
//! Generic over the connection type so that the counting is unit-tested without a server.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Consecutive rounds of call timeouts, with no reply in between, after which the connection is
/// replaced.
///
/// With the probes the wedge is confirmed about three call timeouts after the first call that
/// went unanswered was sent. A process that only renews (one call per heartbeat) would otherwise
/// need three heartbeats, about one ttl: its leases would end first.
///
/// Three, like the short-circuit's default `failures_to_open`, and for the same reason: one
/// round is a blip (a GC pause of Redis, a lost packet retransmitted late), two can still be a
/// slow moment, three rounds (at least about three call timeouts of silence) are a connection
/// that does not answer. Rounds, not calls: a timeout of a call sent before the previous counted
/// timeout was seen is the same silence and does not count again, so a burst of concurrent calls
/// cut by one stall counts once. Waiting for more would cost leases: with the default call
/// timeout (1 s) a rebuild comes about 3 s into the wedge, inside the default ttl (10 s) but not
/// inside a 1 s ttl, which no rule of this kind could save.
pub(super) const ROUNDS_TO_REBUILD: u32 = 3;

/// The least time between two rebuilds, in call timeouts: doubled by each rebuild that follows
/// the previous one within [`SPACING_RESET`] times the cap, up to [`SPACING_CAP`]. A Redis that
/// is merely slower than the call timeout times out just like a wedge; rebuilding is harmless
/// then, but must not turn into one new connection (handshake, resubscriptions) every few
/// seconds from every process of a fleet.
const SPACING_BASE: u32 = 4;

/// The longest spacing between rebuilds (or [`SPACING_BASE`] call timeouts if longer).
const SPACING_CAP: Duration = Duration::from_secs(30);

/// A rebuild this many spacing caps after the previous one starts again from the base spacing.
const SPACING_RESET: u32 = 2;

/// What the caller of [`Link::timed_out`] must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Next {
    Nothing,
    /// Send a probe on the current connection: one more round of silence, or an answer.
    Probe,
    /// Build a new connection, then report [`Link::swap`] or [`Link::rebuild_failed`].
    Rebuild,
}

/// Which connection a call used, and when it was sent: its outcome is reported with it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ticket {
    generation: u64,
    sent: Instant,
}

/// The current connection and the health counters of the backend.
#[derive(Debug)]
pub(super) struct Link<C> {
    call_timeout: Duration,
    state: Mutex<State<C>>,
}

#[derive(Debug)]
struct State<C> {
    conn: C,
    /// Bumped by each swap: outcomes of calls on an older connection are ignored.
    generation: u64,
    /// Consecutive rounds of timeouts on the current connection.
    rounds: u32,
    /// When the last counted timeout was seen.
    counted_at: Option<Instant>,
    rebuilding: bool,
    last_rebuild_at: Option<Instant>,
    /// Least time after `last_rebuild_at` before the next rebuild may start.
    spacing: Duration,
    /// Rebuilds started (successful or not), for tests and logs.
    rebuilds: u64,
    /// When the latest call answered on the current connection was sent.
    answered_sent: Option<Instant>,
}

impl<C: Clone> Link<C> {
    pub(super) fn new(conn: C, call_timeout: Duration) -> Self {
        Link {
            call_timeout,
            state: Mutex::new(State {
                conn,
                generation: 0,
                rounds: 0,
                counted_at: None,
                rebuilding: false,
                last_rebuild_at: None,
                spacing: Duration::ZERO,
                rebuilds: 0,
                answered_sent: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<C>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The connection to send a call on, and its ticket.
    pub(super) fn checkout(&self) -> (C, Ticket) {
        let state = self.lock();
        let ticket = Ticket {
            generation: state.generation,
            sent: Instant::now(),
        };
        (state.conn.clone(), ticket)
    }

    /// The connection answered (anything but a timeout): it is not wedged.
    pub(super) fn replied(&self, ticket: Ticket) {
        let mut state = self.lock();
        if ticket.generation == state.generation {
            state.rounds = 0;
            state.counted_at = None;
            state.answered_sent = state.answered_sent.max(Some(ticket.sent));
        }
    }

    /// True if the current connection answered a call sent at `at` or later.
    pub(super) fn answered_since(&self, at: Instant) -> bool {
        self.lock().answered_sent.is_some_and(|sent| sent >= at)
    }

    /// A call timed out: what to do about it.
    pub(super) fn timed_out(&self, ticket: Ticket) -> Next {
        self.timed_out_at(ticket, Instant::now())
    }

    fn timed_out_at(&self, ticket: Ticket, now: Instant) -> Next {
        let mut state = self.lock();
        if ticket.generation != state.generation {
            return Next::Nothing;
        }
        let new_round = state.counted_at.is_none_or(|at| ticket.sent >= at);
        if new_round {
            state.rounds += 1;
            state.counted_at = Some(now);
        }
        if state.rounds < ROUNDS_TO_REBUILD {
            // One probe per round: the calls of one round that time out after it count nothing.
            return match new_round {
                true => Next::Probe,
                false => Next::Nothing,
            };
        }
        self.rebuild_if_spaced(&mut state, now)
    }

    /// A call on the current connection failed in its handshake (refused credentials, a refused
    /// SELECT of the URL's database, an unknown HELLO: `refused_at_handshake` in `errors.rs`):
    /// redis-rs starts a new connection attempt only after an I/O error, so without a rebuild
    /// this connection would fail every call until the process restarts, even once an operator
    /// fixed the cause. Rebuilds are spaced as for timeouts.
    pub(super) fn handshake_failed(&self, ticket: Ticket) -> Next {
        let mut state = self.lock();
        if ticket.generation != state.generation {
            return Next::Nothing;
        }
        self.rebuild_if_spaced(&mut state, Instant::now())
    }

    fn rebuild_if_spaced(&self, state: &mut State<C>, now: Instant) -> Next {
        let spaced = state
            .last_rebuild_at
            .is_none_or(|at| now >= at + state.spacing);
        if state.rebuilding || !spaced {
            return Next::Nothing;
        }
        let base = self.call_timeout * SPACING_BASE;
        let cap = SPACING_CAP.max(base);
        state.spacing = match state.last_rebuild_at {
            Some(at) if now.duration_since(at) < cap * SPACING_RESET => {
                (state.spacing * 2).clamp(base, cap)
            }
            _ => base,
        };
        state.last_rebuild_at = Some(now);
        state.rebuilding = true;
        state.rebuilds += 1;
        Next::Rebuild
    }

    /// The rebuild succeeded: calls from now on go to `conn`, counted afresh.
    pub(super) fn swap(&self, conn: C) {
        let mut state = self.lock();
        state.conn = conn;
        state.generation += 1;
        state.rounds = 0;
        state.counted_at = None;
        state.rebuilding = false;
        state.answered_sent = None;
    }

    /// The rebuild could not connect: the old connection stays; the next timeout (or refused
    /// handshake) after the spacing tries again.
    pub(super) fn rebuild_failed(&self) {
        self.lock().rebuilding = false;
    }

    /// How many times the connection was replaced: 0 for the backend's first connection.
    pub(super) fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Rebuilds started since the backend connected.
    pub(super) fn rebuilds(&self) -> u64 {
        self.lock().rebuilds
    }

    /// Consecutive rounds of timeouts on the current connection.
    pub(super) fn rounds(&self) -> u32 {
        self.lock().rounds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_millis(100);

    /// A fake clock: `at(ms)` is `ms` after the test's start.
    struct Clock(Instant);

    impl Clock {
        fn at(&self, ms: u64) -> Instant {
            self.0 + Duration::from_millis(ms)
        }
    }

    fn ticket(link: &Link<u32>, sent: Instant) -> Ticket {
        Ticket {
            generation: link.lock().generation,
            sent,
        }
    }

    /// A call sent at `ms` that times out one call timeout later: its own round whenever the
    /// previous counted timeout was seen before `ms`.
    fn round(link: &Link<u32>, clock: &Clock, ms: u64) -> bool {
        let sent = clock.at(ms);
        link.timed_out_at(ticket(link, sent), sent + TIMEOUT) == Next::Rebuild
    }

    #[test]
    fn three_rounds_without_a_reply_start_one_rebuild() {
        let (link, clock) = (Link::new(0u32, TIMEOUT), Clock(Instant::now()));
        assert!(!round(&link, &clock, 0));
        assert!(!round(&link, &clock, 100));
        assert!(round(&link, &clock, 200), "third round");
        assert!(!round(&link, &clock, 300), "one rebuild at a time");
        link.swap(1);
        assert_eq!(link.checkout().0, 1);
        assert_eq!(link.rounds(), 0);
        assert_eq!(link.rebuilds(), 1);
    }

    #[test]
    fn answers_count_on_the_connection_they_came_from() {
        let (link, clock) = (Link::new(0u32, TIMEOUT), Clock(Instant::now()));
        assert!(!link.answered_since(clock.at(0)));
        link.replied(ticket(&link, clock.at(100)));
        assert!(link.answered_since(clock.at(100)));
        assert!(!link.answered_since(clock.at(101)));
        // An earlier call answered late does not move it back.
        link.replied(ticket(&link, clock.at(50)));
        assert!(link.answered_since(clock.at(100)));
        link.swap(1);
        assert!(
            !link.answered_since(clock.at(0)),
            "a new connection has answered nothing"
        );
    }

    #[test]
    fn a_reply_resets_the_count() {
        let (link, clock) = (Link::new(0u32, TIMEOUT), Clock(Instant::now()));
        assert!(!round(&link, &clock, 0));
        assert!(!round(&link, &clock, 100));
        link.replied(ticket(&link, clock.at(200)));
        assert!(!round(&link, &clock, 300));
        assert!(!round(&link, &clock, 400));
        assert_eq!(link.rebuilds(), 0);
    }

    #[test]
    fn calls_under_way_when_a_timeout_is_seen_count_as_that_round() {
        let (link, clock) = (Link::new(0u32, TIMEOUT), Clock(Instant::now()));
        // Ten calls sent together, cut by one stall, time out one after the other.
        let next: Vec<_> = (0..10)
            .map(|i| link.timed_out_at(ticket(&link, clock.at(0)), clock.at(100 + i)))
            .collect();
        assert_eq!(next[0], Next::Probe, "one probe for the round");
        assert!(next[1..].iter().all(|n| *n == Next::Nothing), "{next:?}");
        assert_eq!(link.rounds(), 1);
    }

    #[test]
    fn outcomes_on_a_replaced_connection_are_ignored() {
        let (link, clock) = (Link::new(0u32, TIMEOUT), Clock(Instant::now()));
        let old = ticket(&link, clock.at(0));
        for i in 0..3 {
            round(&link, &clock, 100 * i);
        }
        link.swap(1);
        assert!(!round(&link, &clock, 300));
        link.replied(old);
        assert_eq!(
            link.rounds(),
            1,
            "a late reply on the old connection says nothing"
        );
        assert_eq!(link.timed_out_at(old, clock.at(500)), Next::Nothing);
        assert_eq!(link.rounds(), 1);
    }

    #[test]
    fn rebuilds_are_spaced_and_the_spacing_grows_then_resets() {
        let (link, clock) = (Link::new(0u32, TIMEOUT), Clock(Instant::now()));
        round(&link, &clock, 0);
        round(&link, &clock, 100);
        // Started at 300 ms (the third timeout): the next waits 4 call timeouts.
        assert!(round(&link, &clock, 200));
        link.rebuild_failed();
        for ms in [300, 400, 500] {
            assert!(!round(&link, &clock, ms), "inside the spacing: no hot loop");
        }
        assert!(
            round(&link, &clock, 600),
            "timed out at 700 ms, 400 ms after the first"
        );
        link.swap(1);
        round(&link, &clock, 800);
        round(&link, &clock, 900);
        // The spacing doubled to 800 ms: not before 1500 ms.
        assert!(!round(&link, &clock, 1000));
        assert!(!round(&link, &clock, 1300));
        assert!(round(&link, &clock, 1400));
        link.swap(2);
        assert_eq!(link.rebuilds(), 3);
        // Quiet for two caps: the spacing starts again from the base.
        let later = 1600 + 2 * SPACING_CAP.as_millis() as u64;
        round(&link, &clock, later);
        round(&link, &clock, later + 100);
        assert!(round(&link, &clock, later + 200));
        link.swap(3);
        round(&link, &clock, later + 300);
        round(&link, &clock, later + 400);
        assert!(!round(&link, &clock, later + 500), "base spacing: 400 ms");
        assert!(round(&link, &clock, later + 600));
    }
}
