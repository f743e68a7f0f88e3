//! The checkpoint calls a process makes on another (`cuCheckpointProcess*`, CUDA 12.8): the
//! device relays each to the target's driver ([`crate::checkpoint`] there) and relays its
//! answer back.
//!
//! Beyond the target's answers, what the real driver answers here (measured on 580.159.04):
//! a process that has not initialised CUDA, `CUDA_ERROR_NOT_INITIALIZED`; a process id that
//! names no process, `CUDA_ERROR_OPERATING_SYSTEM`. Arguments are optional; reserved fields
//! must be zero (`CUDA_ERROR_INVALID_VALUE` otherwise).

use crate::ffi::*;
use crate::state::driver;
use gpushare_sim_wire::{CheckpointCall, Reply, Request};
use std::ffi::c_int;

/// Ask process `pid` to carry out `call`; the value it answers with.
fn call(pid: c_int, call: CheckpointCall) -> CuResult<u64> {
    let d = driver()?;
    if pid <= 0 {
        return Err(CUDA_ERROR_OPERATING_SYSTEM);
    }
    let reply = d.client.call(|req| Request::Checkpoint {
        req,
        pid: pid as u32,
        call,
    });
    match reply {
        Ok(Reply::Checkpoint {
            result: 0, value, ..
        }) => Ok(value),
        Ok(Reply::Checkpoint { result, .. }) => Err(result),
        // The device knows no such process (or it exited meanwhile).
        Err(CUDA_ERROR_INVALID_VALUE) => Err(if process_exists(pid) {
            CUDA_ERROR_NOT_INITIALIZED
        } else {
            CUDA_ERROR_OPERATING_SYSTEM
        }),
        Err(e) => Err(e),
        Ok(_) => Err(CUDA_ERROR_UNKNOWN),
    }
}

fn process_exists(pid: c_int) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 || *libc::__errno_location() == libc::EPERM }
}

/// Reserved arguments of a call that takes none yet: absent, or all zero.
fn no_arguments(reserved: Option<[u64; 8]>) -> CuResult {
    match reserved {
        Some(r) if r.iter().any(|&x| x != 0) => Err(CUDA_ERROR_INVALID_VALUE),
        _ => Ok(()),
    }
}

/// The caller's optional arguments (`None`: a null pointer).
fn optional<T: Copy>(p: *const T) -> Option<T> {
    get(p).ok()
}

entry!(
    fn cuCheckpointProcessLock(pid: c_int, args: *mut CUcheckpointLockArgs) {
        let timeout_ms = match optional(args) {
            Some(a) if a.reserved0 != 0 || a.reserved1.iter().any(|&x| x != 0) => {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            Some(a) => a.timeoutMs,
            None => 0,
        };
        call(pid, CheckpointCall::Lock { timeout_ms }).map(|_| ())
    }
);

entry!(
    fn cuCheckpointProcessCheckpoint(pid: c_int, args: *mut CUcheckpointCheckpointArgs) {
        no_arguments(optional(args).map(|a| a.reserved))?;
        call(pid, CheckpointCall::Checkpoint).map(|_| ())
    }
);

entry!(
    fn cuCheckpointProcessRestore(pid: c_int, args: *mut CUcheckpointRestoreArgs) {
        no_arguments(optional(args).map(|a| a.reserved))?;
        call(pid, CheckpointCall::Restore).map(|_| ())
    }
);

entry!(
    fn cuCheckpointProcessUnlock(pid: c_int, args: *mut CUcheckpointUnlockArgs) {
        no_arguments(optional(args).map(|a| a.reserved))?;
        call(pid, CheckpointCall::Unlock).map(|_| ())
    }
);

entry!(
    fn cuCheckpointProcessGetState(pid: c_int, state: *mut CUprocessState) {
        if state.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let s = call(pid, CheckpointCall::GetState)?;
        put(state, s as CUprocessState)
    }
);

entry!(
    fn cuCheckpointProcessGetRestoreThreadId(pid: c_int, tid: *mut c_int) {
        if tid.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let t = call(pid, CheckpointCall::GetRestoreThreadId)?;
        put(tid, t as u32 as c_int)
    }
);
