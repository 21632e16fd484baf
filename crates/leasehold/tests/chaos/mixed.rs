//! The mixed phase: faults drawn from a seeded schedule, overlapping, all on one fleet.

use std::time::{Duration, Instant};

use super::checker::Faults;
use super::fleet::Fleet;
use super::model::{now_ns, Cancel, Ns, Window, MS};
use super::ops::Ops;
use super::phase::{run_for, Phase, PhaseRecord};
use super::scenarios::Plan;

/// A fault that ends later, and what ending it takes.
#[derive(Debug, Clone, Copy)]
enum Undo {
    Resume(usize),
    Heal(usize),
    Unstall(usize),
    LatencyOff,
    RedisResume,
}

/// What starting a drawn fault did.
enum Injected {
    /// Nothing fitted (no holder with enough work left, say).
    Skipped,
    /// Done, over at once.
    Done,
    /// Done, and lasts until undone.
    Lasting(Undo),
}

/// The delay a drawn "latency" adds each way on every proxy (+200 ms per round trip).
const LATENCY: Duration = Duration::from_millis(100);

/// What the schedule can draw.
const ACTIONS: [&str; 8] = [
    "kill",
    "pause",
    "partition",
    "stall",
    "latency",
    "drop-connections",
    "cancel",
    "cancel-marker",
];

/// Runs the mixed phase for `length`, plus one Redis pause in the middle.
pub fn mixed(
    fleet: &mut Fleet,
    ops: &Ops,
    plan: &mut Plan,
    length: Duration,
    seed: u64,
) -> (PhaseRecord, Faults) {
    let mut p = Phase::begin(fleet, "7-mixed", "");
    let ttl = fleet.settings.ttl;
    let began = Instant::now();
    let end = began + length;
    let mut next = began + Duration::from_millis(800);
    let mut redis_paused_once = false;
    let mut pending: Vec<(Instant, Undo, Ns)> = Vec::new();
    // Draws that found something to hit count as injected; the phase fails if none did.
    let mut faults = Faults::planned(0);
    faults.unit = "draw";
    // Bounded: the schedule ends at `end`, and every undo is due within 2 x ttl of it.
    while Instant::now() < end || !pending.is_empty() {
        let now = Instant::now();
        pending.sort_by_key(|(due, _, _)| *due);
        while pending.first().is_some_and(|(due, _, _)| *due <= now) {
            let (_, undo, start) = pending.remove(0);
            undo_fault(fleet, &mut p, undo, start);
        }
        if now >= next && now < end {
            let busy: Vec<usize> = pending
                .iter()
                .filter_map(|(_, u, _)| match u {
                    Undo::Resume(k) | Undo::Heal(k) | Undo::Unstall(k) => Some(*k),
                    _ => None,
                })
                .collect();
            let action = if !redis_paused_once && now >= began + length / 2 {
                redis_paused_once = true;
                "redis-pause"
            } else {
                ACTIONS[plan.rng.below(ACTIONS.len() as u64) as usize]
            };
            let latency_on = pending
                .iter()
                .any(|(_, u, _)| matches!(u, Undo::LatencyOff));
            let redis_down = pending
                .iter()
                .any(|(_, u, _)| matches!(u, Undo::RedisResume));
            let injected = inject(
                fleet, ops, &mut p, plan, action, &busy, latency_on, redis_down,
            );
            if let Injected::Lasting(undo) = injected {
                let lasts = match undo {
                    Undo::LatencyOff => Duration::from_secs(2),
                    Undo::RedisResume => ttl * 6 / 5,
                    _ => ttl * 3 / 2,
                };
                pending.push((Instant::now() + lasts, undo, now_ns()));
            }
            faults.planned += 1;
            if !matches!(injected, Injected::Skipped) {
                faults.add(action);
            }
            next = now + Duration::from_millis(600 + plan.rng.below(800));
        }
        let wake = pending
            .iter()
            .map(|(due, _, _)| *due)
            .chain((next < end).then_some(next))
            .min()
            .unwrap_or(now);
        std::thread::sleep(
            wake.saturating_duration_since(Instant::now())
                .min(Duration::from_millis(50)),
        );
    }
    p.lifted();
    faults.injected.sort();
    p.record().fault = format!("seed {seed}, overlapping faults");
    run_for(Duration::from_millis(1500));
    (p.finish(fleet, ops), faults)
}

/// Starts `action`; says whether it did, and how to end it if it lasts.
#[allow(clippy::too_many_arguments)]
fn inject(
    fleet: &mut Fleet,
    ops: &Ops,
    p: &mut Phase,
    plan: &mut Plan,
    action: &str,
    busy: &[usize],
    latency_on: bool,
    redis_down: bool,
) -> Injected {
    let holder = |min_left: i64| {
        fleet
            .holders()
            .into_iter()
            .find(|h| h.remaining_ms >= min_left && !busy.contains(&h.worker))
    };
    let idle_slot = |rng: &mut super::model::Rng| {
        let free: Vec<usize> = (0..fleet.settings.workers)
            .filter(|k| !busy.contains(k))
            .collect();
        free.get(rng.below(free.len().max(1) as u64) as usize)
            .copied()
    };
    let lasting = |undo: Option<Undo>| undo.map_or(Injected::Skipped, Injected::Lasting);
    match action {
        "kill" => match holder(50) {
            // Not a reuse measurement: other faults overlap; the kill still ends its interval.
            Some(victim) => {
                fleet.kill_and_respawn(victim.worker);
                Injected::Done
            }
            None => Injected::Skipped,
        },
        "pause" => lasting(holder(100).map(|victim| {
            fleet.pause(victim.worker);
            Undo::Resume(victim.worker)
        })),
        "partition" => lasting(idle_slot(&mut plan.rng).map(|k| {
            fleet.proxies[k].partition(true);
            Undo::Heal(k)
        })),
        "stall" => lasting(idle_slot(&mut plan.rng).map(|k| {
            fleet.proxies[k].stall(true);
            Undo::Unstall(k)
        })),
        "latency" if !latency_on => {
            fleet.each_proxy(|proxy| proxy.set_latency(LATENCY));
            Injected::Lasting(Undo::LatencyOff)
        }
        "drop-connections" => {
            fleet.each_proxy(|proxy| proxy.drop_connections());
            Injected::Done
        }
        "cancel" | "cancel-marker" if !redis_down => {
            let Some(victim) = holder(600) else {
                return Injected::Skipped;
            };
            let at = now_ns();
            let sent = if action == "cancel" {
                ops.cancel(&victim.id)
            } else {
                ops.cancel_marker_only(&fleet.server, &victim.id)
            };
            if !sent {
                return Injected::Skipped;
            }
            p.record().cancels.push(Cancel { id: victim.id, at });
            Injected::Done
        }
        "redis-pause" => {
            fleet.server.pause();
            Injected::Lasting(Undo::RedisResume)
        }
        _ => Injected::Skipped,
    }
}

fn undo_fault(fleet: &mut Fleet, p: &mut Phase, undo: Undo, start: Ns) {
    // The fault ends when lifting it begins: a resumed Redis or a healed link may answer, and a
    // worker start work, before the lift call returns.
    let lifting = now_ns();
    match undo {
        Undo::Resume(k) => fleet.resume(k),
        Undo::Heal(k) => fleet.proxies[k].partition(false),
        Undo::Unstall(k) => fleet.proxies[k].stall(false),
        Undo::LatencyOff => fleet.each_proxy(|proxy| proxy.set_latency(Duration::ZERO)),
        Undo::RedisResume => fleet.server.resume(),
    }
    let w = Window::new(start, lifting);
    let lifted = now_ns();
    let r = p.record();
    match undo {
        Undo::Resume(k) => {
            // Ends as SIGCONT is sent, taken just before it: the resumed worker may run at once
            // (on a loaded machine it can preempt the test) and end its work before `lifted`.
            // The resumed holder's stop is measured from there.
            r.paused.push((k, w));
            r.allowed
                .push((Window::new(w.start, lifted + 300 * MS), "paused holder"));
        }
        Undo::Heal(k) | Undo::Unstall(k) => r.isolated.push((k, w)),
        Undo::RedisResume => r.outages.push((w, true)),
        Undo::LatencyOff => r.slowed.push((Window::new(start, lifted), LATENCY)),
    }
}
