//! `cuGetProcAddress` rules: which exported driver symbol implements a driver
//! API name for a requested CUDA version and default-stream mode.
//!
//! This exists so that the simulated driver and the sharing hook answer
//! `cuGetProcAddress` identically, from one table generated from the real
//! CUDA 12.9 headers (`scripts/gen_cuda_abi.py`), instead of each carrying a
//! hand-maintained list of `_v2`/`_ptsz` suffixes.

use crate::generated::{ENTRY_POINTS, SYMBOLS};
use crate::types;

/// `CU_GET_PROC_ADDRESS_DEFAULT`: the driver's default stream semantics
/// (legacy default stream here); as the `u64` flags `cuGetProcAddress` takes.
pub const CU_GET_PROC_ADDRESS_DEFAULT: u64 = types::CU_GET_PROC_ADDRESS_DEFAULT as u64;
/// `CU_GET_PROC_ADDRESS_LEGACY_STREAM`: legacy default-stream variants.
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = types::CU_GET_PROC_ADDRESS_LEGACY_STREAM as u64;
/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`: per-thread default-stream
/// variants (`_ptsz`/`_ptds` symbols) where the API has them.
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 =
    types::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM as u64;

/// One ABI version of a driver API, as named by a
/// `PFN_<name>_v<version>[_ptsz|_ptds]` typedef in `cudaTypedefs.h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EntryPoint {
    /// API name as passed to `cuGetProcAddress`, e.g. `"cuMemAlloc"`.
    pub name: &'static str,
    /// CUDA version (`1000 * major + 10 * minor`) that introduced this ABI.
    pub version: u32,
    /// Whether this is the per-thread default-stream variant.
    pub per_thread: bool,
    /// Exported driver symbol implementing it, e.g. `"cuMemAlloc_v2"`.
    pub symbol: &'static str,
}

/// Outcome of [`resolve`], mirroring `CUdriverProcAddressQueryResult`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Resolution {
    /// `CU_GET_PROC_ADDRESS_SUCCESS`: the symbol to hand out.
    Found(&'static str),
    /// `CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT`: the name is known but
    /// every version of it is newer than the requested CUDA version.
    VersionNotSufficient,
    /// `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`: unknown name.
    NotFound,
}

impl Resolution {
    /// The symbol, if one was found.
    pub fn symbol(self) -> Option<&'static str> {
        match self {
            Resolution::Found(s) => Some(s),
            _ => None,
        }
    }
}

/// All rows for `name`, sorted by version then `per_thread` (empty if unknown).
pub fn entry_points(name: &str) -> &'static [EntryPoint] {
    let start = ENTRY_POINTS.partition_point(|e| e.name < name);
    let len = ENTRY_POINTS[start..].partition_point(|e| e.name == name);
    &ENTRY_POINTS[start..start + len]
}

/// Resolve `name` the way `cuGetProcAddress(name, &pfn, cuda_version, flags)`
/// does.
///
/// Among the legacy rows for `name`, the one with the highest
/// `version <= cuda_version` is selected. If `flags` has
/// [`CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`] set and that ABI has a
/// per-thread variant available at `cuda_version`, the per-thread symbol is
/// returned instead; otherwise (flags 0 or 1, or no such variant) the legacy
/// symbol. Other flag bits are ignored.
pub fn resolve(name: &str, cuda_version: i32, flags: u64) -> Resolution {
    let rows = entry_points(name);
    if rows.is_empty() {
        return Resolution::NotFound;
    }
    let Ok(requested) = u32::try_from(cuda_version) else {
        return Resolution::VersionNotSufficient;
    };
    let Some(legacy) = rows
        .iter()
        .rev()
        .find(|e| !e.per_thread && e.version <= requested)
    else {
        return Resolution::VersionNotSufficient;
    };
    if flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0 {
        let per_thread = rows.iter().rev().find(|e| {
            e.per_thread
                && e.version <= requested
                && per_thread_base(e.symbol) == Some(legacy.symbol)
        });
        if let Some(pt) = per_thread {
            return Resolution::Found(pt.symbol);
        }
    }
    Resolution::Found(legacy.symbol)
}

/// The legacy symbol a per-thread symbol wraps (`cuX_v2_ptds` -> `cuX_v2`).
pub fn per_thread_base(symbol: &str) -> Option<&str> {
    symbol
        .strip_suffix("_ptsz")
        .or_else(|| symbol.strip_suffix("_ptds"))
}

/// Every distinct symbol of [`ENTRY_POINTS`], sorted: what a complete driver
/// implementation has to export.
pub fn symbols() -> impl Iterator<Item = &'static str> {
    SYMBOLS.iter().copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTDS: u64 = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;

    fn found(name: &str, version: i32, flags: u64) -> &'static str {
        match resolve(name, version, flags) {
            Resolution::Found(s) => s,
            other => panic!("{name}@{version} flags {flags}: {other:?}"),
        }
    }

    #[test]
    fn known_facts() {
        assert_eq!(found("cuMemAlloc", 3020, 0), "cuMemAlloc_v2");
        assert_eq!(found("cuMemAlloc", 2000, 0), "cuMemAlloc");
        assert_eq!(found("cuCtxCreate", 3020, 0), "cuCtxCreate_v2");
        assert_eq!(found("cuCtxCreate", 11040, 0), "cuCtxCreate_v3");
        assert_eq!(found("cuCtxCreate", 12050, 0), "cuCtxCreate_v4");
        assert_eq!(
            found("cuEventElapsedTime", 12080, 0),
            "cuEventElapsedTime_v2"
        );
        assert_eq!(found("cuEventElapsedTime", 12070, 0), "cuEventElapsedTime");
        assert_eq!(found("cuLaunchKernel", 4000, 0), "cuLaunchKernel");
        assert_eq!(found("cuLaunchKernel", 7000, PTDS), "cuLaunchKernel_ptsz");
        assert_eq!(found("cuMemcpyHtoD", 12090, PTDS), "cuMemcpyHtoD_v2_ptds");
        assert_eq!(found("cuGetProcAddress", 11030, 0), "cuGetProcAddress");
        assert_eq!(found("cuGetProcAddress", 12000, 0), "cuGetProcAddress_v2");
        let capture: Vec<_> = entry_points("cuStreamGetCaptureInfo")
            .iter()
            .filter(|e| !e.per_thread)
            .map(|e| (e.version, e.symbol))
            .collect();
        assert_eq!(
            capture,
            [
                (10010, "cuStreamGetCaptureInfo"),
                (11030, "cuStreamGetCaptureInfo_v2"),
                (12030, "cuStreamGetCaptureInfo_v3"),
            ]
        );
    }

    #[test]
    fn versions_in_between_pick_the_older_row() {
        assert_eq!(found("cuCtxCreate", 11030, 0), "cuCtxCreate_v2");
        assert_eq!(found("cuCtxCreate", 12040, 0), "cuCtxCreate_v3");
        assert_eq!(found("cuCtxCreate", i32::MAX, 0), "cuCtxCreate_v4");
        assert_eq!(found("cuMemAlloc", 3010, 0), "cuMemAlloc");
        assert_eq!(
            found("cuStreamGetCaptureInfo", 12000, 0),
            "cuStreamGetCaptureInfo_v2"
        );
    }

    #[test]
    fn flags_select_stream_variant() {
        for flags in [
            CU_GET_PROC_ADDRESS_DEFAULT,
            CU_GET_PROC_ADDRESS_LEGACY_STREAM,
        ] {
            assert_eq!(found("cuLaunchKernel", 12090, flags), "cuLaunchKernel");
            assert_eq!(found("cuMemcpyHtoD", 12090, flags), "cuMemcpyHtoD_v2");
        }
        assert_eq!(
            found("cuLaunchKernel", 12090, PTDS | 1),
            "cuLaunchKernel_ptsz"
        );
        assert_eq!(found("cuMemcpy", 12090, PTDS), "cuMemcpy_ptds");
        assert_eq!(
            found("cuStreamGetCaptureInfo", 11030, PTDS),
            "cuStreamGetCaptureInfo_v2_ptsz"
        );
        assert_eq!(
            found("cuStreamGetCaptureInfo", 12090, PTDS),
            "cuStreamGetCaptureInfo_v3_ptsz"
        );
        // Per-thread variants appeared in 7.0: older requests get legacy.
        assert_eq!(found("cuLaunchKernel", 6050, PTDS), "cuLaunchKernel");
        assert_eq!(found("cuMemcpyHtoD", 6050, PTDS), "cuMemcpyHtoD_v2");
        // No per-thread variant at all: legacy symbol.
        assert_eq!(found("cuMemAlloc", 12090, PTDS), "cuMemAlloc_v2");
        assert_eq!(found("cuCtxCreate", 12090, PTDS), "cuCtxCreate_v4");
    }

    #[test]
    fn unknown_names() {
        assert_eq!(resolve("cuNoSuchThing", 12090, 0), Resolution::NotFound);
        assert_eq!(resolve("", 12090, 0), Resolution::NotFound);
        // Symbols are not names: cuGetProcAddress takes the unversioned name.
        assert_eq!(resolve("cuMemAlloc_v2", 12090, 0), Resolution::NotFound);
        assert_eq!(resolve("cumemalloc", 12090, 0), Resolution::NotFound);
        assert!(entry_points("cuNoSuchThing").is_empty());
    }

    #[test]
    fn version_too_low() {
        assert_eq!(
            resolve("cuMemAlloc", 1000, 0),
            Resolution::VersionNotSufficient
        );
        assert_eq!(
            resolve("cuMemAlloc", 0, PTDS),
            Resolution::VersionNotSufficient
        );
        assert_eq!(
            resolve("cuMemAlloc", -1, 0),
            Resolution::VersionNotSufficient
        );
        assert_eq!(
            resolve("cuEventElapsedTime", 1999, 0),
            Resolution::VersionNotSufficient
        );
        assert_eq!(
            resolve("cuLogsCurrent", 12080, 0),
            Resolution::VersionNotSufficient
        );
        assert_eq!(found("cuLogsCurrent", 12090, 0), "cuLogsCurrent");
        assert_eq!(resolve("cuLogsCurrent", 12080, 0).symbol(), None);
    }

    #[test]
    fn table_is_sorted_and_consistent() {
        assert!(ENTRY_POINTS.windows(2).all(|w| {
            (w[0].name, w[0].version, w[0].per_thread) < (w[1].name, w[1].version, w[1].per_thread)
        }));
        for e in ENTRY_POINTS {
            assert!(
                e.name.starts_with("cu") && e.symbol.starts_with("cu"),
                "{e:?}"
            );
            if e.per_thread {
                let base = per_thread_base(e.symbol).expect("per-thread symbol suffix");
                assert!(
                    entry_points(e.name)
                        .iter()
                        .any(|l| !l.per_thread && l.symbol == base && l.version <= e.version),
                    "{e:?} has no matching legacy row"
                );
            } else {
                assert_eq!(per_thread_base(e.symbol), None, "{e:?}");
            }
        }
    }

    #[test]
    fn symbols_are_distinct_and_complete() {
        let syms: Vec<_> = symbols().collect();
        assert!(syms.windows(2).all(|w| w[0] < w[1]), "sorted and distinct");
        for e in ENTRY_POINTS {
            assert!(syms.binary_search(&e.symbol).is_ok(), "{e:?}");
        }
        for s in &syms {
            assert!(ENTRY_POINTS.iter().any(|e| e.symbol == *s), "{s}");
        }
        assert!(syms.contains(&"cuMemcpyHtoD_v2_ptds"));
    }

    #[test]
    fn legacy_header_section_is_included() {
        // Typedefs inside `#if defined(__CUDA_API_VERSION_INTERNAL)`.
        assert_eq!(found("cuMemcpyHtoD", 2000, 0), "cuMemcpyHtoD");
        assert_eq!(
            found("cuStreamBeginCapture", 10000, PTDS),
            "cuStreamBeginCapture_ptsz"
        );
        assert_eq!(
            found("cuGraphInstantiate", 11000, 0),
            "cuGraphInstantiate_v2"
        );
    }

    #[test]
    fn overrides() {
        // Unversioned PFN_ typedefs, versioned from their PFN_ macro.
        assert_eq!(
            resolve("cuModuleGetFunctionCount", 12030, 0),
            Resolution::VersionNotSufficient
        );
        assert_eq!(
            found("cuModuleGetFunctionCount", 12040, 0),
            "cuModuleGetFunctionCount"
        );
        // cuGraphInstantiate became cuGraphInstantiateWithFlags in 12.0.
        assert_eq!(
            found("cuGraphInstantiate", 12000, 0),
            "cuGraphInstantiateWithFlags"
        );
    }

    mod props {
        use super::super::*;
        use super::PTDS;
        use proptest::prelude::*;

        fn any_row() -> impl Strategy<Value = &'static EntryPoint> {
            (0..ENTRY_POINTS.len()).prop_map(|i| &ENTRY_POINTS[i])
        }

        proptest! {
            #[test]
            fn resolution_never_newer_than_requested(
                row in any_row(),
                version in -1i32..14000,
                flags in any::<u64>(),
            ) {
                let rows = entry_points(row.name);
                match resolve(row.name, version, flags) {
                    Resolution::Found(sym) => {
                        let hit = rows.iter().find(|e| e.symbol == sym).unwrap();
                        prop_assert!(i64::from(hit.version) <= i64::from(version));
                        prop_assert!(!hit.per_thread || flags & PTDS != 0);
                    }
                    Resolution::VersionNotSufficient => {
                        prop_assert!(rows.iter().all(|e| i64::from(e.version) > i64::from(version)));
                    }
                    Resolution::NotFound => prop_assert!(false, "known name not found"),
                }
            }

            #[test]
            fn only_the_per_thread_bit_matters(
                row in any_row(),
                version in 0i32..14000,
                flags in any::<u64>(),
            ) {
                let canonical = flags & PTDS;
                prop_assert_eq!(resolve(row.name, version, flags), resolve(row.name, version, canonical));
            }

            #[test]
            fn every_row_is_reachable_at_its_version(row in any_row()) {
                let version = i32::try_from(row.version).unwrap();
                let flags = if row.per_thread { PTDS } else { 0 };
                prop_assert_eq!(resolve(row.name, version, flags), Resolution::Found(row.symbol));
            }
        }
    }
}
