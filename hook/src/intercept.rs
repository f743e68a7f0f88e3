//! The FFI surface: every route by which an application reaches a launch entry point ends at
//! one of the wrappers here.
//! 1. direct linking: the `cu*` launch symbols are exported, and preloading puts them first;
//! 2. `dlsym(handle, "cuLaunchKernel")`: `dlsym` itself is exported and answers with a wrapper;
//! 3. `cuGetProcAddress`/`_v2`: the real driver resolves the name and ABI version, and the
//!    pointer it returns is swapped for our wrapper only if it is the driver's own address of the
//!    exact symbol that wrapper wraps (see [`swap_in_wrapper`]).

use crate::gate::Gate;
use crate::memory;
use crate::process::hook;
use crate::real;
use gpushare_cuda_abi::pfn;
use gpushare_cuda_abi::result::{
    CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED, CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, CUDA_SUCCESS,
};
use gpushare_cuda_abi::types::{
    CU_GRAPH_NODE_TYPE_KERNEL, CUDA_GRAPH_INSTANTIATE_PARAMS, CUDA_LAUNCH_PARAMS, CUdevice,
    CUdriverProcAddressQueryResult, CUgraphNodeType, CUlaunchConfig, CUresult, CUstreamCaptureMode,
};
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::{Mutex, OnceLock};

type P = *mut c_void;

/// The gate of the current context's GPU (`None`: nothing to gate).
#[inline]
fn current_gate() -> Option<&'static Gate> {
    hook()?.gate_for_current()
}

/// Run a launch through the gate of the current GPU. Panics never cross into the caller. A
/// launch into a stream being captured only adds a node to the capture's graph: it is neither
/// gated nor fenced (the graph's launches are).
#[inline(always)]
fn gated(stream: Option<(P, bool)>, launch: impl FnOnce() -> Option<CUresult>) -> CUresult {
    gated_launches(stream, 1, launch)
}

/// [`gated`] for a launch of `launches` kernels at once (a graph).
#[inline(always)]
fn gated_launches(
    stream: Option<(P, bool)>,
    launches: u64,
    launch: impl FnOnce() -> Option<CUresult>,
) -> CUresult {
    let run = || {
        if let Some((s, per_thread)) = stream
            && real::captures_active()
            && real::stream_capturing(s, per_thread)
        {
            return launch().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        }
        match current_gate() {
            Some(g) => {
                let Some(admitted) = g.enter(stream, launches) else {
                    return CUDA_ERROR_NOT_PERMITTED;
                };
                let r = launch();
                g.leave(admitted, stream);
                r
            }
            None => launch(),
        }
        .unwrap_or(CUDA_ERROR_NOT_INITIALIZED)
    };
    crate::guarded(run)
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
// --- graphs: a graph launch is gated as the launch of all its kernels ---------------------

/// Kernels of each executable graph instantiated in this process (exec handle → kernels).
fn graph_kernels() -> &'static Mutex<HashMap<usize, u64>> {
    static KERNELS: OnceLock<Mutex<HashMap<usize, u64>>> = OnceLock::new();
    KERNELS.get_or_init(Default::default)
}

/// The kernel nodes of `graph` (at least 1: a graph of other nodes counts as one launch).
fn kernel_nodes(graph: P) -> u64 {
    let (Some(get_nodes), Some(node_type)) = (real::cuGraphGetNodes(), real::cuGraphNodeGetType())
    else {
        return 1;
    };
    let mut n = 0usize;
    // SAFETY: real driver calls; the node array has room for the count the driver reported.
    unsafe {
        if get_nodes(graph, std::ptr::null_mut(), &mut n) != CUDA_SUCCESS || n == 0 {
            return 1;
        }
        let mut nodes = vec![std::ptr::null_mut(); n];
        if get_nodes(graph, nodes.as_mut_ptr(), &mut n) != CUDA_SUCCESS {
            return 1;
        }
        let kernels = nodes[..n.min(nodes.len())]
            .iter()
            .filter(|&&node| {
                let mut t: CUgraphNodeType = CUgraphNodeType::MAX;
                node_type(node, &mut t) == CUDA_SUCCESS && t == CU_GRAPH_NODE_TYPE_KERNEL
            })
            .count();
        kernels.max(1) as u64
    }
}

/// Run an instantiation; on success remember the executable graph's kernel count.
fn instantiated(exec: *mut P, graph: P, call: impl FnOnce() -> Option<CUresult>) -> CUresult {
    let run = || {
        let r = call().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        if r == CUDA_SUCCESS && !exec.is_null() {
            // SAFETY: the driver just wrote the new executable graph through this out-pointer.
            let e = unsafe { *exec } as usize;
            let kernels = kernel_nodes(graph);
            graph_kernels()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(e, kernels);
        }
        r
    };
    crate::guarded(run)
}

macro_rules! instantiate_wrapper {
    ($name:ident, ($exec:ident: *mut P, $graph:ident: P $(, $arg:ident: $ty:ty)*)) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($exec: *mut P, $graph: P $(, $arg: $ty)*) -> CUresult {
            // SAFETY: forwards the caller's arguments unchanged to the real function of the same
            // name and signature.
            instantiated($exec, $graph, || real::$name().map(|f| unsafe { f($exec, $graph $(, $arg)*) }))
        }
    };
}

instantiate_wrapper!(cuGraphInstantiate, (e: *mut P, g: P, err: *mut P, log: *mut c_char, n: usize));
instantiate_wrapper!(cuGraphInstantiate_v2, (e: *mut P, g: P, err: *mut P, log: *mut c_char, n: usize));
instantiate_wrapper!(cuGraphInstantiateWithFlags, (e: *mut P, g: P, flags: u64));
instantiate_wrapper!(cuGraphInstantiateWithParams,
    (e: *mut P, g: P, params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS));
instantiate_wrapper!(cuGraphInstantiateWithParams_ptsz,
    (e: *mut P, g: P, params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS));

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphExecDestroy(exec: P) -> CUresult {
    let run = || {
        graph_kernels()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(exec as usize));
        // SAFETY: forwards the caller's argument unchanged.
        real::cuGraphExecDestroy().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe { f(exec) })
    };
    crate::guarded(run)
}

fn graph_launch(exec: P, stream: P, per_thread: bool) -> CUresult {
    let kernels = graph_kernels()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(exec as usize))
        .copied()
        .unwrap_or(1);
    let launch = if per_thread {
        real::cuGraphLaunch_ptsz()
    } else {
        real::cuGraphLaunch()
    };
    // SAFETY: forwards the caller's arguments unchanged.
    gated_launches(Some((stream, per_thread)), kernels, || {
        launch.map(|f| unsafe { f(exec, stream) })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch(exec: P, stream: P) -> CUresult {
    graph_launch(exec, stream, false)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch_ptsz(exec: P, stream: P) -> CUresult {
    graph_launch(exec, stream, true)
}

/// Run a synchronisation, first letting the gate of the current GPU hand its token over if the
/// turn ends with the work being waited for, and telling it when the synchronisation returned.
fn synced(sync: impl FnOnce() -> Option<CUresult>) -> CUresult {
    let run = || {
        let gate = current_gate().map(|g| (g, g.before_sync()));
        let r = sync().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        if let Some((g, began)) = gate {
            g.after_sync(began);
        }
        r
    };
    crate::guarded(run)
}

macro_rules! sync_wrapper {
    ($name:ident = $real:ident, ($($arg:ident: $ty:ty),*)) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($($arg: $ty),*) -> CUresult {
            // SAFETY: forwards the caller's arguments unchanged to the real function of the same
            // name and signature.
            synced(|| real::$real().map(|f| unsafe { f($($arg),*) }))
        }
    };
}

// The application's own synchronisations go to the driver unchanged (`raw_`: not the hook's
// capture-safe use of the same functions).
sync_wrapper!(cuCtxSynchronize = raw_cuCtxSynchronize, ());
sync_wrapper!(cuStreamSynchronize = cuStreamSynchronize, (s: P));
sync_wrapper!(cuStreamSynchronize_ptsz = cuStreamSynchronize_ptsz, (s: P));
sync_wrapper!(cuEventSynchronize = raw_cuEventSynchronize, (e: P));

/// Run a capture's begin (`begin`) or end, keeping count of the captures under way, so the hook
/// knows when its own calls must not disturb one (see `real::captures_active`).
fn capture_call(begin: bool, call: impl FnOnce() -> Option<CUresult>) -> CUresult {
    let run = || {
        let r = call().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        crate::log::debug!("capture {} -> {r}", if begin { "begins" } else { "ends" });
        match (begin, r) {
            (true, CUDA_SUCCESS) => real::capture_begun(),
            // These errors end the capture too, as the driver documents.
            (
                false,
                CUDA_SUCCESS
                | CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
                | CUDA_ERROR_STREAM_CAPTURE_UNJOINED
                | CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
            ) => real::capture_ended(),
            _ => {}
        }
        r
    };
    crate::guarded(run)
}

macro_rules! capture_wrapper {
    ($name:ident, begin = $begin:expr, ($($arg:ident: $ty:ty),*)) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($($arg: $ty),*) -> CUresult {
            // SAFETY: forwards the caller's arguments unchanged to the real function of the same
            // name and signature.
            capture_call($begin, || real::$name().map(|f| unsafe { f($($arg),*) }))
        }
    };
}

capture_wrapper!(cuStreamBeginCapture, begin = true, (s: P));
capture_wrapper!(cuStreamBeginCapture_ptsz, begin = true, (s: P));
capture_wrapper!(cuStreamBeginCapture_v2, begin = true, (s: P, mode: CUstreamCaptureMode));
capture_wrapper!(cuStreamBeginCapture_v2_ptsz, begin = true, (s: P, mode: CUstreamCaptureMode));
capture_wrapper!(cuStreamBeginCaptureToGraph, begin = true,
    (s: P, g: P, deps: *const P, edges: *const c_void, n: usize, mode: CUstreamCaptureMode));
capture_wrapper!(cuStreamBeginCaptureToGraph_ptsz, begin = true,
    (s: P, g: P, deps: *const P, edges: *const c_void, n: usize, mode: CUstreamCaptureMode));
capture_wrapper!(cuStreamEndCapture, begin = false, (s: P, graph: *mut P));
capture_wrapper!(cuStreamEndCapture_ptsz, begin = false, (s: P, graph: *mut P));

// --- context lifetimes: the hook's fence events die with their context -------------------

/// Run a call that destroys context state (`ctx`: the one context it destroys, else every
/// context of the current device's gate: a primary context's reset or last release), then
/// have the gates forget the hook's events and contexts it destroyed: the driver may give the
/// same handles to new objects (a primary context keeps its handle across a reset), and a fence
/// recorded with a dead event would fail from then on.
fn destroying(
    ctx: Option<P>,
    dev: Option<CUdevice>,
    call: impl FnOnce() -> Option<CUresult>,
) -> CUresult {
    let run = || {
        let r = call().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
        if r == 0
            && let Some(h) = hook()
        {
            h.forget_contexts(ctx.map(crate::driver::Handle::from_raw), dev);
        }
        r
    };
    crate::guarded(run)
}

macro_rules! context_wrapper {
    ($name:ident, ctx) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name(ctx: P) -> CUresult {
            // SAFETY: forwards the caller's argument unchanged to the real function.
            destroying(Some(ctx), None, || real::$name().map(|f| unsafe { f(ctx) }))
        }
    };
    ($name:ident, dev) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name(dev: CUdevice) -> CUresult {
            // SAFETY: forwards the caller's argument unchanged to the real function.
            destroying(None, Some(dev), || real::$name().map(|f| unsafe { f(dev) }))
        }
    };
}

context_wrapper!(cuCtxDestroy, ctx);
context_wrapper!(cuCtxDestroy_v2, ctx);
context_wrapper!(cuDevicePrimaryCtxRelease, dev);
context_wrapper!(cuDevicePrimaryCtxRelease_v2, dev);
context_wrapper!(cuDevicePrimaryCtxReset, dev);
context_wrapper!(cuDevicePrimaryCtxReset_v2, dev);

/// The stream of a `CUlaunchConfig` (null if there is none).
fn config_stream(config: *const CUlaunchConfig) -> P {
    if config.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a non-null config is the caller's valid `CUlaunchConfig`, per the API contract.
    unsafe { (*config).hStream }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernelEx(
    config: *const CUlaunchConfig,
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
    config: *const CUlaunchConfig,
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
pub extern "C" fn cuLaunchCooperativeKernelMultiDevice(
    list: *mut CUDA_LAUNCH_PARAMS,
    n: u32,
    flags: u32,
) -> CUresult {
    // One launch per device in one call: gated on the current GPU, not paced per stream.
    // SAFETY: forwards the caller's arguments unchanged.
    gated(None, || {
        real::cuLaunchCooperativeKernelMultiDevice().map(|r| unsafe { r(list, n, flags) })
    })
}

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

/// Managed symbols (launches, synchronisations, captures, allocations, frees, memory queries)
/// and their wrappers, sorted by name: every `cu*` symbol this library exports.
fn wrappers() -> [(&'static str, P); 57] {
    #[rustfmt::skip]
    let table = checked_wrappers! {
        cuArray3DCreate_v2 => memory::cuArray3DCreate_v2,
        cuArrayCreate_v2 => memory::cuArrayCreate_v2,
        cuArrayDestroy => memory::cuArrayDestroy,
        cuCtxDestroy => cuCtxDestroy,
        cuCtxDestroy_v2 => cuCtxDestroy_v2,
        cuCtxSynchronize => cuCtxSynchronize,
        cuDevicePrimaryCtxRelease => cuDevicePrimaryCtxRelease,
        cuDevicePrimaryCtxRelease_v2 => cuDevicePrimaryCtxRelease_v2,
        cuDevicePrimaryCtxReset => cuDevicePrimaryCtxReset,
        cuDevicePrimaryCtxReset_v2 => cuDevicePrimaryCtxReset_v2,
        cuDeviceTotalMem_v2 => memory::cuDeviceTotalMem_v2,
        cuEventSynchronize => cuEventSynchronize,
        cuGetProcAddress => cuGetProcAddress,
        cuGetProcAddress_v2 => cuGetProcAddress_v2,
        cuGraphExecDestroy => cuGraphExecDestroy,
        cuGraphInstantiate => cuGraphInstantiate,
        cuGraphInstantiateWithFlags => cuGraphInstantiateWithFlags,
        cuGraphInstantiateWithParams => cuGraphInstantiateWithParams,
        cuGraphInstantiateWithParams_ptsz => cuGraphInstantiateWithParams_ptsz,
        cuGraphInstantiate_v2 => cuGraphInstantiate_v2,
        cuGraphLaunch => cuGraphLaunch,
        cuGraphLaunch_ptsz => cuGraphLaunch_ptsz,
        cuLaunchCooperativeKernel => cuLaunchCooperativeKernel,
        cuLaunchCooperativeKernelMultiDevice => cuLaunchCooperativeKernelMultiDevice,
        cuLaunchCooperativeKernel_ptsz => cuLaunchCooperativeKernel_ptsz,
        cuLaunchKernel => cuLaunchKernel,
        cuLaunchKernelEx => cuLaunchKernelEx,
        cuLaunchKernelEx_ptsz => cuLaunchKernelEx_ptsz,
        cuLaunchKernel_ptsz => cuLaunchKernel_ptsz,
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
        cuStreamBeginCapture => cuStreamBeginCapture,
        cuStreamBeginCaptureToGraph => cuStreamBeginCaptureToGraph,
        cuStreamBeginCaptureToGraph_ptsz => cuStreamBeginCaptureToGraph_ptsz,
        cuStreamBeginCapture_ptsz => cuStreamBeginCapture_ptsz,
        cuStreamBeginCapture_v2 => cuStreamBeginCapture_v2,
        cuStreamBeginCapture_v2_ptsz => cuStreamBeginCapture_v2_ptsz,
        cuStreamEndCapture => cuStreamEndCapture,
        cuStreamEndCapture_ptsz => cuStreamEndCapture_ptsz,
        cuStreamSynchronize => cuStreamSynchronize,
        cuStreamSynchronize_ptsz => cuStreamSynchronize_ptsz,
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
            Some(cuLaunchKernel_ptsz as P as usize)
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
        ];
        for n in names {
            assert!(wrapper(n.as_bytes()).is_some(), "{n} is not managed");
        }
    }

    #[test]
    fn every_context_destroying_variant_is_seen() {
        let destroying = [
            "cuCtxDestroy",
            "cuDevicePrimaryCtxRelease",
            "cuDevicePrimaryCtxReset",
        ];
        for entry in gpushare_cuda_abi::ENTRY_POINTS {
            if destroying.contains(&entry.name) {
                assert!(
                    wrapper(entry.symbol.as_bytes()).is_some(),
                    "{} is not seen",
                    entry.symbol
                );
            }
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
    fn every_graph_instantiation_is_seen() {
        for entry in gpushare_cuda_abi::ENTRY_POINTS {
            let names = [
                "cuGraphInstantiate",
                "cuGraphInstantiateWithFlags",
                "cuGraphInstantiateWithParams",
            ];
            if names.contains(&entry.name) {
                assert!(
                    wrapper(entry.symbol.as_bytes()).is_some(),
                    "{} is not seen",
                    entry.symbol
                );
            }
        }
    }

    #[test]
    fn every_capture_begin_and_end_is_seen() {
        for entry in gpushare_cuda_abi::ENTRY_POINTS {
            let captures = [
                "cuStreamBeginCapture",
                "cuStreamBeginCaptureToGraph",
                "cuStreamEndCapture",
            ];
            if captures.contains(&entry.name) {
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
