//! Stream captures: counted, so the hook's own calls never disturb one.

use super::P;
use crate::real;
use gpushare_cuda_abi::result::{
    CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED, CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, CUDA_SUCCESS,
};
use gpushare_cuda_abi::types::{CUresult, CUstreamCaptureMode};
use std::ffi::c_void;

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
