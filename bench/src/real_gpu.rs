//! Is a real NVIDIA GPU on this machine? If so the benchmark runs there (unless told
//! `--simulated`) and measures from the tenants' timelines, a GPU writing no trace.

use std::ffi::{CStr, c_int, c_void};

type CuInit = unsafe extern "C" fn(u32) -> c_int;
type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;

/// Number of devices the system's `libcuda.so.1` reports (`GPUSHARE_REAL_LIBCUDA` if set),
/// `None` when there is no driver or no device. Loaded with `RTLD_LOCAL` and never unloaded,
/// as the driver expects.
pub fn device_count() -> Option<u32> {
    let path = std::env::var("GPUSHARE_REAL_LIBCUDA").unwrap_or_else(|_| "libcuda.so.1".into());
    let path = std::ffi::CString::new(path).ok()?;
    // SAFETY: dlopen/dlsym with valid C strings; the symbols are called with the driver API's
    // documented signatures.
    unsafe {
        let lib = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if lib.is_null() {
            return None;
        }
        let sym = |name: &CStr| -> *mut c_void { libc::dlsym(lib, name.as_ptr()) };
        let (init, count) = (sym(c"cuInit"), sym(c"cuDeviceGetCount"));
        if init.is_null() || count.is_null() {
            return None;
        }
        let init: CuInit = std::mem::transmute(init);
        let count: CuDeviceGetCount = std::mem::transmute(count);
        let mut n: c_int = 0;
        (init(0) == 0 && count(&mut n) == 0 && n > 0).then_some(n as u32)
    }
}
