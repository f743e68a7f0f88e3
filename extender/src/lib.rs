//! gpushare's kube-scheduler extender: per-node, per-GPU books of units and memory fed from
//! each node's gpushare metrics, placement by the memory each pod is predicted to use, and the
//! replay that measures the placement policies in virtual time.

pub mod api;
pub mod books;
pub mod policy;
pub mod replay;
pub mod report;
pub mod seed;
pub mod serve;
