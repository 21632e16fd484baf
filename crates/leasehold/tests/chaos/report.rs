//! The table: one markdown row per phase, ready to paste into docs/RELIABILITY.md.

use super::checker::Stats;
use super::phase::PhaseRecord;

/// `p50 / max (n)` of some milliseconds, or `–` when there are none.
fn spread(values: &[f64]) -> String {
    if values.is_empty() {
        return "–".into();
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let p50 = sorted[(sorted.len() - 1) / 2];
    let max = sorted[sorted.len() - 1];
    format!("{p50:.0} / {max:.0} ({})", sorted.len())
}

fn max_of(values: &[f64]) -> String {
    values
        .iter()
        .copied()
        .reduce(f64::max)
        .map_or("–".into(), |m| format!("{m:.0}"))
}

/// The header of the table.
pub fn header() -> String {
    [
        "| phase | fault | work: done / lost / cancelled / killed | max running | over limit ms: total / worst / unexplained | leaked: live / ZCARD → after reap | crash→reuse ms p50 / max (n) | cancel→stop ms p50 / max (n) | admissions while cut off | local grants: during / after outage | cut→stop ms max | SIGCONT→stop ms max | lift→first work ms | stale `held` | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    .join("\n")
}

/// One phase's row.
pub fn row(record: &PhaseRecord, s: &Stats, violations: usize) -> String {
    let leak = &record.leak;
    let missed = if s.cancel_missed > 0 {
        format!(", {} raced", s.cancel_missed)
    } else {
        String::new()
    };
    format!(
        "| {} | {} | {} / {} / {} / {} | {} | {:.0} / {:.0} / {:.0} | {} / {} → {} | {} | {}{} | {} | {} / {} | {} | {} | {} | {} | {} |",
        record.name,
        record.fault,
        s.completed,
        s.lost,
        s.cancelled,
        s.killed,
        s.max_running,
        s.over_ms,
        s.worst_over_ms,
        s.unexplained_over_ms,
        leak.live,
        leak.zcard,
        leak.zcard_after,
        spread(&s.reuse_ms),
        spread(&s.cancel_ms),
        missed,
        s.admissions_cut.len(),
        s.local_grants.0,
        s.local_grants.1,
        max_of(&s.cut_to_stop_ms),
        max_of(&s.resume_to_stop_ms),
        s.recovery_ms.map_or("–".into(), |m| format!("{m:.0}")),
        s.stale,
        if violations == 0 { "ok".to_string() } else { format!("**{violations} broken**") },
    )
}
