//! The work that may block, each on a thread of its own so that the event loop never waits for
//! a file or for `/proc`: writing the memory journal, reading who a peer is and whether
//! processes still run, taking the census of GPU processes, swapping processes' GPU memory to
//! host memory and back ([`crate::checkpoint`]), and watching the configuration file. Each does what the node asked ([`crate::node::Effect`]) and posts the outcome back
//! to the loop's inbox as an input.

use crate::config::Config;
use crate::identity::{self, Credentials};
use crate::inbox::Inbox;
use crate::journal::{self, Journal};
use crate::memory::{Holding, ProcessId};
use crate::node::{ConnId, Input};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, SystemTime};

/// A request for the `/proc` reader.
pub enum Lookup {
    /// Who the peer of `conn` is.
    Peer { conn: ConnId, cred: Credentials },
    /// Whether these processes still run.
    Liveness(Vec<ProcessId>),
}

/// The threads' ends for the event loop.
pub struct Workers {
    /// Books to write, by version.
    pub journal: Sender<(u64, Vec<Holding>)>,
    pub lookups: Sender<Lookup>,
    /// Census requests: the pids of the connected clients.
    pub census: Sender<Vec<u32>>,
    /// Swaps to host memory and back ([`crate::checkpoint`]).
    pub swaps: Sender<crate::checkpoint::Job>,
}

impl Workers {
    /// Start the journal writer (on `journal`), the `/proc` reader, the census taker and the
    /// swapper.
    pub fn spawn(journal: Journal, inbox: &Inbox) -> std::io::Result<Workers> {
        let (journal_tx, rx) = channel();
        let i = inbox.clone();
        spawn("journal", move || write_journal(journal, rx, i))?;
        let (lookups, rx) = channel();
        let i = inbox.clone();
        spawn("proc", move || look_up(rx, i))?;
        let (census, rx) = channel();
        let i = inbox.clone();
        spawn("census", move || take_census(rx, i))?;
        let swaps = crate::checkpoint::spawn(inbox.clone())?;
        Ok(Workers {
            journal: journal_tx,
            lookups,
            census,
            swaps,
        })
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(drop)
}

/// Write each version of the books asked for and say when it is done (a failed write is
/// logged by the journal; the books in memory are still right, so what waited for it goes on).
fn write_journal(mut journal: Journal, rx: Receiver<(u64, Vec<Holding>)>, inbox: Inbox) {
    for (seq, holdings) in rx {
        journal.save(holdings);
        if !inbox.input(Input::Persisted { seq }) {
            return;
        }
    }
}

fn look_up(rx: Receiver<Lookup>, inbox: Inbox) {
    for lookup in rx {
        let input = match lookup {
            Lookup::Peer { conn, cred } => {
                let (peer, pid_ns) = identity::resolve(cred);
                Input::Resolved { conn, peer, pid_ns }
            }
            Lookup::Liveness(processes) => Input::Liveness(
                processes
                    .into_iter()
                    .map(|p| (p, journal::alive(&p)))
                    .collect(),
            ),
        };
        if !inbox.input(input) {
            return;
        }
    }
}

fn take_census(rx: Receiver<Vec<u32>>, inbox: Inbox) {
    let own = std::process::id();
    for connected in rx {
        let connected = connected.into_iter().collect();
        let found = crate::census::take(std::path::Path::new("/proc"), &connected, own);
        if !inbox.input(Input::Census(found)) {
            return;
        }
    }
}

/// When `path` was last modified (`None`: it cannot be read).
pub fn mtime(path: &std::path::Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Watch the configuration file (from the version `loaded` at start) and post each version
/// that parses; a broken file keeps the previous configuration.
pub fn watch_config(
    path: PathBuf,
    loaded: Option<SystemTime>,
    inbox: Inbox,
) -> std::io::Result<()> {
    spawn("config", move || {
        let mut seen = loaded;
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let m = mtime(&path);
            if m == seen {
                continue;
            }
            seen = m;
            match Config::load(&path) {
                Ok(cfg) => {
                    tracing::info!(path = %path.display(), "configuration file changed");
                    if !inbox.input(Input::Config(Box::new(cfg))) {
                        return;
                    }
                }
                Err(e) => tracing::error!("keeping the previous configuration: {e}"),
            }
        }
    })
}
