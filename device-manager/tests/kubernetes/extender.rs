//! `gpushare-extender` on three nodes of stand-ins, called as kube-scheduler calls it: each
//! node the simulated GPU(s), the real `gpushare-scheduler` and `gpushare-device-manager` with
//! their metrics endpoints, a fake kubelet and PodResources; one fake API server holding the
//! pods and each node's `gpushare-node` pod (whose named metrics ports the extender scrapes);
//! the real extender binary; the extender API's JSON (`filter` → `prioritize` → `bind`) over
//! HTTP; tenants in kubelet-style cgroups holding real (simulated) GPU memory.

use crate::apiserver::{FakeApiServer, Kind};
use crate::cluster::{
    Cgroup, Driver, Manager, Pod, agent_command_on, cgroups_usable, container_process, free_port,
    fxhash, kubelet_admits,
};
use crate::kubelet::{FakeKubelet, FakePodResources};
use gpushare_device_manager::inventory::RESOURCE;
use gpushare_testkit::harness::{json_lines, target_dir};
use gpushare_testkit::node::{Node, Spin, Tenant};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const GIB: u64 = 1 << 30;

/// One node: its GPUs, scheduler and device manager, kubelet stand-ins, and the units its
/// kubelet assigned so far.
struct GpuNode {
    name: String,
    node: Node,
    kubelet: FakeKubelet,
    podres: FakePodResources,
    manager: Option<Manager>,
    used: BTreeSet<String>,
    /// Ports of the scheduler's and the device manager's metrics.
    ports: [u16; 2],
}

impl GpuNode {
    /// Everything up, the plugin registered, the node's `gpushare-node` pod in the API server.
    /// Its caps may sum to twice a GPU's memory, as a node must allow when pods are placed by
    /// what they use.
    async fn start(name: &str, gpus: u32, api: &FakeApiServer) -> GpuNode {
        let mut node = Node::device_only_with(&["--gpus", &gpus.to_string(), "--memory", "8GiB"]);
        let admin_socket = node.tmp.path().join("admin/admin.sock");
        let scheduler_metrics = free_port();
        node.start_scheduler_with(
            false,
            &[
                "--admin-socket",
                admin_socket.to_str().unwrap(),
                "--metrics",
                &format!("127.0.0.1:{scheduler_metrics}"),
                "--memory-overcommit",
                "2",
            ],
        );
        let kubeconfig = api.kubeconfig(node.tmp.path());
        let kubelet = FakeKubelet::start(&node.tmp.path().join("device-plugins"));
        let podres = FakePodResources::start(&node.tmp.path().join("pod-resources.sock"));
        let manager_metrics = free_port();
        let log = node.tmp.path().join("manager.log");
        let mut cmd = agent_command_on(
            name,
            &node,
            "gpushare-device-manager",
            &admin_socket,
            &kubeconfig,
            &log,
        );
        cmd.arg("--device-plugin-dir")
            .arg(&kubelet.dir)
            .arg("--pod-resources-socket")
            .arg(&podres.socket)
            .arg("--metrics")
            .arg(format!("127.0.0.1:{manager_metrics}"));
        let manager = Manager::spawn(cmd, log);
        kubelet.wait_registrations(1, Duration::from_secs(30)).await;
        api.create_pod(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("gpushare-node-{name}"), "namespace": "gpushare-system",
                "labels": {"app.kubernetes.io/name": "gpushare-node"}},
            "spec": {"nodeName": name, "containers": [{"name": "gpushare", "image": "gpushare:0.1.0",
                "ports": [{"name": "metrics", "containerPort": scheduler_metrics},
                          {"name": "dm-metrics", "containerPort": manager_metrics}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1"}
        }));
        GpuNode {
            name: name.to_string(),
            node,
            kubelet,
            podres,
            manager: Some(manager),
            used: BTreeSet::new(),
            ports: [scheduler_metrics, manager_metrics],
        }
    }

    /// The node's GPUs (UUIDs), as its device plugin advertises them.
    async fn gpus(&self) -> Vec<String> {
        let mut plugin = self.kubelet.plugin().await;
        let ids: BTreeSet<String> = crate::kubelet::devices(&mut plugin)
            .await
            .iter()
            .filter_map(|d| d.id.split_once("::").map(|(g, _)| g.to_string()))
            .collect();
        ids.into_iter().collect()
    }

    /// The kubelet admits pod `name` (bound here): the device manager's preferred units,
    /// `Allocate`, the assignment, the container's ID.
    async fn admit(&mut self, api: &FakeApiServer, name: &str, units: u32) -> Pod {
        kubelet_admits(
            api,
            &self.kubelet,
            &self.podres,
            &mut self.used,
            name,
            units,
        )
        .await
    }

    /// A process of `pod`'s container holding `mib` MiB of GPU memory (idle otherwise) until
    /// it is dropped.
    fn hold(&self, pod: &Pod, cg: &Cgroup, mib: usize) -> Tenant {
        let args = Spin::for_ms(1.0, 600_000.0)
            .idle_ms(100.0)
            .alloc_mib(mib)
            .args();
        self.node
            .spawn(container_process(&self.node, pod, cg, &args))
    }

    fn manager_log(&self) -> String {
        std::fs::read_to_string(self.node.tmp.path().join("manager.log")).unwrap_or_default()
    }
}

/// Units of `pod` on one GPU: its UUID.
fn gpu_of(pod: &Pod) -> String {
    let gpus: BTreeSet<&str> = pod
        .devices
        .iter()
        .filter_map(|d| d.split_once("::").map(|(g, _)| g))
        .collect();
    assert_eq!(gpus.len(), 1, "units from several GPUs: {:?}", pod.devices);
    gpus.into_iter().next().unwrap().to_string()
}

/// A pod for the `gpushare` scheduler, not yet bound: one container `main` asking for
/// `units`, with a memory cap.
fn new_pod(api: &FakeApiServer, name: &str, units: u32, memory: &str) -> Value {
    let uid = format!("{:08x}-1d2c-4b6a-8e0f-5a4b3c2d1e0f", fxhash(name) as u32);
    pod_with(
        api,
        name,
        &uid,
        units,
        json!({"gpushare.io/gpu-memory": memory}),
    )
}

/// As [`new_pod`], with its UID and annotations given.
fn pod_with(api: &FakeApiServer, name: &str, uid: &str, units: u32, annotations: Value) -> Value {
    api.create(
        Kind::Pod,
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": uid,
                "annotations": annotations},
            "spec": {"schedulerName": "gpushare", "containers": [{"name": "main", "image": "cuda-app",
                "resources": {"limits": {RESOURCE: units.to_string()}}}]},
            "status": {"phase": "Pending"}
        }),
    )
}

fn pod_of(api: &FakeApiServer, name: &str) -> Value {
    api.list(Kind::Pod, "default")
        .into_iter()
        .find(|p| p["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no pod {name}"))
}

/// The extender process and kube-scheduler's side of its HTTP API.
struct Extender {
    addr: SocketAddr,
    _process: Manager,
}

impl Extender {
    /// `gpushare-extender serve --policy predicted ARGS…`, listening.
    fn start(kubeconfig: &std::path::Path, log: &std::path::Path, args: &[&str]) -> Extender {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let err = std::fs::File::create(log).unwrap();
        let mut cmd = Command::new(target_dir().join("gpushare-extender"));
        cmd.args([
            "serve",
            "--policy",
            "predicted",
            "--listen",
            &addr.to_string(),
        ])
        .args(["--scrape-interval", "200ms", "--stale-after", "5s"])
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .env("GPUSHARE_LOG", "info")
        .stdout(Stdio::null())
        .stderr(err);
        let process = Manager::spawn(cmd, log.to_path_buf());
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "the extender did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        Extender {
            addr,
            _process: process,
        }
    }

    /// `METHOD path` with a JSON body (POST) or none (GET): status and body.
    async fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut s = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        let text = String::from_utf8_lossy(&out).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (status, body.to_string())
    }

    async fn post(&self, path: &str, body: &Value) -> Value {
        let (status, text) = self.call("POST", path, Some(body)).await;
        assert_eq!(status, 200, "{path}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
    }

    /// `POST /filter` as kube-scheduler sends it with `nodeCacheCapable: true`: the nodes kept
    /// and the others with why.
    async fn filter(&self, pod: &Value, nodes: &[&str]) -> (Vec<String>, BTreeMap<String, String>) {
        let r = self
            .post("/filter", &json!({"pod": pod, "nodenames": nodes}))
            .await;
        assert!(r["error"].as_str().unwrap_or("").is_empty(), "{r}");
        let kept = serde_json::from_value(r["nodenames"].clone()).unwrap_or_default();
        let failed = serde_json::from_value(r["failedNodes"].clone()).unwrap_or_default();
        (kept, failed)
    }

    /// What kube-scheduler does with the extender for `pod` among `nodes`: filter,
    /// prioritize the nodes kept, the highest score (the first of equals), bind. The node.
    async fn schedule(&self, pod: &Value, nodes: &[&str]) -> String {
        let (kept, failed) = self.filter(pod, nodes).await;
        assert!(!kept.is_empty(), "no node kept: {failed:?}");
        let scores = self
            .post("/prioritize", &json!({"pod": pod, "nodenames": kept}))
            .await;
        let mut best: Option<(i64, String)> = None;
        for s in scores.as_array().unwrap() {
            let (host, score) = (s["host"].as_str().unwrap(), s["score"].as_i64().unwrap());
            if best.as_ref().is_none_or(|(b, _)| score > *b) {
                best = Some((score, host.to_string()));
            }
        }
        let node = best.expect("prioritize answered no node").1;
        let m = &pod["metadata"];
        let r = self
            .post(
                "/bind",
                &json!({"podName": m["name"], "podNamespace": m["namespace"],
                    "podUID": m["uid"], "node": node}),
            )
            .await;
        assert!(r["error"].as_str().unwrap_or("").is_empty(), "bind: {r}");
        node
    }

    async fn metrics(&self) -> String {
        self.call("GET", "/metrics", None).await.1
    }
}

/// Debian's Prometheus scraping every node's two metrics endpoints each second, each target
/// labelled with its node (`node`) and, as the usual Kubernetes scrape configs do, with the
/// scraped pod's own `namespace` and `pod` (so Prometheus renames the tenants' labels to
/// `exported_namespace` / `exported_pod`); its URL once it is ready.
fn start_prometheus(nodes: &[&GpuNode], dir: &std::path::Path) -> (Manager, String) {
    let mut config = String::from(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n- job_name: gpushare\n  static_configs:\n",
    );
    for n in nodes {
        config.push_str(&format!(
            "  - targets: ['127.0.0.1:{}', '127.0.0.1:{}']\n    labels:\n      node: {}\n      namespace: gpushare-system\n      pod: gpushare-node-{}\n",
            n.ports[0], n.ports[1], n.name, n.name
        ));
    }
    let file = dir.join("prometheus.yml");
    std::fs::write(&file, config).unwrap();
    let port = free_port();
    let log = dir.join("prometheus.log");
    let mut cmd = Command::new(crate::tools::prometheus());
    cmd.arg(format!("--config.file={}", file.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let process = Manager::spawn(cmd, log);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        use std::io::{Read, Write};
        let ready = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok_and(|mut s| {
            let _ = s.write_all(b"GET /-/ready HTTP/1.0\r\n\r\n");
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200")
        });
        if ready {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "prometheus not ready within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    (process, format!("http://127.0.0.1:{port}"))
}

/// Poll `f` every 100 ms until it returns `Some` (at most `timeout`); `what` says what was
/// awaited when it does not.
async fn until<T, F: std::future::Future<Output = Result<T, String>>>(
    timeout: Duration,
    what: &str,
    mut f: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(last) => assert!(
                Instant::now() < deadline,
                "{what}: not within {timeout:?}; last: {last}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Wait until `ext`'s filter keeps exactly `nodes` for `pod` (its books follow watches and
/// scrapes a moment after the change).
async fn until_kept(ext: &Extender, pod: &Value, nodes: &[&str], timeout: Duration, what: &str) {
    until(timeout, what, || async {
        let (kept, failed) = ext.filter(pod, nodes).await;
        (kept == nodes).then_some(()).ok_or(format!("{failed:?}"))
    })
    .await
}

/// Placement follows what pods really use, on three nodes, judged alike by an extender
/// scraping the nodes and one reading the same series from a real Prometheus server
/// (`--prometheus`): a node whose GPUs' caps are committed but whose tenants use little is
/// refused while their use is unknown, then kept and ranked above an empty node
/// (`predicted`); the bind records the GPU on the pod and binds it; the device manager hands
/// out units of the recorded GPU (not its own binpack choice) and the pod's memory cap is
/// enforced there; a node fragmented across its GPUs is refused, not sent a pod it cannot
/// admit; when a tenant's measured use grows the node stops receiving pods; a node whose
/// metrics cannot be read is not chosen (with the reason, counted); a restarted extender
/// rebuilds its books from the API server and the nodes; a pod being deleted frees its GPU
/// for the next at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_places_pods_by_measured_use_on_three_nodes() {
    cgroups_usable().unwrap_or_else(|why| panic!("cannot run: {why}"));
    let api = FakeApiServer::start().await;
    let mut a = GpuNode::start("node-a", 2, &api).await;
    let b = GpuNode::start("node-b", 1, &api).await;
    let mut c = GpuNode::start("node-c", 1, &api).await;
    let nodes = ["node-a", "node-b", "node-c"];
    let tmp = tempfile::tempdir().unwrap();
    let kubeconfig = api.kubeconfig(tmp.path());
    let mut ext = Extender::start(&kubeconfig, &tmp.path().join("extender.log"), &[]);
    // A second extender reading the same series from a real Prometheus server; it only
    // filters, and must judge as the first does.
    let (_prometheus, url) = start_prometheus(&[&a, &b, &c], tmp.path());
    let prom = Extender::start(
        &kubeconfig,
        &tmp.path().join("extender-prometheus.log"),
        &["--prometheus", &url],
    );

    // Every node's metrics read: a small pod may go anywhere.
    let probe = new_pod(&api, "probe", 10, "1Gi");
    for e in [&ext, &prom] {
        until(
            Duration::from_secs(30),
            "all three nodes readable",
            || async {
                let (kept, failed) = e.filter(&probe, &nodes).await;
                (kept.len() == 3).then_some(()).ok_or(format!("{failed:?}"))
            },
        )
        .await;
    }
    api.delete_pod("default", "probe");

    // x (50 units, 7 GiB cap) and y (30 units, 6 GiB cap) on node-a (kube-scheduler's own
    // filters left only node-a): y cannot share x's GPU by caps, so it gets the other one,
    // which the device manager's own binpack choice (the fuller GPU by units) would not give.
    let gpus = a.gpus().await;
    assert_eq!(gpus.len(), 2);
    let x = new_pod(&api, "x", 50, "7Gi");
    assert_eq!(ext.schedule(&x, &["node-a"]).await, "node-a");
    let gx = pod_of(&api, "x")["metadata"]["annotations"]["gpushare.io/gpu"]
        .as_str()
        .expect("the chosen GPU recorded on x")
        .to_string();
    assert!(gpus.contains(&gx), "{gx} is not a GPU of node-a: {gpus:?}");
    // The kubelet admits it at once: the device manager finds the recorded GPU even if its
    // own pod watch has not shown the binding yet.
    let px = a.admit(&api, "x", 50).await;
    assert_eq!(gpu_of(&px), gx, "{}", a.manager_log());
    let y = new_pod(&api, "y", 30, "6Gi");
    assert_eq!(ext.schedule(&y, &["node-a"]).await, "node-a");
    let gy = pod_of(&api, "y")["metadata"]["annotations"]["gpushare.io/gpu"]
        .as_str()
        .expect("the chosen GPU recorded on y")
        .to_string();
    assert_ne!(gy, gx, "y's cap does not fit beside x's");
    let py = a.admit(&api, "y", 30).await;
    assert_eq!(
        gpu_of(&py),
        gy,
        "the device manager did not follow the recorded GPU\n{}",
        a.manager_log()
    );

    // x uses 6 GiB of its 7, y 1 GiB of its 6.
    let cg_x = Cgroup::make(Driver::SystemdV2, &px.uid, &px.container_id);
    let cg_y = Cgroup::make(Driver::SystemdV2, &py.uid, &py.container_id);
    let _hold_x = a.hold(&px, &cg_x, 6 * 1024);
    let _hold_y = a.hold(&py, &cg_y, 1024);

    // p: 30 units, 4 GiB. By caps node-a is full (7 + 4 and 6 + 4 of 8 GiB): refused while the
    // tenants' use is not yet known.
    let p = new_pod(&api, "p", 30, "4Gi");
    for e in [&ext, &prom] {
        let (kept, failed) = e.filter(&p, &["node-a"]).await;
        assert!(kept.is_empty(), "node-a kept before its use was measured");
        assert!(failed["node-a"].contains("predicted policy"), "{failed:?}");
    }
    // Once their use has settled (20 s flat), node-a is kept, and ranked above the empty
    // node-b: the best fit by what is really used.
    let settled = Instant::now();
    for e in [&ext, &prom] {
        until_kept(
            e,
            &p,
            &["node-a"],
            Duration::from_secs(60),
            "node-a kept by measured use",
        )
        .await;
        eprintln!(
            "node-a kept for p {:.1} s after its tenants started",
            settled.elapsed().as_secs_f64()
        );
    }
    let scores = ext
        .post(
            "/prioritize",
            &json!({"pod": p, "nodenames": ["node-a", "node-b"]}),
        )
        .await;
    assert!(
        scores[0]["score"].as_i64() > scores[1]["score"].as_i64(),
        "{scores}"
    );
    assert_eq!(ext.schedule(&p, &nodes).await, "node-a");
    let p_gpu = pod_of(&api, "p")["metadata"]["annotations"]["gpushare.io/gpu"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(p_gpu, gy, "x's GPU holds 6 of 8 GiB");
    let pp = a.admit(&api, "p", 30).await;
    assert_eq!(
        gpu_of(&pp),
        gy,
        "binpack alone would have chosen x's fuller GPU\n{}",
        a.manager_log()
    );
    // Its group is enforced there: its container sees its cap, 4 GiB, and gets all of it
    // beside y's 1 GiB on that GPU.
    let cg_p = Cgroup::make(Driver::CgroupfsV1, &pp.uid, &pp.container_id);
    let fill = container_process(&a.node, &pp, &cg_p, &["oom".into(), "--fill".into()]);
    let out = a.node.spawn(fill).wait_ok(Duration::from_secs(60));
    let report = json_lines(&out.stdout).pop().expect("oom report");
    assert_eq!(report["total"], json!(4 * GIB), "{report}");

    // node-a now has 50 + 40 units free, but on two GPUs: a pod asking 60 is refused there
    // (Kubernetes' count per node would send it, and its admission would fail).
    let big = new_pod(&api, "big", 60, "1Gi");
    let (kept, failed) = ext.filter(&big, &["node-a"]).await;
    assert!(kept.is_empty(), "fragmented node-a kept for 60 units");
    assert!(failed["node-a"].contains("units free"), "{failed:?}");
    api.delete_pod("default", "big");

    // q: 30 units, 2 GiB: fits beside y (1 GiB used, settled) and p (4 GiB, its cap while new).
    let q = new_pod(&api, "q", 30, "2Gi");
    for e in [&ext, &prom] {
        let (kept, failed) = e.filter(&q, &["node-a"]).await;
        assert_eq!(kept, ["node-a"], "{failed:?}");
    }
    // y's use grows to 5 GiB: a misprediction; y counts at its cap again and node-a is full.
    let _grow_y = a.hold(&py, &cg_y, 4 * 1024);
    for e in [&ext, &prom] {
        let failed = until(
            Duration::from_secs(20),
            "node-a refused once y grew",
            || async {
                let (kept, failed) = e.filter(&q, &["node-a"]).await;
                kept.is_empty().then_some(failed).ok_or(format!("{kept:?}"))
            },
        )
        .await;
        assert!(failed["node-a"].contains("memory asked"), "{failed:?}");
        let m = e.metrics().await;
        assert!(
            m.contains("gpushare_extender_mispredictions_total 1\n"),
            "{m}"
        );
    }

    // node-c's device manager stops: its metrics cannot be read, so it is not chosen, with
    // the reason, and counted.
    c.manager = None;
    for e in [&ext, &prom] {
        let failed = until(Duration::from_secs(20), "node-c unreadable", || async {
            let (kept, failed) = e.filter(&q, &nodes).await;
            (!kept.contains(&"node-c".to_string()))
                .then_some(failed)
                .ok_or(format!("{kept:?}"))
        })
        .await;
        assert!(failed["node-c"].contains("unreadable"), "{failed:?}");
        assert!(
            e.metrics()
                .await
                .contains("gpushare_extender_unreadable_node_total{node=\"node-c\"}"),
            "not counted"
        );
    }
    assert_eq!(ext.schedule(&q, &nodes).await, "node-b");
    assert_eq!(
        pod_of(&api, "q")["metadata"]["annotations"]["gpushare.io/gpu"],
        json!(b.gpus().await[0])
    );
    // A pod already bound is not bound again.
    let r = ext
        .post(
            "/bind",
            &json!({"podName": "q", "podNamespace": "default", "node": "node-a"}),
        )
        .await;
    assert!(
        r["error"].as_str().unwrap_or("").contains("already bound"),
        "{r}"
    );

    // The extender restarts: its books come back from the API server and the nodes, not
    // empty. s (80 units) fits no GPU (x 50; y + p 60; q 30 of 100), though every GPU but
    // node-c's has memory for it.
    drop(ext);
    ext = Extender::start(&kubeconfig, &tmp.path().join("extender-2.log"), &[]);
    let s_pod = new_pod(&api, "s", 80, "1Gi");
    let failed = until(
        Duration::from_secs(30),
        "the restarted extender reads node-a and node-b",
        || async {
            let (kept, failed) = ext.filter(&s_pod, &nodes).await;
            assert!(
                kept.is_empty(),
                "{kept:?} kept for 80 units after a restart"
            );
            (failed["node-a"].contains("units free") && failed["node-b"].contains("units free"))
                .then_some(failed.clone())
                .ok_or(format!("{failed:?}"))
        },
    )
    .await;
    assert!(failed["node-c"].contains("unreadable"), "{failed:?}");
    api.delete_pod("default", "s");

    // x is being deleted (its process still holds 6 GiB): r (50 units, 7 GiB) takes its GPU
    // at once.
    let r_pod = new_pod(&api, "r", 50, "7Gi");
    let (kept, _) = ext.filter(&r_pod, &["node-a"]).await;
    assert!(kept.is_empty(), "x's GPU is taken");
    api.update_pod("default", "x", |p| {
        p["metadata"]["deletionTimestamp"] = json!("2030-01-01T00:00:00Z");
    });
    let deleted = Instant::now();
    until_kept(
        &ext,
        &r_pod,
        &["node-a"],
        Duration::from_secs(5),
        "x's GPU free for r",
    )
    .await;
    eprintln!(
        "x's GPU free for the next pod {} ms after its deletion",
        deleted.elapsed().as_millis()
    );
    // Gone from the API server while its kubelet still counts its units (PodResources still
    // lists x, as a kubelet does for a moment), its GPU stays free.
    api.delete_pod("default", "x");
    assert_eq!(ext.schedule(&r_pod, &nodes).await, "node-a");
    assert_eq!(
        pod_of(&api, "r")["metadata"]["annotations"]["gpushare.io/gpu"],
        json!(gx)
    );
}

/// The recorded GPU of pod `name`.
fn recorded_gpu(api: &FakeApiServer, name: &str) -> String {
    pod_of(api, name)["metadata"]["annotations"]["gpushare.io/gpu"]
        .as_str()
        .unwrap_or_else(|| panic!("no GPU recorded on {name}"))
        .to_string()
}

/// Pods that are not what the books last saw: a pod force-deleted and recreated under its
/// name (another UID) is another pod, placed afresh on the units the old one left, and a
/// binding meant for the old one is refused; a `gpushare.io/gpu` annotation written before
/// the binding is replaced by the extender's choice, with a Warning event, and one edited
/// afterwards to contradict where the node reports the pod is told (logged, counted) while
/// the books follow the node; a pod removed while the extender was down is not counted once
/// it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_tells_recreated_pods_apart_follows_the_node_and_forgets_pods_removed_while_down()
 {
    cgroups_usable().unwrap_or_else(|why| panic!("cannot run: {why}"));
    let api = FakeApiServer::start().await;
    let mut a = GpuNode::start("node-a", 2, &api).await;
    let gpus = a.gpus().await;
    assert_eq!(gpus.len(), 2);
    let tmp = tempfile::tempdir().unwrap();
    let kubeconfig = api.kubeconfig(tmp.path());
    let log = tmp.path().join("extender.log");
    let mut ext = Extender::start(&kubeconfig, &log, &[]);
    let probe = new_pod(&api, "probe", 10, "1Gi");
    until_kept(
        &ext,
        &probe,
        &["node-a"],
        Duration::from_secs(30),
        "node-a readable",
    )
    .await;
    api.delete_pod("default", "probe");

    // w (60 units) on node-a, holding 2 GiB.
    let old_uid = "0ld00000-1d2c-4b6a-8e0f-5a4b3c2d1e0f";
    let w = pod_with(
        &api,
        "w",
        old_uid,
        60,
        json!({"gpushare.io/gpu-memory": "4Gi"}),
    );
    assert_eq!(ext.schedule(&w, &["node-a"]).await, "node-a");
    let g_old = recorded_gpu(&api, "w");
    let pw = a.admit(&api, "w", 60).await;
    assert_eq!(gpu_of(&pw), g_old);
    let cg_w = Cgroup::make(Driver::SystemdV2, &pw.uid, &pw.container_id);
    let hold_w = a.hold(&pw, &cg_w, 2 * 1024);
    // The other GPU takes 60 units no more once x (50) is there.
    let x = new_pod(&api, "x", 50, "3Gi");
    assert_eq!(ext.schedule(&x, &["node-a"]).await, "node-a");
    let g_x = recorded_gpu(&api, "x");
    assert_ne!(g_x, g_old, "60 + 50 units do not share a GPU");
    let px = a.admit(&api, "x", 50).await;
    assert_eq!(gpu_of(&px), g_x);

    // w is force-deleted (gone from the API server at once, its process still running) and
    // created again under its name with another UID: the new w is placed afresh, on the
    // units the old one leaves, and a binding meant for the old one is refused.
    api.delete_pod("default", "w");
    let new_uid = "9e300000-1d2c-4b6a-8e0f-5a4b3c2d1e0f";
    let w2 = pod_with(
        &api,
        "w",
        new_uid,
        60,
        json!({"gpushare.io/gpu-memory": "4Gi"}),
    );
    let r = ext
        .post(
            "/bind",
            &json!({"podName": "w", "podNamespace": "default", "podUID": old_uid, "node": "node-a"}),
        )
        .await;
    assert!(
        r["error"].as_str().unwrap_or("").contains("recreated"),
        "{r}"
    );
    // The extender learns of the deletion from its watch, a moment after the API server.
    until_kept(
        &ext,
        &w2,
        &["node-a"],
        Duration::from_secs(30),
        "the old w's units free",
    )
    .await;
    assert_eq!(ext.schedule(&w2, &["node-a"]).await, "node-a");
    assert_eq!(
        recorded_gpu(&api, "w"),
        g_old,
        "the only GPU with 60 units free"
    );
    // The kubelet lets go of the old w's units before it admits the new one (as a kubelet
    // reclaims the devices of pods no longer active), and its container ends.
    a.podres.forget("default", "w");
    a.used.retain(|d| !pw.devices.contains(d));
    drop(hold_w);
    let pw2 = a.admit(&api, "w", 60).await;
    assert_eq!(gpu_of(&pw2), g_old, "{}", a.manager_log());
    assert_ne!(pw2.uid, pw.uid);
    // Counted once, as one share: 40 units left on its GPU, 50 on x's.
    let y = new_pod(&api, "y", 45, "1Gi");
    let (kept, failed) = ext.filter(&y, &["node-a"]).await;
    assert_eq!(kept, ["node-a"], "{failed:?}");
    let z = new_pod(&api, "z", 55, "1Gi");
    let (kept, failed) = ext.filter(&z, &["node-a"]).await;
    assert!(kept.is_empty(), "55 units fit no GPU");
    assert!(failed["node-a"].contains("units free"), "{failed:?}");
    api.delete_pod("default", "z");

    // y was written to go on w's GPU beforehand: the extender's choice (x's GPU, the only
    // one with 45 units free) replaces it, with a Warning event on y.
    api.update_pod("default", "y", |p| {
        p["metadata"]["annotations"]["gpushare.io/gpu"] = json!(g_old);
    });
    let y = pod_of(&api, "y");
    assert_eq!(ext.schedule(&y, &["node-a"]).await, "node-a");
    assert_eq!(recorded_gpu(&api, "y"), g_x);
    let event = until(
        Duration::from_secs(10),
        "the Warning event on y",
        || async {
            api.events("default")
                .into_iter()
                .find(|e| e["reason"] == "GpuAnnotationReplaced")
                .ok_or("none yet".to_string())
        },
    )
    .await;
    assert_eq!(event["involvedObject"]["name"], "y", "{event}");
    assert_eq!(event["type"], "Warning", "{event}");
    assert!(event["message"].as_str().unwrap().contains(&g_x), "{event}");
    assert_eq!(
        event["reportingComponent"], "gpushare.io/extender",
        "{event}"
    );
    assert_eq!(event["action"], "Bind", "{event}");
    let py = a.admit(&api, "y", 45).await;
    assert_eq!(gpu_of(&py), g_x, "{}", a.manager_log());
    // Then y's annotation is edited to name w's GPU: the node reports y's memory on x's GPU,
    // and that is what the books follow (told and counted once).
    let cg_y = Cgroup::make(Driver::SystemdV2, &py.uid, &py.container_id);
    let _hold_y = a.hold(&py, &cg_y, 512);
    api.update_pod("default", "y", |p| {
        p["metadata"]["annotations"]["gpushare.io/gpu"] = json!(g_old);
    });
    until(
        Duration::from_secs(20),
        "the contradiction counted",
        || async {
            let m = ext.metrics().await;
            m.contains("gpushare_extender_gpu_annotation_conflicts_total 1\n")
                .then_some(())
                .ok_or(m)
        },
    )
    .await;
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains(&format!("reports its memory on {g_x}")),
        "{logged}"
    );
    // 40 units left on w's GPU, as before: y is not counted there.
    let v = new_pod(&api, "v", 40, "1Gi");
    let (kept, failed) = ext.filter(&v, &["node-a"]).await;
    assert_eq!(kept, ["node-a"], "{failed:?}");
    api.delete_pod("default", "v");

    // The extender stops; meanwhile x is removed (from the API server and its kubelet).
    // Back, it rebuilds its books from the API server and the node: x is not counted, so
    // 55 units fit beside y on x's GPU, and 60 fit nowhere.
    drop(ext);
    api.delete_pod("default", "x");
    a.podres.forget("default", "x");
    a.used.retain(|d| !px.devices.contains(d));
    ext = Extender::start(&kubeconfig, &tmp.path().join("extender-2.log"), &[]);
    let big = new_pod(&api, "big", 55, "1Gi");
    until_kept(
        &ext,
        &big,
        &["node-a"],
        Duration::from_secs(30),
        "the restarted extender keeps node-a for 55 units",
    )
    .await;
    let bigger = new_pod(&api, "bigger", 60, "1Gi");
    let (kept, failed) = ext.filter(&bigger, &["node-a"]).await;
    assert!(kept.is_empty(), "w 60 and y 45 leave 40 and 55 units");
    assert!(failed["node-a"].contains("units free"), "{failed:?}");
}
