//! `gpushare-extender replay`: the placement policies on the seed's experiment and on
//! Alibaba's GPU-sharing trace, in virtual time, deterministic per seed; medians over seeds.

pub mod sim;
pub mod workload;

use crate::policy::Policy;
pub use sim::Outcome;
pub use workload::Workload;

#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    #[arg(long, value_enum)]
    pub workload: Workload,
    /// Memory requests over-provisioned by PCT percent (`seed002`).
    #[arg(long, value_name = "PCT", default_value_t = 0)]
    pub overprov: u32,
    #[arg(long, value_enum)]
    pub policy: Policy,
    /// Seeds 0..N, the same draws for every policy.
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub seeds: u64,
    /// `seed002`'s cluster: NODESxGPUS (the seed's testbed is 1x1; 4x2 runs the same pattern
    /// on 4 nodes of 2 GPUs, 30 engines per GPU).
    #[arg(long, value_name = "NODESxGPUS", default_value = "1x1", value_parser = cluster)]
    pub cluster: (usize, usize),
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn cluster(s: &str) -> Result<(usize, usize), String> {
    let (n, g) = s
        .split_once('x')
        .ok_or_else(|| format!("{s:?}: write NODESxGPUS, e.g. 4x2"))?;
    let parse = |v: &str| {
        v.parse::<usize>()
            .ok()
            .filter(|&x| (1..=64).contains(&x))
            .ok_or_else(|| format!("{v:?} in {s:?}: a count from 1 to 64"))
    };
    Ok((parse(n)?, parse(g)?))
}

/// One run: `workload` under `policy` for seed `seed`.
pub fn run_seed(a: &ReplayArgs, seed: u64) -> Outcome {
    let spec = workload::build(a.workload, seed, a.overprov, a.cluster);
    sim::Sim::new(&spec, a.policy, seed).run()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Each figure's median over seeds 0..N, and its mean, smallest and largest value over them.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    #[serde(flatten)]
    pub median: Outcome,
    pub mean: Outcome,
    pub min: Outcome,
    pub max: Outcome,
}

/// Seeds 0..`a.seeds` of `a`, summarised.
pub fn run(a: &ReplayArgs) -> Summary {
    let runs: Vec<Outcome> = (0..a.seeds).map(|s| run_seed(a, s)).collect();
    let each = |pick: fn(Vec<f64>) -> f64| {
        let m = |f: fn(&Outcome) -> f64| pick(runs.iter().map(f).collect());
        Outcome {
            pending_mean_s: m(|o| o.pending_mean_s),
            pending_p99_s: m(|o| o.pending_p99_s),
            jct_p99_s: m(|o| o.jct_p99_s),
            memory_used_frac: m(|o| o.memory_used_frac),
            gpu_busy_frac: m(|o| o.gpu_busy_frac),
            oom: m(|o| o.oom),
            unallocated_gpus_peak: m(|o| o.unallocated_gpus_peak),
        }
    };
    Summary {
        median: each(median),
        mean: each(|v| v.iter().sum::<f64>() / v.len() as f64),
        min: each(|v| v.into_iter().fold(f64::INFINITY, f64::min)),
        max: each(|v| v.into_iter().fold(f64::NEG_INFINITY, f64::max)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(policy: Policy, overprov: u32) -> ReplayArgs {
        ReplayArgs {
            workload: Workload::Seed002,
            overprov,
            policy,
            seeds: 1,
            cluster: (1, 1),
            json: true,
        }
    }

    #[test]
    fn a_seed_replays_identically() {
        for p in [Policy::Predicted, Policy::Seed] {
            assert_eq!(run_seed(&args(p, 100), 7), run_seed(&args(p, 100), 7));
        }
    }

    #[test]
    fn the_oracle_never_fails_and_requests_without_over_provisioning_equal_it() {
        // Every engine peaks at exactly its unprovisioned request.
        let o = run_seed(&args(Policy::Oracle, 0), 1);
        let r = run_seed(&args(Policy::Requests, 0), 1);
        assert_eq!(o, r);
        assert_eq!(o.oom, 0.0);
        for p in [Policy::Oracle, Policy::Requests, Policy::WholeGpu] {
            assert_eq!(run_seed(&args(p, 250), 1).oom, 0.0, "{p:?}");
        }
    }

    #[test]
    fn over_provisioned_requests_wait_longer_than_the_oracle() {
        let o = run_seed(&args(Policy::Oracle, 250), 2);
        let r = run_seed(&args(Policy::Requests, 250), 2);
        let w = run_seed(&args(Policy::WholeGpu, 250), 2);
        assert!(r.pending_mean_s > o.pending_mean_s, "{r:?} {o:?}");
        assert!(w.pending_mean_s >= r.pending_mean_s, "{w:?} {r:?}");
        assert!(o.memory_used_frac > r.memory_used_frac);
    }

    #[test]
    fn the_cluster_flag_reads_nodes_by_gpus() {
        assert_eq!(cluster("4x2"), Ok((4, 2)));
        assert!(cluster("4").is_err());
        assert!(cluster("0x2").is_err());
    }
}
