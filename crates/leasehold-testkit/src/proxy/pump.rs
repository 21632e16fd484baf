//! One direction of one proxied connection: read, delay, hold while stalled, filter, write.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::push_filter::PushFilter;
use super::{Faults, Links};

/// Longest a forwarding thread blocks before it looks at the switches again.
const TICK: Duration = Duration::from_millis(5);
/// Bound on one write: a peer that stops reading for this long ends the connection.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// Bytes held (delayed or stalled) before the thread stops reading from its source.
const MAX_HELD: usize = 16 << 20;
/// Bound on delivering what is still queued once the source has closed.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);

/// Which way the bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Client to server: requests.
    ToServer,
    /// Server to client: replies and pushes (the only direction that can drop pushes).
    ToClient,
}

/// Forwards `src` to `dst` until either side closes, the connection is closed, or the proxy
/// stops; then shuts both sockets down so that the other direction ends too. Once the connection
/// is wedged, reads go on and are thrown away.
pub(crate) fn forward(
    mut src: TcpStream,
    mut dst: TcpStream,
    direction: Direction,
    links: &Links,
    faults: &Faults,
) {
    let closed: &AtomicBool = &links.closed;
    let _ = dst.set_write_timeout(Some(WRITE_TIMEOUT));
    let mut queue: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut held = 0usize;
    let mut filter = PushFilter::default();
    let mut buf = vec![0u8; 64 * 1024];
    let mut source_open = true;
    let mut drain_until = None;
    while !closed.load(Ordering::Relaxed) && !faults.stopping() {
        if links.wedged.load(Ordering::Relaxed) {
            // Read on, so that a side that closes ends the connection, and forward nothing.
            queue.clear();
            held = 0;
            let _ = src.set_read_timeout(Some(TICK));
            match src.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if is_timeout(&e) => {}
                Err(_) => break,
            }
            continue;
        }
        if faults.stalled() {
            thread::sleep(TICK);
            continue;
        }
        let now = Instant::now();
        if deliver_due(&mut queue, &mut held, &mut dst, now).is_err() {
            break;
        }
        if !source_open {
            let until = *drain_until.get_or_insert(now + DRAIN_LIMIT);
            if queue.is_empty() || now >= until {
                break;
            }
            thread::sleep(wait_for(&queue, now));
            continue;
        }
        if held >= MAX_HELD {
            thread::sleep(wait_for(&queue, now));
            continue;
        }
        let _ = src.set_read_timeout(Some(wait_for(&queue, now)));
        match src.read(&mut buf) {
            Ok(0) => source_open = false,
            Ok(n) => {
                let data = if direction == Direction::ToClient {
                    filter.feed(&buf[..n], faults.drop_pushes())
                } else {
                    buf[..n].to_vec()
                };
                if !data.is_empty() {
                    held += data.len();
                    queue.push_back((Instant::now() + faults.latency(direction), data));
                }
            }
            Err(e) if is_timeout(&e) => {}
            Err(_) => break,
        }
    }
    let _ = src.shutdown(Shutdown::Both);
    let _ = dst.shutdown(Shutdown::Both);
}

/// Writes every queued chunk whose time has come, in order.
fn deliver_due(
    queue: &mut VecDeque<(Instant, Vec<u8>)>,
    held: &mut usize,
    dst: &mut TcpStream,
    now: Instant,
) -> io::Result<()> {
    while queue.front().is_some_and(|(due, _)| *due <= now) {
        if let Some((_, chunk)) = queue.pop_front() {
            *held -= chunk.len();
            dst.write_all(&chunk)?;
        }
    }
    Ok(())
}

/// How long to block before the next queued chunk is due (at most one tick, at least 1 ms).
fn wait_for(queue: &VecDeque<(Instant, Vec<u8>)>, now: Instant) -> Duration {
    queue
        .front()
        .map_or(TICK, |(due, _)| due.saturating_duration_since(now))
        .clamp(Duration::from_millis(1), TICK)
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}
