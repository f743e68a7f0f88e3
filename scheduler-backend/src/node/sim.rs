//! A virtual-time world around a [`Node`] (tests only): it plays the shell and the worker
//! threads — it hands the node inputs at a virtual clock, carries out the effects, answers the
//! node's requests (who a peer is, the books written, whether processes run, the census) when
//! a test says so — and models the tenants, so that it checks on the way what must hold
//! whatever the order of events:
//!
//! - nothing is sent to a connection after it was closed, by either side;
//! - a reply granting memory arrives only once a write of the books begun after the
//!   reservation has finished — written, or else the reply says it is not journaled — and
//!   replies arrive in the order they were asked for;
//! - the journal holds at least what every live process was told it holds;
//! - once the world settles, every question asked was answered (or its asker refused), and
//!   the books hold exactly what the tenants were told plus the restored holdings not yet
//!   restated.

use super::{ConnId, Effect, Input, Node, NodeOptions};
use crate::config::Config;
use crate::identity::{Credentials, Peer, PodIdentity};
use crate::memory::{Holding, ProcessId};
use gpushare_protocol::admin::{AdminReply, AdminRequest, ContainerKey, PodGroup, gpu_uuid_string};
use gpushare_protocol::status::{Report, Unhooked};
use gpushare_protocol::{ClientMsg, GpuUuid, GroupSpec, PROTOCOL_VERSION, ServerMsg};
use proptest::prelude::*;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

pub const MS: u64 = 1_000_000;
pub const S: u64 = 1_000_000_000;
pub const MIB: u64 = 1 << 20;
pub const GPUS: [GpuUuid; 2] = [[1; 16], [2; 16]];

/// Groups `a` (uid 1000, 1 GiB cap) and `b` (uid 1001, 512 MiB, limit 0.6); uid 1002 has none.
pub const CONFIG: &str = "[[group]]\nname = \"a\"\nuids = [1000]\nrequest = 0.3\nmemory = \"1GiB\"\n\n[[group]]\nname = \"b\"\nuids = [1001]\nrequest = 0.2\nlimit = 0.6\nmemory = \"512MiB\"\n";

/// A request of the node to a worker, not answered yet.
#[derive(Debug, Clone)]
pub enum Work {
    Resolve(ConnId),
    /// Books to write, and how many inputs the node had handled when it asked.
    Persist {
        seq: u64,
        holdings: Vec<Holding>,
        asked_at: u64,
    },
    Check(Vec<ProcessId>),
    Census(Vec<u32>),
}

/// A question a tenant asked that expects an answer.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Asked {
    /// A reservation of `bytes` on `gpu`, asked when the node had handled `at` inputs.
    Reserve {
        req: u64,
        gpu: GpuUuid,
        bytes: u64,
        at: u64,
    },
    Query {
        req: u64,
    },
    Status,
    Probe {
        gpu: GpuUuid,
    },
}

/// A tenant process and its connection, as the world sees them.
#[derive(Debug, Clone)]
pub struct Tenant {
    pub peer: Peer,
    pub pid_ns: u64,
    /// Sent while the node did not read the connection; handed over when it says so.
    unread: VecDeque<ClientMsg>,
    pub hello_sent: bool,
    /// Its group, once welcomed.
    pub welcome: Option<String>,
    /// Refused (a fatal error): it asks nothing more.
    pub refused: bool,
    pub closed: bool,
    /// Its process has exited (a forked child keeps its connection).
    pub exited: bool,
    /// Its process runs on but cannot reach the node: it does not reconnect after a restart.
    pub cut_off: bool,
    asked: VecDeque<Asked>,
    next_req: u64,
    /// What it was told it holds per GPU (grants, frees, its own restatements).
    pub held: BTreeMap<GpuUuid, u64>,
    /// What of that must be on disk: grants it was told of, less its frees.
    durable: BTreeMap<GpuUuid, u64>,
    pub received: Vec<ServerMsg>,
}

impl Tenant {
    /// Whether it waits for an answer.
    pub fn asking(&self) -> bool {
        !self.asked.is_empty()
    }
}

/// What happened in a world, to tell that random runs reach every path.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub grants: u64,
    pub welcomed: u64,
    pub pods_admitted: u64,
    pub refused: u64,
    pub closed_by_node: u64,
    pub restarts: u64,
    pub ghosts_restored: u64,
    pub freed_by_exit: u64,
    /// Reservations granted while the journal could not be written.
    pub unjournaled: u64,
}

pub struct World {
    pub stats: Stats,
    pub node: Node,
    pub now: u64,
    /// Inputs handled so far.
    inputs: u64,
    pub tenants: BTreeMap<ConnId, Tenant>,
    next_conn: ConnId,
    next_pid: u32,
    pub work: Vec<Work>,
    /// The journal: the holdings of the last write that finished, and when it was asked.
    pub journal: Vec<Holding>,
    journal_asked_at: u64,
    /// The journal's file system is full: writes fail.
    pub journal_full: bool,
    /// When the last write that finished was asked, written or not.
    write_asked_at: u64,
    /// What the holdings restored at the last start still hold, per process and GPU.
    ghosts: BTreeMap<(ProcessId, GpuUuid), (String, u64)>,
    pub published: Arc<Report>,
    pub admin_replies: BTreeMap<u64, AdminReply>,
    next_admin: u64,
    pub config: Config,
    pub dev: bool,
    /// The swaps the node asked for, in order: (swap, pids, out (false: in)); a test answers
    /// them with [`Input::SwappedOut`] and [`Input::SwappedIn`].
    pub swaps: Vec<(u64, Vec<u32>, bool)>,
    /// The processes the node asked the driver about ([`Effect::Settle`]): (id, process); a
    /// test answers them with [`Input::Settled`].
    pub settles: Vec<(u64, ProcessId)>,
    /// The order of the two above, as the node asked (true: a swap, false: a settle).
    pub driver_calls: Vec<bool>,
    /// The shell is behind ([`World::stall`]): inputs arrive before it has read what came
    /// during the stall.
    behind: bool,
}

impl World {
    pub fn new(config: &str, dev: bool) -> World {
        let config = Config::parse(config).expect("a valid config");
        let now = 1_000 * S;
        let node = Node::new(
            NodeOptions {
                config: config.clone(),
                dev,
                restored: Vec::new(),
                memory_overcommit: None,
            },
            now,
        );
        let mut w = World {
            stats: Stats::default(),
            node,
            now,
            inputs: 0,
            tenants: BTreeMap::new(),
            next_conn: 1,
            next_pid: 100,
            work: Vec::new(),
            journal: Vec::new(),
            journal_asked_at: 0,
            journal_full: false,
            write_asked_at: 0,
            ghosts: BTreeMap::new(),
            published: Arc::new(super::report::empty()),
            admin_replies: BTreeMap::new(),
            next_admin: 0,
            config,
            dev,
            swaps: Vec::new(),
            settles: Vec::new(),
            driver_calls: Vec::new(),
            behind: false,
        };
        w.effects();
        w
    }

    /// Hand the node `input` now and carry out its effects.
    pub fn input(&mut self, input: Input) {
        if !self.behind {
            self.node.note_caught_up(self.now);
        }
        self.node.handle(input, self.now);
        self.inputs += 1;
        self.effects();
    }

    /// Move the clock by `ns`, ticking the node at each deadline on the way.
    pub fn advance(&mut self, ns: u64) {
        self.behind = false;
        let until = self.now + ns;
        while let Some(at) = self.node.next_timeout().filter(|&at| at <= until) {
            self.now = self.now.max(at);
            self.input(Input::Tick);
        }
        self.now = until;
        self.input(Input::Tick);
    }

    /// The shell stops for `ns` (stopped, or starved of CPU): time passes without a tick, and
    /// the inputs that follow come before it has caught up, until the next [`World::advance`].
    pub fn stall(&mut self, ns: u64) {
        self.now += ns;
        self.behind = true;
    }

    fn effects(&mut self) {
        let mut resumed = Vec::new();
        for e in self.node.take_effects() {
            match e {
                Effect::Send { conn, msg } => self.receive(conn, msg),
                Effect::Close { conn } => {
                    let t = self.tenants.get_mut(&conn).expect("a known connection");
                    assert!(!t.closed, "conn {conn} closed twice");
                    t.closed = true;
                    self.stats.closed_by_node += 1;
                }
                Effect::Resume { conn } => resumed.push(conn),
                Effect::Resolve { conn, cred } => {
                    let t = &self.tenants[&conn];
                    assert_eq!(cred.pid, t.peer.pid);
                    self.work.push(Work::Resolve(conn));
                }
                Effect::Persist { seq, holdings } => {
                    let writing = self.work.iter().any(|w| matches!(w, Work::Persist { .. }));
                    assert!(!writing, "one write of the books at a time");
                    let asked_at = self.inputs;
                    self.work.push(Work::Persist {
                        seq,
                        holdings,
                        asked_at,
                    });
                }
                Effect::CheckProcesses(p) => self.work.push(Work::Check(p)),
                Effect::TakeCensus { connected } => self.work.push(Work::Census(connected)),
                Effect::AdminReply { token, reply } => {
                    assert!(self.admin_replies.insert(token, reply).is_none());
                }
                Effect::Publish(r) => self.published = r,
                Effect::SwapOut { swap, pids, .. } => {
                    self.swaps.push((swap, pids, true));
                    self.driver_calls.push(true);
                }
                Effect::SwapIn { swap, pids } => {
                    self.swaps.push((swap, pids, false));
                    self.driver_calls.push(true);
                }
                Effect::Settle { id, process } => {
                    self.settles.push((id, process));
                    self.driver_calls.push(false);
                }
            }
        }
        for conn in resumed {
            self.hand_over(conn);
        }
    }

    /// What the node sent to `conn`, checked against what its tenant asked.
    fn receive(&mut self, conn: ConnId, msg: ServerMsg) {
        let (journal_asked_at, write_asked_at) = (self.journal_asked_at, self.write_asked_at);
        let t = self.tenants.get_mut(&conn).expect("a known connection");
        assert!(!t.closed, "{msg:?} sent to conn {conn} after it was closed");
        match &msg {
            ServerMsg::Welcome { group, .. } => {
                assert!(t.welcome.is_none(), "welcomed twice");
                t.welcome = Some(group.clone());
                self.stats.welcomed += 1;
                self.stats.pods_admitted += u64::from(group.starts_with("ns/"));
            }
            ServerMsg::Error { fatal: true, .. } => {
                self.stats.refused += 1;
                t.refused = true;
                t.asked.clear();
            }
            ServerMsg::Memory { .. } | ServerMsg::Status { .. } if t.refused => {}
            ServerMsg::Memory {
                req,
                granted,
                cap,
                used,
                journaled,
            } => {
                let asked = t.asked.pop_front();
                match asked {
                    Some(Asked::Reserve {
                        req: r,
                        gpu,
                        bytes,
                        at,
                    }) => {
                        assert_eq!(*req, r, "replies in the order asked");
                        if *granted && bytes > 0 {
                            self.stats.grants += 1;
                            *t.held.entry(gpu).or_default() += bytes;
                            if *journaled {
                                assert!(
                                    journal_asked_at >= at,
                                    "reservation {r} of conn {conn} granted before the books that hold it were written"
                                );
                                *t.durable.entry(gpu).or_default() += bytes;
                            } else {
                                self.stats.unjournaled += 1;
                                assert!(
                                    write_asked_at >= at,
                                    "reservation {r} of conn {conn} answered before a write of the books that hold it was tried"
                                );
                            }
                        } else {
                            assert!(journaled, "only grants may lack the journal: {msg:?}");
                        }
                        if *granted {
                            assert!(cap.is_none_or(|c| *used <= c), "{msg:?}");
                        }
                    }
                    Some(Asked::Query { req: r }) => {
                        assert_eq!(*req, r, "replies in order");
                        assert!(journaled, "a query holds nothing to journal: {msg:?}");
                    }
                    other => panic!("{msg:?} answers {other:?}"),
                }
            }
            ServerMsg::Status { .. } => {
                assert_eq!(t.asked.pop_front(), Some(Asked::Status), "replies in order");
            }
            ServerMsg::Alive { gpu } if !t.refused => {
                let asked = t.asked.pop_front();
                assert_eq!(asked, Some(Asked::Probe { gpu: *gpu }), "replies in order");
            }
            _ => {}
        }
        t.received.push(msg);
    }

    /// A new process of uid `uid` (in Kubernetes container `pod`, if any) connects.
    pub fn connect(&mut self, uid: u32, pod: Option<PodIdentity>) -> ConnId {
        let pid = self.next_pid;
        self.next_pid += 1;
        let peer = Peer {
            pid,
            start: 7,
            uid,
            gid: uid,
            cgroup: format!("/user.slice/user-{uid}.slice"),
            pod,
        };
        self.connect_as(peer)
    }

    /// Process `peer` connects.
    pub fn connect_as(&mut self, peer: Peer) -> ConnId {
        let conn = self.next_conn;
        self.next_conn += 1;
        let (pid, uid) = (peer.pid, peer.uid);
        let tenant = Tenant {
            peer,
            pid_ns: 4026531836 + u64::from(uid % 2),
            unread: VecDeque::new(),
            hello_sent: false,
            welcome: None,
            refused: false,
            closed: false,
            exited: false,
            cut_off: false,
            asked: VecDeque::new(),
            next_req: 1,
            held: BTreeMap::new(),
            durable: BTreeMap::new(),
            received: Vec::new(),
        };
        self.tenants.insert(conn, tenant);
        let cred = Credentials { pid, uid, gid: uid };
        self.input(Input::Accepted { conn, cred });
        conn
    }

    /// `conn` sends `msg` (read by the node when it reads the connection).
    pub fn send(&mut self, conn: ConnId, msg: ClientMsg) {
        let Some(t) = self.tenants.get_mut(&conn) else {
            return;
        };
        if t.closed {
            return;
        }
        match &msg {
            ClientMsg::Hello { .. } => t.hello_sent = true,
            ClientMsg::MemReserve { req, gpu, bytes } => t.asked.push_back(Asked::Reserve {
                req: *req,
                gpu: *gpu,
                bytes: *bytes,
                at: u64::MAX,
            }),
            ClientMsg::MemQuery { req, .. } => t.asked.push_back(Asked::Query { req: *req }),
            ClientMsg::Status => t.asked.push_back(Asked::Status),
            ClientMsg::Probe { gpu } => t.asked.push_back(Asked::Probe { gpu: *gpu }),
            _ => {}
        }
        t.unread.push_back(msg);
        self.hand_over(conn);
    }

    /// Hand the node what `conn` sent, as long as it reads it.
    fn hand_over(&mut self, conn: ConnId) {
        while self.node.reads(conn) {
            let Some(t) = self.tenants.get_mut(&conn) else {
                return;
            };
            let Some(msg) = t.unread.pop_front() else {
                return;
            };
            // What the node does with a message happens when it reads it.
            let at = self.inputs + 1;
            let member = t.welcome.as_deref().is_some_and(|g| !g.is_empty()) && !t.refused;
            match &msg {
                ClientMsg::MemReserve { req, .. } => {
                    if let Some(Asked::Reserve { at: a, .. }) = (t.asked.iter_mut())
                        .find(|x| matches!(x, Asked::Reserve { req: r, .. } if r == req))
                    {
                        *a = at;
                    }
                }
                ClientMsg::MemFree { gpu, bytes } if member => {
                    for m in [&mut t.held, &mut t.durable] {
                        if let Some(h) = m.get_mut(gpu) {
                            *h = h.saturating_sub(*bytes);
                        }
                    }
                }
                ClientMsg::MemSync { gpu, bytes } if member => {
                    t.held.insert(*gpu, *bytes);
                    let d = t.durable.entry(*gpu).or_default();
                    *d = (*d).min(*bytes);
                    self.ghosts.remove(&(t.peer.process(), *gpu));
                }
                _ => {}
            }
            self.input(Input::Message { conn, msg });
        }
    }

    /// A fresh request id of `conn`.
    pub fn req(&mut self, conn: ConnId) -> u64 {
        let t = self.tenants.get_mut(&conn).expect("a known connection");
        t.next_req += 1;
        t.next_req
    }

    pub fn hello(&mut self, conn: ConnId, declared: Option<GroupSpec>) {
        let hello = ClientMsg::Hello {
            version: PROTOCOL_VERSION,
            declared,
        };
        self.send(conn, hello);
    }

    /// The peer hangs up.
    pub fn hang_up(&mut self, conn: ConnId) {
        let Some(t) = self.tenants.get_mut(&conn) else {
            return;
        };
        if t.closed {
            return;
        }
        t.closed = true;
        self.input(Input::Closed { conn, why: None });
    }

    /// Answer the node's request `i` (of [`World::work`]).
    pub fn complete(&mut self, i: usize) {
        if i >= self.work.len() {
            return;
        }
        let input = match self.work.remove(i) {
            Work::Resolve(conn) => {
                let t = &self.tenants[&conn];
                Input::Resolved {
                    conn,
                    peer: t.peer.clone(),
                    pid_ns: Some(t.pid_ns),
                }
            }
            Work::Persist {
                seq,
                holdings,
                asked_at,
            } => {
                self.write_asked_at = asked_at;
                let written = !self.journal_full;
                if written {
                    self.journal = holdings;
                    self.journal_asked_at = asked_at;
                    self.check_journal();
                }
                Input::Persisted { seq, written }
            }
            Work::Check(processes) => {
                let alive = |p: &ProcessId| {
                    !self
                        .tenants
                        .values()
                        .any(|t| t.peer.process() == *p && t.exited)
                };
                let answers: Vec<(ProcessId, Option<bool>)> =
                    processes.iter().map(|p| (*p, Some(alive(p)))).collect();
                for (p, a) in &answers {
                    if *a == Some(false) {
                        self.stats.freed_by_exit += 1;
                        for t in self.tenants.values_mut().filter(|t| t.peer.process() == *p) {
                            t.held.clear();
                            t.durable.clear();
                        }
                        self.ghosts.retain(|(q, _), _| q != p);
                    }
                }
                Input::Liveness(answers)
            }
            Work::Census(connected) => {
                // A process of the node that never connects, and the newest tenant's, which may
                // have connected since the census began.
                let newest = self.tenants.values().last().map(|t| t.peer.pid);
                let found = [Some(1), newest]
                    .into_iter()
                    .flatten()
                    .filter(|pid| !connected.contains(pid))
                    .map(|pid| Unhooked {
                        pid,
                        command: format!("p{pid}"),
                        hook_loaded: false,
                    })
                    .collect();
                Input::Census(found)
            }
        };
        self.input(input);
    }

    /// Answer every request of the node (and those its answers bring), in order.
    pub fn complete_all(&mut self) {
        for _ in 0..100_000 {
            if self.work.is_empty() {
                return;
            }
            self.complete(0);
        }
        panic!("the node keeps asking: {:?}", self.work);
    }

    pub fn admin(&mut self, req: AdminRequest) -> AdminReply {
        let token = self.next_admin;
        self.next_admin += 1;
        self.input(Input::Admin { token, req });
        self.admin_replies
            .remove(&token)
            .expect("every admin request is answered at once")
    }

    pub fn reload(&mut self, text: &str) {
        if let Ok(cfg) = Config::parse(text) {
            self.config = cfg.clone();
            self.input(Input::Config(Box::new(cfg)));
        }
    }

    /// The daemon is killed and started again: what was written survives, requests in flight
    /// do not; the tenants reconnect and restate what they hold (but those cut off).
    pub fn restart(&mut self) {
        self.check_journal();
        let restored: Vec<Holding> = (self.journal.iter())
            .filter(|h| !(self.tenants.values()).any(|t| t.peer.process() == h.process && t.exited))
            .cloned()
            .collect();
        self.ghosts.clear();
        self.stats.restarts += 1;
        self.stats.ghosts_restored += restored.len() as u64;
        for h in &restored {
            let g = (self.ghosts)
                .entry((h.process, h.gpu))
                .or_insert_with(|| (h.group.clone(), 0));
            g.1 += h.bytes;
        }
        self.now += S;
        self.node = Node::new(
            NodeOptions {
                config: self.config.clone(),
                dev: self.dev,
                restored,
                memory_overcommit: None,
            },
            self.now,
        );
        self.work.clear();
        self.effects();
        // Every connection died with the daemon.
        let old: Vec<Tenant> = (self.tenants.values_mut())
            .filter(|t| !t.closed)
            .map(|t| {
                t.closed = true;
                t.clone()
            })
            .collect();
        for t in old {
            if t.exited || t.cut_off || t.refused || t.welcome.is_none() {
                continue;
            }
            let conn = self.connect_as(t.peer.clone());
            let i = (self.work.iter())
                .position(|w| matches!(w, Work::Resolve(c) if *c == conn))
                .expect("a new connection is resolved");
            self.complete(i);
            self.hello(conn, None);
            for (gpu, bytes) in t.held {
                self.send(conn, ClientMsg::MemSync { gpu, bytes });
            }
        }
    }

    /// The journal holds at least what each live process was told it holds.
    fn check_journal(&self) {
        for t in self.tenants.values().filter(|t| !t.closed && !t.exited) {
            for (gpu, &bytes) in &t.durable {
                let on_disk: u64 = (self.journal.iter())
                    .filter(|h| h.process == t.peer.process() && h.gpu == *gpu)
                    .map(|h| h.bytes)
                    .sum();
                assert!(
                    on_disk >= bytes,
                    "pid {} was told it holds {bytes} on {gpu:?}, the journal says {on_disk}",
                    t.peer.pid
                );
            }
        }
    }

    /// Let everything finish: every request of the node answered, every deadline passed.
    pub fn settle(&mut self) {
        for _ in 0..5 {
            self.complete_all();
            self.advance(S);
        }
        self.complete_all();
    }

    /// After [`World::settle`]: every question was answered, and the books hold exactly what
    /// the tenants were told plus the restored holdings not restated.
    pub fn check_settled(&self) {
        for (conn, t) in &self.tenants {
            if t.closed || t.refused {
                continue;
            }
            assert!(
                !t.hello_sent || t.welcome.is_some(),
                "conn {conn}'s Hello unanswered"
            );
            assert!(t.asked.is_empty(), "conn {conn} waits for {:?}", t.asked);
        }
        let mut expected: BTreeMap<(String, GpuUuid), u64> = BTreeMap::new();
        for t in (self.tenants.values()).filter(|t| !t.closed && !t.refused && !t.exited) {
            let Some(group) = t.welcome.clone().filter(|g| !g.is_empty()) else {
                continue;
            };
            for (gpu, bytes) in &t.held {
                *expected.entry((group.clone(), *gpu)).or_default() += bytes;
            }
        }
        for ((_, gpu), (group, bytes)) in &self.ghosts {
            *expected.entry((group.clone(), *gpu)).or_default() += bytes;
        }
        let mut groups: Vec<String> = expected.keys().map(|(g, _)| g.clone()).collect();
        groups.extend(self.node.groups.keys().cloned());
        groups.sort();
        groups.dedup();
        for group in groups {
            for gpu in GPUS {
                let want = expected.get(&(group.clone(), gpu)).copied().unwrap_or(0);
                assert_eq!(
                    self.node.memory.used(&group, &gpu),
                    want,
                    "group {group} on {gpu:?}"
                );
            }
        }
    }
}

/// Container `i` (0..3) of pod `i % 2`.
pub fn pod_identity(i: u8) -> PodIdentity {
    PodIdentity {
        pod_uid: format!("0b1c8e3a-6f0e-4a57-9a39-8f2d3c1b7e1{}", i % 2),
        container_id: format!("{i}").repeat(64),
    }
}

/// The agent's policy for container `i` of [`pod_identity`].
pub fn pod_group(i: u8) -> PodGroup {
    let who = pod_identity(i);
    PodGroup {
        pod_uid: who.pod_uid,
        namespace: "ns".into(),
        pod: format!("pod{}", i % 2),
        container: format!("c{i}"),
        container_id: Some(who.container_id),
        gpus: vec![gpu_uuid_string(&GPUS[usize::from(i % 2)])],
        request: 0.1 * f64::from(i + 1),
        limit: 1.0,
        weight: 1.0,
        memory: Some(256 * MIB),
        latency: false,
    }
}

/// What a tenant or the world may do next.
#[derive(Debug, Clone)]
pub enum Op {
    /// A new process connects: uid 1000 + `uid % 3`, or a process of container `uid % 3` when
    /// `pod`.
    Connect {
        uid: u8,
        pod: bool,
    },
    Hello {
        who: u8,
        declared: bool,
    },
    Acquire {
        who: u8,
        gpu: u8,
    },
    Reserve {
        who: u8,
        gpu: u8,
        mib: u16,
    },
    Free {
        who: u8,
        gpu: u8,
        eighths: u8,
    },
    Query {
        who: u8,
        gpu: u8,
    },
    Sync {
        who: u8,
        gpu: u8,
    },
    Status {
        who: u8,
    },
    /// A tenant waiting for a turn asks whether the scheduler is there.
    Probe {
        who: u8,
        gpu: u8,
    },
    /// The journal's file system fills up (writes fail from now on), or has room again.
    JournalFull(bool),
    /// Something a well-behaved tenant would not send.
    Hostile {
        who: u8,
        what: u8,
    },
    HangUp {
        who: u8,
    },
    /// The process exits; a child keeps its connection.
    Exit {
        who: u8,
    },
    Admin {
        what: u8,
        which: u8,
    },
    Reload {
        which: u8,
    },
    /// A worker answers one of the node's requests.
    Work {
        which: u8,
    },
    Advance {
        ms: u16,
    },
    Restart,
}

pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<u8>(), prop::bool::weighted(0.25)).prop_map(|(uid, pod)| Op::Connect { uid, pod }),
        3 => (any::<u8>(), prop::bool::weighted(0.2)).prop_map(|(who, declared)| Op::Hello { who, declared }),
        2 => (any::<u8>(), any::<u8>()).prop_map(|(who, gpu)| Op::Acquire { who, gpu }),
        4 => (any::<u8>(), any::<u8>(), 0u16..700).prop_map(|(who, gpu, mib)| Op::Reserve { who, gpu, mib }),
        2 => (any::<u8>(), any::<u8>(), 0u8..9).prop_map(|(who, gpu, eighths)| Op::Free { who, gpu, eighths }),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(who, gpu)| Op::Query { who, gpu }),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(who, gpu)| Op::Sync { who, gpu }),
        1 => any::<u8>().prop_map(|who| Op::Status { who }),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(who, gpu)| Op::Probe { who, gpu }),
        1 => any::<bool>().prop_map(Op::JournalFull),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(who, what)| Op::Hostile { who, what }),
        1 => any::<u8>().prop_map(|who| Op::HangUp { who }),
        1 => any::<u8>().prop_map(|who| Op::Exit { who }),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(what, which)| Op::Admin { what, which }),
        1 => any::<u8>().prop_map(|which| Op::Reload { which }),
        10 => any::<u8>().prop_map(|which| Op::Work { which }),
        3 => (0u16..3_000).prop_map(|ms| Op::Advance { ms }),
        1 => any::<u8>().prop_map(|dice| if dice < 64 { Op::Restart } else { Op::Work { which: dice } }),
    ]
}

/// Configurations a reload may bring: caps changed, a group gone, other timing, tight limits.
const RELOADS: [&str; 4] = [
    CONFIG,
    "[[group]]\nname = \"a\"\nuids = [1000]\nrequest = 0.5\nmemory = \"256MiB\"\n",
    "[scheduler]\nquota = \"5ms\"\nmin_quota = \"1ms\"\ngrace = \"5ms\"\n\n[[group]]\nname = \"b\"\nuids = [1001, 1000]\nmemory = \"2GiB\"\n",
    "[connections]\nmax = 6\nmax_per_uid = 3\nhello_timeout = \"300ms\"\n\n[[group]]\nname = \"a\"\nuids = [1000]\nmemory = \"1GiB\"\n",
];

impl World {
    /// The `who`-th connection still open (and not refused), of those that said Hello
    /// (`greeted`) or not, or of all if there is none such.
    fn pick_among(&self, who: u8, greeted: bool) -> Option<ConnId> {
        let open: Vec<(ConnId, bool)> = (self.tenants.iter())
            .filter(|(_, t)| !t.closed && !t.refused && !t.exited)
            .map(|(c, t)| (*c, t.hello_sent == greeted))
            .collect();
        let first: Vec<ConnId> = open.iter().filter(|(_, f)| *f).map(|(c, _)| *c).collect();
        let all: Vec<ConnId> = open.iter().map(|(c, _)| *c).collect();
        let pool = if first.is_empty() { all } else { first };
        (!pool.is_empty()).then(|| pool[usize::from(who) % pool.len()])
    }

    /// A tenant that said Hello.
    fn pick(&self, who: u8) -> Option<ConnId> {
        self.pick_among(who, true)
            .filter(|c| self.tenants[c].hello_sent)
    }

    /// Carry out `op`.
    pub fn apply(&mut self, op: &Op) {
        let gpu_of = |g: u8| GPUS[usize::from(g) % GPUS.len()];
        match *op {
            Op::Connect { uid, pod } => {
                if pod {
                    self.connect(0, Some(pod_identity(uid % 3)));
                } else {
                    // Mostly processes of a configured group.
                    self.connect([1000, 1000, 1001, 1001, 1002][usize::from(uid % 5)], None);
                }
            }
            Op::Hello { who, declared } => {
                let Some(c) = self.pick_among(who, false) else {
                    return;
                };
                let spec = declared.then(|| GroupSpec {
                    name: format!("dev{}", who % 2),
                    request: 0.25,
                    limit: 1.0,
                    weight: 1.0,
                    memory: Some(300 * MIB),
                    latency: false,
                });
                self.hello(c, spec);
            }
            Op::Acquire { who, gpu } => {
                let Some(c) = self.pick(who) else { return };
                self.send(c, ClientMsg::Acquire { gpu: gpu_of(gpu) });
            }
            Op::Reserve { who, gpu, mib } => {
                let Some(c) = self.pick(who) else { return };
                let req = self.req(c);
                let (gpu, bytes) = (gpu_of(gpu), u64::from(mib) * MIB);
                self.send(c, ClientMsg::MemReserve { req, gpu, bytes });
            }
            Op::Free { who, gpu, eighths } => {
                let Some(c) = self.pick(who) else { return };
                let gpu = gpu_of(gpu);
                let held = self.tenants[&c].held.get(&gpu).copied().unwrap_or(0);
                let bytes = held / 8 * u64::from(eighths);
                self.send(c, ClientMsg::MemFree { gpu, bytes });
            }
            Op::Query { who, gpu } => {
                let Some(c) = self.pick(who) else { return };
                let req = self.req(c);
                self.send(
                    c,
                    ClientMsg::MemQuery {
                        req,
                        gpu: gpu_of(gpu),
                    },
                );
            }
            Op::Sync { who, gpu } => {
                let Some(c) = self.pick(who) else { return };
                // A hook restates what it holds on reconnecting, with no reservation under way.
                if (self.tenants[&c].asked.iter()).any(|a| matches!(a, Asked::Reserve { .. })) {
                    return;
                }
                let gpu = gpu_of(gpu);
                let bytes = self.tenants[&c].held.get(&gpu).copied().unwrap_or(0);
                self.send(c, ClientMsg::MemSync { gpu, bytes });
            }
            Op::Status { who } => {
                let Some(c) = self.pick(who) else { return };
                self.send(c, ClientMsg::Status);
            }
            Op::Probe { who, gpu } => {
                let Some(c) = self.pick(who) else { return };
                self.send(c, ClientMsg::Probe { gpu: gpu_of(gpu) });
            }
            Op::JournalFull(full) => self.journal_full = full,
            Op::Hostile { who, what } => {
                let Some(c) = self.pick_among(who, true) else {
                    return;
                };
                let gpu = gpu_of(what);
                let msg = match what % 4 {
                    0 => ClientMsg::Yield {
                        gpu,
                        token: u64::from(what),
                        drained_ns: u64::MAX,
                    },
                    1 => ClientMsg::Report {
                        gpu,
                        token: u64::from(what) % 5,
                        used: Some(gpushare_protocol::TurnUse {
                            first_ns: u64::MAX,
                            last_ns: 0,
                        }),
                        again: what % 8 < 4,
                    },
                    // Never this protocol's version, whatever its number.
                    2 => ClientMsg::Hello {
                        version: u32::from(what) + PROTOCOL_VERSION + 1,
                        declared: None,
                    },
                    // Frees more than it holds (when no reservation of its is under way, whose
                    // grant the free would take back before the tenant heard of it).
                    _ if !(self.tenants[&c].asked.iter())
                        .any(|a| matches!(a, Asked::Reserve { .. })) =>
                    {
                        ClientMsg::MemFree {
                            gpu,
                            bytes: u64::MAX,
                        }
                    }
                    _ => ClientMsg::Acquire { gpu },
                };
                if let ClientMsg::MemFree { .. } = msg {
                    // Everything it held on every GPU goes with a free of all on each.
                    for gpu in GPUS {
                        self.send(
                            c,
                            ClientMsg::MemFree {
                                gpu,
                                bytes: u64::MAX,
                            },
                        );
                    }
                } else {
                    self.send(c, msg);
                }
            }
            Op::HangUp { who } => {
                if let Some(c) = self.pick(who) {
                    self.hang_up(c);
                }
            }
            Op::Exit { who } => {
                if let Some(c) = self.pick(who) {
                    self.tenants.get_mut(&c).expect("picked").exited = true;
                }
            }
            Op::Admin { what, which } => {
                let i = which % 3;
                let req = match what % 4 {
                    0 => AdminRequest::Sync {
                        groups: (0..3)
                            .filter(|j| which >> j & 1 == 1)
                            .map(pod_group)
                            .collect(),
                    },
                    1 => AdminRequest::Upsert {
                        group: pod_group(i),
                    },
                    2 => AdminRequest::Remove {
                        key: ContainerKey {
                            pod_uid: pod_group(i).pod_uid,
                            container: pod_group(i).container,
                        },
                    },
                    _ => AdminRequest::Usage,
                };
                self.admin(req);
            }
            Op::Reload { which } => self.reload(RELOADS[usize::from(which) % RELOADS.len()]),
            Op::Work { which } => {
                if !self.work.is_empty() {
                    let i = usize::from(which) % self.work.len();
                    self.complete(i);
                }
            }
            Op::Advance { ms } => self.advance(u64::from(ms) * MS),
            Op::Restart => self.restart(),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random tenants, agents, reloads, restarts and worker timings: nothing sent to a closed
    /// connection, no grant before the books that hold it are written, the journal never
    /// behind what tenants were told, and once everything has run its course every question
    /// answered and the books exact.
    #[test]
    fn random_lives_keep_the_books_exact_and_every_question_answered(
        ops in proptest::collection::vec(op(), 1..120),
        dev in any::<bool>(),
    ) {
        let mut w = World::new(CONFIG, dev);
        for op in &ops {
            w.apply(op);
        }
        w.settle();
        w.check_settled();
    }
}

/// The random lives above reach every path: grants, refusals, pods admitted, restarts with
/// holdings restored, memory freed by an exit, connections closed by the node, reservations
/// granted while the journal could not be written.
#[test]
fn random_lives_reach_every_path() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let lives = proptest::collection::vec(op(), 1..120);
    let mut total = Stats::default();
    for i in 0..256 {
        let ops = lives.new_tree(&mut runner).expect("a life").current();
        let mut w = World::new(CONFIG, i % 2 == 0);
        for op in &ops {
            w.apply(op);
        }
        w.settle();
        w.check_settled();
        let s = w.stats;
        total.grants += s.grants;
        total.welcomed += s.welcomed;
        total.pods_admitted += s.pods_admitted;
        total.refused += s.refused;
        total.closed_by_node += s.closed_by_node;
        total.restarts += s.restarts;
        total.ghosts_restored += s.ghosts_restored;
        total.freed_by_exit += s.freed_by_exit;
        total.unjournaled += s.unjournaled;
    }
    eprintln!("{total:?}");
    assert!(total.grants > 200 && total.welcomed >= 400, "{total:?}");
    assert!(total.pods_admitted > 0 && total.refused > 0, "{total:?}");
    assert!(total.closed_by_node > 0 && total.restarts > 0, "{total:?}");
    assert!(
        total.ghosts_restored > 0 && total.freed_by_exit > 0,
        "{total:?}"
    );
    assert!(total.unjournaled > 0, "{total:?}");
}

/// A connection the node closes (here: its turn asked on a GPU its pod may not use) while a
/// grant to it waits for the books: the books forget the grant with the connection, so its
/// reply, still sent in order before the error, says it is not journaled, and the journal is
/// never behind what a live process was told.
#[test]
fn a_grant_waiting_for_the_books_of_a_connection_the_node_closes_is_not_journaled() {
    let ops = [
        Op::Admin { what: 1, which: 0 },
        Op::Connect { uid: 0, pod: true },
        Op::Hello {
            who: 0,
            declared: false,
        },
        Op::Reserve {
            who: 0,
            gpu: 0,
            mib: 1,
        },
        Op::Acquire { who: 0, gpu: 1 },
    ];
    let mut w = World::new(CONFIG, false);
    for op in &ops {
        w.apply(op);
    }
    w.settle();
    w.check_settled();
    let t = w.tenants.values().next().expect("the tenant");
    let replies: Vec<_> = (t.received.iter())
        .filter_map(|m| match m {
            ServerMsg::Memory {
                granted, journaled, ..
            } => Some((*granted, *journaled)),
            ServerMsg::Error { fatal: true, .. } => Some((false, false)),
            _ => None,
        })
        .collect();
    assert_eq!(replies, [(true, false), (false, false)], "{:?}", t.received);
    assert!(w.journal.is_empty(), "{:?}", w.journal);
}
