//! The daemon around the per-GPU [`Policy`] instances: its state, what each client message
//! does, and the status report. One event loop ([`crate::server`]) serves the tenant socket and
//! the policies' timers; metrics, the admin socket and config reloads have a thread each. All
//! decisions come from the policy; this module only routes messages.

use crate::config::{Config, GroupConfig};
use crate::identity::Peer;
use crate::journal::Journal;
use crate::memory::MemoryBooks;
use crate::pods::{GroupChange, PodTable};
use crate::policy::{ClientId, Decision, GroupParams, Policy, TurnUse};
use crate::server::{ConnId, Server};
use crate::status::{ClientReport, GpuReport, GroupReport, PodLabels, Report, uuid_string};
use gpushare_protocol::admin::AdminRequest;
use gpushare_protocol::{ClientMsg, GpuUuid, GroupSpec, PROTOCOL_VERSION, ServerMsg};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

pub use gpushare_units::monotonic_ns as now_ns;

pub struct DaemonOptions {
    pub socket: PathBuf,
    pub config_path: Option<PathBuf>,
    /// Clients may declare their own group and shares.
    pub dev: bool,
    /// Serve Prometheus metrics over HTTP at this address (`GET /metrics`).
    pub metrics: Option<std::net::SocketAddr>,
    /// Serve the admin protocol (Kubernetes node agent) on this socket.
    pub admin_socket: Option<PathBuf>,
    /// The memory books' journal ([`crate::journal`]).
    pub books: PathBuf,
}

struct Client {
    conn: ConnId,
    pid: u32,
    /// `None` until the client is matched to a group (status-only clients never are).
    group: Option<String>,
    peer: Peer,
}

/// The connected clients, and how many of them each group has: a disconnect asks whether its
/// group has processes left, and under a flood of connections that say Hello and go, counting
/// them anew each time took half of the event loop's time.
#[derive(Default)]
struct Clients {
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

    fn remove(&mut self, id: &ClientId) -> Option<Client> {
        let gone = self.by_id.remove(id)?;
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
    fn has_group(&self, name: &str) -> bool {
        self.per_group.contains_key(name)
    }

    fn get(&self, id: &ClientId) -> Option<&Client> {
        self.by_id.get(id)
    }

    fn values(&self) -> impl Iterator<Item = &Client> {
        self.by_id.values()
    }
}

pub(crate) struct State {
    pub(crate) config: Config,
    dev: bool,
    /// Every group the policies know: from the config, and declared ones in dev mode.
    groups: BTreeMap<String, GroupParams>,
    policies: BTreeMap<GpuUuid, Policy>,
    memory: MemoryBooks,
    journal: Journal,
    clients: Clients,
    next_client: ClientId,
    /// Kubernetes containers registered over the admin socket.
    pub(crate) pods: PodTable,
    /// GPU processes of the node with no connection here, at the last census.
    unhooked: Vec<crate::census::Unhooked>,
    /// The last status report sent, and when it was built: requests within
    /// [`STATUS_REUSE_NS`] of it get it again.
    status: Option<(u64, String)>,
}

/// How long a status report is sent again rather than rebuilt: it is built under the state's
/// lock, which the event loop needs for every message, so a client asking in a tight loop (or
/// thousands of them) costs at most one report per this long.
const STATUS_REUSE_NS: u64 = 5_000_000;

pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    /// Wakes the event loop, which delivers what the policies decided and admits the clients
    /// that wait for their pod.
    waker: mio::Waker,
}

impl Shared {
    /// Another thread changed the state: let the event loop act on it.
    pub(crate) fn changed(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::error!("cannot wake the event loop: {e}");
        }
    }
}

type Outbox = Vec<(ClientId, ServerMsg)>;

/// Messages for the event loop to send, by connection.
pub(crate) type Delivery = Vec<(ConnId, ServerMsg)>;

pub(crate) fn lock(s: &Shared) -> MutexGuard<'_, State> {
    s.state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Run the daemon until the process is killed.
pub fn run(opts: DaemonOptions) -> anyhow::Result<()> {
    // Read before the file is loaded: a change made once the socket is up, however soon, is
    // then seen by the reload thread, whenever it starts.
    let config_mtime = opts.config_path.as_deref().and_then(mtime);
    let config = match &opts.config_path {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    // Tenants run as other users: anyone may connect; identity comes from SO_PEERCRED.
    let listener = gpushare_frame::listen_at(&opts.socket, 0o666)
        .map_err(|e| anyhow::anyhow!("{e}; pick another --socket"))?;
    let mut groups = BTreeMap::new();
    let mut memory = MemoryBooks::default();
    for g in &config.groups {
        groups.insert(g.name.clone(), g.params);
        memory.set_cap(&g.name, g.memory);
    }
    let mut journal = Journal::new(opts.books.clone());
    let ghosts = journal.load();
    if !ghosts.is_empty() {
        tracing::info!(holdings = ghosts.len(), path = %journal.path().display(), "memory books restored; they count until their processes reconnect or exit");
    }
    memory.adopt(ghosts);
    journal.save(&mut memory);
    let (server, waker) = Server::new(listener)?;
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            config,
            dev: opts.dev,
            groups,
            policies: BTreeMap::new(),
            memory,
            journal,
            clients: Clients::default(),
            next_client: 1,
            pods: PodTable::default(),
            unhooked: Vec::new(),
            status: None,
        }),
        waker,
    });
    tracing::info!(socket = %opts.socket.display(), dev = opts.dev, "gpushare-scheduler listening");
    if let Some(addr) = opts.metrics {
        let http = std::net::TcpListener::bind(addr).map_err(|e| {
            anyhow::anyhow!("cannot serve metrics on {addr}: {e}; pick another --metrics address")
        })?;
        let s = shared.clone();
        let page = move || crate::status::prometheus(&report(&lock(&s), now_ns()));
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || {
                if let Err(e) = crate::metrics::serve(http, page) {
                    tracing::error!("the metrics endpoint stopped: {e}");
                }
            })?;
    }
    if let Some(path) = &opts.admin_socket {
        let admin = crate::admin::bind(path)?;
        let s = shared.clone();
        std::thread::Builder::new()
            .name("admin".into())
            .spawn(move || crate::admin::listen(s, admin))?;
    }
    let s = shared.clone();
    std::thread::Builder::new()
        .name("books".into())
        .spawn(move || books_loop(s))?;
    let s = shared.clone();
    std::thread::Builder::new()
        .name("census".into())
        .spawn(move || census_loop(s))?;
    if let Some(path) = opts.config_path.clone() {
        let s = shared.clone();
        std::thread::Builder::new()
            .name("config".into())
            .spawn(move || reload_loop(s, path, config_mtime))?;
    }
    server.run(&shared)?;
    Ok(())
}

/// What became of a connection's first message.
pub(crate) enum Greeting {
    /// A client now; send it this `Welcome`.
    Admitted(ClientId, ServerMsg),
    /// Refused with this message for the user (then closed).
    Refused(String),
    /// A process of a Kubernetes container the agent has not registered yet: greet it again
    /// when the state changes, and for the last time once it has waited
    /// [`POD_WAIT`](crate::admin::POD_WAIT).
    AwaitPod,
}

/// A new connection's first message, from the process `peer`, on `conn`; `waited` says it has
/// waited [`POD_WAIT`](crate::admin::POD_WAIT) for its pod already.
pub(crate) fn greet(
    st: &mut State,
    peer: &Peer,
    conn: ConnId,
    first: &ClientMsg,
    waited: bool,
) -> Greeting {
    let ClientMsg::Hello { version, declared } = first else {
        return Greeting::Refused("the first message must be Hello".into());
    };
    match crate::admin::pod_admission(st, peer, waited) {
        Ok(true) => {}
        Ok(false) => return Greeting::AwaitPod,
        Err(message) => return Greeting::Refused(message),
    }
    match hello(st, peer, *version, declared.clone(), conn) {
        Ok((id, group)) => Greeting::Admitted(id, ServerMsg::Welcome { group }),
        Err(message) => Greeting::Refused(message),
    }
}

/// A client's message: its replies, and whatever the policies decided meanwhile.
pub(crate) fn on_message(st: &mut State, id: ClientId, msg: ClientMsg, now: u64) -> Delivery {
    let mut out = handle(st, id, msg, now);
    collect(st, &mut out);
    deliver(st, out)
}

/// A client's connection closed: everything it held is released at once.
pub(crate) fn on_disconnect(st: &mut State, id: ClientId, now: u64) -> Delivery {
    let gone = st.clients.remove(&id);
    st.memory.forget_client(id);
    for p in st.policies.values_mut() {
        p.disconnect(id, now);
    }
    if let Some(group) = gone.and_then(|c| c.group) {
        crate::admin::client_left(st, &group, now);
    }
    let mut out = Outbox::new();
    collect(st, &mut out);
    deliver(st, out)
}

/// The passage of time: what the policies decided by `now` (revocations, turns ending and
/// starting, cap refills), and when they next need to be told the time.
pub(crate) fn on_tick(st: &mut State, now: u64) -> (Delivery, Option<u64>) {
    for p in st.policies.values_mut() {
        p.tick(now);
    }
    let mut out = Outbox::new();
    collect(st, &mut out);
    let wake = st
        .policies
        .values()
        .filter_map(|p| p.next_wakeup(now))
        .min();
    (deliver(st, out), wake)
}

/// Register a client and find its group. Errors are messages for the user.
fn hello(
    st: &mut State,
    peer: &Peer,
    version: u32,
    declared: Option<GroupSpec>,
    conn: ConnId,
) -> Result<(ClientId, String), String> {
    if version != PROTOCOL_VERSION {
        return Err(format!(
            "client speaks protocol {version}, scheduler {PROTOCOL_VERSION}: install libgpushare.so and gpushare-scheduler from the same release"
        ));
    }
    let pod_group = crate::admin::pod_group(st, peer);
    let group = match declared {
        // A process in a registered Kubernetes container: identity from the kernel only.
        _ if pod_group.is_some() => pod_group,
        Some(spec) if st.dev => {
            let params = GroupParams {
                request: spec.request,
                limit: spec.limit,
                weight: spec.weight,
            };
            Policy::new(st.config.policy.clone())
                .set_group(&spec.name, params)
                .map_err(|e| e.to_string())?;
            set_group(st, &spec.name, params);
            // A declaration without --memory leaves an earlier declared cap in place.
            if spec.memory.is_some() {
                st.memory.set_cap(&spec.name, spec.memory);
            }
            Some(spec.name)
        }
        Some(spec) => match st.config.group_for(peer) {
            Some(g) => Some(g.name.clone()),
            None => {
                return Err(format!(
                    "group {:?} was declared, but the scheduler is not in --dev mode and no [[group]] of its config matches uid {} / cgroup {:?}",
                    spec.name, peer.uid, peer.cgroup
                ));
            }
        },
        None => match st.config.group_for(peer) {
            Some(g) => Some(g.name.clone()),
            // In --dev, an undeclared process gets its own uid's group (created when it first
            // uses a GPU, so status-only clients like `gpushare status` leave no trace).
            None if st.dev => Some(format!("uid-{}", peer.uid)),
            None => None,
        },
    };
    let id = st.next_client;
    st.next_client += 1;
    st.memory.attach(id, peer.process());
    st.clients.insert(
        id,
        Client {
            conn,
            pid: peer.pid,
            group: group.clone(),
            peer: peer.clone(),
        },
    );
    Ok((id, group.unwrap_or_default()))
}

fn set_group(st: &mut State, name: &str, params: GroupParams) {
    st.groups.insert(name.to_string(), params);
    for (gpu, p) in st.policies.iter_mut() {
        if st.pods.on_gpu(name, gpu) {
            let _ = p.set_group(name, params);
        }
    }
}

fn remove_group(st: &mut State, name: &str, now: u64) {
    st.groups.remove(name);
    for p in st.policies.values_mut() {
        p.remove_group(name, now);
    }
}

/// Admin hook: apply the pod table's changes to the policies and memory books.
pub(crate) fn apply_group_changes(st: &mut State, changes: Vec<GroupChange>, now: u64) {
    for c in changes {
        match c {
            GroupChange::Set {
                name,
                params,
                memory,
            } => {
                set_group(st, &name, params);
                st.memory.set_cap(&name, memory);
            }
            GroupChange::Remove { name } => {
                remove_group(st, &name, now);
                st.memory.set_cap(&name, None);
            }
        }
    }
}

/// Whether group `name` has at least one connected process.
pub(crate) fn has_processes(st: &State, name: &str) -> bool {
    st.clients.has_group(name)
}

/// Admin hook: the pod table's changes for one admin request (a group still in use by a
/// process outlives its pod's removal until that process leaves).
pub(crate) fn pod_changes(st: &mut State, req: AdminRequest) -> Result<Vec<GroupChange>, String> {
    let clients = &st.clients;
    st.pods.apply(req, |name| clients.has_group(name))
}

/// Admin hook: change the state with `f` (given the time), then wake the event loop, which
/// delivers what the policies decided as a result.
pub(crate) fn with_state<R>(shared: &Shared, f: impl FnOnce(&mut State, u64) -> R) -> R {
    let r = f(&mut lock(shared), now_ns());
    shared.changed();
    r
}

fn handle(st: &mut State, id: ClientId, msg: ClientMsg, now: u64) -> Outbox {
    let mut out = Outbox::new();
    match msg {
        ClientMsg::Hello { .. } => {
            out.push((
                id,
                ServerMsg::Error {
                    message: "Hello sent twice".into(),
                    fatal: false,
                },
            ));
        }
        ClientMsg::Acquire { gpu } => {
            let Some(group) = group_of(st, id, &mut out) else {
                return out;
            };
            let policy = policy_for(st, gpu);
            if policy.client_group(id).is_none()
                && let Err(e) = policy.connect(id, &group)
            {
                out.push((
                    id,
                    ServerMsg::Error {
                        message: e.to_string(),
                        fatal: true,
                    },
                ));
                return out;
            }
            if let Err(e) = policy.acquire(id, now) {
                out.push((
                    id,
                    ServerMsg::Error {
                        message: e.to_string(),
                        fatal: false,
                    },
                ));
            }
        }
        ClientMsg::Yield {
            gpu,
            token,
            drained_ns,
        } => {
            if let Some(p) = st.policies.get_mut(&gpu)
                && let Err(e) = p.yield_turn(id, token, drained_ns, now)
            {
                out.push((
                    id,
                    ServerMsg::Error {
                        message: e.to_string(),
                        fatal: false,
                    },
                ));
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
            if let Some(p) = st.policies.get_mut(&gpu)
                && let Err(e) = p.report(id, token, used, again, now)
            {
                out.push((
                    id,
                    ServerMsg::Error {
                        message: e.to_string(),
                        fatal: false,
                    },
                ));
            }
        }
        ClientMsg::MemReserve { req, gpu, bytes } => match group_of(st, id, &mut out) {
            Some(group) => {
                policy_for(st, gpu); // so `gpushare status` shows the GPU
                let u = st.memory.reserve(id, &group, gpu, bytes);
                // On disk before the process is told it may allocate.
                st.journal.save(&mut st.memory);
                out.push((
                    id,
                    ServerMsg::Memory {
                        req,
                        granted: u.granted,
                        cap: u.cap,
                        used: u.used,
                    },
                ));
            }
            None => out.push((
                id,
                ServerMsg::Memory {
                    req,
                    granted: false,
                    cap: Some(0),
                    used: 0,
                },
            )),
        },
        ClientMsg::MemQuery { req, gpu } => {
            if let Some(group) = group_of(st, id, &mut out) {
                let u = st.memory.query(&group, &gpu);
                out.push((
                    id,
                    ServerMsg::Memory {
                        req,
                        granted: true,
                        cap: u.cap,
                        used: u.used,
                    },
                ));
            }
        }
        ClientMsg::MemFree { gpu, bytes } => st.memory.free(id, gpu, bytes),
        ClientMsg::MemSync { gpu, bytes } => {
            if let Some(group) = group_of(st, id, &mut out) {
                st.memory.sync(id, &group, gpu, bytes);
            }
        }
        ClientMsg::Status => {
            let json = match &st.status {
                Some((at, json)) if now.saturating_sub(*at) < STATUS_REUSE_NS => json.clone(),
                _ => {
                    let json = serde_json::to_string(&report(st, now)).unwrap_or_default();
                    st.status = Some((now, json.clone()));
                    json
                }
            };
            out.push((id, ServerMsg::Status { json }));
        }
    }
    out
}

/// The client's group, or (queued in `out`) the error that tells the user how to get one.
/// A `--dev` default group (`uid-N`) is created on first use with request 0, limit 1, weight 1.
fn group_of(st: &mut State, id: ClientId, out: &mut Outbox) -> Option<String> {
    let group = group_or_error(st, id, out)?;
    if !st.groups.contains_key(&group) {
        set_group(
            st,
            &group,
            GroupParams {
                request: 0.0,
                limit: 1.0,
                weight: 1.0,
            },
        );
    }
    Some(group)
}

fn group_or_error(st: &State, id: ClientId, out: &mut Outbox) -> Option<String> {
    let client = st.clients.get(&id)?;
    if client.group.is_none() {
        let p = &client.peer;
        out.push((id, ServerMsg::Error {
            message: format!(
                "no group of the scheduler's config matches uid {} gid {} cgroup {:?}: add a [[group]] for it, or run gpushare-scheduler --dev and `gpushare run --group NAME`",
                p.uid, p.gid, p.cgroup
            ),
            fatal: true,
        }));
    }
    client.group.clone()
}

/// The policy of `gpu`, created with every known group on first use.
fn policy_for(st: &mut State, gpu: GpuUuid) -> &mut Policy {
    let cfg = st.config.policy.clone();
    let (groups, pods) = (&st.groups, &st.pods);
    st.policies.entry(gpu).or_insert_with(|| {
        let mut p = Policy::new(cfg);
        for (name, params) in groups.iter().filter(|(n, _)| pods.on_gpu(n, &gpu)) {
            let _ = p.set_group(name, *params);
        }
        p
    })
}

/// Turn every pending policy decision into a message.
fn collect(st: &mut State, out: &mut Outbox) {
    for (gpu, p) in st.policies.iter_mut() {
        for d in p.take_decisions() {
            tracing::debug!(at = now_ns(), gpu = %uuid_string(gpu), ?d, "decision");
            match d {
                Decision::Grant {
                    client,
                    token,
                    start_ns,
                    deadline_ns,
                    quota_ns,
                    queue_budget_ns,
                } => out.push((
                    client,
                    ServerMsg::Grant {
                        gpu: *gpu,
                        token,
                        start_ns,
                        deadline_ns,
                        quota_ns,
                        queue_budget_ns,
                    },
                )),
                Decision::Revoke { client, token } => {
                    tracing::info!(client, token, "revoking a turn (no report, or withdrawn)");
                    out.push((client, ServerMsg::Revoke { gpu: *gpu, token }))
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
                } => out.push((
                    client,
                    ServerMsg::Deadline {
                        gpu: *gpu,
                        token,
                        deadline_ns,
                    },
                )),
            }
        }
    }
}

fn deliver(st: &State, out: Outbox) -> Delivery {
    out.into_iter()
        .filter_map(|(id, m)| st.clients.get(&id).map(|c| (c.conn, m)))
        .collect()
}

/// `namespace`, `pod`, `container` of a Kubernetes container's group.
fn pod_labels(st: &State, group: &str) -> Option<PodLabels> {
    let (namespace, pod, container) = st.pods.labels(group)?;
    Some(PodLabels {
        namespace: namespace.into(),
        pod: pod.into(),
        container: container.into(),
    })
}

pub(crate) fn report(st: &State, now: u64) -> Report {
    let client = |id: &ClientId| {
        st.clients.get(id).map(|c| ClientReport {
            pid: c.pid,
            group: c.group.clone().unwrap_or_default(),
        })
    };
    let gpus = st
        .policies
        .iter()
        .map(|(uuid, p)| {
            let s = p.status(now);
            GpuReport {
                uuid: uuid_string(uuid),
                holder: s.holder.as_ref().and_then(client),
                waiting: s.waiting.iter().filter_map(client).collect(),
                groups: s
                    .groups
                    .iter()
                    .map(|g| GroupReport {
                        name: g.name.clone(),
                        request: g.params.request,
                        limit: g.params.limit,
                        weight: g.params.weight,
                        effective_request: g.effective_request,
                        target_share: g.target_share,
                        // Clamp float noise (and a negative zero) from the usage window.
                        achieved_share: if g.achieved_share > 0.0 {
                            g.achieved_share
                        } else {
                            0.0
                        },
                        busy_seconds: g.busy_ns as f64 / 1e9,
                        tokens: g.tokens,
                        waits: g.waits,
                        overruns: g.overruns,
                        revocations: g.revocations,
                        preempted: g.preempted,
                        pids: g
                            .clients
                            .iter()
                            .filter_map(|c| st.clients.get(c).map(|c| c.pid))
                            .collect(),
                        active: g.active,
                        memory_used: st.memory.used(&g.name, uuid),
                        memory_cap: st.memory.cap(&g.name),
                        memory_reservations: st.memory.reservations(&g.name, uuid),
                        pod: pod_labels(st, &g.name),
                    })
                    .collect(),
            }
        })
        .collect();
    Report {
        dev_mode: st.dev,
        gpus,
        pods: st.pods.report(),
        unhooked: st.unhooked.clone(),
    }
}

/// Keep the journal up to date with frees and departures, lay to rest the restored holdings
/// of processes that exited without reconnecting, and (every second) free the memory of
/// connected clients whose process has exited while a forked child keeps its socket open.
fn books_loop(shared: Arc<Shared>) {
    let restored = Instant::now();
    for round in 0u64.. {
        std::thread::sleep(crate::journal::FLUSH_EVERY);
        if round % 10 == 0 {
            // `/proc` is read without the state's lock (the event loop needs it for every
            // message), once per process, and only for the clients holding memory: thousands
            // of idle connections must not stall the turns.
            let holders = lock(&shared).memory.holders();
            let mut exited: HashMap<crate::memory::ProcessId, bool> = HashMap::new();
            let gone: Vec<u64> = holders
                .into_iter()
                .filter(|(_, p)| {
                    *exited
                        .entry(*p)
                        .or_insert_with(|| crate::journal::alive(p) == Some(false))
                })
                .map(|(c, _)| c)
                .collect();
            let mut st = lock(&shared);
            for client in gone {
                st.memory.forget_client(client);
            }
        }
        let mut st = lock(&shared);
        let st = &mut *st;
        if st.memory.has_ghosts() {
            let grace_over = restored.elapsed() > crate::journal::UNVERIFIABLE_GHOST_GRACE;
            st.memory.retain_ghosts(|p| match crate::journal::alive(p) {
                Some(alive) => alive,
                None => !grace_over,
            });
        }
        st.journal.save(&mut st.memory);
    }
}

/// Take the census of GPU processes without a connection here (`/proc` is read without the
/// state's lock).
fn census_loop(shared: Arc<Shared>) {
    let own = std::process::id();
    loop {
        let connected: HashSet<u32> = lock(&shared).clients.values().map(|c| c.pid).collect();
        let found = crate::census::take(std::path::Path::new("/proc"), &connected, own);
        // A process that connected while /proc was read is not listed.
        let mut st = lock(&shared);
        let now: HashSet<u32> = st.clients.values().map(|c| c.pid).collect();
        st.unhooked = found
            .into_iter()
            .filter(|u| !now.contains(&u.pid))
            .collect();
        drop(st);
        std::thread::sleep(crate::census::EVERY);
    }
}

fn mtime(path: &std::path::Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Re-read the config when its file changes (from the version `loaded` at start); a broken
/// file keeps the previous config.
fn reload_loop(shared: Arc<Shared>, path: PathBuf, loaded: Option<SystemTime>) {
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
                apply(&mut lock(&shared), cfg, now_ns());
                tracing::info!(path = %path.display(), "configuration reloaded");
                shared.changed();
            }
            Err(e) => tracing::error!("keeping the previous configuration: {e}"),
        }
    }
}

fn apply(st: &mut State, cfg: Config, now: u64) {
    let removed: Vec<GroupConfig> = st
        .config
        .groups
        .iter()
        .filter(|old| !cfg.groups.iter().any(|g| g.name == old.name))
        .cloned()
        .collect();
    for g in removed {
        remove_group(st, &g.name, now);
    }
    for p in st.policies.values_mut() {
        p.set_config(cfg.policy.clone());
        p.tick(now);
    }
    for g in &cfg.groups {
        set_group(st, &g.name, g.params);
        st.memory.set_cap(&g.name, g.memory);
    }
    st.config = cfg;
}

/// The daemon's receive paths fed hostile input, as peers would send it: whatever a socket
/// decodes goes through the handlers, and a config file that parses is applied as on reload.
#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_frame::fuzz;
    use gpushare_protocol::admin::{ContainerKey, PodGroup};

    const GPU: GpuUuid = *b"gpushare-sim-gpu";
    const GPU_TEXT: &str = "GPU-67707573-6861-7265-2d73-696d2d677075";

    fn state(dev: bool) -> State {
        let config = Config::parse(
            "[[group]]\nname = \"train\"\nuids = [1000]\nrequest = 0.3\nmemory = \"1GiB\"",
        )
        .unwrap();
        let mut st = State {
            config: Config::default(),
            dev,
            groups: BTreeMap::new(),
            policies: BTreeMap::new(),
            memory: MemoryBooks::default(),
            // Unwritable: the fuzz loop does not write a file per reservation.
            journal: Journal::new(PathBuf::from("/nonexistent/gpushare-books")),
            clients: Clients::default(),
            next_client: 1,
            pods: PodTable::default(),
            unhooked: Vec::new(),
            status: None,
        };
        apply(&mut st, config, 0);
        st
    }

    /// A client as the event loop registers it, after its Hello.
    fn connect(st: &mut State, declared: Option<GroupSpec>) -> Result<ClientId, String> {
        let peer = Peer {
            pid: 1,
            start: 0,
            uid: 1000,
            gid: 1000,
            cgroup: "/user.slice".into(),
            pod: None,
        };
        let conn = st.next_client as ConnId;
        hello(st, &peer, PROTOCOL_VERSION, declared, conn).map(|(id, _)| id)
    }

    /// A status report is rebuilt at most every 5 ms, however often it is asked for.
    #[test]
    fn status_reports_are_reused_for_a_moment() {
        let mut st = state(true);
        let id = connect(&mut st, None).unwrap();
        let status = |st: &mut State, now| match on_message(st, id, ClientMsg::Status, now)
            .pop()
            .map(|(_, m)| m)
        {
            Some(ServerMsg::Status { json }) => json,
            other => panic!("{other:?}"),
        };
        let first = status(&mut st, 1_000);
        st.dev = !st.dev;
        assert_eq!(
            status(&mut st, 1_000 + STATUS_REUSE_NS - 1),
            first,
            "reused"
        );
        assert_ne!(status(&mut st, 1_000 + STATUS_REUSE_NS), first, "rebuilt");
    }

    /// Tokens the policy hands out are small numbers: samples use them so that mutated
    /// messages reach turns that exist.
    fn client_msgs() -> Vec<ClientMsg> {
        let used = gpushare_protocol::TurnUse {
            first_ns: 1_000_000,
            last_ns: 3_000_000,
        };
        vec![
            ClientMsg::Hello {
                version: PROTOCOL_VERSION,
                declared: Some(GroupSpec {
                    name: "dev".into(),
                    request: 0.5,
                    limit: 1.0,
                    weight: 2.0,
                    memory: Some(1 << 30),
                }),
            },
            ClientMsg::Acquire { gpu: GPU },
            ClientMsg::Yield {
                gpu: GPU,
                token: 1,
                drained_ns: 2_000_000,
            },
            ClientMsg::Report {
                gpu: GPU,
                token: 2,
                used: Some(used),
                again: true,
            },
            ClientMsg::Report {
                gpu: GPU,
                token: 1,
                used: None,
                again: false,
            },
            ClientMsg::Status,
            ClientMsg::MemReserve {
                req: 1,
                gpu: GPU,
                bytes: 512 << 20,
            },
            ClientMsg::MemFree {
                gpu: GPU,
                bytes: 256 << 20,
            },
            ClientMsg::MemQuery { req: 2, gpu: GPU },
            ClientMsg::MemSync {
                gpu: GPU,
                bytes: 1 << 20,
            },
        ]
    }

    /// Hostile tenants of a `--dev` scheduler: a Hello (re)connects, anything else goes to
    /// `handle` from the latest client, with the clock moving and the timer thread's ticks.
    #[test]
    fn hostile_client_streams_are_handled_without_panicking() {
        let mut st = state(true);
        let mut id = connect(&mut st, None).unwrap();
        let (mut now, mut handled) = (1_000_000_000u64, 0usize);
        let n = 30_000;
        fuzz::frames(51, &client_msgs(), n, |msg| {
            // A fresh daemon now and then, so that random GPUs and groups do not pile up.
            if handled % 1_000 == 0 {
                st = state(true);
                id = connect(&mut st, None).unwrap();
            }
            handled += 1;
            now += 500_000;
            let mut out = match msg {
                ClientMsg::Hello { declared, .. } => {
                    if let Ok(new) = connect(&mut st, declared) {
                        id = new;
                    }
                    Outbox::new()
                }
                msg => handle(&mut st, id, msg, now),
            };
            for p in st.policies.values_mut() {
                p.tick(now);
            }
            collect(&mut st, &mut out);
        })
        .assert_exercised(n);
        assert!(handled > n / 10, "{handled} messages handled");
    }

    fn pod_group(pod_uid: &str) -> PodGroup {
        PodGroup {
            pod_uid: pod_uid.into(),
            namespace: "default".into(),
            pod: "train".into(),
            container: "main".into(),
            container_id: Some("ab".repeat(32)),
            gpus: vec![GPU_TEXT.into()],
            request: 0.3,
            limit: 0.6,
            weight: 2.0,
            memory: Some(2 << 30),
        }
    }

    /// A removed container's group stays while any of its processes is connected and goes
    /// with the last one (the daemon counts each group's processes as they come and go).
    #[test]
    fn a_removed_pods_group_goes_with_its_last_process() {
        let spec = pod_group("0b1c8e3a-6f0e");
        let mut st = state(false);
        let changes = pod_changes(
            &mut st,
            AdminRequest::Sync {
                groups: vec![spec.clone()],
            },
        );
        apply_group_changes(&mut st, changes.unwrap(), 1);
        let peer = |pid| Peer {
            pid,
            start: 0,
            uid: 1000,
            gid: 1000,
            cgroup: "/kubepods/x".into(),
            pod: Some(crate::identity::PodIdentity {
                pod_uid: spec.pod_uid.clone(),
                container_id: spec.container_id.clone().unwrap(),
            }),
        };
        let hello = ClientMsg::Hello {
            version: PROTOCOL_VERSION,
            declared: None,
        };
        let mut ids = Vec::new();
        for (pid, conn) in [(10, 100), (11, 101)] {
            match greet(&mut st, &peer(pid), conn, &hello, false) {
                Greeting::Admitted(id, _) => ids.push(id),
                _ => panic!("a process of a registered container is admitted"),
            }
        }
        let name = st
            .clients
            .get(&ids[0])
            .and_then(|c| c.group.clone())
            .unwrap();
        assert!(st.groups.contains_key(&name));
        let changes = pod_changes(&mut st, AdminRequest::Remove { key: spec.key() });
        apply_group_changes(&mut st, changes.unwrap(), 2);
        assert!(
            st.groups.contains_key(&name),
            "kept while its processes run"
        );
        on_disconnect(&mut st, ids[0], 3);
        assert!(
            st.groups.contains_key(&name),
            "kept while one process is left"
        );
        on_disconnect(&mut st, ids[1], 4);
        assert!(!st.groups.contains_key(&name), "gone with its last process");
        assert!(!has_processes(&st, &name));
    }

    /// Hostile admin requests go to the pod table and the policies as `admin::serve` applies
    /// them; a tenant of those pods keeps using the GPU meanwhile.
    #[test]
    fn hostile_admin_streams_are_applied_without_panicking() {
        // A second pod of the same name whose UID has a multi-byte character across byte 8,
        // where the group's disambiguating suffix was cut (regression: a slicing panic).
        let (a, b) = (pod_group("0b1c8e3a-6f0e"), pod_group("pod-uidé-1"));
        let samples = [
            AdminRequest::Sync {
                groups: vec![a.clone()],
            },
            AdminRequest::Upsert { group: b.clone() },
            AdminRequest::Upsert { group: a.clone() },
            AdminRequest::Remove { key: a.key() },
            AdminRequest::Remove {
                key: ContainerKey {
                    pod_uid: b.pod_uid.clone(),
                    container: "main".into(),
                },
            },
            AdminRequest::Usage,
        ];
        let mut st = state(false);
        let id = connect(&mut st, None).unwrap();
        let (mut now, mut applied) = (1_000_000_000u64, 0usize);
        let n = 100_000;
        fuzz::frames(52, &samples, n, |req| {
            now += 500_000;
            if let Ok(changes) = pod_changes(&mut st, req) {
                apply_group_changes(&mut st, changes, now);
                applied += 1;
            }
            let mut out = handle(&mut st, id, ClientMsg::Acquire { gpu: GPU }, now);
            collect(&mut st, &mut out);
        })
        .assert_exercised(n);
        assert!(applied > 0);
    }

    /// Config files as an administrator might break them: whatever parses is applied to a
    /// running daemon as on reload (anything else keeps the previous config).
    #[test]
    fn hostile_configs_are_rejected_or_applied_without_panicking() {
        let samples = [
            "[scheduler]\nquota = \"10ms\"\nmin_quota = \"1ms\"\ngrace = \"5ms\"\nwindow = \"5s\"\ngrant_ahead = \"2ms\"\n",
            "[[group]]\nname = \"train\"\nuids = [1000]\ngids = [7]\nrequest = 0.3\nlimit = 0.6\nweight = 1.5\nmemory = \"4GiB\"\n",
            "[[group]]\nname = \"pods\"\ncgroups = [\"kubepods/pod42\"]\nweight = 2\n",
        ];
        let mut st = state(false);
        let id = connect(&mut st, None).unwrap();
        let mut now = 1_000_000_000u64;
        let n = 50_000;
        fuzz::texts(53, &samples, n, |text| {
            let Ok(cfg) = Config::parse(text) else {
                return false;
            };
            now += 500_000;
            apply(&mut st, cfg, now);
            let mut out = handle(&mut st, id, ClientMsg::Acquire { gpu: GPU }, now);
            for p in st.policies.values_mut() {
                p.tick(now + 1_000_000_000);
            }
            collect(&mut st, &mut out);
            true
        })
        .assert_exercised(n);
    }
}
