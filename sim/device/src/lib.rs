//! The simulated GPU device: a model of every simulated GPU's timeline ([`model`]), the socket
//! server that lets many processes' simulated drivers share it ([`server`]), and the
//! `gpushare-sim` launcher built on both.

pub mod model;
pub mod server;
