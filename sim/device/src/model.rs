//! Pure model of the simulated GPUs: stream queues with dependencies, one kernel at a time per
//! device, and time-slicing between contexts the way the NVIDIA driver does it.
//!
//! No I/O, no threads, no clock: every call takes `now` (CLOCK_MONOTONIC nanoseconds), so the
//! scheduling rules can be tested in virtual time. The device process wraps it in sockets.
//!
//! Timeline rules:
//! - a device runs one kernel at a time; kernels of different contexts never overlap;
//! - the context holding the device keeps it for one time slice while it has ready work; at the
//!   end of the slice, if another context has ready work, the running kernel is preempted (unless
//!   preemption is off) and the next context in round-robin order gets the device after the
//!   switch cost; an idle context gives the device up at once;
//! - decisions are committed at device time `cursor`; the model may run ahead of `now` only
//!   within the current slice of the current context, where nothing another client does can
//!   change the outcome. Completions committed ahead become visible when `now` reaches them.
//!
//! Peer waits (what NCCL's kernels do: spin on a flag that a kernel on another GPU writes):
//! - a `gpushare_wait_flag*` kernel spins on the device until the flag its first argument
//!   points to is set, then runs for its own duration (as any kernel: `--kernel` or the default)
//!   and completes. While it spins it holds the device like any running kernel: time-sliced
//!   with other contexts, preempted at its slice's end when another context has work (never,
//!   without preemption), resumed later where it was;
//! - a `gpushare_set_flag*` kernel runs for its duration and, as it completes, sets the flag its
//!   first argument points to. A flag is a device address in one process (a client
//!   connection): any of its GPUs may set it for any other. Once set it stays set for the life
//!   of the process (the device does not see host writes such as memsets, nor frees);
//! - a spinning kernel's progress is never committed beyond what is known: the model lets it
//!   spin only up to the *spin horizon*, the earliest instant at which a flag not yet known to
//!   be set could still be set (`now`, or earlier a spinning kernel's slice end, where another
//!   context's kernel, which might set a flag, could take its device). A flag set at `t` is
//!   seen by its spinning waiters at `t` (or when one next gets its device back).

use crate::trace::Record;
use rustc_hash::FxHashMap;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

pub type ConnId = u32;
/// A client's object id, made unique across clients by the connection it came on.
pub type Key = (ConnId, u64);

/// How many completion times each stream remembers for dependency and wait lookups.
const HISTORY: usize = 256;

#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// Memory capacity of each simulated device, in bytes; its length is the device count.
    pub device_memory: Vec<u64>,
    pub timeslice_ns: u64,
    pub switch_cost_ns: u64,
    /// Whether a running kernel is preempted at the end of its context's slice.
    pub preempt: bool,
    /// Duration of a kernel that is neither `gpushare_spin*` nor configured by name.
    pub default_kernel_ns: u64,
    pub kernel_ns: HashMap<String, u64>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            device_memory: vec![80 << 30],
            timeslice_ns: 1_000_000,
            switch_cost_ns: 25_000,
            preempt: true,
            default_kernel_ns: 5_000,
            kernel_ns: HashMap::new(),
        }
    }
}

/// What a peer-wait kernel does with the flag (a device address) its first argument names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlagOp {
    /// `gpushare_wait_flag*`: spin until the flag is set (then the kernel's own duration runs).
    Wait(u64),
    /// `gpushare_set_flag*`: set the flag as the kernel completes.
    Set(u64),
}

/// Kernel name prefix of peer-wait kernels: spin until a flag is set.
pub const WAIT_FLAG_KERNEL: &str = "gpushare_wait_flag";
/// Kernel name prefix of flag-setting kernels.
pub const SET_FLAG_KERNEL: &str = "gpushare_set_flag";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Work {
    Kernel {
        name: Arc<str>,
        remaining_ns: u64,
        /// A flag this kernel waits for (until it has seen it set) or sets.
        flag: Option<FlagOp>,
    },
    /// `event`: a record of the event in this board slot, with this generation, whose
    /// completion time outlives the stream's history (until the slot's next record).
    Marker { event: Option<(u32, u64)> },
    /// `notified` once the client has been asked to run it.
    HostFunc { notified: bool },
}

#[derive(Debug)]
struct QueuedOp {
    seq: u64,
    submit_ns: u64,
    deps: Vec<(Key, u64)>,
    work: Work,
}

#[derive(Debug)]
struct Stream {
    ctx: Key,
    priority: i32,
    queue: VecDeque<QueuedOp>,
    done_upto: u64,
    /// `(seq, end_ns)` of the latest completions, ascending.
    history: VecDeque<(u64, u64)>,
    destroyed: bool,
}

#[derive(Debug)]
struct Context {
    device: u32,
    streams: Vec<u64>,
}

#[derive(Debug, Clone, Copy)]
struct Running {
    stream: Key,
    seg_start: u64,
}

#[derive(Debug, Default)]
struct Device {
    /// Contexts in creation order: the round-robin order.
    ctxs: Vec<Key>,
    cursor: u64,
    active: Option<Key>,
    slice_end: u64,
    last_ctx: Option<Key>,
    running: Option<Running>,
    mem_used: u64,
    mem_total: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    UnknownStream,
    UnknownFunction,
}

#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    devices: Vec<Device>,
    ctxs: FxHashMap<Key, Context>,
    streams: FxHashMap<Key, Stream>,
    functions: FxHashMap<Key, Arc<str>>,
    pids: FxHashMap<ConnId, u32>,
    /// Memory held per (connection, device), released when the connection closes.
    held: FxHashMap<(ConnId, u32), u64>,
    trace: Vec<Record>,
    host_calls: Vec<(Key, u64)>,
    /// Event records decided since the last [`Model::take_decided_events`].
    decided_events: Vec<DecidedEvent>,
    /// Completion times of event records, until their slot is recorded again.
    events: FxHashMap<(Key, u64), u64>,
    /// The latest record `(stream, seq)` of each client's event board slot.
    event_slots: FxHashMap<(ConnId, u32), (Key, u64)>,
    /// When each flag `(connection, device address)` was set (the earliest decided set).
    flags: FxHashMap<(ConnId, u64), u64>,
    /// Events shared between processes (IPC events), by id: the sharing connection, and the
    /// latest record made of it by any process.
    shared_events: FxHashMap<u64, (ConnId, Option<(Key, u64)>)>,
    next_shared_event: u64,
    /// How far spinning peer-wait kernels may be committed during this [`Model::advance`].
    spin_horizon: u64,
}

/// An event record whose completion time is now known (possibly ahead of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecidedEvent {
    pub conn: ConnId,
    pub slot: u32,
    pub generation: u64,
    pub end_ns: u64,
}

impl Model {
    pub fn new(cfg: ModelConfig) -> Self {
        let devices = cfg
            .device_memory
            .iter()
            .map(|&mem_total| Device {
                mem_total,
                ..Device::default()
            })
            .collect();
        Model {
            cfg,
            devices,
            ctxs: FxHashMap::default(),
            streams: FxHashMap::default(),
            functions: FxHashMap::default(),
            pids: FxHashMap::default(),
            held: FxHashMap::default(),
            trace: Vec::new(),
            host_calls: Vec::new(),
            decided_events: Vec::new(),
            events: FxHashMap::default(),
            event_slots: FxHashMap::default(),
            flags: FxHashMap::default(),
            shared_events: FxHashMap::default(),
            next_shared_event: 1,
            spin_horizon: 0,
        }
    }

    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    pub fn connect(&mut self, conn: ConnId, pid: u32) {
        self.pids.insert(conn, pid);
    }

    /// Forget everything a client had: its queued work is dropped and its memory released,
    /// as when a process dies on a real GPU.
    pub fn disconnect(&mut self, conn: ConnId, now: u64) {
        let ctxs: Vec<Key> = self.ctxs.keys().filter(|k| k.0 == conn).copied().collect();
        for ctx in ctxs {
            self.destroy_context(ctx, now);
        }
        self.functions.retain(|k, _| k.0 != conn);
        self.events.retain(|k, _| k.0.0 != conn);
        self.event_slots.retain(|k, _| k.0 != conn);
        self.flags.retain(|k, _| k.0 != conn);
        self.shared_events.retain(|_, e| e.0 != conn);
        let held: Vec<_> = self.held.keys().filter(|k| k.0 == conn).copied().collect();
        for key in held {
            let bytes = self.held.remove(&key).unwrap_or(0);
            let dev = &mut self.devices[key.1 as usize];
            dev.mem_used = dev.mem_used.saturating_sub(bytes);
        }
        self.pids.remove(&conn);
    }

    /// False if there is no such device, or `key` is in use: a reused key would leave the old
    /// context's streams behind, known to the device but to no context.
    pub fn create_context(&mut self, key: Key, device: u32) -> bool {
        let Some(dev) = self.devices.get_mut(device as usize) else {
            return false;
        };
        if self.ctxs.contains_key(&key) {
            return false;
        }
        dev.ctxs.push(key);
        self.ctxs.insert(
            key,
            Context {
                device,
                streams: Vec::new(),
            },
        );
        true
    }

    /// Drop a context and its streams with whatever they still had queued.
    pub fn destroy_context(&mut self, key: Key, now: u64) {
        if !self.ctxs.contains_key(&key) {
            return;
        }
        // Up to `now` the context was there: decide that first (a spinning kernel, committed
        // no further than what was known, spun until now).
        self.advance(now);
        let Some(ctx) = self.ctxs.remove(&key) else {
            return;
        };
        let dev = &mut self.devices[ctx.device as usize];
        dev.ctxs.retain(|k| *k != key);
        if dev.active == Some(key) {
            dev.active = None;
        }
        if let Some(run) = dev.running
            && run.stream.0 == key.0
            && ctx.streams.contains(&run.stream.1)
        {
            // The kernel stops where the device is now (or where it was committed to).
            let end = now.clamp(run.seg_start, dev.cursor.max(run.seg_start));
            let kernel = match &self.streams[&run.stream].queue.front().map(|o| &o.work) {
                Some(Work::Kernel { name, .. }) => name.clone(),
                _ => Arc::from("?"),
            };
            self.trace.push(Record {
                device: ctx.device,
                pid: self.pids.get(&key.0).copied().unwrap_or(0),
                ctx: key.1,
                stream: run.stream.1,
                kernel: kernel.to_string(),
                start_ns: run.seg_start,
                end_ns: end,
                preempted: true,
            });
            dev.running = None;
            dev.cursor = end;
        }
        for s in ctx.streams {
            self.streams.remove(&(key.0, s));
        }
    }

    /// False if `ctx` does not exist or `key` is in use (a reused key would leave its first
    /// context naming a stream the device no longer has).
    pub fn create_stream(&mut self, key: Key, ctx: Key, priority: i32) -> bool {
        if self.streams.contains_key(&key) {
            return false;
        }
        let Some(c) = self.ctxs.get_mut(&ctx) else {
            return false;
        };
        c.streams.push(key.1);
        self.streams.insert(
            key,
            Stream {
                ctx,
                priority,
                queue: VecDeque::new(),
                done_upto: 0,
                history: VecDeque::new(),
                destroyed: false,
            },
        );
        true
    }

    /// Streams are released once their queued work has completed, as the driver documents.
    pub fn destroy_stream(&mut self, key: Key) {
        if let Some(s) = self.streams.get_mut(&key) {
            s.destroyed = true;
        }
        self.reap_stream(key);
    }

    fn reap_stream(&mut self, key: Key) {
        let Some(s) = self.streams.get(&key) else {
            return;
        };
        if s.destroyed && s.queue.is_empty() {
            let ctx = s.ctx;
            self.streams.remove(&key);
            if let Some(c) = self.ctxs.get_mut(&ctx) {
                c.streams.retain(|&id| id != key.1);
            }
        }
    }

    pub fn register_function(&mut self, key: Key, name: &str) {
        self.functions.insert(key, Arc::from(name));
    }

    /// Device time a kernel needs: `gpushare_spin*` kernels spin for their first argument (a
    /// `gpushare_wait_flag*` kernel needs this once its flag is set).
    fn kernel_duration(&self, name: &str, arg0: Option<u64>) -> u64 {
        if name.starts_with("gpushare_spin")
            && let Some(ns) = arg0
        {
            return ns;
        }
        self.cfg
            .kernel_ns
            .get(name)
            .copied()
            .unwrap_or(self.cfg.default_kernel_ns)
    }

    pub fn submit(
        &mut self,
        now: u64,
        stream: Key,
        seq: u64,
        deps: &[(u64, u64)],
        op: &gpushare_sim_wire::Op,
    ) -> Result<(), SubmitError> {
        use gpushare_sim_wire::Op;
        let work = match op {
            Op::Kernel { function, arg0 } => {
                let name = self
                    .functions
                    .get(&(stream.0, *function))
                    .ok_or(SubmitError::UnknownFunction)?
                    .clone();
                let remaining_ns = self.kernel_duration(&name, *arg0);
                let flag = match *arg0 {
                    Some(addr) if name.starts_with(WAIT_FLAG_KERNEL) => Some(FlagOp::Wait(addr)),
                    Some(addr) if name.starts_with(SET_FLAG_KERNEL) => Some(FlagOp::Set(addr)),
                    _ => None,
                };
                Work::Kernel {
                    name,
                    remaining_ns,
                    flag,
                }
            }
            Op::Marker => Work::Marker { event: None },
            &Op::Event { slot, generation } => Work::Marker {
                event: Some((slot, generation)),
            },
            Op::HostFunc => Work::HostFunc { notified: false },
            &Op::SharedEvent {
                slot, generation, ..
            } => Work::Marker {
                event: Some((slot, generation)),
            },
            Op::WaitShared { .. } => Work::Marker { event: None },
        };
        let conn = stream.0;
        let mut deps: Vec<(Key, u64)> = deps.iter().map(|&(st, q)| ((conn, st), q)).collect();
        match *op {
            // The latest record of the shared event so far, whichever process made it.
            Op::WaitShared { event } => deps.extend(self.shared_record(event)),
            Op::SharedEvent { event, .. } if self.streams.contains_key(&stream) => {
                if let Some(e) = self.shared_events.get_mut(&event) {
                    e.1 = Some((stream, seq));
                }
            }
            _ => {}
        }
        let s = self
            .streams
            .get_mut(&stream)
            .ok_or(SubmitError::UnknownStream)?;
        if let Work::Marker {
            event: Some((slot, _)),
        } = work
        {
            // The slot's previous record is no longer anyone's to ask about.
            if let Some(old) = self.event_slots.insert((conn, slot), (stream, seq)) {
                self.events.remove(&old);
            }
        }
        s.queue.push_back(QueuedOp {
            seq,
            submit_ns: now,
            deps,
            work,
        });
        Ok(())
    }

    /// Share an event of `conn` with other processes, its latest record so far being `record`;
    /// the id others name it by.
    pub fn share_event(&mut self, conn: ConnId, record: Option<(u64, u64)>) -> u64 {
        let id = self.next_shared_event;
        self.next_shared_event += 1;
        let record = record.map(|(stream, seq)| ((conn, stream), seq));
        self.shared_events.insert(id, (conn, record));
        id
    }

    /// Whether shared event `event` exists (its sharer has neither destroyed it nor exited).
    pub fn shared_event_exists(&self, event: u64) -> bool {
        self.shared_events.contains_key(&event)
    }

    /// The sharer `conn` destroyed shared event `event`.
    pub fn unshare_event(&mut self, conn: ConnId, event: u64) {
        if self.shared_events.get(&event).is_some_and(|e| e.0 == conn) {
            self.shared_events.remove(&event);
        }
    }

    /// The latest record of shared event `event`, if it has one.
    pub fn shared_record(&self, event: u64) -> Option<(Key, u64)> {
        self.shared_events.get(&event).and_then(|e| e.1)
    }

    /// The client finished running a host function: the stream moves on from `now`.
    pub fn host_func_done(&mut self, now: u64, stream: Key, seq: u64) {
        let Some(s) = self.streams.get_mut(&stream) else {
            return;
        };
        if let Some(op) = s.queue.front()
            && op.seq == seq
            && matches!(op.work, Work::HostFunc { notified: true })
        {
            Self::complete_front(s, now);
            self.reap_stream(stream);
        }
    }

    fn complete_front(s: &mut Stream, end: u64) {
        if let Some(op) = s.queue.pop_front() {
            s.done_upto = op.seq;
            s.history.push_back((op.seq, end));
            if s.history.len() > HISTORY {
                s.history.pop_front();
            }
        }
    }

    /// When op `seq` of `stream` completes (possibly in the future), if that is decided yet.
    /// Event records are exact however old; other ops older than the stream's history, or of
    /// streams that no longer exist, count as long done (time 0).
    pub fn completion(&self, stream: Key, seq: u64) -> Option<u64> {
        if let Some(&t) = self.events.get(&(stream, seq)) {
            return Some(t);
        }
        let Some(s) = self.streams.get(&stream) else {
            return Some(0);
        };
        if seq > s.done_upto {
            return None;
        }
        match s.history.binary_search_by_key(&seq, |&(q, _)| q) {
            Ok(i) => Some(s.history[i].1),
            Err(0) => Some(0),
            Err(i) => Some(s.history[i - 1].1),
        }
    }

    /// When the head op of `stream` may start, once every dependency's completion is decided.
    fn head_ready(&self, key: Key) -> Option<u64> {
        let s = &self.streams[&key];
        let op = s.queue.front()?;
        let mut t = op.submit_ns.max(s.history.back().map_or(0, |h| h.1));
        for &(dep, seq) in &op.deps {
            t = t.max(self.completion(dep, seq)?);
        }
        Some(t)
    }

    /// Best kernel of `ctx` that may start by `at`: highest priority (lowest number), then oldest.
    fn ready_kernel(&self, ctx: Key, at: u64) -> Option<Key> {
        let c = self.ctxs.get(&ctx)?;
        c.streams
            .iter()
            .map(|&id| (ctx.0, id))
            .filter(|k| {
                matches!(
                    self.streams[k].queue.front().map(|o| &o.work),
                    Some(Work::Kernel { .. })
                )
            })
            .filter_map(|k| self.head_ready(k).filter(|&t| t <= at).map(|t| (k, t)))
            .min_by_key(|&(k, t)| (self.streams[&k].priority, t, self.streams[&k].queue[0].seq))
            .map(|(k, _)| k)
    }

    /// Earliest decided start time of any kernel waiting on `device`.
    fn earliest_kernel(&self, device: usize) -> Option<u64> {
        self.devices[device]
            .ctxs
            .iter()
            .flat_map(|ctx| self.ctxs[ctx].streams.iter().map(move |&id| (ctx.0, id)))
            .filter(|k| {
                matches!(
                    self.streams[k].queue.front().map(|o| &o.work),
                    Some(Work::Kernel { .. })
                )
            })
            .filter_map(|k| self.head_ready(k))
            .min()
    }

    /// Process everything decidable up to `now`.
    pub fn advance(&mut self, now: u64) {
        // Spinning kernels first stay where they are; once everything else is decided, no flag
        // can be set before the spin horizon, so they spin up to it, and what that decided
        // (a slice's end) may let the horizon move on.
        self.spin_horizon = 0;
        loop {
            self.settle(now);
            match self.spin_limit(now) {
                Some(h) if h > self.spin_horizon => self.spin_horizon = h,
                _ => break,
            }
        }
    }

    /// The flag the kernel running from `stream` spins on, while it has not seen it set.
    fn spinning_on(&self, stream: Key) -> Option<u64> {
        match self.streams.get(&stream)?.queue.front()?.work {
            Work::Kernel {
                flag: Some(FlagOp::Wait(addr)),
                ..
            } => Some(addr),
            _ => None,
        }
    }

    /// The spin horizon once everything else up to `now` is decided. Every completion not
    /// decided yet (a flag's set among them) waits for a future launch or host function (after
    /// `now`), or for a spinning kernel to end or give its device up: at its slice's end, or
    /// when its flag, known to be set, is seen, at the earliest. `None` while nothing spins.
    fn spin_limit(&self, now: u64) -> Option<u64> {
        self.devices
            .iter()
            .filter_map(|dev| {
                let run = dev.running?;
                let addr = self.spinning_on(run.stream)?;
                let slice_end = if self.cfg.preempt {
                    dev.slice_end
                } else {
                    u64::MAX
                };
                let set = self.flags.get(&(run.stream.0, addr)).copied();
                Some(slice_end.min(set.unwrap_or(u64::MAX)))
            })
            .min()
            .map(|t| t.min(now))
    }

    /// Everything decidable up to `now` with spinning kernels held at the spin horizon.
    fn settle(&mut self, now: u64) {
        loop {
            let mut progress = false;
            for d in 0..self.devices.len() {
                while self.step_device(d, now) {
                    progress = true;
                }
            }
            progress |= self.resolve_non_kernels(now);
            if !progress {
                break;
            }
        }
    }

    /// Complete markers whose dependencies are decided; ask clients to run due host functions.
    fn resolve_non_kernels(&mut self, now: u64) -> bool {
        let mut progress = false;
        let keys: Vec<Key> = self.streams.keys().copied().collect();
        for key in keys {
            while let Some(op) = self.streams.get(&key).and_then(|s| s.queue.front()) {
                let event = match op.work {
                    Work::Marker { event } => event,
                    _ => None,
                };
                let is_marker = matches!(op.work, Work::Marker { .. });
                let fresh_host = matches!(op.work, Work::HostFunc { notified: false });
                let seq = op.seq;
                if !is_marker && !fresh_host {
                    break;
                }
                let Some(ready) = self.head_ready(key) else {
                    break;
                };
                let s = self.streams.get_mut(&key).expect("stream checked above");
                if is_marker {
                    Self::complete_front(s, ready);
                    if let Some((slot, generation)) = event
                        && self.event_slots.get(&(key.0, slot)) == Some(&(key, seq))
                    {
                        self.events.insert((key, seq), ready);
                        self.decided_events.push(DecidedEvent {
                            conn: key.0,
                            slot,
                            generation,
                            end_ns: ready,
                        });
                    }
                    progress = true;
                    self.reap_stream(key);
                    continue;
                }
                if ready <= now {
                    if let Some(QueuedOp {
                        work: Work::HostFunc { notified },
                        ..
                    }) = s.queue.front_mut()
                    {
                        *notified = true;
                    }
                    self.host_calls.push((key, seq));
                    progress = true;
                }
                break;
            }
        }
        progress
    }

    /// One scheduling step on device `d`; false when nothing more is decidable at `now`.
    fn step_device(&mut self, d: usize, now: u64) -> bool {
        let preempt = self.cfg.preempt;
        if let Some(run) = self.devices[d].running {
            let dev = &self.devices[d];
            let cap = if preempt { dev.slice_end } else { u64::MAX };
            let cursor = dev.cursor;
            if cursor < cap
                && let Some(addr) = self.spinning_on(run.stream)
            {
                let set = self.flags.get(&(run.stream.0, addr)).copied();
                if set.is_some_and(|t| t <= cursor) {
                    // Seen: the kernel goes on with its own work.
                    if let Some(QueuedOp {
                        work: Work::Kernel { flag, .. },
                        ..
                    }) = self
                        .streams
                        .get_mut(&run.stream)
                        .and_then(|s| s.queue.front_mut())
                    {
                        *flag = None;
                    }
                    return true;
                }
                let to = cap.min(self.spin_horizon).min(set.unwrap_or(u64::MAX));
                if to > cursor {
                    self.devices[d].cursor = to;
                    return true;
                }
                return false;
            }
            if cursor < cap {
                let s = self
                    .streams
                    .get_mut(&run.stream)
                    .expect("running stream exists");
                let Some(QueuedOp {
                    work: Work::Kernel { remaining_ns, .. },
                    ..
                }) = s.queue.front_mut()
                else {
                    unreachable!("running stream's head is a kernel")
                };
                let ran = (*remaining_ns).min(cap - cursor);
                *remaining_ns -= ran;
                let finished = *remaining_ns == 0;
                self.devices[d].cursor = cursor + ran;
                if finished {
                    self.end_segment(d, false);
                }
                return true;
            }
            // Slice over with the kernel unfinished: decide only once the device reaches it.
            if cursor > now {
                return false;
            }
            let active = self.devices[d]
                .active
                .expect("running implies an active context");
            if self.other_ready_context(d, active, cursor).is_none() {
                self.devices[d].slice_end = cursor + self.cfg.timeslice_ns;
                return true;
            }
            self.end_segment(d, true);
        }

        let dev = &self.devices[d];
        let cursor = dev.cursor;
        if let Some(active) = dev.active
            && cursor < dev.slice_end
            && let Some(stream) = self.ready_kernel(active, cursor)
        {
            self.devices[d].running = Some(Running {
                stream,
                seg_start: cursor,
            });
            return true;
        }
        if cursor > now {
            return false;
        }
        let next = match dev.active {
            Some(a) => self
                .other_ready_context(d, a, cursor)
                .or_else(|| self.ready_kernel(a, cursor).map(|_| a)),
            None => self.other_ready_context_from(d, 0, cursor),
        };
        let Some(next) = next else {
            // Idle until the earliest kernel's ready time. The cursor stays put otherwise: work
            // that becomes ready later (after a marker or host function resolves) starts when
            // it became ready, not when the model happened to look.
            match self.earliest_kernel(d) {
                Some(t) if t <= now && t > cursor => {
                    self.devices[d].cursor = t;
                    return true;
                }
                _ => return false,
            }
        };
        let switch = self.cfg.switch_cost_ns;
        let slice = self.cfg.timeslice_ns;
        let dev = &mut self.devices[d];
        if dev.last_ctx.is_some_and(|l| l != next) {
            dev.cursor += switch;
        }
        dev.active = Some(next);
        dev.last_ctx = Some(next);
        dev.slice_end = dev.cursor + slice;
        let at = dev.cursor;
        let stream = self
            .ready_kernel(next, cursor)
            .expect("chosen context has a ready kernel");
        self.devices[d].running = Some(Running {
            stream,
            seg_start: at,
        });
        true
    }

    /// Next context after `after` in round-robin order with a kernel ready by `at`.
    fn other_ready_context(&self, d: usize, after: Key, at: u64) -> Option<Key> {
        let ctxs = &self.devices[d].ctxs;
        let start = ctxs.iter().position(|k| *k == after).map_or(0, |i| i + 1);
        self.other_ready_context_from(d, start, at)
            .filter(|k| *k != after)
    }

    fn other_ready_context_from(&self, d: usize, start: usize, at: u64) -> Option<Key> {
        let ctxs = &self.devices[d].ctxs;
        (0..ctxs.len())
            .map(|i| ctxs[(start + i) % ctxs.len()])
            .find(|&k| self.ready_kernel(k, at).is_some())
    }

    /// Close the running kernel's trace segment at the cursor; complete it unless preempted.
    fn end_segment(&mut self, d: usize, preempted: bool) {
        let dev = &mut self.devices[d];
        let run = dev.running.take().expect("a kernel is running");
        let end = dev.cursor;
        let s = self
            .streams
            .get_mut(&run.stream)
            .expect("running stream exists");
        let (kernel, flag) = match s.queue.front().map(|o| &o.work) {
            Some(Work::Kernel { name, flag, .. }) => (name.clone(), *flag),
            _ => unreachable!("running stream's head is a kernel"),
        };
        let ctx = s.ctx;
        if !preempted {
            Self::complete_front(s, end);
            if let Some(FlagOp::Set(addr)) = flag {
                let t = self.flags.entry((run.stream.0, addr)).or_insert(end);
                *t = (*t).min(end);
            }
        }
        self.trace.push(Record {
            device: d as u32,
            pid: self.pids.get(&run.stream.0).copied().unwrap_or(0),
            ctx: ctx.1,
            stream: run.stream.1,
            kernel: kernel.to_string(),
            start_ns: run.seg_start,
            end_ns: end,
            preempted,
        });
        self.reap_stream(run.stream);
    }

    /// The earliest future instant at which [`Model::advance`] can decide more.
    pub fn next_wakeup(&self, now: u64) -> Option<u64> {
        let mut t: Option<u64> = None;
        let mut consider = |x: u64| {
            if x > now {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        for (i, dev) in self.devices.iter().enumerate() {
            // The cursor matters only to a kernel cut at its slice's end or one still waiting:
            // an idle device has nothing to decide there.
            let waiting = self.earliest_kernel(i);
            if dev.running.is_some() || waiting.is_some() {
                consider(dev.cursor);
            }
            if let Some(e) = waiting {
                consider(e);
            }
            // A spinning kernel: its slice's end (another context may take the device), and
            // when its flag is set, if that is decided.
            if let Some(run) = dev.running
                && let Some(addr) = self.spinning_on(run.stream)
            {
                if self.cfg.preempt {
                    consider(dev.slice_end);
                }
                if let Some(&t) = self.flags.get(&(run.stream.0, addr)) {
                    consider(t);
                }
            }
        }
        for (&key, s) in &self.streams {
            if matches!(
                s.queue.front().map(|o| &o.work),
                Some(Work::HostFunc { notified: false })
            ) && let Some(r) = self.head_ready(key)
            {
                consider(r);
            }
        }
        t
    }

    pub fn take_trace(&mut self) -> Vec<Record> {
        std::mem::take(&mut self.trace)
    }

    /// Host functions whose turn has come, as `(stream, seq)`.
    pub fn take_host_calls(&mut self) -> Vec<(Key, u64)> {
        std::mem::take(&mut self.host_calls)
    }

    /// Event records decided since the last call (only each slot's latest record).
    pub fn take_decided_events(&mut self) -> Vec<DecidedEvent> {
        std::mem::take(&mut self.decided_events)
    }

    /// Reserve `bytes` on `device` for `conn`; false when that would exceed the capacity.
    pub fn alloc(&mut self, conn: ConnId, device: u32, bytes: u64) -> bool {
        let Some(dev) = self.devices.get_mut(device as usize) else {
            return false;
        };
        if dev.mem_used.saturating_add(bytes) > dev.mem_total {
            return false;
        }
        dev.mem_used += bytes;
        *self.held.entry((conn, device)).or_default() += bytes;
        true
    }

    pub fn free(&mut self, conn: ConnId, device: u32, bytes: u64) {
        let Some(held) = self.held.get_mut(&(conn, device)) else {
            return;
        };
        let bytes = bytes.min(*held);
        *held -= bytes;
        let dev = &mut self.devices[device as usize];
        dev.mem_used -= bytes;
    }

    /// `(free, total)` bytes of `device`.
    pub fn mem_info(&self, device: u32) -> Option<(u64, u64)> {
        let dev = self.devices.get(device as usize)?;
        Some((dev.mem_total - dev.mem_used, dev.mem_total))
    }
}

#[cfg(test)]
mod tests;
