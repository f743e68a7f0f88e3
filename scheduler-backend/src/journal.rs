//! The memory books on disk, so that a daemon restarted after a crash or `kill -9` still counts
//! what live processes hold: without them, a process of a group could be granted memory that
//! another, idle process of the group already holds, until that one reconnects.
//!
//! One JSON file (`--books`, default the socket path plus `.books`) rewritten whole, through a
//! temporary file and a rename, so a crash mid-write leaves the previous version. A reservation
//! is written before it is granted; frees and disconnections are written within
//! [`FLUSH_EVERY`](crate::node::FLUSH_EVERY) (until then the file overstates, which is the
//! safe side). The node core decides what to write and when ([`crate::node`]); a thread of its
//! own writes it, so the event loop never waits for a file. The file lives beside the socket, normally on tmpfs
//! (`/run`): it must survive the daemon, not a reboot, after which every process that held
//! memory is gone anyway.

use crate::identity::start_time;
use crate::memory::{Holding, ProcessId};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    holdings: Vec<Holding>,
}

#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    /// The last write failed (warned once until one succeeds again).
    failing: bool,
}

impl Journal {
    pub fn new(path: PathBuf) -> Journal {
        Journal {
            path,
            failing: false,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The holdings of processes still alive when the previous daemon last wrote. A missing
    /// file is an empty journal; an unreadable one is reported and ignored (the books then
    /// start empty, as without a journal: live hooks restate what they hold on reconnecting).
    pub fn load(&self) -> Vec<Holding> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => {
                tracing::error!(path = %self.path.display(), "cannot read the memory journal: {e}; starting with empty books");
                return Vec::new();
            }
        };
        match serde_json::from_str::<File>(&text) {
            Ok(f) if f.version == VERSION => f
                .holdings
                .into_iter()
                .filter(|h| alive(&h.process) != Some(false))
                .collect(),
            Ok(f) => {
                tracing::error!(path = %self.path.display(), version = f.version, "memory journal of another version; starting with empty books");
                Vec::new()
            }
            Err(e) => {
                tracing::error!(path = %self.path.display(), "corrupt memory journal: {e}; starting with empty books");
                Vec::new()
            }
        }
    }

    /// Write `holdings` as the books' current state; whether it was written. A failure is
    /// logged (once until a write succeeds again): the books in memory stay right, only a
    /// restart of the daemon would forget what they hold beyond the last good write, so the
    /// reservations granted meanwhile are answered as not journaled.
    pub fn save(&mut self, holdings: Vec<Holding>) -> bool {
        let file = File {
            version: VERSION,
            holdings,
        };
        match self.write(&file) {
            Ok(()) => {
                if self.failing {
                    tracing::info!(path = %self.path.display(), "the memory journal is written again");
                }
                self.failing = false;
                true
            }
            Err(e) => {
                if !self.failing {
                    tracing::error!(path = %self.path.display(), "cannot write the memory journal: {e}; GPU memory reservations are answered as not journaled until it is written again (hooks with GPUSHARE_FAIL=open allocate anyway, and a restart of the daemon would forget those; GPUSHARE_FAIL=closed refuses them): free space on its file system, or move it with --books");
                }
                self.failing = true;
                false
            }
        }
    }

    fn write(&self, file: &File) -> std::io::Result<()> {
        let mut staging = self.path.clone().into_os_string();
        staging.push(".new");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&staging)?;
        f.write_all(&serde_json::to_vec(file).map_err(std::io::Error::other)?)?;
        drop(f);
        std::fs::rename(&staging, &self.path)
    }
}

/// Whether the process is still the one that held the memory: `None` when the daemon cannot
/// tell (no pid or start time: a peer in another pid namespace).
pub fn alive(p: &ProcessId) -> Option<bool> {
    if p.pid == 0 || p.start == 0 {
        return None;
    }
    Some(start_time(p.pid) == Some(p.start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryBooks;

    fn me() -> ProcessId {
        let pid = std::process::id();
        ProcessId {
            pid,
            start: start_time(pid).unwrap(),
        }
    }

    #[test]
    fn holdings_of_live_processes_come_back_and_the_dead_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let mut j = Journal::new(dir.path().join("s.sock.books"));
        assert!(j.load().is_empty(), "no file yet: empty books");
        let mut books = MemoryBooks::default();
        books.attach(1, me());
        // A process that exited (its pid now reused by nobody with that start time).
        books.attach(
            2,
            ProcessId {
                pid: me().pid,
                start: me().start + 1,
            },
        );
        assert!(books.reserve(1, "g", [1; 16], 3 << 30).granted);
        assert!(books.reserve(2, "g", [1; 16], 1 << 30).granted);
        assert!(j.save(books.holdings()));
        let back = j.load();
        assert_eq!(
            back,
            vec![Holding {
                process: me(),
                group: "g".into(),
                gpu: [1; 16],
                bytes: 3 << 30
            }]
        );
        let mode = std::fs::metadata(j.path()).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
    }

    #[test]
    fn a_corrupt_or_foreign_file_is_empty_books() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::new(dir.path().join("b"));
        std::fs::write(j.path(), b"{\"version\":1,\"holdings\":[{\"pro").unwrap();
        assert!(j.load().is_empty());
        std::fs::write(j.path(), b"{\"version\":99,\"holdings\":[]}").unwrap();
        assert!(j.load().is_empty());
    }

    #[test]
    fn a_failed_write_leaves_the_last_good_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut j = Journal::new(dir.path().join("b"));
        let held = Holding {
            process: me(),
            group: "g".into(),
            gpu: [1; 16],
            bytes: 5,
        };
        assert!(j.save(vec![held.clone()]));
        // The staging file cannot be created: a directory stands in its way.
        std::fs::create_dir(dir.path().join("b.new")).unwrap();
        assert!(!j.save(Vec::new()));
        assert!(j.failing);
        assert_eq!(j.load(), vec![held]);
        std::fs::remove_dir(dir.path().join("b.new")).unwrap();
        assert!(j.save(Vec::new()));
        assert!(!j.failing);
        assert!(j.load().is_empty());
    }
}
