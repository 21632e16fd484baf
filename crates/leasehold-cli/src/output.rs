//! Writing to stdout without panicking: `println!` panics when stdout is closed or full, and a
//! command line must end with one `leasehold: ` line and its documented exit code instead.

use std::io::{ErrorKind, Write};

use crate::exit::{self, Failure};

fn write_out(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// Prints the output a command exists for (`status`, the demo's summary). A failed write is
/// exit 74; quietly so when the reader closed the pipe on purpose (`| head -1`).
pub fn print(text: &str) -> Result<(), Failure> {
    write_out(text).map_err(|e| match e.kind() {
        ErrorKind::BrokenPipe => Failure::quiet(exit::IO_ERROR),
        _ => Failure::new(exit::IO_ERROR, format!("cannot write the output: {e}")),
    })
}

/// Prints what a command did after it took effect (`cancel`, `release`): a failed write must
/// not turn a done action into a failure, so it is only said on stderr (and not at all when
/// the reader closed the pipe).
pub fn tell(text: &str) {
    if let Err(e) = write_out(text) {
        if e.kind() != ErrorKind::BrokenPipe {
            say!("leasehold: cannot write the output: {e}");
        }
    }
}
