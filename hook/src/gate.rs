//! The token gate of one GPU in this process.
//!
//! Fast path ([`Gate::enter`]): check that no pacing wait is due, count the launch as in
//! progress and check that a token is held (no clock read: the watcher takes the token away at
//! its deadline); on return ([`Gate::leave`]) count it and note its stream (for
//! [`crate::queue`]). Everything else happens on the slow path under a mutex:
//! - waiting for a grant;
//! - pacing: every K launches (half the queue budget, an eighth of the quota, of estimated GPU
//!   work) a fence event is recorded on the launching stream; while more than half the budget
//!   is queued, the next launch waits for the oldest fence before it is submitted, so with the
//!   next K launches the queue stays within the budget — what the next holder's first kernels
//!   wait behind. (Waiting before a launch, not in the one just submitted, leaves an
//!   application free to record its own events right after each launch.) The GPU time
//!   per launch is learned from the fences' completions ([`crate::queue`]), so K adapts: many
//!   tiny kernels pay for one fence per batch, long kernels are paced one by one;
//! - draining at expiry or when idle: stop admitting, wait for in-progress launches, synchronise
//!   every context used, and report grant → drained as the time this process held the GPU;
//!   the token is handed over when about a handoff lead of work is left (its tail estimated,
//!   settled later), and already when the application synchronises so close to the deadline
//!   that its turn is over once that work drains, or went idle after one of its last 8
//!   synchronisations.

use crate::client::Hook;
use crate::log::debug;
use crate::queue::{LaunchStreams, Queue};
use crate::real;
use gpushare_protocol::ClientMsg;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

type P = *mut c_void;

/// The idle-after-synchronisation score just after idleness, and the score above which the
/// next synchronisation is expected to be followed by idleness too (1000 · 0.85⁸ ≈ 272 > 250).
const IDLE: u32 = 1000;
const IDLE_RECENTLY: u32 = 250;

/// Deadline meaning "no limits" (fail-open).
const UNLIMITED: u64 = u64::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token {
    None,
    Requested,
    Held {
        token: u64,
        granted_ns: u64,
        quota_ns: u64,
    },
    Unthrottled,
    /// The scheduler refused this process (e.g. no group matches it): launches fail.
    Refused,
}

struct Inner {
    token: Token,
    queue: Queue,
    /// The contexts launched into (synchronised at a drain).
    ctxs: Vec<P>,
    /// The launch count the watcher last saw, and when it saw it change.
    seen_launches: u64,
    seen_at: u64,
    /// The latest launch that was paced (fenced), and when it returned.
    paced_launch: u64,
    paced_at: u64,
}

// SAFETY: the raw pointers are driver handles (contexts), usable from any thread.
unsafe impl Send for Inner {}

pub struct Gate {
    pub uuid: [u8; 16],
    /// Absolute CLOCK_MONOTONIC deadline of the held token; 0 when none (or being given back).
    /// Launches are admitted while it is non-zero: the watcher wakes at the deadline and clears
    /// it as it drains.
    deadline: AtomicU64,
    /// Launches between admission and return from the driver.
    in_progress: AtomicU32,
    /// The scheduler extended the held token: nobody else wants the GPU, so the watcher need
    /// not look for idleness until the deadline (whoever asks ends the extension, and the new
    /// deadline says so).
    alone: AtomicBool,
    /// Launchers waiting in `wait_for_queue` for their queued work: busy, not idle.
    pacing: AtomicU32,
    /// The last fence found more than half the queue budget queued: the next launch waits
    /// (takes the slow path) until it is not.
    pace_due: AtomicBool,
    /// A drain holds the lock (until this process's work has drained).
    draining: AtomicBool,
    /// When the application last began to synchronise (0: never), and when that returned; with
    /// the launch count at each, which says exactly whether anything was launched since.
    synced_at: AtomicU64,
    sync_returned_at: AtomicU64,
    launches_at_sync: AtomicU64,
    launches_at_sync_return: AtomicU64,
    /// It went idle after that synchronisation (no launch for the idle release time).
    idled_after_sync: AtomicBool,
    /// Whether the application went idle after a recent synchronisation rather than launching
    /// again (a request-serving or bursty process, whose token is best handed over as its
    /// synchronised work drains): 1000 after one that was followed by idleness, 15 % less after
    /// each followed by more launches; above [`IDLE_RECENTLY`] for the next 8.
    idle_after_sync_score: AtomicU32,
    launches: AtomicU64,
    /// The stream of each recent launch (what a completed fence vouches for).
    launch_streams: LaunchStreams,
    next_pace: AtomicU64,
    inner: Mutex<Inner>,
    changed: Condvar,
}

impl Gate {
    pub fn new(uuid: [u8; 16]) -> Gate {
        Gate {
            uuid,
            deadline: AtomicU64::new(0),
            in_progress: AtomicU32::new(0),
            alone: AtomicBool::new(false),
            pacing: AtomicU32::new(0),
            pace_due: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            synced_at: AtomicU64::new(0),
            sync_returned_at: AtomicU64::new(0),
            launches_at_sync: AtomicU64::new(0),
            launches_at_sync_return: AtomicU64::new(0),
            idled_after_sync: AtomicBool::new(false),
            idle_after_sync_score: AtomicU32::new(0),
            launches: AtomicU64::new(0),
            launch_streams: LaunchStreams::new(),
            next_pace: AtomicU64::new(1),
            inner: Mutex::new(Inner {
                token: Token::None,
                queue: Queue::default(),
                ctxs: Vec::new(),
                seen_launches: 0,
                seen_at: 0,
                paced_launch: 0,
                paced_at: 0,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admit one launch (returns once this process may use the GPU); pair with [`Gate::leave`].
    /// `false`: the scheduler refused this process, and the launch must not run.
    #[inline]
    pub fn enter(&self, hook: &Hook) -> bool {
        self.try_enter() || self.enter_slow(hook)
    }

    /// The fast path: admitted while a token is held (or none is needed) and no pacing wait is
    /// due. The deadline is enforced by the watcher, which sleeps until it: a clock read per
    /// launch cost more than everything else here.
    #[inline]
    fn try_enter(&self) -> bool {
        if self.pace_due.load(Ordering::Relaxed) {
            return false;
        }
        // SeqCst with the drain's store and load: either the drain sees this launch in progress
        // or this launch sees the token gone (free on x86: the increment is a locked one).
        self.in_progress.fetch_add(1, Ordering::SeqCst);
        if self.deadline.load(Ordering::SeqCst) != 0 {
            return true;
        }
        self.in_progress.fetch_sub(1, Ordering::AcqRel);
        false
    }

    /// The launch returned; every K launches, record a fence on `stream`.
    #[inline]
    pub fn leave(&self, stream: Option<(P, bool)>) {
        let n = self.launches.fetch_add(1, Ordering::Relaxed) + 1;
        // Before the launch stops counting as in progress: a drain, which waits for that, knows
        // the stream of every launch.
        let key = self.launch_streams.record(n, stream);
        self.in_progress.fetch_sub(1, Ordering::AcqRel);
        if n >= self.next_pace.load(Ordering::Relaxed)
            && let Some((stream, per_thread)) = stream
        {
            self.fence(stream, per_thread, key, n);
        }
    }

    /// A graph launch returned: [`Gate::leave`], counting it as `launches` launches (the graph's
    /// kernels), so that the GPU time per launch the fences measure stays that of one kernel
    /// whether kernels come one by one or in graphs.
    pub fn leave_graph(&self, stream: Option<(P, bool)>, launches: u64) {
        let extra = launches.saturating_sub(1);
        let first = self.launches.fetch_add(extra, Ordering::Relaxed) + 1;
        for n in first..first + extra {
            self.launch_streams.record(n, stream);
        }
        self.leave(stream);
    }

    fn enter_slow(&self, hook: &Hook) -> bool {
        if self.pace_due.load(Ordering::Relaxed) {
            self.wait_for_queue();
        }
        let mut g = self.lock();
        // The first launch since a synchronisation that handed the token over: was the
        // application idle in between (see `before_sync`)?
        let returned = self.sync_returned_at.load(Ordering::Relaxed);
        if g.token == Token::None
            && returned != 0
            && self.launches.load(Ordering::Relaxed)
                == self.launches_at_sync_return.load(Ordering::Relaxed)
            && crate::now_ns() >= returned + hook.settings.idle_release_ns
        {
            self.idled_after_sync.store(true, Ordering::Relaxed);
        }
        loop {
            match g.token {
                Token::Refused => return false,
                Token::Unthrottled => break,
                Token::Held { .. } => {
                    let d = self.deadline.load(Ordering::Acquire);
                    if d != 0 && crate::now_ns() < d {
                        break;
                    }
                    // This launch wants the GPU again: queue for it in the same breath, so the
                    // scheduler weighs this process against the others for the next turn.
                    self.drain_and_release(hook, &mut g, true);
                }
                Token::None => {
                    if hook.send(&ClientMsg::Acquire { gpu: self.uuid }) {
                        g.token = Token::Requested;
                    } else {
                        g = self
                            .changed
                            .wait_timeout(g, Duration::from_millis(100))
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                }
                Token::Requested => {
                    g = self
                        .changed
                        .wait_timeout(g, Duration::from_millis(100))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
        self.in_progress.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// The token, held from `start_ns` (when the previous holder's queued work drains).
    pub fn on_grant(
        &self,
        hook: &Hook,
        token: u64,
        start_ns: u64,
        deadline_ns: u64,
        quota_ns: u64,
    ) {
        let mut g = self.lock();
        if g.token != Token::Requested {
            // Nobody here wants it (any more): hand it straight back.
            hook.send(&ClientMsg::Release {
                gpu: self.uuid,
                token,
                used_ns: 0,
            });
            return;
        }
        g.token = Token::Held {
            token,
            granted_ns: crate::now_ns().max(start_ns),
            quota_ns,
        };
        self.alone.store(false, Ordering::Relaxed);
        self.deadline.store(deadline_ns.max(1), Ordering::Release);
        self.changed.notify_all();
    }

    /// The token overran: stop admitting at once; the next launch or the watcher drains it.
    pub fn on_revoke(&self, token: u64) {
        self.on_deadline(token, 1);
    }

    /// The token now ends at `deadline_ns`, unless it is being given back already (a drain
    /// clears the deadline under the lock). One already past (a revocation, a turn cut short to
    /// now) stops admission at once: the next launch drains, without waiting for the watcher.
    pub fn on_deadline(&self, token: u64, deadline_ns: u64) {
        let g = self.lock();
        let current = self.deadline.load(Ordering::Acquire);
        if matches!(g.token, Token::Held { token: t, .. } if t == token) && current != 0 {
            self.alone.store(deadline_ns > current, Ordering::Relaxed);
            let ended = deadline_ns <= crate::now_ns();
            self.deadline
                .store(if ended { 0 } else { deadline_ns }, Ordering::Release);
        }
    }

    pub fn on_connected(&self) {
        let mut g = self.lock();
        if g.token == Token::Unthrottled {
            g.token = Token::None;
            self.deadline.store(0, Ordering::Release);
            self.next_pace.store(1, Ordering::Relaxed);
        }
        self.changed.notify_all();
    }

    /// The scheduler is gone (it released our token when the socket closed).
    pub fn on_disconnected(&self) {
        let mut g = self.lock();
        if !matches!(g.token, Token::Unthrottled | Token::Refused) {
            g.token = Token::None;
            self.deadline.store(0, Ordering::Release);
        }
        self.changed.notify_all();
    }

    pub fn set_refused(&self) {
        let mut g = self.lock();
        g.token = Token::Refused;
        self.deadline.store(0, Ordering::Release);
        self.changed.notify_all();
    }

    pub fn set_unthrottled(&self) {
        let mut g = self.lock();
        g.token = Token::Unthrottled;
        self.deadline.store(UNLIMITED, Ordering::Release);
        self.changed.notify_all();
    }

    /// Watcher duty: release a token that expired or whose holder launched nothing for
    /// `idle_ns`. Returns when to look again (`None`: no token held, nothing to watch).
    pub fn watch(&self, hook: &Hook, idle_ns: u64) -> Option<u64> {
        let mut g = self.lock();
        let Token::Held { granted_ns, .. } = g.token else {
            return None;
        };
        // The clock is read under the lock: a launcher pacing may have held it a while.
        let now = crate::now_ns();
        let deadline = self.deadline.load(Ordering::Acquire);
        let (last, synced_last) = self.last_active(&mut g, now);
        let idle_since = last.max(granted_ns).saturating_add(idle_ns);
        let quiet = self.in_progress.load(Ordering::Acquire) == 0
            && self.pacing.load(Ordering::Acquire) == 0;
        if self.alone.load(Ordering::Relaxed) && now < deadline {
            return Some(deadline);
        }
        let idle = quiet && now >= idle_since;
        if now >= deadline || idle {
            // Given back for idleness (not at the deadline) with nothing launched since the
            // application synchronised: it went idle after synchronising.
            if now < deadline && synced_last {
                self.idled_after_sync.store(true, Ordering::Relaxed);
            }
            // At the deadline, an application that is not idle wants the next turn too.
            self.drain_and_release(hook, &mut g, !idle);
            return None;
        }
        Some(if quiet { idle_since } else { now + idle_ns }.min(deadline))
    }

    /// When the application last launched or began to synchronise (the fast path takes no
    /// timestamp), and whether that was a synchronisation: exactly, when it began one with
    /// nothing launched since (later than any launch: a paced one may be a whole queue budget
    /// earlier), or when the last launch was paced; else when the watcher, looking at `now`, saw
    /// the launch count move (a look late at most). Waiting in a synchronisation counts towards
    /// idleness: the work it waits for drains as the token is handed over (`drain_and_release`).
    fn last_active(&self, g: &mut Inner, now: u64) -> (u64, bool) {
        let count = self.launches.load(Ordering::Relaxed);
        if count != g.seen_launches {
            g.seen_launches = count;
            g.seen_at = now;
        }
        let synced = self.synced_at.load(Ordering::Relaxed);
        if synced != 0 && count == self.launches_at_sync.load(Ordering::Relaxed) {
            (synced, true)
        } else if g.paced_launch == count {
            (g.paced_at, false)
        } else {
            (g.seen_at, false)
        }
    }

    /// Stop admitting, let in-progress launches return, wait for this process's GPU work, and
    /// give the token back with the time it was held. With `again`, ask for the next turn first
    /// (the scheduler then chooses among all who want the GPU, this process included).
    fn drain_and_release(&self, hook: &Hook, g: &mut Inner, again: bool) {
        let Token::Held {
            token, granted_ns, ..
        } = g.token
        else {
            return;
        };
        self.deadline.store(0, Ordering::SeqCst);
        self.draining.store(true, Ordering::Release);
        while self.in_progress.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        // Hand over early: wait only until the work still queued is about one handoff
        // (`GPUSHARE_HANDOFF_LEAD`), so the next holder's first kernels reach the GPU as ours
        // finish instead of after an idle round trip; that tail is charged as estimated.
        let estimate = self
            .queued_estimate(g, hook.settings.handoff_lead_ns)
            .map(|tail| crate::now_ns().saturating_sub(granted_ns) + tail);
        if let Some(used_ns) = estimate {
            self.give_back(hook, g, token, used_ns, again);
        }
        // Draining also restarts the pacing from an empty queue, so that no fence spacing
        // spans another holder's turn.
        for &ctx in &g.ctxs {
            sync_context(ctx);
        }
        g.queue
            .drained(&self.launch_streams, self.launches.load(Ordering::Relaxed));
        self.pace_due.store(false, Ordering::Relaxed);
        let used_ns = crate::now_ns().saturating_sub(granted_ns);
        match estimate {
            None => self.give_back(hook, g, token, used_ns, again),
            // The tail took longer than estimated: settle the charge, so the estimate never
            // lets a group run past its share or its cap.
            Some(est) if used_ns > est => {
                hook.send(&ClientMsg::Settle {
                    gpu: self.uuid,
                    token,
                    used_ns,
                });
            }
            Some(_) => {}
        }
        self.draining.store(false, Ordering::Release);
    }

    /// Wait until the GPU work still queued is estimated at `lead_ns` or less; that estimate,
    /// or `None` when it cannot be made (see [`Queue::queued_ns`]; or the estimate would not run
    /// down; or a fence the driver would not wait for). Between fences it sleeps to the moment
    /// the estimate reaches the lead, so the handover does not jump by whole kernels. On several
    /// streams, up to half a lead of work launched after the streams' newest fences is
    /// tolerated in the estimate.
    fn queued_estimate(&self, g: &mut Inner, lead_ns: u64) -> Option<u64> {
        if lead_ns == 0 {
            return None;
        }
        g.queue
            .scan(&self.launch_streams, self.launches.load(Ordering::Relaxed));
        loop {
            // Fences on other streams may have completed before the oldest: take them in too,
            // so that the GPU time per launch counts their launches with the time they took.
            g.queue
                .complete_finished(self.launches.load(Ordering::Relaxed));
            let now = crate::now_ns();
            let (tail, runs_down) = g.queue.queued_ns(now, lead_ns / 2)?;
            if tail <= lead_ns {
                return Some(tail);
            }
            if !runs_down {
                return None;
            }
            // When the oldest fence completes, relative to the moment the tail reaches the lead
            // (none pending: the estimate runs down from the last completion).
            let fence_in = g.queue.oldest_fence_in(tail).unwrap_or(f64::INFINITY);
            if fence_in <= (tail - lead_ns) as f64 {
                if !g
                    .queue
                    .complete_oldest(self.launches.load(Ordering::Relaxed))
                {
                    return None;
                }
            } else {
                std::thread::sleep(Duration::from_nanos(tail - lead_ns));
            }
        }
    }

    /// The application is about to wait for its GPU work. The turn is over in all but name when
    /// the token ends before that work has drained plus a handoff lead, or when this
    /// application went idle after one of its last 8 synchronisations (a missed idle costs the
    /// GPU an idle release, a needless handover only the rest of this turn: a request server
    /// whose next requests queued up for a while still hands over after the one that empties
    /// its queue): then hand over as the work drains, as at expiry, rather than leave the next
    /// holder an idle GPU for a round trip after it (or after the idle release). Skipped while
    /// another thread is launching or the gate is busy.
    pub fn before_sync(&self, hook: &Hook) {
        // Going idle next matters only to someone waiting (not while the token is extended).
        let idle_next =
            self.learn_after_sync() > IDLE_RECENTLY && !self.alone.load(Ordering::Relaxed);
        let deadline = self.deadline.load(Ordering::Acquire);
        if deadline == 0
            || deadline == UNLIMITED
            || self.in_progress.load(Ordering::Acquire) != 0
            || self.pacing.load(Ordering::Acquire) != 0
        {
            return;
        }
        let Ok(mut g) = self.inner.try_lock() else {
            return;
        };
        if !matches!(g.token, Token::Held { .. }) {
            return;
        }
        let launched = self.launches.load(Ordering::Relaxed);
        g.queue.complete_finished(launched);
        g.queue.scan(&self.launch_streams, launched);
        let now = crate::now_ns();
        let lead_ns = hook.settings.handoff_lead_ns;
        let Some((tail, _)) = g.queue.queued_ns(now, lead_ns / 2) else {
            return;
        };
        if idle_next || now + tail + lead_ns >= deadline {
            self.drain_and_release(hook, &mut g, false);
        }
    }

    /// A synchronisation returned.
    pub fn after_sync(&self) {
        self.launches_at_sync_return
            .store(self.launches.load(Ordering::Relaxed), Ordering::Relaxed);
        self.sync_returned_at
            .store(crate::now_ns(), Ordering::Relaxed);
    }

    /// Fold what followed the previous synchronisation (idleness, or more launches) into the
    /// score, and return it.
    fn learn_after_sync(&self) -> u32 {
        let score = self.idle_after_sync_score.load(Ordering::Relaxed);
        let synced = self.synced_at.load(Ordering::Relaxed);
        let outcome = if synced == 0 {
            None
        } else if self.idled_after_sync.load(Ordering::Relaxed) {
            Some(IDLE)
        } else if self.launches.load(Ordering::Relaxed)
            > self.launches_at_sync.load(Ordering::Relaxed)
        {
            Some(0)
        } else {
            None // synchronised twice in a row
        };
        self.idled_after_sync.store(false, Ordering::Relaxed);
        self.launches_at_sync
            .store(self.launches.load(Ordering::Relaxed), Ordering::Relaxed);
        self.synced_at.store(crate::now_ns(), Ordering::Relaxed);
        let Some(outcome) = outcome else {
            return score;
        };
        let score = if outcome == IDLE {
            IDLE
        } else {
            85 * score / 100
        };
        self.idle_after_sync_score.store(score, Ordering::Relaxed);
        score
    }

    /// Return the token (asking for the next turn first with `again`).
    fn give_back(&self, hook: &Hook, g: &mut Inner, token: u64, used_ns: u64, again: bool) {
        g.token = Token::None;
        debug!("release token {token} after {used_ns} ns");
        if again && hook.send(&ClientMsg::Acquire { gpu: self.uuid }) {
            g.token = Token::Requested;
        }
        hook.send(&ClientMsg::Release {
            gpu: self.uuid,
            token,
            used_ns,
        });
    }

    /// Record a fence after launch `n` (on `stream`, whose key is `key`); when too much work is
    /// queued, the next launch waits.
    fn fence(&self, stream: P, per_thread: bool, key: u64, n: u64) {
        // A drain holds the lock until this process's work has drained and makes a fence
        // pointless: fence the next launch instead of holding this launch call (already
        // submitted) until then.
        if self.draining.load(Ordering::Acquire) {
            self.next_pace.store(n + 1, Ordering::Relaxed);
            return;
        }
        let mut g = self.lock();
        let Some(budget) = queue_budget(&g) else {
            // Unthrottled (no scheduler): nothing to pace until it is back (`on_connected`).
            let next = if g.token == Token::Unthrottled {
                u64::MAX
            } else {
                n + 1
            };
            self.next_pace.store(next, Ordering::Relaxed);
            return;
        };
        let mut ctx: P = std::ptr::null_mut();
        // SAFETY: real driver call with a valid out-pointer.
        let Some(get_ctx) = real::cuCtxGetCurrent() else {
            return;
        };
        if unsafe { get_ctx(&mut ctx) } != 0 || ctx.is_null() {
            return;
        }
        if !g.ctxs.contains(&ctx) {
            g.ctxs.push(ctx);
        }
        let Some(event) = g.queue.take_event(ctx) else {
            return;
        };
        let record = if per_thread {
            real::cuEventRecord_ptsz()
        } else {
            real::cuEventRecord()
        };
        // SAFETY: event of the current context, recorded on the stream just launched on.
        if record.is_none_or(|r| unsafe { r(event, stream) } != 0) {
            g.queue.put_event(ctx, event);
            return;
        }
        let now = crate::now_ns();
        let est = g
            .queue
            .push_fence(&self.launch_streams, (event, ctx), key, n, now);
        (g.paced_launch, g.paced_at) = (n, now);
        let (k, wait_above) = pacing(budget, est.unwrap_or(0.0));
        if g.queue.too_much(wait_above) {
            self.pace_due.store(true, Ordering::Relaxed);
        }
        self.next_pace.store(n + k, Ordering::Relaxed);
    }

    /// Before a launch, after a fence found too much work queued: wait for the oldest fences
    /// until it is not (or a drain empties the queue).
    fn wait_for_queue(&self) {
        let mut g = self.lock();
        while let Some(budget) = queue_budget(&g)
            && !self.draining.load(Ordering::Acquire)
        {
            g.queue
                .scan(&self.launch_streams, self.launches.load(Ordering::Relaxed));
            if !g.queue.too_much(pacing(budget, 0.0).1) {
                break;
            }
            // Wait without the lock, so grants, cut-short tokens and the watcher are not held
            // up by a launcher waiting for its GPU work.
            let event = g.queue.oldest_event().expect("two fences");
            self.pacing.fetch_add(1, Ordering::AcqRel);
            drop(g);
            // SAFETY: a fence event recorded by `fence` (if a drain recycled it meanwhile, this
            // waits for its new record: longer, never wrong).
            let waited = real::cuEventSynchronize().is_some_and(|s| unsafe { s(event) } == 0);
            g = self.lock();
            self.pacing.fetch_sub(1, Ordering::AcqRel);
            // Completed now (unless a drain or another launcher took it meanwhile, or a drain
            // recycled the event into a newer fence: then this waits under the lock).
            if !waited
                || g.queue.oldest_event() == Some(event)
                    && !g
                        .queue
                        .complete_oldest(self.launches.load(Ordering::Relaxed))
            {
                break;
            }
        }
        self.pace_due.store(false, Ordering::Relaxed);
    }
}

/// The queue budget of the token held (an eighth of its quota, at least 0.1 ms), if one is.
fn queue_budget(g: &Inner) -> Option<f64> {
    match g.token {
        Token::Held { quota_ns, .. } => Some((quota_ns / 8).max(100_000) as f64),
        _ => None,
    }
}

/// For a queue budget and the GPU time per launch: launches between fences (K, half the budget
/// of work, 1 to 4096), and the queued work above which a launcher waits for its oldest fence
/// (half the budget, so that K more launches keep the queue within the budget).
fn pacing(budget_ns: f64, est_ns: f64) -> (u64, f64) {
    let k = if est_ns > 0.0 {
        (budget_ns / (2.0 * est_ns)).clamp(1.0, 4096.0) as u64
    } else {
        1
    };
    (k, budget_ns / 2.0)
}

/// Wait for all work of `ctx`, from whatever thread we are on.
fn sync_context(ctx: P) {
    let (Some(push), Some(sync), Some(pop)) = (
        real::cuCtxPushCurrent_v2(),
        real::cuCtxSynchronize(),
        real::cuCtxPopCurrent_v2(),
    ) else {
        return;
    };
    let mut popped: P = std::ptr::null_mut();
    // SAFETY: push/pop are balanced; `ctx` is a context this process launched into.
    unsafe {
        if push(ctx) == 0 {
            sync();
            pop(&mut popped);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gate holding `token` for an hour.
    fn holding(token: u64) -> Gate {
        let gate = Gate::new([0; 16]);
        gate.lock().token = Token::Held {
            token,
            granted_ns: crate::now_ns(),
            quota_ns: 20_000_000,
        };
        gate.deadline
            .store(crate::now_ns() + 3_600_000_000_000, Ordering::Release);
        gate
    }

    /// Idleness counts from the start of a synchronisation with nothing launched since, not from
    /// the last paced launch before it (up to a queue budget earlier): a training loop is not
    /// idle the moment the work it synchronises on drains.
    #[test]
    fn idleness_counts_from_a_synchronisation_not_the_launches_before_it() {
        let gate = holding(7);
        let mut g = gate.lock();
        gate.launches.store(20, Ordering::Relaxed);
        (g.paced_launch, g.paced_at) = (20, 1_000);
        assert_eq!(gate.last_active(&mut g, 9_000), (1_000, false));
        gate.synced_at.store(3_000, Ordering::Relaxed);
        gate.launches_at_sync.store(20, Ordering::Relaxed);
        assert_eq!(gate.last_active(&mut g, 9_000), (3_000, true));
        gate.launches.store(21, Ordering::Relaxed);
        assert_eq!(
            gate.last_active(&mut g, 9_000),
            (9_000, false),
            "an unpaced launch since: when the watcher saw it"
        );
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

    /// A fence that finds more than half the queue budget queued makes the next launch wait
    /// before it is submitted (the slow path), not the launch call just submitted; the wait is
    /// over once the queue is within the budget (here it already is).
    #[test]
    fn a_pacing_wait_holds_the_next_launch_not_the_one_submitted() {
        let gate = holding(7);
        let budget = queue_budget(&gate.lock()).expect("token held");
        assert_eq!(budget, 2_500_000.0, "an eighth of the 20 ms quota");
        gate.pace_due.store(true, Ordering::Relaxed);
        assert!(!gate.try_enter(), "a wait is due: the slow path");
        assert_eq!(gate.in_progress.load(Ordering::Relaxed), 0);
        gate.wait_for_queue();
        assert!(gate.try_enter(), "the wait is over");
        gate.leave(None);
    }

    #[test]
    fn a_deadline_already_past_stops_admission_at_once() {
        let gate = holding(7);
        assert!(gate.try_enter());
        gate.leave(None);
        gate.on_deadline(8, 1);
        assert!(gate.try_enter(), "another token's deadline changes nothing");
        gate.leave(None);
        gate.on_revoke(7);
        assert!(
            !gate.try_enter(),
            "revoked: the next launch takes the slow path"
        );
    }

    #[test]
    fn pacing_keeps_the_queue_within_the_budget() {
        let budget = 2_500_000.0;
        for est in [
            10.0,
            1_000.0,
            100_000.0,
            400_000.0,
            1_000_000.0,
            1_250_000.0,
        ] {
            let (k, wait_above) = pacing(budget, est);
            // The most a launcher leaves queued when it stops waiting, plus K more launches.
            let most = (wait_above / est).floor() + k as f64;
            assert!(
                most * est <= budget,
                "{est} ns per launch: K {k}, up to {} ns queued",
                most * est
            );
            assert!(
                k == 4096 || k as f64 * est >= budget / 2.0 - est,
                "K {k} too small"
            );
        }
    }

    /// Idle after a synchronisation raises the score, launching again right away lowers it.
    #[test]
    fn going_idle_after_synchronising_is_learnt() {
        let gate = Gate::new([0; 16]);
        assert_eq!(gate.learn_after_sync(), 0, "no synchronisation before");
        gate.idled_after_sync.store(true, Ordering::Relaxed);
        assert_eq!(gate.learn_after_sync(), IDLE);
        // A synchronisation right after another teaches nothing.
        assert_eq!(gate.learn_after_sync(), IDLE);
        // Launched again after each of the next ones: still expected idle for 8 of them (a
        // request server working through a queue), not after the 9th.
        let mut scores = Vec::new();
        for _ in 0..9 {
            gate.launches.fetch_add(1, Ordering::Relaxed);
            scores.push(gate.learn_after_sync());
        }
        assert!(scores[..8].iter().all(|&s| s > IDLE_RECENTLY), "{scores:?}");
        assert!(scores[8] <= IDLE_RECENTLY, "{scores:?}");
        gate.idled_after_sync.store(true, Ordering::Relaxed);
        assert_eq!(gate.learn_after_sync(), IDLE, "one idle is enough again");
    }

    /// The fast path's cost, printed: an in-progress count and a deadline load, and on return
    /// a launch count. (The figure for the whole hook is measured end to end
    /// against the bare simulator by the isolation tests and the benchmark.)
    #[test]
    fn fast_path_admits_while_the_token_is_held_and_costs_little() {
        assert!(!Gate::new([0; 16]).try_enter(), "no token: slow path");
        let gate = holding(1);
        gate.next_pace.store(u64::MAX, Ordering::Relaxed);
        let n = 2_000_000u64;
        let t0 = crate::now_ns();
        for _ in 0..n {
            assert!(gate.try_enter());
            gate.leave(None);
        }
        let ns = (crate::now_ns() - t0) as f64 / n as f64;
        eprintln!("hook fast path: {ns:.1} ns per launch (enter + leave)");
        assert_eq!(gate.launches.load(Ordering::Relaxed), n);
        assert_eq!(gate.in_progress.load(Ordering::Relaxed), 0);
        gate.deadline.store(0, Ordering::Release);
        assert!(!gate.try_enter(), "given back: slow path");
        assert!(ns < 2_000.0, "{ns} ns per launch");
    }
}
