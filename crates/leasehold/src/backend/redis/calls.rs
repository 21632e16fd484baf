//! The script calls of batched admissions, renewals and releases.

use std::time::Duration;

use super::replies::{int, lease_record, text, versioned_limit};
use super::{RedisBackend, ACQUIRE, RELEASE, RENEW};
use crate::backend::{AcquireReply, RenewOutcome, RenewReply, VersionedLimit};
use crate::error::{Misconfiguration, Result};
use crate::keys::QuotaKeys;

impl RedisBackend {
    /// One renew call for at most [`RENEW_BATCH`](crate::backend::RENEW_BATCH) leases, sent with
    /// the epoch `epoch`.
    pub(super) async fn renew_batch(
        &self,
        keys: &QuotaKeys,
        ttl: Duration,
        epoch: &str,
        leases: &[(String, u64)],
    ) -> Result<RenewReply> {
        let mut args = Vec::with_capacity(4 + 2 * leases.len());
        args.push(ttl.as_millis().to_string());
        args.push(epoch.to_owned());
        let (seq, highest_token) = self.seen_for_renewal(&keys.name, epoch);
        args.push(seq.to_string());
        args.push(highest_token.to_string());
        for (id, token) in leases {
            args.push(id.clone());
            args.push(token.to_string());
        }
        let mut renew_keys = vec![
            keys.leases.clone(),
            keys.holders.clone(),
            keys.fence.clone(),
            keys.epoch.clone(),
            keys.quarantine.clone(),
            keys.limit.clone(),
        ];
        renew_keys.extend(leases.iter().map(|(id, _)| keys.cancel(id)));
        let reply = self
            .invoke(keys.name.clone(), &RENEW, renew_keys, args)
            .await?;
        if reply.len() != 3 + 2 * leases.len() {
            return Err(Misconfiguration::Protocol(format!(
                "renew replied {} values for {} leases",
                reply.len(),
                leases.len()
            ))
            .into());
        }
        let outcomes = reply[3..]
            .chunks(2)
            .map(|pair| match int(pair.first())? {
                1 => Ok(RenewOutcome::Renewed {
                    deadline_ms: int(pair.get(1))?,
                }),
                2 => Ok(RenewOutcome::Superseded),
                3 => Ok(RenewOutcome::Cancelled {
                    reason: text(pair.get(1))?,
                }),
                _ => Ok(RenewOutcome::Gone),
            })
            .collect::<Result<Vec<_>>>()?;
        let epoch = text(reply.get(1))?;
        self.saw_reply(&keys.name, &epoch, int(reply.get(2))?, 0);
        Ok(RenewReply { epoch, outcomes })
    }

    /// One acquire call for `ids`, served in order; one answer per id.
    pub(super) async fn acquire_batch(
        &self,
        keys: &QuotaKeys,
        ttl: Duration,
        limit: VersionedLimit,
        ids: Vec<String>,
    ) -> Result<Vec<AcquireReply>> {
        let mut script_keys = Vec::with_capacity(7 + ids.len());
        script_keys.extend([
            keys.leases.clone(),
            keys.holders.clone(),
            keys.fence.clone(),
            keys.epoch.clone(),
            keys.quarantine.clone(),
            keys.waiting.clone(),
            keys.limit.clone(),
        ]);
        script_keys.extend(ids.iter().map(|id| keys.cancel(id)));
        let seen = self.seen_epoch(&keys.name);
        let mut args = Vec::with_capacity(6 + ids.len());
        args.extend([
            ttl.as_millis().to_string(),
            limit.limit.to_string(),
            seen.id,
            limit.version.to_string(),
            seen.seq.to_string(),
            seen.highest_token.to_string(),
        ]);
        args.extend(ids.iter().cloned());
        let reply = self
            .invoke(keys.name.clone(), &ACQUIRE, script_keys, args)
            .await?;
        if reply.len() != 3 + 4 * ids.len() {
            return Err(Misconfiguration::Protocol(format!(
                "acquire replied {} values for {} task ids",
                reply.len(),
                ids.len()
            ))
            .into());
        }
        let now_ms = int(reply.get(1))?;
        let epoch = text(reply.first())?;
        let seq = int(reply.get(2))?;
        let answers = ids
            .into_iter()
            .zip(reply[3..].chunks(4))
            .map(|(id, answer)| match int(answer.first())? {
                1 => Ok(AcquireReply::Acquired(lease_record(
                    id, answer, now_ms, &epoch,
                )?)),
                2 => Ok(AcquireReply::Held(lease_record(
                    id, answer, now_ms, &epoch,
                )?)),
                3 => Ok(AcquireReply::Cancelled {
                    reason: text(answer.get(1))?,
                }),
                4 => Ok(AcquireReply::Quarantined {
                    remaining_ms: int(answer.get(1))?,
                }),
                0 => Ok(AcquireReply::Full {
                    earliest_deadline_ms: int(answer.get(1))?,
                    now_ms,
                }),
                5 => Ok(AcquireReply::LimitMismatch {
                    stored: versioned_limit(&answer[1..])?,
                }),
                other => Err(Misconfiguration::Protocol(format!("acquire replied {other}")).into()),
            })
            .collect::<Result<Vec<_>>>();
        // One look at the per-name state per call: this is the admission path.
        let highest_token = answers.as_ref().map_or(0, |answers| {
            answers
                .iter()
                .filter_map(|answer| match answer {
                    AcquireReply::Acquired(lease) | AcquireReply::Held(lease) => Some(lease.token),
                    _ => None,
                })
                .max()
                .unwrap_or(0)
        });
        self.saw_reply(&keys.name, &epoch, seq, highest_token);
        answers
    }

    /// One release call for `leases` (task id, token or `*`); whether each was removed.
    pub(super) async fn release_batch(
        &self,
        keys: &QuotaKeys,
        leases: Vec<(String, String)>,
    ) -> Result<Vec<bool>> {
        let mut args = Vec::with_capacity(1 + 2 * leases.len());
        args.push(self.inner.channel(keys));
        for (id, token) in &leases {
            args.push(id.clone());
            args.push(token.clone());
        }
        let reply = self
            .invoke(
                keys.name.clone(),
                &RELEASE,
                vec![
                    keys.leases.clone(),
                    keys.holders.clone(),
                    keys.waiting.clone(),
                ],
                args,
            )
            .await?;
        if reply.len() != leases.len() {
            return Err(Misconfiguration::Protocol(format!(
                "release replied {} values for {} leases",
                reply.len(),
                leases.len()
            ))
            .into());
        }
        reply.iter().map(|v| Ok(int(Some(v))? == 1)).collect()
    }
}
