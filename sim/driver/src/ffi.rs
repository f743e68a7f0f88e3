//! C types of the driver API and the helpers every entry point uses to cross the FFI boundary
//! safely: no panic escapes, null pointers become `CUDA_ERROR_INVALID_VALUE`.
//!
//! The types, constants and records are cuda.h's, generated into `gpushare_cuda_abi::types`;
//! every entry point is checked at compile time against the type cuda.h gives its symbol.

use std::ffi::{CStr, c_char, c_void};

pub use gpushare_cuda_abi::types::*;

/// `CUlaunchAttribute` as cuda.h declares it: the attribute's id, padding to 8 bytes, then the
/// 64-byte `CUlaunchAttributeValue` union, read here as words (a cluster dimension is its first
/// three: x, y, z).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LaunchAttribute {
    pub id: CUlaunchAttributeID,
    _pad: u32,
    pub value: [u32; 16],
}
const _: () = assert!(std::mem::size_of::<LaunchAttribute>() == 72);

/// Opaque handles: our object ids, cast to pointers.
pub type Handle = *mut c_void;

/// A driver call's outcome before it becomes a `CUresult`.
pub type CuResult<T = ()> = Result<T, CUresult>;

/// A host function (`CUhostFn`, once known not to be null).
pub type HostFn = unsafe extern "C" fn(*mut c_void);
/// A stream callback (`CUstreamCallback`, once known not to be null).
pub type StreamCallback = unsafe extern "C" fn(CUstream, CUresult, *mut c_void);

/// Run an entry point's body, turning its error or a panic into a `CUresult`.
pub fn guard(f: impl FnOnce() -> CuResult) -> CUresult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Whether `GPUSHARE_SIM_TRACE` asks for every driver call on stderr.
pub fn tracing_calls() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("GPUSHARE_SIM_TRACE").is_some_and(|v| v != "0"))
}

/// [`guard`] for the exported entry point `name`, traced when `GPUSHARE_SIM_TRACE` is set.
/// A `gated` entry point waits while a checkpoint holds the process locked.
pub fn entry_point(name: &str, gated: bool, f: impl FnOnce() -> CuResult) -> CUresult {
    let _pass = gated.then(crate::checkpoint::Pass::enter);
    let r = guard(f);
    if tracing_calls() {
        eprintln!("gpushare-sim libcuda: {name} -> {r}");
    }
    r
}

/// Export a driver entry point. The body returns [`CuResult`]; pointer arguments are only
/// touched through the helpers below. The function must have the type cuda.h gives the symbol
/// (`gpushare_cuda_abi::pfn::NAME`): one typed otherwise does not build.
macro_rules! entry {
    ($(#[$m:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($($arg: $ty),*) -> $crate::ffi::CUresult {
            const GATED: bool = $crate::ffi::gated(stringify!($name));
            $crate::ffi::entry_point(stringify!($name), GATED, || -> $crate::ffi::CuResult { $body })
        }
        // The entry point has the type cuda.h gives the symbol, or the driver does not build.
        const _: gpushare_cuda_abi::pfn::$name = $name;
    };
}

/// Whether entry point `name` waits while a checkpoint holds the process locked: every one but
/// the checkpoint calls (a locked process may still act on others) and the error names.
pub const fn gated(name: &str) -> bool {
    !(starts_with(name, "cuCheckpoint") || starts_with(name, "cuGetError"))
}

const fn starts_with(s: &str, prefix: &str) -> bool {
    let (s, p) = (s.as_bytes(), prefix.as_bytes());
    if s.len() < p.len() {
        return false;
    }
    let mut i = 0;
    while i < p.len() {
        if s[i] != p[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Export a stream-ordered entry point twice: legacy default stream semantics under `$legacy`
/// and per-thread default stream semantics under `$per_thread` (`_ptsz`/`_ptds`). The body sees
/// `$pt: bool`.
macro_rules! entry_pt {
    ($legacy:ident / $per_thread:ident, |$pt:ident| fn($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        entry!(fn $legacy($($arg: $ty),*) {
            let $pt = false;
            $body
        });
        entry!(fn $per_thread($($arg: $ty),*) {
            let $pt = true;
            $body
        });
    };
}

/// Store `value` through an out-pointer.
pub fn put<T>(ptr: *mut T, value: T) -> CuResult {
    if ptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller passed a non-null out-pointer for a `T`, as the API contract requires.
    unsafe { ptr.write_unaligned(value) };
    Ok(())
}

/// Read a `T` the caller passed by pointer.
pub fn get<T: Copy>(ptr: *const T) -> CuResult<T> {
    if ptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller passed a non-null pointer to a valid `T`, as the API contract requires.
    Ok(unsafe { ptr.read_unaligned() })
}

/// Borrow a caller's NUL-terminated string.
pub fn c_str<'a>(ptr: *const c_char) -> CuResult<&'a CStr> {
    if ptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null and NUL-terminated per the API contract.
    Ok(unsafe { CStr::from_ptr(ptr) })
}

/// Borrow `len` elements the caller passed by pointer (empty when `len` is 0).
pub fn slice<'a, T>(ptr: *const T, len: usize) -> CuResult<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller promises `len` valid elements at `ptr`.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// Copy host bytes between caller-provided addresses (validated by the caller of this helper).
pub fn copy_bytes(dst: u64, src: u64, len: usize) {
    if len == 0 {
        return;
    }
    // SAFETY: both ranges were checked to lie inside live allocations or caller host buffers;
    // `copy` tolerates overlap, as cuMemcpy between overlapping ranges of one buffer may.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
}

pub fn handle(id: u64) -> Handle {
    id as usize as Handle
}

pub fn id(h: Handle) -> u64 {
    h as usize as u64
}
