//! `libgpushare.so`: preloaded into tenant processes, it holds each kernel launch until the
//! process has its GPU's time turn from `gpushare-scheduler`, bounds the work queued on the GPU,
//! reports how long it really held the GPU, and holds allocations to the group's memory cap.
//!
//! Layers, lowest first (each module imports only those below it):
//! - [`real`] finds the real driver (and the real `dlsym`), each function typed as cuda.h
//!   declares it (`gpushare_cuda_abi::pfn`); [`driver`] wraps the hook's own driver calls in
//!   safe, typed functions;
//! - [`settings`] reads the environment; [`port`] is the connection to the scheduler;
//! - [`turn`] is the pure turn state machine and pacing arithmetic (tested in virtual time);
//!   [`queue`] (pure) estimates the GPU work this process has queued, from its fence events,
//!   fed the times and the driver's answers by the gate;
//!   [`books`] keeps the memory this process holds, and [`lease`] (pure) the arithmetic of
//!   what it holds at the scheduler;
//! - [`gate`] is one GPU's gate: the launch fast path, and a watcher and a drainer that carry
//!   out the machine's decisions;
//! - [`process`] is the process's hook: gates, port and books, and what happens at `fork`;
//! - [`charges`] reserves and gives back at the scheduler through the leases, and runs the
//!   thread that returns spare the process does not use;
//! - [`intercept`] is the FFI surface: the exported `cu*` symbols, `dlsym` and
//!   `cuGetProcAddress`, which route every launch, synchronisation and allocation; each hooked
//!   symbol is declared once (`intercept::hooked!`: its wrapper, real accessor and lookup row)
//!   and checked at compile time against the type cuda.h gives it.
//!
//! Rules for a guest in someone else's process: nothing runs at load time; no panic crosses
//! `extern "C"`; the fast path is a few atomic operations (no clock read, no lock); no output
//! unless `GPUSHARE_LOG` is set (or the scheduler is unreachable in fail-open mode, which warns
//! once).

// The documentation is read with the private items (`--document-private-items`), where
// links to them resolve.
#![allow(rustdoc::private_intra_doc_links)]

mod books;
mod charges;
mod driver;
mod gate;
mod intercept;
mod lease;
mod log;
mod port;
mod process;
mod queue;
mod real;
mod settings;
mod turn;

/// Run the body of an exported entry point: a panic never crosses into the caller, which gets
/// `CUDA_ERROR_UNKNOWN` instead. Inlined into the entry point: a launch's return from the
/// driver then goes through one frame of the hook, not two.
#[inline(always)]
fn guarded(
    run: impl FnOnce() -> gpushare_cuda_abi::types::CUresult,
) -> gpushare_cuda_abi::types::CUresult {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
        .unwrap_or(gpushare_cuda_abi::result::CUDA_ERROR_UNKNOWN)
}

/// CLOCK_MONOTONIC in nanoseconds: the time base of token deadlines.
pub use gpushare_units::monotonic_ns as now_ns;
