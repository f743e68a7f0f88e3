//! The driver's I/O shell: its settings, the state its tasks share ([`Driver`]), preparing and
//! unpreparing claims for the kubelet, and the reconcile loop that pushes
//! [`super::reconcile::desired`] to the scheduler. GPU discovery, the pod watch, the
//! ResourceSlice ([`super::publish`]) and the kubelet's sockets ([`super::plugin`]) run as
//! tasks of their own.

use super::checkpoint::Checkpoint;
use super::claim::{self, Node, PreparedClaim};
use super::{DRIVER, REASON, cdi};
use crate::admin_client::AdminLink;
use crate::agent::{AgentArgs, Gpus};
use crate::events::{Object, Reporter, Warning};
use crate::injection::Injection;
use crate::inventory::Gpu;
use crate::podwatch::Pods;
use crate::proto::dra::{
    Claim, Device, NodePrepareResourceResponse, NodeUnprepareResourceResponse,
};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// The driver's settings (the command line, besides the agents' common ones).
#[derive(clap::Args, Debug, Clone)]
pub struct Options {
    #[command(flatten)]
    pub agent: AgentArgs,
    /// The driver's directory under the kubelet's plugins directory (its dra.sock, which the
    /// kubelet calls, and checkpoint.json, the claims prepared on this node).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kubelet/plugins/gpushare.io"
    )]
    pub plugin_dir: PathBuf,
    /// The kubelet's plugin registration directory (our gpushare.io-reg.sock goes there).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    pub registry_dir: PathBuf,
    /// The directory of CDI specs the container runtime reads (one file per prepared claim).
    #[arg(long, value_name = "DIR", default_value = "/var/run/cdi")]
    pub cdi_dir: PathBuf,
    /// How often the scheduler's groups are pushed again besides after each change.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = crate::agent::duration)]
    pub reconcile_interval: Duration,
}

impl Options {
    /// The socket the kubelet calls `NodePrepareResources` on.
    pub fn dra_socket(&self) -> PathBuf {
        self.plugin_dir.join("dra.sock")
    }

    /// The socket the kubelet finds the driver by.
    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir.join(format!("{DRIVER}-reg.sock"))
    }

    pub fn checkpoint(&self) -> PathBuf {
        self.plugin_dir.join("checkpoint.json")
    }
}

/// What the driver's tasks share.
pub struct Driver {
    pub opts: Options,
    injection: Injection,
    client: kube::Client,
    gpus: Mutex<Gpus>,
    /// The GPUs the last look found, for the ResourceSlice.
    healthy: watch::Sender<Vec<Gpu>>,
    /// The claims prepared; prepares and unprepares hold it from their checks to their writes.
    prepared: tokio::sync::Mutex<Checkpoint>,
    /// What `prepared` holds, for the reconcile loop (which does not wait for a prepare).
    snapshot: Mutex<Vec<PreparedClaim>>,
    /// Claims the kubelet asked for that could not be prepared, by UID: why.
    refused: Mutex<BTreeMap<String, Warning>>,
    pods: Pods,
    admin: Arc<Mutex<AdminLink>>,
    /// Something changed that the reconcile loop should look at.
    poke: Notify,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Driver {
    fn set_found(&self, found: Result<Vec<Gpu>, String>) {
        let mut gpus = locked(&self.gpus);
        if gpus.update(found) {
            self.healthy.send_replace(gpus.healthy());
        }
    }

    /// A receiver of the healthy GPUs.
    pub fn healthy_gpus(&self) -> watch::Receiver<Vec<Gpu>> {
        self.healthy.subscribe()
    }

    /// `NodePrepareResources`: each claim prepared (or found prepared), or why not.
    pub async fn prepare(
        &self,
        claims: Vec<Claim>,
    ) -> HashMap<String, NodePrepareResourceResponse> {
        let mut out = HashMap::new();
        for c in claims {
            let r = match self.prepare_one(&c).await {
                Ok(devices) => NodePrepareResourceResponse {
                    devices,
                    error: String::new(),
                },
                Err(error) => NodePrepareResourceResponse {
                    devices: vec![],
                    error: format!("{DRIVER}: {error}"),
                },
            };
            out.insert(c.uid, r);
        }
        self.poke.notify_one();
        out
    }

    async fn prepare_one(&self, c: &Claim) -> Result<Vec<Device>, String> {
        if let Some(p) = self.prepared.lock().await.claims.get(&c.uid) {
            return Ok(self.devices(p));
        }
        let what = format!("ResourceClaim {}/{}", c.namespace, c.name);
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &c.namespace);
        let rc = tokio::time::timeout(Duration::from_secs(10), api.get(&c.name))
            .await
            .map_err(|_| {
                format!("the API server did not answer for {what} within 10 s; the kubelet retries")
            })?
            .map_err(|e| {
                format!("cannot read {what} from the API server: {e}; the kubelet retries")
            })?;
        let uid = rc.metadata.uid.as_deref().unwrap_or_default();
        if uid != c.uid {
            return Err(format!(
                "{what} has UID {uid}, not {}: the claim was deleted and made again",
                c.uid
            ));
        }
        let mut cp = self.prepared.lock().await;
        if let Some(p) = cp.claims.get(&c.uid) {
            return Ok(self.devices(p));
        }
        let gpus = locked(&self.gpus).healthy();
        let node = Node {
            pool: self.opts.agent.node(),
            gpus: &gpus,
            units_per_gpu: self.opts.agent.units_per_gpu,
        };
        let others: Vec<PreparedClaim> = cp.claims.values().cloned().collect();
        let p = claim::prepare(&rc, node, &others).inspect_err(|e| {
            tracing::warn!("{what} not prepared: {e}");
            let w = Warning {
                object: Object {
                    api_version: "resource.k8s.io/v1",
                    kind: "ResourceClaim",
                    namespace: c.namespace.clone(),
                    name: c.name.clone(),
                    uid: c.uid.clone(),
                },
                reason: REASON,
                action: "PrepareResources",
                message: e.clone(),
            };
            locked(&self.refused).insert(c.uid.clone(), w);
        })?;
        let dir = &self.opts.cdi_dir;
        if !p.devices.is_empty() {
            cdi::write(dir, &p.uid, &self.injection.edits(&p.gpus()))?;
        }
        cp.claims.insert(p.uid.clone(), p.clone());
        if let Err(e) = cp.save(&self.opts.checkpoint()) {
            // Nothing prepared half-way: the kubelet asks again.
            cp.claims.remove(&p.uid);
            let _ = cdi::remove(dir, &p.uid);
            return Err(e);
        }
        *locked(&self.snapshot) = cp.claims.values().cloned().collect();
        locked(&self.refused).remove(&p.uid);
        tracing::info!(claim = %p.full_name(), gpus = ?p.gpus(), units = p.share_units, memory = p.memory, limit = p.limit, weight = p.weight, "prepared");
        Ok(self.devices(&p))
    }

    /// The kubelet's view of a prepared claim's devices: each with the claim's CDI device, and
    /// its GPU's CDI device of `--cdi-kind`.
    fn devices(&self, p: &PreparedClaim) -> Vec<Device> {
        p.devices
            .iter()
            .map(|d| {
                let mut request_names = vec![d.request.clone()];
                // A subrequest's device serves a container that names its request.
                if let Some((base, _)) = d.request.split_once('/') {
                    request_names.push(base.to_string());
                }
                let mut cdi_device_ids = vec![cdi::device_id(&p.uid)];
                cdi_device_ids.extend(
                    self.injection
                        .edits(std::slice::from_ref(&d.gpu))
                        .cdi_devices,
                );
                Device {
                    request_names,
                    pool_name: d.pool.clone(),
                    device_name: d.device.clone(),
                    cdi_device_ids,
                    share_id: d.share_id.clone(),
                }
            })
            .collect()
    }

    /// `NodeUnprepareResources`: each claim's CDI spec and checkpoint entry removed (a claim
    /// not prepared is fine); its containers' groups go with the next reconcile.
    pub async fn unprepare(
        &self,
        claims: Vec<Claim>,
    ) -> HashMap<String, NodeUnprepareResourceResponse> {
        let mut cp = self.prepared.lock().await;
        let mut removed = Vec::new();
        let mut errors: HashMap<String, String> = HashMap::new();
        for c in &claims {
            locked(&self.refused).remove(&c.uid);
            if !cp.claims.contains_key(&c.uid) {
                continue;
            }
            match cdi::remove(&self.opts.cdi_dir, &c.uid) {
                Ok(()) => removed.extend(cp.claims.remove(&c.uid)),
                Err(e) => {
                    errors.insert(c.uid.clone(), e);
                }
            }
        }
        if !removed.is_empty()
            && let Err(e) = cp.save(&self.opts.checkpoint())
        {
            for p in removed.drain(..) {
                errors.insert(p.uid.clone(), e.clone());
                cp.claims.insert(p.uid.clone(), p);
            }
        }
        *locked(&self.snapshot) = cp.claims.values().cloned().collect();
        drop(cp);
        for p in &removed {
            tracing::info!(claim = %p.full_name(), "unprepared");
        }
        self.poke.notify_one();
        claims
            .into_iter()
            .map(|c| {
                let error = errors
                    .remove(&c.uid)
                    .map(|e| format!("{DRIVER}: {e}"))
                    .unwrap_or_default();
                (c.uid, NodeUnprepareResourceResponse { error })
            })
            .collect()
    }
}

/// Run the driver until the process is killed.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    let injection = crate::agent::install_hook(&opts.agent)?;
    let client = crate::podwatch::client(opts.agent.kubeconfig.as_deref()).await?;
    let checkpoint = Checkpoint::load(&opts.checkpoint()).map_err(|e| anyhow::anyhow!(e))?;
    restore(&opts, &injection, &checkpoint)?;
    let exe = std::env::current_exe()?;
    let first = crate::agent::first_gpus(&exe, opts.agent.health_interval).await;
    let node = opts.agent.node().to_string();
    let changed = Arc::new(Notify::new());
    let (pods, watch) = crate::podwatch::watch(client.clone(), &node, changed.clone());
    let driver = Arc::new(Driver {
        admin: Arc::new(Mutex::new(AdminLink::new(
            opts.agent.scheduler_socket.clone(),
            super::COMPONENT,
        ))),
        snapshot: Mutex::new(checkpoint.claims.values().cloned().collect()),
        prepared: tokio::sync::Mutex::new(checkpoint),
        opts,
        injection,
        client: client.clone(),
        gpus: Mutex::new(Gpus::default()),
        healthy: watch::Sender::new(Vec::new()),
        refused: Mutex::new(BTreeMap::new()),
        pods,
        poke: Notify::new(),
    });
    driver.set_found(Ok(first));
    let d = driver.clone();
    tokio::spawn(crate::agent::watch_gpus(
        exe,
        driver.opts.agent.health_interval,
        move |found| d.set_found(found),
    ));
    tokio::spawn(super::publish::run(
        client.clone(),
        node.clone(),
        driver.opts.agent.units_per_gpu,
        driver.healthy_gpus(),
    ));
    tokio::spawn(watch);
    let d = driver.clone();
    tokio::spawn(async move {
        loop {
            changed.notified().await;
            d.poke.notify_one();
        }
    });
    tokio::spawn(super::plugin::serve(driver.clone()));
    reconcile_loop(driver, Reporter::new(client, super::COMPONENT, &node)).await;
    Ok(())
}

/// After a restart: the CDI specs of the claims in the checkpoint written again (with this
/// run's hook and settings), and specs of claims it does not list (a prepare cut short)
/// removed.
fn restore(opts: &Options, injection: &Injection, cp: &Checkpoint) -> anyhow::Result<()> {
    for p in cp.claims.values().filter(|p| !p.devices.is_empty()) {
        cdi::write(&opts.cdi_dir, &p.uid, &injection.edits(&p.gpus()))
            .map_err(|e| anyhow::anyhow!(e))?;
    }
    for uid in cdi::claims_in(&opts.cdi_dir) {
        if !cp.claims.contains_key(&uid) {
            tracing::info!(claim_uid = %uid, "removing the CDI spec of a claim not prepared");
            cdi::remove(&opts.cdi_dir, &uid).map_err(|e| anyhow::anyhow!(e))?;
        }
    }
    tracing::info!(claims = cp.claims.len(), "prepared claims restored");
    Ok(())
}

/// On every change (and every `reconcile_interval`): the groups of the containers of prepared
/// claims pushed to the scheduler, and what is wrong posted as events.
async fn reconcile_loop(driver: Arc<Driver>, reporter: Reporter) {
    let mut logged: HashSet<Warning> = HashSet::new();
    loop {
        let _ = tokio::time::timeout(driver.opts.reconcile_interval, driver.poke.notified()).await;
        // Push only from complete knowledge: a restarted driver must not wipe the scheduler's
        // table before it has seen the pods.
        if !driver.pods.ready() {
            continue;
        }
        let pods = driver.pods.views();
        let prepared = locked(&driver.snapshot).clone();
        let want = super::reconcile::desired(&pods, &prepared, driver.opts.agent.units_per_gpu);
        crate::admin_client::push(&driver.admin, want.groups).await;
        let mut now: HashSet<Warning> = want.problems.into_iter().collect();
        for w in now.difference(&logged) {
            tracing::warn!(namespace = %w.object.namespace, pod = %w.object.name, "{}", w.message);
        }
        logged = now.clone();
        {
            // A refused claim is reported while a pod of the node uses it.
            let used: HashSet<(&str, &str)> = pods
                .iter()
                .flat_map(|p| {
                    p.claims
                        .values()
                        .flatten()
                        .map(|c| (p.namespace.as_str(), c.as_str()))
                })
                .collect();
            let mut refused = locked(&driver.refused);
            refused.retain(|_, w| {
                used.contains(&(w.object.namespace.as_str(), w.object.name.as_str()))
            });
            now.extend(refused.values().cloned());
        }
        reporter.report(&now);
    }
}
