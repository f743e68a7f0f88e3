//! The node's GPUs and the device IDs the plugin advertises for them: `units` IDs per GPU,
//! `<GPU-UUID>::<n>` for n in 0..units (the NVIDIA plugin's replica habit), so that a container
//! asking for 30 units of `gpushare.io/gpu-share` holds 30 of one GPU's IDs.

use serde::{Deserialize, Serialize};

/// The extended resource the plugin serves.
pub const RESOURCE: &str = "gpushare.io/gpu-share";

/// One GPU as the CUDA driver reports it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Gpu {
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi prints it.
    pub uuid: String,
    /// Total memory in bytes.
    pub memory: u64,
    /// Product name.
    pub name: String,
}

/// The device ID of unit `n` of `gpu`.
pub fn device_id(gpu: &str, n: u32) -> String {
    format!("{gpu}::{n}")
}

/// `<GPU-UUID>::<n>` → (UUID, n).
pub fn parse_device_id(id: &str) -> Option<(&str, u32)> {
    let (gpu, n) = id.rsplit_once("::")?;
    if gpu.is_empty() || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((gpu, n.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ids_round_trip() {
        let gpu = "GPU-67707573-6861-7265-2d73-696d2d677075";
        let id = device_id(gpu, 42);
        assert!(id.len() <= 63, "the kubelet's limit");
        assert_eq!(parse_device_id(&id), Some((gpu, 42)));
        assert_eq!(parse_device_id("GPU-x::"), None);
        assert_eq!(parse_device_id("GPU-x::-1"), None);
        assert_eq!(parse_device_id("::3"), None);
        assert_eq!(parse_device_id("GPU-x:3"), None);
    }
}
