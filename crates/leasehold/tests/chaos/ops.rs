//! What the test itself does to the quota: cancels (through the library, or by writing the
//! marker alone), and the end-of-phase leak check (raw Redis reads, then probe acquires).

use std::time::Duration;

use leasehold::{Quota, RedisBackend};
use leasehold_testkit::{RedisServer, Reply};
use tokio::runtime::Runtime;

/// A quota handle of the test's own, connected straight to the server (not through a proxy).
pub struct Ops {
    rt: Runtime,
    quota: Quota,
}

/// The state of the quota after one ttl of quiet.
#[derive(Debug, Clone, Copy, Default)]
pub struct Leak {
    /// Members of the leases ZSET (expired ones not yet reaped included).
    pub zcard: i64,
    /// Live leases (deadline after the server's now): leaked slots.
    pub live: i64,
    /// Probe leases admitted out of `limit` tries.
    pub probes_admitted: u64,
    /// Members of the leases ZSET after the probes were admitted and released.
    pub zcard_after: i64,
}

impl Ops {
    /// Connects to `server` for the quota `name`.
    pub fn connect(server: &RedisServer, name: &str, limit: u64, ttl: Duration) -> Ops {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("test runtime");
        let quota = rt.block_on(async {
            let backend = RedisBackend::connect(&server.url())
                .await
                .expect("the test connects to its server");
            Quota::builder(name)
                .limit(limit)
                .ttl(ttl)
                .backend(backend)
                .build()
                .expect("quota settings")
        });
        Ops { rt, quota }
    }

    /// The quota's heartbeat (the library's default for this ttl).
    pub fn heartbeat(&self) -> Duration {
        self.quota.heartbeat()
    }

    /// Cancels `id` through the library (marker, then Pub/Sub message); false if the call
    /// failed (Redis unreachable).
    pub fn cancel(&self, id: &str) -> bool {
        self.rt.block_on(self.quota.cancel(id, "chaos")).is_ok()
    }

    /// Cancels `id` by writing only its marker, as if every cancel message were lost; false if
    /// the write failed (Redis unreachable).
    pub fn cancel_marker_only(&self, server: &RedisServer, id: &str) -> bool {
        let key = format!("leasehold:{{{}}}:cancel:{id}", self.quota.name());
        let args = ["SET", &key, "chaos (marker only)", "PX", "60000"];
        let reply = server.try_command_timeout(&args, Duration::from_millis(500));
        matches!(reply, Ok(Reply::Status(ok)) if ok == "OK")
    }

    /// Reads the leases ZSET, then admits and releases `limit` probe leases.
    pub fn leak_check(&self, server: &RedisServer, phase: &str) -> Leak {
        let leases = format!("leasehold:{{{}}}:leases", self.quota.name());
        let zcard = || {
            server
                .command(&["ZCARD", &leases])
                .as_int()
                .expect("ZCARD is an integer")
        };
        let mut leak = Leak {
            zcard: zcard(),
            ..Leak::default()
        };
        let now_ms = match server.command(&["TIME"]) {
            Reply::Array(parts) => {
                let part = |i: usize| -> u64 {
                    parts[i]
                        .as_string()
                        .and_then(|s| s.parse().ok())
                        .expect("TIME parts")
                };
                part(0) * 1000 + part(1) / 1000
            }
            other => panic!("TIME replied {other:?}"),
        };
        leak.live = server
            .command(&["ZCOUNT", &leases, &format!("({now_ms}"), "+inf"])
            .as_int()
            .expect("ZCOUNT is an integer");
        let limit = u64::from(self.quota.limit());
        self.rt.block_on(async {
            let mut held = Vec::new();
            for k in 0..limit {
                if let Ok(lease) = self.quota.try_acquire(&format!("probe-{phase}-{k}")).await {
                    held.push(lease);
                }
            }
            leak.probes_admitted = held.len() as u64;
            for lease in held {
                lease.release().await.expect("release a probe");
            }
        });
        leak.zcard_after = zcard();
        leak
    }
}
