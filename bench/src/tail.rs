//! The latency tail table (`gpushare-bench tail`): a request server's per-request latency
//! percentiles in the latency class beside training loops, against the same server natively
//! (the device's own time-slicing, no hook) and alone under gpushare, over request rates and
//! kernel sizes, and for two servers beside two trainers. Every figure is the median over
//! `--repeat` runs (the alone baseline too), with the p99's range.

use crate::progress;
use crate::report::{Latency, Spread, round};
use crate::run::{self, Mode, RunSpec};
use crate::scenario::{Scenario, Workload};
use crate::settings::Settings;
use anyhow::Context;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// Kernels per request.
const KERNELS: u64 = 4;

/// One line of the table: `servers` request servers (Poisson, `rate_hz` each, [`KERNELS`]
/// kernels of `kernel_ms`) in the latency class beside `trainers` training loops of kernels of
/// the same size, all with equal requests.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Case {
    pub rate_hz: f64,
    pub kernel_ms: f64,
    pub servers: u32,
    pub trainers: u32,
}

/// The cases: 10, 40 and 100 requests/s of 0.1 ms and of 1 ms kernels, 5, 10 and 20/s of 5 ms
/// kernels (at 100/s they would ask for twice the GPU), and two servers of 40/s × 1 ms beside two
/// trainers.
pub fn cases() -> Vec<Case> {
    let one = |rate_hz, kernel_ms| Case {
        rate_hz,
        kernel_ms,
        servers: 1,
        trainers: 1,
    };
    let mut v = Vec::new();
    for kernel_ms in [0.1, 1.0] {
        v.extend([10.0, 40.0, 100.0].map(|r| one(r, kernel_ms)));
    }
    v.extend([5.0, 10.0, 20.0].map(|r| one(r, 5.0)));
    v.push(Case {
        servers: 2,
        trainers: 2,
        ..one(40.0, 1.0)
    });
    v
}

impl Case {
    pub fn name(&self) -> String {
        format!(
            "tail-{}x{}hz-{}ms-{}train",
            self.servers, self.rate_hz, self.kernel_ms, self.trainers
        )
    }

    /// The scenario (`duration` as a scenario file writes it).
    fn scenario(&self, duration: &str) -> anyhow::Result<Scenario> {
        let request = 1.0 / (self.servers + self.trainers) as f64;
        let mut text = format!("name = \"{}\"\nduration = \"{duration}\"\n", self.name());
        for (name, count) in [("server", self.servers), ("train", self.trainers)] {
            let _ = write!(
                text,
                "[[tenant]]\nname = \"{name}\"\ncount = {count}\nrequest = {request}\n\
                 kernel_ms = {}\n",
                self.kernel_ms
            );
            if name == "server" {
                let _ = write!(
                    text,
                    "workload = \"latency\"\nclass = \"latency\"\nrate_hz = {}\nkernels = {KERNELS}\n",
                    self.rate_hz
                );
            } else {
                text.push_str("workload = \"train\"\n");
            }
        }
        Scenario::parse(&text).with_context(|| format!("tail case {self:?}"))
    }
}

/// Request latency percentiles over runs (and servers): medians, and each percentile's range.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Tail {
    pub p50_ms: Spread,
    pub p90_ms: Spread,
    pub p99_ms: Spread,
    pub p999_ms: Spread,
    /// Requests per run and server (median).
    pub requests: f64,
}

impl Tail {
    fn of(runs: &[Latency]) -> Option<Tail> {
        let s = |f: fn(&Latency) -> f64| Spread::of(runs.iter().map(f), 2);
        Some(Tail {
            p50_ms: s(|l| l.p50_ms)?,
            p90_ms: s(|l| l.p90_ms)?,
            p99_ms: s(|l| l.p99_ms)?,
            p999_ms: s(|l| l.p999_ms)?,
            requests: Spread::of(runs.iter().map(|l| l.requests as f64), 0)?.median,
        })
    }
}

/// One case's figures.
#[derive(Debug, Clone, Serialize)]
pub struct CaseReport {
    pub case: Case,
    /// In the latency class under gpushare, beside the trainers.
    pub gpushare: Option<Tail>,
    /// The same tenants without gpushare.
    pub native: Option<Tail>,
    /// One server alone under gpushare.
    pub alone: Option<Tail>,
    /// Median p99 with gpushare over median p99 alone.
    pub p99_vs_alone: Option<f64>,
    /// The trainers' busy share of the GPU with gpushare against their target (medians over
    /// runs of the mean over trainers).
    pub trainer_share: Option<Spread>,
    pub trainer_target: Option<f64>,
    /// Busy fraction of the GPU with gpushare.
    pub utilisation: Option<Spread>,
}

/// The whole table.
#[derive(Debug, Clone, Serialize)]
pub struct TailReport {
    pub repeat: u32,
    pub duration_s: f64,
    pub gpu: String,
    pub cases: Vec<CaseReport>,
}

/// Run every case `s.repeat` times with gpushare, natively and alone; write `tail.json` and
/// `tail.md` into `out`.
pub fn bench(out: &Path, s: &Settings) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;
    let duration = if s.quick { "3s" } else { "6s" };
    let mut reports = Vec::new();
    for case in cases() {
        let sc = case.scenario(duration)?;
        reports.push(measure(&sc, case, s)?);
    }
    let report = TailReport {
        repeat: s.repeat,
        duration_s: sc_seconds(duration),
        gpu: s.gpu(),
        cases: reports,
    };
    std::fs::write(
        out.join("tail.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    let md = markdown(&report);
    std::fs::write(out.join("tail.md"), &md)?;
    println!("{md}");
    Ok(())
}

fn sc_seconds(duration: &str) -> f64 {
    gpushare_units::parse_duration_ns(duration).unwrap_or(0) as f64 / 1e9
}

fn measure(sc: &Scenario, case: Case, s: &Settings) -> anyhow::Result<CaseReport> {
    let all: Vec<usize> = (0..sc.tenants.len()).collect();
    let servers: Vec<usize> = all
        .iter()
        .copied()
        .filter(|&i| sc.tenants[i].workload == Workload::Latency)
        .collect();
    let trainers: Vec<usize> = all
        .iter()
        .copied()
        .filter(|&i| !servers.contains(&i))
        .collect();
    let duration_ns = s.duration_ns(sc);
    let lat = |mode: Mode, which: &[usize], what: &str| -> anyhow::Result<_> {
        let mut latencies = Vec::new();
        let mut shares = Vec::new();
        let mut busy = Vec::new();
        for k in 1..=s.repeat {
            progress(format!("{}: {what} run {k}/{}", sc.name, s.repeat));
            let label = format!("{}/{what}/{k}", sc.name);
            let spec = RunSpec {
                sc,
                which,
                mode,
                duration_ns,
                keep_trace: None,
                label: &label,
                flood: None,
                fault: None,
            };
            let o = run::run(&spec, s)?;
            for (pos, &i) in which.iter().enumerate() {
                if servers.contains(&i)
                    && let Some(l) = o.outputs[pos].as_ref().and_then(|r| r.latency())
                {
                    latencies.push(l);
                }
            }
            let f = &o.figures;
            let t: Vec<usize> = (0..which.len())
                .filter(|&pos| trainers.contains(&which[pos]))
                .collect();
            if !t.is_empty() && f.achieved.len() == which.len() {
                let mean = |v: &[f64]| t.iter().map(|&p| v[p]).sum::<f64>() / t.len() as f64;
                shares.push((mean(&f.achieved), mean(&f.target)));
            }
            busy.push(f.summary.device_utilization);
        }
        Ok((Tail::of(&latencies), shares, busy))
    };
    let (gpushare, shares, busy) = lat(Mode::Gpushare, &all, "gpushare")?;
    let native = if s.baseline {
        lat(Mode::Native, &all, "native")?.0
    } else {
        None
    };
    let alone = if s.alone {
        lat(Mode::Gpushare, &servers[..1], "alone")?.0
    } else {
        None
    };
    let p99_vs_alone = gpushare
        .zip(alone)
        .filter(|(_, a)| a.p99_ms.median > 0.0)
        .map(|(g, a)| round(g.p99_ms.median / a.p99_ms.median, 2));
    Ok(CaseReport {
        case,
        gpushare,
        native,
        alone,
        p99_vs_alone,
        trainer_share: Spread::of(shares.iter().map(|s| s.0), 3),
        trainer_target: Spread::of(shares.iter().map(|s| s.1), 3).map(|t| t.median),
        utilisation: Spread::of(busy, 3),
    })
}

/// The table in Markdown: one line per case and mode.
pub fn markdown(r: &TailReport) -> String {
    let mut md = format!(
        "Request latency (ms) of the latency-class server(s), p50 / p90 / p99 / p99.9, medians \
         over {} runs of {} s each (p99 range in brackets), on the {} GPU.\n\n\
         | servers × rate | kernel | trainers | mode | p50 | p90 | p99 [range] | p99.9 | requests/run | p99 vs alone | trainer share (target) | utilisation |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        r.repeat, r.duration_s, r.gpu
    );
    for c in &r.cases {
        let k = c.case;
        for (mode, tail) in [
            ("gpushare", c.gpushare),
            ("native", c.native),
            ("alone", c.alone),
        ] {
            let Some(t) = tail else { continue };
            let gpushare = mode == "gpushare";
            let _ = writeln!(
                md,
                "| {} × {}/s | {} ms | {} | {mode} | {} | {} | {} [{}–{}] | {} | {} | {} | {} | {} |",
                k.servers,
                k.rate_hz,
                k.kernel_ms,
                k.trainers,
                t.p50_ms.median,
                t.p90_ms.median,
                t.p99_ms.median,
                t.p99_ms.min,
                t.p99_ms.max,
                t.p999_ms.median,
                t.requests,
                c.p99_vs_alone
                    .filter(|_| gpushare)
                    .map_or(String::new(), |x| format!("{x}×")),
                match (c.trainer_share, c.trainer_target) {
                    (Some(s), Some(t)) if gpushare =>
                        format!("{} [{}–{}] ({t})", s.median, s.min, s.max),
                    _ => String::new(),
                },
                c.utilisation
                    .filter(|_| gpushare)
                    .map_or(String::new(), |u| format!("{}", u.median)),
            );
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every case is a valid scenario whose servers stay within their share of the GPU, and the
    /// table covers the rates, kernel sizes and the two-by-two mix.
    #[test]
    fn the_cases_are_valid_scenarios_within_the_servers_share() {
        let cases = cases();
        for c in &cases {
            let sc = c.scenario("3s").expect("a valid scenario");
            assert_eq!(sc.tenants.len() as u32, c.servers + c.trainers);
            let server = sc
                .tenants
                .iter()
                .find(|t| t.workload == Workload::Latency)
                .expect("a server");
            assert!(
                server.demand() <= server.request + 1e-9,
                "{c:?}: demand {} over its request {}",
                server.demand(),
                server.request
            );
        }
        for kernel_ms in [0.1, 1.0, 5.0] {
            assert_eq!(
                cases.iter().filter(|c| c.kernel_ms == kernel_ms).count(),
                3 + usize::from(kernel_ms == 1.0)
            );
        }
        assert!(cases.iter().any(|c| c.servers == 2 && c.trainers == 2));
    }
}
