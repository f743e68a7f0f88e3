//! The real driver and the real `dlsym`.
//!
//! `dlsym` is overridden by this library, so the real one is fetched with `dlvsym` by its GLIBC
//! version (2.34 where dlsym moved into libc, else the architecture's base version). The driver
//! is `dlopen`ed from `GPUSHARE_REAL_LIBCUDA` or as `libcuda.so.1` and never closed. Each real
//! function pointer is resolved once and cached in an atomic.

use std::ffi::{CStr, c_char, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

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
    cuDeviceGetUuid_v2: fn(*mut [u8; 16], i32);
    cuCtxGetCurrent: fn(*mut P);
    cuCtxGetDevice: fn(*mut i32);
    cuCtxPushCurrent_v2: fn(P);
    cuCtxPopCurrent_v2: fn(*mut P);
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

/// Declare the hook's own use of a driver function: `real::NAME()` hands out `own`, a function
/// of the same signature, once the real one (`raw`) exists.
macro_rules! own_call {
    ($(#[$m:meta])* $name:ident($($arg:ident: $ty:ty),*) = $raw:ident => $own:ident) => {
        $(#[$m])*
        #[allow(non_snake_case)]
        pub fn $name() -> Option<unsafe extern "C" fn($($ty),*) -> u32> {
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

fn record(raw: Option<Fn2>, event: P, stream: P, per_thread: bool) -> u32 {
    let Some(raw) = raw else {
        return NOT_INITIALIZED;
    };
    if captures_active() && stream_capturing(stream, per_thread) {
        return CAPTURE_UNSUPPORTED;
    }
    // SAFETY: the hook's own fence event, on a stream the application launched on.
    relaxed(|| unsafe { raw(event, stream) })
}

type Fn2 = unsafe extern "C" fn(P, P) -> u32;

unsafe extern "C" fn own_event_record(event: P, stream: P) -> u32 {
    record(raw_cuEventRecord(), event, stream, false)
}

unsafe extern "C" fn own_event_record_ptsz(event: P, stream: P) -> u32 {
    record(raw_cuEventRecord_ptsz(), event, stream, true)
}

unsafe extern "C" fn own_ctx_synchronize() -> u32 {
    if captures_active() {
        return CAPTURE_UNSUPPORTED;
    }
    // SAFETY: real driver call without arguments.
    raw_cuCtxSynchronize().map_or(NOT_INITIALIZED, |f| unsafe { f() })
}

unsafe extern "C" fn own_event_synchronize(event: P) -> u32 {
    // SAFETY: the hook's own fence event.
    raw_cuEventSynchronize().map_or(NOT_INITIALIZED, |f| relaxed(|| unsafe { f(event) }))
}

unsafe extern "C" fn own_event_query(event: P) -> u32 {
    // SAFETY: the hook's own fence event.
    raw_cuEventQuery().map_or(NOT_INITIALIZED, |f| relaxed(|| unsafe { f(event) }))
}

unsafe extern "C" fn own_event_create(event: *mut P, flags: u32) -> u32 {
    // SAFETY: the hook's own out-pointer.
    raw_cuEventCreate().map_or(NOT_INITIALIZED, |f| relaxed(|| unsafe { f(event, flags) }))
}

unsafe extern "C" fn own_elapsed(ms: *mut f32, start: P, end: P) -> u32 {
    // SAFETY: the hook's own out-pointer and fence events.
    raw_cuEventElapsedTime().map_or(NOT_INITIALIZED, |f| {
        relaxed(|| unsafe { f(ms, start, end) })
    })
}
