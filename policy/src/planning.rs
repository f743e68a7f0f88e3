//! Planning: which waiting group gets the next turn and when, how long it lasts, and how the
//! turns before it end (the [algorithm](crate)'s `docs/scheduling.md#selection`,
//! `docs/scheduling.md#yield`, `docs/scheduling.md#preemption` and
//! `docs/scheduling.md#extension`).

use crate::group::Group;
use crate::turn::Turn;
use crate::{ClientId, Decision, GroupClass, Policy, TurnUse};
use std::collections::BTreeMap;

/// A group that came back from an absence, or went idle, this recently is taken to come back
/// and cut turns short (the others' turns get the shorter queue budget).
const RETURNS_NS: u64 = 1_000_000_000;

/// The turn [`Policy::plan_at`] chose, sized and reserved, before it is granted.
struct Planned {
    client: ClientId,
    /// Where the turn was planned to start (the end of the running one, or now).
    start: u64,
    /// When it may start (later than `start` when a cap holds its group back).
    at: u64,
    quota_ns: u64,
    /// Other groups were active when it was planned.
    contested: bool,
    /// It was planned to follow another turn back to back.
    after_turn: bool,
}

impl Policy {
    /// The running turn ends at `at` (≥ now) before its deadline (yielded, or its client lost):
    /// the planned turn, if any, is moved to start there; else the next one is chosen now to
    /// start there.
    pub(crate) fn yield_current(&mut self, at: u64, now: u64) {
        let Some(mut t) = self.current.take() else {
            return;
        };
        t.yielded = true;
        if let Some(g) = self.groups.get_mut(&t.group) {
            g.draining_until = at + self.cfg.min_quota_ns / 4;
        }
        let after_linger = self.linger_until > 0 && at == self.linger_until;
        if let Some(n) = self.next.as_mut() {
            n.deadline_ns = at + n.quota_ns;
            n.start_ns = at;
            n.open_at_start = after_linger;
            let moved = n.grant();
            let token = n.token;
            self.move_handoff(token, at);
            self.decisions.push(moved);
            self.end_turn(t, at);
            self.promote(now);
        } else {
            self.end_turn(t, at);
            self.plan_at(now, at, true);
        }
    }

    /// The planned turn becomes the running one once it starts.
    pub(crate) fn promote(&mut self, now: u64) {
        if self.current.is_none()
            && let Some(n) = self.next.take_if(|n| n.start_ns <= now)
        {
            self.current = Some(n);
        }
    }

    /// The GPU is free now and the planned turn starts later (a capped group's, when its bucket
    /// refills): withdraw it (its client waits again, first in its group) if a group that may
    /// start now waits, so the GPU is not left idle meanwhile.
    pub(crate) fn reclaim_gap(&mut self, now: u64) {
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
        self.requeue_next(client, token, now);
    }

    /// Withdraws the planned turn `token` of `client` (told so) before it starts: its client
    /// waits again, first in its group.
    pub(crate) fn requeue_next(&mut self, client: ClientId, token: u64, now: u64) {
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

    /// A latency-class group `group` asks again before the turn planned after its given-back
    /// one has started (docs/latency.md: it kept the GPU a moment past its drain for this): that
    /// turn is withdrawn, its client waits again first in its group, and `group` is served at
    /// once, unless it is ahead of that turn's group by a minimum quota (the rule it returns
    /// by, `docs/scheduling.md#preemption`) or its cap holds it back. Its given-back turn ends
    /// now.
    pub(crate) fn take_back_linger(&mut self, group: &str, now: u64) {
        let (depth, thr) = (self.cfg.bucket_depth(), self.cfg.cap_threshold());
        let min_quota = self.cfg.min_quota_ns as f64;
        let Some(g) = self.groups.get(group) else {
            return;
        };
        if g.params.class != GroupClass::Latency
            || self.current.is_some()
            || !g.eligible(now, depth, thr)
        {
            return;
        }
        let Some(n) = self
            .next
            .as_ref()
            .filter(|n| n.group != group && n.start_ns > now && n.start_ns == g.gave_back_at)
            // It lingered: it gave the turn back a linger past its drain.
            .filter(|n| n.start_ns == self.linger_until)
        else {
            return;
        };
        let Some(ng) = self.groups.get(&n.group) else {
            return;
        };
        // Its reservation returned, the planned turn's group is owed this much more.
        if g.credit - (ng.credit + n.applied as f64) <= -min_quota {
            return;
        }
        let (client, token, gave_back_at) = (n.client, n.token, n.start_ns);
        self.requeue_next(client, token, now);
        if let Some(t) =
            (self.ended.values_mut()).find(|t| t.group == group && t.end_ns == Some(gave_back_at))
        {
            t.end_ns = Some(now);
        }
        self.busy_until = now;
        if let Some(g) = self.groups.get_mut(group) {
            g.gave_back_at = 0;
        }
        self.plan_group(group.to_string(), now, now, true, now);
    }

    /// A latency-class group that lingers reports the turn it gave back (`token`): its work
    /// drained at `used.last_ns`, measured, where its linger was set to run from the drain it
    /// estimated when it gave the turn back (docs/latency.md). Measured earlier, the linger runs
    /// from there instead, to now at the earliest: it ends earlier, and the turn planned at its
    /// end starts there (its client told so). A queue estimate that runs late would otherwise
    /// leave the GPU idle that long on top of the linger, the turn after opening at its start.
    pub(crate) fn reanchor_linger(&mut self, token: u64, used: Option<TurnUse>, now: u64) {
        let until = self.linger_until;
        let Some(u) = used else {
            return;
        };
        if until <= now || self.current.is_some() {
            return;
        }
        let Some(group) = (self.ended.get(&token))
            .filter(|t| t.yielded && t.end_ns == Some(until))
            .map(|t| t.group.clone())
        else {
            return;
        };
        let at = u
            .last_ns
            .saturating_add(self.cfg.latency_linger_ns())
            .max(now);
        if at >= until || self.next.as_ref().is_some_and(|n| n.start_ns != until) {
            return;
        }
        if let Some(t) = self.ended.get_mut(&token) {
            t.end_ns = Some(at);
        }
        self.linger_until = at;
        if self.busy_until == until {
            self.busy_until = at;
        }
        if let Some(g) = self
            .groups
            .get_mut(&group)
            .filter(|g| g.gave_back_at == until)
        {
            g.gave_back_at = at;
        }
        if let Some(n) = self.next.as_mut() {
            n.start_ns = at;
            n.deadline_ns = at + n.quota_ns;
            let moved = n.grant();
            let next = n.token;
            self.move_handoff(next, at);
            self.hold_handoff(next, at);
            self.decisions.push(moved);
            self.promote(now);
        }
    }

    /// Drops the planned turn (its client no longer wants it, or is gone): its reservation is
    /// returned.
    pub(crate) fn withdraw_next(&mut self, now: u64) {
        let Some(t) = self.next.take() else {
            return;
        };
        self.forget_handoff_into(t.token);
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

    /// Plans the next turn if it is time: with a turn running, a grant-ahead before its end
    /// (the holder counts as waiting for another unless it yielded); with none, at once or, for
    /// a capped group, a grant-ahead before its bucket refills.
    pub(crate) fn plan(&mut self, now: u64) {
        if self.next.is_some() {
            return;
        }
        match &self.current {
            Some(c) => {
                if now < c.deadline_ns.saturating_sub(self.grant_ahead_ns()) {
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
    /// that) and grants it, or extends the running turn if its client is the one chosen. In
    /// steps: choose the group ([`Policy::best_candidate`]), size its turn and reserve it
    /// ([`Policy::take_turn`]), then either extend the running turn
    /// ([`Policy::extend_alone`]) or grant a new one ([`Policy::grant_turn`]) and note the
    /// handoff it follows ([`Policy::record_handoff`]).
    pub(crate) fn plan_at(&mut self, now: u64, start: u64, after_turn: bool) {
        let Some((name, at)) = self.best_candidate(start) else {
            return;
        };
        if at > start && at.saturating_sub(self.grant_ahead_ns()) > now {
            return; // planned later (next_wakeup says when)
        }
        self.plan_group(name, start, at, after_turn, now);
    }

    /// [`Policy::plan_at`] once group `name` is chosen to start at `at` (≥ `start`).
    fn plan_group(&mut self, name: String, start: u64, at: u64, after_turn: bool, now: u64) {
        // The turn's length depends on its group's target among the groups active now.
        self.refresh_targets();
        let contested = self
            .groups
            .iter()
            .any(|(n, g)| *n != name && g.active_at(now));
        let (client, quota_ns) = self.take_turn(&name, at, contested, now);
        if self.extend_alone(client, start, at, quota_ns, contested) {
            return;
        }
        let planned = Planned {
            client,
            start,
            at,
            quota_ns,
            contested,
            after_turn,
        };
        let turn = self.grant_turn(name, planned, now);
        if turn.after_turn {
            self.record_handoff(&turn);
        }
        self.next = Some(turn);
        self.promote(now);
    }

    /// Takes the first waiting client of group `name` for a turn at `at`, and sizes the turn: a
    /// quota, shorter for a small share while `contested` (other groups active), no more than
    /// a capped group's bucket holds then, never under the minimum quota. The turn is reserved
    /// from the group's credit and bucket.
    fn take_turn(&mut self, name: &str, at: u64, contested: bool, now: u64) -> (ClientId, u64) {
        let (lo, _) = self.cfg.credit_bounds();
        let (depth, window) = (self.cfg.bucket_depth(), self.cfg.window_ns);
        let (quota, min_quota) = (self.cfg.quota_ns, self.cfg.min_quota_ns);
        let g = self.groups.get_mut(name).expect("chosen from the groups");
        let (client, _) = g.queue.pop_front().expect("a waiting client");
        let mut quota_ns = if contested {
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
        (client, quota_ns)
    }

    /// Its own client again, alone on the GPU: the running turn goes on for `quota_ns` more
    /// (extended); `true` if so. With others waiting it gets a new turn back to back, which its
    /// hook reports the one before for: a holder that has stopped is noticed at the handoff
    /// (see `tick`).
    fn extend_alone(
        &mut self,
        client: ClientId,
        start: u64,
        at: u64,
        quota_ns: u64,
        contested: bool,
    ) -> bool {
        let Some(cur) = self
            .current
            .as_mut()
            .filter(|c| c.client == client && c.deadline_ns == start && at == start && !contested)
        else {
            return false;
        };
        cur.unextended.get_or_insert(cur.deadline_ns);
        cur.deadline_ns += quota_ns;
        cur.quota_ns += quota_ns;
        cur.applied += quota_ns;
        self.decisions.push(Decision::Extend {
            client,
            token: cur.token,
            deadline_ns: cur.deadline_ns,
        });
        true
    }

    /// A new turn for group `name` as [`Policy::take_turn`] sized it, granted (the decision is
    /// queued) but not yet planned.
    fn grant_turn(&mut self, name: String, p: Planned, now: u64) -> Turn {
        let g = self.groups.get_mut(&name).expect("chosen from the groups");
        g.turns += 1;
        g.tokens += 1;
        let token = self.next_token;
        self.next_token += 1;
        let start_ns = p.at.max(now);
        let mut queue_budget_ns =
            (self.cfg).queue_budget_ns(p.quota_ns, self.may_be_cut(&name, now));
        let just_in_time = self.latency_group_besides(&name);
        if just_in_time {
            queue_budget_ns = queue_budget_ns.min(self.cfg.latency_queue_budget_ns());
        }
        // The turn after a latency-class group's linger opens at its start (docs/latency.md).
        let open_at_start = self.linger_until > 0 && start_ns == self.linger_until;
        let turn = Turn {
            client: p.client,
            group: name,
            token,
            start_ns,
            deadline_ns: start_ns + p.quota_ns,
            unextended: None,
            quota_ns: p.quota_ns,
            after_turn: p.after_turn && start_ns == p.start,
            contested: p.contested,
            end_ns: None,
            followed: false,
            yielded: false,
            revoked: false,
            stopped: false,
            silenced: false,
            applied: p.quota_ns,
            recorded: 0,
            queue_budget_ns,
            open_at_start,
            just_in_time,
        };
        self.decisions.push(turn.grant());
        turn
    }

    /// Whether a turn of group `name` granted now may be cut short by a group that comes back:
    /// then that group waits behind what the holder has queued, which the shorter queue budget
    /// bounds. Such a group is one whose bucket holds it back, one connected and idle since
    /// less than a second, or one that came back from an absence within the last second (a
    /// request server or bursty client, even while it holds or awaits a turn now; a trainer
    /// that synchronises asks again at once and is no such group). A group that comes and goes
    /// keeps its own turns short too: its hook tells when its work drains from fences the
    /// shorter budget places closer together.
    fn may_be_cut(&self, name: &str, now: u64) -> bool {
        let recent = |at: u64| at > 0 && now < at.saturating_add(RETURNS_NS);
        self.groups.iter().any(|(n, g)| {
            *n == name && recent(g.returned_at)
                || *n != name
                    && !g.clients.is_empty()
                    && (g.held_back || recent(g.returned_at) || !g.wants() && recent(g.last_active))
        })
    }

    /// Whether a latency-class group other than `name` is connected: it may ask at any time,
    /// and then waits behind the work a turn of `name` keeps queued.
    pub(crate) fn latency_group_besides(&self, name: &str) -> bool {
        self.groups.iter().any(|(n, g)| {
            n != name && g.params.class == GroupClass::Latency && !g.clients.is_empty()
        })
    }

    /// The waiting group to serve at `start`, and when it may start (≥ `start`): the one with
    /// the most credit among those that may start then; if none may, the one that may soonest.
    pub(crate) fn best_candidate(&self, start: u64) -> Option<(String, u64)> {
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

    /// `group` asks while the running turn is extended because its holder was alone
    /// (`docs/scheduling.md#extension`): the turn ends a minimum quota from now, or at its
    /// deadline before the extension if that is later.
    pub(crate) fn end_extension(&mut self, group: &str, now: u64) {
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

    /// `group` just returned with work (`docs/scheduling.md#preemption`): if it is owed more
    /// than the holder will be once its turn is settled, by a minimum quota at least, the turn
    /// that would run before it — the planned one, else the running one — ends now, but never
    /// below a minimum quota after its start.
    pub(crate) fn preempt_for(&mut self, group: &str, now: u64) {
        let (depth, thr) = (self.cfg.bucket_depth(), self.cfg.cap_threshold());
        let min_quota = self.cfg.min_quota_ns;
        let Some(g) = self.groups.get(group) else {
            return;
        };
        if !g.eligible(now, depth, thr) {
            return;
        }
        let (credit, gave_back_at, latency) = (
            g.credit,
            g.gave_back_at,
            g.params.class == GroupClass::Latency,
        );
        // Owed more than the holder of `turn` will be once it is settled, by a minimum quota at
        // least (not for a tie: a handoff costs both a little). A latency-class group is served
        // unless it is ahead of the holder by a minimum quota: its requests wait for no turn,
        // and what it takes is charged, so once ahead it waits like any other group.
        let margin = if latency {
            -(min_quota as f64)
        } else {
            min_quota as f64
        };
        let owed_more = |turn: &Turn, groups: &BTreeMap<String, Group>| {
            groups.get(&turn.group).is_some_and(|hg| {
                let held = now.saturating_sub(turn.start_ns);
                credit - (hg.credit + turn.applied as f64 - held as f64) > margin
            })
        };
        // A latency-class group is not kept waiting behind the running turn for one planned
        // after it (a scheduler granting a quota ahead plans the next turn as the running one
        // starts): that turn is withdrawn, its client first in line again, and the running one
        // ends at its next kernel.
        if latency
            && let (Some(c), Some(n)) = (self.current.as_ref(), self.next.as_ref())
            && c.group != group
            && n.group != group
            && owed_more(c, &self.groups)
        {
            let (client, token) = (n.client, n.token);
            self.requeue_next(client, token, now);
        }
        let turn = match self.next.as_mut() {
            Some(n) => n,
            None => match self.current.as_mut() {
                Some(c) => c,
                None => return,
            },
        };
        if turn.group == group || !owed_more(turn, &self.groups) {
            return;
        }
        // A turn the group gave its own turn back to is taken back sooner: a request server
        // with requests queued returns as soon as its synchronisation does, and waiting out
        // the minimum quota there would delay each queued request by it. A latency-class
        // group takes any turn back that soon: the holder stops at its next kernel.
        let floor = if latency || gave_back_at == turn.start_ns {
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
    pub(crate) fn mark_held_back(&mut self, now: u64) {
        let (depth, thr) = (self.cfg.bucket_depth(), self.cfg.cap_threshold());
        for g in self.groups.values_mut() {
            g.held_back = !g.queue.is_empty() && !g.suspended && !g.eligible(now, depth, thr);
        }
    }
}
