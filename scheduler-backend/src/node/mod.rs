//! The node core: everything the scheduler daemon decides, as a state machine without I/O,
//! clock or threads, in the shape of quinn-proto's connection or raft-rs's `RawNode`. It owns
//! the daemon's state — the connections and their clients, the per-GPU [`Policy`] instances,
//! the groups, the memory books, the Kubernetes containers, the last census — and is driven by
//! [`Input`]s, each with the time it happens at, returning [`Effect`]s for the shell to carry
//! out (send, close, resolve a peer, write the books, take a census, publish a report…);
//! [`Node::next_timeout`] says when to hand it [`Input::Tick`] next.
//!
//! One thread owns it: the daemon's event loop ([`crate::server`]). The other threads post
//! inputs to that loop (an admin request, a reloaded configuration, a census, the books
//! written) and read the reports it publishes; nothing is shared under a lock.
//!
//! **Persisting before replying.** A reservation of GPU memory is granted only once the books
//! that hold it are on disk, as raft releases its messages only after the entries they depend
//! on are persisted: the reply is held ([`books`]) and [`Effect::Persist`] asks the shell to
//! write the books, which it does off the event loop and reports with [`Input::Persisted`].
//! Everything sent to that connection after the held reply waits behind it, so a connection
//! sees its replies in order. Frees and departures reach the file within
//! [`books::FLUSH_EVERY`] (until then it overstates, the safe side). A write that fails (the
//! journal's file system full) releases what waited for it all the same, each reservation's
//! reply saying that it is not journaled (the hook then follows `GPUSHARE_FAIL`), and is tried
//! again within [`books::FLUSH_EVERY`].
//!
//! Tested like the policy: in virtual time, with scripted and random input sequences
//! (`tests.rs`, `sim.rs`).

mod admin;
mod books;
mod conns;
mod overcommit;
mod report;
mod tenants;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

use crate::config::{Config, ConnectionLimits};
use crate::histogram::Histogram;
use crate::identity::{Credentials, Peer};
use crate::latency::{self, Recent};
use crate::memory::{Holding, MemoryBooks, ProcessId};
use crate::pods::PodTable;
use crate::throttle::Throttle;
use gpushare_policy::{GroupParams, Policy};
use gpushare_protocol::admin::{AdminReply, AdminRequest};
use gpushare_protocol::status::{Report, Unhooked};
use gpushare_protocol::{ClientMsg, GpuUuid, ServerMsg};
use std::collections::BTreeMap;
use std::sync::Arc;

pub use admin::POD_WAIT;
pub use books::FLUSH_EVERY;
pub use gpushare_policy::overcommit::SwapOutFailure;
pub use overcommit::Settings as OvercommitSettings;
pub use report::usage;

/// A connection, as the shell numbers it (never reused). A connection admitted as a client is
/// that client for the policies and the books ([`gpushare_policy::ClientId`]).
pub type ConnId = u64;

/// How often the report other threads read (metrics, the admin socket's `Usage`) is rebuilt.
pub const PUBLISH_EVERY_NS: u64 = 1_000_000_000;
/// A report asked for over the tenant socket is reused for this long while nothing but
/// questions reached the node: building one takes the event loop's time, so clients asking in a
/// tight loop cost at most one report per this long, yet every answer reflects whatever the
/// node handled before the question.
pub const STATUS_REUSE_NS: u64 = 5_000_000;
/// How often the census of GPU processes without the hook is taken.
pub const CENSUS_EVERY_NS: u64 = 2_000_000_000;

/// What happens to the node.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// Time passed: act on whatever was due by now ([`Node::next_timeout`]).
    Tick,
    /// A connection was accepted from a peer with these credentials (`SO_PEERCRED`).
    Accepted { conn: ConnId, cred: Credentials },
    /// Who the peer of `conn` is ([`Effect::Resolve`]): its cgroup, start time and pid
    /// namespace (`None` if unreadable), read from `/proc` off the event loop.
    Resolved {
        conn: ConnId,
        peer: Peer,
        pid_ns: Option<u64>,
    },
    /// A whole message from `conn`.
    Message { conn: ConnId, msg: ClientMsg },
    /// The shell closed `conn`: the peer hung up, the socket failed, or the peer broke the
    /// framing or left too many replies unread (said in `why`, for the log).
    Closed { conn: ConnId, why: Option<String> },
    /// A request of the node agent ([`gpushare_protocol::admin`]); answered with
    /// [`Effect::AdminReply`] of the same `token`.
    Admin { token: u64, req: AdminRequest },
    /// The configuration file changed and parsed.
    Config(Box<Config>),
    /// The census of GPU processes without a connection ([`Effect::TakeCensus`]).
    Census(Vec<Unhooked>),
    /// Whether the processes of [`Effect::CheckProcesses`] still run (`None`: cannot tell,
    /// e.g. a process of another pid namespace).
    Liveness(Vec<(ProcessId, Option<bool>)>),
    /// The write of the books of [`Effect::Persist`] `seq` ended: on disk (`written`), or it
    /// failed (logged by the writer): the books in memory are still right, and the replies that
    /// waited for the write go out saying the reservation is not journaled.
    Persisted { seq: u64, written: bool },
    /// The checkpoint of [`Effect::SwapOut`] `swap` ended.
    SwappedOut {
        swap: u64,
        outcome: Result<(), SwapOutFailure>,
    },
    /// The restore of [`Effect::SwapIn`] `swap` ended (`ok: false`: its memory is gone).
    SwappedIn { swap: u64, ok: bool },
    /// Where the driver holds the memory of the process of [`Effect::Settle`] `id`:
    /// `checkpointed`, in host memory; else on the GPU, the process running (or it is not
    /// that process any more, and was left alone).
    Settled { id: u64, checkpointed: bool },
}

/// What the shell must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Queue `msg` on `conn`.
    Send { conn: ConnId, msg: ServerMsg },
    /// Close `conn` once what was queued on it is written (as far as its socket takes it now).
    Close { conn: ConnId },
    /// Read `conn` again: its input was left unread while it waited (for its identity, or for
    /// its pod to be registered). See [`Node::reads`].
    Resume { conn: ConnId },
    /// Find out who the peer of `conn` is, off the event loop: answer [`Input::Resolved`].
    Resolve { conn: ConnId, cred: Credentials },
    /// Write the memory books (`holdings`) to the journal, off the event loop: answer
    /// [`Input::Persisted`] with `seq`. At most one is in flight.
    Persist { seq: u64, holdings: Vec<Holding> },
    /// Check whether these processes still run (`/proc`): answer [`Input::Liveness`].
    CheckProcesses(Vec<ProcessId>),
    /// Take the census of GPU processes except `connected` (pids): answer [`Input::Census`].
    TakeCensus { connected: Vec<u32> },
    /// The answer to [`Input::Admin`] `token`.
    AdminReply { token: u64, reply: AdminReply },
    /// A fresh report for the other threads to read.
    Publish(Arc<Report>),
    /// Move these processes' GPU memory to host memory, off the event loop: lock each (its
    /// submitted work drains, waiting at most `lock_timeout_ms`), then checkpoint each; on
    /// a failure, put back what was done. Answer [`Input::SwappedOut`] with `swap`.
    SwapOut {
        swap: u64,
        pids: Vec<u32>,
        lock_timeout_ms: u32,
    },
    /// Restore these processes' GPU memory and unlock them, off the event loop: answer
    /// [`Input::SwappedIn`] with `swap`.
    SwapIn { swap: u64, pids: Vec<u32> },
    /// Ask the driver where the memory of `process` is, off the event loop, and unlock it if
    /// a swap left it locked with its memory on the GPU; only if its pid still names that
    /// process (same start time, when known), else leave it alone. Answer [`Input::Settled`] with `id`
    /// (the node's number for it: a client's id, or that of a holding restored from the
    /// journal whose process has not reconnected).
    Settle {
        id: u64,
        process: crate::memory::ProcessId,
    },
}

/// What the node starts from.
pub struct NodeOptions {
    pub config: Config,
    /// Clients may declare their own group and shares.
    pub dev: bool,
    /// The holdings the journal kept from the previous daemon (of processes still alive).
    pub restored: Vec<Holding>,
    /// `--memory-overcommit`: the ratio when the configuration does not set
    /// `memory_overcommit`.
    pub memory_overcommit: Option<f64>,
}

pub struct Node {
    config: Config,
    dev: bool,
    /// Every group the policies know: from the config, the pods, and declared ones in dev mode.
    groups: BTreeMap<String, GroupParams>,
    policies: BTreeMap<GpuUuid, Policy>,
    memory: MemoryBooks,
    conns: conns::Conns,
    clients: tenants::Clients,
    /// Kubernetes containers registered over the admin socket.
    pods: PodTable,
    /// GPU processes of the node with no connection here, at the last census.
    unhooked: Vec<Unhooked>,
    books: books::Books,
    /// Memory beyond the card: the physical books, waits and swaps.
    overcommit: overcommit::State,
    /// `--memory-overcommit`, below the configuration's `memory_overcommit`.
    memory_overcommit: Option<f64>,
    /// The last report built, and when.
    report: (u64, Arc<Report>),
    /// Whether an input other than a question came since the last report was built.
    report_stale: bool,
    /// How late the event loop handled what was due.
    latency: Histogram,
    /// How late it lately acted on its timers, and what the policies were last told of it.
    recent_late: (Recent, u64),
    warnings: Throttle,
    /// When the next census is taken (`None` while one is under way).
    census_at: Option<u64>,
    /// The time of the latest input.
    now: u64,
    /// By when the shell has handed every input that arrived ([`Node::note_caught_up`]).
    caught_up: u64,
    effects: Vec<Effect>,
}

impl Node {
    /// A node at `now` with `opts`; its first effects publish the first report.
    pub fn new(opts: NodeOptions, now: u64) -> Node {
        let mut memory = MemoryBooks::default();
        let mut groups = BTreeMap::new();
        for g in &opts.config.groups {
            groups.insert(g.name.clone(), g.params);
            memory.set_cap(&g.name, g.memory);
        }
        memory.adopt(opts.restored);
        let overcommit =
            overcommit::State::new(overcommit_settings(&opts.config, opts.memory_overcommit));
        let mut node = Node {
            config: opts.config,
            dev: opts.dev,
            groups,
            policies: BTreeMap::new(),
            memory,
            conns: conns::Conns::default(),
            clients: tenants::Clients::default(),
            pods: PodTable::default(),
            unhooked: Vec::new(),
            books: books::Books::new(now),
            overcommit,
            memory_overcommit: opts.memory_overcommit,
            report: (0, Arc::new(report::empty())),
            report_stale: true,
            latency: Histogram::new(&latency::BOUNDS_NS),
            recent_late: (Recent::default(), 0),
            warnings: Throttle::default(),
            census_at: Some(now),
            now,
            caught_up: now,
            effects: Vec::new(),
        };
        node.follow_ghosts(now);
        node.publish(now);
        node.settle(now);
        node
    }

    /// Handle `input`, which happens at `now` (`CLOCK_MONOTONIC` ns; an earlier time than the
    /// previous input's is taken as that). Its effects are in [`Node::take_effects`].
    pub fn handle(&mut self, input: Input, now: u64) {
        let now = now.max(self.now);
        self.now = now;
        let question = matches!(
            input,
            Input::Message {
                msg: ClientMsg::Status,
                ..
            }
        );
        self.report_stale |= !question;
        match input {
            Input::Tick => {}
            Input::Accepted { conn, cred } => self.accepted(conn, cred, now),
            Input::Resolved { conn, peer, pid_ns } => self.resolved(conn, peer, pid_ns, now),
            Input::Message { conn, msg } => self.message(conn, msg, now),
            Input::Closed { conn, why } => self.closed(conn, why, now),
            Input::Admin { token, req } => self.admin(token, req, now),
            Input::Config(cfg) => self.reconfigure(*cfg, now),
            Input::Census(found) => self.census(found, now),
            Input::Liveness(alive) => self.liveness(alive, now),
            Input::Persisted { seq, written } => self.persisted(seq, written, now),
            Input::SwappedOut { swap, outcome } => self.swapped_out(swap, outcome, now),
            Input::SwappedIn { swap, ok } => self.swapped_in(swap, ok, now),
            Input::Settled { id, checkpointed } => self.settled(id, checkpointed, now),
        }
        self.settle(now);
    }

    /// The effects of the inputs so far, in order.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// When the node next needs [`Input::Tick`]: a turn ending or starting, a connection's
    /// deadline, the books' flush, a census, a report. May be in the past (tick at once).
    pub fn next_timeout(&self) -> Option<u64> {
        let policies = self
            .policies
            .values()
            .filter_map(|p| p.next_wakeup(self.now));
        policies
            .chain(self.conns.next_deadline())
            .chain(self.books.next_timeout())
            .chain(self.census_at)
            .chain(self.overcommit_wakeup())
            .chain([self.report.0.saturating_add(PUBLISH_EVERY_NS)])
            .min()
    }

    /// How often at least the shell publishes its heartbeat (the time its event loop last ran,
    /// which a process waiting for a turn reads instead of probing): a quarter of the liveness
    /// bound, while a process waits for a turn on some GPU; `None` while none does (nobody
    /// would read it).
    pub fn heartbeat_every(&self) -> Option<u64> {
        (self.policies.values().any(Policy::has_waiters)).then(|| (self.liveness_ns() / 4).max(1))
    }

    /// Whether the shell should hand over the messages `conn` sent: not while the node waits
    /// for who its peer is or for its pod (its input stays unread, and the node says
    /// [`Effect::Resume`] when it may be read again).
    pub fn reads(&self, conn: ConnId) -> bool {
        self.conns.reads(conn)
    }

    /// The shell has handed every input that arrived by `at`. A connection's deadline passes
    /// only then: a daemon that was stopped or starved of CPU finds its timers and its sockets
    /// ready at once, and must read a Hello that waits in its socket before closing that
    /// connection for having said none.
    pub fn note_caught_up(&mut self, at: u64) {
        self.caught_up = self.caught_up.max(at);
    }

    /// The event loop handled something `ns` after it was due (measured by the shell).
    pub fn note_lateness(&mut self, ns: u64) {
        self.latency.record(ns);
    }

    /// The event loop's timer fired `ns` late, at `now`: noted, and the policies grant turns
    /// earlier by the worst of the last second or two ([`Policy::set_lateness`]), so that a
    /// daemon short of CPU still gets each grant to its holder before the turn starts.
    pub fn note_timer_lateness(&mut self, ns: u64, now: u64) {
        self.note_lateness(ns);
        let worst = self.recent_late.0.record(ns, now);
        if worst != self.recent_late.1 {
            self.recent_late.1 = worst;
            for p in self.policies.values_mut() {
                p.set_lateness(worst);
            }
        }
    }

    /// The tenant socket's bounds in force.
    pub fn limits(&self) -> ConnectionLimits {
        self.config.connections
    }

    /// After every input: act on what is due by `now`, deliver what the policies decided, and
    /// write the books or release what waited for them.
    fn settle(&mut self, now: u64) {
        for c in self.conns.expired(now.min(self.caught_up)) {
            self.expire(c, now);
        }
        for p in self.policies.values_mut() {
            if p.next_wakeup(now).is_some_and(|at| at <= now) {
                p.tick(now);
            }
        }
        self.settle_caps();
        self.tick_overcommit(now);
        self.collect_decisions(now);
        if self.census_at.is_some_and(|at| at <= now) {
            self.census_at = None;
            let connected = self.clients.pids();
            self.effects.push(Effect::TakeCensus { connected });
        }
        self.check_processes(now);
        if now >= self.report.0.saturating_add(PUBLISH_EVERY_NS) {
            self.publish(now);
        }
        self.persist(now);
    }

    /// A new configuration: groups gone from it are removed, the others set, the policies
    /// given the new timing.
    fn reconfigure(&mut self, cfg: Config, now: u64) {
        let removed: Vec<String> = (self.config.groups.iter())
            .filter(|old| !cfg.groups.iter().any(|g| g.name == old.name))
            .map(|g| g.name.clone())
            .collect();
        for name in removed {
            self.remove_group(&name, now);
        }
        for p in self.policies.values_mut() {
            p.set_config(cfg.policy.clone());
            p.tick(now);
        }
        for g in &cfg.groups {
            self.set_group(&g.name, g.params);
            self.memory.set_cap(&g.name, g.memory);
        }
        let settings = overcommit_settings(&cfg, self.memory_overcommit);
        if settings != self.overcommit.settings() {
            self.set_overcommit(settings, now);
        }
        self.config = cfg;
        tracing::info!("configuration applied");
    }

    /// The census came back: a process that connected meanwhile is not listed.
    fn census(&mut self, found: Vec<Unhooked>, now: u64) {
        let connected = self.clients.pids();
        self.unhooked = found
            .into_iter()
            .filter(|u| !connected.contains(&u.pid))
            .collect();
        self.census_at = Some(now.saturating_add(CENSUS_EVERY_NS));
    }

    /// Queue `msg` for `conn`, behind anything of its held for the books.
    fn send(&mut self, conn: ConnId, msg: ServerMsg) {
        (self.books).route(conn, Effect::Send { conn, msg }, &mut self.effects);
    }

    /// Close `conn` after what was queued for it.
    fn close(&mut self, conn: ConnId) {
        (self.books).route(conn, Effect::Close { conn }, &mut self.effects);
    }
}

/// The overcommit settings of `config`, its ratio defaulting to `--memory-overcommit`.
fn overcommit_settings(config: &Config, flag: Option<f64>) -> overcommit::Settings {
    overcommit::Settings {
        ratio: config.memory_overcommit.or(flag).unwrap_or(1.0),
        params: config.overcommit.params,
        lock_timeout_ms: config.overcommit.lock_timeout_ms,
    }
}
