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
}

hooked! {
    fn cuStreamBeginCapture(s: P) |real| { capture_call(true, real) }
    fn cuStreamBeginCapture_ptsz(s: P) |real| { capture_call(true, real) }
    fn cuStreamBeginCapture_v2(s: P, mode: CUstreamCaptureMode) |real| { capture_call(true, real) }
    fn cuStreamBeginCapture_v2_ptsz(s: P, mode: CUstreamCaptureMode) |real| {
        capture_call(true, real)
    }
    fn cuStreamBeginCaptureToGraph(s: P, g: P, deps: *const P, edges: *const c_void, n: usize,
        mode: CUstreamCaptureMode) |real| {
        capture_call(true, real)
    }
    fn cuStreamBeginCaptureToGraph_ptsz(s: P, g: P, deps: *const P, edges: *const c_void,
        n: usize, mode: CUstreamCaptureMode) |real| {
        capture_call(true, real)
    }
    fn cuStreamEndCapture(s: P, graph: *mut P) |real| { capture_call(false, real) }
    fn cuStreamEndCapture_ptsz(s: P, graph: *mut P) |real| { capture_call(false, real) }
}
