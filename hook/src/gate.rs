//! The turn gate of one GPU in this process: the launch fast path, and the hands that carry
//! out the turn state machine's decisions ([`crate::turn`]).
//!
//! Fast path ([`Gate::enter`]): check that no pacing wait is due and that the turn is open (no
//! clock read: the watcher closes it near its deadline), take the launch's number and note its
//! stream (for [`crate::queue`]); on return ([`Gate::leave`]) mark its call returned. One atomic
//! increment per launch, before the driver call (after it, an atomic read-modify-write would wait
//! for the driver's stores to drain), no lock, no system call, no allocation.
//! Everything else happens on the slow path, under the gate's mutex, through [`Turns`]:
//! - waiting for a turn: a launcher asks for one, and opens the gate a lead before the
//!   granted turn's start, so its first kernels queue behind the previous turn's last ones;
//! - pacing: every K launches (half the queue budget of estimated GPU work) a fence event is
//!   recorded on the launching stream; while more than half the budget is queued, the next
//!   launch waits for the oldest fence before it is submitted (never the launch call just
//!   submitted: an application may record its own events right after each launch);
//! - ending a turn: this GPU's own watcher thread closes the gate when the work queued would
//!   run to the deadline (or gives an idle turn back), lets the launch calls admitted return, and
//!   has this GPU's drainer thread wait for the process's work. The wait is bounded: past the
//!   deadline plus `GPUSHARE_DRAIN_GRACE` (a kernel waiting for a peer GPU, say) the turn is
//!   reported anyway and the next one goes on; the drain settles in the background. Each GPU
//!   has its own watcher and drainer, so a process driving several GPUs never has one GPU's
//!   drain hold up another's turns.
//!
//! No driver call is made under the gate's mutex, waits or not: the fence events are asked
//! about without it and the answers taken in after ([`Gate::ask`]). A process the driver holds
//! locked (`cuCheckpointProcessLock`, as a swap to host memory begins) blocks in every CUDA
//! call until it is unlocked; the thread that made one must not keep the connection thread
//! (the scheduler's grants, revocations, answers), the launchers and the watcher waiting.
//!
//! The pacing (fences and the waits for them) is [`pace`]'s; the drainer thread [`drain`]'s.

mod drain;
mod pace;

use crate::driver::{self, Handle, Stream};
use crate::log::debug;
use crate::port::Port;
use crate::queue::{self, Ask, Asked, LaunchStreams, Queue};
use crate::turn::{
    Activity, Plan, Runway, Say, Step, Turn, TurnConfig, Turns, UNLIMITED, Waiter, Watch, pacing,
};
use drain::Drainer;
use gpushare_protocol::ClientMsg;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, Once};
use std::time::Duration;

struct Inner {
    turns: Turns,
    queue: Queue,
    /// The contexts launched into (synchronised at a drain).
    ctxs: Vec<Handle>,
    /// Every launch call up to this count has returned from the driver.
    returned: u64,
    /// Where the work launched should end (launching just in time).
    runway: Runway,
    /// Buffers for questions about the fences, reused ([`Gate::ask`]).
    asked: Vec<Asked>,
    /// Launches have run without limits and unpaced (no scheduler) since the pacing last
    /// started from an empty queue.
    unpaced: bool,
}

/// An admitted launch (or graph launch): its launch numbers `first..=last`, its stream's key in
/// [`LaunchStreams`], and whether a fence follows it (decided on admission, so that the return
/// from the driver reads nothing the driver's work may have pushed out of the cache).
#[derive(Debug, Clone, Copy)]
pub struct Admission {
    first: u64,
    last: u64,
    key: u64,
    fence: bool,
}

/// The fields the fast path reads and writes come first, in one cache line of their own.
#[repr(C, align(64))]
pub struct Gate {
    /// Absolute CLOCK_MONOTONIC deadline of the open turn; 0 while the gate is closed.
    /// Launches are admitted while it is non-zero: the watcher clears it near the deadline.
    deadline: AtomicU64,
    /// Launches admitted (each graph launch counts its kernels); the latest's number.
    launches: AtomicU64,
    next_pace: AtomicU64,
    /// The stream of each recent launch (what a completed fence vouches for), and whether its
    /// call has returned (what a drain waits for).
    launch_streams: LaunchStreams,
    /// The last fence found more than half the queue budget queued: the next launch waits
    /// (takes the slow path) until it is not.
    pace_due: AtomicBool,
    /// A turn's work drains (the gate is closed for it).
    draining: AtomicBool,
    pub uuid: [u8; 16],
    port: &'static Port,
    drain_grace_ns: u64,
    /// Launchers waiting in `wait_for_queue` for their queued work: busy, not idle.
    pacing: AtomicU32,
    /// Launchers waiting for a turn: this process has work. Changed only under `inner`'s
    /// lock, so that a read under it is exact.
    waiters: AtomicU32,
    inner: Mutex<Inner>,
    changed: Condvar,
    /// Set to run the watcher before its period ends (a grant, a deadline moved).
    wake: (Mutex<bool>, Condvar),
    drainer: Drainer,
    threads: Once,
}

impl Gate {
    pub fn new(
        uuid: [u8; 16],
        cfg: TurnConfig,
        liveness_ns: u64,
        drain_grace_ns: u64,
        port: &'static Port,
    ) -> Gate {
        Gate {
            uuid,
            port,
            drain_grace_ns,
            deadline: AtomicU64::new(0),
            pacing: AtomicU32::new(0),
            waiters: AtomicU32::new(0),
            pace_due: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            launches: AtomicU64::new(0),
            launch_streams: LaunchStreams::new(),
            next_pace: AtomicU64::new(1),
            inner: Mutex::new(Inner {
                turns: Turns::new(cfg, liveness_ns),
                queue: Queue::default(),
                ctxs: Vec::new(),
                returned: 0,
                runway: Runway::default(),
                asked: Vec::new(),
                unpaced: false,
            }),
            changed: Condvar::new(),
            wake: (Mutex::new(false), Condvar::new()),
            drainer: Drainer::default(),
            threads: Once::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the counters say now.
    fn activity(&self, g: &mut Inner) -> Activity {
        let launches = self.launches.load(Ordering::Acquire);
        Activity {
            launches,
            quiet: self.all_returned(g, launches) && self.pacing.load(Ordering::Acquire) == 0,
            waiters: self.waiters.load(Ordering::Acquire),
        }
    }

    /// Whether every launch call up to number `n` has returned from the driver.
    fn all_returned(&self, g: &mut Inner, n: u64) -> bool {
        g.returned = self.launch_streams.returned_through(g.returned, n);
        g.returned >= n
    }

    /// Carry out what the machine decided: the fast path's deadline, and what to tell the
    /// scheduler (in order). Limits that apply again after a spell without them and without
    /// pacing (no scheduler) restart the pacing from an empty queue (what the fences knew spans
    /// the spell); after a fail-open spell, paced, the queue is known as it is.
    fn apply(&self, g: &mut Inner) {
        let deadline = g.turns.gate_deadline();
        self.deadline.store(deadline, Ordering::SeqCst);
        if deadline == UNLIMITED {
            g.unpaced |= g.turns.queue_budget().is_none();
        } else if std::mem::take(&mut g.unpaced) {
            self.next_pace.store(1, Ordering::Relaxed);
            let n = self.launches.load(Ordering::Relaxed);
            g.queue.drained(&self.launch_streams, n);
            g.runway.drained(n);
        }
        for say in g.turns.take_said() {
            let msg = match say {
                Say::Acquire => ClientMsg::Acquire { gpu: self.uuid },
                Say::Probe => {
                    debug!("probing the scheduler: nothing heard for half the liveness bound");
                    ClientMsg::Probe { gpu: self.uuid }
                }
                Say::Yield { token, drained_ns } => ClientMsg::Yield {
                    gpu: self.uuid,
                    token,
                    drained_ns,
                },
                Say::Report { token, used, again } => {
                    debug!("turn {token} used {used:?}, again {again}");
                    ClientMsg::Report {
                        gpu: self.uuid,
                        token,
                        used,
                        again,
                    }
                }
            };
            self.port.send(&msg);
        }
    }

    /// Apply, wake launchers waiting on the gate, and the watcher.
    fn changed(&self, g: &mut Inner) {
        self.apply(g);
        self.changed.notify_all();
        self.wake();
    }

    // --- launches ------------------------------------------------------------------------

    /// Admit a launch of `kernels` kernels (a graph's count as that many launches, so that the
    /// GPU time per launch the fences measure stays that of one kernel) on `stream`; returns once
    /// this process may use the GPU. Pair with [`Gate::leave`]. `None`: the scheduler refused
    /// this process, and the launch must not run.
    #[inline(always)]
    pub fn enter(&'static self, stream: Option<(Stream, bool)>, kernels: u64) -> Option<Admission> {
        let key = queue::key_of(stream, driver::thread_id);
        let kernels = kernels.max(1);
        self.try_enter(key, kernels)
            .or_else(|| self.enter_slow(key, kernels))
    }

    /// The fast path: admitted while a turn is open (or none is needed) and no pacing wait is
    /// due. The deadline is enforced by the watcher, which sleeps until it: a clock read per
    /// launch cost more than everything else here.
    #[inline]
    fn try_enter(&self, key: u64, kernels: u64) -> Option<Admission> {
        if self.pace_due.load(Ordering::Relaxed) || self.deadline.load(Ordering::Relaxed) == 0 {
            return None;
        }
        // SeqCst with the close's store of the deadline and load of the count: either the close
        // counts this launch (and waits for its call to return) or this launch sees the turn
        // gone.
        let last = self.launches.fetch_add(kernels, Ordering::SeqCst) + kernels;
        let a = self.admitted(last, kernels, key);
        if self.deadline.load(Ordering::SeqCst) != 0 {
            return Some(a);
        }
        self.launch_streams.withdrawn(a.first, a.last);
        None
    }

    /// Launches up to `last` are admitted, the last `kernels` of them this one's.
    #[inline]
    fn admitted(&self, last: u64, kernels: u64, key: u64) -> Admission {
        let a = Admission {
            first: last + 1 - kernels,
            last,
            key,
            fence: last >= self.next_pace.load(Ordering::Relaxed),
        };
        self.launch_streams.admitted(a.first, a.last, key);
        a
    }

    /// The launch call returned (plain stores: no read-modify-write after the driver call); every
    /// K launches, record a fence on `stream`.
    #[inline]
    pub fn leave(&self, a: Admission, stream: Option<(Stream, bool)>) {
        self.launch_streams.returned(a.first, a.last, a.key);
        if a.fence
            && let Some((stream, per_thread)) = stream
        {
            self.fence(stream, per_thread, a.key, a.last);
        }
    }

    #[cold]
    #[inline(never)]
    fn enter_slow(&'static self, key: u64, kernels: u64) -> Option<Admission> {
        self.threads.call_once(|| self.start_threads());
        if self.pace_due.load(Ordering::Relaxed) {
            self.wait_for_queue();
        }
        let mut g = self.lock();
        g.turns
            .launcher_arrives(crate::now_ns(), self.launches.load(Ordering::Relaxed));
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let mut waiter = Waiter::default();
        let admitted = loop {
            let now = crate::now_ns();
            if let Some(beat) = self.port.heartbeat() {
                g.turns.heartbeat(beat, now);
            }
            let step = g.turns.admit(now, &mut waiter);
            self.apply(&mut g);
            match step {
                Step::Admit => break true,
                Step::Opened => {
                    // Fence the turn's first launch: its queue is known from the start.
                    self.next_pace
                        .store(self.launches.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                    self.changed.notify_all();
                    self.wake();
                    break true;
                }
                Step::Ungated => {
                    // Paced from its first launch, as a turn is.
                    self.next_pace
                        .store(self.launches.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                    ungated_warning(g.turns.liveness_ns());
                    self.port.mark_owed();
                    self.wake();
                    break true;
                }
                Step::Refuse => break false,
                Step::Ask => {
                    let sent = self.port.send(&ClientMsg::Acquire { gpu: self.uuid });
                    g.turns.asked(sent, now);
                    if !sent {
                        g = self.wait(g, Duration::from_millis(100));
                    }
                }
                Step::Wait { until_ns } => {
                    if g.turns.overdue(now) {
                        // Fail-closed: waits on.
                        debug!("gpushare-scheduler owes an answer: waiting for it (fail-closed)");
                        self.port.mark_owed();
                    }
                    g = self.wait(g, Duration::from_nanos(until_ns.saturating_sub(now)));
                }
            }
        };
        self.waiters.fetch_sub(1, Ordering::AcqRel);
        // Under the lock: a close, which takes it, counts this launch.
        admitted.then(|| {
            let last = self.launches.fetch_add(kernels, Ordering::SeqCst) + kernels;
            self.admitted(last, kernels, key)
        })
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Inner>, d: Duration) -> MutexGuard<'a, Inner> {
        self.changed
            .wait_timeout(g, d)
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    // --- the scheduler -------------------------------------------------------------------

    pub fn on_grant(&self, token: u64, start_ns: u64, deadline_ns: u64, plan: Plan) {
        let mut g = self.lock();
        g.turns
            .grant(token, start_ns, deadline_ns, plan, crate::now_ns());
        self.changed(&mut g);
    }

    pub fn on_revoke(&self, token: u64) {
        debug!("turn {token} revoked by the scheduler");
        let mut g = self.lock();
        let waiting = self.waiters.load(Ordering::Acquire) > 0;
        g.turns.revoke(token, waiting, crate::now_ns());
        self.bound_drain(&g);
        self.changed(&mut g);
    }

    pub fn on_deadline(&self, token: u64, deadline_ns: u64) {
        let mut g = self.lock();
        g.turns.deadline(token, deadline_ns, crate::now_ns());
        self.bound_drain(&g);
        self.changed(&mut g);
    }

    /// A drain under way ends by its turn's end (as it is now: a yielded turn ends where its
    /// work should have drained; a revoked one ended long ago) plus the drain grace.
    fn bound_drain(&self, g: &Inner) {
        if let Some(d) = g.turns.closing_deadline() {
            self.drainer.until(d.saturating_add(self.drain_grace_ns));
        }
    }

    /// Connected (again), to a scheduler that promises to answer within `liveness_ns` (unless
    /// the settings fix the bound).
    pub fn on_connected(&self, liveness_ns: u64) {
        let mut g = self.lock();
        g.turns.set_liveness(liveness_ns);
        g.turns.connected(crate::now_ns());
        self.changed(&mut g);
    }

    /// The scheduler answered a probe.
    pub fn on_alive(&self) {
        let mut g = self.lock();
        g.turns.alive(crate::now_ns());
        self.changed(&mut g);
    }

    /// The scheduler is gone (its turns with it). What the queue knew is forgotten too: the
    /// next fence's spacing from the last one would span the outage.
    pub fn on_disconnected(&self) {
        let mut g = self.lock();
        if g.turns.disconnected() {
            let n = self.launches.load(Ordering::Relaxed);
            g.queue.drained(&self.launch_streams, n);
        }
        self.changed(&mut g);
    }

    /// Context `ctx` (`None`: every context of this GPU) was destroyed: the fence events and
    /// the context this gate kept of it are gone.
    pub fn forget_context(&self, ctx: Option<Handle>) {
        let mut g = self.lock();
        g.ctxs.retain(|c| ctx.is_some_and(|d| d != *c));
        let n = self.launches.load(Ordering::Relaxed);
        g.queue.forget_context(&self.launch_streams, ctx, n);
        self.pace_due.store(false, Ordering::Relaxed);
    }

    pub fn set_refused(&self) {
        let mut g = self.lock();
        g.turns.refused();
        self.changed(&mut g);
    }

    pub fn set_unthrottled(&self) {
        let mut g = self.lock();
        g.turns.unthrottled();
        self.changed(&mut g);
    }

    // --- the watcher and the drain ---------------------------------------------------------

    /// This GPU's watcher and drainer, started with the first launch that takes the slow path.
    fn start_threads(&'static self) {
        let _ = std::thread::Builder::new()
            .name("gpushare-watch".into())
            .spawn(move || self.watch_loop());
        let _ = std::thread::Builder::new()
            .name("gpushare-drain".into())
            .spawn(move || self.drainer.run());
    }

    /// Run the watcher now: a turn was granted (it must be watched) or its deadline moved.
    fn wake(&self) {
        *self.wake.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.wake.1.notify_one();
    }

    /// Sleep until the earliest moment the turn could be due (its deadline, at which it closes
    /// the gate — the launch fast path does not read the clock — or the idle release after the
    /// last activity it knows of), or until woken by a change; no wake-ups while no turn is held.
    fn watch_loop(&'static self) {
        driver::precise_timers();
        let mut next: Option<u64> = None;
        loop {
            let (flag, cv) = &self.wake;
            let woken = flag.lock().unwrap_or_else(|e| e.into_inner());
            let sleep = next.map_or(Duration::from_secs(3600), |t| {
                Duration::from_nanos(t.saturating_sub(crate::now_ns()))
            });
            let mut woken = cv
                .wait_timeout_while(woken, sleep, |w| !*w)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            *woken = false;
            drop(woken);
            next = self.watch();
        }
    }

    /// One look: returns when to look again (`None`: when woken). What the GPU has passed is
    /// asked first, without the lock ([`Gate::ask`]).
    fn watch(&self) -> Option<u64> {
        let (mut g, _) = self.ask(self.lock(), Ask::All, false);
        // The clock is read under the lock: a launcher pacing may have held it a while, the
        // driver's answers taken a while (a process locked by a checkpoint).
        let now = crate::now_ns();
        let a = self.activity(&mut g);
        let Inner { turns, queue, .. } = &mut *g;
        let tolerance = turns.queue_budget().unwrap_or(0.0) as u64;
        let mut queued = || self.queued_now(queue, now, tolerance);
        match turns.watch(now, a, &mut queued) {
            // (Applied: a probe, when ungated.)
            Watch::Nothing => {
                self.apply(&mut g);
                None
            }
            Watch::At(t) => {
                self.apply(&mut g);
                Some(t)
            }
            Watch::RollOver => {
                g.turns.roll_over();
                self.apply(&mut g);
                Some(now)
            }
            Watch::Close { yield_at, busy } => {
                self.close(g, yield_at, busy);
                None
            }
        }
    }

    /// The GPU work this process has queued now, as far as its fences tell (as last asked:
    /// no driver call).
    fn queued_now(&self, queue: &mut Queue, now: u64, tolerance_ns: u64) -> Option<u64> {
        let launched = self.launches.load(Ordering::Relaxed);
        queue.scan(&self.launch_streams, launched);
        // On several streams, launches after a stream's newest fence are vouched for only by a
        // later one: counted as queued (an overestimate, up to a budget), so a turn is closed
        // early rather than late.
        queue.queued_ns(now, tolerance_ns).map(|(tail, _)| tail)
    }

    /// Ask the driver about the pending fences `which` (`wait`: wait for the oldest of them
    /// first) without the lock `g`, and take the answers in under it again, tolerating what
    /// changed meanwhile ([`Queue::take_in`]). No driver call is made under the gate's lock: a
    /// process the driver holds locked (a checkpoint, for a swap to host memory) blocks in its
    /// calls until it is let go, and the connection thread (the scheduler's grants,
    /// revocations and answers), the launchers and the watcher must not wait behind it.
    /// Returns the lock, and false if `wait` found nothing to wait for or the driver would not
    /// wait.
    fn ask<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        which: Ask,
        wait: bool,
    ) -> (MutexGuard<'a, Inner>, bool) {
        let mut asked = g.asked.pop().unwrap_or_default();
        g.queue.to_ask(which, &mut asked);
        if asked.is_empty() {
            g.asked.push(asked);
            return (g, false);
        }
        let launched = self.launches.load(Ordering::Relaxed);
        drop(g);
        let waited = if wait {
            asked.wait_oldest(&mut Driver)
        } else {
            asked.ask(&mut Driver);
            true
        };
        let mut g = self.lock();
        g.queue.take_in(&asked, launched);
        g.asked.push(asked);
        (g, waited)
    }

    /// Close the gate for the held turn, let the launch calls admitted return, have this
    /// process's GPU work drained (without the lock, bounded), and report the turn: its first
    /// launch and when its work drained, and whether this process has more work (`busy`, or a
    /// launcher waiting by then). `yield_at`: the turn is given back before its deadline (at that time),
    /// with when its work should drain, so the next turn starts there.
    fn close(&self, mut g: MutexGuard<'_, Inner>, yield_at: Option<u64>, busy: bool) {
        let Some(turn) = g.turns.begin_close() else {
            return;
        };
        self.deadline.store(0, Ordering::SeqCst);
        self.draining.store(true, Ordering::Release);
        let admitted = self.launches.load(Ordering::SeqCst);
        let limit = turn.deadline_ns.max(crate::now_ns()) + self.drain_grace_ns;
        // Launch calls admitted return (one stuck in the driver behind a waiting kernel is not
        // waited for past the limit).
        while !self.all_returned(&mut g, admitted) && crate::now_ns() < limit {
            std::thread::yield_now();
        }
        if let Some(now) = yield_at {
            let tolerance = g.turns.queue_budget().unwrap_or(0.0) as u64;
            let drained_ns = now + self.queued_now(&mut g.queue, now, tolerance).unwrap_or(0);
            debug!("yield turn {} (drains at {drained_ns})", turn.token);
            g.turns.yield_turn(&turn, now, drained_ns);
            self.apply(&mut g);
        }
        if turn.opened_ns.is_none() {
            // Nothing was launched in it: nothing of it to drain (and work of an earlier turn
            // that is still draining is not this one's).
            drop(g);
            self.closed(turn, false, busy);
            return;
        }
        self.bound_drain(&g);
        let ctxs = g.ctxs.clone();
        drop(g);
        let drained = self.drainer.drain(ctxs);
        self.closed(turn, drained, busy);
    }

    /// The drain of `turn` ended (`drained`: its work completed; else the limit passed).
    fn closed(&self, turn: Turn, drained: bool, busy: bool) {
        let last_ns = crate::now_ns();
        let mut g = self.lock();
        if drained {
            // Draining also restarts the pacing from an empty queue, so that no fence spacing
            // spans another holder's turn.
            let n = self.launches.load(Ordering::Relaxed);
            g.queue.drained(&self.launch_streams, n);
            g.runway.drained(n);
        } else if turn.opened_ns.is_some() {
            debug!("turn {}: work still running at its drain limit", turn.token);
        }
        self.pace_due.store(false, Ordering::Relaxed);
        let again = busy || self.waiters.load(Ordering::Acquire) > 0;
        g.turns.end_close(turn, last_ns, again);
        self.draining.store(false, Ordering::Release);
        self.changed(&mut g);
    }

    // --- synchronisations ------------------------------------------------------------------

    /// The application is about to synchronise: a process that went idle after its last
    /// synchronisations gives its turn back as the work it waits for drains (see
    /// [`Turns::before_sync`]). Returns when (for [`Gate::after_sync`]).
    pub fn before_sync(&self) -> u64 {
        let mut g = self.lock();
        let now = crate::now_ns();
        let a = self.activity(&mut g);
        if let Some(token) = g.turns.before_sync(now, a) {
            // What is queued, for when the turn's work drains. The lock is let go meanwhile:
            // closed only if it is still that turn, and no launcher has come since.
            let (mut g, _) = self.ask(g, Ask::All, false);
            let a = self.activity(&mut g);
            if g.turns.still_gives_back(token, a) {
                self.close(g, Some(crate::now_ns()), false);
            }
        }
        now
    }

    /// A synchronisation that began at `began` returned. The fences of the work it waited for
    /// have completed: taken in now (a query each, no wait), so that the launches after it are
    /// not held for work already done (a launch-bound loop would otherwise wait on a completed
    /// fence every few fences). The pacing keeps the work queued within the queue budget: a
    /// wait of more than twice the budget (margin for a thread woken late, and for the previous
    /// holder's last kernels at a turn's start) shows the GPU time per launch higher than the
    /// fences knew. Only while a turn is held: during a fail-open spell the device time-slices
    /// among the processes, and a wait holds their kernels too.
    pub fn after_sync(&self, began: u64) {
        let n = self.launches.load(Ordering::Relaxed);
        let mut g = self.lock();
        let now = crate::now_ns();
        g.turns.after_sync(now, n);
        let budget = g.turns.queue_budget();
        // (Launching just in time, a latency-class group's kernels run between this process's:
        // a wait holds them too.)
        if let Some(budget) = g.turns.held_budget()
            && g.turns.just_in_time().is_none()
            && now.saturating_sub(began) as f64 > 2.0 * budget
        {
            g.queue.scan(&self.launch_streams, n);
            g.queue.waited(now.saturating_sub(began) as f64);
        }
        let (g, _) = self.ask(g, Ask::All, false);
        if let Some(budget) = budget
            && !g.queue.too_much(pacing(budget, 0.0).1)
        {
            self.pace_due.store(false, Ordering::Relaxed);
        }
    }
}

/// The GPU as this process observes it: the driver's answers about the fence events, and
/// CLOCK_MONOTONIC (what the queue is fed).
struct Driver;

impl queue::Gpu for Driver {
    fn now_ns(&mut self) -> u64 {
        crate::now_ns()
    }

    fn passed(&mut self, event: Handle) -> Option<bool> {
        driver::event_done(event)
    }

    fn wait(&mut self, event: Handle) -> bool {
        driver::event_wait(event)
    }

    fn elapsed_ms(&mut self, start: Handle, end: Handle) -> Option<f32> {
        driver::event_elapsed_ms(start, end)
    }
}

/// A launcher found the scheduler unresponsive (fail-open): said once per process on stderr,
/// as when it cannot be reached, and each time under `GPUSHARE_LOG`.
fn ungated_warning(liveness_ns: u64) {
    static WARN: Once = Once::new();
    let ms = liveness_ns as f64 / 1e6;
    debug!(
        "gpushare-scheduler left a probe unanswered ({ms:.0} ms): launching without turns (queued work still paced) until it answers"
    );
    WARN.call_once(|| {
        eprintln!("gpushare: gpushare-scheduler has not answered for {ms:.0} ms; running without turns (its queued work still paced) until it does (fail-open). Set GPUSHARE_FAIL=closed to wait for it, or GPUSHARE_LIVENESS to wait longer.");
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::turn::Step;

    const CFG: TurnConfig = TurnConfig {
        idle_release_ns: 2_000_000,
        handoff_lead_ns: 1_000_000,
        fail_open: true,
    };
    const LIVENESS: u64 = 40_000_000;

    fn port() -> &'static Port {
        Box::leak(Box::new(Port::new(
            "/nonexistent".into(),
            None,
            None,
            LIVENESS,
        )))
    }

    /// A gate whose process has just asked the scheduler for a turn (no answer will come): the
    /// state a fail-open spell starts from. Returns when it asked.
    fn asking() -> (&'static Gate, u64) {
        let gate: &'static Gate = Box::leak(Box::new(Gate::new(
            [0; 16],
            CFG,
            LIVENESS,
            10_000_000,
            port(),
        )));
        let asked = crate::now_ns();
        {
            let mut g = gate.lock();
            assert_eq!(g.turns.admit(asked, &mut Waiter::default()), Step::Ask);
            g.turns.asked(true, asked);
        }
        (gate, asked)
    }

    /// A gate whose turn `token`, an hour long, is open.
    fn holding(token: u64) -> Gate {
        let gate = Gate::new([0; 16], CFG, LIVENESS, 10_000_000, port());
        let now = crate::now_ns();
        {
            let mut g = gate.lock();
            let mut w = Waiter::default();
            assert_eq!(g.turns.admit(now, &mut w), Step::Ask);
            g.turns.asked(true, now);
            let plan = Plan {
                queue_budget_ns: 2_500_000,
                ..Plan::default()
            };
            g.turns
                .grant(token, now, now + 3_600_000_000_000, plan, now);
            assert_eq!(g.turns.admit(now, &mut w), Step::Opened);
            gate.apply(&mut g);
        }
        gate
    }

    /// A launch returning while a drain holds the gate does not wait for the drain (the
    /// application's thread would sit in a launch call already submitted until this process's
    /// work had drained); the next launch paces instead.
    #[test]
    fn a_launch_does_not_wait_for_a_drain_to_pace() {
        let gate = holding(7);
        let drain = gate.lock();
        gate.draining.store(true, Ordering::Release);
        gate.fence(std::ptr::null_mut(), false, 0, 41);
        assert_eq!(gate.next_pace.load(Ordering::Relaxed), 42);
        drop(drain);
    }

    /// A launch whose fence could not be recorded (here: no current context) leaves the next
    /// fence due at the next launch, not at every one after it.
    #[test]
    fn a_fence_not_recorded_is_tried_at_the_next_launch_only() {
        let gate = holding(7);
        gate.next_pace.store(1, Ordering::Relaxed);
        gate.fence(std::ptr::null_mut(), false, 0, 41);
        assert_eq!(gate.next_pace.load(Ordering::Relaxed), 42);
    }

    /// A fence that finds more than half the queue budget queued makes the next launch wait
    /// before it is submitted (the slow path), not the launch call just submitted; the wait is
    /// over once the queue is within the budget (here it already is).
    #[test]
    fn a_pacing_wait_holds_the_next_launch_not_the_one_submitted() {
        let gate = holding(7);
        let budget = gate.lock().turns.queue_budget().expect("turn held");
        assert_eq!(budget, 2_500_000.0, "an eighth of the 20 ms quota");
        gate.pace_due.store(true, Ordering::Relaxed);
        assert!(
            gate.try_enter(0, 1).is_none(),
            "a wait is due: the slow path"
        );
        assert_eq!(gate.launches.load(Ordering::Relaxed), 0, "nothing admitted");
        gate.wait_for_queue();
        let a = gate.try_enter(0, 1).expect("the wait is over");
        gate.leave(a, None);
    }

    /// A synchronisation's wait during a fail-open spell holds other processes' kernels too
    /// (the device time-slices among them): it does not set the GPU time per launch; while a
    /// turn is held it does.
    #[test]
    fn a_wait_during_a_fail_open_spell_is_not_taken_for_this_process_work() {
        let (gate, _) = asking();
        let a = gate.enter(None, 1).expect("ungated: admitted");
        gate.leave(a, None);
        assert_eq!(gate.lock().turns.token(), crate::turn::Token::Ungated);
        let began = crate::now_ns() - 100_000_000;
        gate.after_sync(began);
        assert_eq!(
            gate.queued_now(&mut gate.lock().queue, crate::now_ns(), u64::MAX),
            None,
            "nothing learnt from the spell's wait"
        );

        let gate = holding(7);
        let a = gate.try_enter(0, 1).expect("open");
        gate.leave(a, None);
        let began = crate::now_ns() - 100_000_000;
        gate.after_sync(began);
        assert!(
            gate.queued_now(&mut gate.lock().queue, crate::now_ns(), u64::MAX)
                .is_some(),
            "a turn's wait is learnt from"
        );
    }

    /// A fail-open spell (the scheduler left a probe unanswered past the bound): the fast path
    /// admits without a turn, but fences are recorded from the spell's first launch and a
    /// pacing wait still holds the next launch. Without a scheduler at all, nothing is paced,
    /// and limits that apply again after that start the pacing from an empty queue.
    #[test]
    fn a_fail_open_spell_is_paced_and_no_scheduler_is_not() {
        let (gate, asked) = asking();
        gate.next_pace.store(u64::MAX, Ordering::Relaxed);
        // A launcher waits for the turn; the scheduler (none here) leaves its probe unanswered.
        let a = gate.enter(None, 1).expect("ungated: admitted");
        assert!(
            crate::now_ns() >= asked + LIVENESS,
            "ungated within the bound, not before"
        );
        assert!(a.fence, "the spell's first launch is fenced");
        gate.leave(a, None);
        assert!(gate.fences_apply(&gate.lock(), 1), "a budget applies");
        let a = gate
            .try_enter(0, 1)
            .expect("no turn gate: the fast path admits");
        gate.leave(a, None);
        gate.pace_due.store(true, Ordering::Relaxed);
        assert!(gate.try_enter(0, 1).is_none(), "a pacing wait is due");
        gate.wait_for_queue();
        let a = gate.try_enter(0, 1).expect("the wait is over");
        gate.leave(a, None);

        // The connection closes: no scheduler, no limits, no pacing.
        gate.on_disconnected();
        gate.set_unthrottled();
        assert!(!gate.fences_apply(&gate.lock(), 4));
        assert_eq!(gate.next_pace.load(Ordering::Relaxed), u64::MAX);
        let a = gate.try_enter(0, 1).expect("unthrottled");
        assert!(!a.fence);
        gate.leave(a, None);
        // Connected again: the pacing starts afresh at the next turn's first launch.
        gate.on_connected(LIVENESS);
        assert_eq!(gate.next_pace.load(Ordering::Relaxed), 1);
        assert!(gate.try_enter(0, 1).is_none(), "no turn: the slow path");
    }

    #[test]
    fn a_deadline_already_past_stops_admission_at_once() {
        let gate = holding(7);
        let a = gate.try_enter(0, 1).expect("open");
        gate.leave(a, None);
        gate.on_deadline(8, 1);
        let a = gate
            .try_enter(0, 1)
            .expect("another turn's deadline changes nothing");
        gate.leave(a, None);
        gate.on_revoke(7);
        assert!(
            gate.try_enter(0, 1).is_none(),
            "revoked: the next launch takes the slow path"
        );
    }

    /// The fast path admits launches while the turn is open and numbers each (a graph's
    /// kernels count as launches), marks its call returned, and sends a launch to the slow path
    /// without a turn or once the turn was given back. Its cost is measured end to end by
    /// `gpushare-bench` (launch overhead), not here.
    #[test]
    fn fast_path_admits_while_the_turn_is_open() {
        let closed = Gate::new([0; 16], CFG, LIVENESS, 10_000_000, port());
        assert!(closed.try_enter(0, 1).is_none(), "no turn: slow path");
        let gate = holding(1);
        gate.next_pace.store(u64::MAX, Ordering::Relaxed);
        let n = 100_000u64;
        for _ in 0..n {
            let a = gate.try_enter(0, 1).expect("open");
            gate.leave(a, None);
        }
        let graph = gate.try_enter(0, 3).expect("open");
        assert_eq!((graph.first, graph.last), (n + 1, n + 3));
        assert!(
            !gate.activity(&mut gate.lock()).quiet,
            "a graph launch in the driver"
        );
        gate.leave(graph, None);
        assert_eq!(gate.launches.load(Ordering::Relaxed), n + 3);
        assert!(gate.activity(&mut gate.lock()).quiet, "every call returned");
        gate.deadline.store(0, Ordering::Release);
        assert!(gate.try_enter(0, 1).is_none(), "given back: slow path");
    }

    /// A close waits for the launch calls admitted before the gate closed, and only for them;
    /// an admission that finds the gate closed under it is withdrawn (no launch, nothing to
    /// wait for).
    #[test]
    fn a_close_waits_for_the_calls_admitted_before_it() {
        let gate = holding(1);
        gate.next_pace.store(u64::MAX, Ordering::Relaxed);
        let inside = gate.try_enter(0, 1).expect("open");
        let mut g = gate.lock();
        assert!(!gate.all_returned(&mut g, gate.launches.load(Ordering::SeqCst)));
        gate.leave(inside, None);
        assert!(gate.all_returned(&mut g, 1));
        // Admitted as the gate closes: counted, then withdrawn.
        let late = gate.launches.fetch_add(1, Ordering::SeqCst) + 1;
        let a = gate.admitted(late, 1, 0);
        assert!(!gate.all_returned(&mut g, late));
        gate.launch_streams.withdrawn(a.first, a.last);
        assert!(gate.all_returned(&mut g, late));
    }
}
