//! The key scheme of protocol version 1 (see docs/PROTOCOL.md) and input validation.

use crate::error::{Misconfiguration, Result};

/// Version of the wire protocol these keys and scripts implement.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest limit a quota may have.
pub const MAX_LIMIT: u32 = 1_000_000;

/// Largest integer the scripts take (a limit version, a fencing token, a seq): 2^53 − 1, the
/// last one exact in the Lua numbers (doubles) they compare them as (PROTOCOL.md §2).
pub(crate) const MAX_SCRIPT_INTEGER: u64 = (1 << 53) - 1;

/// Largest limit version a quota may have: 2^53 − 1, so that the version is exact in the Lua
/// numbers (doubles) the scripts compare it as.
pub const MAX_LIMIT_VERSION: u64 = MAX_SCRIPT_INTEGER;

/// Largest task id, in bytes.
pub const MAX_TASK_ID_BYTES: usize = 1024;

/// Largest cancel reason, in bytes: it is stored in the cancel marker and sent to every
/// subscriber of the quota.
pub const MAX_CANCEL_REASON_BYTES: usize = 1024;

/// Largest quota name, in bytes.
pub const MAX_QUOTA_NAME_BYTES: usize = 256;

/// The Redis keys and channel of one quota. All share the hash tag `{<quota>}` so that they live
/// in one Cluster slot and one script may touch them all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaKeys {
    /// The quota's name.
    pub name: String,
    /// ZSET: member = task id, score = lease deadline in server milliseconds.
    pub leases: String,
    /// HASH: field = task id, value = `<fencing token>:<acquired at, server ms>`.
    pub holders: String,
    /// STRING counter: the last fencing token handed out.
    pub fence: String,
    /// HASH: `limit` = the limit acquire admits up to, `version` = its limit version. Written by
    /// the acquire of a caller with a higher version (or the first one); no TTL.
    pub limit: String,
    /// Pub/Sub channel for release and cancel events.
    pub events: String,
    /// HASH: `id` = the current epoch (changes when the quota's state was lost, all of it or its
    /// latest writes), `seq` = how many calls changed a lease in this epoch, `detected_ms` = when
    /// a loss of that epoch's predecessor was detected.
    pub epoch: String,
    /// STRING with a TTL: while it exists, new admissions wait (dataset-loss quarantine).
    pub quarantine: String,
    /// STRING with a TTL: set when an acquire finds the quota full; while it exists, releases are
    /// announced on the channel (someone may be waiting), otherwise they are silent.
    pub waiting: String,
    /// Prefix of the cancel markers: `<prefix><task id>` (STRING, the reason, with a TTL).
    pub cancel_prefix: String,
}

impl QuotaKeys {
    /// Keys for the quota `name`, which must already be valid.
    pub fn new(name: &str) -> Result<Self> {
        validate_quota_name(name)?;
        let base = format!("leasehold:{{{name}}}");
        Ok(QuotaKeys {
            name: name.to_owned(),
            leases: format!("{base}:leases"),
            holders: format!("{base}:holders"),
            fence: format!("{base}:fence"),
            limit: format!("{base}:limit"),
            events: format!("{base}:events"),
            epoch: format!("{base}:epoch"),
            quarantine: format!("{base}:quarantine"),
            waiting: format!("{base}:waiting"),
            cancel_prefix: format!("{base}:cancel:"),
        })
    }

    /// The cancel marker key of `task_id`.
    pub fn cancel(&self, task_id: &str) -> String {
        format!("{}{task_id}", self.cancel_prefix)
    }
}

/// Rejects names that would break the hash tag (braces), control characters, and names that are
/// empty or longer than [`MAX_QUOTA_NAME_BYTES`].
pub fn validate_quota_name(name: &str) -> Result<()> {
    let bad =
        |why: &str| Err(Misconfiguration::InvalidQuotaName(format!("{name:?}: {why}")).into());
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > MAX_QUOTA_NAME_BYTES {
        return bad("longer than 256 bytes");
    }
    if name.contains(['{', '}']) {
        return bad("braces would break the key's hash tag");
    }
    if name.chars().any(char::is_control) {
        return bad("control characters are not allowed");
    }
    Ok(())
}

/// The start of `text`, short enough for an error message.
fn shown(text: &str) -> String {
    text.chars().take(40).collect()
}

/// Rejects task ids that are empty, longer than [`MAX_TASK_ID_BYTES`] or hold control characters.
pub fn validate_task_id(id: &str) -> Result<()> {
    let shown = shown(id);
    let bad = |why: &str| Err(Misconfiguration::InvalidTaskId(format!("{shown:?}: {why}")).into());
    if id.is_empty() {
        return bad("empty");
    }
    if id.len() > MAX_TASK_ID_BYTES {
        return bad("longer than 1024 bytes");
    }
    if id.chars().any(char::is_control) {
        return bad("control characters are not allowed");
    }
    Ok(())
}

/// Rejects a cancel reason longer than [`MAX_CANCEL_REASON_BYTES`].
pub fn validate_cancel_reason(reason: &str) -> Result<()> {
    if reason.len() > MAX_CANCEL_REASON_BYTES {
        return Err(Misconfiguration::InvalidCancelReason(format!(
            "{:?}...: {} bytes, at most {MAX_CANCEL_REASON_BYTES}",
            shown(reason),
            reason.len()
        ))
        .into());
    }
    Ok(())
}

/// Rejects a limit version above [`MAX_LIMIT_VERSION`].
pub fn validate_limit_version(version: u64) -> Result<u64> {
    if version > MAX_LIMIT_VERSION {
        return Err(Misconfiguration::InvalidLimitVersion(version).into());
    }
    Ok(version)
}

/// Rejects a limit of 0 or above [`MAX_LIMIT`].
pub fn validate_limit(limit: u64) -> Result<u32> {
    if limit == 0 || limit > u64::from(MAX_LIMIT) {
        return Err(Misconfiguration::InvalidLimit(limit).into());
    }
    Ok(limit as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_one_hash_tag() {
        let k = QuotaKeys::new("llm:gpt").unwrap();
        assert_eq!(k.leases, "leasehold:{llm:gpt}:leases");
        assert_eq!(k.holders, "leasehold:{llm:gpt}:holders");
        assert_eq!(k.fence, "leasehold:{llm:gpt}:fence");
        assert_eq!(k.limit, "leasehold:{llm:gpt}:limit");
        assert_eq!(k.events, "leasehold:{llm:gpt}:events");
        assert_eq!(k.waiting, "leasehold:{llm:gpt}:waiting");
        assert_eq!(k.cancel("t:1"), "leasehold:{llm:gpt}:cancel:t:1");
    }

    #[test]
    fn bad_names_and_ids_are_rejected() {
        assert!(QuotaKeys::new("").is_err());
        assert!(QuotaKeys::new("a{b").is_err());
        assert!(QuotaKeys::new("a}b").is_err());
        assert!(QuotaKeys::new("a\nb").is_err());
        assert!(QuotaKeys::new(&"x".repeat(257)).is_err());
        assert!(QuotaKeys::new("with space:and colon").is_ok());
        assert!(validate_task_id("").is_err());
        assert!(validate_task_id(&"x".repeat(1025)).is_err());
        assert!(validate_task_id("tab\there").is_err());
        assert!(validate_task_id(&"x".repeat(1024)).is_ok());
        assert!(validate_task_id("日本語 ok").is_ok());
        assert!(validate_limit(0).is_err());
        assert!(validate_limit(u64::from(MAX_LIMIT) + 1).is_err());
        assert_eq!(validate_limit(10).unwrap(), 10);
        assert!(validate_limit_version(MAX_LIMIT_VERSION).is_ok());
        assert!(validate_limit_version(MAX_LIMIT_VERSION + 1).is_err());
    }
}
