//! What this process reserves at the scheduler: every allocation draws its bytes from the
//! GPU's [`Lease`] (a round trip only when the lease must grow), every
//! free puts them back, and a thread of its own (`gpushare-mem`, started on first need) gives
//! back, once per [`LEASE_WINDOW`], the spare no allocation needed in the window.
//!
//! Stream-ordered allocations are charged by their pool: what the pool reserves on the device
//! (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`), since the driver keeps freed bytes in the pool
//! until a synchronisation releases them down to the pool's release threshold, or a trim. An
//! allocation from a pool reserves what the pool must grow by (nothing when its free bytes
//! hold it) before the driver allocates; the pool's reservation is read again after, after
//! each free, at every `cuMemGetInfo_v2`, and by the thread while the pool holds a granule or
//! more that no allocation uses (every window at first, then less and less often, down to once
//! a second): the bytes a pool releases are given back within a window or two of the
//! synchronisation or trim that released them (or of its next activity). The thread sleeps
//! without a timeout while there is nothing to watch.
//!
//! Every message that changes the scheduler's books of this process (a reservation, a give
//! back, a statement of the holding) is sent under its lease's lock, so the scheduler reads
//! them in the order the lease changed.
//!
//! Without an answer — no scheduler, or one that owes an answer past the liveness bound
//! (`crate::turn`) — fail-open decides alone, against the cap and the others' use the
//! scheduler last told it ([`Lease::grant_alone`]), and states its whole holding when the
//! scheduler answers again (or on the next connection), so that the scheduler's books are
//! exact again: what was allocated meanwhile is charged, nothing twice. Fail-closed waits for a
//! connection, and for an answer at most [`ANSWER_TIMEOUT`] (then the allocation fails). A
//! grant the scheduler could not journal (its disk full) is kept under `open` and given back
//! under `closed` (the allocation fails), with a line on stderr either way. A refused process
//! allocates nothing.

use crate::books::PoolCharge;
use crate::driver::{self, Handle};
use crate::lease::{Ask, Lease, Refused, Take};
use crate::log::debug;
use crate::port::NoAnswer;
use crate::process::Hook;
use crate::settings::FailPolicy;
use gpushare_protocol::{ClientMsg, ServerMsg};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{MutexGuard, Once};
use std::time::{Duration, Instant};

/// Spare that no allocation needed for this long goes back to the scheduler: another process
/// of the group waits at most about twice this for bytes an idle process leased.
pub const LEASE_WINDOW: Duration = Duration::from_millis(20);
/// The longest a watched pool goes unread.
const POOL_POLL_MAX: Duration = Duration::from_secs(1);
/// Pools reserve device memory in granules of 2 MiB (on current GPUs, and in the simulator):
/// a pool's growth is reserved in whole granules, and less than a granule unused is not
/// watched (the pool cannot release it).
const POOL_GRANULE: u64 = 2 << 20;
/// How long fail-closed waits for the answer to a reservation before the allocation fails.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// What became of a reservation.
enum Answer {
    Granted {
        journaled: bool,
    },
    Refused,
    /// No answer (fail-open): decide alone.
    Alone,
    /// No answer (fail-closed), or a refused process: the allocation fails.
    Failed,
}

/// Reserve `bytes` for an allocation on gate `gpu`; false: over the cap (or refused).
pub fn draw(h: &'static Hook, gpu: usize, bytes: u64) -> bool {
    let take = h.memory.lease(gpu).take(bytes);
    let Take::Ask(mut a) = take else {
        return true;
    };
    loop {
        let answer = ask(h, gpu, &a);
        let mut lease = h.memory.lease(gpu);
        let granted = match answer {
            Answer::Granted { journaled } => {
                let back = lease.granted(&a);
                give_back(h, gpu, &mut lease, back);
                if journaled || h.settings.fail == FailPolicy::Open {
                    true
                } else {
                    let back = lease.free(a.bytes);
                    give_back(h, gpu, &mut lease, back);
                    false
                }
            }
            Answer::Refused => match lease.refused(&a) {
                Refused::Retry(next) => {
                    a = next;
                    continue;
                }
                Refused::Failed { give_back: back } => {
                    give_back(h, gpu, &mut lease, back);
                    false
                }
            },
            Answer::Alone => match lease.grant_alone(&a) {
                Ok(()) => true,
                Err(back) => {
                    give_back(h, gpu, &mut lease, back);
                    false
                }
            },
            Answer::Failed => {
                let back = lease.fail(&a);
                give_back(h, gpu, &mut lease, back);
                false
            }
        };
        settled(h, gpu, lease);
        return granted;
    }
}

/// Allocations of `bytes` on gate `gpu` ended (freed, or failed by the driver after their
/// reservation).
pub fn release(h: &'static Hook, gpu: usize, bytes: u64) {
    let mut lease = h.memory.lease(gpu);
    let back = lease.free(bytes);
    give_back(h, gpu, &mut lease, back);
    settled(h, gpu, lease);
}

/// After a change of gate `gpu`'s lease: state the holding if a statement is owed and may be
/// made now, and have the keeper look if there is spare.
fn settled(h: &'static Hook, gpu: usize, mut lease: MutexGuard<'_, Lease>) {
    state_if_owed(h, gpu, &mut lease);
    let spare = lease.spare();
    drop(lease);
    if spare > 0 {
        keep(h);
    }
}

/// Send the statement of its holding gate `gpu`'s lease owes, if it owes one, no ask is in
/// flight, and the scheduler answers (it is sent under the lease's lock: nothing between).
fn state_if_owed(h: &Hook, gpu: usize, lease: &mut Lease) {
    if !h.port.is_connected() || h.port.owes() {
        return;
    }
    if let Some(bytes) = lease.sync_due() {
        debug!("stating what this process holds on GPU {gpu}: {bytes} bytes");
        if !h.port.send(&ClientMsg::MemSync {
            gpu: h.gates[gpu].uuid,
            bytes,
        }) {
            lease.owe_sync();
        }
    }
}

/// The scheduler answers again after leaving a question unanswered: the statements owed.
pub fn answered_again(h: &Hook) {
    for gpu in 0..h.memory.gpus() {
        state_if_owed(h, gpu, &mut h.memory.lease(gpu));
    }
}

/// The process made a managed allocation (said once, and again to each new connection).
static MANAGED: AtomicBool = AtomicBool::new(false);
/// The process exported or opened IPC memory (said once, and again to each new connection).
static IPC: AtomicBool = AtomicBool::new(false);

/// The process is about to allocate managed memory: the scheduler learns it first, so that
/// it never picks the process's group to swap to host memory (the driver would refuse).
pub fn managed(h: &Hook) {
    say_once(h, &MANAGED, ClientMsg::MemManaged);
}

/// The process is about to export or open memory shared with another process (CUDA IPC): the
/// scheduler learns it first, so that it never swaps the process's group to host memory
/// (the other process would lose the memory meanwhile).
pub fn ipc(h: &Hook) {
    say_once(h, &IPC, ClientMsg::MemIpc);
}

fn say_once(h: &Hook, said: &AtomicBool, msg: ClientMsg) {
    if !said.swap(true, Ordering::AcqRel) {
        // Not connected: the greeting says it.
        h.port.send(&msg);
    }
}

/// What a new connection is told first: each lease's whole holding, spare included (the
/// process may allocate the spare without asking again), under every lease's lock.
pub fn greet(h: &Hook, send: &mut dyn FnMut(&[ClientMsg])) {
    let mut leases: Vec<MutexGuard<'_, Lease>> =
        (0..h.memory.gpus()).map(|g| h.memory.lease(g)).collect();
    let mut greeting: Vec<ClientMsg> = Vec::with_capacity(2 * leases.len());
    for (gpu, lease) in leases.iter_mut().enumerate() {
        let uuid = h.gates[gpu].uuid;
        if h.gpu_memory[gpu] > 0 {
            greeting.push(ClientMsg::MemTotal {
                gpu: uuid,
                bytes: h.gpu_memory[gpu],
            });
        }
        greeting.push(ClientMsg::MemSync {
            gpu: uuid,
            bytes: lease.stated(),
        });
    }
    if MANAGED.load(Ordering::Acquire) {
        greeting.push(ClientMsg::MemManaged);
    }
    if IPC.load(Ordering::Acquire) {
        greeting.push(ClientMsg::MemIpc);
    }
    send(&greeting);
}

/// The scheduler told the group's cap on gate `gpu` (`None`: uncapped) and its use: the lease
/// block follows the cap.
pub fn learn_cap(h: &Hook, gpu: usize, cap: Option<u64>, used: u64) {
    let block = h.memory.block_for(cap);
    let mut lease = h.memory.lease(gpu);
    lease.learn(cap, used);
    let back = lease.set_block(block);
    give_back(h, gpu, &mut lease, back);
}

/// The group's cap on gate `gpu` and its use (this process's spare included): the
/// scheduler's answer, or, while it owes answers or cannot be reached (fail-open), what it
/// last said. `None` if it said nothing yet, or when fail-closed gets no answer (it asks even
/// while the scheduler owes one, and waits).
pub fn query(h: &'static Hook, gpu: usize) -> Option<(Option<u64>, u64)> {
    let known = || h.memory.lease(gpu).known();
    let open = h.settings.fail == FailPolicy::Open;
    if open && (!h.port.is_connected() || h.port.owes()) {
        return known();
    }
    if !h.port.is_connected() {
        return None;
    }
    let uuid = h.gates[gpu].uuid;
    let Some(pending) = h.port.request(|req| ClientMsg::MemQuery { req, gpu: uuid }) else {
        return if open { known() } else { None };
    };
    let timeout = if open {
        h.port.liveness()
    } else {
        ANSWER_TIMEOUT
    };
    // Under memory overcommit the scheduler may say the reservation waits for memory (others
    // freeing it, or being swapped to host memory): then its answer comes within its bound.
    let mut answer = pending.wait(timeout);
    if let Ok(ServerMsg::MemWait { max_wait_ns, .. }) = answer {
        answer = pending.wait(Duration::from_nanos(max_wait_ns) + ANSWER_TIMEOUT);
    }
    match answer {
        Ok(ServerMsg::Memory { cap, used, .. }) => {
            learn_cap(h, gpu, cap, used);
            Some((cap, used))
        }
        Ok(_) => None,
        Err(NoAnswer::Late) => {
            h.port.mark_owed();
            if open { known() } else { None }
        }
        Err(NoAnswer::Gone) => {
            if open {
                known()
            } else {
                None
            }
        }
    }
}

/// Bytes this process holds on gate `gpu` that it has not allocated: free for it, though the
/// scheduler counts them as the group's.
pub fn spare(h: &Hook, gpu: usize) -> u64 {
    h.memory.lease(gpu).spare()
}

/// Allocate `bytes` from memory pool `pool` (on gate `gpu`) with `alloc`: the growth the pool
/// needs is reserved first (refused: `None`, nothing allocated), then the pool's reservation
/// is charged as it is after the call. `alloc`'s result otherwise.
pub fn pool_alloc<R>(
    h: &'static Hook,
    gpu: usize,
    pool: Handle,
    bytes: u64,
    alloc: impl FnOnce() -> R,
) -> Option<R> {
    let key = pool.key();
    let mut pools = h.memory.pools();
    let charge = pools.entry(key).or_insert_with(|| PoolCharge {
        gpu,
        charged: 0,
        watched: false,
        poll_every: LEASE_WINDOW,
        next_poll: Instant::now(),
    });
    let idle = match reconcile(h, key, charge) {
        Some((reserved, used)) => reserved.saturating_sub(used),
        None => 0,
    };
    let need = bytes.saturating_sub(idle).div_ceil(POOL_GRANULE) * POOL_GRANULE;
    if need > 0 {
        if !draw(h, charge.gpu, need) {
            return None;
        }
        charge.charged += need;
    }
    let r = alloc();
    used(h, key, pools);
    Some(r)
}

/// An allocation from `pool` was freed: its bytes stay in the pool, which is watched for the
/// release.
pub fn pool_freed(h: &'static Hook, pool: u64) {
    used(h, pool, h.memory.pools());
}

/// `pool` was just used: charge it as it is now and read it again soon; if it holds spare,
/// make sure the keeper will look (after letting go of the pools).
fn used(h: &'static Hook, pool: u64, mut pools: MutexGuard<'_, HashMap<u64, PoolCharge>>) {
    let Some(charge) = pools.get_mut(&pool) else {
        return;
    };
    reconcile(h, pool, charge);
    activity(charge);
    let watched = charge.watched;
    drop(pools);
    if watched {
        keep(h);
    }
}

/// Charge every pool of gate `gpu` what it reserves now (before `cuMemGetInfo_v2` reports).
pub fn reconcile_pools(h: &'static Hook, gpu: usize) {
    let mut pools = h.memory.pools();
    for (&pool, charge) in pools.iter_mut().filter(|(_, c)| c.gpu == gpu) {
        reconcile(h, pool, charge);
    }
    forget_empty(&mut pools);
}

/// Bring `charge` to what `pool` reserves now: give back what it released, reserve what it
/// grew by beyond what was reserved for it. The pool's reservation and use, if the driver can
/// tell (a destroyed pool is charged for its live allocations until they are freed).
fn reconcile(h: &'static Hook, pool: u64, charge: &mut PoolCharge) -> Option<(u64, u64)> {
    let memory = driver::pool_memory(Handle::from_key(pool));
    let (reserved, used) = memory.unwrap_or_else(|| {
        let live = h.memory.pooled_bytes(pool);
        (live, live)
    });
    if reserved < charge.charged {
        release(h, charge.gpu, charge.charged - reserved);
        charge.charged = reserved;
    } else if reserved > charge.charged {
        // Grown by more than was reserved for it (a driver with coarser granules than
        // assumed): charged now if the cap allows, else at the next reading.
        if draw(h, charge.gpu, reserved - charge.charged) {
            charge.charged = reserved;
        } else {
            debug!(
                "pool {pool:#x} holds {reserved} bytes, {} charged",
                charge.charged
            );
        }
    }
    charge.watched = reserved.saturating_sub(used) >= POOL_GRANULE;
    memory
}

/// The pool was just used: read it again soon.
fn activity(charge: &mut PoolCharge) {
    charge.poll_every = LEASE_WINDOW;
    charge.next_poll = Instant::now() + LEASE_WINDOW;
}

/// Forget the pools that hold nothing charged and are not watched.
fn forget_empty(pools: &mut HashMap<u64, PoolCharge>) {
    pools.retain(|_, c| c.charged > 0 || c.watched);
}

/// One reservation round trip for `a` (sent under the lease's lock). Fail-open waits for the
/// answer at most the liveness bound, and not at all while the scheduler owes one or cannot be
/// reached; fail-closed waits for a connection, then at most [`ANSWER_TIMEOUT`].
fn ask(h: &Hook, gpu: usize, a: &Ask) -> Answer {
    let open = h.settings.fail == FailPolicy::Open;
    let no_answer = || if open { Answer::Alone } else { Answer::Failed };
    if h.port.is_refused() {
        return Answer::Failed;
    }
    if open && (!h.port.is_connected() || h.port.owes()) {
        return Answer::Alone;
    }
    if !h.wait_connected() {
        return no_answer();
    }
    let uuid = h.gates[gpu].uuid;
    let timeout = if open {
        h.port.liveness()
    } else {
        ANSWER_TIMEOUT
    };
    // When the scheduler said the reservation waits for memory, the bound it gave.
    let mut waits_until: Option<Instant> = None;
    let answer = loop {
        let pending = {
            let _lease = h.memory.lease(gpu);
            h.port.request(|req| ClientMsg::MemReserve {
                req,
                gpu: uuid,
                bytes: a.ask,
            })
        };
        let Some(pending) = pending else {
            return no_answer();
        };
        // Under memory overcommit the scheduler may say the reservation waits for memory
        // (others freeing it, or being swapped to host memory): then its answer comes within
        // its bound.
        // Asked again across a reconnection: the bound it was given still stands (the new
        // scheduler may first read who this process is).
        let first = waits_until.map_or(timeout, |until| {
            until.saturating_duration_since(Instant::now()) + ANSWER_TIMEOUT
        });
        let mut answer = pending.wait(first);
        if let Ok(ServerMsg::MemWait { max_wait_ns, .. }) = answer {
            waits_until.get_or_insert(Instant::now() + Duration::from_nanos(max_wait_ns));
            answer = pending.wait(Duration::from_nanos(max_wait_ns) + ANSWER_TIMEOUT);
        }
        // The scheduler went away while the reservation waited for memory (a swap it began
        // for it may still be under way): rather than race that swap to the GPU alone, the
        // allocation waits for a scheduler again, within the bound it was given, and asks it.
        match (answer, waits_until) {
            (Err(NoAnswer::Gone), Some(until)) if reconnected_by(h, until) => continue,
            (answer, _) => break answer,
        }
    };
    match answer {
        Ok(ServerMsg::Memory {
            granted,
            cap,
            used,
            journaled,
            ..
        }) => {
            let mut lease = h.memory.lease(gpu);
            if granted {
                // As it will be once the grant is counted.
                lease.learn(cap, used.saturating_sub(a.ask));
            } else {
                lease.learn(cap, used);
            }
            let back = lease.set_block(h.memory.block_for(cap));
            give_back(h, gpu, &mut lease, back);
            drop(lease);
            if !granted {
                return Answer::Refused;
            }
            if !journaled {
                unjournaled_warning(open);
            }
            Answer::Granted { journaled }
        }
        Ok(_) => no_answer(),
        Err(NoAnswer::Late) => {
            debug!(
                "no answer to a reservation within {} ms: the scheduler is taken to be unresponsive",
                timeout.as_millis()
            );
            h.port.mark_owed();
            no_answer()
        }
        Err(NoAnswer::Gone) => no_answer(),
    }
}

/// Whether the hook is connected to a scheduler again by `until`.
fn reconnected_by(h: &Hook, until: Instant) -> bool {
    while !h.port.is_connected() {
        if h.port.is_refused() || Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// The scheduler could not journal a reservation: said once per process on stderr.
fn unjournaled_warning(open: bool) {
    static WARN: Once = Once::new();
    WARN.call_once(|| {
        let what = if open {
            "allocating anyway (GPUSHARE_FAIL=open): a restart of the scheduler now would forget it"
        } else {
            "the allocation fails (GPUSHARE_FAIL=closed)"
        };
        eprintln!("gpushare: gpushare-scheduler could not journal a GPU memory reservation (its journal's file system may be full); {what}");
    });
}

/// Give back `bytes` of gate `gpu`'s lease (under its lock); a statement is owed if the
/// scheduler does not hear it.
fn give_back(h: &Hook, gpu: usize, lease: &mut Lease, bytes: u64) {
    if bytes > 0
        && !h.port.send(&ClientMsg::MemFree {
            gpu: h.gates[gpu].uuid,
            bytes,
        })
    {
        lease.owe_sync();
    }
}

/// The process holds spare: make sure the keeper thread will give it back if unused.
fn keep(h: &'static Hook) {
    h.memory.keeper.start_once(|| {
        let spawned = std::thread::Builder::new()
            .name("gpushare-mem".into())
            .spawn(move || h.memory.keeper.run(LEASE_WINDOW, || tick(h)));
        if let Err(e) = spawned {
            debug!("no memory keeper thread ({e}): spare and pooled bytes go back only at the next allocation or free");
        }
    });
    h.memory.keeper.ring();
}

/// One round of the keeper: the spare each lease did not need in the window goes back, and
/// the watched pools due for a reading are read. When to come back (`None`: when rung).
fn tick(h: &'static Hook) -> Option<Duration> {
    let mut next: Option<Duration> = None;
    let mut soon = |d: Duration| next = Some(next.map_or(d, |n| n.min(d)));
    for gpu in 0..h.memory.gpus() {
        let mut lease = h.memory.lease(gpu);
        let back = lease.expire();
        give_back(h, gpu, &mut lease, back);
        let spare = lease.spare();
        drop(lease);
        if spare > 0 {
            soon(LEASE_WINDOW);
        }
    }
    // An allocation holding the pools now reads its pool itself; the others wait a window.
    let Some(mut pools) = h.memory.try_pools() else {
        soon(LEASE_WINDOW);
        return next;
    };
    let now = Instant::now();
    for (&pool, charge) in pools.iter_mut().filter(|(_, c)| c.watched) {
        if charge.next_poll <= now {
            let before = charge.charged;
            reconcile(h, pool, charge);
            // Unchanged: read it less and less often.
            charge.poll_every = if charge.charged == before {
                (charge.poll_every * 2).min(POOL_POLL_MAX)
            } else {
                LEASE_WINDOW
            };
            charge.next_poll = now + charge.poll_every;
        }
        if charge.watched {
            soon(charge.next_poll.saturating_duration_since(now));
        }
    }
    forget_empty(&mut pools);
    next
}
