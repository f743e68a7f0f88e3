//! The extender's books: per node, per GPU, the units committed, the memory caps and each
//! pod's memory in use over time. Rebuilt at every question from what the API server says
//! (which pods are bound where, their units, caps and chosen GPUs) and what each node's
//! gpushare reports (its GPUs, the units its kubelet assigned, where each pod's memory is and
//! how much), never from the extender's own memory alone: its only state of its own is what it
//! observed of each pod's use (for `predicted`), the GPUs' use over time (for `seed`), and the
//! bindings it made that the API server has not shown yet.
//!
//! Pure: the I/O shell (`serve.rs`) feeds it and asks it.

use crate::policy::{
    self, Demand, Fit, GpuBook, Kind, Learner, Observed, Policy, SeedWindow, Tenant,
};
use crate::report::NodeReport;
use k8s_openapi::api::core::v1::Pod;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

pub const RESOURCE: &str = "gpushare.io/gpu-share";
/// The GPU(s) the extender chose, by UUID (comma-separated for whole GPUs); the device
/// manager hands the pod units of exactly these.
pub const GPU_ANNOTATION: &str = "gpushare.io/gpu";
pub const MEMORY_ANNOTATION: &str = "gpushare.io/gpu-memory";
pub const UNITS_PER_GPU: u32 = 100;
/// How long the GPUs' use is kept for `seed` (its window runs from the last placement).
const SERIES_KEEP_S: f64 = 3600.0;
/// How long the units of a pod gone from the API server stay free while its node still counts
/// them (its kubelet lets go of them within seconds); past this they count as unexplained.
const DEPARTED_KEEP_S: f64 = 60.0;

/// What the books need of a pod.
#[derive(Debug, Clone, PartialEq)]
pub struct PodInfo {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub node: Option<String>,
    pub units: u32,
    /// `gpushare.io/gpu-memory`, when valid.
    pub memory: Option<u64>,
    /// `gpushare.io/gpu`, as written.
    pub gpus: Vec<String>,
    /// Ended, or being deleted: its memory is free for the next pod at once.
    pub gone: bool,
    /// Its namespace, container images, units and memory annotation (hashed): `predicted`
    /// expects pods of one kind to use alike.
    pub kind: Kind,
}

/// FNV-1a: a hash that is the same in every process and run.
fn fnv(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The pod's units of `gpushare.io/gpu-share` (limits, else requests, summed over its
/// containers); `None` when it asks for none.
pub fn pod_info(p: &Pod) -> Result<Option<PodInfo>, String> {
    let spec = p.spec.as_ref().ok_or("pod without a spec")?;
    let mut units: u64 = 0;
    for c in &spec.containers {
        let r = c.resources.as_ref();
        let q = r
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get(RESOURCE))
            .or_else(|| {
                r.and_then(|r| r.requests.as_ref())
                    .and_then(|l| l.get(RESOURCE))
            });
        if let Some(q) = q {
            let n: u64 = q.0.trim().parse().map_err(|_| {
                format!(
                    "container {:?} asks for {RESOURCE} {:?}: write a whole number of units",
                    c.name, q.0
                )
            })?;
            units += n;
        }
    }
    if units == 0 {
        return Ok(None);
    }
    let units = u32::try_from(units)
        .ok()
        .filter(|u| *u <= 64 * UNITS_PER_GPU)
        .ok_or_else(|| format!("{units} units of {RESOURCE} is more than any node has"))?;
    let m = &p.metadata;
    let ann = m.annotations.clone().unwrap_or_default();
    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
    let namespace = m.namespace.clone().unwrap_or_else(|| "default".into());
    let images = spec
        .containers
        .iter()
        .map(|c| c.image.as_deref().unwrap_or(""));
    let kind = fnv(std::iter::once(namespace.as_str())
        .chain(images)
        .chain([
            units.to_string().as_str(),
            ann.get(MEMORY_ANNOTATION).map_or("", String::as_str),
        ])
        .flat_map(|s| s.bytes().chain([0])));
    Ok(Some(PodInfo {
        uid: m.uid.clone().unwrap_or_default(),
        namespace,
        name: m.name.clone().unwrap_or_default(),
        node: spec.node_name.clone().filter(|n| !n.is_empty()),
        units,
        memory: ann
            .get(MEMORY_ANNOTATION)
            .and_then(|v| gpushare_units::parse_quantity(v).ok()),
        gpus: ann
            .get(GPU_ANNOTATION)
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default(),
        gone: m.deletion_timestamp.is_some() || matches!(phase, Some("Succeeded" | "Failed")),
        kind,
    }))
}

impl PodInfo {
    /// Whole GPUs it needs (0: a share of one), or why it cannot be placed.
    pub fn whole_gpus(&self) -> Result<u32, String> {
        if self.units <= UNITS_PER_GPU {
            Ok(0)
        } else if self.units.is_multiple_of(UNITS_PER_GPU) {
            Ok(self.units / UNITS_PER_GPU)
        } else {
            Err(format!(
                "{} units of {RESOURCE}: above {UNITS_PER_GPU} a pod must ask for whole GPUs (a multiple of {UNITS_PER_GPU})",
                self.units
            ))
        }
    }

    /// Its memory cap on a GPU of `memory`: the annotation, else its units' share; at most
    /// the GPU's memory (as the device manager sets it).
    pub fn cap_on(&self, memory: u64, whole: bool) -> u64 {
        if whole {
            return memory;
        }
        self.memory
            .unwrap_or(memory / u64::from(UNITS_PER_GPU) * u64::from(self.units))
            .min(memory)
    }
}

#[derive(Debug, Clone, Default)]
struct NodeState {
    report: Option<NodeReport>,
    at: f64,
    error: Option<String>,
}

/// A binding the extender made that the API server has not shown yet.
#[derive(Debug, Clone)]
struct Assumed {
    pod: PodInfo,
    node: String,
}

/// A bound pod gone from the API server whose units its node may still count: free for the
/// next pod, as they were while it was being deleted, until the node's report lets go of them.
#[derive(Debug, Clone)]
struct Departed {
    pod: PodInfo,
    at: f64,
}

/// What the extender counts (its `/metrics`).
#[derive(Debug, Clone, Default)]
pub struct Counters {
    /// Per node: scrapes that failed.
    pub scrape_failures: BTreeMap<String, u64>,
    /// Per node: times it was not chosen because its metrics could not be read.
    pub unreadable: BTreeMap<String, u64>,
    pub bindings: u64,
    pub binding_errors: u64,
    pub bad_requests: u64,
    /// Pods whose `gpushare.io/gpu` annotation their node's report contradicted.
    pub annotation_conflicts: u64,
}

/// The books.
pub struct Books {
    pub policy: Policy,
    /// A node whose last good report is older than this is not chosen (seconds).
    pub stale_after: f64,
    nodes: BTreeMap<String, NodeState>,
    pods: BTreeMap<String, PodInfo>,
    observed: BTreeMap<String, Observed>,
    learner: Learner,
    series: BTreeMap<String, VecDeque<(f64, f64)>>,
    last_placement: Option<f64>,
    assumed: BTreeMap<String, Assumed>,
    departed: BTreeMap<String, Departed>,
    /// Pods whose annotation the node's report contradicts, told once each.
    conflicts: BTreeSet<String>,
    /// What the shell should log (drained by [`Books::take_warnings`]).
    warnings: Vec<String>,
    pub counters: Counters,
}

/// A node's GPUs with the pods known to be there.
struct Placed {
    books: BTreeMap<String, GpuBook>,
    /// Per GPU: units of pods being deleted.
    leaving: BTreeMap<String, u32>,
    /// Per GPU: units of departed pods.
    departed: BTreeMap<String, u32>,
}

impl Placed {
    /// Units the node's kubelet assigned on `gpu` beyond the pods known there (and those
    /// leaving it; departed ones too if `with_departed`).
    fn unexplained(&self, gpu: &str, report: &NodeReport, with_departed: bool) -> u32 {
        let credit = |m: &BTreeMap<String, u32>| m.get(gpu).copied().unwrap_or(0);
        let known = self.books.get(gpu).map_or(0, GpuBook::units_used)
            + credit(&self.leaving)
            + if with_departed {
                credit(&self.departed)
            } else {
                0
            };
        report
            .gpus
            .get(gpu)
            .map_or(0, |g| g.allocated.saturating_sub(known))
    }
}

/// Where a pod bound to a node is.
struct Located<'a> {
    gpus: Vec<&'a str>,
    /// Found there in the node's report (else: where its annotation says).
    in_report: bool,
}

/// `reported` if not empty, else `annotated` (not in the report).
fn located<'a>(reported: Vec<&'a str>, annotated: Vec<&'a str>) -> Located<'a> {
    if reported.is_empty() {
        Located {
            gpus: annotated,
            in_report: false,
        }
    } else {
        Located {
            gpus: reported,
            in_report: true,
        }
    }
}

/// Where one pod would go on one node.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub gpus: Vec<String>,
    pub score: f64,
}

impl Books {
    pub fn new(policy: Policy, stale_after: f64) -> Books {
        Books {
            policy,
            stale_after,
            nodes: BTreeMap::new(),
            pods: BTreeMap::new(),
            observed: BTreeMap::new(),
            learner: Learner::default(),
            series: BTreeMap::new(),
            last_placement: None,
            assumed: BTreeMap::new(),
            departed: BTreeMap::new(),
            conflicts: BTreeSet::new(),
            warnings: Vec::new(),
            counters: Counters::default(),
        }
    }

    /// The API server's pods, whole (after a list) at `now`: bound pods no longer listed have
    /// departed.
    pub fn set_pods(&mut self, pods: Vec<PodInfo>, now: f64) {
        let mut pods: BTreeMap<String, PodInfo> =
            pods.into_iter().map(|p| (p.uid.clone(), p)).collect();
        std::mem::swap(&mut self.pods, &mut pods);
        let gone: Vec<PodInfo> = pods
            .into_values()
            .filter(|p| !self.pods.contains_key(&p.uid))
            .collect();
        for p in gone {
            self.depart(&p.uid.clone(), Some(p), now);
        }
        self.forget_seen();
    }

    pub fn upsert_pod(&mut self, p: PodInfo) {
        self.departed.remove(&p.uid);
        self.pods.insert(p.uid.clone(), p);
        self.forget_seen();
    }

    /// A pod gone from the API server at `now`.
    pub fn remove_pod(&mut self, uid: &str, now: f64) {
        let known = self.pods.remove(uid);
        self.depart(uid, known, now);
    }

    /// Forget pod `uid` (last known as `known`), keeping its units free while its node still
    /// counts them if it was bound (or assumed bound).
    fn depart(&mut self, uid: &str, known: Option<PodInfo>, now: f64) {
        let assumed = self.assumed.remove(uid).map(|a| a.pod);
        self.observed.remove(uid);
        if let Some(mut pod) = known.filter(|p| p.node.is_some()).or(assumed) {
            pod.gone = true;
            self.departed
                .insert(uid.to_string(), Departed { pod, at: now });
        }
    }

    /// Bindings now visible in the API server need no assuming.
    fn forget_seen(&mut self) {
        let pods = &self.pods;
        self.assumed.retain(|uid, a| {
            pods.get(uid)
                .is_none_or(|p| p.node.as_ref() != Some(&a.node))
        });
        self.observed.retain(|uid, _| pods.contains_key(uid));
        self.conflicts.retain(|uid| pods.contains_key(uid));
    }

    /// A node's report (or why it could not be read) at `now`.
    pub fn node_report(&mut self, node: &str, report: Result<NodeReport, String>, now: f64) {
        let report = report.and_then(|r| r.check().map(|_| r));
        match report {
            Err(e) => {
                *self
                    .counters
                    .scrape_failures
                    .entry(node.to_string())
                    .or_default() += 1;
                self.nodes.entry(node.to_string()).or_default().error = Some(e);
            }
            Ok(r) => {
                // Each report of a pod's use goes to the pod bound here that is there (by
                // UID: a namesake being deleted is another pod), summed over its GPUs.
                let mut totals: BTreeMap<&str, f64> = BTreeMap::new();
                for ((gpu, _, _), u) in &r.pods {
                    *totals.entry(gpu.as_str()).or_default() += u.used as f64;
                }
                let mut uses: Vec<(String, Kind, u64)> = Vec::new();
                let mut conflicts: Vec<(String, String)> = Vec::new();
                for (p, at) in self.locate(node, &r) {
                    if p.gone || !at.in_report {
                        continue;
                    }
                    let used = at
                        .gpus
                        .iter()
                        .filter_map(|g| {
                            r.pods
                                .get(&(g.to_string(), p.namespace.clone(), p.name.clone()))
                        })
                        .map(|u| u.used)
                        .sum();
                    uses.push((p.uid.clone(), p.kind, used));
                    if !p.gpus.is_empty() && at.gpus.iter().any(|g| !p.gpus.iter().any(|a| a == g))
                    {
                        conflicts.push((
                            p.uid.clone(),
                            format!(
                                "pod {}/{} has {GPU_ANNOTATION}={} but node {node} reports its memory on {}: the books follow the node",
                                p.namespace,
                                p.name,
                                p.gpus.join(","),
                                at.gpus.join(",")
                            ),
                        ));
                    }
                }
                for (uid, kind, used) in uses {
                    self.observed
                        .entry(uid)
                        .or_insert_with(|| Observed::new(now, Some(kind)))
                        .observe(used, now, &mut self.learner);
                }
                for (uid, why) in conflicts {
                    if self.conflicts.insert(uid) {
                        self.counters.annotation_conflicts += 1;
                        self.warnings.push(why);
                    }
                }
                for gpu in r.gpus.keys() {
                    let s = self.series.entry(gpu.clone()).or_default();
                    s.push_back((now, totals.get(gpu.as_str()).copied().unwrap_or(0.0)));
                    while s.front().is_some_and(|(t, _)| now - t > SERIES_KEEP_S) {
                        s.pop_front();
                    }
                }
                // Departed pods' units stay free only while the node still counts units that
                // the pods known there do not explain.
                let placed = self.placed(node, &r, now);
                self.departed.retain(|_, d| {
                    d.pod.node.as_deref() != Some(node)
                        || (now - d.at <= DEPARTED_KEEP_S
                            && placed
                                .departed
                                .keys()
                                .any(|g| placed.unexplained(g, &r, false) > 0))
                });
                let state = self.nodes.entry(node.to_string()).or_default();
                state.report = Some(r);
                state.at = now;
                state.error = None;
            }
        }
    }

    /// The node's GPUs as books at `now`, or why the node cannot be judged.
    pub fn gpus_of(&self, node: &str, now: f64) -> Result<Vec<(String, GpuBook)>, String> {
        let state = self.nodes.get(node).ok_or_else(|| {
            format!("no gpushare metrics known for node {node} (is gpushare-node running there?)")
        })?;
        if let Some(e) = &state.error {
            return Err(format!("metrics of node {node} unreadable: {e}"));
        }
        let report = state
            .report
            .as_ref()
            .ok_or_else(|| format!("no metrics read from node {node} yet"))?;
        if now - state.at > self.stale_after {
            return Err(format!(
                "metrics of node {node} are {:.0} s old",
                now - state.at
            ));
        }
        let mut placed = self.placed(node, report, now);
        // Units the kubelet assigned that no known pod accounts for (pods placed by the
        // device manager's own choice before their scheduler group exists): at their share of
        // the memory, as new pods.
        let unexplained: Vec<u32> = placed
            .books
            .keys()
            .map(|g| placed.unexplained(g, report, true))
            .collect();
        for ((_, book), units) in placed.books.iter_mut().zip(unexplained) {
            if units > 0 {
                book.tenants.push(Tenant {
                    units,
                    cap: book.memory / u64::from(book.units.max(1)) * u64::from(units),
                    peak: None,
                    observed: Observed::new(now, None),
                });
            }
        }
        Ok(placed.books.into_iter().collect())
    }

    /// The node's healthy GPUs with the pods the API server (and the extender's own bindings)
    /// place there, by `report` at `now`.
    fn placed(&self, node: &str, report: &NodeReport, now: f64) -> Placed {
        let mut placed = Placed {
            books: report
                .gpus
                .iter()
                .filter(|(_, g)| g.units > 0)
                .map(|(uuid, g)| {
                    (
                        uuid.clone(),
                        GpuBook {
                            memory: g.memory,
                            units: g.units,
                            tenants: Vec::new(),
                        },
                    )
                })
                .collect(),
            leaving: BTreeMap::new(),
            departed: BTreeMap::new(),
        };
        for (p, at) in self.locate(node, report) {
            let whole = at.gpus.len() > 1 || p.units > UNITS_PER_GPU;
            for g in at.gpus {
                let Some(book) = placed.books.get_mut(g) else {
                    continue;
                };
                let units = if whole { book.units } else { p.units };
                if p.gone {
                    // The kubelet may still count its units; the books do not.
                    let credit = if self.departed.contains_key(&p.uid) {
                        &mut placed.departed
                    } else {
                        &mut placed.leaving
                    };
                    *credit.entry(g.to_string()).or_default() += units;
                    continue;
                }
                book.tenants.push(Tenant {
                    units,
                    cap: p.cap_on(book.memory, whole),
                    peak: None,
                    observed: self
                        .observed
                        .get(&p.uid)
                        .cloned()
                        .unwrap_or_else(|| Observed::new(now, Some(p.kind))),
                });
            }
        }
        placed
    }

    /// Every pod bound (or assumed bound, or departed) to `node`, with the GPUs it is on. The
    /// node's report wins over the `gpushare.io/gpu` annotation: a pod's memory is where the
    /// report finds it (the device manager falls back to its own choice when the recorded GPU
    /// cannot take the pod); a pod not in the report yet is where its annotation says. The
    /// report names pods by namespace and name, so namesakes — a pod deleted and recreated
    /// under its name while the old one still holds its GPU — share the GPUs reported under
    /// that name: the leaving one takes those its annotation names, the other the rest (or,
    /// with none left, those its own annotation names).
    fn locate<'a>(&'a self, node: &str, report: &'a NodeReport) -> Vec<(&'a PodInfo, Located<'a>)> {
        let on_node = |p: &&PodInfo| p.node.as_deref() == Some(node);
        let mut by_name: BTreeMap<(&str, &str), Vec<&PodInfo>> = BTreeMap::new();
        for p in self
            .pods
            .values()
            .filter(on_node)
            .chain(self.assumed.values().map(|a| &a.pod).filter(on_node))
            .chain(self.departed.values().map(|d| &d.pod).filter(on_node))
        {
            by_name
                .entry((p.namespace.as_str(), p.name.as_str()))
                .or_default()
                .push(p);
        }
        let mut out = Vec::new();
        for ((ns, name), pods) in by_name {
            let reported: Vec<&str> = report
                .pods
                .keys()
                .filter(|(_, n, p)| n == ns && p == name)
                .map(|(g, _, _)| g.as_str())
                .collect();
            let annotated =
                |p: &'a PodInfo| -> Vec<&'a str> { p.gpus.iter().map(String::as_str).collect() };
            if let [p] = pods[..] {
                out.push((p, located(reported, annotated(p))));
                continue;
            }
            let annotated_in_report = |p: &PodInfo| -> Vec<&'a str> {
                reported
                    .iter()
                    .copied()
                    .filter(|g| p.gpus.iter().any(|a| a == g))
                    .collect()
            };
            // The leaving ones first: on the reported GPUs their annotations name.
            let mut leaving_on: Vec<&str> = Vec::new();
            for p in pods.iter().copied().filter(|p| p.gone) {
                let mine = annotated_in_report(p);
                leaving_on.extend(&mine);
                out.push((p, located(mine, annotated(p))));
            }
            // The others on the rest (the device manager may have put one elsewhere than its
            // annotation says), else beside a leaving namesake where annotated.
            let rest: Vec<&str> = reported
                .iter()
                .copied()
                .filter(|g| !leaving_on.contains(g))
                .collect();
            for p in pods.iter().copied().filter(|p| !p.gone) {
                let at = if rest.is_empty() {
                    located(annotated_in_report(p), annotated(p))
                } else {
                    Located {
                        gpus: rest.clone(),
                        in_report: true,
                    }
                };
                out.push((p, at));
            }
        }
        out
    }

    fn seed_samples(&self, gpu: &str, now: f64) -> Vec<f64> {
        let last = self.last_placement.unwrap_or(f64::NEG_INFINITY);
        let start = if now - last >= 20.0 { last } else { now - 20.0 };
        self.series
            .get(gpu)
            .map(|s| {
                s.iter()
                    .filter(|(t, _)| *t >= start)
                    .map(|(_, v)| *v)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The best GPU(s) of `node` for `pod` at `now`, or why none.
    pub fn choose(&self, pod: &PodInfo, node: &str, now: f64) -> Result<Choice, String> {
        if self.policy == Policy::Seed
            && let Some(l) = self.last_placement
            && now - l < policy::SEED_PAUSE_S
        {
            return Err(format!(
                "the seed policy places one pod per {} s",
                policy::SEED_PAUSE_S
            ));
        }
        let whole = match pod.whole_gpus()? {
            0 if self.policy == Policy::WholeGpu => 1,
            n => n,
        };
        let books = self.gpus_of(node, now)?;
        if books.is_empty() {
            return Err(format!("node {node} has no healthy GPU"));
        }
        if whole > 0 {
            let free: Vec<String> = books
                .iter()
                .filter(|(_, b)| b.tenants.is_empty())
                .map(|(u, _)| u.clone())
                .take(whole as usize)
                .collect();
            return if free.len() == whole as usize {
                Ok(Choice {
                    gpus: free,
                    score: 1.0,
                })
            } else {
                Err(format!(
                    "{whole} whole GPU(s) asked, {} free on node {node}",
                    free.len()
                ))
            };
        }
        let mut best: Option<(Fit, &str)> = None;
        let mut why = Vec::new();
        for (uuid, book) in &books {
            let demand = Demand {
                units: pod.units,
                cap: pod.cap_on(book.memory, false),
                peak: None,
                kind: Some(pod.kind),
            };
            let samples;
            let window = if self.policy == Policy::Seed {
                samples = self.seed_samples(uuid, now);
                Some(SeedWindow { used: &samples })
            } else {
                None
            };
            match policy::admit(
                self.policy,
                book,
                &demand,
                now,
                &self.learner,
                window.as_ref(),
            ) {
                Ok(fit) => {
                    let better = best.as_ref().is_none_or(|(b, _)| match self.policy {
                        Policy::Requests => fit.free_memory < b.free_memory,
                        _ => fit.score() > b.score(),
                    });
                    if better {
                        best = Some((fit, uuid));
                    }
                }
                Err(e) => why.push(format!("{uuid}: {e}")),
            }
        }
        match best {
            Some((fit, uuid)) => Ok(Choice {
                gpus: vec![uuid.to_string()],
                score: fit.score(),
            }),
            None => Err(format!(
                "no GPU of node {node} can take the pod ({})",
                why.join("; ")
            )),
        }
    }

    /// Filter: the nodes kept, and the others with why.
    pub fn filter(
        &mut self,
        pod: &PodInfo,
        nodes: &[String],
        now: f64,
    ) -> (Vec<String>, BTreeMap<String, String>) {
        let (mut ok, mut failed) = (Vec::new(), BTreeMap::new());
        for n in nodes {
            match self.choose(pod, n, now) {
                Ok(_) => ok.push(n.clone()),
                Err(e) => {
                    if self.gpus_of(n, now).is_err() {
                        *self.counters.unreadable.entry(n.clone()).or_default() += 1;
                    }
                    failed.insert(n.clone(), e);
                }
            }
        }
        (ok, failed)
    }

    /// Prioritize: 0–10 per node. `requests` and `whole-gpu` leave ranking to kube-scheduler
    /// (0 everywhere); `seed` ranks at random, as published. The books hold no node's CPU or
    /// memory (kube-scheduler names the nodes, and books those), so the rank has no
    /// stranding term here: kube-scheduler's own scores weigh CPU and memory beside it.
    pub fn prioritize(&self, pod: &PodInfo, nodes: &[String], now: f64) -> Vec<(String, i64)> {
        nodes
            .iter()
            .map(|n| {
                let score = match self.choose(pod, n, now) {
                    Ok(c) if self.policy.ranks_nodes() => policy::rank(c.score, None) as i64,
                    Ok(_) if self.policy == Policy::Seed => {
                        (fnv(n.bytes().chain(pod.uid.bytes())) % 11) as i64
                    }
                    _ => 0,
                };
                (n.clone(), score)
            })
            .collect()
    }

    /// A binding made: counted in the books until the API server shows it.
    pub fn bound(&mut self, pod: &PodInfo, node: &str, gpus: Vec<String>, now: f64) {
        let mut p = pod.clone();
        p.node = Some(node.to_string());
        p.gpus = gpus;
        self.observed
            .insert(p.uid.clone(), Observed::new(now, Some(p.kind)));
        self.assumed.insert(
            p.uid.clone(),
            Assumed {
                pod: p,
                node: node.to_string(),
            },
        );
        self.last_placement = Some(now);
        self.counters.bindings += 1;
    }

    /// A pod by namespace and name.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<&PodInfo> {
        self.pods
            .values()
            .find(|p| p.namespace == namespace && p.name == name)
    }

    /// Every node the books heard of (from reports or bound pods).
    pub fn known_nodes(&self) -> std::collections::BTreeSet<String> {
        self.nodes
            .keys()
            .cloned()
            .chain(self.pods.values().filter_map(|p| p.node.clone()))
            .collect()
    }

    /// Warnings found since the last call, for the log.
    pub fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }

    pub fn learner(&self) -> &Learner {
        &self.learner
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{GpuReport, PodUse};

    const GIB: u64 = 1 << 30;

    fn report(gpus: &[(&str, u32)], pods: &[(&str, &str, u64)]) -> NodeReport {
        NodeReport {
            gpus: gpus
                .iter()
                .map(|(u, alloc)| {
                    (
                        u.to_string(),
                        GpuReport {
                            memory: 8 * GIB,
                            units: 100,
                            allocated: *alloc,
                        },
                    )
                })
                .collect(),
            pods: pods
                .iter()
                .map(|(g, p, used)| {
                    (
                        (g.to_string(), "default".to_string(), p.to_string()),
                        PodUse {
                            used: *used,
                            cap: None,
                        },
                    )
                })
                .collect(),
        }
    }

    fn pod(name: &str, units: u32, node: Option<&str>, gpus: &[&str]) -> PodInfo {
        PodInfo {
            uid: format!("uid-{name}"),
            namespace: "default".into(),
            name: name.into(),
            node: node.map(str::to_string),
            units,
            memory: None,
            gpus: gpus.iter().map(|s| s.to_string()).collect(),
            gone: false,
            kind: fnv(name.bytes()),
        }
    }

    #[test]
    fn a_fragmented_node_is_filtered_out_and_a_fitting_one_kept() {
        let mut b = Books::new(Policy::Requests, 10.0);
        b.set_pods(
            vec![
                pod("a", 40, Some("n1"), &["GPU-a"]),
                pod("b", 40, Some("n1"), &["GPU-b"]),
            ],
            0.0,
        );
        b.node_report("n1", Ok(report(&[("GPU-a", 40), ("GPU-b", 40)], &[])), 0.0);
        b.node_report("n2", Ok(report(&[("GPU-c", 0), ("GPU-d", 0)], &[])), 0.0);
        let p = pod("new", 80, None, &[]);
        let (ok, failed) = b.filter(&p, &["n1".into(), "n2".into()], 1.0);
        assert_eq!(ok, vec!["n2".to_string()]);
        assert!(failed["n1"].contains("60 of 100 units free"), "{failed:?}");
        // A node the books have never heard of is refused, by filter and by bind alike.
        let (ok, failed) = b.filter(&p, &["n9".into()], 1.0);
        assert!(ok.is_empty());
        assert!(
            failed["n9"].contains("no gpushare metrics known"),
            "{failed:?}"
        );
        let e = b.choose(&p, "n9", 1.0).unwrap_err();
        assert!(e.contains("no gpushare metrics known for node n9"), "{e}");
    }

    #[test]
    fn a_deleted_pods_memory_is_free_at_once_and_stays_free() {
        let mut b = Books::new(Policy::Requests, 100.0);
        let mut big = pod("big", 90, Some("n1"), &["GPU-a"]);
        b.set_pods(vec![big.clone()], 0.0);
        b.node_report(
            "n1",
            Ok(report(&[("GPU-a", 90)], &[("GPU-a", "big", GIB)])),
            0.0,
        );
        let p = pod("next", 50, None, &[]);
        assert!(b.choose(&p, "n1", 1.0).is_err());
        // Deleted in the API server; the node still reports its units and memory for a while.
        big.gone = true;
        b.upsert_pod(big);
        assert_eq!(b.choose(&p, "n1", 1.0).unwrap().gpus, vec!["GPU-a"]);
        // Gone from the API server before its kubelet lets go of its units: still free.
        b.remove_pod("uid-big", 2.0);
        b.node_report(
            "n1",
            Ok(report(&[("GPU-a", 90)], &[("GPU-a", "big", GIB)])),
            2.0,
        );
        assert_eq!(b.choose(&p, "n1", 2.0).unwrap().gpus, vec!["GPU-a"]);
        // The kubelet lets go: nothing left to explain, and nothing credited any more, so units
        // the kubelet assigns afterwards that no known pod explains count again.
        b.node_report("n1", Ok(report(&[("GPU-a", 0)], &[])), 3.0);
        assert_eq!(b.choose(&p, "n1", 3.0).unwrap().gpus, vec!["GPU-a"]);
        b.node_report("n1", Ok(report(&[("GPU-a", 90)], &[])), 4.0);
        assert!(
            b.choose(&p, "n1", 4.0).is_err(),
            "units the kubelet holds, unexplained"
        );
    }

    #[test]
    fn a_departed_pods_units_count_again_if_its_node_never_lets_go() {
        let mut b = Books::new(Policy::Requests, 100.0);
        b.set_pods(vec![pod("big", 90, Some("n1"), &["GPU-a"])], 0.0);
        b.node_report("n1", Ok(report(&[("GPU-a", 90)], &[])), 0.0);
        // Missing from a fresh list: departed.
        b.set_pods(vec![], 1.0);
        let p = pod("next", 50, None, &[]);
        b.node_report("n1", Ok(report(&[("GPU-a", 90)], &[])), 1.0);
        assert!(b.choose(&p, "n1", 1.0).is_ok());
        let late = 1.0 + DEPARTED_KEEP_S + 1.0;
        b.node_report("n1", Ok(report(&[("GPU-a", 90)], &[])), late);
        assert!(b.choose(&p, "n1", late).is_err());
    }

    #[test]
    fn a_pod_bound_by_the_extender_and_deleted_before_the_watch_shows_it_is_departed() {
        let mut b = Books::new(Policy::Requests, 100.0);
        b.node_report("n1", Ok(report(&[("GPU-a", 0)], &[])), 0.0);
        let big = pod("big", 90, None, &[]);
        let c = b.choose(&big, "n1", 0.0).unwrap();
        b.bound(&big, "n1", c.gpus, 0.0);
        // The kubelet admitted it; the watch shows only its deletion.
        b.remove_pod("uid-big", 1.0);
        b.node_report("n1", Ok(report(&[("GPU-a", 90)], &[])), 1.0);
        assert!(b.choose(&pod("next", 50, None, &[]), "n1", 1.0).is_ok());
    }

    #[test]
    fn a_pod_recreated_under_its_name_is_another_pod() {
        let mut b = Books::new(Policy::Requests, 100.0);
        let mut old = pod("w", 60, Some("n1"), &["GPU-a"]);
        old.uid = "uid-w-old".into();
        b.set_pods(vec![old, pod("v", 30, Some("n1"), &["GPU-b"])], 0.0);
        let lingering = |new_w: Option<u64>| {
            let mut pods = vec![("GPU-a", "w", 2 * GIB)];
            pods.extend(new_w.map(|u| ("GPU-b", "w", u)));
            report(
                &[
                    ("GPU-a", 60),
                    ("GPU-b", if new_w.is_some() { 90 } else { 30 }),
                ],
                &pods,
            )
        };
        b.node_report("n1", Ok(lingering(None)), 0.0);
        // Force-deleted: gone from the API server while its process still holds 2 GiB and its
        // kubelet still counts its units; a new pod of the same name follows at once.
        b.remove_pod("uid-w-old", 1.0);
        let new = pod("w", 60, None, &[]);
        b.upsert_pod(new.clone());
        b.node_report("n1", Ok(lingering(None)), 1.0);
        assert!(
            !b.observed.contains_key("uid-w"),
            "the old pod's use taken for the new one's"
        );
        let c = b.choose(&new, "n1", 1.0).unwrap();
        assert_eq!(c.gpus, vec!["GPU-b"], "best fit beside v: {c:?}");
        b.bound(&new, "n1", c.gpus.clone(), 1.0);
        b.upsert_pod(pod("w", 60, Some("n1"), &["GPU-b"]));
        // The node reports both under the name w: the old one's on GPU-a, the new one's on
        // GPU-b. The new pod is one share on GPU-b (not a whole GPU on each), and GPU-a is
        // free for the next pod.
        for t in 2..=4 {
            b.node_report("n1", Ok(lingering(Some(GIB))), t as f64);
        }
        let books: BTreeMap<String, GpuBook> = b.gpus_of("n1", 4.0).unwrap().into_iter().collect();
        assert!(books["GPU-a"].tenants.is_empty(), "{:?}", books["GPU-a"]);
        assert_eq!(books["GPU-b"].units_used(), 90);
        assert_eq!(b.observed["uid-w"].peak, GIB, "only the new pod's own use");
        let z = pod("z", 30, None, &[]);
        assert_eq!(b.choose(&z, "n1", 4.0).unwrap().gpus, vec!["GPU-a"]);
        // The old process ends and the kubelet lets go: nothing changes for the new pod.
        b.node_report(
            "n1",
            Ok(report(
                &[("GPU-a", 0), ("GPU-b", 90)],
                &[("GPU-b", "w", GIB)],
            )),
            5.0,
        );
        assert!(b.departed.is_empty());
        assert_eq!(b.choose(&z, "n1", 5.0).unwrap().gpus, vec!["GPU-a"]);
        assert!(b.take_warnings().is_empty());
    }

    #[test]
    fn a_recreated_pod_the_node_placed_elsewhere_than_recorded_is_found_there() {
        let mut b = Books::new(Policy::Requests, 100.0);
        let mut old = pod("w", 60, Some("n1"), &["GPU-a"]);
        old.uid = "uid-w-old".into();
        b.set_pods(vec![old], 0.0);
        b.remove_pod("uid-w-old", 1.0);
        // The new w was recorded on GPU-a too, but the kubelet still held the old one's units
        // there: the device manager gave it GPU-b's.
        b.upsert_pod(pod("w", 60, Some("n1"), &["GPU-a"]));
        b.node_report(
            "n1",
            Ok(report(
                &[("GPU-a", 60), ("GPU-b", 60)],
                &[("GPU-a", "w", 2 * GIB), ("GPU-b", "w", GIB)],
            )),
            2.0,
        );
        let books: BTreeMap<String, GpuBook> = b.gpus_of("n1", 2.0).unwrap().into_iter().collect();
        assert!(books["GPU-a"].tenants.is_empty(), "{:?}", books["GPU-a"]);
        assert_eq!(books["GPU-b"].units_used(), 60);
        assert_eq!(b.observed["uid-w"].peak, GIB);
        assert_eq!(b.counters.annotation_conflicts, 1, "recorded on GPU-a");
    }

    #[test]
    fn a_gpu_annotation_the_node_contradicts_is_counted_where_the_node_says_and_told_once() {
        let mut b = Books::new(Policy::Requests, 100.0);
        // p was recorded on GPU-a, but the node reports its units and memory on GPU-b (the
        // device manager's own choice: the recorded GPU could not take it).
        b.set_pods(vec![pod("p", 60, Some("n1"), &["GPU-a"])], 0.0);
        let r = report(&[("GPU-a", 0), ("GPU-b", 60)], &[("GPU-b", "p", GIB)]);
        b.node_report("n1", Ok(r.clone()), 0.0);
        let books: BTreeMap<String, GpuBook> = b.gpus_of("n1", 0.0).unwrap().into_iter().collect();
        assert!(books["GPU-a"].tenants.is_empty(), "counted where annotated");
        assert_eq!(books["GPU-b"].units_used(), 60);
        let w = b.take_warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("gpushare.io/gpu=GPU-a") && w[0].contains("on GPU-b"),
            "{w:?}"
        );
        b.node_report("n1", Ok(r), 1.0);
        assert!(b.take_warnings().is_empty(), "told once");
        assert_eq!(b.counters.annotation_conflicts, 1);
        assert_eq!(
            b.choose(&pod("q", 100, None, &[]), "n1", 1.0).unwrap().gpus,
            vec!["GPU-a"]
        );
        // A pod recorded on a GPU its node does not have, not yet holding memory: its units,
        // wherever the kubelet assigned them, count there as unexplained.
        b.upsert_pod(pod("s", 30, Some("n1"), &["GPU-gone"]));
        b.node_report(
            "n1",
            Ok(report(
                &[("GPU-a", 30), ("GPU-b", 60)],
                &[("GPU-b", "p", GIB)],
            )),
            2.0,
        );
        let err = b.choose(&pod("q", 80, None, &[]), "n1", 2.0).unwrap_err();
        assert!(err.contains("70 of 100 units free"), "{err}");
    }

    #[test]
    fn a_restarted_extender_counts_no_pod_removed_before_it_started() {
        // Fresh books: the API server's list has k, not r (removed while the extender was
        // down), though r's kubelet still counts its 40 units and its process its memory.
        let mut b = Books::new(Policy::Predicted, 100.0);
        b.set_pods(vec![pod("k", 50, Some("n1"), &["GPU-a"])], 0.0);
        b.node_report(
            "n1",
            Ok(report(
                &[("GPU-a", 90)],
                &[("GPU-a", "k", GIB), ("GPU-a", "r", GIB)],
            )),
            0.0,
        );
        assert!(!b.observed.contains_key("uid-r"));
        let next = pod("next", 50, None, &[]);
        let err = b.choose(&next, "n1", 0.0).unwrap_err();
        assert!(
            err.contains("10 of 100 units free"),
            "held by the node: {err}"
        );
        // The node lets go of r: counted no more.
        b.node_report(
            "n1",
            Ok(report(&[("GPU-a", 50)], &[("GPU-a", "k", GIB)])),
            1.0,
        );
        assert_eq!(b.choose(&next, "n1", 1.0).unwrap().gpus, vec!["GPU-a"]);
    }

    #[test]
    fn unreadable_or_stale_metrics_keep_a_node_out_and_are_counted() {
        let mut b = Books::new(Policy::Predicted, 5.0);
        let p = pod("new", 10, None, &[]);
        b.node_report("n1", Ok(report(&[("GPU-a", 0)], &[])), 0.0);
        b.node_report("n2", Err("connection refused".into()), 0.0);
        let nodes = ["n1".to_string(), "n2".to_string(), "n3".to_string()];
        let (ok, failed) = b.filter(&p, &nodes, 1.0);
        assert_eq!(ok, vec!["n1".to_string()]);
        assert!(failed["n2"].contains("connection refused"));
        assert!(failed["n3"].contains("no gpushare metrics known"));
        assert_eq!(b.counters.unreadable["n2"], 1);
        assert_eq!(b.counters.scrape_failures["n2"], 1);
        let (ok, failed) = b.filter(&p, &nodes[..1], 7.0);
        assert!(ok.is_empty());
        assert!(failed["n1"].contains("s old"), "{failed:?}");
        // A report that lacks the GPUs' memory is as unreadable.
        let mut r = report(&[("GPU-a", 0)], &[]);
        r.gpus.get_mut("GPU-a").unwrap().memory = 0;
        b.node_report("n1", Ok(r), 8.0);
        assert!(
            b.choose(&p, "n1", 8.0)
                .unwrap_err()
                .contains("no memory size")
        );
    }

    #[test]
    fn measured_use_that_grows_keeps_a_node_from_new_pods_under_predicted() {
        let mut b = Books::new(Policy::Predicted, 10.0);
        let mut a = pod("a", 30, Some("n1"), &["GPU-a"]);
        a.memory = Some(6 * GIB);
        b.set_pods(vec![a], 0.0);
        let mut next = pod("next", 30, None, &[]);
        next.memory = Some(3 * GIB);
        for s in 0..=30 {
            b.node_report(
                "n1",
                Ok(report(&[("GPU-a", 30)], &[("GPU-a", "a", GIB)])),
                s as f64,
            );
        }
        // Settled at 1 GiB: 3 GiB more fits on the 8 GiB GPU although caps sum to 9.
        assert!(b.choose(&next, "n1", 30.0).is_ok());
        // Its use grows to 6 GiB: a misprediction, and the node is full again.
        b.node_report(
            "n1",
            Ok(report(&[("GPU-a", 30)], &[("GPU-a", "a", 6 * GIB)])),
            31.0,
        );
        assert!(b.choose(&next, "n1", 31.0).is_err());
        assert_eq!(b.learner().mispredictions, 1);
    }

    #[test]
    fn the_chosen_gpu_is_booked_until_the_api_server_shows_the_binding() {
        let mut b = Books::new(Policy::Requests, 10.0);
        b.node_report("n1", Ok(report(&[("GPU-a", 0), ("GPU-b", 0)], &[])), 0.0);
        let p = pod("p", 60, None, &[]);
        let c = b.choose(&p, "n1", 0.0).unwrap();
        b.bound(&p, "n1", c.gpus.clone(), 0.0);
        let q = pod("q", 60, None, &[]);
        let other = b.choose(&q, "n1", 0.0).unwrap();
        assert_ne!(other.gpus, c.gpus, "the first binding is in the books");
        // The API server shows it: no longer assumed, still booked.
        b.upsert_pod(pod("p", 60, Some("n1"), &[&c.gpus[0]]));
        assert_ne!(b.choose(&q, "n1", 0.0).unwrap().gpus, c.gpus);
    }

    #[test]
    fn pod_units_and_annotations_are_read_safely() {
        let mk = |units: &str, ann: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u", "annotations": ann},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {RESOURCE: units}}}]}
            }))
            .unwrap()
        };
        let p = pod_info(&mk(
            "30",
            serde_json::json!({MEMORY_ANNOTATION: "2Gi", GPU_ANNOTATION: "GPU-a, "}),
        ))
        .unwrap()
        .unwrap();
        assert_eq!(
            (p.units, p.memory, p.gpus.clone()),
            (30, Some(2 * GIB), vec!["GPU-a".to_string()])
        );
        let p = pod_info(&mk("30", serde_json::json!({MEMORY_ANNOTATION: "lots"})))
            .unwrap()
            .unwrap();
        assert_eq!(
            p.memory, None,
            "an invalid cap falls back to the units' share"
        );
        assert_eq!(p.cap_on(8 * GIB, false), 8 * GIB / 100 * 30);
        assert!(pod_info(&mk("thirty", serde_json::json!({}))).is_err());
        assert_eq!(pod_info(&mk("0", serde_json::json!({}))).unwrap(), None);
        let p = pod_info(&mk("150", serde_json::json!({})))
            .unwrap()
            .unwrap();
        assert!(p.whole_gpus().unwrap_err().contains("whole GPUs"));
    }
}
