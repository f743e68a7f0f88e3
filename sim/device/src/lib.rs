//! The simulated GPU device: a model of every simulated GPU's timeline ([`model`]), the socket
//! server that lets many processes' simulated drivers share it ([`server`]), the device trace
//! it writes and the figures computed from it ([`trace`]), and the `gpushare-sim` launcher.

pub mod model;
pub mod server;
pub mod trace;
