//! A Kubernetes node made of stand-ins: the simulated GPU and `gpushare-scheduler` (from
//! `gpushare_testkit::node::Node`), a fake API server, a fake kubelet and PodResources,
//! and the real `gpushare-device-manager`; "pods" whose containers are processes placed in
//! kubelet-style cgroups (so the scheduler identifies them from the kernel) and started with
//! what `Allocate` returned, as a container runtime would.

use crate::apiserver::FakeApiServer;
use crate::kubelet::{FakeKubelet, FakePodResources};
use gpushare_device_manager::inventory::RESOURCE;
use gpushare_device_manager::proto::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, PreferredAllocationRequest,
};
use gpushare_testkit::harness::{describe, output_with_timeout, target_dir};
use gpushare_testkit::node::{Node, Tenant};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether this test can place processes in cgroups (root, cgroup filesystems mounted).
pub fn cgroups_usable() -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective user.
    if std::fs::metadata("/proc/self").map_or(true, |m| m.uid() != 0) {
        return Err(
            "not root: tenants cannot be placed in kubelet-style cgroups (run it as root, as CI does)"
                .into(),
        );
    }
    for d in [V2_ROOT, V1_ROOT] {
        if !Path::new(d).join("cgroup.procs").exists() {
            return Err(format!(
                "{d} is not a mounted cgroup hierarchy (these tests need the hybrid layout: \
                 cgroup v2 at {V2_ROOT} and the v1 pids hierarchy at {V1_ROOT})"
            ));
        }
    }
    Ok(())
}

/// cgroup v2 (unified) and a v1 hierarchy, as a host with the hybrid layout mounts them.
const V2_ROOT: &str = "/sys/fs/cgroup/unified";
const V1_ROOT: &str = "/sys/fs/cgroup/pids";

/// How the kubelet names a pod's cgroups.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Driver {
    /// systemd driver on cgroup v2, containerd: `…-pod<uid_>.slice/cri-containerd-<id>.scope`.
    SystemdV2,
    /// cgroupfs driver on cgroup v1, CRI-O: `…/kubepods/besteffort/pod<uid>/crio-<id>`.
    CgroupfsV1,
}

/// A container's cgroup, removed (with the test's cgroup root) on drop.
pub struct Cgroup {
    pub dir: PathBuf,
    root: PathBuf,
}

impl Cgroup {
    /// The cgroup the kubelet would make for container `id` of pod `uid`, under a cgroup root
    /// of this test's own (`--cgroup-root`).
    pub fn make(driver: Driver, uid: &str, id: &str) -> Cgroup {
        let tag = format!("gpusharetest{}", std::process::id());
        let (root, dir) = match driver {
            Driver::SystemdV2 => {
                let root = Path::new(V2_ROOT).join(format!("{tag}.slice"));
                let u = uid.replace('-', "_");
                let dir = root
                    .join(format!("{tag}-kubepods.slice"))
                    .join(format!("{tag}-kubepods-burstable.slice"))
                    .join(format!("{tag}-kubepods-burstable-pod{u}.slice"))
                    .join(format!("cri-containerd-{id}.scope"));
                (root, dir)
            }
            Driver::CgroupfsV1 => {
                let root = Path::new(V1_ROOT).join(&tag);
                let dir = root
                    .join("kubepods/besteffort")
                    .join(format!("pod{uid}"))
                    .join(format!("crio-{id}"));
                (root, dir)
            }
        };
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create cgroup {}: {e}", dir.display()));
        Cgroup { dir, root }
    }

    /// `program args…` started inside this cgroup (a shell moves itself in, then execs).
    pub fn command(&self, program: &Path, args: &[String]) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!(
                "echo $$ > '{}/cgroup.procs' && exec \"$@\"",
                self.dir.display()
            ))
            .arg("sh")
            .arg(program)
            .args(args);
        c
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Deepest first; a cgroup shared with another live container of the test stays.
        let mut dirs = Vec::new();
        let mut d = self.dir.clone();
        while d.starts_with(&self.root) {
            dirs.push(d.clone());
            if !d.pop() {
                break;
            }
        }
        for d in dirs {
            let _ = std::fs::remove_dir(&d);
        }
    }
}

/// The whole node.
pub struct Cluster {
    pub node: Node,
    pub api: FakeApiServer,
    pub kubelet: FakeKubelet,
    pub podres: FakePodResources,
    pub kubeconfig: PathBuf,
    manager: Option<Manager>,
    manager_args: Vec<String>,
    pub admin_socket: PathBuf,
    pub metrics: std::net::SocketAddr,
    pub scheduler_metrics: std::net::SocketAddr,
    used: BTreeSet<String>,
}

pub const NODE: &str = "node-1";

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Cluster {
    /// Everything up, the plugin registered.
    pub async fn start(sim_args: &[&str], manager_args: &[&str]) -> Cluster {
        let mut node = Node::device_only_with(sim_args);
        let admin_socket = node.tmp.path().join("admin/admin.sock");
        let scheduler_metrics = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
        node.start_scheduler_with(
            false,
            &[
                "--admin-socket",
                admin_socket.to_str().unwrap(),
                "--metrics",
                &scheduler_metrics.to_string(),
            ],
        );
        let api = FakeApiServer::start().await;
        let kubeconfig = api.kubeconfig(node.tmp.path());
        let kubelet = FakeKubelet::start(&node.tmp.path().join("device-plugins"));
        let podres = FakePodResources::start(&node.tmp.path().join("pod-resources.sock"));
        let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut c = Cluster {
            node,
            api,
            kubelet,
            podres,
            kubeconfig,
            manager: None,
            manager_args: manager_args.iter().map(|s| s.to_string()).collect(),
            admin_socket,
            metrics,
            scheduler_metrics,
            used: BTreeSet::new(),
        };
        c.start_manager();
        c.kubelet
            .wait_registrations(1, Duration::from_secs(30))
            .await;
        c
    }

    pub fn manager_log_path(&self) -> PathBuf {
        self.node.tmp.path().join("manager.log")
    }

    pub fn manager_log(&self) -> String {
        std::fs::read_to_string(self.manager_log_path()).unwrap_or_default()
    }

    pub fn start_manager(&mut self) {
        assert!(self.manager.is_none());
        let mut cmd = agent_command(
            &self.node,
            "gpushare-device-manager",
            &self.admin_socket,
            &self.kubeconfig,
            &self.manager_log_path(),
        );
        cmd.arg("--device-plugin-dir")
            .arg(&self.kubelet.dir)
            .arg("--pod-resources-socket")
            .arg(&self.podres.socket)
            .arg("--metrics")
            .arg(self.metrics.to_string())
            .args(&self.manager_args);
        self.manager = Some(Manager::spawn(cmd, self.manager_log_path()));
    }

    pub fn stop_manager(&mut self) {
        self.manager = None;
    }

    /// Stop everything; the device trace.
    pub fn finish(self) -> gpushare_testkit::trace::Trace {
        let Cluster { node, manager, .. } = self;
        drop(manager);
        node.finish()
    }

    /// `kubectl ARGS…` against the fake API server; its output (it must succeed).
    pub fn kubectl(&self, args: &[&str]) -> String {
        let mut c = Command::new(crate::tools::kubectl());
        c.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(self.node.tmp.path().join("kube-cache"))
            .args(args);
        let out = output_with_timeout(c, Duration::from_secs(60));
        assert!(
            out.status.success(),
            "kubectl {args:?} failed\n{}",
            describe(&out)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The manager's metrics page.
    pub fn manager_metrics(&self) -> String {
        scrape(self.metrics)
    }

    /// The scheduler's metrics page.
    pub fn scheduler_metrics(&self) -> String {
        scrape(self.scheduler_metrics)
    }
}

/// `GET /metrics` from `addr`.
fn scrape(addr: std::net::SocketAddr) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

impl Cluster {
    /// What the kubelet does for a new pod with one container asking for `units`: the pod
    /// in the API server (bound to this node), then [`kubelet_admits`].
    pub async fn admit(&mut self, name: &str, units: u32, annotations: Value) -> Pod {
        let uid = format!("{:08x}-6f0e-4a57-9a39-8f2d3c1b7e11", fxhash(name) as u32);
        self.api.create_pod(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": uid, "annotations": annotations},
            "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "cuda-app",
                "resources": {"limits": {RESOURCE: units.to_string()}}}]},
            "status": {"phase": "Pending"}
        }));
        kubelet_admits(
            &self.api,
            &self.kubelet,
            &self.podres,
            &mut self.used,
            name,
            units,
        )
        .await
    }

    /// A process of `pod`'s container (see [`container_process`]).
    pub fn container_process(&self, pod: &Pod, cg: &Cgroup, args: &[String]) -> Command {
        container_process(&self.node, pod, cg, args)
    }

    pub fn spawn(&self, cmd: Command) -> Tenant {
        self.node.spawn(cmd)
    }

    /// Poll `gpushare status --json` until `f` holds (at most `timeout`); the status then.
    pub fn wait_status(&self, timeout: Duration, f: impl Fn(&Value) -> bool) -> Value {
        wait_status(&self.node, timeout, f, || self.manager_log())
    }
}

/// What a node's kubelet does for pod `default/NAME`, bound to it, with one container `main`
/// asking for `units`: preferred units, `Allocate`, the assignment in PodResources, the
/// container ID in the pod's status. `used`: the units the kubelet assigned before.
pub async fn kubelet_admits(
    api: &FakeApiServer,
    kubelet: &FakeKubelet,
    podres: &FakePodResources,
    used: &mut BTreeSet<String>,
    name: &str,
    units: u32,
) -> Pod {
    let uid = api
        .list(crate::apiserver::Kind::Pod, "default")
        .into_iter()
        .find(|p| p["metadata"]["name"] == name)
        .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_string))
        .unwrap_or_else(|| panic!("no pod default/{name} in the API server"));
    let id = format!("{:016x}", fxhash(name)).repeat(4);
    let mut plugin = kubelet.plugin().await;
    let available: Vec<String> = crate::kubelet::devices(&mut plugin)
        .await
        .iter()
        .filter(|d| d.health == "Healthy" && !used.contains(&d.id))
        .map(|d| d.id.clone())
        .collect();
    let preferred = plugin
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: available,
                must_include_device_i_ds: vec![],
                allocation_size: units as i32,
            }],
        })
        .await
        .expect("GetPreferredAllocation")
        .into_inner()
        .container_responses
        .remove(0)
        .device_i_ds;
    let alloc = plugin
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: preferred.clone(),
            }],
        })
        .await
        .expect("Allocate")
        .into_inner()
        .container_responses
        .remove(0);
    used.extend(preferred.iter().cloned());
    podres.assign("default", name, "main", RESOURCE, preferred.clone());
    api.update_pod("default", name, |p| {
        p["status"] = json!({"phase": "Running", "containerStatuses": [{"name": "main",
            "containerID": format!("containerd://{id}"), "ready": true, "restartCount": 0,
            "image": "cuda-app", "imageID": "", "started": true}]});
    });
    Pod {
        uid,
        container_id: id,
        alloc,
        devices: preferred,
    }
}

/// A process of `pod`'s container on `node`: `cudarc-client ARGS` with the container's
/// environment from `Allocate` (container paths mapped back to the host, as the runtime's
/// mounts would), on the simulated GPU, in the container's cgroup. It sees only the GPUs
/// `NVIDIA_VISIBLE_DEVICES` names, as the NVIDIA container runtime's device mounts make it.
pub fn container_process(node: &Node, pod: &Pod, cg: &Cgroup, args: &[String]) -> Command {
    let mut c = cg.command(&target_dir().join("cudarc-client"), args);
    for (k, v) in &node.sim_env {
        c.env(k, v);
    }
    for (k, v) in &pod.alloc.envs {
        c.env(k, host_path(&pod.alloc, v));
        if k == "NVIDIA_VISIBLE_DEVICES" {
            c.env("CUDA_VISIBLE_DEVICES", v);
        }
    }
    c.env("GPUSHARE_FAIL", "closed");
    c
}

/// Poll `node`'s `gpushare status --json` until `f` holds (at most `timeout`); the status
/// then. On failure the last status and `agent_log()` are shown.
pub fn wait_status(
    node: &Node,
    timeout: Duration,
    f: impl Fn(&Value) -> bool,
    agent_log: impl Fn() -> String,
) -> Value {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(s) = node.status_json()
            && f(&s)
        {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "the scheduler's status did not get there within {timeout:?}: {:#}\n--- agent log ---\n{}",
            node.status_json().unwrap_or_default(),
            agent_log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A node agent (`program`: `gpushare-device-manager` or `gpushare-dra`) on `node` with the
/// settings both take (the node's name, the scheduler's sockets, the API server, the hook),
/// logging to `log` (appended).
pub fn agent_command(
    node: &Node,
    program: &str,
    admin_socket: &Path,
    kubeconfig: &Path,
    log: &Path,
) -> Command {
    agent_command_on(NODE, node, program, admin_socket, kubeconfig, log)
}

/// [`agent_command`] on the node named `node_name`.
pub fn agent_command_on(
    node_name: &str,
    node: &Node,
    program: &str,
    admin_socket: &Path,
    kubeconfig: &Path,
    log: &Path,
) -> Command {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let mut cmd = node.command(target_dir().join(program));
    cmd.args(["--node-name", node_name])
        .arg("--scheduler-socket")
        .arg(admin_socket)
        .arg("--tenant-socket")
        .arg(&node.sched_socket)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--hook-library")
        .arg(target_dir().join("libgpushare.so"))
        .arg("--hook-dir")
        .arg(node.tmp.path().join("var-lib-gpushare/lib"))
        .env("GPUSHARE_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log);
    cmd
}

/// A running node agent, killed on drop (its log printed if the test is failing).
pub struct Manager {
    child: Child,
    log: PathBuf,
}

impl Manager {
    /// Start `cmd` (its stderr already going to `log`).
    pub fn spawn(mut cmd: Command, log: PathBuf) -> Manager {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start {:?}: {e}", cmd.get_program()));
        Manager { child, log }
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("--- manager log ---\n{log}");
        }
    }
}

/// A pod admitted by [`Cluster::admit`].
pub struct Pod {
    pub uid: String,
    pub container_id: String,
    pub alloc: ContainerAllocateResponse,
    /// The units the kubelet assigned (`<GPU-UUID>::<n>`).
    pub devices: Vec<String>,
}

/// An environment value with a mount's container path replaced by its host path.
fn host_path(alloc: &ContainerAllocateResponse, v: &str) -> String {
    for m in &alloc.mounts {
        if let Some(rest) = v.strip_prefix(&m.container_path)
            && (rest.is_empty() || rest.starts_with('/'))
        {
            return format!("{}{rest}", m.host_path);
        }
    }
    v.to_string()
}

/// A stable hash of a name (for test UIDs and container IDs).
pub fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    })
}
