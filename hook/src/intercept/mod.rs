//! The FFI surface: every route by which an application reaches a launch entry point ends at
//! one of the wrappers here.
//! 1. direct linking: the `cu*` launch symbols are exported, and preloading puts them first;
//! 2. `dlsym(handle, "cuLaunchKernel")`: `dlsym` itself is exported and answers with a wrapper;
//! 3. `cuGetProcAddress`/`_v2`: the real driver resolves the name and ABI version, and the
//!    pointer it returns is swapped for our wrapper only if it is the driver's own address of the
//!    exact symbol that wrapper wraps (see `lookup::swap_in_wrapper`).
//!
//! Each hooked symbol is declared once, by `hooked!` (below), which emits its wrapper, its real
//! accessor and its row in the table behind `dlsym` and `cuGetProcAddress`.
//!
//! One module per concern: [`launch`] (kernel launches through the gate), [`graphs`] (a graph
//! launch gated as all its kernels), [`sync`] (synchronisations hand the turn over),
//! [`capture`] (stream captures counted so the hook never disturbs one), [`contexts`] (context
//! lifetimes), [`memory`] (allocations, frees and memory queries held to the group's cap),
//! [`lookup`] (the symbol table behind `dlsym` and `cuGetProcAddress`).

/// Declare the hooked symbols of one module, each once. For every
/// `fn cuName(arg: Type, …) |real| { body }` it emits
/// - the exported wrapper `cuName`, returning `CUresult`; its body runs with `real`, a closure
///   that calls the real driver's `cuName` with the caller's arguments unchanged (`None`: the
///   driver lacks it), and a panic in it never crosses into the caller, which gets
///   `CUDA_ERROR_UNKNOWN` instead;
/// - the accessor of the real `cuName`, resolved once and cached in an atomic;
/// - the wrapper's row in the module's `HOOKED` table (`(symbol, wrapper)`), which
///   `lookup` answers `dlsym` and `cuGetProcAddress` from, the wrapper checked at compile time
///   against the type cuda.h gives the symbol (`gpushare_cuda_abi::pfn`): a wrapper typed
///   otherwise, or named after no driver function, does not build.
///
/// One invocation per module (a second would define `HOOKED` twice); a module's table that
/// `lookup` does not list is dead code (a `dead_code` warning, denied in clippy runs).
macro_rules! hooked {
    ($(
        $(#[$attr:meta])*
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?) |$real:ident| $body:block
    )*) => {
        $(
            $(#[$attr])*
            #[unsafe(no_mangle)]
            pub extern "C" fn $name($($arg: $ty),*) -> gpushare_cuda_abi::types::CUresult {
                $crate::real::real_fn!(fn real_fn = $name);
                // SAFETY: the caller's arguments, unchanged, to the real function of the same
                // name, typed as cuda.h declares it.
                let $real = || real_fn().map(|f| unsafe { f($($arg),*) });
                $crate::guarded(|| $body)
            }
        )*

        /// This module's hooked symbols and their wrappers, each checked against the type
        /// cuda.h gives the symbol.
        pub(crate) const HOOKED: &[(&str, *mut std::ffi::c_void)] = &[$((
            stringify!($name),
            {
                const WRAPPER: gpushare_cuda_abi::pfn::$name = $name;
                WRAPPER as *mut std::ffi::c_void
            },
        )),*];
    };
}

mod capture;
mod contexts;
mod graphs;
mod launch;
mod lookup;
mod memory;
mod sync;

use crate::gate::Gate;
use crate::process::hook;
use std::ffi::c_void;

type P = *mut c_void;
/// The gate of the current context's GPU (`None`: nothing to gate).
#[inline]
fn current_gate() -> Option<&'static Gate> {
    hook()?.gate_for_current()
}
