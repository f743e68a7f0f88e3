//! `summary.md`: the [`Report`] as tables — each figure the median over the runs with
//! [min–max].

use crate::fault::FaultKind;
use crate::report::{LatencySpread, Report, ScenarioReport, Spread};
use std::fmt::Write as _;

/// `median [min–max]` to `d` decimals (the median alone when all runs agree).
fn spread(s: &Spread, d: usize) -> String {
    let (lo, mid, hi) = (
        format!("{:.d$}", s.min),
        format!("{:.d$}", s.median),
        format!("{:.d$}", s.max),
    );
    if lo == hi {
        mid
    } else {
        format!("{mid} [{lo}–{hi}]")
    }
}

fn opt(s: Option<&Spread>, d: usize) -> String {
    s.map_or_else(|| "–".into(), |s| spread(s, d))
}

fn num(x: Option<f64>, d: usize) -> String {
    x.map_or_else(|| "–".into(), |x| format!("{x:.d$}"))
}

fn latency(l: Option<&LatencySpread>) -> String {
    l.map_or_else(
        || "–".into(),
        |l| {
            format!(
                "{}/{}/{}/{}",
                spread(&l.p50_ms, 1),
                spread(&l.p90_ms, 1),
                spread(&l.p99_ms, 1),
                spread(&l.p999_ms, 1)
            )
        },
    )
}

pub fn render(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# gpushare benchmark{}{}\n\nGPU: {}. Every scenario ran {} time(s) with gpushare{}; each figure is the median over \
         the runs with [min–max]. Shares are busy time per {} s window after {} s warm-up, from the {}. \
         Targets are the benchmark's own water-filling of the shares (not the scheduler's code), each \
         tenant's demand as a cap (a latency tenant's: the work its requests would run in the window alone). \
         \"native\" = same tenants without gpushare (the device's own time-slicing).\n",
        if r.quick { " (--quick)" } else { "" },
        if r.noise.is_some() { " (--noisy)" } else { "" },
        r.gpu,
        r.repeat,
        if r.scenarios.iter().any(|s| s.baseline.is_some()) {
            " and as many natively"
        } else {
            ""
        },
        r.window_s,
        r.warmup_s,
        r.measured_from
    );
    if let Some(n) = &r.noise {
        let _ = writeln!(
            o,
            "Noisy host (seed {}): {} CPU hog process(es) spinning for the whole of each run; stalls \
             (SIGSTOP, then SIGCONT) of a tenant or the scheduler chosen at random, {}–{} ms each \
             (uniform), {} ms apart on average (exponential); the simulated device is never stalled.\n",
            n.seed, n.hogs, n.stall_min_ms, n.stall_max_ms, n.stall_mean_interval_ms
        );
    }
    let noisy = r.noise.is_some();
    let _ = writeln!(
        o,
        "| scenario | tenants | max abs err | mean abs err | native max abs err | utilisation | native utilisation | handoff p50 µs | handoff p99 µs | scheduler CPU % |{}",
        if noisy { " stalls per run |" } else { "" }
    );
    let _ = writeln!(
        o,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|{}",
        if noisy { "---:|" } else { "" }
    );
    for sc in &r.scenarios {
        let h = &sc.headline;
        let b = sc.baseline.as_ref().map(|b| &b.headline);
        let mut row = format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            sc.name,
            sc.tenants.len(),
            spread(&h.max_abs_error, 3),
            spread(&h.mean_abs_error, 3),
            opt(b.map(|b| &b.max_abs_error), 3),
            spread(&h.device_utilization, 3),
            opt(b.map(|b| &b.device_utilization), 3),
            spread(&h.handoff_p50_us, 0),
            spread(&h.handoff_p99_us, 0),
            opt(sc.scheduler_cpu_percent.as_ref(), 2),
        );
        if noisy {
            let stalls = Spread::of(
                sc.runs
                    .iter()
                    .filter_map(|r| r.noise.as_ref())
                    .map(|n| f64::from(n.total_stalls())),
                0,
            );
            let _ = write!(row, " {} |", opt(stalls.as_ref(), 0));
        }
        let _ = writeln!(o, "{row}");
    }
    if let Some(lo) = &r.launch_overhead {
        let _ = writeln!(
            o,
            "\nLaunch overhead (cuLaunchKernel of cudarc-client launch-latency, medians of {} runs): in one process, alternating blocks, hooked {:.0} ns against the driver's own entry {:.0} ns, throughput ratio {:.3} (runs {:.3}–{:.3}; the same measure without the hook: {}). Separate processes, native {:.0} ns and hooked {:.0} ns, ratio {}. Hooked with token turnover (a competing group) {:.0} ns.\n",
            lo.pairs,
            lo.hooked_ns,
            lo.native_ns,
            lo.ratio.median,
            lo.ratio.min,
            lo.ratio.max,
            spread(&lo.control_ratio, 3),
            lo.separate_processes.native_ns,
            lo.separate_processes.hooked_ns,
            spread(&lo.separate_processes.ratio, 3),
            lo.hooked_turnover_ns
        );
    }
    for sc in &r.scenarios {
        scenario(&mut o, sc);
    }
    for e in &r.errors {
        let _ = writeln!(o, "\n**FAILED** {}: {}", e.name, e.error);
    }
    o
}

fn scenario(o: &mut String, sc: &ScenarioReport) {
    let _ = writeln!(
        o,
        "\n## {}\n\n{}\n\n| tenant | workload | gpu | request | limit | weight | target | achieved | abs err | max window err | native achieved | kernels/s | native kernels/s | alone kernels/s | vs alone | latency p50/p90/p99/p99.9 ms (gpushare · native · alone) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        sc.name, sc.description
    );
    for t in &sc.tenants {
        let lat = if t.latency.is_some() {
            // The tail against the same tenant alone: the figure a latency class is judged by.
            let p99_vs_alone = match (t.latency, t.alone_latency) {
                (Some(l), Some(a)) if a.p99_ms > 0.0 => {
                    format!("; p99 {:.2}× alone", l.p99_ms.median / a.p99_ms)
                }
                _ => String::new(),
            };
            format!(
                "{} · {} · {}{p99_vs_alone}",
                latency(t.latency.as_ref()),
                latency(t.baseline_latency.as_ref()),
                t.alone_latency.map_or_else(
                    || "–".into(),
                    |l| format!(
                        "{:.1}/{:.1}/{:.1}/{:.1}",
                        l.p50_ms, l.p90_ms, l.p99_ms, l.p999_ms
                    )
                )
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            o,
            "| {} | {:?} | {} | {:.2} | {:.2} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            t.name,
            t.workload,
            t.gpu,
            t.request,
            t.limit,
            t.weight,
            spread(&t.target_share, 3),
            spread(&t.achieved_share, 3),
            spread(&t.abs_error, 3),
            spread(&t.max_window_error, 3),
            opt(t.baseline_achieved_share.as_ref(), 3),
            opt(t.throughput_kps.as_ref(), 0),
            opt(t.baseline_throughput_kps.as_ref(), 0),
            num(t.alone_kernels_per_s, 0),
            opt(t.throughput_vs_alone.as_ref(), 3),
            lat
        );
    }
    for run in &sc.runs {
        if let Some(c) = &run.device_trace_check {
            let _ = writeln!(
                o,
                "\nRun {}: the simulated device's trace of the same run gives shares {}, max abs err {:.3}, utilisation {:.3}, handoff p99 {:.0} µs.",
                run.run,
                c.achieved_shares
                    .iter()
                    .map(|x| format!("{x:.3}"))
                    .collect::<Vec<_>>()
                    .join(" / "),
                c.summary.max_abs_error,
                c.summary.device_utilization,
                c.summary.handoff_p99_us
            );
        }
    }
    let stalls: Vec<String> = sc
        .runs
        .iter()
        .filter_map(|r| {
            let n = r.noise.as_ref()?;
            Some(format!(
                "run {}: {}",
                r.run,
                n.stalls
                    .iter()
                    .map(|p| format!("{} {} ({:.0} ms)", p.process, p.stalls, p.stopped_ms))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
        .collect();
    if !stalls.is_empty() {
        let _ = writeln!(
            o,
            "\nStalls per process (time stopped): {}.",
            stalls.join("; ")
        );
    }
    if let Some(f) = &sc.flood {
        let c = &f.connections;
        let _ = writeln!(
            o,
            "\nUnder a connection flood in every run with gpushare ({} idle connections that said Hello, {} junk connections renewed every {} ms, {} stalled mid-frame after their Hello, {} mid-Hello): scheduler threads at most {}; `gpushare status` {} ms at most, {} ms median per run; {} status call(s) failed.",
            c.idle,
            c.junk,
            c.junk_renew_ms,
            c.stalled_after_hello,
            c.mid_hello,
            spread(&f.threads_max, 0),
            spread(&f.status_max_ms, 1),
            spread(&f.status_median_ms, 1),
            f.status_failures
        );
    }
    if let Some(f) = &sc.fault {
        let what = match f.fault.kind {
            FaultKind::Stop => format!(
                "The scheduler stopped (`SIGSTOP`) for {} ms, {} ms into every run with gpushare",
                f.fault.for_ms, f.fault.at_ms
            ),
            FaultKind::Kill => format!(
                "The scheduler killed (`kill -9`) {} ms into every run with gpushare and started again {} ms later",
                f.fault.at_ms, f.fault.for_ms
            ),
            FaultKind::StarveRequest => "The scheduler starved of CPU for every run with gpushare: a cpu cgroup with a 50m request's weight beside a CPU hog per core".to_string(),
            FaultKind::StarveQuota => "The scheduler under a hard 50m CPU quota (5 ms per 100 ms) for every run with gpushare, beside a CPU hog per core".to_string(),
            FaultKind::ReplaceSocket => format!(
                "The scheduler's socket removed (its directory replaced) {} ms into every run with gpushare, the window lasting until every tenant was listed through the path again",
                f.fault.at_ms
            ),
            FaultKind::JournalFull => format!(
                "The scheduler's memory journal on a full file system from {} ms into every run with gpushare for {} ms, while a third process (fail-open) allocated 256 MiB",
                f.fault.at_ms, f.fault.for_ms
            ),
        };
        let _ = write!(
            o,
            "\n{what}: GPU busy {} of the fault's window; no tenant without a kernel for longer than {} ms",
            spread(&f.gpu_busy, 4),
            spread(&f.longest_blocked_ms, 1),
        );
        if let Some(d) = &f.drift_after {
            let _ = write!(
                o,
                "; largest share error from 1 s after it {}",
                spread(d, 4)
            );
        }
        if let Some(b) = &f.back_ms {
            let back = match f.fault.kind {
                FaultKind::ReplaceSocket => "listed through the path again",
                _ => "on the new scheduler",
            };
            let since = match f.fault.kind {
                FaultKind::ReplaceSocket => "the socket's removal",
                _ => "its start",
            };
            let _ = write!(o, "; every tenant {back} {} ms after {since}", spread(b, 1));
        }
        if let Some(t) = &f.throttled {
            let _ = write!(o, "; throttled in {} of its periods", spread(t, 3));
        }
        if let Some(j) = &f.journal {
            let _ = write!(
                o,
                "; the allocation succeeded in {} of {} runs, the process said it was not journaled in {}, the scheduler logged its failing journal in {}",
                j.allocated, j.runs, j.hook_said, j.scheduler_said
            );
        }
        let _ = writeln!(o, ".");
    }
    if let Some(l) = &sc.event_loop {
        let _ = writeln!(
            o,
            "\nThe scheduler's event loop (`gpushare_event_loop_lateness_seconds`, per run, bucket bounds): late by {} ms (median), {} ms (99 %), {} ms (worst).",
            spread(&l.p50_ms, 3),
            spread(&l.p99_ms, 3),
            spread(&l.max_ms, 3),
        );
    }
    let _ = writeln!(o, "\n![{}]({})", sc.name, sc.plot);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_reads_median_then_range() {
        let s = Spread {
            min: 0.0101,
            median: 0.012,
            max: 0.0204,
        };
        assert_eq!(spread(&s, 3), "0.012 [0.010–0.020]");
        let same = Spread {
            min: 25.0,
            median: 25.0,
            max: 25.04,
        };
        assert_eq!(spread(&same, 0), "25");
    }
}
