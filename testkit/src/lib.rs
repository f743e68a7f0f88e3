//! Real CUDA driver-API clients for the simulated GPU, and the tools to judge their runs.
//!
//! - [`trace`]: parse the device trace `gpushare-sim run --trace FILE` writes, and compute what
//!   tests and benchmarks assert on: overlaps, busy shares, utilisation.
//! - [`harness`]: find the built simulator (`gpushare-sim`, `libcuda.so`) next to a test or
//!   benchmark executable and run commands under it.
//! - [`node`]: a simulated node (device + scheduler) and tenants under `gpushare run`.
//! - [`flood`]: a connection flood against a scheduler's socket, and what a flooded
//!   run watches (the scheduler's threads, `gpushare status` latency).
//! - [`margins`]: how far the end-to-end tests let a figure stray (behaviour, not precision).
//! - [`ptx`]: the hand-written PTX module (`gpushare_spin`, `touch`) every client loads.
//! - [`direct`]: the driver's own entry points, past any interposition (launch-overhead
//!   measurement).
//! - [`timeline`]: kernel timelines a program records with CUDA timing events, for a GPU that
//!   writes no trace.
//! - [`python`]: the Python programs of `python/` and the cached virtual environments (PyTorch)
//!   they run in.
//!
//! The `cudarc-client` binary of this package is a real cudarc 0.19 program; the C programs in
//! `c/` use the driver API directly (linked, or through `cuGetProcAddress`).

pub mod direct;
pub mod flood;
pub mod harness;
pub mod margins;
pub mod node;
pub mod ptx;
pub mod python;
pub mod timeline;
/// The device trace and its figures live with the device that writes it.
pub use gpushare_sim_device::trace;
