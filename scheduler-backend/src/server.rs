//! The tenant socket's event loop: one thread serves every client connection (non-blocking
//! accept, reads and writes over epoll, through `mio`) and the policies' timers (a timerfd in
//! the same poll: nanosecond deadlines, where epoll's own timeout has milliseconds).
//!
//! A flood of idle, slow or hostile connections therefore costs bounded memory, never threads,
//! and no peer can block the others: connections are bounded in number (in total and per uid,
//! `[connections]` in the config), in the time they take to say Hello, in the size of a frame
//! (a partial one waits in its connection's buffer) and in the replies they leave unread. What
//! the messages mean is [`crate::daemon`]'s business.

use crate::config::ConnectionLimits;
use crate::daemon::{self, Delivery, Greeting, Shared, lock, now_ns};
use crate::identity::{self, Peer};
use crate::policy::ClientId;
use gpushare_protocol::{ClientMsg, FrameBuf, ServerMsg};
use mio::net::{UnixListener, UnixStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use std::collections::{BTreeSet, HashMap};
use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A connection's key in the poll (its mio token); never reused.
pub(crate) type ConnId = usize;

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const TIMER: Token = Token(2);
const FIRST_CONN: ConnId = 3;

/// Largest client message accepted: the tenant protocol's are a few dozen bytes.
pub const MAX_CLIENT_FRAME: usize = 64 << 10;
/// Replies a connection may leave unread (beyond what its socket buffer holds) before it is
/// dropped: a peer that does not read must not make the daemon wait, nor hold its memory.
pub const MAX_OUTPUT: usize = 256 << 10;
/// Bytes read from one connection before the others get their turn.
const READ_BUDGET: usize = 64 << 10;
/// Connections accepted before the others (and the timer) get their turn.
const ACCEPT_BUDGET: usize = 32;
/// After `accept` failed for want of file descriptors (or memory), try again this much later;
/// the waiting connections stay in the listen backlog meanwhile.
const ACCEPT_RETRY_NS: u64 = 50_000_000;

/// A peer for the per-user bound: its uid and its pid namespace (0 if unreadable).
type PeerKey = (u32, u64);

struct Conn {
    stream: UnixStream,
    /// The peer's pid, uid and gid; the rest of who it is ([`Peer`]) is read at its Hello, as
    /// junk never gets that far.
    cred: libc::ucred,
    /// What its connections are counted under for `max_per_uid`.
    peer_key: PeerKey,
    input: FrameBuf,
    output: Vec<u8>,
    /// Bytes at the front of `output` already written.
    sent: usize,
    phase: Phase,
}

enum Phase {
    /// Connected; closed unless it says Hello by `deadline`.
    Greeting {
        deadline: u64,
    },
    /// Said Hello as a process of a Kubernetes container the agent has not registered yet;
    /// its further input waits meanwhile.
    AwaitingPod {
        hello: ClientMsg,
        peer: Peer,
        deadline: u64,
    },
    Client(ClientId),
}

impl Phase {
    /// When the connection must have moved on from this phase.
    fn deadline(&self) -> Option<u64> {
        match self {
            Phase::Greeting { deadline } | Phase::AwaitingPod { deadline, .. } => Some(*deadline),
            Phase::Client(_) => None,
        }
    }
}

pub(crate) struct Server {
    poll: Poll,
    listener: UnixListener,
    timer: Timer,
    conns: HashMap<ConnId, Conn>,
    next_conn: ConnId,
    /// Open connections per user and pid namespace (`max_per_uid`).
    per_peer: HashMap<PeerKey, usize>,
    limits: ConnectionLimits,
    /// Connection deadlines (Hello, pod wait) and accept retries ([`LISTENER`]), earliest
    /// first; a connection's entry goes when it moves on or closes, so that the timer never
    /// wakes the loop for a connection long gone.
    deadlines: BTreeSet<(u64, ConnId)>,
    /// Connections that used up their read budget with input left, and [`LISTENER`] if it did:
    /// served again before the loop sleeps.
    again: Vec<ConnId>,
    /// Connections with output to write.
    dirty: Vec<ConnId>,
    scratch: Vec<u8>,
    warnings: Throttle,
}

impl Server {
    /// The loop serving `listener`, and the waker through which other threads tell it that the
    /// state changed.
    pub(crate) fn new(listener: std::os::unix::net::UnixListener) -> io::Result<(Server, Waker)> {
        listener.set_nonblocking(true)?;
        let mut listener = UnixListener::from_std(listener);
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        let timer = Timer::new()?;
        poll.registry().register(
            &mut SourceFd(&timer.fd.as_raw_fd()),
            TIMER,
            Interest::READABLE,
        )?;
        let server = Server {
            poll,
            listener,
            timer,
            conns: HashMap::new(),
            next_conn: FIRST_CONN,
            per_peer: HashMap::new(),
            limits: ConnectionLimits::default(),
            deadlines: BTreeSet::new(),
            again: Vec::new(),
            dirty: Vec::new(),
            scratch: vec![0; 16 << 10],
            warnings: Throttle::default(),
        };
        Ok((server, waker))
    }

    /// Serve until polling itself fails.
    pub(crate) fn run(mut self, shared: &Shared) -> io::Result<()> {
        self.limits = lock(shared).config.connections;
        raise_open_files_limit(self.limits.max);
        let mut events = Events::with_capacity(1024);
        loop {
            let timeout = (!self.again.is_empty()).then_some(std::time::Duration::ZERO);
            match self.poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            let mut changed = false;
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept(),
                    WAKER => changed = true,
                    TIMER => self.timer.clear(),
                    Token(c) => {
                        if ev.is_writable() {
                            self.dirty.push(c);
                        }
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.read(shared, c);
                        }
                    }
                }
                self.on_time(shared);
            }
            for c in std::mem::take(&mut self.again) {
                if c == LISTENER.0 {
                    self.accept();
                } else {
                    self.read(shared, c);
                }
                self.on_time(shared);
            }
            self.settle(shared, changed);
            self.flush(shared);
        }
    }

    /// Serve the timer if its deadline has passed: a burst of events must not delay a turn.
    fn on_time(&mut self, shared: &Shared) {
        if self.timer.armed.is_some_and(|at| at <= now_ns()) {
            self.settle(shared, false);
            self.flush(shared);
        }
    }

    /// Accept the pending connections within the limits (up to [`ACCEPT_BUDGET`]); close the
    /// others at once.
    fn accept(&mut self) {
        for _ in 0..ACCEPT_BUDGET {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.warnings.warn(format_args!(
                        "cannot accept connections: {e}; retrying (raise the open files limit, or lower [connections] max)"
                    ));
                    let retry = now_ns() + ACCEPT_RETRY_NS;
                    self.deadlines.insert((retry, LISTENER.0));
                    return;
                }
            };
            let Ok(cred) = identity::credentials(&stream) else {
                continue;
            };
            // A user's connections are counted per pid namespace: root in every container of a
            // node is one uid, and each container is its own peer.
            let key = (
                cred.uid,
                identity::pid_namespace(cred.pid as u32).unwrap_or(0),
            );
            let of_uid = self.per_peer.get(&key).copied().unwrap_or(0);
            let (max, per_uid) = (self.limits.max, self.limits.max_per_uid);
            if self.conns.len() >= max || of_uid >= per_uid {
                self.warnings.warn(format_args!(
                    "closing a new connection of pid {} uid {}: {} connections are open, {of_uid} of them this user's in its pid namespace (limits: [connections] max = {max}, max_per_uid = {per_uid})",
                    cred.pid,
                    cred.uid,
                    self.conns.len()
                ));
                continue;
            }
            self.admit(stream, cred, key);
        }
        self.again.push(LISTENER.0);
    }

    fn admit(&mut self, mut stream: UnixStream, cred: libc::ucred, peer_key: PeerKey) {
        let c = self.next_conn;
        let interest = Interest::READABLE | Interest::WRITABLE;
        if let Err(e) = self
            .poll
            .registry()
            .register(&mut stream, Token(c), interest)
        {
            tracing::error!("cannot poll a new connection: {e}");
            return;
        }
        self.next_conn += 1;
        *self.per_peer.entry(peer_key).or_default() += 1;
        let deadline = now_ns() + self.limits.hello_timeout_ns;
        self.deadlines.insert((deadline, c));
        let conn = Conn {
            stream,
            cred,
            peer_key,
            input: FrameBuf::new(MAX_CLIENT_FRAME),
            output: Vec::new(),
            sent: 0,
            phase: Phase::Greeting { deadline },
        };
        self.conns.insert(c, conn);
    }

    /// Read what `c` has (up to [`READ_BUDGET`]) and act on each whole frame.
    fn read(&mut self, shared: &Shared, c: ConnId) {
        let mut budget = READ_BUDGET;
        loop {
            // The frames in hand first: the buffer has room again only once they are out.
            if !self.dispatch(shared, c) {
                return;
            }
            let Some(conn) = self.conns.get_mut(&c) else {
                return;
            };
            let room = conn.input.room().min(self.scratch.len()).min(budget);
            if room == 0 {
                self.again.push(c);
                return;
            }
            match conn.stream.read(&mut self.scratch[..room]) {
                Ok(0) => return self.close(shared, c),
                Ok(n) => {
                    conn.input.push(&self.scratch[..n]);
                    budget -= n;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(pid = conn.cred.pid, "closing a connection: {e}");
                    return self.close(shared, c);
                }
            }
        }
    }

    /// Act on the whole frames `c` has sent; `false` once it is closed or waits for its pod.
    fn dispatch(&mut self, shared: &Shared, c: ConnId) -> bool {
        loop {
            // Replies pile up here if the peer asks without reading: it must not get more.
            if !self.drain(shared, c) {
                return false;
            }
            let Some(conn) = self.conns.get_mut(&c) else {
                return false;
            };
            if let Phase::AwaitingPod { .. } = conn.phase {
                return false;
            }
            let msg = match conn.input.take::<ClientMsg>() {
                Ok(Some(msg)) => msg,
                Ok(None) => return true,
                Err(e) => {
                    let what = match conn.phase {
                        Phase::Client(_) => "a malformed message",
                        _ => "a malformed first message",
                    };
                    let pid = conn.cred.pid;
                    self.warnings.warn(format_args!(
                        "dropping pid {pid}'s client after {what}: {e}"
                    ));
                    self.close(shared, c);
                    return false;
                }
            };
            match conn.phase {
                Phase::Client(id) => {
                    let out = daemon::on_message(&mut lock(shared), id, msg, now_ns());
                    self.deliver(out);
                }
                _ => {
                    let peer = identity::peer_of(conn.cred);
                    if !self.greet(shared, c, msg, peer, false) {
                        return false;
                    }
                }
            }
        }
    }

    /// Greet `c`, the process `peer`, with its first message; `true` if it is a client now.
    fn greet(
        &mut self,
        shared: &Shared,
        c: ConnId,
        first: ClientMsg,
        peer: Peer,
        waited: bool,
    ) -> bool {
        let Some(conn) = self.conns.get_mut(&c) else {
            return false;
        };
        let greeting = daemon::greet(&mut lock(shared), &peer, c, &first, waited);
        if let Some(d) = conn.phase.deadline() {
            self.deadlines.remove(&(d, c));
        }
        match greeting {
            Greeting::Admitted(id, welcome) => {
                conn.phase = Phase::Client(id);
                self.send(c, &welcome);
                true
            }
            Greeting::Refused(message) => {
                let pid = peer.pid;
                self.warnings
                    .warn(format_args!("refused pid {pid}: {message}"));
                self.send(
                    c,
                    &ServerMsg::Error {
                        message,
                        fatal: true,
                    },
                );
                self.write(c);
                self.close(shared, c);
                false
            }
            Greeting::AwaitPod => {
                let deadline = now_ns() + crate::admin::POD_WAIT.as_nanos() as u64;
                conn.phase = Phase::AwaitingPod {
                    hello: first,
                    peer,
                    deadline,
                };
                self.deadlines.insert((deadline, c));
                false
            }
        }
    }

    /// After the events: greet again the clients that wait for their pod if the state changed,
    /// act on the deadlines that passed, deliver what the policies decided, and set the timer.
    fn settle(&mut self, shared: &Shared, changed: bool) {
        if changed {
            let waiting: Vec<ConnId> = self
                .conns
                .iter()
                .filter(|(_, conn)| matches!(conn.phase, Phase::AwaitingPod { .. }))
                .map(|(c, _)| *c)
                .collect();
            for c in waiting {
                self.greet_again(shared, c, false);
            }
        }
        let now = now_ns();
        while let Some(&(at, c)) = self.deadlines.first() {
            if at > now {
                break;
            }
            self.deadlines.pop_first();
            self.expire(shared, c);
        }
        let (out, wake) = {
            let mut st = lock(shared);
            self.limits = st.config.connections;
            daemon::on_tick(&mut st, now)
        };
        self.deliver(out);
        let next = self.deadlines.first().map(|(at, _)| *at);
        self.timer.set(wake.into_iter().chain(next).min());
    }

    /// The deadline of `c` passed.
    fn expire(&mut self, shared: &Shared, c: ConnId) {
        if c == LISTENER.0 {
            return self.accept();
        }
        let Some(conn) = self.conns.get(&c) else {
            return;
        };
        match conn.phase {
            Phase::Greeting { .. } => {
                let (pid, secs) = (conn.cred.pid, self.limits.hello_timeout_ns as f64 / 1e9);
                self.warnings.warn(format_args!(
                    "dropping pid {pid}'s connection: no Hello within {secs} s"
                ));
                self.close(shared, c);
            }
            Phase::AwaitingPod { .. } => self.greet_again(shared, c, true),
            Phase::Client(_) => {}
        }
    }

    /// Greet a client that waits for its pod again; once admitted, its input is served.
    fn greet_again(&mut self, shared: &Shared, c: ConnId, waited: bool) {
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        let Phase::AwaitingPod { hello, peer, .. } = &conn.phase else {
            return;
        };
        let (hello, peer) = (hello.clone(), peer.clone());
        if self.greet(shared, c, hello, peer, waited) {
            self.again.push(c);
        }
    }

    fn deliver(&mut self, out: Delivery) {
        for (c, msg) in out {
            self.send(c, &msg);
        }
    }

    /// Queue `msg` for `c`; it is written when the loop has acted on its events.
    fn send(&mut self, c: ConnId, msg: &ServerMsg) {
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        let mut frame = Vec::new();
        if let Err(e) = gpushare_protocol::encode(msg, &mut frame) {
            tracing::error!("cannot encode a reply: {e}");
            return;
        }
        conn.output.extend_from_slice(&frame);
        self.dirty.push(c);
    }

    /// Write the queued output.
    fn flush(&mut self, shared: &Shared) {
        while let Some(c) = self.dirty.pop() {
            self.drain(shared, c);
        }
    }

    /// Write what `c`'s socket takes; close it if that fails or if it leaves more than
    /// [`MAX_OUTPUT`] unread. `false` if it is closed.
    fn drain(&mut self, shared: &Shared, c: ConnId) -> bool {
        if !self.write(c) {
            self.close(shared, c);
            return false;
        }
        let Some(conn) = self.conns.get(&c) else {
            return false;
        };
        let unsent = conn.output.len() - conn.sent;
        if unsent > MAX_OUTPUT {
            let pid = conn.cred.pid;
            self.warnings.warn(format_args!(
                "dropping pid {pid}'s connection: it leaves its replies unread ({unsent} bytes)"
            ));
            self.close(shared, c);
            return false;
        }
        true
    }

    /// Write what `c`'s socket takes now; `false` if the connection failed.
    fn write(&mut self, c: ConnId) -> bool {
        let Some(conn) = self.conns.get_mut(&c) else {
            return true;
        };
        while conn.sent < conn.output.len() {
            match conn.stream.write(&conn.output[conn.sent..]) {
                Ok(0) => return false,
                Ok(n) => conn.sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(pid = conn.cred.pid, "closing a connection: {e}");
                    return false;
                }
            }
        }
        if conn.sent == conn.output.len() {
            // An idle connection keeps no buffer.
            conn.output = Vec::new();
            conn.sent = 0;
        } else if conn.sent > conn.output.len() / 2 {
            conn.output.drain(..conn.sent);
            conn.sent = 0;
        }
        true
    }

    /// Close `c`; a client's turns, tokens and memory are released at once.
    fn close(&mut self, shared: &Shared, c: ConnId) {
        let Some(conn) = self.conns.remove(&c) else {
            return;
        };
        if let Some(d) = conn.phase.deadline() {
            self.deadlines.remove(&(d, c));
        }
        // Closing the socket (dropping `conn`) takes it out of the poll.
        if let Some(n) = self.per_peer.get_mut(&conn.peer_key) {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&conn.peer_key);
            }
        }
        if let Phase::Client(id) = conn.phase {
            let out = daemon::on_disconnect(&mut lock(shared), id, now_ns());
            self.deliver(out);
        }
    }
}

/// Warnings about misbehaving connections: at most [`Throttle::BURST`] per
/// [`Throttle::PERIOD_NS`], so that a flood of connections does not become a flood of log
/// lines; the others are logged at debug level and counted in the next warning.
#[derive(Default)]
struct Throttle {
    period_start: u64,
    warned: u32,
    suppressed: u64,
}

impl Throttle {
    const BURST: u32 = 20;
    const PERIOD_NS: u64 = 10_000_000_000;

    fn warn(&mut self, what: std::fmt::Arguments) {
        let now = now_ns();
        if now.saturating_sub(self.period_start) >= Self::PERIOD_NS {
            self.period_start = now;
            self.warned = 0;
        }
        if self.warned < Self::BURST {
            self.warned += 1;
            match std::mem::take(&mut self.suppressed) {
                0 => tracing::warn!("{what}"),
                n => tracing::warn!("{what} ({n} similar warnings suppressed before this one)"),
            }
        } else {
            self.suppressed += 1;
            tracing::debug!("{what}");
        }
    }
}

/// A `CLOCK_MONOTONIC` timerfd: readable at the deadline it was set to.
struct Timer {
    fd: OwnedFd,
    armed: Option<u64>,
}

impl Timer {
    fn new() -> io::Result<Timer> {
        // SAFETY: timerfd_create takes no pointers; the fd it returns is owned from here on.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Timer { fd, armed: None })
    }

    /// Fire at `at` (`CLOCK_MONOTONIC` ns; at once if past), or never.
    fn set(&mut self, at: Option<u64>) {
        if at == self.armed {
            return;
        }
        self.armed = at;
        // A zero it_value disarms the timer: a deadline of 0 is one long past, i.e. 1 ns.
        let ns = at.map_or(0, |t| t.max(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (ns % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: timerfd_settime on our own timerfd with a valid itimerspec; no old value.
        let r = unsafe {
            libc::timerfd_settime(
                self.fd.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
        if r != 0 {
            tracing::error!("cannot set the timer: {}", io::Error::last_os_error());
        }
    }

    /// Acknowledge an expiry (the timer is set again after every turn of the loop).
    fn clear(&mut self) {
        let mut count = [0u8; 8];
        // SAFETY: reading at most 8 bytes into an 8-byte buffer from our own timerfd.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
        self.armed = None;
    }
}

/// Raise the soft limit on open files to the hard one: every connection holds a descriptor.
/// Warns if even that cannot hold `max` connections.
fn raise_open_files_limit(max: usize) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit struct.
    let ok = unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0
        }
    };
    // Descriptors besides the connections: the listener, the poll, the timer, metrics, admin.
    let need = max as u64 + 64;
    if !ok || lim.rlim_cur < need {
        tracing::warn!(
            "the open files limit ({}) is below [connections] max + 64 ({need}): connections beyond it wait until others close; raise LimitNOFILE (ulimit -n) or lower max",
            lim.rlim_cur
        );
    }
}
