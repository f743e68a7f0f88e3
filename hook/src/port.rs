//! The process's connection to `gpushare-scheduler`: the handshake, sending, requests that wait
//! for their answer, and one thread (`gpushare-rx`) that reads what the scheduler sends and
//! reconnects when the connection is lost. What the messages mean is the [`Inbox`]'s business
//! (the process, which hands grants to its gates): this module knows sockets, not turns.
//!
//! Nothing here makes a caller wait for the scheduler beyond what it asked for: a message is
//! written without blocking (what the socket does not take now waits in a backlog, written
//! before the next message; a scheduler that leaves a megabyte unread loses the connection), a
//! request waits for its answer only as long as its caller says, and a process's first call
//! waits for the handshake at most [`FIRST_WELCOME_WAIT`] (the rest of it goes on in the
//! background). The port remembers that a question went unanswered past the liveness bound,
//! and tells the inbox when the scheduler speaks again.

use crate::log::debug;
use gpushare_protocol::heartbeat::{Beats, FdReader};
use gpushare_protocol::{ClientMsg, GroupSpec, PROTOCOL_VERSION, ServerMsg};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// How long a lost or unreachable scheduler is left before the next attempt…
const RECONNECT: Duration = Duration::from_millis(500);
/// …and how long while nobody listens at its socket (a daemon killed or restarting): such an
/// attempt costs no daemon anything, so a restarted one has its processes back within a turn
/// of binding its socket…
const RECONNECT_ABSENT: Duration = Duration::from_millis(20);
/// …for this long; a daemon gone longer (not restarting, or its node draining) is tried less and
/// less often, the wait doubling up to [`RECONNECT`], so that a process does not wake 50 times a
/// second for ever.
const ABSENT_FAST: Duration = Duration::from_secs(2);
/// How long the handshake waits for the scheduler's `Welcome` on the reader thread (it follows
/// the scheduler's read of this process's `/proc` entries).
const WELCOME_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a process's first call waits for the first handshake; past it the process goes on
/// as if the scheduler were unreachable (`GPUSHARE_FAIL`) until the handshake ends.
pub const FIRST_WELCOME_WAIT: Duration = Duration::from_millis(200);
/// Bytes the scheduler may leave unread before the connection is given up (and made again).
const MAX_BACKLOG: usize = 1 << 20;

/// The waits between connection attempts.
#[derive(Debug, Default)]
struct Backoff {
    /// How long nobody has listened at the socket, as the sum of the waits since (the attempts
    /// themselves take next to nothing when nobody listens).
    absent_for: Duration,
    /// The last wait once past [`ABSENT_FAST`].
    slow: Option<Duration>,
}

impl Backoff {
    /// The wait before the next attempt; `absent`: nobody listened at the last one.
    fn next(&mut self, absent: bool) -> Duration {
        if !absent {
            *self = Backoff::default();
            return RECONNECT;
        }
        let wait = if self.absent_for < ABSENT_FAST {
            RECONNECT_ABSENT
        } else {
            let doubled = self.slow.unwrap_or(RECONNECT_ABSENT) * 2;
            let wait = doubled.min(RECONNECT);
            self.slow = Some(wait);
            wait
        };
        self.absent_for += wait;
        wait
    }
}

/// What the connection delivers.
pub trait Inbox: Sync {
    /// Hand `send` what is said first on every new connection, before anything else this
    /// process sends on it, while what it states cannot change (it is sent at once).
    fn greet(&self, send: &mut dyn FnMut(&[ClientMsg]));
    /// The handshake succeeded: limits apply again; the scheduler promises to answer within
    /// `liveness_ns`.
    fn connected(&self, liveness_ns: u64);
    /// A grant, revocation, new deadline or answer to a probe.
    fn message(&self, msg: ServerMsg);
    /// The scheduler spoke again after leaving a question unanswered past the liveness bound.
    fn answered_again(&self);
    /// The scheduler refused this process (for good).
    fn refused(&self, why: &str);
    /// The scheduler cannot be reached, or the connection was lost.
    fn unreachable(&self, why: &str);
}

/// The writing half of the connection.
struct Writer {
    stream: UnixStream,
    /// Encoded messages the socket has not taken yet, in order.
    backlog: Vec<u8>,
}

impl Writer {
    /// Write what the socket takes now, without blocking.
    fn flush(&mut self) -> std::io::Result<()> {
        while !self.backlog.is_empty() {
            // SAFETY: send(2) from a live buffer on our own socket; MSG_DONTWAIT never blocks,
            // MSG_NOSIGNAL turns a closed peer into EPIPE rather than SIGPIPE.
            let n = unsafe {
                libc::send(
                    self.stream.as_raw_fd(),
                    self.backlog.as_ptr().cast(),
                    self.backlog.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                match e.kind() {
                    std::io::ErrorKind::WouldBlock => break,
                    std::io::ErrorKind::Interrupted => continue,
                    _ => return Err(e),
                }
            }
            self.backlog.drain(..n as usize);
        }
        if self.backlog.len() > MAX_BACKLOG {
            return Err(std::io::Error::other(
                "the scheduler leaves its input unread",
            ));
        }
        Ok(())
    }
}

/// The heartbeat page of the scheduler connected to, if it passed one: read by launchers
/// waiting for a turn (no lock, no allocation), replaced on each connection by the reader
/// thread, which unmaps the last one once no launcher is reading it.
struct Heartbeat {
    page: AtomicPtr<Beats>,
    /// Launchers reading `page` now.
    readers: AtomicU32,
}

impl Heartbeat {
    /// The latest beat, if a page is mapped.
    fn read(&self) -> Option<u64> {
        self.readers.fetch_add(1, Ordering::SeqCst);
        let page = self.page.load(Ordering::SeqCst);
        // SAFETY: a non-null pointer is a leaked `Beats`, freed by `replace` only once no
        // reader counted before its swap is left (this one is counted).
        let beat = unsafe { page.as_ref() }.map(Beats::read);
        self.readers.fetch_sub(1, Ordering::Release);
        beat
    }

    /// The page of a new connection (`None`: none, or none that could be mapped); the last
    /// one is unmapped.
    fn replace(&self, fd: Option<OwnedFd>) {
        let new = fd.and_then(|fd| match Beats::map(&fd) {
            Ok(b) => Some(b),
            Err(e) => {
                debug!("the scheduler's heartbeat cannot be read ({e}): probing it instead");
                None
            }
        });
        let new = new.map_or(std::ptr::null_mut(), |b| Box::into_raw(Box::new(b)));
        let old = self.page.swap(new, Ordering::SeqCst);
        if !old.is_null() {
            while self.readers.load(Ordering::SeqCst) != 0 {
                std::thread::yield_now();
            }
            // SAFETY: `old` was leaked by an earlier `replace`, is no longer reachable from
            // `page`, and no reader that loaded it is left.
            drop(unsafe { Box::from_raw(old) });
        }
    }
}

/// A request sent, waiting for its answer.
pub struct Pending<'a> {
    port: &'a Port,
    req: u64,
    rx: Receiver<ServerMsg>,
}

/// Why a request has no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoAnswer {
    /// Not within the time given.
    Late,
    /// The connection is gone.
    Gone,
}

impl Pending<'_> {
    /// The answer, if it comes within `timeout`.
    pub fn wait(&self, timeout: Duration) -> Result<ServerMsg, NoAnswer> {
        self.rx.recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => NoAnswer::Late,
            RecvTimeoutError::Disconnected => NoAnswer::Gone,
        })
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.port.pending().remove(&self.req);
    }
}

pub struct Port {
    socket: PathBuf,
    declared: Option<GroupSpec>,
    writer: Mutex<Option<Writer>>,
    /// The connection's file descriptors (writer, reader; -1: none), for a forked child to close:
    /// recorded as soon as each is open and cleared before it is closed, so a child never closes
    /// a number the application has since reused.
    conn_fds: [AtomicI32; 2],
    connected: AtomicBool,
    /// The scheduler refused this process; it will not ask again.
    refused: AtomicBool,
    /// The liveness bound: the settings', or the scheduler's promise in its `Welcome`.
    liveness_ns: AtomicU64,
    /// `GPUSHARE_LIVENESS` was set: the scheduler's promise does not change the bound.
    liveness_fixed: bool,
    /// A question went unanswered past the liveness bound since the scheduler last spoke.
    owed: AtomicBool,
    heartbeat: Heartbeat,
    /// Requests waiting for their answer, by request id.
    pending: Mutex<HashMap<u64, SyncSender<ServerMsg>>>,
    next_req: AtomicU64,
    /// A handshake has ended (well or not): a process's first call waits for this, a while.
    greeted: (Mutex<bool>, Condvar),
    inbox: OnceLock<&'static dyn Inbox>,
}

impl Port {
    /// A port to `socket`; `liveness`: the bound fixed by the settings (else the scheduler's
    /// promise, and `default_liveness_ns` until it is known).
    pub fn new(
        socket: PathBuf,
        declared: Option<GroupSpec>,
        liveness: Option<u64>,
        default_liveness_ns: u64,
    ) -> Port {
        Port {
            socket,
            declared,
            writer: Mutex::new(None),
            conn_fds: [AtomicI32::new(-1), AtomicI32::new(-1)],
            connected: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            liveness_ns: AtomicU64::new(liveness.unwrap_or(default_liveness_ns)),
            liveness_fixed: liveness.is_some(),
            owed: AtomicBool::new(false),
            heartbeat: Heartbeat {
                page: AtomicPtr::new(std::ptr::null_mut()),
                readers: AtomicU32::new(0),
            },
            pending: Mutex::new(HashMap::new()),
            next_req: AtomicU64::new(1),
            greeted: (Mutex::new(false), Condvar::new()),
            inbox: OnceLock::new(),
        }
    }

    /// Connect and read on a thread of its own (`gpushare-rx`), reconnecting when the
    /// connection is lost; wait for the first handshake at most [`FIRST_WELCOME_WAIT`], then
    /// go on as if the scheduler were unreachable until it ends.
    pub fn start(&'static self, inbox: &'static dyn Inbox) {
        let _ = self.inbox.set(inbox);
        let spawned = std::thread::Builder::new()
            .name("gpushare-rx".into())
            .spawn(move || self.run());
        if let Err(e) = spawned {
            inbox.unreachable(&format!("cannot start the hook's reader thread: {e}"));
            return;
        }
        let (lock, cv) = &self.greeted;
        let greeted = lock.lock().unwrap_or_else(|e| e.into_inner());
        let (greeted, _) = cv
            .wait_timeout_while(greeted, FIRST_WELCOME_WAIT, |g| !*g)
            .unwrap_or_else(|e| e.into_inner());
        if !*greeted {
            // Under the lock: a handshake ending now says `connected` after this.
            inbox.unreachable(&format!(
                "gpushare-scheduler at {} has not answered within {} ms",
                self.socket.display(),
                FIRST_WELCOME_WAIT.as_millis()
            ));
        }
    }

    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    pub fn is_refused(&self) -> bool {
        self.refused.load(Ordering::Acquire)
    }

    /// The liveness bound now.
    pub fn liveness(&self) -> Duration {
        Duration::from_nanos(self.liveness_ns.load(Ordering::Relaxed))
    }

    /// Whether the scheduler owes an answer past the liveness bound (and has said nothing
    /// since).
    pub fn owes(&self) -> bool {
        self.owed.load(Ordering::Acquire)
    }

    /// When the scheduler's event loop last ran, as its heartbeat says (`None`: it passed no
    /// heartbeat on this connection, or there is none).
    pub fn heartbeat(&self) -> Option<u64> {
        self.heartbeat.read()
    }

    /// A question went unanswered past the liveness bound.
    pub fn mark_owed(&self) {
        self.owed.store(true, Ordering::Release);
    }

    fn inbox(&self) -> &'static dyn Inbox {
        *self.inbox.get().expect("started before use")
    }

    /// Connect, read while connected, reconnect when lost, until refused.
    fn run(&'static self) {
        let mut backoff = Backoff::default();
        loop {
            let mut absent = false;
            if let Some(r) = self.connect(&mut absent) {
                self.read_loop(r);
            }
            if self.is_refused() {
                return;
            }
            std::thread::sleep(backoff.next(absent));
        }
    }

    /// Connect and say hello; the reader half of the connection on success. `absent` is set
    /// when nobody listens at the socket (no such file, or refused).
    fn connect(&self, absent: &mut bool) -> Option<UnixStream> {
        // Err((message, refused)): unreachable, or reachable but refusing this process.
        let mut attempt = || -> Result<(UnixStream, Welcomed), (String, bool)> {
            let mut s = UnixStream::connect(&self.socket).map_err(|e| {
                use std::io::ErrorKind::{ConnectionRefused, NotFound};
                *absent = matches!(e.kind(), NotFound | ConnectionRefused);
                let msg = format!(
                    "cannot reach gpushare-scheduler at {}: {e}",
                    self.socket.display()
                );
                (msg, false)
            })?;
            self.conn_fds[0].store(s.as_raw_fd(), Ordering::Release);
            match self.handshake(&mut s) {
                Ok(welcomed) => Ok((s, welcomed)),
                Err(e) => {
                    self.conn_fds[0].store(-1, Ordering::Release);
                    Err(e)
                }
            }
        };
        let outcome = attempt().and_then(|(s, welcomed)| match s.try_clone() {
            Ok(reader) => Ok((s, reader, welcomed)),
            Err(e) => {
                self.conn_fds[0].store(-1, Ordering::Release);
                Err((format!("cannot read from the scheduler: {e}"), false))
            }
        });
        // What the inbox is told is ordered with the first call's wait (see `start`).
        let (lock, cv) = &self.greeted;
        let mut greeted = lock.lock().unwrap_or_else(|e| e.into_inner());
        let reader = match outcome {
            Ok((s, reader, welcomed)) => {
                self.conn_fds[1].store(reader.as_raw_fd(), Ordering::Release);
                if !self.liveness_fixed {
                    self.liveness_ns
                        .store(welcomed.liveness_ns, Ordering::Relaxed);
                }
                self.heartbeat.replace(welcomed.heartbeat);
                self.install(s);
                self.connected.store(true, Ordering::Release);
                self.inbox().connected(self.liveness().as_nanos() as u64);
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
        };
        *greeted = true;
        cv.notify_all();
        reader
    }

    /// Make `s` the connection written to, after the greeting (written first, while the
    /// inbox holds what it states).
    fn install(&self, s: UnixStream) {
        let mut s = Some(s);
        self.inbox().greet(&mut |greeting| {
            let Some(stream) = s.take() else { return };
            let mut w = Writer {
                stream,
                backlog: Vec::new(),
            };
            for msg in greeting {
                let _ = gpushare_protocol::append(msg, &mut w.backlog);
            }
            if w.flush().is_ok() {
                *self.writer() = Some(w);
            }
        });
        self.owed.store(false, Ordering::Release);
    }

    /// The handshake; the scheduler's liveness bound and heartbeat page.
    fn handshake(&self, s: &mut UnixStream) -> Result<Welcomed, (String, bool)> {
        let io = |e: std::io::Error| (e.to_string(), false);
        let hello = ClientMsg::Hello {
            version: PROTOCOL_VERSION,
            declared: self.declared.clone(),
        };
        gpushare_protocol::send(s, &hello).map_err(|e| (e.to_string(), false))?;
        s.set_read_timeout(Some(WELCOME_TIMEOUT)).map_err(io)?;
        // The scheduler's heartbeat page comes with its Welcome, if it has one.
        let mut r = FdReader::new(&*s);
        let liveness_ns = match gpushare_protocol::recv::<ServerMsg>(&mut r, &mut Vec::new()) {
            Ok(Some(ServerMsg::Welcome { group, liveness_ns })) => {
                debug!("connected as group {group}");
                liveness_ns
            }
            Ok(Some(ServerMsg::Error { message, .. })) => return Err((message, true)),
            other => {
                return Err((
                    format!("unexpected answer from the scheduler: {other:?}"),
                    false,
                ));
            }
        };
        let heartbeat = r.fd.take();
        s.set_read_timeout(None).map_err(io)?;
        Ok(Welcomed {
            liveness_ns,
            heartbeat,
        })
    }

    fn refuse(&self, msg: &str) {
        if !self.refused.swap(true, Ordering::AcqRel) {
            eprintln!("gpushare: the scheduler refused this process: {msg}");
        }
        self.inbox().refused(msg);
    }

    fn writer(&self) -> MutexGuard<'_, Option<Writer>> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Send a message (without waiting for the socket); false when the scheduler is gone.
    pub fn send(&self, msg: &ClientMsg) -> bool {
        let mut w = self.writer();
        let Some(writer) = w.as_mut() else {
            return false;
        };
        if gpushare_protocol::append(msg, &mut writer.backlog).is_ok() && writer.flush().is_ok() {
            return true;
        }
        // Given up: the reader sees the connection end, and a new one is made.
        debug!("giving up the scheduler connection: it does not take what is sent");
        let _ = writer.stream.shutdown(std::net::Shutdown::Both);
        self.conn_fds[0].store(-1, Ordering::Release);
        *w = None;
        false
    }

    /// Send a request made around a fresh request id; its answer is awaited with
    /// [`Pending::wait`]. `None` when the scheduler is not there to ask.
    pub fn request(&self, make: impl FnOnce(u64) -> ClientMsg) -> Option<Pending<'_>> {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        // Room for a `MemWait` before the answer.
        let (tx, rx) = sync_channel(2);
        self.pending().insert(req, tx);
        let pending = Pending {
            port: self,
            req,
            rx,
        };
        self.send(&make(req)).then_some(pending)
    }

    fn pending(&self) -> MutexGuard<'_, HashMap<u64, SyncSender<ServerMsg>>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn read_loop(&self, mut s: UnixStream) {
        let mut buf = Vec::new();
        while let Ok(Some(msg)) = gpushare_protocol::recv::<ServerMsg>(&mut s, &mut buf) {
            if self.owed.swap(false, Ordering::AcqRel) {
                debug!("the scheduler answers again");
                self.inbox().answered_again();
            }
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
                ServerMsg::MemWait { req, .. } => {
                    if let Some(tx) = self.pending().get(&req) {
                        let _ = tx.try_send(msg);
                    }
                }
                ServerMsg::Welcome { .. } | ServerMsg::Status { .. } => {}
                msg => self.inbox().message(msg),
            }
        }
        debug!("lost the scheduler connection");
        // Both ends closed (each fd forgotten first) before a reconnect may open new ones.
        {
            let mut w = self.writer();
            self.conn_fds[0].store(-1, Ordering::Release);
            *w = None;
        }
        self.conn_fds[1].store(-1, Ordering::Release);
        drop(s);
        self.heartbeat.replace(None);
        self.connected.store(false, Ordering::Release);
        self.pending().clear();
        if !self.is_refused() {
            self.inbox()
                .unreachable("lost the connection to gpushare-scheduler");
        }
    }

    /// In a forked child: close the parent's connection (its reader thread did not survive the
    /// fork). Only atomics and close(2), async-signal-safe: another thread may have held any
    /// lock at the fork. The parent's heartbeat page stays mapped, unread: the child's hook is
    /// a new one, with a port of its own that reads only the page of its own connection.
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

/// What the scheduler's `Welcome` brought.
struct Welcomed {
    liveness_ns: u64,
    /// Its heartbeat page's descriptor.
    heartbeat: Option<OwnedFd>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The waits of `n` attempts in a row at a socket nobody listens at.
    fn absent_waits(b: &mut Backoff, n: usize) -> Vec<Duration> {
        (0..n).map(|_| b.next(true)).collect()
    }

    #[test]
    fn an_absent_scheduler_is_tried_every_20_ms_for_two_seconds_then_less_often() {
        let mut b = Backoff::default();
        let fast = absent_waits(&mut b, 100);
        assert!(fast.iter().all(|&w| w == RECONNECT_ABSENT), "{fast:?}");
        let ms = |w: &Vec<Duration>| w.iter().map(|d| d.as_millis()).collect::<Vec<_>>();
        let slower = absent_waits(&mut b, 8);
        assert_eq!(ms(&slower), [40, 80, 160, 320, 500, 500, 500, 500]);
        // An hour gone: still tried every 0.5 s, so it rejoins within that once back.
        let hour = absent_waits(&mut b, 7200);
        assert!(hour.iter().all(|&w| w == RECONNECT), "{:?}", &hour[..3]);
    }

    #[test]
    fn a_listening_scheduler_starts_the_fast_attempts_again() {
        let mut b = Backoff::default();
        absent_waits(&mut b, 200);
        // Reached (it failed the handshake or the connection was lost later): 500 ms, then the
        // fast attempts again if it is gone.
        assert_eq!(b.next(false), RECONNECT);
        assert_eq!(absent_waits(&mut b, 100), vec![RECONNECT_ABSENT; 100]);
    }
}
