//! The FFI surface: every route by which an application reaches a launch entry point ends at
//! one of the wrappers here.
//! 1. direct linking: the `cu*` launch symbols are exported, and preloading puts them first;
//! 2. `dlsym(handle, "cuLaunchKernel")`: `dlsym` itself is exported and answers with a wrapper;
//! 3. `cuGetProcAddress`/`_v2`: the real driver resolves the name and ABI version, and the
//!    pointer it returns is swapped for our wrapper only if it is the driver's own address of the
//!    exact symbol that wrapper wraps (see [`swap_in_wrapper`]).

//!
//! One module per concern: [`launch`] (kernel launches through the gate), [`graphs`] (a graph
//! launch gated as all its kernels), [`sync`] (synchronisations hand the turn over),
//! [`capture`] (stream captures counted so the hook never disturbs one), [`contexts`] (context
//! lifetimes), [`lookup`] (the symbol table behind `dlsym` and `cuGetProcAddress`).

mod capture;
mod contexts;
mod graphs;
mod launch;
mod lookup;
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
