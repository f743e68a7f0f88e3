//! A group's share parameters and the policy's timing parameters, validated in one place.

use gpushare_protocol::CUT_TURN_QUEUE_BUDGET_NS;
use serde::{Deserialize, Serialize};

/// A group's share parameters on one GPU (docs/scheduling.md#targets).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GroupParams {
    /// Guaranteed minimum share of GPU time, 0..=1.
    pub request: f64,
    /// Hard cap on the share of GPU time, request..=1 (1 = uncapped).
    pub limit: f64,
    /// Relative weight for splitting spare time, > 0 (default 1).
    pub weight: f64,
    /// How its turns are handed out: see [`GroupClass`].
    pub class: GroupClass,
}

/// A group's scheduling class. Either way its GPU time is charged and capped alike: the class
/// changes when a group gets the GPU, never how much.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupClass {
    /// Turns of a quota, handed over at their deadlines (training, batch work).
    #[default]
    Standard,
    /// Short requests judged by their tail latency (an inference server): while such a group
    /// is connected the other groups keep little work queued, and when it asks for the GPU the
    /// holder's turn ends at its next kernel (see [`PolicyConfig::latency_queue_budget_ns`]).
    Latency,
}

impl GroupClass {
    /// Parses a class name (`"standard"` or `"latency"`); the error lists the names.
    pub fn parse(s: &str) -> Result<GroupClass, String> {
        match s {
            "standard" => Ok(GroupClass::Standard),
            "latency" => Ok(GroupClass::Latency),
            _ => Err(format!(
                "unknown class {s:?}: write \"latency\" for a request server whose tail latency \
                 matters, or \"standard\" (the default)"
            )),
        }
    }

    /// `Latency` if `latency`, else `Standard`.
    pub fn latency_if(latency: bool) -> GroupClass {
        if latency {
            GroupClass::Latency
        } else {
            GroupClass::Standard
        }
    }
}

impl Default for GroupParams {
    /// No guarantee, no cap, weight 1.
    fn default() -> Self {
        GroupParams {
            request: 0.0,
            limit: 1.0,
            weight: 1.0,
            class: GroupClass::Standard,
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

/// Timing parameters of the policy (hot-reloadable with [`super::Policy::set_config`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyConfig {
    /// Default turn length.
    pub quota_ns: u64,
    /// Never grant less than this; a turn cut short for another group lasts at least this long
    /// after its start.
    pub min_quota_ns: u64,
    /// A turn whose client has not reported its use by its end + grace is revoked (the client
    /// is told to stop at once) and charged as held.
    pub grace_ns: u64,
    /// Window of the achieved share reported in [`super::GroupStatus::achieved_share`].
    pub window_ns: u64,
    /// How long before a turn starts its client is granted it: the next turn is decided this
    /// long before the current one ends, so no process has to wake up for the handoff itself.
    pub grant_ahead_ns: u64,
}

impl Default for PolicyConfig {
    /// 20 ms quota, 2 ms minimum quota, 20 ms grace, 5 s window, turns granted 5 ms ahead.
    fn default() -> Self {
        PolicyConfig {
            quota_ns: 20_000_000,
            min_quota_ns: 2_000_000,
            grace_ns: 20_000_000,
            window_ns: 5_000_000_000,
            grant_ahead_ns: 5_000_000,
        }
    }
}

impl PolicyConfig {
    /// Makes a configuration usable: quota ≥ 1 ns, `min_quota ≤ quota`, window ≥ 1 ns.
    pub(super) fn sanitized(mut self) -> PolicyConfig {
        self.quota_ns = self.quota_ns.max(1);
        self.min_quota_ns = self.min_quota_ns.min(self.quota_ns);
        self.window_ns = self.window_ns.max(1);
        self
    }

    /// The length of a turn of a group whose target share is `share` while other groups use
    /// the GPU: the quota, shortened for a share under one half so that no turn moves its
    /// group's lag (time behind its share, which a turn lowers by `(1 − share)` of its length)
    /// by more than half a quota. Every group's lag then swings within the same band however
    /// small its share: sixteen groups at 1/16 would otherwise each swing by 19 ms, a share
    /// off by 0.019 over a one-second window.
    pub(super) fn contested_turn_ns(&self, share: f64) -> u64 {
        let half = self.quota_ns as f64 / 2.0;
        let turn = half / (1.0 - share).max(f64::EPSILON);
        (turn.min(self.quota_ns as f64) as u64).max(self.min_quota_ns)
    }

    /// The shortest a turn may be cut to by the group whose yield started it, returning at
    /// once (docs/scheduling.md#preemption): an eighth of the minimum quota.
    pub(super) fn take_back_ns(&self) -> u64 {
        self.min_quota_ns / 8
    }

    /// The shortest absence after which a group asking again is taken to come and go (a
    /// request server between requests): a quarter quota. A trainer that synchronises asks
    /// again as soon as its work drains and its host thread wakes.
    pub(super) fn away_ns(&self) -> u64 {
        self.quota_ns / 4
    }

    /// How much GPU work the holder of a turn of `quota_ns` may keep queued (its hook paces its
    /// launches to it): an eighth of the quota, 0.1 to 2.5 ms
    /// ([`CUT_TURN_QUEUE_BUDGET_NS`], what a process paces to before its first turn), when
    /// another group may come back and cut the turn short (it then waits behind that work);
    /// else a quarter, 0.1 to 5 ms, so that a launcher its host wakes late finds work still
    /// queued.
    pub(super) fn queue_budget_ns(&self, quota_ns: u64, may_be_cut: bool) -> u64 {
        if may_be_cut {
            (quota_ns / 8).clamp(100_000, CUT_TURN_QUEUE_BUDGET_NS)
        } else {
            (quota_ns / 4).clamp(100_000, 5_000_000)
        }
    }

    /// How much GPU work the holder of a turn may keep queued while a latency-class group is
    /// connected (it waits behind that work when it asks): an eighth of the minimum quota, 0.1
    /// to 0.5 ms.
    pub(super) fn latency_queue_budget_ns(&self) -> u64 {
        (self.min_quota_ns / 8).clamp(100_000, 500_000)
    }

    /// How long past its work's drain a latency-class group keeps the GPU when it gives its
    /// turn back (docs/latency.md): three fortieths of the minimum quota (0.15 ms by default),
    /// for a request queued behind the one that ended to be asked for.
    pub(super) fn latency_linger_ns(&self) -> u64 {
        self.min_quota_ns * 3 / 40
    }

    /// Bucket depth of a capped group: two quotas.
    pub(super) fn bucket_depth(&self) -> f64 {
        2.0 * self.quota_ns as f64
    }

    /// Allowance a capped group needs before it may take a turn: a full quota.
    pub(super) fn cap_threshold(&self) -> f64 {
        self.quota_ns.max(self.min_quota_ns) as f64
    }

    /// Credit bounds `(−2B, B)`, `B = 2·quota + grace`.
    pub(super) fn credit_bounds(&self) -> (f64, f64) {
        let b = 2.0 * self.quota_ns as f64 + self.grace_ns as f64;
        (-2.0 * b, b)
    }
}
