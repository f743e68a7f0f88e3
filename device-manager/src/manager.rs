//! The I/O shell: GPU discovery and health, the plugin's registration with the kubelet, the
//! pod watch, PodResources, and the reconcile loop that pushes [`reconcile::desired`] to the
//! scheduler. Each runs as its own task; they meet in [`Shared`].

use crate::admin_client::AdminLink;
use crate::allocation::{Injection, Load, Placement, Preload};
use crate::inventory::{Gpu, device_id};
use crate::metrics::Metrics;
use crate::podwatch::PodStore;
use crate::proto::deviceplugin::{Device, HEALTHY, UNHEALTHY};
use crate::reconcile::{self, Assignment, PodProblem};
use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// The manager's settings (the command line).
#[derive(Debug, Clone)]
pub struct Options {
    pub node_name: String,
    pub device_plugin_dir: PathBuf,
    pub pod_resources_socket: PathBuf,
    /// The scheduler's admin socket.
    pub scheduler_socket: PathBuf,
    /// The scheduler's tenant socket, as containers see it (its directory is mounted).
    pub tenant_socket: PathBuf,
    pub kubeconfig: Option<PathBuf>,
    pub units_per_gpu: u32,
    pub placement: Placement,
    pub hook_library: PathBuf,
    pub hook_dir: PathBuf,
    pub preload: Preload,
    pub cdi_kind: Option<String>,
    pub metrics: Option<SocketAddr>,
    pub health_interval: Duration,
    pub pod_resources_interval: Duration,
}

/// What the tasks share.
pub struct Shared {
    pub opts: Options,
    pub injection: Injection,
    /// The device list the plugin advertises (`ListAndWatch`).
    pub devices: watch::Sender<Vec<Device>>,
    /// Every GPU ever seen, and whether the last look found it.
    gpus: Mutex<Vec<(Gpu, bool)>>,
    admin: Arc<Mutex<AdminLink>>,
    /// Something changed that the reconcile loop should look at.
    poke: Notify,
    metrics: Arc<Mutex<Metrics>>,
    /// The node's pods (the pod watch's store).
    pods: Arc<Mutex<PodStore>>,
    /// The last assignments read from PodResources.
    assigned: Mutex<Vec<Assignment>>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// The kubelet allocated units: their assignment shows in PodResources right after this
    /// call returns, so look again shortly (and a little later, for a slow kubelet).
    pub fn allocated(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            for ms in [50, 250, 1000] {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                me.poke.notify_one();
            }
        });
    }

    /// The GPU(s) the scheduler extender recorded for the container a preferred allocation of
    /// `size` units is for (see [`crate::allocation::recorded_choice`]). PodResources is read
    /// afresh, as the previous pod's units were assigned just before this request.
    pub async fn recorded_choice(&self, size: usize) -> Option<Vec<String>> {
        let fresh = tokio::time::timeout(
            Duration::from_secs(1),
            crate::podresources::list(&self.opts.pod_resources_socket),
        )
        .await;
        let assigned = match fresh {
            Ok(Ok(a)) => a,
            _ => locked(&self.assigned).clone(),
        };
        let pods: Vec<_> = locked(&self.pods).pods.values().cloned().collect();
        crate::allocation::recorded_choice(&pods, &assigned, size)
    }

    pub fn registered(&self, took: Duration) {
        tracing::info!(took_ms = took.as_millis() as u64, "registration done");
        locked(&self.metrics).registrations += 1;
    }

    /// What the scheduler measures per GPU; empty if it cannot be asked now.
    pub async fn measured_load(&self) -> BTreeMap<String, Load> {
        let admin = self.admin.clone();
        let usage = tokio::task::spawn_blocking(move || locked(&admin).usage()).await;
        match usage {
            Ok(Ok(u)) => {
                let gpus: Vec<Gpu> = locked(&self.gpus).iter().map(|(g, _)| g.clone()).collect();
                crate::plugin::loads(&u, &gpus)
            }
            Ok(Err(e)) => {
                tracing::debug!("placement without measurements: {e}");
                BTreeMap::new()
            }
            Err(_) => BTreeMap::new(),
        }
    }

    /// Take in a discovery result: GPUs found are healthy, known ones missing unhealthy (all of
    /// them when discovery failed). Publishes the device list if it changed.
    fn set_found(&self, found: Result<Vec<Gpu>, String>) {
        let mut gpus = locked(&self.gpus);
        match found {
            Ok(list) => {
                for (g, healthy) in gpus.iter_mut() {
                    *healthy = list.iter().any(|x| x.uuid == g.uuid);
                }
                for g in list {
                    if !gpus.iter().any(|(x, _)| x.uuid == g.uuid) {
                        tracing::info!(uuid = %g.uuid, name = %g.name, memory = g.memory, "GPU found");
                        gpus.push((g, true));
                    }
                }
            }
            Err(e) => {
                tracing::warn!("{e}: every GPU is unhealthy until discovery works again");
                for (_, healthy) in gpus.iter_mut() {
                    *healthy = false;
                }
            }
        }
        let per_gpu = self.opts.units_per_gpu;
        let devices: Vec<Device> = gpus
            .iter()
            .flat_map(|(g, healthy)| {
                (0..per_gpu).map(move |n| Device {
                    id: device_id(&g.uuid, n),
                    health: if *healthy { HEALTHY } else { UNHEALTHY }.to_string(),
                    topology: None,
                })
            })
            .collect();
        {
            let mut m = locked(&self.metrics);
            m.memory = gpus
                .iter()
                .map(|(g, _)| (g.uuid.clone(), g.memory))
                .collect();
            m.allocatable = gpus
                .iter()
                .enumerate()
                .map(|(i, (g, healthy))| (g.uuid.clone(), (i, if *healthy { per_gpu } else { 0 })))
                .collect();
        }
        drop(gpus);
        self.devices.send_if_modified(|cur| {
            let changed = *cur != devices;
            if changed {
                *cur = devices;
            }
            changed
        });
    }
}

/// Run the manager until the process is killed.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    let hook_dir = crate::hook_install::install(&opts.hook_library, &opts.hook_dir)
        .map_err(|e| anyhow::anyhow!(e))?;
    tracing::info!(dir = %hook_dir.display(), "hook installed");
    let injection = Injection {
        tenant_socket: opts.tenant_socket.clone(),
        hook_dir,
        preload: opts.preload,
        cdi_kind: opts.cdi_kind.clone(),
    };
    let exe = std::env::current_exe()?;
    // The first discovery must succeed: without GPUs there is nothing to serve.
    let first = loop {
        match crate::discovery::probe(&exe, Duration::from_secs(30)).await {
            Ok(g) if !g.is_empty() => break g,
            Ok(_) => tracing::warn!("no GPU found; looking again"),
            Err(e) => tracing::warn!("{e}; looking again"),
        }
        tokio::time::sleep(opts.health_interval).await;
    };
    let metrics = Arc::new(Mutex::new(Metrics::default()));
    let store = Arc::new(Mutex::new(PodStore::default()));
    let shared = Arc::new(Shared {
        admin: Arc::new(Mutex::new(AdminLink::new(opts.scheduler_socket.clone()))),
        opts,
        injection,
        devices: watch::Sender::new(Vec::new()),
        gpus: Mutex::new(Vec::new()),
        poke: Notify::new(),
        metrics: metrics.clone(),
        pods: store.clone(),
        assigned: Mutex::new(Vec::new()),
    });
    shared.set_found(Ok(first));
    if let Some(addr) = shared.opts.metrics {
        let l = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            anyhow::anyhow!("cannot serve metrics on {addr}: {e}; pick another --metrics address")
        })?;
        tokio::spawn(crate::metrics::serve(l, metrics));
    }
    tokio::spawn(health_loop(shared.clone(), exe));
    tokio::spawn(crate::kubelet::run(shared.clone()));
    let client = match crate::podwatch::client(shared.opts.kubeconfig.as_deref()).await {
        Ok(c) => {
            let changed = Arc::new(Notify::new());
            tokio::spawn(crate::podwatch::run(
                c.clone(),
                shared.opts.node_name.clone(),
                store.clone(),
                changed.clone(),
            ));
            let s = shared.clone();
            tokio::spawn(async move {
                loop {
                    changed.notified().await;
                    s.poke.notify_one();
                }
            });
            Some(c)
        }
        Err(e) => {
            tracing::error!("{e:#}; serving the device plugin without pod policies");
            None
        }
    };
    reconcile_loop(shared, store, client).await;
    Ok(())
}

async fn health_loop(shared: Arc<Shared>, exe: PathBuf) {
    loop {
        tokio::time::sleep(shared.opts.health_interval).await;
        let found = crate::discovery::probe(&exe, Duration::from_secs(30)).await;
        shared.set_found(found);
    }
}

/// On every change (and every `pod_resources_interval`): read PodResources, compute the
/// desired groups, push the difference, report new annotation problems.
async fn reconcile_loop(
    shared: Arc<Shared>,
    store: Arc<Mutex<PodStore>>,
    client: Option<kube::Client>,
) {
    let mut assignments: Option<Vec<Assignment>> = None;
    let mut counted: HashSet<PodProblem> = HashSet::new();
    let events = Arc::new(Mutex::new(Reported::default()));
    let mut pr_failing = false;
    loop {
        let _ =
            tokio::time::timeout(shared.opts.pod_resources_interval, shared.poke.notified()).await;
        match crate::podresources::list(&shared.opts.pod_resources_socket).await {
            Ok(a) => {
                if pr_failing {
                    tracing::info!("PodResources reachable again");
                    pr_failing = false;
                }
                locked(&shared.metrics).allocated = reconcile::allocated_units(&a);
                *locked(&shared.assigned) = a.clone();
                assignments = Some(a);
            }
            Err(e) => {
                if !pr_failing {
                    tracing::warn!("{e} (keeping the last known assignments)");
                    pr_failing = true;
                }
            }
        }
        let (pods, ready) = {
            let s = locked(&store);
            (s.pods.values().cloned().collect::<Vec<_>>(), s.ready)
        };
        // Push only from complete knowledge: a restarted manager must not wipe the scheduler's
        // table before it has seen the pods and the assignments.
        let Some(assignments) = assignments.as_ref().filter(|_| ready) else {
            continue;
        };
        let gpus: Vec<Gpu> = locked(&shared.gpus)
            .iter()
            .map(|(g, _)| g.clone())
            .collect();
        let want = reconcile::desired(&pods, assignments, &gpus, shared.opts.units_per_gpu);
        let admin = shared.admin.clone();
        let groups = want.groups.clone();
        match tokio::task::spawn_blocking(move || locked(&admin).push(&groups)).await {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => tracing::info!(
                requests = n,
                containers = want.groups.len(),
                "scheduler updated"
            ),
            Ok(Err(e)) => tracing::warn!("{e}"),
            Err(e) => tracing::error!("admin push panicked: {e}"),
        }
        let now: HashSet<PodProblem> = want.problems.iter().cloned().collect();
        for p in now.difference(&counted) {
            tracing::warn!(namespace = %p.namespace, pod = %p.pod, "{}={:?}: {}", p.problem.annotation, p.problem.value, p.problem.message);
            *locked(&shared.metrics)
                .annotation_errors
                .entry((
                    p.namespace.clone(),
                    p.pod.clone(),
                    p.problem.annotation.clone(),
                ))
                .or_default() += 1;
        }
        counted = now.clone();
        if let Some(c) = &client {
            report(c, &shared.opts.node_name, &now, &events);
        }
    }
}

/// Problems whose event was posted, and those being posted.
#[derive(Default)]
struct Reported {
    posted: HashSet<PodProblem>,
    in_flight: HashSet<PodProblem>,
}

/// Post an event for each problem not reported yet, each in its own task (the API server may
/// be slow or down; the reconcile loop does not wait for it). Problems that went away are
/// forgotten, so one that comes back is reported again.
fn report(
    client: &kube::Client,
    node: &str,
    now: &HashSet<PodProblem>,
    events: &Arc<Mutex<Reported>>,
) {
    let mut r = locked(events);
    r.posted.retain(|p| now.contains(p));
    for p in now {
        if r.posted.contains(p) || !r.in_flight.insert(p.clone()) {
            continue;
        }
        let (client, node, p, events) =
            (client.clone(), node.to_string(), p.clone(), events.clone());
        tokio::spawn(async move {
            let res = tokio::time::timeout(
                Duration::from_secs(10),
                crate::events::post(client, &p, &node),
            )
            .await;
            let mut r = locked(&events);
            r.in_flight.remove(&p);
            match res {
                Ok(Ok(())) => {
                    r.posted.insert(p);
                }
                Ok(Err(e)) => {
                    tracing::warn!("cannot post an event on {}/{}: {e}", p.namespace, p.pod)
                }
                Err(_) => tracing::warn!("posting an event on {}/{} timed out", p.namespace, p.pod),
            }
        });
    }
}
