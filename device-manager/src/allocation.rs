//! Which units a container should get (`GetPreferredAllocation`) and what the kubelet must put
//! into it (`Allocate`). Pure: the plugin shell passes the GPUs' measured load in.
//!
//! A request of up to one GPU's units comes from one GPU. Which one: `binpack` (default) takes
//! the GPU with the fewest free units that still fit (keeping whole GPUs free for big
//! requests), `spread` the one with the most; ties, and the choice among equally free GPUs,
//! go to the GPU the scheduler measured as least loaded (GPU time and memory actually used,
//! not what was requested: requests over-provision). More than one GPU's units must be whole
//! GPUs.
//!
//! When the scheduler extender chose the GPU (the pod's `gpushare.io/gpu` annotation), the
//! units come from that GPU ([`recorded_choice`], [`preferred_on`]); the manager's own choice
//! is the fallback when there is no such annotation or it cannot be followed.

use crate::injection::Injection;
use crate::inventory::parse_device_id;
use crate::proto::deviceplugin::{CdiDevice, ContainerAllocateResponse, Mount};
use crate::reconcile::{Assignment, PodView};
use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Placement {
    /// Fill the fullest GPU that fits first.
    Binpack,
    /// Use the emptiest GPU first.
    Spread,
}

/// What the scheduler measured on a GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    /// Share of GPU time used over the scheduler's window, 0..=1.
    pub busy: f64,
    /// Share of the GPU's memory held by its tenants, 0..=1.
    pub memory: f64,
}

impl Load {
    fn score(&self) -> f64 {
        self.busy.max(0.0) + self.memory.max(0.0)
    }
}

/// The preferred `size` units out of `available`, including `must_include`.
pub fn preferred(
    available: &[String],
    must_include: &[String],
    size: usize,
    units_per_gpu: u32,
    placement: Placement,
    load: &BTreeMap<String, Load>,
) -> Result<Vec<String>, String> {
    let per_gpu = units_per_gpu as usize;
    let mut free: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
    for id in available.iter().chain(must_include) {
        if let Some((gpu, n)) = parse_device_id(id) {
            free.entry(gpu).or_default().insert(n);
        }
    }
    let required: BTreeSet<&str> = must_include
        .iter()
        .filter_map(|id| parse_device_id(id).map(|(g, _)| g))
        .collect();
    let load_of = |g: &str| load.get(g).copied().unwrap_or_default().score();
    if size <= per_gpu {
        let mut fits: Vec<(&str, usize)> = free
            .iter()
            .filter(|(g, units)| units.len() >= size && required.iter().all(|r| r == *g))
            .map(|(g, units)| (*g, units.len()))
            .collect();
        fits.sort_by(|a, b| {
            let by_free = match placement {
                Placement::Binpack => a.1.cmp(&b.1),
                Placement::Spread => b.1.cmp(&a.1),
            };
            by_free.then(load_of(a.0).total_cmp(&load_of(b.0)))
        });
        let Some((gpu, _)) = fits.first() else {
            return Err(format!(
                "no single GPU has {size} free units of gpushare.io/gpu-share: a request of up to {per_gpu} units must come from one GPU"
            ));
        };
        let must: Vec<String> = must_include.to_vec();
        let rest = free[gpu]
            .iter()
            .map(|n| crate::inventory::device_id(gpu, *n))
            .filter(|id| !must.contains(id));
        return Ok(must.iter().cloned().chain(rest).take(size).collect());
    }
    whole_gpus_check(size, units_per_gpu)?;
    let mut whole: Vec<&str> = free
        .iter()
        .filter(|(_, units)| units.len() == per_gpu)
        .map(|(g, _)| *g)
        .collect();
    whole.sort_by(|a, b| {
        (!required.contains(a))
            .cmp(&!required.contains(b))
            .then(load_of(a).total_cmp(&load_of(b)))
    });
    let n = size / per_gpu;
    if whole.len() < n || required.iter().any(|r| !whole[..n].contains(r)) {
        return Err(format!(
            "{size} units need {n} whole free GPUs; only {} are free",
            whole.len()
        ));
    }
    Ok(whole[..n]
        .iter()
        .flat_map(|g| (0..units_per_gpu).map(move |u| crate::inventory::device_id(g, u)))
        .collect())
}

/// The annotation in which the scheduler extender records the GPU(s) it chose for a pod.
pub const CHOSEN_GPU: &str = "gpushare.io/gpu";

/// The GPU(s) recorded for the container a preferred-allocation request of `size` units is
/// for. The request does not name its pod, but the kubelet admits one pod at a time, oldest
/// first: it is the oldest pod of the node with the annotation and a container asking `size`
/// units that holds none yet. A pod going away is not waiting, nor is one that a newer pod of
/// the same name replaced (the watch may still show a deleted pod whose name was taken again:
/// its units are given back and its recorded GPU is not the new pod's).
pub fn recorded_choice(
    pods: &[PodView],
    assigned: &[Assignment],
    size: usize,
) -> Option<Vec<String>> {
    let replaced = |p: &PodView| {
        pods.iter().any(|q| {
            q.namespace == p.namespace
                && q.name == p.name
                && (q.created, &q.uid) > (p.created, &p.uid)
        })
    };
    pods.iter()
        .filter(|p| !p.terminating && !replaced(p))
        .filter(|p| {
            p.units.iter().any(|(c, u)| {
                *u as usize == size
                    && !assigned
                        .iter()
                        .any(|a| a.namespace == p.namespace && a.pod == p.name && &a.container == c)
            })
        })
        .filter_map(|p| {
            let gpus: Vec<String> = p
                .annotations
                .get(CHOSEN_GPU)?
                .split(',')
                .map(|g| g.trim().to_string())
                .filter(|g| !g.is_empty())
                .collect();
            (!gpus.is_empty()).then_some((p.created, &p.name, gpus))
        })
        .min_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)))
        .map(|(_, _, gpus)| gpus)
}

/// `size` units of the chosen GPU(s) out of `available` (with `must_include`), if they are
/// there: up to one GPU's worth from the one chosen GPU, or the chosen whole GPUs.
pub fn preferred_on(
    chosen: &[String],
    available: &[String],
    must_include: &[String],
    size: usize,
    units_per_gpu: u32,
) -> Option<Vec<String>> {
    let per_gpu = units_per_gpu as usize;
    let on = |gpu: &str| -> Vec<String> {
        must_include
            .iter()
            .chain(available)
            .filter(|id| parse_device_id(id).is_some_and(|(g, _)| g == gpu))
            .fold(Vec::new(), |mut v, id| {
                if !v.contains(id) {
                    v.push(id.clone());
                }
                v
            })
    };
    let outside = |gpus: &[String]| {
        must_include
            .iter()
            .any(|id| parse_device_id(id).is_none_or(|(g, _)| !gpus.iter().any(|c| c == g)))
    };
    if outside(chosen) {
        return None;
    }
    if size <= per_gpu {
        let [gpu] = chosen else {
            return None;
        };
        let units = on(gpu);
        return (units.len() >= size).then(|| units.into_iter().take(size).collect());
    }
    if chosen.len() * per_gpu != size {
        return None;
    }
    let mut all = Vec::new();
    for gpu in chosen {
        let units = on(gpu);
        if units.len() != per_gpu {
            return None;
        }
        all.extend(units);
    }
    Some(all)
}

fn whole_gpus_check(size: usize, units_per_gpu: u32) -> Result<(), String> {
    if !size.is_multiple_of(units_per_gpu as usize) {
        return Err(format!(
            "{size} units of gpushare.io/gpu-share: above {units_per_gpu} units a container must ask for whole GPUs (a multiple of {units_per_gpu})"
        ));
    }
    Ok(())
}

/// The GPUs of one container's units, checked: up to one GPU's worth from one GPU, or whole
/// GPUs.
pub fn gpus_of(device_ids: &[String], units_per_gpu: u32) -> Result<Vec<String>, String> {
    let mut units: BTreeMap<&str, u32> = BTreeMap::new();
    for id in device_ids {
        let (gpu, _) = parse_device_id(id)
            .filter(|(_, n)| *n < units_per_gpu)
            .ok_or_else(|| format!("{id:?} is not a gpushare.io/gpu-share device ID"))?;
        *units.entry(gpu).or_default() += 1;
    }
    let size = device_ids.len();
    match units.len() {
        0 => Err("no units requested".into()),
        1 => Ok(units.keys().map(|g| g.to_string()).collect()),
        _ => {
            if size > units_per_gpu as usize {
                whole_gpus_check(size, units_per_gpu)?;
            }
            if units.values().any(|u| *u != units_per_gpu) {
                return Err(format!(
                    "the kubelet assigned units from several GPUs ({units:?}): a container's units must come from one GPU, or be whole GPUs. Free units are fragmented across GPUs; retry the pod or ask for fewer units"
                ));
            }
            Ok(units.keys().map(|g| g.to_string()).collect())
        }
    }
}

/// The container's part of the `Allocate` answer for `gpus`.
pub fn container_response(gpus: &[String], inj: &Injection) -> ContainerAllocateResponse {
    let edits = inj.edits(gpus);
    ContainerAllocateResponse {
        envs: edits.env.into_iter().collect(),
        mounts: edits
            .mounts
            .into_iter()
            .map(|m| Mount {
                container_path: m.container_path,
                host_path: m.host_path,
                read_only: m.read_only,
            })
            .collect(),
        devices: vec![],
        annotations: Default::default(),
        cdi_devices: edits
            .cdi_devices
            .into_iter()
            .map(|name| CdiDevice { name })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::device_id;
    use proptest::prelude::*;

    const A: &str = "GPU-00000000-0000-0000-0000-00000000000a";
    const B: &str = "GPU-00000000-0000-0000-0000-00000000000b";

    fn ids(gpu: &str, r: std::ops::Range<u32>) -> Vec<String> {
        r.map(|n| device_id(gpu, n)).collect()
    }

    fn gpu_of(v: &[String]) -> BTreeSet<&str> {
        v.iter().map(|id| parse_device_id(id).unwrap().0).collect()
    }

    #[test]
    fn binpack_fills_the_fuller_gpu_and_spread_the_emptier() {
        // A has 40 free units, B 100.
        let avail: Vec<String> = ids(A, 60..100).into_iter().chain(ids(B, 0..100)).collect();
        let none = BTreeMap::new();
        let b = preferred(&avail, &[], 30, 100, Placement::Binpack, &none).unwrap();
        assert_eq!(gpu_of(&b), BTreeSet::from([A]));
        assert_eq!(b.len(), 30);
        let s = preferred(&avail, &[], 30, 100, Placement::Spread, &none).unwrap();
        assert_eq!(gpu_of(&s), BTreeSet::from([B]));
        let big = preferred(&avail, &[], 50, 100, Placement::Binpack, &none).unwrap();
        assert_eq!(gpu_of(&big), BTreeSet::from([B]), "A cannot fit 50");
    }

    #[test]
    fn measured_load_breaks_ties() {
        let avail: Vec<String> = ids(A, 0..100).into_iter().chain(ids(B, 0..100)).collect();
        let load = BTreeMap::from([
            (
                A.to_string(),
                Load {
                    busy: 0.9,
                    memory: 0.5,
                },
            ),
            (
                B.to_string(),
                Load {
                    busy: 0.1,
                    memory: 0.0,
                },
            ),
        ]);
        for p in [Placement::Binpack, Placement::Spread] {
            let v = preferred(&avail, &[], 30, 100, p, &load).unwrap();
            assert_eq!(gpu_of(&v), BTreeSet::from([B]), "{p:?}");
        }
    }

    #[test]
    fn whole_gpus_or_a_clear_refusal() {
        let avail: Vec<String> = ids(A, 0..100).into_iter().chain(ids(B, 0..100)).collect();
        let none = BTreeMap::new();
        assert_eq!(
            preferred(&avail, &[], 200, 100, Placement::Binpack, &none)
                .unwrap()
                .len(),
            200
        );
        let e = preferred(&avail, &[], 150, 100, Placement::Binpack, &none).unwrap_err();
        assert!(e.contains("whole GPUs"), "{e}");
        assert!(
            gpus_of(
                &ids(A, 0..50)
                    .into_iter()
                    .chain(ids(B, 0..100))
                    .collect::<Vec<_>>(),
                100
            )
            .is_err()
        );
        let split: Vec<String> = ids(A, 0..10).into_iter().chain(ids(B, 0..10)).collect();
        assert!(gpus_of(&split, 100).unwrap_err().contains("several GPUs"));
        assert_eq!(gpus_of(&ids(A, 5..35), 100).unwrap(), vec![A.to_string()]);
        assert!(gpus_of(&["nonsense".to_string()], 100).is_err());
        assert!(
            gpus_of(&[device_id(A, 100)], 100).is_err(),
            "unit beyond the GPU"
        );
    }

    #[test]
    fn allocate_injects_gpu_socket_and_hook() {
        use crate::injection::Preload;
        let inj = Injection {
            tenant_socket: "/run/gpushare/gpushare.sock".into(),
            hook_dir: "/var/lib/gpushare/lib/0.1.0-abc".into(),
            preload: Preload::LdPreload,
            cdi_kind: Some("nvidia.com/gpu".into()),
        };
        let r = container_response(&[A.to_string()], &inj);
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], A);
        assert_eq!(r.envs["GPUSHARE_SOCKET"], "/run/gpushare/gpushare.sock");
        assert_eq!(r.envs["LD_PRELOAD"], "/usr/lib/gpushare/libgpushare.so");
        assert!(
            r.mounts
                .iter()
                .any(|m| m.host_path == "/var/lib/gpushare/lib/0.1.0-abc" && m.read_only)
        );
        assert!(
            r.mounts
                .iter()
                .any(|m| m.host_path == "/run/gpushare" && !m.read_only)
        );
        assert_eq!(r.cdi_devices[0].name, format!("nvidia.com/gpu={A}"));
        let r = container_response(
            &[A.to_string()],
            &Injection {
                preload: Preload::LdSoPreload,
                ..inj
            },
        );
        assert!(!r.envs.contains_key("LD_PRELOAD"));
        assert!(
            r.mounts
                .iter()
                .any(|m| m.container_path == "/etc/ld.so.preload" && m.read_only)
        );
    }

    fn view(name: &str, created: i64, units: u32, chosen: Option<&str>) -> PodView {
        PodView {
            uid: format!("uid-{name}"),
            namespace: "ns".into(),
            name: name.into(),
            annotations: chosen
                .map(|g| BTreeMap::from([(CHOSEN_GPU.to_string(), g.to_string())]))
                .unwrap_or_default(),
            container_ids: BTreeMap::new(),
            units: BTreeMap::from([("main".to_string(), units)]),
            created,
            claims: BTreeMap::new(),
            terminating: false,
        }
    }

    #[test]
    fn the_recorded_gpu_is_that_of_the_oldest_pod_waiting_for_units_of_that_size() {
        let pods = vec![
            view("late", 20, 30, Some(B)),
            view("early", 10, 30, Some(A)),
            view("other-size", 5, 50, Some(B)),
            view("no-choice", 1, 30, None),
        ];
        assert_eq!(recorded_choice(&pods, &[], 30), Some(vec![A.to_string()]));
        let done = Assignment {
            namespace: "ns".into(),
            pod: "early".into(),
            container: "main".into(),
            device_ids: ids(A, 0..30),
        };
        assert_eq!(
            recorded_choice(&pods, &[done], 30),
            Some(vec![B.to_string()])
        );
        assert_eq!(recorded_choice(&pods, &[], 70), None);
    }

    #[test]
    fn a_deleted_pod_of_the_same_name_does_not_lend_its_gpu_to_the_new_one() {
        // The old `w` on A, deleted, its units given back; the new `w` chose B.
        let mut going = view("w", 10, 30, Some(A));
        going.terminating = true;
        let new = view("w", 20, 30, Some(B));
        assert_eq!(
            recorded_choice(&[going, new.clone()], &[], 30),
            Some(vec![B.to_string()])
        );
        // The watch still shows the old one as it was before its deletion.
        let mut stale = view("w", 10, 30, Some(A));
        stale.uid = "uid-old-w".into();
        assert_eq!(
            recorded_choice(&[stale, new], &[], 30),
            Some(vec![B.to_string()])
        );
    }

    #[test]
    fn units_come_from_the_recorded_gpu_when_it_has_them() {
        // A has 40 free units, B 100: binpack alone would take A; the extender chose B.
        let avail: Vec<String> = ids(A, 60..100).into_iter().chain(ids(B, 0..100)).collect();
        let got = preferred_on(&[B.to_string()], &avail, &[], 30, 100).unwrap();
        assert_eq!(gpu_of(&got), BTreeSet::from([B]));
        assert_eq!(got.len(), 30);
        // Chosen A for 50 units: A lacks them, so the manager falls back to its own choice.
        assert_eq!(preferred_on(&[A.to_string()], &avail, &[], 50, 100), None);
        // A unit the kubelet must include on another GPU contradicts the choice.
        assert_eq!(
            preferred_on(&[B.to_string()], &avail, &[device_id(A, 99)], 30, 100),
            None
        );
        // Whole GPUs: exactly the chosen ones, free.
        let two: Vec<String> = ids(A, 0..100).into_iter().chain(ids(B, 0..100)).collect();
        let got = preferred_on(&[A.to_string(), B.to_string()], &two, &[], 200, 100).unwrap();
        assert_eq!(got.len(), 200);
        assert_eq!(preferred_on(&[A.to_string()], &two, &[], 200, 100), None);
        assert_eq!(
            preferred_on(&["GPU-unknown".to_string()], &two, &[], 30, 100),
            None
        );
    }

    proptest! {
        /// Any feasible request gets `size` distinct available units of one GPU, with the
        /// required ones.
        #[test]
        fn preferred_units_are_available_distinct_and_from_one_gpu(
            free_a in 0u32..=100, free_b in 0u32..=100, size in 1usize..=100, spread in any::<bool>(), must in any::<bool>()
        ) {
            let avail: Vec<String> = ids(A, 100 - free_a..100).into_iter().chain(ids(B, 100 - free_b..100)).collect();
            let must_include: Vec<String> = if must && free_a > 0 { vec![device_id(A, 99)] } else { vec![] };
            let p = if spread { Placement::Spread } else { Placement::Binpack };
            match preferred(&avail, &must_include, size, 100, p, &BTreeMap::new()) {
                Ok(v) => {
                    prop_assert_eq!(v.len(), size);
                    prop_assert_eq!(gpu_of(&v).len(), 1);
                    let set: BTreeSet<&String> = v.iter().collect();
                    prop_assert_eq!(set.len(), size);
                    prop_assert!(v.iter().all(|id| avail.contains(id)));
                    prop_assert!(must_include.iter().all(|m| v.contains(m)));
                }
                Err(_) => {
                    let fits_a = free_a as usize >= size;
                    let fits_b = free_b as usize >= size && must_include.is_empty();
                    prop_assert!(!fits_a && !fits_b, "refused although it fits");
                }
            }
        }
    }
}
