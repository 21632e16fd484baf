//! A steppable wall clock for a redis-server process (field-notes scenario F14), or any other
//! process (F13).

use std::ffi::OsString;
use std::fs;
use std::path::PathBuf;
use std::process::Command;

use crate::temp_dir;

/// Environment variable the shim reads: the file holding the offset in milliseconds.
const OFFSET_FILE_ENV: &str = "LEASEHOLD_CLOCK_OFFSET_FILE";
/// The shim's source, compiled by [`ServerClock::new`].
const SHIM_SOURCE: &str = include_str!("clock/shift.c");

/// A wall-clock offset that a test can change while the server runs.
///
/// [`ServerClock::new`] compiles a small `LD_PRELOAD` shim (with `$CC`, default `cc`) that
/// shifts `gettimeofday`, `time` and `clock_gettime(CLOCK_REALTIME*)` of the process it is loaded
/// into by the offset, read again from a file on every call; monotonic clocks are untouched, as
/// they would be by an NTP step. Pass [`ServerClock::env`] to
/// [`RedisServer::start_with_env`](crate::RedisServer::start_with_env), then step the server's
/// clock with [`ServerClock::set_offset_ms`].
///
/// Nothing in it is specific to redis-server: [`env`](ServerClock::env) loaded into any dynamically linked
/// process (`Command::envs`) steps that process's wall clock the same way; the multi-process
/// tests step a lease holder's clock with it (field notes F13).
///
/// libfaketime cannot do this for Debian's redis-server: it recurses into `clock_gettime` while
/// initialising under jemalloc and the server never starts (libfaketime issue #130).
///
/// ```no_run
/// use leasehold_testkit::{RedisServer, ServerClock};
///
/// let clock = ServerClock::new();
/// let server = RedisServer::start_with_env(&clock.env(), &[]);
/// clock.set_offset_ms(30_000); // the server's TIME jumps 30 s ahead
/// ```
#[derive(Debug)]
pub struct ServerClock {
    dir: PathBuf,
    library: PathBuf,
    offset_file: PathBuf,
}

impl ServerClock {
    /// Compiles the shim into a fresh temporary directory (removed on drop) and sets the offset
    /// to 0. Panics if no C compiler runs or the compile fails.
    pub fn new() -> ServerClock {
        let dir = temp_dir("leasehold-clock");
        let source = dir.join("shift.c");
        let library = dir.join("libleasehold_clock_shift.so");
        let offset_file = dir.join("offset_ms");
        fs::write(&source, SHIM_SOURCE)
            .unwrap_or_else(|e| panic!("could not write {}: {e}", source.display()));
        let compiler = std::env::var_os("CC")
            .filter(|cc| !cc.is_empty())
            .unwrap_or_else(|| OsString::from("cc"));
        let output = Command::new(&compiler)
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&library)
            .arg(&source)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "could not run the C compiler {compiler:?} to build the clock shim: {e} \
                     (install gcc, or set CC)"
                )
            });
        assert!(
            output.status.success(),
            "compiling the clock shim with {compiler:?} failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        let clock = ServerClock {
            dir,
            library,
            offset_file,
        };
        clock.set_offset_ms(0);
        clock
    }

    /// The environment that makes a process follow this clock: `LD_PRELOAD` and the offset file.
    pub fn env(&self) -> Vec<(String, OsString)> {
        vec![
            (
                "LD_PRELOAD".to_owned(),
                self.library.clone().into_os_string(),
            ),
            (
                OFFSET_FILE_ENV.to_owned(),
                self.offset_file.clone().into_os_string(),
            ),
        ]
    }

    /// Sets the offset from the true wall clock, in milliseconds (negative: behind). Takes effect
    /// at the process's next clock read.
    pub fn set_offset_ms(&self, offset_ms: i64) {
        // Written aside and renamed, so that a concurrent read sees the old offset or the new.
        let staged = self.dir.join("offset_ms.new");
        fs::write(&staged, offset_ms.to_string())
            .and_then(|()| fs::rename(&staged, &self.offset_file))
            .unwrap_or_else(|e| panic!("could not set the clock offset: {e}"));
    }
}

impl Default for ServerClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for ServerClock {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}
