//! `gpushare-bench`: run fairness scenarios with gpushare and without it (native time-slicing),
//! each several times, measure launch overhead, and write `summary.json` (a [`report::Report`]),
//! `summary.md`, one SVG plot of shares over time per scenario and the kernel records the
//! figures come from: the simulated device's trace (`NAME-runK.trace.jsonl`,
//! `NAME-native-runK.trace.jsonl`; `gpushare-sim report` reads them), or, with `--source events`
//! and always on a machine with a real GPU, the tenants' own timelines from CUDA timing events
//! (`NAME-runK.timeline.jsonl`, same format).
//!
//! Modules, one job each:
//! - [`scenario`]: scenario files; [`expected`]: target shares (the benchmark's own
//!   water-filling of the shares, independent of the scheduler's code);
//! - [`run`]: one run of a scenario's tenants on a node; [`alone`]: tenants alone;
//!   [`overhead`]: launch overhead; [`tail`]: the latency tail table; [`noise`]: the
//!   noisy-host mode; [`fault`]: a scenario's
//!   fault of the scheduler (stopped, killed, starved of CPU); [`memory`]: the
//!   `memory-overcommit` scenario (memory beyond the card);
//! - [`analysis`]: figures from kernel records; [`client`]: what the tenants report;
//! - [`report`]: the typed report; [`markdown`], [`svg`]: its renderings;
//! - [`suite`]: a whole invocation (repeats, report files); [`settings`]: its options;
//!   [`real_gpu`]: is there a GPU on this machine.

// The documentation is read with the private items (`--document-private-items`), where
// links to them resolve.
#![allow(rustdoc::private_intra_doc_links)]

pub mod alone;
pub mod analysis;
pub mod client;
pub mod expected;
pub mod fault;
pub mod markdown;
pub mod memory;
pub mod noise;
pub mod overhead;
pub mod real_gpu;
pub mod report;
pub mod run;
pub mod scenario;
pub mod settings;
pub mod suite;
pub mod svg;
pub mod tail;

/// A progress line on stderr.
pub fn progress(msg: impl AsRef<str>) {
    eprintln!("[gpushare-bench] {}", msg.as_ref());
}
