//! `gpushare-bench run` on a small scenario, end to end on the simulated GPU (needs the
//! workspace binaries: `cargo build --workspace --bins --lib`).

use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// A scenario of a training loop with request 0.6 and a second tenant (its `name` and
/// `workload` lines) with 0.2.
fn scenario(name: &str, second: &str) -> String {
    format!(
        r#"
name = "{name}"
description = "A training loop and a second tenant, requests 0.6 / 0.2."
duration = "2500ms"

[[tenant]]
name = "big"
workload = "train"
request = 0.6

[[tenant]]
{second}
request = 0.2
"#
    )
}

/// Two training loops.
fn small() -> String {
    scenario("e2e-small", "name = \"small\"\nworkload = \"train\"")
}

/// A training loop and a tenant launching from 4 threads on 4 streams: its threads' timing
/// events are recorded right after their launches only if the hook never holds a launch call
/// that has already submitted its kernel.
fn with_threads() -> String {
    scenario(
        "e2e-threads",
        "name = \"threads\"\nworkload = \"threads\"\nthreads = 4",
    )
}

fn in_unit(v: &Value) -> bool {
    v.as_f64().is_some_and(|x| (0.0..=1.0).contains(&x))
}

#[test]
fn small_scenario_end_to_end() {
    let dir = std::env::temp_dir().join(format!("gpushare-bench-e2e-{}", std::process::id()));
    let out_dir = dir.join("out");
    let summary = bench(&small(), &dir, &[], &[]);
    let scenarios = summary["scenarios"].as_array().expect("scenarios[]");
    assert_eq!(scenarios.len(), 1);
    let sc = &scenarios[0];
    assert_eq!(sc["name"], "e2e-small");
    let tenants = sc["tenants"].as_array().expect("tenants[]");
    assert_eq!(tenants.len(), 2);
    let mut target_sum = 0.0;
    for t in tenants {
        for k in [
            "name",
            "request",
            "limit",
            "target_share",
            "achieved_share",
            "abs_error",
        ] {
            assert!(!t[k].is_null(), "tenant field {k} missing: {t}");
        }
        for k in [
            "target_share",
            "achieved_share",
            "abs_error",
            "baseline_achieved_share",
        ] {
            assert!(in_unit(&t[k]), "{k} = {} not in [0, 1]", t[k]);
        }
        // Both tenants really ran.
        assert!(t["achieved_share"].as_f64().unwrap() > 0.05, "{t}");
        // Alone, the same workload runs faster than when sharing the GPU.
        assert!(
            t["alone_kernels_per_s"].as_f64().is_some_and(|x| x > 0.0),
            "{t}"
        );
        assert!(
            t["throughput_vs_alone"]
                .as_f64()
                .is_some_and(|x| x > 0.0 && x < 1.0),
            "{t}"
        );
        target_sum += t["target_share"].as_f64().unwrap();
    }
    assert!(
        target_sum <= 1.0 + 1e-9,
        "target shares sum to {target_sum}"
    );
    for k in ["max_abs_error", "device_utilization"] {
        assert!(in_unit(&sc[k]), "{k} = {} not in [0, 1]", sc[k]);
        assert!(
            in_unit(&sc["baseline"][k]),
            "baseline {k} = {}",
            sc["baseline"][k]
        );
    }
    assert!(sc["handoff_p99_us"].as_f64().is_some_and(|x| x >= 0.0));
    assert!(
        sc["scheduler_cpu_percent"]
            .as_f64()
            .is_some_and(|x| (0.0..=200.0).contains(&x)),
        "scheduler_cpu_percent = {}",
        sc["scheduler_cpu_percent"]
    );
    assert!(sc["device_utilization"].as_f64().unwrap() > 0.5);
    assert!(summary.get("launch_overhead").is_some());
    assert!(out_dir.join("summary.md").is_file());
    let svg = std::fs::read_to_string(out_dir.join("e2e-small.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `gpushare-bench run SCENARIO --out DIR ARGS…` with extra environment; its summary.json.
fn bench(scenario: &str, dir: &Path, args: &[&str], env: &[(String, String)]) -> Value {
    std::fs::create_dir_all(dir).unwrap();
    let file = dir.join("scenario.toml");
    std::fs::write(&file, scenario).unwrap();
    let out_dir = dir.join("out");
    let out = Command::new(env!("CARGO_BIN_EXE_gpushare-bench"))
        .arg("run")
        .arg(&file)
        .arg("--out")
        .arg(&out_dir)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("run gpushare-bench");
    assert!(
        out.status.success(),
        "gpushare-bench failed ({}); build the workspace first (cargo build --workspace --bins --lib)\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(out_dir.join("summary.json")).unwrap()).unwrap()
}

fn shares(sc: &Value) -> Vec<f64> {
    sc["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["achieved_share"].as_f64().unwrap())
        .collect()
}

/// The tenants' own timelines (CUDA timing events, the measurement on a real GPU) give the
/// figures the simulated device's trace gives, for a multi-stream tenant too.
#[test]
fn timelines_from_timing_events_agree_with_the_device_trace() {
    let dir = std::env::temp_dir().join(format!("gpushare-bench-events-{}", std::process::id()));
    let summary = bench(
        &with_threads(),
        &dir,
        &["--source", "events", "--no-baseline", "--no-alone"],
        &[],
    );
    assert_eq!(summary["gpu"], "simulated");
    assert_eq!(summary["measured_from"], "tenant CUDA timing events");
    let sc = &summary["scenarios"][0];
    let check = &sc["device_trace_check"];
    let from_device: Vec<f64> = check["achieved_shares"]
        .as_array()
        .expect("device_trace_check.achieved_shares")
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let from_events = shares(sc);
    assert!(from_events.iter().all(|&s| s > 0.1), "{from_events:?}");
    for (e, d) in from_events.iter().zip(&from_device) {
        assert!(
            (e - d).abs() <= 0.005,
            "events {from_events:?} vs device {from_device:?}"
        );
    }
    let (ue, ud) = (
        sc["device_utilization"].as_f64().unwrap(),
        check["device_utilization"].as_f64().unwrap(),
    );
    assert!(
        (ue - ud).abs() <= 0.01,
        "utilisation: events {ue}, device {ud}"
    );
    assert!(dir.join("out/e2e-threads.timeline.jsonl").is_file());
    assert!(dir.join("out/e2e-threads.trace.jsonl").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

/// On a machine whose `libcuda.so.1` reports a GPU, the benchmark runs there and measures from
/// timing events. Here the "machine's driver" is a simulated device started outside the bench,
/// whose trace is the ground truth the bench never sees.
#[test]
fn on_a_machine_with_a_gpu_the_bench_runs_on_it() {
    use gpushare_sim_clients::node::Node;
    use gpushare_sim_clients::trace::Window;
    let dir = std::env::temp_dir().join(format!("gpushare-bench-system-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The machine's GPU: a simulated device the bench finds only through the environment.
    let machine = Node::device_only();
    let env = machine.sim_env.clone();
    let file = dir.join("refused.toml");
    std::fs::write(&file, small()).unwrap();
    let refused = Command::new(env!("CARGO_BIN_EXE_gpushare-bench"))
        .arg("run")
        .arg(&file)
        .args(["--out", "/nonexistent", "--source", "device"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let summary = bench(&small(), &dir, &["--no-baseline", "--no-alone"], &env);
    let truth = machine.finish();
    assert_eq!(summary["gpu"], "this machine's (1)");
    assert_eq!(summary["measured_from"], "tenant CUDA timing events");
    let sc = &summary["scenarios"][0];
    assert!(sc.get("device_trace_check").is_none());
    assert!(!dir.join("out/e2e-small.trace.jsonl").exists());
    // The figures match the device's own record of the same span.
    let window = Window::new(
        sc["measure_start_ns"].as_u64().unwrap(),
        sc["measure_end_ns"].as_u64().unwrap(),
    );
    let mut by_pid: Vec<f64> = truth
        .busy_by_pid(0, window)
        .values()
        .map(|&ns| ns as f64 / window.len_ns() as f64)
        .filter(|&s| s > 0.01)
        .collect();
    let mut measured = shares(sc);
    by_pid.sort_by(f64::total_cmp);
    measured.sort_by(f64::total_cmp);
    assert_eq!(by_pid.len(), 2, "{by_pid:?}");
    for (m, t) in measured.iter().zip(&by_pid) {
        assert!(
            (m - t).abs() <= 0.005,
            "measured {measured:?}, device {by_pid:?}"
        );
    }
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--simulated"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
