//! One backend call at a time per task id, for the calls that admit or release it.
//!
//! Admissions and releases travel in separate batches, so without this an acquire of a task
//! could overtake the release of that task's previous lease: the backend would answer `held`
//! with the lease it is about to remove, and the caller would run on a slot given away a moment
//! later. Taking turns per task id keeps the backend's order the same as this process's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as TurnLock, OwnedMutexGuard};

/// The turn locks of the task ids that have a call waiting or under way; the others have none.
#[derive(Default)]
pub(crate) struct TaskTurns {
    locks: Mutex<HashMap<String, Entry>>,
}

#[derive(Default)]
struct Entry {
    lock: Arc<TurnLock<()>>,
    /// Calls holding or waiting for the turn. The entry goes when the last one does, even one
    /// whose wait was abandoned (its future dropped).
    users: usize,
}

/// The turn of one task id, held until dropped.
pub(crate) struct Turn<'a> {
    turns: &'a TaskTurns,
    task_id: String,
    guard: Option<OwnedMutexGuard<()>>,
}

impl TaskTurns {
    /// Waits until no other admission or release of `task_id` in this process is under way.
    pub(crate) async fn take(&self, task_id: &str) -> Turn<'_> {
        let lock = {
            let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
            let entry = locks.entry(task_id.to_owned()).or_default();
            entry.users += 1;
            entry.lock.clone()
        };
        // Counted from here on: dropping this future while it waits still ends the count.
        let mut turn = Turn {
            turns: self,
            task_id: task_id.to_owned(),
            guard: None,
        };
        turn.guard = Some(lock.lock_owned().await);
        turn
    }

    /// Task ids with a turn taken or waited for (see `Quota::debug_sizes`).
    pub(crate) fn tracked(&self) -> usize {
        self.locks.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut locks = self.turns.locks.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = locks.get_mut(&self.task_id) {
            entry.users -= 1;
            if entry.users == 0 {
                locks.remove(&self.task_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn calls_of_one_task_take_turns_and_other_tasks_do_not_wait() {
        let turns = Arc::new(TaskTurns::default());
        let first = turns.take("a").await;
        let waiting = {
            let turns = turns.clone();
            tokio::spawn(async move {
                let _turn = turns.take("a").await;
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiting.is_finished(),
            "a second call of `a` waits its turn"
        );
        let other = tokio::time::timeout(Duration::from_secs(1), turns.take("b")).await;
        assert!(other.is_ok(), "another task id does not wait");
        drop(other);
        drop(first);
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("the second call runs once the first is done")
            .unwrap();
        assert_eq!(turns.tracked(), 0, "no lock is kept for idle task ids");
    }

    #[tokio::test]
    async fn an_abandoned_wait_leaves_nothing_behind() {
        let turns = TaskTurns::default();
        let first = turns.take("a").await;
        let mut second = Box::pin(turns.take("a"));
        let waited = tokio::time::timeout(Duration::from_millis(10), &mut second).await;
        assert!(waited.is_err(), "the second call waits its turn");
        // The turn passes while the second call is abandoned before it runs again.
        drop(first);
        drop(second);
        assert_eq!(
            turns.tracked(),
            0,
            "the abandoned wait is not counted any more"
        );
        let again = tokio::time::timeout(Duration::from_secs(1), turns.take("a")).await;
        assert!(again.is_ok(), "the task id takes turns as before");
    }
}
