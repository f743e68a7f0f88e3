//! `gpushare-bench`: run fairness scenarios with gpushare and without it (native time-slicing),
//! measure launch overhead, and write `summary.json`, `summary.md`, one SVG plot of shares over
//! time per scenario and the kernel records the figures come from: the simulated device's trace
//! (`NAME.trace.jsonl`, `NAME-native.trace.jsonl`; `gpushare-sim report` reads them), or, with
//! `--source events` and always on a machine with a real GPU, the tenants' own timelines from
//! CUDA timing events (`NAME.timeline.jsonl`, same format).

mod analysis;
mod real_gpu;
mod scenario;
mod svg;

use analysis::{RunFigures, analyse, quantile};
use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use gpushare_sim_clients::harness::target_dir;
use gpushare_sim_clients::node::{Node, Tenant};
use gpushare_sim_clients::trace::{Trace, Window};
use scenario::{Scenario, Workload};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

/// Native/hooked pairs of launch-overhead runs (fewer with `--quick`, to stay under 2 min).
const OVERHEAD_PAIRS: usize = 15;
const QUICK_OVERHEAD_PAIRS: usize = 7;

/// Scenario duration with `--quick`.
const QUICK_DURATION_NS: u64 = 3_000_000_000;

#[derive(Parser)]
#[command(
    name = "gpushare-bench",
    about = "Fairness and overhead benchmark, on the simulated GPU or this machine's GPUs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one scenario (with gpushare, then natively as the baseline).
    Run {
        scenario: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// Shorten the scenario to 3 s.
        #[arg(long)]
        quick: bool,
        /// Skip the native (no gpushare) baseline run.
        #[arg(long)]
        no_baseline: bool,
        /// Also measure launch overhead.
        #[arg(long)]
        overhead: bool,
        /// Skip running each tenant alone (throughput and latency vs alone).
        #[arg(long)]
        no_alone: bool,
        #[command(flatten)]
        gpu: GpuOpts,
    },
    /// Run every scenario in --scenarios (default: bench/scenarios) and the launch overhead.
    Suite {
        #[arg(long)]
        out: PathBuf,
        /// 3 s per scenario, scenarios marked full_only skipped.
        #[arg(long)]
        quick: bool,
        #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios"))]
        scenarios: PathBuf,
        /// Only scenarios whose name contains one of these (repeatable).
        #[arg(long)]
        only: Vec<String>,
        /// Skip the native baseline runs.
        #[arg(long)]
        no_baseline: bool,
        /// Skip running each tenant alone (throughput and latency vs alone).
        #[arg(long)]
        no_alone: bool,
        #[command(flatten)]
        gpu: GpuOpts,
    },
}

/// Which GPU, and where the figures come from.
#[derive(clap::Args, Clone, Copy)]
struct GpuOpts {
    /// Where the figures come from: `device`, the simulated device's trace (exact; the default
    /// on the simulator), or `events`, each tenant's CUDA timing events (the only source on a
    /// real GPU; on the simulator the device trace's figures are reported next to them).
    #[arg(long, value_enum)]
    source: Option<Source>,
    /// Run on the simulated GPU even on a machine with a real one (by default the benchmark runs
    /// on the GPUs `libcuda.so.1` reports).
    #[arg(long)]
    simulated: bool,
}

impl GpuOpts {
    /// Where the figures come from, and this machine's GPU count when running on them.
    fn resolve(self) -> anyhow::Result<(Source, Option<u32>)> {
        let system = if self.simulated {
            None
        } else {
            real_gpu::device_count()
        };
        Ok(match (system, self.source) {
            (Some(_), Some(Source::Device)) => bail!(
                "--source device needs the simulated GPU: this machine has a real one (add --simulated)"
            ),
            (Some(n), _) => {
                progress(format!(
                    "running on this machine's {n} GPU(s) (libcuda.so.1), measuring from the \
                     tenants' CUDA timing events (--simulated: use the simulated GPU instead)"
                ));
                (Source::Events, system)
            }
            (None, source) => (source.unwrap_or(Source::Device), None),
        })
    }
}

/// Where the figures come from.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
enum Source {
    /// The simulated device's trace.
    Device,
    /// The tenants' timelines from CUDA timing events (`cudarc-client --timeline`).
    Events,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Run {
            scenario,
            out,
            quick,
            no_baseline,
            overhead,
            no_alone,
            gpu,
        } => Scenario::load(&scenario).and_then(|sc| {
            let (source, system_gpus) = gpu.resolve()?;
            bench(
                vec![sc],
                &out,
                Opts {
                    quick,
                    baseline: !no_baseline,
                    overhead,
                    alone: !no_alone,
                    source,
                    system_gpus,
                },
            )
        }),
        Cmd::Suite {
            out,
            quick,
            scenarios,
            only,
            no_baseline,
            no_alone,
            gpu,
        } => load_dir(&scenarios).and_then(|all| {
            let list = all
                .into_iter()
                .filter(|s| !(quick && s.full_only))
                .filter(|s| only.is_empty() || only.iter().any(|o| s.name.contains(o.as_str())))
                .collect();
            let (source, system_gpus) = gpu.resolve()?;
            bench(
                list,
                &out,
                Opts {
                    quick,
                    baseline: !no_baseline,
                    overhead: true,
                    alone: !no_alone,
                    source,
                    system_gpus,
                },
            )
        }),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load_dir(dir: &Path) -> anyhow::Result<Vec<Scenario>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    files.iter().map(|p| Scenario::load(p)).collect()
}

#[derive(Clone, Copy)]
struct Opts {
    quick: bool,
    baseline: bool,
    overhead: bool,
    /// Run each distinct tenant workload alone too.
    alone: bool,
    source: Source,
    /// Running on this machine's own GPUs (this many), not the simulated one.
    system_gpus: Option<u32>,
}

impl Opts {
    /// A node for `gpus` GPUs: simulated, or this machine's.
    fn node(&self, gpus: u32) -> anyhow::Result<Node> {
        Ok(match self.system_gpus {
            Some(n) if gpus > n => bail!("needs {gpus} GPUs; this machine has {n}"),
            Some(_) => Node::on_system_driver(),
            None => Node::device_only_with(&["--gpus", &gpus.to_string()]),
        })
    }
}

fn progress(msg: impl AsRef<str>) {
    eprintln!("[gpushare-bench] {}", msg.as_ref());
}

/// One run of (some of) a scenario's tenants, with or without gpushare.
struct RunResult {
    figures: RunFigures,
    /// Measuring from the tenants' timelines on the simulator: the device trace's figures.
    device_check: Option<RunFigures>,
    /// Each tenant's JSON result line (Null when it printed none).
    outputs: Vec<Value>,
    /// With gpushare: the scheduler's CPU time (user + system) while the tenants ran, and the
    /// wall time it was measured over (s).
    scheduler_cpu: Option<(f64, f64)>,
}

/// CPU seconds of process `pid` so far: `(from /proc/PID/stat, from /proc/PID/task/*/schedstat)`.
/// The first is utime + stime of all threads, living and exited, in clock ticks (10 ms); the
/// second is ns-precise but only counts the threads alive now (None when unreadable).
fn cpu_seconds(pid: u32) -> Option<(f64, Option<f64>)> {
    let ticks = stat_cpu_seconds(pid)?;
    let precise = std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()
        .and_then(|tasks| {
            tasks
                .map(|t| {
                    let s = std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok()?;
                    s.split_whitespace().next()?.parse::<u64>().ok()
                })
                .sum::<Option<u64>>()
        })
        .map(|ns| ns as f64 / 1e9);
    Some((ticks, precise))
}

/// CPU seconds between two [`cpu_seconds`] readings: the precise figure, unless a thread
/// exited in between (the tick-based figure then exceeds it by more than two ticks).
fn cpu_delta(a: (f64, Option<f64>), b: (f64, Option<f64>)) -> f64 {
    let ticks = (b.0 - a.0).max(0.0);
    match (a.1, b.1) {
        (Some(x), Some(y)) if y >= x && ticks <= y - x + 0.02 => y - x,
        _ => ticks,
    }
}

/// User + system CPU seconds of process `pid` so far, from `/proc/PID/stat`.
fn stat_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which is in parentheses and may contain spaces):
    // state is field 3, utime field 14, stime field 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (ticks > 0).then(|| (utime + stime) / ticks as f64)
}

/// Run tenants `which` of `sc` for `duration_ns` on a fresh simulated node; the device trace
/// is copied to `keep_trace` if given.
fn run_once(
    sc: &Scenario,
    which: &[usize],
    gpushare: bool,
    duration_ns: u64,
    keep_trace: Option<&Path>,
    opts: Opts,
) -> anyhow::Result<RunResult> {
    let mut node = opts.node(sc.gpus)?;
    if gpushare {
        node.start_scheduler(&[]);
    }
    let client = target_dir().join("cudarc-client");
    let duration_ms = duration_ns as f64 / 1e6;
    let sched_cpu0 = node
        .scheduler_pid()
        .and_then(cpu_seconds)
        .map(|c| (c, Instant::now()));
    let mut running: Vec<Tenant> = Vec::new();
    let timelines: Vec<PathBuf> = (0..which.len())
        .map(|k| node.tmp.path().join(format!("timeline-{k}.jsonl")))
        .collect();
    for (k, &i) in which.iter().enumerate() {
        let t = &sc.tenants[i];
        let mut args = Vec::new();
        if opts.source == Source::Events {
            args.push("--timeline".to_string());
            args.push(timelines[k].display().to_string());
        }
        args.extend(t.client_args(duration_ms, k as u64 + 1));
        let cmd = if gpushare {
            node.tenant_command(&t.name, t.request, t.limit, t.weight, &client, &args)
        } else {
            let mut c = node.command(&client);
            c.args(&args);
            c
        };
        running.push(node.spawn(cmd));
    }
    let pids: Vec<u32> = running.iter().map(Tenant::pid).collect();
    let deadline = Duration::from_nanos(duration_ns) + Duration::from_secs(30);
    let t0 = Instant::now();
    let mut outputs = Vec::new();
    let mut failures = Vec::new();
    for (k, t) in running.into_iter().enumerate() {
        let (out, killed) = t.finish_within(deadline.saturating_sub(t0.elapsed()));
        let name = &sc.tenants[which[k]].name;
        if killed || !out.status.success() {
            failures.push(format!(
                "tenant {name} {}: {}",
                if killed {
                    "did not finish in time".to_string()
                } else {
                    format!("failed ({})", out.status)
                },
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        outputs.push(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .rev()
                .find_map(|l| serde_json::from_str(l).ok())
                .unwrap_or(Value::Null),
        );
    }
    let scheduler_cpu = sched_cpu0.and_then(|(c0, t)| {
        let c1 = cpu_seconds(node.scheduler_pid()?)?;
        Some((cpu_delta(c0, c1), t.elapsed().as_secs_f64()))
    });
    let log = if gpushare {
        node.scheduler_log()
    } else {
        String::new()
    };
    // The tenants' timelines (read before the node's scratch directory goes), or the device's.
    let timeline = if opts.source == Source::Events && failures.is_empty() {
        let mut records = Vec::new();
        for (path, &i) in timelines.iter().zip(which) {
            let t = Trace::read(path).with_context(|| {
                format!(
                    "tenant {}: no timeline ({})",
                    sc.tenants[i].name,
                    path.display()
                )
            })?;
            records.extend_from_slice(t.records());
        }
        Some(Trace::from_records(records))
    } else {
        None
    };
    let device_trace = node.stop();
    if let Some(dest) = keep_trace {
        let write = |trace: &Trace, dest: &Path| {
            trace
                .write(dest)
                .with_context(|| format!("cannot write {}", dest.display()))
        };
        if let Some(t) = &device_trace {
            write(t, dest)?;
        }
        if let Some(t) = &timeline {
            write(t, &timeline_path(dest))?;
        }
    }
    if !failures.is_empty() {
        bail!("{}\n{}", failures.join("\n"), log.trim());
    }
    let (trace, check) = match timeline {
        Some(t) => (t, device_trace),
        None => (
            device_trace.context("no device trace (running on the system's driver)")?,
            None,
        ),
    };
    // Targets per window: a latency tenant demands the work of the requests that arrived in it
    // (it reports their times); the others their nominal demand.
    let arrivals: Vec<Option<Vec<u64>>> = outputs
        .iter()
        .map(|o| {
            o["arrivals_ns"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
        })
        .collect();
    let targets = |w: Window| -> Vec<f64> {
        let all = sc.target_shares(|i| {
            let t = &sc.tenants[i];
            match which
                .iter()
                .position(|&j| j == i)
                .and_then(|k| arrivals[k].as_ref())
            {
                Some(a) => t.demand_in(a, w),
                None => t.demand(),
            }
        });
        which.iter().map(|&i| all[i]).collect()
    };
    let gpus: Vec<u32> = which.iter().map(|&i| sc.tenants[i].gpu).collect();
    let figures = analyse(&trace, &pids, &gpus, &targets);
    Ok(RunResult {
        figures,
        device_check: check.map(|t| analyse(&t, &pids, &gpus, &targets)),
        outputs,
        scheduler_cpu,
    })
}

/// Where the timeline a kept trace `NAME.trace.jsonl` comes with goes: `NAME.timeline.jsonl`.
fn timeline_path(trace: &Path) -> PathBuf {
    let name = trace.file_name().unwrap_or_default().to_string_lossy();
    let stem = name.strip_suffix(".trace.jsonl").unwrap_or(&name);
    trace.with_file_name(format!("{stem}.timeline.jsonl"))
}

/// Kernels per second from a `spin` result (kernels over wall time) or a `latency` result
/// (requests × kernels per request over the run).
fn throughput(v: &Value) -> Option<f64> {
    if let (Some(k), Some(wall)) = (v["kernels"].as_f64(), v["wall_ms"].as_f64()) {
        return (wall > 0.0).then(|| k / wall * 1e3);
    }
    let k = v["requests"].as_f64()? * v["kernels_per_request"].as_f64()?;
    let ns = v["end_ns"].as_f64()? - v["start_ns"].as_f64()?;
    (ns > 0.0).then(|| k / ns * 1e9)
}

/// Results of tenants run alone (under gpushare, on a 1-GPU node), keyed by
/// [`alone_key`]: a workload shared by several tenants or scenarios runs alone only once.
type AloneCache = HashMap<String, Value>;

/// What determines a tenant's run alone: its workload arguments (on GPU 0, seed 1) and its
/// limit (alone, its request and weight do not matter: it gets min(limit, demand)).
fn alone_key(t: &scenario::TenantSpec, duration_ns: u64) -> String {
    let solo = scenario::TenantSpec {
        gpu: 0,
        ..t.clone()
    };
    format!(
        "{}|limit={}",
        solo.client_args(duration_ns as f64 / 1e6, 1).join(" "),
        t.limit
    )
}

/// Tenant `i` of `sc` alone under gpushare (same workload, same duration; cached).
fn run_alone(
    sc: &Scenario,
    i: usize,
    duration_ns: u64,
    cache: &mut AloneCache,
    opts: Opts,
) -> anyhow::Result<Value> {
    let key = alone_key(&sc.tenants[i], duration_ns);
    if let Some(v) = cache.get(&key) {
        return Ok(v.clone());
    }
    let t = &sc.tenants[i];
    progress(format!(
        "{}: tenant {} ({:?}) alone",
        sc.name, t.name, t.workload
    ));
    let solo = Scenario {
        gpus: 1,
        tenants: vec![scenario::TenantSpec {
            gpu: 0,
            ..t.clone()
        }],
        ..sc.clone()
    };
    let v = run_once(&solo, &[0], true, duration_ns, None, opts)?.outputs[0].clone();
    cache.insert(key, v.clone());
    Ok(v)
}

fn r4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

fn r1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn run_scenario(
    sc: &Scenario,
    opts: Opts,
    out: &Path,
    cache: &mut AloneCache,
) -> anyhow::Result<Value> {
    let duration_ns = if opts.quick {
        sc.duration_ns.min(QUICK_DURATION_NS)
    } else {
        sc.duration_ns
    };
    let all: Vec<usize> = (0..sc.tenants.len()).collect();
    let started = Instant::now();
    progress(format!(
        "{}: {} tenants on {} GPU(s), {:.1} s with gpushare",
        sc.name,
        sc.tenants.len(),
        sc.gpus,
        duration_ns as f64 / 1e9
    ));
    let trace = out.join(format!("{}.trace.jsonl", sc.name));
    let gs = run_once(sc, &all, true, duration_ns, Some(&trace), opts)?;
    let targets = gs.figures.target.clone();
    progress(format!(
        "{}: gpushare max |err| {:.4}, util {:.3}, handoff p99 {:.0} µs",
        sc.name, gs.figures.max_abs_error, gs.figures.device_utilization, gs.figures.handoff_p99_us
    ));
    let base = if opts.baseline {
        progress(format!("{}: native baseline (no gpushare)", sc.name));
        let trace = out.join(format!("{}-native.trace.jsonl", sc.name));
        let b = run_once(sc, &all, false, duration_ns, Some(&trace), opts)?;
        progress(format!(
            "{}: native max |err| {:.4}, util {:.3}",
            sc.name, b.figures.max_abs_error, b.figures.device_utilization
        ));
        Some(b)
    } else {
        None
    };
    // Every tenant alone (under gpushare), for its throughput (and latency) without
    // contention.
    let alone: Vec<Option<Value>> = if opts.alone {
        (0..sc.tenants.len())
            .map(|i| run_alone(sc, i, duration_ns, cache, opts).map(Some))
            .collect::<anyhow::Result<_>>()?
    } else {
        vec![None; sc.tenants.len()]
    };
    let names: Vec<String> = sc.tenants.iter().map(|t| t.name.clone()).collect();
    let plot = format!("{}.svg", sc.name);
    std::fs::write(
        out.join(&plot),
        svg::shares_plot(
            &format!("{} — with gpushare (dashed: targets)", sc.name),
            &gs.figures.plot_t,
            &names,
            &gs.figures.plot_shares,
            &targets,
        ),
    )?;
    if let Some(b) = &base {
        std::fs::write(
            out.join(format!("{}-native.svg", sc.name)),
            svg::shares_plot(
                &format!("{} — native time-slicing (dashed: targets)", sc.name),
                &b.figures.plot_t,
                &names,
                &b.figures.plot_shares,
                &targets,
            ),
        )?;
    }
    let tenants: Vec<Value> = sc
        .tenants
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut v = json!({
                "name": t.name,
                "workload": t.workload,
                "gpu": t.gpu,
                "request": t.request,
                "limit": t.limit,
                "weight": t.weight,
                "target_share": r4(targets[i]),
                "achieved_share": r4(gs.figures.achieved[i]),
                "abs_error": r4(gs.figures.abs_error[i]),
                "max_window_error": r4(gs.figures.max_window_error[i]),
                "throughput_kps": throughput(&gs.outputs[i]).map(r1),
            });
            if let Some(a) = &alone[i] {
                let (with, solo) = (throughput(&gs.outputs[i]), throughput(a));
                v["alone_kernels_per_s"] = json!(solo.map(r1));
                v["throughput_vs_alone"] = json!(
                    with.zip(solo)
                        .filter(|(_, s)| *s > 0.0)
                        .map(|(w, s)| r4(w / s))
                );
            }
            if let Some(b) = &base {
                v["baseline_achieved_share"] = json!(r4(b.figures.achieved[i]));
                v["baseline_abs_error"] = json!(r4(b.figures.abs_error[i]));
                v["baseline_throughput_kps"] = json!(throughput(&b.outputs[i]).map(r1));
            }
            if t.workload == Workload::Latency {
                let lat = |o: &Value| json!({"p50_ms": o["latency_p50_ms"], "p99_ms": o["latency_p99_ms"], "requests": o["requests"]});
                v["latency"] = lat(&gs.outputs[i]);
                if let Some(b) = &base {
                    v["baseline_latency"] = lat(&b.outputs[i]);
                }
                if let Some(a) = &alone[i] {
                    v["alone_latency"] = lat(a);
                }
            }
            v
        })
        .collect();
    let mut v = json!({
        "name": sc.name,
        "description": sc.description,
        "gpus": sc.gpus,
        "duration_s": duration_ns as f64 / 1e9,
        "tenants": tenants,
        "target_share_sum": r4(targets.iter().sum::<f64>()),
        "max_abs_error": r4(gs.figures.max_abs_error),
        "mean_abs_error": r4(gs.figures.mean_abs_error),
        "device_utilization": r4(gs.figures.device_utilization),
        "handoffs": gs.figures.handoffs,
        "handoff_p50_us": r1(gs.figures.handoff_p50_us),
        "handoff_p99_us": r1(gs.figures.handoff_p99_us),
        "windows": gs.figures.windows.len(),
        "measure_start_ns": gs.figures.measure_ns.0,
        "measure_end_ns": gs.figures.measure_ns.1,
        "plot": plot,
    });
    if let Some(d) = &gs.device_check {
        v["device_trace_check"] = json!({
            "achieved_shares": d.achieved.iter().map(|&x| r4(x)).collect::<Vec<_>>(),
            "max_abs_error": r4(d.max_abs_error),
            "device_utilization": r4(d.device_utilization),
            "handoff_p99_us": r1(d.handoff_p99_us),
        });
    }
    if let Some((cpu_s, wall_s)) = gs.scheduler_cpu {
        v["scheduler_cpu_s"] = json!((cpu_s * 1e4).round() / 1e4);
        v["scheduler_cpu_percent"] =
            json!((cpu_s / wall_s.max(1e-9) * 100.0 * 100.0).round() / 100.0);
    }
    if let Some(b) = &base {
        v["baseline"] = json!({
            "max_abs_error": r4(b.figures.max_abs_error),
            "mean_abs_error": r4(b.figures.mean_abs_error),
            "device_utilization": r4(b.figures.device_utilization),
            "handoffs": b.figures.handoffs,
            "handoff_p50_us": r1(b.figures.handoff_p50_us),
            "handoff_p99_us": r1(b.figures.handoff_p99_us),
            "plot": format!("{}-native.svg", sc.name),
        });
    }
    v["wall_s"] = json!(r1(started.elapsed().as_secs_f64()));
    Ok(v)
}

/// ns per cuLaunchKernel of `cudarc-client launch-latency` under the hook (alone, so the token
/// stays held: the fast path) against the driver's own entry point in the same process, and,
/// as a control and the classic comparison, in processes without the hook.
fn launch_overhead(pairs: usize, opts: Opts) -> anyhow::Result<Value> {
    progress("launch overhead: cudarc-client launch-latency, hooked vs the driver's own entry");
    let mut node = opts.node(1)?;
    node.start_scheduler(&[]);
    let client = target_dir().join("cudarc-client");
    const LAUNCHES: u64 = 50_000;
    let n_arg = LAUNCHES.to_string();
    let args = ["launch-latency", "--n", n_arg.as_str()];
    let measure = |cmd: Command| -> anyhow::Result<Value> {
        let (out, killed) = Tenant::spawn(cmd).finish_within(Duration::from_secs(60));
        if killed || !out.status.success() {
            bail!(
                "launch-latency failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let v: Value = serde_json::from_slice(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .last()
                .unwrap_or("")
                .as_bytes(),
        )?;
        for k in [
            "ns_per_launch",
            "ns_per_launch_direct",
            "direct_over_linked",
        ] {
            v[k].as_f64()
                .with_context(|| format!("no {k} in launch-latency output"))?;
        }
        Ok(v)
    };
    let get = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    // In each process launches alternate, block by block, between the route the program
    // resolves (the hook's wrapper when preloaded) and the driver's own entry point: the ratio
    // compares the two under the same conditions. Native processes are the control (both
    // routes are the driver: ratio 1 up to the method's noise) and, against the hooked
    // processes, the comparison of separate runs, alternating so that drifts of this (shared,
    // 2-core) machine hit both alike.
    let mut runs = Vec::new();
    for _ in 0..pairs {
        let mut c = node.command(&client);
        c.args(args);
        let native = measure(c)?;
        let hooked = measure(node.run_command(&["--group", "overhead"], &client, &args))?;
        runs.push((native, hooked));
    }
    let median = |f: &dyn Fn(&(Value, Value)) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        (quantile(&v, 0.5), v[0], v[v.len() - 1])
    };
    let (ratio, ratio_min, ratio_max) = median(&|(_, h)| get(h, "direct_over_linked"));
    let (hooked_ns, _, _) = median(&|(_, h)| get(h, "ns_per_launch"));
    let (direct_ns, _, _) = median(&|(_, h)| get(h, "ns_per_launch_direct"));
    let (control, control_min, control_max) = median(&|(n, _)| get(n, "direct_over_linked"));
    let (sep_native, _, _) = median(&|(n, _)| get(n, "ns_per_launch"));
    let (sep_hooked, _, _) = median(&|(_, h)| get(h, "ns_per_launch"));
    let (sep_ratio, sep_min, sep_max) =
        median(&|(n, h)| get(n, "ns_per_launch") / get(h, "ns_per_launch"));
    progress(format!(
        "launch overhead: hooked {hooked_ns:.0} ns vs the driver's own entry {direct_ns:.0} ns in the same process, ratio {ratio:.3} ({ratio_min:.3}–{ratio_max:.3}); control without the hook {control:.3}; separate processes {sep_native:.0} vs {sep_hooked:.0} ns, ratio {sep_ratio:.3} ({sep_min:.3}–{sep_max:.3})"
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
    let turnover = get(&turnover?, "ns_per_launch");
    progress(format!(
        "launch overhead with token turnover (a competing group): {turnover:.0} ns per launch"
    ));
    drop(node.stop());
    Ok(json!({
        "native_ns": r1(direct_ns),
        "hooked_ns": r1(hooked_ns),
        "ratio": r4(ratio),
        "ratio_min": r4(ratio_min),
        "ratio_max": r4(ratio_max),
        "overhead_ns": r1(hooked_ns - direct_ns),
        "method": "same process, blocks of 500 launches alternating between the hooked entry and the driver's own; medians",
        "control_ratio": r4(control),
        "control_ratio_min": r4(control_min),
        "control_ratio_max": r4(control_max),
        "separate_processes": {
            "native_ns": r1(sep_native),
            "hooked_ns": r1(sep_hooked),
            "ratio": r4(sep_ratio),
            "ratio_min": r4(sep_min),
            "ratio_max": r4(sep_max),
        },
        "hooked_turnover_ns": r1(turnover),
        "launches_per_sample": 2 * LAUNCHES,
        "pairs": pairs,
    }))
}

fn bench(list: Vec<Scenario>, out: &Path, opts: Opts) -> anyhow::Result<()> {
    if list.is_empty() {
        bail!("no scenarios to run");
    }
    std::fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;
    let started = Instant::now();
    let mut scenarios = Vec::new();
    let mut errors = Vec::new();
    let mut cache = AloneCache::new();
    for (k, sc) in list.iter().enumerate() {
        progress(format!("[{}/{}] scenario {}", k + 1, list.len(), sc.name));
        match run_scenario(sc, opts, out, &mut cache) {
            Ok(v) => scenarios.push(v),
            Err(e) => {
                progress(format!("{}: FAILED: {e:#}", sc.name));
                errors.push(json!({"name": sc.name, "error": format!("{e:#}")}));
            }
        }
    }
    let overhead = if opts.overhead {
        let pairs = if opts.quick {
            QUICK_OVERHEAD_PAIRS
        } else {
            OVERHEAD_PAIRS
        };
        match launch_overhead(pairs, opts) {
            Ok(v) => v,
            Err(e) => {
                progress(format!("launch overhead FAILED: {e:#}"));
                errors.push(json!({"name": "launch_overhead", "error": format!("{e:#}")}));
                Value::Null
            }
        }
    } else {
        Value::Null
    };
    let summary = json!({
        "quick": opts.quick,
        "gpu": match opts.system_gpus {
            Some(n) => format!("this machine's ({n})"),
            None => "simulated".into(),
        },
        "measured_from": match opts.source {
            Source::Device => "device trace",
            Source::Events => "tenant CUDA timing events",
        },
        "wall_s": r1(started.elapsed().as_secs_f64()),
        "warmup_s": analysis::WARMUP_NS as f64 / 1e9,
        "window_s": analysis::WINDOW_NS as f64 / 1e9,
        "scenarios": scenarios,
        "launch_overhead": overhead,
        "errors": errors,
    });
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary)? + "\n",
    )?;
    std::fs::write(out.join("summary.md"), markdown(&summary))?;
    progress(format!(
        "done in {:.1} s: {}/summary.json, summary.md, *.svg, {}",
        started.elapsed().as_secs_f64(),
        out.display(),
        match (opts.source, opts.system_gpus) {
            (Source::Device, _) => "*.trace.jsonl",
            (Source::Events, None) => "*.timeline.jsonl, *.trace.jsonl",
            (Source::Events, Some(_)) => "*.timeline.jsonl",
        }
    ));
    if !errors.is_empty() {
        bail!("{} part(s) failed (see summary.json errors)", errors.len());
    }
    Ok(())
}

fn f(v: &Value, d: usize) -> String {
    v.as_f64()
        .map_or_else(|| "–".to_string(), |x| format!("{x:.d$}"))
}

fn markdown(s: &Value) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# gpushare benchmark{}\n\nGPU: {}. Shares are busy time per {} s window after {} s warm-up, from the {}. \
         Targets follow DESIGN §2 with each tenant's demand as a cap (a latency tenant's: the work of \
         the requests that arrived in the window). \
         \"native\" = same tenants without gpushare (the device's own time-slicing).\n",
        if s["quick"].as_bool() == Some(true) {
            " (--quick)"
        } else {
            ""
        },
        s["gpu"].as_str().unwrap_or(""),
        s["window_s"],
        s["warmup_s"],
        s["measured_from"].as_str().unwrap_or("")
    );
    let _ = writeln!(
        o,
        "| scenario | tenants | max abs err | mean abs err | native max abs err | utilisation | native utilisation | handoff p50 / p99 µs | scheduler CPU % |"
    );
    let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let empty = Vec::new();
    let list = s["scenarios"].as_array().unwrap_or(&empty);
    for sc in list {
        let b = &sc["baseline"];
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} | {} / {} | {} |",
            sc["name"].as_str().unwrap_or(""),
            sc["tenants"].as_array().map_or(0, Vec::len),
            f(&sc["max_abs_error"], 3),
            f(&sc["mean_abs_error"], 3),
            f(&b["max_abs_error"], 3),
            f(&sc["device_utilization"], 3),
            f(&b["device_utilization"], 3),
            f(&sc["handoff_p50_us"], 0),
            f(&sc["handoff_p99_us"], 0),
            f(&sc["scheduler_cpu_percent"], 2),
        );
    }
    let lo = &s["launch_overhead"];
    if !lo.is_null() {
        let _ = writeln!(
            o,
            "\nLaunch overhead (cuLaunchKernel of cudarc-client launch-latency, medians of {} runs): in one process, alternating blocks, hooked {} ns against the driver's own entry {} ns, throughput ratio {} (runs {}–{}; the same measure without the hook: {}, {}–{}). Separate processes, native {} ns and hooked {} ns, ratio {} ({}–{}). Hooked with token turnover (a competing group) {} ns.\n",
            lo["pairs"],
            f(&lo["hooked_ns"], 0),
            f(&lo["native_ns"], 0),
            f(&lo["ratio"], 3),
            f(&lo["ratio_min"], 3),
            f(&lo["ratio_max"], 3),
            f(&lo["control_ratio"], 3),
            f(&lo["control_ratio_min"], 3),
            f(&lo["control_ratio_max"], 3),
            f(&lo["separate_processes"]["native_ns"], 0),
            f(&lo["separate_processes"]["hooked_ns"], 0),
            f(&lo["separate_processes"]["ratio"], 3),
            f(&lo["separate_processes"]["ratio_min"], 3),
            f(&lo["separate_processes"]["ratio_max"], 3),
            f(&lo["hooked_turnover_ns"], 0)
        );
    }
    for sc in list {
        let _ = writeln!(
            o,
            "\n## {}\n\n{}\n\n| tenant | workload | gpu | request | limit | weight | target | achieved | abs err | max window err | native achieved | kernels/s | native kernels/s | alone kernels/s | vs alone | latency p50/p99 ms (gpushare · native · alone) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            sc["name"].as_str().unwrap_or(""),
            sc["description"].as_str().unwrap_or("")
        );
        for t in sc["tenants"].as_array().unwrap_or(&empty) {
            let lat = |k: &str| {
                let l = &t[k];
                if l.is_null() {
                    "–".to_string()
                } else {
                    format!("{}/{}", f(&l["p50_ms"], 1), f(&l["p99_ms"], 1))
                }
            };
            let latency = if t["latency"].is_null() {
                "".to_string()
            } else {
                format!(
                    "{} · {} · {}",
                    lat("latency"),
                    lat("baseline_latency"),
                    lat("alone_latency")
                )
            };
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                t["name"].as_str().unwrap_or(""),
                t["workload"].as_str().unwrap_or(""),
                t["gpu"],
                f(&t["request"], 2),
                f(&t["limit"], 2),
                f(&t["weight"], 1),
                f(&t["target_share"], 3),
                f(&t["achieved_share"], 3),
                f(&t["abs_error"], 3),
                f(&t["max_window_error"], 3),
                f(&t["baseline_achieved_share"], 3),
                f(&t["throughput_kps"], 0),
                f(&t["baseline_throughput_kps"], 0),
                f(&t["alone_kernels_per_s"], 0),
                f(&t["throughput_vs_alone"], 3),
                latency
            );
        }
        let check = &sc["device_trace_check"];
        if !check.is_null() {
            let _ = writeln!(
                o,
                "\nThe simulated device's trace of the same run: shares {}, max abs err {}, utilisation {}, handoff p99 {} µs.",
                check["achieved_shares"]
                    .as_array()
                    .unwrap_or(&empty)
                    .iter()
                    .map(|x| f(x, 3))
                    .collect::<Vec<_>>()
                    .join(" / "),
                f(&check["max_abs_error"], 3),
                f(&check["device_utilization"], 3),
                f(&check["handoff_p99_us"], 0)
            );
        }
        let _ = writeln!(
            o,
            "\n![{}]({})",
            sc["name"].as_str().unwrap_or(""),
            sc["plot"].as_str().unwrap_or("")
        );
    }
    for e in s["errors"].as_array().unwrap_or(&empty) {
        let _ = writeln!(o, "\n**FAILED** {}: {}", e["name"], e["error"]);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_cpu_reading_of_own_process() {
        let a = cpu_seconds(std::process::id()).expect("read /proc/self");
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(50) {
            std::hint::black_box(0u64);
        }
        let b = cpu_seconds(std::process::id()).unwrap();
        let d = cpu_delta(a, b);
        assert!((0.02..1.0).contains(&d), "{d} s of CPU for a 50 ms spin");
    }

    #[test]
    fn throughput_of_spin_and_latency_results() {
        let spin = json!({"kernels": 500, "wall_ms": 1000.0});
        assert_eq!(throughput(&spin), Some(500.0));
        let lat = json!({"requests": 40, "kernels_per_request": 4, "start_ns": 0, "end_ns": 2_000_000_000u64});
        assert_eq!(throughput(&lat), Some(80.0));
        assert_eq!(throughput(&Value::Null), None);
    }
}
