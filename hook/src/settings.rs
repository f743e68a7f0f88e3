//! The hook's settings, from the environment (set by `gpushare run`, by the device manager in
//! a pod, or by hand). Read once, when the hook starts in a process.

use crate::turn::TurnConfig;
use gpushare_protocol::GroupSpec;
use std::path::PathBuf;

/// What to do when the scheduler cannot be reached, or owes an answer past the liveness bound.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum FailPolicy {
    /// Run unthrottled, with one warning on stderr, and keep trying to reconnect.
    Open,
    /// Hold launches until the scheduler is back.
    Closed,
}

/// The liveness bound until the scheduler says its own: the default quota (20 ms) plus the
/// default grace (20 ms).
pub const DEFAULT_LIVENESS_NS: u64 = 40_000_000;

pub struct Settings {
    pub socket: PathBuf,
    pub fail: FailPolicy,
    pub turns: TurnConfig,
    /// How long past a turn's deadline a drain waits for this process's work before the turn
    /// is reported anyway (a kernel waiting for a peer GPU may run on; the scheduler charges
    /// a turn up to its deadline plus its grace at most).
    pub drain_grace_ns: u64,
    pub declared: Option<GroupSpec>,
    /// `GPUSHARE_LIVENESS`: the liveness bound, fixed (`off`: none, the scheduler is waited for
    /// however long it takes); unset: the scheduler's own (its quota plus its grace).
    pub liveness: Option<u64>,
    /// `GPUSHARE_MEM_LEASE`: the largest block of its group's memory cap a process leases at
    /// once (the block is also at most cap / 32); 0: no lease, every allocation waits for the
    /// scheduler.
    pub lease_max: u64,
}

impl Settings {
    pub fn from_env() -> Settings {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let num = |k: &str, d: f64| var(k).and_then(|v| v.parse::<f64>().ok()).unwrap_or(d);
        let duration = |k: &str, d: u64| {
            var(k)
                .and_then(|v| gpushare_units::parse_duration_ns(&v).ok())
                .unwrap_or(d)
        };
        let declared = var("GPUSHARE_GROUP").map(|name| GroupSpec {
            name,
            request: num("GPUSHARE_REQUEST", 0.0),
            limit: num("GPUSHARE_LIMIT", 1.0),
            weight: num("GPUSHARE_WEIGHT", 1.0),
            memory: var("GPUSHARE_MEMORY").and_then(|m| gpushare_units::parse_size(&m).ok()),
            latency: var("GPUSHARE_CLASS").as_deref() == Some("latency"),
        });
        let fail = match var("GPUSHARE_FAIL").as_deref() {
            Some("closed") => FailPolicy::Closed,
            _ => FailPolicy::Open,
        };
        Settings {
            socket: var(gpushare_protocol::SOCKET_ENV)
                .unwrap_or_else(|| gpushare_protocol::DEFAULT_SOCKET.into())
                .into(),
            fail,
            turns: TurnConfig {
                idle_release_ns: duration("GPUSHARE_IDLE_RELEASE", 2_000_000),
                handoff_lead_ns: duration("GPUSHARE_HANDOFF_LEAD", 1_000_000),
                fail_open: fail == FailPolicy::Open,
            },
            liveness: var("GPUSHARE_LIVENESS").and_then(|v| match v.as_str() {
                "off" => Some(u64::MAX),
                v => gpushare_units::parse_duration_ns(v)
                    .ok()
                    .map(|ns| if ns == 0 { u64::MAX } else { ns }),
            }),
            drain_grace_ns: duration("GPUSHARE_DRAIN_GRACE", 10_000_000),
            declared,
            lease_max: var("GPUSHARE_MEM_LEASE")
                .and_then(|v| gpushare_units::parse_size(&v).ok())
                .unwrap_or(64 << 20),
        }
    }
}
