//! Several processes on the simulated GPUs: one device is time-sliced fairly between them (the
//! "without gpushare" baseline), separate devices run in parallel.

mod common;

use common::{env, sh_quote, u64_field};
use gpushare_testkit::harness::{describe, json_lines};
use gpushare_testkit::margins;
use gpushare_testkit::trace::{Trace, common_window};
use std::collections::BTreeSet;

/// A shell script starting `cmds` in the background and failing if any of them fails.
fn all_in_background(cmds: &[String]) -> String {
    let mut s = String::new();
    for (i, c) in cmds.iter().enumerate() {
        s += &format!("{c} & p{i}=$!\n");
    }
    for i in 0..cmds.len() {
        s += &format!("wait $p{i} || exit 1\n");
    }
    s
}

/// Run `spin` clients concurrently (one per `(device, kernels)`), return their JSON lines and
/// the trace.
fn run_spinners(
    sim_args: &[&str],
    clients: &[(u32, u32)],
    ms: f64,
) -> (Vec<serde_json::Value>, Trace) {
    let env = env();
    let client = sh_quote(&env.client);
    let cmds: Vec<String> = clients
        .iter()
        .map(|(dev, kernels)| {
            format!("{client} --device {dev} spin --ms-per-kernel {ms} --kernels {kernels}")
        })
        .collect();
    let script = all_in_background(&cmds);
    let out = env.run_ok(sim_args, ["sh", "-c", &script]);
    let results = json_lines(&out.stdout);
    assert_eq!(
        results.len(),
        clients.len(),
        "one JSON line per client\n{}",
        describe(&out)
    );
    (results, env.trace())
}

fn pid_of(v: &serde_json::Value) -> u32 {
    u64_field(v, "pid") as u32
}

/// Two processes, each with ~1 s of 2 ms kernels, on one device: the device never runs both at
/// once, each gets half of it while both are busy, and it is almost never idle.
#[test]
fn two_processes_share_one_device_evenly() {
    let (results, trace) = run_spinners(&[], &[(0, 500), (0, 500)], 2.0);
    let pids: BTreeSet<u32> = results.iter().map(pid_of).collect();
    assert_eq!(pids.len(), 2);
    assert_eq!(trace.pids(), pids, "trace pids vs client pids");
    assert_eq!(trace.devices(), [0].into());

    let overlaps = trace.overlaps();
    assert!(
        overlaps.is_empty(),
        "{} overlapping record pairs on one device, e.g. {:#?}",
        overlaps.len(),
        &overlaps[..overlaps.len().min(3)]
    );

    // Every process got its full 1 s of device time.
    let all = trace.span().unwrap();
    for (pid, busy) in trace.busy_by_pid(0, all) {
        assert!(
            (busy as f64 - 1e9).abs() <= 0.01e9,
            "pid {pid} ran {:.3} s of its 1 s of kernels",
            busy as f64 / 1e9
        );
    }

    let spans: Vec<_> = pids
        .iter()
        .map(|&p| trace.span_of_pid(p).unwrap())
        .collect();
    let window =
        common_window(spans.iter().copied()).expect("the two processes never ran together");
    let shares = trace.shares(0, window);
    let util = trace.utilization(0, window);
    println!(
        "2 processes on 1 device: common window {window}, shares {shares:?}, utilisation {util:.4}; \
         total span {all}; clients: {results:?}"
    );
    assert!(
        window.len_ns() >= 1_000_000_000,
        "the processes were both active for only {window}: expected most of ~2 s"
    );
    for (pid, share) in &shares {
        assert!(
            (share - 0.5).abs() <= 0.05,
            "pid {pid} got {share:.3} of the device in {window}, expected 0.5 +- 0.05"
        );
    }
    assert!(
        util >= margins::UTILISATION,
        "device utilisation {util:.4} in {window}, expected >= {}",
        margins::UTILISATION
    );
    // Contended, the 2 ms kernels are preempted at the end of each 1 ms time slice.
    let contended = trace.filter(|r| r.window().intersect(&window.shrink(5_000_000)).is_some());
    let longest = contended
        .records()
        .iter()
        .map(|r| r.duration_ns())
        .max()
        .unwrap();
    assert!(
        longest <= 1_000_000,
        "a {longest} ns record while both processes were busy: the default time slice is 1 ms"
    );
    assert!(
        contended.records().iter().any(|r| r.preempted),
        "no preempted slice while both processes were busy"
    );
    // Both processes needed about twice their own device time.
    for v in &results {
        let wall_ms = v["wall_ms"].as_f64().unwrap();
        assert!(
            wall_ms >= 1700.0,
            "a sharing process finished in {wall_ms} ms: {v}"
        );
    }
}

/// With `--gpus 2`, a process on each device: both devices are busy at the same time.
#[test]
fn two_devices_run_in_parallel() {
    let (results, trace) = run_spinners(&["--gpus", "2"], &[(0, 150), (1, 150)], 2.0);
    assert_eq!(trace.devices(), [0, 1].into());
    assert!(trace.overlaps().is_empty(), "{:#?}", trace.overlaps());
    for v in &results {
        // The client named by --device DEV is the only user of device DEV.
        let dev = u64_field(v, "device") as u32;
        let on_dev = trace.filter(|r| r.device == dev);
        assert_eq!(on_dev.pids(), [pid_of(v)].into(), "device {dev}: {v}");
        assert_eq!(on_dev.len(), 150, "device {dev}: 150 unpreempted kernels");
    }
    let s0 = trace.filter(|r| r.device == 0).span().unwrap();
    let s1 = trace.filter(|r| r.device == 1).span().unwrap();
    let both = s0
        .intersect(&s1)
        .expect("the two devices were never busy at the same time");
    let shorter = s0.len_ns().min(s1.len_ns());
    println!("2 devices: device 0 {s0}, device 1 {s1}, both busy {both}");
    assert!(
        both.len_ns() * 2 >= shorter,
        "devices overlapped for only {both} of {shorter} ns: they did not run in parallel"
    );
    for dev in [0, 1] {
        let util = trace.utilization(dev, both);
        assert!(
            util >= 0.95,
            "device {dev} utilisation {util:.4} while both were busy"
        );
    }
}
