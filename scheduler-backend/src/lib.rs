//! gpushare's scheduler daemon. Its decisions are made by the node core ([`node`]): pure, no
//! I/O, tested in virtual time, around the fair-share policy of each GPU
//! ([`gpushare_policy`]), the memory books ([`memory`]), the Kubernetes containers
//! ([`pods`]) and the durations its report counts ([`histogram`], [`latency`]). Around it, the shell: the event loop that owns the core and serves the tenant
//! socket ([`server`]), the threads that do what may block ([`workers`]: the books' journal
//! [`journal`], peer identity from `/proc` [`identity`], the [`census`] of GPU processes,
//! swaps to host memory through the driver's [`checkpoint`] API, the [`config`] file), the admin socket ([`admin`]) and the Prometheus endpoint ([`metrics`],
//! [`prometheus`]), wired by [`daemon`]. Other threads reach the loop through its [`inbox`].

// The documentation is read with the private items (`--document-private-items`), where
// links to them resolve.
#![allow(rustdoc::private_intra_doc_links)]

pub mod admin;
pub mod census;
pub mod checkpoint;
pub mod config;
pub mod daemon;
pub mod histogram;
pub mod identity;
pub mod inbox;
pub mod journal;
pub mod latency;
pub mod memory;
pub mod metrics;
pub mod node;
pub mod pods;
pub mod prometheus;
pub mod server;
pub mod throttle;
pub mod workers;
