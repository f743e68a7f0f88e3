//! The driver's policy as a pure function: the pods on this node (which containers use which
//! claims) and the claims prepared here in; the scheduler group of every container that uses a
//! prepared claim, and what is wrong, out. Called on every change, like the device plugin's
//! [`crate::reconcile::desired`], with whose groups it shares their form
//! ([`crate::reconcile::group`]).
//!
//! A container's group has its claim's share, memory cap, limit and weight on the claim's
//! GPUs. A claim used by several containers (of one pod or of several) is split evenly between
//! them: each gets 1/n of its share and of its memory, and its limit and weight. A container
//! that uses several gpushare claims gets no group (a Warning on its pod says why).

use super::REASON;
use super::claim::PreparedClaim;
use crate::events::{Object, Warning};
use crate::reconcile::{PodView, Policy, group};
use gpushare_protocol::admin::{ContainerKey, PodGroup};
use std::collections::BTreeMap;

/// The outcome of [`desired`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Desired {
    pub groups: BTreeMap<ContainerKey, PodGroup>,
    pub problems: Vec<Warning>,
}

/// Every container's group from the claims it uses.
pub fn desired(pods: &[PodView], prepared: &[PreparedClaim], units_per_gpu: u32) -> Desired {
    let mut by_name: BTreeMap<(&str, &str), &PreparedClaim> = BTreeMap::new();
    for p in prepared.iter().filter(|p| !p.devices.is_empty()) {
        by_name.insert((p.namespace.as_str(), p.name.as_str()), p);
    }
    // Each container with the prepared claims it uses.
    let mut uses: Vec<(&PodView, &str, Vec<&PreparedClaim>)> = Vec::new();
    for pod in pods {
        for (container, names) in &pod.claims {
            let claims: Vec<&PreparedClaim> = names
                .iter()
                .filter_map(|n| by_name.get(&(pod.namespace.as_str(), n.as_str())).copied())
                .collect();
            if !claims.is_empty() {
                uses.push((pod, container, claims));
            }
        }
    }
    let mut users: BTreeMap<&str, u32> = BTreeMap::new();
    for (_, _, claims) in &uses {
        for c in claims {
            *users.entry(c.uid.as_str()).or_default() += 1;
        }
    }
    let mut out = Desired::default();
    for (pod, container, claims) in uses {
        let [claim] = claims.as_slice() else {
            let names: Vec<String> = claims.iter().map(|c| c.name.clone()).collect();
            out.problems.push(Warning {
                object: Object {
                    api_version: "v1",
                    kind: "Pod",
                    namespace: pod.namespace.clone(),
                    name: pod.name.clone(),
                    uid: pod.uid.clone(),
                },
                reason: REASON,
                action: "ApplyPolicy",
                message: format!(
                    "container {container} uses {} gpushare claims ({}): gpushare schedules a container by one claim, so it has no share and its processes are refused; ask for all its GPUs in one claim (a request with count: {})",
                    names.len(),
                    names.join(", "),
                    names.len()
                ),
            });
            continue;
        };
        let n = users[claim.uid.as_str()];
        let mut class_problems = Vec::new();
        let latency =
            crate::annotations::latency_class(&pod.annotations, container, &mut class_problems);
        for p in class_problems {
            out.problems.push(Warning {
                object: Object {
                    api_version: "v1",
                    kind: "Pod",
                    namespace: pod.namespace.clone(),
                    name: pod.name.clone(),
                    uid: pod.uid.clone(),
                },
                reason: "InvalidGpushareAnnotation",
                action: "ApplyPolicy",
                message: format!("{}: {}", p.annotation, p.message),
            });
        }
        let policy = Policy {
            share: f64::from(claim.share_units) / f64::from(units_per_gpu.max(1)) / f64::from(n),
            limit: claim.limit,
            weight: claim.weight,
            memory: claim.memory / u64::from(n),
            latency,
        };
        let g = group(pod, container, claim.gpus(), &policy);
        out.groups.insert(g.key(), g);
    }
    out.problems.sort();
    out.problems.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dra::claim::PreparedDevice;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;
    const A: &str = "GPU-00000000-0000-0000-0000-00000000000a";
    const B: &str = "GPU-00000000-0000-0000-0000-00000000000b";

    fn prepared(name: &str, gpu: &str, units: u32, memory: u64) -> PreparedClaim {
        PreparedClaim {
            uid: format!("uid-{name}"),
            namespace: "ns".into(),
            name: name.into(),
            devices: vec![PreparedDevice {
                request: "gpu".into(),
                pool: "node-1".into(),
                device: crate::dra::device_name(gpu),
                share_id: None,
                gpu: gpu.into(),
            }],
            share_units: units,
            memory,
            limit: 1.0,
            weight: 1.0,
        }
    }

    fn pod(name: &str, containers: &[(&str, &[&str])]) -> PodView {
        PodView {
            uid: format!("pod-{name}"),
            namespace: "ns".into(),
            name: name.into(),
            annotations: BTreeMap::new(),
            container_ids: BTreeMap::new(),
            units: BTreeMap::new(),
            created: 0,
            claims: containers
                .iter()
                .map(|(c, claims)| {
                    (
                        c.to_string(),
                        claims.iter().map(|s| s.to_string()).collect(),
                    )
                })
                .collect(),
            terminating: false,
        }
    }

    fn group_of<'a>(d: &'a Desired, pod: &str, container: &str) -> Option<&'a PodGroup> {
        d.groups
            .values()
            .find(|g| g.pod == pod && g.container == container)
    }

    #[test]
    fn a_claims_container_gets_its_share_memory_limit_and_weight() {
        let mut c = prepared("c30", B, 30, 4 * GIB);
        c.limit = 0.6;
        c.weight = 2.0;
        let d = desired(&[pod("p", &[("main", &["c30"])])], &[c], 100);
        let g = group_of(&d, "p", "main").unwrap();
        assert_eq!(g.gpus, [B]);
        assert_eq!(
            (g.request, g.limit, g.weight, g.memory),
            (0.3, 0.6, 2.0, Some(4 * GIB))
        );
        assert!(d.problems.is_empty());
        let mut low = prepared("c30", B, 30, 4 * GIB);
        low.limit = 0.2;
        let d = desired(&[pod("p", &[("main", &["c30"])])], &[low], 100);
        assert_eq!(
            group_of(&d, "p", "main").unwrap().request,
            0.2,
            "a limit below the share lowers the request"
        );
    }

    #[test]
    fn a_shared_claim_is_split_between_its_containers() {
        let c = prepared("team", A, 60, 6 * GIB);
        let pods = [
            pod("p1", &[("a", &["team"]), ("b", &["team"])]),
            pod("p2", &[("c", &["team"])]),
        ];
        let d = desired(&pods, &[c], 100);
        assert_eq!(d.groups.len(), 3);
        for g in d.groups.values() {
            assert!((g.request - 0.2).abs() < 1e-12, "{g:?}");
            assert_eq!(g.memory, Some(2 * GIB));
        }
    }

    #[test]
    fn unprepared_claims_and_claims_of_other_namespaces_give_nothing() {
        let c = prepared("c30", A, 30, GIB);
        let mut other_ns = pod("q", &[("main", &["c30"])]);
        other_ns.namespace = "elsewhere".into();
        let d = desired(&[pod("p", &[("main", &["nope"])]), other_ns], &[c], 100);
        assert!(d.groups.is_empty() && d.problems.is_empty());
    }

    #[test]
    fn two_claims_in_one_container_are_reported() {
        let d = desired(
            &[pod("p", &[("main", &["x", "y"]), ("side", &["y"])])],
            &[prepared("x", A, 30, GIB), prepared("y", B, 30, GIB)],
            100,
        );
        assert!(group_of(&d, "p", "main").is_none());
        assert!(group_of(&d, "p", "side").is_some());
        assert_eq!(d.problems.len(), 1);
        assert!(
            d.problems[0]
                .message
                .contains("uses 2 gpushare claims (x, y)"),
            "{:?}",
            d.problems
        );
        assert_eq!(d.problems[0].object.kind, "Pod");
    }

    proptest! {
        /// Whatever the claims and who uses them, a GPU's groups never get more than the
        /// claims prepared on it: requests sum to at most the GPU, memory to at most what the
        /// claims hold.
        #[test]
        fn groups_never_exceed_their_claims(
            claims in proptest::collection::vec((0usize..2, 1u32..=50, 1u64..=4), 1..5),
            users in proptest::collection::vec((0usize..4, 0usize..5), 0..10),
        ) {
            let prepared: Vec<PreparedClaim> = claims
                .iter()
                .enumerate()
                .map(|(i, (g, u, m))| prepared(&format!("c{i}"), [A, B][*g], *u, m * GIB))
                .collect();
            let pods: Vec<PodView> = users
                .iter()
                .enumerate()
                .map(|(i, (p, c))| {
                    let mut v = pod(&format!("p{p}"), &[]);
                    v.uid = format!("pod-{p}-{i}");
                    v.claims.insert(format!("c{i}"), vec![format!("c{}", c % prepared.len())]);
                    v
                })
                .collect();
            let d = desired(&pods, &prepared, 100);
            prop_assert!(d.problems.is_empty());
            for gpu in [A, B] {
                let on: Vec<&PodGroup> = d.groups.values().filter(|g| g.gpus == [gpu]).collect();
                let request: f64 = on.iter().map(|g| g.request).sum();
                let memory: u64 = on.iter().map(|g| g.memory.unwrap()).sum();
                let held: Vec<&PreparedClaim> = prepared.iter().filter(|c| c.gpus() == [gpu]).collect();
                let units: u32 = held.iter().map(|c| c.share_units).sum();
                let bytes: u64 = held.iter().map(|c| c.memory).sum();
                prop_assert!(request <= f64::from(units) / 100.0 + 1e-9);
                prop_assert!(memory <= bytes);
            }
        }
    }
}
