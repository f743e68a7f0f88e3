//! The placement policies: whether one GPU can take a pod, and how well it fits there. Pure
//! functions of the books at an instant (seconds, virtual in the replay, wall-clock in the
//! extender), shared by the extender and the replay so that the replay measures the code that
//! places pods.
//!
//! Memory is in one unit throughout (bytes in the extender, MiB in the replay).

use crate::seed;

/// How a GPU's memory is judged free. `requests`, `oracle`, `seed` and `predicted` differ only
/// in what they believe each pod will use; `whole-gpu` is Kubernetes' default (one pod per GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// One pod per GPU, whatever it asks (`nvidia.com/gpu: 1`).
    WholeGpu,
    /// Each pod by its memory cap (Alibaba's gpushare-scheduler-extender: best fit on caps).
    Requests,
    /// Each pod by its true peak, known in advance (the replay only: the limit of prediction).
    Oracle,
    /// The resource-aware GPU scheduler this work builds on, as published: caps, else the
    /// GPU's measured use (80th percentile or an AR(1) forecast), one placement per 6 s.
    Seed,
    /// gpushare's: each pod by its observed peak plus a learnt margin once its use has settled;
    /// until then by the settled peaks of pods of its kind plus that margin, else its cap.
    Predicted,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::WholeGpu => "whole-gpu",
            Policy::Requests => "requests",
            Policy::Oracle => "oracle",
            Policy::Seed => "seed",
            Policy::Predicted => "predicted",
        }
    }

    /// Whether the extender ranks nodes: `requests` leaves that to kube-scheduler, as
    /// Alibaba's extender (filter and bind only) does; `seed` ranks at random, as published.
    pub fn ranks_nodes(self) -> bool {
        matches!(self, Policy::Oracle | Policy::Predicted)
    }
}

/// How long a pod's use must not have grown (and it must have run) before `predicted` trusts
/// its observed peak: the seed's own observation window.
pub const SETTLE_S: f64 = 20.0;
/// The margin `predicted` starts with, before any misprediction was seen.
pub const INITIAL_MARGIN: f64 = 0.05;
/// The seed's pause after each placement.
pub const SEED_PAUSE_S: f64 = 6.0;

/// What a pod is an instance of, for `predicted`: pods of one kind (in the extender: one
/// namespace, the same container images, units and memory cap) are expected to use alike.
pub type Kind = u64;

/// What the books saw of one pod's memory use.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    pub placed_at: f64,
    /// The highest use seen.
    pub peak: u64,
    /// When the use last rose above the peak (the placement time before any sample).
    pub grew_at: f64,
    pub kind: Option<Kind>,
    /// It grew past what its kind predicted before it settled: it counts at its cap until
    /// it settles.
    pub beyond_kind: bool,
}

impl Observed {
    pub fn new(placed_at: f64, kind: Option<Kind>) -> Observed {
        Observed {
            placed_at,
            peak: 0,
            grew_at: placed_at,
            kind,
            beyond_kind: false,
        }
    }

    /// Whether the use has been flat (not above its peak) for [`SETTLE_S`]. A pod never seen
    /// holding memory has not settled: its GPU work has not begun (it may still be loading).
    pub fn settled(&self, now: f64) -> bool {
        self.peak > 0 && now - self.grew_at >= SETTLE_S && now - self.placed_at >= SETTLE_S
    }

    /// Take in a sample of the pod's use. A pod found above what `predicted` counted it at
    /// (a settled pod above its own peak with the margin, or a new one above its kind's) is a
    /// misprediction: the margin grows to cover it, and the pod counts at its cap until it
    /// settles anew. A settled pod's peak teaches its kind.
    pub fn observe(&mut self, used: u64, now: f64, learner: &mut Learner) {
        if used > self.peak {
            let settled = self.settled(now);
            let believed = if settled {
                Some(self.peak)
            } else if !settled && !self.beyond_kind {
                self.kind.and_then(|k| learner.kinds.get(&k).copied())
            } else {
                None
            };
            if let Some(base) = believed
                && used > learner.with_margin(base)
            {
                learner.mispredictions += 1;
                learner.margin = learner.margin.max(used as f64 / base as f64 - 1.0);
                self.beyond_kind = !settled;
            }
            self.peak = used;
            self.grew_at = now;
        }
        if self.settled(now) {
            self.beyond_kind = false;
            if let Some(k) = self.kind {
                let p = learner.kinds.entry(k).or_default();
                *p = (*p).max(self.peak);
            }
        }
    }
}

/// What `predicted` learnt: the margin it adds to observed peaks (the largest relative
/// misprediction seen), and each kind's largest settled peak.
#[derive(Debug, Clone, PartialEq)]
pub struct Learner {
    pub margin: f64,
    pub mispredictions: u64,
    pub kinds: std::collections::BTreeMap<Kind, u64>,
}

impl Default for Learner {
    fn default() -> Self {
        Learner {
            margin: INITIAL_MARGIN,
            mispredictions: 0,
            kinds: Default::default(),
        }
    }
}

impl Learner {
    /// `peak` with the margin.
    pub fn with_margin(&self, peak: u64) -> u64 {
        (peak as f64 * (1.0 + self.margin)).ceil() as u64
    }

    /// What a pod of `kind` not yet settled is expected to use at most: its kind's largest
    /// settled peak with the margin; `None` before any pod of its kind settled.
    pub fn of_kind(&self, kind: Option<Kind>) -> Option<u64> {
        kind.and_then(|k| self.kinds.get(&k))
            .map(|&p| self.with_margin(p))
    }
}

/// One pod on a GPU, as the books know it.
#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    pub units: u32,
    /// Its memory cap (`gpushare.io/gpu-memory`, else units / 100 of the GPU).
    pub cap: u64,
    /// Its true peak: only the replay knows it (for `oracle`).
    pub peak: Option<u64>,
    pub observed: Observed,
}

impl Tenant {
    /// What `policy` believes this pod will use at most.
    pub fn estimate(&self, policy: Policy, now: f64, learner: &Learner) -> u64 {
        match policy {
            Policy::WholeGpu | Policy::Requests | Policy::Seed => self.cap,
            Policy::Oracle => self.peak.unwrap_or(self.cap),
            Policy::Predicted => {
                let o = &self.observed;
                if o.settled(now) {
                    learner.with_margin(o.peak).min(self.cap)
                } else if o.beyond_kind {
                    self.cap
                } else {
                    learner
                        .of_kind(o.kind)
                        .map_or(self.cap, |k| k.max(o.peak).min(self.cap))
                }
            }
        }
    }
}

/// One GPU's books.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuBook {
    pub memory: u64,
    pub units: u32,
    pub tenants: Vec<Tenant>,
}

impl GpuBook {
    pub fn units_used(&self) -> u32 {
        self.tenants.iter().map(|t| t.units).sum()
    }

    /// Memory `policy` believes the tenants will hold at most.
    pub fn committed(&self, policy: Policy, now: f64, learner: &Learner) -> u64 {
        self.tenants
            .iter()
            .map(|t| t.estimate(policy, now, learner))
            .sum()
    }
}

/// What a new pod asks of one GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    pub units: u32,
    pub cap: u64,
    /// Its true peak (the replay's `oracle` only).
    pub peak: Option<u64>,
    pub kind: Option<Kind>,
}

/// How a GPU would be left by a placement (for ranking).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    pub free_units: u32,
    pub free_memory: u64,
    pub units: u32,
    pub memory: u64,
}

impl Fit {
    /// Best fit: the fuller the GPU is left, the better, with a bonus for filling its units
    /// exactly (closing a fragment rather than leaving one). In [0, 1].
    pub fn score(&self) -> f64 {
        let units = 1.0 - f64::from(self.free_units) / f64::from(self.units.max(1));
        let memory = 1.0 - self.free_memory as f64 / self.memory.max(1) as f64;
        let closed = if self.free_units == 0 { 1.0 } else { 0.0 };
        0.4 * units + 0.4 * memory + 0.2 * closed
    }
}

/// A node's room besides its GPUs' memory: its GPU units, CPU and memory, free of the total
/// (CPU and memory as kube-scheduler books them: pods' requests against the node's
/// allocatable; a total of 0: not constrained).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRoom {
    pub units: u32,
    pub units_free: u32,
    pub cpu: u64,
    pub cpu_free: u64,
    pub mem: u64,
    pub mem_free: u64,
}

impl NodeRoom {
    /// The room left once a pod asking `units` of GPU, `cpu` and `mem` is placed.
    pub fn taking(&self, units: u32, cpu: u64, mem: u64) -> NodeRoom {
        NodeRoom {
            units_free: self.units_free.saturating_sub(units),
            cpu_free: self.cpu_free.saturating_sub(cpu),
            mem_free: self.mem_free.saturating_sub(mem),
            ..*self
        }
    }

    /// GPUs' worth of free units the node lacks CPU or memory for, were later pods to ask
    /// CPU and memory per GPU as the node offers them: its free share of units beyond its
    /// free share of CPU (or memory, whichever is less).
    pub fn stranded(&self) -> f64 {
        let share = |free: u64, total: u64| {
            if total == 0 {
                1.0
            } else {
                free as f64 / total as f64
            }
        };
        let units = share(self.units_free.into(), self.units.into());
        let other = share(self.cpu_free, self.cpu).min(share(self.mem_free, self.mem));
        (units - other).max(0.0) * f64::from(self.units) / 100.0
    }
}

/// The extender's rank of a node, 0–10: how well its best GPU fits the pod (`fit`, a
/// [`Fit::score`]), less the GPUs the placement would newly strand there for lack of CPU or
/// memory ([`NodeRoom::stranded`] of the node's room `(before, after)` it; `None`: unknown, not
/// counted). Ranking by GPU fit alone packs pods onto nodes whatever CPU and memory they take,
/// and a node whose CPU or memory runs out first keeps GPUs no later pod can use; with the
/// term, a pod asking much CPU or memory per unit of GPU goes where they are to spare.
pub fn rank(fit: f64, node: Option<(&NodeRoom, &NodeRoom)>) -> u64 {
    let strands = node.map_or(0.0, |(before, after)| {
        (after.stranded() - before.stranded()).max(0.0)
    });
    ((fit - strands).max(0.0) * 10.0).round() as u64
}

/// Inputs of the seed's check besides the books: the GPU's memory in use, one sample a second
/// over the window since the last placement (at least 20 s).
pub struct SeedWindow<'a> {
    pub used: &'a [f64],
}

/// Why a GPU cannot take a pod.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Refusal {
    /// `whole-gpu`: another pod has it.
    InUse,
    Units {
        free: u32,
        total: u32,
        asked: u32,
    },
    Memory {
        asked: u64,
        free: u64,
        total: u64,
        policy: Policy,
    },
    /// `seed`: no samples of the GPU's use.
    NoMeasurements,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::InUse => write!(f, "GPU in use (one pod per GPU)"),
            Refusal::Units { free, total, asked } => {
                write!(f, "{free} of {total} units free, {asked} asked")
            }
            Refusal::Memory {
                asked,
                free,
                total,
                policy,
            } => write!(
                f,
                "{asked} of memory asked, {free} free of {total} by the {} policy",
                policy.name()
            ),
            Refusal::NoMeasurements => write!(f, "no measurements of the GPU's memory"),
        }
    }
}

/// Whether `gpu` can take `demand` under `policy` at `now`; how it would be left if so, or why
/// not.
pub fn admit(
    policy: Policy,
    gpu: &GpuBook,
    demand: &Demand,
    now: f64,
    learner: &Learner,
    window: Option<&SeedWindow>,
) -> Result<Fit, Refusal> {
    if policy == Policy::WholeGpu {
        if !gpu.tenants.is_empty() {
            return Err(Refusal::InUse);
        }
        return Ok(Fit {
            free_units: 0,
            free_memory: 0,
            units: gpu.units,
            memory: gpu.memory,
        });
    }
    let used_units = gpu.units_used();
    if used_units + demand.units > gpu.units {
        return Err(Refusal::Units {
            free: gpu.units.saturating_sub(used_units),
            total: gpu.units,
            asked: demand.units,
        });
    }
    let committed = gpu.committed(policy, now, learner);
    let asked = match policy {
        Policy::Oracle => demand.peak.unwrap_or(demand.cap),
        Policy::Predicted => learner
            .of_kind(demand.kind)
            .map_or(demand.cap, |k| k.min(demand.cap)),
        _ => demand.cap,
    };
    let free = gpu.memory.saturating_sub(committed);
    let fits = match policy {
        Policy::Seed if asked > free => {
            let w = window.ok_or(Refusal::NoMeasurements)?;
            seed::admits(asked as f64, gpu.memory as f64, w.used)
        }
        _ => asked <= free,
    };
    if !fits {
        return Err(Refusal::Memory {
            asked,
            free,
            total: gpu.memory,
            policy,
        });
    }
    Ok(Fit {
        free_units: gpu.units - used_units - demand.units,
        free_memory: free.saturating_sub(asked),
        units: gpu.units,
        memory: gpu.memory,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tenant(units: u32, cap: u64, placed: f64) -> Tenant {
        Tenant {
            units,
            cap,
            peak: None,
            observed: Observed::new(placed, None),
        }
    }

    fn gpu(tenants: Vec<Tenant>) -> GpuBook {
        GpuBook {
            memory: 32_000,
            units: 100,
            tenants,
        }
    }

    #[test]
    fn a_new_pod_counts_at_its_cap_until_its_use_has_settled() {
        let mut l = Learner::default();
        let mut t = tenant(10, 24_000, 0.0);
        assert_eq!(t.estimate(Policy::Predicted, 0.0, &l), 24_000);
        for s in 0..30 {
            let used = if s < 10 { 300 } else { 7_000 };
            t.observed.observe(used, s as f64, &mut l);
        }
        // Grew at 10 s: not settled at 29 s, settled at 30 s.
        assert_eq!(t.estimate(Policy::Predicted, 29.0, &l), 24_000);
        assert_eq!(t.estimate(Policy::Predicted, 30.0, &l), 7_350);
        assert_eq!(l.mispredictions, 0);
        // It grows past its estimate: a misprediction; it counts at its cap until it settles
        // again, and the margin covers the error from then on.
        t.observed.observe(8_400, 31.0, &mut l);
        assert_eq!(l.mispredictions, 1);
        assert!((l.margin - 0.2).abs() < 1e-9, "{}", l.margin);
        assert_eq!(t.estimate(Policy::Predicted, 32.0, &l), 24_000);
        assert_eq!(t.estimate(Policy::Predicted, 51.0, &l), 10_080);
    }

    #[test]
    fn a_pod_not_yet_seen_holding_memory_counts_at_its_cap_however_long_it_ran() {
        let mut l = Learner::default();
        let mut t = tenant(10, 24_000, 0.0);
        t.observed.kind = Some(3);
        for s in 0..=60 {
            t.observed.observe(0, s as f64, &mut l);
        }
        assert_eq!(t.estimate(Policy::Predicted, 60.0, &l), 24_000);
        assert_eq!(l.of_kind(Some(3)), None, "its kind learns nothing from it");
    }

    #[test]
    fn each_policy_judges_memory_by_its_own_estimate() {
        let mut t = tenant(10, 24_000, 0.0);
        t.peak = Some(7_000);
        let mut l = Learner::default();
        for s in 0..=40 {
            t.observed.observe(7_000, s as f64, &mut l);
        }
        let g = gpu(vec![t]);
        let d = Demand {
            units: 10,
            cap: 20_000,
            peak: Some(7_000),
            kind: None,
        };
        assert!(admit(Policy::Requests, &g, &d, 40.0, &l, None).is_err());
        assert!(admit(Policy::Oracle, &g, &d, 40.0, &l, None).is_ok());
        assert!(admit(Policy::Predicted, &g, &d, 40.0, &l, None).is_ok());
        assert!(admit(Policy::Predicted, &g, &d, 10.0, &l, None).is_err());
        assert!(admit(Policy::WholeGpu, &g, &d, 40.0, &l, None).is_err());
        let e = admit(Policy::Seed, &g, &d, 40.0, &l, None).unwrap_err();
        assert_eq!(e, Refusal::NoMeasurements);
        let used = vec![7_000.0; 21];
        let w = SeedWindow { used: &used };
        assert!(admit(Policy::Seed, &g, &d, 40.0, &l, Some(&w)).is_ok());
    }

    #[test]
    fn units_bind_whatever_the_memory() {
        let g = gpu(vec![tenant(70, 1, 0.0)]);
        let d = Demand {
            units: 40,
            cap: 1,
            peak: Some(1),
            kind: None,
        };
        for p in [Policy::Requests, Policy::Oracle, Policy::Predicted] {
            let e = admit(p, &g, &d, 100.0, &Learner::default(), None).unwrap_err();
            assert!(e.to_string().contains("30 of 100 units free"), "{e}");
        }
    }

    #[test]
    fn best_fit_prefers_the_fuller_gpu_and_a_closed_fragment() {
        let l = Learner::default();
        let d = Demand {
            units: 30,
            cap: 3_000,
            peak: None,
            kind: None,
        };
        let empty = admit(Policy::Requests, &gpu(vec![]), &d, 0.0, &l, None).unwrap();
        let half = admit(
            Policy::Requests,
            &gpu(vec![tenant(50, 16_000, 0.0)]),
            &d,
            0.0,
            &l,
            None,
        )
        .unwrap();
        let exact = admit(
            Policy::Requests,
            &gpu(vec![tenant(70, 16_000, 0.0)]),
            &d,
            0.0,
            &l,
            None,
        )
        .unwrap();
        assert!(half.score() > empty.score());
        assert!(exact.score() > half.score());
    }

    #[test]
    fn a_new_pod_counts_as_its_kind_once_one_of_its_kind_has_settled() {
        let mut l = Learner::default();
        let kind = Some(7);
        let mut first = tenant(10, 24_000, 0.0);
        first.observed.kind = kind;
        let d = Demand {
            units: 10,
            cap: 24_000,
            peak: None,
            kind,
        };
        // Nothing of its kind settled yet: a new pod needs its cap free.
        let g = gpu(vec![first.clone()]);
        assert!(admit(Policy::Predicted, &g, &d, 5.0, &l, None).is_err());
        for s in 0..=30 {
            first
                .observed
                .observe(if s < 5 { 500 } else { 7_000 }, s as f64, &mut l);
        }
        assert_eq!(l.of_kind(kind), Some(7_350));
        assert_eq!(l.of_kind(Some(8)), None, "another kind learns nothing");
        // Now a new pod of that kind counts at 7_350, settled or not: four fit on 32_000.
        let mut tenants = vec![first];
        for k in 1..4 {
            let g = gpu(tenants.clone());
            let fit = admit(Policy::Predicted, &g, &d, 31.0, &l, None).unwrap();
            assert_eq!(fit.free_memory, 32_000 - 7_350 * (k + 1));
            let mut t = tenant(10, 24_000, 31.0);
            t.observed.kind = kind;
            assert_eq!(t.estimate(Policy::Predicted, 31.0, &l), 7_350);
            tenants.push(t);
        }
        assert!(admit(Policy::Predicted, &gpu(tenants.clone()), &d, 31.0, &l, None).is_err());
        // One of them grows past its kind's estimate before settling: a misprediction; it
        // counts at its cap until it settles, and the margin covers the error from then on.
        tenants[3].observed.observe(8_400, 32.0, &mut l);
        assert_eq!(l.mispredictions, 1);
        assert!((l.margin - 0.2).abs() < 1e-9, "{}", l.margin);
        assert_eq!(tenants[3].estimate(Policy::Predicted, 33.0, &l), 24_000);
        assert_eq!(tenants[2].estimate(Policy::Predicted, 33.0, &l), 8_400);
        for s in 33..=60 {
            tenants[3].observed.observe(8_400, s as f64, &mut l);
        }
        assert_eq!(tenants[3].estimate(Policy::Predicted, 60.0, &l), 10_080);
        assert_eq!(
            l.of_kind(kind),
            Some(10_080),
            "the kind's peak rose with it"
        );
    }

    fn room(units: u32, units_free: u32, cpu: u64, cpu_free: u64) -> NodeRoom {
        NodeRoom {
            units,
            units_free,
            cpu,
            cpu_free,
            mem: 0,
            mem_free: 0,
        }
    }

    #[test]
    fn a_node_whose_cpu_runs_out_before_its_gpus_strands_them() {
        // Eight GPUs, 96 cores: half the GPUs free with a quarter of the CPU strands two.
        let r = room(800, 400, 96_000, 24_000);
        assert!((r.stranded() - 2.0).abs() < 1e-9, "{}", r.stranded());
        // CPU to spare, or nothing constrained: nothing stranded.
        assert_eq!(room(800, 400, 96_000, 60_000).stranded(), 0.0);
        assert_eq!(room(800, 400, 0, 0).stranded(), 0.0);
        // A share of a GPU with 14 of the 15 cores left strands the node's other GPU, and
        // ranks below the empty GPU of a node with CPU to spare, though it fits better.
        let lean = room(200, 150, 16_000, 15_000);
        let rich = room(100, 100, 64_000, 24_000);
        let closing = rank(1.0, Some((&lean, &lean.taking(50, 14_000, 0))));
        let spare = rank(0.4, Some((&rich, &rich.taking(50, 14_000, 0))));
        assert!(spare > closing, "{spare} {closing}");
        // Unknown room: the fit alone.
        assert_eq!(rank(1.0, None), 10);
    }

    proptest! {
        /// Whatever was observed, `predicted` never believes a pod needs more than its cap nor
        /// less than its observed peak once settled; and an admitted pod leaves the GPU's
        /// units and its estimated memory within the GPU.
        #[test]
        fn estimates_stay_between_peak_and_cap(
            samples in proptest::collection::vec(0u64..40_000, 1..80),
            cap in 1u64..40_000,
            units in 1u32..=100,
            ask_units in 1u32..=100,
            ask_cap in 1u64..40_000,
        ) {
            let mut l = Learner::default();
            let mut t = tenant(units, cap, 0.0);
            for (s, u) in samples.iter().enumerate() {
                t.observed.observe(*u, s as f64, &mut l);
                let e = t.estimate(Policy::Predicted, s as f64, &l);
                prop_assert!(e <= cap);
                if t.observed.settled(s as f64) {
                    prop_assert!(e >= t.observed.peak.min(cap));
                }
            }
            let now = samples.len() as f64;
            let g = gpu(vec![t]);
            let d = Demand { units: ask_units, cap: ask_cap, peak: None, kind: None };
            for p in [Policy::Requests, Policy::Predicted] {
                if let Ok(fit) = admit(p, &g, &d, now, &l, None) {
                    prop_assert!(g.units_used() + ask_units <= g.units);
                    prop_assert!(g.committed(p, now, &l) + ask_cap <= g.memory);
                    prop_assert_eq!(fit.free_units, g.units - g.units_used() - ask_units);
                }
            }
        }

        /// The stranding term only ever lowers a node's rank, and leaves it as the GPU's fit
        /// alone where the node's CPU and memory are not constrained or the pod strands
        /// nothing.
        #[test]
        fn stranding_only_lowers_a_rank(
            fit in 0.0f64..=1.0,
            gpus in 1u32..=8,
            used in 0u32..=800,
            units in 0u32..=100,
            cpu in 1u64..200_000,
            cpu_used in 0u64..200_000,
            ask_cpu in 0u64..50_000,
        ) {
            let total = 100 * gpus;
            let before = room(total, total - used.min(total), cpu, cpu.saturating_sub(cpu_used));
            let after = before.taking(units, ask_cpu, 0);
            prop_assert!(rank(fit, Some((&before, &after))) <= rank(fit, None));
            let free = room(total, before.units_free, 0, 0);
            let free_after = free.taking(units, ask_cpu, 0);
            prop_assert_eq!(rank(fit, Some((&free, &free_after))), rank(fit, None));
            if after.stranded() <= before.stranded() {
                prop_assert_eq!(rank(fit, Some((&before, &after))), rank(fit, None));
            }
        }
    }
}
