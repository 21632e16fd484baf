//! The backend calls of admissions and token-guarded releases, made under the task's turn.

use std::time::Instant;

use super::Shared;
use crate::backend::AcquireReply;
use crate::error::{Error, Result};

impl Shared {
    /// One admission attempt for `task_id` in the backend, made under its turn; returns the
    /// reply and when the attempt was sent.
    ///
    /// A reply `held` with the token of this task's release that got no answer is not handed
    /// out: that release may still reach the backend (from a connection replaced since, whose
    /// bytes a proxy held) and end the lease under its new holder, while another process takes
    /// the slot. The release is sent again, and the attempt made afresh: it gets a new token,
    /// which the late release cannot touch.
    pub(super) async fn acquire_in_backend(
        &self,
        task_id: &str,
    ) -> (Result<AcquireReply>, Instant) {
        let attempt = || async {
            let sent = Instant::now();
            let reply = self
                .backend
                .acquire_with_limit(&self.keys, task_id, self.config.ttl, self.config.limit)
                .await;
            (reply, sent)
        };
        let (reply, sent) = attempt().await;
        let Ok(AcquireReply::Held(record)) = &reply else {
            return (reply, sent);
        };
        if !self.admissions.is_release_unanswered(task_id, record.token) {
            return (reply, sent);
        }
        tracing::debug!(quota = %self.keys.name, task_id, token = record.token,
            "an admission whose release got no answer came back held; released again");
        // The first call ran (it extended that admission): whatever fails from here leaves the
        // acquire's outcome unknown, not "not run".
        if let Err(e) = self.release_token(task_id, record.token).await {
            return (Err(e.after_a_call_ran()), sent);
        }
        let (reply, sent) = attempt().await;
        (reply.map_err(Error::after_a_call_ran), sent)
    }

    /// The backend call of a token-guarded release, remembering one that got no answer.
    pub(super) async fn release_token(&self, task_id: &str, token: u64) -> Result<bool> {
        let result = self.backend.release(&self.keys, task_id, Some(token)).await;
        match &result {
            // A lease lives at most a ttl past its last renewal, all sent before this; twice
            // that leaves room for a server clock that runs a little faster than ours.
            Err(Error::BackendUnavailable { kind, .. }) if kind.may_have_run() => self
                .admissions
                .release_unanswered(task_id, token, Instant::now() + 2 * self.config.ttl),
            // Refused before it ran (no connection, the server's refusal): this one cannot land
            // late, and settles nothing about an earlier one that got no answer.
            Err(Error::BackendUnavailable { .. }) => {}
            _ => self.admissions.release_answered(task_id, token),
        }
        result
    }

    /// Releases `task_id` in the backend (token-guarded unless `None`).
    pub(crate) async fn release_in_backend(
        &self,
        task_id: &str,
        token: Option<u64>,
    ) -> Result<bool> {
        let Some(token) = token else {
            return self.backend.release(&self.keys, task_id, None).await;
        };
        let _turn = self.admissions.turns.take(task_id).await;
        // An acquire of this task that came back `held` while the release waited for its turn
        // handed this very admission to a new handle: the slot is that handle's now.
        if self.lease(task_id).is_some_and(|live| live.token == token) {
            return Ok(false);
        }
        self.release_token(task_id, token).await
    }
}
