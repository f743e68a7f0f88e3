//! The FFI surface: every route by which an application reaches a launch entry point ends at
//! one of the wrappers here.
//! 1. direct linking: the `cu*` launch symbols are exported, and preloading puts them first;
//! 2. `dlsym(handle, "cuLaunchKernel")`: `dlsym` itself is exported and answers with a wrapper;
//! 3. `cuGetProcAddress`/`_v2`: the real driver resolves the name and ABI version, the shared
//!    version table (`gpushare-cuda-abi`) says which symbol that is, and a managed symbol is
//!    swapped for its wrapper.

use crate::client::{Hook, hook};
use crate::gate::Gate;
use crate::memory;
use crate::real;
use gpushare_cuda_abi::{Resolution, resolve};
use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int, c_void};

type P = *mut c_void;
type CUresult = u32;
const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// The hook and the gate of the current context's GPU (`None`: nothing to gate).
#[inline]
fn current_gate() -> Option<(&'static Hook, &'static Gate)> {
    hook().and_then(|h| Some((h, h.gate_for_current()?)))
}

/// Run a launch through the gate of the current GPU. Panics never cross into the caller.
#[inline]
fn gated(stream: Option<(P, bool)>, launch: impl FnOnce() -> Option<CUresult>) -> CUresult {
    let run = || {
        match current_gate() {
            Some((h, g)) => {
                if !g.enter(h) {
                    return CUDA_ERROR_NOT_PERMITTED;
                }
                let r = launch();
                g.leave(stream);
                r
            }
            None => launch(),
        }
        .unwrap_or(CUDA_ERROR_NOT_INITIALIZED)
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or(CUDA_ERROR_UNKNOWN)
}

macro_rules! launch_wrapper {
    ($name:ident, per_thread = $pt:expr, stream = $stream:ident, ($($arg:ident: $ty:ty),*)) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($($arg: $ty),*) -> CUresult {
            // SAFETY: forwards the caller's arguments unchanged to the real function of the same
            // name and signature.
            gated(Some(($stream, $pt)), || real::$name().map(|f| unsafe { f($($arg),*) }))
        }
    };
}

launch_wrapper!(cuLaunchKernel, per_thread = false, stream = s,
    (f: P, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: P, params: *mut P, extra: *mut P));
launch_wrapper!(cuLaunchKernel_ptsz, per_thread = true, stream = s,
    (f: P, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: P, params: *mut P, extra: *mut P));
launch_wrapper!(cuLaunchCooperativeKernel, per_thread = false, stream = s,
    (f: P, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: P, params: *mut P));
launch_wrapper!(cuLaunchCooperativeKernel_ptsz, per_thread = true, stream = s,
    (f: P, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: P, params: *mut P));
launch_wrapper!(cuGraphLaunch, per_thread = false, stream = s, (g: P, s: P));
launch_wrapper!(cuGraphLaunch_ptsz, per_thread = true, stream = s, (g: P, s: P));

/// Run a synchronisation, first letting the gate of the current GPU hand its token over if the
/// turn ends with the work being waited for, and telling it when the synchronisation returned.
fn synced(sync: impl FnOnce() -> Option<CUresult>) -> CUresult {
    let run = || {
        let gate = current_gate();
        if let Some((h, g)) = gate {
            g.before_sync(h);
        }
        let r = sync().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        if let Some((_, g)) = gate {
            g.after_sync();
        }
        r
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or(CUDA_ERROR_UNKNOWN)
}

macro_rules! sync_wrapper {
    ($name:ident, ($($arg:ident: $ty:ty),*)) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($($arg: $ty),*) -> CUresult {
            // SAFETY: forwards the caller's arguments unchanged to the real function of the same
            // name and signature.
            synced(|| real::$name().map(|f| unsafe { f($($arg),*) }))
        }
    };
}

sync_wrapper!(cuCtxSynchronize, ());
sync_wrapper!(cuStreamSynchronize, (s: P));
sync_wrapper!(cuStreamSynchronize_ptsz, (s: P));
sync_wrapper!(cuEventSynchronize, (e: P));

/// The stream of a `CUlaunchConfig` (grid, block, shared memory bytes, then the stream).
fn config_stream(config: *const c_void) -> P {
    if config.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: CUlaunchConfig starts with seven u32 fields, then (8-byte aligned) the stream.
    unsafe { *(config.cast::<u8>().add(32) as *const P) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernelEx(
    config: *const c_void,
    f: P,
    params: *mut P,
    extra: *mut P,
) -> CUresult {
    // SAFETY: forwards the caller's arguments unchanged.
    gated(Some((config_stream(config), false)), || {
        real::cuLaunchKernelEx().map(|r| unsafe { r(config, f, params, extra) })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const c_void,
    f: P,
    params: *mut P,
    extra: *mut P,
) -> CUresult {
    // SAFETY: forwards the caller's arguments unchanged.
    gated(Some((config_stream(config), true)), || {
        real::cuLaunchKernelEx_ptsz().map(|r| unsafe { r(config, f, params, extra) })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchCooperativeKernelMultiDevice(list: P, n: u32, flags: u32) -> CUresult {
    // One launch per device in one call: gated on the current GPU, not paced per stream.
    // SAFETY: forwards the caller's arguments unchanged.
    gated(None, || {
        real::cuLaunchCooperativeKernelMultiDevice().map(|r| unsafe { r(list, n, flags) })
    })
}

/// Managed symbols (launches, synchronisations, allocations, frees, memory queries) and their
/// wrappers, sorted by name.
fn wrappers() -> [(&'static str, P); 34] {
    [
        ("cuArray3DCreate_v2", memory::cuArray3DCreate_v2 as P),
        ("cuArrayCreate_v2", memory::cuArrayCreate_v2 as P),
        ("cuArrayDestroy", memory::cuArrayDestroy as P),
        ("cuCtxSynchronize", cuCtxSynchronize as P),
        ("cuDeviceTotalMem_v2", memory::cuDeviceTotalMem_v2 as P),
        ("cuEventSynchronize", cuEventSynchronize as P),
        ("cuGetProcAddress", cuGetProcAddress as P),
        ("cuGetProcAddress_v2", cuGetProcAddress_v2 as P),
        ("cuGraphLaunch", cuGraphLaunch as P),
        ("cuGraphLaunch_ptsz", cuGraphLaunch_ptsz as P),
        ("cuLaunchCooperativeKernel", cuLaunchCooperativeKernel as P),
        (
            "cuLaunchCooperativeKernelMultiDevice",
            cuLaunchCooperativeKernelMultiDevice as P,
        ),
        (
            "cuLaunchCooperativeKernel_ptsz",
            cuLaunchCooperativeKernel_ptsz as P,
        ),
        ("cuLaunchKernel", cuLaunchKernel as P),
        ("cuLaunchKernelEx", cuLaunchKernelEx as P),
        ("cuLaunchKernelEx_ptsz", cuLaunchKernelEx_ptsz as P),
        ("cuLaunchKernel_ptsz", cuLaunchKernel_ptsz as P),
        ("cuMemAllocAsync", memory::cuMemAllocAsync as P),
        ("cuMemAllocAsync_ptsz", memory::cuMemAllocAsync_ptsz as P),
        (
            "cuMemAllocFromPoolAsync",
            memory::cuMemAllocFromPoolAsync as P,
        ),
        (
            "cuMemAllocFromPoolAsync_ptsz",
            memory::cuMemAllocFromPoolAsync_ptsz as P,
        ),
        ("cuMemAllocManaged", memory::cuMemAllocManaged as P),
        ("cuMemAllocPitch_v2", memory::cuMemAllocPitch_v2 as P),
        ("cuMemAlloc_v2", memory::cuMemAlloc_v2 as P),
        ("cuMemCreate", memory::cuMemCreate as P),
        ("cuMemFreeAsync", memory::cuMemFreeAsync as P),
        ("cuMemFreeAsync_ptsz", memory::cuMemFreeAsync_ptsz as P),
        ("cuMemFree_v2", memory::cuMemFree_v2 as P),
        ("cuMemGetInfo_v2", memory::cuMemGetInfo_v2 as P),
        ("cuMemRelease", memory::cuMemRelease as P),
        (
            "cuMipmappedArrayCreate",
            memory::cuMipmappedArrayCreate as P,
        ),
        (
            "cuMipmappedArrayDestroy",
            memory::cuMipmappedArrayDestroy as P,
        ),
        ("cuStreamSynchronize", cuStreamSynchronize as P),
        ("cuStreamSynchronize_ptsz", cuStreamSynchronize_ptsz as P),
    ]
}

fn wrapper(symbol: &[u8]) -> Option<P> {
    let table = wrappers();
    table
        .binary_search_by(|(n, _)| n.as_bytes().cmp(symbol))
        .ok()
        .map(|i| table[i].1)
}

thread_local! {
    /// Set while inside our `dlsym`, so lookups made by the C library on our behalf pass through.
    static IN_DLSYM: Cell<bool> = const { Cell::new(false) };
}

/// `dlsym` override: managed driver symbols resolve to their wrappers, whatever the handle.
///
/// # Safety
/// Same contract as the C library's `dlsym`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: P, symbol: *const c_char) -> P {
    let Some(real_dlsym) = real::dlsym() else {
        return std::ptr::null_mut();
    };
    if symbol.is_null() || IN_DLSYM.with(|f| f.replace(true)) {
        // SAFETY: the caller's arguments, unchanged.
        return unsafe { real_dlsym(handle, symbol) };
    }
    // SAFETY: non-null, NUL-terminated per dlsym's contract.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    let found = if name.starts_with(b"cu") {
        wrapper(name)
    } else {
        None
    };
    // SAFETY: the caller's arguments, unchanged.
    let r = found.unwrap_or_else(|| unsafe { real_dlsym(handle, symbol) });
    IN_DLSYM.with(|f| f.set(false));
    r
}

/// After the real driver resolved `symbol`, hand out our wrapper if the resolved ABI variant
/// is one we manage.
fn swap_in_wrapper(symbol: *const c_char, pfn: *mut P, version: c_int, flags: u64) {
    if symbol.is_null() || pfn.is_null() {
        return;
    }
    // SAFETY: non-null, NUL-terminated per cuGetProcAddress's contract.
    let Ok(name) = unsafe { CStr::from_ptr(symbol) }.to_str() else {
        return;
    };
    if let Resolution::Found(sym) = resolve(name, version, flags)
        && let Some(w) = wrapper(sym.as_bytes())
    {
        // SAFETY: `pfn` is the caller's out-pointer, just written by the real driver.
        unsafe { *pfn = w };
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut P,
    version: c_int,
    flags: u64,
) -> CUresult {
    let run = || {
        // SAFETY: forwards the caller's arguments unchanged.
        let r = real::cuGetProcAddress().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe {
            f(symbol, pfn, version, flags)
        });
        if r == 0 {
            swap_in_wrapper(symbol, pfn, version, flags);
        }
        r
    };
    std::panic::catch_unwind(run).unwrap_or(CUDA_ERROR_UNKNOWN)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut P,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    let run = || {
        // SAFETY: forwards the caller's arguments unchanged.
        let r = real::cuGetProcAddress_v2().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe {
            f(symbol, pfn, version, flags, status)
        });
        if r == 0 {
            swap_in_wrapper(symbol, pfn, version, flags);
        }
        r
    };
    std::panic::catch_unwind(run).unwrap_or(CUDA_ERROR_UNKNOWN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapper_table_is_sorted_and_names_real_symbols() {
        let table = wrappers();
        assert!(table.windows(2).all(|w| w[0].0 < w[1].0));
        let real: Vec<&str> = gpushare_cuda_abi::symbols().collect();
        for (name, _) in table {
            assert!(real.contains(&name), "{name}");
        }
    }

    #[test]
    fn every_allocation_path_and_free_is_managed() {
        let names = [
            "cuMemAlloc_v2",
            "cuMemAllocPitch_v2",
            "cuMemAllocManaged",
            "cuMemAllocAsync",
            "cuMemAllocAsync_ptsz",
            "cuMemAllocFromPoolAsync",
            "cuMemAllocFromPoolAsync_ptsz",
            "cuMemCreate",
            "cuArrayCreate_v2",
            "cuArray3DCreate_v2",
            "cuMipmappedArrayCreate",
            "cuMemFree_v2",
            "cuMemFreeAsync",
            "cuMemFreeAsync_ptsz",
            "cuMemRelease",
            "cuArrayDestroy",
            "cuMipmappedArrayDestroy",
            "cuMemGetInfo_v2",
            "cuDeviceTotalMem_v2",
        ];
        for n in names {
            assert!(wrapper(n.as_bytes()).is_some(), "{n} is not managed");
        }
    }

    #[test]
    fn every_synchronisation_variant_is_seen() {
        let syncs = [
            "cuCtxSynchronize",
            "cuStreamSynchronize",
            "cuEventSynchronize",
        ];
        for entry in gpushare_cuda_abi::ENTRY_POINTS {
            if syncs.contains(&entry.name) {
                assert!(
                    wrapper(entry.symbol.as_bytes()).is_some(),
                    "{} is not seen",
                    entry.symbol
                );
            }
        }
    }

    #[test]
    fn every_launch_variant_is_managed() {
        for entry in gpushare_cuda_abi::ENTRY_POINTS {
            let launches = [
                "cuLaunchKernel",
                "cuLaunchKernelEx",
                "cuLaunchCooperativeKernel",
                "cuLaunchCooperativeKernelMultiDevice",
                "cuGraphLaunch",
            ];
            if launches.contains(&entry.name) {
                assert!(
                    wrapper(entry.symbol.as_bytes()).is_some(),
                    "{} is not gated",
                    entry.symbol
                );
            }
        }
    }
}
