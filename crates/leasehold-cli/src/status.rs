//! `leasehold status`: the holders of a quota, as an aligned table or as JSON.

use std::fmt::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold::Quota;
use serde_json::json;

use crate::exit::{self, Failure};
use crate::output;

fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn between(from: SystemTime, to: SystemTime) -> Duration {
    to.duration_since(from).unwrap_or_default()
}

pub async fn print(quota: &Quota, limit_known: bool, as_json: bool) -> Result<i32, Failure> {
    let status = quota.status().await?;
    // The stored limit is the quota's; --limit only stands in while none is stored.
    let known = limit_known || status.stored_limit.is_some();
    let limit = known.then(|| status.effective_limit());
    let version = status.stored_limit.map(|s| s.version);
    let free = known.then(|| status.free());
    if as_json {
        let holders: Vec<_> = status
            .holders
            .iter()
            .map(|h| {
                json!({
                    "task_id": h.task_id,
                    "fencing_token": h.fencing_token,
                    "acquired_at_ms": millis(h.acquired_at),
                    "deadline_ms": millis(h.deadline),
                    "age_ms": between(h.acquired_at, status.now).as_millis() as u64,
                    "expires_in_ms": between(status.now, h.deadline).as_millis() as u64,
                })
            })
            .collect();
        let doc = json!({
            "quota": status.quota,
            "now_ms": millis(status.now),
            "limit": limit,
            "limit_version": version,
            "held": status.holders.len(),
            "free": free,
            "quarantine_ms": status.quarantine.map(|d| d.as_millis() as u64),
            "holders": holders,
        });
        output::print(&format!("{doc}\n"))?;
        return Ok(0);
    }
    let shown = |v: Option<u32>| v.map_or_else(|| "?".to_owned(), |n| n.to_string());
    // Built whole, then written once: a failed write is one error, not a panic mid-table.
    let mut table = String::new();
    let version = version.map_or_else(String::new, |v| format!(" (version {v})"));
    let _ = writeln!(
        table,
        "quota {}: {} held, limit {}{version}, free {}",
        status.quota,
        status.holders.len(),
        shown(limit),
        shown(free)
    );
    if let Some(left) = status.quarantine {
        let _ = writeln!(
            table,
            "quarantined for {:.1}s more: Redis lost the quota's data; its holders re-register \
             and nobody new is admitted until then",
            left.as_secs_f64()
        );
    }
    if status.holders.is_empty() {
        output::print(&table)?;
        return Ok(0);
    }
    // Task ids come from Redis, where any client may have written them: shown escaped, as
    // every text of another party (found by review: raw escape sequences reached the terminal).
    let ids: Vec<String> = status
        .holders
        .iter()
        .map(|h| exit::escaped(&h.task_id))
        .collect();
    let width = ids
        .iter()
        .map(|id| id.chars().count())
        .max()
        .unwrap_or(0)
        .max("TASK ID".len());
    let _ = writeln!(
        table,
        "{:<width$}  {:>8}  {:>10}  {:>10}",
        "TASK ID", "TOKEN", "AGE", "EXPIRES IN"
    );
    for (h, id) in status.holders.iter().zip(&ids) {
        let age = between(h.acquired_at, status.now);
        let left = between(status.now, h.deadline);
        let _ = writeln!(
            table,
            "{:<width$}  {:>8}  {:>9.1}s  {:>9.1}s",
            id,
            h.fencing_token,
            age.as_secs_f64(),
            left.as_secs_f64()
        );
    }
    output::print(&table)?;
    Ok(0)
}
