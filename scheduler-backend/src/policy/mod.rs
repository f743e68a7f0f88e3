//! The fair-share policy core: a pure state machine, one instance per GPU.
//!
//! No I/O, no threads, no clock: every call carries `now` (nanoseconds of `CLOCK_MONOTONIC`),
//! and what the policy decides (grant a turn, move its deadline, revoke it) is queued as
//! [`Decision`]s that the daemon's I/O shell drains with [`Policy::take_decisions`] after every
//! call. The shell also asks [`Policy::next_wakeup`] when to call [`Policy::tick`] next.
//! Fairness is therefore tested in virtual time (see `virtual_time.rs`).
//!
//! # Model
//!
//! *Clients* are processes; each belongs to a *group* (a container, pod or user) with
//! [`GroupParams`]: `request` (guaranteed share), `limit` (hard cap), `weight` (split of spare
//! time). The GPU is used in *turns*: a client's token from a start to a deadline, one turn at a
//! time. A client asks with [`Policy::acquire`] and is told its turn with a
//! [`Decision::Grant`] — usually *ahead of time*: the next turn is decided
//! [`PolicyConfig::grant_ahead_ns`] before the current one ends, and starts exactly when it
//! ends. The holder stops launching at its deadline on its own, and the next client's first
//! kernels are already queued by then: no process, the daemon included, has to wake up for a
//! handoff, so handoffs cost nothing however slowly the host schedules its processes. After a
//! turn's work has drained its client reports what it measured ([`Policy::report`]), which
//! settles the turn's charge; a client that runs out of work gives its turn back early with
//! [`Policy::yield_turn`].
//!
//! # Algorithm
//!
//! The rules as `docs/scheduling.md` numbers and explains them; code and tests cite each by its
//! anchor there (`docs/scheduling.md#charges`), never by number.
//!
//! 1. **Targets.** (`docs/scheduling.md#targets`) The active groups' target shares come from
//!    [`water_fill`]: effective requests first (scaled down if they sum to more than 1), the rest
//!    split by weight among groups below their limit, limits capping and their excess
//!    redistributed. Recomputed lazily whenever the active set or the parameters change. A group is
//!    *active* while it has a turn, waits for one, or yielded one a moment ago with work still
//!    draining.
//! 2. **Credit** (`docs/scheduling.md#credit`) (a deficit counter, ns). While a turn runs, each
//!    active group accrues credit at its target share, and each idle group with a request *banks*
//!    its guarantee (normalised over both, so exactly the elapsed time is handed out; the targets
//!    count an idle group as taking exactly its guarantee, so banking comes out of spare time,
//!    never out of another group's guarantee). A turn's group is debited its quota when it is
//!    granted and settled to its charge (`docs/scheduling.md#charges`) when its client reports.
//!    Credit a group cannot absorb above the upper bound is passed on by weight to the active
//!    groups below their limit. All credits are re-centred on their mean and bounded to `[−2B,
//!    +B]`, `B = 2·quota + grace`.
//! 3. **Caps.** (`docs/scheduling.md#caps`) Each group with `limit < 1` has a token bucket filling
//!    at `limit` ns per ns up to `2·quota`, debited like the credit. It may start a turn only when
//!    its bucket holds a full quota then, and never with `limit = 0`. A capped group's turn is
//!    planned for when its bucket refills, granted ahead like any other.
//! 4. **Selection.** (`docs/scheduling.md#selection`) The next turn goes to the waiting group with
//!    the largest credit among those that may start then (ties: the one waiting longest); within a
//!    group clients are served in the order they asked, i.e. round-robin. A turn lasts a quota, but
//!    while other groups are active one of a group whose target share `s` is under one half lasts
//!    `quota / (2·(1 − s))`: no turn moves its group's credit by more than half a quota, so every
//!    group's share over a window is off by the same small amount however small the share
//!    (`PolicyConfig::contested_turn_ns`). The holder of the current turn counts as waiting for
//!    another (it is still launching, as far as the policy knows) unless it yielded; if it is
//!    chosen again while no other group wants the GPU its turn is *extended*
//!    ([`Decision::Extend`]), else it gets a new turn back to back (its hook reports the one before
//!    at the handoff, so a stopped process is noticed there). A client whose report says it has no
//!    more work leaves the queue (a turn already planned for it is revoked). The GPU is never left
//!    without a turn while a group that may start waits (work conservation).
//! 5. **Yield.** (`docs/scheduling.md#yield`) A client whose work runs out gives its turn back with
//!    an estimate of when its last kernels drain; the next turn starts there (a planned one is
//!    moved earlier).
//! 6. **Preemption.** (`docs/scheduling.md#preemption`) A group that comes back with work (a client
//!    asks while the group has no turn), or a capped waiting group whose bucket has refilled, is
//!    served sooner if it is owed more than the holder by a minimum quota: the turn that would run
//!    next (the planned one, else the current one) ends at once, but never below `min_quota_ns`
//!    after its start (an eighth of it for the turn the returning group itself gave the GPU to by
//!    yielding). An idle group with a request banks its guarantee (`docs/scheduling.md#credit`), so
//!    a bursty or latency-sensitive group gets what it needs however long it idled, instead of
//!    waiting out whole turns.
//! 7. **Charges.** (`docs/scheduling.md#charges`) Back to back, a turn is charged from its start to
//!    its end: the GPU was its client's in between, used or held while others waited. Where the GPU
//!    was free before or after it, it is charged from its first launch or until its last kernel
//!    ended, as its client measured: a tenant alone is charged for the time its kernels occupied
//!    the GPU, not for the time its turn lasted. (See [`turn::Turn::charge`].)
//! 8. **Timeouts.** (`docs/scheduling.md#timeouts`) A turn whose client has not reported by its
//!    end plus the grace is revoked (the client is told to stop at once; its queued work is
//!    bounded by its hook, and the next turn started on time anyway) and charged as held until a
//!    late report settles it. A client that disconnects ends its turn at once.
//! 9. **Extension while alone.** (`docs/scheduling.md#extension`) A holder alone on the GPU keeps
//!    its turn a quota at a time. When another group asks, the turn ends a `min_quota_ns` later (or
//!    at its deadline before the extension, if later; less by `docs/scheduling.md#preemption`),
//!    announced as a cut-short turn.

mod group;
mod params;
mod turn;
mod water_fill;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod virtual_time;

pub use params::{GroupParams, PolicyConfig};
pub use turn::TurnUse;
pub use water_fill::{effective_requests, water_fill};

use group::Group;
use std::collections::BTreeMap;
use turn::Turn;

/// A client of the scheduler: one process's connection, as numbered by the daemon.
pub type ClientId = u64;

/// Ended turns awaiting their client's report, at most (the oldest is settled as held beyond).
const MAX_ENDED: usize = 1024;
/// Handoffs remembered until both their turns have reported, at most.
const MAX_HANDOFFS: usize = 256;
/// A group that came back from an absence, or went idle, this recently is taken to come back
/// and cut turns short (the others' turns get the shorter queue budget).
const RETURNS_NS: u64 = 1_000_000_000;

/// A handoff between two turns back to back, and what their clients measured around it: where
/// the one's kernels ended and the other's began.
#[derive(Debug, Clone)]
struct Handoff {
    before: (u64, String),
    after: (u64, String),
    /// The instant the charges divide at until both are known.
    at: u64,
    last_ns: Option<u64>,
    first_ns: Option<u64>,
}

/// What the shell must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Give `client` the turn `token` from `start_ns` (now, or ahead: when the turn before it
    /// ends) until `deadline_ns` (absolute, CLOCK_MONOTONIC). Sent again, same token, when a
    /// planned turn moves earlier (the one before it was yielded). Its client keeps at most
    /// `queue_budget_ns` of GPU work queued (see `PolicyConfig::queue_budget_ns`).
    Grant {
        client: ClientId,
        token: u64,
        start_ns: u64,
        deadline_ns: u64,
        quota_ns: u64,
        queue_budget_ns: u64,
    },
    /// Stop at once: the turn ended without a report by its end + grace, or a planned turn was
    /// withdrawn (its client has no more work).
    Revoke { client: ClientId, token: u64 },
    /// The turn now ends earlier, at `deadline_ns` (a group owed more is waiting).
    Shorten {
        client: ClientId,
        token: u64,
        deadline_ns: u64,
    },
    /// The turn now ends later, at `deadline_ns` (its group is still the one to serve).
    Extend {
        client: ClientId,
        token: u64,
        deadline_ns: u64,
    },
}

/// Errors of the policy's calls.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PolicyError {
    #[error("unknown group {0:?}")]
    UnknownGroup(String),
    #[error("invalid parameters for group {group:?}: {reason}")]
    InvalidParams { group: String, reason: String },
    #[error("unknown client {0}")]
    UnknownClient(ClientId),
}

/// What the policy sees on one GPU ([`Policy::status`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GpuStatus {
    /// The client whose turn runs now.
    pub holder: Option<ClientId>,
    /// The client whose turn is planned next.
    pub planned: Option<ClientId>,
    /// Clients waiting for a turn, longest waiting first.
    pub waiting: Vec<ClientId>,
    /// Every configured group, by name.
    pub groups: Vec<GroupStatus>,
    /// The holder's token.
    pub holder_token: Option<u64>,
    /// The holder's group.
    pub holder_group: Option<String>,
    /// The holder's deadline.
    pub holder_deadline_ns: Option<u64>,
    /// Sum of the groups' achieved shares: how busy the GPU was over the window.
    pub busy_share: f64,
}

/// One group's configuration, targets and accounting.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GroupStatus {
    pub name: String,
    pub params: GroupParams,
    /// The request, scaled down if the requests of all configured groups sum to more than 1.
    pub effective_request: f64,
    /// Water-filled share among the currently active groups (0 when not active).
    pub target_share: f64,
    /// Usage within the last window / window (includes the current holder's time so far).
    pub achieved_share: f64,
    /// Total usage charged, ns.
    pub busy_ns: u64,
    /// Turns granted.
    pub tokens: u64,
    /// Requests that could not be granted at once.
    pub waits: u64,
    /// Turns charged beyond their quota (including revoked ones).
    pub overruns: u64,
    /// Turns revoked at end + grace.
    pub revocations: u64,
    /// Turns cut short for a group owed more that came back (preemption).
    pub preempted: u64,
    /// Connected clients.
    pub clients: Vec<ClientId>,
    /// It has a turn, waits for one, or yielded one a moment ago.
    pub active: bool,
    /// Scheduling credit, ns (relative; positive = behind its target).
    pub credit_ns: f64,
    /// Token-bucket allowance, ns (`None` when `limit` is 1: never capped).
    pub allowance_ns: Option<f64>,
    /// Waiting but held back by its limit until the bucket refills.
    pub capped: bool,
}

#[derive(Debug, Clone)]
struct Client {
    group: String,
    /// Request sequence number while waiting.
    waiting: Option<u64>,
}

/// The fair-share policy of one GPU. See the [module documentation](self).
#[derive(Debug, Clone)]
pub struct Policy {
    cfg: PolicyConfig,
    groups: BTreeMap<String, Group>,
    clients: BTreeMap<ClientId, Client>,
    /// The turn running now (its start ≤ now < its deadline).
    current: Option<Turn>,
    /// The turn granted to follow (its start is in the future).
    next: Option<Turn>,
    /// Turns that ended and await their client's report, by token.
    ended: BTreeMap<u64, Turn>,
    /// Where the last turn ended: no turn starts before (a yielded turn's work drains until
    /// then).
    busy_until: u64,
    /// Recent handoffs awaiting their turns' reports (docs/scheduling.md#charges).
    handoffs: std::collections::VecDeque<Handoff>,
    next_token: u64,
    /// Latest time seen; calls with an earlier `now` are treated as happening now.
    now: u64,
    seq: u64,
    targets_dirty: bool,
    decisions: Vec<Decision>,
    /// When the first client asked for a turn: achieved shares are over at most the time
    /// since, so they are right from the first seconds.
    first_acquire: Option<u64>,
}

impl Policy {
    /// A policy with no groups. The configuration is used as given, except that a zero quota
    /// becomes 1 ns and `min_quota_ns` is lowered to `quota_ns` if above it.
    pub fn new(cfg: PolicyConfig) -> Policy {
        Policy {
            cfg: cfg.sanitized(),
            groups: BTreeMap::new(),
            clients: BTreeMap::new(),
            current: None,
            next: None,
            ended: BTreeMap::new(),
            busy_until: 0,
            handoffs: std::collections::VecDeque::new(),
            next_token: 1,
            now: 0,
            seq: 0,
            targets_dirty: false,
            decisions: Vec::new(),
            first_acquire: None,
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    /// Hot reload of the timing parameters. Turns granted keep their deadlines; buckets and
    /// credits are clamped to the new bounds.
    pub fn set_config(&mut self, cfg: PolicyConfig) {
        let now = self.now;
        let old_depth = self.cfg.bucket_depth();
        self.cfg = cfg.sanitized();
        let (depth, bounds, window) = (
            self.cfg.bucket_depth(),
            self.cfg.credit_bounds(),
            self.cfg.window_ns,
        );
        for g in self.groups.values_mut() {
            g.refill(now, old_depth);
            g.clamp(bounds, depth, window);
        }
    }

    /// Creates or updates (hot reload) a group. Takes effect for the next turn.
    pub fn set_group(&mut self, name: &str, p: GroupParams) -> Result<(), PolicyError> {
        p.validate().map_err(|reason| PolicyError::InvalidParams {
            group: name.to_string(),
            reason,
        })?;
        let now = self.now;
        let (depth, bounds, window) = (
            self.cfg.bucket_depth(),
            self.cfg.credit_bounds(),
            self.cfg.window_ns,
        );
        match self.groups.get_mut(name) {
            Some(g) => {
                g.refill(now, depth);
                let was_capped = g.capped();
                g.params = p;
                if !was_capped {
                    // The bucket was not maintained while uncapped: start full.
                    g.fill_bucket(now, depth);
                }
                g.clamp(bounds, depth, window);
            }
            None => {
                self.groups
                    .insert(name.to_string(), Group::new(p, now, depth));
            }
        }
        self.targets_dirty = true;
        Ok(())
    }

    /// Removes a group; its clients are disconnected (a turn of theirs ends at once). Unknown
    /// names are ignored.
    pub fn remove_group(&mut self, name: &str, now: u64) {
        let Some(g) = self.groups.get(name) else {
            return;
        };
        let clients = g.clients.clone();
        let now = self.advance(now);
        for c in clients {
            self.detach(c, now);
        }
        self.groups.remove(name);
        self.targets_dirty = true;
        self.plan(now);
    }

    /// Connects `client` to `group`. Connecting again to the same group does nothing; connecting
    /// to another group moves the client (as if it had disconnected, at the latest time seen).
    pub fn connect(&mut self, client: ClientId, group: &str) -> Result<(), PolicyError> {
        if !self.groups.contains_key(group) {
            return Err(PolicyError::UnknownGroup(group.to_string()));
        }
        let mut moved = false;
        if let Some(c) = self.clients.get(&client) {
            if c.group == group {
                return Ok(());
            }
            self.detach(client, self.now);
            moved = true;
        }
        self.clients.insert(
            client,
            Client {
                group: group.to_string(),
                waiting: None,
            },
        );
        self.groups
            .get_mut(group)
            .expect("checked above")
            .clients
            .push(client);
        self.targets_dirty = true;
        if moved {
            self.plan(self.now);
        }
        Ok(())
    }

    /// Disconnects `client`: it stops waiting, its running turn ends at once (charged as held)
    /// and the next one starts, a turn planned for it is dropped. Unknown clients are ignored.
    pub fn disconnect(&mut self, client: ClientId, now: u64) {
        if !self.clients.contains_key(&client) {
            return;
        }
        let now = self.advance(now);
        self.detach(client, now);
        self.plan(now);
    }

    /// `client` wants a turn. Idempotent while it waits or has one planned; the holder asking
    /// queues for its next turn.
    pub fn acquire(&mut self, client: ClientId, now: u64) -> Result<(), PolicyError> {
        if !self.clients.contains_key(&client) {
            return Err(PolicyError::UnknownClient(client));
        }
        let now = self.advance(now);
        self.first_acquire.get_or_insert(now);
        if self.next.as_ref().is_some_and(|t| t.client == client) {
            return Ok(());
        }
        if self.clients[&client].waiting.is_some() {
            return Ok(());
        }
        let group = self.clients[&client].group.clone();
        // Back with work while it has no turn: served before the turn that would run next if it
        // is owed more (docs/scheduling.md#preemption).
        let returning = self.groups[&group].turns == 0;
        if !self.enqueue(client, now) {
            return Ok(());
        }
        if self.current.is_none() {
            // The GPU is free until a capped group's planned turn: served in between if it may.
            self.reclaim_gap(now);
            self.plan(now);
        }
        let holding = self.current.as_ref().is_some_and(|t| t.client == client);
        if self.clients[&client].waiting.is_some() && !holding {
            self.groups.get_mut(&group).expect("exists").waits += 1;
            if returning {
                self.preempt_for(&group, now);
            }
            self.end_extension(&group, now);
            self.plan(now);
        }
        self.mark_held_back(now);
        Ok(())
    }

    /// `client` gives back its turn `token` before its deadline: it has no more work for now
    /// (it asks again when it has), and what it launched drains at about `drained_ns`. The next
    /// turn starts there (at most a minimum quota from now, and not after the deadline).
    /// Yielding a planned turn withdraws it. Stale tokens are ignored.
    pub fn yield_turn(
        &mut self,
        client: ClientId,
        token: u64,
        drained_ns: u64,
        now: u64,
    ) -> Result<(), PolicyError> {
        if !self.clients.contains_key(&client) {
            return Err(PolicyError::UnknownClient(client));
        }
        let now = self.advance(now);
        self.dequeue(client, now);
        if self
            .next
            .as_ref()
            .is_some_and(|t| t.token == token && t.client == client)
        {
            self.withdraw_next(now);
            self.plan(now);
        } else if self
            .current
            .as_ref()
            .is_some_and(|t| t.token == token && t.client == client)
        {
            // Never past its deadline: a yield does not lengthen a turn.
            let (deadline, group) = (self.current.as_ref())
                .map_or((now, String::new()), |t| (t.deadline_ns, t.group.clone()));
            let at = drained_ns.clamp(now, (now + self.cfg.min_quota_ns).min(deadline).max(now));
            self.yield_current(at, now);
            if let Some(g) = self.groups.get_mut(&group) {
                g.gave_back_at = at;
            }
        }
        self.mark_held_back(now);
        Ok(())
    }

    /// `client` reports what it measured of its turn `token` once the turn's work drained
    /// (`used`: `None` if it launched nothing), and whether it has more work (`again`: it stays
    /// queued for a turn; else it leaves the queue). Settles the turn's charge (docs/scheduling.md#charges). A report of the running turn ends it there (the client
    /// stopped on its own, say at a deadline it had not yet heard was extended). Unknown tokens
    /// are ignored, but `again` is always taken in.
    pub fn report(
        &mut self,
        client: ClientId,
        token: u64,
        used: Option<TurnUse>,
        again: bool,
        now: u64,
    ) -> Result<(), PolicyError> {
        if !self.clients.contains_key(&client) {
            return Err(PolicyError::UnknownClient(client));
        }
        let now = self.advance(now);
        if self
            .current
            .as_ref()
            .is_some_and(|t| t.token == token && t.client == client)
        {
            self.yield_current(now, now);
        }
        if self.ended.get(&token).is_some_and(|t| t.client == client) {
            let t = self.ended.remove(&token).expect("checked");
            self.settle(t, used, now);
            self.note_handoffs(token, used, now);
        }
        if again {
            self.enqueue(client, now);
        } else {
            // A turn already planned for it stays: it yields that if it still has nothing to do
            // when it comes (a bursty client often has again by then).
            self.dequeue(client, now);
        }
        self.plan(now);
        self.mark_held_back(now);
        Ok(())
    }

    /// Handles the passage of time: turns end at their deadlines and the planned ones start,
    /// the next turn is planned, turns without a report by end + grace are revoked, and a
    /// capped group whose bucket refilled while it waited is served like one returning.
    pub fn tick(&mut self, now: u64) {
        let now = self.advance(now);
        let grace = self.cfg.grace_ns;
        let overdue: Vec<u64> = self
            .ended
            .values()
            .filter(|t| !t.revoked && now >= t.end().saturating_add(grace))
            .map(|t| t.token)
            .collect();
        for token in overdue {
            let mut t = self.ended.remove(&token).expect("listed above");
            t.revoked = true;
            if let Some(g) = self.groups.get_mut(&t.group) {
                g.revocations += 1;
                g.overruns += 1;
            }
            // Charged as held until a late report says otherwise.
            self.charge_turn(&mut t, None, now);
            self.decisions.push(Decision::Revoke {
                client: t.client,
                token,
            });
            self.ended.insert(token, t);
        }
        // A client whose turn ended a grace ago without a report may be stopped: it is
        // not presumed to want another (it asks again when it reports), and a turn of its that
        // started since, which it cannot use, ends now.
        let silence = self.silence_ns();
        let silent: Vec<(ClientId, u64)> = self
            .ended
            .values_mut()
            .filter(|t| !t.yielded && !t.silenced && now >= t.end().saturating_add(silence))
            .map(|t| {
                t.silenced = true;
                (t.client, t.end())
            })
            .collect();
        for (client, ended_at) in silent {
            self.dequeue(client, now);
            if let Some(t) = self
                .current
                .as_ref()
                .filter(|t| t.client == client && t.start_ns >= ended_at)
            {
                let token = t.token;
                self.yield_current(now, now);
                self.decisions.push(Decision::Revoke { client, token });
            }
            if let Some(t) = self.next.as_ref().filter(|t| t.client == client) {
                let token = t.token;
                self.withdraw_next(now);
                self.decisions.push(Decision::Revoke { client, token });
            }
        }
        let (depth, thr) = (self.cfg.bucket_depth(), self.cfg.cap_threshold());
        let refilled: Vec<String> = self
            .groups
            .iter()
            .filter(|(_, g)| g.held_back && g.eligible(now, depth, thr))
            .map(|(n, _)| n.clone())
            .collect();
        for name in refilled {
            self.preempt_for(&name, now);
        }
        if self.current.is_none() {
            // The GPU fell free before a capped group's planned turn (its bucket refills a
            // moment later), while another group that may start waits: served in between.
            self.reclaim_gap(now);
        }
        self.plan(now);
        self.mark_held_back(now);
    }

    /// The decisions taken since the last call, in order.
    pub fn take_decisions(&mut self) -> Vec<Decision> {
        std::mem::take(&mut self.decisions)
    }

    /// The earliest time at which [`Policy::tick`] has something to do: the running turn's end
    /// or the time to plan the next, a planned turn's start, a revocation, a capped group's
    /// refill. May be in the past (then tick at once); `None` when nothing is pending.
    pub fn next_wakeup(&self, _now: u64) -> Option<u64> {
        let (depth, thr) = (self.cfg.bucket_depth(), self.cfg.cap_threshold());
        let ahead = self.cfg.grant_ahead_ns;
        let mut at: Vec<u64> = Vec::new();
        // When a waiting group may start a turn at `start`, less the grant-ahead.
        let planning = |start: u64| {
            self.groups
                .values()
                .filter(|g| !g.queue.is_empty())
                .filter_map(move |g| g.eligible_at(start, depth, thr))
                .map(move |t| t.saturating_sub(ahead))
        };
        if let Some(c) = &self.current {
            at.push(c.deadline_ns);
            let plan_at = c.deadline_ns.saturating_sub(ahead).max(c.start_ns);
            if self.next.is_none() {
                if self.now < plan_at {
                    at.push(plan_at);
                } else {
                    at.extend(planning(c.deadline_ns));
                }
            }
            // A held-back group's refill may cut the running turn short.
            at.extend(
                self.groups
                    .values()
                    .filter(|g| g.held_back)
                    .filter_map(|g| g.eligible_at(self.now, depth, thr)),
            );
        }
        if let Some(n) = &self.next {
            at.push(n.start_ns);
        }
        if self.current.is_none() && self.next.is_none() {
            at.extend(planning(self.busy_until.max(self.now)));
        }
        at.extend(
            self.ended
                .values()
                .filter(|t| !t.revoked)
                .map(|t| t.end().saturating_add(self.cfg.grace_ns)),
        );
        // A silent client leaves the queue and its turns (see `tick`).
        at.extend(
            self.ended
                .values()
                .filter(|t| !t.yielded && !t.silenced)
                .map(|t| t.end().saturating_add(self.silence_ns()))
                .filter(|&t| t > self.now),
        );
        at.into_iter().min()
    }

    /// What the policy sees at `now`.
    pub fn status(&self, now: u64) -> GpuStatus {
        let now = now.max(self.now);
        let all: Vec<GroupParams> = self.groups.values().map(|g| g.params).collect();
        let eff = effective_requests(&all);
        let active: Vec<GroupParams> = self
            .groups
            .values()
            .filter(|g| g.active_at(now))
            .map(|g| g.params)
            .collect();
        let mut targets = water_fill(&active).into_iter();
        let since_start = now.saturating_sub(self.first_acquire.unwrap_or(now)).max(1);
        let window = self.cfg.window_ns.min(since_start);
        let from = now.saturating_sub(window);
        let (depth, thr) = (self.cfg.bucket_depth(), self.cfg.cap_threshold());
        let mut groups = Vec::with_capacity(self.groups.len());
        for (i, (name, g)) in self.groups.iter().enumerate() {
            let mut used = g.usage_within(from, now);
            if let Some(t) = self.current.as_ref().filter(|t| &t.group == name) {
                used += now.saturating_sub(t.start_ns.max(from)) as f64;
            }
            groups.push(GroupStatus {
                name: name.clone(),
                params: g.params,
                effective_request: eff[i],
                target_share: if g.active_at(now) {
                    targets.next().unwrap_or(0.0)
                } else {
                    0.0
                },
                achieved_share: used / window as f64,
                busy_ns: g.busy_ns,
                tokens: g.tokens,
                waits: g.waits,
                overruns: g.overruns,
                revocations: g.revocations,
                preempted: g.preempted,
                clients: g.clients.clone(),
                active: g.active_at(now),
                credit_ns: g.credit,
                allowance_ns: g.capped().then(|| g.allowance(now, depth)),
                capped: !g.queue.is_empty() && !g.eligible(now, depth, thr),
            });
        }
        let mut waiting: Vec<(u64, ClientId)> = self
            .clients
            .iter()
            .filter_map(|(&id, c)| c.waiting.map(|s| (s, id)))
            .collect();
        waiting.sort_unstable();
        GpuStatus {
            holder: self.current.as_ref().map(|t| t.client),
            planned: self.next.as_ref().map(|t| t.client),
            waiting: waiting.into_iter().map(|(_, id)| id).collect(),
            busy_share: groups.iter().map(|g| g.achieved_share).sum(),
            groups,
            holder_token: self.current.as_ref().map(|t| t.token),
            holder_group: self.current.as_ref().map(|t| t.group.clone()),
            holder_deadline_ns: self.current.as_ref().map(|t| t.deadline_ns),
        }
    }

    /// The running turn's client and token.
    pub fn holder(&self) -> Option<(ClientId, u64)> {
        self.current.as_ref().map(|t| (t.client, t.token))
    }

    /// The group `client` is connected to.
    pub fn client_group(&self, client: ClientId) -> Option<&str> {
        self.clients.get(&client).map(|c| c.group.as_str())
    }

    /// A group's parameters.
    pub fn group_params(&self, name: &str) -> Option<GroupParams> {
        self.groups.get(name).map(|g| g.params)
    }

    // ---- internals ----

    /// How long after a turn's end without its report its client is taken to be stopped: the
    /// grace (its hook reports as the turn's work drains, a few ms at most).
    fn silence_ns(&self) -> u64 {
        self.cfg.grace_ns
    }

    /// Moves the clock to `now` (never backwards): credit accrues for the time a turn ran,
    /// turns end at their deadlines and planned ones start, groups that yielded stop counting
    /// as active once their work drained.
    fn advance(&mut self, now: u64) -> u64 {
        let now = now.max(self.now);
        loop {
            let t = self.now;
            if let Some(turn) = self.current.take_if(|c| c.deadline_ns <= t) {
                let end = turn.deadline_ns;
                self.end_turn(turn, end);
            }
            self.promote(t);
            if t >= now {
                return now;
            }
            let step = self
                .groups
                .values()
                .map(|g| g.draining_until)
                .chain(self.current.as_ref().map(|c| c.deadline_ns))
                .chain(self.next.as_ref().map(|n| n.start_ns))
                .filter(|&x| x > t)
                .fold(now, u64::min);
            self.refresh_targets();
            if self.current.is_some() {
                self.accrue((step - t) as f64);
            }
            self.now = step;
            if self
                .groups
                .values()
                .any(|g| g.draining_until == step && !g.wants())
            {
                self.targets_dirty = true;
            }
        }
    }

    /// The running turn ends at `at` (≥ now) before its deadline (yielded, or its client lost):
    /// the planned turn, if any, is moved to start there; else the next one is chosen now to
    /// start there.
    fn yield_current(&mut self, at: u64, now: u64) {
        let Some(mut t) = self.current.take() else {
            return;
        };
        t.yielded = true;
        if let Some(g) = self.groups.get_mut(&t.group) {
            g.draining_until = at + self.cfg.min_quota_ns / 4;
        }
        if let Some(n) = self.next.as_mut() {
            n.deadline_ns = at + n.quota_ns;
            n.start_ns = at;
            if let Some(h) = self.handoffs.iter_mut().find(|h| h.after.0 == n.token) {
                h.at = at;
            }
            self.decisions.push(Decision::Grant {
                client: n.client,
                token: n.token,
                start_ns: n.start_ns,
                deadline_ns: n.deadline_ns,
                quota_ns: n.quota_ns,
                queue_budget_ns: n.queue_budget_ns,
            });
            self.end_turn(t, at);
            self.promote(now);
        } else {
            self.end_turn(t, at);
            self.plan_at(now, at, true);
        }
    }

    /// The planned turn becomes the running one once it starts.
    fn promote(&mut self, now: u64) {
        if self.current.is_none()
            && let Some(n) = self.next.take_if(|n| n.start_ns <= now)
        {
            self.current = Some(n);
        }
    }

    /// Ends turn `t` at `at` (its deadline, a yield, a disconnect): it awaits its client's
    /// report, charged as reserved until then.
    fn end_turn(&mut self, mut t: Turn, at: u64) {
        t.end_ns = Some(at);
        self.busy_until = self.busy_until.max(at);
        t.followed = self.next.as_ref().is_some_and(|n| n.start_ns <= at);
        if let Some(n) = self.next.as_mut().filter(|n| n.start_ns <= at) {
            n.after_turn = true;
        }
        if let Some(g) = self.groups.get_mut(&t.group) {
            g.turns = g.turns.saturating_sub(1);
            g.last_active = at;
            if !g.wants() {
                self.targets_dirty = true;
            }
        }
        if self.ended.len() >= MAX_ENDED
            && let Some((_, oldest)) = self.ended.pop_first()
        {
            self.settle(oldest, None, at);
        }
        self.ended.insert(t.token, t);
    }

    /// Turn `token`'s client measured `used`: where a handoff it took part in is now known on
    /// both sides, the charges divide there instead of at the planned instant — midway between
    /// the one's last kernel and the other's first launch, as the GPU time-slices the two in
    /// between (at most a queue budget either way). A holder whose kernels ran on past its turn
    /// pays for them; one whose kernels ended early does not pay for the GPU idling before the
    /// next holder's first (nor does that one).
    fn note_handoffs(&mut self, token: u64, used: Option<TurnUse>, now: u64) {
        for h in self.handoffs.iter_mut() {
            if h.before.0 == token {
                h.last_ns = used.map(|u| u.last_ns);
            }
            if h.after.0 == token {
                h.first_ns = used.map(|u| u.first_ns);
            }
        }
        let (lo, _) = self.cfg.credit_bounds();
        let (depth, window) = (self.cfg.bucket_depth(), self.cfg.window_ns);
        let cap = 2_500_000i64;
        let mut i = 0;
        while i < self.handoffs.len() {
            let h = &self.handoffs[i];
            let (Some(last), Some(first)) = (h.last_ns, h.first_ns) else {
                i += 1;
                continue;
            };
            let middle = (first as i128 + last as i128) / 2;
            let shift = (middle - h.at as i128).clamp(-(cap as i128), cap as i128) as f64;
            let h = self.handoffs.remove(i).expect("in range");
            if let Some(g) = self.groups.get_mut(&h.before.1) {
                g.settle(shift, now, lo, depth, window);
            }
            if let Some(g) = self.groups.get_mut(&h.after.1) {
                g.settle(-shift, now, lo, depth, window);
            }
        }
    }

    /// Charges turn `t` what its client's report says (`None`: as held), settling what was
    /// debited and recorded for it so far (it may be charged again: a revoked turn's late
    /// report).
    fn charge_turn(&mut self, t: &mut Turn, used: Option<TurnUse>, now: u64) {
        let total = t.charge(used, self.cfg.grace_ns);
        let (lo, _) = self.cfg.credit_bounds();
        let (depth, window) = (self.cfg.bucket_depth(), self.cfg.window_ns);
        let Some(g) = self.groups.get_mut(&t.group) else {
            return;
        };
        g.settle(total as f64 - t.applied as f64, now, lo, depth, window);
        g.record_usage(t.token, t.start_ns, total.saturating_sub(t.recorded));
        if total > t.quota_ns + self.cfg.min_quota_ns / 4 && !t.revoked {
            g.overruns += 1;
        }
        g.prune_usage(now.saturating_sub(window));
        t.applied = total;
        t.recorded = t.recorded.max(total);
    }

    /// Charges turn `t` what its client's report says and forgets it.
    fn settle(&mut self, mut t: Turn, used: Option<TurnUse>, now: u64) {
        self.charge_turn(&mut t, used, now);
    }

    /// Queues `client` for a turn (no-op if it waits already). Returns whether it waits now.
    fn enqueue(&mut self, client: ClientId, now: u64) -> bool {
        let Some(c) = self.clients.get_mut(&client) else {
            return false;
        };
        if c.waiting.is_some() {
            return true;
        }
        let seq = self.seq;
        self.seq += 1;
        c.waiting = Some(seq);
        let away_ns = self.cfg.away_ns();
        let g = self
            .groups
            .get_mut(&c.group)
            .expect("clients belong to groups");
        if !g.active_at(now) {
            self.targets_dirty = true;
        }
        if !g.wants() && g.last_active > 0 && now >= g.last_active.saturating_add(away_ns) {
            g.returned_at = now;
        }
        g.queue.push_back((client, seq));
        true
    }

    /// Takes `client` out of its group's queue.
    fn dequeue(&mut self, client: ClientId, now: u64) {
        let Some(c) = self.clients.get_mut(&client) else {
            return;
        };
        if c.waiting.take().is_none() {
            return;
        }
        let g = self
            .groups
            .get_mut(&c.group)
            .expect("clients belong to groups");
        g.queue.retain(|&(id, _)| id != client);
        g.last_active = now;
        if !g.wants() {
            self.targets_dirty = true;
        }
    }

    /// The GPU is free now and the planned turn starts later (a capped group's, when its bucket
    /// refills): withdraw it (its client waits again, first in its group) if a group that may
    /// start now waits, so the GPU is not left idle meanwhile.
    fn reclaim_gap(&mut self, now: u64) {
        let (depth, thr) = (self.cfg.bucket_depth(), self.cfg.cap_threshold());
        let Some(n) = self
            .next
            .as_ref()
            .filter(|n| n.start_ns > now && !n.after_turn)
        else {
            return;
        };
        let (client, token, group) = (n.client, n.token, n.group.clone());
        if !self
            .groups
            .iter()
            .any(|(name, g)| *name != group && !g.queue.is_empty() && g.eligible(now, depth, thr))
        {
            return;
        }
        self.withdraw_next(now);
        self.decisions.push(Decision::Revoke { client, token });
        let seq = self.seq;
        self.seq += 1;
        if let Some(c) = self.clients.get_mut(&client) {
            c.waiting = Some(seq);
            if let Some(g) = self.groups.get_mut(&c.group) {
                // Once in the queue at most: it may have asked for a further turn already.
                g.queue.retain(|&(id, _)| id != client);
                g.queue.push_front((client, seq));
            }
        }
    }

    /// Drops the planned turn (its client no longer wants it, or is gone): its reservation is
    /// returned.
    fn withdraw_next(&mut self, now: u64) {
        let Some(t) = self.next.take() else {
            return;
        };
        let (lo, _) = self.cfg.credit_bounds();
        let (depth, window) = (self.cfg.bucket_depth(), self.cfg.window_ns);
        if let Some(g) = self.groups.get_mut(&t.group) {
            g.turns = g.turns.saturating_sub(1);
            g.tokens = g.tokens.saturating_sub(1);
            g.settle(-(t.applied as f64), now, lo, depth, window);
            if !g.wants() {
                self.targets_dirty = true;
            }
        }
    }

    /// Removes `client` from its group, the queue and the turns (a running one ends now,
    /// charged as held; a planned one is dropped), without planning anyone.
    fn detach(&mut self, client: ClientId, now: u64) {
        self.dequeue(client, now);
        let Some(c) = self.clients.remove(&client) else {
            return;
        };
        if let Some(g) = self.groups.get_mut(&c.group) {
            g.clients.retain(|&id| id != client);
        }
        if self.next.as_ref().is_some_and(|t| t.client == client) {
            self.withdraw_next(now);
        }
        if self.current.as_ref().is_some_and(|t| t.client == client) {
            self.yield_current(now, now);
        }
        let gone: Vec<u64> = self
            .ended
            .values()
            .filter(|t| t.client == client)
            .map(|t| t.token)
            .collect();
        for token in gone {
            let t = self.ended.remove(&token).expect("listed above");
            self.settle(t, None, now);
        }
        self.targets_dirty = true;
    }

    /// Plans the next turn if it is time: with a turn running, a grant-ahead before its end
    /// (the holder counts as waiting for another unless it yielded); with none, at once or, for
    /// a capped group, a grant-ahead before its bucket refills.
    fn plan(&mut self, now: u64) {
        if self.next.is_some() {
            return;
        }
        match &self.current {
            Some(c) => {
                if now < c.deadline_ns.saturating_sub(self.cfg.grant_ahead_ns) {
                    return;
                }
                let (client, deadline, yielded) = (c.client, c.deadline_ns, c.yielded);
                if !yielded {
                    self.enqueue(client, now);
                }
                self.plan_at(now, deadline, true);
            }
            None => {
                let start = self.busy_until.max(now);
                self.plan_at(now, start, self.busy_until > 0 && start == self.busy_until);
            }
        }
    }

    /// Chooses the turn that starts at `start` (or when the chosen group's bucket allows, if
    /// later: then the GPU is free in between and the grant waits until a grant-ahead before
    /// that) and grants it, or extends the running turn if its client is the one chosen.
    fn plan_at(&mut self, now: u64, start: u64, after_turn: bool) {
        let Some((name, at)) = self.best_candidate(start) else {
            return;
        };
        if at > start && at.saturating_sub(self.cfg.grant_ahead_ns) > now {
            return; // planned later (next_wakeup says when)
        }
        // The turn's length depends on its group's target among the groups active now.
        self.refresh_targets();
        let (lo, _) = self.cfg.credit_bounds();
        let (depth, window) = (self.cfg.bucket_depth(), self.cfg.window_ns);
        let (quota, min_quota) = (self.cfg.quota_ns, self.cfg.min_quota_ns);
        let others_active = self
            .groups
            .iter()
            .any(|(n, g)| *n != name && g.active_at(now));
        let g = self.groups.get_mut(&name).expect("chosen from the groups");
        let (client, _) = g.queue.pop_front().expect("a waiting client");
        let mut quota_ns = if others_active {
            self.cfg.contested_turn_ns(g.target)
        } else {
            quota
        };
        if g.capped() {
            g.refill(now, depth);
            quota_ns = quota_ns.min(g.allowance(at, depth).floor().max(0.0) as u64);
        }
        let quota_ns = quota_ns.max(min_quota);
        g.reserve(quota_ns, now, lo, depth, window);
        if let Some(c) = self.clients.get_mut(&client) {
            c.waiting = None;
        }
        // Its own client again, alone on the GPU: the turn goes on (extended). With others
        // waiting it gets a new turn back to back, which its hook reports the one before for:
        // a holder that has stopped is noticed at the handoff (see `tick`).
        if let Some(cur) = self.current.as_mut().filter(|c| {
            c.client == client && c.deadline_ns == start && at == start && !others_active
        }) {
            cur.unextended.get_or_insert(cur.deadline_ns);
            cur.deadline_ns += quota_ns;
            cur.quota_ns += quota_ns;
            cur.applied += quota_ns;
            self.decisions.push(Decision::Extend {
                client,
                token: cur.token,
                deadline_ns: cur.deadline_ns,
            });
            return;
        }
        g.turns += 1;
        g.tokens += 1;
        let token = self.next_token;
        self.next_token += 1;
        let start_ns = at.max(now);
        // Another group that may come back and cut this turn short then waits behind what its
        // holder has queued: one whose bucket holds it back, one connected and idle since less
        // than a second, or one that came back from an absence within the last second (a
        // request server or bursty client, even while it holds or awaits a turn now; a trainer
        // that synchronises asks again at once and is no such group). A group that comes and
        // goes keeps its own turns short too: its hook tells when its work drains from fences
        // the shorter budget places closer together.
        let recent = |at: u64| at > 0 && now < at.saturating_add(RETURNS_NS);
        let may_be_cut = self.groups.iter().any(|(n, g)| {
            *n == name && recent(g.returned_at)
                || *n != name
                    && !g.clients.is_empty()
                    && (g.held_back || recent(g.returned_at) || !g.wants() && recent(g.last_active))
        });
        let turn = Turn {
            client,
            group: name,
            token,
            start_ns,
            deadline_ns: start_ns + quota_ns,
            unextended: None,
            quota_ns,
            after_turn: after_turn && start_ns == start,
            contested: others_active,
            end_ns: None,
            followed: false,
            yielded: false,
            revoked: false,
            silenced: false,
            applied: quota_ns,
            recorded: 0,
            queue_budget_ns: self.cfg.queue_budget_ns(quota_ns, may_be_cut),
        };
        self.decisions.push(Decision::Grant {
            client,
            token,
            start_ns: turn.start_ns,
            deadline_ns: turn.deadline_ns,
            quota_ns,
            queue_budget_ns: turn.queue_budget_ns,
        });
        if turn.after_turn {
            let before = match self.current.as_ref().filter(|c| c.deadline_ns == start_ns) {
                Some(c) => Some((c.token, c.group.clone())),
                None => self
                    .ended
                    .values_mut()
                    .rev()
                    .find(|t| t.end() == start_ns)
                    .map(|prev| {
                        prev.followed = true;
                        (prev.token, prev.group.clone())
                    }),
            };
            if let Some(before) = before {
                if self.handoffs.len() >= MAX_HANDOFFS {
                    self.handoffs.pop_front();
                }
                self.handoffs.push_back(Handoff {
                    before,
                    after: (token, turn.group.clone()),
                    at: start_ns,
                    last_ns: None,
                    first_ns: None,
                });
            }
        }
        self.next = Some(turn);
        self.promote(now);
    }

    /// The waiting group to serve at `start`, and when it may start (≥ `start`): the one with
    /// the most credit among those that may start then; if none may, the one that may soonest.
    fn best_candidate(&self, start: u64) -> Option<(String, u64)> {
        let (depth, thr) = (self.cfg.bucket_depth(), self.cfg.cap_threshold());
        let waiting = || self.groups.iter().filter(|(_, g)| !g.queue.is_empty());
        let eligible = waiting()
            .filter(|(_, g)| g.eligible(start, depth, thr))
            .max_by(|(_, a), (_, b)| {
                a.credit
                    .total_cmp(&b.credit)
                    .then_with(|| b.queue[0].1.cmp(&a.queue[0].1))
            });
        if let Some((name, _)) = eligible {
            return Some((name.clone(), start));
        }
        waiting()
            .filter_map(|(n, g)| Some((n.clone(), g.eligible_at(start, depth, thr)?)))
            .min_by_key(|(_, at)| *at)
    }

    /// `group` asks while the running turn is extended because its holder was alone (point
    /// 7): the turn ends a minimum quota from now, or at its deadline before the extension if
    /// that is later.
    fn end_extension(&mut self, group: &str, now: u64) {
        let min_quota = self.cfg.min_quota_ns;
        let Some(t) = self.current.as_mut().filter(|t| t.group != group) else {
            return;
        };
        let Some(unextended) = t.unextended.take() else {
            return;
        };
        let deadline_ns = now.saturating_add(min_quota).max(unextended);
        if deadline_ns < t.deadline_ns {
            t.deadline_ns = deadline_ns;
            self.decisions.push(Decision::Shorten {
                client: t.client,
                token: t.token,
                deadline_ns,
            });
        }
    }

    /// `group` just returned with work (docs/scheduling.md#preemption): if it is owed more than the holder will be
    /// once its turn is settled, by a minimum quota at least, the turn that would run before
    /// it — the planned one, else the running one — ends now, but never below a minimum quota
    /// after its start.
    fn preempt_for(&mut self, group: &str, now: u64) {
        let (depth, thr) = (self.cfg.bucket_depth(), self.cfg.cap_threshold());
        let min_quota = self.cfg.min_quota_ns;
        let Some(g) = self.groups.get(group) else {
            return;
        };
        if !g.eligible(now, depth, thr) {
            return;
        }
        let (credit, gave_back_at) = (g.credit, g.gave_back_at);
        let turn = match self.next.as_mut() {
            Some(n) => n,
            None => match self.current.as_mut() {
                Some(c) => c,
                None => return,
            },
        };
        if turn.group == group {
            return;
        }
        let Some(hg) = self.groups.get(&turn.group) else {
            return;
        };
        let held = now.saturating_sub(turn.start_ns);
        let settled = hg.credit + turn.applied as f64 - held as f64;
        // Owed more than the holder by a minimum quota at least (not for a tie: a handoff
        // costs both a little).
        if credit - settled <= min_quota as f64 {
            return;
        }
        // A turn the group gave its own turn back to is taken back sooner: a request server
        // with requests queued returns as soon as its synchronisation does, and waiting out
        // the minimum quota there would delay each queued request by it.
        let floor = if gave_back_at == turn.start_ns {
            self.cfg.take_back_ns()
        } else {
            min_quota
        };
        let deadline_ns = turn.start_ns.saturating_add(floor).max(now);
        if deadline_ns >= turn.deadline_ns {
            return;
        }
        turn.deadline_ns = deadline_ns;
        turn.unextended = None;
        let (client, token, tg) = (turn.client, turn.token, turn.group.clone());
        if let Some(hg) = self.groups.get_mut(&tg) {
            hg.preempted += 1;
        }
        self.decisions.push(Decision::Shorten {
            client,
            token,
            deadline_ns,
        });
    }

    /// Notes which waiting groups their bucket holds back (see [`Policy::tick`]).
    fn mark_held_back(&mut self, now: u64) {
        let (depth, thr) = (self.cfg.bucket_depth(), self.cfg.cap_threshold());
        for g in self.groups.values_mut() {
            g.held_back = !g.queue.is_empty() && !g.eligible(now, depth, thr);
        }
    }

    fn refresh_targets(&mut self) {
        if !self.targets_dirty {
            return;
        }
        self.targets_dirty = false;
        let now = self.now;
        // Guarantees of the groups with processes on this GPU (requests scaled down if they
        // sum to more than 1); a configured group with none here has nothing to bank.
        let present: Vec<GroupParams> = self
            .groups
            .values()
            .filter(|g| !g.clients.is_empty())
            .map(|g| g.params)
            .collect();
        let mut eff = effective_requests(&present).into_iter();
        for g in self.groups.values_mut() {
            g.guarantee = if g.clients.is_empty() {
                0.0
            } else {
                eff.next().unwrap_or(0.0)
            };
        }
        // A group that goes idle having had less than its guarantee over the window (it needs
        // less, or was kept waiting) banks it (see `accrue`); it counts here as taking exactly
        // its guarantee, so the bank comes out of the spare time, never out of another group's
        // guarantee.
        let since = now.saturating_sub(self.first_acquire.unwrap_or(now)).max(1);
        let window = self.cfg.window_ns.min(since);
        for g in self.groups.values_mut() {
            g.banks = match (g.active_at(now), g.banks) {
                (true, _) => None,
                (false, Some(b)) => Some(b),
                (false, None) => {
                    let used = g.usage_within(now.saturating_sub(window), now);
                    Some(used < g.guarantee * window as f64)
                }
            };
        }
        let counted: Vec<GroupParams> = self
            .groups
            .values()
            .filter(|g| g.active_at(now) || g.banking(now))
            .map(|g| {
                if g.active_at(now) {
                    g.params
                } else {
                    GroupParams {
                        request: g.guarantee,
                        limit: g.guarantee,
                        weight: g.params.weight,
                    }
                }
            })
            .collect();
        let mut targets = water_fill(&counted).into_iter();
        for g in self.groups.values_mut() {
            g.target = if g.active_at(now) || g.banking(now) {
                targets.next().unwrap_or(0.0)
            } else {
                0.0
            };
        }
    }

    /// Credit accrual over `dt` ns of a running turn: each active group at its target share,
    /// each idle group with a request at its guarantee, normalised (so exactly `dt` is handed
    /// out); credit a group cannot absorb above the upper bound is redistributed by weight to
    /// the active groups below their limit; finally all groups are shifted by their common
    /// mean — which leaves every difference, and so every decision, unchanged, but keeps the
    /// values centred on the bounds.
    fn accrue(&mut self, dt: f64) {
        let (lo, hi) = self.cfg.credit_bounds();
        let now = self.now;
        let total: f64 = self.groups.values().map(|g| g.target).sum();
        if total <= 0.0 {
            return;
        }
        let mut overflow = 0.0;
        for g in self.groups.values_mut() {
            g.credit += g.target / total * dt;
            if g.credit > hi {
                overflow += g.credit - hi;
                g.credit = hi;
            }
        }
        let recipient = |g: &Group| g.active_at(now) && g.credit < hi && g.target < g.params.limit;
        for _ in 0..=self.groups.len() {
            if overflow <= 1e-6 {
                break;
            }
            let weights: f64 = self
                .groups
                .values()
                .filter(|g| recipient(g))
                .map(|g| g.params.weight)
                .sum();
            if weights <= 0.0 {
                break;
            }
            let pool = std::mem::take(&mut overflow);
            for g in self.groups.values_mut().filter(|g| recipient(g)) {
                g.credit += pool * g.params.weight / weights;
                if g.credit > hi {
                    overflow += g.credit - hi;
                    g.credit = hi;
                }
            }
        }
        let mean = self.groups.values().map(|g| g.credit).sum::<f64>() / self.groups.len() as f64;
        for g in self.groups.values_mut() {
            g.credit = (g.credit - mean).max(lo);
        }
    }
}
