//! `leasehold run` under a parent that never reaps the processes it adopts (an init that does
//! not reap, as in many containers): a process of the command's group that has ended but was
//! never reaped must not hold the slot. Its own test binary, because it makes the test process
//! such a parent.

mod common;

use std::time::{Duration, Instant};

use common::*;
use leasehold_testkit::RedisServer;

#[test]
fn a_leftover_that_ended_but_was_never_reaped_does_not_hold_the_slot() {
    // Orphans of the run's command are adopted by this process, which does not reap them.
    // SAFETY: prctl(2) setting a flag on this process; no memory involved.
    assert_eq!(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) }, 0);
    let server = RedisServer::start();
    let dir = TempDir::new("leasehold-reaping");
    let pidfile = dir.join("pid");
    let script = format!("sleep 60 & echo $! > {}; exit 0", pidfile.display());
    let grace = Duration::from_secs(20);
    let started = Instant::now();
    let out = run_cli(
        &server.url(),
        "zombie",
        [
            "run", "--limit", "1", "--grace", "20s", "--", "sh", "-c", &script,
        ],
    );
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let leftover = pid_from(&pidfile);
    // The scenario happened: the leftover was ended and is a zombie nobody reaps.
    assert_eq!(
        proc_stat(leftover).and_then(|s| s.chars().next()),
        Some('Z'),
        "the leftover is not a zombie"
    );
    assert_eq!(holders(&server, "zombie"), 0, "the slot is still held");
    assert!(
        took < grace / 2,
        "the run took {took:?}: it waited on a zombie (grace {grace:?})"
    );
    println!("run with a zombie leftover ended after {took:?} (grace {grace:?})");
    // SAFETY: waitpid(2) on our own (adopted) child, reaping it; no memory beyond the status.
    unsafe { libc::waitpid(leftover, std::ptr::null_mut(), 0) };
}
