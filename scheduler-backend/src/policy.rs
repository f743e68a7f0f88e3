//! The fair-share policy core: a pure state machine, one instance per GPU.
//!
//! No I/O, no threads, no clock: every call carries `now` (nanoseconds of `CLOCK_MONOTONIC`),
//! and what the policy decides (grant a token, revoke one) is queued as [`Decision`]s that the
//! daemon's I/O shell drains with [`Policy::take_decisions`] after every call. The shell also
//! asks [`Policy::next_wakeup`] when to call [`Policy::tick`] next. Fairness is therefore tested
//! in virtual time (see the simulator in `policy/sim.rs`).
//!
//! # Model
//!
//! *Clients* are processes; each belongs to a *group* (a container, pod or user) with a
//! [`GroupParams`]: `request` (guaranteed share), `limit` (hard cap), `weight` (split of spare
//! time). One client at a time holds the GPU's token. It asks with [`Policy::acquire`], receives
//! a [`Decision::Grant`] with an absolute deadline, runs, and gives the token back with
//! [`Policy::release`], reporting how long its work really occupied the GPU (grant → drained).
//! A group is *active* while one of its clients waits for or holds the token.
//!
//! # Algorithm
//!
//! 1. **Targets.** The active groups' target shares come from [`water_fill`]: effective
//!    requests first (scaled down if they sum to more than 1), the rest split by weight among
//!    groups below their limit, limits capping and their excess redistributed. Recomputed
//!    lazily whenever the active set or the parameters change.
//! 2. **Credit** (a deficit counter, ns). While the token is held, each active group accrues
//!    credit at its target share, and each idle group with a request *banks* its guarantee
//!    (normalised over both, so exactly the held time is handed out — what will be charged for
//!    it; the targets count an idle group as taking exactly its guarantee, so banking comes out
//!    of spare time, never out of another group's guarantee). The holder is debited its quota at grant and
//!    settled to its real charge at release. Credit a group cannot absorb above the upper bound
//!    (it wants less than its target) is passed on by weight to the active groups below their
//!    limit, so unused share is split by weight. All credits are re-centred on their mean (a
//!    uniform shift: no difference, hence no decision, changes) and bounded to `[−2B, +B]`,
//!    `B = 2·quota + grace`: an idle group cannot bank more than `B` of priority, and an overrun
//!    is charged in full up to `2B` of debt.
//! 3. **Caps.** Each group with `limit < 1` has a token bucket filling at `limit` ns per ns up to
//!    `2·quota`, debited like the credit (quota reserved at grant, settled at release; debt kept
//!    up to one window's worth). It may take the token only when its bucket holds a full quota,
//!    and never with `limit = 0`.
//! 4. **Selection.** A free token goes at once to the waiting, not-capped group with the largest
//!    credit (ties: the one waiting longest); within a group clients are served in the order they
//!    asked, i.e. round-robin. The token is never left free while such a group waits (work
//!    conservation; the one bounded exception is point 6); if only capped groups wait, [`Policy::next_wakeup`] says when the first
//!    bucket refills.
//! 5. **Adaptive quota.** A group that is not waiting at the instant the token is handed on,
//!    but was active within the last quota (the one that just released at its deadline —
//!    clients usually release, then ask again — or a short user without a request between
//!    bursts; one with a request banks it and uses point 7), would have been chosen had it
//!    been waiting if it is owed more than the grantee. The grant is then shortened by the
//!    difference (never below `min_quota_ns`, never beyond a capped group's bucket), so the token
//!    comes back to it sooner: shares stay exact with either client protocol, and a short user
//!    is let in within about a minimum quota.
//! 6. **Anticipation.** When that difference is so large that even a `min_quota_ns` grant would
//!    overshoot (very lopsided shares, e.g. 0.99 / 0.01), and the releaser was cut off by its
//!    deadline (so it still has work; one that released early has drained), the token is kept
//!    free for the releaser for `min_quota_ns / 4` (500 µs by default). If it asks again within
//!    that window it is granted at once; otherwise the best waiter is granted when the window
//!    ends ([`Policy::next_wakeup`] reports it). This is the only case where the token is free
//!    while an uncapped group waits, and it is bounded by one window per release.
//! 7. **Preemption.** A group with a request that comes back from idle (its work arrived), or a
//!    capped waiting group whose bucket has refilled, would have been chosen had it been
//!    waiting at the grant if it is owed more than the holder (whose credit is counted as
//!    settled for the time held). The holder's deadline then moves to when the two are even —
//!    at once for a group that banked its guarantee — but never below `min_quota_ns` after its
//!    grant ([`Decision::Shorten`]). So a bursty or latency-sensitive group gets what it needs,
//!    however long it idled (DESIGN §2.5), instead of waiting out a whole quota per burst.
//!    (Groups without a request rely on point 5.)
//! 8. **Timeouts.** A holder still holding at `deadline + grace` is revoked (charged the time
//!    since its grant, provisionally) and the next client is granted in the same call; its late
//!    release settles the charge to what it reports (never less than the provisional charge).
//!    A disconnect releases at once, charging the time elapsed since the grant.
//! 9. **Extension.** A minimum quota before the holder's deadline, if no other client could
//!    be granted (nobody eligible waits, no other group is active — one that released a moment
//!    ago counts, it asks again as its work drains — the token is not kept for anyone) and its
//!    own group could take another quota, the deadline moves a quota later ([`Decision::Extend`],
//!    reserved like a grant), up to a tenth of the window per token: a lone tenant does not
//!    drain its queue and ask again every quota. Whoever asks meanwhile ends the extension: the
//!    token then ends a `min_quota_ns` later (or at its deadline before the extension, if
//!    later; less by point 7), announced like a cut-short token — which also tells the client
//!    that it is no longer alone.
//!
//! Usage charged is `min(used_ns, now + min_quota_ns − start)`: the client's own measure of
//! occupancy, which cannot exceed the time it held the token plus a little work still queued
//! at its release (the hook hands over early, with its last ≈ 1 ms of work queued and
//! estimated). A token's time starts when it is granted or, later, when that reported work of
//! the previous holder drains ([`Decision::Grant`]'s `start_ns`): the two are never charged for
//! the same instant.
//!
//! # Deviations from the first sketch
//!
//! - A capped group waits for a full quota in its bucket rather than `min_quota_ns`: granting the
//!   refill in crumbs of 2 ms multiplies handoffs (each costs the tenant a drain and an IPC round
//!   trip out of its own share) without changing its long-run share; a lone tenant capped at 0.3
//!   gets one full 20 ms token every 66.7 ms. `min_quota_ns` stays the floor of every grant.
//! - Debits are reserved at grant and settled at release (rather than charged only at release),
//!   so the hard cap also holds while a token is in flight; refill lost to the bucket's depth
//!   during a token that then overruns is given back, so the bucket equals one debited with the
//!   true usage at grant.
//! - Grants may be shorter than `quota_ns` (point 5) and, rarely, a released token is kept for
//!   its releaser for a fraction of a millisecond (point 6). Without these, with the natural
//!   client protocol (release, then ask again), two busy groups simply alternate and split 1:1
//!   whatever their shares. A client that asks for its next turn *before* releasing (a holder
//!   may call [`Policy::acquire`]) needs neither.

mod water_fill;

pub use water_fill::{effective_requests, water_fill};

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, VecDeque};

/// A client of the scheduler: one process's connection, as numbered by the daemon.
pub type ClientId = u64;

/// A group's share parameters on one GPU (DESIGN §2).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GroupParams {
    /// Guaranteed minimum share of GPU time, 0..=1.
    pub request: f64,
    /// Hard cap on the share of GPU time, request..=1 (1 = uncapped).
    pub limit: f64,
    /// Relative weight for splitting spare time, > 0 (default 1).
    pub weight: f64,
}

impl Default for GroupParams {
    /// No guarantee, no cap, weight 1.
    fn default() -> Self {
        GroupParams {
            request: 0.0,
            limit: 1.0,
            weight: 1.0,
        }
    }
}

impl GroupParams {
    /// Checks `0 ≤ request ≤ limit ≤ 1`, `weight > 0`, all finite. The error says what to change.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("request", self.request),
            ("limit", self.limit),
            ("weight", self.weight),
        ] {
            if !v.is_finite() {
                return Err(format!("{name} must be a finite number, got {v}"));
            }
        }
        if !(0.0..=1.0).contains(&self.request) {
            return Err(format!(
                "request {} must be a fraction of GPU time between 0 and 1 (e.g. 0.3)",
                self.request
            ));
        }
        if self.limit < self.request || self.limit > 1.0 {
            return Err(format!(
                "limit {} must lie between the request {} and 1; raise the limit or lower the request",
                self.limit, self.request
            ));
        }
        if self.weight <= 0.0 {
            return Err(format!(
                "weight {} must be greater than 0 (the default is 1)",
                self.weight
            ));
        }
        Ok(())
    }
}

/// Timing parameters of the policy (hot-reloadable with [`Policy::set_config`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PolicyConfig {
    /// Default token length.
    pub quota_ns: u64,
    /// Never grant less than this.
    pub min_quota_ns: u64,
    /// A holder is revoked at deadline + grace.
    pub grace_ns: u64,
    /// Window of the achieved share reported in [`GroupStatus::achieved_share`].
    pub window_ns: u64,
}

impl Default for PolicyConfig {
    /// 20 ms quota, 2 ms minimum quota, 20 ms grace, 5 s window.
    fn default() -> Self {
        PolicyConfig {
            quota_ns: 20_000_000,
            min_quota_ns: 2_000_000,
            grace_ns: 20_000_000,
            window_ns: 5_000_000_000,
        }
    }
}

/// What the shell must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Give `client` the token from `start_ns` (when the previous holder's reported work
    /// drains; usually now) until `deadline_ns` (absolute, CLOCK_MONOTONIC).
    Grant {
        client: ClientId,
        token: u64,
        start_ns: u64,
        deadline_ns: u64,
        quota_ns: u64,
    },
    /// The holder overran deadline + grace: the token is taken away; the next client may be granted already.
    Revoke { client: ClientId, token: u64 },
    /// The holder's deadline moves earlier (a group owed more arrived): stop launching at
    /// `deadline_ns` and give the token back as at any deadline.
    Shorten {
        client: ClientId,
        token: u64,
        deadline_ns: u64,
    },
    /// Nobody else can take the GPU: the holder keeps its token until the later `deadline_ns`
    /// (a quota further), instead of draining and asking again.
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
    /// The client holding the token.
    pub holder: Option<ClientId>,
    /// Clients waiting for the token, longest waiting first.
    pub waiting: Vec<ClientId>,
    /// Every configured group, by name.
    pub groups: Vec<GroupStatus>,
    /// The holder's token.
    pub holder_token: Option<u64>,
    /// The holder's group.
    pub holder_group: Option<String>,
    /// The holder's deadline (it is revoked at deadline + grace).
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
    /// Tokens granted.
    pub tokens: u64,
    /// Requests that could not be granted at once.
    pub waits: u64,
    /// Tokens used beyond their quota (including revoked ones).
    pub overruns: u64,
    /// Tokens revoked at deadline + grace.
    pub revocations: u64,
    /// Tokens cut short for a group owed more that came back (preemption).
    pub preempted: u64,
    /// Connected clients.
    pub clients: Vec<ClientId>,
    /// A client of the group waits for or holds the token.
    pub active: bool,
    /// Scheduling credit, ns (relative; positive = behind its target).
    pub credit_ns: f64,
    /// Token-bucket allowance, ns (`None` when `limit` is 1: never capped).
    pub allowance_ns: Option<f64>,
    /// Waiting but held back by its limit until the bucket refills.
    pub capped: bool,
}

/// Float slack (ns) when comparing a bucket against the threshold.
const NS_EPS: f64 = 0.5;
/// Usage intervals kept per group for the windowed share; older ones are merged beyond this.
const MAX_USAGE_ENTRIES: usize = 4096;
/// Revoked tokens awaiting their late release, at most.
const MAX_REVOKED: usize = 1024;
/// Released tokens whose charge may still be settled, at most.
const MAX_SETTLING: usize = 64;

/// A token in flight (or revoked, awaiting its late release).
#[derive(Debug, Clone)]
struct Hold {
    client: ClientId,
    group: String,
    token: u64,
    /// When its time starts: the grant, or the previous holder's reported drain.
    granted_at: u64,
    /// The token whose reported drain it starts at, if later than the grant.
    follows: Option<u64>,
    /// How much later than its client was told its time really started: that token's drain,
    /// settled, came later than reported. Taken off what the client reports.
    late_ns: u64,
    deadline_ns: u64,
    /// Its deadline before it was first extended (point 9).
    unextended: Option<u64>,
    quota_ns: u64,
    /// Debited from credit and bucket so far (the reserve, then the settled charge).
    applied: u64,
    /// Added to the usage statistics so far.
    recorded: u64,
}

/// Charged usage over `[start, end)` (`busy ≤ end − start` once merged).
#[derive(Debug, Clone)]
struct Usage {
    token: u64,
    start: u64,
    end: u64,
    busy: u64,
}

#[derive(Debug, Clone)]
struct Group {
    params: GroupParams,
    clients: Vec<ClientId>,
    /// Waiting clients with their request sequence number, FIFO.
    queue: VecDeque<(ClientId, u64)>,
    holding: bool,
    target: f64,
    /// The request, scaled down if the configured requests sum to more than 1.
    guarantee: f64,
    credit: f64,
    /// Waiting while its bucket held less than a quota (see `Policy::tick`).
    held_back: bool,
    /// While idle: whether it banks its guarantee (it got less than that over the window when
    /// it went idle). `None` while active.
    banks: Option<bool>,
    allowance: f64,
    allowance_at: u64,
    /// Refill cut off by the depth since the last grant: while a token is in flight only its
    /// quota is reserved, so an overrun settled at release is partly paid from this, making the
    /// bucket exactly one debited with the true usage at grant.
    clamp_lost: f64,
    usage: VecDeque<Usage>,
    /// Last time the group stopped holding or had a client leave the queue.
    last_active: u64,
    /// Released, but still counted active until `draining_until`: when its reported work
    /// drains, plus the anticipation window. A client that hands over early at a
    /// synchronisation asks again as that returns; counted idle for that instant, its share
    /// would go to the others every turn.
    draining: bool,
    draining_until: u64,
    busy_ns: u64,
    tokens: u64,
    waits: u64,
    overruns: u64,
    revocations: u64,
    preempted: u64,
}

impl Group {
    fn new(params: GroupParams, now: u64, depth: f64) -> Group {
        Group {
            params,
            clients: Vec::new(),
            queue: VecDeque::new(),
            holding: false,
            target: 0.0,
            guarantee: 0.0,
            credit: 0.0,
            held_back: false,
            banks: None,
            allowance: depth,
            allowance_at: now,
            clamp_lost: 0.0,
            usage: VecDeque::new(),
            last_active: 0,
            draining: false,
            draining_until: 0,
            busy_ns: 0,
            tokens: 0,
            waits: 0,
            overruns: 0,
            revocations: 0,
            preempted: 0,
        }
    }

    /// Holding the token or waiting for it.
    fn wants(&self) -> bool {
        self.holding || !self.queue.is_empty()
    }

    /// Wants the GPU, or released it a moment ago with work still draining (`draining_until`):
    /// targets and credit count it.
    fn active(&self) -> bool {
        self.wants() || self.draining
    }

    /// [`Group::active`] as of `now` (which may be later than the policy's last call).
    fn active_at(&self, now: u64) -> bool {
        self.wants() || (self.draining && now < self.draining_until)
    }

    fn capped(&self) -> bool {
        self.params.limit < 1.0
    }

    /// Idle and banking its guarantee.
    fn banking(&self) -> bool {
        !self.active() && self.banks == Some(true) && self.guarantee > 0.0
    }

    /// Bucket content at `now` (infinite for an uncapped group).
    fn allowance(&self, now: u64, depth: f64) -> f64 {
        if !self.capped() {
            return f64::INFINITY;
        }
        let dt = now.saturating_sub(self.allowance_at) as f64;
        (self.allowance + self.params.limit * dt).min(depth)
    }

    /// May take the token now: not capped, or a bucket holding `thr` (never with limit 0).
    fn eligible(&self, now: u64, depth: f64, thr: f64) -> bool {
        self.params.limit > 0.0 && self.allowance(now, depth) >= thr - NS_EPS
    }

    /// When its bucket will hold `thr` (`now` if it does; never with limit 0).
    fn eligible_at(&self, now: u64, depth: f64, thr: f64) -> Option<u64> {
        if self.eligible(now, depth, thr) {
            return Some(now);
        }
        (self.params.limit > 0.0).then(|| {
            let wait = ((thr - self.allowance(now, depth)) / self.params.limit).ceil();
            now.saturating_add(wait.max(0.0) as u64)
        })
    }

    fn refill(&mut self, now: u64, depth: f64) {
        if self.capped() {
            let dt = now.saturating_sub(self.allowance_at) as f64;
            let raw = self.allowance + self.params.limit * dt;
            self.clamp_lost += (raw - depth.max(self.allowance)).max(0.0);
            self.allowance = raw.min(depth);
            self.allowance_at = self.allowance_at.max(now);
        }
    }

    /// Lowest the bucket may go: one window's worth of allowance (at least one bucket), so one
    /// pathological report cannot lock a group out for longer than a window.
    /// Debit `ns` of a token about to be held from credit and bucket (settled at release).
    fn reserve(&mut self, ns: u64, now: u64, lo: f64, depth: f64, window_ns: u64) {
        self.credit = (self.credit - ns as f64).max(lo);
        if self.capped() {
            self.refill(now, depth);
            let floor = self.bucket_floor(depth, window_ns);
            self.allowance = (self.allowance - ns as f64).max(floor);
            self.clamp_lost = 0.0;
        }
    }

    fn bucket_floor(&self, depth: f64, window_ns: u64) -> f64 {
        -(depth.max(self.params.limit * window_ns as f64))
    }

    fn record_usage(&mut self, token: u64, start: u64, extra: u64) {
        if extra == 0 {
            return;
        }
        if let Some(u) = self
            .usage
            .iter_mut()
            .rev()
            .take(64)
            .find(|u| u.token == token)
        {
            u.end += extra;
            u.busy += extra;
            return;
        }
        self.usage.push_back(Usage {
            token,
            start,
            end: start + extra,
            busy: extra,
        });
        if self.usage.len() > MAX_USAGE_ENTRIES {
            let a = self.usage.pop_front().expect("non-empty");
            let b = self.usage.front_mut().expect("non-empty");
            b.start = a.start.min(b.start);
            b.end = a.end.max(b.end);
            b.busy += a.busy;
        }
    }

    fn prune_usage(&mut self, horizon: u64) {
        while self.usage.front().is_some_and(|u| u.end <= horizon) {
            self.usage.pop_front();
        }
    }

    /// Usage within `[from, to)`.
    fn usage_within(&self, from: u64, to: u64) -> f64 {
        self.usage
            .iter()
            .map(|u| {
                let span = u.end.saturating_sub(u.start);
                let overlap = u.end.min(to).saturating_sub(u.start.max(from));
                if span == 0 {
                    0.0
                } else {
                    u.busy as f64 * overlap as f64 / span as f64
                }
            })
            .sum()
    }
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
    holder: Option<Hold>,
    revoked: BTreeMap<u64, Hold>,
    /// Recently released tokens, whose charge a [`Policy::settle`] may still raise.
    settling: BTreeMap<u64, Hold>,
    next_token: u64,
    /// Latest time seen; calls with an earlier `now` are treated as happening now.
    now: u64,
    seq: u64,
    targets_dirty: bool,
    decisions: Vec<Decision>,
    /// The token is kept free for this group until this time (anticipation after its release).
    anticipation: Option<(String, u64)>,
    /// The group whose token was just cut off by its deadline (it asks again at once).
    cut_off: Option<String>,
    /// When the first client asked for the token: achieved shares are over at most the time
    /// since, so they are right from the first seconds.
    first_acquire: Option<u64>,
    /// When the work of the last released token (`.0`) drains by its report (it may hand over
    /// with some still queued): the next token's time starts there.
    busy_until: (u64, u64),
}

/// Makes a configuration usable: quota ≥ 1 ns, `min_quota ≤ quota`, window ≥ 1 ns.
fn sanitize(mut cfg: PolicyConfig) -> PolicyConfig {
    cfg.quota_ns = cfg.quota_ns.max(1);
    cfg.min_quota_ns = cfg.min_quota_ns.min(cfg.quota_ns);
    cfg.window_ns = cfg.window_ns.max(1);
    cfg
}

impl Policy {
    /// A policy with no groups. The configuration is used as given, except that a zero quota
    /// becomes 1 ns and `min_quota_ns` is lowered to `quota_ns` if above it.
    pub fn new(cfg: PolicyConfig) -> Policy {
        Policy {
            cfg: sanitize(cfg),
            groups: BTreeMap::new(),
            clients: BTreeMap::new(),
            holder: None,
            revoked: BTreeMap::new(),
            settling: BTreeMap::new(),
            next_token: 1,
            now: 0,
            seq: 0,
            targets_dirty: false,
            decisions: Vec::new(),
            anticipation: None,
            cut_off: None,
            first_acquire: None,
            busy_until: (0, 0),
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    /// Hot reload of the timing parameters. The current holder keeps its deadline; buckets and
    /// credits are clamped to the new bounds.
    pub fn set_config(&mut self, cfg: PolicyConfig) {
        let now = self.now;
        let old_depth = self.bucket_depth();
        self.cfg = sanitize(cfg);
        let depth = self.bucket_depth();
        let (lo, hi) = self.credit_bounds();
        let window = self.cfg.window_ns;
        for g in self.groups.values_mut() {
            g.refill(now, old_depth);
            let floor = g.bucket_floor(depth, window);
            g.allowance = g.allowance.clamp(floor, depth);
            g.credit = g.credit.clamp(lo, hi);
        }
    }

    /// Creates or updates (hot reload) a group. Takes effect for the next token; if it makes a
    /// waiting group eligible, [`Policy::next_wakeup`] reports it.
    pub fn set_group(&mut self, name: &str, p: GroupParams) -> Result<(), PolicyError> {
        p.validate().map_err(|reason| PolicyError::InvalidParams {
            group: name.to_string(),
            reason,
        })?;
        let now = self.now;
        let depth = self.bucket_depth();
        let window = self.cfg.window_ns;
        match self.groups.get_mut(name) {
            Some(g) => {
                g.refill(now, depth);
                let was_capped = g.capped();
                g.params = p;
                if !was_capped {
                    // The bucket was not maintained while uncapped: start full.
                    g.allowance = depth;
                    g.allowance_at = now;
                }
                let floor = g.bucket_floor(depth, window);
                g.allowance = g.allowance.clamp(floor, depth);
            }
            None => {
                self.groups
                    .insert(name.to_string(), Group::new(p, now, depth));
            }
        }
        self.targets_dirty = true;
        Ok(())
    }

    /// Removes a group; its clients are disconnected (a holder releases at once). Unknown names
    /// are ignored.
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
        self.revoked.retain(|_, h| h.group != name);
        self.targets_dirty = true;
        self.schedule(now);
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
            self.schedule(self.now);
        }
        Ok(())
    }

    /// Disconnects `client`: it stops waiting, and if it holds the token the token is released
    /// at once (charged the time elapsed since the grant) and the next client granted. Unknown
    /// clients are ignored.
    pub fn disconnect(&mut self, client: ClientId, now: u64) {
        if !self.clients.contains_key(&client) {
            return;
        }
        let now = self.advance(now);
        self.detach(client, now);
        self.schedule(now);
    }

    /// `client` wants the token. Idempotent while it waits; a holder asking again queues for
    /// its next turn.
    pub fn acquire(&mut self, client: ClientId, now: u64) -> Result<(), PolicyError> {
        if !self.clients.contains_key(&client) {
            return Err(PolicyError::UnknownClient(client));
        }
        let now = self.advance(now);
        self.first_acquire.get_or_insert(now);
        let c = self.clients.get_mut(&client).expect("checked above");
        if c.waiting.is_some() {
            return Ok(());
        }
        let seq = self.seq;
        self.seq += 1;
        c.waiting = Some(seq);
        let group = c.group.clone();
        let g = self
            .groups
            .get_mut(&group)
            .expect("clients belong to groups");
        // Back with a banked guarantee (not merely asking again after a release).
        let returning = g.banking() && now > g.last_active;
        if !g.active() {
            self.targets_dirty = true;
        }
        g.queue.push_back((client, seq));
        self.schedule(now);
        if self.clients[&client].waiting.is_some() {
            self.groups.get_mut(&group).expect("exists").waits += 1;
            if returning {
                self.preempt_for(&group, now);
            }
            self.end_extension(client, now);
        }
        self.mark_held_back(now);
        Ok(())
    }

    /// `client` gives back `token`, having occupied the GPU for `used_ns` (grant → drained).
    /// The next client is granted in the same call. Also accepted for a token that was revoked:
    /// then the late usage is charged. A stale token (already released) is ignored.
    pub fn release(
        &mut self,
        client: ClientId,
        token: u64,
        used_ns: u64,
        now: u64,
    ) -> Result<(), PolicyError> {
        if !self.clients.contains_key(&client) {
            return Err(PolicyError::UnknownClient(client));
        }
        let now = self.advance(now);
        if self
            .holder
            .as_ref()
            .is_some_and(|h| h.token == token && h.client == client)
        {
            let mut h = self.holder.take().expect("checked");
            // Work still queued at the release may be reported, up to a minimum quota of it.
            let charge = used_ns
                .saturating_sub(h.late_ns)
                .min((now + self.cfg.min_quota_ns).saturating_sub(h.granted_at));
            self.charge(&mut h, charge, now);
            self.busy_until = (h.token, h.granted_at + charge);
            let draining_until = self.busy_until.1 + self.anticipation_window();
            if let Some(g) = self.groups.get_mut(&h.group) {
                g.holding = false;
                g.last_active = now;
                g.draining = true;
                g.draining_until = draining_until;
                if charge > h.quota_ns {
                    g.overruns += 1;
                }
                if !g.active() {
                    self.targets_dirty = true;
                }
            }
            // Only a holder cut off by its deadline still has work and will ask again at once;
            // one that released early has drained (a short user between bursts).
            let cut_off = charge + self.anticipation_window() >= h.quota_ns;
            if self.settling.len() >= MAX_SETTLING {
                self.settling.pop_first();
            }
            self.settling.insert(h.token, h.clone());
            if cut_off {
                self.anticipate(&h.group, now);
                self.cut_off = Some(h.group.clone());
            }
            self.schedule(now);
            self.cut_off = None;
            self.mark_held_back(now);
        } else if self.revoked.get(&token).is_some_and(|h| h.client == client) {
            let h = self.revoked.remove(&token).expect("checked");
            self.charge_late(h, used_ns, now);
        }
        Ok(())
    }

    /// `client` reports how long its released token `token` really held the GPU (it released
    /// early with the tail of its work estimated). Raises that token's charge to
    /// `min(used_ns, now − grant)`; never lowers it. Unknown or old tokens are ignored. A holder
    /// whose time was to start at that token's reported drain starts at the real one instead:
    /// the two are not charged for the same instant.
    pub fn settle(&mut self, client: ClientId, token: u64, used_ns: u64, now: u64) {
        let now = self.advance(now);
        if self
            .settling
            .get(&token)
            .is_some_and(|h| h.client == client)
        {
            let h = self.settling.remove(&token).expect("checked");
            let drained = h.granted_at + self.charge_late(h, used_ns, now);
            let min_quota = self.cfg.min_quota_ns;
            if let Some(next) = self.holder.as_mut()
                && next.follows == Some(token)
                && drained > next.granted_at
            {
                let late = (drained - next.granted_at).min(min_quota);
                next.granted_at += late;
                next.late_ns += late;
            }
        }
    }

    /// A token no longer held reports its real use: charge up to it (never beyond the time
    /// since its grant, never below what was charged already). Returns the charge.
    fn charge_late(&mut self, mut h: Hold, used_ns: u64, now: u64) -> u64 {
        let charge = used_ns.min(now.saturating_sub(h.granted_at)).max(h.applied);
        self.charge(&mut h, charge, now);
        charge
    }

    /// Handles timeouts at `now`: revokes a holder past deadline + grace (and grants the next
    /// client), and grants a capped group whose bucket has refilled.
    pub fn tick(&mut self, now: u64) {
        let now = self.advance(now);
        if self
            .holder
            .as_ref()
            .is_some_and(|h| now >= h.deadline_ns.saturating_add(self.cfg.grace_ns))
        {
            let mut h = self.holder.take().expect("checked");
            let elapsed = now.saturating_sub(h.granted_at);
            self.charge(&mut h, elapsed, now);
            if let Some(g) = self.groups.get_mut(&h.group) {
                g.holding = false;
                g.last_active = now;
                g.revocations += 1;
                g.overruns += 1;
                if !g.active() {
                    self.targets_dirty = true;
                }
            }
            self.decisions.push(Decision::Revoke {
                client: h.client,
                token: h.token,
            });
            if self.revoked.len() >= MAX_REVOKED {
                self.revoked.pop_first();
            }
            self.revoked.insert(h.token, h);
        }
        // A capped group whose bucket refilled while it waited returns like one from idle.
        let depth = self.bucket_depth();
        let thr = self.cap_threshold();
        let refilled: Vec<String> = self
            .groups
            .iter()
            .filter(|(_, g)| g.held_back && g.eligible(now, depth, thr))
            .map(|(n, _)| n.clone())
            .collect();
        for name in refilled {
            self.preempt_for(&name, now);
        }
        self.schedule(now);
        self.extend_lone_holder(now);
        self.mark_held_back(now);
    }

    /// `asker` asks while the holder's token is extended (point 9): it ends a minimum quota
    /// from now, or at its deadline before the extension if that is later (unless the holder
    /// itself asks for its next turn).
    fn end_extension(&mut self, asker: ClientId, now: u64) {
        let min_quota = self.cfg.min_quota_ns;
        let Some(h) = self.holder.as_mut().filter(|h| h.client != asker) else {
            return;
        };
        let Some(unextended) = h.unextended.take() else {
            return;
        };
        let deadline_ns = now.saturating_add(min_quota).max(unextended);
        if deadline_ns < h.deadline_ns {
            h.deadline_ns = deadline_ns;
            self.decisions.push(Decision::Shorten {
                client: h.client,
                token: h.token,
                deadline_ns,
            });
        }
    }

    /// No one but the holder could take the GPU: no other group wants it or released it a
    /// moment ago (it will ask again), no one eligible waits, the token is kept for no one.
    fn holder_alone(&self, now: u64) -> bool {
        let Some(holder) = self.holder.as_ref().map(|h| &h.group) else {
            return false;
        };
        !self.groups.iter().any(|(n, g)| n != holder && g.active())
            && self.best_waiter(now).is_none()
            && self.reserved_for(now).is_none()
    }

    /// How long before its deadline a lone holder's token is extended: time for the message
    /// to arrive before the client starts to give the token back.
    fn extend_margin(&self) -> u64 {
        self.cfg.min_quota_ns
    }

    /// Point 9: when the holder's deadline is less than [`Policy::extend_margin`] away and no
    /// one else could be granted, push it a quota further (reserved like a grant), up to a
    /// tenth of the window in all: its client still reports (and drains) now and then.
    fn extend_lone_holder(&mut self, now: u64) {
        let (lo, _) = self.credit_bounds();
        let (depth, thr, window) = (
            self.bucket_depth(),
            self.cap_threshold(),
            self.cfg.window_ns,
        );
        let (quota, margin) = (self.cfg.quota_ns, self.extend_margin());
        if !self.holder_alone(now) {
            return;
        }
        let Some(h) = self.holder.as_mut() else {
            return;
        };
        let longest = (window / 10).max(quota);
        if now >= h.deadline_ns
            || now.saturating_add(margin) < h.deadline_ns
            || h.deadline_ns + quota - h.granted_at > longest
        {
            return;
        }
        let Some(g) = self.groups.get_mut(&h.group) else {
            return;
        };
        if !g.eligible(now, depth, thr) {
            return;
        }
        g.reserve(quota, now, lo, depth, window);
        h.unextended.get_or_insert(h.deadline_ns);
        h.deadline_ns += quota;
        h.quota_ns += quota;
        h.applied += quota;
        self.decisions.push(Decision::Extend {
            client: h.client,
            token: h.token,
            deadline_ns: h.deadline_ns,
        });
    }

    /// Notes which waiting groups their bucket holds back (see [`Policy::tick`]).
    fn mark_held_back(&mut self, now: u64) {
        let depth = self.bucket_depth();
        let thr = self.cap_threshold();
        for g in self.groups.values_mut() {
            g.held_back = !g.queue.is_empty() && !g.eligible(now, depth, thr);
        }
    }

    /// The decisions taken since the last call, in order.
    pub fn take_decisions(&mut self) -> Vec<Decision> {
        std::mem::take(&mut self.decisions)
    }

    /// The earliest time at which [`Policy::tick`] has something to do: the holder's revocation
    /// time, or (token free) when the first waiting capped group's bucket holds a quota. May be
    /// in the past (then tick at once); `None` when nothing is pending.
    pub fn next_wakeup(&self, _now: u64) -> Option<u64> {
        let depth = self.bucket_depth();
        let thr = self.cap_threshold();
        if let Some(h) = &self.holder {
            // Also when a held-back group's bucket refills: it may take the GPU back then.
            let refill = self
                .groups
                .values()
                .filter(|g| g.held_back)
                .filter_map(|g| g.eligible_at(self.now, depth, thr));
            // And shortly before its deadline, to extend it if nobody else could be granted.
            let extend = h.deadline_ns.saturating_sub(self.extend_margin());
            // (Only no waiter is asked for here: a group that just released may be idle by
            // then, and the tick checks the rest.)
            let extend =
                (self.now < extend && self.best_waiter(self.now).is_none()).then_some(extend);
            return refill
                .chain(extend)
                .chain([h.deadline_ns.saturating_add(self.cfg.grace_ns)])
                .min();
        }
        let reserved = self.reserved_for(self.now);
        self.groups
            .iter()
            .filter(|(_, g)| !g.queue.is_empty())
            .filter_map(|(name, g)| {
                let at = g.eligible_at(self.now, depth, thr)?;
                Some(match reserved {
                    Some((r, until)) if r != name => at.max(until),
                    _ => at,
                })
            })
            .min()
    }

    /// The group the free token is being kept for, and until when (see the module
    /// documentation, "Anticipation").
    pub fn anticipating(&self) -> Option<(&str, u64)> {
        self.reserved_for(self.now)
            .map(|(g, until)| (g.as_str(), until))
    }

    /// What the policy sees at `now`.
    pub fn status(&self, now: u64) -> GpuStatus {
        let now = now.max(self.now);
        let names: Vec<&String> = self.groups.keys().collect();
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
        let depth = self.bucket_depth();
        let thr = self.cap_threshold();
        let mut groups = Vec::with_capacity(names.len());
        for (i, (name, g)) in self.groups.iter().enumerate() {
            let mut used = g.usage_within(from, now);
            if let Some(h) = self.holder.as_ref().filter(|h| &h.group == name) {
                used += now.saturating_sub(h.granted_at.max(from)) as f64;
            }
            let allowance = g.capped().then(|| g.allowance(now, depth));
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
                allowance_ns: allowance,
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
            holder: self.holder.as_ref().map(|h| h.client),
            waiting: waiting.into_iter().map(|(_, id)| id).collect(),
            busy_share: groups.iter().map(|g| g.achieved_share).sum(),
            groups,
            holder_token: self.holder.as_ref().map(|h| h.token),
            holder_group: self.holder.as_ref().map(|h| h.group.clone()),
            holder_deadline_ns: self.holder.as_ref().map(|h| h.deadline_ns),
        }
    }

    /// The current holder and its token.
    pub fn holder(&self) -> Option<(ClientId, u64)> {
        self.holder.as_ref().map(|h| (h.client, h.token))
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

    /// Bucket depth: two quotas.
    fn bucket_depth(&self) -> f64 {
        2.0 * self.cfg.quota_ns as f64
    }

    /// Allowance a capped group needs before it may take the token: a full quota.
    fn cap_threshold(&self) -> f64 {
        self.cfg.quota_ns.max(self.cfg.min_quota_ns) as f64
    }

    /// Credit bounds `(−2B, B)`, `B = 2·quota + grace`.
    fn credit_bounds(&self) -> (f64, f64) {
        let b = 2.0 * self.cfg.quota_ns as f64 + self.cfg.grace_ns as f64;
        (-2.0 * b, b)
    }

    fn refresh_targets(&mut self) {
        if !self.targets_dirty {
            return;
        }
        self.targets_dirty = false;
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
        let now = self.now;
        let since = now.saturating_sub(self.first_acquire.unwrap_or(now)).max(1);
        let window = self.cfg.window_ns.min(since);
        for g in self.groups.values_mut() {
            g.banks = match (g.active(), g.banks) {
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
            .filter(|g| g.active() || g.banking())
            .map(|g| {
                if g.active() {
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
            g.target = if g.active() || g.banking() {
                targets.next().unwrap_or(0.0)
            } else {
                0.0
            };
        }
    }

    /// Moves the clock to `now` (never backwards), accruing credit for the time passed.
    fn advance(&mut self, now: u64) -> u64 {
        let now = now.max(self.now);
        while self.now < now {
            // Up to `now`, or to where a released group stops counting as active.
            let step = self
                .groups
                .values()
                .filter(|g| g.draining)
                .map(|g| g.draining_until.max(self.now))
                .fold(now, u64::min);
            self.refresh_targets();
            if self.holder.is_some() {
                self.accrue((step - self.now) as f64);
            }
            self.now = step;
            for g in self.groups.values_mut() {
                if g.draining && g.draining_until <= step {
                    g.draining = false;
                    self.targets_dirty |= !g.wants();
                }
            }
        }
        now
    }

    /// Credit accrual over `dt` ns of held token: each active group at its target share, each
    /// idle group with a request at its guarantee, normalised (so exactly `dt` is handed out,
    /// matching the usage that will be charged for that time); credit a group cannot absorb
    /// above the upper bound is redistributed by weight to the active groups below their limit;
    /// finally all groups are shifted by their common mean — which leaves every difference, and
    /// so every decision, unchanged, but keeps the values centred on the bounds.
    fn accrue(&mut self, dt: f64) {
        let (lo, hi) = self.credit_bounds();
        let total: f64 = self.groups.values().map(|g| g.target).sum();
        if total <= 0.0 {
            return;
        }
        // An idle group with a guarantee banks it, up to the upper bound: time it is owed but
        // does not use now, to take back at full speed when its work arrives (`preempt_for`).
        // What it cannot bank is spare time for the active groups (the overflow below).
        let mut overflow = 0.0;
        for g in self.groups.values_mut() {
            let add = g.target / total * dt;
            g.credit += add;
            if g.credit > hi {
                overflow += g.credit - hi;
                g.credit = hi;
            }
        }
        let recipient = |g: &Group| g.active() && g.credit < hi && g.target < g.params.limit;
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

    /// Settles `h` to a total charge of `total` ns: credit and bucket by the difference from
    /// what was already applied, statistics by what was not yet recorded.
    fn charge(&mut self, h: &mut Hold, total: u64, now: u64) {
        let (lo, _) = self.credit_bounds();
        let depth = self.bucket_depth();
        let window = self.cfg.window_ns;
        let Some(g) = self.groups.get_mut(&h.group) else {
            return;
        };
        let delta = total as f64 - h.applied as f64;
        g.credit = (g.credit - delta).max(lo);
        if g.capped() {
            g.refill(now, depth);
            let floor = g.bucket_floor(depth, window);
            let refund = if delta > 0.0 {
                g.clamp_lost.min(delta)
            } else {
                0.0
            };
            g.clamp_lost = 0.0;
            g.allowance = (g.allowance - delta + refund).clamp(floor, depth);
        }
        h.applied = total;
        if total > h.recorded {
            let extra = total - h.recorded;
            g.busy_ns += extra;
            g.record_usage(h.token, h.granted_at + h.recorded, extra);
            h.recorded = total;
        }
        g.prune_usage(now.saturating_sub(window));
    }

    /// Removes `client` from its group, the queue and the token (charging elapsed time),
    /// without granting anyone.
    fn detach(&mut self, client: ClientId, now: u64) {
        let Some(c) = self.clients.remove(&client) else {
            return;
        };
        if let Some(g) = self.groups.get_mut(&c.group) {
            g.clients.retain(|&id| id != client);
            g.queue.retain(|&(id, _)| id != client);
            g.last_active = now;
        }
        if self.holder.as_ref().is_some_and(|h| h.client == client) {
            let mut h = self.holder.take().expect("checked");
            let elapsed = now.saturating_sub(h.granted_at);
            self.charge(&mut h, elapsed, now);
            if let Some(g) = self.groups.get_mut(&h.group) {
                g.holding = false;
                g.last_active = now;
            }
        }
        self.revoked.retain(|_, h| h.client != client);
        self.settling.retain(|_, h| h.client != client);
        self.targets_dirty = true;
    }

    /// How long a free token is kept for a group that just released it: a quarter of the
    /// minimum quota (500 µs by default), far more than a client needs to ask again.
    fn anticipation_window(&self) -> u64 {
        (self.cfg.min_quota_ns / 4).max(1)
    }

    /// The group a free token is kept for at `now`, and until when: the anticipation, unless
    /// it has expired or its group has gone (removed, or its last client disconnected).
    fn reserved_for(&self, now: u64) -> Option<(&String, u64)> {
        self.anticipation
            .as_ref()
            .filter(|(r, until)| {
                now < *until
                    && self.holder.is_none()
                    && self.groups.get(r).is_some_and(|g| !g.clients.is_empty())
            })
            .map(|(r, until)| (r, *until))
    }

    /// The eligible waiting group that would get the token now, with its credit.
    fn best_waiter(&self, now: u64) -> Option<(&String, f64)> {
        let depth = self.bucket_depth();
        let thr = self.cap_threshold();
        let reserved = self.reserved_for(now).map(|(r, _)| r);
        self.groups
            .iter()
            .filter(|(n, g)| {
                !g.queue.is_empty()
                    && g.eligible(now, depth, thr)
                    && reserved.is_none_or(|r| r == *n)
            })
            .max_by(|(_, a), (_, b)| {
                a.credit
                    .total_cmp(&b.credit)
                    .then_with(|| b.queue[0].1.cmp(&a.queue[0].1))
            })
            .map(|(n, g)| (n, g.credit))
    }

    /// After `released` gave the token back at its deadline: if it is owed so much more than the best waiter
    /// that even a minimum-quota grant to that waiter would overshoot, keep the token for it for
    /// the anticipation window (it usually asks again at once).
    fn anticipate(&mut self, released: &str, now: u64) {
        self.anticipation = None;
        let depth = self.bucket_depth();
        let thr = self.cap_threshold();
        let Some(r) = self.groups.get(released) else {
            return;
        };
        if r.wants() || r.clients.is_empty() || !r.eligible(now, depth, thr) {
            return;
        }
        let slack = self.cfg.quota_ns.saturating_sub(self.cfg.min_quota_ns) as f64;
        let owed = self
            .best_waiter(now)
            .is_some_and(|(_, best)| r.credit - best > slack);
        if owed {
            let until = now + self.anticipation_window();
            self.anticipation = Some((released.to_string(), until));
        }
    }

    /// `group` just returned with work: if it is owed more than the holder will be at its
    /// deadline (the holder's credit settled for the time held), it would have been chosen had
    /// it been waiting at the grant. The holder's deadline then moves to when the two are even
    /// (never below `min_quota_ns` after its grant). A group that banked its guarantee while
    /// idle thus gets the GPU back within about a minimum quota.
    fn preempt_for(&mut self, group: &str, now: u64) {
        let (depth, thr) = (self.bucket_depth(), self.cap_threshold());
        let min_quota = self.cfg.min_quota_ns;
        let Some(h) = self.holder.as_mut() else {
            return;
        };
        let (Some(g), Some(hg)) = (self.groups.get(group), self.groups.get(&h.group)) else {
            return;
        };
        if h.group == group || !g.eligible(now, depth, thr) {
            return;
        }
        let settled = hg.credit + h.applied as f64 - now.saturating_sub(h.granted_at) as f64;
        let even = now.saturating_add((settled - g.credit).max(0.0) as u64);
        let deadline_ns = h.granted_at.saturating_add(min_quota).max(even);
        if deadline_ns >= h.deadline_ns {
            return;
        }
        h.deadline_ns = deadline_ns;
        if let Some(hg) = self.groups.get_mut(&h.group) {
            hg.preempted += 1;
        }
        self.decisions.push(Decision::Shorten {
            client: h.client,
            token: h.token,
            deadline_ns,
        });
    }

    /// Grants a free token to the best eligible waiting group, if any.
    ///
    /// Adaptive quota: a group that is not waiting right now but was active within the last
    /// quota (typically the one that just released: it asks again at once; or a short user
    /// between two bursts) and is owed more than the grantee would have been chosen had it been
    /// waiting. The grant is shortened by the difference (never below `min_quota_ns`), so the
    /// token comes back to it sooner instead of after a whole quota.
    fn schedule(&mut self, now: u64) {
        if self.holder.is_some() {
            return;
        }
        let depth = self.bucket_depth();
        let thr = self.cap_threshold();
        let Some(name) = self.best_waiter(now).map(|(n, _)| n.clone()) else {
            return;
        };
        self.anticipation = None;
        let (lo, _) = self.credit_bounds();
        let window = self.cfg.window_ns;
        let (quota, min_quota) = (self.cfg.quota_ns, self.cfg.min_quota_ns);
        let own = self.groups[&name].credit;
        let lead = self
            .groups
            .iter()
            .filter(|(n, g)| {
                **n != name
                    && !g.wants()
                    && !g.clients.is_empty()
                    && now.saturating_sub(g.last_active) <= quota
                    // One banking its guarantee takes the GPU back on return (`preempt_for`).
                    && (!g.banking() || self.cut_off.as_ref() == Some(*n))
                    && g.eligible(now, depth, thr)
            })
            .map(|(_, g)| g.credit - own)
            .fold(0.0, f64::max);
        let g = self.groups.get_mut(&name).expect("exists");
        let (client, _) = g.queue.pop_front().expect("non-empty");
        let mut quota_ns = ((quota as f64 - lead).max(0.0) as u64).max(min_quota);
        if g.capped() {
            g.refill(now, depth);
            quota_ns = quota_ns.min(g.allowance.floor().max(0.0) as u64);
        }
        let quota_ns = quota_ns.max(min_quota);
        g.reserve(quota_ns, now, lo, depth, window);
        g.holding = true;
        g.tokens += 1;
        if let Some(c) = self.clients.get_mut(&client) {
            c.waiting = None;
        }
        let token = self.next_token;
        self.next_token += 1;
        let (previous, drained) = self.busy_until;
        let start_ns = now.max(drained);
        let deadline_ns = start_ns.saturating_add(quota_ns);
        self.holder = Some(Hold {
            client,
            group: name,
            token,
            granted_at: start_ns,
            follows: (start_ns > now).then_some(previous),
            late_ns: 0,
            unextended: None,
            deadline_ns,
            quota_ns,
            applied: quota_ns,
            recorded: 0,
        });
        self.decisions.push(Decision::Grant {
            client,
            token,
            start_ns,
            deadline_ns,
            quota_ns,
        });
    }
}
