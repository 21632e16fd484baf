//! One phase of the suite: the fleet works, a fault is injected and lifted, the fleet goes quiet
//! for one ttl, and the leftovers are checked. The record says what the test did and when.

use std::time::Duration;

use super::fleet::Fleet;
use super::model::{now_ns, Cancel, Kill, Ns, Window};
use super::ops::{Leak, Ops};

/// What the test did during one phase, with monotonic times.
#[derive(Debug, Clone)]
pub struct PhaseRecord {
    /// Short name (the table's first column).
    pub name: String,
    /// What was injected.
    pub fault: String,
    /// From the start of work to the moment the workers were told to go quiet.
    pub window: Window,
    /// When the last fault was lifted (work starting after it shows the fleet recovered).
    pub faults_lifted: Ns,
    /// Named windows in which running above the limit is a documented, bounded exception.
    pub allowed: Vec<(Window, &'static str)>,
    /// Redis unreachable for everyone (killed or SIGSTOPped): no admission may start inside.
    /// The flag says whether the cut lasts long enough that every holder must have stopped
    /// within one ttl of its start (it cannot renew).
    pub outages: Vec<(Window, bool)>,
    /// One worker cut off from Redis (partition or stall): it may start nothing inside.
    pub isolated: Vec<(usize, Window)>,
    /// Proxies delaying every chunk by this much each way: a grant the server sent just before
    /// a cut then reaches its worker up to that much after the cut's start.
    pub slowed: Vec<(Window, Duration)>,
    /// Workers SIGSTOPped, with the pause.
    pub paused: Vec<(usize, Window)>,
    /// SIGKILLs sent while the worker was holding.
    pub kills: Vec<Kill>,
    /// Cancels issued for running tasks.
    pub cancels: Vec<Cancel>,
    /// Whether the workers' backend-down policy admits while Redis cannot answer (admissions
    /// during an outage are then counted, not a failure).
    pub policy_admits: bool,
    /// Whether every lease must survive the phase (no loss is expected from its fault).
    pub no_loss_expected: bool,
    /// The end-of-phase check.
    pub leak: Leak,
}

impl PhaseRecord {
    /// An empty record of the phase `name`, injecting `fault`, whose work spans `window`.
    pub fn new(name: &str, fault: &str, window: Window) -> PhaseRecord {
        PhaseRecord {
            name: name.into(),
            fault: fault.into(),
            window,
            faults_lifted: window.start,
            allowed: Vec::new(),
            outages: Vec::new(),
            isolated: Vec::new(),
            slowed: Vec::new(),
            paused: Vec::new(),
            kills: Vec::new(),
            cancels: Vec::new(),
            policy_admits: false,
            no_loss_expected: false,
            leak: Leak::default(),
        }
    }
}

/// A phase in progress.
pub struct Phase {
    record: PhaseRecord,
}

impl Phase {
    /// Lets the fleet work and starts recording.
    pub fn begin(fleet: &Fleet, name: &str, fault: &str) -> Phase {
        fleet.go();
        let start = now_ns();
        Phase {
            record: PhaseRecord::new(name, fault, Window::new(start, start)),
        }
    }

    /// The record, to add fault windows to.
    pub fn record(&mut self) -> &mut PhaseRecord {
        &mut self.record
    }

    /// Notes that Redis, unreachable for everyone since `cut`, answers again now; lifting the
    /// cut began at `lifting`. The outage ends there, not now: Redis serves the calls queued
    /// during the cut as soon as it runs again, and a worker can start work before the test
    /// sees the lift done.
    pub fn redis_back(&mut self, cut: Ns, lifting: Ns) {
        self.lifted();
        self.record.outages.push((Window::new(cut, lifting), true));
    }

    /// Notes that a fault was lifted now.
    pub fn lifted(&mut self) {
        self.record.faults_lifted = now_ns();
    }

    /// Ends the phase: quiet, one ttl (and a little) of nothing, then the leak check.
    pub fn finish(mut self, fleet: &Fleet, ops: &Ops) -> PhaseRecord {
        self.record.window.end = now_ns();
        fleet.quiet(&self.record.name);
        std::thread::sleep(fleet.settings.ttl + Duration::from_millis(100));
        self.record.leak = ops.leak_check(&fleet.server, &self.record.name);
        self.record
    }
}

/// Sleeps `d` (the phases' pacing).
pub fn run_for(d: Duration) {
    std::thread::sleep(d);
}
