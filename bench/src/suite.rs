//! A benchmark invocation: every scenario `--repeat` times with gpushare (and natively), its
//! tenants alone, the launch overhead; the report written to `summary.json` and `summary.md`,
//! one plot per scenario, and the kernel records of every run.

use crate::alone::AloneCache;
use crate::analysis;
use crate::client::ClientResult;
use crate::markdown;
use crate::overhead;
use crate::progress;
use crate::report::{
    Baseline, DeviceCheck, EventLoopReport, Failure, FaultReport, FloodReport, Headline,
    LatencySpread, Report, RunReport, ScenarioReport, Spread, TenantReport, TenantRun, round,
    rounded,
};
use crate::run::{self, Mode, RunOutcome, RunSpec};
use crate::scenario::{Scenario, TenantSpec};
use crate::settings::{Settings, Source};
use crate::svg;
use anyhow::{Context, bail};
use std::path::Path;
use std::time::Instant;

/// Run `list` and write the report into `out`. Fails (after writing it) if any part failed.
pub fn bench(list: Vec<Scenario>, out: &Path, s: &Settings) -> anyhow::Result<()> {
    if list.is_empty() {
        bail!("no scenarios to run (check --scenarios and --only)");
    }
    std::fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;
    let started = Instant::now();
    let mut scenarios = Vec::new();
    let mut errors = Vec::new();
    let mut cache = AloneCache::default();
    for (k, sc) in list.iter().enumerate() {
        progress(format!("[{}/{}] scenario {}", k + 1, list.len(), sc.name));
        match run_scenario(sc, s, out, &mut cache) {
            Ok(v) => scenarios.push(v),
            Err(e) => {
                progress(format!("{}: FAILED: {e:#}", sc.name));
                errors.push(Failure {
                    name: sc.name.clone(),
                    error: format!("{e:#}"),
                });
            }
        }
    }
    let launch_overhead = if s.overhead {
        let pairs = if s.quick {
            overhead::QUICK_PAIRS
        } else {
            overhead::PAIRS
        };
        match overhead::measure_launch_overhead(pairs, s) {
            Ok(v) => Some(v),
            Err(e) => {
                progress(format!("launch overhead FAILED: {e:#}"));
                errors.push(Failure {
                    name: "launch_overhead".into(),
                    error: format!("{e:#}"),
                });
                None
            }
        }
    } else {
        None
    };
    let report = Report {
        quick: s.quick,
        gpu: s.gpu(),
        measured_from: s.source.describe().into(),
        repeat: s.repeat,
        noise: s.noise,
        wall_s: round(started.elapsed().as_secs_f64(), 1),
        warmup_s: analysis::WARMUP_NS as f64 / 1e9,
        window_s: analysis::WINDOW_NS as f64 / 1e9,
        scenarios,
        launch_overhead,
        errors,
    };
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    std::fs::write(out.join("summary.md"), markdown::render(&report))?;
    progress(format!(
        "done in {:.1} s: {}/summary.json, summary.md, *.svg, {}",
        started.elapsed().as_secs_f64(),
        out.display(),
        match (s.source, s.system_gpus) {
            (Source::Device, _) => "*.trace.jsonl",
            (Source::Events, None) => "*.timeline.jsonl, *.trace.jsonl",
            (Source::Events, Some(_)) => "*.timeline.jsonl",
        }
    ));
    if !report.errors.is_empty() {
        bail!(
            "{} part(s) failed (see summary.json errors)",
            report.errors.len()
        );
    }
    Ok(())
}

/// Base name of the kernel records of run `k` (from 1): `NAME-runK`, `NAME-native-runK`.
fn records_stem(sc: &Scenario, mode: Mode, k: u32) -> String {
    match mode {
        Mode::Gpushare => format!("{}-run{k}", sc.name),
        Mode::Native => format!("{}-native-run{k}", sc.name),
    }
}

/// `s.repeat` runs of every tenant of `sc` in `mode`, each outcome with its report.
fn repeated(
    sc: &Scenario,
    mode: Mode,
    duration_ns: u64,
    out: &Path,
    s: &Settings,
) -> anyhow::Result<Vec<(RunOutcome, RunReport)>> {
    let all: Vec<usize> = (0..sc.tenants.len()).collect();
    (1..=s.repeat)
        .map(|k| {
            let stem = records_stem(sc, mode, k);
            let trace = out.join(format!("{stem}.trace.jsonl"));
            let label = format!("{}/{}/{k}", sc.name, mode.label());
            let o = run::run(
                &RunSpec {
                    sc,
                    which: &all,
                    mode,
                    duration_ns,
                    keep_trace: Some(&trace),
                    label: &label,
                    flood: sc.flood.as_ref(),
                    fault: sc.fault.as_ref(),
                },
                s,
            )
            .with_context(|| format!("{} run {k}", mode.label()))?;
            let f = &o.figures;
            progress(format!(
                "{}: {} run {k}/{}: max |err| {:.4}, util {:.3}, handoff p99 {:.0} µs{}{}",
                sc.name,
                mode.label(),
                s.repeat,
                f.summary.max_abs_error,
                f.summary.device_utilization,
                f.summary.handoff_p99_us,
                o.flood.as_ref().map_or_else(String::new, |f| format!(
                    "; flooded: scheduler threads ≤ {}, status {:.1} ms max ({:.1} median, {} calls), {} junk connections",
                    f.threads_max,
                    f.status_max_ms,
                    f.status_median_ms,
                    f.status_calls,
                    f.connections.junk_opened
                )),
                o.noise.as_ref().map_or_else(String::new, |n| format!(
                    "; {} stalls ({})",
                    n.total_stalls(),
                    n.stalls
                        .iter()
                        .map(|p| format!("{} {}", p.process, p.stalls))
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            ));
            let records = match s.source {
                Source::Device => format!("{stem}.trace.jsonl"),
                Source::Events => format!("{stem}.timeline.jsonl"),
            };
            let report = run_report(k, &o, records);
            Ok((o, report))
        })
        .collect()
}

fn run_report(run: u32, o: &RunOutcome, records: String) -> RunReport {
    let f = &o.figures;
    RunReport {
        run,
        summary: rounded(&f.summary),
        windows: f.windows.len(),
        measure_start_ns: f.measure_ns.0,
        measure_end_ns: f.measure_ns.1,
        tenants: (0..f.achieved.len())
            .map(|i| TenantRun {
                target_share: round(f.target[i], 4),
                achieved_share: round(f.achieved[i], 4),
                abs_error: round(f.abs_error[i], 4),
                max_window_error: round(f.max_window_error[i], 4),
                throughput_kps: o.outputs[i]
                    .as_ref()
                    .and_then(ClientResult::throughput)
                    .map(|x| round(x, 1)),
                latency: o.outputs[i].as_ref().and_then(ClientResult::latency),
            })
            .collect(),
        scheduler_cpu_s: o.scheduler_cpu.map(|(cpu, _)| round(cpu, 4)),
        scheduler_cpu_percent: o
            .scheduler_cpu
            .map(|(cpu, wall)| round(cpu / wall.max(1e-9) * 100.0, 2)),
        device_trace_check: o.device_check.as_ref().map(|d| DeviceCheck {
            achieved_shares: d.achieved.iter().map(|&x| round(x, 4)).collect(),
            summary: rounded(&d.summary),
        }),
        noise: o.noise.clone(),
        flood: o.flood.clone(),
        fault: o.fault.clone(),
        event_loop: o.event_loop.clone(),
        records,
    }
}

/// Index of the run with the median worst-window error (the lower middle one for an even
/// count): the run plotted.
fn median_run(runs: &[RunOutcome]) -> usize {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    let worst = |k: usize| runs[k].figures.summary.max_abs_error;
    order.sort_by(|&a, &b| worst(a).total_cmp(&worst(b)));
    order[(runs.len() - 1) / 2]
}

/// Plot the run of `runs` with the median worst-window error to `out/file`, the title
/// `what` followed by which run it is; that run's index.
fn plot_median(
    out: &Path,
    file: &str,
    what: &str,
    names: &[String],
    runs: &[RunOutcome],
) -> anyhow::Result<usize> {
    let k = median_run(runs);
    let f = &runs[k].figures;
    let title = format!(
        "{what}, run {} of {} (median worst window; dashed: targets)",
        k + 1,
        runs.len()
    );
    let svg = svg::shares_plot(&title, &f.plot_t, names, &f.plot_shares, &f.target);
    std::fs::write(out.join(file), svg).with_context(|| format!("cannot write {file}"))?;
    Ok(k)
}

/// Tenant `i` (`t`) over the runs with gpushare (`outcomes`, and their `runs`), the native
/// runs `baseline` and its run alone.
fn tenant_report(
    i: usize,
    t: &TenantSpec,
    outcomes: &[RunOutcome],
    runs: &[RunReport],
    baseline: Option<&[RunReport]>,
    alone: Option<&ClientResult>,
) -> TenantReport {
    let of = |runs: &[RunReport], f: fn(&TenantRun) -> Option<f64>, d| {
        Spread::of(runs.iter().filter_map(|r| f(&r.tenants[i])), d)
    };
    let all = |f: fn(&TenantRun) -> f64| Spread::all(runs.iter().map(|r| f(&r.tenants[i])), 4);
    let latency = |runs: &[RunReport]| {
        LatencySpread::of(
            &runs
                .iter()
                .map(|r| r.tenants[i].latency)
                .collect::<Vec<_>>(),
        )
    };
    let solo = alone.and_then(ClientResult::throughput);
    TenantReport {
        name: t.name.clone(),
        workload: t.workload,
        gpu: t.gpu,
        request: t.request,
        limit: t.limit,
        weight: t.weight,
        target_share: all(|r| r.target_share),
        achieved_share: all(|r| r.achieved_share),
        abs_error: all(|r| r.abs_error),
        max_window_error: all(|r| r.max_window_error),
        throughput_kps: of(runs, |r| r.throughput_kps, 1),
        alone_kernels_per_s: solo.map(|x| round(x, 1)),
        throughput_vs_alone: Spread::of(
            outcomes.iter().filter_map(|o| {
                let with = o.outputs[i].as_ref()?.throughput()?;
                solo.filter(|&a| a > 0.0).map(|a| with / a)
            }),
            4,
        ),
        baseline_achieved_share: baseline.and_then(|b| of(b, |r| Some(r.achieved_share), 4)),
        baseline_abs_error: baseline.and_then(|b| of(b, |r| Some(r.abs_error), 4)),
        baseline_throughput_kps: baseline.and_then(|b| of(b, |r| r.throughput_kps, 1)),
        latency: latency(runs),
        baseline_latency: baseline.and_then(latency),
        alone_latency: alone.and_then(ClientResult::latency),
    }
}

fn run_scenario(
    sc: &Scenario,
    s: &Settings,
    out: &Path,
    cache: &mut AloneCache,
) -> anyhow::Result<ScenarioReport> {
    let duration_ns = s.duration_ns(sc);
    let started = Instant::now();
    progress(format!(
        "{}: {} tenants on {} GPU(s), {} × {:.1} s with gpushare{}",
        sc.name,
        sc.tenants.len(),
        sc.gpus,
        s.repeat,
        duration_ns as f64 / 1e9,
        if s.baseline { " and natively" } else { "" }
    ));
    let (outcomes, runs): (Vec<RunOutcome>, Vec<RunReport>) =
        repeated(sc, Mode::Gpushare, duration_ns, out, s)?
            .into_iter()
            .unzip();
    let base = if s.baseline {
        Some(repeated(sc, Mode::Native, duration_ns, out, s)?)
    } else {
        None
    };
    // Every tenant alone (under gpushare), for its throughput (and latency) without contention.
    let alone: Vec<Option<ClientResult>> = if s.alone {
        (0..sc.tenants.len())
            .map(|i| cache.run(sc, i, duration_ns, s))
            .collect::<anyhow::Result<_>>()?
    } else {
        vec![None; sc.tenants.len()]
    };
    let names: Vec<String> = sc.tenants.iter().map(|t| t.name.clone()).collect();
    let plot_file = format!("{}.svg", sc.name);
    let what = format!("{} — with gpushare", sc.name);
    let plotted = plot_median(out, &plot_file, &what, &names, &outcomes)?;
    let baseline = match base {
        Some(b) => {
            let (b_outcomes, runs): (Vec<RunOutcome>, Vec<RunReport>) = b.into_iter().unzip();
            let file = format!("{}-native.svg", sc.name);
            let what = format!("{} — native time-slicing", sc.name);
            let k = plot_median(out, &file, &what, &names, &b_outcomes)?;
            Some(Baseline {
                headline: Headline::of(&runs),
                runs,
                plot: file,
                plot_run: k as u32 + 1,
            })
        }
        None => None,
    };
    let tenants = sc
        .tenants
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let b = baseline.as_ref().map(|b| b.runs.as_slice());
            tenant_report(i, t, &outcomes, &runs, b, alone[i].as_ref())
        })
        .collect();
    Ok(ScenarioReport {
        name: sc.name.clone(),
        description: sc.description.clone(),
        gpus: sc.gpus,
        duration_s: duration_ns as f64 / 1e9,
        tenants,
        target_share_sum: Spread::all(
            runs.iter()
                .map(|r| r.tenants.iter().map(|t| t.target_share).sum::<f64>()),
            4,
        ),
        headline: Headline::of(&runs),
        scheduler_cpu_percent: Spread::of(runs.iter().filter_map(|r| r.scheduler_cpu_percent), 2),
        flood: sc.flood.and_then(|f| FloodReport::of(f, &runs)),
        fault: sc.fault.and_then(|f| FaultReport::of(f, &runs)),
        event_loop: EventLoopReport::of(&runs),
        runs,
        baseline,
        plot: plot_file,
        plot_run: plotted as u32 + 1,
        wall_s: round(started.elapsed().as_secs_f64(), 1),
    })
}
