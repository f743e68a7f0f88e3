//! The report: `summary.json` is a [`Report`] (rendered to `summary.md` by
//! [`crate::markdown`]). Every headline figure of a scenario is given over its repeated runs as a
//! [`Spread`] (min / median / max); each run's own figures are kept in `runs`.

use crate::analysis::RunSummary;
use crate::fault::FaultSpec;
use crate::noise::{NoiseParams, NoiseRecord};
use crate::scenario::Workload;
use gpushare_protocol::status::Durations;
use gpushare_testkit::flood::{FloodOutcome, FloodSpec};
use serde::{Deserialize, Serialize};

/// A figure over repeated runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub min: f64,
    /// The middle run's (the mean of the two middle ones for an even count).
    pub median: f64,
    pub max: f64,
}

impl Spread {
    /// Min / median / max of `values`, rounded to `decimals` places; `None` when empty.
    pub fn of(values: impl IntoIterator<Item = f64>, decimals: i32) -> Option<Spread> {
        let mut v: Vec<f64> = values.into_iter().collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Spread {
            min: round(v[0], decimals),
            median: round(median, decimals),
            max: round(v[n - 1], decimals),
        })
    }

    /// [`Spread::of`] for figures every run has.
    pub fn all(values: impl IntoIterator<Item = f64>, decimals: i32) -> Spread {
        Spread::of(values, decimals).expect("at least one run")
    }
}

/// `x` rounded to `decimals` places.
pub fn round(x: f64, decimals: i32) -> f64 {
    let k = 10f64.powi(decimals);
    (x * k).round() / k
}

/// `s` as the report gives it: shares to 4 places, times to 0.1 µs.
pub fn rounded(s: &RunSummary) -> RunSummary {
    RunSummary {
        max_abs_error: round(s.max_abs_error, 4),
        mean_abs_error: round(s.mean_abs_error, 4),
        device_utilization: round(s.device_utilization, 4),
        handoffs: s.handoffs,
        handoff_p50_us: round(s.handoff_p50_us, 1),
        handoff_p99_us: round(s.handoff_p99_us, 1),
    }
}

/// `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Run with `--quick` (3 s per scenario).
    pub quick: bool,
    /// `simulated`, or `this machine's (N)`.
    pub gpu: String,
    /// `device trace` or `tenant CUDA timing events`.
    pub measured_from: String,
    /// Runs per scenario (`--repeat`), with gpushare and natively each.
    pub repeat: u32,
    /// The noisy-host mode's parameters, when `--noisy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise: Option<NoiseParams>,
    pub wall_s: f64,
    pub warmup_s: f64,
    pub window_s: f64,
    pub scenarios: Vec<ScenarioReport>,
    /// With `--overhead` (always in `suite`).
    pub launch_overhead: Option<LaunchOverhead>,
    pub errors: Vec<Failure>,
}

/// A part of the benchmark that failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// Scenario name, or `launch_overhead`.
    pub name: String,
    pub error: String,
}

/// The figures of a scenario's headline, over its runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Headline {
    /// Largest |share − target| of any tenant in any window.
    pub max_abs_error: Spread,
    /// Mean over tenants and windows of |share − target|.
    pub mean_abs_error: Spread,
    /// Busy fraction of the GPUs over the measurement span.
    pub device_utilization: Spread,
    /// Idle time at changes of the process running on a GPU (µs).
    pub handoff_p50_us: Spread,
    pub handoff_p99_us: Spread,
}

impl Headline {
    pub fn of(runs: &[RunReport]) -> Headline {
        let s = |f: fn(&RunSummary) -> f64, d| Spread::all(runs.iter().map(|r| f(&r.summary)), d);
        Headline {
            max_abs_error: s(|r| r.max_abs_error, 4),
            mean_abs_error: s(|r| r.mean_abs_error, 4),
            device_utilization: s(|r| r.device_utilization, 4),
            handoff_p50_us: s(|r| r.handoff_p50_us, 1),
            handoff_p99_us: s(|r| r.handoff_p99_us, 1),
        }
    }
}

/// One scenario: its tenants' figures and the headline, over `runs` with gpushare (and the
/// same number natively, in `baseline`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScenarioReport {
    pub name: String,
    pub description: String,
    pub gpus: u32,
    pub duration_s: f64,
    pub tenants: Vec<TenantReport>,
    /// Sum of the tenants' targets (above 1 with several GPUs).
    pub target_share_sum: Spread,
    #[serde(flatten)]
    pub headline: Headline,
    /// Scheduler CPU time per wall time while the tenants ran (%).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_cpu_percent: Option<Spread>,
    /// Scenarios with a `[flood]`: the flood and what the scheduler did under it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flood: Option<FloodReport>,
    /// Scenarios with a `[fault]`: the fault and what it cost the tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<FaultReport>,
    /// How late the scheduler's event loop ran, each run's (ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_loop: Option<EventLoopReport>,
    /// Each run with gpushare.
    pub runs: Vec<RunReport>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<Baseline>,
    /// Shares over time of the run with the median `max_abs_error` (`plot_run`, from 1).
    pub plot: String,
    pub plot_run: u32,
    pub wall_s: f64,
}

/// The same tenants without gpushare (the device's own time-slicing).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    #[serde(flatten)]
    pub headline: Headline,
    pub runs: Vec<RunReport>,
    pub plot: String,
    pub plot_run: u32,
}

/// A tenant over the runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantReport {
    pub name: String,
    pub workload: Workload,
    pub gpu: u32,
    pub request: f64,
    pub limit: f64,
    pub weight: f64,
    /// Over the measurement span; it moves between runs only for a latency tenant (its demand
    /// is the work of the requests that arrived).
    pub target_share: Spread,
    pub achieved_share: Spread,
    pub abs_error: Spread,
    /// The worst window's |share − target|.
    pub max_window_error: Spread,
    /// Kernels per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throughput_kps: Option<Spread>,
    /// The same workload alone under gpushare (one run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alone_kernels_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throughput_vs_alone: Option<Spread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_achieved_share: Option<Spread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_abs_error: Option<Spread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_throughput_kps: Option<Spread>,
    /// Latency tenants: request latency with gpushare, natively, alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<LatencySpread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_latency: Option<LatencySpread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alone_latency: Option<Latency>,
}

/// Request latency of one run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    /// With fewer than 1000 requests, the slowest.
    pub p999_ms: f64,
    pub requests: u64,
}

/// Request latency over runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LatencySpread {
    pub p50_ms: Spread,
    pub p90_ms: Spread,
    pub p99_ms: Spread,
    pub p999_ms: Spread,
}

impl LatencySpread {
    /// `None` unless every run has a latency.
    pub fn of(runs: &[Option<Latency>]) -> Option<LatencySpread> {
        let all: Vec<Latency> = runs.iter().copied().collect::<Option<_>>()?;
        Some(LatencySpread {
            p50_ms: Spread::of(all.iter().map(|l| l.p50_ms), 2)?,
            p90_ms: Spread::of(all.iter().map(|l| l.p90_ms), 2)?,
            p99_ms: Spread::of(all.iter().map(|l| l.p99_ms), 2)?,
            p999_ms: Spread::of(all.iter().map(|l| l.p999_ms), 2)?,
        })
    }
}

/// One run's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// 1, 2, …
    pub run: u32,
    #[serde(flatten)]
    pub summary: RunSummary,
    /// Measurement windows and their span (CLOCK_MONOTONIC ns).
    pub windows: usize,
    pub measure_start_ns: u64,
    pub measure_end_ns: u64,
    /// Per tenant, in the scenario's order.
    pub tenants: Vec<TenantRun>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_cpu_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_cpu_percent: Option<f64>,
    /// Measuring from the tenants' timelines on the simulator: the device trace's figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_trace_check: Option<DeviceCheck>,
    /// `--noisy`: what the noise did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise: Option<NoiseRecord>,
    /// Under a `[flood]`: the scheduler's threads, `gpushare status` latency, the connections.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flood: Option<FloodRun>,
    /// Under a `[fault]`: what it cost the tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<FaultRun>,
    /// With gpushare: how late the scheduler's event loop ran (`gpushare status` at the end of
    /// the run: since the scheduler started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_loop: Option<EventLoopRun>,
    /// The kernel records the figures come from (file in the output directory).
    pub records: String,
}

/// One tenant in one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantRun {
    pub target_share: f64,
    pub achieved_share: f64,
    pub abs_error: f64,
    pub max_window_error: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throughput_kps: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<Latency>,
}

/// A scenario's connection flood over its runs with gpushare.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FloodReport {
    /// The connections of each kind.
    pub connections: FloodSpec,
    /// The scheduler's thread count, the most seen in each run (`/proc/PID/task`, sampled every
    /// [`FLOOD_SAMPLE_MS`] ms).
    pub threads_max: Spread,
    /// `gpushare status --json` wall time per call (process start included), each run's
    /// slowest and median (ms).
    pub status_max_ms: Spread,
    pub status_median_ms: Spread,
    /// Status calls that failed, over all runs.
    pub status_failures: usize,
}

impl FloodReport {
    /// `None` unless every run was flooded.
    pub fn of(connections: FloodSpec, runs: &[RunReport]) -> Option<FloodReport> {
        let all: Vec<&FloodRun> = runs
            .iter()
            .map(|r| r.flood.as_ref())
            .collect::<Option<_>>()?;
        Some(FloodReport {
            connections,
            threads_max: Spread::of(all.iter().map(|f| f.threads_max as f64), 0)?,
            status_max_ms: Spread::of(all.iter().map(|f| f.status_max_ms), 1)?,
            status_median_ms: Spread::of(all.iter().map(|f| f.status_median_ms), 1)?,
            status_failures: all.iter().map(|f| f.status_failures.len()).sum(),
        })
    }
}

/// A scenario's fault over its runs with gpushare.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultReport {
    pub fault: FaultSpec,
    /// Each run's figures ([`FaultRun`]).
    pub gpu_busy: Spread,
    pub longest_blocked_ms: Spread,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift_after: Option<Spread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub back_ms: Option<Spread>,
    /// Starved under a quota: the share of its 100 ms periods the scheduler was throttled in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttled: Option<Spread>,
    /// A full journal: in how many runs the allocation made meanwhile succeeded, the hook said
    /// it was not journaled, and the scheduler logged that it cannot write its journal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<JournalReport>,
}

/// What became of the allocations made while the journal's file system was full, over the
/// runs: how many runs had each outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalReport {
    pub runs: usize,
    pub allocated: usize,
    pub hook_said: usize,
    pub scheduler_said: usize,
}

impl FaultReport {
    /// `None` unless every run had the fault.
    pub fn of(fault: FaultSpec, runs: &[RunReport]) -> Option<FaultReport> {
        let all: Vec<&FaultRun> = runs
            .iter()
            .map(|r| r.fault.as_ref())
            .collect::<Option<_>>()?;
        Some(FaultReport {
            fault,
            gpu_busy: Spread::of(all.iter().map(|f| f.gpu_busy), 4)?,
            longest_blocked_ms: Spread::of(all.iter().map(|f| f.longest_blocked_ms), 1)?,
            drift_after: Spread::of(all.iter().filter_map(|f| f.drift_after), 4),
            back_ms: Spread::of(all.iter().filter_map(|f| f.back_ms), 1),
            throttled: Spread::of(
                (all.iter().filter_map(|f| f.throttled_periods))
                    .map(|(t, n)| t as f64 / n.max(1) as f64),
                3,
            ),
            journal: {
                let j: Vec<JournalRun> = all.iter().filter_map(|f| f.journal).collect();
                let count = |f: fn(&JournalRun) -> bool| j.iter().filter(|r| f(r)).count();
                (!j.is_empty()).then(|| JournalReport {
                    runs: j.len(),
                    allocated: count(|r| r.allocated),
                    hook_said: count(|r| r.hook_said),
                    scheduler_said: count(|r| r.scheduler_said),
                })
            },
        })
    }
}

/// One run's fault.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultRun {
    /// The fault's window: from the stop or kill to the continue or restart; a starved run's
    /// measured span.
    pub window_ms: f64,
    /// The GPU's busy fraction of the window.
    pub gpu_busy: f64,
    /// The longest any tenant started no kernel in the window.
    pub longest_blocked_ms: f64,
    /// Stop, kill: the largest |share − target| from a second after the window to the end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift_after: Option<f64>,
    /// Kill: when every tenant was connected to the new scheduler, after it started; socket
    /// removed: when every tenant was listed through the path again, after the removal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub back_ms: Option<f64>,
    /// Starved: the 100 ms periods the scheduler was throttled in, of those it ran in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttled_periods: Option<(u64, u64)>,
    /// A full journal: what became of the allocation made meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<JournalRun>,
}

/// What became of the allocation made while the journal's file system was full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalRun {
    /// The allocating process (fail-open) ran to its end: its allocation succeeded.
    pub allocated: bool,
    /// It said on stderr that the reservation was not journaled.
    pub hook_said: bool,
    /// The scheduler logged that it cannot write its journal.
    pub scheduler_said: bool,
}

/// The scheduler's event-loop lateness over a scenario's runs (ms).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventLoopReport {
    pub p50_ms: Spread,
    pub p99_ms: Spread,
    pub max_ms: Spread,
}

impl EventLoopReport {
    /// `None` unless every run has it.
    pub fn of(runs: &[RunReport]) -> Option<EventLoopReport> {
        let all: Vec<&EventLoopRun> = runs
            .iter()
            .map(|r| r.event_loop.as_ref())
            .collect::<Option<_>>()?;
        Some(EventLoopReport {
            p50_ms: Spread::of(all.iter().map(|l| l.p50_ms), 3)?,
            p99_ms: Spread::of(all.iter().map(|l| l.p99_ms), 3)?,
            max_ms: Spread::of(all.iter().map(|l| l.max_ms), 3)?,
        })
    }
}

/// How late the scheduler's event loop handled what was due in one run: quantiles are the
/// upper bounds of the histogram's buckets (`gpushare_event_loop_lateness_seconds`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventLoopRun {
    pub events: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl EventLoopRun {
    /// From `gpushare status --json`'s `event_loop`.
    pub fn of(status: &serde_json::Value) -> Option<EventLoopRun> {
        let l: Durations = serde_json::from_value(status.get("event_loop")?.clone()).ok()?;
        let q = |x| round(l.quantile(x).unwrap_or(0.0) * 1e3, 3);
        Some(EventLoopRun {
            events: l.count,
            p50_ms: q(0.5),
            p99_ms: q(0.99),
            max_ms: round(l.max_s * 1e3, 3),
        })
    }
}

/// How often a flooded run samples the scheduler's threads and `gpushare status`.
pub const FLOOD_SAMPLE_MS: u64 = 250;

/// One run under a connection flood.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FloodRun {
    pub threads_max: usize,
    /// `gpushare status --json` calls made while the tenants ran, the slowest and the median (ms).
    pub status_calls: usize,
    pub status_max_ms: f64,
    pub status_median_ms: f64,
    /// Why the status calls that failed did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub status_failures: Vec<String>,
    /// What became of the flood's connections at the end of the run.
    #[serde(flatten)]
    pub connections: FloodOutcome,
}

/// The device trace's figures of a run measured from the tenants' timelines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceCheck {
    pub achieved_shares: Vec<f64>,
    #[serde(flatten)]
    pub summary: RunSummary,
}

/// Launch overhead: `cudarc-client launch-latency` hooked against the driver's own entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LaunchOverhead {
    pub method: String,
    /// Native/hooked process pairs.
    pub pairs: usize,
    pub launches_per_sample: u64,
    /// Medians over the hooked processes: through the hook, and through the driver's own entry
    /// in the same processes.
    pub hooked_ns: f64,
    pub native_ns: f64,
    pub overhead_ns: f64,
    /// Throughput ratio (driver's own time / hooked time) over the hooked processes.
    pub ratio: Spread,
    /// The same ratio in processes without the hook (both routes are the driver): the noise
    /// floor.
    pub control_ratio: Spread,
    pub separate_processes: SeparateProcesses,
    /// Hooked, while another group competes for the token.
    pub hooked_turnover_ns: f64,
}

/// Launch cost of separate native and hooked processes (medians over the pairs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeparateProcesses {
    pub native_ns: f64,
    pub hooked_ns: f64,
    pub ratio: Spread,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_runs() {
        let s = Spread::of([0.3, 0.1, 0.2], 4).unwrap();
        assert_eq!(
            s,
            Spread {
                min: 0.1,
                median: 0.2,
                max: 0.3
            }
        );
        assert_eq!(Spread::of([4.0, 1.0], 1).unwrap().median, 2.5);
        assert_eq!(Spread::of([0.123456], 3).unwrap().median, 0.123);
        assert_eq!(Spread::of(std::iter::empty(), 3), None);
    }

    #[test]
    fn latency_over_runs_needs_every_run() {
        let l = |p50| {
            Some(Latency {
                p50_ms: p50,
                p90_ms: 1.5 * p50,
                p99_ms: 2.0 * p50,
                p999_ms: 3.0 * p50,
                requests: 10,
            })
        };
        let s = LatencySpread::of(&[l(1.0), l(3.0), l(2.0)]).unwrap();
        assert_eq!(s.p50_ms.median, 2.0);
        assert_eq!(s.p99_ms.max, 6.0);
        assert_eq!(LatencySpread::of(&[l(1.0), None]), None);
    }
}
