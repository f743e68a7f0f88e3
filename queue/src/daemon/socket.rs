//! The Unix socket's protocol: one thread per connection, its user from `SO_PEERCRED`.

use super::Shared;
use super::service::{cancel, may_read_logs, read_log, submit, token};
use super::views::{view, views};
use crate::core::JobId;
use gpushare_queue_protocol::{QUEUE_PROTOCOL_VERSION, Request, Response};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

/// One connection on the Unix socket.
pub(super) fn client(sh: Arc<Shared>, mut stream: UnixStream) {
    let Ok(peer) = gpushare_frame::peer_credentials(&stream) else {
        return;
    };
    let mut buf = Vec::new();
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let reply = |stream: &mut UnixStream, r: &Response| gpushare_frame::send(stream, r).is_ok();
    match gpushare_frame::recv::<Request>(&mut stream, &mut buf) {
        Ok(Some(Request::Hello { version })) if version == QUEUE_PROTOCOL_VERSION => {
            if !reply(&mut stream, &Response::Welcome) {
                return;
            }
        }
        Ok(Some(Request::Hello { version })) => {
            reply(
                &mut stream,
                &Response::Error(format!(
                    "this gpushare speaks queue protocol {version}, gpushare-queue {QUEUE_PROTOCOL_VERSION}: install both from one release"
                )),
            );
            return;
        }
        _ => {
            reply(
                &mut stream,
                &Response::Error("the first request must be Hello".into()),
            );
            return;
        }
    }
    let _ = stream.set_read_timeout(None);
    loop {
        let req = match gpushare_frame::recv::<Request>(&mut stream, &mut buf) {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => {
                reply(
                    &mut stream,
                    &Response::Error(format!("malformed request: {e}")),
                );
                return;
            }
        };
        let r = match req {
            Request::Hello { .. } => Response::Error("Hello sent twice".into()),
            Request::Submit(s) => match submit(&sh, peer.uid, s) {
                Ok(id) => Response::Submitted { id },
                Err(e) => Response::Error(e),
            },
            Request::Jobs => Response::Jobs(views(&sh.lock())),
            Request::Cancel { id } => match cancel(&sh, peer.uid, id) {
                Ok(v) => Response::Cancelled(v),
                Err(e) => Response::Error(e),
            },
            Request::Token { renew } => match token(&sh, peer.uid, renew) {
                Ok(t) => Response::Token(t),
                Err(e) => Response::Error(e),
            },
            Request::Logs { id, follow } => {
                if let Err(e) = may_read_logs(&sh, peer.uid, id) {
                    Response::Error(e)
                } else if !stream_logs(&sh, &mut stream, id, follow) {
                    return;
                } else {
                    continue;
                }
            }
        };
        if !reply(&mut stream, &r) {
            return;
        }
    }
}

/// Send job `id`'s output, then [`Response::LogEnd`]; with `follow`, until the job has
/// finished. False if the client went away.
fn stream_logs(sh: &Arc<Shared>, stream: &mut UnixStream, id: JobId, follow: bool) -> bool {
    let mut offset = 0u64;
    loop {
        let chunk = read_log(sh, id, offset, 64 << 10);
        if !chunk.is_empty() {
            offset += chunk.len() as u64;
            if gpushare_frame::send(stream, &Response::LogChunk(chunk)).is_err() {
                return false;
            }
            continue;
        }
        let st = sh.lock();
        let Some(v) = view(&st, id) else {
            return false;
        };
        if !follow || v.finished() {
            drop(st);
            // Whatever the job wrote before it ended is in the file now.
            loop {
                let rest = read_log(sh, id, offset, 64 << 10);
                if rest.is_empty() {
                    break;
                }
                offset += rest.len() as u64;
                if gpushare_frame::send(stream, &Response::LogChunk(rest)).is_err() {
                    return false;
                }
            }
            return gpushare_frame::send(stream, &Response::LogEnd(v)).is_ok();
        }
        // The job writes without telling anyone: look again shortly, or at its end.
        let _ = sh
            .changed
            .wait_timeout(st, Duration::from_millis(100))
            .unwrap_or_else(|e| e.into_inner());
    }
}
