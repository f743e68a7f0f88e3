//! gpushare's scheduler: the pure fair-share policy core ([`policy`], one instance per GPU) and
//! the daemon around it: configuration ([`config`]), client identity from the socket
//! ([`identity`]), the daemon's state and message handling ([`daemon`]) around the tenant
//! socket's event loop ([`server`]) and the status report ([`status`]), which [`client`] fetches
//! from a running daemon and the Prometheus endpoint ([`metrics`]) serves; the memory books
//! ([`memory`]) and their journal ([`journal`]), which survives a restart; the pure core of
//! memory overcommitment ([`overcommit`]: physical books, waits, swaps); for Kubernetes, the
//! admin socket ([`admin`]) through which the node agent registers containers ([`pods`]).

pub mod admin;
pub mod census;
pub mod client;
pub mod config;
pub mod daemon;
pub mod identity;
pub mod journal;
pub mod memory;
pub mod metrics;
pub mod overcommit;
pub mod pods;
pub mod policy;
pub mod server;
pub mod status;
