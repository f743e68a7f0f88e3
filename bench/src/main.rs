//! `gpushare-bench`: run fairness scenarios on the simulated GPU with gpushare and without it
//! (native time-slicing), measure launch overhead, and write `summary.json`, `summary.md` and one
//! SVG plot of shares over time per scenario.

mod analysis;
mod scenario;
mod svg;

use analysis::{RunFigures, analyse, quantile};
use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use gpushare_sim_clients::harness::target_dir;
use gpushare_sim_clients::node::{Node, Tenant};
use scenario::{Scenario, Workload};
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

/// Scenario duration with `--quick`.
const QUICK_DURATION_NS: u64 = 3_000_000_000;

#[derive(Parser)]
#[command(
    name = "gpushare-bench",
    about = "Fairness and overhead benchmark on the simulated GPU"
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
    },
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
        } => Scenario::load(&scenario).and_then(|sc| {
            bench(
                vec![sc],
                &out,
                Opts {
                    quick,
                    baseline: !no_baseline,
                    overhead,
                },
            )
        }),
        Cmd::Suite {
            out,
            quick,
            scenarios,
            only,
            no_baseline,
        } => load_dir(&scenarios).and_then(|all| {
            let list = all
                .into_iter()
                .filter(|s| !(quick && s.full_only))
                .filter(|s| only.is_empty() || only.iter().any(|o| s.name.contains(o.as_str())))
                .collect();
            bench(
                list,
                &out,
                Opts {
                    quick,
                    baseline: !no_baseline,
                    overhead: true,
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
}

fn progress(msg: impl AsRef<str>) {
    eprintln!("[gpushare-bench] {}", msg.as_ref());
}

/// One run of (some of) a scenario's tenants, with or without gpushare.
struct RunResult {
    figures: RunFigures,
    /// Each tenant's JSON result line (Null when it printed none).
    outputs: Vec<Value>,
}

/// Run tenants `which` of `sc` for `duration_ns` on a fresh simulated node.
fn run_once(
    sc: &Scenario,
    which: &[usize],
    gpushare: bool,
    duration_ns: u64,
) -> anyhow::Result<RunResult> {
    let gpus = sc.gpus.to_string();
    let mut node = Node::device_only_with(&["--gpus", &gpus]);
    if gpushare {
        node.start_scheduler(&[]);
    }
    let client = target_dir().join("cudarc-client");
    let duration_ms = duration_ns as f64 / 1e6;
    let mut running: Vec<Tenant> = Vec::new();
    for (k, &i) in which.iter().enumerate() {
        let t = &sc.tenants[i];
        let args = t.client_args(duration_ms, k as u64 + 1);
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
    let log = if gpushare {
        node.scheduler_log()
    } else {
        String::new()
    };
    let trace = node.finish();
    if !failures.is_empty() {
        bail!("{}\n{}", failures.join("\n"), log.trim());
    }
    let targets = sc.target_shares();
    let figures = analyse(
        &trace,
        &pids,
        &which.iter().map(|&i| sc.tenants[i].gpu).collect::<Vec<_>>(),
        &which.iter().map(|&i| targets[i]).collect::<Vec<_>>(),
    );
    Ok(RunResult { figures, outputs })
}

/// Kernels per second from a `spin` result.
fn throughput(v: &Value) -> Option<f64> {
    let k = v["kernels"].as_f64()?;
    let wall = v["wall_ms"].as_f64()?;
    (wall > 0.0).then(|| k / wall * 1e3)
}

fn r4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

fn r1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn run_scenario(sc: &Scenario, opts: Opts, out: &Path) -> anyhow::Result<Value> {
    let duration_ns = if opts.quick {
        sc.duration_ns.min(QUICK_DURATION_NS)
    } else {
        sc.duration_ns
    };
    let all: Vec<usize> = (0..sc.tenants.len()).collect();
    let targets = sc.target_shares();
    let started = Instant::now();
    progress(format!(
        "{}: {} tenants on {} GPU(s), {:.1} s with gpushare",
        sc.name,
        sc.tenants.len(),
        sc.gpus,
        duration_ns as f64 / 1e9
    ));
    let gs = run_once(sc, &all, true, duration_ns)?;
    progress(format!(
        "{}: gpushare max |err| {:.4}, util {:.3}, handoff p99 {:.0} µs",
        sc.name, gs.figures.max_abs_error, gs.figures.device_utilization, gs.figures.handoff_p99_us
    ));
    let base = if opts.baseline {
        progress(format!("{}: native baseline (no gpushare)", sc.name));
        let b = run_once(sc, &all, false, duration_ns)?;
        progress(format!(
            "{}: native max |err| {:.4}, util {:.3}",
            sc.name, b.figures.max_abs_error, b.figures.device_utilization
        ));
        Some(b)
    } else {
        None
    };
    // Latency tenants alone (under gpushare), for their latency without contention.
    let mut alone: Vec<Option<Value>> = vec![None; sc.tenants.len()];
    for (i, t) in sc.tenants.iter().enumerate() {
        if t.workload == Workload::Latency {
            progress(format!("{}: latency tenant {} alone", sc.name, t.name));
            alone[i] = Some(run_once(sc, &[i], true, duration_ns)?.outputs[0].clone());
        }
    }
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
        "plot": plot,
    });
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

/// ns per cuLaunchKernel of `cudarc-client launch-latency`, natively and under the hook (alone,
/// so the token stays held: the fast path), on the same node, alternating, median of 3 each.
fn launch_overhead() -> anyhow::Result<Value> {
    progress("launch overhead: cudarc-client launch-latency, native vs hooked (token held)");
    let mut node = Node::device_only();
    node.start_scheduler(&[]);
    let client = target_dir().join("cudarc-client");
    let args = ["launch-latency", "--n", "20000"];
    let measure = |cmd: Command| -> anyhow::Result<f64> {
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
        v["ns_per_launch"]
            .as_f64()
            .context("no ns_per_launch in launch-latency output")
    };
    let (mut native, mut hooked) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let mut c = node.command(&client);
        c.args(args);
        native.push(measure(c)?);
        hooked.push(measure(node.run_command(
            &["--group", "overhead"],
            &client,
            &args,
        ))?);
    }
    native.sort_by(f64::total_cmp);
    hooked.sort_by(f64::total_cmp);
    let (n, h) = (quantile(&native, 0.5), quantile(&hooked, 0.5));
    progress(format!(
        "launch overhead: native {n:.0} ns, hooked {h:.0} ns, ratio {:.3}",
        n / h
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
    let turnover = turnover?;
    progress(format!(
        "launch overhead with token turnover (a competing group): {turnover:.0} ns per launch"
    ));
    drop(node.finish());
    Ok(json!({
        "native_ns": r1(n),
        "hooked_ns": r1(h),
        "ratio": r4(n / h),
        "overhead_ns": r1(h - n),
        "hooked_turnover_ns": r1(turnover),
        "native_samples_ns": native.iter().map(|x| r1(*x)).collect::<Vec<_>>(),
        "hooked_samples_ns": hooked.iter().map(|x| r1(*x)).collect::<Vec<_>>(),
        "launches_per_sample": 20000,
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
    for (k, sc) in list.iter().enumerate() {
        progress(format!("[{}/{}] scenario {}", k + 1, list.len(), sc.name));
        match run_scenario(sc, opts, out) {
            Ok(v) => scenarios.push(v),
            Err(e) => {
                progress(format!("{}: FAILED: {e:#}", sc.name));
                errors.push(json!({"name": sc.name, "error": format!("{e:#}")}));
            }
        }
    }
    let overhead = if opts.overhead {
        match launch_overhead() {
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
        "done in {:.1} s: {}/summary.json, summary.md, *.svg",
        started.elapsed().as_secs_f64(),
        out.display()
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
        "# gpushare benchmark{}\n\nShares are busy time per {} s window after {} s warm-up, from the device trace. \
         \"native\" = same tenants without gpushare (the device's own time-slicing).\n",
        if s["quick"].as_bool() == Some(true) {
            " (--quick)"
        } else {
            ""
        },
        s["window_s"],
        s["warmup_s"]
    );
    let _ = writeln!(
        o,
        "| scenario | tenants | max abs err | mean abs err | native max abs err | utilisation | native utilisation | handoff p50 / p99 µs |"
    );
    let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|---:|");
    let empty = Vec::new();
    let list = s["scenarios"].as_array().unwrap_or(&empty);
    for sc in list {
        let b = &sc["baseline"];
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} | {} / {} |",
            sc["name"].as_str().unwrap_or(""),
            sc["tenants"].as_array().map_or(0, Vec::len),
            f(&sc["max_abs_error"], 3),
            f(&sc["mean_abs_error"], 3),
            f(&b["max_abs_error"], 3),
            f(&sc["device_utilization"], 3),
            f(&b["device_utilization"], 3),
            f(&sc["handoff_p50_us"], 0),
            f(&sc["handoff_p99_us"], 0),
        );
    }
    let lo = &s["launch_overhead"];
    if !lo.is_null() {
        let _ = writeln!(
            o,
            "\nLaunch overhead (cuLaunchKernel of cudarc-client launch-latency, same binary): native {} ns, hooked with the token held {} ns, ratio native/hooked {}; hooked with token turnover (a competing group) {} ns.\n",
            f(&lo["native_ns"], 0),
            f(&lo["hooked_ns"], 0),
            f(&lo["ratio"], 3),
            f(&lo["hooked_turnover_ns"], 0)
        );
    }
    for sc in list {
        let _ = writeln!(
            o,
            "\n## {}\n\n{}\n\n| tenant | workload | gpu | request | limit | weight | target | achieved | abs err | max window err | native achieved | kernels/s | native kernels/s | latency p50/p99 ms (gpushare · native · alone) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
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
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
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
                latency
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
