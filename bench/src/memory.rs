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
    /// Each tenant's phases: the working set (bytes) and how many kernels it launches there.
    pub phases: Vec<Vec<(u64, u64)>>,
    pub kernel_ms: f64,
    /// Keys of the scheduler's `[overcommit]` table besides the bandwidths (which are the
    /// simulated driver's, when set), if not its defaults.
    pub overcommit_keys: Option<String>,
    /// The longest gap (ms) between a tenant's kernels within a window in which it counts as
    /// resident and running.
    pub resident_gap_ms: u64,
    /// How long a run may take before its tenants are killed.
    pub timeout_s: u64,
}

impl Params {
    /// The benchmark: an 80 GiB GPU, 4 tenants capped at 40 GiB (caps 2x the GPU) whose peaks
    /// (36, 36, 32 and 32 GiB) sum to 136 GiB, 1.7x the GPU, over 6 GiB bases, with kernels of
    /// 2 ms, well under a turn (13.3 ms at a quarter of the GPU), so that the device runs one
    /// tenant's kernels at a time but at the hand-offs and the shares measured are the
    /// scheduler's turns, not the device's own time-slicing of kernels queued at once. Tenants
    /// t2 and t3 start at their peaks (76 GiB in all) and drop to their bases after 375
    /// kernels; t0 grows to its peak after 750 kernels (60 GiB in all) and holds it for 2500;
    /// t1 grows to its peak after 1375 kernels, while t0 holds its own: the two peaks and two
    /// bases need 84 GiB, so t1's allocation waits, then another group (t0, or a base tenant
    /// when t0 holds the turn) is swapped out for it; t1 holds its peak for 750 kernels, then
    /// drops to its base and the group swapped out comes back. Every tenant then runs on for
    /// several seconds (with all four at a quarter of the GPU, 125 kernels a second each):
    /// every run swaps, with windows in which all four are resident before the swap and after
    /// the restore. The simulated driver's checkpoint and restore bandwidths are scaled x10
    /// (15 GB/s and 44 GB/s: at the H200's, a 36 GiB swap out takes 26 s and the scheduler
    /// keeps a group in memory four times what its swaps cost, which would make a run last
    /// minutes), and the scheduler told so; its other `[overcommit]` keys at their defaults.
    pub fn full() -> Params {
        let (base, top, peak) = (6 * GIB, 32 * GIB, 36 * GIB);
        Params {
            gpu_bytes: 80 * GIB,
            checkpoint_bandwidth: Some("15GB/s".into()),
            restore_bandwidth: Some("44GB/s".into()),
            overcommit: 2.0,
            cap_bytes: 40 * GIB,
            static_cap_bytes: 20 * GIB,
            phases: vec![
                vec![(base, 750), (peak, 2500), (base, 1250)],
                vec![(base, 1375), (peak, 750), (base, 2250)],
                vec![(top, 375), (base, 4375)],
                vec![(top, 375), (base, 4500)],
            ],
            kernel_ms: 2.0,
            overcommit_keys: None,
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
        let low_first = vec![(base, 80), (peak, 80), (base, 80)];
        let high_first = vec![(peak, 80), (base, 80), (peak, 80)];
        Params {
            gpu_bytes: 4 * GIB,
            checkpoint_bandwidth: Some("15GB/s".into()),
            restore_bandwidth: Some("44GB/s".into()),
            overcommit: 2.0,
            cap_bytes: 2 * GIB,
            static_cap_bytes: GIB,
            phases: vec![low_first.clone(), high_first.clone(), low_first, high_first],
            kernel_ms: 5.0,
            overcommit_keys: Some(
                "wait = \"200ms\"\nmemory_turn = \"1s\"\nwindow = \"10s\"\n".into(),
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
                .map(|(bytes, kernels)| format!("{bytes}:{kernels}")),
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
    /// What it wrote on stderr (the hook's warnings among it).
    #[serde(skip)]
    pub stderr: String,
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
    /// The `wanting` windows around each spell out of memory: before it, after it (until the
    /// next), and the restored group's shares there.
    pub around_swaps: Vec<AroundSwap>,
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
    // The scheduler is told what the simulated link carries, as an operator would set it.
    let mut table = String::from("[overcommit]\n");
    if let Some(b) = &p.checkpoint_bandwidth {
        table += &format!("checkpoint_bandwidth = {b:?}\n");
    }
    if let Some(b) = &p.restore_bandwidth {
        table += &format!("restore_bandwidth = {b:?}\n");
    }
    table += p.overcommit_keys.as_deref().unwrap_or("");
    std::fs::write(&config, format!("memory_overcommit = {ratio:?}\n{table}"))?;
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
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
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
    for e in &ends {
        std::fs::write(dir.join(format!("{label}.{}.stderr", e.group)), &e.stderr)?;
    }
    let swaps = &status["memory_swaps"];
    let count = |k: &str| swaps[k].as_u64().unwrap_or(0);
    let secs = |k: &str| swaps[k]["sum_s"].as_f64().unwrap_or(0.0);
    let (resident, wanting, around) = if mode == Mode::Overcommit {
        let span = trace.span();
        let gap_ns = p.resident_gap_ms * 1_000_000;
        let resident = share_windows(&trace, &pids, span, |w| {
            (pids.iter()).all(|&p| longest_without_kernel(&trace, p, w) <= gap_ns)
        });
        let tenants: Vec<Wanting> = (ends.iter().zip(&pids))
            .map(|(e, &pid)| Wanting::of(&trace, pid, &e.gpu_stretches, watch.out_spans(&e.group)))
            .collect();
        let windows = window_shares(&trace, &pids, span, |w| wanting_all_along(&tenants, w));
        let wanting = WindowShares::of(windows.iter().map(|(_, s)| s.as_slice()));
        let spells: Vec<(usize, (u64, u64))> = (tenants.iter().enumerate())
            .flat_map(|(i, t)| t.out.iter().map(move |&span| (i, span)))
            .collect();
        (resident, wanting, around_swaps(&windows, &groups, &spells))
    } else {
        Default::default()
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
        around_swaps: around,
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

/// Over consecutive 1 s windows of `span`, those `counts` keeps in which the device was busy:
/// each window and every tenant's share of its busy time.
pub fn window_shares(
    trace: &Trace,
    pids: &[u32],
    span: Option<Window>,
    counts: impl Fn(Window) -> bool,
) -> Vec<(Window, Vec<f64>)> {
    let Some(Window {
        start_ns: first,
        end_ns: last,
    }) = span
    else {
        return Vec::new();
    };
    let mut v = Vec::new();
    let mut t = first;
    while t + 1_000_000_000 <= last {
        let w = Window::new(t, t + 1_000_000_000);
        t += 1_000_000_000;
        if !counts(w) {
            continue;
        }
        let shares = shares_in(trace, pids, w);
        let busy: f64 = shares.iter().sum();
        if busy > 0.0 {
            v.push((w, shares.iter().map(|s| s / busy).collect()));
        }
    }
    v
}

/// Over consecutive 1 s windows of `span`, those `counts` keeps: how many, the worst deviation
/// of a share of the busy time from an even split, and how many were within 0.02.
pub fn share_windows(
    trace: &Trace,
    pids: &[u32],
    span: Option<Window>,
    counts: impl Fn(Window) -> bool,
) -> WindowShares {
    let windows = window_shares(trace, pids, span, counts);
    WindowShares::of(windows.iter().map(|(_, shares)| shares.as_slice()))
}

impl WindowShares {
    /// The figures of windows whose shares of the busy time are `windows`.
    fn of<'a>(windows: impl Iterator<Item = &'a [f64]>) -> WindowShares {
        let (mut n, mut worst, mut within) = (0, None::<f64>, 0);
        for shares in windows {
            let err = share_error(shares);
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
}

/// The worst deviation of a share from an even split.
fn share_error(shares: &[f64]) -> f64 {
    let even = 1.0 / shares.len() as f64;
    (shares.iter())
        .map(|s| (s - even).abs())
        .fold(0.0, f64::max)
}

/// The windows around one spell out of memory.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AroundSwap {
    pub group: String,
    /// How long it was out of memory (s), from the last status poll that saw it resident to
    /// the first that saw it back: an upper bound.
    pub out_s: f64,
    /// The windows in which every tenant was resident and wanted the GPU, between the end of
    /// the spell out before (of any group; else the start) and this one's start.
    pub before: WindowShares,
    /// The same between this spell's end and the next one's start (else the end).
    pub after: WindowShares,
    /// The group's share of the busy time in each of the `after` windows, in order, and how
    /// long after its spell's end each began (s).
    pub restored_shares: Vec<f64>,
    pub restored_window_starts_s: Vec<f64>,
}

/// For each spell out of memory (`spells`: the group's index and its span), the windows `counts`
/// keeps that lie between it and the spells before and after it, of any group.
pub fn around_swaps(
    windows: &[(Window, Vec<f64>)],
    groups: &[String],
    spells: &[(usize, (u64, u64))],
) -> Vec<AroundSwap> {
    let mut spells = spells.to_vec();
    spells.sort_by_key(|&(_, (from, _))| from);
    (spells.iter())
        .map(|&(g, (from, to))| {
            let since = (spells.iter())
                .map(|&(_, (_, end))| end)
                .filter(|&end| end <= from)
                .max()
                .unwrap_or(0);
            let until = (spells.iter())
                .map(|&(_, (start, _))| start)
                .filter(|&start| start >= to)
                .min()
                .unwrap_or(u64::MAX);
            let within = |a: u64, b: u64| {
                (windows.iter()).filter(move |(w, _)| a <= w.start_ns && w.end_ns <= b)
            };
            let after: Vec<&(Window, Vec<f64>)> = within(to, until).collect();
            AroundSwap {
                group: groups[g].clone(),
                out_s: round(to.saturating_sub(from) as f64 / 1e9, 2),
                before: WindowShares::of(within(since, from).map(|(_, s)| s.as_slice())),
                after: WindowShares::of(after.iter().map(|(_, s)| s.as_slice())),
                restored_shares: after.iter().map(|(_, s)| round(s[g], 4)).collect(),
                restored_window_starts_s: (after.iter())
                    .map(|(w, _)| round((w.start_ns - to) as f64 / 1e9, 2))
                    .collect(),
            }
        })
        .collect()
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
        s + &self.around_swaps_markdown()
    }

    /// Each spell out of memory of the overcommitted runs, with the windows all resident and
    /// wanting the GPU before and after it.
    fn around_swaps_markdown(&self) -> String {
        let mut s = String::from(
            "\n| run | group out | out (s) | windows before (within 0.02) | worst share error \
             | windows after (within 0.02) | worst share error | its share in the windows \
             after (from its return, s) |\n|---|---|---|---|---|---|---|---|\n",
        );
        let worst =
            |w: &WindowShares| (w.worst_share_error).map_or("-".into(), |e| format!("{:.3}", e));
        for (k, r) in self.of_mode(Mode::Overcommit).enumerate() {
            for a in &r.around_swaps {
                let shares: Vec<String> = (a.restored_shares.iter())
                    .zip(&a.restored_window_starts_s)
                    .map(|(sh, t)| format!("{sh:.3} ({t:.1})"))
                    .collect();
                s += &format!(
                    "| {} | {} | {:.1} | {} ({}) | {} | {} ({}) | {} | {} |\n",
                    k + 1,
                    a.group,
                    a.out_s,
                    a.before.windows,
                    a.before.within_0_02,
                    worst(&a.before),
                    a.after.windows,
                    a.after.within_0_02,
                    worst(&a.after),
                    shares.join(", "),
                );
            }
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
    fn windows_around_each_swap_lie_between_it_and_the_spells_next_to_it() {
        let s = 1_000_000_000;
        // Two tenants' shares in the windows all resident and wanting the GPU, 1 s each.
        let w =
            |from: u64, shares: [f64; 2]| (Window::new(from * s, (from + 1) * s), shares.to_vec());
        let windows = vec![
            w(0, [0.5, 0.5]),
            w(1, [0.51, 0.49]),
            w(2, [0.5, 0.5]), // ends after t1's spell out begins
            w(6, [0.49, 0.51]),
            w(7, [0.45, 0.55]),
            w(9, [0.5, 0.5]),
        ];
        let groups = ["t0".to_string(), "t1".to_string()];
        // t1 out from 2.5 s to 5.2 s, then t0 from 8.1 s to 8.9 s (given out of order).
        let spells = [
            (0, (8_100_000_000, 8_900_000_000)),
            (1, (2_500_000_000, 5_200_000_000)),
        ];
        let around = around_swaps(&windows, &groups, &spells);
        assert_eq!(around.len(), 2);
        let (first, second) = (&around[0], &around[1]);
        assert_eq!((first.group.as_str(), first.out_s), ("t1", 2.7));
        assert_eq!(
            first.before,
            WindowShares {
                windows: 2,
                worst_share_error: Some(0.01),
                within_0_02: 2
            }
        );
        // After it: until t0's spell begins.
        assert_eq!(
            first.after,
            WindowShares {
                windows: 2,
                worst_share_error: Some(0.05),
                within_0_02: 1
            }
        );
        assert_eq!(first.restored_shares, vec![0.51, 0.55]);
        assert_eq!(first.restored_window_starts_s, vec![0.8, 1.8]);
        // Before t0's spell: from the end of t1's.
        assert_eq!((second.group.as_str(), second.before.windows), ("t0", 2));
        assert_eq!(second.after.windows, 1);
        assert_eq!(second.restored_shares, vec![0.5]);
        assert_eq!(second.restored_window_starts_s, vec![0.1]);
    }

    #[test]
    fn the_benchmark_peaks_sum_to_1_5_to_2_times_the_gpu() {
        for p in [Params::full(), Params::small()] {
            let peaks: u64 = (p.phases.iter())
                .map(|t| t.iter().map(|&(bytes, _)| bytes).max().unwrap())
                .sum();
            let r = peaks as f64 / p.gpu_bytes as f64;
            assert!((1.5..=2.0).contains(&r), "{r}");
            let caps = p.cap_bytes as f64 * p.phases.len() as f64 / p.gpu_bytes as f64;
            assert!(caps <= p.overcommit, "caps {caps}x past the ratio");
            assert_eq!(p.static_cap_bytes * p.phases.len() as u64, p.gpu_bytes);
        }
    }
}
