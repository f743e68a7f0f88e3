//! `gpushare-dra`: the Kubernetes Dynamic Resource Allocation driver `gpushare.io`.
//!
//! Each GPU of the node is one device of the node's ResourceSlice with two consumable
//! capacities, `share` (units of GPU time, 100 by default) and `memory` (bytes), that many
//! claims may take parts of ([`slice`](mod@slice)); the kube-scheduler places a claim's share and memory
//! on one GPU. When the kubelet prepares a claim on this node, the claim's allocation and its
//! opaque configuration (limit, weight: [`config`]) are checked against the node's GPUs and
//! the claims already prepared ([`claim`]); the container gets the GPU, the scheduler's socket
//! and the hook through a CDI device ([`cdi`]); what is prepared survives restarts
//! ([`checkpoint`]). Every container using a prepared claim becomes a scheduler group with the
//! claim's share, memory cap, limit and weight on its GPU ([`reconcile`]), pushed as the device
//! plugin's are. [`plugin`] serves the kubelet, [`publish`] keeps the ResourceSlice, [`driver`]
//! ties them together.

pub mod cdi;
pub mod checkpoint;
pub mod claim;
pub mod config;
pub mod driver;
pub mod plugin;
pub mod publish;
pub mod reconcile;
pub mod slice;

/// The driver's name: in ResourceSlices, DeviceClass selectors, allocation results and opaque
/// configurations.
pub const DRIVER: &str = "gpushare.io";
/// The capacity of GPU time, in units (`--units-per-gpu` per GPU).
pub const SHARE: &str = "share";
/// The capacity of GPU memory, in bytes.
pub const MEMORY: &str = "memory";
/// The Event reason of a claim (or a pod's use of claims) that cannot be prepared as written.
pub const REASON: &str = "InvalidGpushareClaim";
/// The component the driver's events come from.
pub const COMPONENT: &str = "gpushare-dra";

/// The device name of a GPU in the ResourceSlice: its UUID in lower case
/// (`gpu-67707573-6861-7265-2d73-696d2d677075`), a DNS label that stays the GPU's whatever
/// the order the driver finds the GPUs in.
pub fn device_name(uuid: &str) -> String {
    uuid.to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    #[test]
    fn device_names_are_dns_labels() {
        let n = super::device_name("GPU-67707573-6861-7265-2d73-696d2d677075");
        assert_eq!(n, "gpu-67707573-6861-7265-2d73-696d2d677075");
        assert!(n.len() <= 63);
        assert!(
            n.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        );
    }
}
