//! Splits the server-to-client byte stream into RESP2/RESP3 frames so that Pub/Sub deliveries
//! can be dropped while every other frame passes unchanged.

/// Push kinds that carry a published message (the ones a lost Pub/Sub message would be).
const DELIVERIES: [&[u8]; 3] = [b"message", b"pmessage", b"smessage"];

/// A frame scanner for one connection. While dropping is off and no partial frame is held, bytes
/// are still framed (so that turning dropping on mid-stream stays aligned).
#[derive(Debug, Default)]
pub(crate) struct PushFilter {
    pending: Vec<u8>,
    /// Set when the stream held something this scanner cannot frame: from then on it forwards
    /// everything untouched rather than risk corrupting the stream.
    passthrough: bool,
}

impl PushFilter {
    /// Takes the next bytes read from the server; returns the bytes to forward.
    pub(crate) fn feed(&mut self, bytes: &[u8], drop_deliveries: bool) -> Vec<u8> {
        if self.passthrough {
            return bytes.to_vec();
        }
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::with_capacity(self.pending.len());
        let mut pos = 0;
        loop {
            match frame_end(&self.pending, pos) {
                Ok(Some(end)) => {
                    let frame = &self.pending[pos..end];
                    if !(drop_deliveries && is_delivery(frame)) {
                        out.extend_from_slice(frame);
                    }
                    pos = end;
                }
                Ok(None) => break,
                Err(Unframeable) => {
                    self.passthrough = true;
                    out.extend_from_slice(&self.pending[pos..]);
                    pos = self.pending.len();
                    break;
                }
            }
        }
        self.pending.drain(..pos);
        out
    }
}

/// The stream holds a type byte this scanner does not know.
#[derive(Debug, PartialEq, Eq)]
struct Unframeable;

/// Whether `frame` (one complete frame) is a push whose first element names a delivery.
fn is_delivery(frame: &[u8]) -> bool {
    if frame.first() != Some(&b'>') {
        return false;
    }
    let Some(header_end) = line_end(frame, 0) else {
        return false;
    };
    let Ok(Some(first_end)) = frame_end(frame, header_end) else {
        return false;
    };
    let first = &frame[header_end..first_end];
    // `$7\r\nmessage\r\n` (bulk) or `+message\r\n` (simple string).
    let body = match first.first() {
        Some(b'$') => line_end(first, 0).map(|start| &first[start..first.len() - 2]),
        Some(b'+') => Some(&first[1..first.len() - 2]),
        _ => None,
    };
    body.is_some_and(|kind| DELIVERIES.contains(&kind))
}

/// The index just past the `\r\n` that ends the line starting at `pos`, if it is complete.
fn line_end(buf: &[u8], pos: usize) -> Option<usize> {
    buf.get(pos..)?
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|i| pos + i + 2)
}

/// The integer on the line starting at `pos` (after its type byte), and where the line ends.
fn header(buf: &[u8], pos: usize) -> Result<Option<(i64, usize)>, Unframeable> {
    let Some(end) = line_end(buf, pos) else {
        return Ok(None);
    };
    let text = std::str::from_utf8(&buf[pos + 1..end - 2]).map_err(|_| Unframeable)?;
    let n = text.parse::<i64>().map_err(|_| Unframeable)?;
    Ok(Some((n, end)))
}

/// The end of the complete frame starting at `pos`, `None` if more bytes are needed.
fn frame_end(buf: &[u8], pos: usize) -> Result<Option<usize>, Unframeable> {
    let Some(&kind) = buf.get(pos) else {
        return Ok(None);
    };
    match kind {
        // Simple string, error, integer, null, boolean, double, big number.
        b'+' | b'-' | b':' | b'_' | b'#' | b',' | b'(' => Ok(line_end(buf, pos)),
        // Bulk string, bulk error, verbatim string.
        b'$' | b'!' | b'=' => {
            let Some((len, body)) = header(buf, pos)? else {
                return Ok(None);
            };
            if len < 0 {
                return Ok(Some(body));
            }
            let end = body + usize::try_from(len).map_err(|_| Unframeable)? + 2;
            Ok((buf.len() >= end).then_some(end))
        }
        // Array, set, push; map and attribute hold pairs.
        b'*' | b'~' | b'>' | b'%' | b'|' => {
            let Some((count, mut next)) = header(buf, pos)? else {
                return Ok(None);
            };
            let elements = if matches!(kind, b'%' | b'|') {
                count.saturating_mul(2)
            } else {
                count
            };
            for _ in 0..elements.max(0) {
                match frame_end(buf, next)? {
                    Some(end) => next = end,
                    None => return Ok(None),
                }
            }
            if kind == b'|' {
                // An attribute precedes the frame it describes.
                return frame_end(buf, next);
            }
            Ok(Some(next))
        }
        _ => Err(Unframeable),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MESSAGE: &[u8] = b">3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$5\r\nhello\r\n";
    const SUBSCRIBED: &[u8] = b">3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n";
    const REPLY: &[u8] = b"*2\r\n:1\r\n%1\r\n+k\r\n$3\r\na\r\n\r\n";

    #[test]
    fn drops_only_deliveries_whatever_the_chunking() {
        let stream = [REPLY, MESSAGE, SUBSCRIBED, b"+PONG\r\n", MESSAGE].concat();
        let kept = [REPLY, SUBSCRIBED, b"+PONG\r\n"].concat();
        for chunk in 1..stream.len() {
            let mut filter = PushFilter::default();
            let out: Vec<u8> = stream
                .chunks(chunk)
                .flat_map(|c| filter.feed(c, true))
                .collect();
            assert_eq!(out, kept, "chunk size {chunk}");
        }
    }

    #[test]
    fn forwards_everything_when_not_dropping() {
        let stream = [MESSAGE, REPLY, b"$-1\r\n_\r\n"].concat();
        let mut filter = PushFilter::default();
        assert_eq!(filter.feed(&stream, false), stream);
    }

    #[test]
    fn unknown_bytes_switch_to_passthrough() {
        let mut filter = PushFilter::default();
        assert_eq!(filter.feed(b"?weird", true), b"?weird");
        assert_eq!(filter.feed(MESSAGE, true), MESSAGE);
    }
}
