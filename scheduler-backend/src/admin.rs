//! The admin socket (`gpushare-scheduler --admin-socket PATH`): a node agent
//! (`gpushare-device-manager`) registers Kubernetes containers and their shares
//! ([`gpushare_protocol::admin`]). This module is the socket: each agent connection has a thread
//! that hands its requests to the event loop and waits for each answer; what they do is the
//! node core's business ([`crate::node`]).
//!
//! The socket is created mode 0600 in a directory of its own: only root on the host, and
//! whoever shares that directory (the agent's container), can change policy. Tenants never see
//! it.

use crate::inbox::{Inbox, Post, Published};
use gpushare_protocol::admin::{ADMIN_PROTOCOL_VERSION, AdminReply, AdminRequest};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Admin clients served at once (a thread each; there is one agent per node): more are closed,
/// so that the daemon's threads stay few whatever connects.
const MAX_ADMIN_CLIENTS: usize = 8;

/// Bind the admin socket (replacing a stale one), mode 0600.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    gpushare_frame::listen_at(path, 0o600)
        .map_err(|e| anyhow::anyhow!("{e}; pick another --admin-socket"))
}

/// Serve admin clients, one thread each (at most [`MAX_ADMIN_CLIENTS`]), until the process
/// exits.
pub fn listen(inbox: Inbox, published: Published, listener: UnixListener) {
    let active = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_ADMIN_CLIENTS {
            active.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("closing an admin connection: {MAX_ADMIN_CLIENTS} are open already");
            continue;
        }
        let (i, p, a) = (inbox.clone(), published.clone(), active.clone());
        let spawned = std::thread::Builder::new()
            .name("admin".into())
            .spawn(move || {
                serve(&i, &p, stream);
                a.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// One agent's connection: its requests go to the event loop, one at a time; `Usage` is
/// answered from the published report.
fn serve(inbox: &Inbox, published: &Published, mut stream: UnixStream) {
    let mut buf = Vec::new();
    let reply = |stream: &mut UnixStream, r: &AdminReply| {
        let _ = gpushare_protocol::send(stream, r);
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    match gpushare_protocol::recv::<AdminRequest>(&mut stream, &mut buf) {
        Ok(Some(AdminRequest::Hello { version, agent })) if version == ADMIN_PROTOCOL_VERSION => {
            tracing::info!(%agent, "admin client connected");
            reply(
                &mut stream,
                &AdminReply::Welcome {
                    version: ADMIN_PROTOCOL_VERSION,
                },
            );
        }
        Ok(Some(AdminRequest::Hello { version, .. })) => {
            reply(
                &mut stream,
                &AdminReply::Error {
                    message: format!(
                        "agent speaks admin protocol {version}, scheduler {ADMIN_PROTOCOL_VERSION}: run gpushare-device-manager and gpushare-scheduler of the same release"
                    ),
                },
            );
            return;
        }
        _ => {
            reply(
                &mut stream,
                &AdminReply::Error {
                    message: "the first message must be Hello".into(),
                },
            );
            return;
        }
    }
    let _ = stream.set_read_timeout(None);
    loop {
        let req = match gpushare_protocol::recv::<AdminRequest>(&mut stream, &mut buf) {
            Ok(Some(req)) => req,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("dropping an admin client after a malformed message: {e}");
                return;
            }
        };
        let answer = if req == AdminRequest::Usage {
            let gpus = crate::node::usage(&published.load());
            AdminReply::Usage { gpus }
        } else {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            if !inbox.post(Post::Admin { req, reply: tx }) {
                return;
            }
            match rx.recv() {
                Ok(answer) => answer,
                Err(_) => return,
            }
        };
        reply(&mut stream, &answer);
    }
}
