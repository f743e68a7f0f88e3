//! Symbol lookup: the table of managed symbols and their wrappers, answered by our `dlsym` and
//! swapped into what the driver's `cuGetProcAddress` returns.

use super::{P, capture, contexts, graphs, launch, memory, sync};
use crate::real;
use gpushare_cuda_abi::result::{CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS};
use gpushare_cuda_abi::types::CUdriverProcAddressQueryResult;
use std::ffi::{CStr, CString, c_char, c_int};
use std::sync::OnceLock;

/// Every hooked symbol and its wrapper: the tables each module's `hooked!` declarations emit.
const SURFACE: [&[(&str, P)]; 7] = [
    launch::HOOKED,
    graphs::HOOKED,
    sync::HOOKED,
    capture::HOOKED,
    contexts::HOOKED,
    memory::HOOKED,
    HOOKED,
];

/// The hooked symbols and their wrappers: every `cu*` symbol this library exports.
fn wrappers() -> impl Iterator<Item = (&'static str, P)> {
    SURFACE.into_iter().flatten().copied()
}

/// The wrapper of the hooked `symbol`, if it is one.
fn wrapper(symbol: &[u8]) -> Option<P> {
    wrappers()
        .find(|(name, _)| name.as_bytes() == symbol)
        .map(|(_, w)| w)
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
        .map(|(name, w)| (real(name), w as usize))
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

hooked! {
    fn cuGetProcAddress(symbol: *const c_char, pfn: *mut P, version: c_int, flags: u64) |real| {
        let r = real().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        if r == CUDA_SUCCESS {
            swap_in_wrapper(symbol, pfn, version, flags);
        }
        r
    }
    fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut P, version: c_int, flags: u64,
        status: *mut CUdriverProcAddressQueryResult) |real| {
        let r = real().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        if r == CUDA_SUCCESS {
            swap_in_wrapper(symbol, pfn, version, flags);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_hooked_symbol_is_a_driver_entry_point_once() {
        let real: Vec<&str> = gpushare_cuda_abi::symbols().collect();
        let mut names: Vec<&str> = wrappers().map(|(name, _)| name).collect();
        for name in &names {
            assert!(real.contains(name), "{name}");
        }
        names.sort_unstable();
        assert!(names.windows(2).all(|w| w[0] < w[1]), "{names:?}");
    }

    /// A made-up driver: each managed symbol at its own address, and `extra` too.
    fn made_up_driver(extra: &'static str) -> impl Fn(&str) -> usize {
        move |name: &str| match wrappers().position(|(n, _)| n == name) {
            Some(i) => 0x1000 * (i + 1),
            None if name == extra => 0x99_0000,
            None => 0,
        }
    }

    #[test]
    fn the_wrapper_handed_out_is_the_one_of_the_exact_symbol_returned() {
        let addr = made_up_driver("cuMemAlloc");
        let table = real_addresses(&addr);
        assert_eq!(table.len(), wrappers().count());
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

    /// Every ABI variant (`_v2`, `_ptsz`, …) of each function the hook must see is wrapped: a
    /// variant left out would let an application around the gate, the books or the fences. Each
    /// function comes with the CUDA version from which on its variants are wrapped: the 32-bit
    /// variants of CUDA 2.0 (`cuMemAlloc`, before `cuMemAlloc_v2` of 3.2) are left alone.
    #[test]
    fn every_variant_of_each_managed_function_is_wrapped() {
        let managed = [
            // context lifetimes
            ("cuCtxDestroy", 0),
            ("cuDevicePrimaryCtxRelease", 0),
            ("cuDevicePrimaryCtxReset", 0),
            // synchronisations
            ("cuCtxSynchronize", 0),
            ("cuStreamSynchronize", 0),
            ("cuEventSynchronize", 0),
            // graph instantiations
            ("cuGraphInstantiate", 0),
            ("cuGraphInstantiateWithFlags", 0),
            ("cuGraphInstantiateWithParams", 0),
            ("cuGraphExecDestroy", 0),
            // captures
            ("cuStreamBeginCapture", 0),
            ("cuStreamBeginCaptureToGraph", 0),
            ("cuStreamEndCapture", 0),
            // launches
            ("cuLaunchKernel", 0),
            ("cuLaunchKernelEx", 0),
            ("cuLaunchCooperativeKernel", 0),
            ("cuLaunchCooperativeKernelMultiDevice", 0),
            ("cuGraphLaunch", 0),
            // allocations, frees and memory queries
            ("cuMemAlloc", 3020),
            ("cuMemAllocPitch", 3020),
            ("cuMemAllocManaged", 0),
            ("cuMemAllocAsync", 0),
            ("cuMemAllocFromPoolAsync", 0),
            ("cuMemCreate", 0),
            ("cuArrayCreate", 3020),
            ("cuArray3DCreate", 3020),
            ("cuMipmappedArrayCreate", 0),
            ("cuMemFree", 3020),
            ("cuMemFreeAsync", 0),
            ("cuMemRelease", 0),
            ("cuMemRetainAllocationHandle", 0),
            ("cuMemMap", 0),
            ("cuMemUnmap", 0),
            ("cuArrayDestroy", 0),
            ("cuMipmappedArrayDestroy", 0),
            ("cuMemGetInfo", 3020),
            ("cuDeviceTotalMem", 3020),
            // IPC exports and opens
            ("cuIpcGetMemHandle", 0),
            ("cuIpcOpenMemHandle", 0),
            // lookups
            ("cuGetProcAddress", 0),
        ];
        for (name, since) in managed {
            let variants = gpushare_cuda_abi::entry_points(name);
            assert!(!variants.is_empty(), "{name} is no driver function");
            for entry in variants.iter().filter(|e| e.version >= since) {
                assert!(
                    wrapper(entry.symbol.as_bytes()).is_some(),
                    "{} is not wrapped",
                    entry.symbol
                );
            }
        }
    }
}
