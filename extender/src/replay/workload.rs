//! The replay's workloads, built per seed from the data files in `extender/data/` (their
//! provenance and derivation: `extender/data/README.md`).
//!
//! - `seed002`: the seed's experiment. Per GPU, 30 MLPerf ssd-mobilenet inference engines,
//!   the k-th created after k draws of U{20..40} s; each asks for its measured 6994 MiB
//!   over-provisioned by `--overprov` percent (at most the V100's 32510 MiB, as the seed's
//!   generator caps it) and 10 units (the engines kept the GPU 3–10 % busy); its memory use
//!   and utilisation are those of one of the 179 engines measured alone on the seed's V100,
//!   drawn at random, after 4 s of container start; engines sharing a GPU run slower (see
//!   [`SLOWDOWN_PER_NEIGHBOUR`]).
//! - `openb-*`: the pods of Alibaba's `cluster-trace-gpu-v2023` on its GPU nodes, as its
//!   simulator replays them: submitted in the file's order (one a second here) into an empty
//!   cluster, none leaving, so the cluster fills to its peak; pods asking no GPU take CPU and
//!   memory only. A pod's memory cap is its units'
//!   share of the GPU's memory (gpushare's default); its use, an assumption the trace cannot
//!   give, follows a measured engine's shape scaled to a peak of U(0.2, 1) of its cap.

use crate::replay::sim::{Cap, JobSpec, NodeSpec, Spec};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::sync::{Arc, OnceLock};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    #[value(name = "seed002")]
    Seed002,
    #[value(name = "openb-default")]
    OpenbDefault,
    #[value(name = "openb-gpushare40")]
    OpenbGpushare40,
    #[value(name = "openb-gpushare80")]
    OpenbGpushare80,
}

impl Workload {
    /// The name `--workload` takes.
    pub fn to_possible_value_name(self) -> String {
        clap::ValueEnum::to_possible_value(&self)
            .map_or(String::new(), |v| v.get_name().to_string())
    }
}

/// The seed's V100 (MiB, as its scheduler counts it).
pub const V100_MIB: u64 = 32_510;
/// What one engine uses once loaded, and asks for without over-provisioning (MiB).
pub const ENGINE_MIB: u64 = 6_994;
/// Units each engine asks for.
pub const ENGINE_UNITS: u32 = 10;
/// Container start before an engine touches the GPU (the seed's pods: 4 s from pod start to
/// container start).
pub const STARTUP_S: usize = 4;
/// Engines sharing a GPU progress at 1 / (1 + this × neighbours): the seed's four engines per
/// GPU (requests at 0 %, Alibaba's extender) ran 158.9 s on average against 131.5 s alone.
pub const SLOWDOWN_PER_NEIGHBOUR: f64 = 0.07;
/// How long an openb replay runs on after the last submission (settling, seed's pauses).
pub const OPENB_TAIL_S: u64 = 600;

/// One engine measured alone: MiB per second, and its mean GPU utilisation (0..1).
#[derive(Debug)]
pub struct Engine {
    pub mib: Vec<u32>,
    pub util: f64,
}

/// The engines of `seed-engines.csv`.
pub fn engines() -> &'static [Engine] {
    static E: OnceLock<Vec<Engine>> = OnceLock::new();
    E.get_or_init(|| {
        let mut out: Vec<Engine> = Vec::new();
        for line in include_str!("../../data/seed-engines.csv").lines().skip(1) {
            let f: Vec<&str> = line.split(',').collect();
            let (id, secs, mib, util): (usize, usize, u32, f64) = (
                f[0].parse().expect("engine"),
                f[1].parse().expect("seconds"),
                f[2].parse().expect("mib"),
                f[3].parse().expect("util"),
            );
            if id == out.len() {
                out.push(Engine {
                    mib: vec![0; STARTUP_S],
                    util: util / 100.0,
                });
            }
            out[id].mib.extend(std::iter::repeat_n(mib, secs));
        }
        out
    })
}

fn csv_rows(text: &str) -> impl Iterator<Item = Vec<&str>> {
    text.lines().skip(1).map(|l| l.split(',').collect())
}

/// GPU memory (MiB) of an openb GPU model; G1–G3 are undisclosed: taken as 32 GiB.
fn model_memory(model: &str) -> u64 {
    match model {
        "P100" | "T4" | "V100M16" => 16 << 10,
        "A10" => 24 << 10,
        _ => 32 << 10,
    }
}

fn openb_nodes() -> Vec<NodeSpec> {
    csv_rows(include_str!("../../data/openb-nodes.csv"))
        .map(|f| NodeSpec {
            cpu: f[0].parse().expect("cpu"),
            mem: f[1].parse().expect("memory"),
            gpus: f[2].parse().expect("gpus"),
            gpu_memory: model_memory(f[3]),
        })
        .collect()
}

fn openb_pods(w: Workload) -> &'static str {
    match w {
        Workload::OpenbDefault => include_str!("../../data/openb-default.csv"),
        Workload::OpenbGpushare40 => include_str!("../../data/openb-gpushare40.csv"),
        _ => include_str!("../../data/openb-gpushare80.csv"),
    }
}

/// The workload `w` as seed `seed` draws it; `cluster` (nodes, GPUs per node) for `seed002`.
pub fn build(w: Workload, seed: u64, overprov_pct: u32, cluster: (usize, usize)) -> Spec {
    match w {
        Workload::Seed002 => {
            let mut rng = StdRng::seed_from_u64(seed);
            let engines = engines();
            let (nodes, gpus) = cluster;
            let request = (ENGINE_MIB as f64 * (1.0 + f64::from(overprov_pct) / 100.0)) as u64;
            let request = request.min(V100_MIB);
            let mut jobs = Vec::new();
            for _ in 0..nodes * gpus {
                let mut t = 0u64;
                for _ in 0..30 {
                    let e = &engines[rng.random_range(0..engines.len())];
                    jobs.push(JobSpec {
                        arrival: t,
                        cpu: 0,
                        mem: 0,
                        whole: 0,
                        units: ENGINE_UNITS,
                        cap: Cap::Fixed(request),
                        shape: Arc::new(e.mib.clone()),
                        peak_of_cap: None,
                        util: e.util,
                        held: None,
                        kind: Some(0),
                    });
                    t += rng.random_range(20..=40u64);
                }
            }
            jobs.sort_by_key(|j| j.arrival);
            Spec {
                nodes: (0..nodes)
                    .map(|_| NodeSpec {
                        cpu: 0,
                        mem: 0,
                        gpus,
                        gpu_memory: V100_MIB,
                    })
                    .collect(),
                jobs,
                slowdown: SLOWDOWN_PER_NEIGHBOUR,
                end: None,
            }
        }
        _ => openb(w, seed, 1),
    }
}

/// `w`'s pods on Alibaba's GPU nodes, keeping every `every`-th node and pod (1: the whole
/// trace; more: a smaller cluster filled the same way, for tests), submitted one a second.
pub(crate) fn openb(w: Workload, seed: u64, every: usize) -> Spec {
    let mut rng = StdRng::seed_from_u64(seed);
    let engines = engines();
    let mut jobs = Vec::new();
    for f in csv_rows(openb_pods(w)).step_by(every) {
        let (cpu, mem, gpus, milli, held): (u64, u64, u32, u32, u64) = (
            f[0].parse().expect("cpu"),
            f[1].parse().expect("memory"),
            f[2].parse().expect("gpus"),
            f[3].parse().expect("gpu milli"),
            f[4].parse().expect("held"),
        );
        let e = &engines[rng.random_range(0..engines.len())];
        let peak = 0.2 + 0.8 * rng.random::<f64>();
        let shared = gpus == 1 && milli < 1000;
        let units = if gpus == 0 {
            0
        } else if shared {
            milli.div_ceil(10).max(1)
        } else {
            100
        };
        jobs.push(JobSpec {
            arrival: jobs.len() as u64,
            cpu,
            mem,
            whole: if shared { 0 } else { gpus },
            units,
            cap: Cap::OfGpu(units),
            shape: Arc::new(e.mib.clone()),
            peak_of_cap: Some(peak),
            util: f64::from(units) / 100.0,
            held: Some(held),
            kind: None,
        });
    }
    let end = jobs.len() as u64 + OPENB_TAIL_S;
    Spec {
        nodes: openb_nodes().into_iter().step_by(every).collect(),
        jobs,
        slowdown: 0.0,
        end: Some(end),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_files_hold_what_the_replay_assumes() {
        let e = engines();
        assert_eq!(e.len(), 179);
        assert!(
            e.iter()
                .all(|e| e.mib.iter().max() == Some(&(ENGINE_MIB as u32)))
        );
        assert!(e.iter().all(|e| (100..=170).contains(&e.mib.len())));
        let nodes = openb_nodes();
        assert_eq!(nodes.len(), 1213);
        assert_eq!(nodes.iter().map(|n| n.gpus).sum::<usize>(), 6212);
        for w in [
            Workload::OpenbDefault,
            Workload::OpenbGpushare40,
            Workload::OpenbGpushare80,
        ] {
            let s = build(w, 0, 0, (1, 1));
            assert_eq!(s.jobs.len(), 8152);
            assert!(s.jobs.iter().all(|j| j.units <= 100));
            let cpu_only = s.jobs.iter().filter(|j| !j.asks_gpu()).count();
            assert_eq!(cpu_only, 1088, "pods asking no GPU");
        }
    }

    #[test]
    fn seed002_is_the_seeds_arrival_pattern_and_requests() {
        let s = build(Workload::Seed002, 3, 250, (1, 1));
        assert_eq!(s.jobs.len(), 30);
        assert_eq!(s.jobs[0].arrival, 0);
        for w in s.jobs.windows(2) {
            assert!((20..=40).contains(&(w[1].arrival - w[0].arrival)));
        }
        assert!(matches!(s.jobs[0].cap, Cap::Fixed(24_479)));
        let scaled = build(Workload::Seed002, 3, 0, (4, 2));
        assert_eq!(scaled.jobs.len(), 240);
        assert!(matches!(scaled.jobs[0].cap, Cap::Fixed(6_994)));
        assert_eq!(scaled.nodes.len(), 4);
    }
}
