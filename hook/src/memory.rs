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
use crate::real;
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
    let run = || {
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
    };
    crate::guarded(run)
}

/// Call the driver; if it succeeded, update the books and give back what `update` says the
/// call freed.
fn then_books(
    call: impl FnOnce() -> Option<CUresult>,
    update: impl FnOnce(&mut Held) -> Vec<(usize, u64)>,
) -> CUresult {
    let run = || {
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
    };
    crate::guarded(run)
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
    let run = || {
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
    };
    crate::guarded(run)
}

/// Free device memory through the driver: a plain allocation gives its bytes back; one from a
/// pool leaves them in the pool, charged until the pool releases them.
fn release_device(ptr: u64, free: impl FnOnce() -> Option<CUresult>) -> CUresult {
    let run = || {
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
    };
    crate::guarded(run)
}

/// Read a caller's struct or an out-pointer the driver has just written (`None` if null).
fn read<T: Copy>(p: *const T) -> Option<T> {
    // SAFETY: non-null pointers here are the caller's valid arguments or out-pointers the real
    // driver wrote on success.
    (!p.is_null()).then(|| unsafe { p.read_unaligned() })
}

// SAFETY (all wrappers below): the caller's arguments are forwarded unchanged to the real
// function of the same name and signature.

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> CUresult {
    allocate(
        None,
        Some(size),
        || real::cuMemAlloc_v2().map(|f| unsafe { f(dptr, size) }),
        || read(dptr).unwrap_or(0),
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut u64,
    pitch: *mut usize,
    w: usize,
    h: usize,
    elem: u32,
) -> CUresult {
    let bytes = w
        .div_ceil(PITCH_ALIGN)
        .checked_mul(PITCH_ALIGN)
        .and_then(|p| p.checked_mul(h));
    allocate(
        None,
        bytes,
        || real::cuMemAllocPitch_v2().map(|f| unsafe { f(dptr, pitch, w, h, elem) }),
        || read(dptr).unwrap_or(0),
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocManaged(dptr: *mut u64, size: usize, flags: u32) -> CUresult {
    allocate(
        None,
        Some(size),
        || {
            if let Some(h) = hook() {
                charges::managed(h);
            }
            real::cuMemAllocManaged().map(|f| unsafe { f(dptr, size, flags) })
        },
        || read(dptr).unwrap_or(0),
    )
}

/// Exporting memory to another process: the scheduler learns it first (never a swap victim).
#[unsafe(no_mangle)]
pub extern "C" fn cuIpcGetMemHandle(handle: *mut CUipcMemHandle, dptr: u64) -> CUresult {
    let run = || {
        if let Some(h) = hook() {
            charges::ipc(h);
        }
        real::cuIpcGetMemHandle().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe { f(handle, dptr) })
    };
    crate::guarded(run)
}

/// Opening another process's memory: the scheduler learns it first (never a swap victim).
#[unsafe(no_mangle)]
pub extern "C" fn cuIpcOpenMemHandle(
    dptr: *mut u64,
    handle: CUipcMemHandle,
    flags: u32,
) -> CUresult {
    open_ipc(real::cuIpcOpenMemHandle, dptr, handle, flags)
}

/// [`cuIpcOpenMemHandle`] by its CUDA 11 name.
#[unsafe(no_mangle)]
pub extern "C" fn cuIpcOpenMemHandle_v2(
    dptr: *mut u64,
    handle: CUipcMemHandle,
    flags: u32,
) -> CUresult {
    open_ipc(real::cuIpcOpenMemHandle_v2, dptr, handle, flags)
}

/// Both names of the IPC open through the driver's entry `real`, once the scheduler knows.
fn open_ipc(
    real: fn() -> Option<gpushare_cuda_abi::functions::PFN_cuIpcOpenMemHandle>,
    dptr: *mut u64,
    handle: CUipcMemHandle,
    flags: u32,
) -> CUresult {
    let run = || {
        if let Some(h) = hook() {
            charges::ipc(h);
        }
        real().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe {
            f(dptr, handle, flags)
        })
    };
    crate::guarded(run)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocAsync(dptr: *mut u64, size: usize, s: P) -> CUresult {
    allocate_pooled(
        None,
        size,
        || real::cuMemAllocAsync().map(|f| unsafe { f(dptr, size, s) }),
        || read(dptr).unwrap_or(0),
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocAsync_ptsz(dptr: *mut u64, size: usize, s: P) -> CUresult {
    allocate_pooled(
        None,
        size,
        || real::cuMemAllocAsync_ptsz().map(|f| unsafe { f(dptr, size, s) }),
        || read(dptr).unwrap_or(0),
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocFromPoolAsync(dptr: *mut u64, size: usize, pool: P, s: P) -> CUresult {
    allocate_pooled(
        Some(pool).filter(|p| !p.is_null()),
        size,
        || real::cuMemAllocFromPoolAsync().map(|f| unsafe { f(dptr, size, pool, s) }),
        || read(dptr).unwrap_or(0),
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut u64,
    size: usize,
    pool: P,
    s: P,
) -> CUresult {
    allocate_pooled(
        Some(pool).filter(|p| !p.is_null()),
        size,
        || real::cuMemAllocFromPoolAsync_ptsz().map(|f| unsafe { f(dptr, size, pool, s) }),
        || read(dptr).unwrap_or(0),
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    let Some(p) = read(prop) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    let create = || real::cuMemCreate().map(|f| unsafe { f(handle, size, prop, flags) });
    // Host memory (NCCL's host buffers) is not the GPU's: not charged.
    if p.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
        return create().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
    }
    // The allocation is on the device the properties name, not the current context's.
    let gpu = (p.location.id >= 0).then_some(p.location.id as usize);
    let gpu = gpu.filter(|&g| hook().is_some_and(|h| g < h.gates.len()));
    allocate_into(gpu, Some(size), create, |held, gpu, bytes| {
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
#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    then_books(
        || real::cuMemRelease().map(|f| unsafe { f(handle) }),
        |held| {
            if let Some(p) = held.physical.get_mut(&handle) {
                p.refs = p.refs.saturating_sub(1);
            }
            held.take_unused(handle).into_iter().collect()
        },
    )
}

/// The handle of a mapped address, with one more reference (released by its own cuMemRelease).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemRetainAllocationHandle(handle: *mut u64, addr: P) -> CUresult {
    then_books(
        || real::cuMemRetainAllocationHandle().map(|f| unsafe { f(handle, addr) }),
        |held| {
            if let Some(p) = read(handle).and_then(|h| held.physical.get_mut(&h)) {
                p.refs += 1;
            }
            Vec::new()
        },
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(
    ptr: u64,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> CUresult {
    then_books(
        || real::cuMemMap().map(|f| unsafe { f(ptr, size, offset, handle, flags) }),
        |held| {
            if let Some(p) = held.physical.get_mut(&handle) {
                p.mappings += 1;
                held.mappings.insert(ptr, (size, handle));
            }
            Vec::new()
        },
    )
}

/// Unmaps every mapping in the range; those that were the last use of their memory give it back.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(ptr: u64, size: usize) -> CUresult {
    then_books(
        || real::cuMemUnmap().map(|f| unsafe { f(ptr, size) }),
        |held| {
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
        },
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuArrayCreate_v2(arr: *mut P, desc: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult {
    let d = read(desc);
    let bytes = d.and_then(|d| d.bytes());
    allocate(
        None,
        bytes,
        || real::cuArrayCreate_v2().map(|f| unsafe { f(arr, desc) }),
        || read(arr).map_or(0, |a| a as u64),
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuArray3DCreate_v2(
    arr: *mut P,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    let d = read(desc);
    let bytes = d.and_then(|d| d.bytes());
    allocate(
        None,
        bytes,
        || real::cuArray3DCreate_v2().map(|f| unsafe { f(arr, desc) }),
        || read(arr).map_or(0, |a| a as u64),
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMipmappedArrayCreate(
    arr: *mut P,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: u32,
) -> CUresult {
    let d = read(desc);
    let bytes = d.and_then(|d| mipmapped_bytes(&d, levels));
    allocate(
        None,
        bytes,
        || real::cuMipmappedArrayCreate().map(|f| unsafe { f(arr, desc, levels) }),
        || read(arr).map_or(0, |a| a as u64),
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(ptr: u64) -> CUresult {
    release_device(ptr, || real::cuMemFree_v2().map(|f| unsafe { f(ptr) }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync(ptr: u64, s: P) -> CUresult {
    release_device(ptr, || real::cuMemFreeAsync().map(|f| unsafe { f(ptr, s) }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync_ptsz(ptr: u64, s: P) -> CUresult {
    release_device(ptr, || {
        real::cuMemFreeAsync_ptsz().map(|f| unsafe { f(ptr, s) })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuArrayDestroy(arr: P) -> CUresult {
    release(arr as u64, || {
        real::cuArrayDestroy().map(|f| unsafe { f(arr) })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMipmappedArrayDestroy(arr: P) -> CUresult {
    release(arr as u64, || {
        real::cuMipmappedArrayDestroy().map(|f| unsafe { f(arr) })
    })
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

#[unsafe(no_mangle)]
pub extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let run = || {
        let r = real::cuMemGetInfo_v2()
            .map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe { f(free, total) });
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
    };
    crate::guarded(run)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: i32) -> CUresult {
    let run = || {
        let r = real::cuDeviceTotalMem_v2()
            .map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe { f(bytes, dev) });
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
    };
    crate::guarded(run)
}
