//! What a benchmark invocation does, resolved from the command line.

use crate::noise::NoiseParams;
use crate::scenario::Scenario;
use anyhow::bail;
use gpushare_testkit::node::Node;

/// Scenario duration with `--quick`.
pub const QUICK_DURATION_NS: u64 = 3_000_000_000;

/// Where the figures come from.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Source {
    /// The simulated device's trace.
    Device,
    /// The tenants' timelines from CUDA timing events (`cudarc-client --timeline`).
    Events,
}

impl Source {
    /// As the report says it.
    pub fn describe(self) -> &'static str {
        match self {
            Source::Device => "device trace",
            Source::Events => "tenant CUDA timing events",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// 3 s per scenario, scenarios marked `full_only` skipped.
    pub quick: bool,
    /// Runs per scenario, with gpushare and natively each.
    pub repeat: u32,
    /// Run the native (no gpushare) baseline.
    pub baseline: bool,
    /// Measure launch overhead.
    pub overhead: bool,
    /// Run each distinct tenant workload alone too.
    pub alone: bool,
    pub source: Source,
    /// Running on this machine's own GPUs (this many), not the simulated one.
    pub system_gpus: Option<u32>,
    /// Noisy-host mode.
    pub noise: Option<NoiseParams>,
    /// Keep the scheduler's log of its decisions and of the turns' reports next to each kept
    /// trace (`NAME-runK.scheduler.log`).
    pub scheduler_log: bool,
}

/// The scheduler's log filter under `--scheduler-log`: every decision (grants, shortened,
/// extended and revoked turns) and every turn's report, with the scheduler's clock.
pub const SCHEDULER_LOG_FILTER: &str = "warn,gpushare_scheduler::node=debug";

impl Settings {
    /// A node for `gpus` GPUs: simulated, or this machine's.
    pub fn node(&self, gpus: u32) -> anyhow::Result<Node> {
        Ok(match self.system_gpus {
            Some(n) if gpus > n => bail!("needs {gpus} GPUs; this machine has {n}"),
            Some(_) => Node::on_system_driver(),
            None => Node::device_only_with(&["--gpus", &gpus.to_string()]),
        })
    }

    /// How long `sc` runs.
    pub fn duration_ns(&self, sc: &Scenario) -> u64 {
        if self.quick {
            sc.duration_ns.min(QUICK_DURATION_NS)
        } else {
            sc.duration_ns
        }
    }

    /// `simulated`, or `this machine's (N)`.
    pub fn gpu(&self) -> String {
        match self.system_gpus {
            Some(n) => format!("this machine's ({n})"),
            None => "simulated".into(),
        }
    }
}
