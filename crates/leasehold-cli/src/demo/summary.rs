//! The headless summary: one row per semantics, as a table or as JSON.

use std::time::Duration;

use serde_json::{json, Value};

use super::experiment::SAMPLE_EVERY;
use super::headless::Outcome;
use super::world::Sample;

/// One row of the summary, from the final sample of a column.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// "counter", "ttl-counter" or "lease".
    pub semantics: &'static str,
    /// Tasks admitted.
    pub admitted: u64,
    /// Tasks refused.
    pub refused: u64,
    /// Admissions that pushed the real concurrency above the limit.
    pub over_admitted: u64,
    /// Most tasks running at once.
    pub peak_running: u32,
    /// Admitted tasks that crashed.
    pub crashes: u64,
    /// Crashed slots still counted at the end, after every task ended and the drain passed.
    pub leaked_at_end: u32,
    /// The limiter's count at the end (a counter can end below zero).
    pub count_at_end: i64,
    /// Lowest available capacity sampled.
    pub min_available: i64,
    /// Arrivals not submitted because the store fell behind (0 unless it did).
    pub shed: u64,
    /// The longest time a crashed slot stayed counted; `None` when one never came back (or
    /// nothing crashed: see `crashes`).
    pub time_to_recover: Option<Duration>,
}

impl Row {
    /// The row of a column's last sample.
    pub fn of(sample: &Sample) -> Self {
        let t = &sample.tally;
        Row {
            semantics: sample.kind.id(),
            admitted: t.admitted,
            refused: t.refused,
            over_admitted: t.over_admitted,
            peak_running: t.peak_running,
            crashes: t.crashes,
            leaked_at_end: sample.crashed,
            count_at_end: sample.counted,
            min_available: t.min_available.unwrap_or(sample.available),
            shed: t.shed,
            time_to_recover: (sample.crashed == 0)
                .then_some(t.max_recovery_ms)
                .flatten()
                .map(Duration::from_millis),
        }
    }

    fn recover_text(&self) -> String {
        match (self.time_to_recover, self.leaked_at_end) {
            (Some(d), _) => format!("{:.2}s", d.as_secs_f64()),
            (None, 0) => "-".into(),
            (None, _) => "never".into(),
        }
    }
}

/// The rows of a run, in column order.
pub fn rows(outcome: &Outcome) -> Vec<Row> {
    outcome.last.worlds.iter().map(Row::of).collect()
}

fn settings_line(outcome: &Outcome, store: &str) -> String {
    let p = &outcome.params;
    format!(
        "{:?} of tasks (+{:.1}s drain), limit {}, crash probability {}, ttl {:?}, task {:?} (mean), \
         speed {}, seed {}, store {store}",
        outcome.duration,
        outcome.drain.as_secs_f64(),
        p.limit,
        p.crash_probability,
        p.ttl(),
        p.task(),
        p.speed,
        p.seed
    )
}

/// The summary as an aligned table with a short legend.
pub fn table(outcome: &Outcome, store: &str) -> String {
    let header = [
        "SEMANTICS",
        "ADMITTED",
        "REFUSED",
        "OVER-ADMITTED",
        "PEAK RUNNING",
        "CRASHED",
        "LEAKED AT END",
        "COUNT AT END",
        "MIN AVAILABLE",
        "TIME TO RECOVER",
    ];
    let mut lines = vec![header.map(str::to_owned).to_vec()];
    for r in rows(outcome) {
        lines.push(vec![
            r.semantics.to_owned(),
            r.admitted.to_string(),
            r.refused.to_string(),
            r.over_admitted.to_string(),
            r.peak_running.to_string(),
            r.crashes.to_string(),
            r.leaked_at_end.to_string(),
            r.count_at_end.to_string(),
            r.min_available.to_string(),
            r.recover_text(),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| lines.iter().map(|l| l[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = format!("{}\n\n", settings_line(outcome, store));
    for line in &lines {
        let cells: Vec<String> = line
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, w))| match c {
                0 => format!("{cell:<w$}"),
                _ => format!("{cell:>w$}"),
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out.push_str(&format!(
        "\nOVER-ADMITTED: admissions that made more tasks run than the limit. LEAKED AT END: crashed \
         slots still counted\nafter every task ended and one ttl + heartbeat passed. TIME TO RECOVER: \
         longest time from a crash until the\nlimiter stopped counting its slot (sampled every \
         {:?}); never = a slot leaked for good.\n",
        SAMPLE_EVERY
    ));
    if let Some(shed) = shed_line(outcome) {
        out.push_str(&format!("\n{shed}\n"));
    }
    out
}

/// A warning when the store fell behind and some column did not get every task: its figures
/// then cover fewer tasks than the others', which the table must not hide.
fn shed_line(outcome: &Outcome) -> Option<String> {
    let rows = rows(outcome);
    if rows.iter().all(|r| r.shed == 0) {
        return None;
    }
    let each: Vec<String> = rows
        .iter()
        .map(|r| format!("{} {}", r.semantics, r.shed))
        .collect();
    Some(format!(
        "WARNING: the store fell behind the schedule and arrivals were shed (not submitted): {}. \
         The columns did not get the same tasks; lower the speed or the limit.",
        each.join(", ")
    ))
}

/// The summary as one JSON object.
pub fn json(outcome: &Outcome, store: &str) -> Value {
    let semantics: Vec<Value> = rows(outcome)
        .into_iter()
        .map(|r| {
            json!({
                "semantics": r.semantics,
                "admitted": r.admitted,
                "refused": r.refused,
                "over_admitted": r.over_admitted,
                "peak_running": r.peak_running,
                "crashes": r.crashes,
                "leaked_at_end": r.leaked_at_end,
                "count_at_end": r.count_at_end,
                "min_available": r.min_available,
                "time_to_recover_ms": r.time_to_recover.map(|d| d.as_millis() as u64),
                "shed": r.shed,
            })
        })
        .collect();
    json!({
        "store": store,
        "params": outcome.params,
        "duration_ms": outcome.duration.as_millis() as u64,
        "drain_ms": outcome.drain.as_millis() as u64,
        "heartbeat_ms": outcome.params.scaled_heartbeat().as_millis() as u64,
        "semantics": semantics,
    })
}
