//! The node agents on nodes of stand-ins: gpushare-device-manager (see `cluster.rs`; here) and
//! gpushare-dra (`dra.rs`), each the real agent with the real scheduler and hook on the
//! simulated GPU, fake kubelets and API server, the real `kubectl`, tenants in kubelet-style
//! cgroups; and the scheduler extender placing pods on three such nodes (`extender.rs`).

mod apiserver;
mod cluster;
mod dra;
mod drakubelet;
mod extender;
mod kubelet;
mod tools;

use cluster::{Cgroup, Cluster, Driver, cgroups_usable};
use gpushare_device_manager::proto::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty,
    PreferredAllocationRequest,
};
use gpushare_testkit::harness::{describe, json_lines, target_dir};
use gpushare_testkit::node::{Spin, common_active_window, monotonic_ns, shares_in, wait_for};
use gpushare_testkit::trace::Window;
use kubelet::{FakeKubelet, FakePodResources};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;

/// A simulated device of our own (`gpushare-sim serve`) whose socket and library directory
/// outlive it, so that another device with fewer GPUs can take its place.
struct Device {
    child: Child,
}

impl Device {
    fn start(socket: &Path, gpus: u32) -> Device {
        let child = Command::new(target_dir().join("gpushare-sim"))
            .args([
                "serve",
                "--gpus",
                &gpus.to_string(),
                "--memory",
                "8GiB",
                "--socket",
            ])
            .arg(socket)
            .stdout(Stdio::null())
            .spawn()
            .expect("start gpushare-sim serve");
        wait_for(socket);
        Device { child }
    }

    fn stop(mut self, socket: &Path) {
        // SIGTERM: the device shuts down cleanly.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(socket);
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `libcuda.so` and `libcuda.so.1` (the simulated driver) in a directory of their own.
fn driver_dir(dir: &Path) -> PathBuf {
    let lib = dir.join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    for name in ["libcuda.so", "libcuda.so.1"] {
        let _ = std::os::unix::fs::symlink(target_dir().join("libcuda.so"), lib.join(name));
    }
    lib
}

fn healthy(devs: &[gpushare_device_manager::proto::deviceplugin::Device], gpu: &str) -> Vec<bool> {
    devs.iter()
        .filter(|d| d.id.starts_with(&format!("{gpu}::")))
        .map(|d| d.health == "Healthy")
        .collect()
}

/// The device plugin alone: registration, units, placement, Allocate, refusals, a kubelet
/// restart, a GPU that disappears — all while the API server is unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_plugin_serves_the_kubelet_without_an_api_server() {
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("sim.sock");
    let device = Device::start(&socket, 2);
    let kubelet_dir = tmp.path().join("device-plugins");
    let mut kubelet = FakeKubelet::start(&kubelet_dir);
    let podres = FakePodResources::start(&tmp.path().join("pod-resources.sock"));
    // A kubeconfig naming a port nobody listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let kubeconfig = tmp.path().join("kubeconfig");
    std::fs::write(&kubeconfig, format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://{dead}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n"
    )).unwrap();
    let hook_dir = tmp.path().join("hook");
    let log = tmp.path().join("manager.log");
    let mut manager = Command::new(target_dir().join("gpushare-device-manager"))
        .args(["--node-name", "node-1", "--health-interval", "200ms"])
        .arg("--device-plugin-dir")
        .arg(&kubelet_dir)
        .arg("--pod-resources-socket")
        .arg(&podres.socket)
        .arg("--scheduler-socket")
        .arg(tmp.path().join("no-scheduler.sock"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--hook-library")
        .arg(target_dir().join("libgpushare.so"))
        .arg("--hook-dir")
        .arg(&hook_dir)
        .env("GPUSHARE_SIM_SOCKET", &socket)
        .env("LD_LIBRARY_PATH", driver_dir(tmp.path()))
        .env("GPUSHARE_LOG", "info")
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start gpushare-device-manager");
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    struct Kill<'a>(&'a mut Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _kill = Kill(&mut manager);

    kubelet.wait_registrations(1, Duration::from_secs(30)).await;
    let reg = kubelet.registrations()[0].1.clone();
    assert_eq!(reg.resource_name, "gpushare.io/gpu-share");
    assert!(reg.options.unwrap().get_preferred_allocation_available);
    let mut plugin = kubelet.plugin().await;
    let devs = kubelet::devices(&mut plugin).await;
    assert_eq!(devs.len(), 200, "100 units per GPU, 2 GPUs");
    let gpus: std::collections::BTreeSet<String> = devs
        .iter()
        .map(|d| d.id.split_once("::").unwrap().0.to_string())
        .collect();
    let gpus: Vec<String> = gpus.into_iter().collect();
    assert_eq!(gpus.len(), 2);
    assert!(devs.iter().all(|d| d.health == "Healthy"));

    // Binpack: with 40 units of GPU 0 in use, 30 more come from GPU 0.
    let available: Vec<String> = devs
        .iter()
        .map(|d| d.id.clone())
        .filter(|id| {
            !(id.starts_with(&gpus[0])
                && id.split("::").nth(1).unwrap().parse::<u32>().unwrap() < 40)
        })
        .collect();
    let ask = |size: i32, available: Vec<String>| PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available,
            must_include_device_i_ds: vec![],
            allocation_size: size,
        }],
    };
    let pref = plugin
        .get_preferred_allocation(ask(30, available.clone()))
        .await
        .unwrap()
        .into_inner()
        .container_responses[0]
        .device_i_ds
        .clone();
    assert_eq!(pref.len(), 30);
    assert!(
        pref.iter()
            .all(|id| id.starts_with(&format!("{}::", gpus[0]))),
        "{pref:?}"
    );
    let err = plugin
        .get_preferred_allocation(ask(150, available))
        .await
        .unwrap_err();
    assert!(err.message().contains("whole GPUs"), "{}", err.message());

    let resp = plugin
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: pref }],
        })
        .await
        .unwrap()
        .into_inner()
        .container_responses
        .remove(0);
    assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], gpus[0]);
    assert_eq!(resp.envs["GPUSHARE_SOCKET"], "/run/gpushare/gpushare.sock");
    assert_eq!(resp.envs["LD_PRELOAD"], "/usr/lib/gpushare/libgpushare.so");
    let hook = resp
        .mounts
        .iter()
        .find(|m| m.container_path == "/usr/lib/gpushare")
        .expect("hook mount");
    assert!(hook.read_only);
    assert!(
        hook.host_path.starts_with(hook_dir.to_str().unwrap()),
        "versioned dir under --hook-dir"
    );
    assert_eq!(
        std::fs::read(Path::new(&hook.host_path).join("libgpushare.so")).unwrap(),
        std::fs::read(target_dir().join("libgpushare.so")).unwrap()
    );
    let split: Vec<String> = (0..10)
        .flat_map(|n| [format!("{}::{n}", gpus[0]), format!("{}::{n}", gpus[1])])
        .collect();
    let err = plugin
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: split }],
        })
        .await
        .unwrap_err();
    assert!(err.message().contains("several GPUs"), "{}", err.message());

    // The kubelet restarts: the plugin registers again on its new socket.
    let restarted = kubelet.restart().await;
    let again = kubelet.wait_registrations(2, Duration::from_secs(10)).await;
    let took = again.duration_since(restarted);
    eprintln!(
        "re-registered {} ms after the kubelet restarted",
        took.as_millis()
    );
    assert!(
        took < Duration::from_secs(2),
        "re-registration took {took:?}\n{}",
        log_text()
    );
    let mut plugin = kubelet.plugin().await;
    let mut stream = plugin.list_and_watch(Empty {}).await.unwrap().into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().devices.len(), 200);

    // GPU 1 disappears: the driver now reports one GPU.
    device.stop(&socket);
    let _device = Device::start(&socket, 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let msg = tokio::time::timeout(deadline - Instant::now(), stream.message())
            .await
            .unwrap_or_else(|_| panic!("GPU 1 never turned unhealthy\n{}", log_text()))
            .unwrap()
            .unwrap();
        let (h0, h1) = (
            healthy(&msg.devices, &gpus[0]),
            healthy(&msg.devices, &gpus[1]),
        );
        if h0.len() == 100 && h0.iter().all(|h| *h) && h1.len() == 100 && h1.iter().all(|h| !*h) {
            break;
        }
    }
}

/// The whole path: pods with 30 and 70 units get 0.3 / 0.7 of the GPU; `kubectl annotate`
/// caps the first at 0.2 without a restart; `gpu-memory: 2Gi` holds; a bad annotation becomes
/// a Warning event while the pod keeps running; an unregistered pod's process is refused
/// after 2 s; metrics and status name the pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_get_the_shares_their_units_and_annotations_say() {
    cgroups_usable().unwrap_or_else(|why| panic!("cannot run: {why}"));
    let mut c = Cluster::start(&["--memory", "8GiB"], &[]).await;
    let a = c
        .admit(
            "train-a",
            30,
            json!({"gpushare.io/gpu-memory": "2Gi", "gpushare.io/gpu-weight": "4"}),
        )
        .await;
    let b = c.admit("train-b", 70, json!({})).await;
    let group_a = "default/train-a/main";
    let group_b = "default/train-b/main";
    c.wait_status(Duration::from_secs(10), |s| {
        s["pods"].as_array().is_some_and(|p| p.len() == 2)
    });
    let cg_a = Cgroup::make(Driver::SystemdV2, &a.uid, &a.container_id);
    let cg_b = Cgroup::make(Driver::CgroupfsV1, &b.uid, &b.container_id);

    // Memory: the container of train-a sees and gets 2 GiB.
    let oom = c.container_process(&a, &cg_a, &["oom".into(), "--fill".into()]);
    let out = c.spawn(oom).wait_ok(Duration::from_secs(60));
    let report = json_lines(&out.stdout).pop().expect("oom report");
    assert_eq!(report["total"], json!(2 * GIB), "{report}");
    assert_eq!(report["quarters_allocated"], json!(4), "{report}");

    // A process of a pod the manager never registered waits 2 s, then is told why.
    let stranger = Cgroup::make(
        Driver::SystemdV2,
        "9e1c8e3a-6f0e-4a57-9a39-8f2d3c1b7e11",
        &"ab".repeat(32),
    );
    let mut status = stranger.command(&target_dir().join("gpushare"), &["status".to_string()]);
    status.env("GPUSHARE_SOCKET", &c.node.sched_socket);
    let t = Instant::now();
    let out = c.spawn(status).finish_within(Duration::from_secs(20)).0;
    let waited = t.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no gpushare policy"),
        "{}",
        describe(&out)
    );
    assert!(
        waited >= Duration::from_millis(1900),
        "refused after {waited:?}, before the 2 s wait"
    );
    drop(stranger);

    let spin = Spin::for_ms(1.0, 10_000.0).args();
    let t_a = c.spawn(c.container_process(&a, &cg_a, &spin));
    let t_b = c.spawn(c.container_process(&b, &cg_b, &spin));
    let (pid_a, pid_b) = (t_a.pid(), t_b.pid());
    // Both identified from their cgroups: each group lists its tenant's pid.
    let on_gpu = |s: &Value, g: &str, pid: u32| {
        gpushare_testkit::node::group_in(s, g).is_some_and(|x| {
            x["pids"]
                .as_array()
                .is_some_and(|p| p.contains(&json!(pid)))
        })
    };
    c.wait_status(Duration::from_secs(20), |s| {
        on_gpu(s, group_a, pid_a) && on_gpu(s, group_b, pid_b)
    });
    // Window A: from when both run (+0.5 s) until the annotation; measured from the trace.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let annotate_ns = monotonic_ns();

    // Cap train-a at 0.2 with kubectl, without a restart.
    c.kubectl(&[
        "annotate",
        "pod",
        "train-a",
        "gpushare.io/gpu-limit=0.2",
        "--overwrite",
    ]);
    let annotated = Instant::now();
    c.wait_status(Duration::from_secs(5), |s| {
        gpushare_testkit::node::group_in(s, group_a).is_some_and(|g| g["limit"] == json!(0.2))
    });
    let latency = annotated.elapsed();
    eprintln!(
        "kubectl annotate → scheduler limit in {} ms",
        latency.as_millis()
    );
    assert!(
        latency < Duration::from_secs(1),
        "the new limit took {latency:?}"
    );
    // Window B: from 0.5 s after the scheduler took the limit until the tenants stop.
    let capped_ns = monotonic_ns() + 500_000_000;

    // A bad annotation: a Warning event, the metric, and train-b keeps its policy and runs.
    c.kubectl(&[
        "annotate",
        "pod",
        "train-b",
        "gpushare.io/gpu-weight=heavy",
        "--overwrite",
    ]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let events = loop {
        let ev = c.kubectl(&["get", "events"]);
        if ev.contains("InvalidGpushareAnnotation") {
            break ev;
        }
        assert!(
            Instant::now() < deadline,
            "no event\n{ev}\n{}",
            c.manager_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("kubectl get events:\n{events}");
    assert!(
        events.contains("Warning")
            && events.contains("pod/train-b")
            && events.contains("gpushare.io/gpu-weight"),
        "{events}"
    );
    let sched = c.scheduler_metrics();
    assert!(
        sched.contains("group=\"default/train-a/main\",namespace=\"default\",pod=\"train-a\",container=\"main\"}"),
        "{sched}"
    );
    let posted = c.api.events("default");
    assert_eq!(posted.len(), 1, "one event per problem: {posted:?}");
    assert_eq!(posted[0]["involvedObject"]["uid"], json!(b.uid));
    assert_eq!(
        posted[0]["reportingComponent"],
        json!("gpushare.io/gpushare-device-manager"),
        "{posted:?}"
    );
    assert_eq!(posted[0]["action"], json!("ApplyPolicy"), "{posted:?}");
    let metrics = c.manager_metrics();
    assert!(
        metrics.contains("gpushare_annotation_errors_total{namespace=\"default\",pod=\"train-b\",annotation=\"gpushare.io/gpu-weight\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("gpushare_device_manager_allocated_units{gpu=\"0\","),
        "{metrics}"
    );
    let s = c.node.status_json().unwrap();
    assert_eq!(
        gpushare_testkit::node::group_in(&s, group_b).unwrap()["weight"],
        json!(1.0)
    );
    let text = Command::new(target_dir().join("gpushare"))
        .arg("status")
        .env("GPUSHARE_SOCKET", &c.node.sched_socket)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("Kubernetes containers")
            && text.contains("train-a")
            && text.contains("running"),
        "{text}"
    );

    t_a.wait_ok(Duration::from_secs(60));
    t_b.wait_ok(Duration::from_secs(60));

    // Pod deleted: its group goes (no process left).
    c.api.delete_pod("default", "train-a");
    c.podres.forget("default", "train-a");
    c.wait_status(Duration::from_secs(10), |s| {
        gpushare_testkit::node::group_in(s, group_a).is_none()
            && s["pods"].as_array().is_some_and(|p| p.len() == 1)
    });
    drop((cg_a, cg_b));

    let trace = c.finish();
    let both = common_active_window(&trace, &[pid_a, pid_b], 500_000_000);
    let win_a = Window::new(both.start_ns, annotate_ns);
    assert!(
        win_a.len_ns() >= 1_500_000_000,
        "both tenants ran together only {win_a} before the annotation"
    );
    let sa = shares_in(&trace, &[pid_a, pid_b], win_a);
    let win_b = Window::new(capped_ns, both.end_ns);
    assert!(
        win_b.len_ns() >= 2_000_000_000,
        "both tenants ran together only {win_b} after the cap"
    );
    let sb = shares_in(&trace, &[pid_a, pid_b], win_b);
    // On a loaded 2-core machine the tenants' hosts sometimes cannot keep the GPU busy; the
    // split of the busy time is what the scheduler decides.
    let split = |s: &[f64]| s[0] / (s[0] + s[1]);
    let (fa, fb) = (split(&sa), split(&sb));
    eprintln!(
        "requests 0.3 / 0.7 over {win_a}: {:.3} / {:.3} of wall time, {fa:.3} / {:.3} of busy time",
        sa[0],
        sa[1],
        1.0 - fa
    );
    eprintln!(
        "train-a capped at 0.2 (weight 4) over {win_b}: {:.3} / {:.3} of wall time, {fb:.3} / {:.3} of busy time",
        sb[0],
        sb[1],
        1.0 - fb
    );
    assert!(
        (fa - 0.3).abs() <= 0.06,
        "split {fa:.3} / {:.3}, want 0.3 / 0.7",
        1.0 - fa
    );
    // Uncapped, train-a's weight 4 would take 0.28 (0.2 + 4/5 of the spare 0.1).
    assert!((fb - 0.2).abs() <= 0.06, "capped split {fb:.3}, want 0.2");
    assert!(
        sb[0] <= 0.23,
        "train-a got {:.3} of wall time, over its cap",
        sb[0]
    );
    assert!(
        fb < fa - 0.05,
        "the cap did not lower train-a's share: {fa:.3} → {fb:.3}"
    );
}

/// `deploy/kubernetes` renders with `kubectl kustomize` and its objects (and the example pod)
/// pass strict schema validation for Kubernetes 1.30, the first with admission policies v1;
/// so does `deploy/with-extender`, the base with the scheduler extender's component.
#[test]
fn the_manifests_render_and_validate() {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let rendered = tools::kustomize(&base);
    for want in [
        "kind: DaemonSet",
        "hostPID: true",
        "priorityClassName: system-node-critical",
        "kind: ValidatingAdmissionPolicy\n",
        "kind: ValidatingAdmissionPolicyBinding",
        "path: /var/lib/kubelet/device-plugins",
        "path: /var/lib/kubelet/pod-resources",
        "path: /run/gpushare",
        "path: /var/lib/gpushare",
        "image: gpushare:0.1.0",
        "kind: ConfigMap",
        "memory_overcommit = 1\n",
        "- --config=/etc/gpushare/scheduler.toml",
        "mountPath: /etc/gpushare",
    ] {
        assert!(
            rendered.contains(want),
            "the rendered base lacks {want:?}\n{rendered}"
        );
    }
    // The daemons' CPU: a request (their weight on a node whose cores are saturated), never a
    // limit (a CFS quota stops a cgroup for the rest of its period, longer than the tenants'
    // liveness bound); docs/kubernetes.md#resources.
    assert_eq!(
        rendered.matches("requests:\n            cpu: 50m").count(),
        2,
        "both containers request 50m of CPU\n{rendered}"
    );
    assert!(
        !rendered.contains("limits:\n            cpu:"),
        "no container has a CPU limit\n{rendered}"
    );
    // The scheduler's memory limit is above what its default connection bounds allow: 4096
    // connections, each a 64 KiB frame being read and 256 KiB of unread replies, and its own
    // 16 MiB (docs/kubernetes.md#resources).
    let limits_mib: Vec<u64> = (rendered.split("limits:\n            memory: ").skip(1))
        .filter_map(|rest| rest.split("Mi").next()?.parse().ok())
        .collect();
    let bound_mib = 4096 * (64 + 256) / 1024 + 16;
    assert!(
        limits_mib.iter().any(|&l| l >= bound_mib),
        "no container's memory limit ({limits_mib:?} MiB) holds the scheduler's connection bounds ({bound_mib} MiB)\n{rendered}"
    );
    tools::validate("1.30.0", &rendered, &[base.join("examples/pod.yaml")]);
    // With the scheduler extender's component: its scheduler, configuration and RBAC.
    let overlay = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/with-extender");
    let rendered = tools::kustomize(&overlay);
    for want in [
        "kind: DaemonSet",
        "kind: KubeSchedulerConfiguration",
        "schedulerName: gpushare",
        "filterVerb: filter",
        "prioritizeVerb: prioritize",
        "bindVerb: bind",
        "nodeCacheCapable: true",
        "name: gpushare.io/gpu-share",
        "- gpushare-extender",
        "resources:\n  - pods/binding",
        "name: system:kube-scheduler",
    ] {
        assert!(
            rendered.contains(want),
            "the rendered overlay lacks {want:?}\n{rendered}"
        );
    }
    tools::validate("1.30.0", &rendered, &[]);
}

/// The last known policy stays in force while the API server is down, across a manager
/// restart in that state; the watch recovers from a compaction (410 Gone) by relisting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_survives_api_outages_manager_restarts_and_compaction() {
    cgroups_usable().unwrap_or_else(|why| panic!("cannot run: {why}"));
    let mut c = Cluster::start(&[], &[]).await;
    let p = c
        .admit("serve", 40, json!({"gpushare.io/gpu-limit": "0.5"}))
        .await;
    let group = "default/serve/main";
    // The container's entry in the scheduler's pod table has the limit.
    let limit_is = |want: f64| {
        move |s: &Value| {
            s["pods"].as_array().is_some_and(|p| {
                p.iter()
                    .any(|p| p["group"] == group && p["limit"] == json!(want))
            })
        }
    };
    c.wait_status(Duration::from_secs(10), limit_is(0.5));
    let cg = Cgroup::make(Driver::SystemdV2, &p.uid, &p.container_id);
    let spin = Spin::for_ms(1.0, 60_000.0).args();
    let tenant = c.spawn(c.container_process(&p, &cg, &spin));
    let pid = tenant.pid();
    let has_pid = move |s: &Value| {
        gpushare_testkit::node::group_in(s, group).is_some_and(|g| {
            g["pids"]
                .as_array()
                .is_some_and(|v| v.contains(&json!(pid)))
        })
    };
    c.wait_status(Duration::from_secs(20), has_pid);

    // API server down, manager restarted: nothing is pushed until it has seen the pods again.
    c.api.set_down(true);
    c.stop_manager();
    let refused = c.api.refused();
    c.start_manager();
    c.kubelet
        .wait_registrations(2, Duration::from_secs(30))
        .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.api.refused() == refused {
        assert!(
            Instant::now() < deadline,
            "the restarted manager never tried the API server\n{}",
            c.manager_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = c.node.status_json().unwrap();
    assert!(
        limit_is(0.5)(&s) && has_pid(&s),
        "policy lost while the API server is down: {s:#}"
    );
    // Back up: the manager syncs the same policy; then the history is compacted, and a change
    // made after that still arrives (the watch relists after 410 Gone).
    c.api.set_down(false);
    c.api.compact();
    c.kubectl(&[
        "annotate",
        "pod",
        "serve",
        "gpushare.io/gpu-limit=0.25",
        "--overwrite",
    ]);
    c.wait_status(Duration::from_secs(15), limit_is(0.25));
    assert!(
        has_pid(&c.node.status_json().unwrap()),
        "the tenant was disconnected"
    );

    // The pod is deleted while its process still runs: the group stays, marked removed, until
    // the process is gone.
    c.api.delete_pod("default", "serve");
    c.podres.forget("default", "serve");
    c.wait_status(Duration::from_secs(10), |s| {
        s["pods"][0]["removed"] == json!(true)
    });
    assert!(has_pid(&c.node.status_json().unwrap()));
    drop(tenant);
    c.wait_status(Duration::from_secs(10), |s| {
        gpushare_testkit::node::group_in(s, group).is_none()
            && s["pods"].as_array().is_some_and(Vec::is_empty)
    });
    drop(cg);
}
