//! Guards that undo what a test set up, however the test ends (a panic too): a child process
//! killed and reaped, a temporary directory removed.

use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use crate::temp_dir;

/// A child process killed and reaped when dropped: a test that panics leaves no process
/// running behind it.
pub struct Reaped(Option<Child>);

impl Reaped {
    /// The child, no longer killed on drop (to wait for its output, say).
    pub fn into_inner(mut self) -> Child {
        self.0.take().expect("a child until dropped")
    }
}

impl Deref for Reaped {
    type Target = Child;
    fn deref(&self) -> &Child {
        self.0.as_ref().expect("a child until dropped")
    }
}

impl DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Child {
        self.0.as_mut().expect("a child until dropped")
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `Command::spawn` returning a [`Reaped`] child.
pub trait SpawnReaped {
    /// Spawns the command; panics if it cannot be started.
    fn spawn_reaped(&mut self) -> Reaped;
}

impl SpawnReaped for Command {
    fn spawn_reaped(&mut self) -> Reaped {
        Reaped(Some(self.spawn().expect("spawn")))
    }
}

/// A fresh temporary directory, removed with its contents when dropped (on a panic too).
pub struct TempDir(PathBuf);

impl TempDir {
    /// A new, empty directory under the system's temp dir, named after `prefix`.
    pub fn new(prefix: &str) -> TempDir {
        TempDir(temp_dir(prefix))
    }
}

impl Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
