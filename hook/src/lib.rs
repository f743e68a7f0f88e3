//! `libgpushare.so`: preloaded into tenant processes, it holds each kernel launch until the
//! process has its GPU's time token from `gpushare-scheduler`, bounds the work queued on the GPU,
//! and reports how long it really held the GPU.
//!
//! Layers, each in its own module: [`real`] finds the real driver (and the real `dlsym`);
//! [`intercept`] is the FFI surface (exported `cu*` launch symbols, `dlsym`,
//! `cuGetProcAddress`); [`gate`] is the per-GPU token gate with its launch fast path;
//! [`queue`] estimates the GPU work this process has queued, from its fence events;
//! [`client`] talks to the scheduler; [`memory`] holds every allocation to the group's GPU
//! memory cap.
//!
//! Rules for a guest in someone else's process: nothing runs at load time; no panic crosses
//! `extern "C"`; the fast path is a few atomic operations (no clock read, no lock); no output
//! unless `GPUSHARE_LOG` is set (or the scheduler is unreachable in fail-open mode, which warns
//! once).

mod client;
mod gate;
mod intercept;
mod log;
mod memory;
mod queue;
mod real;

/// CLOCK_MONOTONIC in nanoseconds: the time base of token deadlines.
pub use gpushare_units::monotonic_ns as now_ns;
