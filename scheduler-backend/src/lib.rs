//! gpushare's scheduler: the pure fair-share policy core ([`policy`], one instance per GPU) and
//! the daemon around it: configuration ([`config`]), client identity from the socket
//! ([`identity`]), the socket server ([`daemon`]) and the status report ([`status`]), which
//! [`client`] fetches from a running daemon.

pub mod client;
pub mod config;
pub mod daemon;
pub mod identity;
pub mod memory;
pub mod policy;
pub mod status;
