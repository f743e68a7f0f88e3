//! `gpushare-bench run` on a small scenario, end to end on the simulated GPU (needs the
//! workspace binaries: `cargo build --workspace --bins --lib`).

use gpushare_bench::report::{Report, RunReport, Spread};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};

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

fn in_unit(s: &Spread) -> bool {
    (0.0..=1.0).contains(&s.min) && (0.0..=1.0).contains(&s.max)
}

fn ordered(s: &Spread) -> bool {
    s.min <= s.median && s.median <= s.max
}

#[test]
fn small_scenario_end_to_end() {
    let dir = std::env::temp_dir().join(format!("gpushare-bench-e2e-{}", std::process::id()));
    let out_dir = dir.join("out");
    let summary = bench(&small(), &dir, &["--repeat", "2"], &[]);
    assert_eq!(summary.repeat, 2);
    assert_eq!(summary.noise, None);
    assert_eq!(summary.scenarios.len(), 1);
    let sc = &summary.scenarios[0];
    assert_eq!(sc.name, "e2e-small");
    assert_eq!(sc.runs.len(), 2);
    let base = sc.baseline.as_ref().expect("baseline");
    assert_eq!(base.runs.len(), 2);
    assert_eq!(sc.tenants.len(), 2);
    let mut target_sum = 0.0;
    for (i, t) in sc.tenants.iter().enumerate() {
        let native = t.baseline_achieved_share.expect("baseline_achieved_share");
        for (k, s) in [
            ("target_share", t.target_share),
            ("achieved_share", t.achieved_share),
            ("abs_error", t.abs_error),
            ("baseline_achieved_share", native),
        ] {
            assert!(in_unit(&s) && ordered(&s), "{k} = {s:?}");
        }
        // The spread is over the runs' own figures.
        let achieved: Vec<f64> = sc
            .runs
            .iter()
            .map(|r| r.tenants[i].achieved_share)
            .collect();
        assert!(
            achieved.contains(&t.achieved_share.min) && achieved.contains(&t.achieved_share.max)
        );
        // Both tenants really ran.
        assert!(t.achieved_share.min > 0.05, "{t:?}");
        // Alone, the same workload runs faster than when sharing the GPU.
        assert!(t.alone_kernels_per_s.is_some_and(|x| x > 0.0), "{t:?}");
        let vs_alone = t.throughput_vs_alone.expect("throughput_vs_alone");
        assert!(vs_alone.min > 0.0 && vs_alone.median < 1.0, "{t:?}");
        target_sum += t.target_share.median;
    }
    assert!(
        target_sum <= 1.0 + 1e-9,
        "target shares sum to {target_sum}"
    );
    for (k, h) in [("gpushare", &sc.headline), ("native", &base.headline)] {
        for s in [h.max_abs_error, h.device_utilization] {
            assert!(in_unit(&s) && ordered(&s), "{k}: {h:?}");
        }
        assert!(
            h.handoff_p99_us.min >= 0.0 && ordered(&h.handoff_p99_us),
            "{k}: {h:?}"
        );
    }
    let cpu = sc.scheduler_cpu_percent.expect("scheduler_cpu_percent");
    assert!(
        (0.0..=200.0).contains(&cpu.min) && (0.0..=200.0).contains(&cpu.max),
        "scheduler_cpu_percent = {cpu:?}"
    );
    assert!(
        sc.headline.device_utilization.median > 0.5,
        "{:?}",
        sc.headline
    );
    for r in sc.runs.iter().chain(&base.runs) {
        assert!(out_dir.join(&r.records).is_file(), "{} missing", r.records);
    }
    let raw: Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("summary.json")).unwrap()).unwrap();
    assert!(raw.get("launch_overhead").is_some());
    let md = std::fs::read_to_string(out_dir.join("summary.md")).unwrap();
    assert!(md.contains("| e2e-small | 2 |"), "{md}");
    let svg = std::fs::read_to_string(out_dir.join("e2e-small.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `gpushare-bench run SCENARIO --out DIR ARGS…` with extra environment; its summary.json.
fn bench(scenario: &str, dir: &Path, args: &[&str], env: &[(String, String)]) -> Report {
    bench_with_pid(scenario, dir, args, env).0
}

/// [`bench`], and the benchmark's pid.
fn bench_with_pid(
    scenario: &str,
    dir: &Path,
    args: &[&str],
    env: &[(String, String)],
) -> (Report, u32) {
    std::fs::create_dir_all(dir).unwrap();
    let file = dir.join("scenario.toml");
    std::fs::write(&file, scenario).unwrap();
    let out_dir = dir.join("out");
    let child = Command::new(env!("CARGO_BIN_EXE_gpushare-bench"))
        .arg("run")
        .arg(&file)
        .arg("--out")
        .arg(&out_dir)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run gpushare-bench");
    let pid = child.id();
    let out = child.wait_with_output().expect("wait for gpushare-bench");
    assert!(
        out.status.success(),
        "gpushare-bench failed ({}); build the workspace first (cargo build --workspace --bins --lib)\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let report = serde_json::from_slice(&std::fs::read(out_dir.join("summary.json")).unwrap())
        .expect("summary.json is a Report");
    (report, pid)
}

/// Achieved shares of a run.
fn shares(run: &RunReport) -> Vec<f64> {
    run.tenants.iter().map(|t| t.achieved_share).collect()
}

/// `--noisy`: every run is disturbed by a hog and by stalls of each tenant and the scheduler,
/// recorded in the report; the hog does not outlive the benchmark.
#[test]
fn a_noisy_run_records_its_stalls_and_leaves_no_hog() {
    let dir = std::env::temp_dir().join(format!("gpushare-bench-noisy-{}", std::process::id()));
    let args = [
        "--repeat",
        "1",
        "--no-baseline",
        "--no-alone",
        "--noisy",
        "--noise-seed",
        "7",
        "--stall-mean-interval-ms",
        "20",
    ];
    let (summary, pid) = bench_with_pid(&small(), &dir, &args, &[]);
    let noise = summary.noise.expect("noise parameters in the report");
    assert_eq!(
        (noise.seed, noise.hogs, noise.stall_mean_interval_ms),
        (7, 1, 20.0)
    );
    assert_eq!((noise.stall_min_ms, noise.stall_max_ms), (0.1, 5.0));
    let run = &summary.scenarios[0].runs[0];
    let record = run.noise.as_ref().expect("the run's stalls");
    let names: Vec<&str> = record.stalls.iter().map(|p| p.process.as_str()).collect();
    assert_eq!(names, ["big", "small", "scheduler"]);
    // ~40 stalls each in 2.5 s.
    for p in &record.stalls {
        assert!(p.stalls > 0 && p.stopped_ms > 0.0, "{record:?}");
    }
    // Both tenants ran through it.
    assert!(shares(run).iter().all(|&s| s > 0.05), "{run:?}");
    // No hog of this benchmark is left.
    let parent = format!("--parent\0{pid}\0");
    let hogs: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).into_owned())
        .filter(|c| c.contains("hog\0") && c.contains(&parent))
        .collect();
    assert!(hogs.is_empty(), "hogs left: {hogs:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The tenants' own timelines (CUDA timing events, the measurement on a real GPU) give the
/// figures the simulated device's trace gives, for a multi-stream tenant too.
#[test]
fn timelines_from_timing_events_agree_with_the_device_trace() {
    let dir = std::env::temp_dir().join(format!("gpushare-bench-events-{}", std::process::id()));
    let summary = bench(
        &with_threads(),
        &dir,
        &[
            "--source",
            "events",
            "--no-baseline",
            "--no-alone",
            "--repeat",
            "1",
        ],
        &[],
    );
    assert_eq!(summary.gpu, "simulated");
    assert_eq!(summary.measured_from, "tenant CUDA timing events");
    let run = &summary.scenarios[0].runs[0];
    let check = run.device_trace_check.as_ref().expect("device_trace_check");
    let from_device = check.achieved_shares.clone();
    let from_events = shares(run);
    assert!(from_events.iter().all(|&s| s > 0.1), "{from_events:?}");
    for (e, d) in from_events.iter().zip(&from_device) {
        assert!(
            (e - d).abs() <= 0.005,
            "events {from_events:?} vs device {from_device:?}"
        );
    }
    let (ue, ud) = (
        run.summary.device_utilization,
        check.summary.device_utilization,
    );
    assert!(
        (ue - ud).abs() <= 0.01,
        "utilisation: events {ue}, device {ud}"
    );
    assert_eq!(run.records, "e2e-threads-run1.timeline.jsonl");
    assert!(dir.join("out/e2e-threads-run1.timeline.jsonl").is_file());
    assert!(dir.join("out/e2e-threads-run1.trace.jsonl").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

/// On a machine whose `libcuda.so.1` reports a GPU, the benchmark runs there and measures from
/// timing events. Here the "machine's driver" is a simulated device started outside the bench,
/// whose trace is the ground truth the bench never sees.
#[test]
fn on_a_machine_with_a_gpu_the_bench_runs_on_it() {
    use gpushare_testkit::node::Node;
    use gpushare_testkit::trace::Window;
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
    let summary = bench(
        &small(),
        &dir,
        &["--no-baseline", "--no-alone", "--repeat", "1"],
        &env,
    );
    let truth = machine.finish();
    assert_eq!(summary.gpu, "this machine's (1)");
    assert_eq!(summary.measured_from, "tenant CUDA timing events");
    let run = &summary.scenarios[0].runs[0];
    assert!(run.device_trace_check.is_none());
    assert!(!dir.join("out/e2e-small-run1.trace.jsonl").exists());
    assert!(dir.join("out/e2e-small-run1.timeline.jsonl").is_file());
    // The figures match the device's own record of the same span.
    let window = Window::new(run.measure_start_ns, run.measure_end_ns);
    let mut by_pid: Vec<f64> = truth
        .busy_by_pid(0, window)
        .values()
        .map(|&ns| ns as f64 / window.len_ns() as f64)
        .filter(|&s| s > 0.01)
        .collect();
    let mut measured = shares(run);
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

/// `--scheduler-log` keeps, next to each run's trace, the scheduler's decisions and the turns'
/// reports with its clock: every turn reported was granted, and the file is plain text.
#[test]
fn the_scheduler_log_keeps_its_decisions_and_the_turns_reports() {
    let dir = std::env::temp_dir().join(format!("gpushare-bench-slog-{}", std::process::id()));
    let args = [
        "--repeat",
        "1",
        "--no-baseline",
        "--no-alone",
        "--scheduler-log",
    ];
    bench(&small(), &dir, &args, &[]);
    let log = std::fs::read_to_string(dir.join("out/e2e-small-run1.scheduler.log"))
        .expect("the run's scheduler log next to its trace");
    assert!(!log.contains('\u{1b}'), "no terminal colours in a file");
    let token = |line: &str, key: &str| -> Option<u64> {
        let rest = &line[line.find(key)? + key.len()..];
        let end = rest.find(|c: char| !c.is_ascii_digit())?;
        rest[..end].parse().ok()
    };
    let granted: Vec<u64> = log
        .lines()
        .filter(|l| l.contains(" decision ") && l.contains("Grant {"))
        .filter_map(|l| token(l, "token: "))
        .collect();
    let reported: Vec<u64> = log
        .lines()
        .filter(|l| l.contains(" report at="))
        .filter_map(|l| token(l, " token="))
        .collect();
    // ~2 s of two training loops in 20 ms turns.
    assert!(granted.len() > 50 && reported.len() > 50, "{log}");
    assert!(
        reported.iter().all(|t| granted.contains(t)),
        "a report of a turn never granted:\n{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
