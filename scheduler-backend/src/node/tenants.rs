//! The tenants: a Hello makes a connection a client of a group; what each client message does
//! (turns from the GPU's policy, reservations against the group's memory cap, the report);
//! what the policies decide becomes messages to their clients.

use super::{ConnId, Node};
use crate::identity::Peer;
use gpushare_policy::overcommit::Unswappable;
use gpushare_policy::{ClientId, Decision, GroupClass, GroupParams, Policy, TurnUse};
use gpushare_protocol::status::uuid_string;
use gpushare_protocol::{ClientMsg, GpuUuid, GroupSpec, PROTOCOL_VERSION, ServerMsg};
use std::collections::HashMap;

pub(super) struct Client {
    pub pid: u32,
    /// `None` when no group matches it (status-only clients never need one).
    pub group: Option<String>,
    pub peer: Peer,
}

/// The connected clients, and how many of them each group has: a disconnect asks whether its
/// group has processes left, and under a flood of connections that say Hello and go, counting
/// them anew each time took half of the event loop's time.
#[derive(Default)]
pub(super) struct Clients {
    by_id: HashMap<ClientId, Client>,
    per_group: HashMap<String, usize>,
}

impl Clients {
    fn insert(&mut self, id: ClientId, client: Client) {
        if let Some(g) = &client.group {
            *self.per_group.entry(g.clone()).or_default() += 1;
        }
        let old = self.by_id.insert(id, client);
        debug_assert!(old.is_none(), "client ids are never reused");
    }

    fn remove(&mut self, id: ClientId) -> Option<Client> {
        let gone = self.by_id.remove(&id)?;
        if let Some(g) = gone.group.as_deref()
            && let Some(n) = self.per_group.get_mut(g)
        {
            *n -= 1;
            if *n == 0 {
                self.per_group.remove(g);
            }
        }
        Some(gone)
    }

    /// Whether group `name` has a connected process.
    pub fn has_group(&self, name: &str) -> bool {
        self.per_group.contains_key(name)
    }

    pub fn get(&self, id: ClientId) -> Option<&Client> {
        self.by_id.get(&id)
    }

    /// The clients' pids, sorted.
    pub fn pids(&self) -> Vec<u32> {
        let mut p: Vec<u32> = self.by_id.values().map(|c| c.pid).collect();
        p.sort_unstable();
        p.dedup();
        p
    }
}

/// What became of a connection's first message.
pub(super) enum Greeting {
    /// A client now; send it this `Welcome`.
    Admitted(ServerMsg),
    /// Refused with this message for the user (then closed).
    Refused(String),
    /// A process of a Kubernetes container the agent has not registered yet: greet it again
    /// when the pods change, and for the last time once it has waited [`super::POD_WAIT`].
    AwaitPod,
}

impl Node {
    /// A new connection's first message, from the process `peer`, on `conn`; `waited` says it
    /// has waited [`super::POD_WAIT`] for its pod already.
    pub(super) fn greeting(
        &mut self,
        conn: ConnId,
        first: &ClientMsg,
        peer: &Peer,
        waited: bool,
    ) -> Greeting {
        let ClientMsg::Hello { version, declared } = first else {
            return Greeting::Refused("the first message must be Hello".into());
        };
        match self.pod_admission(peer, waited) {
            Ok(true) => {}
            Ok(false) => return Greeting::AwaitPod,
            Err(message) => return Greeting::Refused(message),
        }
        match self.hello(conn, peer, *version, declared.clone()) {
            Ok(group) => Greeting::Admitted(ServerMsg::Welcome {
                group,
                liveness_ns: self.liveness_ns(),
            }),
            Err(message) => Greeting::Refused(message),
        }
    }

    /// How soon this scheduler answers a question while it is well, as promised to each hook
    /// in its `Welcome`: a quota plus the grace, as long as it waits itself for a holder's
    /// report past a turn's end (the hook probes when it has heard nothing for half of it).
    pub(super) fn liveness_ns(&self) -> u64 {
        let p = &self.config.policy;
        p.quota_ns.saturating_add(p.grace_ns)
    }

    /// Register `conn` as a client and find its group. Errors are messages for the user.
    fn hello(
        &mut self,
        conn: ConnId,
        peer: &Peer,
        version: u32,
        declared: Option<GroupSpec>,
    ) -> Result<String, String> {
        if version != PROTOCOL_VERSION {
            return Err(format!(
                "client speaks protocol {version}, scheduler {PROTOCOL_VERSION}: install libgpushare.so and gpushare-scheduler from the same release"
            ));
        }
        let pod_group = self.pod_group(peer);
        let group = match declared {
            // A process in a registered Kubernetes container: identity from the kernel only.
            _ if pod_group.is_some() => pod_group,
            Some(spec) if self.dev => {
                let params = GroupParams {
                    request: spec.request,
                    limit: spec.limit,
                    weight: spec.weight,
                    class: GroupClass::latency_if(spec.latency),
                };
                params.validate().map_err(|reason| {
                    format!("invalid parameters for group {:?}: {reason}", spec.name)
                })?;
                self.set_group(&spec.name, params);
                // A declaration without --memory leaves an earlier declared cap in place.
                if spec.memory.is_some() {
                    self.memory.set_cap(&spec.name, spec.memory);
                }
                Some(spec.name)
            }
            Some(spec) => match self.config.group_for(peer) {
                Some(g) => Some(g.name.clone()),
                None => {
                    return Err(format!(
                        "group {:?} was declared, but the scheduler is not in --dev mode and no [[group]] of its config matches uid {} / cgroup {:?}",
                        spec.name, peer.uid, peer.cgroup
                    ));
                }
            },
            None => match self.config.group_for(peer) {
                Some(g) => Some(g.name.clone()),
                // In --dev, an undeclared process gets its own uid's group (created when it
                // first uses a GPU, so status-only clients like `gpushare status` leave no
                // trace).
                None if self.dev => Some(format!("uid-{}", peer.uid)),
                None => None,
            },
        };
        self.memory.attach(conn, peer.process());
        self.clients.insert(
            conn,
            Client {
                pid: peer.pid,
                group: group.clone(),
                peer: peer.clone(),
            },
        );
        Ok(group.unwrap_or_default())
    }

    /// Client `id` is gone: everything it held is released at once.
    pub(super) fn disconnect(&mut self, id: ClientId, now: u64) {
        self.exit_physical(id, now);
        let gone = self.clients.remove(id);
        self.memory.forget_client(id);
        for p in self.policies.values_mut() {
            p.disconnect(id, now);
        }
        if let Some(group) = gone.and_then(|c| c.group) {
            self.client_left(&group, now);
        }
    }

    /// A client's message.
    pub(super) fn client_message(&mut self, id: ClientId, msg: ClientMsg, now: u64) {
        match msg {
            ClientMsg::Hello { .. } => self.refuse(id, "Hello sent twice".into()),
            ClientMsg::Acquire { gpu } => self.acquire(id, gpu, now),
            ClientMsg::Yield {
                gpu,
                token,
                drained_ns,
            } => {
                let r =
                    (self.policies.get_mut(&gpu)).map(|p| p.yield_turn(id, token, drained_ns, now));
                if let Some(Err(e)) = r {
                    self.refuse(id, e.to_string());
                }
            }
            ClientMsg::Report {
                gpu,
                token,
                used,
                again,
            } => {
                let used = used.map(|u| TurnUse {
                    first_ns: u.first_ns,
                    last_ns: u.last_ns,
                });
                tracing::debug!(at = now, gpu = %uuid_string(&gpu), client = id, token, ?used, again, "report");
                let r =
                    (self.policies.get_mut(&gpu)).map(|p| p.report(id, token, used, again, now));
                if let Some(Err(e)) = r {
                    self.refuse(id, e.to_string());
                }
                if let Some(group) = self.clients.get(id).and_then(|c| c.group.clone()) {
                    self.group_pending(&group, again, now);
                }
            }
            ClientMsg::MemReserve { req, gpu, bytes } => self.reserve(id, req, gpu, bytes, now),
            ClientMsg::MemQuery { req, gpu } => {
                if let Some(group) = self.group_of(id, now) {
                    let u = self.memory.query(&group, &gpu);
                    let answer = ServerMsg::Memory {
                        req,
                        granted: true,
                        cap: u.cap,
                        used: u.used,
                        journaled: true,
                    };
                    self.send(id, answer);
                }
            }
            ClientMsg::MemFree { gpu, bytes } => {
                self.memory.free(id, gpu, bytes);
                self.free_physical(id, gpu, bytes, now);
            }
            ClientMsg::MemTotal { gpu, bytes } => self.gpu_memory(gpu, bytes, now),
            ClientMsg::MemManaged | ClientMsg::MemIpc => {
                let why = match msg {
                    ClientMsg::MemManaged => Unswappable::Managed,
                    _ => Unswappable::Ipc,
                };
                if let Some(group) = self.group_of(id, now) {
                    self.unswappable_memory(id, &group, why, now);
                }
            }
            ClientMsg::MemSync { gpu, bytes } => {
                if let Some(group) = self.group_of(id, now) {
                    if bytes > 0 {
                        self.policy_for(gpu); // so `gpushare status` shows the GPU
                    }
                    self.memory.sync(id, &group, gpu, bytes);
                    self.restate_physical(id, &group, gpu, bytes, now);
                    self.follow_ghosts(now);
                }
            }
            ClientMsg::Status => {
                let report = Box::new(self.fresh_report(now));
                self.send(id, ServerMsg::Status { report });
            }
            ClientMsg::Probe { gpu } => self.send(id, ServerMsg::Alive { gpu }),
        }
    }

    /// A fatal error for client `id`: the connection is closed after it, and what the client
    /// held is released.
    pub(super) fn fatal(&mut self, id: ClientId, message: String, now: u64) {
        let error = ServerMsg::Error {
            message,
            fatal: true,
        };
        self.send(id, error);
        self.drop_conn(id, now);
    }

    /// A non-fatal error for client `id` (its request was ignored).
    fn refuse(&mut self, id: ClientId, message: String) {
        let error = ServerMsg::Error {
            message,
            fatal: false,
        };
        self.send(id, error);
    }

    fn acquire(&mut self, id: ClientId, gpu: GpuUuid, now: u64) {
        let Some(group) = self.group_of(id, now) else {
            return;
        };
        let policy = self.policy_for(gpu);
        if policy.client_group(id).is_none()
            && let Err(e) = policy.connect(id, &group)
        {
            return self.fatal(id, e.to_string(), now);
        }
        if let Err(e) = policy.acquire(id, now) {
            self.refuse(id, e.to_string());
        }
        self.group_pending(&group, true, now);
    }

    /// Reserve `bytes` on `gpu` for client `id`: the answer waits for the books that hold
    /// the reservation to be on disk.
    fn reserve(&mut self, id: ClientId, req: u64, gpu: GpuUuid, bytes: u64, now: u64) {
        let Some(group) = self.group_of(id, now) else {
            return;
        };
        self.policy_for(gpu); // so `gpushare status` shows the GPU
        let u = self.memory.reserve(id, &group, gpu, bytes);
        let answer = ServerMsg::Memory {
            req,
            granted: u.granted,
            cap: u.cap,
            used: u.used,
            journaled: true,
        };
        if u.granted && bytes > 0 {
            // Within the cap; under overcommit, the memory must be on the GPU too.
            if let Some(answer) = self.reserve_physical(id, &group, gpu, bytes, answer, now) {
                self.books.after_persist(id, answer);
            }
        } else {
            if !u.granted
                && let Some(message) = self.clamped_refusal(&group, &gpu, bytes)
            {
                tracing::debug!(client = id, group = %group, "{message}");
                self.refuse(id, message);
            }
            self.send(id, answer);
        }
    }

    /// The client's group, or (sent to it, and its connection closed) the fatal error that
    /// tells the user how to get one. A `--dev` default group (`uid-N`) is created on first
    /// use with request 0, limit 1, weight 1.
    fn group_of(&mut self, id: ClientId, now: u64) -> Option<String> {
        let client = self.clients.get(id)?;
        let Some(group) = client.group.clone() else {
            let p = &client.peer;
            let message = format!(
                "no group of the scheduler's config matches uid {} gid {} cgroup {:?}: add a [[group]] for it, or run gpushare-scheduler --dev and `gpushare run --group NAME`",
                p.uid, p.gid, p.cgroup
            );
            self.fatal(id, message, now);
            return None;
        };
        if !self.groups.contains_key(&group) {
            self.set_group(&group, GroupParams::default());
        }
        Some(group)
    }

    /// The policy of `gpu`, created with every known group on first use.
    fn policy_for(&mut self, gpu: GpuUuid) -> &mut Policy {
        let cfg = self.config.policy.clone();
        let (groups, pods, late) = (&self.groups, &self.pods, self.recent_late.1);
        let (suspended, now) = (&self.overcommit.suspended, self.now);
        self.policies.entry(gpu).or_insert_with(|| {
            let mut p = Policy::new(cfg);
            p.set_lateness(late);
            for (name, params) in groups.iter().filter(|(n, _)| pods.on_gpu(n, &gpu)) {
                let _ = p.set_group(name, *params);
                if suspended.contains(name) {
                    p.suspend(name, now);
                }
            }
            p
        })
    }

    /// Create or change group `name` on every GPU it may use.
    pub(super) fn set_group(&mut self, name: &str, params: GroupParams) {
        self.groups.insert(name.to_string(), params);
        for (gpu, p) in self.policies.iter_mut() {
            if self.pods.on_gpu(name, gpu) {
                let _ = p.set_group(name, params);
            }
        }
    }

    pub(super) fn remove_group(&mut self, name: &str, now: u64) {
        self.groups.remove(name);
        for p in self.policies.values_mut() {
            p.remove_group(name, now);
        }
    }

    /// Turn every pending policy decision into a message to its client.
    pub(super) fn collect_decisions(&mut self, now: u64) {
        let mut out = Vec::new();
        for (gpu, p) in self.policies.iter_mut() {
            for d in p.take_decisions() {
                tracing::debug!(at = now, gpu = %uuid_string(gpu), ?d, "decision");
                out.push(message_of(*gpu, d));
            }
        }
        for (client, msg) in out {
            if self.clients.get(client).is_some() {
                self.send(client, msg);
            }
        }
    }
}

/// A policy decision as the message to its client.
fn message_of(gpu: GpuUuid, d: Decision) -> (ClientId, ServerMsg) {
    match d {
        Decision::Grant {
            client,
            token,
            start_ns,
            deadline_ns,
            quota_ns: _,
            queue_budget_ns,
            open_at_start,
            just_in_time,
        } => (
            client,
            ServerMsg::Grant {
                gpu,
                token,
                start_ns,
                deadline_ns,
                queue_budget_ns,
                open_at_start,
                just_in_time,
            },
        ),
        Decision::Revoke { client, token } => {
            tracing::info!(client, token, "revoking a turn (no report, or withdrawn)");
            (client, ServerMsg::Revoke { gpu, token })
        }
        Decision::Shorten {
            client,
            token,
            deadline_ns,
        }
        | Decision::Extend {
            client,
            token,
            deadline_ns,
        } => (
            client,
            ServerMsg::Deadline {
                gpu,
                token,
                deadline_ns,
            },
        ),
    }
}
