//! `cuGetProcAddress` / `_v2`: the CUDA 11.3+ runtime and NVIDIA's Python bindings find every
//! driver function through it, asking for a base name and the ABI version they were built for.
//! The version table comes from the real headers (`gpushare-cuda-abi`); the functions from the
//! build-generated list of our own exports, never from `dlsym` (a preloaded hook may override it).

use crate::api_device::DRIVER_VERSION;
use crate::ffi::*;
use gpushare_cuda_abi::{Resolution, resolve};
use std::ffi::{c_char, c_int, c_void};

/// An exported function's address; only ever read.
pub struct Export(pub *const c_void);
// SAFETY: the pointers are addresses of functions in this library, immutable for its lifetime.
unsafe impl Sync for Export {}

include!(concat!(env!("OUT_DIR"), "/exports.rs"));

/// Our implementation of the real driver symbol `symbol`, if we have one.
pub fn export(symbol: &str) -> Option<*const c_void> {
    EXPORTS
        .binary_search_by(|(n, _)| (*n).cmp(symbol))
        .ok()
        .map(|i| EXPORTS[i].1.0)
}

/// The API names `GPUSHARE_SIM_NEWER_ABI` (comma-separated; a test setting) lists: asked for at
/// a CUDA version above this driver's own, these answer [`newer_abi`], as a driver newer than
/// 12.9 would answer with an ABI variant the 12.9 table does not have.
fn newer_abi_names() -> &'static [String] {
    static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| {
        std::env::var("GPUSHARE_SIM_NEWER_ABI")
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect()
    })
}

/// Stands for an ABI variant newer than CUDA 12.9 (see [`newer_abi_names`]): whatever its
/// arguments, it does nothing and fails.
extern "C" fn newer_abi() -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut CUdriverProcAddressQueryResult,
) -> CuResult {
    let name = c_str(symbol)?
        .to_str()
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    if pfn.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let newer = version > DRIVER_VERSION && newer_abi_names().iter().any(|n| n == name);
    let (found, st) = match resolve(name, version, flags) {
        Resolution::Found(_) if newer => (
            Some(newer_abi as *const c_void),
            CU_GET_PROC_ADDRESS_SUCCESS,
        ),
        Resolution::Found(sym) => match export(sym) {
            Some(p) => (Some(p), CU_GET_PROC_ADDRESS_SUCCESS),
            None => (None, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND),
        },
        Resolution::VersionNotSufficient => (None, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT),
        Resolution::NotFound => (None, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND),
    };
    if found.is_none() && tracing_calls() {
        eprintln!(
            "gpushare-sim libcuda: cuGetProcAddress: no {name} for version {version}, flags {flags}"
        );
    }
    put(pfn, found.unwrap_or(std::ptr::null()).cast_mut())?;
    if !status.is_null() {
        put(status, st)?;
    }
    found.map(|_| ()).ok_or(CUDA_ERROR_NOT_FOUND)
}

entry!(
    fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
        get_proc_address(symbol, pfn, version, flags, std::ptr::null_mut())
    }
);

entry!(
    fn cuGetProcAddress_v2(
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        version: c_int,
        flags: u64,
        status: *mut CUdriverProcAddressQueryResult,
    ) {
        get_proc_address(symbol, pfn, version, flags, status)
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_export_is_a_real_driver_symbol() {
        let real: Vec<&str> = gpushare_cuda_abi::symbols().collect();
        for (name, _) in EXPORTS {
            assert!(
                real.contains(name),
                "{name} is not a CUDA 12.9 driver symbol"
            );
        }
        assert!(
            EXPORTS.windows(2).all(|w| w[0].0 < w[1].0),
            "sorted and unique"
        );
    }

    #[test]
    fn the_table_has_every_kind_of_entry_point() {
        // Both macro forms, before and after rustfmt reflows them.
        for name in [
            "cuInit",
            "cuGetErrorName",
            "cuMemAlloc_v2",
            "cuGetProcAddress_v2",
            "cuLaunchKernel_ptsz",
        ] {
            assert!(
                export(name).is_some(),
                "{name} missing from the export table"
            );
        }
        assert!(EXPORTS.len() > 200, "only {} exports", EXPORTS.len());
    }

    #[test]
    fn versions_resolve_to_our_functions() {
        let find = |n: &str, v: i32, f: u64| resolve(n, v, f).symbol().and_then(export);
        assert_eq!(find("cuMemAlloc", 3020, 0), export("cuMemAlloc_v2"));
        assert_eq!(find("cuLaunchKernel", 4000, 0), export("cuLaunchKernel"));
        assert_eq!(
            find("cuLaunchKernel", 12000, 2),
            export("cuLaunchKernel_ptsz")
        );
        assert_eq!(find("cuCtxCreate", 12050, 0), export("cuCtxCreate_v4"));
        assert_eq!(
            find("cuGetProcAddress", 12000, 0),
            export("cuGetProcAddress_v2")
        );
        assert!(find("cuLaunchKernel", 4000, 0).is_some());
    }
}
