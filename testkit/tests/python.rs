//! NVIDIA's Python `cuda-bindings` run unmodified on the simulated GPU, bare and under
//! gpushare (its ~500 `cuGetProcAddress` lookups at import are the route the hook must catch).
//! Needs `pip install "cuda-bindings>=12.9,<13" numpy` (`.ci/run` installs them).

use gpushare_testkit::harness::{Sim, describe, json_lines, output_with_timeout};
use gpushare_testkit::node::Node;
use gpushare_testkit::trace::Trace;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

fn script() -> (PathBuf, PathBuf) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    (
        dir.join("python/driver_smoke.py"),
        dir.join("ptx/gpushare_spin.ptx"),
    )
}

fn require_bindings() {
    let out = Command::new("python3")
        .args(["-c", "import cuda.bindings.driver, numpy"])
        .output();
    let found = out.as_ref().is_ok_and(|o| o.status.success());
    assert!(
        found,
        "this test needs NVIDIA's Python driver bindings: pip install \"cuda-bindings>=12.9,<13\" numpy"
    );
}

#[test]
fn cuda_bindings_run_on_the_simulator() {
    require_bindings();
    let (py, ptx) = script();
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("trace.jsonl");
    let sim = Sim::locate();
    let mut cmd = sim.run(&["--trace", trace.to_str().unwrap()], ["python3"]);
    cmd.arg(&py).arg(&ptx).arg("2000000");
    let out = output_with_timeout(cmd, Duration::from_secs(60));
    assert!(out.status.success(), "{}", describe(&out));
    let r = &json_lines(&out.stdout)[0];
    assert_eq!(r["name"], "NVIDIA H100 80GB HBM3");
    assert_eq!(r["total"], 80u64 << 30);
    assert!(
        (r["elapsed_ms"].as_f64().unwrap() - 2.0).abs() < 0.06,
        "{r}"
    );
    assert_eq!(r["round_trip"], true);
    let t = Trace::read(&trace).unwrap();
    assert_eq!(
        t.records()
            .iter()
            .filter(|x| x.kernel == "gpushare_spin")
            .count(),
        2
    );
}

#[test]
fn cuda_bindings_are_gated_and_capped_by_gpushare() {
    require_bindings();
    let (py, ptx) = script();
    let node = Node::start(&[]);
    let mut cmd = node.command(gpushare_testkit::harness::target_dir().join("gpushare"));
    cmd.args([
        "run",
        "--group",
        "py",
        "--request",
        "0.5",
        "--memory",
        "1GiB",
        "--",
        "python3",
    ])
    .arg(&py)
    .arg(&ptx)
    .arg("2000000")
    .env("GPUSHARE_FAIL", "closed");
    let out = output_with_timeout(cmd, Duration::from_secs(60));
    assert!(out.status.success(), "{}", describe(&out));
    let r = &json_lines(&out.stdout)[0];
    assert_eq!(r["total"], 1u64 << 30, "cuMemGetInfo reports the cap: {r}");
    let group = node
        .status_group("py")
        .expect("the scheduler saw the python process");
    assert!(
        group["tokens"].as_u64().unwrap() >= 1,
        "its launches were gated: {group}"
    );
    node.finish();
}
