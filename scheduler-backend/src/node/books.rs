//! The memory books' way to disk, and the lives of those who hold memory.
//!
//! Every change of the books makes a new *version*. A reply granting a reservation is held
//! until a version that includes it is on disk (the journal's writer, off the event loop, says
//! so with [`Input::Persisted`](super::Input::Persisted)); whatever is sent to that connection
//! meanwhile waits behind it, so each connection sees its replies in order. Only one write is
//! in flight: changes made meanwhile go into the next. Changes nothing waits for (frees,
//! departures) are written within [`FLUSH_EVERY`]. A write that fails releases what waited
//! for it as well — a reservation's reply then says it is not journaled, and the hook follows
//! `GPUSHARE_FAIL` — and the books are written again within [`FLUSH_EVERY`].
//!
//! Once a second the processes that hold memory, and those of the holdings restored from the
//! journal (*ghosts*), are checked (off the event loop): what an exited process held is free
//! again, even while a forked child keeps its connection open.

use super::{ConnId, Effect, Node};
use crate::memory::ProcessId;
use gpushare_protocol::ServerMsg;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// How soon frees and departures reach the journal.
pub const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// How often the processes holding memory are checked.
pub const LIVENESS_EVERY_NS: u64 = 1_000_000_000;
/// How long the holdings of a process whose liveness cannot be checked (its pid is not visible
/// from the daemon's pid namespace) count after a restart: every live hook reconnects within
/// a second or two, and states its holdings itself.
pub const UNVERIFIABLE_GHOST_GRACE_NS: u64 = 10_000_000_000;

pub(super) struct Books {
    /// The books' version: each change makes a new one.
    version: u64,
    /// The latest version on disk.
    persisted: u64,
    /// The version being written.
    writing: Option<u64>,
    /// When changes nothing waits for are written.
    flush_at: Option<u64>,
    /// What is sent to connections waiting for a version to be on disk, in order (versions
    /// never decrease); whether it is a reply that waits for its own reservation's write (the
    /// rest waits behind one).
    held: VecDeque<(u64, ConnId, Effect, bool)>,
    /// How many effects each connection has held.
    held_for: HashMap<ConnId, usize>,
    /// When the node started (the restored holdings' grace counts from there).
    started: u64,
    /// When the holders are checked next (`None` while a check is under way).
    check_at: Option<u64>,
}

impl Books {
    pub fn new(now: u64) -> Books {
        Books {
            version: 0,
            persisted: 0,
            writing: None,
            flush_at: None,
            held: VecDeque::new(),
            held_for: HashMap::new(),
            started: now,
            check_at: Some(now),
        }
    }

    /// Hand on `effect` for `conn`, or hold it behind what that connection has held already.
    pub fn route(&mut self, conn: ConnId, effect: Effect, out: &mut Vec<Effect>) {
        match self.held.back() {
            Some(&(version, ..)) if self.held_for.contains_key(&conn) => {
                self.hold(version, conn, effect, false);
            }
            _ => out.push(effect),
        }
    }

    /// Send `msg` to `conn` once the books as changed by the current input are on disk.
    pub fn after_persist(&mut self, conn: ConnId, msg: ServerMsg) {
        self.hold(self.version + 1, conn, Effect::Send { conn, msg }, true);
    }

    fn hold(&mut self, version: u64, conn: ConnId, effect: Effect, reservation: bool) {
        *self.held_for.entry(conn).or_default() += 1;
        self.held.push_back((version, conn, effect, reservation));
    }

    /// `conn` is closed: what it had held goes.
    pub fn forget(&mut self, conn: ConnId) {
        if self.held_for.remove(&conn).is_some() {
            self.held.retain(|(_, c, ..)| *c != conn);
        }
    }

    /// The node closes `conn` and forgets what it holds: the replies to its reservations still
    /// waiting say they are not journaled (the books no longer hold them), in their order.
    pub fn unjournal_replies(&mut self, conn: ConnId) {
        for (_, c, effect, reservation) in self.held.iter_mut() {
            if *c == conn && *reservation {
                not_journaled(effect);
            }
        }
    }

    /// The write of version `seq` ended (`written`: on disk; else it failed): release what
    /// waited for it, reservations' replies marked not journaled if it failed, and try again
    /// within [`FLUSH_EVERY`].
    fn persisted(&mut self, seq: u64, written: bool, now: u64, out: &mut Vec<Effect>) {
        if self.writing == Some(seq) {
            self.writing = None;
        }
        if written {
            self.persisted = self.persisted.max(seq);
        } else {
            self.flush_at
                .get_or_insert(now.saturating_add(FLUSH_EVERY.as_nanos() as u64));
        }
        while let Some(&(version, ..)) = self.held.front() {
            if version > seq.max(self.persisted) {
                break;
            }
            let (_, conn, mut effect, reservation) = self.held.pop_front().expect("looked at");
            if !written && reservation {
                not_journaled(&mut effect);
            }
            if let Some(n) = self.held_for.get_mut(&conn) {
                *n -= 1;
                if *n == 0 {
                    self.held_for.remove(&conn);
                }
            }
            out.push(effect);
        }
    }

    pub fn next_timeout(&self) -> Option<u64> {
        let flush = self.flush_at.filter(|_| self.writing.is_none());
        flush.into_iter().chain(self.check_at).min()
    }
}

/// A reservation's reply that the journal does not hold.
fn not_journaled(effect: &mut Effect) {
    if let Effect::Send {
        msg: ServerMsg::Memory { journaled, .. },
        ..
    } = effect
    {
        *journaled = false;
    }
}

impl Node {
    /// After an input: a new version if the books changed; written now if a reply waits for
    /// it, else within [`FLUSH_EVERY`].
    pub(super) fn persist(&mut self, now: u64) {
        let b = &mut self.books;
        let waited_for = b.held.back().is_some_and(|&(v, ..)| v > b.version);
        if self.memory.take_changed() || waited_for {
            b.version += 1;
            b.flush_at
                .get_or_insert(now.saturating_add(FLUSH_EVERY.as_nanos() as u64));
        }
        let due = !b.held.is_empty() || b.flush_at.is_some_and(|at| at <= now);
        if b.writing.is_none() && b.persisted < b.version && due {
            b.writing = Some(b.version);
            b.flush_at = None;
            let holdings = self.memory.holdings();
            self.effects.push(Effect::Persist {
                seq: b.version,
                holdings,
            });
        }
    }

    /// The journal's writer finished version `seq` (`written`), or failed to.
    pub(super) fn persisted(&mut self, seq: u64, written: bool, now: u64) {
        self.books.persisted(seq, written, now, &mut self.effects);
    }

    /// Once a second: ask whether the processes holding memory, and those of the restored
    /// holdings, still run.
    pub(super) fn check_processes(&mut self, now: u64) {
        if self.books.check_at.is_none_or(|at| at > now) {
            return;
        }
        let mut processes: Vec<ProcessId> = (self.memory.holders().into_iter())
            .map(|(_, p)| p)
            .chain(self.memory.ghost_processes())
            .collect();
        processes.sort_unstable();
        processes.dedup();
        if processes.is_empty() {
            self.books.check_at = Some(now.saturating_add(LIVENESS_EVERY_NS));
        } else {
            self.books.check_at = None;
            self.effects.push(Effect::CheckProcesses(processes));
        }
    }

    /// Which processes still run: an exited one's memory is free again, whoever keeps its
    /// connection; a restored holding goes with its process, or once the grace is over if its
    /// process cannot be checked.
    pub(super) fn liveness(&mut self, alive: Vec<(ProcessId, Option<bool>)>, now: u64) {
        let alive: HashMap<ProcessId, Option<bool>> = alive.into_iter().collect();
        for (client, process) in self.memory.holders() {
            if alive.get(&process) == Some(&Some(false)) {
                self.memory.forget_client(client);
                self.exit_physical(client, now);
            }
        }
        let grace_over = now
            >= self
                .books
                .started
                .saturating_add(UNVERIFIABLE_GHOST_GRACE_NS);
        self.memory.retain_ghosts(|p| match alive.get(p) {
            Some(Some(alive)) => *alive,
            Some(None) => !grace_over,
            None => true,
        });
        self.follow_ghosts(now);
        self.books.check_at = Some(now.saturating_add(LIVENESS_EVERY_NS));
    }
}
