//! Symbol lookup: the table of managed symbols and their wrappers, answered by our `dlsym` and
//! swapped into what the driver's `cuGetProcAddress` returns.

use super::{P, capture, contexts, graphs, launch, sync};
use crate::memory;
use crate::real;
use gpushare_cuda_abi::pfn;
use gpushare_cuda_abi::result::{CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS};
use gpushare_cuda_abi::types::{CUdriverProcAddressQueryResult, CUresult};
use std::ffi::{CStr, CString, c_char, c_int};
use std::sync::OnceLock;

/// `(symbol, wrapper)` rows, each wrapper checked at compile time against the type cuda.h gives
/// the symbol (`gpushare_cuda_abi::pfn`): a wrapper typed otherwise does not build.
macro_rules! checked_wrappers {
    ($($sym:ident => $wrapper:path,)*) => {
        [$((stringify!($sym), {
            const WRAPPER: pfn::$sym = $wrapper;
            WRAPPER as P
        })),*]
    };
}

/// Managed symbols (launches, synchronisations, captures, allocations, frees, memory queries,
/// IPC exports and opens) and their wrappers, sorted by name: every `cu*` symbol this library
/// exports.
fn wrappers() -> [(&'static str, P); 60] {
    #[rustfmt::skip]
    let table = checked_wrappers! {
        cuArray3DCreate_v2 => memory::cuArray3DCreate_v2,
        cuArrayCreate_v2 => memory::cuArrayCreate_v2,
        cuArrayDestroy => memory::cuArrayDestroy,
        cuCtxDestroy => contexts::cuCtxDestroy,
        cuCtxDestroy_v2 => contexts::cuCtxDestroy_v2,
        cuCtxSynchronize => sync::cuCtxSynchronize,
        cuDevicePrimaryCtxRelease => contexts::cuDevicePrimaryCtxRelease,
        cuDevicePrimaryCtxRelease_v2 => contexts::cuDevicePrimaryCtxRelease_v2,
        cuDevicePrimaryCtxReset => contexts::cuDevicePrimaryCtxReset,
        cuDevicePrimaryCtxReset_v2 => contexts::cuDevicePrimaryCtxReset_v2,
        cuDeviceTotalMem_v2 => memory::cuDeviceTotalMem_v2,
        cuEventSynchronize => sync::cuEventSynchronize,
        cuGetProcAddress => cuGetProcAddress,
        cuGetProcAddress_v2 => cuGetProcAddress_v2,
        cuGraphExecDestroy => graphs::cuGraphExecDestroy,
        cuGraphInstantiate => graphs::cuGraphInstantiate,
        cuGraphInstantiateWithFlags => graphs::cuGraphInstantiateWithFlags,
        cuGraphInstantiateWithParams => graphs::cuGraphInstantiateWithParams,
        cuGraphInstantiateWithParams_ptsz => graphs::cuGraphInstantiateWithParams_ptsz,
        cuGraphInstantiate_v2 => graphs::cuGraphInstantiate_v2,
        cuGraphLaunch => graphs::cuGraphLaunch,
        cuGraphLaunch_ptsz => graphs::cuGraphLaunch_ptsz,
        cuIpcGetMemHandle => memory::cuIpcGetMemHandle,
        cuIpcOpenMemHandle => memory::cuIpcOpenMemHandle,
        cuIpcOpenMemHandle_v2 => memory::cuIpcOpenMemHandle_v2,
        cuLaunchCooperativeKernel => launch::cuLaunchCooperativeKernel,
        cuLaunchCooperativeKernelMultiDevice => launch::cuLaunchCooperativeKernelMultiDevice,
        cuLaunchCooperativeKernel_ptsz => launch::cuLaunchCooperativeKernel_ptsz,
        cuLaunchKernel => launch::cuLaunchKernel,
        cuLaunchKernelEx => launch::cuLaunchKernelEx,
        cuLaunchKernelEx_ptsz => launch::cuLaunchKernelEx_ptsz,
        cuLaunchKernel_ptsz => launch::cuLaunchKernel_ptsz,
        cuMemAllocAsync => memory::cuMemAllocAsync,
        cuMemAllocAsync_ptsz => memory::cuMemAllocAsync_ptsz,
        cuMemAllocFromPoolAsync => memory::cuMemAllocFromPoolAsync,
        cuMemAllocFromPoolAsync_ptsz => memory::cuMemAllocFromPoolAsync_ptsz,
        cuMemAllocManaged => memory::cuMemAllocManaged,
        cuMemAllocPitch_v2 => memory::cuMemAllocPitch_v2,
        cuMemAlloc_v2 => memory::cuMemAlloc_v2,
        cuMemCreate => memory::cuMemCreate,
        cuMemFreeAsync => memory::cuMemFreeAsync,
        cuMemFreeAsync_ptsz => memory::cuMemFreeAsync_ptsz,
        cuMemFree_v2 => memory::cuMemFree_v2,
        cuMemGetInfo_v2 => memory::cuMemGetInfo_v2,
        cuMemMap => memory::cuMemMap,
        cuMemRelease => memory::cuMemRelease,
        cuMemRetainAllocationHandle => memory::cuMemRetainAllocationHandle,
        cuMemUnmap => memory::cuMemUnmap,
        cuMipmappedArrayCreate => memory::cuMipmappedArrayCreate,
        cuMipmappedArrayDestroy => memory::cuMipmappedArrayDestroy,
        cuStreamBeginCapture => capture::cuStreamBeginCapture,
        cuStreamBeginCaptureToGraph => capture::cuStreamBeginCaptureToGraph,
        cuStreamBeginCaptureToGraph_ptsz => capture::cuStreamBeginCaptureToGraph_ptsz,
        cuStreamBeginCapture_ptsz => capture::cuStreamBeginCapture_ptsz,
        cuStreamBeginCapture_v2 => capture::cuStreamBeginCapture_v2,
        cuStreamBeginCapture_v2_ptsz => capture::cuStreamBeginCapture_v2_ptsz,
        cuStreamEndCapture => capture::cuStreamEndCapture,
        cuStreamEndCapture_ptsz => capture::cuStreamEndCapture_ptsz,
        cuStreamSynchronize => sync::cuStreamSynchronize,
        cuStreamSynchronize_ptsz => sync::cuStreamSynchronize_ptsz,
    };
    table
}

fn wrapper(symbol: &[u8]) -> Option<P> {
    let table = wrappers();
    table
        .binary_search_by(|(n, _)| n.as_bytes().cmp(symbol))
        .ok()
        .map(|i| table[i].1)
}

/// `dlsym` override: managed driver symbols resolve to their wrappers, whatever the handle;
/// every other lookup is the C library's own, as if we were not there.
///
/// Why a trampoline: glibc's `dlsym` takes its caller from its own return address, and resolves
/// `RTLD_NEXT` (the next definition after the caller's object, how an interposer finds the
/// function it wraps) and `RTLD_DEFAULT` (the caller's scope) relative to that object. Called
/// from here, it would resolve them relative to `libgpushare.so`: an interposer preloaded after
/// us asking `dlsym(RTLD_NEXT, "getpid")` would get its own `getpid` back and recurse forever.
/// So this function only asks [`dlsym_route`] (a plain Rust function) what to do, then either
/// returns that answer or *jumps* to glibc's `dlsym` with the caller's arguments and the
/// caller's return address still in place: glibc sees the real caller, and answers exactly as
/// without us (scopes, symbol versions, IFUNCs, `dlerror`). This relies on glibc's `dlsym`
/// finding its caller by return address (`RETURN_ADDRESS (0)`, as every glibc release does).
///
/// No re-entrancy guard is needed: nothing here looks a symbol up (the C library's `dlsym`
/// runs after this function has left, in the caller's stead).
///
/// # Safety
/// Same contract as the C library's `dlsym`.
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: P, symbol: *const c_char) -> P {
    // On entry the return address into the caller is at [rsp]; it stays there for the jump.
    // (The CFI lines let debuggers and profilers unwind through the call.)
    #[cfg(target_arch = "x86_64")]
    core::arch::naked_asm!(
        ".cfi_startproc",
        "push rdi",
        ".cfi_adjust_cfa_offset 8",
        "push rsi",
        ".cfi_adjust_cfa_offset 8",
        "sub rsp, 8", // the stack 16-byte aligned at the call, as the ABI requires
        ".cfi_adjust_cfa_offset 8",
        "call {route}",
        "add rsp, 8",
        ".cfi_adjust_cfa_offset -8",
        "pop rsi",
        ".cfi_adjust_cfa_offset -8",
        "pop rdi",
        ".cfi_adjust_cfa_offset -8",
        "test rdx, rdx",
        "jnz 2f",
        "ret", // `answer`, in rax
        "2:",
        "jmp rdx", // `defer`, with the caller's arguments and return address
        ".cfi_endproc",
        route = sym dlsym_route,
    );
    // On entry the return address into the caller is in x30 (lr); it is restored before the
    // jump. x16/x17 are the intra-procedure-call scratch registers (and `br x16` may land on a
    // `bti c`).
    #[cfg(target_arch = "aarch64")]
    core::arch::naked_asm!(
        ".cfi_startproc",
        "stp x29, x30, [sp, #-32]!",
        ".cfi_def_cfa_offset 32",
        ".cfi_offset x29, -32",
        ".cfi_offset x30, -24",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "bl {route}",
        "mov x16, x1",
        "mov x17, x0",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        ".cfi_def_cfa_offset 0",
        ".cfi_restore x29",
        ".cfi_restore x30",
        "cbnz x16, 2f",
        "mov x0, x17", // `answer`
        "ret",
        "2:",
        "br x16", // `defer`, with the caller's arguments and return address
        ".cfi_endproc",
        route = sym dlsym_route,
    );
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!("the dlsym trampoline is written for x86_64 and aarch64 only");

/// What our `dlsym` does with one call: return `answer`, or, if `defer` is not null, jump to
/// `defer` (the C library's `dlsym`) with the caller's arguments. Two pointers, returned in two
/// registers (rax:rdx, x0:x1).
#[repr(C)]
struct Route {
    answer: P,
    defer: P,
}

/// The decision behind [`dlsym`]: a managed `cu*` symbol is answered with its wrapper (whatever
/// the handle: `RTLD_NEXT` from an interposer, or the handle of a library that does not define
/// it, too), anything else is the C library's to answer.
extern "C" fn dlsym_route(_handle: P, symbol: *const c_char) -> Route {
    let run = || {
        let defer = real::dlsym().map_or(std::ptr::null_mut(), |f| f as P);
        let found = if symbol.is_null() {
            None
        } else {
            // SAFETY: non-null, NUL-terminated per dlsym's contract.
            let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
            name.starts_with(b"cu").then(|| wrapper(name)).flatten()
        };
        match found {
            Some(w) => Route {
                answer: w,
                defer: std::ptr::null_mut(),
            },
            None => Route {
                answer: std::ptr::null_mut(),
                defer,
            },
        }
    };
    std::panic::catch_unwind(run).unwrap_or(Route {
        answer: std::ptr::null_mut(),
        defer: std::ptr::null_mut(),
    })
}

/// Each managed symbol's address in the real driver, with its wrapper's, sorted by the former;
/// symbols the driver lacks are left out. `real` finds a symbol's address (0: none).
fn real_addresses(real: impl Fn(&str) -> usize) -> Vec<(usize, usize)> {
    let mut table: Vec<(usize, usize)> = wrappers()
        .iter()
        .map(|&(name, w)| (real(name), w as usize))
        .filter(|&(addr, _)| addr != 0)
        .collect();
    table.sort_unstable();
    table
}

/// The wrapper to hand out for the pointer `returned` by the real driver's `cuGetProcAddress`:
/// the one whose symbol's real address it is, else none. `table` is [`real_addresses`].
fn wrapper_for(returned: usize, table: &[(usize, usize)]) -> Option<usize> {
    let i = table
        .binary_search_by_key(&returned, |&(addr, _)| addr)
        .ok()?;
    Some(table[i].1)
}

/// [`real_addresses`] of the real driver (the one `real` loaded), resolved once with the real
/// `dlsym` on its handle.
fn driver_addresses() -> &'static [(usize, usize)] {
    static TABLE: OnceLock<Vec<(usize, usize)>> = OnceLock::new();
    TABLE.get_or_init(|| {
        real_addresses(|name| CString::new(name).map_or(0, |c| real::symbol(&c) as usize))
    })
}

/// After the real driver resolved `symbol` into `*pfn`, hand out our wrapper instead if the
/// pointer is the driver's own address of the exact symbol variant the wrapper wraps (e.g.
/// `cuMemAlloc_v2`, `cuLaunchKernel_ptsz`).
///
/// Chosen by the pointer, not by the name and version: a driver newer than the CUDA 12.9 table
/// may answer with an ABI variant of a managed function that we do not know (another signature
/// or semantics), and our wrapper of the old variant would be called with the new variant's
/// arguments. Such a pointer is left as the driver gave it (the function then runs unmanaged),
/// and said so under `GPUSHARE_LOG`.
fn swap_in_wrapper(symbol: *const c_char, pfn: *mut P, version: c_int, flags: u64) {
    if pfn.is_null() {
        return;
    }
    // SAFETY: `pfn` is the caller's out-pointer, just written by the real driver.
    let returned = unsafe { *pfn };
    if returned.is_null() {
        return;
    }
    if let Some(w) = wrapper_for(returned as usize, driver_addresses()) {
        // SAFETY: as above.
        unsafe { *pfn = w as P };
        return;
    }
    if crate::log::enabled() && !symbol.is_null() {
        // SAFETY: non-null, NUL-terminated per cuGetProcAddress's contract.
        let name = unsafe { CStr::from_ptr(symbol) }.to_string_lossy();
        let managed = gpushare_cuda_abi::entry_points(&name)
            .iter()
            .any(|e| wrapper(e.symbol.as_bytes()).is_some());
        if managed {
            crate::log::debug!(
                "cuGetProcAddress({name}, {version}, flags {flags}) gave {returned:?} ({}), no variant the hook wraps: left unmanaged",
                symbol_at(returned)
            );
        }
    }
}

/// The dynamic symbol at address `p` and its object (`dladdr`), for diagnostics.
fn symbol_at(p: P) -> String {
    // SAFETY: all-zero is a valid `Dl_info` (null pointers), filled in by dladdr.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address and writes `info`.
    if unsafe { libc::dladdr(p, &mut info) } == 0 {
        return "in no loaded object".into();
    }
    let text = |s: *const c_char| {
        // SAFETY: dladdr's strings are null or NUL-terminated and live as long as the object.
        (!s.is_null()).then(|| unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
    };
    let object = text(info.dli_fname).unwrap_or_default();
    match text(info.dli_sname) {
        Some(name) if info.dli_saddr == p => format!("{name} in {object}"),
        _ => format!("in {object}"),
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
        if r == CUDA_SUCCESS {
            swap_in_wrapper(symbol, pfn, version, flags);
        }
        r
    };
    crate::guarded(run)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut P,
    version: c_int,
    flags: u64,
    status: *mut CUdriverProcAddressQueryResult,
) -> CUresult {
    let run = || {
        // SAFETY: forwards the caller's arguments unchanged.
        let r = real::cuGetProcAddress_v2().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe {
            f(symbol, pfn, version, flags, status)
        });
        if r == CUDA_SUCCESS {
            swap_in_wrapper(symbol, pfn, version, flags);
        }
        r
    };
    crate::guarded(run)
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

    /// A made-up driver: each managed symbol at its own address, and `extra` too.
    fn made_up_driver(extra: &'static str) -> impl Fn(&str) -> usize {
        move |name: &str| {
            let table = wrappers();
            let i = table.iter().position(|(n, _)| *n == name);
            match i {
                Some(i) => 0x1000 * (i + 1),
                None if name == extra => 0x99_0000,
                None => 0,
            }
        }
    }

    #[test]
    fn the_wrapper_handed_out_is_the_one_of_the_exact_symbol_returned() {
        let addr = made_up_driver("cuMemAlloc");
        let table = real_addresses(&addr);
        assert_eq!(table.len(), wrappers().len());
        for (name, w) in wrappers() {
            assert_eq!(wrapper_for(addr(name), &table), Some(w as usize), "{name}");
        }
        assert_eq!(
            wrapper_for(addr("cuMemAlloc_v2"), &table),
            Some(memory::cuMemAlloc_v2 as P as usize)
        );
        assert_eq!(
            wrapper_for(addr("cuLaunchKernel_ptsz"), &table),
            Some(launch::cuLaunchKernel_ptsz as P as usize)
        );
    }

    #[test]
    fn a_variant_the_hook_does_not_wrap_is_left_alone() {
        let addr = made_up_driver("cuMemAlloc");
        let table = real_addresses(&addr);
        // The 32-bit `cuMemAlloc` of CUDA 2.0, or a variant newer than the 12.9 table: any
        // address that is not a wrapped symbol's own.
        assert_eq!(wrapper_for(addr("cuMemAlloc"), &table), None);
        assert_eq!(wrapper_for(addr("cuMemAlloc_v2") + 8, &table), None);
        assert_eq!(wrapper_for(0, &table), None);
    }

    #[test]
    fn symbols_the_driver_lacks_are_left_out() {
        let table = real_addresses(|name| if name == "cuMemAlloc_v2" { 0x1000 } else { 0 });
        assert_eq!(table, vec![(0x1000, memory::cuMemAlloc_v2 as P as usize)]);
        assert_eq!(wrapper_for(0, &table), None);
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
            "cuMemRetainAllocationHandle",
            "cuMemMap",
            "cuMemUnmap",
            "cuArrayDestroy",
            "cuMipmappedArrayDestroy",
            "cuMemGetInfo_v2",
            "cuDeviceTotalMem_v2",
            "cuIpcGetMemHandle",
            "cuIpcOpenMemHandle",
            "cuIpcOpenMemHandle_v2",
        ];
        for n in names {
            assert!(wrapper(n.as_bytes()).is_some(), "{n} is not managed");
        }
    }

    /// Every ABI variant (`_v2`, `_ptsz`, …) of each function the hook must see is wrapped: a
    /// variant left out would let an application around the gate, the books or the fences.
    #[test]
    fn every_variant_of_each_managed_function_is_wrapped() {
        let managed = [
            // context lifetimes
            "cuCtxDestroy",
            "cuDevicePrimaryCtxRelease",
            "cuDevicePrimaryCtxReset",
            // synchronisations
            "cuCtxSynchronize",
            "cuStreamSynchronize",
            "cuEventSynchronize",
            // graph instantiations
            "cuGraphInstantiate",
            "cuGraphInstantiateWithFlags",
            "cuGraphInstantiateWithParams",
            // captures
            "cuStreamBeginCapture",
            "cuStreamBeginCaptureToGraph",
            "cuStreamEndCapture",
            // launches
            "cuLaunchKernel",
            "cuLaunchKernelEx",
            "cuLaunchCooperativeKernel",
            "cuLaunchCooperativeKernelMultiDevice",
            "cuGraphLaunch",
        ];
        for entry in gpushare_cuda_abi::ENTRY_POINTS {
            if managed.contains(&entry.name) {
                assert!(
                    wrapper(entry.symbol.as_bytes()).is_some(),
                    "{} is not wrapped",
                    entry.symbol
                );
            }
        }
    }
}
