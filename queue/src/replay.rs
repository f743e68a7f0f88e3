//! `gpushare-queue replay`: the short-task experiment of the aging paper in virtual time, run
//! through the daemon's own [`Core`].
//!
//! `jobs` jobs arrive as a Poisson process (exponential gaps of mean `mean_interarrival_s`),
//! each needing one whole GPU for a runtime with `log10(runtime)` uniform on `runtime_log10`,
//! and a timeout equal to its runtime. A job on a GPU shared with others progresses at the
//! share the scheduler would give it (its request, scaled when requests sum to more than 1,
//! plus spare time by weight: [`water_fill`]). Repeated over `seeds` random draws (seeds
//! `0..seeds`, the same draws for every policy); the figures are means over all jobs of all
//! draws: response = start − submission, finish = end − submission.

use crate::core::{Action, Core, Demand, Exit, Gpu, JobId, Policy, QueueConfig};
use gpushare_policy::{GroupParams, water_fill};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq)]
pub struct ReplayParams {
    pub policy: Policy,
    pub gpus: u32,
    pub jobs: u32,
    pub mean_interarrival_s: f64,
    /// `log10(runtime in seconds)` is uniform on `[a, b]`.
    pub runtime_log10: (f64, f64),
    pub seeds: u32,
    pub max_jobs_per_gpu: Option<u32>,
}

impl ReplayParams {
    /// The paper's experiment: 20 jobs, gaps of 25 s, runtimes 10–1000 s.
    pub fn paper(policy: Policy, gpus: u32, seeds: u32) -> ReplayParams {
        ReplayParams {
            policy,
            gpus,
            jobs: 20,
            mean_interarrival_s: 25.0,
            runtime_log10: (1.0, 3.0),
            seeds,
            max_jobs_per_gpu: None,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        let (a, b) = self.runtime_log10;
        if self.gpus == 0 || self.jobs == 0 || self.seeds == 0 {
            return Err("--gpus, --jobs and --seeds must be at least 1".into());
        }
        if !(self.mean_interarrival_s.is_finite() && self.mean_interarrival_s >= 0.0) {
            return Err("--mean-interarrival must be a duration >= 0".into());
        }
        if !(a.is_finite() && b.is_finite() && a <= b && b <= 9.0) {
            return Err(format!(
                "--runtime-log10 {a}:{b} must be A:B with A <= B <= 9 (e.g. 1:3 for 10 s to 1000 s)"
            ));
        }
        Ok(())
    }
}

/// Parse `A:B` (`--runtime-log10`).
pub fn parse_range(s: &str) -> Result<(f64, f64), String> {
    let err = || format!("{s:?} is not A:B with numbers A <= B (e.g. 1:3)");
    let (a, b) = s.split_once(':').ok_or_else(err)?;
    let (a, b): (f64, f64) = (
        a.trim().parse().map_err(|_| err())?,
        b.trim().parse().map_err(|_| err())?,
    );
    if !(a.is_finite() && b.is_finite()) || a > b {
        return Err(err());
    }
    Ok((a, b))
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SeedResult {
    pub seed: u32,
    pub mean_response_s: f64,
    pub mean_finish_s: f64,
    pub timed_out: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayResult {
    pub policy: String,
    pub gpus: u32,
    pub jobs: u32,
    pub seeds: u32,
    pub mean_response_s: f64,
    pub mean_finish_s: f64,
    /// Jobs killed at their timeout (none, when each gets what it was promised).
    pub timed_out: u32,
    pub per_seed: Vec<SeedResult>,
}

pub fn replay(p: &ReplayParams) -> ReplayResult {
    let per_seed: Vec<SeedResult> = (0..p.seeds).map(|s| run_seed(p, s)).collect();
    let n = per_seed.len().max(1) as f64;
    ReplayResult {
        policy: p.policy.to_string(),
        gpus: p.gpus,
        jobs: p.jobs,
        seeds: p.seeds,
        mean_response_s: per_seed.iter().map(|r| r.mean_response_s).sum::<f64>() / n,
        mean_finish_s: per_seed.iter().map(|r| r.mean_finish_s).sum::<f64>() / n,
        timed_out: per_seed.iter().map(|r| r.timed_out).sum(),
        per_seed,
    }
}

/// One job of the workload, in virtual nanoseconds.
struct Task {
    arrival: u64,
    runtime: u64,
    started: Option<u64>,
    ended: Option<u64>,
    /// Work left, ns of a whole GPU.
    left: f64,
    gpus: Vec<u32>,
    share: f64,
    limit: f64,
}

/// The draws of seed `seed`: arrival times and runtimes, ns.
pub fn workload(p: &ReplayParams, seed: u32) -> Vec<(u64, u64)> {
    let mut rng = StdRng::seed_from_u64(seed as u64);
    let mut t = 0.0f64;
    (0..p.jobs)
        .map(|_| {
            let u: f64 = rng.random();
            t += -p.mean_interarrival_s * (1.0 - u).ln();
            let (a, b) = p.runtime_log10;
            let e: f64 = a + (b - a) * rng.random::<f64>();
            ((t * 1e9) as u64, (10f64.powf(e) * 1e9) as u64)
        })
        .collect()
}

fn run_seed(p: &ReplayParams, seed: u32) -> SeedResult {
    let mut tasks: Vec<Task> = workload(p, seed)
        .into_iter()
        .map(|(arrival, runtime)| Task {
            arrival,
            runtime,
            started: None,
            ended: None,
            left: runtime as f64,
            gpus: Vec::new(),
            share: 1.0,
            limit: 1.0,
        })
        .collect();
    let mut core = Core::new(
        QueueConfig {
            policy: p.policy,
            max_jobs_per_gpu: p.max_jobs_per_gpu,
            ..QueueConfig::default()
        },
        vec![Gpu { memory: 80 << 30 }; p.gpus as usize],
    );
    let mut ids: BTreeMap<JobId, usize> = BTreeMap::new();
    let mut next = 0usize;
    let mut now = 0u64;
    let mut timed_out = 0;
    loop {
        let rates = rates(&tasks, p.gpus);
        let completion = rates
            .iter()
            .map(|(&i, &r)| now + (tasks[i].left / r).floor() as u64)
            .min();
        let arrival = tasks.get(next).map(|t| t.arrival);
        let Some(t) = [completion, arrival, core.next_wakeup()]
            .into_iter()
            .flatten()
            .min()
        else {
            break;
        };
        let t = t.max(now);
        for (&i, &r) in &rates {
            tasks[i].left -= (t - now) as f64 * r;
        }
        now = t;
        // Completions first: a job finishing exactly at its timeout finished.
        for (&id, &i) in &ids {
            if tasks[i].ended.is_none() && tasks[i].started.is_some() && tasks[i].left <= 1e3 {
                tasks[i].ended = Some(now);
                core.job_exited(id, Exit::Code(0), now)
                    .expect("a running job exits once");
            }
        }
        while next < tasks.len() && tasks[next].arrival <= now {
            let d = Demand {
                timeout_ns: Some(tasks[next].runtime),
                ..Demand::default()
            };
            let id = core.submit(d, now).expect("the paper's jobs are valid");
            ids.insert(id, next);
            next += 1;
        }
        loop {
            core.tick(now);
            let actions = core.take_actions();
            if actions.is_empty() {
                break;
            }
            for a in actions {
                match a {
                    Action::Start {
                        job,
                        gpus,
                        share,
                        limit,
                    } => {
                        let task = &mut tasks[ids[&job]];
                        task.started.get_or_insert(now);
                        (task.gpus, task.share, task.limit) = (gpus, share, limit);
                    }
                    Action::Kill { job, .. } => {
                        tasks[ids[&job]].ended = Some(now);
                        timed_out += 1;
                        core.job_exited(job, Exit::Signal(libc::SIGKILL), now)
                            .expect("a running job exits once");
                    }
                }
            }
        }
        if next == tasks.len() && tasks.iter().all(|t| t.ended.is_some()) {
            break;
        }
    }
    let n = tasks.len().max(1) as f64;
    let mean = |f: &dyn Fn(&Task) -> u64| tasks.iter().map(|t| f(t) as f64 / 1e9).sum::<f64>() / n;
    SeedResult {
        seed,
        mean_response_s: mean(&|t| t.started.unwrap_or(now) - t.arrival),
        mean_finish_s: mean(&|t| t.ended.unwrap_or(now) - t.arrival),
        timed_out,
    }
}

/// Progress rate (share of a whole GPU) of each running task: on each of its GPUs the share
/// the scheduler's water-filling gives it among the tasks there; its slowest GPU counts.
fn rates(tasks: &[Task], gpus: u32) -> BTreeMap<usize, f64> {
    let running: Vec<usize> = (0..tasks.len())
        .filter(|&i| tasks[i].started.is_some() && tasks[i].ended.is_none())
        .collect();
    let mut rate: BTreeMap<usize, f64> = running.iter().map(|&i| (i, 1.0)).collect();
    for g in 0..gpus {
        let here: Vec<usize> = running
            .iter()
            .copied()
            .filter(|&i| tasks[i].gpus.contains(&g))
            .collect();
        let params: Vec<GroupParams> = here
            .iter()
            .map(|&i| GroupParams {
                request: tasks[i].share,
                limit: tasks[i].limit,
                weight: 1.0,
                ..GroupParams::default()
            })
            .collect();
        for (&i, share) in here.iter().zip(water_fill(&params)) {
            let r = rate.get_mut(&i).expect("running");
            *r = r.min(share);
        }
    }
    rate.retain(|_, r| *r > 0.0);
    rate
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(policy: Policy, gpus: u32) -> ReplayResult {
        replay(&ReplayParams::paper(policy, gpus, 30))
    }

    #[test]
    fn the_papers_ordering_holds() {
        for k in [1, 2, 4] {
            let [fifo, sjf, aging, shares] = Policy::ALL.map(|p| run(p, k));
            let r = |x: &ReplayResult| x.mean_response_s;
            assert!(
                r(&fifo) > r(&aging),
                "K={k}: FIFO {} > aging {}",
                r(&fifo),
                r(&aging)
            );
            assert!(
                r(&aging) >= r(&sjf) * 0.95,
                "K={k}: aging {} ≳ SJF {}",
                r(&aging),
                r(&sjf)
            );
            for other in [&fifo, &sjf, &aging] {
                assert!(
                    r(&shares) < r(other),
                    "K={k}: shares {} beats {} {}",
                    r(&shares),
                    other.policy,
                    r(other)
                );
            }
            for x in [&fifo, &sjf, &aging, &shares] {
                assert_eq!(
                    x.timed_out, 0,
                    "{}: every job got what it was promised",
                    x.policy
                );
                // Finish − response is the mean runtime for the non-sharing policies.
                assert!(x.mean_finish_s > x.mean_response_s);
            }
        }
    }

    #[test]
    fn one_gpu_fifo_by_hand() {
        // Jobs of 100 s and 10 s arriving together on one GPU: FIFO runs them in order.
        let p = ReplayParams {
            jobs: 2,
            mean_interarrival_s: 0.0,
            runtime_log10: (2.0, 2.0),
            ..ReplayParams::paper(Policy::Fifo, 1, 1)
        };
        let r = replay(&p);
        assert!((r.mean_response_s - 50.0).abs() < 1e-3, "{r:?}");
        assert!((r.mean_finish_s - 150.0).abs() < 1e-3, "{r:?}");
    }

    #[test]
    fn range_parsing() {
        assert_eq!(parse_range("1:3"), Ok((1.0, 3.0)));
        assert!(parse_range("3:1").is_err());
        assert!(parse_range("x").is_err());
    }
}
