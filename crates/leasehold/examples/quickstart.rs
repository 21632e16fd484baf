//! Twelve tasks share a quota of three slots; each holds its slot for a while, then releases it.
//! The program prints who holds what and checks that no more than three ever ran at once.
//!
//! ```text
//! cargo run -p leasehold --example quickstart                    # embedded backend
//! LEASEHOLD_REDIS_URL=redis://127.0.0.1:6379/ cargo run -p leasehold --example quickstart
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::{Quota, RedisBackend};

#[tokio::main]
async fn main() -> Result<(), leasehold::Error> {
    let builder = Quota::builder("quickstart")
        .limit(3)
        .ttl(Duration::from_secs(2));
    let quota = match std::env::var("LEASEHOLD_REDIS_URL") {
        Ok(url) => builder
            .backend(RedisBackend::connect(&url).await?)
            .build()?,
        Err(_) => builder.build()?, // embedded, in-process backend
    };
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..12 {
        let (quota, running, peak) = (quota.clone(), running.clone(), peak.clone());
        tasks.push(tokio::spawn(async move {
            let lease = quota.acquire(&format!("task-{i:02}")).await?;
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            println!(
                "{:>6.0?}  task-{i:02} holds a slot (fencing token {}, {now} running)",
                start.elapsed(),
                lease.fencing_token()
            );
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(150 + 40 * (i % 4))) => {}
                reason = lease.lost() => println!("task-{i:02} lost its lease: {reason}"),
            }
            running.fetch_sub(1, Ordering::SeqCst);
            lease.release().await
        }));
    }
    for task in tasks {
        task.await.expect("task panicked")?;
    }
    let status = quota.status().await?;
    println!(
        "done in {:.2?}: peak concurrency {} (limit {}), {} holders left",
        start.elapsed(),
        peak.load(Ordering::SeqCst),
        quota.limit(),
        status.holders.len()
    );
    assert!(peak.load(Ordering::SeqCst) <= 3);
    Ok(())
}
