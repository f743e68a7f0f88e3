//! The hook's state in one process: its settings, one [`Gate`] per GPU, the connection to the
//! scheduler, and the memory it holds. Created lazily on the first gated call, again after
//! `fork`.

use crate::books::Books;
use crate::driver;
use crate::gate::Gate;
use crate::log::debug;
use crate::port::{Inbox, Port};
use crate::settings::{DEFAULT_LIVENESS_NS, FailPolicy, Settings};
use crate::turn::Plan;
use gpushare_protocol::{ClientMsg, ServerMsg};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, Once};
use std::time::Duration;

/// Everything the hook knows in this process.
pub struct Hook {
    pub settings: Settings,
    pub gates: Vec<Gate>,
    pub port: &'static Port,
    /// Memory this process holds per GPU, by allocation (pointer or handle), and its leases.
    pub memory: Books,
    /// What each gate's GPU holds in all (0: the driver would not say), told to the scheduler.
    pub gpu_memory: Vec<u64>,
}

static HOOK: AtomicPtr<Hook> = AtomicPtr::new(std::ptr::null_mut());
static INIT: Mutex<()> = Mutex::new(());

/// The hook of this process, created on first use (after `cuInit`, which the application has
/// called before it can launch). `None` while the driver has no devices to gate.
///
/// The fast path is one atomic load: a fork handler clears the pointer in the child, whose
/// connection and turns must be its own.
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
    h.port.start(h);
    Some(h)
}

/// In a forked child: the parent's hook (connection, threads, turns) is not ours. Its
/// connection is closed here: a child that never uses CUDA (a data-loader worker) would otherwise
/// keep it open after the parent exits, and the scheduler would keep the parent's memory booked.
/// Only atomics and close(2) (async-signal-safe): another thread may have held any lock at the
/// fork. The parent's `Hook` stays leaked in the child, so those numbers are never closed again.
extern "C" fn forget_parent_hook() {
    let parent = HOOK.swap(std::ptr::null_mut(), Ordering::AcqRel);
    // SAFETY: a non-null pointer is a leaked `Hook`, never freed.
    if let Some(h) = unsafe { parent.as_ref() } {
        h.port.close_in_child();
    }
}

impl Hook {
    fn new() -> Option<Hook> {
        let settings = Settings::from_env();
        let port: &'static Port = Box::leak(Box::new(Port::new(
            settings.socket.clone(),
            settings.declared.clone(),
            settings.liveness,
            DEFAULT_LIVENESS_NS,
        )));
        let liveness_ns = port.liveness().as_nanos() as u64;
        let gates = (0..driver::device_count()?)
            .map(|dev| {
                let uuid = driver::device_uuid(dev)?;
                Some(Gate::new(
                    uuid,
                    settings.turns,
                    liveness_ns,
                    settings.drain_grace_ns,
                    port,
                ))
            })
            .collect::<Option<Vec<_>>>()?;
        let memory = Books::new(gates.len(), settings.lease_max);
        let gpu_memory = (0..gates.len())
            .map(|d| driver::device_total_memory(d).unwrap_or(0))
            .collect();
        Some(Hook {
            settings,
            gates,
            port,
            memory,
            gpu_memory,
        })
    }

    /// Index of the gate of the current context's GPU.
    #[inline]
    pub fn current_index(&self) -> Option<usize> {
        if self.gates.len() == 1 {
            return Some(0);
        }
        driver::current_device().filter(|&d| d < self.gates.len())
    }

    /// The gate of the GPU the calling thread's current context is on.
    #[inline]
    pub fn gate_for_current(&self) -> Option<&Gate> {
        self.gates.get(self.current_index()?)
    }

    /// Wait (fail-closed) until the scheduler is reachable; false at once in fail-open mode.
    pub fn wait_connected(&self) -> bool {
        while !self.port.is_connected() {
            if self.settings.fail == FailPolicy::Open || self.port.is_refused() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// Context state was destroyed: context `ctx`, or the primary context of device `dev`
    /// (reset, or released by its last user). The gates forget the fence events and contexts
    /// that died with it.
    pub fn forget_contexts(&self, ctx: Option<driver::Handle>, dev: Option<i32>) {
        match (ctx, dev) {
            (Some(ctx), _) => self.gates.iter().for_each(|g| g.forget_context(Some(ctx))),
            (None, Some(dev)) => {
                if let Some(g) = usize::try_from(dev).ok().and_then(|d| self.gates.get(d)) {
                    g.forget_context(None);
                }
            }
            (None, None) => {}
        }
    }

    fn gate(&self, uuid: &[u8; 16]) -> Option<&Gate> {
        self.gates.iter().find(|g| &g.uuid == uuid)
    }
}

impl Inbox for Hook {
    /// A restarted scheduler learns what this process holds on every GPU (nothing, too: its
    /// journal may remember more): its whole lease, spare included, since the process may
    /// allocate the spare without asking again; and how much memory each GPU has.
    fn greet(&self, send: &mut dyn FnMut(&[ClientMsg])) {
        crate::charges::greet(self, send);
    }

    fn connected(&self, liveness_ns: u64) {
        for g in &self.gates {
            g.on_connected(liveness_ns);
        }
    }

    /// What this process decided alone meanwhile is stated.
    fn answered_again(&self) {
        crate::charges::answered_again(self);
    }

    fn message(&self, msg: ServerMsg) {
        match msg {
            ServerMsg::Grant {
                gpu,
                token,
                start_ns,
                deadline_ns,
                queue_budget_ns,
                open_at_start,
                just_in_time,
            } => {
                if let Some(g) = self.gate(&gpu) {
                    let plan = Plan {
                        queue_budget_ns,
                        open_at_start,
                        just_in_time,
                    };
                    g.on_grant(token, start_ns, deadline_ns, plan);
                }
            }
            ServerMsg::Revoke { gpu, token } => {
                if let Some(g) = self.gate(&gpu) {
                    g.on_revoke(token);
                }
            }
            ServerMsg::Deadline {
                gpu,
                token,
                deadline_ns,
            } => {
                if let Some(g) = self.gate(&gpu) {
                    g.on_deadline(token, deadline_ns);
                }
            }
            ServerMsg::Alive { gpu } => {
                if let Some(g) = self.gate(&gpu) {
                    g.on_alive();
                }
            }
            other => debug!("unexpected from the scheduler: {other:?}"),
        }
    }

    /// Launches fail (`CUDA_ERROR_NOT_PERMITTED`), and allocations, rather than run
    /// unthrottled.
    fn refused(&self, _why: &str) {
        for g in &self.gates {
            g.set_refused();
        }
    }

    fn unreachable(&self, why: &str) {
        for g in &self.gates {
            g.on_disconnected();
        }
        match self.settings.fail {
            FailPolicy::Open => {
                static WARN: Once = Once::new();
                WARN.call_once(|| {
                    eprintln!("gpushare: {why}; running WITHOUT GPU sharing limits (fail-open). Start the daemon, or set GPUSHARE_FAIL=closed to wait for it.");
                });
                for g in &self.gates {
                    g.set_unthrottled();
                }
            }
            FailPolicy::Closed => debug!("{why}; waiting for the scheduler (fail-closed)"),
        }
    }
}
