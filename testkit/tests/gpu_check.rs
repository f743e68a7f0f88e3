//! `scripts/gpu-check`, the one-command validation of a machine with an NVIDIA GPU, run against
//! the simulated driver standing in for the machine's (`GPUSHARE_REAL_LIBCUDA` and
//! `LD_LIBRARY_PATH` name the simulator's `libcuda.so.1`, a `gpushare-sim serve` device behind
//! it) in its short mode: the set `--stage` copies from this build, then `DIR/gpu-check --run` as
//! on the GPU machine, where there is no cargo.

use gpushare_testkit::harness::{describe, output_with_timeout, target_dir};
use gpushare_testkit::node::Node;
use gpushare_testkit::trace::Window;
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn last_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(text.lines().last().expect("a line")).expect("a JSON line")
}

#[test]
fn gpu_check_validates_a_machine_with_the_set_it_stages() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let set = tempfile::tempdir().unwrap();
    // The set from this build's binaries (built already: nothing for cargo to do here).
    let mut stage = Command::new(repo.join("scripts/gpu-check"));
    stage
        .arg("--stage")
        .arg(set.path())
        .arg("--prebuilt")
        .arg(target_dir());
    let out = output_with_timeout(stage, Duration::from_secs(120));
    assert!(out.status.success(), "--stage\n{}", describe(&out));

    // A device whose kernels take 500 µs each unless told otherwise (the bench's spin kernels
    // say how long they take; PyTorch's training step is then 26.5 ms).
    let node = Node::device_only_with(&["--default-kernel", "500us"]);
    let lib = &node
        .sim_env
        .iter()
        .find(|(k, _)| k == "LD_LIBRARY_PATH")
        .expect("the simulator's library directory")
        .1;
    let results = tempfile::tempdir().unwrap();
    let mut check = Command::new(set.path().join("gpu-check"));
    check
        .arg("--run")
        .arg("--python")
        .arg(gpushare_testkit::python::torch())
        .arg("--out")
        .arg(results.path())
        .arg("--short")
        .envs(node.sim_env.iter().map(|(k, v)| (k, v)))
        .env("GPUSHARE_REAL_LIBCUDA", Path::new(lib).join("libcuda.so.1"))
        // No cargo on a GPU machine.
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env_remove("GPUSHARE_SOCKET");
    let out = output_with_timeout(check, Duration::from_secs(600));
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}");
    if !out.status.success() {
        let kept = results.keep();
        panic!(
            "gpu-check failed (its outputs are kept in {})\n{}",
            kept.display(),
            describe(&out)
        );
    }
    for check in [
        "GPU shares, two tenants",
        "GPU cap, one tenant alone",
        "launch overhead (cuLaunchKernel)",
        "memory cap, driver API",
        "PyTorch training rate, alone",
        "PyTorch shares, two trainers",
        "PyTorch memory cap",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(check) && l.trim_end().ends_with("  OK")),
            "{check} did not pass:\n{text}"
        );
    }
    assert!(text.contains("RESULT: PASS"), "{text}");
    // The benchmark took the simulated driver for the machine's: it measured from CUDA events.
    let summary: Value = serde_json::from_str(
        &std::fs::read_to_string(results.path().join("bench/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["measured_from"], "tenant CUDA timing events");

    // The PyTorch shares gpu-check measured from CUDA events are the device trace's.
    let trace = node.finish();
    let shares = last_json(&results.path().join("shares.json"));
    let tenants: Vec<Value> = ["a", "b"]
        .iter()
        .map(|t| last_json(&results.path().join(format!("{t}.json"))))
        .collect();
    let ends = |t: &Value| -> Vec<u64> {
        t["ends_ns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_u64().unwrap())
            .collect()
    };
    let lo = tenants.iter().map(|t| ends(t)[0]).max().unwrap();
    let hi = tenants
        .iter()
        .map(|t| *ends(t).last().unwrap())
        .min()
        .unwrap();
    let by = trace.busy_by_pid(0, Window::new(lo, hi));
    for (i, t) in tenants.iter().enumerate() {
        let pid = t["pid"].as_u64().unwrap() as u32;
        let on_trace = by.get(&pid).copied().unwrap_or(0) as f64 / (hi - lo) as f64;
        let from_events = shares["shares"][i].as_f64().unwrap();
        eprintln!(
            "tenant {i}: {from_events:.3} from CUDA events, {on_trace:.3} on the device trace"
        );
        assert!(
            (on_trace - from_events).abs() <= 0.02,
            "tenant {i}: {from_events:.3} from CUDA events, {on_trace:.3} on the device trace"
        );
    }
}
