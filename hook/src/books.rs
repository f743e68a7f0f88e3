//! The books of the GPU memory this process holds: by allocation, with the lifetimes the driver
//! gives each kind (a physical allocation lives until its last handle reference is released
//! and its last mapping unmapped), and per GPU the [`Lease`] it holds at the scheduler. Pure
//! bookkeeping: the allocation wrappers in `intercept::memory` reserve through
//! [`crate::charges`] and write here.

use crate::lease::Lease;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// What this process holds on each GPU.
pub struct Books {
    held: Mutex<Held>,
    /// Per gate: what this process holds at the scheduler, and how much of it is spare.
    leases: Vec<Mutex<Lease>>,
    /// `GPUSHARE_MEM_LEASE`: the largest lease block.
    max_block: u64,
    /// The stream-ordered memory pools this process allocated from, by pool handle.
    pools: Mutex<HashMap<u64, PoolCharge>>,
    /// Wakes the thread that gives back what the leases and pools do not need.
    pub keeper: Wake,
}

#[derive(Default)]
pub struct Held {
    /// Allocations one call frees, by device pointer or array: (gate, bytes).
    pub allocs: HashMap<u64, (usize, u64)>,
    /// Physical allocations (`cuMemCreate` on a GPU), by handle.
    pub physical: HashMap<u64, Physical>,
    /// Mapped ranges of those: base address → (size, handle).
    pub mappings: BTreeMap<u64, (usize, u64)>,
    /// Stream-ordered allocations from a pool whose reservation is charged ([`PoolCharge`]),
    /// by device pointer: their frees leave the bytes in the pool.
    pub pooled: HashMap<u64, Pooled>,
}

/// An allocation from a memory pool.
#[derive(Clone, Copy)]
pub struct Pooled {
    pub pool: u64,
    pub bytes: u64,
}

/// A stream-ordered memory pool: the driver keeps bytes freed with `cuMemFreeAsync` reserved in
/// the pool (up to its release threshold after a synchronisation, until `cuMemPoolTrimTo`), so
/// what the pool reserves on the device is charged, not what its allocations use.
pub struct PoolCharge {
    pub gpu: usize,
    /// Charged at the scheduler for the pool: its reservation when last read, plus the growth
    /// reserved for an allocation under way.
    pub charged: u64,
    /// The pool holds bytes no allocation uses, which a synchronisation, a trim or a lower
    /// threshold may release: read again at `next_poll`.
    pub watched: bool,
    pub poll_every: Duration,
    pub next_poll: Instant,
}

/// The driver frees a physical allocation only once every reference to its handle is released
/// and every mapping of it unmapped (PyTorch's expandable segments release handles while their
/// memory stays mapped), so it is charged until then.
pub struct Physical {
    pub gpu: usize,
    pub bytes: u64,
    pub refs: u32,
    pub mappings: u32,
}

impl Held {
    /// Forget the physical allocation `handle` if nothing references or maps it any more:
    /// its gate and bytes.
    pub fn take_unused(&mut self, handle: u64) -> Option<(usize, u64)> {
        let p = self.physical.get(&handle)?;
        if p.refs > 0 || p.mappings > 0 {
            return None;
        }
        self.physical.remove(&handle).map(|p| (p.gpu, p.bytes))
    }
}

impl Books {
    /// Books for `gpus` gates, with lease blocks of at most `max_block` bytes. Leases start
    /// without a block (every allocation exact) until the group's cap is known.
    pub fn new(gpus: usize, max_block: u64) -> Books {
        Books {
            held: Mutex::default(),
            leases: (0..gpus).map(|_| Mutex::new(Lease::new(0))).collect(),
            max_block,
            pools: Mutex::default(),
            keeper: Wake::default(),
        }
    }

    /// The pools' charges (held across a pool allocation, so one pool's growth and its
    /// reading are never interleaved with another's).
    pub fn pools(&self) -> MutexGuard<'_, HashMap<u64, PoolCharge>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`pools`](Self::pools), unless an allocation holds them now.
    pub fn try_pools(&self) -> Option<MutexGuard<'_, HashMap<u64, PoolCharge>>> {
        match self.pools.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Bytes of the live allocations from `pool` (what it holds for sure if the driver can no
    /// longer tell: a destroyed pool).
    pub fn pooled_bytes(&self, pool: u64) -> u64 {
        let held = self.lock();
        held.pooled
            .values()
            .filter(|p| p.pool == pool)
            .map(|p| p.bytes)
            .sum()
    }

    pub fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The lease of gate `gpu`.
    pub fn lease(&self, gpu: usize) -> MutexGuard<'_, Lease> {
        self.leases[gpu].lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn gpus(&self) -> usize {
        self.leases.len()
    }

    /// The lease block under a group cap of `cap` (`None`: uncapped): min(`GPUSHARE_MEM_LEASE`,
    /// cap / 32), so that a process's spare stays a small part of what its group may hold.
    pub fn block_for(&self, cap: Option<u64>) -> u64 {
        cap.map_or(self.max_block, |c| (c / 32).min(self.max_block))
    }
}

/// A sleeping thread's doorbell: rung (one atomic load when the thread is not in a long sleep)
/// after a change that gives the thread work, so it can sleep long, or without a timeout, while
/// it has none.
#[derive(Default)]
pub struct Wake {
    started: OnceLock<()>,
    /// The thread is about to sleep, or sleeps, longer than its short period (or until rung).
    idle: AtomicBool,
    rung: Mutex<bool>,
    bell: Condvar,
}

impl Wake {
    /// Start the thread with `spawn` if it has not been started.
    pub fn start_once(&self, spawn: impl FnOnce()) {
        self.started.get_or_init(spawn);
    }

    /// After a change the thread must see within its short period: wake it if it sleeps longer.
    pub fn ring(&self) {
        if self.idle.load(Ordering::SeqCst) {
            *self.rung.lock().unwrap_or_else(|e| e.into_inner()) = true;
            self.bell.notify_one();
        }
    }

    /// The thread's loop: `work` runs and says when it wants to run again (`None`: only when
    /// rung). Sleeps of at most `short` are not interrupted; longer ones end early when rung.
    /// A change made while `work` runs is either seen by it or rings the bell: the idle flag is
    /// raised before `work` looks.
    pub fn run(&self, short: Duration, mut work: impl FnMut() -> Option<Duration>) -> ! {
        loop {
            self.idle.store(true, Ordering::SeqCst);
            let next = work();
            if let Some(d) = next.filter(|d| *d <= short) {
                self.idle.store(false, Ordering::SeqCst);
                std::thread::sleep(d);
                continue;
            }
            let deadline = next.map(|d| Instant::now() + d);
            let mut rung = self.rung.lock().unwrap_or_else(|e| e.into_inner());
            while !*rung {
                rung = match deadline {
                    None => self.bell.wait(rung).unwrap_or_else(|e| e.into_inner()),
                    Some(t) => {
                        let left = t.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        let waited = self.bell.wait_timeout(rung, left);
                        waited.unwrap_or_else(|e| e.into_inner()).0
                    }
                };
            }
            *rung = false;
        }
    }
}
