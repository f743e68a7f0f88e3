//! GPU memory beyond the card: the node's side of the overcommit core
//! ([`gpushare_policy::overcommit`]). The caps of the groups on a GPU may sum past its memory
//! (`memory_overcommit` > 1); a reservation within its group's cap then also goes to the core,
//! which keeps the physical books of each GPU (its memory, told by the hooks) and answers at
//! once, after a wait, after swapping another group to host memory, or with a refusal that
//! says why. This module numbers the core's GPUs, groups and requests, holds each waiting
//! reservation's answer, and turns the core's effects into the node's: replies, and the
//! checkpoints and restores the shell carries out ([`Effect::SwapOut`], [`Effect::SwapIn`]).
//!
//! A process is the core's [`ProcessId`] by its client id (one connection per process); a
//! holding the memory journal restored, of a process not reconnected yet, by an id counted
//! down from the top ([`Node::follow_ghosts`]).

use super::{Effect, Node};
use crate::histogram::Histogram;
use gpushare_policy::ClientId;
use gpushare_policy::overcommit::{
    self as core, GroupId, Overcommit, ProcessId, RequestId, Residence, SwapId, SwapOutFailure,
};
use gpushare_protocol::status::{MemoryState, MemorySwaps, PhysicalMemory, uuid_string};
use gpushare_protocol::{GpuUuid, ServerMsg};
use std::collections::{BTreeMap, BTreeSet};

/// What the overcommit core needs from the configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// How far the caps on a GPU may sum past its memory; 1: not at all, and the core stays
    /// out of the way.
    pub ratio: f64,
    pub params: core::Params,
    /// How long a checkpoint's lock waits for the victim's submitted work.
    pub lock_timeout_ms: u32,
}

/// Upper bounds of the buckets of swap and wait times, ns: 10 ms to 600 s (the longest an
/// allocation may wait), in 1-2.5-5 steps.
const DURATION_BOUNDS_NS: [u64; 15] = [
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
    25_000_000_000,
    50_000_000_000,
    100_000_000_000,
    250_000_000_000,
    600_000_000_000,
];

/// A reservation the core has not answered yet.
struct Ask {
    client: ClientId,
    req: u64,
    gpu: GpuUuid,
    bytes: u64,
    cap: Option<u64>,
    /// When it was asked, and whether it waited (was not answered at once).
    since: u64,
    waited: bool,
}

/// How long swaps and waits took, for the report.
struct Timings {
    /// When each swap under way was decided (its checkpoint or its restore).
    started: BTreeMap<SwapId, u64>,
    swap_out: Histogram,
    swap_in: Histogram,
    wait: Histogram,
}

pub(super) struct State {
    settings: Settings,
    core: Overcommit,
    /// The core's GPU numbers: index into this.
    gpus: Vec<GpuUuid>,
    /// The memory each GPU has, as its hooks said (absent: not known yet, not checked).
    capacity: BTreeMap<GpuUuid, u64>,
    /// A GPU's memory or the ratio changed since the caps were last settled on the GPUs.
    pub caps_unsettled: bool,
    groups: BTreeMap<String, GroupId>,
    asks: BTreeMap<RequestId, Ask>,
    next_req: u64,
    /// When the core next needs a tick.
    wake_at: Option<u64>,
    /// Why each group's last allocation was refused, for the report.
    pub refusals: BTreeMap<String, String>,
    timings: Timings,
    /// The groups whose memory is not resident (swapped out, or on its way): the time
    /// policies give them no turns meanwhile ([`gpushare_policy::Policy::suspend`]).
    pub suspended: BTreeSet<String>,
    /// Clients whose memory the driver was asked about ([`Effect::Settle`]).
    settled: BTreeSet<ClientId>,
    /// The memory journal's holdings of processes not reconnected yet (the books' ghosts), as
    /// the core's processes: numbered down from the top, no victims.
    ghosts: BTreeMap<(crate::memory::ProcessId, GpuUuid), ProcessId>,
}

impl State {
    pub fn new(settings: Settings) -> State {
        State {
            settings,
            core: Overcommit::new(settings.params, Vec::new()),
            gpus: Vec::new(),
            capacity: BTreeMap::new(),
            caps_unsettled: false,
            groups: BTreeMap::new(),
            asks: BTreeMap::new(),
            next_req: 1,
            wake_at: None,
            refusals: BTreeMap::new(),
            timings: Timings {
                started: BTreeMap::new(),
                swap_out: Histogram::new(&DURATION_BOUNDS_NS),
                swap_in: Histogram::new(&DURATION_BOUNDS_NS),
                wait: Histogram::new(&DURATION_BOUNDS_NS),
            },
            suspended: BTreeSet::new(),
            settled: BTreeSet::new(),
            ghosts: BTreeMap::new(),
        }
    }

    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// Whether reservations on `gpu` go through the core.
    fn checks(&self, gpu: &GpuUuid) -> bool {
        self.settings.ratio > 1.0 && self.capacity.contains_key(gpu)
    }

    fn gpu_index(&mut self, gpu: GpuUuid) -> usize {
        match self.gpus.iter().position(|g| *g == gpu) {
            Some(i) => i,
            None => {
                self.gpus.push(gpu);
                self.gpus.len() - 1
            }
        }
    }

    fn group_id(&mut self, name: &str) -> GroupId {
        let next = GroupId(self.groups.len() as u64);
        *self.groups.entry(name.to_string()).or_insert(next)
    }

    /// `ask` is answered at `now`: how long it waited, if it did.
    fn waited(&mut self, ask: &Ask, now: u64) {
        if ask.waited {
            self.timings.wait.record(now.saturating_sub(ask.since));
        }
    }

    fn group_name(&self, id: GroupId) -> &str {
        (self.groups.iter())
            .find(|(_, g)| **g == id)
            .map_or("?", |(n, _)| n.as_str())
    }
}

/// Why `group`'s cap of `asked` bytes is `given` on a GPU of `capacity` bytes whose caps may
/// sum to `ratio` × that, and what to do about it.
fn clamp_reason(group: &str, asked: u64, given: u64, capacity: u64, ratio: f64) -> String {
    let mib = |b: u64| b >> 20;
    let promised = (capacity as f64 * ratio) as u64;
    format!(
        "group {group:?}'s memory cap of {} MiB is clamped to {} MiB on this GPU: the caps of \
         the groups that came before it already promise {} of the {} MiB that \
         memory_overcommit = {ratio} allows on its {} MiB; lower their caps, raise \
         memory_overcommit, or run the group on another GPU",
        mib(asked),
        mib(given),
        mib(promised.saturating_sub(given)),
        mib(promised),
        mib(capacity),
    )
}

impl State {
    /// `gpu`'s physical memory, if the core checks it.
    pub fn physical(&self, gpu: &GpuUuid) -> Option<PhysicalMemory> {
        let i = self.gpus.iter().position(|g| g == gpu)?;
        if !self.checks(gpu) {
            return None;
        }
        let b = self.core.books(i);
        Some(PhysicalMemory {
            total: b.capacity,
            used: b.used,
            free: b.capacity.saturating_sub(b.used),
            swapped: b.swapped,
            overcommit: self.settings.ratio,
            waiting: (self.core.waiting().iter()).filter(|w| w.2 == i).count() as u64,
        })
    }

    /// The core's swaps, waits and refusals since the daemon started, and how long they took.
    pub fn swaps_report(&self) -> MemorySwaps {
        let c = self.core.counters();
        MemorySwaps {
            swap_outs: c.swap_outs,
            swap_ins: c.swap_ins,
            swap_out_bytes: c.swap_out_bytes,
            swap_in_bytes: c.swap_in_bytes,
            swap_out_failures: c.swap_out_failures,
            swap_in_failures: c.lost,
            allocation_waits: c.waits,
            allocations_refused: c.refusals,
            swap_out_seconds: self.timings.swap_out.report(),
            swap_in_seconds: self.timings.swap_in.report(),
            allocation_wait_seconds: self.timings.wait.report(),
        }
    }

    /// Where `group`'s memory is: a swap of it moves all its processes together.
    pub fn memory_state(&self, group: &str) -> MemoryState {
        let Some(id) = self.groups.get(group) else {
            return MemoryState::Resident;
        };
        (self.core.swaps().into_iter())
            .filter(|s| s.1 == *id)
            .flat_map(|s| s.3.into_iter().map(move |p| (p, s.2)))
            .find_map(|(p, gpu)| match self.core.process(p, gpu)?.0 {
                Residence::SwappingOut(_) => Some(MemoryState::SwappingOut),
                Residence::Out(_) => Some(MemoryState::SwappedOut),
                Residence::SwappingIn(_) => Some(MemoryState::SwappingIn),
                Residence::Resident | Residence::Lost => None,
            })
            .unwrap_or(MemoryState::Resident)
    }

    /// Bytes of `group` on `gpu` that are not resident: swapped out, or on their way.
    pub fn swapped(&self, group: &str, gpu: &GpuUuid) -> u64 {
        let (Some(id), Some(i)) = (
            self.groups.get(group),
            self.gpus.iter().position(|g| g == gpu),
        ) else {
            return 0;
        };
        (self.core.swaps().into_iter())
            .filter(|s| s.1 == *id)
            .flat_map(|s| s.3)
            .filter_map(|p| self.core.process(p, i))
            .filter(|(r, _)| *r != Residence::Resident)
            .map(|(_, b)| b)
            .sum()
    }
}

impl Node {
    /// The configuration's overcommit settings (ratio, waits, windows) apply from now.
    pub(super) fn set_overcommit(&mut self, settings: Settings, now: u64) {
        let s = &mut self.overcommit;
        s.caps_unsettled |= s.settings.ratio != settings.ratio;
        s.settings = settings;
        let effects = s.core.set_params(now, settings.params);
        self.carry_out(effects, now);
    }

    /// The caps of the groups on each GPU whose memory is known promise at most
    /// `memory_overcommit` × that memory: a group whose cap does not fit beside those of the
    /// groups that came before it gets what is left there (maybe nothing), and the log says
    /// so. Settled after any input that changed a cap, a GPU's memory, the ratio or the pods.
    pub(super) fn settle_caps(&mut self) {
        let s = &mut self.overcommit;
        if !std::mem::take(&mut s.caps_unsettled) && !self.memory.caps_changed() {
            return;
        }
        let (ratio, pods) = (s.settings.ratio, &self.pods);
        let changed = (self.memory).promise_caps(&s.capacity, ratio, |g, gpu| pods.on_gpu(g, gpu));
        for (group, uuid, asked, given) in changed {
            let gpu = uuid_string(&uuid);
            if given < asked {
                let capacity = s.capacity.get(&uuid).copied().unwrap_or(0);
                tracing::warn!(
                    group = %group,
                    gpu = %gpu,
                    "{}",
                    clamp_reason(&group, asked, given, capacity, ratio)
                );
            } else {
                tracing::info!(group = %group, gpu = %gpu, cap_mib = asked >> 20, "memory cap no longer clamped: the caps before it make room");
            }
        }
    }

    /// The caps on `gpu` were clamped for `group` and it asked past its own: why, for the
    /// process (`None`: its cap is whole there).
    pub(super) fn clamped_refusal(&self, group: &str, gpu: &GpuUuid, bytes: u64) -> Option<String> {
        let (asked, given) = self.memory.clamped(group, gpu)?;
        let capacity = *self.overcommit.capacity.get(gpu)?;
        Some(format!(
            "out of GPU memory on {}: {} MiB past the group's cap refused: {}",
            uuid_string(gpu),
            bytes.div_ceil(1 << 20),
            clamp_reason(
                group,
                asked,
                given,
                capacity,
                self.overcommit.settings.ratio
            )
        ))
    }

    /// A hook says how much memory `gpu` has.
    pub(super) fn gpu_memory(&mut self, gpu: GpuUuid, bytes: u64, now: u64) {
        let s = &mut self.overcommit;
        if s.capacity.get(&gpu) == Some(&bytes) {
            return;
        }
        s.capacity.insert(gpu, bytes);
        s.caps_unsettled = true;
        let i = s.gpu_index(gpu);
        let effects = s.core.set_capacity(now, i, bytes);
        tracing::info!(gpu = %uuid_string(&gpu), mib = bytes >> 20, "GPU memory");
        self.carry_out(effects, now);
    }

    /// Client `client` of `group` reserved `bytes` on `gpu` within its cap (`answer` granted
    /// it): sent once the memory is there too. Returns the answer back when the core does not
    /// check `gpu` (nothing to wait for).
    pub(super) fn reserve_physical(
        &mut self,
        client: ClientId,
        group: &str,
        gpu: GpuUuid,
        bytes: u64,
        answer: ServerMsg,
        now: u64,
    ) -> Option<ServerMsg> {
        let s = &mut self.overcommit;
        if !s.checks(&gpu) {
            return Some(answer);
        }
        let ServerMsg::Memory { req, cap, .. } = answer else {
            return Some(answer);
        };
        let weight = self.groups.get(group).map_or(1.0, |p| p.weight);
        let (g, i) = (s.group_id(group), s.gpu_index(gpu));
        let rank = core::GroupRank {
            priority: 0,
            weight,
        };
        s.core.set_group(g, rank);
        s.core.attach(ProcessId(client), g);
        let id = RequestId(s.next_req);
        s.next_req += 1;
        s.asks.insert(
            id,
            Ask {
                client,
                req,
                gpu,
                bytes,
                cap,
                since: now,
                waited: false,
            },
        );
        let effects = s.core.request(now, id, ProcessId(client), i, bytes);
        self.carry_out(effects, now);
        if let Some(a) = self.overcommit.asks.get_mut(&id) {
            // It waits: the process is told so at once, and for how long at most.
            a.waited = true;
            let max_wait_ns = self.overcommit.settings.params.max_wait_ns;
            self.send(client, ServerMsg::MemWait { req, max_wait_ns });
        }
        None
    }

    /// Client `client` of `group` states what it holds on `gpu` (after reconnecting).
    pub(super) fn restate_physical(
        &mut self,
        client: ClientId,
        group: &str,
        gpu: GpuUuid,
        bytes: u64,
        now: u64,
    ) {
        if self.overcommit.settings.ratio <= 1.0 {
            return;
        }
        let s = &mut self.overcommit;
        let (g, i) = (s.group_id(group), s.gpu_index(gpu));
        s.core.attach(ProcessId(client), g);
        // The memory it holds may be in host memory, or locked, by a swap a previous daemon
        // began: the driver says (rule 7 of the core).
        let process = self.clients.get(client).map(|c| c.peer.process());
        if let Some(process) = process
            && bytes > 0
            && process.pid != 0
            && s.settled.insert(client)
        {
            s.core.await_driver(ProcessId(client));
            self.effects.push(Effect::Settle {
                id: client,
                process,
            });
        }
        let effects = self
            .overcommit
            .core
            .restate(now, ProcessId(client), i, bytes);
        self.carry_out(effects, now);
    }

    /// The core's ghosts follow the books' (the memory journal's holdings of processes that
    /// have not reconnected to a restarted daemon): what they hold on a GPU is taken there
    /// until their process restates it (forgotten) or is found gone (freed). Without them, an
    /// allocation asked before a swapped process has reconnected would be granted memory that
    /// process still holds, or that a checkpoint under way has not freed yet.
    ///
    /// Where a ghost's memory is, the driver says, as for a process that reconnects (rule 7
    /// of the core): the checkpoint API needs nothing of the process, so one that never
    /// reconnects is found in host memory and restored, or found locked and unlocked, all the
    /// same. Only a process the daemon can tell apart from a later one of its pid is asked
    /// about (pid and start time known); the others are no victim until their process is
    /// found gone or their grace runs out ([`super::books::UNVERIFIABLE_GHOST_GRACE_NS`]).
    pub(super) fn follow_ghosts(&mut self, now: u64) {
        if self.overcommit.settings.ratio <= 1.0 {
            return;
        }
        let books: Vec<_> = (self.memory.ghosts())
            .map(|(p, gpu, group, bytes)| (p, gpu, group.to_string(), bytes))
            .collect();
        let mut effects = Vec::new();
        let s = &mut self.overcommit;
        for (p, gpu, group, bytes) in &books {
            if s.ghosts.contains_key(&(*p, *gpu)) {
                continue;
            }
            let id = ProcessId(
                (s.ghosts.values())
                    .map(|p| p.0)
                    .min()
                    .map_or(u64::MAX, |m| m - 1),
            );
            let (g, i) = (s.group_id(group), s.gpu_index(*gpu));
            s.core.attach(id, g);
            s.core.await_driver(id);
            if p.pid != 0 && p.start != 0 {
                self.effects.push(Effect::Settle {
                    id: id.0,
                    process: *p,
                });
            }
            effects.extend(s.core.restate(now, id, i, *bytes));
            s.ghosts.insert((*p, *gpu), id);
        }
        let gone: Vec<_> = (s.ghosts.iter())
            .filter(|(k, _)| !books.iter().any(|b| (b.0, b.1) == **k))
            .map(|(k, id)| (*k, *id))
            .collect();
        for ((p, gpu), id) in gone {
            self.overcommit.ghosts.remove(&(p, gpu));
            if self.memory.connected(&p) {
                effects.extend(self.overcommit.core.forget(now, id));
            } else {
                effects.extend(self.overcommit.core.exit(now, id));
            }
        }
        self.carry_out(effects, now);
    }

    /// The driver said where the memory of the process the node numbers `id` is (a client,
    /// or a ghost: [`Effect::Settle`]).
    pub(super) fn settled(&mut self, id: u64, checkpointed: bool, now: u64) {
        if checkpointed {
            let pids = self.pids(&[ProcessId(id)]);
            tracing::info!(
                id,
                ?pids,
                "found in host memory after a restart: restored once its memory fits"
            );
        }
        let effects = (self.overcommit.core).recover(now, ProcessId(id), checkpointed);
        self.carry_out(effects, now);
    }

    /// Client `client` of `group` holds memory the group cannot be swapped out with (managed
    /// memory, or memory shared with another process): its group is never a victim.
    pub(super) fn unswappable_memory(
        &mut self,
        client: ClientId,
        group: &str,
        why: core::Unswappable,
        now: u64,
    ) {
        if self.overcommit.settings.ratio <= 1.0 {
            return;
        }
        let s = &mut self.overcommit;
        let g = s.group_id(group);
        s.core.attach(ProcessId(client), g);
        let effects = (s.core).mark_unswappable(now, ProcessId(client), why);
        self.carry_out(effects, now);
    }

    /// Client `client` freed `bytes` on `gpu`.
    pub(super) fn free_physical(&mut self, client: ClientId, gpu: GpuUuid, bytes: u64, now: u64) {
        let s = &mut self.overcommit;
        let Some(i) = s.gpus.iter().position(|g| *g == gpu) else {
            return;
        };
        let effects = s.core.free(now, ProcessId(client), i, bytes);
        self.carry_out(effects, now);
    }

    /// Client `client` is gone: its memory, on the GPU or in host memory, and its waits.
    pub(super) fn exit_physical(&mut self, client: ClientId, now: u64) {
        let s = &mut self.overcommit;
        s.asks.retain(|_, a| a.client != client);
        s.settled.remove(&client);
        let effects = s.core.exit(now, ProcessId(client));
        self.carry_out(effects, now);
    }

    /// Whether group `group` has work waiting (a swapped-out group then wants to come back),
    /// and that it ran.
    pub(super) fn group_pending(&mut self, group: &str, pending: bool, now: u64) {
        let s = &mut self.overcommit;
        let Some(&g) = s.groups.get(group) else {
            return;
        };
        s.core.ran(g, now);
        let effects = s.core.set_pending(now, g, pending);
        self.carry_out(effects, now);
    }

    /// The checkpoint of `swap` ended.
    pub(super) fn swapped_out(&mut self, swap: u64, outcome: Result<(), SwapOutFailure>, now: u64) {
        let t = &mut self.overcommit.timings;
        let started = t.started.remove(&SwapId(swap));
        match outcome {
            Ok(()) => {
                if let Some(at) = started {
                    t.swap_out.record(now.saturating_sub(at));
                }
            }
            Err(e) => tracing::warn!(
                swap,
                "swap-out failed ({e:?}): choosing another victim or waiting"
            ),
        }
        let effects = self.overcommit.core.swapped_out(now, SwapId(swap), outcome);
        self.carry_out(effects, now);
    }

    /// The restore of `swap` ended.
    pub(super) fn swapped_in(&mut self, swap: u64, ok: bool, now: u64) {
        let t = &mut self.overcommit.timings;
        if let Some(at) = t.started.remove(&SwapId(swap))
            && ok
        {
            t.swap_in.record(now.saturating_sub(at));
        }
        let effects = self.overcommit.core.swapped_in(now, SwapId(swap), ok);
        self.carry_out(effects, now);
    }

    /// Time passed: waits may have run out.
    pub(super) fn tick_overcommit(&mut self, now: u64) {
        if self.overcommit.wake_at.is_some_and(|at| at <= now) {
            let effects = self.overcommit.core.tick(now);
            self.carry_out(effects, now);
        }
    }

    /// When the core next needs a tick.
    pub(super) fn overcommit_wakeup(&self) -> Option<u64> {
        self.overcommit.wake_at
    }

    /// The pids of the core's processes: clients', and ghosts' (a process holding memory on
    /// two GPUs is two ghosts, and one pid).
    fn pids(&self, processes: &[ProcessId]) -> Vec<u32> {
        let ghosts = &self.overcommit.ghosts;
        let mut pids: Vec<u32> = Vec::new();
        for p in processes {
            let pid = (self.clients.get(p.0).map(|c| c.pid)).or_else(|| {
                ghosts
                    .iter()
                    .find(|(_, g)| *g == p)
                    .map(|((q, _), _)| q.pid)
            });
            if let Some(pid) = pid
                && !pids.contains(&pid)
            {
                pids.push(pid);
            }
        }
        pids
    }

    /// What the core decided, as replies and work for the shell.
    fn carry_out(&mut self, effects: Vec<core::Effect>, now: u64) {
        for e in effects {
            match e {
                core::Effect::Grant(r) => {
                    if let Some(a) = self.overcommit.asks.remove(&r) {
                        self.overcommit.waited(&a, now);
                        let used = self.memory_used(a.client, &a.gpu);
                        let answer = ServerMsg::Memory {
                            req: a.req,
                            granted: true,
                            cap: a.cap,
                            used,
                            journaled: true,
                        };
                        self.books.after_persist(a.client, answer);
                    }
                }
                core::Effect::Refuse(r, why) => {
                    let Some(a) = self.overcommit.asks.remove(&r) else {
                        continue;
                    };
                    self.overcommit.waited(&a, now);
                    self.memory.free(a.client, a.gpu, a.bytes);
                    let group = self.clients.get(a.client).and_then(|c| c.group.as_deref());
                    let s = &self.overcommit;
                    let name = |g: core::GroupId| format!("{:?}", s.group_name(g));
                    let message = format!(
                        "out of GPU memory on {}: {} MiB within the group's cap refused: {}",
                        uuid_string(&a.gpu),
                        a.bytes.div_ceil(1 << 20),
                        why.describe(&name)
                    );
                    tracing::warn!(client = a.client, group = ?group, "{message}");
                    if let Some(g) = group {
                        self.overcommit
                            .refusals
                            .insert(g.to_string(), message.clone());
                    }
                    self.send(
                        a.client,
                        ServerMsg::Error {
                            message,
                            fatal: false,
                        },
                    );
                    let used = self.memory_used(a.client, &a.gpu);
                    self.send(
                        a.client,
                        ServerMsg::Memory {
                            req: a.req,
                            granted: false,
                            cap: a.cap,
                            used,
                            journaled: true,
                        },
                    );
                }
                core::Effect::SwapOut {
                    swap,
                    group,
                    gpu,
                    processes,
                } => {
                    let pids = self.pids(&processes);
                    let name = self.overcommit.group_name(group).to_string();
                    let gpu = self.overcommit.gpus.get(gpu).copied().unwrap_or_default();
                    tracing::info!(swap = swap.0, group = %name, gpu = %uuid_string(&gpu), ?pids, "swapping out to host memory");
                    let lock_timeout_ms = self.overcommit.settings.lock_timeout_ms;
                    self.overcommit.timings.started.insert(swap, now);
                    self.effects.push(Effect::SwapOut {
                        swap: swap.0,
                        pids,
                        lock_timeout_ms,
                    });
                }
                core::Effect::SwapIn {
                    swap,
                    group,
                    processes,
                } => {
                    let pids = self.pids(&processes);
                    let name = self.overcommit.group_name(group);
                    tracing::info!(swap = swap.0, group = %name, ?pids, "restoring from host memory");
                    self.overcommit.timings.started.insert(swap, now);
                    self.effects.push(Effect::SwapIn { swap: swap.0, pids });
                }
                core::Effect::Lost { processes, .. } => {
                    for p in processes {
                        let message = "this process's GPU memory could not be restored after \
                                       a swap to host memory: restart it"
                            .to_string();
                        self.fatal(p.0, message, now);
                    }
                }
            }
        }
        self.suspend_swapped(now);
        let s = &mut self.overcommit;
        // Swaps the core dropped (every process of theirs exited) will not be timed.
        let current: Vec<SwapId> = s.core.swaps().into_iter().map(|x| x.0).collect();
        s.timings.started.retain(|id, _| current.contains(id));
        s.wake_at = s.core.next_wakeup(now);
    }

    /// The time policies follow the swaps: a group whose memory leaves the GPU (from the
    /// moment its swap-out begins: its processes are being locked) gets no turns on any GPU
    /// until it is all back, or its swap-out failed (it runs on).
    fn suspend_swapped(&mut self, now: u64) {
        let s = &self.overcommit;
        if s.suspended.is_empty() && s.core.swaps().is_empty() {
            return;
        }
        let out: BTreeSet<String> = (s.groups.keys())
            .filter(|g| s.memory_state(g) != MemoryState::Resident)
            .cloned()
            .collect();
        for g in out.difference(&s.suspended) {
            tracing::info!(group = %g, "no GPU turns while its memory is out");
            for p in self.policies.values_mut() {
                p.suspend(g, now);
            }
        }
        for g in s.suspended.difference(&out) {
            tracing::info!(group = %g, "GPU turns again: its memory is back");
            for p in self.policies.values_mut() {
                p.resume(g, now);
            }
        }
        self.overcommit.suspended = out;
    }

    /// What `client`'s group uses on `gpu` (for a reservation's answer).
    fn memory_used(&self, client: ClientId, gpu: &GpuUuid) -> u64 {
        (self.clients.get(client))
            .and_then(|c| c.group.as_deref())
            .map_or(0, |g| self.memory.used(g, gpu))
    }
}
