//! Kubernetes containers: the node agent's admin requests change the pod table
//! ([`crate::pods`]) and through it the groups, and a tenant process is matched to its
//! container from its cgroup ([`crate::identity`]) — or waits a moment for the agent to
//! register it.

use super::{Effect, Node};
use crate::identity::Peer;
use crate::pods::{GroupChange, Lookup};
use gpushare_protocol::admin::{AdminReply, AdminRequest};
use std::time::Duration;

/// How long a process of a pod waits for the agent to register its container before it is
/// refused.
pub const POD_WAIT: Duration = Duration::from_secs(2);

impl Node {
    /// An admin request: applied to the pod table, the groups and the books, or refused with
    /// nothing changed. The processes waiting for their pod are greeted again.
    pub(super) fn admin(&mut self, token: u64, req: AdminRequest, now: u64) {
        if req == AdminRequest::Usage {
            let gpus = super::report::usage(self.latest_report());
            let reply = AdminReply::Usage { gpus };
            return self.effects.push(Effect::AdminReply { token, reply });
        }
        let clients = &self.clients;
        let reply = match self.pods.apply(req, |name| clients.has_group(name)) {
            Ok(changes) => {
                self.apply_group_changes(changes, now);
                AdminReply::Done
            }
            Err(message) => {
                tracing::warn!("admin request refused: {message}");
                AdminReply::Error { message }
            }
        };
        self.effects.push(Effect::AdminReply { token, reply });
        for conn in self.conns.awaiting_pod() {
            self.greet_again(conn, false, now);
        }
    }

    /// Apply the pod table's changes to the policies and memory books.
    fn apply_group_changes(&mut self, changes: Vec<GroupChange>, now: u64) {
        // A container's GPUs may have changed: its cap counts on those.
        self.overcommit.caps_unsettled = true;
        for c in changes {
            match c {
                GroupChange::Set {
                    name,
                    params,
                    memory,
                } => {
                    self.set_group(&name, params);
                    self.memory.set_cap(&name, memory);
                }
                GroupChange::Remove { name } => {
                    self.remove_group(&name, now);
                    self.memory.set_cap(&name, None);
                }
            }
        }
    }

    /// The group of a process whose container the agent registered, if any.
    pub(super) fn pod_group(&self, peer: &Peer) -> Option<String> {
        match self.pods.lookup(peer.pod.as_ref()?) {
            Lookup::Group(name) => Some(name),
            _ => None,
        }
    }

    /// Whether a process may be admitted as far as its pod goes: `Ok(true)` yes, `Ok(false)`
    /// not yet (the agent has not registered its container; ask again when the pods change),
    /// `Err` the message that refuses it. `waited` says it has waited [`POD_WAIT`] already.
    /// Processes outside pods, processes a config group matches, and every process while no
    /// agent manages this node pass at once.
    pub(super) fn pod_admission(&self, peer: &Peer, waited: bool) -> Result<bool, String> {
        let Some(who) = &peer.pod else {
            return Ok(true);
        };
        if !self.pods.active() || self.config.group_for(peer).is_some() {
            return Ok(true);
        }
        match self.pods.lookup(who) {
            Lookup::Group(_) => Ok(true),
            Lookup::Removed(name) => Err(format!(
                "container {name} was removed from this node; its processes may not start new GPU work"
            )),
            Lookup::Unknown if waited => Err(format!(
                "pod {} container {} has no gpushare policy after {POD_WAIT:?}: only containers that request gpushare.io/gpu-share may use the GPU; if this one does, check that gpushare-device-manager runs on this node (its log says why it did not register the container)",
                who.pod_uid, who.container_id
            )),
            Lookup::Unknown => Ok(false),
        }
    }

    /// A process of group `name` disconnected: a removed container's group goes with its last
    /// process.
    pub(super) fn client_left(&mut self, name: &str, now: u64) {
        let connected = self.clients.has_group(name);
        if let Some(change) = self.pods.client_left(name, connected) {
            self.apply_group_changes(vec![change], now);
        }
    }
}
