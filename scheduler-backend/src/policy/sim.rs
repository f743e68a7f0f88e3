//! A virtual-time simulator driving a [`Policy`] (tests only).
//!
//! Simulated tenants (one client each) follow a demand pattern, the GPU is serial, every token
//! costs a handoff (grant → the client's first kernel runs) out of its quota, and work may
//! overrun the quota. The simulator behaves like the daemon's shell: it feeds the policy events
//! at their virtual times, executes its decisions and calls `tick` at `next_wakeup`. It records
//! per group the time the token was held (what the policy charges) and the device work, in bins,
//! and checks on the way that the policy never grants a client that is not waiting, never grants
//! a second token, and never leaves the token free while a group without a cap waits.

use super::{ClientId, Decision, GroupParams, Policy, PolicyConfig};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

pub const MS: u64 = 1_000_000;
pub const S: u64 = 1_000_000_000;

/// splitmix64: small, deterministic, good enough for workloads.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
}

/// When and how much a tenant uses the GPU.
#[derive(Debug, Clone)]
pub enum Demand {
    /// Always has work: asks again at once and uses its whole quota.
    Busy,
    /// Asks again at once but uses a uniformly random fraction `lo..hi` of its quota.
    Fraction { lo: f64, hi: f64 },
    /// Busy for `on_ns`, idle for `off_ns`, repeating; starts `phase_ns` into the cycle.
    OnOff {
        on_ns: u64,
        off_ns: u64,
        phase_ns: u64,
    },
    /// Bursts of `use_ns` of work (over several tokens if a grant is shorter), released early,
    /// then `think_ns` of CPU before the next burst.
    Short { use_ns: u64, think_ns: u64 },
    /// Never asks.
    Idle,
    /// Busy, but the first token granted at or after `at_ns` is held without any GPU work until
    /// `until_ns` (a stopped process), then released reporting the whole time as used.
    Stuck { at_ns: u64, until_ns: u64 },
}

#[derive(Debug, Clone)]
pub struct Tenant {
    /// Index into the simulator's groups.
    pub group: usize,
    pub demand: Demand,
    /// With probability `.0`, a token's work runs past its quota by up to `.1` ns.
    pub overrun: Option<(f64, u64)>,
    /// A tenant that asks again at once asks *before* releasing (holder queues for its next
    /// turn) instead of right after.
    pub ask_before_release: bool,
    /// A tenant that asks again at once does so this long after releasing (the hook hands over
    /// at a synchronisation and asks again when it returns, as the work drains).
    pub ask_after_ns: u64,
}

impl Tenant {
    pub fn new(group: usize, demand: Demand) -> Tenant {
        Tenant {
            group,
            demand,
            overrun: None,
            ask_before_release: false,
            ask_after_ns: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Idle,
    Waiting,
    Holding(u64),
    Revoked,
    Gone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Acquire,
    Release { token: u64, used: u64 },
}

/// Run-wide measurements.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    /// ∫ min(1, Σ limits of the active groups) dt: the busy time work conservation promises.
    pub promised_ns: f64,
    /// Time the token was held by someone.
    pub held_ns: f64,
    /// Time the token was kept free for a group that had just released it (anticipation).
    pub anticipation_ns: u64,
    /// Time the token was free while a group with limit 1 waited (must stay 0).
    pub idle_with_uncapped_waiter_ns: u64,
    /// Time the token was free while a capped group waited that was below its limit, i.e. had
    /// not used more than `limit · (t − s) + quota` over any trailing interval `(s, t]`
    /// (must stay 0).
    pub idle_with_capped_waiter_below_limit_ns: u64,
    pub grants: u64,
    pub revocations: u64,
    /// Tokens whose deadline was moved earlier for a returning group.
    pub shortened: u64,
    /// Tokens whose deadline was moved later for a lone holder.
    pub extended: u64,
    /// Per tenant, the longest time between asking and being granted.
    pub max_wait_ns: Vec<u64>,
    /// Per tenant, total time between asking and being granted, and the number of grants.
    pub total_wait_ns: Vec<u64>,
    pub grants_of: Vec<u64>,
    /// The longest a holder kept the token past its deadline (to release or revocation).
    pub max_overrun_ns: u64,
    /// Policy calls made.
    pub calls: u64,
}

pub struct Sim {
    pub policy: Policy,
    pub now: u64,
    pub groups: Vec<(String, GroupParams)>,
    pub tenants: Vec<Tenant>,
    states: Vec<State>,
    asked_at: Vec<u64>,
    granted_at: u64,
    stuck_done: Vec<bool>,
    /// Short users: work left of the current burst (cut off by a short grant).
    burst_left: Vec<u64>,
    /// Per tenant, the token it holds and its planned release (changed by a shortened deadline).
    plans: Vec<Option<Plan>>,
    heap: BinaryHeap<Reverse<(u64, u64, usize, Ev)>>,
    seq: u64,
    wakeup: Option<u64>,
    rng: Rng,
    /// Time from grant to the client's first kernel, paid out of its quota.
    pub handoff_ns: u64,
    pub bin_ns: u64,
    /// Per group, per bin: ns the group held the GPU (handoff + work: what it reports).
    pub held: Vec<Vec<f64>>,
    /// Per group, per bin: ns of device work.
    pub work: Vec<Vec<f64>>,
    holder: Option<usize>,
    /// Per group, `X = max over s of [usage(s, t) − limit · (t − s)]` as of the time given
    /// (usage counted at grant), kept by the recursion `X ← max(0, X − limit · Δt) + used`.
    excess: Vec<(f64, u64)>,
    pub stats: Stats,
}

/// A token's planned use: held `start .. start + used`, device work from `start + handoff`
/// (none for a stuck holder).
#[derive(Debug, Clone, Copy)]
struct Plan {
    token: u64,
    start: u64,
    used: u64,
    handoff: u64,
    works: bool,
    /// The token's deadline as last told.
    deadline: u64,
    /// Held and device time are recorded up to here.
    recorded_to: u64,
}

fn client_of(tenant: usize) -> ClientId {
    tenant as ClientId + 1
}

fn add_interval(bins: &mut Vec<f64>, bin_ns: u64, a: u64, b: u64) {
    if b <= a {
        return;
    }
    let last = ((b - 1) / bin_ns) as usize;
    if bins.len() <= last {
        bins.resize(last + 1, 0.0);
    }
    let mut t = a;
    while t < b {
        let bin = t / bin_ns;
        let end = ((bin + 1) * bin_ns).min(b);
        bins[bin as usize] += (end - t) as f64;
        t = end;
    }
}

impl Sim {
    /// Groups and tenants; tenant `i` is client `i + 1`. Handoff 50 µs, 10 ms bins.
    pub fn new(
        cfg: PolicyConfig,
        groups: &[(&str, GroupParams)],
        tenants: Vec<Tenant>,
        seed: u64,
    ) -> Sim {
        let mut policy = Policy::new(cfg);
        for (name, p) in groups {
            policy.set_group(name, *p).expect("valid test parameters");
        }
        let n = tenants.len();
        let mut sim = Sim {
            policy,
            now: 0,
            groups: groups.iter().map(|(n, p)| (n.to_string(), *p)).collect(),
            tenants,
            states: vec![State::Idle; n],
            asked_at: vec![0; n],
            granted_at: 0,
            stuck_done: vec![false; n],
            burst_left: vec![0; n],
            plans: vec![None; n],
            heap: BinaryHeap::new(),
            seq: 0,
            wakeup: None,
            rng: Rng::new(seed),
            handoff_ns: 50_000,
            bin_ns: 10 * MS,
            held: vec![Vec::new(); groups.len()],
            work: vec![Vec::new(); groups.len()],
            holder: None,
            excess: vec![(0.0, 0); groups.len()],
            stats: Stats {
                max_wait_ns: vec![0; n],
                total_wait_ns: vec![0; n],
                grants_of: vec![0; n],
                ..Stats::default()
            },
        };
        for i in 0..n {
            let g = &sim.groups[sim.tenants[i].group].0;
            sim.policy.connect(client_of(i), g).expect("known group");
            sim.next_ask(i, true);
        }
        sim
    }

    fn push(&mut self, at: u64, tenant: usize, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, tenant, ev)));
    }

    /// Schedules tenant `i`'s next request after a release (or at the start).
    fn next_ask(&mut self, i: usize, start: bool) {
        let now = self.now;
        match self.tenants[i].demand.clone() {
            Demand::Busy | Demand::Fraction { .. } | Demand::Stuck { .. } => {
                // Stagger the very first requests a little so ties are not all at t = 0.
                let at = if start {
                    now + i as u64 * 1000
                } else {
                    now + self.tenants[i].ask_after_ns
                };
                self.push(at, i, Ev::Acquire);
            }
            Demand::Short { think_ns, .. } => {
                // Cut off mid-burst: asks again at once for the rest.
                let at = if start {
                    now + i as u64 * 1000
                } else if self.burst_left[i] > 0 {
                    now
                } else {
                    now + think_ns
                };
                self.push(at, i, Ev::Acquire);
            }
            Demand::OnOff {
                on_ns,
                off_ns,
                phase_ns,
            } => {
                let period = on_ns + off_ns;
                let pos = (now + phase_ns) % period;
                let at = if pos < on_ns { now } else { now + period - pos };
                self.push(at, i, Ev::Acquire);
            }
            Demand::Idle => {}
        }
    }

    /// Simulates until `end`.
    pub fn run_until(&mut self, end: u64) {
        let mut last_tick = None;
        let mut ticks_at_same_time = 0;
        loop {
            let next_ev = self.heap.peek().map(|Reverse((t, ..))| *t);
            let t = match (next_ev, self.wakeup) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) => a,
                (None, Some(b)) => b,
                (None, None) => end,
            };
            if t >= end {
                self.integrate(end);
                // Tokens still held count up to here (a lone holder's may be long).
                for i in 0..self.plans.len() {
                    if let Some(p) = self.plans[i] {
                        self.plans[i] = Some(self.record_until(i, p, end));
                    }
                }
                return;
            }
            self.integrate(t);
            let is_tick = self
                .wakeup
                .is_some_and(|w| w <= next_ev.unwrap_or(u64::MAX));
            if is_tick {
                if last_tick == Some(t) {
                    ticks_at_same_time += 1;
                } else {
                    ticks_at_same_time = 0;
                }
                last_tick = Some(t);
                assert!(
                    ticks_at_same_time < 10,
                    "next_wakeup keeps asking for a tick at {t} that does nothing"
                );
                self.stats.calls += 1;
                self.policy.tick(t);
            } else {
                let Reverse((_, _, i, ev)) = self.heap.pop().expect("peeked");
                self.handle(i, ev);
            }
            self.process();
            self.wakeup = self.policy.next_wakeup(self.now).map(|w| w.max(t));
        }
    }

    fn integrate(&mut self, t: u64) {
        if t <= self.now {
            return;
        }
        let dt = t - self.now;
        let mut active = vec![false; self.groups.len()];
        let mut uncapped_waiting = false;
        for (i, s) in self.states.iter().enumerate() {
            let g = self.tenants[i].group;
            match s {
                State::Waiting => {
                    active[g] = true;
                    if self.groups[g].1.limit >= 1.0 {
                        uncapped_waiting = true;
                    }
                }
                State::Holding(_) => active[g] = true,
                _ => {}
            }
        }
        let limits: f64 = (0..self.groups.len())
            .filter(|&g| active[g])
            .map(|g| self.groups[g].1.limit)
            .sum();
        self.stats.promised_ns += limits.min(1.0) * dt as f64;
        if self.holder.is_some() {
            self.stats.held_ns += dt as f64;
        } else if self.policy.anticipating().is_some() {
            self.stats.anticipation_ns += dt;
        } else if uncapped_waiting {
            self.stats.idle_with_uncapped_waiter_ns += dt;
        } else {
            let waiting_capped: Vec<usize> = (0..self.groups.len())
                .filter(|&g| {
                    let l = self.groups[g].1.limit;
                    l > 0.0 && l < 1.0
                })
                .filter(|&g| {
                    (0..self.tenants.len())
                        .any(|i| self.tenants[i].group == g && self.states[i] == State::Waiting)
                })
                .collect();
            if waiting_capped.iter().any(|&g| !self.at_limit(g)) {
                self.stats.idle_with_capped_waiter_below_limit_ns += dt;
            }
        }
        self.now = t;
    }

    /// Whether group `g` has, at the current time, used more than `limit · (now − s) + quota`
    /// over some trailing interval `(s, now]`: a token bucket of depth two quotas, counting
    /// usage at grant, would hold less than the quota it needs to grant.
    fn at_limit(&self, g: usize) -> bool {
        let quota = self.policy.config().quota_ns as f64;
        self.excess_at(g, self.now) >= quota - 1000.0
    }

    fn excess_at(&self, g: usize, t: u64) -> f64 {
        let (x, at) = self.excess[g];
        (x - self.groups[g].1.limit * t.saturating_sub(at) as f64).max(0.0)
    }

    fn acquire_now(&mut self, i: usize) {
        if self.states[i] != State::Idle {
            return;
        }
        self.states[i] = State::Waiting;
        self.asked_at[i] = self.now;
        self.stats.calls += 1;
        self.policy
            .acquire(client_of(i), self.now)
            .expect("connected");
        self.process();
    }

    fn handle(&mut self, i: usize, ev: Ev) {
        match ev {
            Ev::Acquire => self.acquire_now(i),
            Ev::Release { token, used } => {
                if self.states[i] == State::Gone {
                    return;
                }
                let deadline = match self.plans[i] {
                    Some(p) if p.token == token && p.used == used => {
                        self.plans[i] = None;
                        self.record(i, p);
                        p.deadline
                    }
                    // Superseded by a moved deadline.
                    _ => return,
                };
                match self.states[i] {
                    State::Holding(t) if t == token => {
                        self.holder = None;
                        self.stats.max_overrun_ns = self
                            .stats
                            .max_overrun_ns
                            .max(self.now.saturating_sub(deadline));
                        self.states[i] = State::Idle;
                    }
                    State::Revoked => self.states[i] = State::Idle,
                    s => panic!("tenant {i} releases token {token} in state {s:?}"),
                }
                let again_at_once = matches!(
                    self.tenants[i].demand,
                    Demand::Busy | Demand::Fraction { .. } | Demand::Stuck { .. }
                );
                if again_at_once && self.tenants[i].ask_before_release {
                    // Queue for the next turn first; the policy may hand it the very next token.
                    self.states[i] = State::Waiting;
                    self.asked_at[i] = self.now;
                    self.stats.calls += 2;
                    self.policy
                        .acquire(client_of(i), self.now)
                        .expect("connected");
                    self.process();
                    self.policy
                        .release(client_of(i), token, used, self.now)
                        .expect("connected");
                    self.process();
                    return;
                }
                self.stats.calls += 1;
                self.policy
                    .release(client_of(i), token, used, self.now)
                    .expect("connected");
                self.process();
                self.next_ask(i, false);
            }
        }
    }

    /// Executes the policy's decisions, checking them.
    fn process(&mut self) {
        for d in self.policy.take_decisions() {
            match d {
                Decision::Grant {
                    client,
                    token,
                    start_ns,
                    deadline_ns,
                    quota_ns,
                } => {
                    let i = (client - 1) as usize;
                    assert_eq!(
                        self.states[i],
                        State::Waiting,
                        "granted a client not waiting"
                    );
                    assert!(self.holder.is_none(), "granted a second token");
                    // These clients release once drained: nothing of theirs is left queued.
                    assert_eq!(start_ns, self.now);
                    assert_eq!(deadline_ns, self.now + quota_ns);
                    assert!(quota_ns >= self.policy.config().min_quota_ns);
                    self.stats.grants += 1;
                    let waited = self.now - self.asked_at[i];
                    self.stats.max_wait_ns[i] = self.stats.max_wait_ns[i].max(waited);
                    self.stats.total_wait_ns[i] += waited;
                    self.stats.grants_of[i] += 1;
                    self.holder = Some(i);
                    self.granted_at = self.now;
                    self.states[i] = State::Holding(token);
                    self.run_token(i, token, quota_ns);
                }
                Decision::Shorten {
                    client,
                    token,
                    deadline_ns,
                } => {
                    let i = self.holding(client, token, "shortened");
                    let min_quota = self.policy.config().min_quota_ns;
                    assert!(
                        deadline_ns >= self.granted_at + min_quota,
                        "shortened below min"
                    );
                    assert!(deadline_ns >= self.now, "shortened into the past");
                    self.stats.shortened += 1;
                    self.shorten(i, deadline_ns);
                }
                Decision::Extend {
                    client,
                    token,
                    deadline_ns,
                } => {
                    let i = self.holding(client, token, "extended");
                    assert!(deadline_ns > self.now, "extended into the past");
                    self.stats.extended += 1;
                    self.extend(i, deadline_ns);
                }
                Decision::Revoke { client, token } => {
                    let i = self.holding(client, token, "revoked");
                    assert_eq!(self.holder, Some(i));
                    let grace = self.policy.config().grace_ns;
                    let deadline = self.plans[i].map_or(self.granted_at, |p| p.deadline);
                    assert!(self.now >= deadline + grace, "revoked too early");
                    self.stats.max_overrun_ns = self.stats.max_overrun_ns.max(self.now - deadline);
                    self.stats.revocations += 1;
                    self.holder = None;
                    self.states[i] = State::Revoked;
                }
            }
        }
    }

    /// The tenant of `client`, checked to hold `token` (a decision `what` concerns it).
    fn holding(&self, client: ClientId, token: u64, what: &str) -> usize {
        let i = (client - 1) as usize;
        assert_eq!(self.states[i], State::Holding(token), "{what} a non-holder");
        i
    }

    /// Plans the work of tenant `i` under a fresh token.
    fn run_token(&mut self, i: usize, token: u64, quota_ns: u64) {
        let now = self.now;
        let t = self.tenants[i].clone();
        let stuck = match t.demand {
            Demand::Stuck { at_ns, until_ns } if !self.stuck_done[i] && now >= at_ns => {
                Some(until_ns)
            }
            _ => None,
        };
        if let Some(until_ns) = stuck {
            self.stuck_done[i] = true;
            let until = until_ns.max(now + 1);
            // It will report the whole time, and be charged it.
            self.excess[t.group] = (self.excess_at(t.group, now) + (until - now) as f64, now);
            self.plans[i] = Some(Plan {
                token,
                start: now,
                used: until - now,
                handoff: 0,
                works: false,
                deadline: now + quota_ns,
                recorded_to: now,
            });
            self.push(
                until,
                i,
                Ev::Release {
                    token,
                    used: until - now,
                },
            );
            return;
        }
        let h = self.handoff_ns;
        let room = quota_ns.saturating_sub(h);
        let mut work = match t.demand {
            Demand::Busy | Demand::OnOff { .. } | Demand::Stuck { .. } | Demand::Idle => room,
            Demand::Fraction { lo, hi } => (room as f64 * self.rng.range(lo, hi)) as u64,
            Demand::Short { use_ns, .. } => {
                let left = if self.burst_left[i] > 0 {
                    self.burst_left[i]
                } else {
                    use_ns
                };
                let work = left.min(room);
                self.burst_left[i] = left - work;
                work
            }
        };
        let overrun = t.overrun.filter(|&(p, _)| self.rng.unit() < p);
        if let Some((_, extra)) = overrun {
            work += (extra as f64 * self.rng.unit()) as u64;
        }
        let used = h + work;
        self.excess[t.group] = (self.excess_at(t.group, now) + used as f64, now);
        self.plans[i] = Some(Plan {
            token,
            start: now,
            used,
            handoff: h,
            works: true,
            deadline: now + quota_ns,
            recorded_to: now,
        });
        self.push(now + used, i, Ev::Release { token, used });
    }

    /// The held and device time of a finished token.
    fn record(&mut self, i: usize, p: Plan) {
        self.record_until(i, p, u64::MAX);
    }

    /// Records the held and device time of a token up to `t` (from where it was recorded to);
    /// returns the plan with that noted.
    fn record_until(&mut self, i: usize, mut p: Plan, t: u64) -> Plan {
        let g = self.tenants[i].group;
        let from = p.start.max(p.recorded_to);
        let end = (p.start + p.used).min(t).max(from);
        if p.works {
            add_interval(&mut self.held[g], self.bin_ns, from, end);
            add_interval(
                &mut self.work[g],
                self.bin_ns,
                from.max(p.start + p.handoff),
                end,
            );
        }
        p.recorded_to = end;
        p
    }

    /// Tenant `i`'s token now ends at `deadline_ns`: it stops its work there (what is left of
    /// a short user's burst stays to do) and releases.
    fn shorten(&mut self, i: usize, deadline_ns: u64) {
        let Some(mut p) = self.plans[i] else {
            return;
        };
        p.deadline = deadline_ns;
        self.plans[i] = Some(p);
        let used = deadline_ns.max(self.now) - p.start;
        if used >= p.used || !p.works {
            return;
        }
        let cut = p.used - used.max(p.handoff);
        if matches!(self.tenants[i].demand, Demand::Short { .. }) {
            self.burst_left[i] += cut;
        }
        let g = self.tenants[i].group;
        self.excess[g].0 = (self.excess[g].0 - (p.used - used) as f64).max(0.0);
        p.used = used;
        self.plans[i] = Some(p);
        self.push(
            p.start + used,
            i,
            Ev::Release {
                token: p.token,
                used,
            },
        );
    }

    /// Tenant `i`'s token now ends at the later `deadline_ns`: one that was going to work up to
    /// its deadline goes on (a short user only as far as its burst lasts).
    fn extend(&mut self, i: usize, deadline_ns: u64) {
        let Some(mut p) = self.plans[i] else {
            return;
        };
        let old = p.deadline;
        p.deadline = deadline_ns;
        self.plans[i] = Some(p);
        if !p.works || p.start + p.used < old {
            return;
        }
        let mut more = deadline_ns - old;
        if matches!(self.tenants[i].demand, Demand::Short { .. }) {
            more = more.min(self.burst_left[i]);
            self.burst_left[i] -= more;
        }
        if more == 0 {
            return;
        }
        let g = self.tenants[i].group;
        self.excess[g] = (self.excess_at(g, self.now) + more as f64, self.now);
        p.used += more;
        self.plans[i] = Some(p);
        self.push(
            p.start + p.used,
            i,
            Ev::Release {
                token: p.token,
                used: p.used,
            },
        );
    }

    /// Tenant `i`'s process dies (its connection closes).
    pub fn kill(&mut self, i: usize) {
        self.states[i] = State::Gone;
        if self.holder == Some(i) {
            self.holder = None;
        }
        self.stats.calls += 1;
        self.policy.disconnect(client_of(i), self.now);
        self.process();
        self.wakeup = self.policy.next_wakeup(self.now).map(|w| w.max(self.now));
    }

    /// Hot reload of a group's parameters (as the shell would do on a config change).
    pub fn set_group(&mut self, g: usize, p: GroupParams) {
        self.groups[g].1 = p;
        let name = self.groups[g].0.clone();
        self.policy.set_group(&name, p).expect("valid");
        self.policy.tick(self.now);
        self.process();
        self.wakeup = self.policy.next_wakeup(self.now).map(|w| w.max(self.now));
    }

    fn bins_share(&self, bins: &[f64], from: u64, to: u64) -> f64 {
        let (a, b) = ((from / self.bin_ns) as usize, (to / self.bin_ns) as usize);
        let sum: f64 = bins.iter().take(b).skip(a).sum();
        sum / (to - from) as f64
    }

    /// Share of `[from, to)` group `g` held the GPU (bin-aligned bounds).
    pub fn held_share(&self, g: usize, from: u64, to: u64) -> f64 {
        self.bins_share(&self.held[g], from, to)
    }

    /// Share of `[from, to)` the device ran group `g`'s work.
    pub fn work_share(&self, g: usize, from: u64, to: u64) -> f64 {
        self.bins_share(&self.work[g], from, to)
    }

    /// Tenant `i`'s mean wait between asking and being granted.
    pub fn mean_wait_ns(&self, i: usize) -> f64 {
        self.stats.total_wait_ns[i] as f64 / self.stats.grants_of[i].max(1) as f64
    }

    /// Device utilisation over `[from, to)`.
    pub fn utilisation(&self, from: u64, to: u64) -> f64 {
        (0..self.groups.len())
            .map(|g| self.work_share(g, from, to))
            .sum()
    }

    /// Shares of group `g` over every window of `win` starting at `from`, `from + step`, …
    /// and ending by `to`.
    pub fn window_shares(&self, g: usize, win: u64, step: u64, from: u64, to: u64) -> Vec<f64> {
        let mut out = Vec::new();
        let mut a = from;
        while a + win <= to {
            out.push(self.work_share(g, a, a + win));
            a += step;
        }
        out
    }
}
