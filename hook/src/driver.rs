//! Typed, safe wrappers over the hook's own driver (and thread) calls (the gate's fences and drains, the
//! process's device discovery, the memory pools' reservations): the one place outside the exported symbols where the hook calls
//! the driver, so the layers above hold no `unsafe`. Capture-safety is `crate::real`'s
//! (`own_*` calls); a missing entry point reads as a failed call.

use crate::real;
use gpushare_cuda_abi::result::{CUDA_ERROR_NOT_READY, CUDA_SUCCESS};
use gpushare_cuda_abi::types::{CU_EVENT_BLOCKING_SYNC, CUuuid};
use std::ffi::c_void;

/// A context or event handle the hook keeps (driver handles are valid from any thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handle(*mut c_void);

impl Handle {
    /// The handle an application passed (to a call that destroys it).
    pub fn from_raw(p: *mut c_void) -> Handle {
        Handle(p)
    }

    /// The handle as a number (a key in the hook's books), and back.
    pub fn key(self) -> u64 {
        self.0 as u64
    }

    pub fn from_key(key: u64) -> Handle {
        Handle(key as *mut c_void)
    }

    /// No handle (tests of the bookkeeping around handles).
    #[cfg(test)]
    pub fn null() -> Handle {
        Handle(std::ptr::null_mut())
    }
}

// SAFETY: driver handles are opaque values the driver accepts from any thread of the process.
unsafe impl Send for Handle {}
// SAFETY: as above; a `Handle` is never dereferenced.
unsafe impl Sync for Handle {}

/// A stream as the application passed it (never kept past the call).
pub type Stream = *mut c_void;

/// The hook's fences are `CU_EVENT_BLOCKING_SYNC`: a thread waiting for one sleeps instead of
/// spinning a core (they are waited for by launchers and drains, never on a latency path).
const EVENT_BLOCKING_SYNC: u32 = CU_EVENT_BLOCKING_SYNC;

/// The number of devices the driver shows this process.
pub fn device_count() -> Option<usize> {
    let get = real::cuDeviceGetCount()?;
    let mut n = 0;
    // SAFETY: real driver entry point with a valid out-pointer.
    (unsafe { get(&mut n) } == CUDA_SUCCESS && n > 0).then_some(n as usize)
}

/// Device `dev`'s UUID: `cuDeviceGetUuid_v2` where the driver has it (the first version gives
/// every MIG slice its GPU's UUID), else the first version.
pub fn device_uuid(dev: usize) -> Option<[u8; 16]> {
    let get = real::cuDeviceGetUuid_v2().or_else(real::cuDeviceGetUuid)?;
    let mut uuid = CUuuid { bytes: [0; 16] };
    // SAFETY: valid out-pointer and device ordinal.
    (unsafe { get(&mut uuid, dev as i32) } == CUDA_SUCCESS).then(|| uuid.bytes.map(|b| b as u8))
}

/// Device `dev`'s memory in all, as the driver says (the hook's own `cuDeviceTotalMem_v2`
/// would report the group's cap).
pub fn device_total_memory(dev: usize) -> Option<u64> {
    let get = real::cuDeviceTotalMem_v2()?;
    let mut bytes = 0usize;
    // SAFETY: real driver entry point with a valid out-pointer and device ordinal.
    (unsafe { get(&mut bytes, dev as i32) } == CUDA_SUCCESS).then_some(bytes as u64)
}

/// The device of the calling thread's current context.
pub fn current_device() -> Option<usize> {
    let get = real::cuCtxGetDevice()?;
    let mut dev = 0;
    // SAFETY: real driver entry point with a valid out-pointer.
    (unsafe { get(&mut dev) } == CUDA_SUCCESS && dev >= 0).then_some(dev as usize)
}

/// The calling thread's current context.
pub fn current_context() -> Option<Handle> {
    let get = real::cuCtxGetCurrent()?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: real driver call with a valid out-pointer.
    (unsafe { get(&mut ctx) } == CUDA_SUCCESS && !ctx.is_null()).then_some(Handle(ctx))
}

/// A new fence event in the calling thread's current context.
pub fn event_create() -> Option<Handle> {
    let create = real::cuEventCreate()?;
    let mut e = std::ptr::null_mut();
    // SAFETY: valid out-pointer; flags as documented.
    (unsafe { create(&mut e, EVENT_BLOCKING_SYNC) } == CUDA_SUCCESS && !e.is_null())
        .then_some(Handle(e))
}

/// What became of a fence's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    Yes,
    /// Not recorded, the event is fine (e.g. the stream is being captured).
    No,
    /// Not recorded: the event (or its context) no longer exists.
    Dead,
}

/// Record `event` on `stream` (a `_ptsz` entry point's stream if `per_thread`).
pub fn event_record(event: Handle, stream: Stream, per_thread: bool) -> Recorded {
    const INVALID_CONTEXT: u32 = 201;
    const INVALID_HANDLE: u32 = 400;
    const CONTEXT_IS_DESTROYED: u32 = 709;
    let record = if per_thread {
        real::cuEventRecord_ptsz()
    } else {
        real::cuEventRecord()
    };
    // SAFETY: the hook's own event, on a stream the application launched on.
    match record.map(|r| unsafe { r(event.0, stream) }) {
        Some(CUDA_SUCCESS) => Recorded::Yes,
        Some(INVALID_CONTEXT | INVALID_HANDLE | CONTEXT_IS_DESTROYED) => Recorded::Dead,
        _ => Recorded::No,
    }
}

/// Whether `event`'s work has completed: `Some(true)` done, `Some(false)` not yet, `None` the
/// query failed.
pub fn event_done(event: Handle) -> Option<bool> {
    let query = real::cuEventQuery()?;
    // SAFETY: the hook's own event.
    match unsafe { query(event.0) } {
        CUDA_SUCCESS => Some(true),
        CUDA_ERROR_NOT_READY => Some(false),
        _ => None,
    }
}

/// Wait for `event`; false if the wait failed.
pub fn event_wait(event: Handle) -> bool {
    // SAFETY: the hook's own event.
    real::cuEventSynchronize().is_some_and(|s| unsafe { s(event.0) } == CUDA_SUCCESS)
}

/// Milliseconds of GPU time between two completed events of the same context.
pub fn event_elapsed_ms(start: Handle, end: Handle) -> Option<f32> {
    let elapsed = real::cuEventElapsedTime()?;
    let mut ms = 0f32;
    // SAFETY: valid out-pointer; the hook's own events.
    (unsafe { elapsed(&mut ms, start.0, end.0) } == CUDA_SUCCESS).then_some(ms)
}

/// Wait for all work of `ctx`, from whatever thread this is.
pub fn synchronize_context(ctx: Handle) {
    let (Some(push), Some(sync), Some(pop)) = (
        real::cuCtxPushCurrent_v2(),
        real::cuCtxSynchronize(),
        real::cuCtxPopCurrent_v2(),
    ) else {
        return;
    };
    let mut popped = std::ptr::null_mut();
    // SAFETY: push/pop are balanced; `ctx` is a context this process launched into.
    unsafe {
        if push(ctx.0) == CUDA_SUCCESS {
            sync();
            pop(&mut popped);
        }
    }
}

/// The calling thread's id (a per-thread default stream is that thread's own).
pub fn thread_id() -> u64 {
    // SAFETY: pthread_self has no preconditions.
    (unsafe { libc::pthread_self() }) as u64
}

/// Wake this thread's timed waits on time (a watcher ends turns when it wakes at their
/// deadline), not up to the default 50 µs of timer slack late.
pub fn precise_timers() {
    // SAFETY: prctl(PR_SET_TIMERSLACK) only changes this thread's timer slack.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong) };
}

/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`, `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`.
const POOL_RESERVED_MEM_CURRENT: u32 = 5;
const POOL_USED_MEM_CURRENT: u32 = 7;

/// What memory pool `pool` reserves on its device, and how much of that live allocations use;
/// `None` if the driver cannot say (no pools, or the pool was destroyed).
pub fn pool_memory(pool: Handle) -> Option<(u64, u64)> {
    let get = real::cuMemPoolGetAttribute()?;
    let read = |attr| {
        let mut v = 0u64;
        // SAFETY: both attributes are `cuuint64_t`, written through a valid out-pointer.
        (unsafe { get(pool.0, attr, (&mut v as *mut u64).cast()) } == CUDA_SUCCESS).then_some(v)
    };
    Some((
        read(POOL_RESERVED_MEM_CURRENT)?,
        read(POOL_USED_MEM_CURRENT)?,
    ))
}

/// The current memory pool of device `dev`: where its `cuMemAllocAsync` allocations come from.
pub fn device_mem_pool(dev: usize) -> Option<Handle> {
    let get = real::cuDeviceGetMemPool()?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: valid out-pointer and device ordinal.
    (unsafe { get(&mut pool, dev as i32) } == CUDA_SUCCESS && !pool.is_null())
        .then_some(Handle(pool))
}
