//! The process's connection to `gpushare-scheduler`: the handshake, sending, requests that wait
//! for their answer, and one thread (`gpushare-rx`) that reads what the scheduler sends and
//! reconnects when the connection is lost. What the messages mean is the [`Inbox`]'s business
//! (the process, which hands grants to its gates): this module knows sockets, not turns.

use crate::log::debug;
use gpushare_protocol::{ClientMsg, GroupSpec, PROTOCOL_VERSION, ServerMsg};
use std::collections::HashMap;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// How long a lost or unreachable scheduler is left before the next attempt.
const RECONNECT: Duration = Duration::from_millis(500);
/// How long a request waits for its answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// What the connection delivers.
pub trait Inbox: Sync {
    /// Sent first on every new connection, before anything else this process sends on it.
    fn greeting(&self) -> Vec<ClientMsg>;
    /// The handshake succeeded: limits apply again.
    fn connected(&self);
    /// A grant, revocation or new deadline.
    fn message(&self, msg: ServerMsg);
    /// The scheduler refused this process (for good).
    fn refused(&self, why: &str);
    /// The scheduler cannot be reached, or the connection was lost.
    fn unreachable(&self, why: &str);
}

pub struct Port {
    socket: PathBuf,
    declared: Option<GroupSpec>,
    writer: Mutex<Option<UnixStream>>,
    /// The connection's file descriptors (writer, reader; -1: none), for a forked child to close:
    /// recorded as soon as each is open and cleared before it is closed, so a child never closes
    /// a number the application has since reused.
    conn_fds: [AtomicI32; 2],
    connected: AtomicBool,
    /// The scheduler refused this process; it will not ask again.
    refused: AtomicBool,
    /// Requests waiting for their answer, by request id.
    pending: Mutex<HashMap<u64, SyncSender<ServerMsg>>>,
    next_req: AtomicU64,
    inbox: OnceLock<&'static dyn Inbox>,
}

impl Port {
    pub fn new(socket: PathBuf, declared: Option<GroupSpec>) -> Port {
        Port {
            socket,
            declared,
            writer: Mutex::new(None),
            conn_fds: [AtomicI32::new(-1), AtomicI32::new(-1)],
            connected: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            pending: Mutex::new(HashMap::new()),
            next_req: AtomicU64::new(1),
            inbox: OnceLock::new(),
        }
    }

    /// Connect (once, now), then read and reconnect on a thread of its own.
    pub fn start(&'static self, inbox: &'static dyn Inbox) {
        let _ = self.inbox.set(inbox);
        let first = self.connect();
        let _ = std::thread::Builder::new()
            .name("gpushare-rx".into())
            .spawn(move || self.run(first));
    }

    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    pub fn is_refused(&self) -> bool {
        self.refused.load(Ordering::Acquire)
    }

    fn inbox(&self) -> &'static dyn Inbox {
        *self.inbox.get().expect("started before use")
    }

    /// Read while connected; reconnect when lost, until refused.
    fn run(&'static self, mut reader: Option<UnixStream>) {
        loop {
            if let Some(r) = reader.take() {
                self.read_loop(r);
            }
            if self.is_refused() {
                return;
            }
            std::thread::sleep(RECONNECT);
            reader = self.connect();
        }
    }

    /// Connect and say hello; the reader half of the connection on success.
    fn connect(&self) -> Option<UnixStream> {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        // Err((message, refused)): unreachable, or reachable but refusing this process.
        let attempt = || -> Result<UnixStream, (String, bool)> {
            let mut s = UnixStream::connect(&self.socket).map_err(|e| {
                let msg = format!(
                    "cannot reach gpushare-scheduler at {}: {e}",
                    self.socket.display()
                );
                (msg, false)
            })?;
            self.conn_fds[0].store(s.as_raw_fd(), Ordering::Release);
            if let Err(e) = self.handshake(&mut s) {
                self.conn_fds[0].store(-1, Ordering::Release);
                return Err(e);
            }
            Ok(s)
        };
        match attempt() {
            Ok(mut s) => {
                let Ok(reader) = s.try_clone() else {
                    self.conn_fds[0].store(-1, Ordering::Release);
                    return None;
                };
                self.conn_fds[1].store(reader.as_raw_fd(), Ordering::Release);
                for msg in self.inbox().greeting() {
                    let _ = gpushare_protocol::send(&mut s, &msg);
                }
                *w = Some(s);
                drop(w);
                self.connected.store(true, Ordering::Release);
                self.inbox().connected();
                Some(reader)
            }
            Err((msg, true)) => {
                self.refuse(&msg);
                None
            }
            Err((msg, false)) => {
                self.inbox().unreachable(&msg);
                None
            }
        }
    }

    fn handshake(&self, s: &mut UnixStream) -> Result<(), (String, bool)> {
        let io = |e: std::io::Error| (e.to_string(), false);
        let hello = ClientMsg::Hello {
            version: PROTOCOL_VERSION,
            declared: self.declared.clone(),
        };
        gpushare_protocol::send(s, &hello).map_err(|e| (e.to_string(), false))?;
        s.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(io)?;
        match gpushare_protocol::recv::<ServerMsg>(s, &mut Vec::new()) {
            Ok(Some(ServerMsg::Welcome { group })) => debug!("connected as group {group}"),
            Ok(Some(ServerMsg::Error { message, .. })) => return Err((message, true)),
            other => {
                return Err((
                    format!("unexpected answer from the scheduler: {other:?}"),
                    false,
                ));
            }
        }
        s.set_read_timeout(None).map_err(io)
    }

    fn refuse(&self, msg: &str) {
        if !self.refused.swap(true, Ordering::AcqRel) {
            eprintln!("gpushare: the scheduler refused this process: {msg}");
        }
        self.inbox().refused(msg);
    }

    /// Send a message; false when the scheduler is gone.
    pub fn send(&self, msg: &ClientMsg) -> bool {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let Some(s) = w.as_mut() else { return false };
        let mut buf = Vec::new();
        if gpushare_protocol::encode(msg, &mut buf).is_ok() && s.write_all(&buf).is_ok() {
            return true;
        }
        self.conn_fds[0].store(-1, Ordering::Release);
        *w = None;
        false
    }

    /// Send a request made around a fresh request id and wait (at most 5 s) for its answer;
    /// `None` when the scheduler is not there to answer.
    pub fn call(&self, make: impl FnOnce(u64) -> ClientMsg) -> Option<ServerMsg> {
        self.call_within(ANSWER_TIMEOUT, make)
    }

    /// [`call`](Port::call), waiting at most `timeout` for the answer (a lost connection ends
    /// the wait at once).
    pub fn call_within(
        &self,
        timeout: Duration,
        make: impl FnOnce(u64) -> ClientMsg,
    ) -> Option<ServerMsg> {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = sync_channel(1);
        self.pending().insert(req, tx);
        let answer = if self.send(&make(req)) {
            rx.recv_timeout(timeout).ok()
        } else {
            None
        };
        self.pending().remove(&req);
        answer
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, SyncSender<ServerMsg>>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn read_loop(&self, mut s: UnixStream) {
        let mut buf = Vec::new();
        while let Ok(Some(msg)) = gpushare_protocol::recv::<ServerMsg>(&mut s, &mut buf) {
            match msg {
                ServerMsg::Error {
                    message,
                    fatal: true,
                } => {
                    self.refuse(&message);
                    break;
                }
                ServerMsg::Error {
                    message,
                    fatal: false,
                } => debug!("scheduler: {message}"),
                ServerMsg::Memory { req, .. } => {
                    if let Some(tx) = self.pending().remove(&req) {
                        let _ = tx.send(msg);
                    }
                }
                ServerMsg::Welcome { .. } | ServerMsg::Status { .. } => {}
                msg => self.inbox().message(msg),
            }
        }
        debug!("lost the scheduler connection");
        // Both ends closed (each fd forgotten first) before a reconnect may open new ones.
        {
            let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
            self.conn_fds[0].store(-1, Ordering::Release);
            *w = None;
        }
        self.conn_fds[1].store(-1, Ordering::Release);
        drop(s);
        self.connected.store(false, Ordering::Release);
        self.pending().clear();
        if !self.is_refused() {
            self.inbox()
                .unreachable("lost the connection to gpushare-scheduler");
        }
    }

    /// In a forked child: close the parent's connection (its reader thread did not survive the
    /// fork). Only atomics and close(2), async-signal-safe: another thread may have held any
    /// lock at the fork.
    pub fn close_in_child(&self) {
        for fd in &self.conn_fds {
            let n = fd.swap(-1, Ordering::AcqRel);
            if n >= 0 {
                // SAFETY: `n` is the parent's connection, inherited and used by nothing here.
                unsafe { libc::close(n) };
            }
        }
    }
}
