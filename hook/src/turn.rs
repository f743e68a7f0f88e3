//! The turn state machine of one GPU in this process, and the pacing arithmetic: pure. Events
//! and the time come in (grants, revocations, launchers arriving, the watcher looking, the
//! application synchronising), decisions come out (what to tell the scheduler, whether a launch
//! is admitted, when to close the gate, what the launch fast path's deadline is). No atomics,
//! no driver, no clock: every race between a revocation, a drain and an early release is tested
//! in virtual time (the tests below, thousands of turns in milliseconds). [`crate::gate`] reads
//! its atomics into an [`Activity`], calls in under its lock and carries the decisions out.
//!
//! A turn's life: the scheduler grants it ahead of its start; a launcher waits until a *lead*
//! before the start and opens the gate ([`Turns::admit`]); the watcher closes the gate when the
//! work queued would run to the deadline, or gives the turn back early when the holder went idle
//! ([`Turns::watch`]); the gate drains this process's work and reports the turn
//! ([`Turns::begin_close`], [`Turns::yield_turn`], [`Turns::end_close`]). A turn followed by this process's own next one
//! rolls over without closing ([`Turns::roll_over`]).
//!
//! **The liveness contract.** A process waiting for a turn is owed an answer: it probes the
//! scheduler ([`Say::Probe`]) once it has heard nothing about this GPU for half the liveness
//! bound (the scheduler's quota plus its grace, 40 ms by default, or `GPUSHARE_LIVENESS`),
//! and a scheduler that is well answers at once. A beat of the scheduler's heartbeat (its event
//! loop ran, [`Turns::heartbeat`]) since then stands in for the answer: no probe until half the
//! bound after the latest beat, and at least one every [`SPARSE_PROBE_NS`] without a word (a
//! beat does not prove this connection's round trip). Unanswered for the other half — the daemon
//! stopped, starved or swapped out — it is taken to be unresponsive, and `GPUSHARE_FAIL`
//! decides: `open` launches without a turn ([`Token::Ungated`]: the device's own time-slicing
//! among the processes that do the same), probing every bound; `closed` goes on waiting. The
//! first word from the scheduler after that (an answer, a grant, a new deadline) ends it: the
//! process still waits for the turn it asked for and is granted it in the schedule's order, and
//! no turn held while it was ungated is ever reported (it held none). Its launches are still
//! paced to a queue budget meanwhile (that of its latest turn, [`Turns::queue_budget`]): what
//! it queued during the spell is at most a budget of work when the scheduler speaks, not
//! everything up to its next synchronisation running on beside the others' turns.

use gpushare_protocol::{CUT_TURN_QUEUE_BUDGET_NS, TurnUse};

/// The fast path's deadline meaning "no limits" (fail-open).
pub const UNLIMITED: u64 = u64::MAX;

/// The idle-after-synchronisation score just after idleness, and the score above which the
/// next synchronisation is expected to be followed by idleness too (1000 · 0.85⁸ ≈ 272 > 250).
const IDLE: u32 = 1000;
const IDLE_RECENTLY: u32 = 250;

/// How many recent lateness samples of timed waits set the lead.
const LATENESS_SAMPLES: usize = 16;
/// The lead never exceeds this: turns are granted 5 ms ahead by default.
const MAX_LEAD_NS: u64 = 3_000_000;
/// A launcher waiting for a closed turn's drain looks again this often.
const GRANT_WAIT_NS: u64 = 100_000_000;
/// A request for a turn left without a grant this long is sent again (the scheduler may have
/// taken this process for a stopped one).
const ASK_AGAIN_NS: u64 = 500_000_000;
/// A waiter that has heard nothing about its GPU for this long probes even while the
/// scheduler's heartbeat is fresh: a beat proves only that the scheduler's event loop runs,
/// not this connection's round trip (this process's writer, the scheduler reading this
/// connection, this process's reader thread), which only an answer proves. Half a second: a
/// waiting process costs the scheduler at most two probes a second (15 waiters, 30 a second,
/// where probing every half bound costs 750), and a round trip broken while the loop runs is
/// found within half a second and the bound of the last word (or the bound of a request made
/// later than that).
const SPARSE_PROBE_NS: u64 = 500_000_000;
/// How far ahead of this process's clock a beat may be and still be trusted: the two read the
/// same `CLOCK_MONOTONIC` (a beat is read after it was written), so only rounding puts one
/// ahead; one further ahead is from a clock this process does not share (another time
/// namespace), and the waiter probes.
const BEAT_SLACK_NS: u64 = 1_000_000;

/// A turn granted by the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Turn {
    pub token: u64,
    pub start_ns: u64,
    pub deadline_ns: u64,
    /// GPU work to keep queued at most during it, as the scheduler said (launches are paced
    /// to it, and the gate closes that much before the deadline).
    pub queue_budget_ns: u64,
    /// When the gate opened for it (its first launch), if it has.
    pub opened_ns: Option<u64>,
    /// Its deadline arrived already past (revoked, or cut short to now): no launch is admitted
    /// any more, the watcher closes it.
    pub stopped: bool,
    /// A latency-class group keeps the GPU until its start and may take it back (the
    /// scheduler then withdraws this turn): the gate opens at its start, not a lead before.
    pub open_at_start: bool,
    /// A latency-class group may ask at any moment and would wait behind this process's
    /// queued work: a kernel longer than half the queue budget is launched only as the work
    /// before it runs down to the budget ([`Runway`]).
    pub just_in_time: bool,
    /// The gate closed for it: its work drains and is reported.
    pub closed: bool,
}

impl Turn {
    fn new(token: u64, start_ns: u64, deadline_ns: u64, budget_ns: u64) -> Turn {
        Turn {
            token,
            start_ns,
            deadline_ns,
            queue_budget_ns: queue_budget_within(budget_ns),
            opened_ns: None,
            stopped: false,
            open_at_start: false,
            just_in_time: false,
            closed: false,
        }
    }

    fn retime(&mut self, moved: Turn) {
        self.start_ns = moved.start_ns;
        self.deadline_ns = moved.deadline_ns;
        self.queue_budget_ns = moved.queue_budget_ns;
        self.open_at_start = moved.open_at_start;
        self.just_in_time = moved.just_in_time;
        self.stopped = false;
    }

    fn is_open(&self) -> bool {
        self.opened_ns.is_some() && !self.closed && !self.stopped
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token {
    None,
    /// Asked for a turn, or still launching as a turn ended (the scheduler then counts this
    /// process as waiting for another).
    Requested,
    Held(Turn),
    /// No scheduler to ask (disconnected, fail-open): no limits.
    Unthrottled,
    /// Asked, and the scheduler left this process's probe unanswered past the liveness bound
    /// (fail-open): no turn gate until it is heard from again, but the queue kept within a
    /// budget. It still owes the turn asked for.
    Ungated,
    /// The scheduler refused this process (e.g. no group matches it): launches fail.
    Refused,
}

/// What the scheduler is to be told (the gate adds its GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Say {
    Acquire,
    Yield {
        token: u64,
        drained_ns: u64,
    },
    Report {
        token: u64,
        used: Option<TurnUse>,
        again: bool,
    },
    /// Is the scheduler there? (The liveness contract.)
    Probe,
}

/// How a granted turn is to be used, as the scheduler said.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Plan {
    /// GPU work to keep queued at most.
    pub queue_budget_ns: u64,
    /// Open the gate at the turn's start, not a lead before.
    pub open_at_start: bool,
    /// Launch kernels longer than half the budget just in time ([`Runway`]).
    pub just_in_time: bool,
}

/// The hook's settings that shape turns.
#[derive(Debug, Clone, Copy)]
pub struct TurnConfig {
    /// A holder that launched nothing for this long gives its turn back.
    pub idle_release_ns: u64,
    /// The least lead before a turn's start at which the gate opens.
    pub handoff_lead_ns: u64,
    /// `GPUSHARE_FAIL=open`: a scheduler that owes an answer past the liveness bound is done
    /// without (else it is waited for).
    pub fail_open: bool,
}

/// What the gate's counters say at a moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Activity {
    /// Launches returned so far.
    pub launches: u64,
    /// No launch between admission and return, and no launcher waiting for its queued work.
    pub quiet: bool,
    /// Launchers waiting for a turn.
    pub waiters: u32,
}

/// One launcher's progress through [`Turns::admit`].
#[derive(Debug, Default)]
pub struct Waiter {
    /// The opening time its last timed wait was for (to learn how late it woke).
    waited_for: Option<u64>,
}

/// What a launcher does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The launch runs.
    Admit,
    /// The launch runs, and it opened the gate for the held turn: the fast path's deadline
    /// changed and the watcher must look.
    Opened,
    /// The launch must not run: this process was refused.
    Refuse,
    /// Ask for a turn ([`Say::Acquire`]), then [`Turns::asked`].
    Ask,
    /// Wait until this time, or until woken by a change, and ask again.
    Wait { until_ns: u64 },
    /// The launch runs without a turn, and so do the next ones (their queued work still
    /// paced): the scheduler left a probe unanswered past the liveness bound (fail-open). The
    /// watcher must look (it probes on).
    Ungated,
}

/// What the watcher does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Watch {
    /// Nothing to watch until something changes.
    Nothing,
    /// Look again at this time.
    At(u64),
    /// Close the gate for the held turn, drain and report it; `yield_at`: given back before its
    /// deadline, at that time; `busy`: this process has more work.
    Close { yield_at: Option<u64>, busy: bool },
    /// The turn ended and this process's next one starts there: [`Turns::roll_over`].
    RollOver,
}

/// The turn state of one GPU.
#[derive(Debug)]
pub struct Turns {
    cfg: TurnConfig,
    token: Token,
    /// A further turn granted while `token` still holds one (it starts after that one ends).
    next: Option<Turn>,
    liveness: Liveness,
    /// The newest token reported or withdrawn on this connection: a grant moving one of these
    /// crossed this process's report on the way (the scheduler numbers turns in order).
    retired: u64,
    /// How late recent timed waits for a turn's opening returned (ns), in a ring.
    lateness: [u64; LATENESS_SAMPLES],
    lateness_at: usize,
    /// The scheduler extended the turn: nobody else wants the GPU, so the watcher need not look
    /// for idleness until the deadline (whoever asks ends the extension, and the new deadline
    /// says so).
    alone: bool,
    /// The launch count the watcher last saw, and when it saw it change.
    seen_launches: u64,
    seen_at: u64,
    /// The latest launch that was paced (fenced), and when it returned.
    paced_launch: u64,
    paced_at: u64,
    /// The queue budget of the latest turn granted: a fail-open spell keeps to it.
    spell_budget_ns: u64,
    sync: SyncHistory,
    /// What to tell the scheduler, in order ([`Turns::take_said`]).
    said: Vec<Say>,
}

/// What this machine has heard from the scheduler, and what it is owed (the liveness
/// contract, in the module documentation).
#[derive(Debug)]
struct Liveness {
    /// The liveness bound: a probe is sent after half of it without a word about this GPU, and
    /// left unanswered for the other half the scheduler is taken to be unresponsive.
    bound_ns: u64,
    /// When the scheduler last said something about this GPU (or the connection was made).
    heard_at: u64,
    /// When this process last asked for a turn.
    asked_at: u64,
    /// When the latest probe was sent.
    probed_at: Option<u64>,
    /// When the scheduler's event loop last ran, as its heartbeat said ([`Turns::heartbeat`]):
    /// a heartbeat after the last word stands in for an answer (no probe is sent) until the
    /// last word is [`SPARSE_PROBE_NS`] old.
    beat_at: u64,
}

impl Liveness {
    /// A probe is out: sent after the last word from the scheduler (a request sent again
    /// meanwhile does not answer it).
    fn probe_out(&self) -> Option<u64> {
        self.probed_at.filter(|&p| p > self.heard_at)
    }
}

/// What followed the application's recent synchronisations.
#[derive(Debug, Default)]
struct SyncHistory {
    /// When the application last began to synchronise (0: never), and when that returned; with
    /// the launch count at each, which says exactly whether anything was launched since.
    began_at: u64,
    launches_at_begin: u64,
    returned_at: u64,
    launches_at_return: u64,
    /// When the watcher first saw the work drained while that synchronisation was under way:
    /// the application is waiting for its work, not idle, until then.
    drained_at: Option<u64>,
    /// It went idle after that synchronisation (no launch for the idle release time).
    idled_after: bool,
    /// Whether the application went idle after a recent synchronisation rather than launching
    /// again (a request-serving or bursty process, whose turn is best handed over as its
    /// synchronised work drains): 1000 after one that was followed by idleness, 15 % less after
    /// each followed by more launches; above [`IDLE_RECENTLY`] for the next 8.
    score: u32,
}

impl Turns {
    /// A machine whose liveness bound is `liveness_ns` until [`Turns::set_liveness`].
    pub fn new(cfg: TurnConfig, liveness_ns: u64) -> Turns {
        Turns {
            cfg,
            token: Token::None,
            next: None,
            liveness: Liveness {
                bound_ns: liveness_ns,
                heard_at: 0,
                asked_at: 0,
                probed_at: None,
                beat_at: 0,
            },
            retired: 0,
            lateness: [0; LATENESS_SAMPLES],
            lateness_at: 0,
            alone: false,
            seen_launches: 0,
            seen_at: 0,
            paced_launch: 0,
            paced_at: 0,
            // Before any turn was granted: the scheduler's budget for a turn of its default
            // quota that another group may cut short.
            spell_budget_ns: CUT_TURN_QUEUE_BUDGET_NS,
            sync: SyncHistory::default(),
            said: Vec::new(),
        }
    }

    #[cfg(test)]
    pub fn token(&self) -> Token {
        self.token
    }

    /// What to tell the scheduler since the last call, in order.
    pub fn take_said(&mut self) -> Vec<Say> {
        std::mem::take(&mut self.said)
    }

    /// The launch fast path's deadline: that of the open turn, [`UNLIMITED`] without limits,
    /// 0 (closed: launches take the slow path) otherwise.
    pub fn gate_deadline(&self) -> u64 {
        match self.token {
            Token::Unthrottled | Token::Ungated => UNLIMITED,
            Token::Held(t) if t.is_open() => t.deadline_ns.max(1),
            _ => 0,
        }
    }

    /// The queue budget of the turn held, if one is; during a fail-open spell, that of the
    /// latest turn granted (the scheduler answers again to at most that much queued: the
    /// process rejoins the schedule within a turn). None without a scheduler at all
    /// (unthrottled: no schedule to rejoin, nothing to pace for).
    pub fn queue_budget(&self) -> Option<f64> {
        match self.token {
            Token::Ungated => Some(self.spell_budget_ns as f64),
            _ => self.held_budget(),
        }
    }

    /// The queue budget of the turn held, if one is (not during a fail-open spell).
    pub fn held_budget(&self) -> Option<f64> {
        match self.token {
            Token::Held(t) => Some(t.queue_budget_ns as f64),
            _ => None,
        }
    }

    /// The queue budget of the turn held if its long kernels are launched just in time.
    pub fn just_in_time(&self) -> Option<f64> {
        match self.token {
            Token::Held(t) if t.just_in_time => Some(t.queue_budget_ns as f64),
            _ => None,
        }
    }

    // --- launchers -----------------------------------------------------------------------

    /// A launcher takes the slow path at `now`, the launch count being `launches`: the first
    /// launch since a synchronisation that gave the turn back tells whether the application
    /// was idle in between (see [`Turns::before_sync`]).
    pub fn launcher_arrives(&mut self, now: u64, launches: u64) {
        let s = &mut self.sync;
        if self.token == Token::None
            && s.returned_at != 0
            && launches == s.launches_at_return
            && now >= s.returned_at + self.cfg.idle_release_ns
        {
            s.idled_after = true;
        }
    }

    /// What launcher `w` does at `now`.
    pub fn admit(&mut self, now: u64, w: &mut Waiter) -> Step {
        match self.token {
            Token::Refused => Step::Refuse,
            Token::Unthrottled | Token::Ungated => Step::Admit,
            Token::Held(t) if t.is_open() => Step::Admit,
            Token::Held(t) if t.opened_ns.is_none() && !t.closed => {
                let open_at = if t.open_at_start {
                    // As early as this process's timed waits typically wake late: its first
                    // kernel reaches the GPU about at the start.
                    t.start_ns.saturating_sub(self.typical_lateness_ns())
                } else {
                    t.start_ns.saturating_sub(self.lead_ns())
                };
                if now < open_at {
                    w.waited_for = Some(open_at);
                    return Step::Wait { until_ns: open_at };
                }
                if let Some(at) = w.waited_for.take() {
                    self.note_lateness(now.saturating_sub(at));
                }
                self.open(now);
                Step::Opened
            }
            Token::None => Step::Ask,
            Token::Requested => {
                w.waited_for = None;
                match self.await_grant(now) {
                    Some(until_ns) => Step::Wait { until_ns },
                    None => Step::Ungated,
                }
            }
            // Waiting for the last turn to close and drain.
            Token::Held(_) => {
                w.waited_for = None;
                Step::Wait {
                    until_ns: now + GRANT_WAIT_NS,
                }
            }
        }
    }

    /// Waiting for a grant at `now`: probe, ask again, or give up on the scheduler (fail-open:
    /// `None`, this process is ungated); else when to look again.
    fn await_grant(&mut self, now: u64) -> Option<u64> {
        let l = &mut self.liveness;
        if now >= l.asked_at.saturating_add(ASK_AGAIN_NS) {
            l.asked_at = now;
            self.said.push(Say::Acquire);
        }
        let half = (l.bound_ns / 2).max(1);
        let look = match l.probe_out() {
            Some(p) if now >= p.saturating_add(half) => {
                if self.cfg.fail_open {
                    self.token = Token::Ungated;
                    return None;
                }
                // Fail-closed: waits on, for a grant or the next word.
                now.saturating_add(GRANT_WAIT_NS)
            }
            Some(p) => p.saturating_add(half),
            None => {
                // The scheduler's heartbeat since the last word vouches for its event loop:
                // no probe until half the bound after the latest beat, for as long as the last
                // word is less than SPARSE_PROBE_NS old (only an answer proves the round trip).
                let heard = l.heard_at.max(l.asked_at);
                let sparse_at = l.heard_at.saturating_add(SPARSE_PROBE_NS);
                let mut due = heard.saturating_add(half);
                if now < sparse_at {
                    due = due.max(l.beat_at.saturating_add(half).min(sparse_at));
                }
                if now >= due {
                    l.probed_at = Some(now);
                    self.said.push(Say::Probe);
                    now.saturating_add(half)
                } else {
                    due
                }
            }
        };
        Some(look.min(l.asked_at.saturating_add(ASK_AGAIN_NS)))
    }

    /// The request of [`Step::Ask`] was sent at `now` (`sent`), or could not be (the launcher
    /// waits a while and asks again).
    pub fn asked(&mut self, sent: bool, now: u64) {
        if sent && self.token == Token::None {
            self.requested(now);
        }
    }

    /// Waiting for a turn asked for at `now`.
    fn requested(&mut self, now: u64) {
        self.token = Token::Requested;
        self.liveness.asked_at = now;
    }

    /// The scheduler said something about this GPU at `now`: it is there. A process ungated
    /// for want of an answer goes back to waiting for its turn (and asks for it again, in case
    /// the scheduler took it for a stopped one meanwhile).
    fn heard(&mut self, now: u64) {
        self.liveness.heard_at = self.liveness.heard_at.max(now);
        if self.token == Token::Ungated {
            self.requested(now);
            self.said.push(Say::Acquire);
        }
    }

    /// The scheduler answered a probe at `now`.
    pub fn alive(&mut self, now: u64) {
        self.heard(now);
    }

    /// The scheduler's heartbeat, read at `now`, says its event loop last ran at `at`. A
    /// waiter that has heard nothing for half the bound probes only if that too is half the
    /// bound old, or if it has heard nothing for [`SPARSE_PROBE_NS`]; a beat is no answer to a
    /// probe already out (the answer, or the bound, ends that). A beat more than
    /// [`BEAT_SLACK_NS`] ahead of `now` is from a clock this process does not share, and is
    /// not trusted.
    pub fn heartbeat(&mut self, at: u64, now: u64) {
        if at <= now.saturating_add(BEAT_SLACK_NS) {
            let l = &mut self.liveness;
            l.beat_at = l.beat_at.max(at.min(now));
        }
    }

    /// The liveness bound (the scheduler's promise in its `Welcome`, unless the settings fix
    /// it).
    pub fn set_liveness(&mut self, bound_ns: u64) {
        self.liveness.bound_ns = bound_ns;
    }

    pub fn liveness_ns(&self) -> u64 {
        self.liveness.bound_ns
    }

    /// Whether the scheduler owes this process an answer past the liveness bound (fail-closed:
    /// it is waited for; fail-open: [`Token::Ungated`]).
    pub fn overdue(&self, now: u64) -> bool {
        let l = &self.liveness;
        self.token == Token::Ungated
            || l.probe_out()
                .is_some_and(|p| now >= p.saturating_add(l.bound_ns / 2))
    }

    /// Open the gate for the held turn (its first launch is about to be made, at `now`).
    fn open(&mut self, now: u64) {
        if let Token::Held(t) = &mut self.token {
            t.opened_ns = Some(now);
            self.alone = false;
        }
    }

    /// How long before a turn's start the gate opens: the configured lead at least, more when
    /// this process's timed waits have returned late lately (the latest of them, and 0.2 ms),
    /// at most [`MAX_LEAD_NS`].
    pub fn lead_ns(&self) -> u64 {
        let late = self.lateness.iter().copied().max().unwrap_or(0);
        self.cfg
            .handoff_lead_ns
            .max(late + 200_000)
            .min(MAX_LEAD_NS)
    }

    /// How late this process's recent timed waits for a turn's opening woke, typically: the
    /// median of the samples kept, at most [`MAX_LEAD_NS`].
    fn typical_lateness_ns(&self) -> u64 {
        let mut l = self.lateness;
        l.sort_unstable();
        l[LATENESS_SAMPLES / 2].min(MAX_LEAD_NS)
    }

    fn note_lateness(&mut self, late_ns: u64) {
        self.lateness[self.lateness_at % LATENESS_SAMPLES] = late_ns;
        self.lateness_at = self.lateness_at.wrapping_add(1);
    }

    // --- the scheduler -------------------------------------------------------------------

    /// A turn from `start_ns` to `deadline_ns`, usually ahead of its start, during which at
    /// most `queue_budget_ns` of GPU work is kept queued (long kernels launched `just_in_time`
    /// if so), opening at its start if `open_at_start` (else a lead before); or a planned one
    /// moved (same token). One nobody here wants is given straight back.
    pub fn grant(&mut self, token: u64, start_ns: u64, deadline_ns: u64, plan: Plan, now: u64) {
        let current = matches!(self.token, Token::Held(t) if t.token == token)
            || self.next.is_some_and(|n| n.token == token);
        self.liveness.heard_at = self.liveness.heard_at.max(now);
        if token <= self.retired && !current {
            return;
        }
        let turn = Turn {
            open_at_start: plan.open_at_start,
            just_in_time: plan.just_in_time,
            ..Turn::new(token, start_ns, deadline_ns, plan.queue_budget_ns)
        };
        self.spell_budget_ns = turn.queue_budget_ns;
        match (&mut self.token, &mut self.next) {
            (Token::Held(t), _) if t.token == token => t.retime(turn),
            (_, Some(n)) if n.token == token => n.retime(turn),
            (Token::Requested | Token::Ungated, _) => self.token = Token::Held(turn),
            (Token::Held(_), next) => *next = Some(turn),
            (Token::None | Token::Unthrottled | Token::Refused, _) => {
                self.retire(token);
                self.said.push(Say::Yield {
                    token,
                    drained_ns: now,
                });
                self.said.push(Say::Report {
                    token,
                    used: None,
                    again: false,
                });
            }
        }
    }

    /// Stop launching in turn `token` at once (it ended without a report by its end + grace),
    /// or forget it if it has not opened (withdrawn). A withdrawn turn that a launcher
    /// (`waiting`) still waits for is asked for again at once: the scheduler may grant it again
    /// before the launcher would have asked (it keeps the process waiting, first in its
    /// group, when it withdraws a turn to serve another group first), and that grant must find
    /// the process waiting for it, not be given straight back as unwanted.
    pub fn revoke(&mut self, token: u64, waiting: bool, now: u64) {
        self.heard(now);
        if self.next.is_some_and(|n| n.token == token) {
            self.next = None;
            return;
        }
        if let Token::Held(t) = self.token
            && t.token == token
            && t.opened_ns.is_none()
            && !t.closed
        {
            self.retire(token);
            self.token = self.next.take().map_or(Token::None, Token::Held);
            if waiting && self.token == Token::None {
                self.requested(now);
                self.said.push(Say::Acquire);
            }
            return;
        }
        self.deadline(token, 1, now);
    }

    /// Turn `token` now ends at `deadline_ns` (earlier: cut short; later: extended, nobody
    /// else wants the GPU). One already past stops the open turn at once.
    pub fn deadline(&mut self, token: u64, deadline_ns: u64, now: u64) {
        self.heard(now);
        if let Some(n) = self.next.as_mut().filter(|n| n.token == token) {
            n.deadline_ns = deadline_ns;
            return;
        }
        let Token::Held(t) = &mut self.token else {
            return;
        };
        if t.token != token {
            return;
        }
        if t.closed {
            // Draining: only how long its drain may take changes (cut short or revoked: the
            // scheduler expects the report sooner).
            t.deadline_ns = t.deadline_ns.min(deadline_ns);
            return;
        }
        self.alone = deadline_ns > t.deadline_ns;
        t.deadline_ns = deadline_ns;
        if t.opened_ns.is_some() {
            t.stopped = deadline_ns <= now;
        }
    }

    /// Connected (again) to the scheduler at `now`: what was asked of the last one is not
    /// owed by this one.
    pub fn connected(&mut self, now: u64) {
        self.retired = 0;
        self.liveness.heard_at = now;
        self.liveness.beat_at = 0;
        if matches!(self.token, Token::Unthrottled | Token::Ungated) {
            self.token = Token::None;
        }
    }

    /// The scheduler is gone, its turns with it. True when the gate must forget its queue.
    pub fn disconnected(&mut self) -> bool {
        self.retired = 0;
        if matches!(self.token, Token::Unthrottled | Token::Refused) {
            return false;
        }
        self.token = Token::None;
        self.next = None;
        true
    }

    pub fn refused(&mut self) {
        self.token = Token::Refused;
    }

    pub fn unthrottled(&mut self) {
        self.token = Token::Unthrottled;
    }

    /// The deadline of the turn being closed (its drain is bounded from there), if one is.
    pub fn closing_deadline(&self) -> Option<u64> {
        match self.token {
            Token::Held(t) if t.closed => Some(t.deadline_ns),
            _ => None,
        }
    }

    // --- the watcher ---------------------------------------------------------------------

    /// Watcher duty at `now`: close the open turn when the work queued (`queued`, asked only
    /// when needed) would run to its deadline; give back one whose holder launched nothing for
    /// the idle release (or that came with nothing to launch).
    pub fn watch(
        &mut self,
        now: u64,
        a: Activity,
        queued: &mut dyn FnMut() -> Option<u64>,
    ) -> Watch {
        let idle_ns = self.cfg.idle_release_ns.max(100_000);
        if self.token == Token::Ungated {
            // Probe on: the answer ends the spell.
            let l = &mut self.liveness;
            let due = l.probed_at.map_or(now, |p| p.saturating_add(l.bound_ns));
            if now < due {
                return Watch::At(due);
            }
            l.probed_at = Some(now);
            self.said.push(Say::Probe);
            return Watch::At(now.saturating_add(l.bound_ns));
        }
        let Token::Held(turn) = self.token else {
            return Watch::Nothing;
        };
        if turn.closed {
            return Watch::Nothing;
        }
        let Some(opened) = turn.opened_ns else {
            // Not opened: nothing was launched since it started (and its lead) — give it back
            // once that lasts an idle release.
            let idle_at = turn.start_ns.saturating_add(idle_ns);
            if now < idle_at {
                return Watch::At(idle_at);
            }
            if a.waiters == 0 {
                return Watch::Close {
                    yield_at: Some(now),
                    busy: false,
                };
            }
            return Watch::Nothing;
        };
        let deadline = if turn.stopped { 1 } else { turn.deadline_ns };
        let queued = queued();
        let (last, synced_last) = self.last_active(now, a.launches, queued == Some(0));
        let idle_since = last.max(opened).saturating_add(idle_ns);
        // Idle: nothing launched for the idle release, and nothing of this process's left on
        // the GPU (a synchronisation waiting for queued work is not idleness).
        if a.quiet && !self.alone && now >= idle_since && now < deadline && queued == Some(0) {
            // Given back for idleness with nothing launched since the application
            // synchronised: it went idle after synchronising.
            if synced_last {
                self.sync.idled_after = true;
            }
            return Watch::Close {
                yield_at: Some(now),
                busy: false,
            };
        }
        // The next turn is this process's own, back to back: no handoff, the gate stays open;
        // at the deadline the turn is reported and the next one takes over.
        if self.next.is_some_and(|n| n.start_ns <= deadline) {
            return if now < deadline {
                Watch::At(deadline)
            } else {
                Watch::RollOver
            };
        }
        // Close when the work queued would run to the deadline.
        let budget = turn.queue_budget_ns;
        // (Pacing keeps the queue within the budget: an estimate far beyond is stale.)
        let close_at = deadline.saturating_sub(queued.unwrap_or(budget / 2).min(2 * budget));
        if now >= close_at {
            let busy = !a.quiet || a.waiters > 0 || now < idle_since;
            return Watch::Close {
                yield_at: None,
                busy,
            };
        }
        // Look again at the latest a budget before the deadline (the queue estimate then says
        // when exactly), and for idleness: once the idle release has passed, when the work
        // queued should have drained.
        let next = if deadline - now > budget {
            deadline - budget
        } else {
            close_at
        };
        let idle_check = match (a.quiet, now >= idle_since) {
            (false, _) => now + idle_ns,
            (true, false) => idle_since,
            (true, true) => now + queued.unwrap_or(idle_ns).max(100_000),
        };
        Watch::At(if self.alone {
            next
        } else {
            next.min(idle_check)
        })
    }

    /// When the application was last active (the fast path takes no timestamp), and whether it
    /// has been idle since a synchronisation returned. If its last act was a synchronisation:
    /// when that returned, or, while it is under way, when its work was first seen drained
    /// (`drained`: nothing of this process is queued at `now`) — a thread the host is slow to
    /// wake is waiting, not idle, and a launch before it may be a whole queue budget earlier.
    /// Else when the last launch was paced, else when the watcher, looking at `now`, saw the
    /// launch count move (a look late at most).
    fn last_active(&mut self, now: u64, launches: u64, drained: bool) -> (u64, bool) {
        if launches != self.seen_launches {
            self.seen_launches = launches;
            self.seen_at = now;
        }
        let s = &mut self.sync;
        if s.began_at != 0 && launches == s.launches_at_begin {
            if s.returned_at >= s.began_at {
                (s.returned_at, true)
            } else {
                if drained {
                    s.drained_at.get_or_insert(now);
                }
                (s.drained_at.unwrap_or(now), false)
            }
        } else if self.paced_launch == launches {
            (self.paced_at, false)
        } else {
            (self.seen_at, false)
        }
    }

    /// Launch `n` was paced (fenced) as it returned at `now`.
    pub fn paced(&mut self, n: u64, now: u64) {
        (self.paced_launch, self.paced_at) = (n, now);
    }

    /// Close the gate for the held turn: launches stop, and the gate drains this process's work.
    /// Returns the turn, or `None` when there is none to close.
    pub fn begin_close(&mut self) -> Option<Turn> {
        let Token::Held(t) = &mut self.token else {
            return None;
        };
        if t.closed {
            return None;
        }
        t.closed = true;
        Some(*t)
    }

    /// The turn being closed is given back at `at`, before its deadline: its work drains at
    /// `drained_ns`, where the next turn can start.
    pub fn yield_turn(&mut self, turn: &Turn, at: u64, drained_ns: u64) {
        // The scheduler ends it at the drain estimate, but a minimum quota after hearing of the
        // yield at most (a queue estimate can be long): the drain's bound runs from the yield.
        if let Token::Held(t) = &mut self.token
            && t.token == turn.token
        {
            t.deadline_ns = t.deadline_ns.min(at);
        }
        self.said.push(Say::Yield {
            token: turn.token,
            drained_ns,
        });
    }

    /// `turn`'s work drained at `last_ns` (or the gate stopped waiting for it then): report
    /// it, and go on with the next turn if one is planned, else ask for another (`again`) or
    /// hold none. (Disconnected, refused or unthrottled meanwhile: that state stands.)
    pub fn end_close(&mut self, turn: Turn, last_ns: u64, again: bool) {
        if matches!(self.token, Token::Held(t) if t.token == turn.token) {
            match self.next.take() {
                Some(n) => self.token = Token::Held(n),
                None if again => self.requested(last_ns),
                None => self.token = Token::None,
            }
        }
        self.retire(turn.token);
        self.said.push(Say::Report {
            token: turn.token,
            used: turn.opened_ns.map(|first_ns| TurnUse { first_ns, last_ns }),
            again,
        });
    }

    /// The held turn ended at its deadline and the next one, this process's too, starts there:
    /// report the one, open the other, without closing the gate.
    pub fn roll_over(&mut self) {
        let (Token::Held(turn), Some(next)) = (self.token, self.next.take()) else {
            return;
        };
        // (A turn opened after its deadline, moved earlier meanwhile, ends where it opened.)
        let at = turn.deadline_ns.max(turn.opened_ns.unwrap_or(0));
        self.retire(turn.token);
        self.token = Token::Held(Turn {
            opened_ns: Some(at),
            ..next
        });
        self.said.push(Say::Report {
            token: turn.token,
            used: turn.opened_ns.map(|first_ns| TurnUse {
                first_ns,
                last_ns: at,
            }),
            again: true,
        });
    }

    fn retire(&mut self, token: u64) {
        self.retired = self.retired.max(token);
    }

    // --- synchronisations ------------------------------------------------------------------

    /// The application is about to synchronise at `now`. If it went idle after one of its last
    /// synchronisations (a request server, a bursty job: learnt), the turn is best given back as
    /// the work it waits for drains, rather than leave the next holder an idle GPU until the
    /// idle release: the token of the turn the gate should close now (and yield), if one. Not
    /// while the turn is extended, or while another thread launches or paces.
    pub fn before_sync(&mut self, now: u64, a: Activity) -> Option<u64> {
        let idle_next = self.learn_after_sync(now, a.launches) > IDLE_RECENTLY && !self.alone;
        if idle_next && a.quiet {
            self.open_turn()
        } else {
            None
        }
    }

    /// Whether turn `token`, found to be given back at a synchronisation
    /// ([`Turns::before_sync`]), still is as activity `a` is seen later (the gate lets its lock
    /// go between the two to ask the driver what is queued): the same turn still held and
    /// open, and no launch or pacing since.
    pub fn still_gives_back(&self, token: u64, a: Activity) -> bool {
        a.quiet && self.open_turn() == Some(token)
    }

    /// The token of the turn held, if it is open.
    fn open_turn(&self) -> Option<u64> {
        match self.token {
            Token::Held(t) if t.is_open() => Some(t.token),
            _ => None,
        }
    }

    /// A synchronisation returned at `now`.
    pub fn after_sync(&mut self, now: u64, launches: u64) {
        self.sync.launches_at_return = launches;
        self.sync.returned_at = now;
    }

    /// Fold what followed the previous synchronisation (idleness, or more launches) into the
    /// score, and return it.
    fn learn_after_sync(&mut self, now: u64, launches: u64) -> u32 {
        let s = &mut self.sync;
        let outcome = if s.began_at == 0 {
            None
        } else if s.idled_after {
            Some(IDLE)
        } else if launches > s.launches_at_begin {
            Some(0)
        } else {
            None // synchronised twice in a row
        };
        s.idled_after = false;
        s.drained_at = None;
        s.launches_at_begin = launches;
        s.began_at = now;
        match outcome {
            Some(IDLE) => s.score = IDLE,
            Some(_) => s.score = 85 * s.score / 100,
            None => {}
        }
        s.score
    }
}

/// A turn's queue budget as the scheduler gave it, within 0.1 ms (below, every launch would
/// wait for the one before) and 10 ms (beyond, a turn cut short would wait that long).
pub fn queue_budget_within(budget_ns: u64) -> u64 {
    budget_ns.clamp(100_000, 10_000_000)
}

/// Where the GPU should finish the work this process has launched on one GPU, as far as the
/// GPU time per launch tells: what launching just in time goes by. The fences keep the work
/// queued within a turn's budget only down to one kernel behind the running one (a launcher
/// waits for a fence before the newest, never for the launch just made); with kernels longer
/// than half the budget that is more than the budget, and a latency-class request arriving
/// would wait behind a whole kernel queued. Launched just in time, the next kernel goes only
/// as the work before it runs down to the budget: most of the time the running kernel is all
/// that is queued, and the GPU still has the next one before it runs out: a budget's margin,
/// and the launcher aims earlier by how late it has been waking up recently, never more than
/// one kernel ahead (what the fences keep queued anyway): on a busy host the GPU stays busy at
/// the cost of the tail, on a quiet one a kernel seldom waits queued.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Runway {
    /// When the work launched should be done.
    end_ns: u64,
    /// The launch count it accounts for.
    through: u64,
    /// How late the launcher woke from its recent waits: the latest lateness, or the one before
    /// less a 256th if that is more (a late wake-up on a busy host is remembered for a few
    /// hundred launches: the next comes before the margin has shrunk back).
    late_ns: u64,
}

impl Runway {
    /// Launches up to the count `n` were made by `now`, each `est_ns` of GPU time: the GPU
    /// runs them after the work before them, or from `now` if that should be done.
    pub fn launched(&mut self, now: u64, n: u64, est_ns: f64) {
        let new = n.saturating_sub(self.through);
        self.through = self.through.max(n);
        self.end_ns = self.end_ns.max(now) + (new as f64 * est_ns) as u64;
    }

    /// The GPU was seen at `now` to have just finished a fence with `queued_ns` of work after
    /// it (a launcher waited for it): the work ends then, whatever was expected.
    pub fn reached(&mut self, now: u64, queued_ns: u64) {
        self.end_ns = now + queued_ns;
    }

    /// Everything launched up to the count `n` has run (a drain).
    pub fn drained(&mut self, n: u64) {
        self.end_ns = 0;
        self.through = n;
    }

    /// The launcher waited for `at` (from [`Runway::launch_at`]) and went on at `now`.
    pub fn woke(&mut self, at: u64, now: u64) {
        self.late_ns = now
            .saturating_sub(at)
            .max(self.late_ns - self.late_ns / 256);
    }

    /// When the next launch is to be made at the earliest, if later than `now`: as the work
    /// before it runs down to `budget_ns` and the launcher's recent lateness, at most one
    /// kernel; only for kernels longer than half the budget (`est_ns` each: shorter ones the
    /// fences keep within it).
    pub fn launch_at(&self, now: u64, budget_ns: f64, est_ns: f64) -> Option<u64> {
        if est_ns <= budget_ns / 2.0 {
            return None;
        }
        let margin = (budget_ns + self.late_ns as f64).min(est_ns.max(budget_ns)) as u64;
        let at = self.end_ns.saturating_sub(margin);
        (at > now).then_some(at)
    }
}

/// For a queue budget and the GPU time per launch: launches between fences (K, half the budget
/// of work, 1 to 4096), and the queued work above which a launcher waits for its oldest fence
/// (half the budget, so that K more launches keep the queue within the budget).
pub fn pacing(budget_ns: f64, est_ns: f64) -> (u64, f64) {
    let k = if est_ns > 0.0 {
        (budget_ns / (2.0 * est_ns)).clamp(1.0, 4096.0) as u64
    } else {
        1
    };
    (k, budget_ns / 2.0)
}

#[cfg(test)]
mod tests;
