//! What preparing a claim means, decided from the claim's allocation alone: which of this
//! node's GPUs it got, how much of each (its consumed `share` and `memory`), with which limit
//! and weight (its opaque configuration, [`super::config`]), checked against the GPUs and the
//! claims already prepared on them ([`prepare`]). Pure: the shell fetches the claim and
//! records the result.

use super::config::{self, ClaimConfig};
use super::{DRIVER, MEMORY, SHARE, device_name};
use crate::inventory::Gpu;
use gpushare_units::parse_quantity;
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A claim prepared on this node: what the checkpoint keeps, and what its containers get.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreparedClaim {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// The claim's devices of this driver (none: nothing for gpushare to do).
    pub devices: Vec<PreparedDevice>,
    /// Units of `share` on each of its GPUs.
    pub share_units: u32,
    /// Memory cap in bytes on each of its GPUs.
    pub memory: u64,
    /// Hard cap on GPU time, in (0, 1].
    pub limit: f64,
    /// Weight for spare time.
    pub weight: f64,
}

/// One allocated device of a prepared claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreparedDevice {
    /// The claim's request (`request` or `request/subrequest`) the device was allocated for.
    pub request: String,
    pub pool: String,
    pub device: String,
    /// Which of the device's allocations this is (consumable capacity).
    pub share_id: Option<String>,
    /// The GPU's UUID.
    pub gpu: String,
}

impl PreparedClaim {
    /// The claim's GPUs, each once.
    pub fn gpus(&self) -> Vec<String> {
        let mut g: Vec<String> = self.devices.iter().map(|d| d.gpu.clone()).collect();
        g.sort();
        g.dedup();
        g
    }

    /// `namespace/name`.
    pub fn full_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// What the node offers: its pool (the node's name), its GPUs, the units of `share` per GPU.
#[derive(Debug, Clone, Copy)]
pub struct Node<'a> {
    pub pool: &'a str,
    pub gpus: &'a [Gpu],
    pub units_per_gpu: u32,
}

/// What the allocation gives `claim` on this node, or why it cannot be prepared: the error
/// says what is wrong and what to do. `prepared`: the other claims prepared on the node.
pub fn prepare(
    claim: &ResourceClaim,
    node: Node<'_>,
    prepared: &[PreparedClaim],
) -> Result<PreparedClaim, String> {
    let m = &claim.metadata;
    let (namespace, name, uid) = match (&m.namespace, &m.name, &m.uid) {
        (Some(ns), Some(n), Some(u)) => (ns.clone(), n.clone(), u.clone()),
        _ => return Err("the ResourceClaim has no namespace, name or UID".into()),
    };
    let allocation = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .ok_or("the ResourceClaim is not allocated yet")?;
    let devices = allocation.devices.as_ref();
    let results: Vec<&DeviceRequestAllocationResult> = devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.driver == DRIVER)
        .collect();
    let mut out = PreparedClaim {
        uid,
        namespace,
        name,
        devices: Vec::new(),
        share_units: 0,
        memory: 0,
        limit: 1.0,
        weight: 1.0,
    };
    if results.is_empty() {
        return Ok(out);
    }
    let configs = configs(
        devices
            .and_then(|d| d.config.as_deref())
            .unwrap_or_default(),
    )?;
    // Per GPU: units, memory (None: the allocation did not say), configuration.
    let mut per_gpu: BTreeMap<&str, (u32, Option<u64>, ClaimConfig)> = BTreeMap::new();
    for r in &results {
        if r.admin_access == Some(true) {
            return Err(format!(
                "request {:?} asks for admin access to {}, which gpushare does not offer: ask for a share instead",
                r.request, r.device
            ));
        }
        let gpu = device_of(r, node)?;
        let units = match consumed(r, SHARE) {
            Some(q) => share_units(q, node.units_per_gpu)?,
            None => node.units_per_gpu,
        };
        let memory = consumed(r, MEMORY)
            .map(|q| {
                parse_quantity(q)
                    .map_err(|e| format!("consumed capacity {MEMORY} of {}: {e}", r.device))
            })
            .transpose()?;
        let config = configs
            .iter()
            .filter(|(requests, _)| applies(requests, &r.request))
            .fold(ClaimConfig::default(), |acc, (_, c)| acc.then(*c));
        let e = per_gpu
            .entry(gpu.uuid.as_str())
            .or_insert((0, None, config));
        if e.2 != config {
            return Err(format!(
                "the requests on {} have different {DRIVER} configurations: give a claim's requests on one GPU one configuration",
                r.device
            ));
        }
        e.0 += units;
        e.1 = match (e.1, memory) {
            (a, None) => a,
            (None, b) => b,
            (Some(a), Some(b)) => Some(a + b),
        };
        out.devices.push(PreparedDevice {
            request: r.request.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            share_id: r.share_id.clone(),
            gpu: gpu.uuid.clone(),
        });
    }
    let mut each = per_gpu.values();
    let first = *each.next().expect("at least one result");
    if each.any(|x| *x != first) {
        return Err(format!(
            "the claim's GPUs were given different shares, memory or configurations ({}): a claim on several GPUs must ask for the same on each",
            summary(&per_gpu)
        ));
    }
    let (units, consumed_memory, config) = first;
    let gpu_memory = per_gpu
        .keys()
        .filter_map(|u| node.gpus.iter().find(|g| g.uuid == *u))
        .map(|g| g.memory)
        .min()
        .unwrap_or(0);
    let memory = match (consumed_memory, config.memory) {
        (Some(c), Some(m)) => {
            return Err(format!(
                "the claim's memory comes from its {MEMORY} capacity ({c} bytes), and its configuration sets memory {m} too: remove memory from the configuration"
            ));
        }
        (Some(c), None) => c,
        (None, Some(m)) => m,
        (None, None) => {
            (f64::from(units) / f64::from(node.units_per_gpu) * gpu_memory as f64) as u64
        }
    };
    if units > node.units_per_gpu || memory > gpu_memory {
        return Err(format!(
            "the claim asks for {units} {SHARE} units and {memory} bytes of memory on a GPU, more than a GPU has ({} units, {gpu_memory} bytes)",
            node.units_per_gpu
        ));
    }
    for gpu in per_gpu.keys() {
        let others: Vec<&PreparedClaim> = prepared
            .iter()
            .filter(|p| p.uid != out.uid && p.devices.iter().any(|d| d.gpu == *gpu))
            .collect();
        let used_units: u32 = others.iter().map(|p| p.share_units).sum();
        let used_memory: u64 = others.iter().map(|p| p.memory).sum();
        if used_units + units > node.units_per_gpu || used_memory + memory > gpu_memory {
            let holders: Vec<String> = others
                .iter()
                .map(|p| {
                    format!(
                        "{} ({} units, {} bytes)",
                        p.full_name(),
                        p.share_units,
                        p.memory
                    )
                })
                .collect();
            return Err(format!(
                "GPU {} has {} {SHARE} units and {} bytes of memory left (prepared on it: {}), not the {units} units and {memory} bytes this claim was allocated: the allocation overcommits the GPU; delete the pod so that the claim is allocated again",
                device_name(gpu),
                node.units_per_gpu.saturating_sub(used_units),
                gpu_memory.saturating_sub(used_memory),
                holders.join(", ")
            ));
        }
    }
    out.share_units = units;
    out.memory = memory;
    out.limit = config.limit.unwrap_or(1.0);
    out.weight = config.weight.unwrap_or(1.0);
    Ok(out)
}

/// This driver's opaque configurations, parsed, in the order they apply: the class's first,
/// then the claim's (each with the requests it names; none: all).
fn configs(
    all: &[k8s_openapi::api::resource::v1::DeviceAllocationConfiguration],
) -> Result<Vec<(Vec<String>, ClaimConfig)>, String> {
    let mut out = Vec::new();
    for source in ["FromClass", "FromClaim"] {
        for c in all.iter().filter(|c| c.source == source) {
            let Some(o) = c.opaque.as_ref().filter(|o| o.driver == DRIVER) else {
                continue;
            };
            let parsed = config::parse(&o.parameters.0).map_err(|e| {
                let from = if source == "FromClass" {
                    "DeviceClass"
                } else {
                    "claim"
                };
                format!("in the {from}'s configuration: {e}")
            })?;
            out.push((c.requests.clone().unwrap_or_default(), parsed));
        }
    }
    Ok(out)
}

/// Whether a configuration for `requests` applies to a device allocated for `request`
/// (`request` or `request/subrequest`).
fn applies(requests: &[String], request: &str) -> bool {
    requests.is_empty()
        || requests.iter().any(|r| {
            request == r
                || request
                    .strip_prefix(r.as_str())
                    .is_some_and(|s| s.starts_with('/'))
        })
}

/// The GPU of an allocated device, which must be one of this node's.
fn device_of<'a>(r: &DeviceRequestAllocationResult, node: Node<'a>) -> Result<&'a Gpu, String> {
    let known = || {
        node.gpus
            .iter()
            .map(|g| device_name(&g.uuid))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if r.pool != node.pool {
        return Err(format!(
            "device {} of pool {:?} is not on this node (pool {:?}): the allocation is stale or for another node; delete the pod so that the claim is allocated again",
            r.device, r.pool, node.pool
        ));
    }
    node.gpus
        .iter()
        .find(|g| device_name(&g.uuid) == r.device)
        .ok_or_else(|| {
            format!(
                "device {} is not one of this node's GPUs ({}): the GPU is gone or the allocation is stale; delete the pod so that the claim is allocated again",
                r.device,
                known()
            )
        })
}

fn consumed<'a>(r: &'a DeviceRequestAllocationResult, capacity: &str) -> Option<&'a str> {
    r.consumed_capacity
        .as_ref()?
        .get(capacity)
        .map(|q| q.0.as_str())
}

/// A consumed `share` quantity as whole units (`30`, or `1k` as the API server writes 1000;
/// no fractions).
fn share_units(q: &str, units_per_gpu: u32) -> Result<u32, String> {
    let bad = || {
        format!(
            "consumed capacity {SHARE} {q:?} is not a whole number of units from 1 to {units_per_gpu}"
        )
    };
    if q.contains('.') {
        return Err(bad());
    }
    let n = parse_quantity(q).map_err(|_| bad())?;
    u32::try_from(n).map_err(|_| bad())
}

fn summary(per_gpu: &BTreeMap<&str, (u32, Option<u64>, ClaimConfig)>) -> String {
    per_gpu
        .iter()
        .map(|(g, (u, m, _))| {
            let m = m.map_or("no memory".to_string(), |m| format!("{m} bytes"));
            format!("{}: {u} units, {m}", device_name(g))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    const GIB: u64 = 1 << 30;
    const A: &str = "GPU-00000000-0000-0000-0000-00000000000a";
    const B: &str = "GPU-00000000-0000-0000-0000-00000000000b";

    fn gpus() -> Vec<Gpu> {
        [A, B]
            .iter()
            .map(|u| Gpu {
                uuid: u.to_string(),
                memory: 8 * GIB,
                name: "sim".into(),
            })
            .collect()
    }

    fn node(gpus: &[Gpu]) -> Node<'_> {
        Node {
            pool: "node-1",
            gpus,
            units_per_gpu: 100,
        }
    }

    fn result(request: &str, gpu: &str, consumed: Value) -> Value {
        json!({"request": request, "driver": DRIVER, "pool": "node-1",
            "device": device_name(gpu), "shareID": "0b1c8e3a-6f0e-4a57-9a39-8f2d3c1b7e11",
            "consumedCapacity": consumed})
    }

    fn claim(uid: &str, results: Vec<Value>, config: Vec<Value>) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": format!("c-{uid}"), "uid": uid},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results, "config": config}}}
        }))
        .unwrap()
    }

    fn opaque(source: &str, requests: &[&str], parameters: Value) -> Value {
        json!({"source": source, "requests": requests,
            "opaque": {"driver": DRIVER, "parameters": parameters}})
    }

    fn params(extra: Value) -> Value {
        let mut v = json!({"apiVersion": "gpushare.io/v1alpha1", "kind": "GpuShareConfig"});
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        v
    }

    #[test]
    fn thirty_units_and_four_gib_with_a_limit() {
        let g = gpus();
        let c = claim(
            "u1",
            vec![result("gpu", B, json!({"share": "30", "memory": "4Gi"}))],
            vec![opaque("FromClaim", &[], params(json!({"limit": "0.6"})))],
        );
        let p = prepare(&c, node(&g), &[]).unwrap();
        assert_eq!(p.gpus(), [B]);
        assert_eq!((p.share_units, p.memory), (30, 4 * GIB));
        assert_eq!((p.limit, p.weight), (0.6, 1.0));
        assert_eq!(p.devices[0].device, device_name(B));
        assert_eq!(p.full_name(), "ns/c-u1");
    }

    #[test]
    fn without_consumable_capacity_a_claim_gets_a_whole_gpu() {
        let g = gpus();
        let c = claim("u1", vec![result("gpu", A, Value::Null)], vec![]);
        let p = prepare(&c, node(&g), &[]).unwrap();
        assert_eq!((p.share_units, p.memory), (100, 8 * GIB));
        let c = claim(
            "u1",
            vec![result("gpu", A, Value::Null)],
            vec![opaque("FromClass", &[], params(json!({"memory": "2Gi"})))],
        );
        assert_eq!(prepare(&c, node(&g), &[]).unwrap().memory, 2 * GIB);
        let c = claim("u1", vec![result("gpu", A, json!({"share": "50"}))], vec![]);
        assert_eq!(
            prepare(&c, node(&g), &[]).unwrap().memory,
            4 * GIB,
            "memory follows the share when nothing else says"
        );
    }

    #[test]
    fn the_claims_configuration_wins_and_applies_to_the_requests_it_names() {
        let g = gpus();
        let c = claim(
            "u1",
            vec![result(
                "gpu/small",
                A,
                json!({"share": "20", "memory": "1Gi"}),
            )],
            vec![
                opaque("FromClaim", &["gpu"], params(json!({"weight": "4"}))),
                opaque(
                    "FromClass",
                    &[],
                    params(json!({"limit": "0.5", "weight": 2})),
                ),
                opaque("FromClaim", &["other"], params(json!({"limit": "0.1"}))),
                json!({"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"x": 1}}}),
            ],
        );
        let p = prepare(&c, node(&g), &[]).unwrap();
        assert_eq!((p.limit, p.weight), (0.5, 4.0));
    }

    #[test]
    fn results_of_other_drivers_are_left_to_them() {
        let g = gpus();
        let mut other = result("nic", A, Value::Null);
        other["driver"] = json!("nic.example.com");
        let p = prepare(&claim("u1", vec![other], vec![]), node(&g), &[]).unwrap();
        assert!(p.devices.is_empty());
    }

    #[test]
    fn a_claim_on_two_gpus_gets_the_same_on_each() {
        let g = gpus();
        let c = claim(
            "u1",
            vec![
                result("gpus", A, json!({"share": "100", "memory": "8Gi"})),
                result("gpus", B, json!({"share": "100", "memory": "8Gi"})),
            ],
            vec![],
        );
        let p = prepare(&c, node(&g), &[]).unwrap();
        assert_eq!(p.gpus(), [A, B]);
        let c = claim(
            "u1",
            vec![
                result("gpus", A, json!({"share": "30", "memory": "1Gi"})),
                result("gpus", B, json!({"share": "70", "memory": "1Gi"})),
            ],
            vec![],
        );
        let e = prepare(&c, node(&g), &[]).unwrap_err();
        assert!(e.contains("the same on each"), "{e}");
    }

    #[test]
    fn bad_input_is_refused_with_what_to_do() {
        let g = gpus();
        let ok = |r| claim("u9", vec![r], vec![]);
        let cases: Vec<(ResourceClaim, &str)> = vec![
            (
                claim(
                    "u9",
                    vec![result("gpu", A, json!({"share": "30"}))],
                    vec![opaque("FromClaim", &[], params(json!({"weight": "heavy"})))],
                ),
                "weight: \"heavy\" is not a weight",
            ),
            (
                claim(
                    "u9",
                    vec![result("gpu", A, json!({"share": "30"}))],
                    vec![opaque("FromClass", &[], json!({"limit": "0.5"}))],
                ),
                "in the DeviceClass's configuration",
            ),
            (
                ok(result("gpu", A, json!({"share": "150"}))),
                "more than a GPU has (100 units",
            ),
            (
                ok(result("gpu", A, json!({"share": "30", "memory": "9Gi"}))),
                "more than a GPU has",
            ),
            (
                ok(result("gpu", A, json!({"share": "0.5"}))),
                "not a whole number of units",
            ),
            (
                ok(result(
                    "gpu",
                    "GPU-00000000-0000-0000-0000-0000000000ff",
                    Value::Null,
                )),
                "is not one of this node's GPUs (gpu-00000000-0000-0000-0000-00000000000a, gpu-00000000-0000-0000-0000-00000000000b)",
            ),
            (
                ok({
                    let mut r = result("gpu", A, Value::Null);
                    r["pool"] = json!("node-2");
                    r
                }),
                "is not on this node",
            ),
            (
                claim(
                    "u9",
                    vec![result("gpu", A, json!({"share": "30", "memory": "1Gi"}))],
                    vec![opaque("FromClaim", &[], params(json!({"memory": "2Gi"})))],
                ),
                "remove memory from the configuration",
            ),
            (
                ok({
                    let mut r = result("gpu", A, Value::Null);
                    r["adminAccess"] = json!(true);
                    r
                }),
                "admin access",
            ),
        ];
        for (c, want) in cases {
            let e = prepare(&c, node(&g), &[]).unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
        let unallocated: ResourceClaim = serde_json::from_value(
            json!({"metadata": {"namespace": "ns", "name": "c", "uid": "u"}, "spec": {}}),
        )
        .unwrap();
        assert!(
            prepare(&unallocated, node(&g), &[])
                .unwrap_err()
                .contains("not allocated")
        );
    }

    #[test]
    fn claims_on_one_gpu_may_not_overcommit_it() {
        let g = gpus();
        let seventy = prepare(
            &claim(
                "u1",
                vec![result("gpu", A, json!({"share": "70", "memory": "4Gi"}))],
                vec![],
            ),
            node(&g),
            &[],
        )
        .unwrap();
        let thirty = claim(
            "u2",
            vec![result("gpu", A, json!({"share": "30", "memory": "4Gi"}))],
            vec![],
        );
        assert!(prepare(&thirty, node(&g), std::slice::from_ref(&seventy)).is_ok());
        let forty = claim(
            "u3",
            vec![result("gpu", A, json!({"share": "40", "memory": "1Gi"}))],
            vec![],
        );
        let e = prepare(&forty, node(&g), std::slice::from_ref(&seventy)).unwrap_err();
        assert!(
            e.contains("has 30 share units and 4294967296 bytes of memory left (prepared on it: ns/c-u1 (70 units, 4294967296 bytes))"),
            "{e}"
        );
        let on_b = claim(
            "u3",
            vec![result("gpu", B, json!({"share": "40", "memory": "1Gi"}))],
            vec![],
        );
        assert!(
            prepare(&on_b, node(&g), std::slice::from_ref(&seventy)).is_ok(),
            "other GPU"
        );
        // The same claim prepared again does not count against itself.
        let again = claim(
            "u1",
            vec![result("gpu", A, json!({"share": "70", "memory": "4Gi"}))],
            vec![],
        );
        assert_eq!(
            prepare(&again, node(&g), std::slice::from_ref(&seventy)),
            Ok(seventy)
        );
    }
}
