//! A minimal, blocking RESP2 client: one command per fresh connection.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// A parsed RESP2 reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// A simple string (`+OK`).
    Status(String),
    /// An error reply (`-ERR ...`), without the leading `-`.
    Error(String),
    /// An integer reply (`:42`).
    Int(i64),
    /// A bulk string (`$3\r\nfoo`).
    Bulk(Vec<u8>),
    /// A null bulk string or null array (`$-1`, `*-1`).
    Nil,
    /// An array of replies, possibly nested.
    Array(Vec<Reply>),
}

impl Reply {
    /// The value of an integer reply, `None` for any other kind.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Reply::Int(n) => Some(*n),
            _ => None,
        }
    }

    /// The text of a bulk or status reply (UTF-8, lossy), `None` for any other kind.
    pub fn as_string(&self) -> Option<String> {
        match self {
            Reply::Bulk(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
            Reply::Status(s) => Some(s.clone()),
            _ => None,
        }
    }

    /// Whether this is an error reply whose text starts with `prefix`.
    pub fn is_error_starting_with(&self, prefix: &str) -> bool {
        matches!(self, Reply::Error(e) if e.starts_with(prefix))
    }
}

/// A reader over a TCP stream that enforces an overall deadline: before each
/// read, the socket's read timeout is set to the time left.
struct DeadlineReader {
    stream: TcpStream,
    deadline: Instant,
}

impl DeadlineReader {
    fn remaining(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "timed out waiting for a redis reply",
            ))
        } else {
            Ok(left)
        }
    }
}

impl Read for DeadlineReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.remaining()?;
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

/// Encodes `args` as a RESP2 array of bulk strings.
fn encode(args: &[&str], out: &mut Vec<u8>) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Reads one CRLF-terminated line, without the terminator.
fn read_line(reader: &mut impl BufRead) -> io::Result<String> {
    let mut line = Vec::new();
    reader.read_until(b'\n', &mut line)?;
    if !line.ends_with(b"\r\n") {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed in the middle of a redis reply",
        ));
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).map_err(|e| invalid(format!("non UTF-8 reply line: {e}")))
}

fn parse_len(text: &str) -> io::Result<i64> {
    text.parse()
        .map_err(|_| invalid(format!("bad length in redis reply: {text:?}")))
}

/// Reads one complete reply (recursing into arrays).
fn read_reply(reader: &mut impl BufRead) -> io::Result<Reply> {
    let line = read_line(reader)?;
    let Some(kind) = line.chars().next() else {
        return Err(invalid("empty redis reply line".to_owned()));
    };
    let rest = &line[kind.len_utf8()..];
    match kind {
        '+' => Ok(Reply::Status(rest.to_owned())),
        '-' => Ok(Reply::Error(rest.to_owned())),
        ':' => rest
            .parse()
            .map(Reply::Int)
            .map_err(|_| invalid(format!("bad integer reply: {rest:?}"))),
        '$' => {
            let len = parse_len(rest)?;
            if len < 0 {
                return Ok(Reply::Nil);
            }
            let len = usize::try_from(len).map_err(|e| invalid(e.to_string()))?;
            let mut data = vec![0; len + 2];
            reader.read_exact(&mut data)?;
            if !data.ends_with(b"\r\n") {
                return Err(invalid("bulk reply not terminated by CRLF".to_owned()));
            }
            data.truncate(len);
            Ok(Reply::Bulk(data))
        }
        '*' => {
            let len = parse_len(rest)?;
            if len < 0 {
                return Ok(Reply::Nil);
            }
            (0..len)
                .map(|_| read_reply(reader))
                .collect::<io::Result<_>>()
                .map(Reply::Array)
        }
        other => Err(invalid(format!(
            "unknown redis reply type {other:?} in {line:?}"
        ))),
    }
}

/// Opens a fresh connection to `addr`, sends each command in `commands` in
/// order (pipelined) and returns their replies, all within `timeout`.
pub(crate) fn exchange(
    addr: SocketAddr,
    commands: &[&[&str]],
    timeout: Duration,
) -> io::Result<Vec<Reply>> {
    let deadline = Instant::now() + timeout;
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_nodelay(true)?;
    let left = deadline.saturating_duration_since(Instant::now());
    stream.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
    let mut request = Vec::new();
    for command in commands {
        encode(command, &mut request);
    }
    stream.write_all(&request)?;
    let mut reader = BufReader::new(DeadlineReader { stream, deadline });
    commands.iter().map(|_| read_reply(&mut reader)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> io::Result<Reply> {
        read_reply(&mut &bytes[..])
    }

    #[test]
    fn encodes_bulk_array() {
        let mut out = Vec::new();
        encode(&["SET", "k", ""], &mut out);
        assert_eq!(out, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n");
    }

    #[test]
    fn parses_every_kind() {
        assert_eq!(parse(b"+OK\r\n").unwrap(), Reply::Status("OK".into()));
        assert_eq!(
            parse(b"-ERR no\r\n").unwrap(),
            Reply::Error("ERR no".into())
        );
        assert_eq!(parse(b":-7\r\n").unwrap(), Reply::Int(-7));
        assert_eq!(parse(b"$-1\r\n").unwrap(), Reply::Nil);
        assert_eq!(parse(b"*-1\r\n").unwrap(), Reply::Nil);
        assert_eq!(
            parse(b"$4\r\na\r\nb\r\n").unwrap(),
            Reply::Bulk(b"a\r\nb".to_vec())
        );
        assert_eq!(
            parse(b"*2\r\n*1\r\n:1\r\n$0\r\n\r\n").unwrap(),
            Reply::Array(vec![
                Reply::Array(vec![Reply::Int(1)]),
                Reply::Bulk(Vec::new())
            ])
        );
    }

    #[test]
    fn rejects_truncated_and_garbage() {
        assert!(parse(b"+OK").is_err());
        assert!(parse(b"$5\r\nab\r\n").is_err());
        assert!(parse(b"?x\r\n").is_err());
        assert!(parse(b":x\r\n").is_err());
    }

    #[test]
    fn accessors() {
        assert_eq!(Reply::Int(3).as_int(), Some(3));
        assert_eq!(Reply::Nil.as_int(), None);
        assert_eq!(Reply::Bulk(b"v".to_vec()).as_string().as_deref(), Some("v"));
        assert_eq!(
            Reply::Status("OK".into()).as_string().as_deref(),
            Some("OK")
        );
        assert_eq!(Reply::Error("E".into()).as_string(), None);
        assert!(Reply::Error("NOAUTH x".into()).is_error_starting_with("NOAUTH"));
    }
}
