//! Tenants alone: each distinct workload run by itself under gpushare, for its throughput and
//! latency without contention.

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
        let label = format!("alone/{key}");
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
        let v = run::run(&spec, s)?.outputs.swap_remove(0);
        self.0.insert(key, v.clone());
        Ok(v)
    }
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
}
