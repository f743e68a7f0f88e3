//! Launch overhead: ns per `cuLaunchKernel` of `cudarc-client launch-latency` under the hook
//! (alone, so the token stays held: the fast path) against the driver's own entry point in the
//! same process, and, as a control and the classic comparison, in processes without the hook.

use crate::client::LaunchLatency;
use crate::progress;
use crate::report::{LaunchOverhead, SeparateProcesses, Spread, round};
use crate::settings::Settings;
use anyhow::{Context, bail};
use gpushare_testkit::harness::target_dir;
use gpushare_testkit::node::Tenant;
use std::process::Command;
use std::time::Duration;

/// Native/hooked pairs of launch-overhead runs (fewer with `--quick`); odd, so that the median
/// is one pair's.
pub const PAIRS: usize = 15;
pub const QUICK_PAIRS: usize = 7;

/// Launches per route per process.
const LAUNCHES: u64 = 50_000;

/// `cudarc-client launch-latency` from `cmd`: its result line.
fn measure(cmd: Command) -> anyhow::Result<LaunchLatency> {
    let (out, killed) = Tenant::spawn(cmd).finish_within(Duration::from_secs(60));
    if killed || !out.status.success() {
        bail!(
            "launch-latency failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let last = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or("")
        .to_string();
    serde_json::from_str(&last)
        .with_context(|| format!("launch-latency printed no result line: {last:?}"))
}

/// Min / median / max of `f` over `runs` (an odd number: the median is a run's).
fn over(
    runs: &[(LaunchLatency, LaunchLatency)],
    f: impl Fn(&LaunchLatency, &LaunchLatency) -> f64,
) -> Spread {
    Spread::all(runs.iter().map(|(n, h)| f(n, h)), 4)
}

/// Measure over `pairs` native/hooked process pairs.
pub fn measure_launch_overhead(pairs: usize, s: &Settings) -> anyhow::Result<LaunchOverhead> {
    progress("launch overhead: cudarc-client launch-latency, hooked vs the driver's own entry");
    let mut node = s.node(1)?;
    node.start_scheduler(&[]);
    let client = target_dir().join("cudarc-client");
    let n_arg = LAUNCHES.to_string();
    let args = ["launch-latency", "--n", n_arg.as_str()];
    // In each process launches alternate, block by block, between the route the program
    // resolves (the hook's wrapper when preloaded) and the driver's own entry point: the ratio
    // compares the two under the same conditions. Native processes are the control (both
    // routes are the driver: ratio 1 up to the method's noise) and, against the hooked
    // processes, the comparison of separate runs, alternating so that drifts of a shared machine hit
    // both alike.
    let mut runs = Vec::new();
    for _ in 0..pairs {
        let mut c = node.command(&client);
        c.args(args);
        let native = measure(c)?;
        let hooked = measure(node.run_command(&["--group", "overhead"], &client, &args))?;
        runs.push((native, hooked));
    }
    let ratio = over(&runs, |_, h| h.direct_over_linked);
    let hooked_ns = over(&runs, |_, h| h.ns_per_launch).median;
    let direct_ns = over(&runs, |_, h| h.ns_per_launch_direct).median;
    let control = over(&runs, |n, _| n.direct_over_linked);
    let sep_native = over(&runs, |n, _| n.ns_per_launch).median;
    let sep_ratio = over(&runs, |n, h| n.ns_per_launch / h.ns_per_launch);
    progress(format!(
        "launch overhead: hooked {hooked_ns:.0} ns vs the driver's own entry {direct_ns:.0} ns in the same process, ratio {:.3} ({:.3}–{:.3}); control without the hook {:.3}; separate processes {sep_native:.0} vs {hooked_ns:.0} ns, ratio {:.3} ({:.3}–{:.3})",
        ratio.median,
        ratio.min,
        ratio.max,
        control.median,
        sep_ratio.median,
        sep_ratio.min,
        sep_ratio.max
    ));
    // Token turnover: the same hooked measurement while a training loop of another group
    // competes for the token (launches wait while the other group holds it).
    let competitor = Tenant::spawn(node.tenant_command(
        "competitor",
        0.0,
        1.0,
        1.0,
        &client,
        &[
            "spin",
            "--ms-per-kernel",
            "1",
            "--duration-ms",
            "20000",
            "--sync-every",
            "20",
        ],
    ));
    std::thread::sleep(Duration::from_millis(300));
    let turnover = measure(node.run_command(&["--group", "overhead"], &client, &args));
    drop(competitor);
    let turnover = turnover?.ns_per_launch;
    progress(format!(
        "launch overhead with token turnover (a competing group): {turnover:.0} ns per launch"
    ));
    drop(node.stop());
    Ok(LaunchOverhead {
        method: "same process, blocks of 100 launches from an idle stream alternating between the hooked entry and the driver's own; medians".into(),
        pairs,
        launches_per_sample: 2 * LAUNCHES,
        hooked_ns: round(hooked_ns, 1),
        native_ns: round(direct_ns, 1),
        overhead_ns: round(hooked_ns - direct_ns, 1),
        ratio,
        control_ratio: control,
        separate_processes: SeparateProcesses {
            native_ns: round(sep_native, 1),
            hooked_ns: round(hooked_ns, 1),
            ratio: sep_ratio,
        },
        hooked_turnover_ns: round(turnover, 1),
    })
}
