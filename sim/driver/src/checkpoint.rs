//! This process as the target of the checkpoint calls (`cuCheckpointProcess*`) another
//! process makes: the device relays each call here ([`on_call`]) and relays the answer back.
//!
//! As the driver documents them: a lock blocks the process's further driver calls (every entry
//! point but the checkpoint calls and the error names waits at a [`Pass`]) and waits for its
//! calls under way and its submitted work, up to the lock's timeout, after which the process
//! runs on (`CUDA_ERROR_NOT_READY`); a checkpoint moves the bytes of every device allocation
//! into host memory and gives the GPU's memory back; a restore takes the memory again and puts
//! the bytes back at the same addresses; an unlock lets the process's calls through again.
//! A call in the wrong state answers `CUDA_ERROR_ILLEGAL_STATE` and changes nothing.
//!
//! What the real driver (r570 and later; measured on 580.159.04) does beyond its
//! documentation, the simulator does too: a checkpoint of a process holding managed memory
//! fails with `CUDA_ERROR_NOT_SUPPORTED` and leaves it locked; a restore that finds too little
//! memory fails with `CUDA_ERROR_OUT_OF_MEMORY` and leaves it checkpointed, and every later
//! restore of that process fails with `CUDA_ERROR_OPERATING_SYSTEM` (a controller must restore
//! only once the memory is there).

use crate::api_memory::{charged, map, page_round, release_physical, reserve_physical, unmap};
use crate::ffi::*;
use crate::state::{AllocKind, driver};
use gpushare_sim_wire::CheckpointCall;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The process's `CUprocessState`.
static STATE: AtomicU32 = AtomicU32::new(CU_PROCESS_STATE_RUNNING);
/// A restore failed for lack of memory: no later restore succeeds.
static RESTORE_BROKEN: AtomicBool = AtomicBool::new(false);
/// The thread the device's checkpoint calls arrive on (`cuCheckpointProcessGetRestoreThreadId`).
static RESTORE_TID: AtomicI32 = AtomicI32::new(0);

/// Closed while a lock holds (or is taking) the process: gated entry points wait.
static CLOSED: AtomicBool = AtomicBool::new(false);
/// Gated entry points under way.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// Guards the waits on [`CLOSED`] and [`IN_FLIGHT`].
static GATE: Mutex<()> = Mutex::new(());
static GATE_CHANGED: Condvar = Condvar::new();
/// One checkpoint call at a time.
static CALLS: Mutex<()> = Mutex::new(());

thread_local! {
    /// Entry points this thread is inside (a callback from within one may call another).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

fn gate() -> MutexGuard<'static, ()> {
    GATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A gated entry point's passage: entering waits while the process is locked; dropping it
/// lets a lock that waits for the calls under way go on.
pub struct Pass {
    counted: bool,
}

impl Pass {
    pub fn enter() -> Pass {
        let nested = DEPTH
            .try_with(|d| {
                d.set(d.get() + 1);
                d.get() > 1
            })
            .unwrap_or(true);
        if nested {
            return Pass { counted: false };
        }
        loop {
            IN_FLIGHT.fetch_add(1, SeqCst);
            if !CLOSED.load(SeqCst) {
                return Pass { counted: true };
            }
            leave();
            let mut g = gate();
            while CLOSED.load(SeqCst) {
                g = GATE_CHANGED.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        let _ = DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
        if self.counted {
            leave();
        }
    }
}

fn leave() {
    if IN_FLIGHT.fetch_sub(1, SeqCst) == 1 && CLOSED.load(SeqCst) {
        let _g = gate();
        GATE_CHANGED.notify_all();
    }
}

fn open_gate() {
    let _g = gate();
    CLOSED.store(false, SeqCst);
    GATE_CHANGED.notify_all();
}

/// Close the gate and wait until no gated call is under way, or `deadline`; false then (the
/// gate is left closed for the caller to reopen).
fn close_gate(deadline: Option<Instant>) -> bool {
    let mut g = gate();
    CLOSED.store(true, SeqCst);
    while IN_FLIGHT.load(SeqCst) > 0 {
        g = match deadline {
            None => GATE_CHANGED.wait(g).unwrap_or_else(|e| e.into_inner()),
            Some(at) => {
                let left = at.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return false;
                }
                GATE_CHANGED
                    .wait_timeout(g, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        };
    }
    true
}

/// A forked child starts unlocked, whatever its parent's state: it has a driver of its own to
/// initialise (or none).
extern "C" fn after_fork_in_child() {
    CLOSED.store(false, SeqCst);
    IN_FLIGHT.store(0, SeqCst);
    STATE.store(CU_PROCESS_STATE_RUNNING, SeqCst);
    RESTORE_BROKEN.store(false, SeqCst);
}

/// Called by the thread that receives the device's messages, once, as it starts.
pub fn this_is_the_restore_thread() {
    // SAFETY: gettid has no preconditions.
    RESTORE_TID.store(unsafe { libc::gettid() }, SeqCst);
    static ATFORK: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a handler that only stores to atomics.
    ATFORK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(after_fork_in_child));
    });
}

/// Carry out a checkpoint call the device relayed; `answer(result, value)` sends the outcome
/// back. Queries are answered at once; the others, which wait, on a thread of their own.
pub fn on_call(call: CheckpointCall, answer: impl FnOnce(CUresult, u64) + Send + 'static) {
    match call {
        CheckpointCall::GetState => answer(CUDA_SUCCESS, STATE.load(SeqCst) as u64),
        CheckpointCall::GetRestoreThreadId => {
            answer(CUDA_SUCCESS, RESTORE_TID.load(SeqCst) as u32 as u64)
        }
        call => {
            let spawned = std::thread::Builder::new()
                .name("sim-driver-ckpt".into())
                .spawn(move || {
                    let _one = CALLS.lock().unwrap_or_else(|e| e.into_inner());
                    let r = match call {
                        CheckpointCall::Lock { timeout_ms } => lock(timeout_ms),
                        CheckpointCall::Checkpoint => checkpoint(),
                        CheckpointCall::Restore => restore(),
                        _ => unlock(),
                    };
                    answer(r.err().unwrap_or(CUDA_SUCCESS), 0)
                });
            if spawned.is_err() {
                // Nothing was done; the caller learns the process could not act on it.
                eprintln!("gpushare-sim libcuda: cannot start a thread for a checkpoint call");
            }
        }
    }
}

fn in_state(want: CUprocessState) -> CuResult {
    if STATE.load(SeqCst) == want {
        Ok(())
    } else {
        Err(CUDA_ERROR_ILLEGAL_STATE)
    }
}

fn lock(timeout_ms: u32) -> CuResult {
    in_state(CU_PROCESS_STATE_RUNNING)?;
    let deadline =
        (timeout_ms > 0).then(|| Instant::now() + Duration::from_millis(timeout_ms.into()));
    if !(close_gate(deadline) && submitted_work_done(deadline)?) {
        open_gate();
        return Err(CUDA_ERROR_NOT_READY);
    }
    STATE.store(CU_PROCESS_STATE_LOCKED, SeqCst);
    Ok(())
}

/// Wait until every stream's work has completed, or `deadline`; whether it did.
fn submitted_work_done(deadline: Option<Instant>) -> CuResult<bool> {
    let Ok(d) = driver() else {
        return Ok(true);
    };
    let ops = {
        let st = d.lock();
        let ctxs: Vec<u64> = st.contexts.keys().copied().collect();
        ctxs.into_iter().flat_map(|c| st.ctx_tail(c)).collect()
    };
    d.client.wait_until(ops, deadline)
}

fn unlock() -> CuResult {
    in_state(CU_PROCESS_STATE_LOCKED)?;
    STATE.store(CU_PROCESS_STATE_RUNNING, SeqCst);
    open_gate();
    Ok(())
}

/// A device allocation's bytes while the process is checkpointed: kept in a host mapping of
/// the same size, at the same offsets (only the pages the device range had).
struct Parked {
    base: u64,
    len: usize,
    host: u64,
}

static PARKED: Mutex<Vec<Parked>> = Mutex::new(Vec::new());

fn checkpoint() -> CuResult {
    in_state(CU_PROCESS_STATE_LOCKED)?;
    let d = driver()?;
    let ranges: Vec<(u64, usize)> = {
        let st = d.lock();
        if st.allocs.values().any(|a| a.kind == AllocKind::Managed) {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        (st.allocs.iter())
            .filter(|(_, a)| a.kind == AllocKind::Device)
            .map(|(&b, a)| (b, page_round(a.size)))
            .collect()
    };
    let held = charged();
    std::thread::sleep(transfer_time(d, &held, |c, b| c.checkpoint_ns(b)));
    let mut parked = PARKED.lock().unwrap_or_else(|e| e.into_inner());
    for (base, len) in ranges {
        let host = map(len, true)?;
        copy_pages(host, base, len);
        // SAFETY: `base..base+len` is a device allocation of this process, whose calls are
        // locked out; its bytes were copied above, and no access is allowed until the restore.
        unsafe {
            libc::madvise(base as *mut libc::c_void, len, libc::MADV_DONTNEED);
            libc::mprotect(base as *mut libc::c_void, len, libc::PROT_NONE);
        }
        parked.push(Parked { base, len, host });
    }
    for (device, bytes) in held {
        release_physical(d, device, bytes)?;
    }
    STATE.store(CU_PROCESS_STATE_CHECKPOINTED, SeqCst);
    Ok(())
}

fn restore() -> CuResult {
    in_state(CU_PROCESS_STATE_CHECKPOINTED)?;
    if RESTORE_BROKEN.load(SeqCst) {
        return Err(CUDA_ERROR_OPERATING_SYSTEM);
    }
    let d = driver()?;
    let held = charged();
    for (i, &(device, bytes)) in held.iter().enumerate() {
        if reserve_physical(d, device, bytes).is_err() {
            for &(device, bytes) in &held[..i] {
                let _ = release_physical(d, device, bytes);
            }
            RESTORE_BROKEN.store(true, SeqCst);
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
    }
    std::thread::sleep(transfer_time(d, &held, |c, b| c.restore_ns(b)));
    let parked = std::mem::take(&mut *PARKED.lock().unwrap_or_else(|e| e.into_inner()));
    for p in parked {
        // SAFETY: the range was a device allocation made inaccessible at the checkpoint; it is
        // made accessible again and given its bytes back before the process runs on.
        unsafe {
            libc::mprotect(
                p.base as *mut libc::c_void,
                p.len,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        copy_pages(p.base, p.host, p.len);
        unmap(p.host, p.len);
    }
    STATE.store(CU_PROCESS_STATE_LOCKED, SeqCst);
    Ok(())
}

/// How long moving `held` (bytes per GPU) takes at each GPU's rates: one fixed cost, then the
/// bytes of each GPU in turn.
fn transfer_time(
    d: &crate::state::Driver,
    held: &[(u32, u64)],
    ns: impl Fn(&gpushare_sim_wire::SwapCost, u64) -> u64,
) -> Duration {
    let mut total = 0u64;
    let mut latency = 0u64;
    for &(device, bytes) in held {
        if let Some(c) = d.client.swap_cost(device) {
            latency = latency.max(c.latency_ns);
            total += ns(&c, bytes) - c.latency_ns;
        }
    }
    Duration::from_nanos(total + latency)
}

/// Copy the pages of `src..src+len` that hold anything (resident ones) to the same offsets
/// of `dst`; pages never touched read as zeros at both ends and are left alone.
fn copy_pages(dst: u64, src: u64, len: usize) {
    const PAGE: usize = 4096;
    let pages = len.div_ceil(PAGE);
    let mut resident = vec![0u8; pages];
    // SAFETY: `src..src+len` is one of this process's mappings (page aligned); mincore writes
    // one byte per page into `resident`, which has that many.
    let r = unsafe { libc::mincore(src as *mut libc::c_void, len, resident.as_mut_ptr()) };
    let mut i = 0;
    while i < pages {
        if r == 0 && resident[i] & 1 == 0 {
            i += 1;
            continue;
        }
        let start = i;
        while i < pages && (r != 0 || resident[i] & 1 != 0) {
            i += 1;
        }
        let off = start * PAGE;
        let n = (i * PAGE).min(len) - off;
        copy_bytes(dst + off as u64, src + off as u64, n);
    }
}
