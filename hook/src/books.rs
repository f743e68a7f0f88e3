//! The books of the GPU memory this process holds: by allocation, with the lifetimes the driver
//! gives each kind (a physical allocation lives until its last handle reference is released
//! and its last mapping unmapped), and per GPU the [`Lease`] it holds at the scheduler. Pure
//! bookkeeping: the allocation wrappers in [`crate::memory`] reserve through
//! [`crate::charges`] and write here.

use crate::lease::Lease;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// What this process holds on each GPU.
pub struct Books {
    held: Mutex<Held>,
    /// Per gate: what this process holds at the scheduler, and how much of it is spare.
    leases: Vec<Mutex<Lease>>,
    /// `GPUSHARE_MEM_LEASE`: the largest lease block.
    max_block: u64,
    /// Wakes the thread that gives back what the leases do not need.
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
            keeper: Wake::default(),
        }
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

/// A sleeping thread's doorbell: rung (one atomic load when nobody sleeps) after a change that
/// gives the thread work, so it can sleep without a timeout while there is none.
#[derive(Default)]
pub struct Wake {
    started: OnceLock<()>,
    /// The thread is about to sleep, or sleeps, until rung.
    idle: AtomicBool,
    rung: Mutex<bool>,
    bell: Condvar,
}

impl Wake {
    /// Start the thread with `spawn` if it has not been started.
    pub fn start_once(&self, spawn: impl FnOnce()) {
        self.started.get_or_init(spawn);
    }

    /// After a change the thread must see: wake it if it sleeps (or is about to).
    pub fn ring(&self) {
        if self.idle.load(Ordering::SeqCst) {
            *self.rung.lock().unwrap_or_else(|e| e.into_inner()) = true;
            self.bell.notify_one();
        }
    }

    /// The thread's loop: `work` runs, and says whether it left something to come back to
    /// after `period`; if not, the thread sleeps until rung. A change made while `work` runs
    /// either is seen by it or rings the bell (the idle flag is raised before `work` looks).
    pub fn run(&self, period: Duration, mut work: impl FnMut() -> bool) -> ! {
        loop {
            self.idle.store(true, Ordering::SeqCst);
            if work() {
                self.idle.store(false, Ordering::SeqCst);
                std::thread::sleep(period);
                continue;
            }
            let mut rung = self.rung.lock().unwrap_or_else(|e| e.into_inner());
            while !*rung {
                rung = self.bell.wait(rung).unwrap_or_else(|e| e.into_inner());
            }
            *rung = false;
            drop(rung);
            self.idle.store(false, Ordering::SeqCst);
        }
    }
}
