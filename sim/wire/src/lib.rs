//! Wire protocol between the simulated driver (`libcuda.so`, one per client process) and the
//! simulated device process that owns every GPU's timeline.
//!
//! Frames are a little-endian `u32` length followed by a `postcard` body. Launches and other
//! stream operations are fire-and-forget so that a simulated launch costs about what a real one
//! does (one `write`); only queries, waits and allocations carry a request id and get a reply.

pub use board::EventBoard;
pub use gpushare_frame::{MAX_FRAME, WireError, encode, recv, send};

mod board;
use serde::{Deserialize, Serialize};

/// Bumped on every incompatible change; checked in [`Request::Hello`].
pub const PROTOCOL_VERSION: u32 = 6;

/// Environment variable naming the device socket, set by `gpushare-sim run`.
pub const SOCKET_ENV: &str = "GPUSHARE_SIM_SOCKET";

/// A stream operation as the device sees it: `(client stream id, sequence number in that stream)`.
pub type OpRef = (u64, u64);

/// What a queued stream operation does on the device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// A kernel: `function` was announced with [`Request::RegisterFunction`]; `arg0` is the value
    /// of its first parameter when that is 8 bytes wide (the duration of `gpushare_spin*`, the
    /// flag address of `gpushare_wait_flag*` and `gpushare_set_flag*`).
    Kernel { function: u64, arg0: Option<u64> },
    /// Zero-duration marker (stream join, fence): completes once its dependencies have.
    Marker,
    /// Record `generation` of the event in board slot `slot`: a marker whose completion time
    /// the device posts on the client's [`EventBoard`] as soon as it is decided, and keeps
    /// (for waits on it long after) until the slot's next record.
    Event { slot: u32, generation: u64 },
    /// Host function: the device asks the client to run it ([`Reply::RunHostFunc`]) and the
    /// stream waits until the client answers with [`Request::HostFuncDone`].
    HostFunc,
    /// A record of an event shared between processes ([`Request::ShareEvent`]): as
    /// [`Op::Event`], and it becomes the shared event's latest record, whoever made it.
    SharedEvent {
        slot: u32,
        generation: u64,
        event: u64,
    },
    /// Zero-duration marker that also waits for the latest record of shared event `event`
    /// made before it, by any process (none yet: no wait).
    WaitShared { event: u64 },
}

/// Client → device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    Hello {
        version: u32,
        pid: u32,
    },
    CreateContext {
        ctx: u64,
        device: u32,
    },
    DestroyContext {
        ctx: u64,
    },
    CreateStream {
        stream: u64,
        ctx: u64,
        priority: i32,
    },
    DestroyStream {
        stream: u64,
    },
    RegisterFunction {
        function: u64,
        name: String,
    },
    /// Queue `op` as number `seq` of `stream`; it also waits for every op in `deps`.
    Submit {
        stream: u64,
        seq: u64,
        deps: Vec<OpRef>,
        op: Op,
    },
    HostFuncDone {
        stream: u64,
        seq: u64,
    },
    /// Reply [`Reply::Done`] once every op in `ops` has completed on the device.
    Wait {
        req: u64,
        ops: Vec<OpRef>,
    },
    /// Reply [`Reply::Status`] at once.
    Query {
        req: u64,
        ops: Vec<OpRef>,
    },
    /// Reserve device memory; reply [`Reply::Alloc`].
    Alloc {
        req: u64,
        device: u32,
        bytes: u64,
    },
    /// Give device memory back; reply [`Reply::Freed`] once other processes can allocate it
    /// (`cuMemFree` returns with the memory free, so a driver call must wait for it).
    Free {
        req: u64,
        device: u32,
        bytes: u64,
    },
    MemInfo {
        req: u64,
        device: u32,
    },
    /// Share an event with other processes (an IPC event); `record` is its latest record so
    /// far. Reply [`Reply::SharedEvent`] with the id other processes open it by.
    ShareEvent {
        req: u64,
        record: Option<OpRef>,
    },
    /// Open a shared event: reply [`Reply::SharedEvent`] if it exists, else an error.
    OpenSharedEvent {
        req: u64,
        event: u64,
    },
    /// The sharing process destroyed its event: no more opens.
    UnshareEvent {
        event: u64,
    },
    /// The latest record of a shared event, by any process: reply [`Reply::Status`] with its
    /// completion at once, or, with `wait`, [`Reply::Done`] once it has completed.
    SharedEventStatus {
        req: u64,
        event: u64,
        wait: bool,
    },
    /// A checkpoint call (`cuCheckpointProcess*`) on process `pid`: the device relays it to
    /// that process's driver ([`Reply::CheckpointCall`]) and answers with
    /// [`Reply::Checkpoint`].
    Checkpoint {
        req: u64,
        pid: u32,
        call: CheckpointCall,
    },
    /// A target's answer to the relayed checkpoint call `id`: a `CUresult`, and the state or
    /// thread id the call returns.
    CheckpointDone {
        id: u64,
        result: u32,
        value: u64,
    },
}

/// One of the driver's checkpoint calls, as a controlling process makes it on a target process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CheckpointCall {
    /// Block the target's further driver calls and wait for its submitted work; give up after
    /// `timeout_ms` (0: no limit).
    Lock {
        timeout_ms: u32,
    },
    Checkpoint,
    Restore,
    Unlock,
    GetState,
    GetRestoreThreadId,
}

/// Static description of one simulated GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub name: String,
    pub uuid: [u8; 16],
    pub total_memory: u64,
    pub pci_bus: u32,
    /// What moving a process's memory to host memory and back costs on this GPU.
    pub swap: SwapCost,
}

/// How long a checkpoint (device to host memory) or a restore (host to device) of a process's
/// memory takes: `latency_ns`, then its bytes at the rate of that direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapCost {
    pub latency_ns: u64,
    pub checkpoint_bytes_per_s: u64,
    pub restore_bytes_per_s: u64,
}

impl SwapCost {
    /// Nanoseconds a checkpoint of `bytes` takes.
    pub fn checkpoint_ns(&self, bytes: u64) -> u64 {
        self.latency_ns + transfer_ns(bytes, self.checkpoint_bytes_per_s)
    }

    /// Nanoseconds a restore of `bytes` takes.
    pub fn restore_ns(&self, bytes: u64) -> u64 {
        self.latency_ns + transfer_ns(bytes, self.restore_bytes_per_s)
    }
}

fn transfer_ns(bytes: u64, per_s: u64) -> u64 {
    (bytes as u128 * 1_000_000_000 / per_s.max(1) as u128).min(u64::MAX as u128) as u64
}

/// Device → client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// Welcome: the GPUs, and this client's event board (a file to map, with `event_slots`
    /// slots).
    Hello {
        devices: Vec<DeviceInfo>,
        event_board: String,
        event_slots: u32,
    },
    /// Every op waited for completed; `end_ns` is the latest completion (CLOCK_MONOTONIC).
    Done {
        req: u64,
        end_ns: u64,
    },
    /// Completion time of each queried op, `None` while pending.
    Status {
        req: u64,
        ends: Vec<Option<u64>>,
    },
    Alloc {
        req: u64,
        ok: bool,
    },
    /// The memory of [`Request::Free`] `req` is free on the device.
    Freed {
        req: u64,
    },
    MemInfo {
        req: u64,
        free: u64,
        total: u64,
    },
    RunHostFunc {
        stream: u64,
        seq: u64,
    },
    /// The id of a shared event.
    SharedEvent {
        req: u64,
        event: u64,
    },
    /// The answer to [`Request::Checkpoint`]: a `CUresult`, and the state or thread id asked
    /// for.
    Checkpoint {
        req: u64,
        result: u32,
        value: u64,
    },
    /// Carry out checkpoint call `id` on this process, then answer with
    /// [`Request::CheckpointDone`].
    CheckpointCall {
        id: u64,
        call: CheckpointCall,
    },
    /// The device refused a request (unknown stream, bad version…); `message` says why.
    Error {
        req: Option<u64>,
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_frame::fuzz;

    #[test]
    fn requests_round_trip_and_hostile_ones_are_rejected() {
        let samples = [
            Request::Hello {
                version: PROTOCOL_VERSION,
                pid: 7,
            },
            Request::CreateContext { ctx: 1, device: 0 },
            Request::DestroyContext { ctx: 1 },
            Request::CreateStream {
                stream: 3,
                ctx: 1,
                priority: -1,
            },
            Request::DestroyStream { stream: 3 },
            Request::RegisterFunction {
                function: 4,
                name: "gpushare_spin".into(),
            },
            Request::Submit {
                stream: 3,
                seq: 9,
                deps: vec![(1, 2)],
                op: Op::Kernel {
                    function: 4,
                    arg0: Some(1_000_000),
                },
            },
            Request::Submit {
                stream: 3,
                seq: 10,
                deps: vec![],
                op: Op::Event {
                    slot: 2,
                    generation: 5,
                },
            },
            Request::Submit {
                stream: 3,
                seq: 11,
                deps: vec![(3, 10)],
                op: Op::HostFunc,
            },
            Request::Submit {
                stream: 3,
                seq: 12,
                deps: vec![],
                op: Op::Marker,
            },
            Request::HostFuncDone { stream: 3, seq: 11 },
            Request::Wait {
                req: 1,
                ops: vec![(3, 9), (3, 10)],
            },
            Request::Query {
                req: 2,
                ops: vec![(3, 12)],
            },
            Request::Alloc {
                req: 3,
                device: 0,
                bytes: 1 << 30,
            },
            Request::Free {
                req: 4,
                device: 0,
                bytes: 1 << 30,
            },
            Request::MemInfo { req: 4, device: 0 },
            Request::Checkpoint {
                req: 5,
                pid: 4242,
                call: CheckpointCall::Lock { timeout_ms: 500 },
            },
            Request::Checkpoint {
                req: 6,
                pid: 4242,
                call: CheckpointCall::Restore,
            },
            Request::CheckpointDone {
                id: 1,
                result: 0,
                value: 2,
            },
            Request::ShareEvent {
                req: 7,
                record: Some((3, 10)),
            },
            Request::OpenSharedEvent { req: 8, event: 1 },
            Request::UnshareEvent { event: 1 },
            Request::SharedEventStatus {
                req: 9,
                event: 1,
                wait: true,
            },
            Request::Submit {
                stream: 3,
                seq: 13,
                deps: vec![],
                op: Op::SharedEvent {
                    slot: 2,
                    generation: 6,
                    event: 1,
                },
            },
            Request::Submit {
                stream: 3,
                seq: 14,
                deps: vec![],
                op: Op::WaitShared { event: 1 },
            },
        ];
        fuzz::frames(31, &samples, 150_000, |_| {}).assert_exercised(150_000);
    }

    #[test]
    fn replies_round_trip_and_hostile_ones_are_rejected() {
        let samples = [
            Reply::Hello {
                devices: vec![DeviceInfo {
                    name: "NVIDIA H100 80GB HBM3".into(),
                    uuid: *b"gpushare-sim-gpu",
                    total_memory: 80 << 30,
                    pci_bus: 0x18,
                    swap: SwapCost {
                        latency_ns: 100_000_000,
                        checkpoint_bytes_per_s: 1_500_000_000,
                        restore_bytes_per_s: 4_400_000_000,
                    },
                }],
                event_board: "/tmp/sim.sock.events-1".into(),
                event_slots: 4096,
            },
            Reply::Done { req: 1, end_ns: 5 },
            Reply::Status {
                req: 2,
                ends: vec![Some(5), None],
            },
            Reply::Alloc { req: 3, ok: true },
            Reply::MemInfo {
                req: 4,
                free: 1,
                total: 2,
            },
            Reply::RunHostFunc { stream: 3, seq: 11 },
            Reply::Checkpoint {
                req: 5,
                result: 401,
                value: 0,
            },
            Reply::CheckpointCall {
                id: 1,
                call: CheckpointCall::GetState,
            },
            Reply::SharedEvent { req: 6, event: 1 },
            Reply::Error {
                req: Some(1),
                message: "no".into(),
            },
        ];
        fuzz::frames(32, &samples, 100_000, |_| {}).assert_exercised(100_000);
    }
}
