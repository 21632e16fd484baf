//! A worker process for the multi-process tests: it takes leases from a Redis-backed quota and
//! reports what it did on stdout, one line per event, so a test can check the fleet from outside.
//!
//! ```text
//! worker hammer URL QUOTA LIMIT TTL_MS RUN_MS HOLD_US
//!     acquire, hold HOLD_US, release, again, for RUN_MS; prints "hold START_NS END_NS TOKEN"
//!     per cycle, in CLOCK_MONOTONIC nanoseconds (comparable across processes on one machine):
//!     START after the lease was granted, END before it is released; TOKEN its fencing token.
//! worker try URL QUOTA LIMIT TTL_MS TASK_ID
//!     one admission attempt; prints "acquired TOKEN" or "full".
//! worker drop URL QUOTA LIMIT TTL_MS TASK_ID FLUSH
//!     one admission attempt; prints "acquired TOKEN" (or fails), drops the lease, awaits
//!     `Quota::flush` if FLUSH is "flush", and exits the process at once (`process::exit`).
//! worker hold URL QUOTA LIMIT TTL_MS TASK_ID HOLD_MS
//!     acquire (waiting), print "acquired TOKEN", hold HOLD_MS while renewing, print "held" if
//!     the lease was never lost (else "lost REASON"), release.
//! worker work URL QUOTA LIMIT TTL_MS TASK_ID MARKER_TTL_MS EVENTS RUN_MS
//!     the quota's cancel markers live MARKER_TTL_MS; EVENTS is "events" to subscribe to the
//!     quota's events, anything else not to (a holder then learns of a cancel only from a
//!     renewal). Acquire (waiting), print "acquired TOKEN", then work for RUN_MS in 20 ms
//!     steps: a step starts only while the lease is held and counts only if the lease is still
//!     held when it ends; prints "step START_NS END_NS committed" (or "discarded", and stops),
//!     in CLOCK_MONOTONIC nanoseconds. Then "lost REASON" (the `LostReason` in `Debug` form) or
//!     "completed", then "done", and releases.
//! worker tick URL QUOTA LIMIT TTL_MS TASK_ID TICK_MS
//!     acquire (waiting), print "acquired TOKEN", then every TICK_MS print
//!     "tick MONO_NS WALL_MS LOCAL_LEFT_MS DEADLINE_MS": CLOCK_MONOTONIC nanoseconds, this
//!     process's wall clock (ms since the Unix epoch: a test that steps it sees the step), the
//!     ms left to the lease's local (monotonic) deadline, and the lease's deadline as the server
//!     last acknowledged it (server ms). Stops at a line "release" on stdin (or its end): then
//!     releases and prints "released"; or when the lease is lost: "lost REASON" (`Debug` form).
//!     Then "done".
//! worker clock URL QUOTA LIMIT TTL_MS
//!     prints "clock MS": this process's wall clock, in ms since the Unix epoch (a test checks
//!     that a clock it skewed really is skewed).
//! ```

use std::io::BufRead;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use leasehold::{Error, Quota, RedisBackend};
use leasehold_testkit::monotonic_ns;

fn arg(args: &[String], i: usize) -> &str {
    args.get(i)
        .unwrap_or_else(|| panic!("missing argument {i}; see the module doc"))
}

fn num(args: &[String], i: usize) -> u64 {
    arg(args, i)
        .parse()
        .unwrap_or_else(|e| panic!("argument {i}: {e}"))
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = arg(&args, 0).to_owned();
    let backend = RedisBackend::connect(arg(&args, 1)).await?;
    let mut builder = Quota::builder(arg(&args, 2))
        .limit(num(&args, 3))
        .ttl(Duration::from_millis(num(&args, 4)))
        .backend(backend);
    if mode == "work" {
        builder = builder
            .cancel_marker_ttl(Duration::from_millis(num(&args, 6)))
            .events(arg(&args, 7) == "events");
    }
    let quota = builder.build()?;
    match mode.as_str() {
        "hammer" => {
            let run = Duration::from_millis(num(&args, 5));
            let hold = Duration::from_micros(num(&args, 6));
            let end = tokio::time::Instant::now() + run;
            let mut i = 0u64;
            let pid = std::process::id();
            while tokio::time::Instant::now() < end {
                let lease = quota.acquire(&format!("p{pid}-{i}")).await?;
                let start = monotonic_ns();
                tokio::time::sleep(hold).await;
                let stop = monotonic_ns();
                let token = lease.fencing_token();
                lease.release().await?;
                println!("hold {start} {stop} {token}");
                i += 1;
            }
        }
        "try" => match quota.try_acquire(arg(&args, 5)).await {
            Ok(lease) => {
                println!("acquired {}", lease.fencing_token());
                // Keep it: the test decides when it goes away.
                std::mem::forget(lease);
            }
            Err(Error::Full { .. }) => println!("full"),
            Err(e) => return Err(e),
        },
        "drop" => {
            let lease = quota.try_acquire(arg(&args, 5)).await?;
            println!("acquired {}", lease.fencing_token());
            drop(lease);
            if arg(&args, 6) == "flush" {
                quota.flush().await;
            }
            std::process::exit(0);
        }
        "hold" => {
            let lease = quota.acquire(arg(&args, 5)).await?;
            println!("acquired {}", lease.fencing_token());
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(num(&args, 6))) => println!("held"),
                reason = lease.lost() => println!("lost {reason}"),
            }
            lease.release().await?;
        }
        "work" => {
            let lease = quota.acquire(arg(&args, 5)).await?;
            println!("acquired {}", lease.fencing_token());
            let end = tokio::time::Instant::now() + Duration::from_millis(num(&args, 8));
            let mut stopped = false;
            while tokio::time::Instant::now() < end && lease.ensure_held().is_ok() {
                let start = monotonic_ns();
                tokio::time::sleep(Duration::from_millis(20)).await;
                let stop = monotonic_ns();
                // The commit point: a step that outlived the lease (the process was paused
                // across its deadline, say) is thrown away, not counted.
                if lease.ensure_held().is_ok() {
                    println!("step {start} {stop} committed");
                } else {
                    println!("step {start} {stop} discarded");
                    stopped = true;
                    break;
                }
            }
            stopped |= lease.ensure_held().is_err();
            if stopped {
                // ensure_held fails at the local deadline; the reason follows when the renewal
                // task (or an event) records it.
                match tokio::time::timeout(Duration::from_secs(10), lease.lost()).await {
                    Ok(reason) => println!("lost {reason:?}"),
                    Err(_) => println!("lost unreported"),
                }
            } else {
                println!("completed");
            }
            println!("done");
            lease.release().await?;
        }
        "tick" => {
            let lease = quota.acquire(arg(&args, 5)).await?;
            println!("acquired {}", lease.fencing_token());
            // A thread, not tokio's stdin: a blocking read must not hold up the ticks.
            let (release_tx, mut release_rx) = tokio::sync::oneshot::channel::<()>();
            std::thread::spawn(move || {
                for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                    if line.trim() == "release" {
                        break;
                    }
                }
                let _ = release_tx.send(());
            });
            let mut ticks = tokio::time::interval(Duration::from_millis(num(&args, 6)));
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticks.tick() => {
                        if let Err(e) = lease.ensure_held() {
                            // The reason may follow the local deadline by a moment.
                            let reason = tokio::time::timeout(Duration::from_secs(10), lease.lost())
                                .await
                                .map_or_else(|_| format!("unreported ({e})"), |r| format!("{r:?}"));
                            println!("lost {reason}");
                            break;
                        }
                        let mono = monotonic_ns();
                        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
                        let left = lease.local_deadline().saturating_duration_since(Instant::now());
                        let deadline = lease.deadline().duration_since(UNIX_EPOCH).unwrap();
                        println!(
                            "tick {mono} {} {} {}",
                            wall.as_millis(),
                            left.as_millis(),
                            deadline.as_millis()
                        );
                    }
                    reason = lease.lost() => {
                        println!("lost {reason:?}");
                        break;
                    }
                    _ = &mut release_rx => {
                        lease.release().await?;
                        println!("released");
                        break;
                    }
                }
            }
            println!("done");
        }
        "clock" => {
            let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
            println!("clock {}", now.as_millis());
        }
        other => panic!("unknown mode {other:?}"),
    }
    Ok(())
}
