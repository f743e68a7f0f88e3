//! Tenants alone: each distinct workload run by itself under gpushare, `--repeat` times, for
//! its throughput and latency without contention (medians over the runs).

use crate::client::ClientResult;
use crate::progress;
use crate::run::{self, Mode, RunSpec};
use crate::scenario::{Scenario, TenantSpec};
use crate::settings::Settings;
use std::collections::HashMap;

/// Results of tenants run alone, keyed by what determines the run: a workload shared by several
/// tenants or scenarios runs alone only once.
#[derive(Default)]
pub struct AloneCache(HashMap<String, Option<ClientResult>>);

/// What determines a tenant's run alone: its workload arguments (on GPU 0, seed 1) and its
/// limit (alone, its request and weight do not matter: it gets min(limit, demand)).
fn key(t: &TenantSpec, duration_ns: u64) -> String {
    let solo = TenantSpec {
        gpu: 0,
        ..t.clone()
    };
    format!(
        "{}|limit={}",
        solo.client_args(duration_ns as f64 / 1e6, 1).join(" "),
        t.limit
    )
}

impl AloneCache {
    /// Tenant `i` of `sc` alone under gpushare (same workload, same duration; once per key).
    pub fn run(
        &mut self,
        sc: &Scenario,
        i: usize,
        duration_ns: u64,
        s: &Settings,
    ) -> anyhow::Result<Option<ClientResult>> {
        let key = key(&sc.tenants[i], duration_ns);
        if let Some(v) = self.0.get(&key) {
            return Ok(v.clone());
        }
        let t = &sc.tenants[i];
        progress(format!(
            "{}: tenant {} ({:?}) alone",
            sc.name, t.name, t.workload
        ));
        let solo = Scenario {
            gpus: 1,
            tenants: vec![TenantSpec {
                gpu: 0,
                ..t.clone()
            }],
            ..sc.clone()
        };
        let mut runs = Vec::new();
        for k in 1..=s.repeat {
            let label = format!("alone/{key}/{k}");
            let spec = RunSpec {
                sc: &solo,
                which: &[0],
                mode: Mode::Gpushare,
                duration_ns,
                keep_trace: None,
                label: &label,
                flood: None,
                fault: None,
            };
            runs.extend(run::run(&spec, s)?.outputs.swap_remove(0));
        }
        let v = median(runs);
        self.0.insert(key, v.clone());
        Ok(v)
    }
}

/// The run of median throughput, with each latency percentile the median over the runs (one
/// run alone moves a server's p99 by a factor of two on a loaded host).
fn median(mut runs: Vec<ClientResult>) -> Option<ClientResult> {
    let mid = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let p = |f: fn(&ClientResult) -> Option<f64>, runs: &[ClientResult]| {
        mid(runs.iter().filter_map(f).collect())
    };
    let (p50, p90, p99, p999) = (
        p(|r| r.latency_p50_ms, &runs),
        p(|r| r.latency_p90_ms, &runs),
        p(|r| r.latency_p99_ms, &runs),
        p(|r| r.latency_p999_ms, &runs),
    );
    runs.sort_by(|a, b| {
        a.throughput()
            .unwrap_or(0.0)
            .total_cmp(&b.throughput().unwrap_or(0.0))
    });
    let i = runs.len() / 2;
    let mut v = (i < runs.len()).then(|| runs.swap_remove(i))?;
    (
        v.latency_p50_ms,
        v.latency_p90_ms,
        v.latency_p99_ms,
        v.latency_p999_ms,
    ) = (p50, p90, p99, p999);
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_workload_on_another_gpu_or_with_another_request_is_the_same_run_alone() {
        let sc = Scenario::parse(
            r#"
name = "k"
duration = "1s"
gpus = 2
[[tenant]]
name = "a"
workload = "train"
request = 0.5
[[tenant]]
name = "b"
workload = "train"
gpu = 1
request = 0.2
[[tenant]]
name = "c"
workload = "train"
limit = 0.3
"#,
        )
        .unwrap();
        let k = |i: usize| key(&sc.tenants[i], 1_000_000_000);
        assert_eq!(k(0), k(1));
        assert_ne!(k(0), k(2));
    }

    /// Alone, each latency percentile is the median over the runs, the rest the run of median
    /// throughput.
    #[test]
    fn alone_is_the_median_of_its_runs() {
        let run = |kernels: u64, p99: f64| ClientResult {
            kernels: Some(kernels),
            wall_ms: Some(1000.0),
            latency_p99_ms: Some(p99),
            ..ClientResult::default()
        };
        let m = median(vec![run(300, 9.0), run(100, 20.0), run(200, 10.0)]).unwrap();
        assert_eq!(m.kernels, Some(200));
        assert_eq!(m.latency_p99_ms, Some(10.0));
        assert_eq!(m.latency_p50_ms, None);
        assert_eq!(median(Vec::new()), None);
    }
}
