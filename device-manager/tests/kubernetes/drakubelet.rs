//! A stand-in for the kubelet's DRA side: it finds plugins by their sockets in a
//! `plugins_registry` directory (every socket present when it starts, and each new one), asks
//! each `GetInfo`, checks the answer as the kubelet does (a `DRAPlugin` serving
//! `v1.DRAPlugin` on an existing socket) and says so with `NotifyRegistrationStatus`; then it
//! prepares and unprepares claims on the registered endpoint. It dials plugins with
//! `:authority localhost`, as kubelets since 1.26 do.

use gpushare_device_manager::grpc;
use gpushare_device_manager::proto::dra::dra_plugin_client::DraPluginClient;
use gpushare_device_manager::proto::dra::{
    Claim, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodeUnprepareResourceResponse,
    NodeUnprepareResourcesRequest,
};
use gpushare_device_manager::proto::pluginregistration::registration_client::RegistrationClient;
use gpushare_device_manager::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus,
};
use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

const AUTHORITY: &str = "http://localhost";

/// One registration: when, and what the plugin said.
pub type Registration = (Instant, PluginInfo);

pub struct FakeDraKubelet {
    pub registry: PathBuf,
    seen: Arc<Mutex<Vec<Registration>>>,
    watcher: JoinHandle<()>,
}

impl Drop for FakeDraKubelet {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

impl FakeDraKubelet {
    pub fn start(registry: &Path) -> FakeDraKubelet {
        std::fs::create_dir_all(registry).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        FakeDraKubelet {
            registry: registry.to_path_buf(),
            watcher: tokio::spawn(watch(registry.to_path_buf(), seen.clone())),
            seen,
        }
    }

    /// Restart: forget every plugin, then find them again as a starting kubelet does.
    pub fn restart(&mut self) -> Instant {
        self.watcher.abort();
        self.watcher = tokio::spawn(watch(self.registry.clone(), self.seen.clone()));
        Instant::now()
    }

    pub fn registrations(&self) -> Vec<Registration> {
        self.seen.lock().unwrap().clone()
    }

    /// Wait (at most `timeout`) until there are `n` registrations; the time of the `n`th.
    pub async fn wait_registrations(&self, n: usize, timeout: Duration) -> Instant {
        crate::kubelet::wait_nth(n, timeout, || {
            self.registrations().iter().map(|(t, _)| *t).collect()
        })
        .await
    }

    /// A client of the plugin that registered last.
    pub async fn plugin(&self) -> DraPluginClient<Channel> {
        let (_, info) = self
            .registrations()
            .pop()
            .expect("no DRA plugin registered");
        let ch = grpc::channel_as(Path::new(&info.endpoint), AUTHORITY)
            .await
            .expect("connect to the DRA plugin's socket");
        DraPluginClient::new(ch)
    }

    /// `NodePrepareResources` for one claim; the plugin's answer for it.
    pub async fn prepare(&self, claim: &Claim) -> NodePrepareResourceResponse {
        let mut r = self
            .plugin()
            .await
            .node_prepare_resources(NodePrepareResourcesRequest {
                claims: vec![claim.clone()],
            })
            .await
            .expect("NodePrepareResources")
            .into_inner();
        r.claims
            .remove(&claim.uid)
            .expect("an answer for every claim asked")
    }

    /// `NodeUnprepareResources` for one claim; the plugin's answer for it.
    pub async fn unprepare(&self, claim: &Claim) -> NodeUnprepareResourceResponse {
        let mut r = self
            .plugin()
            .await
            .node_unprepare_resources(NodeUnprepareResourcesRequest {
                claims: vec![claim.clone()],
            })
            .await
            .expect("NodeUnprepareResources")
            .into_inner();
        r.claims
            .remove(&claim.uid)
            .expect("an answer for every claim asked")
    }
}

/// Register every socket of `dir` (each socket file once: one made anew registers again).
async fn watch(dir: PathBuf, seen: Arc<Mutex<Vec<Registration>>>) {
    // A socket file's identity: path, inode and change time (an inode number may be reused).
    let mut known: BTreeSet<(PathBuf, u64, i64, i64)> = BTreeSet::new();
    loop {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = e.path();
            let Ok(m) = std::fs::metadata(&path) else {
                continue;
            };
            if !std::os::unix::fs::FileTypeExt::is_socket(&m.file_type())
                || !known.insert((path.clone(), m.ino(), m.ctime(), m.ctime_nsec()))
            {
                continue;
            }
            if let Some(info) = register(&path).await {
                seen.lock().unwrap().push((Instant::now(), info));
            } else {
                // Try again at the next look.
                known.remove(&(path, m.ino(), m.ctime(), m.ctime_nsec()));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `GetInfo`, checked, then `NotifyRegistrationStatus`; the plugin's info if it was accepted.
async fn register(socket: &Path) -> Option<PluginInfo> {
    let ch = grpc::channel_as(socket, AUTHORITY).await.ok()?;
    let mut c = RegistrationClient::new(ch);
    let info = c.get_info(InfoRequest {}).await.ok()?.into_inner();
    let error = if info.r#type != "DRAPlugin" {
        format!("plugin type {:?} is not DRAPlugin", info.r#type)
    } else if !info.supported_versions.iter().any(|v| v == "v1.DRAPlugin") {
        format!("none of {:?} is v1.DRAPlugin", info.supported_versions)
    } else if !Path::new(&info.endpoint).is_absolute() || !Path::new(&info.endpoint).exists() {
        format!("endpoint {:?} is not an existing socket", info.endpoint)
    } else {
        String::new()
    };
    let ok = error.is_empty();
    c.notify_registration_status(RegistrationStatus {
        plugin_registered: ok,
        error,
    })
    .await
    .ok()?;
    ok.then_some(info)
}
