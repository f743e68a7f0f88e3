//! The manager's policy as a pure function: the pods on this node (with their annotations),
//! the units the kubelet assigned to their containers (PodResources) and the node's GPUs in;
//! the scheduler groups every container should have, and what is wrong with the annotations,
//! out ([`desired`]). The I/O shell calls it on every change and pushes the difference
//! ([`diff`]); since it looks only at what is observed now, restarts and missed events heal.

use crate::annotations::{self, Problem};
use crate::events::{Object, Warning};
use crate::inventory::{Gpu, parse_device_id};
use gpushare_protocol::admin::{AdminRequest, ContainerKey, PodGroup};
use std::collections::BTreeMap;

/// A pod on this node, as the API server reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct PodView {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub annotations: BTreeMap<String, String>,
    /// Container name → ID (without the `containerd://` prefix), once running.
    pub container_ids: BTreeMap<String, String>,
    /// Container name → units of our resource it asks for (containers asking for some).
    pub units: BTreeMap<String, u32>,
    /// `metadata.creationTimestamp`, seconds since the epoch: the kubelet admits pods in this
    /// order.
    pub created: i64,
    /// Container name → the names of the ResourceClaims (of the pod's namespace) it uses,
    /// once known (a claim made from a template is named in the pod's status).
    pub claims: BTreeMap<String, Vec<String>>,
    /// `metadata.deletionTimestamp` is set: the pod is going away.
    pub terminating: bool,
}

/// Units of our resource the kubelet assigned to one container (PodResources).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Assignment {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub device_ids: Vec<String>,
}

/// What is wrong with one pod's annotations or assignment (for a Warning event and a metric).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodProblem {
    pub pod_uid: String,
    pub namespace: String,
    pub pod: String,
    pub problem: Problem,
}

impl PodProblem {
    /// The Warning event telling it, on the pod.
    pub fn warning(&self) -> Warning {
        Warning {
            object: Object {
                api_version: "v1",
                kind: "Pod",
                namespace: self.namespace.clone(),
                name: self.pod.clone(),
                uid: self.pod_uid.clone(),
            },
            reason: "InvalidGpushareAnnotation",
            action: "ApplyPolicy",
            message: format!(
                "{}={:?}: {}",
                self.problem.annotation, self.problem.value, self.problem.message
            ),
        }
    }
}

/// The outcome of [`desired`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Desired {
    pub groups: BTreeMap<ContainerKey, PodGroup>,
    pub problems: Vec<PodProblem>,
}

/// Every assigned container's group.
///
/// - request = units / `units_per_gpu` on one GPU; more than one GPU's worth must be whole
///   GPUs (request 1 on each);
/// - limit, weight, memory from the annotations ([`annotations`]); a limit below the units'
///   request lowers the request to it; default memory cap = the units' share of the GPU's
///   memory;
/// - a container whose pod is not (yet) known, or whose units name unknown GPUs, has no group.
pub fn desired(
    pods: &[PodView],
    assignments: &[Assignment],
    gpus: &[Gpu],
    units_per_gpu: u32,
) -> Desired {
    let by_name: BTreeMap<(&str, &str), &PodView> = pods
        .iter()
        .map(|p| ((p.namespace.as_str(), p.name.as_str()), p))
        .collect();
    let memory_of: BTreeMap<&str, u64> = gpus.iter().map(|g| (g.uuid.as_str(), g.memory)).collect();
    let mut out = Desired::default();
    let mut sorted: Vec<&Assignment> = assignments.iter().collect();
    sorted.sort();
    for a in sorted {
        let Some(pod) = by_name.get(&(a.namespace.as_str(), a.pod.as_str())) else {
            continue;
        };
        let mut problems = Vec::new();
        if let Some(g) = group_of(pod, a, &memory_of, units_per_gpu, &mut problems) {
            out.groups.insert(g.key(), g);
        }
        out.problems
            .extend(problems.into_iter().map(|problem| PodProblem {
                pod_uid: pod.uid.clone(),
                namespace: pod.namespace.clone(),
                pod: pod.name.clone(),
                problem,
            }));
    }
    out.problems.sort();
    out.problems.dedup();
    out
}

fn group_of(
    pod: &PodView,
    a: &Assignment,
    memory_of: &BTreeMap<&str, u64>,
    units_per_gpu: u32,
    problems: &mut Vec<Problem>,
) -> Option<PodGroup> {
    let mut units: BTreeMap<&str, u32> = BTreeMap::new();
    for id in &a.device_ids {
        let gpu = parse_device_id(id)
            .map(|(g, _)| g)
            .filter(|g| memory_of.contains_key(g))?;
        *units.entry(gpu).or_default() += 1;
    }
    let per_gpu = units_per_gpu.max(1);
    let request = match units.values().collect::<Vec<_>>().as_slice() {
        [] => return None,
        [u] if **u <= per_gpu => f64::from(**u) / f64::from(per_gpu),
        many if many.iter().all(|u| **u == per_gpu) => 1.0,
        _ => {
            problems.push(Problem::new(
                crate::inventory::RESOURCE,
                &a.device_ids.len().to_string(),
                format!(
                    "container {} holds parts of several GPUs ({units:?}): a request above {per_gpu} units must be whole GPUs (a multiple of {per_gpu}); it is not scheduled by gpushare",
                    a.container
                ),
            ));
            return None;
        }
    };
    let q = annotations::quota(&pod.annotations, &a.container, problems);
    let gpu_memory = units.keys().map(|g| memory_of[g]).min().unwrap_or(0);
    let units_share = f64::from(units.values().sum::<u32>().min(per_gpu)) / f64::from(per_gpu);
    let memory = match q.memory {
        Some(m) if m > gpu_memory => {
            problems.push(Problem::new(
                annotations::MEMORY,
                &m.to_string(),
                format!(
                    "{m} bytes for container {} is more than the GPU's {gpu_memory}: capped at the GPU's memory",
                    a.container
                ),
            ));
            gpu_memory
        }
        Some(m) => m,
        None => (units_share * gpu_memory as f64) as u64,
    };
    let policy = Policy {
        share: request,
        limit: q.limit.unwrap_or(1.0),
        weight: q.weight.unwrap_or(1.0),
        memory,
        latency: q.latency,
    };
    Some(group(
        pod,
        &a.container,
        units.keys().map(|g| g.to_string()).collect(),
        &policy,
    ))
}

/// What a container is given on each of its GPUs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// The share it was scheduled with (units / units per GPU), 0..=1.
    pub share: f64,
    /// Hard cap, in (0, 1].
    pub limit: f64,
    /// Weight for spare time, > 0.
    pub weight: f64,
    /// Memory cap in bytes.
    pub memory: u64,
    /// The latency class.
    pub latency: bool,
}

/// The scheduler group of `container` of `pod` on `gpus`. A cap below the share wins: the
/// guarantee is lowered to it (the container keeps what it was scheduled with, but never gets
/// more than its cap).
pub fn group(pod: &PodView, container: &str, gpus: Vec<String>, p: &Policy) -> PodGroup {
    PodGroup {
        pod_uid: pod.uid.clone(),
        namespace: pod.namespace.clone(),
        pod: pod.name.clone(),
        container: container.to_string(),
        container_id: pod.container_ids.get(container).cloned(),
        gpus,
        request: p.share.min(p.limit),
        limit: p.limit,
        weight: p.weight,
        memory: Some(p.memory),
        latency: p.latency,
    }
}

/// The admin requests that turn `pushed` into `want`: removals first, then upserts of what
/// is new or changed.
pub fn diff(
    pushed: &BTreeMap<ContainerKey, PodGroup>,
    want: &BTreeMap<ContainerKey, PodGroup>,
) -> Vec<AdminRequest> {
    let removes = pushed
        .keys()
        .filter(|k| !want.contains_key(*k))
        .map(|k| AdminRequest::Remove { key: k.clone() });
    let upserts = want
        .iter()
        .filter(|(k, g)| pushed.get(*k) != Some(*g))
        .map(|(_, g)| AdminRequest::Upsert { group: g.clone() });
    removes.chain(upserts).collect()
}

/// Units assigned per GPU (for the allocated-units metric).
pub fn allocated_units(assignments: &[Assignment]) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    for id in assignments.iter().flat_map(|a| &a.device_ids) {
        if let Some((gpu, _)) = parse_device_id(id) {
            *out.entry(gpu.to_string()).or_default() += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::device_id;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;

    fn gpus(n: usize) -> Vec<Gpu> {
        (0..n)
            .map(|i| Gpu {
                uuid: format!("GPU-00000000-0000-0000-0000-00000000000{i}"),
                memory: 80 * GIB,
                name: "sim".into(),
            })
            .collect()
    }

    fn pod(i: usize, annotations: &[(&str, &str)]) -> PodView {
        PodView {
            uid: format!("uid-{i}"),
            namespace: "ns".into(),
            name: format!("p{i}"),
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            container_ids: BTreeMap::new(),
            units: BTreeMap::new(),
            created: 0,
            claims: BTreeMap::new(),
            terminating: false,
        }
    }

    fn assign(i: usize, gpu: &Gpu, units: std::ops::Range<u32>) -> Assignment {
        Assignment {
            namespace: "ns".into(),
            pod: format!("p{i}"),
            container: "main".into(),
            device_ids: units.map(|n| device_id(&gpu.uuid, n)).collect(),
        }
    }

    #[test]
    fn thirty_units_is_a_request_of_point_three_with_annotations_applied() {
        let g = gpus(1);
        let pods = [
            pod(
                0,
                &[(annotations::LIMIT, "60%"), (annotations::MEMORY, "2Gi")],
            ),
            pod(1, &[]),
        ];
        let d = desired(
            &pods,
            &[assign(0, &g[0], 0..30), assign(1, &g[0], 30..100)],
            &g,
            100,
        );
        let v: Vec<&PodGroup> = d.groups.values().collect();
        assert_eq!(v.len(), 2);
        assert_eq!(
            (v[0].request, v[0].limit, v[0].memory),
            (0.3, 0.6, Some(2 * GIB))
        );
        assert_eq!(v[1].request, 0.7);
        assert_eq!(v[1].limit, 1.0);
        assert_eq!(v[1].memory, Some((0.7 * (80 * GIB) as f64) as u64));
        assert!(d.problems.is_empty());
    }

    #[test]
    fn bad_annotations_fall_back_and_are_reported() {
        let g = gpus(1);
        let pods = [pod(
            0,
            &[(annotations::LIMIT, "1.5"), (annotations::WEIGHT, "-3")],
        )];
        let d = desired(&pods, &[assign(0, &g[0], 0..30)], &g, 100);
        let grp = d.groups.values().next().unwrap();
        assert_eq!(
            (grp.request, grp.limit, grp.weight),
            (0.3, 1.0, 1.0),
            "defaults"
        );
        assert_eq!(d.problems.len(), 2, "{:?}", d.problems);
    }

    #[test]
    fn a_limit_below_the_units_lowers_the_request() {
        let g = gpus(1);
        let pods = [pod(0, &[(annotations::LIMIT, "0.2")])];
        let d = desired(&pods, &[assign(0, &g[0], 0..30)], &g, 100);
        let grp = d.groups.values().next().unwrap();
        assert_eq!((grp.request, grp.limit), (0.2, 0.2));
        assert_eq!(
            grp.memory,
            Some((0.3 * (80 * GIB) as f64) as u64),
            "memory follows the units"
        );
        assert!(d.problems.is_empty());
    }

    #[test]
    fn whole_gpus_and_split_units() {
        let g = gpus(2);
        let whole = Assignment {
            device_ids: (0..100)
                .map(|n| device_id(&g[0].uuid, n))
                .chain((0..100).map(|n| device_id(&g[1].uuid, n)))
                .collect(),
            ..assign(0, &g[0], 0..0)
        };
        let d = desired(&[pod(0, &[])], &[whole], &g, 100);
        let grp = d.groups.values().next().unwrap();
        assert_eq!((grp.request, grp.gpus.len()), (1.0, 2));
        let split = Assignment {
            device_ids: (0..20)
                .map(|n| device_id(&g[0].uuid, n))
                .chain((0..10).map(|n| device_id(&g[1].uuid, n)))
                .collect(),
            ..assign(0, &g[0], 0..0)
        };
        let d = desired(&[pod(0, &[])], &[split], &g, 100);
        assert!(d.groups.is_empty());
        assert_eq!(d.problems.len(), 1);
    }

    #[test]
    fn unknown_pods_and_gpus_have_no_group() {
        let g = gpus(1);
        let other = gpus(2).pop().unwrap();
        let d = desired(
            &[pod(0, &[])],
            &[assign(1, &g[0], 0..10), assign(0, &other, 0..10)],
            &g,
            100,
        );
        assert!(d.groups.is_empty());
    }

    /// Containers on GPUs, each with a disjoint run of units, and random annotations.
    fn scenario() -> impl Strategy<Value = (Vec<PodView>, Vec<Assignment>, Vec<Gpu>)> {
        let ann = prop_oneof![
            Just(None),
            Just(Some("0.5")),
            Just(Some("90%")),
            Just(Some("0.05")),
            Just(Some("bogus")),
        ];
        (
            1usize..4,
            proptest::collection::vec((0usize..4, 1u32..60, ann), 0..8),
        )
            .prop_map(|(n_gpus, containers)| {
                let g = gpus(n_gpus);
                let mut next = vec![0u32; n_gpus];
                let (mut pods, mut assigns) = (Vec::new(), Vec::new());
                for (i, (gpu, units, limit)) in containers.into_iter().enumerate() {
                    let gpu = gpu % n_gpus;
                    let units = units.min(100 - next[gpu]);
                    if units == 0 {
                        continue;
                    }
                    let a: Vec<(&str, &str)> =
                        limit.iter().map(|l| (annotations::LIMIT, *l)).collect();
                    pods.push(pod(i, &a));
                    assigns.push(assign(i, &g[gpu], next[gpu]..next[gpu] + units));
                    next[gpu] += units;
                }
                (pods, assigns, g)
            })
    }

    proptest! {
        #[test]
        fn every_assigned_container_gets_a_valid_group_on_its_gpu((pods, assigns, g) in scenario()) {
            let d = desired(&pods, &assigns, &g, 100);
            prop_assert_eq!(d.groups.len(), assigns.len());
            let mut per_gpu: BTreeMap<&str, f64> = BTreeMap::new();
            for a in &assigns {
                let grp = d.groups.values().find(|x| x.pod == a.pod).unwrap();
                let (gpu, _) = parse_device_id(&a.device_ids[0]).unwrap();
                prop_assert_eq!(&grp.gpus, &vec![gpu.to_string()]);
                let units = a.device_ids.len() as f64 / 100.0;
                prop_assert!((grp.request - units.min(grp.limit)).abs() < 1e-12);
                prop_assert!(grp.request <= grp.limit && grp.limit <= 1.0 && grp.weight > 0.0);
                prop_assert!(grp.memory.unwrap() <= 80 * GIB);
                *per_gpu.entry(gpu).or_default() += grp.request;
            }
            for sum in per_gpu.values() {
                prop_assert!(*sum <= 1.0 + 1e-9, "requests on one GPU sum to {}", sum);
            }
        }

        #[test]
        fn order_does_not_matter((pods, assigns, g) in scenario(), seed in any::<u64>()) {
            let d = desired(&pods, &assigns, &g, 100);
            let (mut p2, mut a2) = (pods.clone(), assigns.clone());
            let k = seed as usize;
            if !p2.is_empty() { let n = k % p2.len(); p2.rotate_left(n); }
            a2.reverse();
            prop_assert_eq!(d, desired(&p2, &a2, &g, 100));
        }

        #[test]
        fn pushing_the_diff_reaches_the_desired_state((p1, a1, g) in scenario(), (p2, a2, _) in scenario()) {
            let old = desired(&p1, &a1, &g, 100).groups;
            let new = desired(&p2, &a2, &g, 100).groups;
            let mut applied = old.clone();
            for r in diff(&old, &new) {
                match r {
                    AdminRequest::Upsert { group } => { applied.insert(group.key(), group); }
                    AdminRequest::Remove { key } => { prop_assert!(applied.remove(&key).is_some()); }
                    other => prop_assert!(false, "unexpected {:?}", other),
                }
            }
            prop_assert_eq!(&applied, &new);
            prop_assert!(diff(&new, &new).is_empty(), "idempotent");
        }
    }
}
