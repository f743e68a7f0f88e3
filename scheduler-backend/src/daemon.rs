//! The daemon's start: its configuration and journal read, its sockets bound, its threads
//! started around the event loop ([`crate::server`]) that owns the node core
//! ([`crate::node`]). Threads: the event loop; the journal's writer, the `/proc` reader, the
//! census taker and the file watcher (the tenant socket's path, the configuration)
//! ([`crate::workers`]); the metrics endpoint (with `--metrics`); the admin socket's listener
//! and one thread per agent connection, at most 8 (with `--admin-socket`).

use crate::config::Config;
use crate::inbox::{Inbox, Published};
use crate::journal::Journal;
use crate::node::{Node, NodeOptions};
use crate::server::Server;
use crate::workers::{Watched, Workers, mtime, watch};
use arc_swap::ArcSwap;
use gpushare_protocol::status::Report;
use std::path::PathBuf;
use std::sync::Arc;

pub struct DaemonOptions {
    pub socket: PathBuf,
    pub config_path: Option<PathBuf>,
    /// Clients may declare their own group and shares.
    pub dev: bool,
    /// Serve Prometheus metrics over HTTP at this address (`GET /metrics`).
    pub metrics: Option<std::net::SocketAddr>,
    /// Serve the admin protocol (Kubernetes node agent) on this socket.
    pub admin_socket: Option<PathBuf>,
    /// The memory books' journal ([`crate::journal`]).
    pub books: PathBuf,
    /// `--memory-overcommit`: the ratio where the configuration sets no `memory_overcommit`.
    pub memory_overcommit: Option<f64>,
}

/// Run the daemon until the process is killed.
pub fn run(opts: DaemonOptions) -> anyhow::Result<()> {
    // Read before the file is loaded: a change made once the socket is up, however soon, is
    // then seen by the watcher, whenever it starts.
    let config_mtime = opts.config_path.as_deref().and_then(mtime);
    let config = match &opts.config_path {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    // Tenants run as other users: anyone may connect; identity comes from SO_PEERCRED.
    let listener = gpushare_frame::listen_at(&opts.socket, 0o666)
        .map_err(|e| anyhow::anyhow!("{e}; pick another --socket"))?;
    let journal = Journal::new(opts.books.clone());
    let restored = journal.load();
    if !restored.is_empty() {
        tracing::info!(holdings = restored.len(), path = %journal.path().display(), "memory books restored; they count until their processes reconnect or exit");
    }
    let node = Node::new(
        NodeOptions {
            config,
            dev: opts.dev,
            restored,
            memory_overcommit: opts.memory_overcommit,
        },
        gpushare_units::monotonic_ns(),
    );
    let (poll, waker) = crate::server::poll()?;
    let (inbox, letters) = Inbox::new(waker);
    let published: Published = Arc::new(ArcSwap::from_pointee(Report::clone(node.latest_report())));
    let workers = Workers::spawn(journal, &inbox)?;
    let watched = Watched {
        socket: opts.socket.clone(),
        config: opts.config_path.clone().map(|p| (p, config_mtime)),
    };
    watch(watched, inbox.clone())?;
    if let Some(addr) = opts.metrics {
        let http = std::net::TcpListener::bind(addr).map_err(|e| {
            anyhow::anyhow!("cannot serve metrics on {addr}: {e}; pick another --metrics address")
        })?;
        let p = published.clone();
        let page = move || crate::prometheus::render(&p.load());
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || {
                if let Err(e) = crate::metrics::serve(http, page) {
                    tracing::error!("the metrics endpoint stopped: {e}");
                }
            })?;
    }
    if let Some(path) = &opts.admin_socket {
        let admin = crate::admin::bind(path)?;
        let (i, p) = (inbox.clone(), published.clone());
        std::thread::Builder::new()
            .name("admin".into())
            .spawn(move || crate::admin::listen(i, p, admin))?;
    }
    tracing::info!(socket = %opts.socket.display(), dev = opts.dev, "gpushare-scheduler listening");
    Server::new(poll, listener, node, letters, workers, published)?.run()?;
    Ok(())
}
