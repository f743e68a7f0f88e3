//! The work that may block, each on a thread of its own so that the event loop never waits for
//! a file or for `/proc`: writing the memory journal, reading who a peer is and whether
//! processes still run, taking the census of GPU processes, swapping processes' GPU memory to
//! host memory and back ([`crate::checkpoint`]), and watching the files (the tenant socket's
//! path, the configuration). Each does what the node asked ([`crate::node::Effect`]) and posts the outcome back
//! to the loop's inbox as an input.

use crate::config::Config;
use crate::identity::{self, Credentials};
use crate::inbox::{Inbox, Post};
use crate::journal::{self, Journal};
use crate::memory::{Holding, ProcessId};
use crate::node::{ConnId, Input};
use std::collections::{HashMap, VecDeque};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, SystemTime};

/// A request for the `/proc` reader.
pub enum Lookup {
    /// Who the peers of these connections are (those the event loop accepted in one turn).
    Peers(Vec<(ConnId, Credentials)>),
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

/// Write each version of the books asked for and say when it is done, and whether it was
/// written (a failed write is logged by the journal; the node answers what waited for it as
/// not journaled).
fn write_journal(mut journal: Journal, rx: Receiver<(u64, Vec<Holding>)>, inbox: Inbox) {
    for (seq, holdings) in rx {
        let written = journal.save(holdings);
        if !inbox.input(Input::Persisted { seq, written }) {
            return;
        }
    }
}

/// The most lookups (a connection's peer, a process's liveness) one batch answers: a few
/// milliseconds of `/proc` reads (three files a process), so that the first connections of a
/// flood of accepts are answered that soon, not once every connection queued behind them is.
const MAX_BATCH: usize = 64;

/// Answer the lookups, those queued in batches of at most [`MAX_BATCH`]: each batch is posted
/// with one wake of the event loop, and the connections of one process in a batch (a flood
/// comes from few) are looked up once — the same reads, at the same moment, as one per
/// connection.
fn look_up(rx: Receiver<Lookup>, inbox: Inbox) {
    let mut queued = VecDeque::new();
    while let Ok(first) = rx.recv() {
        queued.push_back(first);
        while !queued.is_empty() {
            queued.extend(rx.try_iter());
            let batch = next_batch(&mut queued);
            if !inbox.inputs(answer(batch, identity::resolve, journal::alive)) {
                return;
            }
        }
    }
}

/// The next batch of `queued`, in order: at most [`MAX_BATCH`] lookups, a request for peers
/// split where the batch is full. A liveness check is one answer ([`Input::Liveness`]): whole,
/// in a batch of its own if it has more processes than fit.
fn next_batch(queued: &mut VecDeque<Lookup>) -> Vec<Lookup> {
    let mut batch = Vec::new();
    let mut room = MAX_BATCH;
    while let Some(lookup) = queued.pop_front() {
        match lookup {
            Lookup::Peers(mut conns) if conns.len() > room => {
                let rest = conns.split_off(room);
                batch.push(Lookup::Peers(conns));
                queued.push_front(Lookup::Peers(rest));
                break;
            }
            Lookup::Liveness(processes) if processes.len() > room && !batch.is_empty() => {
                queued.push_front(Lookup::Liveness(processes));
                break;
            }
            Lookup::Peers(conns) => {
                room -= conns.len();
                batch.push(Lookup::Peers(conns));
            }
            Lookup::Liveness(processes) => {
                room = room.saturating_sub(processes.len());
                batch.push(Lookup::Liveness(processes));
            }
        }
        if room == 0 {
            break;
        }
    }
    batch
}

/// The inputs answering `batch`, in order: peers found by `resolve` (once per credentials),
/// processes checked by `alive`.
fn answer(
    batch: Vec<Lookup>,
    resolve: impl Fn(Credentials) -> (identity::Peer, Option<u64>),
    alive: impl Fn(&ProcessId) -> Option<bool>,
) -> Vec<Input> {
    let mut peers: HashMap<Credentials, (identity::Peer, Option<u64>)> = HashMap::new();
    let mut inputs = Vec::new();
    for lookup in batch {
        match lookup {
            Lookup::Peers(conns) => {
                for (conn, cred) in conns {
                    let (peer, pid_ns) = peers.entry(cred).or_insert_with(|| resolve(cred)).clone();
                    inputs.push(Input::Resolved { conn, peer, pid_ns });
                }
            }
            Lookup::Liveness(processes) => inputs.push(Input::Liveness(
                processes.into_iter().map(|p| (p, alive(&p))).collect(),
            )),
        }
    }
    inputs
}

fn take_census(rx: Receiver<Vec<u32>>, inbox: Inbox) {
    let own = std::process::id();
    let mut pacer = Pacer::new(CENSUS_SLICE_NS, CENSUS_REST);
    for connected in rx {
        let connected = connected.into_iter().collect();
        let found = crate::census::take(std::path::Path::new("/proc"), &connected, own, || {
            pacer.pace()
        });
        if !inbox.input(Input::Census(found)) {
            return;
        }
    }
}

/// The census's CPU between rests, and its rests: at most 0.5 % of a core (1 ms in 200), so
/// that on a busy node (reading every process's maps takes milliseconds) it spends little of
/// a CPU quota the event loop needs: under a 50m limit (5 ms per 100 ms) the loop keeps 90 %
/// of it. A census of 5 ms of CPU then takes a second.
const CENSUS_SLICE_NS: u64 = 1_000_000;
const CENSUS_REST: Duration = Duration::from_millis(199);

/// Spreads a thread's CPU time over wall time: [`pace`](Pacer::pace), called between pieces
/// of work, sleeps `rest` once the thread has used `slice_ns` of CPU since the last rest.
struct Pacer {
    slice_ns: u64,
    rest: Duration,
    since_ns: u64,
}

impl Pacer {
    fn new(slice_ns: u64, rest: Duration) -> Pacer {
        Pacer {
            slice_ns,
            rest,
            since_ns: thread_cpu_ns(),
        }
    }

    fn pace(&mut self) {
        if thread_cpu_ns().saturating_sub(self.since_ns) >= self.slice_ns {
            std::thread::sleep(self.rest);
            self.since_ns = thread_cpu_ns();
        }
    }
}

/// CPU time of the calling thread (ns).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// When `path` was last modified (`None`: it cannot be read).
pub fn mtime(path: &std::path::Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// The files the daemon watches, once a second, on a thread of their own.
pub struct Watched {
    /// The tenant socket: bound again if its path goes (its directory replaced or removed).
    pub socket: PathBuf,
    /// The configuration file, and the version loaded at start: each version that parses is
    /// posted, a broken one keeps the previous configuration.
    pub config: Option<(PathBuf, Option<SystemTime>)>,
}

/// Watch `w`'s files and post what changed.
pub fn watch(w: Watched, inbox: Inbox) -> std::io::Result<()> {
    spawn("watch", move || {
        let mut socket = SocketWatch::new(w.socket);
        let mut config = w.config;
        loop {
            std::thread::sleep(Duration::from_secs(1));
            if let Some(listener) = socket.check()
                && !inbox.post(Post::Listener(listener))
            {
                return;
            }
            let Some((path, seen)) = config.as_mut() else {
                continue;
            };
            let m = mtime(path);
            if m == *seen {
                continue;
            }
            *seen = m;
            match Config::load(path) {
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

/// The tenant socket's path, as the daemon bound it.
struct SocketWatch {
    path: PathBuf,
    /// The bound socket's device and inode (`None`: not known).
    bound: Option<(u64, u64)>,
    /// Something else is at the path now (said once).
    taken: bool,
}

impl SocketWatch {
    fn new(path: PathBuf) -> SocketWatch {
        let bound = identity(&path);
        SocketWatch {
            path,
            bound,
            taken: false,
        }
    }

    /// A listener bound anew if the socket's path is gone (a replaced or removed directory:
    /// the daemon's existing connections live on, new processes could not connect).
    fn check(&mut self) -> Option<std::os::unix::net::UnixListener> {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) => {
                let now = Some((m.dev(), m.ino()));
                if now != self.bound && !self.taken {
                    self.taken = true;
                    tracing::warn!(path = %self.path.display(), "the tenant socket's path is another file now (another daemon?): left alone; new processes reach whatever listens there");
                }
                None
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                match gpushare_frame::listen_at(&self.path, 0o666) {
                    Ok(l) => {
                        tracing::warn!(path = %self.path.display(), "the tenant socket was gone (its directory replaced or removed): listening there again");
                        self.bound = identity(&self.path);
                        self.taken = false;
                        Some(l)
                    }
                    Err(e) => {
                        tracing::error!("the tenant socket is gone and cannot be bound again: {e}");
                        None
                    }
                }
            }
            Err(_) => None,
        }
    }
}

/// A file's device and inode.
fn identity(path: &std::path::Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Peer;
    use std::cell::RefCell;

    fn cred(pid: u32) -> Credentials {
        Credentials {
            pid,
            uid: 1000,
            gid: 1000,
        }
    }

    fn peer(cred: Credentials) -> Peer {
        Peer {
            pid: cred.pid,
            start: u64::from(cred.pid) * 10,
            uid: cred.uid,
            gid: cred.gid,
            cgroup: format!("/user/{}", cred.pid),
            pod: None,
        }
    }

    #[test]
    fn a_batch_is_answered_in_order_each_process_looked_up_once() {
        let looked_up = RefCell::new(Vec::new());
        let resolve = |c: Credentials| {
            looked_up.borrow_mut().push(c.pid);
            (peer(c), Some(u64::from(c.pid) + 1))
        };
        let process = ProcessId { pid: 9, start: 90 };
        let batch = vec![
            Lookup::Peers(vec![(3, cred(7)), (4, cred(8)), (5, cred(7))]),
            Lookup::Liveness(vec![process]),
            Lookup::Peers(vec![(6, cred(8))]),
        ];
        let inputs = answer(batch, resolve, |p| Some(p.pid == 9));
        let resolved = |conn, pid| Input::Resolved {
            conn,
            peer: peer(cred(pid)),
            pid_ns: Some(u64::from(pid) + 1),
        };
        assert_eq!(
            inputs,
            vec![
                resolved(3, 7),
                resolved(4, 8),
                resolved(5, 7),
                Input::Liveness(vec![(process, Some(true))]),
                resolved(6, 8),
            ]
        );
        assert_eq!(*looked_up.borrow(), vec![7, 8], "once per process");
    }

    /// A batch's shape: per lookup, `(true, n)` for n connections' peers, `(false, n)` for a
    /// liveness check of n processes.
    fn shape(batch: &[Lookup]) -> Vec<(bool, usize)> {
        (batch.iter())
            .map(|l| match l {
                Lookup::Peers(conns) => (true, conns.len()),
                Lookup::Liveness(processes) => (false, processes.len()),
            })
            .collect()
    }

    fn peers(conns: std::ops::Range<u64>) -> Lookup {
        Lookup::Peers(conns.map(|c| (c, cred(c as u32))).collect())
    }

    fn liveness(n: u32) -> Lookup {
        Lookup::Liveness((0..n).map(|pid| ProcessId { pid, start: 0 }).collect())
    }

    /// A flood of accepts queued behind one another is answered in batches of at most
    /// MAX_BATCH lookups, in order, each request for peers split where a batch is full; a
    /// liveness check stays one answer, alone in a batch if larger.
    #[test]
    fn a_flood_is_answered_in_bounded_batches_in_order() {
        let n = MAX_BATCH as u64;
        let mut queued = VecDeque::from([
            peers(0..n + 10),
            liveness(3),
            peers(n + 10..2 * n + 30),
            liveness(MAX_BATCH as u32 + 5),
            peers(2 * n + 30..2 * n + 31),
        ]);
        let mut batches = Vec::new();
        let mut conns = Vec::new();
        while !queued.is_empty() {
            let batch = next_batch(&mut queued);
            for l in &batch {
                if let Lookup::Peers(c) = l {
                    conns.extend(c.iter().map(|&(conn, _)| conn));
                }
            }
            batches.push(shape(&batch));
        }
        let m = MAX_BATCH;
        assert_eq!(
            batches,
            vec![
                vec![(true, m)],
                vec![(true, 10), (false, 3), (true, m - 13)],
                vec![(true, 33)],
                vec![(false, m + 5)],
                vec![(true, 1)],
            ]
        );
        assert_eq!(
            conns,
            (0..2 * n + 31).collect::<Vec<_>>(),
            "in order, each once"
        );
    }
}
