//! The I/O shell: GPU discovery and health, the plugin's registration with the kubelet, the
//! pod watch, PodResources, and the reconcile loop that pushes [`reconcile::desired`] to the
//! scheduler. Each runs as its own task; they meet in [`Shared`].

use crate::admin_client::AdminLink;
use crate::agent::{AgentArgs, Gpus};
use crate::allocation::{Load, Placement};
use crate::events::Reporter;
use crate::injection::Injection;
use crate::inventory::{Gpu, device_id};
use crate::metrics::Metrics;
use crate::podwatch::Pods;
use crate::proto::deviceplugin::{Device, HEALTHY, UNHEALTHY};
use crate::reconcile::{self, Assignment, PodProblem};
use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// The device plugin's settings (the command line, besides the agents' common ones).
#[derive(clap::Args, Debug, Clone)]
pub struct Options {
    #[command(flatten)]
    pub agent: AgentArgs,
    /// The kubelet's device-plugin directory (kubelet.sock; our gpushare.sock goes there).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    pub device_plugin_dir: PathBuf,
    /// The kubelet's PodResources socket.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/var/lib/kubelet/pod-resources/kubelet.sock"
    )]
    pub pod_resources_socket: PathBuf,
    /// Which GPU a request's units come from: binpack (fullest that fits) or spread (emptiest).
    #[arg(long, value_enum, default_value = "binpack")]
    pub placement: Placement,
    /// Serve Prometheus metrics at ADDR (e.g. 0.0.0.0:9401).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
    /// How often PodResources is read besides after each allocation and pod change.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = crate::agent::duration)]
    pub pod_resources_interval: Duration,
}

/// What the tasks share.
pub struct Shared {
    pub opts: Options,
    pub injection: Injection,
    /// The device list the plugin advertises (`ListAndWatch`).
    pub devices: watch::Sender<Vec<Device>>,
    gpus: Mutex<Gpus>,
    admin: Arc<Mutex<AdminLink>>,
    /// Something changed that the reconcile loop should look at.
    poke: Notify,
    metrics: Arc<Mutex<Metrics>>,
    /// The node's pods (the pod watch's store), once connected to the API server.
    pods: std::sync::OnceLock<Pods>,
    /// The last assignments read from PodResources.
    assigned: Mutex<Vec<Assignment>>,
    /// The API server, once connected: read afresh when the pod watch has not shown the pod
    /// being admitted yet.
    client: std::sync::OnceLock<kube::Client>,
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
        let pods = self.pods.get().map(Pods::views).unwrap_or_default();
        if let Some(gpus) = crate::allocation::recorded_choice(&pods, &assigned, size) {
            return Some(gpus);
        }
        // The kubelet admits a pod as soon as its own watch shows it bound, which may be
        // before this node's watch does: ask the API server for the node's pods afresh.
        let client = self.client.get()?.clone();
        let node = self.opts.agent.node();
        let fresh =
            tokio::time::timeout(Duration::from_secs(1), crate::podwatch::list(client, node)).await;
        match fresh {
            Ok(Ok(pods)) => crate::allocation::recorded_choice(&pods, &assigned, size),
            Ok(Err(e)) => {
                tracing::warn!(
                    "cannot list this node's pods for the scheduler extender's choice: {e}"
                );
                None
            }
            Err(_) => {
                tracing::warn!(
                    "listing this node's pods for the scheduler extender's choice took over 1 s"
                );
                None
            }
        }
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
            Ok(Ok(u)) => crate::plugin::loads(&u, &locked(&self.gpus).all()),
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
        gpus.update(found);
        let per_gpu = self.opts.agent.units_per_gpu;
        let devices: Vec<Device> = gpus
            .seen
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
                .seen
                .iter()
                .map(|(g, _)| (g.uuid.clone(), g.memory))
                .collect();
            m.allocatable = gpus
                .seen
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
    let injection = crate::agent::install_hook(&opts.agent)?;
    let exe = std::env::current_exe()?;
    let first = crate::agent::first_gpus(&exe, opts.agent.health_interval).await;
    let metrics = Arc::new(Mutex::new(Metrics::default()));
    let shared = Arc::new(Shared {
        admin: Arc::new(Mutex::new(AdminLink::new(
            opts.agent.scheduler_socket.clone(),
            "gpushare-device-manager",
        ))),
        opts,
        injection,
        devices: watch::Sender::new(Vec::new()),
        gpus: Mutex::new(Gpus::default()),
        poke: Notify::new(),
        metrics: metrics.clone(),
        pods: std::sync::OnceLock::new(),
        assigned: Mutex::new(Vec::new()),
        client: std::sync::OnceLock::new(),
    });
    shared.set_found(Ok(first));
    if let Some(addr) = shared.opts.metrics {
        let l = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            anyhow::anyhow!("cannot serve metrics on {addr}: {e}; pick another --metrics address")
        })?;
        tokio::spawn(crate::metrics::serve(l, metrics));
    }
    let s = shared.clone();
    tokio::spawn(crate::agent::watch_gpus(
        exe,
        shared.opts.agent.health_interval,
        move |found| s.set_found(found),
    ));
    tokio::spawn(crate::kubelet::run(shared.clone()));
    let client = match crate::podwatch::client(shared.opts.agent.kubeconfig.as_deref()).await {
        Ok(c) => {
            let _ = shared.client.set(c.clone());
            let changed = Arc::new(Notify::new());
            let (pods, watch) =
                crate::podwatch::watch(c.clone(), shared.opts.agent.node(), changed.clone());
            let _ = shared.pods.set(pods);
            tokio::spawn(watch);
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
    reconcile_loop(shared, client).await;
    Ok(())
}

/// On every change (and every `pod_resources_interval`): read PodResources, compute the
/// desired groups, push the difference, report new annotation problems.
async fn reconcile_loop(shared: Arc<Shared>, client: Option<kube::Client>) {
    let mut assignments: Option<Vec<Assignment>> = None;
    let mut counted: HashSet<PodProblem> = HashSet::new();
    let reporter =
        client.map(|c| Reporter::new(c, "gpushare-device-manager", shared.opts.agent.node()));
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
        // Push only from complete knowledge: a restarted manager must not wipe the scheduler's
        // table before it has seen the pods and the assignments.
        let Some(pods) = shared.pods.get().filter(|p| p.ready()).map(Pods::views) else {
            continue;
        };
        let Some(assignments) = assignments.as_ref() else {
            continue;
        };
        let gpus = locked(&shared.gpus).all();
        let want = reconcile::desired(&pods, assignments, &gpus, shared.opts.agent.units_per_gpu);
        crate::admin_client::push(&shared.admin, want.groups).await;
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
        if let Some(r) = &reporter {
            r.report(&now.iter().map(PodProblem::warning).collect());
        }
        counted = now;
    }
}
