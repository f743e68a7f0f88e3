//! PyTorch, unmodified, on the simulated GPU and under gpushare; and cuBLAS alone through
//! ctypes, the cheaper check of the same driver surface.
//!
//! The programs are `python/torch_capabilities.py` (one case per capability) and
//! `python/torch_tenant.py` (trainers for shares), run in the cached
//! virtual environment of [`gpushare_testkit::python`]. The simulated GPU does not execute
//! kernels, so nothing checks a computed value; data that copies move is checked.

use gpushare_testkit::harness::{Sim, describe, json_lines, output_with_timeout, target_dir};
use gpushare_testkit::margins;
use gpushare_testkit::node::{Node, Tenant};
use gpushare_testkit::python::{CUBLAS, script, torch, venv};
use gpushare_testkit::trace::{Trace, Window};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(300);
/// The device time of each PyTorch kernel in the share tests: a training step of the tenants'
/// MLP is 53 kernels, 26.5 ms, far more than its host needs to launch them.
const KERNEL: &str = "500us";

/// `gpushare-sim run SIM_ARGS -- PYTHON SCRIPT ARGS` with `env`; must succeed; its JSON lines.
fn on_sim(
    sim_args: &[&str],
    python: &Path,
    script: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Vec<Value> {
    let mut cmd = Sim::locate().run(sim_args, [python.as_os_str(), script.as_os_str()]);
    cmd.args(args).envs(env.iter().copied());
    let out = output_with_timeout(cmd, TIMEOUT);
    assert!(out.status.success(), "{}", describe(&out));
    json_lines(&out.stdout)
}

fn case<'a>(lines: &'a [Value], name: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["case"] == name)
        .unwrap_or_else(|| panic!("no {name} line in {lines:?}"))
}

/// An environment variable for a PyTorch process.
type EnvVar = (&'static str, &'static str);

const EXPANDABLE: EnvVar = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True");

#[test]
fn cublas_through_ctypes_runs_on_the_simulator() {
    let python = venv("cublas", CUBLAS);
    let lines = on_sim(&[], &python, &script("cublas_ctypes.py"), &[], &[]);
    assert_eq!(lines[0]["gemms"], 2);
    assert_eq!(lines[0]["round_trip"], true, "{lines:?}");
}

/// Matmuls, convolutions, training, CUDA graphs, `torch.compile`, a green context, and
/// DataLoader workers handing CUDA tensors to the main process (IPC handles: the main process
/// reads the bytes each worker copied into its tensor).
#[test]
fn pytorch_runs_unmodified() {
    let cases = [
        "matmul", "conv", "train", "graph", "compile", "green", "ipc",
    ];
    let s = script("torch_capabilities.py");
    let lines = on_sim(&[], &torch(), &s, &cases, &[]);
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
    assert_eq!(case(&lines, "green")["shape"], serde_json::json!([128, 32]));
    assert_eq!(
        case(&lines, "ipc")["values"],
        serde_json::json!([1.0, 2.0, 3.0, 4.0]),
        "each worker's tensor, as the main process reads it"
    );
}

/// With the caching allocator's expandable segments (VMM): allocations and `empty_cache`, two
/// GPUs with peer access, and PyTorch's own out-of-memory error past the GPU's 4 GiB, then
/// recovery after `empty_cache()`.
#[test]
fn pytorch_expandable_segments_peer_gpus_and_out_of_memory() {
    let s = script("torch_capabilities.py");
    let sim = ["--gpus", "2", "--memory", "4GiB"];
    let lines = on_sim(
        &sim,
        &torch(),
        &s,
        &["expandable", "peer", "oom"],
        &[EXPANDABLE],
    );
    let e = case(&lines, "expandable");
    assert_eq!(e["round_trip"], true, "{e}");
    assert!(e["reserved_mib"].as_u64().unwrap() >= 131, "{e}");
    assert_eq!(e["after_empty_cache_mib"], 0, "{e}");
    let peer = case(&lines, "peer");
    assert_eq!(peer["devices"], 2);
    assert_eq!(peer["can_access_peer"], true);
    assert_eq!(peer["round_trip"], true, "{peer}");
    let oom = case(&lines, "oom");
    assert_eq!(oom["error"], "OutOfMemoryError", "{oom}");
    assert_eq!(oom["recovered"], true);
}

/// The books of a PyTorch process, settled, move exactly as what its caching allocator holds,
/// at every checkpoint of `torch_capabilities.py books` (both from where they stood when the case
/// began: what cuBLAS and the CUDA runtime hold outside the allocator is booked too, and stays).
fn assert_books_exact(lines: &[Value]) {
    let books = case(lines, "books");
    let points = books["points"].as_array().unwrap();
    assert_eq!(points.len(), 7, "{books}");
    for p in points {
        assert_eq!(
            p["booked"], p["reserved"],
            "the scheduler's books move as what the allocator holds: {p} ({books})"
        );
    }
}

/// Under gpushare with a 1 GiB cap, as the default allocator and as expandable segments: the
/// launches are gated; the scheduler's books move exactly as what the caching allocator holds
/// (cached blocks, after `empty_cache`, a CUDA graph's private pool, VMM segments); PyTorch sees the
/// cap as the GPU's memory, gets its own out-of-memory error past it and recovers after
/// `empty_cache()`.
#[test]
fn pytorch_under_gpushare_is_gated_capped_and_booked_exactly() {
    let python = torch();
    let node = Node::start(&[]);
    let runs: [(&str, &[&str], Option<EnvVar>); 2] = [
        ("torch", &["matmul", "train", "books", "oom"], None),
        ("torch-vmm", &["books", "oom"], Some(EXPANDABLE)),
    ];
    for (group, cases, env) in runs {
        let mut args = vec![script("torch_capabilities.py").into_os_string()];
        args.extend(cases.iter().map(Into::into));
        let mut cmd = node.run_command(
            &["--group", group, "--request", "0.5", "--memory", "1GiB"],
            &python,
            &args,
        );
        cmd.env("GPUSHARE_BIN", target_dir().join("gpushare"))
            .envs(env)
            .stdout(std::process::Stdio::piped());
        let out = Tenant::spawn(cmd).wait_ok(TIMEOUT);
        let lines = json_lines(&out.stdout);
        assert_books_exact(&lines);
        let oom = case(&lines, "oom");
        assert_eq!(
            oom["total"],
            1u64 << 30,
            "the cap is the GPU's memory: {oom}"
        );
        assert_eq!(oom["error"], "OutOfMemoryError");
        assert_eq!(oom["recovered"], true);
        let g = node.status_group(group).expect("the scheduler saw PyTorch");
        assert!(g["tokens"].as_u64().unwrap_or(0) >= 1, "gated: {g}");
        assert_eq!(g["memory_used"], 0, "nothing booked after exit: {g}");
    }
    assert!(node.finish().overlaps().is_empty());
}

/// One PyTorch tenant of [`together`]: its group and request, `torch_tenant.py` arguments.
struct TorchTenant<'a> {
    group: &'a str,
    request: f64,
    args: &'a [&'a str],
}

/// What [`together`] saw: each tenant's share of the GPU's time over the window in which all
/// ran, the window, and the trace.
struct Together {
    shares: Vec<f64>,
    window: Window,
    trace: Trace,
}

/// PyTorch tenants started together under gpushare on a simulated GPU (each kernel [`KERNEL`]
/// long): they warm up, wait for each other, then run `seconds`; each one's share of the GPU
/// over the window where all ran (their own reported starts, without the first 0.5 s, to the
/// earliest last step), from the trace.
fn together(tenants: &[TorchTenant], seconds: f64) -> Together {
    let python = torch();
    let mut node = Node::device_only_with(&["--default-kernel", KERNEL]);
    node.start_scheduler(&[]);
    let dir = node.tmp.path().to_path_buf();
    let go = dir.join("go");
    let seconds = seconds.to_string();
    let running: Vec<(Tenant, PathBuf)> = tenants
        .iter()
        .map(|t| {
            let ready = dir.join(format!("ready-{}", t.group));
            let mut args: Vec<std::ffi::OsString> = vec![script("torch_tenant.py").into()];
            args.extend(t.args.iter().map(Into::into));
            args.extend(["--seconds".into(), seconds.clone().into()]);
            args.extend(["--ready".into(), ready.clone().into(), "--go".into()]);
            args.push(go.clone().into());
            let mut cmd = node.tenant_command(t.group, t.request, 1.0, 1.0, &python, &args);
            cmd.stdout(std::process::Stdio::piped());
            (Tenant::spawn(cmd), ready)
        })
        .collect();
    let start = Instant::now();
    while !running.iter().all(|(_, ready)| ready.exists()) {
        assert!(
            start.elapsed() < TIMEOUT,
            "the PyTorch tenants did not all warm up in {TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(&go, b"").unwrap();
    let results: Vec<Value> = running
        .into_iter()
        .map(|(t, _)| {
            let out = t.wait_ok(TIMEOUT);
            json_lines(&out.stdout).pop().expect("a result line")
        })
        .collect();
    let trace = node.finish();
    let from = results
        .iter()
        .map(|r| r["start_ns"].as_u64().unwrap())
        .max()
        .unwrap();
    let to = results
        .iter()
        .map(|r| {
            r["ends_ns"]
                .as_array()
                .unwrap()
                .last()
                .unwrap()
                .as_u64()
                .unwrap()
        })
        .min()
        .unwrap();
    let window = Window::new(from + 500_000_000, to);
    assert!(
        window.len_ns() >= 1_000_000_000,
        "too short a window: {window}"
    );
    let by = trace.busy_by_pid(0, window);
    let shares = results
        .iter()
        .map(|r| {
            let pid = r["pid"].as_u64().unwrap() as u32;
            by.get(&pid).copied().unwrap_or(0) as f64 / window.len_ns() as f64
        })
        .collect();
    Together {
        shares,
        window,
        trace,
    }
}

fn assert_shares(t: &Together, targets: &[f64]) {
    let utilisation = t.trace.utilization(0, t.window);
    let used: f64 = t.shares.iter().sum();
    let split: Vec<f64> = t.shares.iter().map(|s| s / used).collect();
    eprintln!(
        "PyTorch shares {:?}, split {split:?} (targets {targets:?}) over {:.2} s, utilisation {utilisation:.3}",
        t.shares,
        t.window.len_ns() as f64 / 1e9
    );
    for (got, want) in split.iter().zip(targets) {
        assert!(
            (got - want).abs() <= margins::SPLIT,
            "{got:.3} of the busy time for a target of {want} (shares {:?})",
            t.shares
        );
    }
    // The GPU's utilisation is printed, not asserted: here it measures how much host CPU the
    // tenants' Python got (each step is launched by an interpreter, and the suite shares two
    // cores with other tests), not the scheduler; work conservation is asserted with C tenants
    // in `fair_share` and `isolation`.
    assert!(t.trace.overlaps().is_empty());
}

/// Four PyTorch trainers at requests 0.4 / 0.3 / 0.2 / 0.1 each get theirs.
#[test]
fn four_pytorch_trainers_get_their_requests() {
    let requests = [0.4, 0.3, 0.2, 0.1];
    let groups = ["t40", "t30", "t20", "t10"];
    let tenants: Vec<TorchTenant> = groups
        .iter()
        .zip(requests)
        .map(|(group, request)| TorchTenant {
            group,
            request,
            args: &["train"],
        })
        .collect();
    let t = together(&tenants, 6.0);
    assert_shares(&t, &requests);
}
