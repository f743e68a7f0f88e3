//! The real driver and the real `dlsym`.
//!
//! `dlsym` is overridden by this library, so the real one is fetched with `dlvsym` by its GLIBC
//! version (2.34 where dlsym moved into libc, else the architecture's base version). The driver
//! is `dlopen`ed from `GPUSHARE_REAL_LIBCUDA` or as `libcuda.so.1` and never closed. Each real
//! function pointer is resolved once and cached in an atomic. The hook's own calls (what the gate
//! and its queue use) are capture-safe, and stop when the process exits, before the driver's
//! teardown.

use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// The C library's `dlsym`.
pub fn dlsym() -> Option<DlsymFn> {
    static REAL: OnceLock<usize> = OnceLock::new();
    let p = *REAL.get_or_init(|| {
        let versions: &[&CStr] = if cfg!(target_arch = "aarch64") {
            &[c"GLIBC_2.34", c"GLIBC_2.17"]
        } else {
            &[c"GLIBC_2.34", c"GLIBC_2.2.5"]
        };
        for v in versions {
            // SAFETY: dlvsym with RTLD_NEXT and static NUL-terminated strings; it is not
            // overridden here, so this cannot recurse.
            let p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), v.as_ptr()) };
            if !p.is_null() {
                return p as usize;
            }
        }
        0
    });
    // SAFETY: a non-zero value is the address of glibc's dlsym, which has this signature.
    (p != 0).then(|| unsafe { std::mem::transmute::<usize, DlsymFn>(p) })
}

/// Handle of the real driver library.
fn driver() -> *mut c_void {
    static HANDLE: OnceLock<usize> = OnceLock::new();
    *HANDLE.get_or_init(|| {
        let path = std::env::var("GPUSHARE_REAL_LIBCUDA").unwrap_or_else(|_| "libcuda.so.1".into());
        let Ok(c) = std::ffi::CString::new(path) else {
            return 0;
        };
        // SAFETY: dlopen of a NUL-terminated path; the handle is kept for the process lifetime.
        unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) as usize }
    }) as *mut c_void
}

/// Address of the real driver's `name`, or null.
pub fn symbol(name: &CStr) -> *mut c_void {
    let (Some(dlsym), handle) = (dlsym(), driver()) else {
        return std::ptr::null_mut();
    };
    if handle.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: valid handle and NUL-terminated name.
    unsafe { dlsym(handle, name.as_ptr()) }
}

/// Resolve-once cache for one real function.
pub struct RealFn(AtomicPtr<c_void>, &'static CStr);

impl RealFn {
    pub const fn new(name: &'static CStr) -> RealFn {
        RealFn(AtomicPtr::new(std::ptr::null_mut()), name)
    }

    pub fn get(&self) -> *mut c_void {
        let p = self.0.load(Ordering::Relaxed);
        if !p.is_null() {
            return p;
        }
        let p = symbol(self.1);
        self.0.store(p, Ordering::Relaxed);
        p
    }
}

/// Declare typed accessors for real driver functions: `real::cuFoo()` returns
/// `Option<unsafe extern "C" fn(..) -> u32>`; `raw_cuFoo => cuFoo: fn(..)` names the accessor
/// of `cuFoo` `raw_cuFoo` (where the plain name is the hook's own, capture-safe, use of it).
macro_rules! real_fns {
    ($($acc:ident $(=> $sym:ident)?: fn($($arg:ty),*);)*) => {
        $(
            #[allow(non_snake_case)]
            pub fn $acc() -> Option<unsafe extern "C" fn($($arg),*) -> u32> {
                static F: RealFn = RealFn::new(
                    // SAFETY: the literal is NUL-terminated by construction.
                    unsafe { CStr::from_bytes_with_nul_unchecked(concat!(real_fns!(@sym $acc $($sym)?), "\0").as_bytes()) }
                );
                let p = F.get();
                // SAFETY: the driver exports the symbol with exactly this C signature (cuda.h).
                (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> u32>(p) })
            }
        )*
    };
    (@sym $acc:ident $sym:ident) => { stringify!($sym) };
    (@sym $acc:ident) => { stringify!($acc) };
}

type P = *mut c_void;

real_fns! {
    cuDeviceGetCount: fn(*mut i32);
    cuDeviceGetUuid: fn(*mut [u8; 16], i32);
    // The GPU's UUID as `nvidia-smi -L` and `CUDA_VISIBLE_DEVICES` name it (CUDA 11.4+): on a
    // MIG instance, the instance's own, where `cuDeviceGetUuid` gives its parent GPU's, so two
    // instances of one GPU would share one scheduler queue.
    cuDeviceGetUuid_v2: fn(*mut [u8; 16], i32);
    raw_cuCtxGetCurrent => cuCtxGetCurrent: fn(*mut P);
    cuCtxGetDevice: fn(*mut i32);
    raw_cuCtxPushCurrent_v2 => cuCtxPushCurrent_v2: fn(P);
    raw_cuCtxPopCurrent_v2 => cuCtxPopCurrent_v2: fn(*mut P);
    raw_cuCtxSynchronize => cuCtxSynchronize: fn();
    raw_cuEventCreate => cuEventCreate: fn(*mut P, u32);
    raw_cuEventRecord => cuEventRecord: fn(P, P);
    raw_cuEventRecord_ptsz => cuEventRecord_ptsz: fn(P, P);
    raw_cuEventSynchronize => cuEventSynchronize: fn(P);
    raw_cuEventQuery => cuEventQuery: fn(P);
    cuStreamSynchronize: fn(P);
    cuStreamSynchronize_ptsz: fn(P);
    raw_cuEventElapsedTime => cuEventElapsedTime: fn(*mut f32, P, P);
    cuLaunchKernel: fn(P, u32, u32, u32, u32, u32, u32, u32, P, *mut P, *mut P);
    cuLaunchKernel_ptsz: fn(P, u32, u32, u32, u32, u32, u32, u32, P, *mut P, *mut P);
    cuLaunchKernelEx: fn(*const c_void, P, *mut P, *mut P);
    cuLaunchKernelEx_ptsz: fn(*const c_void, P, *mut P, *mut P);
    cuLaunchCooperativeKernel: fn(P, u32, u32, u32, u32, u32, u32, u32, P, *mut P);
    cuLaunchCooperativeKernel_ptsz: fn(P, u32, u32, u32, u32, u32, u32, u32, P, *mut P);
    cuLaunchCooperativeKernelMultiDevice: fn(P, u32, u32);
    cuGraphLaunch: fn(P, P);
    cuGraphLaunch_ptsz: fn(P, P);
    cuGetProcAddress: fn(*const c_char, *mut P, i32, u64);
    cuMemAlloc_v2: fn(*mut u64, usize);
    cuMemAllocPitch_v2: fn(*mut u64, *mut usize, usize, usize, u32);
    cuMemAllocManaged: fn(*mut u64, usize, u32);
    cuMemAllocAsync: fn(*mut u64, usize, P);
    cuMemAllocAsync_ptsz: fn(*mut u64, usize, P);
    cuMemAllocFromPoolAsync: fn(*mut u64, usize, P, P);
    cuMemAllocFromPoolAsync_ptsz: fn(*mut u64, usize, P, P);
    cuMemCreate: fn(*mut u64, usize, *const c_void, u64);
    cuArrayCreate_v2: fn(*mut P, *const c_void);
    cuArray3DCreate_v2: fn(*mut P, *const c_void);
    cuMipmappedArrayCreate: fn(*mut P, *const c_void, u32);
    cuMemFree_v2: fn(u64);
    cuMemFreeAsync: fn(u64, P);
    cuMemFreeAsync_ptsz: fn(u64, P);
    cuMemRelease: fn(u64);
    cuMemRetainAllocationHandle: fn(*mut u64, P);
    cuMemMap: fn(u64, usize, usize, u64, u64);
    cuMemUnmap: fn(u64, usize);
    cuArrayDestroy: fn(P);
    cuMipmappedArrayDestroy: fn(P);
    cuMemGetInfo_v2: fn(*mut usize, *mut usize);
    cuMemPoolGetAttribute: fn(P, u32, *mut c_void);
    cuDeviceGetMemPool: fn(*mut P, i32);
    cuDeviceTotalMem_v2: fn(*mut usize, i32);
    cuGetProcAddress_v2: fn(*const c_char, *mut P, i32, u64, *mut i32);
    cuGraphInstantiate: fn(*mut P, P, *mut P, *mut c_char, usize);
    cuGraphInstantiate_v2: fn(*mut P, P, *mut P, *mut c_char, usize);
    cuGraphInstantiateWithFlags: fn(*mut P, P, u64);
    cuGraphInstantiateWithParams: fn(*mut P, P, P);
    cuGraphInstantiateWithParams_ptsz: fn(*mut P, P, P);
    cuGraphExecDestroy: fn(P);
    cuGraphGetNodes: fn(P, *mut P, *mut usize);
    cuGraphNodeGetType: fn(P, *mut u32);
    cuStreamBeginCapture: fn(P);
    cuStreamBeginCapture_ptsz: fn(P);
    cuStreamBeginCapture_v2: fn(P, i32);
    cuStreamBeginCapture_v2_ptsz: fn(P, i32);
    cuStreamBeginCaptureToGraph: fn(P, P, *const P, *const c_void, usize, i32);
    cuStreamBeginCaptureToGraph_ptsz: fn(P, P, *const P, *const c_void, usize, i32);
    cuStreamEndCapture: fn(P, *mut P);
    cuStreamEndCapture_ptsz: fn(P, *mut P);
    cuStreamIsCapturing: fn(P, *mut i32);
    cuStreamIsCapturing_ptsz: fn(P, *mut i32);
    cuThreadExchangeStreamCaptureMode: fn(*mut i32);
    cuCtxDestroy: fn(P);
    cuCtxDestroy_v2: fn(P);
    cuDevicePrimaryCtxRelease: fn(i32);
    cuDevicePrimaryCtxRelease_v2: fn(i32);
    cuDevicePrimaryCtxReset: fn(i32);
    cuDevicePrimaryCtxReset_v2: fn(i32);
}

// --- Stream capture: the hook's own driver calls never disturb an application's capture ------
//
// Work launched into a capturing stream becomes a graph node, not device work; and the driver
// invalidates a capture when its stream or context is synchronised, when an event recorded in
// it is waited for, or when a thread makes a potentially unsafe call while a global-mode
// capture is under way. So while this process has a capture under way, the hook's own calls
// (below: what the gate and its queue use) never fence a capturing stream, never synchronise a
// context, and run in the relaxed capture mode.

/// Stream captures begun in this process and not yet ended.
static CAPTURES: AtomicUsize = AtomicUsize::new(0);

/// A capture began (`cuStreamBeginCapture*` succeeded).
pub fn capture_begun() {
    CAPTURES.fetch_add(1, Ordering::AcqRel);
}

/// A capture ended (`cuStreamEndCapture` returned its graph or ended it with an error).
pub fn capture_ended() {
    let _ = CAPTURES.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
}

/// Whether a capture may be under way in this process (one atomic load when none is).
#[inline]
pub fn captures_active() -> bool {
    CAPTURES.load(Ordering::Acquire) != 0
}

/// Whether `stream` (a `_ptsz` entry point's if `per_thread`) is being captured.
pub fn stream_capturing(stream: P, per_thread: bool) -> bool {
    let query = if per_thread {
        cuStreamIsCapturing_ptsz()
    } else {
        cuStreamIsCapturing()
    };
    let mut status = 0i32;
    // SAFETY: real driver call with a valid out-pointer; the stream is the caller's.
    query.is_some_and(|q| unsafe { q(stream, &mut status) } == 0 && status != 0)
}

/// Run one of the hook's own driver calls in the relaxed capture mode while captures are under
/// way, so that it is never a prohibited call that invalidates the application's capture.
fn relaxed(call: impl FnOnce() -> u32) -> u32 {
    const RELAXED: i32 = 2; // CU_STREAM_CAPTURE_MODE_RELAXED
    let Some(exchange) = cuThreadExchangeStreamCaptureMode().filter(|_| captures_active()) else {
        return call();
    };
    let mut mode = RELAXED;
    // SAFETY: real driver call with a valid in/out pointer; the old mode is restored below.
    if unsafe { exchange(&mut mode) } != 0 {
        return call();
    }
    let r = call();
    // SAFETY: as above, putting back the thread's own mode.
    unsafe { exchange(&mut mode) };
    r
}

/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`: what the hook's own call answers itself instead of
/// disturbing a capture.
const CAPTURE_UNSUPPORTED: u32 = 900;
const NOT_INITIALIZED: u32 = 3;
/// `CUDA_ERROR_DEINITIALIZED` ("the driver is shutting down"): what the hook's own call answers
/// itself once the process is exiting.
const DEINITIALIZED: u32 = 4;

// --- Process exit: the hook's own calls stop before the driver tears down --------------------
//
// At exit the driver tears itself down, from an exit handler it registers when initialised,
// while the process's other threads — the hook's watcher and reader among them — go on running
// until the process ends; a driver call made then fails at best (`CUDA_ERROR_DEINITIALIZED`)
// and may crash or hang in a driver half torn down. So the hook registers an exit handler of
// its own before its first own driver call: exit handlers run in reverse order of registration,
// and the application has initialised the driver and made a context current before the hook
// makes any call of its own, so ours runs before the driver's teardown (whether the driver
// registers it at `cuInit` or at its first context). From then on the hook's own calls (below:
// what the gate and its queue use) answer `CUDA_ERROR_DEINITIALIZED` without calling the driver.
// The application's own calls, and the hook's wrappers of them, still go to the driver: exit
// handlers registered later (a runtime's teardown) may still use it.

/// Set by [`at_exit`]: the process is exiting.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Whether the process is exiting: the hook makes no driver call of its own any more.
#[inline]
pub fn shutting_down() -> bool {
    EXITING.load(Ordering::Acquire)
}

extern "C" fn at_exit() {
    EXITING.store(true, Ordering::Release);
}

/// Register [`at_exit`], once per process (a forked child inherits it).
fn watch_exit() {
    static REGISTERED: Once = Once::new();
    // SAFETY: registers a handler that only stores to an atomic.
    REGISTERED.call_once(|| unsafe {
        libc::atexit(at_exit);
    });
}

/// Run one of the hook's own driver calls, unless the process is exiting.
fn own(call: impl FnOnce() -> u32) -> u32 {
    if shutting_down() {
        return DEINITIALIZED;
    }
    call()
}

/// Declare the hook's own use of a driver function: `real::NAME()` hands out `own`, a function
/// of the same signature, once the real one (`raw`) exists; asking for it registers the exit
/// handler first (see above).
macro_rules! own_call {
    ($(#[$m:meta])* $name:ident($($arg:ident: $ty:ty),*) = $raw:ident => $own:ident) => {
        $(#[$m])*
        #[allow(non_snake_case)]
        pub fn $name() -> Option<unsafe extern "C" fn($($ty),*) -> u32> {
            watch_exit();
            $raw().map(|_| $own as unsafe extern "C" fn($($ty),*) -> u32)
        }
    };
}

own_call!(
    /// The hook's fence: never recorded in a capturing stream (it would become a graph node,
    /// and waiting for it would invalidate the capture); the gate then fences a later launch.
    cuEventRecord(event: P, stream: P) = raw_cuEventRecord => own_event_record
);
own_call!(cuEventRecord_ptsz(event: P, stream: P) = raw_cuEventRecord_ptsz => own_event_record_ptsz);
own_call!(
    /// A drain's wait for a whole context: while a capture is under way it would invalidate
    /// the capture, so until the capture ends the drain relies on its fences alone.
    cuCtxSynchronize() = raw_cuCtxSynchronize => own_ctx_synchronize
);
own_call!(cuEventSynchronize(event: P) = raw_cuEventSynchronize => own_event_synchronize);
own_call!(cuEventQuery(event: P) = raw_cuEventQuery => own_event_query);
own_call!(cuEventCreate(event: *mut P, flags: u32) = raw_cuEventCreate => own_event_create);
own_call!(
    cuEventElapsedTime(ms: *mut f32, start: P, end: P) = raw_cuEventElapsedTime => own_elapsed
);
own_call!(cuCtxGetCurrent(ctx: *mut P) = raw_cuCtxGetCurrent => own_ctx_get_current);
own_call!(cuCtxPushCurrent_v2(ctx: P) = raw_cuCtxPushCurrent_v2 => own_ctx_push);
own_call!(cuCtxPopCurrent_v2(ctx: *mut P) = raw_cuCtxPopCurrent_v2 => own_ctx_pop);

fn record(raw: Option<Fn2>, event: P, stream: P, per_thread: bool) -> u32 {
    let Some(raw) = raw else {
        return NOT_INITIALIZED;
    };
    own(|| {
        if captures_active() && stream_capturing(stream, per_thread) {
            return CAPTURE_UNSUPPORTED;
        }
        // SAFETY: the hook's own fence event, on a stream the application launched on.
        relaxed(|| unsafe { raw(event, stream) })
    })
}

type Fn2 = unsafe extern "C" fn(P, P) -> u32;

unsafe extern "C" fn own_event_record(event: P, stream: P) -> u32 {
    record(raw_cuEventRecord(), event, stream, false)
}

unsafe extern "C" fn own_event_record_ptsz(event: P, stream: P) -> u32 {
    record(raw_cuEventRecord_ptsz(), event, stream, true)
}

unsafe extern "C" fn own_ctx_synchronize() -> u32 {
    own(|| {
        if captures_active() {
            return CAPTURE_UNSUPPORTED;
        }
        // SAFETY: real driver call without arguments.
        raw_cuCtxSynchronize().map_or(NOT_INITIALIZED, |f| unsafe { f() })
    })
}

unsafe extern "C" fn own_event_synchronize(event: P) -> u32 {
    // SAFETY: the hook's own fence event.
    own(|| raw_cuEventSynchronize().map_or(NOT_INITIALIZED, |f| relaxed(|| unsafe { f(event) })))
}

unsafe extern "C" fn own_event_query(event: P) -> u32 {
    // SAFETY: the hook's own fence event.
    own(|| raw_cuEventQuery().map_or(NOT_INITIALIZED, |f| relaxed(|| unsafe { f(event) })))
}

unsafe extern "C" fn own_event_create(event: *mut P, flags: u32) -> u32 {
    // SAFETY: the hook's own out-pointer.
    own(|| raw_cuEventCreate().map_or(NOT_INITIALIZED, |f| relaxed(|| unsafe { f(event, flags) })))
}

unsafe extern "C" fn own_elapsed(ms: *mut f32, start: P, end: P) -> u32 {
    own(|| {
        // SAFETY: the hook's own out-pointer and fence events.
        raw_cuEventElapsedTime().map_or(NOT_INITIALIZED, |f| {
            relaxed(|| unsafe { f(ms, start, end) })
        })
    })
}

unsafe extern "C" fn own_ctx_get_current(ctx: *mut P) -> u32 {
    // SAFETY: the hook's own out-pointer.
    own(|| raw_cuCtxGetCurrent().map_or(NOT_INITIALIZED, |f| unsafe { f(ctx) }))
}

unsafe extern "C" fn own_ctx_push(ctx: P) -> u32 {
    // SAFETY: a context the application launched into (the drain pops it again).
    own(|| raw_cuCtxPushCurrent_v2().map_or(NOT_INITIALIZED, |f| unsafe { f(ctx) }))
}

unsafe extern "C" fn own_ctx_pop(ctx: *mut P) -> u32 {
    // SAFETY: the hook's own out-pointer, after its own push.
    own(|| raw_cuCtxPopCurrent_v2().map_or(NOT_INITIALIZED, |f| unsafe { f(ctx) }))
}
