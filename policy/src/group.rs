//! One group's state on one GPU: its clients' queue, its scheduling credit, its cap's token
//! bucket, and its charged usage over time.

use super::ClientId;
use super::GroupParams;
use std::collections::VecDeque;

/// Float slack (ns) when comparing a bucket against the threshold.
const NS_EPS: f64 = 0.5;
/// Usage intervals kept per group for the windowed share; older ones are merged beyond this.
const MAX_USAGE_ENTRIES: usize = 4096;

/// Charged usage over `[start, end)` (`busy ≤ end − start` once merged).
#[derive(Debug, Clone)]
struct Usage {
    token: u64,
    start: u64,
    end: u64,
    busy: u64,
}

#[derive(Debug, Clone)]
pub(super) struct Group {
    pub params: GroupParams,
    pub clients: Vec<ClientId>,
    /// Clients waiting for a turn with their request sequence number, FIFO.
    pub queue: VecDeque<(ClientId, u64)>,
    /// Turns of its clients running or planned.
    pub turns: u32,
    pub target: f64,
    /// The request, scaled down if the requests of the groups present sum to more than 1.
    pub guarantee: f64,
    /// Scheduling credit, ns: time it is owed (positive) or has had beyond its target.
    pub credit: f64,
    /// Waiting while its bucket held less than a quota (see `Policy::tick`).
    pub held_back: bool,
    /// Its processes are swapped out of the GPU's memory (`Policy::suspend`): out of the
    /// race — no turns, no target, no guarantee, its credit kept at its distance from the
    /// others' (`credit_ahead`).
    pub suspended: bool,
    /// While suspended: its credit less the mean credit of the groups still in the race when
    /// it left (`Policy::suspend`); it comes back at that distance from their mean.
    pub credit_ahead: Option<f64>,
    /// While idle: whether it banks its guarantee (it got less than that over the window when
    /// it went idle). `None` while active.
    pub banks: Option<bool>,
    allowance: f64,
    allowance_at: u64,
    /// Refill cut off by the depth since the last grant: while a turn is in flight only its
    /// quota is reserved, so an overrun settled later is partly paid from this, making the
    /// bucket exactly one debited with the true usage at grant.
    clamp_lost: f64,
    usage: VecDeque<Usage>,
    /// Last time the group stopped holding or had a client leave the queue.
    pub last_active: u64,
    /// After a client yielded its turn with work still draining: counted active until then (it
    /// usually asks again as its synchronisation returns; counted idle for that instant, its
    /// share would go to the others every turn).
    pub draining_until: u64,
    /// Where its last turn given back early ended: the turn that started there is the one it
    /// gave the GPU to, which it may take back at once if it returns
    /// (`docs/scheduling.md#preemption`).
    pub gave_back_at: u64,
    /// When it last asked for a turn after an absence (no turn, none asked for) of at least
    /// [`away_ns`](super::PolicyConfig::away_ns): it comes and goes, like a request server.
    pub returned_at: u64,
    pub busy_ns: u64,
    pub tokens: u64,
    pub waits: u64,
    pub overruns: u64,
    pub revocations: u64,
    pub preempted: u64,
}

impl Group {
    pub fn new(params: GroupParams, now: u64, depth: f64) -> Group {
        Group {
            params,
            clients: Vec::new(),
            queue: VecDeque::new(),
            turns: 0,
            target: 0.0,
            guarantee: 0.0,
            credit: 0.0,
            held_back: false,
            suspended: false,
            credit_ahead: None,
            banks: None,
            allowance: depth,
            allowance_at: now,
            clamp_lost: 0.0,
            usage: VecDeque::new(),
            last_active: 0,
            draining_until: 0,
            gave_back_at: 0,
            returned_at: 0,
            busy_ns: 0,
            tokens: 0,
            waits: 0,
            overruns: 0,
            revocations: 0,
            preempted: 0,
        }
    }

    /// Has a turn (running or planned) or waits for one.
    pub fn wants(&self) -> bool {
        self.turns > 0 || !self.queue.is_empty()
    }

    /// [`Group::wants`], or yielded a moment ago with work still draining: targets and credit
    /// count it.
    pub fn active_at(&self, now: u64) -> bool {
        !self.suspended && (self.wants() || now < self.draining_until)
    }

    pub fn capped(&self) -> bool {
        self.params.limit < 1.0
    }

    /// Idle (at `now`) and banking its guarantee.
    pub fn banking(&self, now: u64) -> bool {
        !self.active_at(now) && self.banks == Some(true) && self.guarantee > 0.0
    }

    /// Bucket content at `now` (infinite for an uncapped group).
    pub fn allowance(&self, now: u64, depth: f64) -> f64 {
        if !self.capped() {
            return f64::INFINITY;
        }
        let dt = now.saturating_sub(self.allowance_at) as f64;
        (self.allowance + self.params.limit * dt).min(depth)
    }

    /// May start a turn at `at`: not capped, or a bucket holding `thr` then (never with
    /// limit 0, nor while suspended).
    pub fn eligible(&self, at: u64, depth: f64, thr: f64) -> bool {
        self.may_run() && self.allowance(at, depth) >= thr - NS_EPS
    }

    /// Neither limited to nothing nor suspended.
    fn may_run(&self) -> bool {
        self.params.limit > 0.0 && !self.suspended
    }

    /// When its bucket will hold `thr` (`now` if it does; never with limit 0).
    pub fn eligible_at(&self, now: u64, depth: f64, thr: f64) -> Option<u64> {
        if self.eligible(now, depth, thr) {
            return Some(now);
        }
        self.may_run().then(|| {
            let wait = ((thr - self.allowance(now, depth)) / self.params.limit).ceil();
            now.saturating_add(wait.max(0.0) as u64)
        })
    }

    pub fn refill(&mut self, now: u64, depth: f64) {
        if self.capped() {
            let dt = now.saturating_sub(self.allowance_at) as f64;
            let raw = self.allowance + self.params.limit * dt;
            self.clamp_lost += (raw - depth.max(self.allowance)).max(0.0);
            self.allowance = raw.min(depth);
            self.allowance_at = self.allowance_at.max(now);
        }
    }

    /// Starts the bucket full (a group that just became capped).
    pub fn fill_bucket(&mut self, now: u64, depth: f64) {
        self.allowance = depth;
        self.allowance_at = now;
    }

    /// Keeps credit and bucket within new bounds (a configuration change).
    pub fn clamp(&mut self, (lo, hi): (f64, f64), depth: f64, window_ns: u64) {
        let floor = self.bucket_floor(depth, window_ns);
        self.allowance = self.allowance.clamp(floor, depth);
        self.credit = self.credit.clamp(lo, hi);
    }

    /// Debit `ns` of a turn about to run from credit and bucket (settled when it is charged).
    pub fn reserve(&mut self, ns: u64, now: u64, lo: f64, depth: f64, window_ns: u64) {
        self.credit = (self.credit - ns as f64).max(lo);
        if self.capped() {
            self.refill(now, depth);
            let floor = self.bucket_floor(depth, window_ns);
            self.allowance = (self.allowance - ns as f64).max(floor);
            self.clamp_lost = 0.0;
        }
    }

    /// Debit `delta` more (or refund, if negative) of a turn's charge from credit and bucket.
    pub fn settle(&mut self, delta: f64, now: u64, lo: f64, depth: f64, window_ns: u64) {
        self.credit = (self.credit - delta).max(lo);
        if self.capped() {
            self.refill(now, depth);
            let floor = self.bucket_floor(depth, window_ns);
            let refund = if delta > 0.0 {
                self.clamp_lost.min(delta)
            } else {
                0.0
            };
            self.clamp_lost = 0.0;
            self.allowance = (self.allowance - delta + refund).clamp(floor, depth);
        }
    }

    /// Lowest the bucket may go: one window's worth of allowance (at least one bucket), so one
    /// pathological report cannot lock a group out for longer than a window.
    fn bucket_floor(&self, depth: f64, window_ns: u64) -> f64 {
        -(depth.max(self.params.limit * window_ns as f64))
    }

    /// `extra` ns more of turn `token` (which started at `start`) were used.
    pub fn record_usage(&mut self, token: u64, start: u64, extra: u64) {
        if extra == 0 {
            return;
        }
        self.busy_ns += extra;
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

    pub fn prune_usage(&mut self, horizon: u64) {
        while self.usage.front().is_some_and(|u| u.end <= horizon) {
            self.usage.pop_front();
        }
    }

    /// Usage within `[from, to)`.
    pub fn usage_within(&self, from: u64, to: u64) -> f64 {
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
