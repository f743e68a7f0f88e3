//! `gpushare-scheduler`: the node daemon handing out GPU time tokens.

use clap::Parser;
use gpushare_scheduler::daemon::{DaemonOptions, run};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gpushare-scheduler",
    version,
    about = "gpushare node daemon: fair, capped shares of GPU time"
)]
struct Cli {
    /// TOML configuration (groups, quota, grace…); reloaded when the file changes.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Socket to listen on [default: $GPUSHARE_SOCKET or /run/gpushare/gpushare.sock].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Development mode: clients may declare their own group and shares (`gpushare run --group`).
    #[arg(long)]
    dev: bool,
    /// Serve Prometheus metrics at ADDR (e.g. 127.0.0.1:9400), path /metrics.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// Serve the admin socket for gpushare-device-manager here (e.g.
    /// /run/gpushare-admin/admin.sock; created mode 0600). With it, processes in Kubernetes pods
    /// get their container's policy and wait up to 2 s for it.
    #[arg(long, value_name = "PATH")]
    admin_socket: Option<PathBuf>,
    /// Journal of the GPU memory each process holds, rewritten as it changes, so that a
    /// restarted daemon keeps every group under its memory cap [default: the socket path with
    /// `.books` appended]. Keep it on tmpfs beside the socket.
    #[arg(long, value_name = "FILE")]
    books: Option<PathBuf>,
    /// Let the GPU memory caps of the groups on a GPU sum to RATIO times its memory: an
    /// allocation within its cap that does not fit waits for memory, then another group is
    /// swapped to host memory for it (the driver's checkpoint API). 1: caps may not promise
    /// more than a GPU holds. The config's `memory_overcommit` wins over this.
    #[arg(long, value_name = "RATIO", value_parser = ratio)]
    memory_overcommit: Option<f64>,
}

fn ratio(s: &str) -> Result<f64, String> {
    let r: f64 = s.parse().map_err(|e| format!("{e}"))?;
    gpushare_scheduler::config::overcommit_ratio(r)
}

fn main() -> ExitCode {
    // The event loop must never wait for its log (a stalled pipe to a log collector): lines go
    // out through a thread of their own, and are dropped rather than block when stderr does
    // not keep up.
    let (log, _flushed_at_exit) = tracing_appender::non_blocking(std::io::stderr());
    gpushare_logging::init("info", log);
    let cli = Cli::parse();
    let socket = cli.socket.unwrap_or_else(|| {
        std::env::var_os(gpushare_protocol::SOCKET_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| gpushare_protocol::DEFAULT_SOCKET.into())
    });
    let books = cli.books.unwrap_or_else(|| {
        let mut p = socket.clone().into_os_string();
        p.push(".books");
        p.into()
    });
    match run(DaemonOptions {
        books,
        socket,
        config_path: cli.config,
        dev: cli.dev,
        metrics: cli.metrics,
        admin_socket: cli.admin_socket,
        memory_overcommit: cli.memory_overcommit,
    }) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-scheduler: {e:#}");
            ExitCode::FAILURE
        }
    }
}
