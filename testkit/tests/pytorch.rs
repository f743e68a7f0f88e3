//! PyTorch, unmodified, on the simulated GPU and under gpushare; and cuBLAS alone through
//! ctypes, the cheaper check of the same driver surface.
//!
//! PyPI wheels are installed by `scripts/python-env` into virtual environments under the user's
//! cache directory, one per requirement set: the first run on a machine installs (torch 2.10.0,
//! the newest on CUDA 12, with its CUDA wheels: ~3.8 GB), later runs reuse it. `testkit/python/torch_capabilities.py` holds the
//! programs; the simulated GPU does not execute kernels, so nothing checks a computed value.

use gpushare_testkit::harness::{Sim, describe, json_lines, output_with_timeout, target_dir};
use gpushare_testkit::node::Node;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const TORCH: &[&str] = &["torch==2.10.0", "numpy"];
/// The versions torch 2.10.0 pins, so that both environments share pip's download cache.
const CUBLAS: &[&str] = &[
    "nvidia-cublas-cu12==12.8.4.1",
    "nvidia-cuda-runtime-cu12==12.8.90",
];
const TIMEOUT: Duration = Duration::from_secs(300);

/// The Python of the virtual environment holding `reqs` (`scripts/python-env`, which
/// `scripts/test` runs first so that the install is not timed as a test).
fn venv(name: &str, reqs: &[&str]) -> PathBuf {
    let tool = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/python-env");
    let out = Command::new(tool)
        .arg(name)
        .args(reqs)
        .output()
        .expect("run scripts/python-env");
    assert!(
        out.status.success(),
        "python-env {name}: {}",
        describe(&out)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(name)
}

/// `gpushare-sim run SIM_ARGS -- PYTHON SCRIPT ARGS` with `env`; must succeed; its JSON lines.
fn on_sim(
    sim_args: &[&str],
    python: &Path,
    script: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Vec<serde_json::Value> {
    let mut cmd = Sim::locate().run(sim_args, [python.as_os_str(), script.as_os_str()]);
    cmd.args(args).envs(env.iter().copied());
    let out = output_with_timeout(cmd, TIMEOUT);
    assert!(out.status.success(), "{}", describe(&out));
    json_lines(&out.stdout)
}

fn case<'a>(lines: &'a [serde_json::Value], name: &str) -> &'a serde_json::Value {
    lines
        .iter()
        .find(|l| l["case"] == name)
        .unwrap_or_else(|| panic!("no {name} line in {lines:?}"))
}

#[test]
fn cublas_through_ctypes_runs_on_the_simulator() {
    let python = venv("cublas", CUBLAS);
    let lines = on_sim(&[], &python, &script("cublas_ctypes.py"), &[], &[]);
    assert_eq!(lines[0]["gemms"], 2);
    assert_eq!(lines[0]["round_trip"], true, "{lines:?}");
}

fn torch() -> PathBuf {
    venv("torch", TORCH)
}

#[test]
fn pytorch_matmuls_convolutions_training_graphs_and_compile_run_unmodified() {
    let python = torch();
    let cases = ["matmul", "conv", "train", "graph", "compile"];
    let lines = on_sim(&[], &python, &script("torch_capabilities.py"), &cases, &[]);
    assert_eq!(
        case(&lines, "matmul")["shapes"][0],
        serde_json::json!([256, 128])
    );
    let conv = case(&lines, "conv");
    assert_eq!(conv["out"], serde_json::json!([4, 8, 15, 15]), "{conv}");
    assert_eq!(conv["grad"], serde_json::json!([4, 3, 32, 32]));
    assert_eq!(case(&lines, "train")["steps"], 10);
    assert_eq!(case(&lines, "graph")["replays"], 5);
    assert_eq!(
        case(&lines, "compile")["again"],
        serde_json::json!([64, 32])
    );
}

#[test]
fn pytorch_uses_two_peer_gpus_and_recovers_from_out_of_memory() {
    let python = torch();
    let s = script("torch_capabilities.py");
    let lines = on_sim(&["--gpus", "2"], &python, &s, &["peer"], &[]);
    let peer = case(&lines, "peer");
    assert_eq!(peer["devices"], 2);
    assert_eq!(peer["can_access_peer"], true);
    assert_eq!(peer["round_trip"], true, "{peer}");
    let lines = on_sim(&["--memory", "4GiB"], &python, &s, &["oom"], &[]);
    let oom = case(&lines, "oom");
    assert_eq!(oom["error"], "OutOfMemoryError", "{oom}");
    assert_eq!(oom["recovered"], true);
}

/// Under gpushare with a 1 GiB cap: PyTorch sees the cap as the GPU's memory, gets its own
/// out-of-memory error past it, recovers after `empty_cache()`; its launches are gated.
#[test]
fn pytorch_under_gpushare_is_gated_and_capped() {
    let python = torch();
    let node = Node::start(&[]);
    let mut cmd = node.command(target_dir().join("gpushare"));
    cmd.args([
        "run",
        "--group",
        "torch",
        "--request",
        "0.5",
        "--memory",
        "1GiB",
        "--",
    ])
    .arg(&python)
    .arg(script("torch_capabilities.py"))
    .args(["matmul", "train", "oom"])
    .env("GPUSHARE_FAIL", "closed");
    let out = output_with_timeout(cmd, TIMEOUT);
    assert!(out.status.success(), "{}", describe(&out));
    let lines = json_lines(&out.stdout);
    let oom = case(&lines, "oom");
    assert_eq!(
        oom["total"],
        1u64 << 30,
        "the cap is the GPU's memory: {oom}"
    );
    assert_eq!(oom["error"], "OutOfMemoryError");
    assert_eq!(oom["recovered"], true);
    let group = node
        .status_group("torch")
        .expect("the scheduler saw PyTorch");
    assert!(group["tokens"].as_u64().unwrap_or(0) >= 1, "gated: {group}");
    assert!(node.finish().overlaps().is_empty());
}
