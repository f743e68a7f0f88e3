//! End to end: tenants under `gpushare run` (hook + `gpushare-scheduler --dev`) on one simulated
//! GPU get the shares DESIGN §2 promises, measured on the device trace.

use gpushare_sim_clients::harness::{Sim, target_dir};
use gpushare_sim_clients::trace::{Trace, Window, common_window};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A simulated node: a device serving one GPU and a scheduler in development mode.
struct Node {
    device: Child,
    scheduler: Option<Child>,
    sim_env: Vec<(String, String)>,
    sched_socket: PathBuf,
    trace: PathBuf,
    tmp: tempfile::TempDir,
}

fn wait_for(path: &Path) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Node {
    fn start(sched_args: &[&str]) -> Node {
        let sim = Sim::locate();
        let tmp = tempfile::tempdir().unwrap();
        let trace = tmp.path().join("trace.jsonl");
        let mut device = Command::new(&sim.bin)
            .args(["serve", "--trace"])
            .arg(&trace)
            .arg("--socket")
            .arg(tmp.path().join("sim.sock"))
            .stdout(Stdio::piped())
            .spawn()
            .expect("start gpushare-sim serve");
        let mut lines = BufReader::new(device.stdout.take().unwrap()).lines();
        let sim_env = (0..2)
            .map(|_| {
                let l = lines.next().unwrap().unwrap();
                let (k, v) = l.split_once('=').unwrap();
                (k.to_string(), v.to_string())
            })
            .collect();
        let sched_socket = tmp.path().join("gpushare.sock");
        let mut node = Node {
            device,
            scheduler: None,
            sim_env,
            sched_socket,
            trace,
            tmp,
        };
        node.start_scheduler(sched_args);
        node
    }

    fn start_scheduler(&mut self, args: &[&str]) {
        let _ = std::fs::remove_file(&self.sched_socket);
        let child = Command::new(target_dir().join("gpushare-scheduler"))
            .arg("--dev")
            .args(args)
            .arg("--socket")
            .arg(&self.sched_socket)
            .env("GPUSHARE_LOG", "warn")
            .spawn()
            .expect("start gpushare-scheduler");
        self.scheduler = Some(child);
        wait_for(&self.sched_socket);
    }

    fn kill_scheduler(&mut self) {
        if let Some(mut c) = self.scheduler.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A cudarc tenant: `gpushare run --group NAME … -- cudarc-client ARGS`.
    fn tenant(&self, group: &str, request: f64, limit: f64, weight: f64, args: &[&str]) -> Child {
        let mut c = Command::new(target_dir().join("gpushare"));
        c.args(["run", "--group", group])
            .args([
                "--request",
                &request.to_string(),
                "--limit",
                &limit.to_string(),
            ])
            .args(["--weight", &weight.to_string(), "--"])
            .arg(env!("CARGO_BIN_EXE_cudarc-client"))
            .args(args)
            .env("GPUSHARE_SOCKET", &self.sched_socket)
            .env("GPUSHARE_FAIL", "closed")
            .stdout(Stdio::null());
        for (k, v) in &self.sim_env {
            c.env(k, v);
        }
        c.spawn().expect("start tenant")
    }

    /// Stop the device (flushing its trace) and read the trace.
    fn finish(mut self) -> Trace {
        self.kill_scheduler();
        // SAFETY: sending SIGTERM to our own child process.
        unsafe { libc::kill(self.device.id() as i32, libc::SIGTERM) };
        let _ = self.device.wait();
        Trace::read(&self.trace).expect("device trace")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill_scheduler();
        let _ = self.device.kill();
    }
}

fn wait_ok(mut c: Child) {
    let s = c.wait().unwrap();
    assert!(s.success(), "tenant failed: {s}");
}

/// Spin tenants: `kernels` kernels of `ms` milliseconds, syncing every `sync_every` (0: never).
fn spin_args(ms: f64, kernels: u32, sync_every: u32) -> Vec<String> {
    let mut a = vec![
        "spin".to_string(),
        "--ms-per-kernel".into(),
        ms.to_string(),
        "--kernels".into(),
        kernels.to_string(),
    ];
    if sync_every > 0 {
        a.extend(["--sync-every".into(), sync_every.to_string()]);
    }
    a
}

fn as_str(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Shares of each pid in the window where all of them were active, minus warm-up.
fn shares(trace: &Trace, pids: &[u32]) -> (Window, Vec<f64>) {
    let spans = pids
        .iter()
        .map(|p| trace.span_of_pid(*p).expect("tenant ran kernels"));
    let w = common_window(spans).expect("tenants overlapped");
    let w = Window::new(
        w.start_ns + 300_000_000,
        w.end_ns.saturating_sub(50_000_000),
    );
    let by = trace.busy_by_pid(0, w);
    (
        w,
        pids.iter()
            .map(|p| by.get(p).copied().unwrap_or(0) as f64 / w.len_ns() as f64)
            .collect(),
    )
}

#[test]
fn requests_are_honoured_and_spare_time_is_shared() {
    let node = Node::start(&[]);
    let a = spin_args(1.0, 2200, 20);
    let b = spin_args(1.0, 1400, 20);
    let c = spin_args(1.0, 1000, 20);
    let ts = [
        node.tenant("a", 0.5, 1.0, 1.0, &as_str(&a)),
        node.tenant("b", 0.3, 1.0, 1.0, &as_str(&b)),
        node.tenant("c", 0.2, 1.0, 1.0, &as_str(&c)),
    ];
    let pids: Vec<u32> = ts.iter().map(Child::id).collect();
    ts.into_iter().for_each(wait_ok);
    let trace = node.finish();
    assert!(trace.overlaps().is_empty());
    let (w, s) = shares(&trace, &pids);
    eprintln!("window {:.2} s, shares {s:?}", w.len_ns() as f64 / 1e9);
    for (got, want) in s.iter().zip([0.5, 0.3, 0.2]) {
        assert!(
            (got - want).abs() <= 0.02,
            "share {got:.3} vs {want} (all: {s:?})"
        );
    }
    assert!(
        trace.utilization(0, w) >= 0.97,
        "utilisation {}",
        trace.utilization(0, w)
    );
}
