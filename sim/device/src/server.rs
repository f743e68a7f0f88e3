//! The device process's I/O shell around [`Model`]: a Unix socket that every simulated driver
//! connects to, one reader thread per client, and a clock thread that advances the timeline in
//! real time, answers waits when their work completes and hands the device trace to a writer
//! thread (the device never waits for the disk: a write held up by the host's writeback would
//! stop the GPU for every process).

use crate::model::{ConnId, Key, Model, ModelConfig, SubmitError};
use crate::trace::Record;
use gpushare_sim_wire::{
    self as wire, CheckpointCall, DeviceInfo, EventBoard, PROTOCOL_VERSION, Reply, Request,
    SwapCost,
};
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// CLOCK_MONOTONIC in nanoseconds: the device's and the trace's time base.
pub use gpushare_units::monotonic_ns as now_ns;

pub struct ServerConfig {
    pub model: ModelConfig,
    pub socket: PathBuf,
    pub trace: Option<PathBuf>,
    /// What a checkpoint or restore of a process's memory costs on each GPU.
    pub swap: SwapCost,
}

struct Waiter {
    conn: ConnId,
    req: u64,
    ops: Vec<(Key, u64)>,
}

/// A checkpoint call relayed to its target: who asked, under which request id, of whom.
struct Relay {
    asker: ConnId,
    req: u64,
    target: ConnId,
}

/// Event board slots per client: live event objects a process may have.
const EVENT_SLOTS: u32 = 1 << 18;

struct State {
    model: Model,
    writers: HashMap<ConnId, Arc<Mutex<UnixStream>>>,
    /// Each client's event board and its file (removed when the client goes).
    boards: HashMap<ConnId, (EventBoard, PathBuf)>,
    /// Each client's user, from the socket (its event board is made for that user).
    uids: HashMap<ConnId, u32>,
    /// Each client's process id as the device sees it (from the socket, else its `Hello`):
    /// what a checkpoint call names its target by.
    pids: HashMap<ConnId, u32>,
    /// Checkpoint calls waiting for their target's answer, by relay id.
    relays: HashMap<u64, Relay>,
    next_relay: u64,
    waiters: Vec<Waiter>,
    /// To the trace writer thread (`None`: no trace, or it could not be written).
    trace: Option<Sender<Vec<Record>>>,
    next_conn: ConnId,
    stopping: bool,
    /// When the clock thread will next look at the model on its own (`u64::MAX`: not until
    /// told; 0: it is awake and will plan again). A change needs waking it only when it makes
    /// something due earlier: a condvar signal per launch would cost the device a thread wake-up
    /// per launch.
    clock_wake: u64,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled whenever the model changed, so the clock thread re-plans its next wake-up.
    changed: Condvar,
    devices: Vec<DeviceInfo>,
    socket: PathBuf,
}

/// A running device server; dropping it without [`Server::shutdown`] leaves threads running.
pub struct Server {
    shared: Arc<Shared>,
    socket: PathBuf,
    clock: Option<JoinHandle<()>>,
    trace_writer: Option<JoinHandle<std::io::Result<()>>>,
}

type Outbox = Vec<(ConnId, Reply)>;

impl Server {
    pub fn start(cfg: ServerConfig) -> anyhow::Result<Server> {
        // Every user may use the simulated GPUs, as every user may open /dev/nvidia*.
        let listener = gpushare_frame::listen_at(&cfg.socket, 0o666)
            .map_err(|e| anyhow::anyhow!("{e}; pick another --socket path"))?;
        let (trace, trace_writer) = match &cfg.trace {
            Some(p) => {
                let file = File::create(p).map_err(|e| {
                    anyhow::anyhow!("cannot create trace file {}: {e}", p.display())
                })?;
                let (tx, rx) = channel();
                let writer = std::thread::Builder::new()
                    .name("sim-trace".into())
                    .spawn(move || trace_loop(rx, BufWriter::new(file)))?;
                (Some(tx), Some(writer))
            }
            None => (None, None),
        };
        let devices = device_infos(&cfg.model.device_memory, cfg.swap);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                model: Model::new(cfg.model),
                writers: HashMap::new(),
                boards: HashMap::new(),
                uids: HashMap::new(),
                pids: HashMap::new(),
                relays: HashMap::new(),
                next_relay: 1,
                waiters: Vec::new(),
                trace,
                next_conn: 1,
                stopping: false,
                clock_wake: 0,
            }),
            changed: Condvar::new(),
            devices,
            socket: cfg.socket.clone(),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("sim-accept".into())
            .spawn(move || accept_loop(listener, s))?;
        let s = shared.clone();
        let clock = std::thread::Builder::new()
            .name("sim-clock".into())
            .spawn(move || clock_loop(s))?;
        Ok(Server {
            shared,
            socket: cfg.socket,
            clock: Some(clock),
            trace_writer,
        })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Stop the clock, flush the trace and remove the socket.
    pub fn shutdown(mut self) -> anyhow::Result<()> {
        {
            let mut st = lock(&self.shared);
            st.stopping = true;
            self.shared.changed.notify_all();
        }
        if let Some(h) = self.clock.take() {
            let _ = h.join();
        }
        let mut st = lock(&self.shared);
        let now = now_ns();
        st.model.advance(now);
        write_trace(&mut st);
        // The writer ends once it has written what it was sent.
        st.trace = None;
        for (_, (_, path)) in st.boards.drain() {
            let _ = std::fs::remove_file(path);
        }
        drop(st);
        let _ = std::fs::remove_file(&self.socket);
        if let Some(w) = self.trace_writer.take() {
            w.join()
                .map_err(|_| anyhow::anyhow!("the trace writer panicked"))??;
        }
        Ok(())
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    // A panicking client thread must not take the whole device down with it.
    shared.state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Static identity of each simulated GPU (an H100-class part, as the attribute table says).
fn device_infos(memory: &[u64], swap: SwapCost) -> Vec<DeviceInfo> {
    memory
        .iter()
        .enumerate()
        .map(|(i, &total_memory)| {
            let mut uuid = *b"gpushare-sim-gpu";
            uuid[12..].copy_from_slice(&(i as u32).to_be_bytes());
            DeviceInfo {
                name: "NVIDIA H100 80GB HBM3".into(),
                uuid,
                total_memory,
                pci_bus: 0x18 + i as u32,
                swap,
            }
        })
        .collect()
}

fn accept_loop(listener: UnixListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let Ok(writer) = stream.try_clone() else {
            continue;
        };
        let conn = {
            let mut st = lock(&shared);
            if st.stopping {
                return;
            }
            let conn = st.next_conn;
            st.next_conn += 1;
            st.writers.insert(conn, Arc::new(Mutex::new(writer)));
            if let Ok(peer) = gpushare_frame::peer_credentials(&stream) {
                st.uids.insert(conn, peer.uid);
                st.pids.insert(conn, peer.pid as u32);
            }
            conn
        };
        let s = shared.clone();
        let _ = std::thread::Builder::new()
            .name(format!("sim-client-{conn}"))
            .spawn(move || client_loop(conn, stream, s));
    }
}

fn client_loop(conn: ConnId, stream: UnixStream, shared: Arc<Shared>) {
    // Buffered: a launcher ahead of the device leaves many frames to take in one read.
    let mut stream = BufReader::with_capacity(64 << 10, stream);
    let mut buf = Vec::new();
    loop {
        match wire::recv::<Request>(&mut stream, &mut buf) {
            Ok(Some(req)) => {
                let mut out = Outbox::new();
                let wake_clock = {
                    let mut st = lock(&shared);
                    let now = now_ns();
                    handle(&mut st, &shared, conn, req, now, &mut out);
                    pump(&mut st, now, &mut out);
                    next_wake(&st, now).is_some_and(|t| t < st.clock_wake)
                };
                if wake_clock {
                    shared.changed.notify_all();
                }
                deliver(&shared, out);
            }
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(conn, "dropping client after a bad frame: {e}");
                break;
            }
        }
    }
    let mut out = Outbox::new();
    {
        let mut st = lock(&shared);
        let now = now_ns();
        st.model.disconnect(conn, now);
        st.writers.remove(&conn);
        st.uids.remove(&conn);
        st.pids.remove(&conn);
        drop_relays(&mut st, conn, &mut out);
        if let Some((_, path)) = st.boards.remove(&conn) {
            let _ = std::fs::remove_file(path);
        }
        st.waiters.retain(|w| w.conn != conn);
        pump(&mut st, now, &mut out);
    }
    shared.changed.notify_all();
    deliver(&shared, out);
}

fn handle(st: &mut State, shared: &Shared, conn: ConnId, req: Request, now: u64, out: &mut Outbox) {
    let uid = st.uids.get(&conn).copied();
    let m = &mut st.model;
    let err = |req: Option<u64>, message: String| (conn, Reply::Error { req, message });
    match req {
        Request::Hello { version, pid } => {
            if version != PROTOCOL_VERSION {
                out.push(err(
                    None,
                    format!(
                        "simulated driver speaks protocol {version}, device speaks {PROTOCOL_VERSION}: \
                         rebuild libcuda.so and gpushare-sim from the same checkout"
                    ),
                ));
                return;
            }
            let path = PathBuf::from(format!("{}.events-{conn}", shared.socket.display()));
            let board = match EventBoard::create(&path, EVENT_SLOTS, uid) {
                Ok(b) => b,
                Err(e) => {
                    out.push(err(
                        None,
                        format!("cannot create the event board {}: {e}", path.display()),
                    ));
                    return;
                }
            };
            m.connect(conn, pid);
            st.pids.entry(conn).or_insert(pid);
            out.push((
                conn,
                Reply::Hello {
                    devices: shared.devices.clone(),
                    event_board: path.to_string_lossy().into_owned(),
                    event_slots: EVENT_SLOTS,
                },
            ));
            st.boards.insert(conn, (board, path));
        }
        Request::CreateContext { ctx, device } => {
            if !m.create_context((conn, ctx), device) {
                out.push(err(
                    None,
                    format!("context {ctx}: no simulated device {device}, or the context exists"),
                ));
            }
        }
        Request::DestroyContext { ctx } => m.destroy_context((conn, ctx), now),
        Request::CreateStream {
            stream,
            ctx,
            priority,
        } => {
            if !m.create_stream((conn, stream), (conn, ctx), priority) {
                out.push(err(
                    None,
                    format!("stream {stream} names unknown context {ctx}, or exists"),
                ));
            }
        }
        Request::DestroyStream { stream } => m.destroy_stream((conn, stream)),
        Request::RegisterFunction { function, name } => {
            m.register_function((conn, function), &name)
        }
        Request::Submit {
            stream,
            seq,
            deps,
            op,
        } => {
            if let Err(e) = m.submit(now, (conn, stream), seq, &deps, &op) {
                let what = match e {
                    SubmitError::UnknownStream => "unknown stream",
                    SubmitError::UnknownFunction => "unknown function",
                };
                out.push(err(None, format!("submit to stream {stream}: {what}")));
            }
        }
        Request::HostFuncDone { stream, seq } => m.host_func_done(now, (conn, stream), seq),
        Request::Wait { req, ops } => st.waiters.push(Waiter {
            conn,
            req,
            ops: ops.into_iter().map(|(s, q)| ((conn, s), q)).collect(),
        }),
        Request::Query { req, ops } => {
            m.advance(now);
            let ends = ops
                .iter()
                .map(|&(s, q)| m.completion((conn, s), q).filter(|&e| e <= now))
                .collect();
            out.push((conn, Reply::Status { req, ends }));
        }
        Request::Alloc { req, device, bytes } => {
            let ok = m.alloc(conn, device, bytes);
            out.push((conn, Reply::Alloc { req, ok }));
        }
        Request::Free { req, device, bytes } => {
            m.free(conn, device, bytes);
            out.push((conn, Reply::Freed { req }));
        }
        Request::MemInfo { req, device } => match m.mem_info(device) {
            Some((free, total)) => out.push((conn, Reply::MemInfo { req, free, total })),
            None => out.push(err(Some(req), format!("no simulated device {device}"))),
        },
        Request::ShareEvent { req, record } => {
            let event = m.share_event(conn, record);
            out.push((conn, Reply::SharedEvent { req, event }));
        }
        Request::OpenSharedEvent { req, event } => {
            if m.shared_event_exists(event) {
                out.push((conn, Reply::SharedEvent { req, event }));
            } else {
                out.push(err(
                    Some(req),
                    format!("no shared event {event}: its process destroyed it or exited"),
                ));
            }
        }
        Request::UnshareEvent { event } => m.unshare_event(conn, event),
        Request::SharedEventStatus { req, event, wait } => {
            let ops: Vec<(Key, u64)> = m.shared_record(event).into_iter().collect();
            if wait {
                st.waiters.push(Waiter { conn, req, ops });
            } else {
                m.advance(now);
                let end = ops
                    .iter()
                    .try_fold(0, |acc, &(s, q)| Some(acc.max(m.completion(s, q)?)))
                    .filter(|&e| e <= now);
                out.push((
                    conn,
                    Reply::Status {
                        req,
                        ends: vec![end],
                    },
                ));
            }
        }
        Request::Checkpoint { req, pid, call } => relay(st, conn, req, pid, call, out),
        Request::CheckpointDone { id, result, value } => {
            if st.relays.get(&id).is_some_and(|r| r.target == conn) {
                let r = st.relays.remove(&id).expect("present");
                out.push((
                    r.asker,
                    Reply::Checkpoint {
                        req: r.req,
                        result,
                        value,
                    },
                ));
            }
        }
    }
}

/// Pass a checkpoint call on to the process `pid` names, or refuse it if no such process
/// uses the simulated GPUs.
fn relay(
    st: &mut State,
    asker: ConnId,
    req: u64,
    pid: u32,
    call: CheckpointCall,
    out: &mut Outbox,
) {
    let target = st
        .pids
        .iter()
        .find(|&(c, &p)| p == pid && st.boards.contains_key(c))
        .map(|(&c, _)| c);
    let Some(target) = target else {
        let message = format!("no process {pid} uses the simulated GPUs");
        out.push((
            asker,
            Reply::Error {
                req: Some(req),
                message,
            },
        ));
        return;
    };
    let id = st.next_relay;
    st.next_relay += 1;
    st.relays.insert(id, Relay { asker, req, target });
    out.push((target, Reply::CheckpointCall { id, call }));
}

/// Client `conn` is gone: the calls relayed to it fail, the answers to its own calls are
/// dropped.
fn drop_relays(st: &mut State, conn: ConnId, out: &mut Outbox) {
    st.relays.retain(|_, r| {
        if r.target == conn {
            let message = "the process exited during the checkpoint call".to_string();
            out.push((
                r.asker,
                Reply::Error {
                    req: Some(r.req),
                    message,
                },
            ));
        }
        r.target != conn && r.asker != conn
    });
}

/// Advance the model to `now` and collect everything that became due.
fn pump(st: &mut State, now: u64, out: &mut Outbox) {
    st.model.advance(now);
    write_trace(st);
    for ((conn, stream), seq) in st.model.take_host_calls() {
        out.push((conn, Reply::RunHostFunc { stream, seq }));
    }
    for e in st.model.take_decided_events() {
        if let Some((board, _)) = st.boards.get(&e.conn) {
            board.post(e.slot, e.generation, e.end_ns);
        }
    }
    let model = &st.model;
    st.waiters.retain(|w| match waiter_end(model, w) {
        Some(end) if end <= now => {
            out.push((
                w.conn,
                Reply::Done {
                    req: w.req,
                    end_ns: end,
                },
            ));
            false
        }
        _ => true,
    });
}

/// When every op a waiter waits for is done, if that is decided yet.
fn waiter_end(model: &Model, w: &Waiter) -> Option<u64> {
    w.ops
        .iter()
        .try_fold(0, |acc, &(s, q)| Some(acc.max(model.completion(s, q)?)))
}

/// Hand the records the model made since the last call to the trace writer.
fn write_trace(st: &mut State) {
    let records: Vec<Record> = st.model.take_trace();
    if records.is_empty() {
        return;
    }
    if let Some(tx) = &st.trace
        && tx.send(records).is_err()
    {
        // The writer gave up (and said why).
        st.trace = None;
    }
}

/// The trace writer thread: one JSON line per record, flushed once every sender is gone.
fn trace_loop(rx: Receiver<Vec<Record>>, mut out: BufWriter<File>) -> std::io::Result<()> {
    for records in rx {
        for r in records {
            let line = serde_json::to_writer(&mut out, &r)
                .map_err(std::io::Error::other)
                .and_then(|()| out.write_all(b"\n"));
            if let Err(e) = line {
                tracing::error!("cannot write the device trace ({e}); further records are lost");
                return Err(e);
            }
        }
    }
    out.flush()
}

fn deliver(shared: &Shared, out: Outbox) {
    if out.is_empty() {
        return;
    }
    let mut buf = Vec::new();
    for (conn, reply) in out {
        let writer = lock(shared).writers.get(&conn).cloned();
        let Some(writer) = writer else { continue };
        if wire::encode(&reply, &mut buf).is_ok() {
            let mut w = writer.lock().unwrap_or_else(|e| e.into_inner());
            // A client that went away is cleaned up by its reader thread.
            let _ = w.write_all(&buf);
        }
    }
}

fn clock_loop(shared: Arc<Shared>) {
    // SAFETY: prctl(PR_SET_TIMERSLACK) only changes this thread's timer slack.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    let mut st = lock(&shared);
    loop {
        if st.stopping {
            return;
        }
        let now = now_ns();
        let mut out = Outbox::new();
        pump(&mut st, now, &mut out);
        if !out.is_empty() {
            drop(st);
            deliver(&shared, out);
            st = lock(&shared);
            continue;
        }
        let wake = next_wake(&st, now);
        st.clock_wake = wake.unwrap_or(u64::MAX);
        st = match wake {
            Some(t) => {
                let d = Duration::from_nanos(t.saturating_sub(now_ns()));
                if d.is_zero() {
                    continue;
                }
                shared
                    .changed
                    .wait_timeout(st, d)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
            None => shared.changed.wait(st).unwrap_or_else(|e| e.into_inner()),
        };
        st.clock_wake = 0;
    }
}

/// The earliest instant after `now` at which the model or a waiter needs the clock.
fn next_wake(st: &State, now: u64) -> Option<u64> {
    let model = &st.model;
    let waiter_wake = st
        .waiters
        .iter()
        .filter_map(|w| waiter_end(model, w))
        .filter(|&e| e > now)
        .min();
    [model.next_wakeup(now), waiter_wake]
        .into_iter()
        .flatten()
        .min()
}

/// The device's receive path fed hostile input: whatever a client's stream decodes goes to
/// `handle` and the clock's `pump`, as `client_loop` and `clock_loop` do.
#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_frame::fuzz;
    use gpushare_sim_wire::Op;

    fn shared() -> Shared {
        let model = ModelConfig::default();
        Shared {
            devices: device_infos(
                &model.device_memory,
                SwapCost {
                    latency_ns: 0,
                    checkpoint_bytes_per_s: 1,
                    restore_bytes_per_s: 1,
                },
            ),
            state: Mutex::new(State {
                model: Model::new(model),
                writers: HashMap::new(),
                boards: HashMap::new(),
                uids: HashMap::new(),
                pids: HashMap::new(),
                relays: HashMap::new(),
                next_relay: 1,
                waiters: Vec::new(),
                trace: None,
                next_conn: 1,
                stopping: false,
                clock_wake: 0,
            }),
            changed: Condvar::new(),
            socket: PathBuf::from("/nonexistent/gpushare-sim.sock"),
        }
    }

    /// A context, a stream and a function exist, so that mutated requests reach them. `Hello`
    /// (which maps an event board file) is exercised by the socket tests, not here.
    #[test]
    fn hostile_client_streams_are_handled_without_panicking() {
        let samples = [
            Request::CreateContext { ctx: 1, device: 0 },
            Request::CreateStream {
                stream: 2,
                ctx: 1,
                priority: 0,
            },
            Request::RegisterFunction {
                function: 3,
                name: "gpushare_spin".into(),
            },
            Request::Submit {
                stream: 2,
                seq: 1,
                deps: vec![],
                op: Op::Kernel {
                    function: 3,
                    arg0: Some(100_000),
                },
            },
            Request::Submit {
                stream: 2,
                seq: 2,
                deps: vec![(2, 1)],
                op: Op::HostFunc,
            },
            Request::Submit {
                stream: 2,
                seq: 3,
                deps: vec![(2, 2)],
                op: Op::Event {
                    slot: 0,
                    generation: 1,
                },
            },
            Request::HostFuncDone { stream: 2, seq: 2 },
            Request::Wait {
                req: 1,
                ops: vec![(2, 1), (2, 3)],
            },
            Request::Query {
                req: 2,
                ops: vec![(2, 1)],
            },
            Request::Alloc {
                req: 3,
                device: 0,
                bytes: 1 << 30,
            },
            Request::Free {
                req: 6,
                device: 0,
                bytes: 1 << 30,
            },
            Request::MemInfo { req: 4, device: 0 },
            Request::Checkpoint {
                req: 5,
                pid: 7,
                call: CheckpointCall::Lock { timeout_ms: 10 },
            },
            Request::CheckpointDone {
                id: 1,
                result: 0,
                value: 1,
            },
            Request::DestroyStream { stream: 2 },
            Request::DestroyContext { ctx: 1 },
        ];
        let mut sh = shared();
        let (mut now, mut handled) = (1_000_000_000u64, 0usize);
        let n = 100_000;
        fuzz::frames(81, &samples, n, |req| {
            if matches!(req, Request::Hello { .. }) {
                return;
            }
            // A fresh device now and then, so that random streams do not pile up.
            if handled % 1_000 == 0 {
                sh = shared();
            }
            handled += 1;
            now += 50_000;
            let mut out = Outbox::new();
            let mut st = lock(&sh);
            handle(&mut st, &sh, 1, req, now, &mut out);
            pump(&mut st, now, &mut out);
        })
        .assert_exercised(n);
        assert!(handled > n / 10, "{handled} requests handled");
    }
}
