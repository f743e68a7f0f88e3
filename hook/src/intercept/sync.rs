//! Synchronisations: the application's own waits, which may end the turn early.

use super::{P, current_gate};
use crate::real;
use gpushare_cuda_abi::result::CUDA_ERROR_NOT_INITIALIZED;
use gpushare_cuda_abi::types::CUresult;

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
