//! The books of the GPU memory this process holds: by allocation, with the lifetimes the driver
//! gives each kind (a physical allocation lives until its last handle reference is released
//! and its last mapping unmapped). Pure bookkeeping: the allocation wrappers in
//! [`crate::memory`] reserve at the scheduler and write here.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// What this process holds on each GPU.
#[derive(Default)]
pub struct Books {
    held: Mutex<Held>,
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
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes held on the GPU of gate `gpu`.
    pub fn held(&self, gpu: usize) -> u64 {
        let held = self.lock();
        let allocs = held.allocs.values().copied();
        let physical = held.physical.values().map(|p| (p.gpu, p.bytes));
        allocs
            .chain(physical)
            .filter(|&(g, _)| g == gpu)
            .map(|(_, b)| b)
            .sum()
    }
}
