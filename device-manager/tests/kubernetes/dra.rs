//! gpushare-dra on a node of stand-ins: the real driver, scheduler and hook on the simulated
//! GPU (two GPUs of 8 GiB), a fake API server in which the test plays the kube-scheduler (it
//! writes each claim's allocation as the kube-scheduler would), a fake kubelet that registers
//! the driver and prepares claims, and tenants started with what the claims' CDI devices say,
//! in kubelet-style cgroups.

use crate::apiserver::{FakeApiServer, Kind};
use crate::cluster::{Cgroup, Driver, Manager, NODE, agent_command, cgroups_usable, fxhash};
use crate::drakubelet::FakeDraKubelet;
use gpushare_device_manager::proto::dra::{Claim, NodePrepareResourceResponse};
use gpushare_testkit::harness::{json_lines, target_dir};
use gpushare_testkit::node::{Node, Spin, common_active_window};
use gpushare_testkit::trace::Window;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;
const SLICE: &str = "node-1-gpushare.io";

/// The node, with the driver registered and its ResourceSlice published.
pub struct DraNode {
    pub node: Node,
    pub api: FakeApiServer,
    pub kubelet: FakeDraKubelet,
    kubeconfig: PathBuf,
    admin_socket: PathBuf,
    pub cdi_dir: PathBuf,
    pub plugin_dir: PathBuf,
    driver: Option<Manager>,
    /// The GPUs' UUIDs, in the slice's order.
    pub gpus: Vec<String>,
}

/// A pod of the node: its UID and its container's ID.
pub struct PodIds {
    pub name: String,
    pub uid: String,
    pub container_id: String,
}

impl DraNode {
    pub async fn start() -> DraNode {
        let mut node = Node::device_only_with(&["--gpus", "2", "--memory", "8GiB"]);
        let admin_socket = node.tmp.path().join("admin/admin.sock");
        node.start_scheduler_with(false, &["--admin-socket", admin_socket.to_str().unwrap()]);
        let api = FakeApiServer::start().await;
        let kubeconfig = api.kubeconfig(node.tmp.path());
        let kubelet = FakeDraKubelet::start(&node.tmp.path().join("plugins_registry"));
        let tmp = node.tmp.path().to_path_buf();
        let mut n = DraNode {
            node,
            api,
            kubelet,
            kubeconfig,
            admin_socket,
            cdi_dir: tmp.join("cdi"),
            plugin_dir: tmp.join("plugins/gpushare.io"),
            driver: None,
            gpus: Vec::new(),
        };
        n.start_driver();
        n.kubelet
            .wait_registrations(1, Duration::from_secs(30))
            .await;
        let slice = n.wait_slice(Duration::from_secs(10)).await;
        n.gpus = slice["spec"]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                d["attributes"]["uuid"]["string"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        n
    }

    pub fn driver_log(&self) -> String {
        std::fs::read_to_string(self.node.tmp.path().join("dra.log")).unwrap_or_default()
    }

    pub fn start_driver(&mut self) {
        assert!(self.driver.is_none());
        let log = self.node.tmp.path().join("dra.log");
        let mut cmd = agent_command(
            &self.node,
            "gpushare-dra",
            &self.admin_socket,
            &self.kubeconfig,
            &log,
        );
        cmd.arg("--registry-dir")
            .arg(&self.kubelet.registry)
            .arg("--plugin-dir")
            .arg(&self.plugin_dir)
            .arg("--cdi-dir")
            .arg(&self.cdi_dir);
        self.driver = Some(Manager::spawn(cmd, log));
    }

    pub fn stop_driver(&mut self) {
        self.driver = None;
    }

    /// The node's ResourceSlice, once published.
    pub async fn wait_slice(&self, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let slices = self.api.list(Kind::ResourceSlice, "");
            if let Some(s) = slices.iter().find(|s| s["metadata"]["name"] == SLICE) {
                return s.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no ResourceSlice within {timeout:?}\n{}",
                self.driver_log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// What the kube-scheduler writes for a claim `name` of one request `gpu` allocated on
    /// GPU `gpu` with `consumed` capacity, with `parameters` as its opaque configuration
    /// (`Null`: none). The claim, and what the kubelet passes the driver.
    pub fn claim(
        &self,
        name: &str,
        gpu: usize,
        consumed: Value,
        parameters: Value,
    ) -> (Value, Claim) {
        let device = self.gpus[gpu].to_ascii_lowercase();
        self.claim_on(name, &device, consumed, parameters)
    }

    /// [`DraNode::claim`] on any device name.
    pub fn claim_on(
        &self,
        name: &str,
        device: &str,
        consumed: Value,
        parameters: Value,
    ) -> (Value, Claim) {
        let config: Vec<Value> = if parameters.is_null() {
            vec![]
        } else {
            vec![
                json!({"requests": ["gpu"], "opaque": {"driver": "gpushare.io", "parameters": parameters}}),
            ]
        };
        let allocated_config: Vec<Value> = config
            .iter()
            .map(|c| {
                let mut c = c.clone();
                c["source"] = json!("FromClaim");
                c
            })
            .collect();
        let share_id = format!(
            "{:08x}-0000-4000-8000-{:012x}",
            fxhash(name) as u32,
            fxhash(device) >> 16
        );
        let claim = self.api.create(
            Kind::ResourceClaim,
            json!({
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpushare.io",
                        "capacity": {"requests": consumed}}}],
                    "config": config,
                }},
                "status": {"allocation": {
                    "devices": {
                        "results": [{"request": "gpu", "driver": "gpushare.io", "pool": NODE,
                            "device": device, "shareID": share_id, "consumedCapacity": consumed}],
                        "config": allocated_config,
                    },
                    "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                        {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]},
                }},
            }),
        );
        let uid = claim["metadata"]["uid"].as_str().unwrap().to_string();
        (
            claim,
            Claim {
                namespace: "default".into(),
                uid,
                name: name.into(),
            },
        )
    }

    /// A pod on this node whose container `main` uses `claim` (pending until [`DraNode::run`]).
    pub fn pod(&self, name: &str, claim: &Claim) -> PodIds {
        let uid = format!("{:08x}-6f0e-4a57-9a39-8f2d3c1b7e11", fxhash(name) as u32);
        self.api.create_pod(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": {"nodeName": NODE,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim.name}],
                "containers": [{"name": "main", "image": "cuda-app",
                    "resources": {"claims": [{"name": "gpu"}]}}]},
            "status": {"phase": "Pending"}
        }));
        self.api
            .update(Kind::ResourceClaim, "default", &claim.name, |c| {
                c["status"]["reservedFor"] =
                    json!([{"resource": "pods", "name": name, "uid": uid}]);
            });
        PodIds {
            name: name.into(),
            uid,
            container_id: format!("{:016x}", fxhash(name)).repeat(4),
        }
    }

    /// The pod's container started, as the kubelet reports it.
    pub fn run(&self, pod: &PodIds) {
        let id = &pod.container_id;
        self.api.update_pod("default", &pod.name, |p| {
            p["status"] = json!({"phase": "Running", "containerStatuses": [{"name": "main",
                "containerID": format!("containerd://{id}"), "ready": true, "restartCount": 0,
                "image": "cuda-app", "imageID": "", "started": true}]});
        });
    }

    /// The CDI device `name` (`gpushare.io/claim=<uid>`), found in the CDI directory as the
    /// container runtime finds it: its container edits.
    pub fn cdi_edits(&self, name: &str) -> Value {
        let (kind, device) = name.split_once('=').unwrap();
        for e in std::fs::read_dir(&self.cdi_dir).unwrap().flatten() {
            if e.path().extension().is_none_or(|x| x != "json") {
                continue;
            }
            let spec: Value = serde_json::from_slice(&std::fs::read(e.path()).unwrap()).unwrap();
            if spec["kind"] != kind {
                continue;
            }
            if let Some(d) = spec["devices"]
                .as_array()
                .unwrap()
                .iter()
                .find(|d| d["name"] == device)
            {
                return d["containerEdits"].clone();
            }
        }
        panic!("no CDI device {name} in {}", self.cdi_dir.display());
    }

    /// A process of a container given `prepared`'s devices: `cudarc-client ARGS` with the
    /// environment of their gpushare CDI device (container paths mapped back to the host, as
    /// the runtime's mounts would), seeing only the container's GPUs (as the NVIDIA runtime
    /// makes it), on the simulated GPU, in the container's cgroup.
    pub fn container_process(
        &self,
        prepared: &NodePrepareResourceResponse,
        cg: &Cgroup,
        args: &[String],
    ) -> Command {
        let ours: Vec<&String> = prepared
            .devices
            .iter()
            .flat_map(|d| &d.cdi_device_ids)
            .filter(|id| id.starts_with("gpushare.io/claim="))
            .collect();
        assert_eq!(ours.len(), 1, "{prepared:?}");
        let edits = self.cdi_edits(ours[0]);
        let mounts: Vec<(String, String)> = edits["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["containerPath"].as_str().unwrap().to_string(),
                    m["hostPath"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let host = |v: &str| {
            for (c, h) in &mounts {
                if let Some(rest) = v.strip_prefix(c.as_str())
                    && (rest.is_empty() || rest.starts_with('/'))
                {
                    return format!("{h}{rest}");
                }
            }
            v.to_string()
        };
        let mut c = cg.command(&target_dir().join("cudarc-client"), args);
        for (k, v) in &self.node.sim_env {
            c.env(k, v);
        }
        for e in edits["env"].as_array().unwrap() {
            let (k, v) = e.as_str().unwrap().split_once('=').unwrap();
            c.env(k, host(v));
            if k == "NVIDIA_VISIBLE_DEVICES" {
                c.env("CUDA_VISIBLE_DEVICES", v);
            }
        }
        c.env("GPUSHARE_FAIL", "closed");
        c
    }

    /// Poll `gpushare status --json` until `f` holds (at most `timeout`); the status then.
    pub fn wait_status(&self, timeout: Duration, f: impl Fn(&Value) -> bool) -> Value {
        crate::cluster::wait_status(&self.node, timeout, f, || self.driver_log())
    }

    /// Stop everything; the device trace.
    pub fn finish(self) -> gpushare_testkit::trace::Trace {
        let DraNode { node, driver, .. } = self;
        drop(driver);
        node.finish()
    }
}

/// The scheduler's entry of `pod`'s container `main` (`gpushare status --json`, `pods`).
fn entry<'a>(s: &'a Value, pod: &str) -> Option<&'a Value> {
    s["pods"]
        .as_array()?
        .iter()
        .find(|p| p["pod"] == pod && p["container"] == "main")
}

/// The pids of group `group` on any GPU.
fn pids_of(s: &Value, group: &str) -> Vec<u64> {
    s["gpus"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["groups"].as_array().into_iter().flatten())
        .filter(|g| g["name"] == group)
        .flat_map(|g| g["pids"].as_array().into_iter().flatten())
        .filter_map(Value::as_u64)
        .collect()
}

fn cdi_ids(r: &NodePrepareResourceResponse) -> Vec<String> {
    r.devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.clone())
        .collect()
}

/// The whole path on a two-GPU node: a claim of 30 share units and 4 GiB on GPU 1, and one of
/// 70 units beside it, each prepared into a CDI device that carries the hook; their containers
/// get groups with request 0.3 (4 GiB cap, weight 2 from the claim's configuration) and 0.7
/// on GPU 1 only, which split GPU 1's time as asked, measured on the device trace; the 4 GiB
/// cap holds through the hook; unprepare frees the group; prepares are idempotent across a
/// kubelet restart (which re-registers and gets the slice published again) and a driver
/// restart (the checkpoint).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_claims_get_their_share_and_memory_on_their_gpu() {
    cgroups_usable().unwrap_or_else(|why| panic!("cannot run: {why}"));
    let mut n = DraNode::start().await;
    let (_, a) = n.claim(
        "claim-a",
        1,
        json!({"share": "30", "memory": "4Gi"}),
        json!({"apiVersion": "gpushare.io/v1alpha1", "kind": "GpuShareConfig", "weight": "2"}),
    );
    let (_, b) = n.claim(
        "claim-b",
        1,
        json!({"share": "70", "memory": "2Gi"}),
        Value::Null,
    );
    let pa = n.pod("pod-a", &a);
    let pb = n.pod("pod-b", &b);
    let ra = n.kubelet.prepare(&a).await;
    let rb = n.kubelet.prepare(&b).await;
    assert!(
        ra.error.is_empty() && rb.error.is_empty(),
        "{ra:?} {rb:?}\n{}",
        n.driver_log()
    );
    assert_eq!(cdi_ids(&ra), [format!("gpushare.io/claim={}", a.uid)]);
    assert_eq!(ra.devices[0].device_name, n.gpus[1].to_ascii_lowercase());
    assert_eq!(ra.devices[0].request_names, ["gpu"]);
    assert!(ra.devices[0].share_id.is_some());
    let edits = n.cdi_edits(&cdi_ids(&ra)[0]);
    assert!(
        edits["env"]
            .as_array()
            .unwrap()
            .contains(&json!(format!("NVIDIA_VISIBLE_DEVICES={}", n.gpus[1]))),
        "{edits}"
    );
    assert!(
        edits["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["containerPath"] == "/usr/lib/gpushare"
                && m["options"].as_array().unwrap().contains(&json!("ro"))),
        "{edits}"
    );
    n.run(&pa);
    n.run(&pb);
    let s = n.wait_status(Duration::from_secs(10), |s| {
        entry(s, "pod-a").is_some_and(|e| e["container_id"] == json!(pa.container_id))
            && entry(s, "pod-b").is_some_and(|e| e["container_id"] == json!(pb.container_id))
    });
    let (ea, eb) = (entry(&s, "pod-a").unwrap(), entry(&s, "pod-b").unwrap());
    assert_eq!(ea["gpus"], json!([n.gpus[1]]), "{ea}");
    assert_eq!(
        (&ea["request"], &ea["limit"], &ea["weight"], &ea["memory"]),
        (&json!(0.3), &json!(1.0), &json!(2.0), &json!(4 * GIB)),
        "{ea}"
    );
    assert_eq!(
        (&eb["gpus"], &eb["request"], &eb["memory"]),
        (&json!([n.gpus[1]]), &json!(0.7), &json!(2 * GIB)),
        "{eb}"
    );
    let cg_a = Cgroup::make(Driver::SystemdV2, &pa.uid, &pa.container_id);
    let cg_b = Cgroup::make(Driver::CgroupfsV1, &pb.uid, &pb.container_id);

    // The memory cap of claim-a's container, through the hook.
    let oom = n.container_process(&ra, &cg_a, &["oom".into(), "--fill".into()]);
    let out = n.node.spawn(oom).wait_ok(Duration::from_secs(60));
    let report = json_lines(&out.stdout).pop().expect("oom report");
    assert_eq!(report["total"], json!(4 * GIB), "{report}");
    assert_eq!(report["quarters_allocated"], json!(4), "{report}");

    // The two claims split GPU 1.
    let spin = Spin::for_ms(1.0, 5_000.0).args();
    let t_a = n.node.spawn(n.container_process(&ra, &cg_a, &spin));
    let t_b = n.node.spawn(n.container_process(&rb, &cg_b, &spin));
    let (pid_a, pid_b) = (t_a.pid(), t_b.pid());
    let (group_a, group_b) = (
        entry(&s, "pod-a").unwrap()["group"]
            .as_str()
            .unwrap()
            .to_string(),
        entry(&s, "pod-b").unwrap()["group"]
            .as_str()
            .unwrap()
            .to_string(),
    );
    n.wait_status(Duration::from_secs(20), |s| {
        pids_of(s, &group_a).contains(&u64::from(pid_a))
            && pids_of(s, &group_b).contains(&u64::from(pid_b))
    });
    let on_gpu1 = n.node.status_json().unwrap();
    let gpu1 = on_gpu1["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| {
            g["groups"]
                .as_array()
                .unwrap()
                .iter()
                .any(|x| x["name"] == group_a)
        })
        .expect("claim-a's group on a GPU");
    assert_eq!(gpu1["uuid"], json!(n.gpus[1]), "{on_gpu1:#}");
    t_a.wait_ok(Duration::from_secs(60));
    t_b.wait_ok(Duration::from_secs(60));

    // Unprepared: claim-a's group goes (its processes are gone); claim-b's stays.
    let r = n.kubelet.unprepare(&a).await;
    assert!(r.error.is_empty(), "{r:?}");
    assert!(
        !n.cdi_dir
            .join(format!("gpushare.io-claim_{}.json", a.uid))
            .exists()
    );
    n.wait_status(Duration::from_secs(10), |s| {
        entry(s, "pod-a").is_none() && entry(s, "pod-b").is_some()
    });
    assert!(n.kubelet.unprepare(&a).await.error.is_empty(), "idempotent");

    // The kubelet restarts (deleting the node's slices, as it does): the driver registers
    // again and publishes its slice again; a repeated prepare gives the same devices.
    n.api.delete(Kind::ResourceSlice, "", SLICE);
    let deleted = Instant::now();
    let restarted = n.kubelet.restart();
    let again = n
        .kubelet
        .wait_registrations(2, Duration::from_secs(10))
        .await;
    eprintln!(
        "re-registered {} ms after the kubelet restarted",
        again.duration_since(restarted).as_millis()
    );
    assert!(again.duration_since(restarted) < Duration::from_secs(2));
    n.wait_slice(Duration::from_secs(10)).await;
    eprintln!(
        "ResourceSlice published again {} ms after it was deleted",
        deleted.elapsed().as_millis()
    );
    assert_eq!(n.kubelet.prepare(&b).await, rb, "idempotent");

    // The driver restarts: claim-b is still prepared, its group kept.
    n.stop_driver();
    n.start_driver();
    n.kubelet
        .wait_registrations(3, Duration::from_secs(30))
        .await;
    assert_eq!(
        n.kubelet.prepare(&b).await,
        rb,
        "idempotent across a restart"
    );
    assert!(entry(&n.node.status_json().unwrap(), "pod-b").is_some());
    assert!(n.kubelet.unprepare(&b).await.error.is_empty());
    n.wait_status(Duration::from_secs(10), |s| entry(s, "pod-b").is_none());
    let checkpoint: Value =
        serde_json::from_slice(&std::fs::read(n.plugin_dir.join("checkpoint.json")).unwrap())
            .unwrap();
    assert_eq!(checkpoint["claims"], json!({}));
    drop((cg_a, cg_b));

    let trace = n.finish();
    let both = common_active_window(&trace, &[pid_a, pid_b], 500_000_000);
    let win = Window::new(both.start_ns, both.end_ns);
    assert!(
        win.len_ns() >= 2_500_000_000,
        "both tenants ran together only {win}"
    );
    // GPU 1's busy time, by process; nothing of theirs on GPU 0.
    let on = |gpu: u32| trace.busy_by_pid(gpu, win);
    let (gpu0, gpu1) = (on(0), on(1));
    assert!(
        !gpu0.contains_key(&pid_a) && !gpu0.contains_key(&pid_b),
        "the claims' processes ran on GPU 0: {gpu0:?}"
    );
    let sh: Vec<f64> = [pid_a, pid_b]
        .iter()
        .map(|p| gpu1.get(p).copied().unwrap_or(0) as f64 / win.len_ns() as f64)
        .collect();
    let fa = sh[0] / (sh[0] + sh[1]);
    eprintln!(
        "claims of 30 / 70 units on one GPU over {win}: {:.3} / {:.3} of wall time, {fa:.3} / {:.3} of busy time",
        sh[0],
        sh[1],
        1.0 - fa
    );
    assert!(
        (fa - 0.3).abs() <= 0.06,
        "split {fa:.3} / {:.3}, want 0.3 / 0.7",
        1.0 - fa
    );
}

/// `objects` pass the schema of Kubernetes 1.34.
fn validate_134(objects: &[Value]) {
    let text: Vec<String> = objects
        .iter()
        .map(|o| serde_json::to_string_pretty(o).unwrap())
        .collect();
    crate::tools::validate("1.34.0", &text.join("\n---\n"), &[]);
}

/// Bad input: a malformed configuration, a claim over what its GPU has left, a share over a
/// GPU, a device the node does not have: each a clear error to the kubelet and a Warning event
/// on the claim, with nothing prepared (no CDI spec, no checkpoint entry, no group), while a
/// good claim in the same request is prepared. The published slice, and the claims the test
/// writes as the kube-scheduler, pass the 1.34 schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_bad_claims_are_refused_with_an_event_and_nothing_prepared() {
    let n = DraNode::start().await;
    let slice = n.wait_slice(Duration::from_secs(1)).await;
    assert_eq!(n.gpus.len(), 2);
    let device = &slice["spec"]["devices"][0];
    assert_eq!(device["allowMultipleAllocations"], true);
    assert_eq!(device["capacity"]["share"]["value"], "100");
    assert_eq!(device["capacity"]["memory"]["value"], (8 * GIB).to_string());

    let params = |extra: Value| {
        let mut p = json!({"apiVersion": "gpushare.io/v1alpha1", "kind": "GpuShareConfig"});
        p.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        p
    };
    let (good_claim, good) = n.claim(
        "eighty",
        0,
        json!({"share": "80", "memory": "2Gi"}),
        Value::Null,
    );
    validate_134(&[slice.clone(), good_claim]);
    let pg = n.pod("eighty", &good);
    assert!(n.kubelet.prepare(&good).await.error.is_empty());
    n.run(&pg);
    n.wait_status(Duration::from_secs(10), |s| {
        entry(s, "eighty").is_some_and(|e| e["request"] == json!(0.8))
    });

    let bad = [
        (
            n.claim(
                "bad-limit",
                1,
                json!({"share": "10"}),
                params(json!({"limit": "1.5"})),
            ),
            "limit: \"1.5\" is not a share of GPU time: write a fraction in (0, 1] or a percentage",
        ),
        (
            n.claim(
                "typo",
                1,
                json!({"share": "10"}),
                params(json!({"limt": "0.5"})),
            ),
            "unknown field `limt`",
        ),
        (
            n.claim(
                "over",
                0,
                json!({"share": "30", "memory": "1Gi"}),
                Value::Null,
            ),
            "has 20 share units and 6442450944 bytes of memory left (prepared on it: default/eighty (80 units, 2147483648 bytes))",
        ),
        (
            n.claim("too-big", 1, json!({"share": "150"}), Value::Null),
            "more than a GPU has (100 units",
        ),
        (
            n.claim_on(
                "nowhere",
                "gpu-00000000-0000-0000-0000-0000000000ff",
                json!({"share": "10"}),
                Value::Null,
            ),
            "is not one of this node's GPUs",
        ),
    ];
    for ((_, claim), _) in &bad {
        n.pod(&format!("pod-{}", claim.name), claim);
    }
    // One request with a good claim and a bad one: the good one is prepared.
    let (_, fine) = n.claim(
        "fine",
        1,
        json!({"share": "10", "memory": "1Gi"}),
        Value::Null,
    );
    let mut both = n.kubelet.plugin().await;
    let answer = both
        .node_prepare_resources(
            gpushare_device_manager::proto::dra::NodePrepareResourcesRequest {
                claims: vec![fine.clone(), bad[0].0.1.clone()],
            },
        )
        .await
        .unwrap()
        .into_inner();
    assert!(answer.claims[&fine.uid].error.is_empty(), "{answer:?}");
    assert!(
        !answer.claims[&bad[0].0.1.uid].error.is_empty(),
        "{answer:?}"
    );
    for ((_, claim), want) in &bad {
        let r = n.kubelet.prepare(claim).await;
        eprintln!("{}: {}", claim.name, r.error);
        assert!(
            r.error.starts_with("gpushare.io: ") && r.error.contains(want),
            "{want}\n{r:?}"
        );
        assert!(r.devices.is_empty());
        assert!(
            !n.cdi_dir
                .join(format!("gpushare.io-claim_{}.json", claim.uid))
                .exists(),
            "a CDI spec for {}",
            claim.name
        );
    }
    // A Warning event on each bad claim, saying the same.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let events = n.api.events("default");
        let on = |name: &str| {
            events.iter().find(|e| {
                e["involvedObject"]["kind"] == "ResourceClaim"
                    && e["involvedObject"]["name"] == name
            })
        };
        if bad.iter().all(|((_, c), _)| on(&c.name).is_some()) {
            for ((_, c), want) in &bad {
                let e = on(&c.name).unwrap();
                assert_eq!(e["reason"], "InvalidGpushareClaim", "{e}");
                assert_eq!(e["type"], "Warning");
                assert_eq!(e["involvedObject"]["uid"], json!(c.uid));
                assert_eq!(e["reportingComponent"], "gpushare.io/gpushare-dra", "{e}");
                assert_eq!(e["action"], "PrepareResources", "{e}");
                assert!(e["message"].as_str().unwrap().contains(want), "{e}");
            }
            let on_bad = events
                .iter()
                .filter(|e| e["involvedObject"]["kind"] == "ResourceClaim")
                .count();
            assert_eq!(
                on_bad,
                bad.len(),
                "one event per claim, though the kubelet asked twice: {events:#?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "events missing: {events:#?}\n{}",
            n.driver_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let checkpoint: Value =
        serde_json::from_slice(&std::fs::read(n.plugin_dir.join("checkpoint.json")).unwrap())
            .unwrap();
    let mut prepared: Vec<&str> = checkpoint["claims"]
        .as_object()
        .unwrap()
        .values()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    prepared.sort();
    assert_eq!(prepared, ["eighty", "fine"], "{checkpoint:#}");
    let s = n.node.status_json().unwrap();
    let pods: Vec<&str> = s["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pod"].as_str().unwrap())
        .collect();
    assert!(
        pods.iter().all(|p| *p == "eighty" || *p == "pod-fine"),
        "groups only for prepared claims: {pods:?}"
    );
    assert!(
        n.kubelet.unprepare(&bad[2].0.1).await.error.is_empty(),
        "unprepare of a claim never prepared"
    );
}

/// The DRA variant of the manifests (`deploy/kubernetes-dra`: the base with its `dra`
/// component) renders with `kubectl kustomize`; its objects and the example claim template and
/// pod pass strict schema validation for Kubernetes 1.34; its DeviceClass is the one the
/// driver's devices are made for.
#[test]
fn the_dra_manifests_render_and_validate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let rendered = crate::tools::kustomize(&root.join("../kubernetes-dra"));
    for want in [
        "- gpushare-dra\n",
        "kind: DeviceClass",
        "- resourceslices",
        "- resourceclaims",
        "path: /var/lib/kubelet/plugins\n",
        "path: /var/lib/kubelet/plugins_registry\n",
        "path: /var/run/cdi\n",
        "image: gpushare:0.1.0",
    ] {
        assert!(
            rendered.contains(want),
            "the rendered DRA variant lacks {want:?}\n{rendered}"
        );
    }
    assert!(
        !rendered.contains("- gpushare-device-manager\n") && !rendered.contains("device-plugins"),
        "the device plugin is still in the DRA variant\n{rendered}"
    );
    crate::tools::validate("1.34.0", &rendered, &[root.join("examples/dra-pod.yaml")]);
    let class = rendered
        .split("\n---\n")
        .find(|d| d.contains("kind: DeviceClass"))
        .unwrap();
    let want = serde_json::to_value(gpushare_device_manager::dra::slice::device_class()).unwrap();
    let expression = want["spec"]["selectors"][0]["cel"]["expression"]
        .as_str()
        .unwrap();
    assert!(
        class.contains(&format!(
            "name: {}",
            want["metadata"]["name"].as_str().unwrap()
        )) && class.contains(&format!("expression: {expression}")),
        "the manifests' DeviceClass is not the driver's ({expression})\n{class}"
    );
}
