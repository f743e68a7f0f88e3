//! The event loop: the one thread that owns the node core ([`crate::node`]) and does its I/O.
//! It serves every tenant connection (non-blocking accept, reads and writes over epoll,
//! through `mio`), the node's timers (a timerfd in the same poll: nanosecond deadlines, where
//! epoll's own timeout has milliseconds) and the inbox the other threads post to
//! ([`crate::inbox`]); it hands the node what happened and carries out the effects it returns.
//! Whatever may block — files, `/proc` — goes to the worker threads ([`crate::workers`]).
//!
//! The loop bounds what a peer costs it: a frame's size (a partial one waits in its
//! connection's buffer), the bytes read from one connection before the others' turn, the
//! replies a peer leaves unread. It measures how late it handles what is due — a timer
//! against its deadline, a ready socket against the poll that reported it, a post against when
//! it was posted — and tells the node, which reports it.
//!
//! Each time it runs it writes the time into its heartbeat page, passed to every tenant with
//! its `Welcome`, and while a process waits for a turn it runs at least every quarter of the
//! liveness bound ([`Node::heartbeat_every`]): a waiting process reads the page instead of
//! probing (docs/liveness.md#the-heartbeat).

use crate::checkpoint::Job;
use crate::identity::Credentials;
use crate::inbox::{Letter, Post, Published};
use crate::node::{ConnId, Effect, Input, Node, SwapOutFailure};
use crate::throttle::Throttle;
use crate::workers::{Lookup, Workers};
use gpushare_protocol::admin::AdminReply;
use gpushare_protocol::heartbeat::{self, Publisher};
use gpushare_protocol::{ClientMsg, FrameBuf, ServerMsg};
use gpushare_units::monotonic_ns as now_ns;
use mio::net::{UnixListener, UnixStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use std::collections::HashMap;
use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError};

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const TIMER: Token = Token(2);
const FIRST_CONN: usize = 3;

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

/// A connection's socket and buffers.
struct Conn {
    stream: UnixStream,
    input: FrameBuf,
    output: Vec<u8>,
    /// Bytes at the front of `output` already written.
    sent: usize,
    /// Registered for writability: only while its socket held back part of `output`. The
    /// poll is edge-triggered, and a socket always polled for it would wake the loop for
    /// nothing each time the peer read a reply.
    awaits_room: bool,
}

pub struct Server {
    poll: Poll,
    listener: UnixListener,
    timer: Timer,
    node: Node,
    inbox: Receiver<Letter>,
    workers: Workers,
    published: Published,
    conns: HashMap<ConnId, Conn>,
    next_conn: usize,
    /// Admin requests in the node, by the token it answers with.
    admin_replies: HashMap<u64, SyncSender<AdminReply>>,
    next_admin: u64,
    /// When to try `accept` again after it failed.
    accept_retry: Option<u64>,
    /// Connections that used up their read budget with input left, that the node lets be read
    /// again, and [`LISTENER`] if it used up its budget: served again before the loop sleeps.
    again: Vec<usize>,
    /// Connections with output to write.
    dirty: Vec<ConnId>,
    /// Peers to look up ([`Effect::Resolve`]), sent to the `/proc` reader together once the
    /// loop has acted on its events.
    resolve: Vec<(ConnId, Credentials)>,
    scratch: Vec<u8>,
    warnings: Throttle,
    /// The heartbeat page passed to every client with its `Welcome` (`None`: none could be
    /// made; the clients probe), and when the loop last ran, as it says.
    heartbeat: Option<Publisher>,
    beat_at: u64,
}

impl Server {
    /// The loop serving `listener` for `node`. `poll` is where the inbox's waker was made
    /// (with [`WAKER_TOKEN`]).
    pub fn new(
        poll: Poll,
        listener: std::os::unix::net::UnixListener,
        node: Node,
        inbox: Receiver<Letter>,
        workers: Workers,
        published: Published,
    ) -> io::Result<Server> {
        listener.set_nonblocking(true)?;
        let mut listener = UnixListener::from_std(listener);
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let timer = Timer::new()?;
        poll.registry().register(
            &mut SourceFd(&timer.fd.as_raw_fd()),
            TIMER,
            Interest::READABLE,
        )?;
        raise_open_files_limit(node.limits().max);
        let heartbeat = Publisher::new()
            .inspect_err(|e| {
                tracing::warn!(
                    "cannot make the heartbeat page ({e}): processes waiting for a turn probe the scheduler instead"
                )
            })
            .ok();
        let mut server = Server {
            poll,
            listener,
            timer,
            node,
            inbox,
            workers,
            published,
            conns: HashMap::new(),
            next_conn: FIRST_CONN,
            admin_replies: HashMap::new(),
            next_admin: 0,
            accept_retry: None,
            again: Vec::new(),
            dirty: Vec::new(),
            resolve: Vec::new(),
            scratch: vec![0; 16 << 10],
            warnings: Throttle::default(),
            heartbeat,
            beat_at: 0,
        };
        server.apply();
        Ok(server)
    }

    /// Serve until polling itself fails.
    pub fn run(mut self) -> io::Result<()> {
        ask_for_a_short_slice();
        let mut events = Events::with_capacity(1024);
        loop {
            let timeout = (!self.again.is_empty()).then_some(std::time::Duration::ZERO);
            match self.poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            let polled = now_ns();
            self.beat(polled);
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => {
                        self.node.note_lateness(now_ns().saturating_sub(polled));
                        self.accept();
                    }
                    WAKER => self.read_inbox(),
                    TIMER => self.timer.clear(),
                    Token(c) => {
                        self.node.note_lateness(now_ns().saturating_sub(polled));
                        let c = c as ConnId;
                        if ev.is_writable() {
                            self.dirty.push(c);
                        }
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.read(c);
                        }
                    }
                }
                // A burst of events must not delay a turn.
                self.on_time();
            }
            for c in std::mem::take(&mut self.again) {
                if c == LISTENER.0 {
                    self.accept();
                } else {
                    self.read(c as ConnId);
                }
                self.on_time();
            }
            // What was ready when the poll returned has been read (but what `again` holds).
            self.node.note_caught_up(polled);
            self.on_time();
            self.flush();
            self.look_up();
            self.set_timer();
        }
    }

    /// Hand the node `input`, now, and carry out its effects.
    fn handle(&mut self, input: Input) {
        self.node.handle(input, now_ns());
        self.apply();
    }

    /// Tick the node if its timer (or the accept retry) is due.
    fn on_time(&mut self) {
        let now = now_ns();
        if self.accept_retry.is_some_and(|at| at <= now) {
            self.accept_retry = None;
            self.accept();
        }
        if let Some(due) = self.timer.armed.filter(|&at| at <= now) {
            self.timer.armed = None;
            self.node.note_timer_lateness(now.saturating_sub(due), now);
            self.handle(Input::Tick);
        }
    }

    /// The loop runs at `now`: its heartbeat says so.
    fn beat(&mut self, now: u64) {
        if let Some(h) = &self.heartbeat {
            h.beat(now);
            self.beat_at = now;
        }
    }

    /// Arm the timer for the node's next deadline, the accept retry, or the next heartbeat
    /// while a process waits for a turn.
    fn set_timer(&mut self) {
        let beat = (self.heartbeat.as_ref())
            .and(self.node.heartbeat_every())
            .map(|every| self.beat_at.saturating_add(every));
        let at = self
            .node
            .next_timeout()
            .into_iter()
            .chain(self.accept_retry)
            .chain(beat);
        self.timer.set(at.min());
    }

    /// Carry out what the node decided.
    fn apply(&mut self) {
        let mut unwritten = None;
        // Swaps the swapper thread, gone, will never answer.
        let mut swaps_lost = Vec::new();
        for effect in self.node.take_effects() {
            match effect {
                Effect::Send { conn, msg } => self.send(conn, &msg),
                Effect::Close { conn } => {
                    self.write(conn);
                    // Closing the socket (dropping it) takes it out of the poll.
                    self.conns.remove(&conn);
                }
                Effect::Resume { conn } => self.again.push(conn as usize),
                Effect::Resolve { conn, cred } => self.resolve.push((conn, cred)),
                Effect::Persist { seq, holdings } => {
                    if self.workers.journal.send((seq, holdings)).is_err() {
                        tracing::error!(
                            "the memory journal's writer is gone: what waited for it goes on unwritten"
                        );
                        unwritten = Some(seq);
                    }
                }
                Effect::CheckProcesses(processes) => {
                    let _ = self.workers.lookups.send(Lookup::Liveness(processes));
                }
                Effect::TakeCensus { connected } => {
                    let _ = self.workers.census.send(connected);
                }
                Effect::AdminReply { token, reply } => {
                    if let Some(tx) = self.admin_replies.remove(&token) {
                        let _ = tx.send(reply);
                    }
                }
                Effect::Publish(report) => self.published.store(report),
                Effect::SwapOut {
                    swap,
                    pids,
                    lock_timeout_ms,
                } => {
                    let job = Job::Out {
                        swap,
                        pids,
                        lock_timeout_ms,
                    };
                    if self.workers.swaps.send(job).is_err() {
                        swaps_lost.push(Input::SwappedOut {
                            swap,
                            outcome: Err(SwapOutFailure::Refused),
                        });
                    }
                }
                Effect::SwapIn { swap, pids } => {
                    if self.workers.swaps.send(Job::In { swap, pids }).is_err() {
                        swaps_lost.push(Input::SwappedIn { swap, ok: false });
                    }
                }
                Effect::Settle { id, process } => {
                    if self
                        .workers
                        .swaps
                        .send(Job::Settle { id, process })
                        .is_err()
                    {
                        swaps_lost.push(Input::Settled {
                            id,
                            checkpointed: false,
                        });
                    }
                }
            }
        }
        if let Some(seq) = unwritten {
            self.handle(Input::Persisted {
                seq,
                written: false,
            });
        }
        for input in swaps_lost {
            tracing::error!("the swapper thread is gone");
            self.handle(input);
        }
    }

    /// Send the `/proc` reader the peers to look up, in one request.
    fn look_up(&mut self) {
        if !self.resolve.is_empty() {
            let peers = std::mem::take(&mut self.resolve);
            let _ = self.workers.lookups.send(Lookup::Peers(peers));
        }
    }

    /// What the other threads posted.
    fn read_inbox(&mut self) {
        loop {
            let (at, post) = match self.inbox.try_recv() {
                Ok(letter) => letter,
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return,
            };
            self.node.note_lateness(now_ns().saturating_sub(at));
            match post {
                Post::Input(input) => self.handle(input),
                Post::Admin { req, reply } => {
                    let token = self.next_admin;
                    self.next_admin += 1;
                    self.admin_replies.insert(token, reply);
                    self.handle(Input::Admin { token, req });
                }
                Post::Listener(listener) => self.listen_anew(listener),
            }
            // A batch of posts (a thread's lookups) must not delay a turn either.
            self.on_time();
        }
    }

    /// Listen on `listener` from now on (the tenant socket bound again at its path): the
    /// connections the old one has waiting are accepted first.
    fn listen_anew(&mut self, listener: std::os::unix::net::UnixListener) {
        if let Err(e) = listener.set_nonblocking(true) {
            tracing::error!("cannot use the tenant socket bound anew: {e}");
            return;
        }
        let mut listener = UnixListener::from_std(listener);
        let registry = self.poll.registry();
        if let Err(e) = registry.register(&mut listener, LISTENER, Interest::READABLE) {
            tracing::error!("cannot poll the tenant socket bound anew: {e}");
            return;
        }
        self.accept();
        let mut old = std::mem::replace(&mut self.listener, listener);
        let _ = self.poll.registry().deregister(&mut old);
    }

    /// Accept the pending connections (up to [`ACCEPT_BUDGET`]); the node says which stay.
    fn accept(&mut self) {
        for _ in 0..ACCEPT_BUDGET {
            let mut stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    let now = now_ns();
                    self.warnings.warn(now, format_args!(
                        "cannot accept connections: {e}; retrying (raise the open files limit, or lower [connections] max)"
                    ));
                    self.accept_retry = Some(now + ACCEPT_RETRY_NS);
                    return;
                }
            };
            let Ok(cred) = gpushare_frame::peer_credentials(&stream) else {
                continue;
            };
            let c = self.next_conn;
            if let Err(e) = self
                .poll
                .registry()
                .register(&mut stream, Token(c), Interest::READABLE)
            {
                tracing::error!("cannot poll a new connection: {e}");
                continue;
            }
            self.next_conn += 1;
            let conn = Conn {
                stream,
                input: FrameBuf::new(MAX_CLIENT_FRAME),
                output: Vec::new(),
                sent: 0,
                awaits_room: false,
            };
            let c = c as ConnId;
            self.conns.insert(c, conn);
            self.handle(Input::Accepted {
                conn: c,
                cred: Credentials::from(cred),
            });
        }
        self.again.push(LISTENER.0);
    }

    /// Read what `c` has (up to [`READ_BUDGET`]) and hand the node each whole frame, as long
    /// as it reads `c`.
    fn read(&mut self, c: ConnId) {
        let mut budget = READ_BUDGET;
        loop {
            // The frames in hand first: the buffer has room again only once they are out.
            if !self.dispatch(c) {
                return;
            }
            let Some(conn) = self.conns.get_mut(&c) else {
                return;
            };
            let room = conn.input.room().min(self.scratch.len()).min(budget);
            if room == 0 {
                self.again.push(c as usize);
                return;
            }
            match conn.stream.read(&mut self.scratch[..room]) {
                Ok(0) => return self.drop_conn(c, None),
                Ok(n) => {
                    conn.input.push(&self.scratch[..n]);
                    budget -= n;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(conn = c, "closing a connection: {e}");
                    return self.drop_conn(c, None);
                }
            }
        }
    }

    /// Hand the node the whole frames `c` has sent; `false` once it is closed or the node does
    /// not read it (its input waits).
    fn dispatch(&mut self, c: ConnId) -> bool {
        loop {
            // Replies pile up here if the peer asks without reading: it must not get more.
            if !self.drain(c) {
                return false;
            }
            if !self.node.reads(c) {
                return false;
            }
            let Some(conn) = self.conns.get_mut(&c) else {
                return false;
            };
            match conn.input.take::<ClientMsg>() {
                Ok(Some(msg)) => self.handle(Input::Message { conn: c, msg }),
                Ok(None) => return true,
                Err(e) => {
                    self.drop_conn(c, Some(format!("it sent a malformed message: {e}")));
                    return false;
                }
            }
        }
    }

    /// Queue `msg` for `c`; it is written when the loop has acted on its events. A `Welcome`,
    /// the first message on a connection, is written at once with the heartbeat page passed
    /// along (if the socket does not take it now, it is queued without: that client probes).
    fn send(&mut self, c: ConnId, msg: &ServerMsg) {
        let Some(conn) = self.conns.get_mut(&c) else {
            return;
        };
        let mut frame = Vec::new();
        if let Err(e) = gpushare_protocol::encode(msg, &mut frame) {
            tracing::error!("cannot encode a reply: {e}");
            return;
        }
        if let (ServerMsg::Welcome { .. }, Some(h)) = (msg, &self.heartbeat)
            && conn.output.is_empty()
        {
            match heartbeat::send_with_fd(&conn.stream, &frame, h.fd()) {
                Ok(n) => drop(frame.drain(..n)),
                Err(e) => tracing::debug!(conn = c, "the heartbeat page not passed: {e}"),
            }
            if frame.is_empty() {
                return;
            }
        }
        conn.output.extend_from_slice(&frame);
        self.dirty.push(c);
    }

    /// Write the queued output.
    fn flush(&mut self) {
        while let Some(c) = self.dirty.pop() {
            self.drain(c);
        }
    }

    /// Write what `c`'s socket takes; close it if that fails or if it leaves more than
    /// [`MAX_OUTPUT`] unread. `false` if it is closed.
    fn drain(&mut self, c: ConnId) -> bool {
        if !self.write(c) {
            self.drop_conn(c, None);
            return false;
        }
        let Some(conn) = self.conns.get(&c) else {
            return false;
        };
        let unsent = conn.output.len() - conn.sent;
        if unsent > MAX_OUTPUT {
            let why = format!("it leaves its replies unread ({unsent} bytes)");
            self.drop_conn(c, Some(why));
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
                    tracing::debug!(conn = c, "closing a connection: {e}");
                    return false;
                }
            }
        }
        let done = conn.sent == conn.output.len();
        if done {
            // An idle connection keeps no buffer.
            conn.output = Vec::new();
            conn.sent = 0;
        } else if conn.sent > conn.output.len() / 2 {
            conn.output.drain(..conn.sent);
            conn.sent = 0;
        }
        // Polled for room only while output waits for it: re-registering reports the socket's
        // state then, so room made meanwhile is not missed.
        if conn.awaits_room == done {
            let interest = if done {
                Interest::READABLE
            } else {
                Interest::READABLE | Interest::WRITABLE
            };
            let token = Token(c as usize);
            if let Err(e) = self
                .poll
                .registry()
                .reregister(&mut conn.stream, token, interest)
            {
                tracing::debug!(conn = c, "closing a connection: cannot poll it: {e}");
                return false;
            }
            conn.awaits_room = !done;
        }
        true
    }

    /// Close `c` from this side (the peer hung up, failed, or misbehaved: `why`) and tell the
    /// node, which releases what its client held.
    fn drop_conn(&mut self, c: ConnId, why: Option<String>) {
        if self.conns.remove(&c).is_some() {
            self.handle(Input::Closed { conn: c, why });
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

    /// Acknowledge an expiry (whether the node's deadline passed is checked against the
    /// clock: [`Server::on_time`]).
    fn clear(&mut self) {
        let mut count = [0u8; 8];
        // SAFETY: reading at most 8 bytes into an 8-byte buffer from our own timerfd.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
    }
}

/// The token of the inbox's waker in the loop's poll.
pub const WAKER_TOKEN: Token = WAKER;

/// A poll for the event loop and the waker other threads wake it with.
pub fn poll() -> io::Result<(Poll, Waker)> {
    let poll = Poll::new()?;
    let waker = Waker::new(poll.registry(), WAKER_TOKEN)?;
    Ok((poll, waker))
}

/// The CPU slice the event loop asks the kernel for.
const LOOP_SLICE_NS: u64 = 100_000;

/// Ask the kernel's fair scheduler (EEVDF, Linux 6.12+) for a short slice for this thread, the
/// event loop: its work comes in short bursts that are due now, and a shorter slice lets it
/// preempt, when it wakes, the CPU-bound processes beside it — on a node whose cores data
/// loaders saturate, the daemon's small CPU request then buys it CPU on time, not only its
/// share. Needs no privilege; older kernels ignore the slice.
fn ask_for_a_short_slice() {
    // SAFETY: getpriority takes no pointers; errno is cleared first to tell -1 from an error.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, 0)
    };
    let attr = libc::sched_attr {
        size: std::mem::size_of::<libc::sched_attr>() as u32,
        sched_policy: libc::SCHED_OTHER as u32,
        sched_flags: 0,
        sched_nice: nice,
        sched_priority: 0,
        sched_runtime: LOOP_SLICE_NS,
        sched_deadline: 0,
        sched_period: 0,
    };
    // SAFETY: sched_setattr on this thread (0) with a valid, fully initialised sched_attr.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr, 0) };
    if r != 0 {
        tracing::debug!(
            "the event loop keeps the default CPU slice: {}",
            io::Error::last_os_error()
        );
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
