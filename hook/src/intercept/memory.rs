//! GPU memory caps: every allocation path reserves against the group's cap before the real
//! allocation (from the process's lease, [`crate::charges`]: a round trip only when the lease
//! must grow) and rolls back if the driver then fails; frees give back to the lease.
//! Stream-ordered allocations are charged as their pool's reservation, which outlives their
//! frees until the pool releases it.
//! `cuMemGetInfo_v2` and `cuDeviceTotalMem_v2` report the cap and what is left of it, never
//! more than the device really has. Managed allocations and IPC exports and opens are told to
//! the scheduler first: such memory keeps the process's group from being swapped out.

use crate::books::{Held, Physical, Pooled};
use crate::charges;
use crate::driver;
use crate::process::{Hook, hook};
use gpushare_cuda_abi::arrays::mipmapped_bytes;
use gpushare_cuda_abi::result::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS,
};
use gpushare_cuda_abi::types::{
    CU_MEM_LOCATION_TYPE_DEVICE, CUDA_ARRAY_DESCRIPTOR, CUDA_ARRAY3D_DESCRIPTOR, CUipcMemHandle,
    CUmemAllocationProp, CUresult,
};
use std::ffi::c_void;

type P = *mut c_void;
/// Pitch alignment assumed when reserving for cuMemAllocPitch (the real pitch is known after).
const PITCH_ALIGN: usize = 512;

/// Reserve, allocate, then record the allocation under the key `key` reads from the driver's
/// out-pointer, or roll back.
fn allocate(
    gpu: Option<usize>,
    bytes: Option<usize>,
    alloc: impl FnOnce() -> Option<CUresult>,
    key: impl FnOnce() -> u64,
) -> CUresult {
    allocate_into(gpu, bytes, alloc, |held, gpu, bytes| {
        held.allocs.insert(key(), (gpu, bytes));
    })
}

/// [`allocate`], with `record` writing the books once the driver allocated.
fn allocate_into(
    gpu: Option<usize>,
    bytes: Option<usize>,
    alloc: impl FnOnce() -> Option<CUresult>,
    record: impl FnOnce(&mut Held, usize, u64),
) -> CUresult {
    let (Some(h), Some(bytes)) = (hook(), bytes) else {
        return alloc().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
    };
    let Some(gpu) = gpu.or_else(|| h.current_index()) else {
        return alloc().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
    };
    let bytes = bytes as u64;
    if !charges::draw(h, gpu, bytes) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let r = alloc().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
    if r == CUDA_SUCCESS {
        record(&mut h.memory.lock(), gpu, bytes);
    } else {
        charges::release(h, gpu, bytes);
    }
    r
}

/// Call the driver; if it succeeded, update the books and give back what `update` says the
/// call freed.
fn then_books(
    call: impl FnOnce() -> Option<CUresult>,
    update: impl FnOnce(&mut Held) -> Vec<(usize, u64)>,
) -> CUresult {
    let r = call().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
    if r == CUDA_SUCCESS
        && let Some(h) = hook()
    {
        let freed = update(&mut h.memory.lock());
        for (gpu, bytes) in freed {
            charges::release(h, gpu, bytes);
        }
    }
    r
}

/// Free through the driver, then give back what the allocation `key` held.
fn release(key: u64, free: impl FnOnce() -> Option<CUresult>) -> CUresult {
    then_books(free, |held| held.allocs.remove(&key).into_iter().collect())
}

/// A stream-ordered allocation of `size` bytes from `pool` (`None`: the current device's
/// current pool, where `cuMemAllocAsync` allocates): charged through the pool's reservation
/// ([`charges::pool_alloc`]), or as a plain allocation where the driver cannot tell what a
/// pool reserves.
fn allocate_pooled(
    pool: Option<P>,
    size: usize,
    alloc: impl FnOnce() -> Option<CUresult>,
    key: impl FnOnce() -> u64,
) -> CUresult {
    let Some(h) = hook() else {
        return alloc().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
    };
    let Some(gpu) = h.current_index() else {
        return alloc().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
    };
    let pool = pool
        .map(driver::Handle::from_raw)
        .or_else(|| driver::device_mem_pool(gpu));
    let Some(pool) = pool.filter(|&p| driver::pool_memory(p).is_some()) else {
        return allocate(Some(gpu), Some(size), alloc, key);
    };
    let allocated = charges::pool_alloc(h, gpu, pool, size as u64, || {
        let r = alloc().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        if r == CUDA_SUCCESS {
            let p = Pooled {
                pool: pool.key(),
                bytes: size as u64,
            };
            h.memory.lock().pooled.insert(key(), p);
        }
        r
    });
    allocated.unwrap_or(CUDA_ERROR_OUT_OF_MEMORY)
}

/// Free device memory through the driver: a plain allocation gives its bytes back; one from a
/// pool leaves them in the pool, charged until the pool releases them.
fn release_device(ptr: u64, free: impl FnOnce() -> Option<CUresult>) -> CUresult {
    let r = free().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
    if r == CUDA_SUCCESS
        && let Some(h) = hook()
    {
        let (plain, pooled) = {
            let mut held = h.memory.lock();
            (held.allocs.remove(&ptr), held.pooled.remove(&ptr))
        };
        if let Some((gpu, bytes)) = plain {
            charges::release(h, gpu, bytes);
        }
        if let Some(p) = pooled {
            charges::pool_freed(h, p.pool);
        }
    }
    r
}

/// Read a caller's struct or an out-pointer the driver has just written (`None` if null).
fn read<T: Copy>(p: *const T) -> Option<T> {
    // SAFETY: non-null pointers here are the caller's valid arguments or out-pointers the real
    // driver wrote on success.
    (!p.is_null()).then(|| unsafe { p.read_unaligned() })
}

/// Share memory with another process (an IPC export or open) once the scheduler knows: such
/// memory keeps the process's group from being swapped out.
fn shared(call: impl FnOnce() -> Option<CUresult>) -> CUresult {
    if let Some(h) = hook() {
        charges::ipc(h);
    }
    call().unwrap_or(CUDA_ERROR_NOT_INITIALIZED)
}

/// The bytes `cuMemAllocPitch` reserves for rows of `w` bytes, `h` of them (the real pitch is
/// known after).
fn pitched_bytes(w: usize, h: usize) -> Option<usize> {
    w.div_ceil(PITCH_ALIGN)
        .checked_mul(PITCH_ALIGN)
        .and_then(|p| p.checked_mul(h))
}

/// The group's cap on gate `gpu`, if it has one, and what is left of it for this process: the
/// group's use counts this process's leased spare, which is this process's to allocate. The
/// pools' charges are brought up to date first (a synchronisation may have released bytes).
fn cap_of(h: &'static Hook, gpu: usize) -> Option<(u64, u64)> {
    charges::reconcile_pools(h, gpu);
    let (cap, used) = charges::query(h, gpu)?;
    let others = used.saturating_sub(charges::spare(h, gpu));
    cap.map(|cap| (cap, cap.saturating_sub(others)))
}

hooked! {
    fn cuMemAlloc_v2(dptr: *mut u64, size: usize) |real| {
        allocate(None, Some(size), real, || read(dptr).unwrap_or(0))
    }

    fn cuMemAllocPitch_v2(dptr: *mut u64, pitch: *mut usize, w: usize, h: usize, elem: u32)
        |real| {
        allocate(None, pitched_bytes(w, h), real, || read(dptr).unwrap_or(0))
    }

    fn cuMemAllocManaged(dptr: *mut u64, size: usize, flags: u32) |real| {
        let alloc = || {
            if let Some(h) = hook() {
                charges::managed(h);
            }
            real()
        };
        allocate(None, Some(size), alloc, || read(dptr).unwrap_or(0))
    }

    /// Exporting memory to another process: the scheduler learns it first (never a swap
    /// victim).
    fn cuIpcGetMemHandle(handle: *mut CUipcMemHandle, dptr: u64) |real| { shared(real) }

    /// Opening another process's memory: the scheduler learns it first (never a swap victim).
    fn cuIpcOpenMemHandle(dptr: *mut u64, handle: CUipcMemHandle, flags: u32) |real| {
        shared(real)
    }

    /// [`cuIpcOpenMemHandle`] by its CUDA 11 name.
    fn cuIpcOpenMemHandle_v2(dptr: *mut u64, handle: CUipcMemHandle, flags: u32) |real| {
        shared(real)
    }

    fn cuMemAllocAsync(dptr: *mut u64, size: usize, s: P) |real| {
        allocate_pooled(None, size, real, || read(dptr).unwrap_or(0))
    }

    fn cuMemAllocAsync_ptsz(dptr: *mut u64, size: usize, s: P) |real| {
        allocate_pooled(None, size, real, || read(dptr).unwrap_or(0))
    }

    fn cuMemAllocFromPoolAsync(dptr: *mut u64, size: usize, pool: P, s: P) |real| {
        let pool = Some(pool).filter(|p| !p.is_null());
        allocate_pooled(pool, size, real, || read(dptr).unwrap_or(0))
    }

    fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut u64, size: usize, pool: P, s: P) |real| {
        let pool = Some(pool).filter(|p| !p.is_null());
        allocate_pooled(pool, size, real, || read(dptr).unwrap_or(0))
    }

    fn cuMemCreate(handle: *mut u64, size: usize, prop: *const CUmemAllocationProp, flags: u64)
        |real| {
        let Some(p) = read(prop) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        // Host memory (NCCL's host buffers) is not the GPU's: not charged.
        if p.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return real().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        }
        // The allocation is on the device the properties name, not the current context's.
        let gpu = (p.location.id >= 0).then_some(p.location.id as usize);
        let gpu = gpu.filter(|&g| hook().is_some_and(|h| g < h.gates.len()));
        allocate_into(gpu, Some(size), real, |held, gpu, bytes| {
            let p = Physical {
                gpu,
                bytes,
                refs: 1,
                mappings: 0,
            };
            held.physical.insert(read(handle).unwrap_or(0), p);
        })
    }

    /// One reference fewer; the memory is given back once no reference or mapping is left.
    fn cuMemRelease(handle: u64) |real| {
        then_books(real, |held| {
            if let Some(p) = held.physical.get_mut(&handle) {
                p.refs = p.refs.saturating_sub(1);
            }
            held.take_unused(handle).into_iter().collect()
        })
    }

    /// The handle of a mapped address, with one more reference (released by its own
    /// cuMemRelease).
    fn cuMemRetainAllocationHandle(handle: *mut u64, addr: P) |real| {
        then_books(real, |held| {
            if let Some(p) = read(handle).and_then(|h| held.physical.get_mut(&h)) {
                p.refs += 1;
            }
            Vec::new()
        })
    }

    fn cuMemMap(ptr: u64, size: usize, offset: usize, handle: u64, flags: u64) |real| {
        then_books(real, |held| {
            if let Some(p) = held.physical.get_mut(&handle) {
                p.mappings += 1;
                held.mappings.insert(ptr, (size, handle));
            }
            Vec::new()
        })
    }

    /// Unmaps every mapping in the range; those that were the last use of their memory give it
    /// back.
    fn cuMemUnmap(ptr: u64, size: usize) |real| {
        then_books(real, |held| {
            let end = ptr.saturating_add(size as u64);
            let bases: Vec<u64> = held.mappings.range(ptr..end).map(|(&b, _)| b).collect();
            let mut freed = Vec::new();
            for base in bases {
                let Some((_, handle)) = held.mappings.remove(&base) else {
                    continue;
                };
                if let Some(p) = held.physical.get_mut(&handle) {
                    p.mappings = p.mappings.saturating_sub(1);
                }
                freed.extend(held.take_unused(handle));
            }
            freed
        })
    }

    fn cuArrayCreate_v2(arr: *mut P, desc: *const CUDA_ARRAY_DESCRIPTOR) |real| {
        let bytes = read(desc).and_then(|d| d.bytes());
        allocate(None, bytes, real, || read(arr).map_or(0, |a| a as u64))
    }

    fn cuArray3DCreate_v2(arr: *mut P, desc: *const CUDA_ARRAY3D_DESCRIPTOR) |real| {
        let bytes = read(desc).and_then(|d| d.bytes());
        allocate(None, bytes, real, || read(arr).map_or(0, |a| a as u64))
    }

    fn cuMipmappedArrayCreate(arr: *mut P, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: u32)
        |real| {
        let bytes = read(desc).and_then(|d| mipmapped_bytes(&d, levels));
        allocate(None, bytes, real, || read(arr).map_or(0, |a| a as u64))
    }

    fn cuMemFree_v2(ptr: u64) |real| { release_device(ptr, real) }

    fn cuMemFreeAsync(ptr: u64, s: P) |real| { release_device(ptr, real) }

    fn cuMemFreeAsync_ptsz(ptr: u64, s: P) |real| { release_device(ptr, real) }

    fn cuArrayDestroy(arr: P) |real| { release(arr as u64, real) }

    fn cuMipmappedArrayDestroy(arr: P) |real| { release(arr as u64, real) }

    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) |real| {
        let r = real().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        if r != CUDA_SUCCESS || free.is_null() || total.is_null() {
            return r;
        }
        if let Some(h) = hook()
            && let Some(gpu) = h.current_index()
            && let Some((cap, left)) = cap_of(h, gpu)
        {
            // SAFETY: both out-pointers are non-null and were just written by the driver.
            unsafe {
                let real_total = *total as u64;
                let real_free = *free as u64;
                *total = cap.min(real_total) as usize;
                *free = left.min(real_free) as usize;
            }
        }
        r
    }

    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: i32) |real| {
        let r = real().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        if r != CUDA_SUCCESS || bytes.is_null() || dev < 0 {
            return r;
        }
        if let Some(h) = hook()
            && (dev as usize) < h.gates.len()
            && let Some((cap, _)) = cap_of(h, dev as usize)
        {
            // SAFETY: non-null out-pointer just written by the driver.
            unsafe { *bytes = (cap as usize).min(*bytes) };
        }
        r
    }
}
