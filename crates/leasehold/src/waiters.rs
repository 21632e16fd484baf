//! The queue of tasks in this process that wait for a slot of one quota.
//!
//! Waiters are served in arrival order: a wake-up (a release announced on the quota's channel)
//! goes to the earliest waiter that is not already attempting for a freed slot, so when one slot
//! frees, the oldest waiter tries first; when several free, several try at once. A waiter whose
//! own attempt (its first, a poll, its expiry timer) or re-check is out keeps the wake-up and
//! tries again at once if that attempt is refused: it was sent before the slot freed, and a
//! younger waiter must not take the slot meanwhile. Only the head of the queue arms a timer to the earliest lease
//! deadline, so an expiry (which nobody announces) costs one attempt per process, not one per
//! waiter.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::quota::StartedAttempt;

#[derive(Debug, Default)]
pub(crate) struct WaitQueue {
    queue: Mutex<VecDeque<Arc<Waiter>>>,
    /// When the earliest lease is due to expire, as the last full reply said: a newly promoted
    /// head arms its timer from it instead of asking the backend again.
    next_expiry: Mutex<Option<Instant>>,
    /// When the waiters behind the head poll next: one instant for the whole line, so that their
    /// attempts go out together (one script call) instead of one call per waiter.
    line_poll_at: Mutex<Option<Instant>>,
}

#[derive(Debug, Default)]
pub(crate) struct Waiter {
    task_id: String,
    notify: Notify,
    state: Mutex<WaiterState>,
    /// An attempt the waker already started on this waiter's behalf (see `wake_one_starting`).
    started: Mutex<Option<StartedAttempt>>,
}

#[derive(Debug, Default)]
struct WaiterState {
    /// Slots freed for this waiter that it has not tried for yet. Counted, not folded: two
    /// releases before the waiter runs are two slots, and the one it does not need is passed on
    /// when it leaves. A newcomer owed one makes later newcomers queue behind it.
    freed: u32,
    /// Asked to check once more: something may have been missed (lagging events, a
    /// resubscription, a cancel).
    recheck: bool,
    doing: Doing,
    /// True during a newcomer's first attempt, made at once: it is not in line yet, so other
    /// newcomers may try at once too.
    newcomer: bool,
    /// How many times the waiter went out on an attempt: an attempt a waker started for it is
    /// only kept if the waiter has not moved since the waker chose it.
    rounds: u64,
    /// Its attempt was refused and it has not read the refusal in time: its task is not running
    /// (see [`WaitQueue::stalled`]). Freed slots skip it until it reads.
    stalled: bool,
}

impl WaiterState {
    fn asked_nothing(&self) -> bool {
        self.freed == 0 && !self.recheck
    }

    /// Goes out on an attempt for `asked`, or on its own.
    fn go_out(&mut self, asked: Option<Asked>) {
        self.doing = asked.map_or(Doing::OwnAttempt, Doing::WokenAttempt);
        self.rounds += 1;
        self.stalled = false;
    }

    /// Takes one wake-up, a freed slot first.
    fn take(&mut self) -> Option<Asked> {
        if self.freed > 0 {
            self.freed -= 1;
            Some(Asked::FreedSlot)
        } else if std::mem::take(&mut self.recheck) {
            Some(Asked::Recheck)
        } else {
            None
        }
    }
}

/// What a wake-up asks of a waiter: to attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asked {
    /// Something may have been missed.
    Recheck,
    /// A slot freed.
    FreedSlot,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Doing {
    /// In line, taking wake-ups.
    #[default]
    Waiting,
    /// Out on an attempt of its own (its first, a poll, its expiry timer): sent maybe before a
    /// slot freed, so a wake-up for that slot is still this waiter's.
    OwnAttempt,
    /// Out on an attempt a wake-up asked for.
    WokenAttempt(Asked),
}

/// A waiter out on one round of attempts, for [`WaitQueue::stalled`].
pub(crate) struct StallToken {
    waiter: Arc<Waiter>,
    rounds: u64,
}

/// A place in the queue; leaving it (drop) hands any pending wake-up to the next waiter.
pub(crate) struct Place<'a> {
    queue: &'a WaitQueue,
    waiter: Arc<Waiter>,
}

impl WaitQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Arc<Waiter>>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waiters in the queue (see `Quota::debug_sizes`).
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Records when the earliest lease expires (from a full reply).
    pub(crate) fn note_expiry(&self, at: Instant) {
        *self.next_expiry.lock().unwrap_or_else(|e| e.into_inner()) = Some(at);
    }

    /// Time until the line's next poll (for waiters behind the head), drawing the one after
    /// (`after()` from now) once the last has passed.
    pub(crate) fn until_line_poll(&self, after: impl FnOnce() -> Duration) -> Duration {
        let now = Instant::now();
        let mut at = self.line_poll_at.lock().unwrap_or_else(|e| e.into_inner());
        let due = match *at {
            Some(due) if due > now => due,
            _ => *at.insert(now + after()),
        };
        due - now
    }

    /// Time until the earliest known expiry, if one is known.
    pub(crate) fn until_expiry(&self) -> Option<Duration> {
        let at = *self.next_expiry.lock().unwrap_or_else(|e| e.into_inner());
        at.map(|at| at.saturating_duration_since(Instant::now()))
    }

    /// Joins the back of the queue, waiting for `task_id`, and says whether it may try at once:
    /// when nobody waits in line (newcomers on their first attempt do not count, unless a freed
    /// slot was already promised to one of them), or when
    /// `skip_line` (the task already holds a lease, so trying takes no slot from anyone). One
    /// that tries joins busy, so a slot freed while its attempt is out is kept for its next
    /// round rather than lost.
    pub(crate) fn join(&self, task_id: &str, skip_line: bool) -> (Place<'_>, bool) {
        let mut queue = self.lock();
        let trying = skip_line
            || queue.iter().all(|w| {
                let state = w.state();
                // A stalled waiter's task does not run: it holds nobody back, whatever slot
                // it was promised (found by review: a newcomer then waited for its line poll).
                state.stalled || (state.newcomer && state.freed == 0)
            });
        let waiter = Arc::new(Waiter {
            task_id: task_id.to_owned(),
            state: Mutex::new(WaiterState {
                doing: if trying {
                    Doing::OwnAttempt
                } else {
                    Doing::Waiting
                },
                newcomer: trying,
                ..WaiterState::default()
            }),
            ..Waiter::default()
        });
        queue.push_back(waiter.clone());
        drop(queue);
        let place = Place {
            queue: self,
            waiter,
        };
        (place, trying)
    }

    /// Gives `asked` to the earliest waiter in line (`next_in_line`); if all are attempting, one
    /// keeps it for its next round (see [`keeper`]) so none is lost.
    fn pass_on(&self, asked: Asked) {
        let queue = self.lock();
        if let Some(w) = next_in_line(queue.iter()).or_else(|| keeper(queue.iter())) {
            w.ask(asked);
        }
    }

    /// A slot was freed: like [`pass_on`](Self::pass_on), but the chosen idle waiter's attempt
    /// is started here, by `start`, so it leaves at once from where the news arrived instead of
    /// after a hop to the waiter's own runtime and back.
    pub(crate) fn wake_one_starting(&self, start: impl FnOnce(&str) -> StartedAttempt) {
        self.give_freed_slot(None, start);
    }

    /// Gives one freed slot to the earliest waiter in line other than `except`
    /// ([`next_in_line`]), starting its attempt if it is idle, or else to a [`keeper`]. Returns
    /// false if there is nobody but `except`.
    fn give_freed_slot(
        &self,
        except: Option<&Arc<Waiter>>,
        start: impl FnOnce(&str) -> StartedAttempt,
    ) -> bool {
        let chosen = {
            let queue = self.lock();
            let others = || {
                queue
                    .iter()
                    .filter(|w| except.is_none_or(|e| !Arc::ptr_eq(w, e)))
            };
            match next_in_line(others()) {
                Some(w) => {
                    let mut state = w.state();
                    // Counted now, so that no other wake-up picks this waiter meanwhile.
                    state.freed += 1;
                    // Out on its own attempt, it tries again at once if that one is refused.
                    let idle = state.doing == Doing::Waiting;
                    Some((w.clone(), idle, state.rounds))
                }
                None => match keeper(others()) {
                    Some(w) => {
                        w.ask(Asked::FreedSlot);
                        None
                    }
                    None => return false,
                },
            }
        };
        if let Some((w, idle, rounds)) = chosen {
            // Started outside the queue's lock: the drop of a lease `start` looks at may free a
            // local slot, which comes back here.
            let started = idle.then(|| start(&w.task_id));
            w.wake(started, rounds);
        }
        true
    }

    /// Something may have been missed (lagging events, a resubscription, a misconfiguration):
    /// every waiter re-checks. The idle ones' attempts are started here, by `start`, in arrival
    /// order, so the oldest still asks first (each from its own runtime, a younger one could
    /// overtake it); one already out tries again after that attempt.
    pub(crate) fn wake_all_starting(&self, start: impl Fn(&str) -> StartedAttempt) {
        let everyone: Vec<(Arc<Waiter>, bool, u64)> = self
            .lock()
            .iter()
            .map(|w| {
                let mut state = w.state();
                let idle = state.doing == Doing::Waiting && state.asked_nothing();
                state.recheck = true;
                (w.clone(), idle, state.rounds)
            })
            .collect();
        for (w, idle, rounds) in everyone {
            let started = idle.then(|| start(&w.task_id));
            w.wake(started, rounds);
        }
    }

    /// The waiters for `task_id` re-check (the task was cancelled); the others keep their turn.
    pub(crate) fn wake_task(&self, task_id: &str) {
        for w in self.lock().iter().filter(|w| w.task_id == task_id) {
            w.ask(Asked::Recheck);
        }
    }

    /// `task_id` now holds a lease in this process: its waiters idle in line try again, and
    /// come back `held`, instead of at their next poll (found by review: a second `acquire` of
    /// a task waited a whole poll for the lease its task had). One out on an attempt, or already
    /// asked to make one, finds the lease when that attempt is answered (`wait_for_slot`); asked
    /// again, the waiter just admitted (its attempt was started for it) would leave with a
    /// re-check it passes on, and a younger waiter would ask for nothing (found by review).
    pub(crate) fn task_admitted(&self, task_id: &str) {
        for w in self.lock().iter().filter(|w| w.task_id == task_id) {
            let idle = {
                let state = w.state();
                state.doing == Doing::Waiting && state.asked_nothing()
            };
            if idle {
                w.ask(Asked::Recheck);
            }
        }
    }

    /// The waiter of `token` was refused and has not read the refusal in time (its task is not
    /// running: a future parked in a `select!`, a blocked runtime), while still out on that
    /// round. Slots freed meanwhile were counted on it, since it would try again at once; they go
    /// to the next waiters instead, which can run, or stay with it if nobody else waits, and
    /// later ones skip it until it reads (found by review: the slot sat free for as long as the
    /// waiter was parked, up to a line poll).
    pub(crate) fn stalled(&self, token: StallToken, start: impl Fn(&str) -> StartedAttempt) {
        let freed = {
            // Under the queue's lock, which a waker holds from choosing a waiter to counting a
            // slot on it: a slot is never counted on a waiter going stalled meanwhile, whose
            // hook has run (found by review).
            let _queue = self.lock();
            let mut state = token.waiter.state();
            if state.rounds != token.rounds || state.doing == Doing::Waiting {
                return;
            }
            state.stalled = true;
            if state.doing == Doing::WokenAttempt(Asked::FreedSlot) {
                // The refusal settled the slot it was woken for: taken by someone else, not to
                // be passed on if the waiter leaves before it reads (found by review).
                state.doing = Doing::WokenAttempt(Asked::Recheck);
            }
            std::mem::take(&mut state.freed)
        };
        for _ in 0..freed {
            if !self.give_freed_slot(Some(&token.waiter), &start) {
                token.waiter.state().freed += 1;
            }
        }
        // A waiter behind it may now be the one to watch expiries (`Place::is_head`).
        self.promote_head();
    }

    fn promote_head(&self) {
        if let Some(head) = head(&self.lock()) {
            // The new head must arm the expiry timer: wake it without asking for an attempt.
            head.notify.notify_one();
        }
    }
}

impl Waiter {
    fn state(&self) -> MutexGuard<'_, WaiterState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks this waiter to attempt (now, or after the attempt it is making).
    fn ask(&self, asked: Asked) {
        {
            let mut state = self.state();
            match asked {
                Asked::FreedSlot => state.freed += 1,
                Asked::Recheck => state.recheck = true,
            }
        }
        self.notify.notify_one();
    }

    /// Wakes this waiter, already asked, handing it the attempt `started` for it if any, as
    /// the waker chose it after `rounds` attempts. A replaced or unwanted one is dropped last,
    /// since its lease's drop takes other locks.
    fn wake(&self, started: Option<StartedAttempt>, rounds: u64) {
        let replaced = started.and_then(|attempt| {
            let state = self.state();
            if state.doing != Doing::Waiting || state.rounds != rounds {
                // The waiter went out on an attempt of its own while this one was being started
                // (and may be back already): kept, this one would answer a later wake-up with a
                // stale result. Dropped instead; a slot it wins is given back at once.
                return Some(attempt);
            }
            self.started
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .replace(attempt)
        });
        self.notify.notify_one();
        drop(replaced);
    }
}

/// The earliest waiter not already asked to attempt and not attempting for an earlier freed
/// slot: idle, or out on an attempt of its own or on a re-check. Such an attempt was sent maybe
/// before the slot freed, so the slot is kept for that waiter, which tries again at once if it
/// is refused (found by review: a slot freed during an older waiter's re-check went to a younger
/// waiter).
fn next_in_line<'a>(mut waiters: impl Iterator<Item = &'a Arc<Waiter>>) -> Option<&'a Arc<Waiter>> {
    waiters.find(|w| {
        let state = w.state();
        state.asked_nothing()
            && state.doing != Doing::WokenAttempt(Asked::FreedSlot)
            && !state.stalled
    })
}

/// Who keeps a wake-up for their next round when every waiter is attempting: the oldest one not
/// stalled and not already keeping one (so that several releases during a round of attempts are
/// spread), else the oldest not stalled, which then keeps several; a stalled one only if nobody
/// else waits (found by review: a slot kept by a parked waiter reached no one who could run).
fn keeper<'a>(waiters: impl Iterator<Item = &'a Arc<Waiter>> + Clone) -> Option<&'a Arc<Waiter>> {
    let mut all = waiters.clone();
    waiters
        .clone()
        .find(|w| {
            let state = w.state();
            !state.stalled && state.asked_nothing()
        })
        .or_else(|| waiters.clone().find(|w| !w.state().stalled))
        .or_else(|| all.next())
}

/// The waiter that watches expiries: the oldest not stalled (one whose task does not run would
/// arm no timer), else the oldest.
fn head(queue: &VecDeque<Arc<Waiter>>) -> Option<&Arc<Waiter>> {
    queue
        .iter()
        .find(|w| !w.state().stalled)
        .or_else(|| queue.front())
}

impl Place<'_> {
    /// This waiter's current round out, for [`WaitQueue::stalled`].
    pub(crate) fn stall_token(&self) -> StallToken {
        StallToken {
            waiter: self.waiter.clone(),
            rounds: self.waiter.state().rounds,
        }
    }

    /// True when this waiter is the oldest in the queue.
    pub(crate) fn is_head(&self) -> bool {
        head(&self.queue.lock()).is_some_and(|w| Arc::ptr_eq(w, &self.waiter))
    }

    /// Waits for a wake-up, unless one is already pending. Returns true if it asks for an
    /// attempt (the waiter is then busy), false when it was only a nudge (promoted to head).
    pub(crate) async fn woken(&self) -> bool {
        if self.take_wake_up() {
            return true;
        }
        self.waiter.notify.notified().await;
        self.take_wake_up()
    }

    fn take_wake_up(&self) -> bool {
        let mut state = self.waiter.state();
        let asked = state.take();
        if asked.is_some() {
            state.go_out(asked);
        }
        asked.is_some()
    }

    /// Marks the waiter busy for an attempt it makes on its own (timer or poll); a wake-up
    /// pending meanwhile is served by that attempt.
    pub(crate) fn attempting(&self) {
        let mut state = self.waiter.state();
        let asked = state.take();
        state.go_out(asked);
    }

    /// The waiter leaves on an attempt that took no slot (the task's lease already held one, or
    /// an error): a freed slot it was woken for is still owed to someone, and is passed on when
    /// the waiter leaves.
    pub(crate) fn took_no_slot(&self) {
        let mut state = self.waiter.state();
        if state.doing == Doing::WokenAttempt(Asked::FreedSlot) {
            state.freed += 1;
            // Counted in `freed` now: not owed a second time when the waiter leaves.
            state.doing = Doing::Waiting;
        }
    }

    /// The waiter leaves with the slot its attempt took: a freed slot it was woken for was
    /// used, and is owed to nobody.
    pub(crate) fn took_slot(&self) {
        self.waiter.state().doing = Doing::Waiting;
    }

    /// The attempt a waker started for this waiter, if any: the waiter uses it instead of
    /// starting its own.
    pub(crate) fn take_started(&self) -> Option<StartedAttempt> {
        self.waiter
            .started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// The attempt found no slot: the waiter waits in line and may take wake-ups.
    pub(crate) fn idle(&self) {
        let mut state = self.waiter.state();
        state.newcomer = false;
        state.doing = Doing::Waiting;
        state.stalled = false;
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let was_head;
        {
            let mut queue = self.queue.lock();
            was_head = head(&queue).is_some_and(|w| Arc::ptr_eq(w, &self.waiter));
            queue.retain(|w| !Arc::ptr_eq(w, &self.waiter));
        }
        let (freed, recheck) = {
            let mut state = self.waiter.state();
            // Dropped (a timeout, a `select!`) while out on an attempt for a freed slot, before
            // that attempt said whether it took the slot: if it took none (an error, the task's
            // lease held elsewhere), nobody else would be told the slot is free until a poll.
            // Passed on: if it did take it, the next waiter is refused once, and woken again
            // when the unclaimed admission is let go.
            let unsettled = state.doing == Doing::WokenAttempt(Asked::FreedSlot);
            // Taken, and the round ended: a stall hook of this round that runs now finds
            // nothing to pass on a second time (found by review).
            let freed = std::mem::take(&mut state.freed) + u32::from(unsettled);
            state.doing = Doing::Waiting;
            (freed, std::mem::take(&mut state.recheck))
        };
        if freed == 0 && !recheck {
            if was_head {
                self.queue.promote_head();
            }
            return;
        }
        // We leave with wake-ups we did not use: pass them on, as what they were (freed slots,
        // or a re-check that waiters who joined since never got).
        for _ in 0..freed {
            self.queue.pass_on(Asked::FreedSlot);
        }
        if recheck {
            self.queue.pass_on(Asked::Recheck);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> StartedAttempt {
        StartedAttempt::Done(Ok(crate::quota::Attempt::Full {
            retry_after: Duration::ZERO,
            cause: crate::FullCause::NoSlot,
        }))
    }

    /// A waiter in line: joined, and refused once.
    fn in_line(q: &WaitQueue) -> Place<'_> {
        let (place, _) = q.join("t", false);
        place.idle();
        place
    }

    /// The freed slot is counted under the queue's lock, the attempt started for it after. A
    /// waiter that takes the wake-up in between (its timer fires: `attempting`, or `woken` finds
    /// it pending) makes its own attempt; the waker's must not be kept, or it would answer the
    /// waiter's next wake-up that starts nothing (a pass-on, a keeper, a timer) with a stale
    /// result. `back_first`: the waiter's own attempt also came back (full) before the waker
    /// handed its attempt over, so the waiter is idle again then.
    async fn no_stale_attempt_is_left(back_first: bool) {
        let q = WaitQueue::default();
        let a = in_line(&q);
        q.wake_one_starting(|_| {
            // Meanwhile, on the waiter's runtime: its poll timer fires.
            a.attempting();
            assert!(
                a.take_started().is_none(),
                "nothing stored yet: it starts its own"
            );
            if back_first {
                a.idle();
            }
            full()
        });
        if !back_first {
            a.idle(); // its own attempt came back full
        }
        // Later, a freed slot passed on by a waiter that left with it unused.
        q.pass_on(Asked::FreedSlot);
        assert!(a.woken().await);
        assert!(
            a.take_started().is_none(),
            "the freed slot is answered by the stale attempt started for an earlier wake-up"
        );
    }

    #[tokio::test]
    async fn no_stale_attempt_is_left_when_the_waiter_takes_the_wake_up_first() {
        no_stale_attempt_is_left(false).await;
    }

    #[tokio::test]
    async fn no_stale_attempt_is_left_when_the_waiters_own_attempt_ends_first() {
        no_stale_attempt_is_left(true).await;
    }

    #[tokio::test]
    async fn wake_one_goes_to_the_oldest_idle_waiter() {
        let q = WaitQueue::default();
        let a = in_line(&q);
        let b = in_line(&q);
        assert!(a.is_head() && !b.is_head());
        q.pass_on(Asked::FreedSlot);
        assert!(a.woken().await, "the oldest waiter is asked to attempt");
        // `a` is busy attempting: the next wake-up goes to the next idle waiter.
        q.pass_on(Asked::FreedSlot);
        assert!(
            b.woken().await,
            "a second wake-up goes to the next idle waiter"
        );
        drop(a);
        assert!(b.is_head());
    }

    #[tokio::test]
    async fn wake_ups_while_all_are_busy_are_kept_by_the_head() {
        let q = WaitQueue::default();
        let a = in_line(&q);
        q.pass_on(Asked::FreedSlot);
        assert!(a.woken().await);
        q.pass_on(Asked::FreedSlot); // arrives while `a` attempts
        a.idle();
        assert!(
            a.woken().await,
            "the head retries instead of losing the wake-up"
        );
    }

    #[test]
    fn newcomers_on_their_first_attempt_do_not_form_a_line() {
        let q = WaitQueue::default();
        let (a, a_tries) = q.join("a", false);
        let (b, b_tries) = q.join("b", false);
        assert!(a_tries && b_tries, "nobody in line: both try at once");
        a.idle(); // refused: now it waits in line
        let (c, c_tries) = q.join("c", false);
        assert!(!c_tries, "behind a waiter in line");
        let (_d, d_tries) = q.join("d", true);
        assert!(d_tries, "a task that holds may always try");
        drop((a, b, c));
    }

    #[tokio::test]
    async fn wake_ups_while_all_attempt_are_kept_by_several_waiters() {
        let q = WaitQueue::default();
        let (a, _) = q.join("a", false);
        let (b, _) = q.join("b", false);
        // Two releases while both newcomers are out on their first attempt.
        q.pass_on(Asked::FreedSlot);
        q.pass_on(Asked::FreedSlot);
        a.idle();
        b.idle();
        let within = |f| tokio::time::timeout(Duration::from_secs(1), f);
        assert!(
            matches!(within(a.woken()).await, Ok(true)),
            "the first keeps one"
        );
        assert!(
            matches!(within(b.woken()).await, Ok(true)),
            "and the second the other"
        );
    }

    #[tokio::test]
    async fn a_waiter_out_on_its_own_attempt_keeps_the_wake_up_from_younger_ones() {
        let q = WaitQueue::default();
        let a = in_line(&q);
        let b = in_line(&q);
        a.attempting(); // its poll is out; a slot frees meanwhile
        let mut started = Vec::new();
        q.wake_one_starting(|id| {
            started.push(id.to_owned());
            full()
        });
        assert!(
            started.is_empty(),
            "a younger waiter was started ahead of the head"
        );
        a.idle(); // the poll was refused
        let within = |f| tokio::time::timeout(Duration::from_millis(100), f);
        assert!(
            matches!(within(a.woken()).await, Ok(true)),
            "the head tries again at once"
        );
        assert!(within(b.woken()).await.is_err(), "the younger one waits");
    }

    #[test]
    fn a_newcomer_promised_a_freed_slot_makes_a_line() {
        let q = WaitQueue::default();
        let (a, a_tries) = q.join("a", false);
        assert!(a_tries);
        q.pass_on(Asked::FreedSlot); // a slot frees while a's first attempt is out
        let (b, b_tries) = q.join("b", false);
        assert!(!b_tries, "b would take the slot a is to retry for");
        drop((a, b));
        let q = WaitQueue::default();
        let (a, _) = q.join("a", false);
        q.wake_all_starting(|_| full()); // a mere re-check (a resubscription) promises nothing
        let (b, b_tries) = q.join("b", false);
        assert!(b_tries, "newcomers do not queue behind a re-check");
        drop((a, b));
    }

    #[tokio::test]
    async fn an_unused_re_check_is_passed_on_as_a_re_check() {
        let q = WaitQueue::default();
        let a = in_line(&q);
        q.wake_all_starting(|_| full()); // a re-check for everyone in line: only `a`
        let b = in_line(&q); // joins after it
        drop(a); // leaves without using it
        let within = |f| tokio::time::timeout(Duration::from_millis(100), f);
        assert!(
            matches!(within(b.woken()).await, Ok(true)),
            "b checks instead"
        );
        let (_c, c_tries) = q.join("c", false);
        assert!(
            !c_tries,
            "a passed re-check promises b no slot, but b is in line"
        );
    }

    #[tokio::test]
    async fn an_unused_wake_up_is_passed_on() {
        let q = WaitQueue::default();
        let a = in_line(&q);
        let b = in_line(&q);
        q.pass_on(Asked::FreedSlot);
        drop(a); // leaves (timeout) holding an unused wake-up
        assert!(b.woken().await);
    }

    async fn woken_soon(p: &Place<'_>) -> bool {
        matches!(
            tokio::time::timeout(Duration::from_millis(100), p.woken()).await,
            Ok(true)
        )
    }

    /// A slot freed while every runnable waiter is attempting is kept by one of them, not by a
    /// stalled (parked) waiter (found by review).
    #[tokio::test]
    async fn a_slot_freed_while_others_attempt_is_not_kept_by_a_stalled_waiter() {
        let q = WaitQueue::default();
        let a = in_line(&q);
        let b = in_line(&q);
        a.attempting(); // a's poll goes out ...
        q.stalled(a.stall_token(), |_| full()); // ... is refused, a's future is parked: the hook runs
        q.pass_on(Asked::FreedSlot); // slot 1 frees: b, idle, is woken
        assert!(b.woken().await); // b out for slot 1
                                  // slot 2 frees while b is out: nobody in line -> keeper
        q.wake_one_starting(|_| full());
        // b refused (another process took slot 1); b reads it at once
        b.idle();
        assert!(
            woken_soon(&b).await,
            "slot 2 sits with the parked waiter a (keeper ignores `stalled`); runnable b is not told"
        );
    }

    /// A stalled waiter's freed slot goes to a runnable waiter, even one out on an attempt, rather
    /// than to another stalled waiter (found by review).
    #[tokio::test]
    async fn a_stalled_waiters_slot_goes_to_a_runnable_waiter_not_another_stalled_one() {
        let q = WaitQueue::default();
        let c = in_line(&q);
        let a = in_line(&q);
        let b = in_line(&q);
        c.attempting();
        q.stalled(c.stall_token(), |_| full()); // c parked
        a.attempting(); // a's poll out
        q.pass_on(Asked::FreedSlot); // slot 1: counted on a (out on its own attempt)
        q.pass_on(Asked::FreedSlot); // slot 2: b
        assert!(b.woken().await); // b out for slot 2
        q.stalled(a.stall_token(), |_| full()); // a refused, parked: its slot 1 is passed on...
        b.idle(); // b refused (slot 2 taken by another process), reads at once
        assert!(
            woken_soon(&b).await,
            "slot 1 went to the parked waiter c, whose hook already ran; runnable b never hears of it"
        );
        drop((a, c));
    }

    /// The stall hook runs just as the waiter's future is dropped: the slot `Place::drop` passed
    /// on is not passed on a second time (found by review).
    #[tokio::test]
    async fn a_stall_hook_after_the_waiter_left_passes_nothing_twice() {
        let q = WaitQueue::default();
        let a = in_line(&q);
        let b = in_line(&q);
        let c = in_line(&q);
        a.attempting();
        q.pass_on(Asked::FreedSlot); // one slot, counted on a
        let token = a.stall_token();
        drop(a); // a leaves (acquire_timeout elapsed): its slot goes to b
        q.stalled(token, |_| full()); // the hook, already under way, completes
        assert!(woken_soon(&b).await);
        assert!(
            !woken_soon(&c).await,
            "one freed slot woke two waiters: counted by Place::drop and again by the hook"
        );
    }

    /// A stalled waiter's refusal settled the slot it was woken for (taken elsewhere): if its
    /// future is dropped before it reads, nothing is passed on for that slot (found by review).
    #[tokio::test]
    async fn a_stalled_waiter_that_leaves_passes_on_no_phantom_slot() {
        let q = WaitQueue::default();
        let a = in_line(&q);
        let b = in_line(&q);
        q.pass_on(Asked::FreedSlot); // a slot frees: a goes out for it
        assert!(a.woken().await);
        // a's attempt is refused (another process took the slot), and its future is parked
        // past the grace: the hook runs, with nothing counted on a to pass on.
        q.stalled(a.stall_token(), |_| full());
        drop(a); // its future is dropped (a timeout), the refusal never read
        assert!(
            !woken_soon(&b).await,
            "b was asked to attempt for a slot nobody freed"
        );
    }
}
