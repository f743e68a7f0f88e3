//! The admin protocol: how a node agent (`gpushare-device-manager`) tells the scheduler which
//! Kubernetes containers exist on the node and with what share of which GPU. It runs on its own
//! socket (`gpushare-scheduler --admin-socket PATH`), never exposed to tenants. Frames as in the
//! tenant protocol ([`crate::encode`], [`crate::recv`]).
//!
//! The agent says [`AdminRequest::Hello`] with [`ADMIN_PROTOCOL_VERSION`] first; the scheduler
//! answers [`AdminReply::Welcome`] or [`AdminReply::Error`] and closes. Then every request gets
//! exactly one reply. [`AdminRequest::Sync`] replaces the whole table (an agent sends it after
//! each (re)connection, so a restarted scheduler or agent heals); [`AdminRequest::Upsert`] and
//! [`AdminRequest::Remove`] change one container; [`AdminRequest::Usage`] asks what the GPUs
//! are really used for.

use serde::{Deserialize, Serialize};

pub const ADMIN_PROTOCOL_VERSION: u32 = 2;

/// One container's policy: it becomes the scheduler group `namespace/pod/container`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodGroup {
    /// `metadata.uid` of the pod (with dashes, as the API server writes it).
    pub pod_uid: String,
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// The container's ID without the runtime prefix (`containerd://` stripped), once the
    /// kubelet reported it; needed to tell apart several GPU containers of one pod.
    pub container_id: Option<String>,
    /// The GPUs the container was given, as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub gpus: Vec<String>,
    /// Guaranteed share of each of its GPUs, 0..=1.
    pub request: f64,
    /// Hard cap, request..=1.
    pub limit: f64,
    /// Weight for spare time, > 0.
    pub weight: f64,
    /// Memory cap in bytes on each of its GPUs (`None`: uncapped).
    pub memory: Option<u64>,
    /// The latency class (annotation `gpushare.io/gpu-class: latency`).
    pub latency: bool,
}

/// The key of a [`PodGroup`]: pod UID and container name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ContainerKey {
    pub pod_uid: String,
    pub container: String,
}

impl PodGroup {
    pub fn key(&self) -> ContainerKey {
        ContainerKey {
            pod_uid: self.pod_uid.clone(),
            container: self.container.clone(),
        }
    }
}

/// `GPU-8-4-4-4-12` hex form of a driver UUID, as nvidia-smi prints it (and as the admin
/// protocol carries GPUs).
pub fn gpu_uuid_string(u: &crate::GpuUuid) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The inverse of [`gpu_uuid_string`]; `None` for anything else.
pub fn parse_gpu_uuid(s: &str) -> Option<crate::GpuUuid> {
    let rest = s.strip_prefix("GPU-")?;
    let groups: Vec<usize> = rest.split('-').map(str::len).collect();
    let hex: String = rest.split('-').collect();
    if groups != [8, 4, 4, 4, 12] || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Agent → scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum AdminRequest {
    /// First message. `agent` names the sender for the scheduler's log.
    Hello { version: u32, agent: String },
    /// The complete set of containers on the node: anything not listed is removed.
    Sync { groups: Vec<PodGroup> },
    /// Create or change one container's group.
    Upsert { group: PodGroup },
    /// The container (or its pod) is gone; its group is freed when its last process disconnects.
    Remove { key: ContainerKey },
    /// What the scheduler measures on each GPU it has seen ([`AdminReply::Usage`]), for
    /// placement.
    Usage,
}

/// One GPU's measured use ([`AdminRequest::Usage`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuUsage {
    /// `GPU-…` UUID.
    pub gpu: String,
    /// Share of GPU time used over the scheduler's window, 0..=1.
    pub busy: f64,
    /// Bytes of GPU memory its tenants hold.
    pub memory_used: u64,
}

/// Scheduler → agent, one per request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum AdminReply {
    Welcome {
        version: u32,
    },
    /// The request was applied.
    Done,
    /// The request was refused (nothing changed); the message says why and what to do.
    Error {
        message: String,
    },
    /// Answer to [`AdminRequest::Usage`].
    Usage {
        gpus: Vec<GpuUsage>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_frame::fuzz;
    use proptest::prelude::*;

    fn group() -> PodGroup {
        PodGroup {
            pod_uid: "0b1c8e3a-6f0e-4a57-9a39-8f2d3c1b7e11".into(),
            namespace: "default".into(),
            pod: "train".into(),
            container: "main".into(),
            container_id: Some("ab".repeat(32)),
            gpus: vec!["GPU-67707573-6861-7265-2d73-696d2d677075".into()],
            request: 0.3,
            limit: 0.6,
            weight: 2.0,
            memory: Some(2 << 30),
            latency: false,
        }
    }

    #[test]
    fn requests_round_trip_and_hostile_ones_are_rejected() {
        let g = group();
        let samples = [
            AdminRequest::Hello {
                version: ADMIN_PROTOCOL_VERSION,
                agent: "test".into(),
            },
            AdminRequest::Sync {
                groups: vec![g.clone(), g.clone()],
            },
            AdminRequest::Upsert { group: g.clone() },
            AdminRequest::Remove { key: g.key() },
            AdminRequest::Usage,
        ];
        fuzz::frames(21, &samples, 100_000, |_| {}).assert_exercised(100_000);
    }

    #[test]
    fn replies_round_trip_and_hostile_ones_are_rejected() {
        let samples = [
            AdminReply::Welcome {
                version: ADMIN_PROTOCOL_VERSION,
            },
            AdminReply::Done,
            AdminReply::Error {
                message: "no".into(),
            },
            AdminReply::Usage {
                gpus: vec![GpuUsage {
                    gpu: "GPU-67707573-6861-7265-2d73-696d2d677075".into(),
                    busy: 0.5,
                    memory_used: 1 << 30,
                }],
            },
        ];
        fuzz::frames(22, &samples, 100_000, |_| {}).assert_exercised(100_000);
    }

    #[test]
    fn gpu_uuids_round_trip() {
        let text = "GPU-67707573-6861-7265-2d73-696d2d677075";
        let u = parse_gpu_uuid(text).unwrap();
        assert_eq!(&u, b"gpushare-sim-gpu");
        assert_eq!(gpu_uuid_string(&u), text);
        for bad in [
            "GPU-6770757-36861-7265-2d73-696d2d677075",
            "67707573-6861-7265-2d73-696d2d677075",
            "GPU-zz707573-6861-7265-2d73-696d2d677075",
            "GPU-",
        ] {
            assert_eq!(parse_gpu_uuid(bad), None, "{bad}");
        }
    }

    proptest! {
        #[test]
        fn every_gpu_uuid_prints_and_parses_back(u in any::<[u8; 16]>()) {
            prop_assert_eq!(parse_gpu_uuid(&gpu_uuid_string(&u)), Some(u));
        }
    }

    /// Whatever parses is a UUID that prints back as written (up to hex case).
    #[test]
    fn gpu_uuid_text_round_trips_and_hostile_text_is_rejected() {
        let samples = [
            "GPU-67707573-6861-7265-2d73-696d2d677075",
            "GPU-00000000-0000-0000-0000-00000000000F",
        ];
        fuzz::texts(23, &samples, 100_000, |s| match parse_gpu_uuid(s) {
            Some(u) => {
                assert!(gpu_uuid_string(&u).eq_ignore_ascii_case(s), "{s}");
                true
            }
            None => false,
        })
        .assert_exercised(100_000);
    }
}
