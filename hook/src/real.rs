//! The real driver and the real `dlsym`.
//!
//! `dlsym` is overridden by this library, so the real one is fetched with `dlvsym` by its GLIBC
//! version (2.34 where dlsym moved into libc, else the architecture's base version). The driver
//! is `dlopen`ed from `GPUSHARE_REAL_LIBCUDA` or as `libcuda.so.1` and never closed. Each real
//! function pointer is resolved once and cached in an atomic. The hook's own calls (what the gate
//! and its queue use) are capture-safe, and stop when the process exits, before the driver's
//! teardown.

use gpushare_cuda_abi::pfn;
use gpushare_cuda_abi::result::{
    CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    CUDA_SUCCESS,
};
use gpushare_cuda_abi::types::{
    CU_STREAM_CAPTURE_MODE_RELAXED, CU_STREAM_CAPTURE_STATUS_NONE, CUresult, CUstreamCaptureStatus,
};
use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicUsize, Ordering};
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

/// Declare accessors for real driver functions, typed by cuda.h: `real::cuFoo()` returns
/// `Option<PFN_cuFoo>` (`gpushare_cuda_abi::pfn::cuFoo`); `raw_cuFoo => cuFoo` names the
/// accessor of `cuFoo` `raw_cuFoo` (where the plain name is the hook's own, capture-safe, use of
/// it). These are the hook's own uses; each hooked symbol's wrapper has its own accessor
/// (`intercept::hooked!`).
macro_rules! real_fns {
    () => {};
    ($acc:ident => $sym:ident; $($rest:tt)*) => {
        real_fn!(pub fn $acc = $sym);
        real_fns!($($rest)*);
    };
    ($sym:ident; $($rest:tt)*) => {
        real_fn!(pub fn $sym = $sym);
        real_fns!($($rest)*);
    };
}

/// Declare `fn acc() -> Option<pfn::sym>`: the real driver's `sym`, resolved once.
macro_rules! real_fn {
    ($vis:vis fn $acc:ident = $sym:ident) => {
        #[allow(non_snake_case)]
        $vis fn $acc() -> Option<gpushare_cuda_abi::pfn::$sym> {
            static F: $crate::real::RealFn = $crate::real::RealFn::new(
                // SAFETY: the literal is NUL-terminated by construction.
                unsafe {
                    std::ffi::CStr::from_bytes_with_nul_unchecked(
                        concat!(stringify!($sym), "\0").as_bytes(),
                    )
                },
            );
            let p = F.get();
            // SAFETY: the driver exports the symbol with the C signature cuda.h declares, which
            // is what `pfn::$sym` is generated from.
            (!p.is_null()).then(|| unsafe {
                std::mem::transmute::<*mut std::ffi::c_void, gpushare_cuda_abi::pfn::$sym>(p)
            })
        }
    };
}
pub(crate) use real_fn;

type P = *mut c_void;

real_fns! {
    cuDeviceGetCount;
    cuDeviceGetUuid;
    // The GPU's UUID as `nvidia-smi -L` and `CUDA_VISIBLE_DEVICES` name it (CUDA 11.4+): on a
    // MIG instance, the instance's own, where `cuDeviceGetUuid` gives its parent GPU's, so two
    // instances of one GPU would share one scheduler queue.
    cuDeviceGetUuid_v2;
    raw_cuCtxGetCurrent => cuCtxGetCurrent;
    cuCtxGetDevice;
    raw_cuCtxPushCurrent_v2 => cuCtxPushCurrent_v2;
    raw_cuCtxPopCurrent_v2 => cuCtxPopCurrent_v2;
    raw_cuCtxSynchronize => cuCtxSynchronize;
    raw_cuEventCreate => cuEventCreate;
    raw_cuEventRecord => cuEventRecord;
    raw_cuEventRecord_ptsz => cuEventRecord_ptsz;
    raw_cuEventSynchronize => cuEventSynchronize;
    raw_cuEventQuery => cuEventQuery;
    raw_cuEventElapsedTime => cuEventElapsedTime;
    cuMemPoolGetAttribute;
    cuDeviceGetMemPool;
    cuDeviceTotalMem_v2;
    cuGraphGetNodes;
    cuGraphNodeGetType;
    cuStreamIsCapturing;
    cuStreamIsCapturing_ptsz;
    cuThreadExchangeStreamCaptureMode;
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
    let mut status: CUstreamCaptureStatus = CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: real driver call with a valid out-pointer; the stream is the caller's.
    query.is_some_and(|q| unsafe { q(stream, &mut status) } == CUDA_SUCCESS)
        && status != CU_STREAM_CAPTURE_STATUS_NONE
}

/// Run one of the hook's own driver calls in the relaxed capture mode while captures are under
/// way, so that it is never a prohibited call that invalidates the application's capture.
fn relaxed(call: impl FnOnce() -> CUresult) -> CUresult {
    let Some(exchange) = cuThreadExchangeStreamCaptureMode().filter(|_| captures_active()) else {
        return call();
    };
    let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: real driver call with a valid in/out pointer; the old mode is restored below.
    if unsafe { exchange(&mut mode) } != CUDA_SUCCESS {
        return call();
    }
    let r = call();
    // SAFETY: as above, putting back the thread's own mode.
    unsafe { exchange(&mut mode) };
    r
}

/// What the hook's own call answers itself instead of disturbing a capture.
const CAPTURE_UNSUPPORTED: CUresult = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
const NOT_INITIALIZED: CUresult = CUDA_ERROR_NOT_INITIALIZED;
/// What the hook's own call answers itself once the process is exiting ("the driver is
/// shutting down").
const DEINITIALIZED: CUresult = CUDA_ERROR_DEINITIALIZED;

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
/// The hook's own driver calls under way (a call begun before the exit is let finish).
static IN_FLIGHT: AtomicU32 = AtomicU32::new(0);
/// The longest [`at_exit`] waits for calls under way (a drain's wait for a kernel that waits
/// on a peer may not end soon): the driver's teardown is not held up longer.
const EXIT_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// No new call of the hook's own from now on, and the ones under way finish (within
/// [`EXIT_WAIT`]) before the driver's own exit handler, which runs after this one, tears down.
extern "C" fn at_exit() {
    // SeqCst with `own`: either a call sees the exit, or this sees the call under way.
    EXITING.store(true, Ordering::SeqCst);
    let start = std::time::Instant::now();
    while IN_FLIGHT.load(Ordering::SeqCst) != 0 && start.elapsed() < EXIT_WAIT {
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// Register [`at_exit`], once per process (a forked child inherits it).
fn watch_exit() {
    static REGISTERED: Once = Once::new();
    // SAFETY: registers a handler that only uses atomics and sleeps.
    REGISTERED.call_once(|| unsafe {
        libc::atexit(at_exit);
    });
}

/// Run one of the hook's own driver calls, unless the process is exiting.
fn own(call: impl FnOnce() -> CUresult) -> CUresult {
    IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
    let r = if EXITING.load(Ordering::SeqCst) {
        DEINITIALIZED
    } else {
        call()
    };
    IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    r
}

/// Declare the hook's own use of a driver function: `real::NAME()` hands out `own`, a function
/// of the same signature (checked against cuda.h's at compile time), once the real one (`raw`)
/// exists; asking for it registers the exit handler first (see above).
macro_rules! own_call {
    ($(#[$m:meta])* $name:ident = $raw:ident => $own:ident) => {
        $(#[$m])*
        #[allow(non_snake_case)]
        pub fn $name() -> Option<pfn::$name> {
            const OWN: pfn::$name = $own;
            watch_exit();
            $raw().map(|_| OWN)
        }
    };
}

own_call!(
    /// The hook's fence: never recorded in a capturing stream (it would become a graph node,
    /// and waiting for it would invalidate the capture); the gate then fences a later launch.
    cuEventRecord = raw_cuEventRecord => own_event_record
);
own_call!(cuEventRecord_ptsz = raw_cuEventRecord_ptsz => own_event_record_ptsz);
own_call!(
    /// A drain's wait for a whole context: while a capture is under way it would invalidate
    /// the capture, so until the capture ends the drain relies on its fences alone.
    cuCtxSynchronize = raw_cuCtxSynchronize => own_ctx_synchronize
);
own_call!(cuEventSynchronize = raw_cuEventSynchronize => own_event_synchronize);
own_call!(cuEventQuery = raw_cuEventQuery => own_event_query);
own_call!(cuEventCreate = raw_cuEventCreate => own_event_create);
own_call!(cuEventElapsedTime = raw_cuEventElapsedTime => own_elapsed);
own_call!(cuCtxGetCurrent = raw_cuCtxGetCurrent => own_ctx_get_current);
own_call!(cuCtxPushCurrent_v2 = raw_cuCtxPushCurrent_v2 => own_ctx_push);
own_call!(cuCtxPopCurrent_v2 = raw_cuCtxPopCurrent_v2 => own_ctx_pop);

fn record(raw: Option<pfn::cuEventRecord>, event: P, stream: P, per_thread: bool) -> CUresult {
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

unsafe extern "C" fn own_event_record(event: P, stream: P) -> CUresult {
    record(raw_cuEventRecord(), event, stream, false)
}

unsafe extern "C" fn own_event_record_ptsz(event: P, stream: P) -> CUresult {
    record(raw_cuEventRecord_ptsz(), event, stream, true)
}

unsafe extern "C" fn own_ctx_synchronize() -> CUresult {
    own(|| {
        if captures_active() {
            return CAPTURE_UNSUPPORTED;
        }
        // SAFETY: real driver call without arguments.
        raw_cuCtxSynchronize().map_or(NOT_INITIALIZED, |f| unsafe { f() })
    })
}

unsafe extern "C" fn own_event_synchronize(event: P) -> CUresult {
    // SAFETY: the hook's own fence event.
    own(|| raw_cuEventSynchronize().map_or(NOT_INITIALIZED, |f| relaxed(|| unsafe { f(event) })))
}

unsafe extern "C" fn own_event_query(event: P) -> CUresult {
    // SAFETY: the hook's own fence event.
    own(|| raw_cuEventQuery().map_or(NOT_INITIALIZED, |f| relaxed(|| unsafe { f(event) })))
}

unsafe extern "C" fn own_event_create(event: *mut P, flags: u32) -> CUresult {
    // SAFETY: the hook's own out-pointer.
    own(|| raw_cuEventCreate().map_or(NOT_INITIALIZED, |f| relaxed(|| unsafe { f(event, flags) })))
}

unsafe extern "C" fn own_elapsed(ms: *mut f32, start: P, end: P) -> CUresult {
    own(|| {
        // SAFETY: the hook's own out-pointer and fence events.
        raw_cuEventElapsedTime().map_or(NOT_INITIALIZED, |f| {
            relaxed(|| unsafe { f(ms, start, end) })
        })
    })
}

unsafe extern "C" fn own_ctx_get_current(ctx: *mut P) -> CUresult {
    // SAFETY: the hook's own out-pointer.
    own(|| raw_cuCtxGetCurrent().map_or(NOT_INITIALIZED, |f| unsafe { f(ctx) }))
}

unsafe extern "C" fn own_ctx_push(ctx: P) -> CUresult {
    // SAFETY: a context the application launched into (the drain pops it again).
    own(|| raw_cuCtxPushCurrent_v2().map_or(NOT_INITIALIZED, |f| unsafe { f(ctx) }))
}

unsafe extern "C" fn own_ctx_pop(ctx: *mut P) -> CUresult {
    // SAFETY: the hook's own out-pointer, after its own push.
    own(|| raw_cuCtxPopCurrent_v2().map_or(NOT_INITIALIZED, |f| unsafe { f(ctx) }))
}
