//! Kernel launches: every launch entry point runs through the gate of the current GPU.

use super::{P, current_gate};
use crate::real;
use gpushare_cuda_abi::result::CUDA_ERROR_NOT_INITIALIZED;
use gpushare_cuda_abi::result::CUDA_ERROR_NOT_PERMITTED;
use gpushare_cuda_abi::types::{CUDA_LAUNCH_PARAMS, CUlaunchConfig, CUresult};

/// Run a launch through the gate of the current GPU. A launch into a stream being captured
/// only adds a node to the capture's graph: it is neither gated nor fenced (the graph's launches
/// are).
#[inline(always)]
fn gated(stream: Option<(P, bool)>, launch: impl FnOnce() -> Option<CUresult>) -> CUresult {
    gated_launches(stream, 1, launch)
}

/// [`gated`] for a launch of `launches` kernels at once (a graph).
#[inline(always)]
pub(super) fn gated_launches(
    stream: Option<(P, bool)>,
    launches: u64,
    launch: impl FnOnce() -> Option<CUresult>,
) -> CUresult {
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
}

/// The stream of a `CUlaunchConfig` (null if there is none).
fn config_stream(config: *const CUlaunchConfig) -> P {
    if config.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a non-null config is the caller's valid `CUlaunchConfig`, per the API contract.
    unsafe { (*config).hStream }
}

hooked! {
    fn cuLaunchKernel(f: P, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: P,
        params: *mut P, extra: *mut P) |real| {
        gated(Some((s, false)), real)
    }
    fn cuLaunchKernel_ptsz(f: P, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32,
        s: P, params: *mut P, extra: *mut P) |real| {
        gated(Some((s, true)), real)
    }
    fn cuLaunchCooperativeKernel(f: P, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
        sh: u32, s: P, params: *mut P) |real| {
        gated(Some((s, false)), real)
    }
    fn cuLaunchCooperativeKernel_ptsz(f: P, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
        sh: u32, s: P, params: *mut P) |real| {
        gated(Some((s, true)), real)
    }
    fn cuLaunchKernelEx(config: *const CUlaunchConfig, f: P, params: *mut P, extra: *mut P) |real| {
        gated(Some((config_stream(config), false)), real)
    }
    fn cuLaunchKernelEx_ptsz(config: *const CUlaunchConfig, f: P, params: *mut P, extra: *mut P)
        |real| {
        gated(Some((config_stream(config), true)), real)
    }
    /// One launch per device in one call: gated on the current GPU, not paced per stream.
    fn cuLaunchCooperativeKernelMultiDevice(list: *mut CUDA_LAUNCH_PARAMS, n: u32, flags: u32)
        |real| {
        gated(None, real)
    }
}
