//! Kernel launches: every launch entry point runs through the gate of the current GPU.

use super::{P, current_gate};
use crate::real;
use gpushare_cuda_abi::result::CUDA_ERROR_NOT_INITIALIZED;
use gpushare_cuda_abi::result::CUDA_ERROR_NOT_PERMITTED;
use gpushare_cuda_abi::types::{CUDA_LAUNCH_PARAMS, CUlaunchConfig, CUresult};

/// Run a launch through the gate of the current GPU. Panics never cross into the caller. A
/// launch into a stream being captured only adds a node to the capture's graph: it is neither
/// gated nor fenced (the graph's launches are).
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
