//! The demo page in a real browser: Debian's `chromium`, headless, driven through its
//! `chromedriver` by fantoccini, against the built `leasehold demo` on a free port.
//!
//! Needs `chromium` and `chromium-driver` (scripts/test installs them); without them the test
//! fails and says so. Leaves a screenshot at target/demo-e2e.png.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use leasehold_testkit::{free_port, Reaped, SpawnReaped, TempDir};
use serde_json::{json, Value};

/// The flags that work on a closed network, as root, without a display.
const CHROMIUM_FLAGS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1440,1000",
];

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

fn require(name: &str) -> PathBuf {
    on_path(name).unwrap_or_else(|| {
        panic!(
            "`{name}` is not installed: the browser test needs Debian's chromium and \
             chromium-driver (apt-get install -y chromium chromium-driver; scripts/test installs \
             them when run as root)"
        )
    })
}

/// Starts the demo with fast settings (a crash every fourth task, 1 s ttl, 0.6 s tasks) so
/// that a few seconds show all three behaviours; returns it and the page's URL.
fn start_demo() -> (Reaped, String) {
    let mut demo = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args([
            "demo",
            "--port",
            "0",
            "--limit",
            "10",
            "--crash-probability",
            "0.25",
        ])
        .args(["--ttl", "1s", "--task-duration", "600ms", "--seed", "2"])
        .env_remove("LEASEHOLD_REDIS_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn_reaped();
    let stdout = demo.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("leasehold demo printed no URL within 30 s");
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://127.0.0.1:"))
        .unwrap_or_else(|| panic!("no URL in {line:?}"))
        .to_owned();
    (demo, url)
}

/// chromedriver in a process group of its own, killed whole when dropped: the chromium it
/// starts would otherwise outlive a failed test (found by review).
struct Driver(Reaped);

impl Drop for Driver {
    fn drop(&mut self) {
        // SAFETY: kill(2) of the group this test started; no memory involved.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
    }
}

fn start_chromedriver(binary: &Path) -> (Driver, u16) {
    let port = free_port();
    let driver = Command::new(binary)
        .arg(format!("--port={port}"))
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn_reaped();
    let driver = Driver(driver);
    let end = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < end,
            "chromedriver did not listen within 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (driver, port)
}

async fn browser(chromium: &Path, driver_port: u16, profile: &Path) -> Client {
    let mut args: Vec<String> = CHROMIUM_FLAGS.iter().map(|f| f.to_string()).collect();
    args.push(format!("--user-data-dir={}", profile.display()));
    let capabilities = json!({
        "browserName": "chrome",
        "goog:chromeOptions": { "binary": chromium, "args": args },
    });
    let Value::Object(capabilities) = capabilities else {
        unreachable!("an object literal")
    };
    ClientBuilder::new(HttpConnector::new())
        .capabilities(capabilities)
        .connect(&format!("http://127.0.0.1:{driver_port}"))
        .await
        .expect("a chromium session through chromedriver")
}

/// What the page shows for one column: its data attributes and what its grid and chart hold.
#[derive(Debug, Clone, Default)]
struct Column {
    admitted: u64,
    refused: u64,
    over: u64,
    available: i64,
    crashed: u64,
    recovered: u64,
    cells: u64,
    live_cells: u64,
    crashed_cells: u64,
    chart_points: u64,
    chart: String,
}

const READ_COLUMNS: &str = r#"
return ["counter", "ttl-counter", "lease"].map((kind) => {
  const col = document.getElementById("col-" + kind);
  const line = col.querySelector("polyline.line-available");
  const points = line ? line.getAttribute("points") : "";
  return {
    ...col.dataset,
    cells: col.querySelectorAll(".grid .cell").length,
    live_cells: col.querySelectorAll(".grid .cell.live").length,
    crashed_cells: col.querySelectorAll(".grid .cell.crashed").length,
    chart_points: points ? points.split(" ").length : 0,
    chart: points,
  };
});"#;

async fn read_columns(client: &Client) -> Vec<Column> {
    let value = client
        .execute(READ_COLUMNS, vec![])
        .await
        .expect("run a script");
    let number = |v: &Value, key: &str| -> i64 {
        match &v[key] {
            Value::Number(n) => n.as_i64().unwrap_or(0),
            Value::String(s) => s.parse().unwrap_or(0),
            _ => 0,
        }
    };
    value
        .as_array()
        .expect("three columns")
        .iter()
        .map(|v| Column {
            admitted: number(v, "admitted") as u64,
            refused: number(v, "refused") as u64,
            over: number(v, "over") as u64,
            available: number(v, "available"),
            crashed: number(v, "crashed") as u64,
            recovered: number(v, "recovered") as u64,
            cells: number(v, "cells") as u64,
            live_cells: number(v, "live_cells") as u64,
            crashed_cells: number(v, "crashed_cells") as u64,
            chart_points: number(v, "chart_points") as u64,
            chart: v["chart"].as_str().unwrap_or_default().to_owned(),
        })
        .collect()
}

async fn phase(client: &Client) -> String {
    let v = client
        .execute(
            "return document.getElementById('phase').textContent",
            vec![],
        )
        .await
        .expect("read the phase");
    v.as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_counters_leaking_and_leases_healing() {
    let chromium = require("chromium");
    let chromedriver = require("chromedriver");
    let (_demo, url) = start_demo();
    let (_driver, driver_port) = start_chromedriver(&chromedriver);
    let profile = TempDir::new("leasehold-demo-chromium");
    let client = browser(&chromium, driver_port, &profile).await;
    client.goto(&url).await.expect("open the page");

    // The page connected to the event stream and shows an idle experiment with empty grids.
    let end = Instant::now() + Duration::from_secs(15);
    while phase(&client).await != "idle" {
        assert!(Instant::now() < end, "the page never showed the idle phase");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = read_columns(&client).await;
    assert_eq!(before.len(), 3);
    for c in &before {
        assert_eq!((c.cells, c.live_cells, c.admitted), (10, 0, 0), "{c:?}");
    }

    client
        .find(Locator::Id("start"))
        .await
        .expect("the start button")
        .click()
        .await
        .expect("press start");

    // Watch for up to 40 s; stop once everything the test checks has shown, after 10 s at least
    // so that the charts (and the screenshot) hold some history.
    let started = Instant::now();
    let mut seen_live = [false; 3];
    let mut seen_crashed_lease = false;
    let mut counter_dead_at: Option<(Instant, u64)> = None;
    let mut lease_available_after_counter_died = 0;
    let mut history: Vec<Vec<Column>> = Vec::new();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = read_columns(&client).await;
        for (seen, c) in seen_live.iter_mut().zip(&now) {
            *seen |= c.live_cells > 0;
        }
        seen_crashed_lease |= now[2].crashed_cells > 0;
        if now[0].available == 0 && now[0].crashed == 10 && counter_dead_at.is_none() {
            counter_dead_at = Some((Instant::now(), now[0].refused));
        }
        if counter_dead_at.is_some() {
            lease_available_after_counter_died =
                lease_available_after_counter_died.max(now[2].available);
        }
        history.push(now.clone());
        let counter_refusals_grew = counter_dead_at.is_some_and(|(at, refused)| {
            at.elapsed() >= Duration::from_secs(2) && now[0].refused > refused
        });
        let done = started.elapsed() >= Duration::from_secs(10)
            && seen_live.iter().all(|&s| s)
            && counter_refusals_grew
            && now[2].recovered >= 1
            && lease_available_after_counter_died > 0;
        if done || started.elapsed() >= Duration::from_secs(40) {
            break;
        }
    }

    let shot = client.screenshot().await.expect("a screenshot");
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory")
        .join("demo-e2e.png");
    std::fs::write(&target, shot).expect("write the screenshot");
    eprintln!("screenshot: {}", target.display());
    let _ = client.close().await;

    let last = history.last().expect("at least one reading");
    let first = &history[0];
    assert!(
        seen_live.iter().all(|&s| s),
        "every grid showed running tasks: {seen_live:?}"
    );
    for (i, (a, b)) in first.iter().zip(last).enumerate() {
        assert!(
            b.chart_points > a.chart_points && b.chart_points >= 50,
            "chart {i} grew: {a:?} -> {b:?}"
        );
        assert_ne!(a.chart, b.chart, "chart {i} changed");
        assert!(b.admitted > 0, "column {i} admitted tasks");
    }
    let (dead_at, refused_then) =
        counter_dead_at.expect("the counter leaked every slot: available 0, 10 crashed");
    assert!(dead_at.elapsed() >= Duration::from_secs(2));
    assert!(
        last[0].refused > refused_then,
        "the dead counter kept refusing: {refused_then} -> {}",
        last[0].refused
    );
    assert_eq!(last[0].available, 0, "the counter never recovers");
    assert!(seen_crashed_lease, "the lease grid showed a crashed slot");
    assert!(
        last[2].recovered >= 1,
        "the lease reclaimed crashed slots: {:?}",
        last[2]
    );
    assert!(
        lease_available_after_counter_died > 0,
        "the lease still had capacity after the counter died"
    );
    assert_eq!(last[2].over, 0, "the lease never over-admits");
}
