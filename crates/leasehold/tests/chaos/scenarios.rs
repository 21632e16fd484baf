//! The single-fault phases, each with its own fault and its own record.

use std::time::Duration;

use super::checker::Faults;
use super::fleet::Fleet;
use super::model::{now_ns, Cancel, Rng, Window, MS};
use super::ops::Ops;
use super::phase::{run_for, Phase, PhaseRecord};

/// How long the suite runs, and its random choices.
pub struct Plan {
    /// The long run (`LEASEHOLD_CHAOS_LONG=1`).
    pub long: bool,
    /// Chooses victims.
    pub rng: Rng,
}

impl Plan {
    /// `short` rounds in the default run, `long` in the long one.
    pub fn rounds(&self, short: usize, long: usize) -> usize {
        if self.long {
            long
        } else {
            short
        }
    }
}

/// Time the fleet works before a phase's first fault.
const WARM_UP: Duration = Duration::from_millis(1000);
/// Time it works after the last fault, to show it recovered.
const RECOVERY: Duration = Duration::from_millis(1500);
/// The same after Redis lost its data: the short-circuit's cool-down (up to 1.5 s) and the
/// one-ttl quarantine come first.
const RECOVERY_AFTER_LOSS: Duration = Duration::from_millis(3500);
/// How long to wait for a worker to be holding.
const FIND_HOLDER: Duration = Duration::from_secs(3);
/// 2-short pauses a holder at most this long after it started working.
const FRESH_MS: i64 = 100;

fn nanos(d: Duration) -> u128 {
    d.as_nanos()
}

/// 1: SIGKILL one or two random holders at a time, respawn them at once.
pub fn kills(fleet: &mut Fleet, ops: &Ops, plan: &mut Plan) -> (PhaseRecord, Faults) {
    let mut p = Phase::begin(fleet, "1-kill", "SIGKILL 1-2 random holders, respawned");
    run_for(WARM_UP);
    let rounds = plan.rounds(3, 12);
    let mut faults = Faults::planned(rounds);
    for round in 0..rounds {
        let victims = 1 + plan.rng.below(2) as usize;
        let mut busy = Vec::new();
        for k in 0..victims {
            // A round's first victim is waited for; a second one only taken if already there.
            let within = if k == 0 { FIND_HOLDER } else { Duration::ZERO };
            let holders = fleet.wait_for_holders(1, within, |h| {
                h.remaining_ms >= 100 && !busy.contains(&h.worker)
            });
            if holders.is_empty() {
                continue;
            }
            let victim = &holders[plan.rng.below(holders.len() as u64) as usize];
            busy.push(victim.worker);
            let kill = fleet.kill_and_respawn(victim.worker);
            p.record().kills.push(kill);
            faults.add("SIGKILL");
        }
        if round + 1 == rounds {
            p.lifted();
        }
        // Longer than one ttl: the dead leases expire and their slots are reused in between.
        run_for(fleet.settings.ttl * 2 + Duration::from_millis(300));
    }
    (p.finish(fleet, ops), faults)
}

/// 2: SIGSTOP a holder for twice the ttl, then SIGCONT.
pub fn pause_worker(fleet: &mut Fleet, ops: &Ops, plan: &mut Plan) -> (PhaseRecord, Faults) {
    let mut p = Phase::begin(fleet, "2-pause-worker", "SIGSTOP a holder for 2 x ttl");
    run_for(WARM_UP);
    let rounds = plan.rounds(1, 4);
    let mut faults = Faults::planned(rounds);
    for _ in 0..rounds {
        let Some(holder) = fleet.wait_for_holder(200, &[], FIND_HOLDER) else {
            continue;
        };
        let start = now_ns();
        fleet.pause(holder.worker);
        faults.add("SIGSTOP");
        run_for(fleet.settings.ttl * 2);
        // Taken just before SIGCONT: the resumed worker may run at once (on a loaded machine it
        // can preempt the test) and end its work before a time taken after the signal.
        let sigcont = now_ns();
        fleet.resume(holder.worker);
        let end = now_ns();
        p.lifted();
        let r = p.record();
        // Ends as SIGCONT is sent: the resumed holder's stop is measured from there.
        r.paused.push((holder.worker, Window::new(start, sigcont)));
        r.allowed
            .push((Window::new(start, end + 300 * MS), "paused holder"));
        run_for(RECOVERY);
    }
    (p.finish(fleet, ops), faults)
}

/// 2 (short): SIGSTOP a holder for one heartbeat (ttl / 3), less than its lease has left: the
/// lease must survive (no false expiry, no self-fencing).
///
/// The holder is taken within `FRESH_MS` of the start of its work, so that the pause covers its
/// lease's first renewal (due one heartbeat after its acquire was sent) while the lease still
/// has most of its ttl: its local deadline is ttl - ttl / 20 = 950 ms after the acquire was
/// sent, the pause ends at most 100 + 333 ms after the work started, so the renewal sent on
/// resume has about 500 ms (less the acquire's round trip) to be answered. A holder taken at any
/// point of its lease, as before, could be paused just before a renewal was due, leaving
/// 950 - 2 x 333 = 284 ms, too little on a loaded 2-core machine. A lease lost here is still a
/// defect: a false expiry, self-fencing on resume, or no renewal at once after a missed beat.
pub fn pause_worker_short(fleet: &mut Fleet, ops: &Ops, plan: &mut Plan) -> (PhaseRecord, Faults) {
    let pause = ops.heartbeat();
    let mut p = Phase::begin(
        fleet,
        "2-pause-short",
        "SIGSTOP a fresh holder for ttl / 3, over its first renewal",
    );
    p.record().no_loss_expected = true;
    run_for(WARM_UP);
    let rounds = plan.rounds(2, 6);
    let mut faults = Faults::planned(rounds);
    for _ in 0..rounds {
        let found = fleet.wait_for_holders(1, FIND_HOLDER, |h| {
            h.elapsed_ms <= FRESH_MS && h.remaining_ms >= 600
        });
        let Some(holder) = found.into_iter().next() else {
            continue;
        };
        fleet.pause(holder.worker);
        faults.add("SIGSTOP");
        run_for(pause);
        fleet.resume(holder.worker);
        p.lifted();
        run_for(Duration::from_millis(700));
    }
    run_for(RECOVERY);
    (p.finish(fleet, ops), faults)
}

/// 3a: Redis killed and restarted empty (no persistence), after `down`.
pub fn restart(
    fleet: &mut Fleet,
    ops: &Ops,
    plan: &mut Plan,
    down: Duration,
) -> (PhaseRecord, Faults) {
    let fast = down < fleet.settings.ttl;
    let (name, fault) = if fast {
        (
            "3a-restart-fast",
            "Redis SIGKILLed and restarted empty at once",
        )
    } else {
        (
            "3a-restart-slow",
            "Redis SIGKILLed, down 1.5 x ttl, restarted empty",
        )
    };
    let mut p = Phase::begin(fleet, name, fault);
    run_for(WARM_UP);
    let rounds = plan.rounds(1, 3);
    let mut faults = Faults::planned(rounds);
    for _ in 0..rounds {
        fleet.server.kill();
        faults.add("Redis SIGKILL + restart");
        // Once the kill took effect: until then a renewal may still be answered.
        let start = now_ns();
        run_for(down);
        let lifting = now_ns();
        fleet.server.restart();
        let back = now_ns();
        p.lifted();
        let ttl = nanos(fleet.settings.ttl);
        let r = p.record();
        r.outages.push((Window::new(start, lifting), !fast));
        r.allowed.push((
            Window::new(start, back + ttl),
            "restart without persistence",
        ));
        run_for(RECOVERY_AFTER_LOSS);
    }
    (p.finish(fleet, ops), faults)
}

/// 3b: Redis SIGSTOPped for 1.5 x ttl, then SIGCONT.
pub fn pause_redis(fleet: &mut Fleet, ops: &Ops, plan: &mut Plan) -> (PhaseRecord, Faults) {
    let mut p = Phase::begin(fleet, "3b-pause-redis", "Redis SIGSTOPped for 1.5 x ttl");
    run_for(WARM_UP);
    let rounds = plan.rounds(1, 3);
    let mut faults = Faults::planned(rounds);
    for _ in 0..rounds {
        fleet.server.pause();
        faults.add("Redis SIGSTOP");
        // Once the pause took effect: until then a renewal may still be answered.
        let start = now_ns();
        run_for(fleet.settings.ttl * 3 / 2);
        let lifting = now_ns();
        fleet.server.resume();
        p.redis_back(start, lifting);
        run_for(RECOVERY);
    }
    (p.finish(fleet, ops), faults)
}

/// 3c: a script keeps Redis busy for 1.5 x ttl; every other client gets `BUSY` meanwhile.
pub fn busy_redis(fleet: &mut Fleet, ops: &Ops, plan: &mut Plan) -> (PhaseRecord, Faults) {
    let mut p = Phase::begin(
        fleet,
        "3c-busy-redis",
        "a script keeps Redis BUSY for 1.5 x ttl",
    );
    let server = &fleet.server;
    let threshold = server.command(&["CONFIG", "SET", "busy-reply-threshold", "100"]);
    assert_eq!(
        threshold.as_string().as_deref(),
        Some("OK"),
        "{threshold:?}"
    );
    run_for(WARM_UP);
    let rounds = plan.rounds(1, 3);
    let mut faults = Faults::planned(rounds);
    for _ in 0..rounds {
        let start = now_ns();
        // Set when the test starts killing the script: from then on Redis may answer.
        let mut lifting = start;
        std::thread::scope(|scope| {
            let script = scope.spawn(|| {
                // Read-only, so SCRIPT KILL may stop it; TIME-free, so it runs on any version.
                let args = ["EVAL", "while true do end", "0"];
                server.try_command_timeout(&args, Duration::from_secs(10))
            });
            run_for(fleet.settings.ttl * 3 / 2);
            lifting = now_ns();
            let end = std::time::Instant::now() + Duration::from_secs(5);
            while server
                .try_command(&["SCRIPT", "KILL"])
                .is_ok_and(|r| r.is_error_starting_with("NOTBUSY"))
                && std::time::Instant::now() < end
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            let reply = script.join().expect("the script thread");
            assert!(
                matches!(&reply, Ok(r) if r.is_error_starting_with("ERR Script killed")),
                "the busy script ended with {reply:?}"
            );
        });
        faults.add("Redis BUSY");
        p.redis_back(start, lifting);
        run_for(RECOVERY);
    }
    (p.finish(fleet, ops), faults)
}

/// 4: one holder partitioned (connections refused) and another stalled (half-open link) for
/// 2 x ttl; the rest of the fleet stays healthy.
pub fn partition(fleet: &mut Fleet, ops: &Ops, plan: &mut Plan) -> (PhaseRecord, Faults) {
    let mut p = Phase::begin(
        fleet,
        "4-partition",
        "one holder partitioned, another stalled, 2 x ttl",
    );
    run_for(WARM_UP);
    let rounds = plan.rounds(1, 4);
    let mut faults = Faults::planned(rounds);
    for _ in 0..rounds {
        // Both holders from one look, cut at once: a first one found while waiting for a
        // second could have finished its work before its cut.
        let found = fleet.wait_for_holders(2, FIND_HOLDER, |h| h.remaining_ms >= 150);
        let Some(cut) = found.first().cloned() else {
            continue;
        };
        let stalled = found.get(1).cloned();
        fleet.proxies[cut.worker].partition(true);
        faults.add("partition");
        if let Some(s) = &stalled {
            fleet.proxies[s.worker].stall(true);
            faults.add("stall");
        }
        // Once both cuts took effect: until then a renewal may still be answered.
        let start = now_ns();
        run_for(fleet.settings.ttl * 2);
        let end = now_ns();
        fleet.proxies[cut.worker].partition(false);
        if let Some(s) = &stalled {
            fleet.proxies[s.worker].stall(false);
        }
        p.lifted();
        let r = p.record();
        r.isolated.push((cut.worker, Window::new(start, end)));
        if let Some(s) = stalled {
            r.isolated.push((s.worker, Window::new(start, end)));
        }
        run_for(RECOVERY);
    }
    (p.finish(fleet, ops), faults)
}

/// 5: `each_way` added to every chunk in both directions on every proxy.
pub fn latency(
    fleet: &mut Fleet,
    ops: &Ops,
    plan: &mut Plan,
    each_way: Duration,
) -> (PhaseRecord, Faults) {
    let round_trip = each_way * 2;
    let heavy = round_trip >= fleet.settings.ttl / 3;
    let name = if heavy {
        "5b-latency-heavy"
    } else {
        "5-latency"
    };
    let fault = format!(
        "+{} ms per Redis round trip on every worker",
        round_trip.as_millis()
    );
    let mut p = Phase::begin(fleet, name, &fault);
    p.record().no_loss_expected = !heavy;
    run_for(WARM_UP);
    let mut faults = Faults::planned(1);
    fleet.each_proxy(|proxy| proxy.set_latency(each_way));
    faults.add("latency");
    let slowed_from = now_ns();
    run_for(Duration::from_millis(plan.rounds(3000, 12_000) as u64));
    fleet.each_proxy(|proxy| proxy.set_latency(Duration::ZERO));
    p.lifted();
    let slowed = Window::new(slowed_from, p.record().faults_lifted);
    p.record().slowed.push((slowed, each_way));
    run_for(RECOVERY);
    (p.finish(fleet, ops), faults)
}

/// How a cancel reaches its holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelPath {
    /// Marker and Pub/Sub message, both delivered.
    PubSub,
    /// Marker and message, but every proxy drops Pub/Sub deliveries (release events too).
    PushesDropped,
    /// The marker alone, written by the test; no message is ever published.
    MarkerOnly,
}

/// 6: cancels of running tasks, along `path`.
pub fn cancels(
    fleet: &mut Fleet,
    ops: &Ops,
    plan: &mut Plan,
    path: CancelPath,
) -> (PhaseRecord, Faults) {
    let (name, fault) = match path {
        CancelPath::PubSub => ("6a-cancel", "cancels, Pub/Sub delivered"),
        CancelPath::PushesDropped => (
            "6b-cancel-lost-pubsub",
            "cancels; proxies drop every Pub/Sub delivery",
        ),
        CancelPath::MarkerOnly => ("6c-cancel-marker-only", "cancel marker written, no PUBLISH"),
    };
    let mut p = Phase::begin(fleet, name, fault);
    let dropped = path == CancelPath::PushesDropped;
    fleet.each_proxy(|proxy| proxy.drop_pushes(dropped));
    run_for(WARM_UP);
    let rounds = plan.rounds(3, 10);
    let mut faults = Faults::planned(rounds);
    for _ in 0..rounds {
        let Some(holder) = fleet.wait_for_holder(600, &[], FIND_HOLDER) else {
            continue;
        };
        let at = now_ns();
        let sent = match path {
            CancelPath::MarkerOnly => ops.cancel_marker_only(&fleet.server, &holder.id),
            _ => ops.cancel(&holder.id),
        };
        assert!(sent, "{name}: the cancel of {} failed", holder.id);
        p.record().cancels.push(Cancel { id: holder.id, at });
        faults.add("cancel");
        run_for(Duration::from_millis(700));
    }
    fleet.each_proxy(|proxy| proxy.drop_pushes(false));
    p.lifted();
    run_for(RECOVERY);
    (p.finish(fleet, ops), faults)
}

/// 8: Redis down for 1.5 x ttl with the whole fleet on the backend-down `policy` (`open` or
/// `degrade:N`): what the policy admits while Redis cannot answer. The fleet goes back to
/// failing closed afterwards.
pub fn outage_policy(fleet: &mut Fleet, ops: &Ops, policy: &str) -> (PhaseRecord, Faults) {
    fleet.respawn_all(policy);
    let name = format!("8-outage-{}", policy.replace(':', ""));
    let fault = format!("Redis down 1.5 x ttl, workers on policy {policy}");
    let mut p = Phase::begin(fleet, &name, &fault);
    p.record().policy_admits = true;
    run_for(WARM_UP);
    let mut faults = Faults::planned(1);
    fleet.server.kill();
    faults.add("Redis down");
    // Once the kill took effect: until then a renewal may still be answered.
    let start = now_ns();
    run_for(fleet.settings.ttl * 3 / 2);
    let lifting = now_ns();
    fleet.server.restart();
    let back = now_ns();
    p.lifted();
    // The short-circuit may stay open up to 1.5 x its 1 s cool-down after Redis is back, and
    // local leases granted until then run to their end.
    let tail = nanos(Duration::from_millis(1500 + fleet.settings.hold_ms.1 + 300));
    let r = p.record();
    r.outages.push((Window::new(start, lifting), true));
    r.allowed.push((
        Window::new(start, back + tail),
        "policy admits while Redis is down",
    ));
    run_for(RECOVERY_AFTER_LOSS);
    let record = p.finish(fleet, ops);
    fleet.respawn_all("closed");
    (record, faults)
}
