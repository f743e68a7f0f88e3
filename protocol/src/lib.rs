//! The hook ↔ scheduler protocol. One Unix stream socket per process; frames from
//! [`gpushare_frame`]. The first message is always [`ClientMsg::Hello`] with
//! [`PROTOCOL_VERSION`]; the scheduler answers [`ServerMsg::Welcome`] or a fatal
//! [`ServerMsg::Error`] that says what to do.
//!
//! Identity is not in these messages: the scheduler takes it from the socket (`SO_PEERCRED`,
//! `/proc/<pid>/cgroup`). A declared group is honoured only when the daemon runs with `--dev`.

pub use gpushare_frame::{MAX_FRAME, WireError, encode, recv, send};

pub mod admin;
use serde::{Deserialize, Serialize};

pub const PROTOCOL_VERSION: u32 = 2;

/// Environment variable naming the scheduler socket.
pub const SOCKET_ENV: &str = "GPUSHARE_SOCKET";
/// Where the scheduler listens when `GPUSHARE_SOCKET` is not set.
pub const DEFAULT_SOCKET: &str = "/run/gpushare/gpushare.sock";

/// A GPU, by the UUID the driver reports (`cuDeviceGetUuid`), so device renumbering by
/// `CUDA_VISIBLE_DEVICES` cannot confuse the scheduler.
pub type GpuUuid = [u8; 16];

/// A group's declared policy (development mode, `gpushare run --group …`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupSpec {
    pub name: String,
    pub request: f64,
    pub limit: f64,
    pub weight: f64,
    /// Memory cap in bytes, if any.
    pub memory: Option<u64>,
}

/// Client (hook or CLI) → scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ClientMsg {
    Hello {
        version: u32,
        declared: Option<GroupSpec>,
    },
    /// The process wants the GPU's token.
    Acquire { gpu: GpuUuid },
    /// The process gives the token back; `used_ns` is how long it held the GPU, from the
    /// grant until its work drained (more than the quota when it overran).
    Release {
        gpu: GpuUuid,
        token: u64,
        used_ns: u64,
    },
    /// Admin: the scheduler's view as JSON ([`ServerMsg::Status`]).
    Status,
    /// Reserve `bytes` of the group's memory cap on `gpu` before allocating; answered by
    /// [`ServerMsg::Memory`]. Rolled back with [`ClientMsg::MemFree`] if the allocation fails.
    MemReserve { req: u64, gpu: GpuUuid, bytes: u64 },
    /// Give back memory reserved earlier (a free, or a failed allocation). No answer.
    MemFree { gpu: GpuUuid, bytes: u64 },
    /// The group's cap and use on `gpu` (for `cuMemGetInfo`); answered by [`ServerMsg::Memory`].
    MemQuery { req: u64, gpu: GpuUuid },
    /// After reconnecting: what this process holds on `gpu`, so restarted books are right.
    MemSync { gpu: GpuUuid, bytes: u64 },
    /// After an early handoff (released while its last work was still queued, that tail
    /// estimated): how long `token` really held the GPU, grant → drained. It only ever adds to
    /// the charge. (Last, so older variants keep their tags.)
    Settle {
        gpu: GpuUuid,
        token: u64,
        used_ns: u64,
    },
}

/// Scheduler → client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ServerMsg {
    Welcome {
        group: String,
    },
    /// The token of `gpu` from `start_ns` until `deadline_ns` (absolute CLOCK_MONOTONIC).
    /// `start_ns` may lie a little ahead: the work the previous holder left queued at its early
    /// handoff is estimated to drain then. Launches may queue behind it at once; the time held
    /// is counted from `start_ns`.
    Grant {
        gpu: GpuUuid,
        token: u64,
        start_ns: u64,
        deadline_ns: u64,
        quota_ns: u64,
    },
    /// The token overran its deadline and grace: stop launching and release it.
    Revoke {
        gpu: GpuUuid,
        token: u64,
    },
    Status {
        json: String,
    },
    /// Answer to a reservation (`granted`) or query: the group's cap (`None`: uncapped) and
    /// what the group uses on that GPU, this reservation included.
    Memory {
        req: u64,
        granted: bool,
        cap: Option<u64>,
        used: u64,
    },
    /// `fatal`: the connection is closed after this message.
    Error {
        message: String,
        fatal: bool,
    },
    /// The held token now ends at `deadline_ns`: earlier (someone owed more is waiting: stop
    /// launching then and release as at any deadline) or later (nobody else wants the GPU:
    /// keep going without a handover). Ignored once the client has begun to give it back.
    /// (Last, so older variants keep their tags.)
    Deadline {
        gpu: GpuUuid,
        token: u64,
        deadline_ns: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let msgs = [
            ClientMsg::Hello {
                version: PROTOCOL_VERSION,
                declared: Some(GroupSpec {
                    name: "a".into(),
                    request: 0.5,
                    limit: 1.0,
                    weight: 1.0,
                    memory: Some(4 << 30),
                }),
            },
            ClientMsg::Release {
                gpu: [7; 16],
                token: 3,
                used_ns: 20_000_000,
            },
        ];
        let mut wire = Vec::new();
        for m in &msgs {
            send(&mut wire, m).unwrap();
        }
        let (mut r, mut buf) = (&wire[..], Vec::new());
        for m in &msgs {
            assert_eq!(
                recv::<ClientMsg>(&mut r, &mut buf).unwrap().as_ref(),
                Some(m)
            );
        }
    }

    proptest! {
        #[test]
        fn decoders_reject_garbage_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let (mut r, mut buf) = (&bytes[..], Vec::new());
            while let Ok(Some(_)) = recv::<ClientMsg>(&mut r, &mut buf) {}
            let (mut r, mut buf) = (&bytes[..], Vec::new());
            while let Ok(Some(_)) = recv::<ServerMsg>(&mut r, &mut buf) {}
        }
    }
}
