//! The hook ↔ scheduler protocol. One Unix stream socket per process; frames from
//! [`gpushare_frame`]. The first message is always [`ClientMsg::Hello`] with
//! [`PROTOCOL_VERSION`]; the scheduler answers [`ServerMsg::Welcome`] or a fatal
//! [`ServerMsg::Error`] that says what to do.
//!
//! Identity is not in these messages: the scheduler takes it from the socket (`SO_PEERCRED`,
//! `/proc/<pid>/cgroup`). A declared group is honoured only when the daemon runs with `--dev`.

pub use gpushare_frame::{FrameBuf, MAX_FRAME, WireError, append, encode, heartbeat, recv, send};

pub mod admin;
pub mod status;
use serde::{Deserialize, Serialize};

pub const PROTOCOL_VERSION: u32 = 13;

/// The longest the scheduler makes a [`ClientMsg::MemReserve`] wait for memory under
/// overcommit before it answers (its `overcommit.max_wait` is at most this); the hook waits
/// for that answer a little longer.
pub const MAX_MEMORY_WAIT_NS: u64 = 600_000_000_000;

/// The most GPU work a process keeps queued in a turn that another group may cut short: a
/// [`ServerMsg::Grant`]'s `queue_budget_ns` is then an eighth of the turn's quota, at most
/// this (what a turn of the scheduler's default 20 ms quota gets). Before it was ever granted
/// a turn, a process that launches without one (the scheduler unresponsive, `GPUSHARE_FAIL=open`)
/// paces its launches to this budget.
pub const CUT_TURN_QUEUE_BUDGET_NS: u64 = 2_500_000;

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
    /// The latency class (`gpushare run --latency`): a request server whose tail latency
    /// matters.
    pub latency: bool,
}

/// What a process measured of one of its turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnUse {
    /// When it launched the turn's first kernel (CLOCK_MONOTONIC ns).
    pub first_ns: u64,
    /// When the turn's last kernel ended (device time placed on CLOCK_MONOTONIC ns).
    pub last_ns: u64,
}

/// Client (hook or CLI) → scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ClientMsg {
    Hello {
        version: u32,
        declared: Option<GroupSpec>,
    },
    /// The process wants a turn on the GPU.
    Acquire { gpu: GpuUuid },
    /// The process gives its turn `token` back before its deadline: it has no more work for
    /// now (it sends `Acquire` when it has), and what it launched drains at about
    /// `drained_ns`. Also withdraws a planned turn it no longer needs.
    Yield {
        gpu: GpuUuid,
        token: u64,
        drained_ns: u64,
    },
    /// What the process measured of turn `token` once that turn's work drained (`used`:
    /// `None` if it launched nothing in it), and whether it has more work waiting (`again`).
    /// Sent for every turn it was granted and started.
    Report {
        gpu: GpuUuid,
        token: u64,
        used: Option<TurnUse>,
        again: bool,
    },
    /// The scheduler's report ([`ServerMsg::Status`]), for `gpushare status`.
    Status,
    /// Reserve `bytes` of the group's memory cap on `gpu` before allocating; answered by
    /// [`ServerMsg::Memory`]. Rolled back with [`ClientMsg::MemFree`] if the allocation fails.
    MemReserve { req: u64, gpu: GpuUuid, bytes: u64 },
    /// Give back memory reserved earlier (a free, or a failed allocation). No answer.
    MemFree { gpu: GpuUuid, bytes: u64 },
    /// The group's cap and use on `gpu` (for `cuMemGetInfo`); answered by [`ServerMsg::Memory`].
    MemQuery { req: u64, gpu: GpuUuid },
    /// What this process holds on `gpu`, all told: sent after (re)connecting, so that
    /// restarted books are right, and after the scheduler answers again having left a question
    /// unanswered past its [`ServerMsg::Welcome`] `liveness_ns` (the process decided meanwhile
    /// on its own). The books take its word for it.
    MemSync { gpu: GpuUuid, bytes: u64 },
    /// How much memory `gpu` has in all (the driver's `cuDeviceTotalMem_v2`), sent with
    /// [`ClientMsg::MemSync`] after Hello: the scheduler's physical books of that GPU.
    MemTotal { gpu: GpuUuid, bytes: u64 },
    /// The process holds managed (unified) memory, which the driver cannot checkpoint: its
    /// group is never swapped to host memory. Sent before its first managed allocation, and
    /// after each (re)connection once it made one. No answer.
    MemManaged,
    /// The process exported or opened memory shared with another process (CUDA IPC,
    /// `cuIpcGetMemHandle`, `cuIpcOpenMemHandle`): swapped to host memory, the other process
    /// would lose it, so its group is never swapped out. Sent before its first export or open,
    /// and after each (re)connection once it made one. No answer.
    MemIpc,
    /// Is the scheduler there? Answered at once with [`ServerMsg::Alive`] for the same GPU: a
    /// process waiting for a turn on `gpu` asks when it has heard nothing for a while.
    Probe { gpu: GpuUuid },
}

/// Scheduler → client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ServerMsg {
    /// On the tenant socket, the scheduler passes its heartbeat page with it (`SCM_RIGHTS`,
    /// [`heartbeat`]) when it has one: the time its event loop last ran, which a process
    /// waiting for a turn reads before it would send a [`ClientMsg::Probe`].
    Welcome {
        group: String,
        /// The scheduler answers a question (a [`ClientMsg::Probe`], a reservation) within
        /// this long while it is well: past it, the process takes it to be unresponsive and
        /// follows `GPUSHARE_FAIL` until it is heard from again (its quota plus its grace).
        liveness_ns: u64,
    },
    /// A turn on `gpu` from `start_ns` until `deadline_ns` (absolute CLOCK_MONOTONIC),
    /// usually granted ahead of its start: the turn before it ends then. The process may
    /// launch a little before `start_ns` so that its first kernels queue behind that turn's
    /// last ones, and stops launching at `deadline_ns` on its own. Sent again with the same
    /// token when the start moves earlier (the turn before was given back). `queue_budget_ns`:
    /// how much GPU work the process may keep queued during it (its launches are paced to it).
    /// `open_at_start`: a latency-class group keeps the GPU until `start_ns` for its next
    /// request, and may take it back: the process launches nothing before.
    /// `just_in_time`: a latency-class group may ask at any moment and would wait behind what
    /// this process has queued: a kernel longer than half the budget is launched only as the
    /// work queued before it runs down to `queue_budget_ns`, not as soon as the one before it
    /// starts.
    Grant {
        gpu: GpuUuid,
        token: u64,
        start_ns: u64,
        deadline_ns: u64,
        queue_budget_ns: u64,
        open_at_start: bool,
        just_in_time: bool,
    },
    /// Stop launching in turn `token` at once (it ended without a report by its end + grace),
    /// or forget it if it has not started (withdrawn).
    Revoke { gpu: GpuUuid, token: u64 },
    /// Boxed: a report is far larger than any other message.
    Status { report: Box<status::Report> },
    /// Answer to a reservation (`granted`) or query: the group's cap (`None`: uncapped) and
    /// what the group uses on that GPU, this reservation included.
    /// `journaled`: the reservation is on disk, so a restarted scheduler still counts it;
    /// `false` when the journal could not be written (its file system full, say): the process
    /// then follows `GPUSHARE_FAIL` (`open` allocates anyway, `closed` gives it back and
    /// fails the allocation). Always true for refusals and queries.
    Memory {
        req: u64,
        granted: bool,
        cap: Option<u64>,
        used: u64,
        journaled: bool,
    },
    /// Reservation `req` waits for memory on its GPU (memory overcommit: the GPU is full, and
    /// others free memory or are swapped to host memory for it): its answer comes within
    /// `max_wait_ns`.
    MemWait { req: u64, max_wait_ns: u64 },
    /// `fatal`: the connection is closed after this message.
    Error { message: String, fatal: bool },
    /// Turn `token` (running or planned) now ends at `deadline_ns`: earlier (a group owed
    /// more is waiting) or later (its group is still the one to serve: keep going).
    Deadline {
        gpu: GpuUuid,
        token: u64,
        deadline_ns: u64,
    },
    /// The answer to [`ClientMsg::Probe`].
    Alive { gpu: GpuUuid },
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_frame::fuzz;

    const GPU: GpuUuid = *b"gpushare-sim-gpu";

    fn client_msgs() -> Vec<ClientMsg> {
        vec![
            ClientMsg::Hello {
                version: PROTOCOL_VERSION,
                declared: Some(GroupSpec {
                    name: "a".into(),
                    request: 0.5,
                    limit: 1.0,
                    weight: 1.0,
                    memory: Some(4 << 30),
                    latency: false,
                }),
            },
            ClientMsg::Hello {
                version: PROTOCOL_VERSION,
                declared: None,
            },
            ClientMsg::Acquire { gpu: GPU },
            ClientMsg::Yield {
                gpu: GPU,
                token: 3,
                drained_ns: 20_000_000,
            },
            ClientMsg::Report {
                gpu: [7; 16],
                token: 3,
                used: Some(TurnUse {
                    first_ns: 1,
                    last_ns: 20_000_000,
                }),
                again: true,
            },
            ClientMsg::Report {
                gpu: GPU,
                token: u64::MAX,
                used: None,
                again: false,
            },
            ClientMsg::Status,
            ClientMsg::MemReserve {
                req: 1,
                gpu: GPU,
                bytes: 1 << 30,
            },
            ClientMsg::MemFree {
                gpu: GPU,
                bytes: 1 << 30,
            },
            ClientMsg::MemQuery { req: 2, gpu: GPU },
            ClientMsg::MemSync { gpu: GPU, bytes: 5 },
            ClientMsg::MemTotal {
                gpu: GPU,
                bytes: 80 << 30,
            },
            ClientMsg::Probe { gpu: GPU },
        ]
    }

    #[test]
    fn client_messages_round_trip_and_hostile_ones_are_rejected() {
        fuzz::frames(11, &client_msgs(), 150_000, |_| {}).assert_exercised(150_000);
    }

    /// A report with one of everything.
    fn report() -> status::Report {
        use status::*;
        let group = GroupReport {
            name: "ns/train/main".into(),
            request: 0.3,
            limit: 0.6,
            weight: 2.0,
            latency: false,
            effective_request: 0.3,
            target_share: 0.6,
            achieved_share: 0.59,
            busy_seconds: 12.5,
            tokens: 7,
            waits: 3,
            overruns: 1,
            revocations: 0,
            preempted: 2,
            pids: vec![42, 43],
            active: true,
            memory_used: 1 << 30,
            memory_cap: Some(4 << 30),
            memory_clamped: None,
            memory_reservations: 5,
            memory_swapped: 1 << 20,
            memory_state: status::MemoryState::SwappingIn,
            memory_refused: Some("why".into()),
            pod: Some(PodLabels {
                namespace: "ns".into(),
                pod: "train".into(),
                container: "main".into(),
            }),
        };
        Report {
            dev_mode: false,
            gpus: vec![GpuReport {
                uuid: admin::gpu_uuid_string(&GPU),
                holder: Some(ClientReport {
                    pid: 42,
                    group: group.name.clone(),
                }),
                waiting: vec![],
                groups: vec![group],
                physical: Some(status::PhysicalMemory {
                    total: 80 << 30,
                    used: 60 << 30,
                    free: 20 << 30,
                    swapped: 30 << 30,
                    overcommit: 1.5,
                    waiting: 1,
                }),
            }],
            pods: vec![PodReport {
                namespace: "ns".into(),
                pod: "train".into(),
                container: "main".into(),
                pod_uid: "0b1c8e3a-6f0e-4a57-9a39-8f2d3c1b7e11".into(),
                container_id: None,
                group: "ns/train/main".into(),
                gpus: vec![admin::gpu_uuid_string(&GPU)],
                request: 0.3,
                limit: 0.6,
                weight: 2.0,
                memory: Some(4 << 30),
                removed: false,
            }],
            unhooked: vec![Unhooked {
                pid: 7,
                command: "python3".into(),
                hook_loaded: false,
            }],
            event_loop: Durations {
                bounds_s: vec![0.001, 0.01],
                counts: vec![5, 1, 0],
                count: 6,
                sum_s: 0.004,
                max_s: 0.002,
            },
            memory_swaps: status::MemorySwaps {
                swap_outs: 2,
                swap_ins: 1,
                swap_out_failures: 1,
                swap_in_failures: 0,
                allocation_waits: 3,
                allocations_refused: 1,
                swap_out_seconds: Durations {
                    bounds_s: vec![1.0, 10.0],
                    counts: vec![0, 1, 0],
                    count: 1,
                    sum_s: 2.5,
                    max_s: 2.5,
                },
                ..Default::default()
            },
        }
    }

    #[test]
    fn server_messages_round_trip_and_hostile_ones_are_rejected() {
        let samples = [
            ServerMsg::Welcome {
                group: "train".into(),
                liveness_ns: 40_000_000,
            },
            ServerMsg::Grant {
                gpu: GPU,
                token: 9,
                start_ns: 1,
                deadline_ns: 20_000_001,
                queue_budget_ns: 2_500_000,
                open_at_start: true,
                just_in_time: true,
            },
            ServerMsg::Revoke { gpu: GPU, token: 9 },
            ServerMsg::Status {
                report: Box::new(report()),
            },
            ServerMsg::Memory {
                req: 1,
                granted: true,
                cap: Some(4 << 30),
                used: 1 << 30,
                journaled: false,
            },
            ServerMsg::Error {
                message: "no".into(),
                fatal: true,
            },
            ServerMsg::Deadline {
                gpu: GPU,
                token: 9,
                deadline_ns: u64::MAX,
            },
            ServerMsg::Alive { gpu: GPU },
        ];
        fuzz::frames(12, &samples, 150_000, |_| {}).assert_exercised(150_000);
    }
}
