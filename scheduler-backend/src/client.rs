//! Asking a running scheduler for its report: the request behind `gpushare status` (and the
//! job queue's view of what is in use on each GPU).

use crate::status::Report;
use gpushare_protocol::{ClientMsg, PROTOCOL_VERSION, ServerMsg};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error(
        "cannot reach gpushare-scheduler at {path}: {error}; is it running? (set GPUSHARE_SOCKET if it listens elsewhere)"
    )]
    Connect { path: String, error: std::io::Error },
    #[error("talking to gpushare-scheduler: {0}")]
    Wire(#[from] gpushare_protocol::WireError),
    #[error("talking to gpushare-scheduler: {0}")]
    Io(#[from] std::io::Error),
    #[error("scheduler: {0}")]
    Refused(String),
    #[error("the scheduler closed the connection")]
    Closed,
    #[error(
        "the scheduler's report is not what this gpushare expects ({0}); use binaries of one release"
    )]
    Decode(#[from] serde_json::Error),
}

/// The report of the scheduler listening at `socket` (at most 5 s).
pub fn fetch_status(socket: &Path) -> Result<Report, StatusError> {
    let mut s = UnixStream::connect(socket).map_err(|error| StatusError::Connect {
        path: socket.display().to_string(),
        error,
    })?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    gpushare_protocol::send(
        &mut s,
        &ClientMsg::Hello {
            version: PROTOCOL_VERSION,
            declared: None,
        },
    )?;
    gpushare_protocol::send(&mut s, &ClientMsg::Status)?;
    let mut buf = Vec::new();
    loop {
        match gpushare_protocol::recv::<ServerMsg>(&mut s, &mut buf)? {
            Some(ServerMsg::Status { json }) => return Ok(serde_json::from_str(&json)?),
            Some(ServerMsg::Error { message, .. }) => return Err(StatusError::Refused(message)),
            Some(_) => continue,
            None => return Err(StatusError::Closed),
        }
    }
}
