//! A node agent's end of the scheduler's admin socket ([`gpushare_protocol::admin`]). Blocking
//! I/O with timeouts; the async shells call it from `spawn_blocking` ([`push`]).
//!
//! After every (re)connection the first push is a full [`AdminRequest::Sync`] (a restarted
//! scheduler learns everything again); later pushes send only the difference
//! ([`crate::reconcile::diff`]).

use crate::reconcile::diff;
use gpushare_protocol::admin::{
    ADMIN_PROTOCOL_VERSION, AdminReply, AdminRequest, ContainerKey, GpuUsage, PodGroup,
};
use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long one request may take before the connection is dropped and retried.
const IO_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(
        "cannot reach gpushare-scheduler's admin socket {path}: {source}; is the scheduler running with --admin-socket {path}?"
    )]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("admin socket: {0}")]
    Wire(#[from] gpushare_protocol::WireError),
    #[error("the scheduler closed the admin connection")]
    Closed,
    #[error("the scheduler refused: {0}")]
    Refused(String),
    #[error("unexpected answer from the scheduler: {0:?}")]
    Unexpected(AdminReply),
}

pub struct AdminLink {
    path: PathBuf,
    /// Who we are, for the scheduler's log.
    agent: &'static str,
    conn: Option<UnixStream>,
    /// What the scheduler holds, as far as this connection told it.
    pushed: BTreeMap<ContainerKey, PodGroup>,
    /// This connection has sent its full sync.
    synced: bool,
    buf: Vec<u8>,
}

impl AdminLink {
    pub fn new(path: PathBuf, agent: &'static str) -> AdminLink {
        AdminLink {
            path,
            agent,
            conn: None,
            pushed: BTreeMap::new(),
            synced: false,
            buf: Vec::new(),
        }
    }

    fn connect(&mut self) -> Result<(), AdminError> {
        let path = self.path.display().to_string();
        let s = UnixStream::connect(&self.path).map_err(|source| AdminError::Connect {
            path: path.clone(),
            source,
        })?;
        s.set_read_timeout(Some(IO_TIMEOUT))
            .and_then(|_| s.set_write_timeout(Some(IO_TIMEOUT)))
            .map_err(|source| AdminError::Connect { path, source })?;
        self.conn = Some(s);
        self.pushed.clear();
        self.synced = false;
        let hello = AdminRequest::Hello {
            version: ADMIN_PROTOCOL_VERSION,
            agent: format!("{} {}", self.agent, env!("CARGO_PKG_VERSION")),
        };
        match self.call(&hello)? {
            AdminReply::Welcome { .. } => Ok(()),
            other => Err(self.fail(other)),
        }
    }

    fn fail(&mut self, reply: AdminReply) -> AdminError {
        self.conn = None;
        match reply {
            AdminReply::Error { message } => AdminError::Refused(message),
            other => AdminError::Unexpected(other),
        }
    }

    /// One request, one reply; any I/O failure drops the connection.
    fn call(&mut self, req: &AdminRequest) -> Result<AdminReply, AdminError> {
        let Some(conn) = self.conn.as_mut() else {
            return Err(AdminError::Closed);
        };
        let r = gpushare_protocol::send(conn, req)
            .and_then(|_| gpushare_protocol::recv::<AdminReply>(conn, &mut self.buf));
        match r {
            Ok(Some(reply)) => Ok(reply),
            Ok(None) => {
                self.conn = None;
                Err(AdminError::Closed)
            }
            Err(e) => {
                self.conn = None;
                Err(e.into())
            }
        }
    }

    /// Make the scheduler hold exactly `want`: a full sync on a new connection, else the
    /// difference. Returns the number of requests sent.
    pub fn push(&mut self, want: &BTreeMap<ContainerKey, PodGroup>) -> Result<usize, AdminError> {
        if self.conn.is_none() {
            self.connect()?;
        }
        if !self.synced {
            let groups = want.values().cloned().collect();
            self.expect_done(&AdminRequest::Sync { groups })?;
            self.pushed = want.clone();
            self.synced = true;
            return Ok(1);
        }
        let reqs = diff(&self.pushed, want);
        for r in &reqs {
            self.expect_done(r)?;
            match r {
                AdminRequest::Upsert { group } => {
                    self.pushed.insert(group.key(), group.clone());
                }
                AdminRequest::Remove { key } => {
                    self.pushed.remove(key);
                }
                _ => {}
            }
        }
        Ok(reqs.len())
    }

    fn expect_done(&mut self, req: &AdminRequest) -> Result<(), AdminError> {
        match self.call(req)? {
            AdminReply::Done => Ok(()),
            // A refused request changed nothing, and the connection stays usable.
            AdminReply::Error { message } => Err(AdminError::Refused(message)),
            other => Err(self.fail(other)),
        }
    }

    /// What the scheduler measures per GPU (connecting if needed; nothing is synced by this).
    pub fn usage(&mut self) -> Result<Vec<GpuUsage>, AdminError> {
        if self.conn.is_none() {
            self.connect()?;
        }
        match self.call(&AdminRequest::Usage)? {
            AdminReply::Usage { gpus } => Ok(gpus),
            other => Err(self.fail(other)),
        }
    }
}

/// Make the scheduler hold exactly `groups` (from an async task; the I/O runs on a blocking
/// thread). Failures are logged: the next push tries again.
pub async fn push(link: &Arc<Mutex<AdminLink>>, groups: BTreeMap<ContainerKey, PodGroup>) {
    let link = link.clone();
    let containers = groups.len();
    let pushed = tokio::task::spawn_blocking(move || {
        link.lock().unwrap_or_else(|e| e.into_inner()).push(&groups)
    })
    .await;
    match pushed {
        Ok(Ok(0)) => {}
        Ok(Ok(n)) => tracing::info!(requests = n, containers, "scheduler updated"),
        Ok(Err(e)) => tracing::warn!("{e}"),
        Err(e) => tracing::error!("admin push panicked: {e}"),
    }
}
