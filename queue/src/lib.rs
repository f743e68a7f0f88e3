//! gpushare's node job queue.
//!
//! - [`core`]: the scheduling core (pure, virtual time): policies, placement, timeouts.
//! - [`replay`]: the aging paper's experiment through the core, in virtual time;
//!   [`memory_replay`]: jobs whose memory grows and shrinks (a synthetic mix, or the measured
//!   engines of the resource-aware scheduling work), with caps held to the GPU, overcommitted
//!   (waits and swaps by the overcommit core of `gpushare-policy`) or one job at a time.
//! - [`daemon`]: `gpushare-queue serve`, the I/O shell: socket, jobs' processes, clock;
//!   [`db`] its SQLite state, [`http`] its HTTP API and [`web`] page, [`usage`] the last
//!   minutes of the GPUs' use that the page plots, [`shim`] the supervisor of each run, [`gpus`]
//!   the node's GPUs, [`sys`] the few system calls std lacks.

pub mod core;
pub mod daemon;
pub mod db;
pub mod gpus;
pub mod http;
pub mod memory_replay;
pub mod replay;
pub mod shim;
pub mod sys;
pub mod usage;
pub mod web;
