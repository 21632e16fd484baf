//! A worker process for the multi-process tests: it takes leases from a Redis-backed quota and
//! reports what it did on stdout, one line per event, so a test can check the fleet from outside.
//!
//! ```text
//! worker hammer URL QUOTA LIMIT TTL_MS RUN_MS HOLD_US
//!     acquire, hold HOLD_US, release, again, for RUN_MS; prints "hold START_NS END_NS" per
//!     cycle, in CLOCK_MONOTONIC nanoseconds (comparable across processes on one machine):
//!     START after the lease was granted, END before it is released.
//! worker try URL QUOTA LIMIT TTL_MS TASK_ID
//!     one admission attempt; prints "acquired TOKEN" or "full".
//! worker hold URL QUOTA LIMIT TTL_MS TASK_ID HOLD_MS
//!     acquire (waiting), print "acquired TOKEN", hold HOLD_MS while renewing, print "held" if
//!     the lease was never lost (else "lost REASON"), release.
//! worker clock URL QUOTA LIMIT TTL_MS
//!     prints "clock MS": this process's wall clock, in ms since the Unix epoch (a test checks
//!     that a clock it skewed really is skewed).
//! ```

use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
    let quota = Quota::builder(arg(&args, 2))
        .limit(num(&args, 3))
        .ttl(Duration::from_millis(num(&args, 4)))
        .backend(backend)
        .build()?;
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
                lease.release().await?;
                println!("hold {start} {stop}");
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
        "hold" => {
            let lease = quota.acquire(arg(&args, 5)).await?;
            println!("acquired {}", lease.fencing_token());
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(num(&args, 6))) => println!("held"),
                reason = lease.lost() => println!("lost {reason}"),
            }
            lease.release().await?;
        }
        "clock" => {
            let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
            println!("clock {}", now.as_millis());
        }
        other => panic!("unknown mode {other:?}"),
    }
    Ok(())
}
