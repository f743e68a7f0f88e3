//! Context lifetimes: the hook's fence events die with their context.

use super::P;
use crate::process::hook;
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
    let r = call().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
    if r == 0
        && let Some(h) = hook()
    {
        h.forget_contexts(ctx.map(crate::driver::Handle::from_raw), dev);
    }
    r
}

hooked! {
    fn cuCtxDestroy(ctx: P) |real| { destroying(Some(ctx), None, real) }
    fn cuCtxDestroy_v2(ctx: P) |real| { destroying(Some(ctx), None, real) }
    fn cuDevicePrimaryCtxRelease(dev: CUdevice) |real| { destroying(None, Some(dev), real) }
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) |real| { destroying(None, Some(dev), real) }
    fn cuDevicePrimaryCtxReset(dev: CUdevice) |real| { destroying(None, Some(dev), real) }
    fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) |real| { destroying(None, Some(dev), real) }
}
