//! Reads the workers' own logs (the format is documented in `examples/chaos_worker.rs`) into
//! intervals of protected work. Nothing here asks the library or Redis anything.

use super::model::{Interval, Kill, Ns};

/// One parsed log line (lines the checker does not use are skipped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// `start ID TOKEN T HOLD_MS`
    Start {
        /// Task id.
        id: String,
        /// Fencing token (0: granted locally by the backend-down policy).
        token: u64,
        /// When work started.
        at: Ns,
        /// Planned length of the work.
        hold_ms: u64,
    },
    /// `work ID START END OUTCOME`
    Work {
        /// Task id.
        id: String,
        /// When work started.
        start: Ns,
        /// When it stopped.
        end: Ns,
        /// Why it stopped.
        outcome: String,
    },
    /// `stale ID T`
    Stale {
        /// When the work finished.
        at: Ns,
    },
    /// `error T KIND MESSAGE`
    Error {
        /// When the call failed.
        at: Ns,
        /// Which call: connect, acquire or release.
        kind: String,
        /// The error's text.
        message: String,
    },
    /// `idle PHASE T`
    Idle {
        /// The quiet file's content.
        phase: String,
    },
}

/// Parses a whole log; panics on a malformed line (the worker writes whole lines only).
pub fn parse(text: &str) -> Vec<Line> {
    let mut lines = Vec::new();
    for raw in text.lines() {
        let f: Vec<&str> = raw.split(' ').collect();
        let ns = |i: usize| -> Ns {
            f.get(i)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("bad worker log line {raw:?}"))
        };
        let word = |i: usize| -> String {
            f.get(i)
                .map(|s| (*s).to_owned())
                .unwrap_or_else(|| panic!("bad worker log line {raw:?}"))
        };
        match f[0] {
            "start" => lines.push(Line::Start {
                id: word(1),
                token: ns(2) as u64,
                at: ns(3),
                hold_ms: ns(4) as u64,
            }),
            "work" => lines.push(Line::Work {
                id: word(1),
                start: ns(2),
                end: ns(3),
                outcome: word(4),
            }),
            "stale" => lines.push(Line::Stale { at: ns(2) }),
            "error" => lines.push(Line::Error {
                at: ns(1),
                kind: word(2),
                message: f.get(3..).map(|rest| rest.join(" ")).unwrap_or_default(),
            }),
            "idle" => lines.push(Line::Idle { phase: word(1) }),
            _ => {}
        }
    }
    lines
}

/// The log of one worker incarnation.
#[derive(Debug, Clone)]
pub struct WorkerLog {
    /// Worker slot.
    pub worker: usize,
    /// Incarnation.
    pub generation: u32,
    /// Its parsed lines.
    pub lines: Vec<Line>,
}

impl WorkerLog {
    /// The work in progress at the end of the log: id, start and planned length.
    pub fn working(&self) -> Option<(String, Ns, u64)> {
        match self
            .lines
            .iter()
            .rev()
            .find(|l| matches!(l, Line::Start { .. } | Line::Work { .. }))
        {
            Some(Line::Start {
                id, at, hold_ms, ..
            }) => Some((id.clone(), *at, *hold_ms)),
            _ => None,
        }
    }

    /// Whether the worker has gone quiet for `phase`.
    pub fn idle_for(&self, phase: &str) -> bool {
        matches!(self.lines.last(), Some(Line::Idle { phase: p }) if p == phase)
    }
}

/// Every interval of protected work in `logs`. Work that a log opened and never closed ended
/// when its process was killed (from `kills`); without a kill it is reported as `open`.
pub fn intervals(logs: &[WorkerLog], kills: &[Kill], now: Ns) -> Vec<Interval> {
    let mut out = Vec::new();
    for log in logs {
        let mut open: Option<(String, Ns)> = None;
        let mut local = false;
        for line in &log.lines {
            match line {
                Line::Start { id, at, token, .. } => {
                    open = Some((id.clone(), *at));
                    local = *token == 0;
                }
                Line::Work {
                    id,
                    start,
                    end,
                    outcome,
                } => {
                    open = None;
                    out.push(Interval {
                        worker: log.worker,
                        generation: log.generation,
                        id: id.clone(),
                        start: *start,
                        end: *end,
                        local,
                        outcome: outcome.clone(),
                    });
                }
                _ => {}
            }
        }
        if let Some((id, start)) = open {
            let kill = kills
                .iter()
                .find(|k| k.worker == log.worker && k.generation == log.generation);
            out.push(Interval {
                worker: log.worker,
                generation: log.generation,
                id,
                start,
                end: kill.map_or(now, |k| k.at.max(start)),
                local,
                outcome: if kill.is_some() { "killed" } else { "open" }.into(),
            });
        }
    }
    out.sort_by_key(|i| (i.start, i.end));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_killed_worker_s_open_work_ends_at_the_kill() {
        let text = "begin 1 5\nstart w0.0-0 7 10 300\nwork w0.0-0 10 40 completed\n\
                    start w0.0-1 9 50 300\nstale w0.0-1 60\n";
        let log = WorkerLog {
            worker: 0,
            generation: 0,
            lines: parse(text),
        };
        assert_eq!(log.working(), Some(("w0.0-1".into(), 50, 300)));
        let kills = [Kill {
            worker: 0,
            generation: 0,
            at: 70,
        }];
        let got = intervals(&[log], &kills, 100);
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[0].start, got[0].end, got[0].outcome.as_str()),
            (10, 40, "completed")
        );
        assert_eq!(
            (got[1].start, got[1].end, got[1].outcome.as_str()),
            (50, 70, "killed")
        );
    }
}
