//! Swapping processes' GPU memory to host memory and back through the driver's checkpoint API
//! (`cuCheckpointProcessLock / Checkpoint / Restore / Unlock`, CUDA 12.8+), on a thread of its
//! own: a swap takes seconds, the event loop never waits for one. After a restart it also asks
//! the driver where the memory of a process that holds some is (`cuCheckpointProcessGetState`),
//! whether the process reconnected or is only in the memory journal, since a previous daemon
//! may have been killed mid-swap, and unlocks a process left locked with its memory on the
//! GPU; a pid that no longer names the process the journal recorded (another start time) is
//! left alone. The daemon loads the driver
//! (`libcuda.so.1`) the first time it swaps; it runs with the host's pids (the DaemonSet's
//! `hostPID`), which are the pids these calls take.

use crate::inbox::Inbox;
use crate::memory::ProcessId;
use crate::node::{Input, SwapOutFailure};
use gpushare_cuda_abi::pfn;
use gpushare_cuda_abi::result::{CUDA_ERROR_NOT_SUPPORTED, CUDA_SUCCESS};
use gpushare_cuda_abi::types::{
    CU_PROCESS_STATE_CHECKPOINTED, CU_PROCESS_STATE_LOCKED, CUcheckpointCheckpointArgs,
    CUcheckpointLockArgs, CUcheckpointRestoreArgs, CUcheckpointUnlockArgs, CUprocessState,
    CUresult,
};
use std::ffi::{CStr, c_void};
use std::sync::mpsc::{Receiver, Sender, channel};

/// A swap for the thread to carry out.
pub enum Job {
    Out {
        swap: u64,
        pids: Vec<u32>,
        lock_timeout_ms: u32,
    },
    In {
        swap: u64,
        pids: Vec<u32>,
    },
    /// Where `process`'s memory is; unlocked if it is locked with its memory on the GPU.
    Settle {
        id: u64,
        process: ProcessId,
    },
}

/// Start the swapping thread; it posts each outcome to `inbox`.
pub fn spawn(inbox: Inbox) -> std::io::Result<Sender<Job>> {
    let (tx, rx) = channel();
    std::thread::Builder::new()
        .name("swap".into())
        .spawn(move || run(rx, inbox))?;
    Ok(tx)
}

fn run(rx: Receiver<Job>, inbox: Inbox) {
    let mut driver: Option<Result<Driver, String>> = None;
    for job in rx {
        let job = match job {
            // Not the process asked about (gone, its pid maybe reused): left alone. (Without a
            // start time, only a connected client's pid is asked about: its connection vouches.)
            Job::Settle { id, process } if crate::journal::alive(&process) == Some(false) => {
                tracing::info!(
                    pid = process.pid,
                    "not asking the driver about a process that is gone"
                );
                let input = Input::Settled {
                    id,
                    checkpointed: false,
                };
                if !inbox.input(input) {
                    return;
                }
                continue;
            }
            job => job,
        };
        let d = driver.get_or_insert_with(Driver::load);
        let input = match (job, &*d) {
            (Job::Out { swap, .. }, Err(e)) => {
                tracing::error!("cannot swap GPU memory to host memory: {e}");
                Input::SwappedOut {
                    swap,
                    outcome: Err(SwapOutFailure::Refused),
                }
            }
            (Job::In { swap, .. }, Err(e)) => {
                tracing::error!("cannot restore GPU memory: {e}");
                Input::SwappedIn { swap, ok: false }
            }
            // Without the driver nothing was swapped by this node.
            (Job::Settle { id, .. }, Err(_)) => Input::Settled {
                id,
                checkpointed: false,
            },
            (Job::Settle { id, process }, Ok(d)) => Input::Settled {
                id,
                checkpointed: d.settle(process.pid),
            },
            (
                Job::Out {
                    swap,
                    pids,
                    lock_timeout_ms,
                },
                Ok(d),
            ) => {
                let outcome = d.swap_out(&pids, lock_timeout_ms);
                Input::SwappedOut { swap, outcome }
            }
            (Job::In { swap, pids }, Ok(d)) => Input::SwappedIn {
                swap,
                ok: d.swap_in(&pids),
            },
        };
        if !inbox.input(input) {
            return;
        }
    }
}

/// The driver's checkpoint entry points.
struct Driver {
    lock: pfn::cuCheckpointProcessLock,
    checkpoint: pfn::cuCheckpointProcessCheckpoint,
    restore: pfn::cuCheckpointProcessRestore,
    unlock: pfn::cuCheckpointProcessUnlock,
    get_state: pfn::cuCheckpointProcessGetState,
}

impl Driver {
    fn load() -> Result<Driver, String> {
        // SAFETY: dlopen of a static NUL-terminated name; the handle is kept for the process.
        let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
        if lib.is_null() {
            return Err(
                "the CUDA driver (libcuda.so.1) cannot be loaded: mount the driver into \
                        the scheduler's container, or keep memory_overcommit at 1"
                    .into(),
            );
        }
        let sym = |name: &CStr| -> Result<*mut c_void, String> {
            // SAFETY: dlsym on a live handle with a NUL-terminated name.
            let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
            if p.is_null() {
                Err(format!(
                    "the CUDA driver has no {}: swapping to host memory needs driver r570 \
                     (CUDA 12.8) or later",
                    name.to_string_lossy()
                ))
            } else {
                Ok(p)
            }
        };
        let init = sym(c"cuInit")?;
        // SAFETY: each symbol is the driver's function of that name, with the type cuda.h gives.
        let d = unsafe {
            let init = std::mem::transmute::<*mut c_void, pfn::cuInit>(init);
            let r = init(0);
            if r != CUDA_SUCCESS {
                return Err(format!("cuInit failed ({})", name(r)));
            }
            Driver {
                lock: std::mem::transmute::<*mut c_void, pfn::cuCheckpointProcessLock>(sym(
                    c"cuCheckpointProcessLock",
                )?),
                checkpoint: std::mem::transmute::<*mut c_void, pfn::cuCheckpointProcessCheckpoint>(
                    sym(c"cuCheckpointProcessCheckpoint")?,
                ),
                restore: std::mem::transmute::<*mut c_void, pfn::cuCheckpointProcessRestore>(sym(
                    c"cuCheckpointProcessRestore",
                )?),
                unlock: std::mem::transmute::<*mut c_void, pfn::cuCheckpointProcessUnlock>(sym(
                    c"cuCheckpointProcessUnlock",
                )?),
                get_state: std::mem::transmute::<*mut c_void, pfn::cuCheckpointProcessGetState>(
                    sym(c"cuCheckpointProcessGetState")?,
                ),
            }
        };
        Ok(d)
    }

    /// Lock every process (each waits for its submitted work), then checkpoint every one; on
    /// a failure, what was done is undone and the processes run on.
    fn swap_out(&self, pids: &[u32], lock_timeout_ms: u32) -> Result<(), SwapOutFailure> {
        let failure = |r: CUresult| {
            if r == CUDA_ERROR_NOT_SUPPORTED {
                SwapOutFailure::Refused
            } else {
                SwapOutFailure::TimedOut
            }
        };
        for (i, &pid) in pids.iter().enumerate() {
            let r = self.lock_one(pid, lock_timeout_ms);
            if r != CUDA_SUCCESS {
                tracing::warn!(
                    pid,
                    "checkpoint lock failed ({}): the group runs on",
                    name(r)
                );
                self.unlock_all(&pids[..i]);
                return Err(failure(r));
            }
        }
        for (i, &pid) in pids.iter().enumerate() {
            let mut args = CUcheckpointCheckpointArgs { reserved: [0; 8] };
            // SAFETY: the driver's entry point with a valid argument record.
            let r = unsafe { (self.checkpoint)(pid as i32, &mut args) };
            if r != CUDA_SUCCESS {
                tracing::warn!(pid, "checkpoint failed ({}): the group runs on", name(r));
                for &done in &pids[..i] {
                    self.restore_one(done);
                }
                self.unlock_all(pids);
                return Err(failure(r));
            }
        }
        Ok(())
    }

    /// Restore every process, then unlock it; false if one could not be restored. One already
    /// restored (by a restore a previous daemon began) is only unlocked.
    fn swap_in(&self, pids: &[u32]) -> bool {
        let mut ok = true;
        for &pid in pids {
            let r = self.restore_one(pid);
            if r != CUDA_SUCCESS && self.state(pid) != Some(CU_PROCESS_STATE_LOCKED) {
                tracing::error!(pid, "restore failed ({})", name(r));
                ok = false;
                continue;
            }
            self.unlock_all(&[pid]);
        }
        ok
    }

    /// Whether process `pid`'s memory is in host memory (checkpointed); one locked with its
    /// memory on the GPU (a swap cut short before its checkpoint, or after its restore) is
    /// unlocked. A checkpoint or restore a previous daemon began may still be under way in
    /// the driver: it ends before the unlock, which then finds the process checkpointed.
    fn settle(&self, pid: u32) -> bool {
        if self.state(pid) == Some(CU_PROCESS_STATE_LOCKED) {
            tracing::info!(pid, "unlocking a process a swap left locked");
            self.unlock_all(&[pid]);
        }
        self.state(pid) == Some(CU_PROCESS_STATE_CHECKPOINTED)
    }

    /// The driver's state of process `pid` (`None`: it does not say).
    fn state(&self, pid: u32) -> Option<CUprocessState> {
        let mut state: CUprocessState = 0;
        // SAFETY: the driver's entry point with a valid out-pointer.
        let r = unsafe { (self.get_state)(pid as i32, &mut state) };
        (r == CUDA_SUCCESS).then_some(state)
    }

    fn lock_one(&self, pid: u32, timeout_ms: u32) -> CUresult {
        let mut args = CUcheckpointLockArgs {
            timeoutMs: timeout_ms,
            reserved0: 0,
            reserved1: [0; 7],
        };
        // SAFETY: the driver's entry point with a valid argument record.
        unsafe { (self.lock)(pid as i32, &mut args) }
    }

    fn restore_one(&self, pid: u32) -> CUresult {
        let mut args = CUcheckpointRestoreArgs { reserved: [0; 8] };
        // SAFETY: the driver's entry point with a valid argument record.
        unsafe { (self.restore)(pid as i32, &mut args) }
    }

    fn unlock_all(&self, pids: &[u32]) {
        for &pid in pids {
            let mut args = CUcheckpointUnlockArgs { reserved: [0; 8] };
            // SAFETY: the driver's entry point with a valid argument record.
            let r = unsafe { (self.unlock)(pid as i32, &mut args) };
            if r != CUDA_SUCCESS {
                tracing::warn!(pid, "checkpoint unlock failed ({})", name(r));
            }
        }
    }
}

fn name(r: CUresult) -> String {
    gpushare_cuda_abi::error_name(r).map_or_else(|| r.to_string(), str::to_string)
}
