//! Exit codes (stable; documented in docs/CLI.md) and the one-line error that goes with them.

use leasehold::{Error, Misconfiguration};

/// Usage error (clap's own code).
pub const USAGE: i32 = 2;
/// `release`: there was no lease to remove.
pub const NOT_HELD: i32 = 1;
/// Redis could not be reached or answered with a transient error (EX_UNAVAILABLE).
pub const UNAVAILABLE: i32 = 69;
/// An internal error (EX_SOFTWARE).
pub const SOFTWARE: i32 = 70;
/// The output could not be written (EX_IOERR).
pub const IO_ERROR: i32 = 74;
/// No slot within --wait (EX_TEMPFAIL).
pub const NO_SLOT: i32 = 75;
/// Bad configuration: URL, credentials, limit, a limit that disagrees with the stored one, names,
/// a key of the wrong type (EX_CONFIG).
pub const CONFIG: i32 = 78;
/// The lease was lost while the command ran; the command was terminated.
pub const LEASE_LOST: i32 = 79;
/// The task was cancelled, before or while the command ran.
pub const CANCELLED: i32 = 80;
/// The command was found but could not be executed (like a shell).
pub const CANNOT_EXECUTE: i32 = 126;
/// The command was not found (like a shell).
pub const NOT_FOUND: i32 = 127;

/// A failure to report: one line on stderr (none if the message is empty), then exit with
/// `code`.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub message: String,
}

impl Failure {
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }

    /// Exit with `code` and say nothing (the reader of our output went away on purpose).
    pub fn quiet(code: i32) -> Self {
        Failure::new(code, "")
    }

    /// The message as one line: see [`one_line`].
    pub fn one_line(&self) -> String {
        one_line(&self.message)
    }
}

/// `text` as one printable line: scripts log stderr line by line, and some texts span several
/// (an error of a server that is not Redis, a cancel reason someone typed). Lines are joined
/// with "; " and other control characters escaped, so that no text of another party can move
/// the cursor or color a terminal.
pub fn one_line(text: &str) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    escaped(&lines.join("; "))
}

/// `text` with its control characters escaped (`\n`, `\u{1b}`), so that no text of another
/// party can move the cursor or color a terminal.
pub fn escaped(text: &str) -> String {
    let mut shown = String::new();
    for c in text.chars() {
        if c.is_control() {
            shown.extend(c.escape_default());
        } else {
            shown.push(c);
        }
    }
    shown
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::Full { .. } | Error::TimedOut { .. } => NO_SLOT,
            Error::LeaseLost(_) => LEASE_LOST,
            Error::Cancelled(_) => CANCELLED,
            Error::BackendUnavailable { .. } => UNAVAILABLE,
            Error::Misconfigured(_) => CONFIG,
            // `Error` is non-exhaustive: a kind added after this binary was written is still an
            // error, but this code cannot tell an operator what it means.
            _ => SOFTWARE,
        };
        if let Error::Misconfigured(Misconfiguration::LimitMismatch {
            configured,
            stored,
            version,
        }) = e
        {
            // The library's text speaks of a handle; here the limit came from the command line.
            return Failure::new(
                code,
                format!(
                    "limit mismatch: limit {configured} asked, but the quota stores limit \
                     {stored} under the same limit version {version}; give --limit-version above \
                     {version} to change the limit"
                ),
            );
        }
        Failure::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn another_partys_text_is_one_line_and_cannot_drive_the_terminal() {
        assert_eq!(
            one_line("task cancelled: line one\nline two\x1b[31mRED\t."),
            "task cancelled: line one; line two\\u{1b}[31mRED\\t."
        );
        assert_eq!(one_line("  plain  "), "plain");
    }
}
