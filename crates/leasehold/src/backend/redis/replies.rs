//! Reading the values of a script's reply.

use redis::Value;

use crate::backend::{LeaseRecord, VersionedLimit};
use crate::error::{Misconfiguration, Result};

pub(super) fn int(v: Option<&Value>) -> Result<u64> {
    match v {
        Some(Value::Int(i)) if *i >= 0 => Ok(*i as u64),
        other => {
            Err(Misconfiguration::Protocol(format!("expected an integer, got {other:?}")).into())
        }
    }
}

pub(super) fn text(v: Option<&Value>) -> Result<String> {
    match v {
        Some(Value::BulkString(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
        Some(Value::SimpleString(s)) => Ok(s.clone()),
        other => {
            Err(Misconfiguration::Protocol(format!("expected a string, got {other:?}")).into())
        }
    }
}

/// A stored limit from the two values `limit, version` a script replies.
pub(super) fn versioned_limit(values: &[Value]) -> Result<VersionedLimit> {
    let limit = int(values.first())?;
    Ok(VersionedLimit {
        limit: u32::try_from(limit).map_err(|_| {
            Misconfiguration::Protocol(format!("a limit out of range was replied: {limit}"))
        })?,
        version: int(values.get(1))?,
    })
}

/// A lease from the four values `token, acquired_ms, deadline_ms` (after the code) of an acquire
/// answer, in the reply's epoch.
pub(super) fn lease_record(
    task_id: String,
    answer: &[Value],
    now_ms: u64,
    epoch: &str,
) -> Result<LeaseRecord> {
    Ok(LeaseRecord {
        task_id,
        token: int(answer.get(1))?,
        acquired_at_ms: int(answer.get(2))?,
        deadline_ms: int(answer.get(3))?,
        now_ms,
        epoch: epoch.to_owned(),
    })
}
