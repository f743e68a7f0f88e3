//! The `memory-overcommit` scenario: tenants whose working sets grow and shrink in phases, with
//! memory caps that sum past the GPU (`gpushare-scheduler --memory-overcommit`), against the same
//! tenants one after another and under static caps that split the GPU. Each tenant is the C
//! program `phase_tenant` (testkit), which writes its buffers and checks them at the end of
//! every phase.

use crate::progress;
use crate::report::{Spread, round};
use gpushare_testkit::node::{
    Node, Tenant, group_in, longest_without_kernel, monotonic_ns, shares_in,
};
use gpushare_testkit::trace::{Trace, Window};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;

/// The scenario's parameters (fixed before any measurement).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Params {
    /// `gpushare-sim serve --memory`.
    pub gpu_bytes: u64,
    /// `--checkpoint-bandwidth` / `--restore-bandwidth` of the simulated driver (`None`: its
    /// defaults, measured on an H200).
    pub checkpoint_bandwidth: Option<String>,
    pub restore_bandwidth: Option<String>,
    /// `gpushare-scheduler --memory-overcommit`.
    pub overcommit: f64,
    /// Each tenant's memory cap with overcommit.
    pub cap_bytes: u64,
    /// Each tenant's cap in the static run (the GPU split evenly).
    pub static_cap_bytes: u64,
    /// Working set (bytes) of each phase, per tenant.
    pub phases: Vec<Vec<u64>>,
    pub kernel_ms: f64,
    pub kernels_per_phase: u64,
    /// The scheduler's `[overcommit]` table, if not its defaults.
    pub overcommit_table: Option<String>,
    /// The longest gap (ms) between a tenant's kernels within a window in which it counts as
    /// resident and running.
    pub resident_gap_ms: u64,
    /// How long a run may take before its tenants are killed.
    pub timeout_s: u64,
}

impl Params {
    /// The benchmark: an 80 GiB GPU, 4 tenants capped at 40 GiB (caps 2× the GPU), each
    /// alternating 8 GiB and 36 GiB phases (peaks 144 GiB, 1.8× the GPU), two of them starting
    /// with a peak; 4 phases of 250 kernels of 10 ms (2.5 s of GPU time alone each); the
    /// simulated driver's checkpoint and restore bandwidths scaled ×10 (15 GB/s and 44 GB/s: at
    /// the H200's, a 36 GiB swap out takes 26 s and the scheduler keeps a group in memory four
    /// times what its swaps cost, which would make a run last many minutes).
    pub fn full() -> Params {
        let (base, peak) = (8 * GIB, 36 * GIB);
        let low_first = vec![base, peak, base, peak];
        let high_first = vec![peak, base, peak, base];
        Params {
            gpu_bytes: 80 * GIB,
            checkpoint_bandwidth: Some("15GB/s".into()),
            restore_bandwidth: Some("44GB/s".into()),
            overcommit: 2.0,
            cap_bytes: 40 * GIB,
            static_cap_bytes: 20 * GIB,
            phases: vec![low_first.clone(), high_first.clone(), low_first, high_first],
            kernel_ms: 10.0,
            kernels_per_phase: 250,
            overcommit_table: None,
            resident_gap_ms: 250,
            timeout_s: 600,
        }
    }

    /// A small version for tests: a 4 GiB GPU, caps of 2 GiB, phases of 0.5 and 1.75 GiB,
    /// 3 phases of 80 kernels of 5 ms, the driver's bandwidths scaled ×10 as in the benchmark,
    /// and memory turns of 1 s. An allocation waits for as long as a swap would take before
    /// one is made: with swaps this cheap, the first peak phases (0.4 s of GPU time each) last
    /// longer than that wait, so a run always swaps.
    pub fn small() -> Params {
        let mib = 1 << 20;
        let (base, peak) = (512 * mib, 1792 * mib);
        let low_first = vec![base, peak, base];
        let high_first = vec![peak, base, peak];
        Params {
            gpu_bytes: 4 * GIB,
            checkpoint_bandwidth: Some("15GB/s".into()),
            restore_bandwidth: Some("44GB/s".into()),
            overcommit: 2.0,
            cap_bytes: 2 * GIB,
            static_cap_bytes: GIB,
            phases: vec![low_first.clone(), high_first.clone(), low_first, high_first],
            kernel_ms: 5.0,
            kernels_per_phase: 80,
            overcommit_table: Some(
                "[overcommit]\nwait = \"200ms\"\nmemory_turn = \"1s\"\nwindow = \"10s\"\n".into(),
            ),
            resident_gap_ms: 250,
            timeout_s: 240,
        }
    }

    fn tenant_args(&self, i: usize) -> Vec<String> {
        let mut a = vec![(i + 1).to_string(), self.kernel_ms.to_string()];
        a.extend(
            self.phases[i]
                .iter()
                .map(|b| format!("{b}:{}", self.kernels_per_phase)),
        );
        a
    }
}

/// How the tenants run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// All at once, caps summing past the GPU, the scheduler swapping groups to host memory.
    Overcommit,
    /// One after another, each alone on the GPU with its cap.
    Sequential,
    /// All at once, each capped at an even split of the GPU (no overcommit).
    StaticCaps,
}

/// One tenant's end.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantEnd {
    pub group: String,
    pub finished: bool,
    /// It got `CUDA_ERROR_OUT_OF_MEMORY` (and ended).
    pub oom: bool,
    /// Every buffer's sampled pages held what it wrote, at the end of every phase.
    pub intact: bool,
    pub wall_s: f64,
    /// The longest one of its allocations took (s).
    pub longest_alloc_wait_s: f64,
    /// Its phases' GPU stretches (CLOCK_MONOTONIC ns): from just before its first launch to
    /// when its synchronisation returned.
    #[serde(skip)]
    pub gpu_stretches: Vec<(u64, u64)>,
}

/// One run's figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunFigures {
    pub mode: Mode,
    /// From the first tenant's start to the last one's end.
    pub completion_s: f64,
    pub tenants: Vec<TenantEnd>,
    pub swap_outs: u64,
    pub swap_ins: u64,
    pub swap_out_failures: u64,
    pub swap_in_failures: u64,
    /// Time the swaps took (the scheduler's `swap_out_seconds` / `swap_in_seconds` sums).
    pub swap_out_s: f64,
    pub swap_in_s: f64,
    /// Bytes moved to host memory (the groups' `memory_swapped` as each swap was seen in
    /// `gpushare status`, polled every 50 ms).
    pub swapped_bytes: u64,
    pub allocation_waits: u64,
    pub allocations_refused: u64,
    /// 1 s windows in which every tenant ran kernels with no gap over `resident_gap_ms`.
    pub resident_windows: usize,
    /// The worst deviation of a tenant's share of the device's busy time from an even split,
    /// over those windows.
    pub worst_share_error: Option<f64>,
    /// Those windows in which every share was within 0.02 of an even split.
    pub windows_within_0_02: usize,
    /// The same over the 1 s windows in which every tenant was resident and wanted the GPU
    /// throughout ([`wanting_all_along`]).
    pub wanting: WindowShares,
}

/// Shares over a set of 1 s windows: how many, the worst deviation of a tenant's share of the
/// busy time from an even split, and how many windows were within 0.02.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WindowShares {
    pub windows: usize,
    pub worst_share_error: Option<f64>,
    pub within_0_02: usize,
}

impl RunFigures {
    pub fn ooms(&self) -> usize {
        self.tenants.iter().filter(|t| t.oom).count()
    }
    pub fn all_finished(&self) -> bool {
        self.tenants.iter().all(|t| t.finished)
    }
    pub fn all_intact(&self) -> bool {
        self.tenants.iter().all(|t| t.intact)
    }
}

/// The last JSON line of `stdout` that has `key`.
fn last_with(stdout: &[u8], key: &str) -> Option<Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v.get(key).is_some())
}

fn start_node(p: &Params, mode: Mode, dir: &Path) -> anyhow::Result<(Node, PathBuf)> {
    let gpu = p.gpu_bytes.to_string();
    let mut serve = vec!["--memory", &gpu];
    if let Some(b) = &p.checkpoint_bandwidth {
        serve.extend(["--checkpoint-bandwidth", b]);
    }
    if let Some(b) = &p.restore_bandwidth {
        serve.extend(["--restore-bandwidth", b]);
    }
    let mut node = Node::device_only_with(&serve);
    node.scheduler_log_filter =
        "warn,gpushare_scheduler::node::overcommit=info,gpushare_scheduler::checkpoint=info".into();
    let config = dir.join("scheduler.toml");
    let ratio = if mode == Mode::StaticCaps {
        1.0
    } else {
        p.overcommit
    };
    std::fs::write(
        &config,
        format!(
            "memory_overcommit = {ratio:?}\n{}",
            p.overcommit_table.as_deref().unwrap_or("")
        ),
    )?;
    let config = config.display().to_string();
    node.start_scheduler(&["--config", &config]);
    let exe = node.compile_c("phase_tenant.c", true);
    Ok((node, exe))
}

fn spawn(node: &Node, exe: &Path, p: &Params, i: usize, cap: u64) -> Tenant {
    let group = format!("t{i}");
    let cap = format!("{}MiB", cap >> 20);
    let run_args = [
        "--group",
        &group,
        "--request",
        "0.25",
        "--limit",
        "1",
        "--memory",
        &cap,
    ];
    let mut cmd = node.run_command(&run_args, exe, &p.tenant_args(i));
    // Fail-open, as the scheduler's own overcommit tests run.
    cmd.env("GPUSHARE_FAIL", "open");
    node.spawn(cmd)
}

fn end_of(group: String, t: Tenant, timeout: Duration) -> TenantEnd {
    let (out, killed) = t.finish_within(timeout);
    let done = last_with(&out.stdout, "done");
    let oom = last_with(&out.stdout, "oom").is_some();
    let waits = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["alloc_wait_ns"].as_u64())
        .max()
        .unwrap_or(0);
    let wall_s = done
        .as_ref()
        .and_then(|d| Some((d["end_ns"].as_u64()? - d["start_ns"].as_u64()?) as f64 / 1e9))
        .unwrap_or(0.0);
    if !out.status.success() && !oom {
        progress(format!(
            "{group} failed ({}{}): {}",
            out.status,
            if killed {
                ", killed at the timeout"
            } else {
                ""
            },
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let gpu_stretches = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| Some((v["gpu_from_ns"].as_u64()?, v["gpu_to_ns"].as_u64()?)))
        .collect();
    TenantEnd {
        group,
        finished: out.status.success() && done.is_some(),
        oom,
        intact: done.is_some_and(|d| d["intact"] == true),
        wall_s: round(wall_s, 3),
        longest_alloc_wait_s: round(waits as f64 / 1e9, 3),
        gpu_stretches,
    }
}

/// Swap bytes seen in `gpushare status`: each group's `memory_swapped`, its largest over each
/// spell out of memory; and when each group may have been out of memory.
#[derive(Default)]
struct SwapWatch {
    spell: std::collections::BTreeMap<String, u64>,
    bytes: u64,
    /// When the poll before the last one was asked (CLOCK_MONOTONIC ns).
    asked_before_ns: u64,
    /// Per group, the spell out of memory under way: from when the last poll that saw it
    /// resident was asked.
    out_since: std::collections::BTreeMap<String, u64>,
    /// Per group, the spans that hold each of its spells out of memory, from the asking of the
    /// last poll that saw it resident to the answer of the first that saw it back.
    out_spans: std::collections::BTreeMap<String, Vec<(u64, u64)>>,
}

impl SwapWatch {
    /// `status` was asked for at `asked_ns` and answered at `answered_ns`.
    fn see(&mut self, status: &Value, groups: &[String], asked_ns: u64, answered_ns: u64) {
        let before = std::mem::replace(&mut self.asked_before_ns, asked_ns);
        for g in groups {
            let Some(v) = group_in(status, g) else {
                continue;
            };
            let out = matches!(
                v["memory_state"].as_str(),
                Some("swapping_out" | "swapped_out" | "swapping_in")
            );
            if out {
                self.out_since.entry(g.clone()).or_insert(before);
            } else if let Some(from) = self.out_since.remove(g) {
                (self.out_spans.entry(g.clone()).or_default()).push((from, answered_ns));
            }
            let b = v["memory_swapped"].as_u64().unwrap_or(0);
            if out {
                let e = self.spell.entry(g.clone()).or_default();
                *e = (*e).max(b);
            } else if let Some(b) = self.spell.remove(g) {
                self.bytes += b;
            }
        }
    }

    fn total(&self) -> u64 {
        self.bytes + self.spell.values().sum::<u64>()
    }

    /// The spans that hold `group`'s spells out of memory (one still under way runs to the
    /// end of time).
    fn out_spans(&self, group: &str) -> Vec<(u64, u64)> {
        let mut v = self.out_spans.get(group).cloned().unwrap_or_default();
        v.extend(self.out_since.get(group).map(|&from| (from, u64::MAX)));
        v
    }
}

/// Run the tenants once in `mode`; the device trace is kept as `dir/LABEL.trace.jsonl`.
pub fn run(p: &Params, mode: Mode, dir: &Path, label: &str) -> anyhow::Result<RunFigures> {
    let (node, exe) = start_node(p, mode, dir)?;
    let n = p.phases.len();
    let groups: Vec<String> = (0..n).map(|i| format!("t{i}")).collect();
    let timeout = Duration::from_secs(p.timeout_s);
    let start = Instant::now();
    let mut ends = Vec::new();
    let mut pids = Vec::new();
    let mut watch = SwapWatch::default();
    match mode {
        Mode::Sequential => {
            for (i, g) in groups.iter().enumerate() {
                let t = spawn(&node, &exe, p, i, p.cap_bytes);
                pids.push(t.pid());
                ends.push(end_of(g.clone(), t, timeout));
            }
        }
        Mode::Overcommit | Mode::StaticCaps => {
            let cap = if mode == Mode::StaticCaps {
                p.static_cap_bytes
            } else {
                p.cap_bytes
            };
            let tenants: Vec<Tenant> = (0..n).map(|i| spawn(&node, &exe, p, i, cap)).collect();
            pids = tenants.iter().map(Tenant::pid).collect();
            let stop = AtomicBool::new(false);
            let seen = std::thread::scope(|s| {
                let poller = s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let asked = monotonic_ns();
                        if let Ok(st) = node.status_json() {
                            watch.see(&st, &groups, asked, monotonic_ns());
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                });
                let ends: Vec<TenantEnd> = (tenants.into_iter().zip(&groups))
                    .map(|(t, g)| {
                        let left = timeout.saturating_sub(start.elapsed());
                        end_of(g.clone(), t, left)
                    })
                    .collect();
                stop.store(true, Ordering::Relaxed);
                let _ = poller.join();
                ends
            });
            ends = seen;
        }
    }
    let completion_s = start.elapsed().as_secs_f64();
    let status = node.status_json().unwrap_or(Value::Null);
    let log = node.scheduler_log();
    std::fs::write(dir.join(format!("{label}.scheduler.log")), &log)?;
    let trace = node.finish();
    trace.write(dir.join(format!("{label}.trace.jsonl")))?;
    let swaps = &status["memory_swaps"];
    let count = |k: &str| swaps[k].as_u64().unwrap_or(0);
    let secs = |k: &str| swaps[k]["sum_s"].as_f64().unwrap_or(0.0);
    let (resident, wanting) = if mode == Mode::Overcommit {
        let span = trace.span();
        let gap_ns = p.resident_gap_ms * 1_000_000;
        let resident = share_windows(&trace, &pids, span, |w| {
            (pids.iter()).all(|&p| longest_without_kernel(&trace, p, w) <= gap_ns)
        });
        let tenants: Vec<Wanting> = (ends.iter().zip(&pids))
            .map(|(e, &pid)| Wanting::of(&trace, pid, &e.gpu_stretches, watch.out_spans(&e.group)))
            .collect();
        let wanting = share_windows(&trace, &pids, span, |w| wanting_all_along(&tenants, w));
        (resident, wanting)
    } else {
        (WindowShares::default(), WindowShares::default())
    };
    Ok(RunFigures {
        mode,
        completion_s: round(completion_s, 2),
        tenants: ends,
        swap_outs: count("swap_outs"),
        swap_ins: count("swap_ins"),
        swap_out_failures: count("swap_out_failures"),
        swap_in_failures: count("swap_in_failures"),
        swap_out_s: round(secs("swap_out_seconds"), 2),
        swap_in_s: round(secs("swap_in_seconds"), 2),
        swapped_bytes: watch.total(),
        allocation_waits: count("allocation_waits"),
        allocations_refused: count("allocations_refused"),
        resident_windows: resident.windows,
        worst_share_error: resident.worst_share_error,
        windows_within_0_02: resident.within_0_02,
        wanting,
    })
}

/// When a tenant wanted the GPU and held its memory there, as its own output, the device
/// trace and `gpushare status` tell.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Wanting {
    /// Its GPU stretches (CLOCK_MONOTONIC ns): from just before its first launch of a phase to
    /// the end of its last kernel there (its last record in the trace that ended before its
    /// synchronisation returned).
    pub stretches: Vec<(u64, u64)>,
    /// Spans that hold its spells out of memory (`gpushare status` polled).
    pub out: Vec<(u64, u64)>,
}

impl Wanting {
    fn of(trace: &Trace, pid: u32, stretches: &[(u64, u64)], out: Vec<(u64, u64)>) -> Wanting {
        let stretches = (stretches.iter())
            .map(|&(from, to)| {
                let last = (trace.records().iter())
                    .filter(|r| r.pid == pid && r.start_ns >= from && r.end_ns <= to)
                    .map(|r| r.end_ns)
                    .max()
                    .unwrap_or(from);
                (from, last)
            })
            .collect();
        Wanting { stretches, out }
    }
}

/// Every tenant wanted the GPU all through `w` (one of its GPU stretches holds `w`: it was
/// launching, or its kernels queued, with no phase boundary of its own — checking, freeing,
/// allocating, writing its buffers — in between) and none was out of memory at any point of
/// `w`.
pub fn wanting_all_along(tenants: &[Wanting], w: Window) -> bool {
    tenants.iter().all(|t| {
        (t.stretches.iter()).any(|&(from, to)| from <= w.start_ns && w.end_ns <= to)
            && !(t.out.iter()).any(|&(from, to)| from < w.end_ns && w.start_ns < to)
    })
}

/// Over consecutive 1 s windows of `span`, those `counts` keeps: how many, the worst deviation
/// of a share of the busy time from an even split, and how many were within 0.02.
pub fn share_windows(
    trace: &Trace,
    pids: &[u32],
    span: Option<Window>,
    counts: impl Fn(Window) -> bool,
) -> WindowShares {
    let Some(Window {
        start_ns: first,
        end_ns: last,
    }) = span
    else {
        return WindowShares::default();
    };
    let even = 1.0 / pids.len() as f64;
    let (mut n, mut worst, mut within) = (0, None::<f64>, 0);
    let mut t = first;
    while t + 1_000_000_000 <= last {
        let w = Window::new(t, t + 1_000_000_000);
        t += 1_000_000_000;
        if !counts(w) {
            continue;
        }
        let shares = shares_in(trace, pids, w);
        let busy: f64 = shares.iter().sum();
        if busy <= 0.0 {
            continue;
        }
        let err = (shares.iter())
            .map(|s| (s / busy - even).abs())
            .fold(0.0, f64::max);
        n += 1;
        worst = Some(worst.map_or(err, |w: f64| w.max(err)));
        if err <= 0.02 {
            within += 1;
        }
    }
    WindowShares {
        windows: n,
        worst_share_error: worst.map(|w| round(w, 4)),
        within_0_02: within,
    }
}

/// The whole benchmark: each mode `repeat` times; `summary.json` and `summary.md` in `out`.
pub fn bench(p: &Params, out: &Path, repeat: u32) -> anyhow::Result<Summary> {
    std::fs::create_dir_all(out)?;
    let mut runs = Vec::new();
    for k in 1..=repeat {
        for mode in [Mode::Overcommit, Mode::Sequential, Mode::StaticCaps] {
            let label = format!("{}-run{k}", mode_name(mode));
            progress(format!("memory-overcommit: {label}"));
            let r = run(p, mode, out, &label)?;
            progress(format!(
                "  {:.1} s, {} finished, {} OOM, {} swaps out",
                r.completion_s,
                r.tenants.iter().filter(|t| t.finished).count(),
                r.ooms(),
                r.swap_outs
            ));
            runs.push(r);
        }
    }
    let summary = Summary::of(p, runs);
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    std::fs::write(out.join("summary.md"), summary.markdown())?;
    Ok(summary)
}

fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Overcommit => "overcommit",
        Mode::Sequential => "sequential",
        Mode::StaticCaps => "static-caps",
    }
}

/// Every run, and the spreads over them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub params: Params,
    pub runs: Vec<RunFigures>,
}

impl Summary {
    fn of(params: &Params, runs: Vec<RunFigures>) -> Summary {
        Summary {
            params: params.clone(),
            runs,
        }
    }

    fn of_mode(&self, m: Mode) -> impl Iterator<Item = &RunFigures> {
        self.runs.iter().filter(move |r| r.mode == m)
    }

    fn spread(&self, m: Mode, f: impl Fn(&RunFigures) -> f64, d: i32) -> String {
        match Spread::of(self.of_mode(m).map(f).filter(|x| !x.is_nan()), d) {
            Some(s) => format!("{} ({}–{})", s.median, s.min, s.max),
            None => "-".into(),
        }
    }

    /// The table of docs/benchmarks.md: median (min–max) over the runs of each mode.
    pub fn markdown(&self) -> String {
        let mut s = String::from(
            "| run | completion (s) | finished | OOM | bytes intact | swaps out / in | \
             swapped (GiB) | swap time out / in (s) | allocations waited | 1 s windows all \
             running (within 0.02) | worst share error | 1 s windows all resident and wanting \
             the GPU (within 0.02) | worst share error |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for m in [Mode::Overcommit, Mode::Sequential, Mode::StaticCaps] {
            let n = self.of_mode(m).count();
            if n == 0 {
                continue;
            }
            let sp = |f: &dyn Fn(&RunFigures) -> f64, d| self.spread(m, f, d);
            s += &format!(
                "| {} | {} | {} | {} | {} | {} / {} | {} | {} / {} | {} | {} ({}) | {} | {} ({}) \
                 | {} |\n",
                mode_name(m),
                sp(&|r| r.completion_s, 1),
                sp(
                    &|r| r.tenants.iter().filter(|t| t.finished).count() as f64,
                    0
                ),
                sp(&|r| r.ooms() as f64, 0),
                self.of_mode(m)
                    .filter(|r| r.all_intact())
                    .count()
                    .to_string()
                    + &format!(" of {n}"),
                sp(&|r| r.swap_outs as f64, 0),
                sp(&|r| r.swap_ins as f64, 0),
                sp(&|r| r.swapped_bytes as f64 / GIB as f64, 1),
                sp(&|r| r.swap_out_s, 1),
                sp(&|r| r.swap_in_s, 1),
                sp(&|r| r.allocation_waits as f64, 0),
                sp(&|r| r.resident_windows as f64, 0),
                sp(&|r| r.windows_within_0_02 as f64, 0),
                sp(&|r| r.worst_share_error.unwrap_or(f64::NAN), 3),
                sp(&|r| r.wanting.windows as f64, 0),
                sp(&|r| r.wanting.within_0_02 as f64, 0),
                sp(&|r| r.wanting.worst_share_error.unwrap_or(f64::NAN), 3),
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_testkit::trace::Record;

    #[test]
    fn swap_bytes_count_each_spell_out_once_at_its_largest() {
        let st = |state: &str, b: u64| {
            serde_json::json!({"gpus": [{"groups": [
                {"name": "a", "memory_state": state, "memory_swapped": b}
            ]}]})
        };
        let g = vec!["a".to_string()];
        let mut w = SwapWatch::default();
        for (k, (state, b)) in [
            ("resident", 0),
            ("swapping_out", 5),
            ("swapped_out", 8),
            ("swapping_in", 8),
            ("resident", 0),
            ("swapped_out", 3),
        ]
        .into_iter()
        .enumerate()
        {
            // Polls asked every 50 ms, each answered 10 ms later.
            let asked = 1000 + 50 * k as u64;
            w.see(&st(state, b), &g, asked, asked + 10);
        }
        assert_eq!(w.total(), 11);
        // Each spell out lies between the asking of the last poll that saw the group resident
        // and the answer of the first that saw it back; the last one is not over.
        assert_eq!(w.out_spans("a"), vec![(1000, 1210), (1200, u64::MAX)]);
        assert!(w.out_spans("b").is_empty());
    }

    /// Kernels of `ms` ms from `from` to `to` (ms), taking turns among `pids`, skipping those
    /// `pause` says are away at that instant.
    fn turns(pids: &[u32], from: u64, to: u64, pause: impl Fn(u32, u64) -> bool) -> Vec<Record> {
        let ms = 1_000_000;
        let mut v = Vec::new();
        let (mut t, mut k) = (from, 0);
        while t < to {
            let pid = pids[k % pids.len()];
            k += 1;
            if pause(pid, t) {
                continue;
            }
            v.push(Record {
                device: 0,
                pid,
                ctx: 1,
                stream: 1,
                kernel: "k".into(),
                start_ns: t * ms,
                end_ns: (t + 10) * ms,
                preempted: false,
            });
            t += 10;
        }
        v
    }

    #[test]
    fn a_window_counts_only_while_every_tenant_wants_the_gpu_and_holds_its_memory() {
        let ms = 1_000_000;
        // Two tenants taking turns for 3.1 s; the second ends a phase at 1.9 s and spends 100 ms
        // on its own (checking, resizing, writing its buffers) before the next: the first runs
        // alone meanwhile.
        let away = |pid: u32, t: u64| pid == 2 && (1900..2000).contains(&t);
        let trace = Trace::from_records(turns(&[1, 2], 0, 3100, away));
        let pids = [1, 2];
        let span = trace.span();
        let running = share_windows(&trace, &pids, span, |w| {
            (pids.iter()).all(|&p| longest_without_kernel(&trace, p, w) <= 250 * ms)
        });
        // Running with no gap over 250 ms, the window of the phase boundary counts: the first
        // got 0.55 of it, by no fault of the time policy.
        assert_eq!(running.windows, 3);
        assert_eq!(running.within_0_02, 2);
        assert!((running.worst_share_error.unwrap() - 0.05).abs() < 1e-9);
        // The second's stretches as it reports them: its synchronisations return a little
        // after its last kernels end.
        let first = Wanting::of(&trace, 1, &[(0, 3100 * ms + 300_000)], vec![]);
        let second = (trace.records().iter())
            .filter(|r| r.pid == 2)
            .map(|r| r.end_ns)
            .filter(|&e| e <= 1900 * ms)
            .max()
            .unwrap();
        let second_wanting = Wanting::of(
            &trace,
            2,
            &[(0, 1900 * ms + 300_000), (2000 * ms, 3100 * ms + 300_000)],
            vec![],
        );
        assert_eq!(second_wanting.stretches[0], (0, second));
        let tenants = [first.clone(), second_wanting.clone()];
        let wanting = share_windows(&trace, &pids, span, |w| wanting_all_along(&tenants, w));
        assert_eq!(
            wanting,
            WindowShares {
                windows: 2,
                worst_share_error: Some(0.0),
                within_0_02: 2
            }
        );
        // A tenant out of memory for any part of a window takes the window out too.
        let out = Wanting {
            out: vec![(2900 * ms, 3500 * ms)],
            ..first
        };
        let tenants = [out, second_wanting];
        let wanting = share_windows(&trace, &pids, span, |w| wanting_all_along(&tenants, w));
        assert_eq!(wanting.windows, 1);
    }

    #[test]
    fn the_benchmark_peaks_sum_to_1_5_to_2_times_the_gpu() {
        for p in [Params::full(), Params::small()] {
            let peaks: u64 = p.phases.iter().map(|t| t.iter().max().unwrap()).sum();
            let r = peaks as f64 / p.gpu_bytes as f64;
            assert!((1.5..=2.0).contains(&r), "{r}");
            let caps = p.cap_bytes as f64 * p.phases.len() as f64 / p.gpu_bytes as f64;
            assert!(caps <= p.overcommit, "caps {caps}x past the ratio");
            assert_eq!(p.static_cap_bytes * p.phases.len() as u64, p.gpu_bytes);
        }
    }
}
