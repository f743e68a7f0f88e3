//! The process's connection to `gpushare-scheduler`, the hook's settings, and the per-process
//! state (one [`Gate`] per GPU). Created lazily on the first gated launch, again after `fork`.

use crate::gate::Gate;
use crate::log::debug;
use crate::real;
use gpushare_protocol::{ClientMsg, GroupSpec, PROTOCOL_VERSION, ServerMsg};
use std::collections::HashMap;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Condvar, Mutex, Once};
use std::time::Duration;

/// What to do when the scheduler cannot be reached.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum FailPolicy {
    /// Run unthrottled, with one warning on stderr, and keep trying to reconnect.
    Open,
    /// Hold launches until the scheduler is back.
    Closed,
}

/// Settings from the environment (set by `gpushare run`, or by hand).
pub struct Settings {
    pub socket: PathBuf,
    pub fail: FailPolicy,
    /// A holder that launched nothing for this long gives its token back.
    pub idle_release_ns: u64,
    /// At expiry, give the token back once this much GPU work is left queued (0: after it drained).
    pub handoff_lead_ns: u64,
    pub declared: Option<GroupSpec>,
}

impl Settings {
    fn from_env() -> Settings {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let num = |k: &str, d: f64| var(k).and_then(|v| v.parse::<f64>().ok()).unwrap_or(d);
        let declared = var("GPUSHARE_GROUP").map(|name| GroupSpec {
            name,
            request: num("GPUSHARE_REQUEST", 0.0),
            limit: num("GPUSHARE_LIMIT", 1.0),
            weight: num("GPUSHARE_WEIGHT", 1.0),
            memory: var("GPUSHARE_MEMORY").and_then(|m| gpushare_units::parse_size(&m).ok()),
        });
        Settings {
            socket: var(gpushare_protocol::SOCKET_ENV)
                .unwrap_or_else(|| gpushare_protocol::DEFAULT_SOCKET.into())
                .into(),
            fail: match var("GPUSHARE_FAIL").as_deref() {
                Some("closed") => FailPolicy::Closed,
                _ => FailPolicy::Open,
            },
            idle_release_ns: var("GPUSHARE_IDLE_RELEASE")
                .and_then(|v| gpushare_units::parse_duration_ns(&v).ok())
                .unwrap_or(2_000_000),
            handoff_lead_ns: var("GPUSHARE_HANDOFF_LEAD")
                .and_then(|v| gpushare_units::parse_duration_ns(&v).ok())
                .unwrap_or(1_000_000),
            declared,
        }
    }
}

/// Everything the hook knows in this process.
pub struct Hook {
    pub settings: Settings,
    pub gates: Vec<Gate>,
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
    /// Memory this process holds per GPU, by allocation (pointer or handle).
    pub memory: crate::memory::Books,
    /// Set to wake the watcher before its period ends (a token was cut short).
    wake: (Mutex<bool>, Condvar),
}

static HOOK: AtomicPtr<Hook> = AtomicPtr::new(std::ptr::null_mut());
static INIT: Mutex<()> = Mutex::new(());

/// The hook of this process, created on first use (after `cuInit`, which the application has
/// called before it can launch). `None` while the driver has no devices to gate.
///
/// The fast path is one atomic load: a fork handler clears the pointer in the child, whose
/// connection and tokens must be its own.
#[inline]
pub fn hook() -> Option<&'static Hook> {
    // SAFETY: a non-null pointer is a leaked `Hook`, never freed.
    if let Some(h) = unsafe { HOOK.load(Ordering::Acquire).as_ref() } {
        return Some(h);
    }
    init_hook()
}

#[cold]
fn init_hook() -> Option<&'static Hook> {
    let _guard = INIT.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: as above.
    if let Some(h) = unsafe { HOOK.load(Ordering::Acquire).as_ref() } {
        return Some(h);
    }
    static AT_FORK: Once = Once::new();
    AT_FORK.call_once(|| {
        // SAFETY: registers a child-side handler that only uses atomics and close(2).
        unsafe { libc::pthread_atfork(None, None, Some(forget_parent_hook)) };
    });
    let h: &'static Hook = Box::leak(Box::new(Hook::new()?));
    HOOK.store(h as *const Hook as *mut Hook, Ordering::Release);
    h.start();
    Some(h)
}

/// In a forked child: the parent's hook (connection, threads, tokens) is not ours. Its
/// connection is closed here: a child that never uses CUDA (a data-loader worker) would otherwise
/// keep it open after the parent exits, and the scheduler would keep the parent's memory booked.
/// Only atomics and close(2) (async-signal-safe): another thread may have held any lock at the
/// fork. The parent's `Hook` stays leaked in the child, so those numbers are never closed again.
extern "C" fn forget_parent_hook() {
    let parent = HOOK.swap(std::ptr::null_mut(), Ordering::AcqRel);
    // SAFETY: a non-null pointer is a leaked `Hook`, never freed.
    if let Some(h) = unsafe { parent.as_ref() } {
        for fd in &h.conn_fds {
            let n = fd.swap(-1, Ordering::AcqRel);
            if n >= 0 {
                // SAFETY: `n` is the parent's connection, inherited and used by nothing here.
                unsafe { libc::close(n) };
            }
        }
    }
}

impl Hook {
    fn new() -> Option<Hook> {
        let mut count = 0;
        // SAFETY: real driver entry point with a valid out-pointer.
        if unsafe { real::cuDeviceGetCount()?(&mut count) } != 0 || count <= 0 {
            return None;
        }
        let gates = (0..count)
            .map(|dev| {
                let mut uuid = [0u8; 16];
                // `_v2` where the driver has it: v1 gives a MIG instance its parent GPU's UUID.
                let uuid_of = real::cuDeviceGetUuid_v2().or_else(real::cuDeviceGetUuid)?;
                // SAFETY: valid out-pointer and device ordinal.
                unsafe { uuid_of(&mut uuid, dev) };
                Some(Gate::new(uuid))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Hook {
            settings: Settings::from_env(),
            gates,
            writer: Mutex::new(None),
            conn_fds: [AtomicI32::new(-1), AtomicI32::new(-1)],
            connected: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            pending: Mutex::new(HashMap::new()),
            next_req: AtomicU64::new(1),
            memory: crate::memory::Books::default(),
            wake: (Mutex::new(false), Condvar::new()),
        })
    }

    fn start(&'static self) {
        self.connect();
        let _ = std::thread::Builder::new()
            .name("gpushare-watch".into())
            .spawn(move || self.watch());
    }

    /// The gate of the GPU the calling thread's current context is on.
    #[inline]
    pub fn gate_for_current(&self) -> Option<&Gate> {
        if self.gates.len() == 1 {
            return self.gates.first();
        }
        let mut dev = 0;
        // SAFETY: real driver entry point with a valid out-pointer.
        if unsafe { real::cuCtxGetDevice()?(&mut dev) } != 0 {
            return None;
        }
        self.gates.get(dev as usize)
    }

    /// Wait (fail-closed) until the scheduler is reachable; false at once in fail-open mode.
    pub fn wait_connected(&self) -> bool {
        while !self.is_connected() {
            if self.settings.fail == FailPolicy::Open || self.is_refused() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    /// Connect and say hello; on success a reader thread delivers grants from then on.
    fn connect(&'static self) -> bool {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if self.is_connected() {
            return true;
        }
        // Err((message, refused)): unreachable, or reachable but refusing this process.
        let attempt = || -> Result<UnixStream, (String, bool)> {
            let mut s = UnixStream::connect(&self.settings.socket).map_err(|e| {
                let msg = format!(
                    "cannot reach gpushare-scheduler at {}: {e}",
                    self.settings.socket.display()
                );
                (msg, false)
            })?;
            self.conn_fds[0].store(s.as_raw_fd(), Ordering::Release);
            let handshake = |s: &mut UnixStream| {
                let hello = ClientMsg::Hello {
                    version: PROTOCOL_VERSION,
                    declared: self.settings.declared.clone(),
                };
                let io = |e: std::io::Error| (e.to_string(), false);
                gpushare_protocol::send(s, &hello).map_err(|e| (e.to_string(), false))?;
                s.set_read_timeout(Some(Duration::from_secs(5)))
                    .map_err(io)?;
                match gpushare_protocol::recv::<ServerMsg>(s, &mut Vec::new()) {
                    Ok(Some(ServerMsg::Welcome { group })) => {
                        debug!("connected as group {group}")
                    }
                    Ok(Some(ServerMsg::Error { message, .. })) => return Err((message, true)),
                    other => {
                        return Err((
                            format!("unexpected answer from the scheduler: {other:?}"),
                            false,
                        ));
                    }
                }
                s.set_read_timeout(None).map_err(io)
            };
            if let Err(e) = handshake(&mut s) {
                self.conn_fds[0].store(-1, Ordering::Release);
                return Err(e);
            }
            Ok(s)
        };
        match attempt() {
            Ok(mut s) => {
                let Ok(reader) = s.try_clone() else {
                    self.conn_fds[0].store(-1, Ordering::Release);
                    return false;
                };
                self.conn_fds[1].store(reader.as_raw_fd(), Ordering::Release);
                // A restarted scheduler learns what this process holds on every GPU (nothing,
                // too: its journal may remember more), before anything else this process sends
                // on the new connection.
                for (i, g) in self.gates.iter().enumerate() {
                    let bytes = self.memory.held(i);
                    let _ =
                        gpushare_protocol::send(&mut s, &ClientMsg::MemSync { gpu: g.uuid, bytes });
                }
                *w = Some(s);
                drop(w);
                self.connected.store(true, Ordering::Release);
                let _ = std::thread::Builder::new()
                    .name("gpushare-rx".into())
                    .spawn(move || self.read_loop(reader));
                for g in &self.gates {
                    g.on_connected();
                }
                true
            }
            Err((msg, true)) => {
                self.on_refused(&msg);
                false
            }
            Err((msg, false)) => {
                self.on_unreachable(&msg);
                false
            }
        }
    }

    /// The scheduler answered, and the answer is no: say why, once, and fail this process's
    /// launches (`CUDA_ERROR_NOT_PERMITTED`) and allocations rather than run unthrottled.
    fn on_refused(&self, msg: &str) {
        if !self.refused.swap(true, Ordering::AcqRel) {
            eprintln!("gpushare: the scheduler refused this process: {msg}");
        }
        for g in &self.gates {
            g.set_refused();
        }
    }

    pub fn is_refused(&self) -> bool {
        self.refused.load(Ordering::Acquire)
    }

    fn on_unreachable(&self, msg: &str) {
        match self.settings.fail {
            FailPolicy::Open => {
                static WARN: Once = Once::new();
                WARN.call_once(|| {
                    eprintln!("gpushare: {msg}; running WITHOUT GPU sharing limits (fail-open). Start the daemon, or set GPUSHARE_FAIL=closed to wait for it.");
                });
                for g in &self.gates {
                    g.set_unthrottled();
                }
            }
            FailPolicy::Closed => debug!("{msg}; waiting for the scheduler (fail-closed)"),
        }
    }

    /// Send a message; false (and the gates reset) when the scheduler is gone.
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
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = sync_channel(1);
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(req, tx);
        let answer = if self.send(&make(req)) {
            rx.recv_timeout(Duration::from_secs(5)).ok()
        } else {
            None
        };
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&req);
        answer
    }

    /// Index of the gate of the current context's GPU.
    pub fn current_index(&self) -> Option<usize> {
        if self.gates.len() == 1 {
            return Some(0);
        }
        let mut dev = 0;
        // SAFETY: real driver entry point with a valid out-pointer.
        if unsafe { real::cuCtxGetDevice()?(&mut dev) } != 0 {
            return None;
        }
        ((dev as usize) < self.gates.len()).then_some(dev as usize)
    }

    fn gate(&self, uuid: &[u8; 16]) -> Option<&Gate> {
        self.gates.iter().find(|g| &g.uuid == uuid)
    }

    fn read_loop(&'static self, mut s: UnixStream) {
        let mut buf = Vec::new();
        while let Ok(Some(msg)) = gpushare_protocol::recv::<ServerMsg>(&mut s, &mut buf) {
            match msg {
                ServerMsg::Grant {
                    gpu,
                    token,
                    start_ns,
                    deadline_ns,
                    quota_ns,
                } => {
                    if let Some(g) = self.gate(&gpu) {
                        g.on_grant(self, token, start_ns, deadline_ns, quota_ns);
                        self.wake_watcher();
                    }
                }
                ServerMsg::Revoke { gpu, token } => {
                    if let Some(g) = self.gate(&gpu) {
                        g.on_revoke(token);
                        self.wake_watcher();
                    }
                }
                ServerMsg::Deadline {
                    gpu,
                    token,
                    deadline_ns,
                } => {
                    if let Some(g) = self.gate(&gpu) {
                        g.on_deadline(token, deadline_ns);
                        self.wake_watcher();
                    }
                }
                ServerMsg::Error {
                    message,
                    fatal: true,
                } => {
                    self.on_refused(&message);
                    break;
                }
                ServerMsg::Error {
                    message,
                    fatal: false,
                } => debug!("scheduler: {message}"),
                ServerMsg::Memory { req, .. } => {
                    let tx = self
                        .pending
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&req);
                    if let Some(tx) = tx {
                        let _ = tx.send(msg);
                    }
                }
                ServerMsg::Welcome { .. } | ServerMsg::Status { .. } => {}
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
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        for g in &self.gates {
            g.on_disconnected();
        }
        if !self.is_refused() {
            self.on_unreachable("lost the connection to gpushare-scheduler");
        }
    }

    /// Run the watcher now: a token was granted (it must be watched) or its deadline moved (cut
    /// short, a holder blocked in a synchronisation should give it back at once).
    pub fn wake_watcher(&self) {
        *self.wake.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.wake.1.notify_one();
    }

    /// Background duties: give back tokens that expired or sit idle, reconnect when needed.
    ///
    /// It sleeps until the earliest moment a held token could be due (its deadline, at which it
    /// takes the token away — the launch fast path does not read the clock — or the idle time
    /// after the last activity it knows of), or until woken by a grant or a cut-short token;
    /// while the holder launches, it looks once per idle-release time; no wake-ups while no
    /// token is held.
    fn watch(&'static self) {
        const RECONNECT_NS: u64 = 500_000_000;
        // Tokens end when this thread wakes at their deadline: wake on time, not up to the
        // default 50 µs of timer slack late.
        // SAFETY: prctl(PR_SET_TIMERSLACK) only changes this thread's timer slack.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong) };
        let idle_ns = self.settings.idle_release_ns.max(100_000);
        let mut last_attempt = crate::now_ns();
        let mut next = last_attempt + RECONNECT_NS;
        loop {
            let (flag, cv) = &self.wake;
            let woken = flag.lock().unwrap_or_else(|e| e.into_inner());
            let sleep = Duration::from_nanos(next.saturating_sub(crate::now_ns()));
            let mut woken = cv
                .wait_timeout_while(woken, sleep, |w| !*w)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            *woken = false;
            drop(woken);
            let now = crate::now_ns();
            if !self.is_connected() && !self.is_refused() && now - last_attempt > RECONNECT_NS {
                last_attempt = now;
                self.connect();
            }
            next = self
                .gates
                .iter()
                .filter_map(|g| g.watch(self, idle_ns))
                .fold(now + RECONNECT_NS, u64::min);
        }
    }
}
