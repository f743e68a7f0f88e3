//! Connection to the device process: fire-and-forget sends for stream work, blocking requests
//! for waits and allocations, and a reader thread that routes replies and runs host functions.

use crate::ffi::*;
use gpushare_sim_wire::{self as wire, DeviceInfo, EventBoard, PROTOCOL_VERSION, Reply, Request};
use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};

/// A host function waiting for its turn on the device.
pub enum HostCall {
    Func(HostFn, usize),
    Callback(StreamCallback, usize, usize),
}

/// The socket's sending half with its encode buffer; one lock keeps frames whole.
type Writer = Arc<Mutex<(UnixStream, Vec<u8>)>>;

pub struct Client {
    writer: Writer,
    /// The connection's socket, for [`Client::shut_down`] (which takes no lock).
    fd: RawFd,
    pending: Arc<Mutex<HashMap<u64, Sender<Reply>>>>,
    next_req: AtomicU64,
    pub host_calls: Arc<Mutex<HashMap<(u64, u64), HostCall>>>,
    /// The GPUs this process sees, in ordinal order (`CUDA_VISIBLE_DEVICES` applied).
    pub devices: Vec<DeviceInfo>,
    /// The device process's index of each visible GPU (what requests name), by ordinal.
    physical: Vec<u32>,
    /// Where the device posts event records' completion times (one slot per event object).
    pub events: EventBoard,
}

impl Client {
    /// Connect to the device named by `GPUSHARE_SIM_SOCKET` and say hello.
    pub fn connect() -> CuResult<Client> {
        let Some(path) = std::env::var_os(wire::SOCKET_ENV) else {
            eprintln!(
                "gpushare-sim libcuda: {} is not set; run the program under `gpushare-sim run -- CMD`",
                wire::SOCKET_ENV
            );
            return Err(CUDA_ERROR_NO_DEVICE);
        };
        let mut stream = UnixStream::connect(&path).map_err(|e| {
            eprintln!("gpushare-sim libcuda: cannot reach the simulated device at {path:?}: {e}");
            CUDA_ERROR_NO_DEVICE
        })?;
        wire::send(
            &mut stream,
            &Request::Hello {
                version: PROTOCOL_VERSION,
                pid: std::process::id(),
            },
        )
        .map_err(|_| CUDA_ERROR_NO_DEVICE)?;
        let mut buf = Vec::new();
        let (devices, board, slots) = match wire::recv::<Reply>(&mut stream, &mut buf) {
            Ok(Some(Reply::Hello {
                devices,
                event_board,
                event_slots,
            })) => (devices, event_board, event_slots),
            Ok(Some(Reply::Error { message, .. })) => {
                eprintln!("gpushare-sim libcuda: {message}");
                return Err(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH);
            }
            _ => return Err(CUDA_ERROR_NO_DEVICE),
        };
        let events = EventBoard::open(std::path::Path::new(&board), slots).map_err(|e| {
            eprintln!("gpushare-sim libcuda: cannot map the event board {board}: {e}");
            CUDA_ERROR_OPERATING_SYSTEM
        })?;
        let physical = visible_devices(
            std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
            &devices,
        );
        let devices = physical
            .iter()
            .map(|&i| devices[i as usize].clone())
            .collect();
        let reader = stream
            .try_clone()
            .map_err(|_| CUDA_ERROR_OPERATING_SYSTEM)?;
        let client = Client {
            fd: stream.as_raw_fd(),
            writer: Arc::new(Mutex::new((stream, Vec::new()))),
            pending: Arc::default(),
            next_req: AtomicU64::new(1),
            host_calls: Arc::default(),
            devices,
            physical,
            events,
        };
        let (host_tx, host_rx) = channel();
        let pending = client.pending.clone();
        let answers = client.writer.clone();
        std::thread::Builder::new()
            .name("sim-driver-rx".into())
            .spawn(move || read_loop(reader, pending, host_tx, answers))
            .map_err(|_| CUDA_ERROR_OPERATING_SYSTEM)?;
        let calls = client.host_calls.clone();
        let writer = client.writer.clone();
        std::thread::Builder::new()
            .name("sim-driver-host".into())
            .spawn(move || host_loop(host_rx, calls, writer))
            .map_err(|_| CUDA_ERROR_OPERATING_SYSTEM)?;
        Ok(client)
    }

    /// End the connection both ways, taking no lock (from an exit handler, while other threads
    /// may be sending): the device forgets this process's work and memory, as when it exits,
    /// and calls waiting for an answer fail.
    pub fn shut_down(&self) {
        // SAFETY: shutdown(2) of our own socket; the descriptor stays open (and ours).
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
    }

    /// The device process's index of the GPU with this process's ordinal `device`.
    pub fn physical(&self, device: u32) -> u32 {
        self.physical[device as usize]
    }

    /// What a checkpoint or restore costs on the GPU the device process calls `physical`, if
    /// this process sees it.
    pub fn swap_cost(&self, physical: u32) -> Option<wire::SwapCost> {
        let ordinal = self.physical.iter().position(|&p| p == physical)?;
        Some(self.devices[ordinal].swap)
    }

    /// Send without waiting for an answer.
    pub fn send(&self, msg: &Request) -> CuResult {
        send_on(&self.writer, msg)
    }

    /// Send a request built around a fresh request id and block until its reply.
    pub fn call(&self, make: impl FnOnce(u64) -> Request) -> CuResult<Reply> {
        self.call_until(make, None)?.ok_or(CUDA_ERROR_UNKNOWN)
    }

    /// [`call`](Client::call), giving up at `deadline` (`None`: never): `Ok(None)` then (a
    /// reply arriving later is dropped).
    pub fn call_until(
        &self,
        make: impl FnOnce(u64) -> Request,
        deadline: Option<std::time::Instant>,
    ) -> CuResult<Option<Reply>> {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(req, tx);
        if let Err(e) = self.send(&make(req)) {
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&req);
            return Err(e);
        }
        let reply = match deadline {
            None => rx.recv().map_err(|_| CUDA_ERROR_DEVICE_UNAVAILABLE)?,
            Some(at) => {
                match rx.recv_timeout(at.saturating_duration_since(std::time::Instant::now())) {
                    Ok(r) => r,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                        self.pending
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&req);
                        return Ok(None);
                    }
                    Err(_) => return Err(CUDA_ERROR_DEVICE_UNAVAILABLE),
                }
            }
        };
        match reply {
            Reply::Error { .. } => Err(CUDA_ERROR_INVALID_VALUE),
            reply => Ok(Some(reply)),
        }
    }

    /// Block until every op has completed or `deadline` passed; whether they completed.
    pub fn wait_until(
        &self,
        ops: Vec<wire::OpRef>,
        deadline: Option<std::time::Instant>,
    ) -> CuResult<bool> {
        if ops.is_empty() {
            return Ok(true);
        }
        Ok(self
            .call_until(|req| Request::Wait { req, ops }, deadline)?
            .is_some())
    }

    /// Block until every op has completed; returns the latest completion time.
    pub fn wait(&self, ops: Vec<wire::OpRef>) -> CuResult<u64> {
        if ops.is_empty() {
            return Ok(0);
        }
        match self.call(|req| Request::Wait { req, ops })? {
            Reply::Done { end_ns, .. } => Ok(end_ns),
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }

    /// The latest record of shared event `event` (by any process): its completion time once
    /// it has completed (0 if there is none), `None` while pending; `wait` blocks until then.
    pub fn shared_event_status(&self, event: u64, wait: bool) -> CuResult<Option<u64>> {
        match self.call(|req| Request::SharedEventStatus { req, event, wait })? {
            Reply::Done { end_ns, .. } => Ok(Some(end_ns)),
            Reply::Status { ends, .. } => Ok(ends.first().copied().flatten()),
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }

    /// Completion time of each op, `None` while pending.
    pub fn query(&self, ops: Vec<wire::OpRef>) -> CuResult<Vec<Option<u64>>> {
        match self.call(|req| Request::Query { req, ops })? {
            Reply::Status { ends, .. } => Ok(ends),
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }
}

fn send_on(writer: &Writer, msg: &Request) -> CuResult {
    let mut w = writer.lock().unwrap_or_else(|e| e.into_inner());
    let (stream, buf) = &mut *w;
    wire::encode(msg, buf).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    stream
        .write_all(buf)
        .map_err(|_| CUDA_ERROR_DEVICE_UNAVAILABLE)
}

fn reply_req(r: &Reply) -> Option<u64> {
    match r {
        Reply::Done { req, .. }
        | Reply::Status { req, .. }
        | Reply::Alloc { req, .. }
        | Reply::Freed { req }
        | Reply::MemInfo { req, .. }
        | Reply::Checkpoint { req, .. }
        | Reply::SharedEvent { req, .. } => Some(*req),
        Reply::Error { req, .. } => *req,
        Reply::Hello { .. } | Reply::RunHostFunc { .. } | Reply::CheckpointCall { .. } => None,
    }
}

/// Receives the device's messages: replies go to their callers, host functions to their
/// thread, checkpoint calls on this process to [`crate::checkpoint`] (this thread is the
/// process's restore thread, `cuCheckpointProcessGetRestoreThreadId`).
fn read_loop(
    mut stream: UnixStream,
    pending: Arc<Mutex<HashMap<u64, Sender<Reply>>>>,
    host_tx: Sender<(u64, u64)>,
    answers: Writer,
) {
    crate::checkpoint::this_is_the_restore_thread();
    let mut buf = Vec::new();
    while let Ok(Some(reply)) = wire::recv::<Reply>(&mut stream, &mut buf) {
        if let Reply::RunHostFunc { stream, seq } = reply {
            let _ = host_tx.send((stream, seq));
            continue;
        }
        if let Reply::CheckpointCall { id, call } = reply {
            let answers = answers.clone();
            crate::checkpoint::on_call(call, move |result, value| {
                let _ = send_on(&answers, &Request::CheckpointDone { id, result, value });
            });
            continue;
        }
        if let Some(req) = reply_req(&reply) {
            let tx = pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&req);
            if let Some(tx) = tx {
                let _ = tx.send(reply);
            }
        }
    }
    // The device went away: fail every waiter instead of hanging it.
    pending.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// Host functions run on their own thread, in device order, as the driver's callback thread does.
fn host_loop(
    rx: Receiver<(u64, u64)>,
    calls: Arc<Mutex<HashMap<(u64, u64), HostCall>>>,
    writer: Writer,
) {
    for (stream, seq) in rx {
        let call = calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(stream, seq));
        match call {
            // SAFETY: the application registered this function and its argument with
            // cuLaunchHostFunc / cuStreamAddCallback; it is called exactly once, as promised.
            Some(HostCall::Func(f, data)) => unsafe { f(data as *mut _) },
            // SAFETY: as above, for cuStreamAddCallback's signature.
            Some(HostCall::Callback(f, s, data)) => unsafe {
                f(s as Handle, CUDA_SUCCESS, data as *mut _)
            },
            None => {}
        }
        if send_on(&writer, &Request::HostFuncDone { stream, seq }).is_err() {
            return;
        }
    }
}

/// The device indices a process sees under `CUDA_VISIBLE_DEVICES` (`None`: every GPU), in the
/// order listed, as the real driver reads it: comma-separated ordinals or UUIDs (`GPU-…`, any
/// unique prefix); the list ends at the first entry that names no GPU (or one already listed),
/// so an empty or invalid value hides every GPU.
fn visible_devices(spec: Option<&str>, devices: &[DeviceInfo]) -> Vec<u32> {
    let Some(spec) = spec else {
        return (0..devices.len() as u32).collect();
    };
    let hex = |d: &DeviceInfo| {
        d.uuid
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let mut out: Vec<u32> = Vec::new();
    for entry in spec.split(',').map(str::trim) {
        let found = if let Some(uuid) = entry.strip_prefix("GPU-") {
            let want = uuid.replace('-', "").to_ascii_lowercase();
            let mut hits = (0..devices.len())
                .filter(|&i| !want.is_empty() && hex(&devices[i]).starts_with(&want));
            match (hits.next(), hits.next()) {
                (Some(i), None) => Some(i as u32),
                _ => None,
            }
        } else {
            entry
                .parse::<u32>()
                .ok()
                .filter(|&i| (i as usize) < devices.len())
        };
        match found {
            Some(i) if !out.contains(&i) => out.push(i),
            _ => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(n: u32) -> Vec<DeviceInfo> {
        (0..n)
            .map(|i| {
                let mut uuid = *b"gpushare-sim-gpu";
                uuid[12..].copy_from_slice(&i.to_be_bytes());
                DeviceInfo {
                    name: format!("gpu {i}"),
                    uuid,
                    total_memory: 1 << 30,
                    pci_bus: i,
                    swap: gpushare_sim_wire::SwapCost {
                        latency_ns: 0,
                        checkpoint_bytes_per_s: 1,
                        restore_bytes_per_s: 1,
                    },
                }
            })
            .collect()
    }

    #[test]
    fn cuda_visible_devices() {
        let d = gpus(4);
        assert_eq!(visible_devices(None, &d), vec![0, 1, 2, 3]);
        assert_eq!(visible_devices(Some("2"), &d), vec![2]);
        assert_eq!(visible_devices(Some("3, 1"), &d), vec![3, 1]);
        assert_eq!(
            visible_devices(Some("1,7,2"), &d),
            vec![1],
            "ends at an invalid entry"
        );
        assert_eq!(visible_devices(Some("1,1"), &d), vec![1]);
        assert_eq!(visible_devices(Some(""), &d), Vec::<u32>::new());
        assert_eq!(visible_devices(Some("-1"), &d), Vec::<u32>::new());
        // GPU-67707573-6861-7265-2d73-696d00000002 is GPU 2; a unique prefix will do.
        assert_eq!(
            visible_devices(Some("GPU-67707573-6861-7265-2d73-696d00000002,0"), &d),
            vec![2, 0]
        );
        assert_eq!(
            visible_devices(Some("GPU-67707573"), &d),
            Vec::<u32>::new(),
            "ambiguous"
        );
    }
}
