//! Connections from accept to close: who the peer is, whether it said Hello in time, whether it
//! waits for its pod, and the tenant socket's bounds (`[connections]`: in total, per user and
//! pid namespace, the time to say Hello). A flood of idle, slow or hostile connections
//! therefore costs bounded memory and never a client's turn.

use super::{ConnId, Effect, Node};
use crate::identity::{Credentials, Peer};
use gpushare_protocol::{ClientMsg, ServerMsg};
use std::collections::{BTreeSet, HashMap};

/// A peer for the per-user bound: its uid and its pid namespace (0 if unreadable). A user's
/// connections are counted per pid namespace: root in every container of a node is one uid,
/// and each container is its own peer.
type PeerKey = (u32, u64);

pub(super) enum Phase {
    /// Accepted; who its peer is is being read (its input waits meanwhile).
    Resolving,
    /// Its peer known; closed unless it says Hello by its deadline.
    Greeting { peer: Peer },
    /// Said Hello as a process of a Kubernetes container the agent has not registered yet;
    /// its further input waits meanwhile.
    AwaitingPod { hello: ClientMsg, peer: Peer },
    /// A client (its id is the connection's).
    Client,
}

pub(super) struct Conn {
    pub cred: Credentials,
    /// What it is counted under for `max_per_uid`, once its peer is known.
    key: Option<PeerKey>,
    pub phase: Phase,
    /// When it must have moved on from its phase.
    deadline: Option<u64>,
}

#[derive(Default)]
pub(super) struct Conns {
    by_id: HashMap<ConnId, Conn>,
    /// Open connections per user and pid namespace.
    per_peer: HashMap<PeerKey, usize>,
    /// Connection deadlines, earliest first; an entry goes when its connection moves on or
    /// closes, so that no timer fires for a connection long gone.
    deadlines: BTreeSet<(u64, ConnId)>,
}

impl Conns {
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn get(&self, c: ConnId) -> Option<&Conn> {
        self.by_id.get(&c)
    }

    fn get_mut(&mut self, c: ConnId) -> Option<&mut Conn> {
        self.by_id.get_mut(&c)
    }

    fn insert(&mut self, c: ConnId, cred: Credentials, deadline: u64) {
        self.deadlines.insert((deadline, c));
        let conn = Conn {
            cred,
            key: None,
            phase: Phase::Resolving,
            deadline: Some(deadline),
        };
        self.by_id.insert(c, conn);
    }

    /// Forget `c`; what it was.
    pub fn remove(&mut self, c: ConnId) -> Option<Conn> {
        let conn = self.by_id.remove(&c)?;
        if let Some(d) = conn.deadline {
            self.deadlines.remove(&(d, c));
        }
        if let Some(key) = conn.key
            && let Some(n) = self.per_peer.get_mut(&key)
        {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&key);
            }
        }
        Some(conn)
    }

    /// `c` moves to `phase`, with a deadline to move on from it (or none).
    pub fn set_phase(&mut self, c: ConnId, phase: Phase, deadline: Option<u64>) {
        let Some(conn) = self.by_id.get_mut(&c) else {
            return;
        };
        if let Some(d) = conn.deadline {
            self.deadlines.remove(&(d, c));
        }
        if let Some(d) = deadline {
            self.deadlines.insert((d, c));
        }
        conn.phase = phase;
        conn.deadline = deadline;
    }

    /// The connections whose deadline passed by `now`, taken off the deadline list.
    pub fn expired(&mut self, now: u64) -> Vec<ConnId> {
        let mut out = Vec::new();
        while let Some(&(at, c)) = self.deadlines.first() {
            if at > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(conn) = self.by_id.get_mut(&c) {
                conn.deadline = None;
            }
            out.push(c);
        }
        out
    }

    pub fn next_deadline(&self) -> Option<u64> {
        self.deadlines.first().map(|(at, _)| *at)
    }

    pub fn reads(&self, c: ConnId) -> bool {
        self.by_id
            .get(&c)
            .is_some_and(|conn| matches!(conn.phase, Phase::Greeting { .. } | Phase::Client))
    }

    /// The connections waiting for their pod.
    pub fn awaiting_pod(&self) -> Vec<ConnId> {
        let mut v: Vec<ConnId> = (self.by_id.iter())
            .filter(|(_, conn)| matches!(conn.phase, Phase::AwaitingPod { .. }))
            .map(|(c, _)| *c)
            .collect();
        v.sort_unstable();
        v
    }
}

impl Node {
    /// A new connection: closed at once over the total bound, else its peer is looked up.
    pub(super) fn accepted(&mut self, conn: ConnId, cred: Credentials, now: u64) {
        if self.conns.get(conn).is_some() {
            return;
        }
        let max = self.config.connections.max;
        if self.conns.len() >= max {
            self.warnings.warn(
                now,
                format_args!(
                    "closing a new connection of pid {} uid {}: {} connections are open (limit: [connections] max = {max})",
                    cred.pid,
                    cred.uid,
                    self.conns.len()
                ),
            );
            self.effects.push(Effect::Close { conn });
            return;
        }
        let deadline = now.saturating_add(self.config.connections.hello_timeout_ns);
        self.conns.insert(conn, cred, deadline);
        self.effects.push(Effect::Resolve { conn, cred });
    }

    /// Who the peer of `conn` is: closed at once over its user's bound, else its input is read.
    pub(super) fn resolved(&mut self, conn: ConnId, peer: Peer, pid_ns: Option<u64>, now: u64) {
        let Some(c) = self.conns.get(conn) else {
            return;
        };
        if !matches!(c.phase, Phase::Resolving) {
            return;
        }
        let key = (c.cred.uid, pid_ns.unwrap_or(0));
        let of_peer = self.conns.per_peer.get(&key).copied().unwrap_or(0);
        let per_uid = self.config.connections.max_per_uid;
        if of_peer >= per_uid {
            self.warnings.warn(
                now,
                format_args!(
                    "closing a new connection of pid {} uid {}: {of_peer} connections of this user in its pid namespace are open (limit: [connections] max_per_uid = {per_uid})",
                    peer.pid, peer.uid
                ),
            );
            self.conns.remove(conn);
            self.effects.push(Effect::Close { conn });
            return;
        }
        *self.conns.per_peer.entry(key).or_default() += 1;
        let deadline = self.conns.get(conn).and_then(|c| c.deadline);
        if let Some(c) = self.conns.get_mut(conn) {
            c.key = Some(key);
        }
        self.conns
            .set_phase(conn, Phase::Greeting { peer }, deadline);
        self.effects.push(Effect::Resume { conn });
    }

    /// A message from `conn`: its Hello, or a client's message.
    pub(super) fn message(&mut self, conn: ConnId, msg: ClientMsg, now: u64) {
        let Some(c) = self.conns.get(conn) else {
            return;
        };
        match &c.phase {
            Phase::Client => self.client_message(conn, msg, now),
            Phase::Greeting { peer } => {
                let peer = peer.clone();
                self.greet(conn, msg, peer, false, now);
            }
            // The shell hands over no input of these (`Node::reads`); a stray one waits its turn
            // no more than the others did.
            Phase::Resolving | Phase::AwaitingPod { .. } => {}
        }
    }

    /// The shell closed `conn`.
    pub(super) fn closed(&mut self, conn: ConnId, why: Option<String>, now: u64) {
        self.books.forget(conn);
        let Some(c) = self.conns.remove(conn) else {
            return;
        };
        if let Some(why) = why {
            let pid = c.cred.pid;
            self.warnings
                .warn(now, format_args!("dropping pid {pid}'s connection: {why}"));
        }
        if let Phase::Client = c.phase {
            self.disconnect(conn, now);
        }
    }

    /// The node closes `conn`: what it holds is released at once, and its reservations'
    /// replies still waiting for the books say they are not journaled.
    pub(super) fn drop_conn(&mut self, conn: ConnId, now: u64) {
        if let Some(c) = self.conns.remove(conn) {
            if let Phase::Client = c.phase {
                self.disconnect(conn, now);
            }
            self.books.unjournal_replies(conn);
            self.close(conn);
        }
    }

    /// `conn`'s deadline passed: it did not say Hello in time, or waited for its pod long
    /// enough.
    pub(super) fn expire(&mut self, conn: ConnId, now: u64) {
        let Some(c) = self.conns.get(conn) else {
            return;
        };
        match &c.phase {
            Phase::Resolving | Phase::Greeting { .. } => {
                let (pid, secs) = (
                    c.cred.pid,
                    self.config.connections.hello_timeout_ns as f64 / 1e9,
                );
                self.warnings.warn(
                    now,
                    format_args!("dropping pid {pid}'s connection: no Hello within {secs} s"),
                );
                self.drop_conn(conn, now);
            }
            Phase::AwaitingPod { .. } => self.greet_again(conn, true, now),
            Phase::Client => {}
        }
    }

    /// Greet again a connection that waits for its pod (the pods changed, or it waited long
    /// enough: `waited`); once admitted its input is read again.
    pub(super) fn greet_again(&mut self, conn: ConnId, waited: bool, now: u64) {
        let Some(Phase::AwaitingPod { hello, peer }) = self.conns.get(conn).map(|c| &c.phase)
        else {
            return;
        };
        let (hello, peer) = (hello.clone(), peer.clone());
        if self.greet(conn, hello, peer, waited, now) {
            self.effects.push(Effect::Resume { conn });
        }
    }

    /// Greet `conn`, the process `peer`, with its first message; `true` if it is a client now.
    fn greet(
        &mut self,
        conn: ConnId,
        first: ClientMsg,
        peer: Peer,
        waited: bool,
        now: u64,
    ) -> bool {
        match self.greeting(conn, &first, &peer, waited) {
            super::tenants::Greeting::Admitted(welcome) => {
                self.conns.set_phase(conn, Phase::Client, None);
                self.send(conn, welcome);
                true
            }
            super::tenants::Greeting::Refused(message) => {
                let pid = peer.pid;
                self.warnings
                    .warn(now, format_args!("refused pid {pid}: {message}"));
                self.send(
                    conn,
                    ServerMsg::Error {
                        message,
                        fatal: true,
                    },
                );
                self.drop_conn(conn, now);
                false
            }
            super::tenants::Greeting::AwaitPod => {
                // Greeted again as the pods change, it waits from its first Hello still.
                let deadline = match self.conns.get(conn) {
                    Some(Conn {
                        phase: Phase::AwaitingPod { .. },
                        deadline: Some(d),
                        ..
                    }) => *d,
                    _ => now.saturating_add(super::POD_WAIT.as_nanos() as u64),
                };
                let phase = Phase::AwaitingPod { hello: first, peer };
                self.conns.set_phase(conn, phase, Some(deadline));
                false
            }
        }
    }
}
