//! What the policy shows of one GPU: the groups' parameters, targets, achieved shares and
//! counters ([`Policy::status`]).

use crate::{ClientId, GroupParams, Policy, effective_requests, water_fill};

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
    /// Turns revoked at end + grace (not those ended early and revoked then: the group
    /// suspended, its client silent).
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

impl Policy {
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
}
