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
//!    [`water_fill()`]: effective requests first (scaled down if they sum to more than 1), the rest
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
//! 10. **Latency class.** (`docs/latency.md`) While a group of [`GroupClass::Latency`] is
//!     connected, every other group's turns keep at most
//!     [`PolicyConfig::latency_queue_budget_ns`] of work queued. When it comes back with work it is
//!     served unless it is ahead of the holder by a minimum quota, and the holder's turn ends an
//!     eighth of a minimum quota after its start at the earliest: its client stops at its next
//!     kernel. It keeps the GPU a linger ([`PolicyConfig::latency_linger_ns`]) past its drain
//!     whenever it gives a turn back (unless its cap would not let it take the GPU back; the
//!     drain its client estimated, or the one it measured if its report comes earlier),
//!     charged to it; the turn after opens at its start ([`Decision::Grant`]'s
//!     `open_at_start`), not ahead of it, and asking again within the linger (a request queued
//!     behind the one that ended) the group is served at once, the turn planned after it
//!     withdrawn; a turn planned for its process after the one it gives back is withdrawn with
//!     it. It does not linger when the turn after it goes to another latency-class group that
//!     waits (that one starts at the drain), nor does it take back a turn it did not linger
//!     before; a turn planned for its client is withdrawn when the client reports it has no more
//!     work. Returning, it does not wait behind a running turn for one planned after it: that one
//!     is withdrawn. What it uses is charged and capped like any other group's time.
//!
//! # Memory
//!
//! [`overcommit`] is the node's memory counterpart, as pure: which allocation is granted, which
//! waits, which group is swapped to host memory and when it comes back, when the groups' memory
//! caps on a GPU promise more than it holds.

// The documentation is read with the private items (`--document-private-items`), where
// links to them resolve.
#![allow(rustdoc::private_intra_doc_links)]

mod credit;
mod group;
pub mod overcommit;
mod params;
mod planning;
mod status;
mod turn;
mod water_fill;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod virtual_time;

pub use params::{GroupClass, GroupParams, PolicyConfig};
pub use status::{GpuStatus, GroupStatus};
pub use turn::TurnUse;
pub use water_fill::{effective_requests, water_fill};

use credit::Handoff;
use group::Group;
use std::collections::BTreeMap;
use turn::Turn;

/// A client of the scheduler: one process's connection, as numbered by the daemon.
pub type ClientId = u64;

/// Ended turns awaiting their client's report, at most (the oldest is settled as held beyond).
const MAX_ENDED: usize = 1024;

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
        /// A latency-class group keeps the GPU until `start_ns` and may take it back (the turn
        /// is then withdrawn): its client launches nothing before, where it would otherwise
        /// launch a little ahead (docs/latency.md).
        open_at_start: bool,
        /// A latency-class group of another client is connected to the GPU: its client launches
        /// a kernel longer than half its queue budget only as the work queued before runs down
        /// to the budget, so that none waits queued behind a running one for a request
        /// (docs/latency.md).
        just_in_time: bool,
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
    /// Where the last linger of a latency-class group ends (docs/latency.md): the turn that
    /// starts there opens no earlier.
    linger_until: u64,
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
    /// How late the scheduler has lately acted on its timers ([`Policy::set_lateness`]).
    late_ns: u64,
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
            linger_until: 0,
            handoffs: std::collections::VecDeque::new(),
            next_token: 1,
            now: 0,
            seq: 0,
            targets_dirty: false,
            decisions: Vec::new(),
            first_acquire: None,
            late_ns: 0,
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    /// How late the scheduler has lately acted on what was due (its event loop's recent
    /// lateness, measured by the caller): a scheduler short of CPU decides and grants each turn
    /// that much earlier, so that the grant still reaches the next holder before its start.
    pub fn set_lateness(&mut self, late_ns: u64) {
        self.late_ns = late_ns;
    }

    /// How long before its start a turn is granted: [`PolicyConfig::grant_ahead_ns`], plus
    /// the recent lateness, up to a quota less a minimum quota (a turn is never decided before
    /// its predecessor has run a minimum quota, which no decision could take from it anyway).
    pub(crate) fn grant_ahead_ns(&self) -> u64 {
        let ahead = self.cfg.grant_ahead_ns;
        ahead.max(
            ahead
                .saturating_add(self.late_ns)
                .min(self.cfg.quota_ns - self.cfg.min_quota_ns),
        )
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
        if returning {
            self.take_back_linger(&group, now);
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
            let drained =
                drained_ns.clamp(now, (now + self.cfg.min_quota_ns).min(deadline).max(now));
            let latency =
                (self.groups.get(&group)).is_some_and(|g| g.params.class == GroupClass::Latency);
            if latency && let Some(n) = self.next.as_ref().filter(|n| n.client == client) {
                // A turn planned for it after this one, presuming it would want another (a
                // holder that has not given its turn back counts as waiting): it has said it has
                // no more work, and would hold that turn idle until it gave it back too. Its
                // linger keeps the GPU for its next request instead.
                let token = n.token;
                self.withdraw_next(now);
                self.decisions.push(Decision::Revoke { client, token });
            }
            // A latency-class group lingers past its drain, unless its cap would not let it take
            // the GPU back, or the turn after it goes to another latency-class group that waits
            // now: that one is latency-sensitive too, and starts at the drain. (A turn planned
            // already may be one its client no longer wants: it was planned as it held the GPU,
            // presumed to want another.)
            let (depth, thr) = (self.cfg.bucket_depth(), self.cfg.cap_threshold());
            let follower = match self.next.as_ref() {
                Some(_) => None,
                None => self.best_candidate(drained).map(|(name, _)| name),
            };
            let to_latency = follower.is_some_and(|f| {
                f != group
                    && (self.groups.get(&f)).is_some_and(|g| g.params.class == GroupClass::Latency)
            });
            let linger = latency
                && !to_latency
                && (self.groups.get(&group)).is_some_and(|g| g.eligible(now, depth, thr));
            let at = if linger {
                let at = (drained + self.cfg.latency_linger_ns())
                    .min(deadline)
                    .max(drained);
                self.linger_until = at;
                at
            } else {
                drained
            };
            self.yield_current(at, now);
            if linger && let Some(token) = self.next.as_ref().map(|n| n.token) {
                self.hold_handoff(token, at);
            }
            if let Some(g) = self.groups.get_mut(&group) {
                g.gave_back_at = at;
            }
        }
        self.mark_held_back(now);
        Ok(())
    }

    /// `client` reports what it measured of its turn `token` once the turn's work drained
    /// (`used`: `None` if it launched nothing), and whether it has more work (`again`: it stays
    /// queued for a turn; else it leaves the queue). Settles the turn's charge
    /// (`docs/scheduling.md#charges`). A report of the running turn ends it there (the client
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
            self.reanchor_linger(token, used, now);
            let t = self.ended.remove(&token).expect("checked");
            self.settle(t, used, now);
            self.note_handoffs(token, used, now);
        }
        if again {
            self.enqueue(client, now);
        } else {
            // A turn already planned for it stays: it yields that if it still has nothing to do
            // when it comes (a bursty client often has again by then). A latency-class client's
            // is withdrawn: planned as it held the GPU, presumed to want another, it would only
            // be given straight back (the client asks with its next request, and is served
            // then).
            self.dequeue(client, now);
            let latency = (self.clients.get(&client))
                .and_then(|c| self.groups.get(&c.group))
                .is_some_and(|g| g.params.class == GroupClass::Latency);
            if latency && let Some(n) = self.next.as_ref().filter(|n| n.client == client) {
                let token = n.token;
                self.withdraw_next(now);
                self.decisions.push(Decision::Revoke { client, token });
            }
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
            // A turn ended early with its client told to stop was revoked then.
            if !t.stopped {
                if let Some(g) = self.groups.get_mut(&t.group) {
                    g.revocations += 1;
                    g.overruns += 1;
                }
                self.decisions.push(Decision::Revoke {
                    client: t.client,
                    token,
                });
            }
            // Charged as held until a late report says otherwise.
            self.charge_turn(&mut t, None, now);
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
            if (self.current.as_ref()).is_some_and(|t| t.client == client && t.start_ns >= ended_at)
            {
                self.stop_current(now);
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
        let ahead = self.grant_ahead_ns();
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

    /// Group `name`'s processes are being swapped out of the GPU's memory (the driver's
    /// checkpoint locks them: they launch nothing until restored): it is out of the race until
    /// [`Policy::resume`]. Its running turn ends now and a turn planned for it is withdrawn
    /// (both revoked), and it is granted none, though its clients may ask (they wait). Its
    /// credit stays as it was — it neither pays for the time out nor banks it — and its target
    /// and guarantee go to the others meanwhile: the time out is as if it had no processes
    /// here, so the others keep their guarantees and it comes back neither owed a burst nor in
    /// debt (docs/scheduling.md#suspension). Unknown names, and a group suspended already, are
    /// ignored.
    pub fn suspend(&mut self, name: &str, now: u64) {
        let now = self.advance(now);
        let ahead = self.credit_ahead_of_race(name);
        match self.groups.get_mut(name) {
            Some(g) if !g.suspended => {
                g.suspended = true;
                g.credit_ahead = ahead;
            }
            _ => return,
        }
        self.targets_dirty = true;
        if let Some(n) = self.next.as_ref().filter(|n| n.group == name) {
            // Its client waits again, first in its group, for when the group is back.
            let (client, token) = (n.client, n.token);
            self.requeue_next(client, token, now);
        }
        if self.current.as_ref().is_some_and(|t| t.group == name) {
            self.stop_current(now);
        }
        self.plan(now);
        self.mark_held_back(now);
    }

    /// Group `name`'s processes are back in the GPU's memory: it takes part again, its credit
    /// as far from the others' mean as when it left (`docs/scheduling.md#suspension`), a
    /// waiting client of it served as one returning
    /// (`docs/scheduling.md#preemption`). Unknown or not suspended: ignored.
    pub fn resume(&mut self, name: &str, now: u64) {
        let now = self.advance(now);
        // Where the others' credit went meanwhile (their charges move it, and not only their
        // accrual), its own goes too.
        let (lo, hi) = self.cfg.credit_bounds();
        let mean = self.race_mean_credit(name);
        match self.groups.get_mut(name) {
            Some(g) if g.suspended => {
                g.suspended = false;
                if let (Some(ahead), Some(mean)) = (g.credit_ahead.take(), mean) {
                    g.credit = (mean + ahead).clamp(lo, hi);
                }
            }
            _ => return,
        }
        self.targets_dirty = true;
        if self.groups[name].queue.is_empty() {
            return;
        }
        if self.current.is_none() {
            self.reclaim_gap(now);
        }
        self.plan(now);
        self.preempt_for(name, now);
        self.end_extension(name, now);
        self.plan(now);
        self.mark_held_back(now);
    }

    /// The mean credit of the groups in the race (with processes here, not suspended) other
    /// than `name`; `None` if there are none.
    fn race_mean_credit(&self, name: &str) -> Option<f64> {
        let credits: Vec<f64> = (self.groups.iter())
            .filter(|(n, g)| *n != name && !g.suspended && !g.clients.is_empty())
            .map(|(_, g)| g.credit)
            .collect();
        (!credits.is_empty()).then(|| credits.iter().sum::<f64>() / credits.len() as f64)
    }

    /// Group `name`'s credit less [`Policy::race_mean_credit`].
    fn credit_ahead_of_race(&self, name: &str) -> Option<f64> {
        let g = self.groups.get(name)?;
        Some(g.credit - self.race_mean_credit(name)?)
    }

    /// Whether group `name` is suspended ([`Policy::suspend`]).
    pub fn suspended(&self, name: &str) -> bool {
        self.groups.get(name).is_some_and(|g| g.suspended)
    }

    /// The running turn's client and token.
    pub fn holder(&self) -> Option<(ClientId, u64)> {
        self.current.as_ref().map(|t| (t.client, t.token))
    }

    /// Whether a client waits for a turn (asked, and not granted one yet).
    pub fn has_waiters(&self) -> bool {
        self.groups.values().any(|g| !g.queue.is_empty())
    }

    /// The group `client` is connected to.
    pub fn client_group(&self, client: ClientId) -> Option<&str> {
        self.clients.get(&client).map(|c| c.group.as_str())
    }

    /// A group's parameters.
    pub fn group_params(&self, name: &str) -> Option<GroupParams> {
        self.groups.get(name).map(|g| g.params)
    }

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

    /// Ends the running turn now and tells its client to stop at once (revoked once: not again
    /// at its end + grace if it has not reported by then).
    fn stop_current(&mut self, now: u64) {
        let Some(t) = self.current.as_mut() else {
            return;
        };
        t.stopped = true;
        let (client, token) = (t.client, t.token);
        self.decisions.push(Decision::Revoke { client, token });
        self.yield_current(now, now);
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
}
