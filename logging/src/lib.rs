//! The log set-up of gpushare's daemons, so that every one of them reads the same variable and
//! writes the same way.

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::{EnvFilter, fmt};

/// The environment variable that holds the log filter, in `tracing`'s syntax
/// (`info`, `warn,gpushare_scheduler::node=debug`).
pub const ENV: &str = "GPUSHARE_LOG";

/// Installs the process's log subscriber: filtered by [`ENV`] (`default_filter` when it is unset
/// or unreadable), written to `writer`, coloured only when stderr is a terminal. Call it once,
/// first thing in `main`.
pub fn init<W>(default_filter: &str, writer: W)
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    fmt()
        .with_env_filter(
            EnvFilter::try_from_env(ENV).unwrap_or_else(|_| EnvFilter::new(default_filter)),
        )
        .with_writer(writer)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
