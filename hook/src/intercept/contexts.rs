//! Context lifetimes: the hook's fence events die with their context.

use super::P;
use crate::process::hook;
use crate::real;
use gpushare_cuda_abi::result::CUDA_ERROR_NOT_INITIALIZED;
use gpushare_cuda_abi::types::{CUdevice, CUresult};

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
