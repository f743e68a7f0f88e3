//! Credit and charging: the targets, the credit each group accrues while turns run, what each
//! turn is charged once its client reports, and where the charges of two turns back to back
//! divide (the [algorithm](crate)'s `docs/scheduling.md#targets`, `docs/scheduling.md#credit`,
//! `docs/scheduling.md#caps` and `docs/scheduling.md#charges`).

use crate::group::Group;
use crate::turn::{Turn, TurnUse};
use crate::{GroupParams, Policy, effective_requests, water_fill};

/// Handoffs remembered until both their turns have reported, at most.
const MAX_HANDOFFS: usize = 256;

/// A handoff between two turns back to back, and what their clients measured around it: where
/// the one's kernels ended and the other's began.
#[derive(Debug, Clone)]
pub(crate) struct Handoff {
    before: (u64, String),
    after: (u64, String),
    /// The instant the charges divide at until both are known.
    at: u64,
    last_ns: Option<u64>,
    first_ns: Option<u64>,
    /// The turn before kept the GPU until then whatever it used (a latency-class group's
    /// linger, docs/latency.md): the idle time up to it is its own.
    held_until: u64,
}

impl Policy {
    /// The planned turn `token` now starts at `at` (the turn before it was given back): the
    /// handoff into it divides the charges there.
    pub(crate) fn move_handoff(&mut self, token: u64, at: u64) {
        if let Some(h) = self.handoffs.iter_mut().find(|h| h.after.0 == token) {
            h.at = at;
        }
    }

    /// The turn before the planned turn `token` keeps the GPU until `until` (a latency-class
    /// group's linger): the handoff into it charges that time to the turn before.
    pub(crate) fn hold_handoff(&mut self, token: u64, until: u64) {
        if let Some(h) = self.handoffs.iter_mut().find(|h| h.after.0 == token) {
            h.held_until = until;
        }
    }

    /// The planned turn `token` was withdrawn: it never runs, and no handoff into it divides
    /// charges.
    pub(crate) fn forget_handoff_into(&mut self, token: u64) {
        self.handoffs.retain(|h| h.after.0 != token);
    }

    /// Notes the handoff a turn granted back to back starts with: the turn before it (the
    /// running one, or one that ended where it starts) and it divide their charges there until
    /// both have reported ([`Policy::note_handoffs`]).
    pub(crate) fn record_handoff(&mut self, turn: &Turn) {
        let start_ns = turn.start_ns;
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
                after: (turn.token, turn.group.clone()),
                at: start_ns,
                last_ns: None,
                first_ns: None,
                held_until: 0,
            });
        }
    }

    /// Turn `token`'s client measured `used`: where a handoff it took part in is now known on
    /// both sides, the charges divide there instead of at the planned instant — midway between
    /// the one's last kernel and the other's first launch, as the GPU time-slices the two in
    /// between (at most a queue budget either way). A holder whose kernels ran on past its turn
    /// pays for them; one whose kernels ended early does not pay for the GPU idling before the
    /// next holder's first (nor does that one).
    pub(crate) fn note_handoffs(&mut self, token: u64, used: Option<TurnUse>, now: u64) {
        for h in self.handoffs.iter_mut() {
            if h.before.0 == token {
                h.last_ns = used.map(|u| u.last_ns.max(h.held_until));
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
    pub(crate) fn charge_turn(&mut self, t: &mut Turn, used: Option<TurnUse>, now: u64) {
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
    pub(crate) fn settle(&mut self, mut t: Turn, used: Option<TurnUse>, now: u64) {
        self.charge_turn(&mut t, used, now);
    }

    pub(crate) fn refresh_targets(&mut self) {
        if !self.targets_dirty {
            return;
        }
        self.targets_dirty = false;
        let now = self.now;
        // Guarantees of the groups with processes on this GPU (requests scaled down if they
        // sum to more than 1); a configured group with none here has nothing to bank, and a
        // suspended one (swapped out of the GPU's memory) is out of the race meanwhile.
        let present = |g: &Group| !g.clients.is_empty() && !g.suspended;
        let params: Vec<GroupParams> = (self.groups.values())
            .filter(|g| present(g))
            .map(|g| g.params)
            .collect();
        let mut eff = effective_requests(&params).into_iter();
        for g in self.groups.values_mut() {
            g.guarantee = if present(g) {
                eff.next().unwrap_or(0.0)
            } else {
                0.0
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
                        ..g.params
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
    pub(crate) fn accrue(&mut self, dt: f64) {
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
