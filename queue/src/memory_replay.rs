//! `gpushare-queue replay --workload memory`: jobs whose memory grows and shrinks in phases, on
//! GPUs whose memory caps may promise `R` times what they hold, in virtual time — through the
//! queue's own [`Core`] (placement by caps) and the scheduler's overcommit core ([`Overcommit`]:
//! waits and swaps to host memory, with their cost). Each draw runs twice, with the same jobs:
//! caps held to the GPU (`R` = 1, memory partitioned statically by caps) and overcommitted.
//!
//! The workload. `jobs` jobs arrive as a Poisson process (mean gap `mean_interarrival_s`). A job
//! runs `runtime` seconds alone (`log10` uniform on `runtime_log10`), using a fraction `u` of the
//! GPU's time (uniform on `gpu_demand`: the rest of the time it waits for its input, its host
//! code); shared, it gets its water-filled share of the GPU, at most `u`, and progresses at
//! share / `u`. Its memory cap is its peak, uniform on [`PEAK_GIB`]; its work is split into
//! [`PHASES`] equal phases, each at the peak with probability [`PEAK_PHASES`], else at its base
//! working set (a fraction of the peak uniform on [`BASE_FRACTION`]). Entering a phase that needs
//! more memory asks the overcommit core for it, and the job waits (no progress) until it is
//! granted; a swapped-out job makes no progress; swaps take the checkpoint and restore cost of
//! its memory.
//!
//! The figures, per mode, are means over the draws: completion = end − arrival (mean over
//! jobs), memory utilisation = memory in use on the GPUs (resident jobs' allocations) over
//! their capacity, averaged from the first arrival to the last end; GPU utilisation likewise
//! for GPU time; swaps, bytes and seconds moved; allocations refused (out of memory).

use crate::core::{Action, Core, Demand, Exit, Gpu, GpuLoad, JobId, Policy, QueueConfig};
use gpushare_policy::overcommit::{
    Effect, GroupId, Overcommit, Params, ProcessId, RequestId, SwapId,
};
use gpushare_policy::{GroupParams, water_fill};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use serde::Serialize;
use std::collections::BTreeMap;

const GIB: u64 = 1 << 30;
/// Each GPU's memory.
pub const GPU_MEMORY: u64 = 80 * GIB;
/// A job's peak working set (its memory cap), GiB.
pub const PEAK_GIB: (f64, f64) = (20.0, 40.0);
/// Its working set outside its peaks, as a fraction of its peak.
pub const BASE_FRACTION: (f64, f64) = (0.25, 0.5);
/// Phases per job, and the chance that a phase is at the peak.
pub const PHASES: usize = 10;
pub const PEAK_PHASES: f64 = 0.4;

/// What moving a job's memory to host memory and back costs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SwapCost {
    pub latency_s: f64,
    pub checkpoint_bytes_per_s: f64,
    pub restore_bytes_per_s: f64,
}

impl SwapCost {
    /// As measured on an H200 (driver 580): 0.1 s, then 1.5 GB/s out and 4.4 GB/s back.
    pub fn measured() -> SwapCost {
        SwapCost {
            latency_s: 0.1,
            checkpoint_bytes_per_s: 1.5e9,
            restore_bytes_per_s: 4.4e9,
        }
    }

    fn ns(&self, bytes: u64, out: bool) -> u64 {
        let rate = if out {
            self.checkpoint_bytes_per_s
        } else {
            self.restore_bytes_per_s
        };
        ((self.latency_s + bytes as f64 / rate) * 1e9) as u64
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct MemoryReplayParams {
    pub policy: Policy,
    pub gpus: u32,
    pub jobs: u32,
    pub mean_interarrival_s: f64,
    pub runtime_log10: (f64, f64),
    /// The fraction of a GPU's time a job can use alone, uniform on `[a, b]`.
    pub gpu_demand: (f64, f64),
    pub memory_overcommit: f64,
    pub seeds: u32,
    pub swap: SwapCost,
    /// The overcommit core's waits, windows and memory turns.
    pub overcommit: Params,
}

impl MemoryReplayParams {
    pub fn new(policy: Policy, memory_overcommit: f64) -> MemoryReplayParams {
        MemoryReplayParams {
            policy,
            gpus: 1,
            jobs: 40,
            // Offered GPU time about 0.8 of a GPU: mean demand 0.5 × mean runtime 391 s
            // every 240 s (busy, not overloaded).
            mean_interarrival_s: 240.0,
            runtime_log10: (2.0, 3.0),
            gpu_demand: (0.3, 0.7),
            memory_overcommit,
            seeds: 20,
            swap: SwapCost::measured(),
            // Jobs wait for memory as long as the scheduler lets an allocation wait at most
            // (`overcommit.max_wait` as high as it goes): a job is queued work, better late
            // than failed.
            overcommit: Params {
                max_wait_ns: gpushare_protocol::MAX_MEMORY_WAIT_NS,
                ..Params::default()
            },
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        let (a, b) = self.gpu_demand;
        if !(a > 0.0 && a <= b && b <= 1.0) {
            return Err(format!(
                "--gpu-demand {a}:{b} must be A:B with 0 < A <= B <= 1 (e.g. 0.3:0.7)"
            ));
        }
        if !(self.memory_overcommit.is_finite() && self.memory_overcommit >= 1.0) {
            return Err("--memory-overcommit must be a ratio >= 1".into());
        }
        let (a, b) = self.runtime_log10;
        if self.gpus == 0 || self.jobs == 0 || self.seeds == 0 {
            return Err("--gpus, --jobs and --seeds must be at least 1".into());
        }
        if !(a.is_finite() && b.is_finite() && a <= b && b <= 9.0) {
            return Err(format!(
                "--runtime-log10 {a}:{b} must be A:B with A <= B <= 9"
            ));
        }
        Ok(())
    }
}

/// One mode's figures (means over the draws).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ModeResult {
    pub memory_overcommit: f64,
    pub mean_completion_s: f64,
    pub memory_utilisation: f64,
    pub gpu_utilisation: f64,
    pub swap_outs: f64,
    pub swap_ins: f64,
    pub swapped_gib: f64,
    pub swap_seconds: f64,
    /// Allocations refused, in all draws.
    pub out_of_memory: u64,
    /// Summed peaks of the jobs running at once, over the GPUs' memory: the most, over time.
    pub max_peaks_over_memory: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryReplayResult {
    pub policy: String,
    pub gpus: u32,
    pub jobs: u32,
    pub seeds: u32,
    pub gpu_demand: (f64, f64),
    pub static_caps: ModeResult,
    pub overcommitted: ModeResult,
    /// How much lower the mean completion time is overcommitted, and how much higher the memory
    /// utilisation (relative, e.g. 0.15 = 15 %), over all draws.
    pub completion_reduction: f64,
    pub memory_utilisation_gain: f64,
    /// The completion reduction of each draw: (seed, static mean s, overcommitted mean s).
    pub per_seed: Vec<(u32, f64, f64)>,
}

impl MemoryReplayResult {
    /// The least and greatest completion reduction over the draws.
    pub fn reduction_range(&self) -> (f64, f64) {
        (self.per_seed.iter())
            .map(|&(_, s, o)| 1.0 - o / s)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), r| {
                (lo.min(r), hi.max(r))
            })
    }
}

pub fn replay(p: &MemoryReplayParams) -> MemoryReplayResult {
    let runs = |r: f64| -> Vec<ModeResult> { (0..p.seeds).map(|s| run_seed(p, s, r)).collect() };
    let (a, b) = (runs(1.0), runs(p.memory_overcommit));
    let per_seed = (0..p.seeds)
        .map(|s| {
            let i = s as usize;
            (s, a[i].mean_completion_s, b[i].mean_completion_s)
        })
        .collect();
    let (static_caps, overcommitted) = (mean(&a, 1.0), mean(&b, p.memory_overcommit));
    MemoryReplayResult {
        per_seed,
        policy: p.policy.to_string(),
        gpus: p.gpus,
        jobs: p.jobs,
        seeds: p.seeds,
        gpu_demand: p.gpu_demand,
        completion_reduction: 1.0 - overcommitted.mean_completion_s / static_caps.mean_completion_s,
        memory_utilisation_gain: overcommitted.memory_utilisation / static_caps.memory_utilisation
            - 1.0,
        static_caps,
        overcommitted,
    }
}

fn mean(rs: &[ModeResult], r: f64) -> ModeResult {
    let n = rs.len().max(1) as f64;
    let m = |f: fn(&ModeResult) -> f64| rs.iter().map(f).sum::<f64>() / n;
    ModeResult {
        memory_overcommit: r,
        mean_completion_s: m(|x| x.mean_completion_s),
        memory_utilisation: m(|x| x.memory_utilisation),
        gpu_utilisation: m(|x| x.gpu_utilisation),
        swap_outs: m(|x| x.swap_outs),
        swap_ins: m(|x| x.swap_ins),
        swapped_gib: m(|x| x.swapped_gib),
        swap_seconds: m(|x| x.swap_seconds),
        out_of_memory: rs.iter().map(|x| x.out_of_memory).sum(),
        max_peaks_over_memory: rs
            .iter()
            .map(|x| x.max_peaks_over_memory)
            .fold(0.0, f64::max),
    }
}

/// One job of a draw.
#[derive(Debug, Clone)]
struct Job {
    arrival: u64,
    /// ns alone.
    runtime: u64,
    demand: f64,
    peak: u64,
    /// Memory of each phase.
    phases: Vec<u64>,
    // What happened.
    id: Option<JobId>,
    gpu: Option<u32>,
    started: Option<u64>,
    ended: Option<u64>,
    /// ns of work done (at the rate of running alone).
    done: f64,
    phase: usize,
    held: u64,
    /// An allocation asked for and not granted yet.
    waiting: Option<u64>,
}

impl Job {
    fn phase_end(&self, k: usize) -> f64 {
        self.runtime as f64 * (k + 1) as f64 / self.phases.len() as f64
    }
}

/// The draws of seed `seed`.
fn draw(p: &MemoryReplayParams, seed: u32) -> Vec<Job> {
    let mut rng = StdRng::seed_from_u64(seed as u64);
    let mut t = 0.0f64;
    let uniform = |(a, b): (f64, f64), rng: &mut StdRng| a + (b - a) * rng.random::<f64>();
    (0..p.jobs)
        .map(|_| {
            let u: f64 = rng.random();
            t += -p.mean_interarrival_s * (1.0 - u).ln();
            let runtime = 10f64.powf(uniform(p.runtime_log10, &mut rng));
            let demand = uniform(p.gpu_demand, &mut rng);
            let peak = (uniform(PEAK_GIB, &mut rng) * GIB as f64) as u64;
            let base = (peak as f64 * uniform(BASE_FRACTION, &mut rng)) as u64;
            let phases = (0..PHASES)
                .map(|_| {
                    if rng.random::<f64>() < PEAK_PHASES {
                        peak
                    } else {
                        base
                    }
                })
                .collect();
            Job {
                arrival: (t * 1e9) as u64,
                runtime: (runtime * 1e9) as u64,
                demand,
                peak,
                phases,
                id: None,
                gpu: None,
                started: None,
                ended: None,
                done: 0.0,
                phase: 0,
                held: 0,
                waiting: None,
            }
        })
        .collect()
}

/// A swap under way: when it ends, which, and whether it is a swap-out.
struct Due {
    at: u64,
    swap: SwapId,
    out: bool,
}

fn run_seed(p: &MemoryReplayParams, seed: u32, ratio: f64) -> ModeResult {
    let mut jobs = draw(p, seed);
    let mut core = Core::new(
        QueueConfig {
            policy: p.policy,
            memory_overcommit: ratio,
            ..QueueConfig::default()
        },
        vec![Gpu { memory: GPU_MEMORY }; p.gpus as usize],
    );
    let mut oc = Overcommit::new(p.overcommit, vec![GPU_MEMORY; p.gpus as usize]);
    let mut index: BTreeMap<JobId, usize> = BTreeMap::new();
    let mut due: Vec<Due> = Vec::new();
    let mut out = ModeResult::default();
    let (mut next, mut now, mut req) = (0usize, 0u64, 0u64);
    let (mut mem_ns, mut gpu_ns) = (0f64, 0f64);
    loop {
        let rates = rates(&jobs, &oc, p.gpus);
        // Phase ends of running jobs.
        let phase_end = (rates.iter())
            .map(|(&i, &r)| {
                let j = &jobs[i];
                now + ((j.phase_end(j.phase) - j.done).max(0.0) / r).ceil() as u64
            })
            .min();
        let arrival = jobs.get(next).map(|j| j.arrival);
        let swap_end = due.iter().map(|d| d.at).min();
        let Some(t) = [phase_end, arrival, swap_end, oc.next_wakeup(now)]
            .into_iter()
            .flatten()
            .min()
        else {
            break;
        };
        let t = t.max(now);
        let dt = (t - now) as f64;
        for (&i, &r) in &rates {
            jobs[i].done += dt * r;
            gpu_ns += dt * r * jobs[i].demand;
        }
        mem_ns += dt
            * (0..p.gpus as usize)
                .map(|g| oc.books(g).used as f64)
                .sum::<f64>();
        now = t;
        let mut effects = Vec::new();
        // Swaps ending.
        due.sort_by_key(|d| d.at);
        while due.first().is_some_and(|d| d.at <= now) {
            let d = due.remove(0);
            effects.extend(if d.out {
                oc.swapped_out(now, d.swap, Ok(()))
            } else {
                oc.swapped_in(now, d.swap, true)
            });
        }
        // Phases ending: ask for the next phase's memory, or give back what it does not need.
        for &i in rates.keys() {
            let j = &mut jobs[i];
            if j.done + 1e3 < j.phase_end(j.phase) {
                continue;
            }
            let (pid, gpu) = (ProcessId(i as u64), j.gpu.expect("running") as usize);
            j.phase += 1;
            if j.phase == j.phases.len() {
                j.ended = Some(now);
                j.held = 0;
                effects.extend(oc.exit(now, pid));
                core.job_exited(j.id.expect("queued"), Exit::Code(0), now)
                    .expect("a running job exits once");
                continue;
            }
            let want = j.phases[j.phase];
            if want > j.held {
                j.waiting = Some(want - j.held);
                req += 1;
                effects.extend(oc.request(
                    now,
                    RequestId(req << 16 | i as u64),
                    pid,
                    gpu,
                    want - j.held,
                ));
            } else if want < j.held {
                effects.extend(oc.free(now, pid, gpu, j.held - want));
                j.held = want;
            }
        }
        while next < jobs.len() && jobs[next].arrival <= now {
            let d = Demand {
                share: 0.0,
                limit: jobs[next].demand,
                memory: Some(jobs[next].peak),
                ..Demand::default()
            };
            let id = core.submit(d, now).expect("the replay's jobs are valid");
            index.insert(id, next);
            jobs[next].id = Some(id);
            next += 1;
        }
        core.gpu_state(loads(&jobs, p.gpus), now);
        core.tick(now);
        for a in core.take_actions() {
            if let Action::Start { job, gpus, .. } = a {
                let i = index[&job];
                let j = &mut jobs[i];
                (j.gpu, j.started) = (Some(gpus[0]), Some(now));
                let (pid, group) = (ProcessId(i as u64), GroupId(i as u64));
                oc.attach(pid, group);
                effects.extend(oc.set_pending(now, group, true));
                j.waiting = Some(j.phases[0]);
                req += 1;
                effects.extend(oc.request(
                    now,
                    RequestId(req << 16 | i as u64),
                    pid,
                    gpus[0] as usize,
                    j.phases[0],
                ));
            }
        }
        effects.extend(oc.tick(now));
        let mut effects = std::collections::VecDeque::from(effects);
        while let Some(e) = effects.pop_front() {
            match e {
                Effect::Grant(RequestId(r)) => {
                    let j = &mut jobs[(r & 0xffff) as usize];
                    j.held += j.waiting.take().expect("asked");
                }
                Effect::Refuse(RequestId(r), _) => {
                    // Out of memory: the job fails and leaves.
                    out.out_of_memory += 1;
                    let i = (r & 0xffff) as usize;
                    let j = &mut jobs[i];
                    (j.ended, j.held, j.waiting) = (Some(now), 0, None);
                    effects.extend(oc.exit(now, ProcessId(i as u64)));
                    core.job_exited(j.id.expect("queued"), Exit::Code(1), now)
                        .expect("running");
                }
                Effect::SwapOut { swap, group, .. } | Effect::SwapIn { swap, group, .. } => {
                    let swap_out = matches!(e, Effect::SwapOut { .. });
                    let bytes = jobs[group.0 as usize].held;
                    let took = p.swap.ns(bytes, swap_out);
                    out.swapped_gib += bytes as f64 / GIB as f64;
                    out.swap_seconds += took as f64 / 1e9;
                    due.push(Due {
                        at: now + took,
                        swap,
                        out: swap_out,
                    });
                }
                Effect::Lost { .. } => unreachable!("every restore succeeds here"),
            }
        }
        out.max_peaks_over_memory = out
            .max_peaks_over_memory
            .max(peaks_over_memory(&jobs, p.gpus));
        if next == jobs.len() && jobs.iter().all(|j| j.ended.is_some()) {
            break;
        }
    }
    let n = jobs.len().max(1) as f64;
    let span = now.max(1) as f64 * p.gpus as f64;
    let c = oc.counters();
    ModeResult {
        memory_overcommit: ratio,
        mean_completion_s: jobs
            .iter()
            .map(|j| (j.ended.unwrap_or(now) - j.arrival) as f64 / 1e9)
            .sum::<f64>()
            / n,
        memory_utilisation: mem_ns / (span * GPU_MEMORY as f64),
        gpu_utilisation: gpu_ns / span,
        swap_outs: c.swap_outs as f64,
        swap_ins: c.swap_ins as f64,
        ..out
    }
}

/// What the scheduler's books tell the queue: each job's memory (held, on the GPU or swapped).
fn loads(jobs: &[Job], gpus: u32) -> Vec<GpuLoad> {
    let mut l = vec![GpuLoad::default(); gpus as usize];
    for j in jobs {
        if let (Some(id), Some(g), None) = (j.id, j.gpu, j.ended) {
            l[g as usize].job_memory.insert(id, j.held);
        }
    }
    l
}

/// The running jobs' summed peaks over their GPUs' memory, at the GPU where it is largest.
fn peaks_over_memory(jobs: &[Job], gpus: u32) -> f64 {
    (0..gpus)
        .map(|g| {
            (jobs.iter())
                .filter(|j| j.gpu == Some(g) && j.ended.is_none())
                .map(|j| j.peak)
                .sum::<u64>() as f64
                / GPU_MEMORY as f64
        })
        .fold(0.0, f64::max)
}

/// Progress rate (ns of work per ns) of each job that runs now: resident, not waiting for
/// memory; its water-filled share of its GPU (at most its demand), over its demand.
fn rates(jobs: &[Job], oc: &Overcommit, gpus: u32) -> BTreeMap<usize, f64> {
    let mut rate = BTreeMap::new();
    for g in 0..gpus {
        let here: Vec<usize> = (0..jobs.len())
            .filter(|&i| {
                let j = &jobs[i];
                j.gpu == Some(g)
                    && j.ended.is_none()
                    && j.waiting.is_none()
                    && oc.resident(GroupId(i as u64))
            })
            .collect();
        let params: Vec<GroupParams> = here
            .iter()
            .map(|&i| GroupParams {
                request: 0.0,
                limit: jobs[i].demand,
                weight: 1.0,
                ..GroupParams::default()
            })
            .collect();
        for (&i, share) in here.iter().zip(water_fill(&params)) {
            if share > 0.0 {
                rate.insert(i, share / jobs[i].demand);
            }
        }
    }
    rate
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(r: f64) -> MemoryReplayParams {
        MemoryReplayParams {
            jobs: 15,
            seeds: 3,
            ..MemoryReplayParams::new(Policy::Aging, r)
        }
    }

    #[test]
    fn a_job_alone_takes_its_runtime() {
        let p = MemoryReplayParams {
            jobs: 1,
            seeds: 1,
            ..params(2.0)
        };
        let job = &draw(&p, 0)[0];
        let r = replay(&p);
        for m in [&r.static_caps, &r.overcommitted] {
            let alone = job.runtime as f64 / 1e9;
            assert!(
                (m.mean_completion_s - alone).abs() < 1e-3,
                "{m:?} vs {alone}"
            );
            assert_eq!(m.swap_outs, 0.0);
        }
    }

    #[test]
    fn caps_promise_what_the_mode_allows_and_no_job_fails_for_memory() {
        let r = replay(&params(2.0));
        let (s, o) = (&r.static_caps, &r.overcommitted);
        assert_eq!((s.out_of_memory, o.out_of_memory), (0, 0));
        assert!(
            s.max_peaks_over_memory <= 1.0 && s.swap_outs == 0.0,
            "{s:?}"
        );
        assert!(
            o.max_peaks_over_memory > 1.5 && o.max_peaks_over_memory <= 2.0,
            "the running jobs' peaks reach 1.5-2x the GPU: {o:?}"
        );
        assert!(o.swap_outs > 0.0 && o.swap_seconds > 0.0, "{o:?}");
        for m in [s, o] {
            assert!(
                m.memory_utilisation > 0.0 && m.memory_utilisation <= 1.0,
                "{m:?}"
            );
            assert!(m.gpu_utilisation > 0.0 && m.gpu_utilisation <= 1.0, "{m:?}");
        }
        assert!(o.memory_utilisation > s.memory_utilisation);
    }

    /// Where caps held to the GPU leave it idle (jobs that use little of its time), running
    /// more of them at once pays for the swaps.
    #[test]
    fn gpu_light_jobs_finish_sooner_with_overcommitted_caps() {
        let p = MemoryReplayParams {
            gpu_demand: (0.1, 0.3),
            mean_interarrival_s: 98.0,
            seeds: 10,
            ..MemoryReplayParams::new(Policy::Aging, 1.5)
        };
        let r = replay(&p);
        assert!(r.completion_reduction >= 0.15, "{r:#?}");
        assert!(r.memory_utilisation_gain >= 0.10, "{r:#?}");
        assert_eq!(r.overcommitted.out_of_memory, 0);
    }
}
