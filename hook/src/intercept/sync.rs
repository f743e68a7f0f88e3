//! Synchronisations: the application's own waits, which may end the turn early.

use super::{P, current_gate};
use gpushare_cuda_abi::result::CUDA_ERROR_NOT_INITIALIZED;
use gpushare_cuda_abi::types::CUresult;

/// Run a synchronisation, first letting the gate of the current GPU hand its token over if the
/// turn ends with the work being waited for, and telling it when the synchronisation returned.
fn synced(sync: impl FnOnce() -> Option<CUresult>) -> CUresult {
    let gate = current_gate().map(|g| (g, g.before_sync()));
    let r = sync().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
    if let Some((g, began)) = gate {
        g.after_sync(began);
    }
    r
}

// The application's own synchronisations go to the driver unchanged (not the hook's
// capture-safe use of the same functions, `real::cuCtxSynchronize`).
hooked! {
    fn cuCtxSynchronize() |real| { synced(real) }
    fn cuStreamSynchronize(s: P) |real| { synced(real) }
    fn cuStreamSynchronize_ptsz(s: P) |real| { synced(real) }
    fn cuEventSynchronize(e: P) |real| { synced(real) }
}
