//! Device, managed, pinned-host, stream-ordered, virtual (VMM) and array memory, plus copies
//! and memsets.
//!
//! Device memory is real host memory (an anonymous `MAP_NORESERVE` mapping per allocation, so an
//! untouched 40 GiB buffer costs nothing) and the device pointer is its address, which keeps
//! copies exact and managed memory host-accessible. The device process holds the books of each
//! GPU's capacity, so processes sharing a GPU run out of memory together, as on real hardware.
//!
//! Copies and memsets act when called, which is a valid schedule of stream order because the
//! simulated kernels never touch memory; where the driver documents that a call returns only
//! once data is in place (synchronous copies, device-to-pageable-host copies), the call first
//! waits for the stream's prior work.

use crate::api_graph::capture_node;
use crate::ffi::*;
use crate::state::{Alloc, AllocKind, Driver, NodeKind, Pinned, State, driver, with_state};
use gpushare_cuda_abi::arrays::mipmapped_bytes;
use gpushare_sim_wire::{Reply, Request};
use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

/// Allocation granularity charged against the device's capacity.
const CHARGE_ALIGN: u64 = 512;
/// Pitch alignment of cuMemAllocPitch, as on current GPUs.
const PITCH_ALIGN: usize = 512;
/// Granularity of cuMemCreate / cuMemMap (2 MiB, as the driver reports).
const VMM_GRANULARITY: usize = 2 << 20;

pub fn page_round(size: usize) -> usize {
    let page = 4096;
    size.div_ceil(page) * page
}

/// Map `size` bytes of zeroed, lazily backed memory, `PROT_NONE` unless `access`.
pub fn map(size: usize, access: bool) -> CuResult<u64> {
    let prot = if access {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_NONE
    };
    // SAFETY: an anonymous private mapping at an address the kernel chooses; no existing memory
    // is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page_round(size),
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    } else {
        Ok(p as u64)
    }
}

pub fn unmap(addr: u64, size: usize) {
    // SAFETY: `addr..addr+size` is a mapping this module created and no longer hands out.
    unsafe { libc::munmap(addr as *mut c_void, page_round(size)) };
}

/// Bytes of each GPU's capacity this process holds (by the device process's index of the GPU;
/// the simulator has at most 64): what a checkpoint gives back and a restore takes again.
static CHARGED: [AtomicU64; 64] = [const { AtomicU64::new(0) }; 64];

/// What this process holds of each GPU's capacity: (device process's index, bytes).
pub fn charged() -> Vec<(u32, u64)> {
    (0..CHARGED.len() as u32)
        .map(|i| (i, CHARGED[i as usize].load(Ordering::Relaxed)))
        .filter(|&(_, b)| b > 0)
        .collect()
}

/// Reserve `bytes` of the capacity of the GPU the device process calls `physical`.
fn charge_physical(d: &Driver, physical: u32, bytes: u64) -> CuResult {
    let slot = CHARGED
        .get(physical as usize)
        .ok_or(CUDA_ERROR_INVALID_DEVICE)?;
    reserve_physical(d, physical, bytes)?;
    slot.fetch_add(bytes, Ordering::Relaxed);
    Ok(())
}

/// Give back `bytes` of the capacity of the GPU the device process calls `physical`.
fn uncharge_physical(d: &Driver, physical: u32, bytes: u64) -> CuResult {
    if let Some(slot) = CHARGED.get(physical as usize) {
        let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
            Some(b.saturating_sub(bytes))
        });
    }
    release_physical(d, physical, bytes)
}

/// Take `bytes` of a GPU's capacity in the device process without counting them as this
/// process's allocations (a restore takes back what [`charged`] still counts).
pub fn reserve_physical(d: &Driver, physical: u32, bytes: u64) -> CuResult {
    match d.client.call(|req| Request::Alloc {
        req,
        device: physical,
        bytes,
    })? {
        Reply::Alloc { ok: true, .. } => Ok(()),
        _ => Err(CUDA_ERROR_OUT_OF_MEMORY),
    }
}

/// Give `bytes` of a GPU's capacity back in the device process without uncounting them (a
/// checkpoint releases what [`charged`] goes on counting).
pub fn release_physical(d: &Driver, physical: u32, bytes: u64) -> CuResult {
    if bytes == 0 {
        return Ok(());
    }
    match d.client.call(|req| Request::Free {
        req,
        device: physical,
        bytes,
    })? {
        Reply::Freed { .. } => Ok(()),
        _ => Err(CUDA_ERROR_UNKNOWN),
    }
}

/// Reserve `bytes` of the capacity of this process's GPU `device` in the device process.
fn charge(d: &Driver, device: u32, bytes: u64) -> CuResult {
    charge_physical(d, d.client.physical(device), bytes)
}

fn uncharge(d: &Driver, device: u32, bytes: u64) -> CuResult {
    uncharge_physical(d, d.client.physical(device), bytes)
}

/// Allocate device (or managed) memory on the current context's device.
fn allocate(size: usize, kind: AllocKind) -> CuResult<u64> {
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let d = driver()?;
    let device = {
        let mut st = d.lock();
        st.check_unsafe_call()?;
        st.current_device()?
    };
    let charged = (size as u64).div_ceil(CHARGE_ALIGN) * CHARGE_ALIGN;
    charge(d, device, charged)?;
    // Device memory another process may map (cuIpcGetMemHandle); managed memory is the
    // process's own.
    let shared = match kind {
        AllocKind::Device => crate::api_ipc::map_shared(size),
        _ => None,
    };
    let addr = match shared.map_or_else(|| map(size, true), Ok) {
        Ok(a) => a,
        Err(e) => {
            uncharge(d, device, charged)?;
            return Err(e);
        }
    };
    let alloc = Alloc {
        size,
        mapped: size,
        device,
        charged,
        kind,
        arena: shared.is_some(),
    };
    d.lock().allocs.insert(addr, alloc);
    Ok(addr)
}

/// Free an allocation made by [`allocate`] or [`pool_allocate`], given its base address: the
/// device's memory again, or its pool's.
fn release(ptr: u64) -> CuResult {
    let d = driver()?;
    let a = {
        let mut st = d.lock();
        st.check_unsafe_call()?;
        match st.allocs.get(&ptr) {
            Some(a) if matches!(a.kind, AllocKind::Device | AllocKind::Managed) => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        st.allocs.remove(&ptr).expect("checked above")
    };
    // Forgotten before the address can be mapped again for another allocation.
    let pooled = pools().of.remove(&ptr);
    if a.arena {
        crate::api_ipc::forget_export(ptr);
        crate::api_ipc::unmap_shared(ptr, a.mapped);
    } else {
        unmap(ptr, a.mapped);
    }
    match pooled {
        Some((pool, bytes)) => back_to_pool(d, pool, bytes),
        None => uncharge(d, a.device, a.charged),
    }
}

entry!(
    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) {
        let a = allocate(size, AllocKind::Device)?;
        put(dptr, a).inspect_err(|_| {
            let _ = release(a);
        })
    }
);

entry!(
    fn cuMemAllocPitch_v2(
        dptr: *mut CUdeviceptr,
        pitch: *mut usize,
        width: usize,
        height: usize,
        elem_size: c_uint,
    ) {
        if ![4, 8, 16].contains(&elem_size) || width == 0 || height == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = width.div_ceil(PITCH_ALIGN) * PITCH_ALIGN;
        let a = allocate(
            p.checked_mul(height).ok_or(CUDA_ERROR_INVALID_VALUE)?,
            AllocKind::Device,
        )?;
        put(pitch, p)?;
        put(dptr, a)
    }
);

entry!(
    fn cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) {
        // CU_MEM_ATTACH_GLOBAL = 1, CU_MEM_ATTACH_HOST = 2.
        if flags != 1 && flags != 2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(dptr, allocate(size, AllocKind::Managed)?)
    }
);

entry!(
    fn cuMemFree_v2(ptr: CUdeviceptr) {
        if ptr == 0 {
            return Ok(());
        }
        release(ptr)
    }
);

// --- stream-ordered allocation and memory pools -------------------------------------------
//
// As the driver documents (cuMemAllocAsync, cuMemFreeAsync, cuMemPoolSetAttribute,
// cuMemPoolTrimTo): a stream-ordered allocation comes from a pool (the device's current pool,
// or the one named), which reserves device memory as it grows; a free gives the bytes back to
// the pool, still reserved on the device (cuMemGetInfo_v2 does not see them free), for the
// pool's later allocations. At the next stream, event or context synchronisation a pool that
// holds more than its release threshold (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, default 0)
// releases what it does not use, down to the threshold; cuMemPoolTrimTo releases down to what
// the caller keeps; a destroyed pool releases everything once its last allocation is freed.
// Pools reserve in 2 MiB granules. Simplifications: a pool's free bytes are interchangeable
// (any allocation that fits in them reuses them), and a free is complete when called (the
// simulated kernels never touch memory).

/// Granule of a pool's reservations on the device.
const POOL_GRANULE: u64 = 2 << 20;

/// One memory pool.
struct Pool {
    device: u32,
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`.
    threshold: u64,
    /// Reserved on the device (`RESERVED_MEM_CURRENT`) and its high watermark.
    reserved: u64,
    reserved_high: u64,
    /// Of `reserved`, what live allocations use (`USED_MEM_CURRENT`) and its high watermark.
    used: u64,
    used_high: u64,
    /// The three reuse policies (`CU_MEMPOOL_ATTR_REUSE_*`): kept, not modelled.
    reuse: [c_int; 3],
    /// `maxSize` of a created pool (0: the device's memory).
    max_size: u64,
    /// Destroyed while allocations were live: gone (and released) with the last of them.
    destroyed: bool,
}

impl Pool {
    fn new(device: u32, max_size: u64) -> Pool {
        Pool {
            device,
            threshold: 0,
            reserved: 0,
            reserved_high: 0,
            used: 0,
            used_high: 0,
            reuse: [1; 3],
            max_size,
            destroyed: false,
        }
    }

    /// Release reserved bytes no allocation uses, keeping at least `keep`; the bytes released.
    fn shrink_to(&mut self, keep: u64) -> u64 {
        let target = self.used.div_ceil(POOL_GRANULE) * POOL_GRANULE;
        let target = target.max(keep);
        let released = self.reserved.saturating_sub(target);
        self.reserved -= released;
        released
    }
}

#[derive(Default)]
struct Pools {
    pools: std::collections::HashMap<u64, Pool>,
    /// Each device's current pool (`cuDeviceSetMemPool`); its default pool when absent.
    current: std::collections::HashMap<u32, u64>,
    /// Live pool allocations: base address → (pool, bytes it uses of the pool).
    of: std::collections::HashMap<u64, (u64, u64)>,
}

/// The pools. Lock order: the driver state's lock, if needed, before this one.
fn pools() -> std::sync::MutexGuard<'static, Pools> {
    static P: std::sync::OnceLock<std::sync::Mutex<Pools>> = std::sync::OnceLock::new();
    P.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The handle of device `device`'s default pool.
fn default_pool(device: u32) -> u64 {
    0x100 + device as u64
}

impl Pools {
    /// The live pool `h` (a device's default pool is created on first use).
    fn get(&mut self, d: &Driver, h: u64) -> CuResult<&mut Pool> {
        let devices = d.device_count() as u64;
        if !self.pools.contains_key(&h) && (0x100..0x100 + devices).contains(&h) {
            self.pools.insert(h, Pool::new((h - 0x100) as u32, 0));
        }
        match self.pools.get_mut(&h) {
            Some(p) if !p.destroyed => Ok(p),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }

    fn current(&self, device: u32) -> u64 {
        self.current
            .get(&device)
            .copied()
            .unwrap_or(default_pool(device))
    }
}

/// Allocate `size` bytes from pool `pool` (`None`: the current device's current pool).
fn pool_allocate(size: usize, pool: Option<u64>) -> CuResult<u64> {
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let d = driver()?;
    let current = {
        let mut st = d.lock();
        st.check_unsafe_call()?;
        st.current_device()?
    };
    let charged = (size as u64).div_ceil(CHARGE_ALIGN) * CHARGE_ALIGN;
    let (h, device) = {
        let mut ps = pools();
        let h = pool.unwrap_or_else(|| ps.current(current));
        let p = ps.get(d, h)?;
        let need = (p.used + charged).saturating_sub(p.reserved);
        let grow = need.div_ceil(POOL_GRANULE) * POOL_GRANULE;
        if p.max_size > 0 && p.reserved + grow > p.max_size {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        if grow > 0 {
            charge(d, p.device, grow)?;
        }
        p.reserved += grow;
        p.reserved_high = p.reserved_high.max(p.reserved);
        p.used += charged;
        p.used_high = p.used_high.max(p.used);
        (h, p.device)
    };
    let addr = match map(size, true) {
        Ok(a) => a,
        Err(e) => {
            back_to_pool(d, h, charged)?;
            return Err(e);
        }
    };
    pools().of.insert(addr, (h, charged));
    let alloc = Alloc {
        size,
        mapped: size,
        device,
        charged,
        kind: AllocKind::Device,
        arena: false,
    };
    d.lock().allocs.insert(addr, alloc);
    Ok(addr)
}

/// `bytes` of pool `h` are free again; a destroyed pool goes once nothing uses it.
fn back_to_pool(d: &Driver, h: u64, bytes: u64) -> CuResult {
    let mut ps = pools();
    let Some(p) = ps.pools.get_mut(&h) else {
        return Ok(());
    };
    p.used = p.used.saturating_sub(bytes);
    if p.destroyed && p.used == 0 {
        let p = ps.pools.remove(&h).expect("present");
        return uncharge(d, p.device, p.reserved);
    }
    Ok(())
}

/// A synchronisation (stream, event or context) completed: every pool holding more than its
/// release threshold releases what it does not use, down to the threshold.
pub fn release_pools_at_sync() -> CuResult {
    let d = driver()?;
    let released: Vec<(u32, u64)> = pools()
        .pools
        .values_mut()
        .filter(|p| p.reserved > p.threshold)
        .map(|p| {
            let keep = p.threshold / POOL_GRANULE * POOL_GRANULE;
            (p.device, p.shrink_to(keep))
        })
        .collect();
    for (device, bytes) in released {
        uncharge(d, device, bytes)?;
    }
    Ok(())
}

entry_pt!(cuMemAllocAsync / cuMemAllocAsync_ptsz, |pt| fn(dptr: *mut CUdeviceptr, size: usize, stream: Handle) {
    with_state(|d, st| st.resolve_stream(&d.client, stream, pt).map(|_| ()))?;
    put(dptr, pool_allocate(size, None)?)
});

entry_pt!(cuMemAllocFromPoolAsync / cuMemAllocFromPoolAsync_ptsz, |pt| fn(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Handle,
    stream: Handle,
) {
    if pool.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    with_state(|d, st| st.resolve_stream(&d.client, stream, pt).map(|_| ()))?;
    put(dptr, pool_allocate(size, Some(id(pool)))?)
});

entry_pt!(cuMemFreeAsync / cuMemFreeAsync_ptsz, |pt| fn(ptr: CUdeviceptr, stream: Handle) {
    with_state(|d, st| st.resolve_stream(&d.client, stream, pt).map(|_| ()))?;
    release(ptr)
});

entry!(
    fn cuDeviceGetDefaultMemPool(pool: *mut Handle, dev: CUdevice) {
        let d = driver()?;
        put(pool, handle(default_pool(d.check_device(dev)?)))
    }
);

entry!(
    fn cuDeviceGetMemPool(pool: *mut Handle, dev: CUdevice) {
        let d = driver()?;
        let device = d.check_device(dev)?;
        put(pool, handle(pools().current(device)))
    }
);

entry!(
    fn cuDeviceSetMemPool(dev: CUdevice, pool: Handle) {
        let d = driver()?;
        let device = d.check_device(dev)?;
        let mut ps = pools();
        if ps.get(d, id(pool))?.device != device {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        ps.current.insert(device, id(pool));
        Ok(())
    }
);

entry!(
    fn cuMemPoolCreate(pool: *mut Handle, props: *const CUmemPoolProps) {
        let p = get(props)?;
        let d = driver()?;
        // Pinned device memory only: the device reports no host pools and no shareable handles.
        if p.allocType != CU_MEM_ALLOCATION_TYPE_PINNED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if p.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE || p.handleTypes != 0 {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let device = d.check_device(p.location.id)?;
        let h = d.lock().new_id();
        pools().pools.insert(h, Pool::new(device, p.maxSize as u64));
        put(pool, handle(h)).inspect_err(|_| {
            pools().pools.remove(&h);
        })
    }
);

entry!(
    fn cuMemPoolDestroy(pool: Handle) {
        let d = driver()?;
        let h = id(pool);
        let mut ps = pools();
        let p = ps.get(d, h)?;
        // A device's default pool is not the caller's to destroy.
        if h == default_pool(p.device) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let device = p.device;
        let (released, live) = (p.shrink_to(0), p.used > 0);
        if live {
            p.destroyed = true;
        } else {
            ps.pools.remove(&h);
        }
        // A destroyed current pool leaves the device its default one.
        if ps.current.get(&device) == Some(&h) {
            ps.current.remove(&device);
        }
        drop(ps);
        uncharge(d, device, released)
    }
);

/// `CUmemPool_attribute`.
const POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES: c_uint = 1;
const POOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES: c_uint = 3;
const POOL_RELEASE_THRESHOLD: c_uint = 4;
const POOL_RESERVED_MEM_CURRENT: c_uint = 5;
const POOL_RESERVED_MEM_HIGH: c_uint = 6;
const POOL_USED_MEM_CURRENT: c_uint = 7;
const POOL_USED_MEM_HIGH: c_uint = 8;

entry!(
    fn cuMemPoolSetAttribute(pool: Handle, attr: c_uint, value: *mut c_void) {
        let d = driver()?;
        let mut ps = pools();
        let p = ps.get(d, id(pool))?;
        match attr {
            POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES..=POOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                p.reuse[attr as usize - 1] = get(value as *const c_int)?;
            }
            // Takes effect at the next synchronisation, as documented.
            POOL_RELEASE_THRESHOLD => p.threshold = get(value as *const u64)?,
            // The high watermarks can only be reset (to the current value), by setting 0.
            POOL_RESERVED_MEM_HIGH | POOL_USED_MEM_HIGH => {
                if get(value as *const u64)? != 0 {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                if attr == POOL_RESERVED_MEM_HIGH {
                    p.reserved_high = p.reserved;
                } else {
                    p.used_high = p.used;
                }
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        Ok(())
    }
);

entry!(
    fn cuMemPoolGetAttribute(pool: Handle, attr: c_uint, value: *mut c_void) {
        let d = driver()?;
        let mut ps = pools();
        let p = ps.get(d, id(pool))?;
        let bytes = match attr {
            POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES..=POOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                return put(value as *mut c_int, p.reuse[attr as usize - 1]);
            }
            POOL_RELEASE_THRESHOLD => p.threshold,
            POOL_RESERVED_MEM_CURRENT => p.reserved,
            POOL_RESERVED_MEM_HIGH => p.reserved_high,
            POOL_USED_MEM_CURRENT => p.used,
            POOL_USED_MEM_HIGH => p.used_high,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        put(value as *mut u64, bytes)
    }
);

entry!(
    fn cuMemPoolTrimTo(pool: Handle, keep: usize) {
        let d = driver()?;
        let mut ps = pools();
        let p = ps.get(d, id(pool))?;
        let keep = (keep as u64).div_ceil(POOL_GRANULE) * POOL_GRANULE;
        let (device, released) = (p.device, p.shrink_to(keep));
        drop(ps);
        uncharge(d, device, released)
    }
);

entry!(
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        let d = driver()?;
        let device = d.client.physical(d.lock().current_device()?);
        match d.client.call(|req| Request::MemInfo { req, device })? {
            Reply::MemInfo {
                free: f, total: t, ..
            } => {
                put(free, f as usize)?;
                put(total, t as usize)
            }
            _ => Err(CUDA_ERROR_UNKNOWN),
        }
    }
);

entry!(
    fn cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, ptr: CUdeviceptr) {
        with_state(|_, st| {
            let (b, s) = st.device_range(ptr, 0).ok_or(CUDA_ERROR_NOT_FOUND)?;
            if !base.is_null() {
                put(base, b)?;
            }
            if !size.is_null() {
                put(size, s)?;
            }
            Ok(())
        })
    }
);

// --- page-locked host memory -------------------------------------------------------------

/// `CU_MEMHOSTALLOC_PORTABLE | DEVICEMAP | WRITECOMBINED`.
const HOST_ALLOC_FLAGS: u32 = 0x7;
/// `CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY`.
const HOST_REGISTER_FLAGS: u32 = 0xf;

fn host_alloc(pp: *mut *mut c_void, size: usize, flags: u32) -> CuResult {
    if size == 0 || flags & !HOST_ALLOC_FLAGS != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    with_state(|_, st| st.check_unsafe_call())?;
    let p = map(size, true)?;
    with_state(|_, st| {
        st.pinned.insert(
            p,
            Pinned {
                size,
                flags,
                allocated: true,
            },
        );
        Ok(())
    })?;
    put(pp, p as *mut c_void)
}

entry!(
    fn cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) {
        host_alloc(pp, size, 0)
    }
);
entry!(
    fn cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: c_uint) {
        host_alloc(pp, size, flags)
    }
);

entry!(
    fn cuMemFreeHost(p: *mut c_void) {
        let size = with_state(|_, st| match st.pinned.get(&(p as u64)) {
            Some(b) if b.allocated => Ok(st.pinned.remove(&(p as u64)).expect("present").size),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        })?;
        unmap(p as u64, size);
        Ok(())
    }
);

entry!(
    fn cuMemHostRegister_v2(p: *mut c_void, size: usize, flags: c_uint) {
        if p.is_null() || size == 0 || flags & !HOST_REGISTER_FLAGS != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        with_state(|_, st| {
            let (start, end) = (p as u64, p as u64 + size as u64);
            let overlaps = st
                .pinned
                .range(..end)
                .next_back()
                .is_some_and(|(&b, q)| b + q.size as u64 > start);
            if overlaps {
                return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
            }
            st.pinned.insert(
                start,
                Pinned {
                    size,
                    flags,
                    allocated: false,
                },
            );
            Ok(())
        })
    }
);

entry!(
    fn cuMemHostUnregister(p: *mut c_void) {
        with_state(|_, st| match st.pinned.get(&(p as u64)) {
            Some(b) if !b.allocated => {
                st.pinned.remove(&(p as u64));
                Ok(())
            }
            _ => Err(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED),
        })
    }
);

entry!(
    fn cuMemHostGetDevicePointer_v2(dptr: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        with_state(|_, st| {
            if !st.is_pinned(p as u64, 1) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // Unified addressing: the host address is the device address.
            put(dptr, p as u64)
        })
    }
);

entry!(
    fn cuMemHostGetFlags(flags: *mut c_uint, p: *mut c_void) {
        with_state(|_, st| {
            let (_, b) = st
                .find_pinned(p as u64, 1)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            put(flags, b.flags)
        })
    }
);

/// What a pointer points into: base, size, device, kind, and whether it is host memory.
fn pointer_info(st: &State, ptr: CUdeviceptr) -> Option<(u64, usize, u32, AllocKind, bool)> {
    if let Some((b, a)) = st.find_alloc(ptr, 0) {
        return Some((b, a.size, a.device, a.kind, false));
    }
    let (b, p) = st.find_pinned(ptr, 0)?;
    Some((b, p.size, 0, AllocKind::Device, true))
}

/// Write one `CUpointer_attribute` of `ptr` to `data`.
fn pointer_attribute(
    st: &State,
    attribute: c_uint,
    ptr: CUdeviceptr,
    data: *mut c_void,
) -> CuResult {
    let (base, size, device, kind, host) = pointer_info(st, ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    match attribute {
        // CONTEXT
        1 => put(data as *mut Handle, handle(st.current().unwrap_or(0))),
        // MEMORY_TYPE: HOST = 1, DEVICE = 2
        2 => put(data as *mut c_uint, if host { 1 } else { 2 }),
        // DEVICE_POINTER
        3 => put(data as *mut u64, ptr),
        // HOST_POINTER: only host and managed memory have one
        4 if host || kind == AllocKind::Managed => put(data as *mut u64, ptr),
        4 => Err(CUDA_ERROR_INVALID_VALUE),
        // SYNC_MEMOPS
        6 => put(data as *mut c_uint, 1),
        // BUFFER_ID: unique per allocation for the process's lifetime
        7 => put(data as *mut u64, base),
        // IS_MANAGED
        8 => put(data as *mut c_uint, (kind == AllocKind::Managed) as c_uint),
        // DEVICE_ORDINAL
        9 => put(data as *mut i32, device as i32),
        // IS_LEGACY_CUDA_IPC_CAPABLE: cuMemAlloc memory (cuIpcGetMemHandle takes it)
        10 => {
            let capable = st
                .allocs
                .get(&base)
                .is_some_and(|a| crate::api_ipc::in_arena(base, a));
            put(data as *mut c_uint, capable as c_uint)
        }
        // RANGE_START_ADDR, RANGE_SIZE
        11 => put(data as *mut u64, base),
        12 => put(data as *mut usize, size),
        // MAPPED
        13 => put(data as *mut c_uint, 1),
        // ALLOWED_HANDLE_TYPES
        14 => put(data as *mut u64, 0),
        // IS_GPU_DIRECT_RDMA_CAPABLE
        15 => put(data as *mut c_uint, 0),
        // ACCESS_FLAGS: read and write
        16 => put(data as *mut c_uint, 3),
        // MEMPOOL_HANDLE: the pool of a stream-ordered allocation (lock order: state, pools)
        17 => {
            let pool = pools().of.get(&base).map_or(0, |&(pool, _)| pool);
            put(data as *mut Handle, handle(pool))
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

entry!(
    fn cuPointerGetAttribute(data: *mut c_void, attribute: c_uint, ptr: CUdeviceptr) {
        with_state(|_, st| pointer_attribute(st, attribute, ptr, data))
    }
);

entry!(
    fn cuPointerGetAttributes(
        n: c_uint,
        attributes: *mut c_uint,
        data: *mut *mut c_void,
        ptr: CUdeviceptr,
    ) {
        let attributes = slice(attributes as *const c_uint, n as usize)?;
        let outs = slice(data as *const *mut c_void, n as usize)?;
        with_state(|_, st| {
            let known = pointer_info(st, ptr).is_some();
            for (&a, &out) in attributes.iter().zip(outs) {
                if out.is_null() {
                    continue;
                }
                if known {
                    match pointer_attribute(st, a, ptr, out) {
                        // Device memory has no host pointer: it reads as null.
                        Err(_) if a == 4 => put(out as *mut u64, 0)?,
                        r => r?,
                    }
                } else {
                    // Not a CUDA pointer: every attribute reads as zero (memory type 0:
                    // unregistered host memory), and the call succeeds.
                    match a {
                        1 | 3 | 4 | 7 | 11 | 14 | 17 => put(out as *mut u64, 0)?,
                        12 => put(out as *mut usize, 0)?,
                        9 => put(out as *mut i32, -2)?,
                        _ => put(out as *mut c_uint, 0)?,
                    }
                }
            }
            Ok(())
        })
    }
);

// --- copies and memsets ------------------------------------------------------------------

/// Which side of a copy must be device memory of this process.
#[derive(Clone, Copy)]
enum Dir {
    HtoD,
    DtoH,
    DtoD,
    /// Unified addressing: either side may be host or device memory.
    Any,
}

/// Error unless `[ptr, ptr + len)` is memory the device addresses: an allocation of this
/// process or (mapped) page-locked host memory.
pub fn check_dev(st: &State, ptr: u64, len: usize) -> CuResult {
    st.device_range(ptr, len)
        .map(|_| ())
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

fn check_copy(st: &State, dir: Dir, dst: u64, src: u64, len: usize) -> CuResult {
    if len > 0 && (dst == 0 || src == 0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match dir {
        Dir::HtoD => check_dev(st, dst, len),
        Dir::DtoH => check_dev(st, src, len),
        Dir::DtoD => check_dev(st, dst, len).and_then(|_| check_dev(st, src, len)),
        Dir::Any => Ok(()),
    }
}

/// Copy now, after checking that the device side lies inside a live allocation.
pub fn copy_checked(st: &State, dst: u64, src: u64, len: usize) -> CuResult {
    check_copy(st, Dir::Any, dst, src, len)?;
    copy_bytes(dst, src, len);
    Ok(())
}

/// A synchronous copy: ordered after prior work on the default stream, done on return.
fn copy_sync(pt: bool, dir: Dir, dst: u64, src: u64, len: usize) -> CuResult {
    let d = driver()?;
    let fence = {
        let mut st = d.lock();
        check_copy(&st, dir, dst, src, len)?;
        st.check_unsafe_call()?;
        let s = st.resolve_stream(&d.client, std::ptr::null_mut(), pt)?;
        st.check_not_capturing(s)?;
        st.fence(&d.client, s)?
    };
    d.client.wait(vec![fence])?;
    copy_bytes(dst, src, len);
    Ok(())
}

/// An asynchronous copy; into pageable host memory it returns only once the data is there.
fn copy_async(stream: Handle, pt: bool, dir: Dir, dst: u64, src: u64, len: usize) -> CuResult {
    let d = driver()?;
    let fence = {
        let mut st = d.lock();
        check_copy(&st, dir, dst, src, len)?;
        let s = st.resolve_stream(&d.client, stream, pt)?;
        if capture_node(&mut st, s, NodeKind::Memcpy { dst, src, len })? {
            return Ok(());
        }
        let to_pageable = match dir {
            Dir::DtoH => !st.is_pinned(dst, len),
            Dir::Any => st.find_alloc(dst, len).is_none() && !st.is_pinned(dst, len),
            _ => false,
        };
        if !to_pageable {
            copy_bytes(dst, src, len);
            return Ok(());
        }
        st.fence(&d.client, s)?
    };
    d.client.wait(vec![fence])?;
    copy_bytes(dst, src, len);
    Ok(())
}

entry_pt!(cuMemcpyHtoD_v2 / cuMemcpyHtoD_v2_ptds, |pt| fn(dst: CUdeviceptr, src: *const c_void, n: usize) {
    copy_sync(pt, Dir::HtoD, dst, src as u64, n)
});
entry_pt!(cuMemcpyDtoH_v2 / cuMemcpyDtoH_v2_ptds, |pt| fn(dst: *mut c_void, src: CUdeviceptr, n: usize) {
    copy_sync(pt, Dir::DtoH, dst as u64, src, n)
});
entry_pt!(cuMemcpyDtoD_v2 / cuMemcpyDtoD_v2_ptds, |pt| fn(dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
    copy_sync(pt, Dir::DtoD, dst, src, n)
});
entry_pt!(cuMemcpy / cuMemcpy_ptds, |pt| fn(dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
    copy_sync(pt, Dir::Any, dst, src, n)
});
entry_pt!(cuMemcpyHtoDAsync_v2 / cuMemcpyHtoDAsync_v2_ptsz, |pt| fn(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    stream: Handle,
) {
    copy_async(stream, pt, Dir::HtoD, dst, src as u64, n)
});
entry_pt!(cuMemcpyDtoHAsync_v2 / cuMemcpyDtoHAsync_v2_ptsz, |pt| fn(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    stream: Handle,
) {
    copy_async(stream, pt, Dir::DtoH, dst as u64, src, n)
});
entry_pt!(cuMemcpyDtoDAsync_v2 / cuMemcpyDtoDAsync_v2_ptsz, |pt| fn(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    stream: Handle,
) {
    copy_async(stream, pt, Dir::DtoD, dst, src, n)
});
entry_pt!(cuMemcpyAsync / cuMemcpyAsync_ptsz, |pt| fn(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: Handle) {
    copy_async(stream, pt, Dir::Any, dst, src, n)
});
entry_pt!(cuMemcpyPeer / cuMemcpyPeer_ptds, |pt| fn(
    dst: CUdeviceptr,
    _dst_ctx: Handle,
    src: CUdeviceptr,
    _src_ctx: Handle,
    n: usize,
) {
    copy_sync(pt, Dir::DtoD, dst, src, n)
});
entry_pt!(cuMemcpyPeerAsync / cuMemcpyPeerAsync_ptsz, |pt| fn(
    dst: CUdeviceptr,
    _dst_ctx: Handle,
    src: CUdeviceptr,
    _src_ctx: Handle,
    n: usize,
    stream: Handle,
) {
    copy_async(stream, pt, Dir::DtoD, dst, src, n)
});

/// Resolve one side of a 2D copy to its start address (`CUmemorytype`: 1 host, 2 device,
/// 3 array, 4 unified).
fn side(kind: c_uint, host: u64, device: u64, x: usize, y: usize, pitch: usize) -> CuResult<u64> {
    let base = match kind {
        1 => host,
        2 | 4 => device,
        3 => return Err(CUDA_ERROR_NOT_SUPPORTED),
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    Ok(base + (y * pitch + x) as u64)
}

fn copy_2d(p: *const CUDA_MEMCPY2D, sync_stream: Option<(Handle, bool)>) -> CuResult {
    let p = get(p)?;
    if p.Height > 1 && (p.srcPitch < p.WidthInBytes || p.dstPitch < p.WidthInBytes) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let src = side(
        p.srcMemoryType,
        p.srcHost as u64,
        p.srcDevice,
        p.srcXInBytes,
        p.srcY,
        p.srcPitch,
    )?;
    let dst = side(
        p.dstMemoryType,
        p.dstHost as u64,
        p.dstDevice,
        p.dstXInBytes,
        p.dstY,
        p.dstPitch,
    )?;
    let d = driver()?;
    let fence = {
        let mut st = d.lock();
        for row in 0..p.Height as u64 {
            let (s, t) = (src + row * p.srcPitch as u64, dst + row * p.dstPitch as u64);
            if p.srcMemoryType == CU_MEMORYTYPE_DEVICE {
                check_dev(&st, s, p.WidthInBytes)?;
            }
            if p.dstMemoryType == CU_MEMORYTYPE_DEVICE {
                check_dev(&st, t, p.WidthInBytes)?;
            }
        }
        match sync_stream {
            Some((h, pt)) => {
                let s = st.resolve_stream(&d.client, h, pt)?;
                st.check_not_capturing(s)?;
                Some(st.fence(&d.client, s)?)
            }
            None => None,
        }
    };
    if let Some(f) = fence {
        d.client.wait(vec![f])?;
    }
    for row in 0..p.Height as u64 {
        copy_bytes(
            dst + row * p.dstPitch as u64,
            src + row * p.srcPitch as u64,
            p.WidthInBytes,
        );
    }
    Ok(())
}

entry_pt!(cuMemcpy2D_v2 / cuMemcpy2D_v2_ptds, |pt| fn(p: *const CUDA_MEMCPY2D) {
    copy_2d(p, Some((std::ptr::null_mut(), pt)))
});
entry_pt!(cuMemcpy2DUnaligned_v2 / cuMemcpy2DUnaligned_v2_ptds, |pt| fn(p: *const CUDA_MEMCPY2D) {
    copy_2d(p, Some((std::ptr::null_mut(), pt)))
});
entry_pt!(cuMemcpy2DAsync_v2 / cuMemcpy2DAsync_v2_ptsz, |pt| fn(p: *const CUDA_MEMCPY2D, stream: Handle) {
    // Pageable destinations make it synchronous, as for 1D copies.
    let pageable_dst = get(p)?.dstMemoryType == CU_MEMORYTYPE_HOST;
    copy_2d(p, pageable_dst.then_some((stream, pt)))
});

/// Fill `height` rows of `width` elements, `pitch` bytes apart, after checking the range.
pub fn memset_checked(
    st: &State,
    dst: u64,
    value: u32,
    element_size: u32,
    width: usize,
    height: usize,
    pitch: usize,
) -> CuResult {
    let row_bytes = width * element_size as usize;
    let pitch = if height <= 1 { row_bytes } else { pitch };
    if height > 1 && pitch < row_bytes {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    for row in 0..height {
        check_dev(st, dst + (row * pitch) as u64, row_bytes)?;
    }
    for row in 0..height {
        let start = dst + (row * pitch) as u64;
        // SAFETY: the row lies inside a live allocation of this process (checked above).
        let bytes = unsafe { std::slice::from_raw_parts_mut(start as *mut u8, row_bytes) };
        match element_size {
            1 => bytes.fill(value as u8),
            2 => bytes
                .chunks_exact_mut(2)
                .for_each(|c| c.copy_from_slice(&(value as u16).to_ne_bytes())),
            _ => bytes
                .chunks_exact_mut(4)
                .for_each(|c| c.copy_from_slice(&value.to_ne_bytes())),
        }
    }
    Ok(())
}

/// A memset, asynchronous with respect to the host in every variant, as documented.
#[allow(clippy::too_many_arguments)]
fn memset(
    stream: Handle,
    pt: bool,
    dst: u64,
    value: u32,
    element_size: u32,
    width: usize,
    height: usize,
    pitch: usize,
) -> CuResult {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, stream, pt)?;
        let node = NodeKind::Memset {
            dst,
            value,
            element_size,
            width,
            height,
            pitch,
        };
        if capture_node(st, s, node)? {
            return Ok(());
        }
        memset_checked(st, dst, value, element_size, width, height, pitch)
    })
}

const NULL: Handle = std::ptr::null_mut();

entry_pt!(cuMemsetD8_v2 / cuMemsetD8_v2_ptds, |pt| fn(dst: CUdeviceptr, v: u8, n: usize) {
    memset(NULL, pt, dst, v as u32, 1, n, 1, 0)
});
entry_pt!(cuMemsetD16_v2 / cuMemsetD16_v2_ptds, |pt| fn(dst: CUdeviceptr, v: u16, n: usize) {
    memset(NULL, pt, dst, v as u32, 2, n, 1, 0)
});
entry_pt!(cuMemsetD32_v2 / cuMemsetD32_v2_ptds, |pt| fn(dst: CUdeviceptr, v: u32, n: usize) {
    memset(NULL, pt, dst, v, 4, n, 1, 0)
});
entry_pt!(cuMemsetD8Async / cuMemsetD8Async_ptsz, |pt| fn(dst: CUdeviceptr, v: u8, n: usize, s: Handle) {
    memset(s, pt, dst, v as u32, 1, n, 1, 0)
});
entry_pt!(cuMemsetD16Async / cuMemsetD16Async_ptsz, |pt| fn(dst: CUdeviceptr, v: u16, n: usize, s: Handle) {
    memset(s, pt, dst, v as u32, 2, n, 1, 0)
});
entry_pt!(cuMemsetD32Async / cuMemsetD32Async_ptsz, |pt| fn(dst: CUdeviceptr, v: u32, n: usize, s: Handle) {
    memset(s, pt, dst, v, 4, n, 1, 0)
});
entry_pt!(cuMemsetD2D8_v2 / cuMemsetD2D8_v2_ptds, |pt| fn(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize) {
    memset(NULL, pt, dst, v as u32, 1, w, h, pitch)
});
entry_pt!(cuMemsetD2D16_v2 / cuMemsetD2D16_v2_ptds, |pt| fn(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize) {
    memset(NULL, pt, dst, v as u32, 2, w, h, pitch)
});
entry_pt!(cuMemsetD2D32_v2 / cuMemsetD2D32_v2_ptds, |pt| fn(dst: CUdeviceptr, pitch: usize, v: u32, w: usize, h: usize) {
    memset(NULL, pt, dst, v, 4, w, h, pitch)
});
entry_pt!(cuMemsetD2D8Async / cuMemsetD2D8Async_ptsz, |pt| fn(
    dst: CUdeviceptr,
    pitch: usize,
    v: u8,
    w: usize,
    h: usize,
    s: Handle,
) {
    memset(s, pt, dst, v as u32, 1, w, h, pitch)
});
entry_pt!(cuMemsetD2D16Async / cuMemsetD2D16Async_ptsz, |pt| fn(
    dst: CUdeviceptr,
    pitch: usize,
    v: u16,
    w: usize,
    h: usize,
    s: Handle,
) {
    memset(s, pt, dst, v as u32, 2, w, h, pitch)
});
entry_pt!(cuMemsetD2D32Async / cuMemsetD2D32Async_ptsz, |pt| fn(
    dst: CUdeviceptr,
    pitch: usize,
    v: u32,
    w: usize,
    h: usize,
    s: Handle,
) {
    memset(s, pt, dst, v, 4, w, h, pitch)
});

/// Hints that change nothing on the simulated device, accepted for valid ranges.
fn check_managed_range(ptr: u64, len: usize) -> CuResult {
    with_state(|_, st| check_dev(st, ptr, len))
}

entry_pt!(cuMemPrefetchAsync / cuMemPrefetchAsync_ptsz, |_pt| fn(ptr: CUdeviceptr, n: usize, _dev: CUdevice, _s: Handle) {
    check_managed_range(ptr, n)
});
entry_pt!(cuMemPrefetchAsync_v2 / cuMemPrefetchAsync_v2_ptsz, |_pt| fn(
    ptr: CUdeviceptr,
    n: usize,
    _location: CUmemLocation,
    flags: c_uint,
    _s: Handle,
) {
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    check_managed_range(ptr, n)
});
entry!(
    fn cuMemAdvise(ptr: CUdeviceptr, n: usize, _advice: c_uint, _dev: CUdevice) {
        check_managed_range(ptr, n)
    }
);
entry!(
    fn cuMemAdvise_v2(ptr: CUdeviceptr, n: usize, _advice: c_uint, _location: CUmemLocation) {
        check_managed_range(ptr, n)
    }
);

// --- virtual memory management -------------------------------------------------------------
//
// As the driver documents: a physical allocation (cuMemCreate) is freed once every reference to
// its handle is released (cuMemRelease; cuMemRetainAllocationHandle adds one) AND every mapping
// of it is unmapped (cuMemUnmap), in either order. Arrays share the table, with one reference
// and no mappings.

/// A physical allocation: where it lives (`None`: host memory, not charged to a device), its
/// size, handle references and live mappings.
struct Physical {
    device: Option<u32>,
    bytes: u64,
    refs: u32,
    mappings: u32,
    /// Handle types it may be exported as (`requestedHandleTypes`).
    shareable: CUmemAllocationHandleType,
    /// Imported from another process's export: its memory is charged to the exporter.
    imported: bool,
}

#[derive(Default)]
struct Vmm {
    physical: std::collections::HashMap<u64, Physical>,
    /// Mapped ranges: base → (size, handle).
    mappings: std::collections::BTreeMap<u64, (usize, u64)>,
}

fn vmm() -> std::sync::MutexGuard<'static, Vmm> {
    static V: std::sync::OnceLock<std::sync::Mutex<Vmm>> = std::sync::OnceLock::new();
    V.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Record a new physical allocation (one reference, no mapping); its handle.
fn new_physical(d: &Driver, device: Option<u32>, bytes: u64) -> u64 {
    let h = d.lock().new_id();
    let p = Physical {
        device,
        bytes,
        refs: 1,
        mappings: 0,
        shareable: CU_MEM_HANDLE_TYPE_NONE,
        imported: false,
    };
    vmm().physical.insert(h, p);
    h
}

/// Free the physical allocation `h` if nothing references or maps it any more.
fn free_if_unused(d: &Driver, v: &mut Vmm, h: u64) -> CuResult {
    match v.physical.get(&h) {
        Some(p) if p.refs == 0 && p.mappings == 0 => {
            let p = v.physical.remove(&h).expect("present");
            match p.device {
                Some(dev) if !p.imported => uncharge(d, dev, p.bytes),
                _ => Ok(()),
            }
        }
        _ => Ok(()),
    }
}

/// Drop one reference to a cuMemCreate handle or an array (a handle without references is
/// invalid, even while its memory is still mapped).
fn release_handle(h: u64) -> CuResult {
    let d = driver()?;
    let mut v = vmm();
    match v.physical.get_mut(&h) {
        Some(p) if p.refs > 0 => p.refs -= 1,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    }
    free_if_unused(d, &mut v, h)
}

entry!(
    fn cuMemGetAllocationGranularity(
        gran: *mut usize,
        prop: *const CUmemAllocationProp,
        _option: c_uint,
    ) {
        get(prop)?;
        put(gran, VMM_GRANULARITY)
    }
);

entry!(
    fn cuMemCreate(out: *mut u64, size: usize, prop: *const CUmemAllocationProp, flags: u64) {
        let p = get(prop)?;
        let pinned = p.type_ == CU_MEM_ALLOCATION_TYPE_PINNED;
        if flags != 0 || !pinned || size == 0 || !size.is_multiple_of(VMM_GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = driver()?;
        // Host memory is not the device's: HOST ignores the id and cannot be shared between
        // processes; HOST_NUMA names a NUMA node (this host has one, node 0); any other location
        // (HOST_NUMA_CURRENT included) is not accepted for a physical allocation.
        let device = match p.location.type_ {
            CU_MEM_LOCATION_TYPE_DEVICE => Some(d.check_device(p.location.id)?),
            CU_MEM_LOCATION_TYPE_HOST if p.requestedHandleTypes == 0 => None,
            CU_MEM_LOCATION_TYPE_HOST_NUMA if p.location.id == 0 => None,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        if let Some(dev) = device {
            charge(d, dev, size as u64)?;
        }
        let h = new_physical(d, device, size as u64);
        if let Some(physical) = vmm().physical.get_mut(&h) {
            physical.shareable = p.requestedHandleTypes;
        }
        put(out, h).inspect_err(|_| {
            let _ = release_handle(h);
        })
    }
);

// Exported handles. A POSIX file descriptor names the allocation (a small record in a memfd:
// its device and size) so that another process can import it, as the driver documents; the
// imported handle maps memory of the exporter's size, charged once, to the exporter. Its bytes
// are not the exporter's: simulated device memory is each process's own host memory.

/// The record an exported descriptor holds.
const EXPORT_MAGIC: &[u8; 8] = b"GSVMMEXP";

entry!(
    fn cuMemExportToShareableHandle(
        out: *mut c_void,
        h: u64,
        handle_type: CUmemAllocationHandleType,
        flags: u64,
    ) {
        let (device, bytes) = {
            let v = vmm();
            let p = v.physical.get(&h).filter(|p| p.refs > 0);
            let p = p.ok_or(CUDA_ERROR_INVALID_VALUE)?;
            // Only a type requested at cuMemCreate can be exported.
            if flags != 0 || p.shareable & handle_type == 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            if handle_type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
                return Err(CUDA_ERROR_NOT_SUPPORTED);
            }
            (p.device.ok_or(CUDA_ERROR_INVALID_VALUE)?, p.bytes)
        };
        let mut record = EXPORT_MAGIC.to_vec();
        record.extend_from_slice(&device.to_le_bytes());
        record.extend_from_slice(&bytes.to_le_bytes());
        // SAFETY: memfd_create with a valid name; the descriptor is handed to the caller.
        let fd = unsafe { libc::memfd_create(c"gpushare-sim-vmm".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        // SAFETY: writes the record from a live buffer to the descriptor just created.
        let written = unsafe { libc::write(fd, record.as_ptr().cast(), record.len()) };
        if written != record.len() as isize {
            // SAFETY: the descriptor is ours and not handed out.
            unsafe { libc::close(fd) };
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        put(out.cast::<libc::c_int>(), fd)
    }
);

entry!(
    fn cuMemImportFromShareableHandle(
        out: *mut u64,
        os_handle: *mut c_void,
        handle_type: CUmemAllocationHandleType,
    ) {
        if handle_type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        // "the file descriptor ... cast to void *".
        let fd = os_handle as usize as libc::c_int;
        let mut record = [0u8; 20];
        // SAFETY: reads into a live buffer of its length from the caller's descriptor.
        let n = unsafe { libc::pread(fd, record.as_mut_ptr().cast(), record.len(), 0) };
        if n != record.len() as isize || &record[..8] != EXPORT_MAGIC {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let device = u32::from_le_bytes(record[8..12].try_into().expect("4 bytes"));
        let bytes = u64::from_le_bytes(record[12..20].try_into().expect("8 bytes"));
        let d = driver()?;
        let device = d.check_device(device as CUdevice)?;
        let h = new_physical(d, Some(device), bytes);
        if let Some(p) = vmm().physical.get_mut(&h) {
            p.imported = true;
            p.shareable = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        }
        put(out, h)
    }
);

entry!(
    fn cuMemRelease(h: u64) {
        release_handle(h)
    }
);

entry!(
    fn cuMemRetainAllocationHandle(out: *mut u64, addr: *mut c_void) {
        let mut v = vmm();
        let addr = addr as u64;
        let (&base, &(size, h)) = v
            .mappings
            .range(..=addr)
            .next_back()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if addr >= base + size as u64 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, h)?;
        v.physical.get_mut(&h).expect("a mapped handle").refs += 1;
        Ok(())
    }
);

entry!(
    fn cuMemAddressReserve(
        ptr: *mut CUdeviceptr,
        size: usize,
        _align: usize,
        _addr: CUdeviceptr,
        _flags: u64,
    ) {
        if size == 0 || !size.is_multiple_of(VMM_GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(ptr, map(size, false)?)
    }
);

entry!(
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) {
        with_state(|_, st| {
            if st
                .find_alloc(ptr, size)
                .is_some_and(|(_, a)| a.kind == AllocKind::Mapped)
            {
                return Err(CUDA_ERROR_INVALID_VALUE); // still mapped
            }
            Ok(())
        })?;
        unmap(ptr, size);
        Ok(())
    }
);

entry!(
    fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, h: u64, flags: u64) {
        let mut guard = vmm();
        let v = &mut *guard;
        let p = v.physical.get_mut(&h).filter(|p| p.refs > 0);
        let p = p.ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let end = ptr
            .checked_add(size as u64)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let overlaps = v
            .mappings
            .range(..end)
            .next_back()
            .is_some_and(|(&b, &(s, _))| b + s as u64 > ptr);
        if flags != 0 || overlaps || offset as u64 + size as u64 > p.bytes {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `ptr..ptr+size` lies in a range reserved by cuMemAddressReserve (PROT_NONE).
        let r =
            unsafe { libc::mprotect(ptr as *mut c_void, size, libc::PROT_READ | libc::PROT_WRITE) };
        if r != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        p.mappings += 1;
        // Host memory mapped for the device reports device 0, like pinned host memory.
        let device = p.device.unwrap_or(0);
        v.mappings.insert(ptr, (size, h));
        with_state(|_, st| {
            st.allocs.insert(
                ptr,
                Alloc {
                    size,
                    mapped: 0,
                    device,
                    charged: 0,
                    kind: AllocKind::Mapped,
                    arena: false,
                },
            );
            Ok(())
        })
    }
);

entry!(
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) {
        let d = driver()?;
        let mut v = vmm();
        // The range must be made of whole mappings, back to back, from `ptr` to `ptr + size`.
        let end = ptr
            .checked_add(size as u64)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let covered: Vec<(u64, usize, u64)> = v
            .mappings
            .range(ptr..end)
            .map(|(&b, &(s, h))| (b, s, h))
            .collect();
        let mut at = ptr;
        for &(b, s, _) in &covered {
            if b != at {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            at = b + s as u64;
        }
        if size == 0 || at != end {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        with_state(|_, st| {
            for &(b, _, _) in &covered {
                st.allocs.remove(&b);
            }
            Ok(())
        })?;
        // SAFETY: the range was mapped by cuMemMap; dropping its pages and access returns it to the
        // reserved state.
        unsafe {
            libc::madvise(ptr as *mut c_void, size, libc::MADV_DONTNEED);
            libc::mprotect(ptr as *mut c_void, size, libc::PROT_NONE);
        }
        for (b, _, h) in covered {
            v.mappings.remove(&b);
            v.physical.get_mut(&h).expect("a mapped handle").mappings -= 1;
            free_if_unused(d, &mut v, h)?;
        }
        Ok(())
    }
);

entry!(
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, _desc: *const c_void, count: usize) {
        if count == 0 || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // The range must be mapped throughout; it may span several mappings back to back (the
        // caching allocator of PyTorch grants access to a whole segment at once).
        let end = ptr
            .checked_add(size as u64)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let v = vmm();
        let mut at = match v.mappings.range(..=ptr).next_back() {
            Some((&b, &(s, _))) if b + s as u64 > ptr => b + s as u64,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        for (&b, &(s, _)) in v.mappings.range(ptr + 1..end) {
            if b != at {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            at = b + s as u64;
        }
        if at < end {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }
);

// --- arrays --------------------------------------------------------------------------------

/// Arrays own device memory but no address: they are charged and tracked by handle.
fn array_create(out: *mut Handle, bytes: usize) -> CuResult {
    if bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let d = driver()?;
    let device = d.lock().current_device()?;
    charge(d, device, bytes as u64)?;
    let h = new_physical(d, Some(device), bytes as u64);
    put(out, handle(h))
}

entry!(
    fn cuArrayCreate_v2(out: *mut Handle, desc: *const CUDA_ARRAY_DESCRIPTOR) {
        let d = get(desc)?;
        array_create(out, d.bytes().ok_or(CUDA_ERROR_INVALID_VALUE)?)
    }
);

entry!(
    fn cuArray3DCreate_v2(out: *mut Handle, desc: *const CUDA_ARRAY3D_DESCRIPTOR) {
        let d = get(desc)?;
        array_create(out, d.bytes().ok_or(CUDA_ERROR_INVALID_VALUE)?)
    }
);

entry!(
    fn cuMipmappedArrayCreate(
        out: *mut Handle,
        desc: *const CUDA_ARRAY3D_DESCRIPTOR,
        levels: c_uint,
    ) {
        let d = get(desc)?;
        let total = mipmapped_bytes(&d, levels).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        array_create(out, total)
    }
);

entry!(
    fn cuArrayDestroy(h: Handle) {
        release_handle(id(h))
    }
);
entry!(
    fn cuMipmappedArrayDestroy(h: Handle) {
        release_handle(id(h))
    }
);
