//! `gpushare-queue replay --workload memory`: jobs whose memory grows and shrinks in phases, on
//! GPUs whose memory caps may promise `R` times what they hold, in virtual time — through the
//! queue's own [`Core`] (placement by caps) and the scheduler's overcommit core ([`Overcommit`]:
//! waits and swaps to host memory, with their cost). Each draw runs three times, with the same
//! jobs: caps held to the GPU (`R` = 1, memory partitioned statically by caps), overcommitted
//! (the queue admitting past the GPU's memory as `admission` says, reading each running job's
//! demand as its measured GPU time), and one job per GPU at a time.
//!
//! The synthetic mix ([`Mix::Synthetic`]). `jobs` jobs arrive as a Poisson process (mean gap `mean_interarrival_s`). A job
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
//! The `seed002` mix ([`Mix::Seed002`]) is the measured experiment of the resource-aware
//! scheduling work instead: on one V100 ([`V100_MEMORY`]), [`SEED_JOBS`] MLPerf ssd-mobilenet
//! inference engines, the k-th arriving after k draws of U{20..40} s; each is one of the
//! engines the seed measured alone (`extender/data/seed-engines.csv`), drawn at random: its
//! runtime, its GPU demand (its measured mean utilisation) and its memory phases (the runs of
//! constant memory it was measured in) are that engine's; its cap is its request, the measured
//! [`ENGINE_PEAK`] over-provisioned by `overprov_pct` (at most the GPU, as the seed's generator
//! capped it); engines sharing a GPU progress [`SEED_INTERFERENCE`] slower per neighbour.
//!
//! Besides caps held to the GPU and overcommitted caps, each draw runs a third time with one
//! job per GPU at a time (the whole GPU per job: the default Kubernetes scheduler's placement,
//! the resource-aware scheduling work's first baseline).
//!
//! The figures, per mode, are means over the draws: completion = end − arrival and wait =
//! start − arrival (means over jobs), memory utilisation = memory in use on the GPUs (resident jobs' allocations) over
//! their capacity, averaged from the first arrival to the last end; GPU utilisation likewise
//! for GPU time; swaps, bytes and seconds moved; allocations refused (out of memory).

use crate::core::{
    Action, Core, Demand, Exit, Gpu, GpuLoad, JobId, OvercommitAdmission, Policy, QueueConfig,
};
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

const MIB: u64 = 1 << 20;
/// The `seed002` mix's GPU: the seed's V100, as its scheduler counted it (32510 MiB).
pub const V100_MEMORY: u64 = 32_510 * MIB;
/// What each measured engine used at its peak (every one of them), and asks for without
/// over-provisioning.
pub const ENGINE_PEAK: u64 = 6_994 * MIB;
/// Engines per draw in the seed's experiment.
pub const SEED_JOBS: u32 = 30;
/// The seed's arrival gaps: uniform on these whole seconds.
pub const SEED_GAP_S: (u64, u64) = (20, 40);
/// Engines sharing a GPU progress at 1 / (1 + this × neighbours): in the seed's runs, four
/// engines per GPU ran 158.9 s on average against 131.5 s alone.
pub const SEED_INTERFERENCE: f64 = 0.07;

/// Which jobs a draw holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mix {
    /// Poisson arrivals, phases at a peak or a base, runtime and GPU demand as the parameters
    /// say, on 80 GiB GPUs.
    Synthetic,
    /// The resource-aware scheduling work's measured engines and arrivals on its V100, memory
    /// requests over-provisioned by `overprov_pct` percent.
    Seed002 { overprov_pct: u32 },
}

impl Mix {
    /// Each GPU's memory.
    pub fn gpu_memory(self) -> u64 {
        match self {
            Mix::Synthetic => GPU_MEMORY,
            Mix::Seed002 { .. } => V100_MEMORY,
        }
    }

    /// How much slower a job runs per other job running on its GPU.
    pub fn interference(self) -> f64 {
        match self {
            Mix::Synthetic => 0.0,
            Mix::Seed002 { .. } => SEED_INTERFERENCE,
        }
    }

    /// An engine's memory cap: its peak over-provisioned, at most the GPU.
    pub fn seed_request(overprov_pct: u32) -> u64 {
        let r = ENGINE_PEAK as f64 * (1.0 + f64::from(overprov_pct) / 100.0);
        (r as u64).min(V100_MEMORY)
    }
}

/// One engine the seed measured alone on its V100: its runs of constant memory (seconds,
/// bytes) and its mean utilisation (0..1).
#[derive(Debug)]
pub struct Engine {
    pub phases: Vec<(u64, u64)>,
    pub util: f64,
}

/// The engines of `extender/data/seed-engines.csv` (provenance: `extender/data/README.md`).
pub fn seed_engines() -> &'static [Engine] {
    static E: std::sync::OnceLock<Vec<Engine>> = std::sync::OnceLock::new();
    E.get_or_init(|| {
        let mut out: Vec<Engine> = Vec::new();
        for line in include_str!("../../extender/data/seed-engines.csv")
            .lines()
            .skip(1)
        {
            let f: Vec<&str> = line.split(',').collect();
            let id: usize = f[0].parse().expect("engine");
            if id == out.len() {
                out.push(Engine {
                    phases: Vec::new(),
                    util: f[3].parse::<f64>().expect("util") / 100.0,
                });
            }
            let secs: u64 = f[1].parse().expect("seconds");
            let mib: u64 = f[2].parse().expect("mib");
            out[id].phases.push((secs, mib * MIB));
        }
        out
    })
}

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
    pub mix: Mix,
    pub policy: Policy,
    pub gpus: u32,
    pub jobs: u32,
    pub mean_interarrival_s: f64,
    pub runtime_log10: (f64, f64),
    /// The fraction of a GPU's time a job can use alone, uniform on `[a, b]`.
    pub gpu_demand: (f64, f64),
    pub memory_overcommit: f64,
    /// Which jobs the queue starts on caps past the GPU's memory, overcommitted.
    pub admission: OvercommitAdmission,
    pub seeds: u32,
    pub swap: SwapCost,
    /// The overcommit core's waits, windows and memory turns.
    pub overcommit: Params,
}

impl MemoryReplayParams {
    pub fn new(policy: Policy, memory_overcommit: f64) -> MemoryReplayParams {
        MemoryReplayParams {
            mix: Mix::Synthetic,
            policy,
            gpus: 1,
            jobs: 40,
            // Offered GPU time about 0.8 of a GPU: mean demand 0.5 × mean runtime 391 s
            // every 240 s (busy, not overloaded).
            mean_interarrival_s: 240.0,
            runtime_log10: (2.0, 3.0),
            gpu_demand: (0.3, 0.7),
            memory_overcommit,
            admission: OvercommitAdmission::Caps,
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

    /// The `seed002` mix: the seed's 30 engines, caps over-provisioned by `overprov_pct` %.
    pub fn seed002(policy: Policy, memory_overcommit: f64, overprov_pct: u32) -> Self {
        MemoryReplayParams {
            mix: Mix::Seed002 { overprov_pct },
            jobs: SEED_JOBS,
            ..MemoryReplayParams::new(policy, memory_overcommit)
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
    /// Mean time from a job's arrival to its start.
    pub mean_wait_s: f64,
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
    /// Summed caps of the jobs running at once, over the GPUs' memory: the most, over time
    /// (the peaks, where a job's cap is its peak).
    pub max_caps_over_memory: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryReplayResult {
    pub mix: Mix,
    pub policy: String,
    pub gpus: u32,
    pub jobs: u32,
    pub seeds: u32,
    pub gpu_demand: (f64, f64),
    pub static_caps: ModeResult,
    pub overcommitted: ModeResult,
    /// One job per GPU at a time (caps held to the GPU).
    pub one_at_a_time: ModeResult,
    /// How much lower the mean completion time is overcommitted, and how much higher the memory
    /// utilisation (relative, e.g. 0.15 = 15 %), over all draws.
    pub completion_reduction: f64,
    pub memory_utilisation_gain: f64,
    /// The same against one job at a time.
    pub completion_reduction_vs_one_at_a_time: f64,
    pub memory_utilisation_gain_vs_one_at_a_time: f64,
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
    let runs = |r: f64, max_jobs: Option<u32>| -> Vec<ModeResult> {
        (0..p.seeds).map(|s| run_seed(p, s, r, max_jobs)).collect()
    };
    let (a, b) = (runs(1.0, None), runs(p.memory_overcommit, None));
    let one = mean(&runs(1.0, Some(1)), 1.0);
    let per_seed = (0..p.seeds)
        .map(|s| {
            let i = s as usize;
            (s, a[i].mean_completion_s, b[i].mean_completion_s)
        })
        .collect();
    let (static_caps, overcommitted) = (mean(&a, 1.0), mean(&b, p.memory_overcommit));
    MemoryReplayResult {
        per_seed,
        mix: p.mix,
        policy: p.policy.to_string(),
        gpus: p.gpus,
        jobs: p.jobs,
        seeds: p.seeds,
        gpu_demand: p.gpu_demand,
        completion_reduction: 1.0 - overcommitted.mean_completion_s / static_caps.mean_completion_s,
        memory_utilisation_gain: overcommitted.memory_utilisation / static_caps.memory_utilisation
            - 1.0,
        completion_reduction_vs_one_at_a_time: 1.0
            - overcommitted.mean_completion_s / one.mean_completion_s,
        memory_utilisation_gain_vs_one_at_a_time: overcommitted.memory_utilisation
            / one.memory_utilisation
            - 1.0,
        static_caps,
        overcommitted,
        one_at_a_time: one,
    }
}

fn mean(rs: &[ModeResult], r: f64) -> ModeResult {
    let n = rs.len().max(1) as f64;
    let m = |f: fn(&ModeResult) -> f64| rs.iter().map(f).sum::<f64>() / n;
    ModeResult {
        memory_overcommit: r,
        mean_completion_s: m(|x| x.mean_completion_s),
        mean_wait_s: m(|x| x.mean_wait_s),
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
        max_caps_over_memory: rs
            .iter()
            .map(|x| x.max_caps_over_memory)
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
    /// What it asks the queue for: its peak, or more where it over-provisions.
    cap: u64,
    /// Memory of each phase.
    phases: Vec<u64>,
    /// ns of work done at the end of each phase.
    ends: Vec<f64>,
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
        self.ends[k]
    }

    /// A job of `phases` (memory) ending after `ends` ns of work, the last at its runtime.
    fn new(arrival: u64, demand: f64, cap: u64, phases: Vec<u64>, ends: Vec<f64>) -> Job {
        Job {
            arrival,
            runtime: ends.last().copied().unwrap_or(0.0) as u64,
            demand,
            peak: phases.iter().copied().max().unwrap_or(0),
            cap,
            phases,
            ends,
            id: None,
            gpu: None,
            started: None,
            ended: None,
            done: 0.0,
            phase: 0,
            held: 0,
            waiting: None,
        }
    }
}

/// The jobs of draw `seed`.
fn draw(p: &MemoryReplayParams, seed: u32) -> Vec<Job> {
    let mut rng = StdRng::seed_from_u64(seed as u64);
    match p.mix {
        Mix::Synthetic => draw_synthetic(p, &mut rng),
        Mix::Seed002 { overprov_pct } => {
            let engines = seed_engines();
            let cap = Mix::seed_request(overprov_pct);
            let mut t = 0u64;
            (0..p.jobs)
                .map(|k| {
                    if k > 0 {
                        t += rng.random_range(SEED_GAP_S.0..=SEED_GAP_S.1);
                    }
                    let e = &engines[rng.random_range(0..engines.len())];
                    let mut at = 0u64;
                    let ends = (e.phases.iter())
                        .map(|&(s, _)| {
                            at += s * 1_000_000_000;
                            at as f64
                        })
                        .collect();
                    let phases = e.phases.iter().map(|&(_, b)| b).collect();
                    Job::new(t * 1_000_000_000, e.util, cap, phases, ends)
                })
                .collect()
        }
    }
}

fn draw_synthetic(p: &MemoryReplayParams, rng: &mut StdRng) -> Vec<Job> {
    let mut t = 0.0f64;
    let uniform = |(a, b): (f64, f64), rng: &mut StdRng| a + (b - a) * rng.random::<f64>();
    (0..p.jobs)
        .map(|_| {
            let u: f64 = rng.random();
            t += -p.mean_interarrival_s * (1.0 - u).ln();
            let runtime = (10f64.powf(uniform(p.runtime_log10, rng)) * 1e9) as u64;
            let demand = uniform(p.gpu_demand, rng);
            let peak = (uniform(PEAK_GIB, rng) * GIB as f64) as u64;
            let base = (peak as f64 * uniform(BASE_FRACTION, rng)) as u64;
            let phases = (0..PHASES)
                .map(|_| {
                    if rng.random::<f64>() < PEAK_PHASES {
                        peak
                    } else {
                        base
                    }
                })
                .collect();
            // Equal phases.
            let ends = (1..=PHASES)
                .map(|k| runtime as f64 * k as f64 / PHASES as f64)
                .collect();
            let mut j = Job::new((t * 1e9) as u64, demand, peak, phases, ends);
            (j.runtime, j.peak) = (runtime, peak);
            j
        })
        .collect()
}

/// A swap under way: when it ends, which, and whether it is a swap-out.
struct Due {
    at: u64,
    swap: SwapId,
    out: bool,
}

fn run_seed(p: &MemoryReplayParams, seed: u32, ratio: f64, max_jobs: Option<u32>) -> ModeResult {
    let mut jobs = draw(p, seed);
    let memory = p.mix.gpu_memory();
    let mut core = Core::new(
        QueueConfig {
            policy: p.policy,
            memory_overcommit: ratio,
            max_jobs_per_gpu: max_jobs,
            overcommit_admission: p.admission,
            ..QueueConfig::default()
        },
        vec![Gpu { memory }; p.gpus as usize],
    );
    let mut oc = Overcommit::new(p.overcommit, vec![memory; p.gpus as usize]);
    let mut index: BTreeMap<JobId, usize> = BTreeMap::new();
    let mut due: Vec<Due> = Vec::new();
    let mut out = ModeResult::default();
    let (mut next, mut now, mut req) = (0usize, 0u64, 0u64);
    let (mut mem_ns, mut gpu_ns) = (0f64, 0f64);
    loop {
        let rates = rates(&jobs, &oc, p.gpus, p.mix.interference());
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
                memory: Some(jobs[next].cap),
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
        let (peaks, caps) = over_memory(&jobs, p.gpus, memory);
        out.max_peaks_over_memory = out.max_peaks_over_memory.max(peaks);
        out.max_caps_over_memory = out.max_caps_over_memory.max(caps);
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
        mean_wait_s: jobs
            .iter()
            .map(|j| (j.started.unwrap_or(now) - j.arrival) as f64 / 1e9)
            .sum::<f64>()
            / n,
        memory_utilisation: mem_ns / (span * memory as f64),
        gpu_utilisation: gpu_ns / span,
        swap_outs: c.swap_outs as f64,
        swap_ins: c.swap_ins as f64,
        ..out
    }
}

/// What the scheduler's books tell the queue: each job's memory (held, on the GPU or swapped)
/// and the GPU time it was measured using, its demand (what it uses running uncontended).
fn loads(jobs: &[Job], gpus: u32) -> Vec<GpuLoad> {
    let mut l = vec![GpuLoad::default(); gpus as usize];
    for j in jobs {
        if let (Some(id), Some(g), None) = (j.id, j.gpu, j.ended) {
            l[g as usize].job_memory.insert(id, j.held);
            l[g as usize].job_busy.insert(id, j.demand);
        }
    }
    l
}

/// The running jobs' summed peaks and summed caps over their GPUs' memory, each at the GPU
/// where it is largest.
fn over_memory(jobs: &[Job], gpus: u32, memory: u64) -> (f64, f64) {
    let sum = |g: u32, f: fn(&Job) -> u64| {
        (jobs.iter())
            .filter(|j| j.gpu == Some(g) && j.ended.is_none())
            .map(f)
            .sum::<u64>() as f64
            / memory as f64
    };
    (0..gpus).fold((0.0, 0.0), |(p, c), g| {
        (p.max(sum(g, |j| j.peak)), c.max(sum(g, |j| j.cap)))
    })
}

/// Progress rate (ns of work per ns) of each job that runs now: resident, not waiting for
/// memory; its water-filled share of its GPU (at most its demand), over its demand, slowed by
/// `interference` per other job running there.
fn rates(jobs: &[Job], oc: &Overcommit, gpus: u32, interference: f64) -> BTreeMap<usize, f64> {
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
        let slow = 1.0 + interference * here.len().saturating_sub(1) as f64;
        for (&i, share) in here.iter().zip(water_fill(&params)) {
            if share > 0.0 {
                rate.insert(i, share / jobs[i].demand / slow);
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
            assert_eq!((m.swap_outs, m.mean_wait_s), (0.0, 0.0));
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

    /// The `seed002` mix is what docs/memory-overcommit.md says it is: the seed's 179 measured
    /// engines, its arrivals and its requests.
    #[test]
    fn seed002_is_the_seeds_engines_arrivals_and_requests() {
        let engines = seed_engines();
        assert_eq!(engines.len(), 179);
        let secs = |e: &Engine| e.phases.iter().map(|&(s, _)| s).sum::<u64>();
        for e in engines {
            assert_eq!(e.phases.iter().map(|&(_, b)| b).max(), Some(ENGINE_PEAK));
            assert!((104..=154).contains(&secs(e)), "{e:?}");
            assert!(e.util >= 0.0297 && e.util <= 0.0974, "{e:?}");
        }
        let mean_util = engines.iter().map(|e| e.util).sum::<f64>() / 179.0;
        assert!((mean_util - 0.039).abs() < 0.0005, "{mean_util}");
        let mean_s = engines.iter().map(secs).sum::<u64>() as f64 / 179.0;
        assert!((mean_s - 135.0).abs() < 0.5, "{mean_s}");
        let mib = |pct| Mix::seed_request(pct) / MIB;
        assert_eq!(
            [0, 50, 100, 150, 200, 250, 400].map(mib),
            [6994, 10491, 13988, 17485, 20982, 24479, 32510]
        );
        let p = MemoryReplayParams::seed002(Policy::Aging, 2.0, 100);
        assert_eq!((p.jobs, p.mix.gpu_memory()), (30, 32510 * MIB));
        for seed in 0..5 {
            let jobs = draw(&p, seed);
            assert_eq!(jobs.len(), 30);
            assert_eq!(jobs[0].arrival, 0);
            for w in jobs.windows(2) {
                let gap = w[1].arrival - w[0].arrival;
                assert!(gap % 1_000_000_000 == 0 && (20..=40).contains(&(gap / 1_000_000_000)));
            }
            for j in &jobs {
                assert_eq!((j.cap, j.peak), (13988 * MIB, ENGINE_PEAK));
                // Each job is one measured engine: its phases, runtime and demand.
                let same = |e: &Engine| {
                    e.util == j.demand
                        && e.phases
                            .iter()
                            .map(|&(_, b)| b)
                            .eq(j.phases.iter().copied())
                        && secs(e) * 1_000_000_000 == j.runtime
                };
                assert!(engines.iter().any(same), "{j:?}");
            }
        }
    }

    /// Engines sharing a GPU progress 1 / (1 + 0.07 × others running) as fast; the synthetic
    /// mix's jobs only by their water-filled shares.
    #[test]
    fn sharing_engines_slow_each_other_as_the_seed_measured() {
        let p = MemoryReplayParams::seed002(Policy::Aging, 2.0, 0);
        let mut jobs = draw(&p, 0);
        jobs.truncate(4);
        for j in &mut jobs {
            j.gpu = Some(0);
        }
        let oc = Overcommit::new(p.overcommit, vec![V100_MEMORY]);
        let r = rates(&jobs, &oc, 1, p.mix.interference());
        assert_eq!(r.len(), 4);
        for (_, rate) in r {
            assert!((rate - 1.0 / 1.21).abs() < 1e-12, "{rate}");
        }
        let r = rates(&jobs, &oc, 1, Mix::Synthetic.interference());
        assert!(r.values().all(|&rate| rate == 1.0), "{r:?}");
    }

    /// With the seed's engines the caps, not the use, sum past the GPU: caps held to it admit
    /// what they hold, overcommitted caps 1.5–2× it, while the running engines' peaks stay
    /// within it; one job at a time never shares.
    #[test]
    fn seed002_caps_sum_past_the_gpu_and_the_peaks_do_not() {
        let p = MemoryReplayParams {
            seeds: 3,
            ..MemoryReplayParams::seed002(Policy::Aging, 2.0, 100)
        };
        let r = replay(&p);
        let (s, o, one) = (&r.static_caps, &r.overcommitted, &r.one_at_a_time);
        assert!(s.max_caps_over_memory <= 1.0, "{s:?}");
        assert!(
            o.max_caps_over_memory > 1.5 && o.max_caps_over_memory <= 2.0,
            "{o:?}"
        );
        assert!(o.max_peaks_over_memory <= 1.0, "{o:?}");
        assert!(one.max_caps_over_memory < 0.5, "{one:?}");
        for m in [s, o, one] {
            assert_eq!(m.out_of_memory, 0);
            assert!(m.gpu_utilisation > 0.0 && m.gpu_utilisation < 0.5, "{m:?}");
        }
    }

    /// Engines asking for more than they use finish sooner with overcommitted caps: the
    /// caps held to the GPU leave its memory and its time idle.
    #[test]
    fn overprovisioned_engines_finish_sooner_with_overcommitted_caps() {
        for r in [1.5, 2.0] {
            let p = MemoryReplayParams {
                seeds: 5,
                ..MemoryReplayParams::seed002(Policy::Aging, r, 100)
            };
            let res = replay(&p);
            assert!(res.completion_reduction >= 0.15, "{res:#?}");
            assert!(res.memory_utilisation_gain >= 0.10, "{res:#?}");
            assert_eq!(res.overcommitted.out_of_memory, 0);
            assert_eq!(res.overcommitted.swap_outs, 0.0, "their use fits: {res:#?}");
        }
    }

    /// Admitting past the GPU's memory only into the GPU time the running jobs leave: the
    /// default mix (GPU time already taken) comes out no later than with caps held to the GPU
    /// in any draw, and GPU-light jobs keep their gain.
    #[test]
    fn gpu_time_admission_never_makes_the_default_mix_later() {
        for r in [1.5, 2.0] {
            let p = MemoryReplayParams {
                seeds: 10,
                admission: OvercommitAdmission::GpuTime,
                ..MemoryReplayParams::new(Policy::Aging, r)
            };
            let res = replay(&p);
            for &(seed, s, o) in &res.per_seed {
                assert!(o <= s * 1.001, "draw {seed}: {o} s against {s} s");
            }
            assert_eq!(res.overcommitted.out_of_memory, 0);
            let caps = replay(&MemoryReplayParams {
                admission: OvercommitAdmission::Caps,
                ..p.clone()
            });
            assert!(
                caps.completion_reduction < 0.0,
                "caps alone: later {caps:#?}"
            );
            let light = replay(&MemoryReplayParams {
                gpu_demand: (0.1, 0.3),
                mean_interarrival_s: 98.0,
                ..p
            });
            assert!(light.completion_reduction >= 0.15, "{light:#?}");
            assert!(light.memory_utilisation_gain >= 0.10, "{light:#?}");
        }
    }
}
