//! gpushare's scheduler: the pure fair-share policy core ([`policy`]) and the daemon around it.

pub mod policy;
