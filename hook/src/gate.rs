//! The turn gate of one GPU in this process.
//!
//! Fast path ([`Gate::enter`]): check that no pacing wait is due, count the launch as in
//! progress and check that the turn is open (no clock read: the watcher closes it near its
//! deadline); on return ([`Gate::leave`]) count it and note its stream (for [`crate::queue`]).
//! Everything else happens on the slow path under a mutex:
//! - waiting for a turn. The scheduler grants turns ahead of their start (the turn before
//!   ends then); a launcher waits until a *lead* before the start and opens the gate, so its
//!   first kernels are queued on the GPU as the previous turn's last ones finish, without any
//!   process waking up for the handoff itself. The lead adapts to how late this process's own
//!   timed waits return (`GPUSHARE_HANDOFF_LEAD` is its least value);
//! - pacing: every K launches (half the queue budget, an eighth of the quota, of estimated GPU
//!   work) a fence event is recorded on the launching stream; while more than half the budget
//!   is queued, the next launch waits for the oldest fence before it is submitted, so with the
//!   next K launches the queue stays within the budget. (Waiting before a launch, not in the
//!   one just submitted, leaves an application free to record its own events right after each
//!   launch.) The GPU time per launch is learned from the fences' completions
//!   ([`crate::queue`]), so K adapts: many tiny kernels pay for one fence per batch, long
//!   kernels are paced one by one;
//! - ending a turn: the watcher closes the gate when the work queued would run to the deadline,
//!   lets in-progress launches return, waits (without the lock) for this process's work to
//!   drain, and reports the turn's first launch and the end of its last kernel; the next turn
//!   was planned by the scheduler long before. A turn whose holder goes idle (no launch for
//!   `GPUSHARE_IDLE_RELEASE`, or a synchronisation after which it went idle the last times) is
//!   given back early (yielded), as its work drains.

use crate::client::Hook;
use crate::log::debug;
use crate::queue::{LaunchStreams, Queue};
use crate::real;
use gpushare_protocol::{ClientMsg, TurnUse};
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

/// A turn granted by the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Turn {
    token: u64,
    start_ns: u64,
    deadline_ns: u64,
    quota_ns: u64,
    /// When the gate opened for it (its first launch), if it has.
    opened_ns: Option<u64>,
    /// The gate closed for it: its work drains and is reported.
    closed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token {
    None,
    /// Asked for a turn, or still launching as a turn ended (the scheduler then counts this
    /// process as waiting for another).
    Requested,
    Held(Turn),
    Unthrottled,
    /// The scheduler refused this process (e.g. no group matches it): launches fail.
    Refused,
}

/// How many recent lateness samples of timed waits set the lead.
const LATENESS_SAMPLES: usize = 16;
/// The lead never exceeds this: turns are granted 5 ms ahead by default.
const MAX_LEAD_NS: u64 = 3_000_000;

struct Inner {
    token: Token,
    /// A further turn granted while `token` still holds one (it starts after that one ends).
    next: Option<Turn>,
    /// 100 ms waits for a grant since the last request.
    requests_unanswered: u32,
    /// How late recent timed waits for a turn's opening returned (ns), in a ring.
    lateness: [u64; LATENESS_SAMPLES],
    lateness_at: usize,
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
    /// Absolute CLOCK_MONOTONIC deadline of the open turn; 0 while the gate is closed.
    /// Launches are admitted while it is non-zero: the watcher clears it near the deadline.
    deadline: AtomicU64,
    /// Launches between admission and return from the driver.
    in_progress: AtomicU32,
    /// The scheduler extended the turn: nobody else wants the GPU, so the watcher need not look
    /// for idleness until the deadline (whoever asks ends the extension, and the new deadline
    /// says so).
    alone: AtomicBool,
    /// Launchers waiting in `wait_for_queue` for their queued work: busy, not idle.
    pacing: AtomicU32,
    /// Launchers waiting for a turn: this process has work.
    waiters: AtomicU32,
    /// The last fence found more than half the queue budget queued: the next launch waits
    /// (takes the slow path) until it is not.
    pace_due: AtomicBool,
    /// A turn's work drains (the gate is closed for it).
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
            waiters: AtomicU32::new(0),
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
                next: None,
                requests_unanswered: 0,
                lateness: [0; LATENESS_SAMPLES],
                lateness_at: 0,
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
        // The first launch since a synchronisation that gave the turn back: was the
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
        self.waiters.fetch_add(1, Ordering::AcqRel);
        // When this launcher last waited for a turn's opening (to learn how late it woke).
        let mut waited_for: Option<u64> = None;
        let admitted = loop {
            match g.token {
                Token::Refused => break false,
                Token::Unthrottled => break true,
                Token::Held(turn) if !turn.closed => {
                    if self.deadline.load(Ordering::Acquire) != 0 {
                        break true;
                    }
                    let now = crate::now_ns();
                    let open_at = turn.start_ns.saturating_sub(lead_ns(&g, hook));
                    if now >= open_at {
                        if let Some(at) = waited_for {
                            note_lateness(&mut g, now.saturating_sub(at));
                        }
                        self.open(&mut g, now);
                        hook.wake_watcher();
                        break true;
                    }
                    waited_for = Some(open_at);
                    g = self.wait(g, Duration::from_nanos(open_at - now));
                }
                Token::None => {
                    if hook.send(&ClientMsg::Acquire { gpu: self.uuid }) {
                        g.token = Token::Requested;
                    } else {
                        g = self.wait(g, Duration::from_millis(100));
                    }
                }
                // Waiting for a grant, or for the last turn's work to drain. (Asked long ago and
                // still nothing: ask again — the scheduler may have taken this process for a
                // stopped one.)
                Token::Requested | Token::Held(_) => {
                    waited_for = None;
                    g = self.wait(g, Duration::from_millis(100));
                    if g.token == Token::Requested {
                        g.requests_unanswered += 1;
                        if g.requests_unanswered >= 5 {
                            g.requests_unanswered = 0;
                            hook.send(&ClientMsg::Acquire { gpu: self.uuid });
                        }
                    }
                }
            }
        };
        self.waiters.fetch_sub(1, Ordering::AcqRel);
        if admitted {
            self.in_progress.fetch_add(1, Ordering::AcqRel);
        }
        admitted
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Inner>, d: Duration) -> MutexGuard<'a, Inner> {
        self.changed
            .wait_timeout(g, d)
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    /// Open the gate for the held turn (its first launch is about to be made, at `now`).
    fn open(&self, g: &mut Inner, now: u64) {
        let Token::Held(turn) = &mut g.token else {
            return;
        };
        turn.opened_ns = Some(now);
        self.alone.store(false, Ordering::Relaxed);
        // Fence the turn's first launch: its queue is known from the start.
        self.next_pace
            .store(self.launches.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        self.deadline
            .store(turn.deadline_ns.max(1), Ordering::Release);
        self.changed.notify_all();
    }

    /// A turn from `start_ns` to `deadline_ns`, usually ahead of its start; or a planned one
    /// moved earlier (same token).
    pub fn on_grant(
        &self,
        hook: &Hook,
        token: u64,
        start_ns: u64,
        deadline_ns: u64,
        quota_ns: u64,
    ) {
        let mut g = self.lock();
        let turn = Turn {
            token,
            start_ns,
            deadline_ns,
            quota_ns,
            opened_ns: None,
            closed: false,
        };
        let retime = |t: &mut Turn| {
            t.start_ns = start_ns;
            t.deadline_ns = deadline_ns;
            t.quota_ns = quota_ns;
        };
        let inner = &mut *g;
        match (&mut inner.token, &mut inner.next) {
            (Token::Held(t), _) if t.token == token => {
                retime(t);
                if t.opened_ns.is_some() && !t.closed {
                    self.deadline.store(deadline_ns.max(1), Ordering::Release);
                }
            }
            (_, Some(n)) if n.token == token => retime(n),
            (Token::Requested, _) => {
                inner.requests_unanswered = 0;
                inner.token = Token::Held(turn);
            }
            (Token::Held(_), next) => *next = Some(turn),
            // Nobody here wants it (any more), or no limits apply: give it straight back.
            (Token::None | Token::Unthrottled | Token::Refused, _) => {
                drop(g);
                self.give_back(hook, token, crate::now_ns(), None, false);
                return;
            }
        }
        self.changed.notify_all();
    }

    /// Stop launching in turn `token` at once (it ended without a report by its end + grace), or
    /// forget it if it has not started.
    pub fn on_revoke(&self, token: u64) {
        let mut g = self.lock();
        if g.next.is_some_and(|n| n.token == token) {
            g.next = None;
            return;
        }
        if let Token::Held(t) = g.token
            && t.token == token
            && t.opened_ns.is_none()
        {
            // Withdrawn (this process was taken to be stopped, say): a launcher asks again.
            g.token = g.next.take().map_or(Token::None, Token::Held);
            self.changed.notify_all();
            return;
        }
        drop(g);
        self.on_deadline(token, 1);
    }

    /// Turn `token` now ends at `deadline_ns` (earlier or later). One already past (a
    /// revocation, a turn cut short to now) closes the gate at once: the next launch waits,
    /// without waiting for the watcher.
    pub fn on_deadline(&self, token: u64, deadline_ns: u64) {
        let mut g = self.lock();
        if let Some(n) = g.next.as_mut().filter(|n| n.token == token) {
            n.deadline_ns = deadline_ns;
            return;
        }
        let Token::Held(t) = &mut g.token else {
            return;
        };
        if t.token != token || t.closed {
            return;
        }
        self.alone
            .store(deadline_ns > t.deadline_ns, Ordering::Relaxed);
        t.deadline_ns = deadline_ns;
        if t.opened_ns.is_some() {
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
            g.queue
                .drained(&self.launch_streams, self.launches.load(Ordering::Relaxed));
        }
        self.changed.notify_all();
    }

    /// The scheduler is gone (its turns with it). What the queue knew is forgotten too: the
    /// next fence's spacing from the last one would span the outage.
    pub fn on_disconnected(&self) {
        let mut g = self.lock();
        if !matches!(g.token, Token::Unthrottled | Token::Refused) {
            g.token = Token::None;
            g.next = None;
            self.deadline.store(0, Ordering::Release);
            g.queue
                .drained(&self.launch_streams, self.launches.load(Ordering::Relaxed));
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

    /// Watcher duty: close the open turn when the work queued would run to its deadline, give
    /// back one whose holder launched nothing for `idle_ns` (or that came with nothing to
    /// launch). Returns when to look again (`None`: nothing to watch).
    pub fn watch(&self, hook: &Hook, idle_ns: u64) -> Option<u64> {
        let mut g = self.lock();
        let Token::Held(turn) = g.token else {
            return None;
        };
        if turn.closed {
            return None;
        }
        // The clock is read under the lock: a launcher pacing may have held it a while.
        let now = crate::now_ns();
        let Some(opened) = turn.opened_ns else {
            // Not opened: nothing was launched since it started (and its lead) — give it back
            // once that lasts an idle release.
            let idle_at = turn.start_ns.saturating_add(idle_ns);
            if now < idle_at {
                return Some(idle_at);
            }
            if self.waiters.load(Ordering::Acquire) == 0 {
                self.close(hook, g, Some(now), false);
            }
            return None;
        };
        let deadline = self.deadline.load(Ordering::Acquire).max(1);
        let (last, synced_last) = self.last_active(&mut g, now);
        let idle_since = last.max(opened).saturating_add(idle_ns);
        let quiet = self.in_progress.load(Ordering::Acquire) == 0
            && self.pacing.load(Ordering::Acquire) == 0;
        let alone = self.alone.load(Ordering::Relaxed);
        let queued = self.queued_now(&mut g, now);
        // Idle: nothing launched for the idle release, and nothing of this process's left on
        // the GPU (a synchronisation waiting for queued work is not idleness).
        if quiet && !alone && now >= idle_since && now < deadline && queued == Some(0) {
            // Given back for idleness with nothing launched since the application
            // synchronised: it went idle after synchronising.
            if synced_last {
                self.idled_after_sync.store(true, Ordering::Relaxed);
            }
            self.close(hook, g, Some(now), false);
            return None;
        }
        // The next turn is this process's own, back to back: no handoff, the gate stays open;
        // at the deadline the turn is reported and the next one takes over.
        if let Some(n) = g.next.filter(|n| n.start_ns <= deadline) {
            if now < deadline {
                return Some(deadline);
            }
            self.roll_over(hook, g, turn, n, deadline);
            return Some(now);
        }
        // Close when the work queued would run to the deadline.
        let budget = queue_budget_of(turn.quota_ns) as u64;
        // (Pacing keeps the queue within the budget: an estimate far beyond is stale.)
        let close_at = deadline.saturating_sub(queued.unwrap_or(budget / 2).min(2 * budget));
        if now >= close_at {
            let busy = !quiet || self.waiters.load(Ordering::Acquire) > 0 || now < idle_since;
            self.close(hook, g, None, busy);
            return None;
        }
        // Look again at the latest a budget before the deadline (the queue estimate then says
        // when exactly), and for idleness: once the idle release has passed, when the work
        // queued should have drained.
        let next = if deadline - now > budget {
            deadline - budget
        } else {
            close_at
        };
        let idle_check = match (quiet, now >= idle_since) {
            (false, _) => now + idle_ns,
            (true, false) => idle_since,
            (true, true) => now + queued.unwrap_or(idle_ns).max(100_000),
        };
        Some(if alone { next } else { next.min(idle_check) })
    }

    /// The GPU work this process has queued now, as far as its fences tell.
    fn queued_now(&self, g: &mut Inner, now: u64) -> Option<u64> {
        let launched = self.launches.load(Ordering::Relaxed);
        g.queue.complete_finished(launched);
        g.queue.scan(&self.launch_streams, launched);
        // On several streams, launches after a stream's newest fence are vouched for only by a
        // later one: counted as queued (an overestimate, up to a budget), so a turn is closed
        // early rather than late.
        let tolerance = g.token_budget().unwrap_or(0.0) as u64;
        g.queue.queued_ns(now, tolerance).map(|(tail, _)| tail)
    }

    /// When the application last launched or began to synchronise (the fast path takes no
    /// timestamp), and whether that was a synchronisation: exactly, when it began one with
    /// nothing launched since (later than any launch: a paced one may be a whole queue budget
    /// earlier), or when the last launch was paced; else when the watcher, looking at `now`, saw
    /// the launch count move (a look late at most).
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

    /// Close the gate for the held turn, let in-progress launches return, wait (without the
    /// lock) for this process's GPU work to drain, and report the turn: its first launch and the
    /// end of its last kernel, and whether this process has more work (`again`, or a launcher
    /// waiting by then). `yield_at`: the turn is given back before its deadline (at that time),
    /// with when its work should drain, so the next turn starts there.
    fn close(&self, hook: &Hook, mut g: MutexGuard<'_, Inner>, yield_at: Option<u64>, again: bool) {
        let Token::Held(turn) = &mut g.token else {
            return;
        };
        turn.closed = true;
        let turn = *turn;
        self.deadline.store(0, Ordering::SeqCst);
        self.draining.store(true, Ordering::Release);
        while self.in_progress.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        if let Some(now) = yield_at {
            let drained_ns = now + self.queued_now(&mut g, now).unwrap_or(0);
            debug!("yield turn {} (drains at {drained_ns})", turn.token);
            hook.send(&ClientMsg::Yield {
                gpu: self.uuid,
                token: turn.token,
                drained_ns,
            });
        }
        let ctxs = g.ctxs.clone();
        drop(g);
        for ctx in ctxs {
            sync_context(ctx);
        }
        let last_ns = crate::now_ns();
        let mut g = self.lock();
        // Draining also restarts the pacing from an empty queue, so that no fence spacing spans
        // another holder's turn.
        g.queue
            .drained(&self.launch_streams, self.launches.load(Ordering::Relaxed));
        self.pace_due.store(false, Ordering::Relaxed);
        let again = again || self.waiters.load(Ordering::Acquire) > 0;
        g.token = match g.next.take() {
            Some(n) => Token::Held(n),
            None if again => Token::Requested,
            None => Token::None,
        };
        self.draining.store(false, Ordering::Release);
        self.changed.notify_all();
        drop(g);
        let used = turn.opened_ns.map(|first_ns| TurnUse { first_ns, last_ns });
        debug!("turn {} used {used:?}, again {again}", turn.token);
        hook.send(&ClientMsg::Report {
            gpu: self.uuid,
            token: turn.token,
            used,
            again,
        });
        hook.wake_watcher();
    }

    /// Turn `turn` ends at `at` and this process's next turn `next` starts there: report the
    /// one, open the other, without closing the gate.
    fn roll_over(
        &self,
        hook: &Hook,
        mut g: MutexGuard<'_, Inner>,
        turn: Turn,
        next: Turn,
        at: u64,
    ) {
        g.next = None;
        g.token = Token::Held(Turn {
            opened_ns: Some(at),
            ..next
        });
        self.deadline
            .store(next.deadline_ns.max(1), Ordering::Release);
        drop(g);
        hook.send(&ClientMsg::Report {
            gpu: self.uuid,
            token: turn.token,
            used: turn.opened_ns.map(|first_ns| TurnUse {
                first_ns,
                last_ns: at,
            }),
            again: true,
        });
    }

    /// Give turn `token` back unused (granted when nobody here wanted it).
    fn give_back(&self, hook: &Hook, token: u64, now: u64, used: Option<TurnUse>, again: bool) {
        hook.send(&ClientMsg::Yield {
            gpu: self.uuid,
            token,
            drained_ns: now,
        });
        hook.send(&ClientMsg::Report {
            gpu: self.uuid,
            token,
            used,
            again,
        });
    }

    /// The application is about to synchronise. If it went idle after one of its last
    /// synchronisations (a request server, a bursty job: learnt), give the turn back as the work
    /// it waits for drains, rather than leave the next holder an idle GPU until the idle
    /// release. Skipped while another thread is launching or the gate is busy.
    pub fn before_sync(&self, hook: &Hook) {
        // Going idle next matters only to someone waiting (not while the turn is extended).
        let idle_next =
            self.learn_after_sync() > IDLE_RECENTLY && !self.alone.load(Ordering::Relaxed);
        let deadline = self.deadline.load(Ordering::Acquire);
        if !idle_next
            || deadline == 0
            || deadline == UNLIMITED
            || self.in_progress.load(Ordering::Acquire) != 0
            || self.pacing.load(Ordering::Acquire) != 0
        {
            return;
        }
        let Ok(g) = self.inner.try_lock() else {
            return;
        };
        if matches!(g.token, Token::Held(t) if t.opened_ns.is_some() && !t.closed) {
            self.close(hook, g, Some(crate::now_ns()), false);
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

/// The queue budget of the turn held, if one is.
fn queue_budget(g: &Inner) -> Option<f64> {
    g.token_budget()
}

impl Inner {
    /// The queue budget of the turn held, if one is.
    fn token_budget(&self) -> Option<f64> {
        match self.token {
            Token::Held(t) => Some(queue_budget_of(t.quota_ns)),
            _ => None,
        }
    }
}

/// The queue budget of a turn of `quota_ns`: an eighth of it, 0.1 ms to 2.5 ms (what a
/// handoff may wait behind, however long the turns).
fn queue_budget_of(quota_ns: u64) -> f64 {
    (quota_ns / 8).clamp(100_000, 2_500_000) as f64
}

/// How long before a turn's start the gate opens: `GPUSHARE_HANDOFF_LEAD` at least, more when
/// this process's timed waits have returned late lately (the latest of them, and 0.2 ms), at
/// most [`MAX_LEAD_NS`].
fn lead_ns(g: &Inner, hook: &Hook) -> u64 {
    let late = g.lateness.iter().copied().max().unwrap_or(0);
    hook.settings
        .handoff_lead_ns
        .max(late + 200_000)
        .min(MAX_LEAD_NS)
}

/// A timed wait for a turn's opening returned `late_ns` late.
fn note_lateness(g: &mut Inner, late_ns: u64) {
    let i = g.lateness_at % LATENESS_SAMPLES;
    g.lateness[i] = late_ns;
    g.lateness_at = g.lateness_at.wrapping_add(1);
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

    /// A gate whose turn `token`, an hour long, is open.
    fn holding(token: u64) -> Gate {
        let gate = Gate::new([0; 16]);
        let now = crate::now_ns();
        let deadline_ns = now + 3_600_000_000_000;
        gate.lock().token = Token::Held(Turn {
            token,
            start_ns: now,
            deadline_ns,
            quota_ns: 20_000_000,
            opened_ns: Some(now),
            closed: false,
        });
        gate.deadline.store(deadline_ns, Ordering::Release);
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
