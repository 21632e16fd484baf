//! The experiment's claims, checked on a real, seeded, short headless run in memory: the
//! counter leaks to zero for good, the TTL counter over-admits, the lease never exceeds its
//! limit and gets every crashed slot back within ttl + one heartbeat.

use std::sync::OnceLock;
use std::time::Duration;

use super::experiment::{Frame, SAMPLE_EVERY};
use super::headless::{self, Outcome};
use super::params::Params;
use super::semantics::Kind;
use super::store::Store;
use super::world::Sample;

/// Short tasks and a high crash rate, so that 5 s show everything; the ttl stays well above
/// scheduling noise on a loaded 2-core CI machine.
fn params() -> Params {
    Params {
        limit: 4,
        crash_probability: 0.3,
        ttl_ms: 500,
        task_ms: 200,
        speed: 1.0,
        seed: 3,
    }
}

/// Slack on top of ttl + heartbeat: one sampling period (a recovery is seen at the next sample)
/// plus scheduling delay of the sampler on a busy machine.
const RECOVERY_TOLERANCE: Duration = Duration::from_millis(250);

/// One run shared by the tests below (they check different columns of the same run).
fn outcome() -> &'static Outcome {
    static RUN: OnceLock<Outcome> = OnceLock::new();
    RUN.get_or_init(|| {
        let runtime = tokio::runtime::Runtime::new().expect("a runtime");
        runtime
            .block_on(headless::run(
                params(),
                &Store::Memory,
                Duration::from_secs(5),
            ))
            .expect("the memory store does not fail")
    })
}

fn column(frame: &Frame, kind: Kind) -> &Sample {
    frame
        .worlds
        .iter()
        .find(|s| s.kind == kind)
        .expect("every frame has the three columns")
}

fn series(kind: Kind) -> Vec<&'static Sample> {
    outcome().frames.iter().map(|f| column(f, kind)).collect()
}

#[test]
fn the_counter_leaks_to_zero_and_stays_there() {
    let p = params();
    let samples = series(Kind::Counter);
    assert!(
        samples.len() as u32 >= (5000 / SAMPLE_EVERY.as_millis() as u32) / 2,
        "the sampler ran"
    );
    let full = samples
        .iter()
        .position(|s| s.crashed == p.limit)
        .expect("crashed tasks came to hold every slot of the counter");
    assert!(
        samples[full..].iter().all(|s| s.available == 0),
        "once every slot leaked, nothing came back"
    );
    let last = samples.last().unwrap();
    assert_eq!(last.running, 0, "every task ended");
    assert_eq!(last.counted, i64::from(p.limit), "the count is all leaks");
    assert_eq!(last.tally.recovered, 0);
    assert!(
        last.tally.refused > last.tally.admitted,
        "a dead counter refuses"
    );
}

#[test]
fn the_ttl_counter_over_admits() {
    let p = params();
    let last = column(outcome().last(), Kind::TtlCounter);
    assert!(last.tally.over_admitted >= 1, "{last:?}");
    assert!(last.tally.peak_running > p.limit, "{last:?}");
    assert!(
        series(Kind::TtlCounter)
            .iter()
            .any(|s| i64::from(s.running) > i64::from(p.limit) || s.counted < 0),
        "a sample shows the damage: more tasks running than the limit, or a negative count"
    );
}

#[test]
fn the_lease_never_exceeds_the_limit_and_recovers_every_crash() {
    let p = params();
    let samples = series(Kind::Lease);
    assert!(samples.iter().all(|s| s.running <= p.limit));
    let last = samples.last().unwrap();
    assert_eq!(last.tally.over_admitted, 0);
    assert!(last.tally.peak_running <= p.limit);
    assert_eq!(last.tally.lost, 0, "no lease was lost to a missed renewal");
    assert_eq!(last.tally.errors, 0);
    assert!(
        last.tally.crashes >= 3,
        "the run must crash tasks to mean anything"
    );
    assert_eq!(last.crashed, 0, "no crashed slot is still held at the end");
    assert_eq!(last.tally.recovered, last.tally.crashes);
    let bound = p.scaled_ttl() + p.scaled_heartbeat() + RECOVERY_TOLERANCE;
    let worst = Duration::from_millis(last.tally.max_recovery_ms.expect("crashes recovered"));
    assert!(
        worst <= bound,
        "a crashed slot took {worst:?} to come back (bound {bound:?})"
    );
    assert_eq!(last.counted, 0, "the quota is empty at the end");
}

#[test]
fn the_three_columns_got_the_same_tasks() {
    let last = outcome().last();
    let submitted: Vec<u64> = last
        .worlds
        .iter()
        .map(|s| s.tally.admitted + s.tally.refused + s.tally.errors)
        .collect();
    assert!(submitted[0] > 0);
    assert!(
        submitted.iter().all(|&n| n == submitted[0]),
        "{submitted:?}"
    );
}
