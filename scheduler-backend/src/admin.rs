//! The admin socket (`gpushare-scheduler --admin-socket PATH`): a node agent
//! (`gpushare-device-manager`) registers Kubernetes containers and their shares
//! ([`gpushare_protocol::admin`]); the [`PodTable`](crate::pods::PodTable) keeps them, and a
//! tenant process is matched to its container from its cgroup ([`crate::identity`]).
//!
//! The socket is created mode 0600 in a directory of its own: only root on the host, and
//! whoever shares that directory (the agent's container), can change policy. Tenants never see
//! it.

use crate::daemon::{
    Shared, State, apply_group_changes, has_processes, lock, now_ns, pod_changes, report,
    with_state,
};
use crate::identity::Peer;
use crate::pods::Lookup;
use crate::status::Report;
use gpushare_protocol::admin::{ADMIN_PROTOCOL_VERSION, AdminReply, AdminRequest, GpuUsage};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How long a process of a pod waits for the agent to register its container before it is
/// refused.
pub const POD_WAIT: Duration = Duration::from_secs(2);

/// Admin clients served at once (a thread each; there is one agent per node): more are closed,
/// so that the daemon's threads stay few whatever connects.
const MAX_ADMIN_CLIENTS: usize = 8;

/// Bind the admin socket (replacing a stale one), mode 0600.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    gpushare_frame::listen_at(path, 0o600)
        .map_err(|e| anyhow::anyhow!("{e}; pick another --admin-socket"))
}

/// Serve admin clients, one thread each (at most [`MAX_ADMIN_CLIENTS`]), until the process
/// exits.
pub(crate) fn listen(shared: Arc<Shared>, listener: UnixListener) {
    let active = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_ADMIN_CLIENTS {
            active.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("closing an admin connection: {MAX_ADMIN_CLIENTS} are open already");
            continue;
        }
        let (s, a) = (shared.clone(), active.clone());
        let spawned = std::thread::Builder::new()
            .name("admin".into())
            .spawn(move || {
                serve(s, stream);
                a.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

fn serve(shared: Arc<Shared>, mut stream: UnixStream) {
    let mut buf = Vec::new();
    let reply = |stream: &mut UnixStream, r: &AdminReply| {
        let _ = gpushare_protocol::send(stream, r);
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    match gpushare_protocol::recv::<AdminRequest>(&mut stream, &mut buf) {
        Ok(Some(AdminRequest::Hello { version, agent })) if version == ADMIN_PROTOCOL_VERSION => {
            tracing::info!(%agent, "admin client connected");
            reply(
                &mut stream,
                &AdminReply::Welcome {
                    version: ADMIN_PROTOCOL_VERSION,
                },
            );
        }
        Ok(Some(AdminRequest::Hello { version, .. })) => {
            reply(
                &mut stream,
                &AdminReply::Error {
                    message: format!(
                        "agent speaks admin protocol {version}, scheduler {ADMIN_PROTOCOL_VERSION}: run gpushare-device-manager and gpushare-scheduler of the same release"
                    ),
                },
            );
            return;
        }
        _ => {
            reply(
                &mut stream,
                &AdminReply::Error {
                    message: "the first message must be Hello".into(),
                },
            );
            return;
        }
    }
    let _ = stream.set_read_timeout(None);
    loop {
        let req = match gpushare_protocol::recv::<AdminRequest>(&mut stream, &mut buf) {
            Ok(Some(req)) => req,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("dropping an admin client after a malformed message: {e}");
                return;
            }
        };
        if req == AdminRequest::Usage {
            let report = {
                let st = lock(&shared);
                report(&st, now_ns())
            };
            reply(
                &mut stream,
                &AdminReply::Usage {
                    gpus: usage(&report),
                },
            );
            continue;
        }
        let result = with_state(&shared, |st, now| {
            let changes = pod_changes(st, req)?;
            apply_group_changes(st, changes, now);
            Ok(())
        });
        match result {
            Ok(()) => reply(&mut stream, &AdminReply::Done),
            Err(message) => {
                tracing::warn!("admin request refused: {message}");
                reply(&mut stream, &AdminReply::Error { message });
            }
        }
    }
}

/// Per GPU: the groups' achieved shares and memory, summed.
fn usage(r: &Report) -> Vec<GpuUsage> {
    r.gpus
        .iter()
        .map(|g| GpuUsage {
            gpu: g.uuid.clone(),
            busy: g
                .groups
                .iter()
                .map(|x| x.achieved_share)
                .sum::<f64>()
                .min(1.0),
            memory_used: g.groups.iter().map(|x| x.memory_used).sum(),
        })
        .collect()
}

/// The group of a process whose container the agent registered, if any.
pub(crate) fn pod_group(st: &State, peer: &Peer) -> Option<String> {
    match st.pods.lookup(peer.pod.as_ref()?) {
        Lookup::Group(name) => Some(name),
        _ => None,
    }
}

/// Whether a process may be admitted as far as its pod goes: `Ok(true)` yes, `Ok(false)` not
/// yet (the agent has not registered its container; ask again when the state changes), `Err`
/// the message that refuses it. `waited` says it has waited [`POD_WAIT`] already. Processes
/// outside pods, processes a config group matches, and every process while no agent manages
/// this node pass at once.
pub(crate) fn pod_admission(st: &State, peer: &Peer, waited: bool) -> Result<bool, String> {
    let Some(who) = &peer.pod else {
        return Ok(true);
    };
    if !st.pods.active() || st.config.group_for(peer).is_some() {
        return Ok(true);
    }
    match st.pods.lookup(who) {
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

/// A process of group `name` disconnected (hook of the daemon's disconnect path): a removed
/// container's group goes with its last process.
pub(crate) fn client_left(st: &mut State, name: &str, now: u64) {
    let connected = has_processes(st, name);
    if let Some(change) = st.pods.client_left(name, connected) {
        apply_group_changes(st, vec![change], now);
    }
}
