//! What the driver publishes: the node's ResourceSlice, one device per GPU with two
//! consumable capacities that many claims can take parts of (`allowMultipleAllocations`,
//! KEP-5075), and the DeviceClass that selects them (shipped in the manifests). Pure.
//!
//! | capacity | value | a claim that does not ask for it gets | a request is rounded up to |
//! |---|---|---|---|
//! | `share` | `--units-per-gpu` (100) | all of it: a whole GPU | whole units, 1 at least |
//! | `memory` | the GPU's memory, bytes | [`DEFAULT_MEMORY`] (at most the GPU's) | whole MiB |

use super::{DRIVER, MEMORY, SHARE, device_name};
use crate::inventory::Gpu;
use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute,
    DeviceCapacity, DeviceClass, DeviceClassSpec, DeviceSelector, ResourcePool, ResourceSlice,
    ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::BTreeMap;

/// The memory a claim that does not ask for any is given (and capped at): 1 GiB.
pub const DEFAULT_MEMORY: u64 = 1 << 30;
/// Memory requests are whole MiB.
const MEMORY_STEP: u64 = 1 << 20;
/// The DeviceClass's name.
pub const CLASS: &str = "gpushare.io";

/// The name of `node`'s ResourceSlice.
pub fn slice_name(node: &str) -> String {
    format!("{node}-{DRIVER}")
}

/// `node`'s pool: each healthy GPU, with `units_per_gpu` of `share`. `generation` is the
/// pool's, raised on every change.
pub fn resource_slice(
    node: &str,
    gpus: &[Gpu],
    units_per_gpu: u32,
    generation: i64,
) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node)),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(
                gpus.iter()
                    .enumerate()
                    .map(|(i, g)| device(i, g, units_per_gpu))
                    .collect(),
            ),
            ..Default::default()
        },
    }
}

fn q(n: u64) -> Quantity {
    Quantity(n.to_string())
}

fn device(index: usize, g: &Gpu, units_per_gpu: u32) -> Device {
    let units = u64::from(units_per_gpu);
    let attr = |s: &str| DeviceAttribute {
        string: Some(s.into()),
        ..Default::default()
    };
    let attributes = BTreeMap::from([
        ("uuid".to_string(), attr(&g.uuid)),
        ("productName".to_string(), attr(&g.name)),
        (
            "index".to_string(),
            DeviceAttribute {
                int: Some(index as i64),
                ..Default::default()
            },
        ),
    ]);
    let policy = |default: u64, min: u64, step: u64, max: Option<u64>| CapacityRequestPolicy {
        default: Some(q(default)),
        valid_range: Some(CapacityRequestPolicyRange {
            min: q(min),
            step: Some(q(step)),
            max: max.map(q),
        }),
        ..Default::default()
    };
    let default_memory = DEFAULT_MEMORY.min(g.memory / MEMORY_STEP * MEMORY_STEP);
    let capacity = BTreeMap::from([
        (
            SHARE.to_string(),
            DeviceCapacity {
                value: q(units),
                request_policy: Some(policy(units, 1, 1, Some(units))),
            },
        ),
        (
            MEMORY.to_string(),
            DeviceCapacity {
                value: q(g.memory),
                request_policy: Some(policy(default_memory, MEMORY_STEP, MEMORY_STEP, None)),
            },
        ),
    ]);
    Device {
        name: device_name(&g.uuid),
        attributes: Some(attributes),
        capacity: Some(capacity),
        allow_multiple_allocations: Some(true),
        ..Default::default()
    }
}

/// The DeviceClass `gpushare.io`: every device of this driver.
pub fn device_class() -> DeviceClass {
    DeviceClass {
        metadata: ObjectMeta {
            name: Some(CLASS.into()),
            ..Default::default()
        },
        spec: Some(DeviceClassSpec {
            selectors: Some(vec![DeviceSelector {
                cel: Some(CELDeviceSelector {
                    expression: format!("device.driver == \"{DRIVER}\""),
                }),
            }]),
            ..Default::default()
        }),
    }
}

/// Whether two slices publish the same pool content (everything but generation and metadata).
pub fn same_devices(a: &ResourceSlice, b: &ResourceSlice) -> bool {
    a.spec.devices == b.spec.devices
        && a.spec.driver == b.spec.driver
        && a.spec.node_name == b.spec.node_name
        && a.spec.pool.name == b.spec.pool.name
        && a.spec.pool.resource_slice_count == b.spec.pool.resource_slice_count
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn one_shareable_device_per_gpu() {
        let gpus = [Gpu {
            uuid: "GPU-67707573-6861-7265-2d73-696d2d677075".into(),
            memory: 8 << 30,
            name: "gpushare-sim".into(),
        }];
        let s = serde_json::to_value(resource_slice("node-1", &gpus, 100, 3)).unwrap();
        assert_eq!(s["apiVersion"], "resource.k8s.io/v1");
        assert_eq!(s["metadata"]["name"], "node-1-gpushare.io");
        assert_eq!(
            s["spec"]["pool"],
            json!({"name": "node-1", "generation": 3, "resourceSliceCount": 1})
        );
        let d = &s["spec"]["devices"][0];
        assert_eq!(d["name"], "gpu-67707573-6861-7265-2d73-696d2d677075");
        assert_eq!(d["allowMultipleAllocations"], true);
        assert_eq!(
            d["capacity"]["share"],
            json!({"value": "100", "requestPolicy": {"default": "100",
                "validRange": {"min": "1", "step": "1", "max": "100"}}})
        );
        assert_eq!(
            d["capacity"]["memory"],
            json!({"value": "8589934592", "requestPolicy": {"default": "1073741824",
                "validRange": {"min": "1048576", "step": "1048576"}}})
        );
        assert_eq!(d["attributes"]["uuid"]["string"], gpus[0].uuid);
        assert_eq!(d["attributes"]["index"]["int"], 0);
        let c = serde_json::to_value(device_class()).unwrap();
        assert_eq!(
            c["spec"]["selectors"][0]["cel"]["expression"],
            "device.driver == \"gpushare.io\""
        );
    }
}
