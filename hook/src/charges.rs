//! What this process reserves at the scheduler: every allocation draws its bytes from the
//! GPU's [`Lease`](crate::lease::Lease) (a round trip only when the lease must grow), every
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
//! Without a scheduler, fail-open grants everything unchecked (and counts it, so a restated
//! holding after the reconnection is whole) and fail-closed waits for it; a refused process
//! allocates nothing.

use crate::books::PoolCharge;
use crate::driver::{self, Handle};
use crate::lease::{Refused, Take};
use crate::log::debug;
use crate::process::Hook;
use crate::settings::FailPolicy;
use gpushare_protocol::{ClientMsg, ServerMsg};
use std::collections::HashMap;
use std::sync::MutexGuard;
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

/// Reserve `bytes` for an allocation on gate `gpu`; false: over the cap (or refused).
pub fn draw(h: &'static Hook, gpu: usize, bytes: u64) -> bool {
    let take = h.memory.lease(gpu).take(bytes);
    let Take::Ask(mut a) = take else {
        return true;
    };
    loop {
        let granted = ask(h, gpu, a.ask);
        let mut lease = h.memory.lease(gpu);
        if granted {
            let back = lease.granted(&a);
            let spare = lease.spare();
            drop(lease);
            give_back(h, gpu, back);
            if spare > 0 {
                keep(h);
            }
            return true;
        }
        match lease.refused(&a) {
            Refused::Retry(next) => a = next,
            Refused::Failed { give_back: back } => {
                drop(lease);
                give_back(h, gpu, back);
                return false;
            }
        }
    }
}

/// Allocations of `bytes` on gate `gpu` ended (freed, or failed by the driver after their
/// reservation).
pub fn release(h: &'static Hook, gpu: usize, bytes: u64) {
    let mut lease = h.memory.lease(gpu);
    let back = lease.free(bytes);
    let spare = lease.spare();
    drop(lease);
    give_back(h, gpu, back);
    if spare > 0 {
        keep(h);
    }
}

/// The scheduler told the group's cap on gate `gpu` (`None`: uncapped): the lease block
/// follows it.
pub fn learn_cap(h: &Hook, gpu: usize, cap: Option<u64>) {
    let block = h.memory.block_for(cap);
    let back = h.memory.lease(gpu).set_block(block);
    give_back(h, gpu, back);
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

/// One reservation round trip: granted or not. Without a scheduler, fail-open grants
/// unchecked and fail-closed waits for it (and refuses if it does not answer).
fn ask(h: &Hook, gpu: usize, bytes: u64) -> bool {
    if !h.wait_connected() {
        return !h.port.is_refused();
    }
    let uuid = h.gates[gpu].uuid;
    // Under memory overcommit the scheduler may make the allocation wait for memory (others
    // freeing it, or being swapped to host memory), never longer than its bound.
    let wait = Duration::from_nanos(gpushare_protocol::MAX_MEMORY_WAIT_NS) + Duration::from_secs(5);
    match h.port.call_within(wait, |req| ClientMsg::MemReserve {
        req,
        gpu: uuid,
        bytes,
    }) {
        Some(ServerMsg::Memory { granted, cap, .. }) => {
            learn_cap(h, gpu, cap);
            granted
        }
        _ => h.settings.fail == FailPolicy::Open,
    }
}

fn give_back(h: &Hook, gpu: usize, bytes: u64) {
    if bytes > 0 {
        h.port.send(&ClientMsg::MemFree {
            gpu: h.gates[gpu].uuid,
            bytes,
        });
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
        let spare = lease.spare();
        drop(lease);
        give_back(h, gpu, back);
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
