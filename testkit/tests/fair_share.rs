//! End to end: tenants under `gpushare run` (hook + `gpushare-scheduler --dev`) on one simulated
//! GPU get the shares docs/scheduling.md promises, measured on the device trace.

use gpushare_testkit::margins;
use gpushare_testkit::node::Node;
use gpushare_testkit::trace::{Trace, Window, common_window};
use std::process::Child;

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
            (got - want).abs() <= margins::SHARE,
            "share {got:.3} vs {want} (all: {s:?})"
        );
    }
    assert!(
        trace.utilization(0, w) >= margins::UTILISATION,
        "utilisation {}",
        trace.utilization(0, w)
    );
}

/// A request server in the latency class (`gpushare run --latency`: 40 requests/s of four 1 ms
/// kernels, 0.16 of the GPU) beside a trainer: the scheduler knows its class, it is served every
/// request and charged what it used, and the trainer gets all the rest.
#[test]
fn a_latency_class_server_beside_a_trainer_gets_what_it_uses_and_no_more() {
    let node = Node::start(&[]);
    let client = node.programs.path("cudarc-client");
    let server_args = [
        "latency",
        "--rate-hz",
        "40",
        "--kernels",
        "4",
        "--ms-per-kernel",
        "1",
        "--duration-ms",
        "4000",
    ];
    let server = node.spawn(node.run_command(
        &["--group", "server", "--request", "0.5", "--latency"],
        &client,
        &server_args,
    ));
    let train = spin_args(1.0, 4000, 20);
    let trainer = node.tenant("train", 0.5, 1.0, 1.0, &as_str(&train));
    // Its class travels with its group from `gpushare run` through the hook to the scheduler.
    let mut class = None;
    for _ in 0..50 {
        class = node.status_group("server").map(|g| g["latency"].clone());
        if class.is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(class, Some(serde_json::Value::Bool(true)));
    assert_eq!(
        node.status_group("train").map(|g| g["latency"].clone()),
        Some(serde_json::Value::Bool(false))
    );
    let server_pid = server.pid();
    let out = server.wait_ok(std::time::Duration::from_secs(60));
    let result: serde_json::Value = String::from_utf8_lossy(&out.stdout)
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .expect("the server printed its result");
    let pids = [server_pid, trainer.id()];
    wait_ok(trainer);
    let trace = node.finish();
    assert!(trace.overlaps().is_empty());
    let (w, s) = shares(&trace, &pids);
    eprintln!(
        "window {:.2} s, shares {s:?}, server latency p50 {} ms, p99 {} ms",
        w.len_ns() as f64 / 1e9,
        result["latency_p50_ms"],
        result["latency_p99_ms"]
    );
    // Every request was served (about 160 arrive in 4 s).
    assert!(result["requests"].as_u64().unwrap_or(0) >= 100, "{result}");
    // The server is charged what it uses; the trainer keeps the rest.
    assert!((s[0] - 0.16).abs() <= margins::SHARE, "server {s:?}");
    assert!((s[1] - 0.84).abs() <= margins::SHARE, "trainer {s:?}");
    assert!(
        trace.utilization(0, w) >= margins::UTILISATION,
        "utilisation {}",
        trace.utilization(0, w)
    );
}
