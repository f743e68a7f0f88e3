//! A virtual-time simulator driving a [`Policy`] the way the daemon and the hooks do (tests
//! only).
//!
//! Simulated tenants (one client each) follow a demand pattern. As the hook does, a tenant
//! runs its planned turn from its start (its first kernel a configurable lateness after it, or
//! queued a configurable time before it),
//! stops at its deadline on its own (its last kernels running up to a configurable overrun
//! beyond it), reports what it measured a little later, and yields its turn when its work runs
//! out. The GPU is serial: a tenant's work runs only within its turns (an overrun aside). The
//! simulator executes the policy's decisions and calls `tick` at `next_wakeup`, records per
//! group the time its turns covered and its device work, in bins, and checks on the way that
//! the policy never grants a turn overlapping another, never grants a client that does not want
//! one, and never leaves the GPU without a turn while a group without a cap waits.

use super::{ClientId, Decision, GroupClass, GroupParams, Policy, PolicyConfig, TurnUse};
use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng as _, SeedableRng};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

pub const MS: u64 = 1_000_000;
pub const S: u64 = 1_000_000_000;

/// The workloads' draws, from SplitMix64: small, deterministic, good enough for workloads, and a
/// fixed algorithm (a seed gives the same runs on every platform and release).
#[derive(Debug, Clone)]
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(SplitMix64::seed_from_u64(seed ^ 0x9E37_79B9_7F4A_7C15))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform in [0, x].
    pub fn upto(&mut self, x: u64) -> u64 {
        (x as f64 * self.unit()) as u64
    }
}

/// When and how much a tenant uses the GPU.
#[derive(Debug, Clone)]
pub enum Demand {
    /// Always has work.
    Busy,
    /// Uses a uniformly random fraction `lo..hi` of each turn, yields it, and asks again at once.
    Fraction { lo: f64, hi: f64 },
    /// Busy for `on_ns`, idle for `off_ns`, repeating; starts `phase_ns` into the cycle.
    OnOff {
        on_ns: u64,
        off_ns: u64,
        phase_ns: u64,
    },
    /// Bursts of `use_ns` of work (over several turns if one is shorter), then `think_ns` of CPU
    /// before the next burst.
    Short { use_ns: u64, think_ns: u64 },
    /// Never asks.
    Idle,
    /// Busy, but from the first turn starting at or after `at_ns` until `until_ns` it does
    /// nothing at all (a stopped process): no work, no report; then it goes on.
    Stuck { at_ns: u64, until_ns: u64 },
}

#[derive(Debug, Clone)]
pub struct Tenant {
    /// Index into the simulator's groups.
    pub group: usize,
    pub demand: Demand,
    /// With probability `.0`, a turn's last kernels run past its end by up to `.1` ns (the hook
    /// stopped late).
    pub overrun: Option<(f64, u64)>,
    /// Its first kernel of a turn runs up to this long after the turn's start (the hook opened
    /// late), uniformly.
    pub late_ns: u64,
    /// Its report arrives this long after its turn's work ended.
    pub report_after_ns: u64,
    /// Its first kernel of a turn is queued this long before the turn's start, behind the
    /// previous holder's work, and reported so: the turn is charged from there.
    pub early_ns: u64,
}

impl Tenant {
    pub fn new(group: usize, demand: Demand) -> Tenant {
        Tenant {
            group,
            demand,
            overrun: None,
            late_ns: 0,
            report_after_ns: 300_000,
            early_ns: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Planned {
    token: u64,
    start: u64,
    deadline: u64,
}

/// A turn the tenant runs: its work from `work_from` until it stops.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Running {
    token: u64,
    start: u64,
    deadline: u64,
    work_from: u64,
    /// When this turn's work runs out (`u64::MAX`: not before the deadline).
    work_until: u64,
    /// Its last kernels run past the deadline by this much.
    overrun: u64,
    /// Frozen (a stopped process) until then.
    stuck_until: Option<u64>,
    /// Bumped whenever its end moves (stale `Stop` events are ignored).
    generation: u64,
    /// Held and device time are recorded up to here (a run can be continued).
    recorded_to: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Acquire,
    Start {
        token: u64,
    },
    Stop {
        token: u64,
        generation: u64,
    },
    Report {
        token: u64,
        first: u64,
        last: u64,
        again: bool,
    },
}

/// Run-wide measurements.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    /// ∫ min(1, Σ limits of the active groups) dt: the busy time work conservation promises.
    pub promised_ns: f64,
    /// Time the GPU ran no turn while a group with limit 1 waited (must stay 0 with tenants
    /// that open on time).
    pub idle_with_uncapped_waiter_ns: u64,
    /// Time the GPU ran no turn while a group with limit 1 waited because a latency-class
    /// group that gave its turn back keeps it a linger past its drain (docs/latency.md); it is
    /// charged for it.
    pub latency_linger_ns: u64,
    /// Turns given back by latency-class groups.
    pub latency_yields: u64,
    /// Time the GPU ran no turn while a capped group waited that was below its limit, i.e. had
    /// not been granted more than `limit · (t − s) + quota` over any trailing interval `(s, t]`
    /// (must stay 0).
    pub idle_with_capped_waiter_below_limit_ns: u64,
    pub grants: u64,
    pub revocations: u64,
    /// Turns whose deadline was moved earlier.
    pub shortened: u64,
    /// Turns whose deadline was moved later.
    pub extended: u64,
    /// Per tenant, the longest time between asking and its next turn starting.
    pub max_wait_ns: Vec<u64>,
    /// Per tenant, total time between asking and its turn starting, and the number of waits.
    pub total_wait_ns: Vec<u64>,
    pub waits_of: Vec<u64>,
    /// Per tenant, the largest queue budget it was granted.
    pub max_queue_budget_ns: Vec<u64>,
    /// Per tenant, grants (and moves) of turns that open no earlier than their start, where a
    /// latency-class group's work drains.
    pub opening_at_start: Vec<u64>,
    /// Per tenant, grants (and moves) of turns whose long kernels are launched just in time,
    /// beside a latency-class group.
    pub just_in_time: Vec<u64>,
    /// Per tenant, turns planned for it that it no longer wanted when they started (given
    /// straight back: its hook would hold such a turn an idle release before giving it back).
    pub unwanted: Vec<u64>,
    /// Policy calls made.
    pub calls: u64,
}

pub struct Sim {
    pub policy: Policy,
    pub now: u64,
    pub groups: Vec<(String, GroupParams)>,
    pub tenants: Vec<Tenant>,
    /// Per tenant: wants the GPU (has work, has asked).
    wants: Vec<bool>,
    /// Per tenant: turns it stopped but has not reported yet (the policy may still presume it
    /// wants another).
    unreported: Vec<u32>,
    asked_at: Vec<Option<u64>>,
    planned: Vec<Option<Planned>>,
    running: Vec<Option<Running>>,
    gone: Vec<bool>,
    stuck_done: Vec<bool>,
    /// Short users: work left of the current burst.
    burst_left: Vec<u64>,
    heap: BinaryHeap<Reverse<(u64, u64, usize, Ev)>>,
    seq: u64,
    wakeup: Option<u64>,
    rng: Rng,
    pub bin_ns: u64,
    /// Per group, per bin: ns of its turns (start to end, as the policy planned them).
    pub held: Vec<Vec<f64>>,
    /// Per group, per bin: ns of device work.
    pub work: Vec<Vec<f64>>,
    /// Per group, `X = max over s of [granted(s, t) − limit · (t − s)]` as of the time given,
    /// kept by the recursion `X ← max(0, X − limit · Δt) + granted`.
    excess: Vec<(f64, u64)>,
    /// Per group, when a tenant of it last gave a turn back early: the turn that starts then
    /// (within a minimum quota) may be taken back sooner than a minimum quota
    /// (`docs/scheduling.md#preemption`).
    yielded_at: Vec<Option<u64>>,
    /// Until when a latency-class group that gave its turn back may keep the GPU idle.
    lingering_until: u64,
    /// With probability `.0`, the policy's timer fires late by up to `.1` ns, uniformly (a
    /// scheduler short of CPU); `None`: on time.
    pub timer_late: Option<(f64, u64)>,
    /// The wakeup the policy last asked for and when its tick runs.
    late_tick: Option<(u64, u64)>,
    pub stats: Stats,
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
    /// Groups and tenants; tenant `i` is client `i + 1`. 10 ms bins.
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
            wants: vec![false; n],
            unreported: vec![0; n],
            asked_at: vec![None; n],
            planned: vec![None; n],
            running: vec![None; n],
            gone: vec![false; n],
            stuck_done: vec![false; n],
            burst_left: vec![0; n],
            heap: BinaryHeap::new(),
            seq: 0,
            wakeup: None,
            rng: Rng::new(seed),
            bin_ns: 10 * MS,
            held: vec![Vec::new(); groups.len()],
            work: vec![Vec::new(); groups.len()],
            excess: vec![(0.0, 0); groups.len()],
            yielded_at: vec![None; groups.len()],
            lingering_until: 0,
            timer_late: None,
            late_tick: None,
            stats: Stats {
                max_wait_ns: vec![0; n],
                total_wait_ns: vec![0; n],
                waits_of: vec![0; n],
                max_queue_budget_ns: vec![0; n],
                opening_at_start: vec![0; n],
                just_in_time: vec![0; n],
                unwanted: vec![0; n],
                ..Stats::default()
            },
        };
        for i in 0..n {
            let g = &sim.groups[sim.tenants[i].group].0;
            sim.policy.connect(client_of(i), g).expect("known group");
            // Stagger the very first requests a little so ties are not all at t = 0.
            sim.next_ask(i, Some(i as u64 * 1000));
        }
        sim
    }

    fn push(&mut self, at: u64, tenant: usize, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, tenant, ev)));
    }

    /// Schedules tenant `i`'s next request once it has none (`first`: the very first, at that
    /// time).
    fn next_ask(&mut self, i: usize, first: Option<u64>) {
        let now = self.now;
        let at = match self.tenants[i].demand.clone() {
            Demand::Busy | Demand::Fraction { .. } | Demand::Stuck { .. } => first.unwrap_or(now),
            Demand::Short { think_ns, .. } => match first {
                Some(t) => t,
                None if self.burst_left[i] > 0 => now,
                None => now + think_ns,
            },
            Demand::OnOff {
                on_ns,
                off_ns,
                phase_ns,
            } => {
                let period = on_ns + off_ns;
                let pos = (now + phase_ns) % period;
                if pos < on_ns { now } else { now + period - pos }
            }
            Demand::Idle => return,
        };
        self.push(at, i, Ev::Acquire);
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
                self.record_running(end);
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
                    "next_wakeup keeps asking for a tick at {t} that does nothing: current {:?} next {:?} ended {:?} busy_until {} groups {:?}",
                    self.policy.current,
                    self.policy.next,
                    self.policy.ended,
                    self.policy.busy_until,
                    self.policy
                        .groups
                        .iter()
                        .map(|(n, g)| (n, g.queue.clone(), g.held_back, g.turns))
                        .collect::<Vec<_>>()
                );
                self.stats.calls += 1;
                self.policy.tick(t);
            } else {
                let Reverse((_, _, i, ev)) = self.heap.pop().expect("peeked");
                self.handle(i, ev);
            }
            self.process();
            self.wakeup = (self.policy.next_wakeup(self.now))
                .map(|w| w.max(t))
                .map(|w| self.tick_time(w));
        }
    }

    /// When the tick the policy asks for at `w` runs: at `w`, or late by a draw of
    /// [`Sim::timer_late`] (one draw per wakeup asked for).
    fn tick_time(&mut self, w: u64) -> u64 {
        let Some((prob, max)) = self.timer_late else {
            return w;
        };
        if let Some((asked, at)) = self.late_tick
            && asked == w
        {
            return at;
        }
        let late = if self.rng.unit() < prob {
            self.rng.upto(max)
        } else {
            0
        };
        self.late_tick = Some((w, w + late));
        w + late
    }

    /// Tenant `i` gave its turn back, its work drained at `drained`.
    fn yielded(&mut self, i: usize, drained: u64) {
        let g = self.tenants[i].group;
        self.yielded_at[g] = Some(self.now);
        if self.groups[g].1.class == GroupClass::Latency {
            self.stats.latency_yields += 1;
            let until = drained + self.policy.config().latency_linger_ns();
            self.lingering_until = self.lingering_until.max(until);
        }
    }

    /// Advances the clock to `t`, checking work conservation over the interval.
    fn integrate(&mut self, t: u64) {
        if t <= self.now {
            return;
        }
        let dt = t - self.now;
        let mut active = vec![false; self.groups.len()];
        let mut uncapped_waiting = false;
        for i in 0..self.tenants.len() {
            let g = self.tenants[i].group;
            if self.wants[i] || self.running[i].is_some() {
                active[g] = true;
            }
            if self.wants[i] && self.running[i].is_none() && self.groups[g].1.limit >= 1.0 {
                uncapped_waiting = true;
            }
        }
        let limits: f64 = (0..self.groups.len())
            .filter(|&g| active[g])
            .map(|g| self.groups[g].1.limit)
            .sum();
        self.stats.promised_ns += limits.min(1.0) * dt as f64;
        if self.running.iter().all(Option::is_none) {
            // A latency-class group's linger is idle by design, charged to it.
            let linger = self.lingering_until.saturating_sub(self.now).min(dt);
            self.stats.latency_linger_ns += linger;
            let dt = dt - linger;
            if uncapped_waiting {
                self.stats.idle_with_uncapped_waiter_ns += dt;
            } else {
                let below: Vec<usize> = (0..self.groups.len())
                    .filter(|&g| {
                        let l = self.groups[g].1.limit;
                        l > 0.0 && l < 1.0 && !self.at_limit(g)
                    })
                    .filter(|&g| {
                        (0..self.tenants.len()).any(|i| {
                            self.tenants[i].group == g && self.wants[i] && self.running[i].is_none()
                        })
                    })
                    .collect();
                if !below.is_empty() {
                    self.stats.idle_with_capped_waiter_below_limit_ns += dt;
                }
            }
        }
        self.now = t;
    }

    /// Whether group `g` has been granted more than `limit · (now − s) + quota` over some
    /// trailing interval `(s, now]`: a token bucket of depth two quotas, counting turns at
    /// grant, would hold less than the quota it needs.
    fn at_limit(&self, g: usize) -> bool {
        let quota = self.policy.config().quota_ns as f64;
        self.excess_at(g, self.now) >= quota - 1000.0
    }

    fn excess_at(&self, g: usize, t: u64) -> f64 {
        let (x, at) = self.excess[g];
        (x - self.groups[g].1.limit * t.saturating_sub(at) as f64).max(0.0)
    }

    fn note_granted(&mut self, g: usize, ns: u64) {
        self.excess[g] = (self.excess_at(g, self.now) + ns as f64, self.now);
    }

    fn handle(&mut self, i: usize, ev: Ev) {
        if self.gone[i] {
            return;
        }
        match ev {
            Ev::Acquire => {
                if self.wants[i] {
                    return;
                }
                self.wants[i] = true;
                if self.running[i].is_none() && self.planned[i].is_none() {
                    self.asked_at[i] = Some(self.now);
                }
                self.stats.calls += 1;
                self.policy
                    .acquire(client_of(i), self.now)
                    .expect("connected");
            }
            Ev::Start { token } => {
                if self.planned[i].is_some_and(|p| p.token == token) {
                    let p = self.planned[i].take().expect("checked");
                    if self.wants[i] || self.running[i].is_some() {
                        self.start(i, p);
                    } else {
                        // Planned while it still had work; it has none now: given back at once.
                        self.stats.unwanted[i] += 1;
                        self.stats.calls += 1;
                        self.policy
                            .yield_turn(client_of(i), token, self.now, self.now)
                            .expect("connected");
                        self.yielded(i, self.now);
                        self.push(
                            self.now,
                            i,
                            Ev::Report {
                                token,
                                first: 0,
                                last: 0,
                                again: false,
                            },
                        );
                    }
                }
            }
            Ev::Stop { token, generation } => {
                if let Some(r) = self.running[i]
                    && r.token == token
                    && r.generation == generation
                {
                    self.stop(i, r);
                }
            }
            Ev::Report {
                token,
                first,
                last,
                again,
            } => {
                self.stats.calls += 1;
                self.unreported[i] = self.unreported[i].saturating_sub(1);
                let used = (last > first).then_some(TurnUse {
                    first_ns: first,
                    last_ns: last,
                });
                self.policy
                    .report(client_of(i), token, used, again, self.now)
                    .expect("connected");
            }
        }
    }

    /// Tenant `i` starts its turn `p` (now).
    fn start(&mut self, i: usize, p: Planned) {
        for (j, r) in self.running.iter().enumerate() {
            if let Some(r) = r {
                assert!(
                    r.deadline <= self.now,
                    "tenant {i}'s turn {} starts at {} while tenant {j}'s turn {} runs until {}",
                    p.token,
                    self.now,
                    r.token,
                    r.deadline
                );
            }
        }
        if let Some(asked) = self.asked_at[i].take() {
            let waited = self.now - asked;
            self.stats.max_wait_ns[i] = self.stats.max_wait_ns[i].max(waited);
            self.stats.total_wait_ns[i] += waited;
            self.stats.waits_of[i] += 1;
        }
        let t = self.tenants[i].clone();
        let now = self.now;
        let stuck_until = match t.demand {
            Demand::Stuck { at_ns, until_ns } if !self.stuck_done[i] && now >= at_ns => {
                self.stuck_done[i] = true;
                Some(until_ns.max(now + 1))
            }
            _ => None,
        };
        let late = self.rng.upto(t.late_ns);
        let overrun = t
            .overrun
            .filter(|&(prob, _)| self.rng.unit() < prob)
            .map_or(0, |(_, extra)| self.rng.upto(extra));
        let quota = p.deadline - p.start;
        let work_until = match t.demand {
            Demand::Fraction { lo, hi } => {
                now + late + (quota as f64 * self.rng.range(lo, hi)) as u64
            }
            Demand::Short { use_ns, .. } => {
                if self.burst_left[i] == 0 {
                    self.burst_left[i] = use_ns;
                }
                now + late + self.burst_left[i]
            }
            Demand::OnOff {
                on_ns,
                off_ns,
                phase_ns,
            } => {
                let period = on_ns + off_ns;
                let pos = (now + phase_ns) % period;
                if pos < on_ns {
                    now + (on_ns - pos)
                } else {
                    now
                }
            }
            _ => u64::MAX,
        };
        let r = Running {
            token: p.token,
            start: p.start,
            deadline: p.deadline,
            work_from: now + late,
            work_until,
            overrun,
            stuck_until,
            generation: 0,
            recorded_to: now,
        };
        self.running[i] = Some(r);
        self.schedule_stop(i);
    }

    /// Schedules tenant `i`'s stop: when its work runs out, or at its deadline (a stuck one
    /// when it wakes up).
    fn schedule_stop(&mut self, i: usize) {
        let Some(r) = self.running[i].as_mut() else {
            return;
        };
        r.generation += 1;
        let at = match r.stuck_until {
            Some(until) => until,
            None => r.work_until.min(r.deadline).max(self.now),
        };
        let (token, generation) = (r.token, r.generation);
        self.push(at, i, Ev::Stop { token, generation });
    }

    /// Tenant `i` stops its turn `r` now: its work ran out (it yields) or its deadline came.
    fn stop(&mut self, i: usize, r: Running) {
        self.running[i] = None;
        let g = self.tenants[i].group;
        let now = self.now;
        if r.stuck_until.is_some() {
            // It was stopped all along: it did nothing, and reports so, late.
            add_interval(
                &mut self.held[g],
                self.bin_ns,
                r.recorded_to,
                r.deadline.min(now),
            );
            self.unreported[i] += 1;
            self.push(
                now,
                i,
                Ev::Report {
                    token: r.token,
                    first: 0,
                    last: 0,
                    again: true,
                },
            );
            return;
        }
        let ran_out = r.work_until < r.deadline;
        let last = if ran_out {
            r.work_until
        } else {
            r.deadline + r.overrun
        };
        add_interval(&mut self.held[g], self.bin_ns, r.recorded_to, now);
        add_interval(
            &mut self.work[g],
            self.bin_ns,
            r.work_from.max(r.recorded_to),
            last,
        );
        let mut again = !ran_out;
        if ran_out {
            // Work ran out before the deadline: give the turn back as it drains.
            if let Demand::Short { .. } = self.tenants[i].demand {
                self.burst_left[i] = 0;
            }
            self.wants[i] = false;
            self.stats.calls += 1;
            self.policy
                .yield_turn(client_of(i), r.token, last, now)
                .expect("connected");
            self.yielded(i, last.max(now));
            if let Demand::Fraction { .. } = self.tenants[i].demand {
                // More work at once: it asks again.
                self.push(now, i, Ev::Acquire);
                again = true;
            }
        } else if let Demand::Short { .. } = self.tenants[i].demand {
            // Cut off mid-burst: the rest is for the next turn.
            let done = r.deadline.saturating_sub(r.work_from);
            self.burst_left[i] = self.burst_left[i].saturating_sub(done);
            again = self.burst_left[i] > 0;
            self.wants[i] = again;
        }
        if again && self.asked_at[i].is_none() {
            self.asked_at[i] = Some(now);
        }
        self.unreported[i] += 1;
        let report_at = last.max(now) + self.tenants[i].report_after_ns;
        self.push(
            report_at,
            i,
            Ev::Report {
                token: r.token,
                first: r.work_from.saturating_sub(self.tenants[i].early_ns),
                last,
                again,
            },
        );
        if !again {
            self.next_ask(i, None);
        }
    }

    /// The held and device time of every running turn up to `t` (the end of the run).
    fn record_running(&mut self, t: u64) {
        for i in 0..self.running.len() {
            if let Some(r) = self.running[i].as_mut() {
                let g = self.tenants[i].group;
                add_interval(&mut self.held[g], self.bin_ns, r.recorded_to, t);
                if r.stuck_until.is_none() {
                    let from = r.work_from.max(r.recorded_to);
                    add_interval(&mut self.work[g], self.bin_ns, from, r.work_until.min(t));
                }
                r.recorded_to = r.recorded_to.max(t);
            }
        }
    }

    /// Executes the policy's decisions, checking them.
    fn process(&mut self) {
        // Until none is left: a turn started here may decide more.
        loop {
            let decisions = self.policy.take_decisions();
            if decisions.is_empty() {
                return;
            }
            for d in decisions {
                match d {
                    Decision::Grant {
                        client,
                        token,
                        start_ns,
                        deadline_ns,
                        quota_ns,
                        queue_budget_ns,
                        open_at_start,
                        just_in_time,
                    } => {
                        let i = (client - 1) as usize;
                        // Just in time only beside a latency-class group.
                        let g = self.tenants[i].group;
                        let latency_besides = (self.groups.iter().enumerate())
                            .any(|(o, (_, p))| o != g && p.class == GroupClass::Latency);
                        assert!(
                            !just_in_time || latency_besides,
                            "a just-in-time turn without a latency-class group besides"
                        );
                        if just_in_time {
                            self.stats.just_in_time[i] += 1;
                        }
                        if open_at_start {
                            assert!(
                                (self.groups.iter()).any(|(_, p)| p.class == GroupClass::Latency),
                                "a turn opening at its start without a latency-class group"
                            );
                            self.stats.opening_at_start[i] += 1;
                        }
                        assert!(!self.gone[i], "granted a client that is gone");
                        assert!((100_000..=5_000_000).contains(&queue_budget_ns));
                        let budget = &mut self.stats.max_queue_budget_ns[i];
                        *budget = (*budget).max(queue_budget_ns);
                        assert!(quota_ns >= self.policy.config().min_quota_ns);
                        assert_eq!(deadline_ns, start_ns + quota_ns);
                        assert!(start_ns >= self.now, "a turn granted in the past");
                        if let Some(p) = self.planned[i].filter(|p| p.token == token) {
                            // A planned turn moved earlier.
                            assert!(start_ns <= p.start, "a planned turn moved later");
                        } else {
                            if let Some(p) = self.planned[i].filter(|p| p.start <= self.now) {
                                // The turn before starts now, and this one was decided as it
                                // started (a scheduler granting a quota ahead): it starts first.
                                self.handle(i, Ev::Start { token: p.token });
                            }
                            assert!(
                                self.wants[i]
                                    || self.running[i].is_some()
                                    || self.unreported[i] > 0,
                                "granted a client that does not want the GPU"
                            );
                            assert!(
                                self.planned[i].is_none(),
                                "two turns planned for one client"
                            );
                            self.stats.grants += 1;
                            self.note_granted(self.tenants[i].group, quota_ns);
                        }
                        let p = Planned {
                            token,
                            start: start_ns,
                            deadline: deadline_ns,
                        };
                        self.planned[i] = Some(p);
                        self.push(start_ns, i, Ev::Start { token });
                    }
                    Decision::Shorten {
                        client,
                        token,
                        deadline_ns,
                    } => {
                        let i = (client - 1) as usize;
                        // Never below a minimum quota after its start, but for a turn that
                        // another group's yield started (docs/scheduling.md#preemption).
                        let cfg = self.policy.config().clone();
                        let g = self.tenants[i].group;
                        let yields: Vec<u64> = (self.yielded_at.iter().enumerate())
                            .filter(|&(o, _)| o != g)
                            .filter_map(|(_, y)| *y)
                            .collect();
                        // A latency-class group takes any turn back as soon.
                        let latency_besides = (self.groups.iter().enumerate())
                            .any(|(o, (_, p))| o != g && p.class == GroupClass::Latency);
                        self.stats.shortened += 1;
                        self.set_deadline(i, token, deadline_ns, |start| {
                            let at_a_yield = (yields.iter())
                                .any(|&y| y <= start && start <= y + cfg.min_quota_ns);
                            let floor = if at_a_yield || latency_besides {
                                cfg.take_back_ns()
                            } else {
                                cfg.min_quota_ns
                            };
                            assert!(deadline_ns >= start + floor, "shortened below min");
                        });
                    }
                    Decision::Extend {
                        client,
                        token,
                        deadline_ns,
                    } => {
                        let i = (client - 1) as usize;
                        assert!(deadline_ns > self.now, "extended into the past");
                        self.stats.extended += 1;
                        let g = self.tenants[i].group;
                        let old = self.running[i]
                            .filter(|r| r.token == token)
                            .map(|r| r.deadline)
                            .or(self.planned[i]
                                .filter(|p| p.token == token)
                                .map(|p| p.deadline));
                        if let Some(old) = old {
                            self.note_granted(g, deadline_ns.saturating_sub(old));
                        }
                        self.set_deadline(i, token, deadline_ns, |_| {});
                    }
                    Decision::Revoke { client, token } => {
                        let i = (client - 1) as usize;
                        if self.planned[i].is_some_and(|p| p.token == token) {
                            self.planned[i] = None;
                            continue;
                        }
                        self.stats.revocations += 1;
                        if let Some(r) = self.running[i].filter(|r| r.token == token) {
                            // A stuck tenant cannot act on it; others stop at once.
                            if r.stuck_until.is_none() {
                                self.stop(i, r);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Tenant `i`'s turn `token` (running or planned) now ends at `deadline_ns`.
    fn set_deadline(&mut self, i: usize, token: u64, deadline_ns: u64, check: impl Fn(u64)) {
        if let Some(p) = self.planned[i].as_mut().filter(|p| p.token == token) {
            check(p.start);
            p.deadline = deadline_ns;
            return;
        }
        if let Some(r) = self.running[i].as_mut().filter(|r| r.token == token) {
            check(r.start);
            r.deadline = deadline_ns.max(self.now);
            self.schedule_stop(i);
        }
    }

    /// Tenant `i`'s process dies (its connection closes).
    pub fn kill(&mut self, i: usize) {
        self.gone[i] = true;
        self.wants[i] = false;
        self.planned[i] = None;
        if let Some(r) = self.running[i].take() {
            let g = self.tenants[i].group;
            add_interval(&mut self.held[g], self.bin_ns, r.recorded_to, self.now);
            add_interval(
                &mut self.work[g],
                self.bin_ns,
                r.work_from.max(r.recorded_to),
                r.work_until.min(self.now),
            );
        }
        self.stats.calls += 1;
        self.policy.disconnect(client_of(i), self.now);
        self.process();
        self.wakeup = self.policy.next_wakeup(self.now).map(|w| w.max(self.now));
    }

    /// Group `g`'s processes are swapped out of the GPU's memory (`out`) or restored, as the
    /// shell would say ([`Policy::suspend`], [`Policy::resume`]). Its tenants go on asking and
    /// reporting: the policy alone keeps it off the GPU.
    pub fn swap(&mut self, g: usize, out: bool) {
        let name = self.groups[g].0.clone();
        self.stats.calls += 1;
        if out {
            self.policy.suspend(&name, self.now);
        } else {
            self.policy.resume(&name, self.now);
        }
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

    /// Share of `[from, to)` group `g`'s turns covered (bin-aligned bounds).
    pub fn held_share(&self, g: usize, from: u64, to: u64) -> f64 {
        self.bins_share(&self.held[g], from, to)
    }

    /// Share of `[from, to)` the device ran group `g`'s work.
    pub fn work_share(&self, g: usize, from: u64, to: u64) -> f64 {
        self.bins_share(&self.work[g], from, to)
    }

    /// Tenant `i`'s mean wait between asking and its turn starting.
    pub fn mean_wait_ns(&self, i: usize) -> f64 {
        self.stats.total_wait_ns[i] as f64 / self.stats.waits_of[i].max(1) as f64
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

/// A seed names the same workload whatever the version of the crate that provides the
/// generator: SplitMix64 from the seed xor the golden ratio.
#[test]
fn the_generator_is_splitmix64() {
    let mut rng = Rng::new(1);
    let first: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
    assert_eq!(
        first,
        [
            16_834_447_057_089_888_969,
            4_048_727_598_324_417_001,
            7_862_637_804_313_477_842
        ]
    );
}
