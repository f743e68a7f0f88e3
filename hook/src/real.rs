//! The real driver and the real `dlsym`.
//!
//! `dlsym` is overridden by this library, so the real one is fetched with `dlvsym` by its GLIBC
//! version (2.34 where dlsym moved into libc, else the architecture's base version). The driver
//! is `dlopen`ed from `GPUSHARE_REAL_LIBCUDA` or as `libcuda.so.1` and never closed. Each real
//! function pointer is resolved once and cached in an atomic.

use std::ffi::{CStr, c_char, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, Ordering};

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
/// `Option<unsafe extern "C" fn(..) -> u32>`.
macro_rules! real_fns {
    ($($name:ident: fn($($arg:ty),*);)*) => {
        $(
            #[allow(non_snake_case)]
            pub fn $name() -> Option<unsafe extern "C" fn($($arg),*) -> u32> {
                static F: RealFn = RealFn::new(
                    // SAFETY: the literal is NUL-terminated by construction.
                    unsafe { CStr::from_bytes_with_nul_unchecked(concat!(stringify!($name), "\0").as_bytes()) }
                );
                let p = F.get();
                // SAFETY: the driver exports `$name` with exactly this C signature (cuda.h).
                (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> u32>(p) })
            }
        )*
    };
}

type P = *mut c_void;

real_fns! {
    cuDeviceGetCount: fn(*mut i32);
    cuDeviceGetUuid: fn(*mut [u8; 16], i32);
    cuCtxGetCurrent: fn(*mut P);
    cuCtxGetDevice: fn(*mut i32);
    cuCtxPushCurrent_v2: fn(P);
    cuCtxPopCurrent_v2: fn(*mut P);
    cuCtxSynchronize: fn();
    cuEventCreate: fn(*mut P, u32);
    cuEventRecord: fn(P, P);
    cuEventRecord_ptsz: fn(P, P);
    cuEventSynchronize: fn(P);
    cuEventQuery: fn(P);
    cuStreamSynchronize: fn(P);
    cuStreamSynchronize_ptsz: fn(P);
    cuEventElapsedTime: fn(*mut f32, P, P);
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
    cuArrayDestroy: fn(P);
    cuMipmappedArrayDestroy: fn(P);
    cuMemGetInfo_v2: fn(*mut usize, *mut usize);
    cuDeviceTotalMem_v2: fn(*mut usize, i32);
    cuGetProcAddress_v2: fn(*const c_char, *mut P, i32, u64, *mut i32);
}
