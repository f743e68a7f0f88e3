//! GPU memory beyond the card: the pure core that decides, when the groups' memory caps on a
//! GPU promise more than it holds, which allocation is granted, which waits, and which group
//! is moved to host memory (checkpointed) to make room, and when it comes back.
//!
//! No I/O, no threads, no clock: every input carries `now` (nanoseconds) and returns the
//! [`Effect`]s it causes; [`Overcommit::next_wakeup`] says when [`Overcommit::tick`] is due.
//! The caps themselves are checked before an allocation reaches this core (a request here is
//! within its group's cap); this core keeps the *physical* books: what is really allocated on
//! each GPU, against what the GPU holds ([`Overcommit::set_capacity`]).
//!
//! # Rules
//!
//! 1. **Grant** an allocation that fits in the GPU's free memory, at once.
//! 2. **Wait** otherwise, for memory others free, up to [`Params::alloc_wait_ns`] or, when
//!    longer, as long as swapping its bytes out of the way would take (a swap costs seconds: an
//!    allocation waits for memory about as long as making room would take, then has room
//!    made — never more than twice the better of the two, whenever memory would have come
//!    free). Waiting
//!    demands (allocations, and swapped-out groups that want to run) are served in the order
//!    they arose, each as soon as it fits; a later, smaller one that fits goes first rather
//!    than leave the memory idle, but never into memory owed to a demand whose wait ran out
//!    (room is being made for that one: the victims must not come straight back into it).
//! 3. **Swap out** when a wait runs out: the fewest groups, in order of preference, whose
//!    memory on that GPU makes room (counting what swaps under way will free). A *victim* is
//!    never the asker's group, never a group with memory the driver cannot checkpoint (managed
//!    or IPC memory, or a checkpoint it refused), never one mid-swap, nor one inside its
//!    *memory turn* (after it came back, or after a swap made room for it: at least
//!    [`Params::memory_turn_ns`], and [`TURN_PER_SWAP`] times what swapping its memory out and
//!    back costs, so that swaps take at most a fifth of a group's time in memory) or cooling
//!    down after a checkpoint that timed out. Preferred: groups not holding
//!    a turn on that GPU, then of lower priority, lower weight, holding more memory there, and
//!    run least recently. All of a victim's processes holding memory on that GPU are
//!    checkpointed together ([`Effect::SwapOut`]); their memory on every GPU is free once the
//!    swap is done, and the allocation is granted when it fits.
//! 4. **Refuse** (out of memory, with a [`Refusal`] saying why) only an allocation that could
//!    not fit even with every group that may be swapped out gone: what its own group holds there
//!    and what cannot be swapped fill the rest.
//! 5. **Restore** a swapped-out group as soon as its memory fits ([`Effect::SwapIn`]): in the
//!    order of rule 2 if it wants to run (pending work, or an allocation of its own waiting),
//!    else only when no demand waits on the GPU. A group that wants to run is resident at least
//!    once per [`Params::window_ns`]: when it has wanted for that long, others are swapped out
//!    for it by rule 3.
//! 6. **Faults.** A checkpoint that times out puts its group back (resident) and out of reach
//!    for [`Params::retry_after_ns`]; one the driver refuses marks the group unswappable; the
//!    next victim is chosen at once. A restore is only ever attempted when the memory is there
//!    (a real driver never restores a process whose restore once failed); if one fails anyway,
//!    its processes are [`Effect::Lost`]. A process that exits while swapped out takes its
//!    host copy with it.
//! 7. **Restart.** A daemon that restarts (after a crash or `kill -9`, perhaps mid-swap)
//!    learns what processes hold from what they restate, not where their memory is: each
//!    process that restates memory is asked of the driver ([`Overcommit::await_driver`]) and
//!    is no victim until it answers ([`Overcommit::recover`]). One the driver holds
//!    checkpointed is swapped out (its bytes in host memory, not on the GPU) and comes back by
//!    rule 5; one it holds locked with its memory on the GPU is unlocked by the caller and
//!    runs on. So a swap cut short is finished (restored when its memory fits) or undone.
//!
//! A swapped-out group gets no turns on the GPU; the time policy keeps its share for the
//! windows in which it is resident (the daemon tells it which groups are resident).

mod admission;
#[cfg(test)]
mod tests;

pub use admission::{Promise, promise};

use std::collections::{BTreeMap, BTreeSet};

pub type Bytes = u64;
pub type Nanos = u64;
/// A GPU, by index.
pub type Gpu = usize;

/// A group (container, pod, job): what caps, turns and swaps apply to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupId(pub u64);

/// A process of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProcessId(pub u64);

/// An allocation request, as the caller numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// A swap: the processes of one group checkpointed together, until they are restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SwapId(pub u64);

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// How long an allocation that does not fit waits for memory freed by others before
    /// groups are swapped out for it.
    pub alloc_wait_ns: Nanos,
    /// A swapped-out group that wants to run is resident at least once per window.
    pub window_ns: Nanos,
    /// After a group comes back (or a swap made room for it), it is not swapped out for this
    /// long: swaps cost seconds, so a group back in must get to use the memory.
    pub memory_turn_ns: Nanos,
    /// A group whose checkpoint timed out is not chosen again for this long.
    pub retry_after_ns: Nanos,
    /// The longest an allocation waits, whatever it waits for (memory, a swap, a group's
    /// memory turn): then it is refused ([`Refusal::WaitedTooLong`]), so that no allocation
    /// call blocks without bound.
    pub max_wait_ns: Nanos,
    /// What a swap costs before any is seen (each one seen updates it).
    pub swap_cost: SwapCost,
    /// An exited process's memory still counts as used this long: the driver releases it
    /// asynchronously, and a restore that finds too little memory breaks the restored process
    /// for good.
    pub exit_release_ns: Nanos,
}

/// What moving memory to host memory and back costs: `latency_ns`, then the bytes at the rate
/// of the direction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwapCost {
    pub latency_ns: Nanos,
    pub checkpoint_bytes_per_s: f64,
    pub restore_bytes_per_s: f64,
}

impl SwapCost {
    /// As measured on an H200 (driver 580): 0.1 s, then 1.5 GB/s to host memory and 4.4 GB/s
    /// back.
    pub const MEASURED: SwapCost = SwapCost {
        latency_ns: 100_000_000,
        checkpoint_bytes_per_s: 1.5e9,
        restore_bytes_per_s: 4.4e9,
    };

    /// Nanoseconds to move `bytes` out (`out`) or back in.
    pub fn ns(&self, bytes: Bytes, out: bool) -> Nanos {
        let rate = if out {
            self.checkpoint_bytes_per_s
        } else {
            self.restore_bytes_per_s
        };
        self.latency_ns + (bytes as f64 / rate.max(1.0) * 1e9) as Nanos
    }

    /// Take in a swap of `bytes` that took `took` ns.
    fn learn(&mut self, bytes: Bytes, took: Nanos, out: bool) {
        let moving = took.saturating_sub(self.latency_ns);
        if bytes < (1 << 20) || moving == 0 {
            return;
        }
        let seen = bytes as f64 / (moving as f64 / 1e9);
        let rate = if out {
            &mut self.checkpoint_bytes_per_s
        } else {
            &mut self.restore_bytes_per_s
        };
        *rate = (*rate + seen) / 2.0;
    }
}

/// A memory turn lasts at least this many times what swapping the group out and back costs.
pub const TURN_PER_SWAP: u64 = 4;

impl Default for Params {
    fn default() -> Params {
        Params {
            alloc_wait_ns: 1_000_000_000,
            window_ns: 60_000_000_000,
            memory_turn_ns: 10_000_000_000,
            retry_after_ns: 10_000_000_000,
            max_wait_ns: 120_000_000_000,
            swap_cost: SwapCost::MEASURED,
            exit_release_ns: 1_000_000_000,
        }
    }
}

/// What orders groups as victims (besides memory held and time since they ran).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupRank {
    /// Higher is kept longer.
    pub priority: i64,
    /// The time policy's weight: heavier is kept longer.
    pub weight: f64,
}

impl Default for GroupRank {
    fn default() -> GroupRank {
        GroupRank {
            priority: 0,
            weight: 1.0,
        }
    }
}

/// Why a group's memory cannot be checkpointed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unswappable {
    /// Managed (unified) memory: the driver's checkpoint does not support it.
    Managed,
    /// Memory shared with another process (IPC): the other process would lose it.
    Ipc,
    /// The driver refused a checkpoint of one of its processes.
    Refused,
}

impl Unswappable {
    pub fn as_str(self) -> &'static str {
        match self {
            Unswappable::Managed => "managed memory",
            Unswappable::Ipc => "memory shared with another process (IPC)",
            Unswappable::Refused => "a checkpoint the driver refused",
        }
    }
}

/// How a swap-out ended badly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapOutFailure {
    /// The lock timed out (work still running): the group runs on; tried again later.
    TimedOut,
    /// The driver refused (e.g. managed memory): never tried again.
    Refused,
}

/// Why an allocation within its cap is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Even with every group that may be swapped out gone it would not fit: `own` bytes of the
    /// asker's group and `unswappable` bytes of groups that cannot be swapped (with why) are
    /// on the GPU of `capacity` bytes.
    NeverFits {
        bytes: Bytes,
        capacity: Bytes,
        own: Bytes,
        unswappable: Vec<(GroupId, Unswappable, Bytes)>,
    },
    /// It waited [`Params::max_wait_ns`] (`waited_ns`) and memory still did not come free:
    /// every group that could make room was mid-swap, inside its memory turn or cooling down.
    WaitedTooLong { bytes: Bytes, waited_ns: Nanos },
    /// The process could not be restored after a swap, so it cannot allocate.
    Lost,
}

impl Refusal {
    /// What to tell the asker, naming each group as `name` gives it (the core numbers them;
    /// users know them by name).
    pub fn describe(&self, name: &dyn Fn(GroupId) -> String) -> String {
        let mut s = String::new();
        self.write(&mut s, name).expect("writing to a String");
        s
    }

    fn write(
        &self,
        f: &mut dyn std::fmt::Write,
        name: &dyn Fn(GroupId) -> String,
    ) -> std::fmt::Result {
        const MIB: Bytes = 1 << 20;
        match self {
            Refusal::NeverFits {
                bytes,
                capacity,
                own,
                unswappable,
            } => {
                write!(
                    f,
                    "{} MiB cannot fit on the GPU ({} MiB) even with every other group \
                     swapped out: the group itself holds {} MiB there",
                    bytes.div_ceil(MIB),
                    capacity / MIB,
                    own / MIB
                )?;
                for (g, why, b) in unswappable {
                    write!(
                        f,
                        "; group {} holds {} MiB of {}",
                        name(*g),
                        b / MIB,
                        why.as_str()
                    )?;
                }
                write!(
                    f,
                    "; free memory on the GPU or lower the group's memory cap"
                )
            }
            Refusal::WaitedTooLong { bytes, waited_ns } => write!(
                f,
                "{} MiB did not come free on the GPU within {:.1} s (the other groups' memory \
                 was mid-swap or inside its memory turn); retry later, raise the scheduler's \
                 overcommit.max_wait, or lower memory_overcommit",
                bytes.div_ceil(MIB),
                *waited_ns as f64 / 1e9
            ),
            Refusal::Lost => write!(
                f,
                "the process could not be restored after a swap to host memory; restart it"
            ),
        }
    }
}

/// What the caller must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// The allocation may go ahead (its bytes are booked).
    Grant(RequestId),
    /// The allocation fails with out-of-memory.
    Refuse(RequestId, Refusal),
    /// Lock and checkpoint these processes (give the group no turns on any GPU); report with
    /// [`Overcommit::swapped_out`].
    SwapOut {
        swap: SwapId,
        group: GroupId,
        gpu: Gpu,
        processes: Vec<ProcessId>,
    },
    /// Restore and unlock these processes; report with [`Overcommit::swapped_in`].
    SwapIn {
        swap: SwapId,
        group: GroupId,
        processes: Vec<ProcessId>,
    },
    /// These processes cannot be restored (their memory is gone): end them.
    Lost {
        swap: SwapId,
        group: GroupId,
        processes: Vec<ProcessId>,
    },
}

/// Where a process's memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residence {
    Resident,
    SwappingOut(SwapId),
    Out(SwapId),
    SwappingIn(SwapId),
    /// A restore failed: its memory is gone.
    Lost,
}

#[derive(Debug)]
struct Process {
    group: GroupId,
    /// Bytes per GPU.
    held: BTreeMap<Gpu, Bytes>,
    residence: Residence,
    unswappable: Option<Unswappable>,
    /// Where its memory is is not known yet (the daemon restarted): not a victim until the
    /// driver says ([`Overcommit::recover`]).
    awaiting_driver: bool,
}

impl Process {
    fn occupies(&self) -> bool {
        !matches!(self.residence, Residence::Out(_) | Residence::Lost)
    }

    fn on(&self, gpu: Gpu) -> Bytes {
        self.held.get(&gpu).copied().unwrap_or(0)
    }
}

#[derive(Debug, Default)]
struct Group {
    rank: GroupRank,
    /// GPUs on which the group holds (or has been granted) a turn.
    turns: BTreeSet<Gpu>,
    last_ran: Nanos,
    pending_work: bool,
    /// Not a victim before this (memory turn).
    protected_until: Nanos,
    /// Not a victim before this (a checkpoint timed out).
    cooldown_until: Nanos,
    unswappable: Option<Unswappable>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SwapState {
    SwappingOut,
    Out,
    SwappingIn,
}

#[derive(Debug)]
struct Swap {
    group: GroupId,
    gpu: Gpu,
    processes: Vec<ProcessId>,
    state: SwapState,
    /// When it started wanting to run again (pending work, or an allocation of its own).
    wanted_since: Option<Nanos>,
    /// When it went out (restores of groups that do not want to run go in this order).
    out_since: Nanos,
    /// When its checkpoint or restore started.
    started: Nanos,
    /// Victims were swapped out to bring it back (rule 5): the memory they free is its.
    room_made: bool,
}

#[derive(Debug, Clone)]
struct Wait {
    req: RequestId,
    process: ProcessId,
    gpu: Gpu,
    bytes: Bytes,
    since: Nanos,
    /// Victims were swapped out for it (rule 3): the memory they free is its.
    room_made: bool,
}

/// Counters for metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    pub swap_outs: u64,
    pub swap_ins: u64,
    /// Device memory the swap-outs begun held when they were decided (all their processes'
    /// memory: a checkpoint moves a process whole).
    pub swap_out_bytes: Bytes,
    /// Host memory the restores begun moved back to the device.
    pub swap_in_bytes: Bytes,
    pub swap_out_failures: u64,
    pub lost: u64,
    pub waits: u64,
    pub refusals: u64,
}

/// One GPU's physical books.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuBooks {
    pub capacity: Bytes,
    /// Allocated by processes whose memory is on the GPU (resident or mid-swap).
    pub used: Bytes,
    /// Held in host memory by swapped-out processes.
    pub swapped: Bytes,
}

/// The overcommit core of one node: every GPU's physical books and swaps.
#[derive(Debug)]
pub struct Overcommit {
    params: Params,
    capacity: Vec<Bytes>,
    groups: BTreeMap<GroupId, Group>,
    processes: BTreeMap<ProcessId, Process>,
    swaps: BTreeMap<SwapId, Swap>,
    waits: Vec<Wait>,
    next_swap: u64,
    counters: Counters,
    /// What swaps cost, as last seen.
    cost: SwapCost,
    /// Memory of exited processes the driver may not have released yet: (GPU, bytes, until).
    releasing: Vec<(Gpu, Bytes, Nanos)>,
}

impl Overcommit {
    /// A node with GPUs of `capacity` bytes each.
    pub fn new(params: Params, capacity: Vec<Bytes>) -> Overcommit {
        Overcommit {
            params,
            capacity,
            groups: BTreeMap::new(),
            processes: BTreeMap::new(),
            swaps: BTreeMap::new(),
            waits: Vec::new(),
            next_swap: 1,
            counters: Counters::default(),
            cost: params.swap_cost,
            releasing: Vec::new(),
        }
    }

    pub fn params(&self) -> Params {
        self.params
    }

    /// New parameters apply from `now`. A changed [`Params::swap_cost`] (what the link is said
    /// to carry) replaces what the swaps seen so far taught; an unchanged one keeps it.
    pub fn set_params(&mut self, now: Nanos, params: Params) -> Vec<Effect> {
        if params.swap_cost != self.params.swap_cost {
            self.cost = params.swap_cost;
        }
        self.params = params;
        self.step(now)
    }

    /// What `gpu` holds for the processes booked here (its memory less what others use, e.g.
    /// contexts and processes without the hook).
    pub fn set_capacity(&mut self, now: Nanos, gpu: Gpu, bytes: Bytes) -> Vec<Effect> {
        if gpu >= self.capacity.len() {
            self.capacity.resize(gpu + 1, 0);
        }
        self.capacity[gpu] = bytes;
        self.step(now)
    }

    pub fn set_group(&mut self, group: GroupId, rank: GroupRank) {
        self.groups.entry(group).or_default().rank = rank;
    }

    /// Process `process` belongs to `group` (before its first request).
    pub fn attach(&mut self, process: ProcessId, group: GroupId) {
        self.groups.entry(group).or_default();
        self.processes.entry(process).or_insert(Process {
            group,
            held: BTreeMap::new(),
            residence: Residence::Resident,
            unswappable: None,
            awaiting_driver: false,
        });
    }

    /// The caller asks the driver where `process`'s memory is (it restated memory after the
    /// daemon restarted): its group is no victim until [`recover`](Self::recover) says.
    pub fn await_driver(&mut self, process: ProcessId) {
        if let Some(p) = self.processes.get_mut(&process) {
            p.awaiting_driver = true;
        }
    }

    /// The driver says where `process`'s memory is (rule 7): `checkpointed`, in host memory
    /// (a swap-out a previous daemon started, or a swap-in it did not finish), so the process
    /// is swapped out, with the rest of its group's recovered processes, and restored when its
    /// memory fits; else on the GPU (the caller unlocked it if it was locked), resident.
    pub fn recover(&mut self, now: Nanos, process: ProcessId, checkpointed: bool) -> Vec<Effect> {
        let Some(p) = self.processes.get_mut(&process) else {
            return self.step(now);
        };
        p.awaiting_driver = false;
        if !checkpointed || p.residence != Residence::Resident {
            return self.step(now);
        }
        let group = p.group;
        let gpu = (p.held.iter())
            .max_by_key(|(_, b)| **b)
            .map_or(0, |(g, _)| *g);
        let joined = (self.swaps.iter_mut())
            .find(|(_, s)| s.group == group && s.state == SwapState::Out)
            .map(|(&id, s)| {
                s.processes.push(process);
                id
            });
        let id = joined.unwrap_or_else(|| {
            let id = SwapId(self.next_swap);
            self.next_swap += 1;
            self.swaps.insert(
                id,
                Swap {
                    group,
                    gpu,
                    processes: vec![process],
                    state: SwapState::Out,
                    wanted_since: None,
                    out_since: now,
                    started: now,
                    room_made: false,
                },
            );
            id
        });
        self.processes.get_mut(&process).expect("present").residence = Residence::Out(id);
        self.step(now)
    }

    /// The process holds memory the driver cannot checkpoint: its group is never a victim.
    pub fn mark_unswappable(
        &mut self,
        now: Nanos,
        process: ProcessId,
        why: Unswappable,
    ) -> Vec<Effect> {
        if let Some(p) = self.processes.get_mut(&process) {
            p.unswappable.get_or_insert(why);
        }
        self.step(now)
    }

    /// `group` holds (or has been granted) a turn on `gpu`, or not.
    pub fn set_turn(&mut self, group: GroupId, gpu: Gpu, holds: bool) {
        let g = self.groups.entry(group).or_default();
        if holds {
            g.turns.insert(gpu);
        } else {
            g.turns.remove(&gpu);
        }
    }

    /// `group` ran (a turn of it ended) at `now`.
    pub fn ran(&mut self, group: GroupId, now: Nanos) {
        let g = self.groups.entry(group).or_default();
        g.last_ran = g.last_ran.max(now);
    }

    /// Whether `group` has work waiting to run (a swapped-out one then wants to come back).
    pub fn set_pending(&mut self, now: Nanos, group: GroupId, pending: bool) -> Vec<Effect> {
        self.groups.entry(group).or_default().pending_work = pending;
        self.step(now)
    }

    /// Process `process` asks for `bytes` on `gpu`, within its group's cap. Answered by an
    /// [`Effect::Grant`] or [`Effect::Refuse`] of `req`, now or later.
    pub fn request(
        &mut self,
        now: Nanos,
        req: RequestId,
        process: ProcessId,
        gpu: Gpu,
        bytes: Bytes,
    ) -> Vec<Effect> {
        let Some(p) = self.processes.get(&process) else {
            // Unknown process: nothing is booked for it, nothing to weigh.
            return vec![Effect::Refuse(req, Refusal::Lost)];
        };
        if p.residence == Residence::Lost {
            self.counters.refusals += 1;
            return vec![Effect::Refuse(req, Refusal::Lost)];
        }
        if gpu >= self.capacity.len() {
            self.capacity.resize(gpu + 1, 0);
        }
        self.waits.push(Wait {
            req,
            process,
            gpu,
            bytes,
            since: now,
            room_made: false,
        });
        let effects = self.step(now);
        if self.waits.iter().any(|w| w.req == req) {
            self.counters.waits += 1;
        }
        effects
    }

    /// `bytes` allocated by `process` on `gpu` were freed (or an allocation it was granted
    /// failed in the driver).
    pub fn free(&mut self, now: Nanos, process: ProcessId, gpu: Gpu, bytes: Bytes) -> Vec<Effect> {
        if let Some(p) = self.processes.get_mut(&process)
            && let Some(h) = p.held.get_mut(&gpu)
        {
            *h = h.saturating_sub(bytes);
        }
        self.step(now)
    }

    /// `process` states what it holds on `gpu` (its books were lost, e.g. the daemon
    /// restarted): booked as it is, even past the GPU — the memory is taken already.
    pub fn restate(
        &mut self,
        now: Nanos,
        process: ProcessId,
        gpu: Gpu,
        bytes: Bytes,
    ) -> Vec<Effect> {
        if gpu >= self.capacity.len() {
            self.capacity.resize(gpu + 1, 0);
        }
        if let Some(p) = self.processes.get_mut(&process) {
            p.held.insert(gpu, bytes);
        }
        self.step(now)
    }

    /// Request `req` is no longer wanted (its asker went away): it stops waiting.
    pub fn cancel(&mut self, now: Nanos, req: RequestId) -> Vec<Effect> {
        self.waits.retain(|w| w.req != req);
        self.step(now)
    }

    /// The caller books `process`'s memory under another id now (it reconnected): it goes
    /// without its memory being freed.
    pub fn forget(&mut self, now: Nanos, process: ProcessId) -> Vec<Effect> {
        self.processes.remove(&process);
        self.waits.retain(|w| w.process != process);
        self.swaps.retain(|_, s| {
            s.processes.retain(|&p| p != process);
            !s.processes.is_empty()
        });
        self.step(now)
    }

    /// The process exited: its memory is free, on the GPU or in host memory, and its waits end.
    pub fn exit(&mut self, now: Nanos, process: ProcessId) -> Vec<Effect> {
        if let Some(p) = self.processes.remove(&process)
            && p.occupies()
        {
            let until = now.saturating_add(self.params.exit_release_ns);
            (self.releasing).extend(p.held.into_iter().map(|(g, b)| (g, b, until)));
        }
        self.waits.retain(|w| w.process != process);
        self.swaps.retain(|_, s| {
            s.processes.retain(|&p| p != process);
            !s.processes.is_empty() || s.state != SwapState::Out
        });
        self.step(now)
    }

    /// The checkpoint of `swap` ended.
    pub fn swapped_out(
        &mut self,
        now: Nanos,
        swap: SwapId,
        outcome: Result<(), SwapOutFailure>,
    ) -> Vec<Effect> {
        let Some(s) = self.swaps.get_mut(&swap) else {
            return self.step(now);
        };
        if s.state != SwapState::SwappingOut {
            return self.step(now);
        }
        match outcome {
            Ok(()) => {
                s.state = SwapState::Out;
                s.out_since = now;
                let (group, took, processes) =
                    (s.group, now.saturating_sub(s.started), s.processes.clone());
                let bytes: Bytes = self.swap_bytes(&self.swaps[&swap]).values().sum();
                self.cost.learn(bytes, took, true);
                for p in processes {
                    if let Some(p) = self.processes.get_mut(&p) {
                        p.residence = Residence::Out(swap);
                    }
                }
                if self.wants(group, swap) {
                    self.swaps.get_mut(&swap).expect("present").wanted_since = Some(now);
                }
                if self.swaps[&swap].processes.is_empty() {
                    self.swaps.remove(&swap);
                }
            }
            Err(failure) => {
                self.counters.swap_out_failures += 1;
                let s = self.swaps.remove(&swap).expect("present");
                for p in &s.processes {
                    if let Some(p) = self.processes.get_mut(p) {
                        p.residence = Residence::Resident;
                    }
                }
                let g = self.groups.entry(s.group).or_default();
                match failure {
                    SwapOutFailure::TimedOut => g.cooldown_until = now + self.params.retry_after_ns,
                    SwapOutFailure::Refused => g.unswappable = Some(Unswappable::Refused),
                }
            }
        }
        self.step(now)
    }

    /// The restore of `swap` ended; `ok: false`: its processes' memory is gone.
    pub fn swapped_in(&mut self, now: Nanos, swap: SwapId, ok: bool) -> Vec<Effect> {
        let Some(s) = self.swaps.get(&swap) else {
            return self.step(now);
        };
        if s.state != SwapState::SwappingIn {
            return self.step(now);
        }
        let bytes: Bytes = self.swap_bytes(s).values().sum();
        let s = self.swaps.remove(&swap).expect("present");
        let mut effects = Vec::new();
        if ok {
            self.cost.learn(bytes, now.saturating_sub(s.started), false);
            for p in &s.processes {
                if let Some(p) = self.processes.get_mut(p) {
                    p.residence = Residence::Resident;
                }
            }
            let turn = self.memory_turn(bytes);
            let g = self.groups.entry(s.group).or_default();
            g.protected_until = g.protected_until.max(now + turn);
        } else {
            self.counters.lost += 1;
            for p in &s.processes {
                if let Some(p) = self.processes.get_mut(p) {
                    p.residence = Residence::Lost;
                    p.held.clear();
                }
            }
            let lost: BTreeSet<ProcessId> = s.processes.iter().copied().collect();
            let (refused, kept): (Vec<Wait>, Vec<Wait>) = std::mem::take(&mut self.waits)
                .into_iter()
                .partition(|w| lost.contains(&w.process));
            self.waits = kept;
            for w in refused {
                self.counters.refusals += 1;
                effects.push(Effect::Refuse(w.req, Refusal::Lost));
            }
            effects.push(Effect::Lost {
                swap,
                group: s.group,
                processes: s.processes,
            });
        }
        effects.extend(self.step(now));
        effects
    }

    /// Time passed: waits may have run out, windows ended.
    pub fn tick(&mut self, now: Nanos) -> Vec<Effect> {
        self.step(now)
    }

    /// The next instant at which [`tick`](Self::tick) may decide something (`None`: not until
    /// an input changes something).
    pub fn next_wakeup(&self, now: Nanos) -> Option<Nanos> {
        let mut times: Vec<Nanos> = Vec::new();
        for w in &self.waits {
            times.push(w.since + self.wait_for(w.bytes));
            times.push(w.since.saturating_add(self.params.max_wait_ns));
        }
        for s in self.swaps.values() {
            if let (SwapState::Out, Some(t)) = (s.state, s.wanted_since) {
                times.push(t + self.params.window_ns);
            }
        }
        times.extend(self.releasing.iter().map(|r| r.2));
        if !self.waits.is_empty() || self.swaps.values().any(|s| s.wanted_since.is_some()) {
            for g in self.groups.values() {
                times.extend([g.protected_until, g.cooldown_until]);
            }
        }
        times.into_iter().filter(|&t| t > now).min()
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// What swaps cost, as last seen.
    pub fn swap_cost(&self) -> SwapCost {
        self.cost
    }

    /// How long an allocation of `bytes` waits for memory before room is made for it.
    fn wait_for(&self, bytes: Bytes) -> Nanos {
        self.params.alloc_wait_ns.max(self.cost.ns(bytes, true))
    }

    /// How long a group of `bytes` keeps the memory it was brought back to or had made room in.
    fn memory_turn(&self, bytes: Bytes) -> Nanos {
        let swap = self.cost.ns(bytes, true) + self.cost.ns(bytes, false);
        self.params.memory_turn_ns.max(TURN_PER_SWAP * swap)
    }

    pub fn books(&self, gpu: Gpu) -> GpuBooks {
        let mut b = GpuBooks {
            capacity: self.capacity.get(gpu).copied().unwrap_or(0),
            ..GpuBooks::default()
        };
        for p in self.processes.values() {
            match p.residence {
                Residence::Out(_) => b.swapped += p.on(gpu),
                Residence::Lost => {}
                _ => b.used += p.on(gpu),
            }
        }
        b
    }

    /// Where `process`'s memory is, and what it holds on `gpu`.
    pub fn process(&self, process: ProcessId, gpu: Gpu) -> Option<(Residence, Bytes)> {
        let p = self.processes.get(&process)?;
        Some((p.residence, p.on(gpu)))
    }

    /// Whether `group` may be given turns: none of its processes is swapped out or mid-swap.
    pub fn resident(&self, group: GroupId) -> bool {
        self.processes
            .values()
            .filter(|p| p.group == group)
            .all(|p| p.residence == Residence::Resident)
    }

    /// The swaps under way or done, for status: (swap, group, GPU, processes, whether its
    /// memory is out (false: mid-swap)).
    pub fn swaps(&self) -> Vec<(SwapId, GroupId, Gpu, Vec<ProcessId>, bool)> {
        self.swaps
            .iter()
            .map(|(&id, s)| {
                (
                    id,
                    s.group,
                    s.gpu,
                    s.processes.clone(),
                    s.state == SwapState::Out,
                )
            })
            .collect()
    }

    /// Allocations waiting, oldest first: (request, process, GPU, bytes, since).
    pub fn waiting(&self) -> Vec<(RequestId, ProcessId, Gpu, Bytes, Nanos)> {
        self.waits
            .iter()
            .map(|w| (w.req, w.process, w.gpu, w.bytes, w.since))
            .collect()
    }

    // --- the decisions ------------------------------------------------------------------

    /// Whether swapped-out `swap` of `group` wants to run: the group has pending work or one of
    /// the swap's processes waits for an allocation.
    fn wants(&self, group: GroupId, swap: SwapId) -> bool {
        self.groups.get(&group).is_some_and(|g| g.pending_work)
            || self.waits.iter().any(|w| {
                self.processes
                    .get(&w.process)
                    .is_some_and(|p| p.residence == Residence::Out(swap))
            })
    }

    fn free_on(&self, gpu: Gpu) -> Bytes {
        let used: Bytes = (self.processes.values())
            .filter(|p| p.occupies())
            .map(|p| p.on(gpu))
            .sum::<Bytes>()
            + self.releasing_on(gpu);
        self.capacity
            .get(gpu)
            .copied()
            .unwrap_or(0)
            .saturating_sub(used)
    }

    /// Bytes on `gpu` that swaps under way and exited processes will free.
    fn freeing_on(&self, gpu: Gpu) -> Bytes {
        (self.swaps.values())
            .filter(|s| s.state == SwapState::SwappingOut)
            .flat_map(|s| &s.processes)
            .filter_map(|p| self.processes.get(p))
            .map(|p| p.on(gpu))
            .sum::<Bytes>()
            + self.releasing_on(gpu)
    }

    /// Bytes on `gpu` of exited processes that the driver may still be releasing.
    fn releasing_on(&self, gpu: Gpu) -> Bytes {
        (self.releasing.iter())
            .filter(|r| r.0 == gpu)
            .map(|r| r.1)
            .sum()
    }

    /// The bytes swap `swap`'s processes hold per GPU.
    fn swap_bytes(&self, swap: &Swap) -> BTreeMap<Gpu, Bytes> {
        let mut m = BTreeMap::new();
        for p in swap.processes.iter().filter_map(|p| self.processes.get(p)) {
            for (&g, &b) in &p.held {
                *m.entry(g).or_default() += b;
            }
        }
        m
    }

    fn step(&mut self, now: Nanos) -> Vec<Effect> {
        let mut effects = Vec::new();
        self.releasing.retain(|r| r.2 > now);
        // Wanting is re-read every step: pending work comes and goes.
        let ids: Vec<SwapId> = self.swaps.keys().copied().collect();
        for id in ids {
            let s = &self.swaps[&id];
            if s.state != SwapState::Out {
                continue;
            }
            let wants = self.wants(s.group, id);
            let s = self.swaps.get_mut(&id).expect("present");
            match (wants, s.wanted_since) {
                (true, None) => s.wanted_since = Some(now),
                (false, Some(_)) => s.wanted_since = None,
                _ => {}
            }
        }
        self.serve(now, &mut effects);
        self.refuse_waited_too_long(now, &mut effects);
        self.swap_out_for_overdue(now, &mut effects);
        // A refusal may leave a GPU where nothing waits: groups that do not want to run may
        // come back there.
        self.serve(now, &mut effects);
        effects
    }

    /// Rule 2 and 5: serve the demands that fit, oldest first; then restore groups that do not
    /// want to run, on GPUs where nothing waits. A younger demand never takes memory victims
    /// were swapped out to free for an older one: else that room goes to whoever fits first,
    /// the victims come straight back, and the older one waits for ever.
    fn serve(&mut self, now: Nanos, effects: &mut Vec<Effect>) {
        enum Demand {
            Alloc(usize),
            Restore(SwapId),
        }
        let mut demands: Vec<(Nanos, u64, Demand)> = Vec::new();
        for (i, w) in self.waits.iter().enumerate() {
            let resident = self
                .processes
                .get(&w.process)
                .is_some_and(|p| p.residence == Residence::Resident);
            if resident {
                demands.push((w.since, i as u64, Demand::Alloc(i)));
            }
        }
        for (&id, s) in &self.swaps {
            if let (SwapState::Out, Some(t)) = (s.state, s.wanted_since) {
                demands.push((t, u64::MAX / 2 + id.0, Demand::Restore(id)));
            }
        }
        demands.sort_by_key(|d| (d.0, d.1));
        let mut granted: BTreeSet<usize> = BTreeSet::new();
        // Bytes per GPU owed to demands that room is being made for.
        let mut owed: BTreeMap<Gpu, Bytes> = BTreeMap::new();
        for (_, _, d) in demands {
            match d {
                Demand::Alloc(i) => {
                    let w = &self.waits[i];
                    let owed_here = owed.get(&w.gpu).copied().unwrap_or(0);
                    if w.bytes <= self.free_on(w.gpu).saturating_sub(owed_here) {
                        let (process, gpu, bytes, req) = (w.process, w.gpu, w.bytes, w.req);
                        let p = self.processes.get_mut(&process).expect("resident");
                        *p.held.entry(gpu).or_default() += bytes;
                        granted.insert(i);
                        effects.push(Effect::Grant(req));
                    } else if w.room_made {
                        let group = self.processes[&w.process].group;
                        if self.could_fit(group, w.gpu, w.bytes) {
                            *owed.entry(w.gpu).or_default() += w.bytes;
                        }
                    }
                }
                Demand::Restore(id) => {
                    if !self.restore_if_it_fits(now, id, &owed, effects)
                        && self.swaps[&id].room_made
                    {
                        let (group, need) =
                            (self.swaps[&id].group, self.swap_bytes(&self.swaps[&id]));
                        if need.iter().all(|(&g, &b)| self.could_fit(group, g, b)) {
                            for (g, b) in need {
                                *owed.entry(g).or_default() += b;
                            }
                        }
                    }
                }
            }
        }
        let mut i = 0;
        self.waits.retain(|_| {
            i += 1;
            !granted.contains(&(i - 1))
        });
        let idle: Vec<SwapId> = (self.swaps.iter())
            .filter(|(_, s)| s.state == SwapState::Out && s.wanted_since.is_none())
            .map(|(&id, s)| (s.out_since, id))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .map(|(_, id)| id)
            .collect();
        for id in idle {
            let bytes = self.swap_bytes(&self.swaps[&id]);
            let contested = self.waits.iter().any(|w| bytes.contains_key(&w.gpu));
            if !contested {
                self.restore_if_it_fits(now, id, &owed, effects);
            }
        }
    }

    /// Start restoring swap `id` if its memory fits beside what is `owed` to others; whether
    /// it started.
    fn restore_if_it_fits(
        &mut self,
        now: Nanos,
        id: SwapId,
        owed: &BTreeMap<Gpu, Bytes>,
        effects: &mut Vec<Effect>,
    ) -> bool {
        let s = &self.swaps[&id];
        let fits = self.swap_bytes(s).iter().all(|(&g, &b)| {
            b <= (self.free_on(g)).saturating_sub(owed.get(&g).copied().unwrap_or(0))
        });
        if !fits {
            return false;
        }
        let bytes: Bytes = self.swap_bytes(s).values().sum();
        let s = self.swaps.get_mut(&id).expect("present");
        s.state = SwapState::SwappingIn;
        s.started = now;
        let (group, processes) = (s.group, s.processes.clone());
        for p in &processes {
            if let Some(p) = self.processes.get_mut(p) {
                p.residence = Residence::SwappingIn(id);
            }
        }
        self.counters.swap_ins += 1;
        self.counters.swap_in_bytes += bytes;
        effects.push(Effect::SwapIn {
            swap: id,
            group,
            processes,
        });
        true
    }

    /// Rule 2's bound: an allocation that waited [`Params::max_wait_ns`] is refused.
    fn refuse_waited_too_long(&mut self, now: Nanos, effects: &mut Vec<Effect>) {
        let max = self.params.max_wait_ns;
        let (done, kept): (Vec<Wait>, Vec<Wait>) = std::mem::take(&mut self.waits)
            .into_iter()
            .partition(|w| now >= w.since.saturating_add(max));
        self.waits = kept;
        for w in done {
            self.counters.refusals += 1;
            let refusal = Refusal::WaitedTooLong {
                bytes: w.bytes,
                waited_ns: now - w.since,
            };
            effects.push(Effect::Refuse(w.req, refusal));
        }
    }

    /// Rules 3, 4 and 5: swap groups out for allocations whose wait ran out and for swapped-out
    /// groups whose window ran out; refuse allocations that can never fit.
    fn swap_out_for_overdue(&mut self, now: Nanos, effects: &mut Vec<Effect>) {
        // Oldest first, as rule 2 serves them.
        let mut overdue: Vec<(Nanos, Result<RequestId, SwapId>)> = Vec::new();
        for w in &self.waits {
            let resident = self
                .processes
                .get(&w.process)
                .is_some_and(|p| p.residence == Residence::Resident);
            if resident && now >= w.since + self.wait_for(w.bytes) {
                overdue.push((w.since, Ok(w.req)));
            }
        }
        for (&id, s) in &self.swaps {
            if let (SwapState::Out, Some(t)) = (s.state, s.wanted_since)
                && now >= t + self.params.window_ns
            {
                overdue.push((t, Err(id)));
            }
        }
        overdue.sort();
        for (_, o) in overdue {
            match o {
                Ok(req) => {
                    let Some(w) = self.waits.iter().find(|w| w.req == req).cloned() else {
                        continue;
                    };
                    let group = self.processes[&w.process].group;
                    match self.make_room(now, group, &BTreeMap::from([(w.gpu, w.bytes)]), effects) {
                        Room::Made => {
                            if let Some(w) = self.waits.iter_mut().find(|w| w.req == req) {
                                w.room_made = true;
                            }
                        }
                        Room::Later => {}
                        Room::Never(refusal) => {
                            self.waits.retain(|x| x.req != req);
                            self.counters.refusals += 1;
                            effects.push(Effect::Refuse(req, refusal));
                        }
                    }
                }
                Err(id) => {
                    let Some(s) = self.swaps.get(&id) else {
                        continue;
                    };
                    if s.state != SwapState::Out {
                        continue;
                    }
                    let (group, need) = (s.group, self.swap_bytes(s));
                    // A group that can never fit again waits until others leave.
                    if let Room::Made = self.make_room(now, group, &need, effects) {
                        self.swaps.get_mut(&id).expect("present").room_made = true;
                    }
                }
            }
        }
    }

    /// Swap out victims so that `need` (bytes per GPU) fits for `asker`'s group, counting what
    /// is free and what swaps under way will free.
    fn make_room(
        &mut self,
        now: Nanos,
        asker: GroupId,
        need: &BTreeMap<Gpu, Bytes>,
        effects: &mut Vec<Effect>,
    ) -> Room {
        let mut chosen: Vec<(GroupId, Gpu)> = Vec::new();
        let mut later = false;
        for (&gpu, &bytes) in need {
            if !self.could_fit(asker, gpu, bytes) {
                let (own, unswappable) = self.fixed_on(gpu, asker);
                return Room::Never(Refusal::NeverFits {
                    bytes,
                    capacity: self.capacity.get(gpu).copied().unwrap_or(0),
                    own,
                    unswappable,
                });
            }
            let already: Bytes = chosen
                .iter()
                .map(|&(g, from)| self.victim_bytes(g, from, gpu))
                .sum();
            let short = bytes
                .saturating_sub(self.free_on(gpu))
                .saturating_sub(self.freeing_on(gpu))
                .saturating_sub(already);
            if short == 0 {
                continue;
            }
            let candidates = self.candidates(now, asker, gpu, &chosen);
            let mut picked: Vec<(GroupId, Bytes)> = Vec::new();
            let mut got = 0;
            for (g, b) in candidates {
                if got >= short {
                    break;
                }
                picked.push((g, b));
                got += b;
            }
            if got < short {
                // Groups that cannot be victims now (mid-swap, in their memory turn, cooling
                // down) will be later.
                later = true;
                continue;
            }
            // Drop victims the later, larger ones made unnecessary (least preferred first).
            let mut i = picked.len().saturating_sub(1);
            while i > 0 {
                i -= 1;
                if got - picked[i].1 >= short {
                    got -= picked[i].1;
                    picked.remove(i);
                }
            }
            chosen.extend(picked.into_iter().map(|(g, _)| (g, gpu)));
        }
        if !chosen.is_empty() {
            for (group, gpu) in chosen {
                self.swap_out(now, group, gpu, effects);
            }
            // The room made is the asker's to use for a memory turn.
            let turn = self.memory_turn(need.values().sum());
            let g = self.groups.entry(asker).or_default();
            g.protected_until = g.protected_until.max(now + turn);
        }
        if later { Room::Later } else { Room::Made }
    }

    /// Rule 4: whether `bytes` more for `group` on `gpu` could fit with every group that may
    /// be swapped out gone (a demand that never fits is owed nothing: it would block the rest).
    fn could_fit(&self, group: GroupId, gpu: Gpu, bytes: Bytes) -> bool {
        let capacity = self.capacity.get(gpu).copied().unwrap_or(0);
        let (own, unswappable) = self.fixed_on(gpu, group);
        let fixed = own + unswappable.iter().map(|u| u.2).sum::<Bytes>();
        bytes <= capacity.saturating_sub(fixed)
    }

    /// What `asker`'s group holds on `gpu`, and what groups that can never be victims hold
    /// there (with why).
    fn fixed_on(&self, gpu: Gpu, asker: GroupId) -> (Bytes, Vec<(GroupId, Unswappable, Bytes)>) {
        let mut own = 0;
        let mut fixed: BTreeMap<GroupId, (Unswappable, Bytes)> = BTreeMap::new();
        for p in self.processes.values().filter(|p| p.occupies()) {
            let b = p.on(gpu);
            if b == 0 {
                continue;
            }
            if p.group == asker {
                own += b;
            } else if let Some(why) = self.unswappable(p.group) {
                let e = fixed.entry(p.group).or_insert((why, 0));
                e.1 += b;
            }
        }
        (
            own,
            fixed.into_iter().map(|(g, (w, b))| (g, w, b)).collect(),
        )
    }

    fn unswappable(&self, group: GroupId) -> Option<Unswappable> {
        self.groups
            .get(&group)
            .and_then(|g| g.unswappable)
            .or_else(|| {
                (self.processes.values())
                    .filter(|p| p.group == group)
                    .find_map(|p| p.unswappable)
            })
    }

    /// Bytes on `gpu` that swapping out `group`'s processes holding memory on `from` frees.
    fn victim_bytes(&self, group: GroupId, from: Gpu, gpu: Gpu) -> Bytes {
        (self.processes.values())
            .filter(|p| p.group == group && p.residence == Residence::Resident && p.on(from) > 0)
            .map(|p| p.on(gpu))
            .sum()
    }

    /// Groups that may be swapped out to make room on `gpu` for `asker`, most preferred first,
    /// with the bytes each frees there.
    fn candidates(
        &self,
        now: Nanos,
        asker: GroupId,
        gpu: Gpu,
        chosen: &[(GroupId, Gpu)],
    ) -> Vec<(GroupId, Bytes)> {
        let mut c: Vec<(GroupId, Bytes)> = Vec::new();
        for (&id, g) in &self.groups {
            if id == asker
                || chosen.iter().any(|&(x, _)| x == id)
                || self.unswappable(id).is_some()
                || now < g.protected_until
                || now < g.cooldown_until
            {
                continue;
            }
            let on_gpu: Vec<&Process> = (self.processes.values())
                .filter(|p| p.group == id && p.on(gpu) > 0 && p.occupies())
                .collect();
            if on_gpu.is_empty()
                || on_gpu.iter().any(|p| p.residence != Residence::Resident)
                || (self.processes.values()).any(|p| p.group == id && p.awaiting_driver)
            {
                continue;
            }
            c.push((id, on_gpu.iter().map(|p| p.on(gpu)).sum()));
        }
        c.sort_by(|a, b| {
            let (ga, gb) = (&self.groups[&a.0], &self.groups[&b.0]);
            (ga.turns.contains(&gpu).cmp(&gb.turns.contains(&gpu)))
                .then(ga.rank.priority.cmp(&gb.rank.priority))
                .then(ga.rank.weight.total_cmp(&gb.rank.weight))
                .then(b.1.cmp(&a.1))
                .then(ga.last_ran.cmp(&gb.last_ran))
                .then(a.0.cmp(&b.0))
        });
        c
    }

    fn swap_out(&mut self, now: Nanos, group: GroupId, gpu: Gpu, effects: &mut Vec<Effect>) {
        let id = SwapId(self.next_swap);
        self.next_swap += 1;
        let processes: Vec<ProcessId> = (self.processes.iter())
            .filter(|(_, p)| {
                p.group == group && p.residence == Residence::Resident && p.on(gpu) > 0
            })
            .map(|(&id, _)| id)
            .collect();
        for p in &processes {
            self.processes.get_mut(p).expect("present").residence = Residence::SwappingOut(id);
        }
        let swap = Swap {
            group,
            gpu,
            processes: processes.clone(),
            state: SwapState::SwappingOut,
            wanted_since: None,
            out_since: now,
            started: now,
            room_made: false,
        };
        self.counters.swap_out_bytes += self.swap_bytes(&swap).values().sum::<Bytes>();
        self.swaps.insert(id, swap);
        self.counters.swap_outs += 1;
        effects.push(Effect::SwapOut {
            swap: id,
            group,
            gpu,
            processes,
        });
    }
}

enum Room {
    /// Swaps that make room were started (or none was needed).
    Made,
    /// Not now: the groups that could make room cannot be swapped yet.
    Later,
    /// Never, with why.
    Never(Refusal),
}
