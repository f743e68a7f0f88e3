//! The admin protocol: how a node agent (`gpushare-device-manager`) tells the scheduler which
//! Kubernetes containers exist on the node and with what share of which GPU. It runs on its own
//! socket (`gpushare-scheduler --admin-socket PATH`), never exposed to tenants. Frames as in the
//! tenant protocol ([`crate::encode`], [`crate::recv`]).
//!
//! The agent says [`AdminRequest::Hello`] with [`ADMIN_PROTOCOL_VERSION`] first; the scheduler
//! answers [`AdminReply::Welcome`] or [`AdminReply::Error`] and closes. Then every request gets
//! exactly one reply. [`AdminRequest::Sync`] replaces the whole table (an agent sends it after
//! each (re)connection, so a restarted scheduler or agent heals); [`AdminRequest::Upsert`] and
//! [`AdminRequest::Remove`] change one container.

use serde::{Deserialize, Serialize};

pub const ADMIN_PROTOCOL_VERSION: u32 = 1;

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let g = PodGroup {
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
        };
        let msgs = [
            AdminRequest::Hello {
                version: ADMIN_PROTOCOL_VERSION,
                agent: "test".into(),
            },
            AdminRequest::Sync {
                groups: vec![g.clone()],
            },
            AdminRequest::Remove { key: g.key() },
        ];
        let mut wire = Vec::new();
        for m in &msgs {
            crate::send(&mut wire, m).unwrap();
        }
        let (mut r, mut buf) = (&wire[..], Vec::new());
        for m in &msgs {
            assert_eq!(
                crate::recv::<AdminRequest>(&mut r, &mut buf)
                    .unwrap()
                    .as_ref(),
                Some(m)
            );
        }
    }

    proptest! {
        #[test]
        fn decoders_reject_garbage_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let (mut r, mut buf) = (&bytes[..], Vec::new());
            while let Ok(Some(_)) = crate::recv::<AdminRequest>(&mut r, &mut buf) {}
            let (mut r, mut buf) = (&bytes[..], Vec::new());
            while let Ok(Some(_)) = crate::recv::<AdminReply>(&mut r, &mut buf) {}
        }
    }
}
