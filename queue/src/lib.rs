//! gpushare's node job queue.
//!
//! - [`core`]: the scheduling core (pure, virtual time): policies, placement, timeouts.
//! - [`replay`]: the aging paper's experiment through the core, in virtual time.
pub mod core;
pub mod replay;
