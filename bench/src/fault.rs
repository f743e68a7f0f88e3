//! Faults of the scheduler during a run with gpushare (a scenario's `[fault]`), and what they
//! cost the tenants: stopped (`SIGSTOP`, a frozen cgroup or a debugger) for a while, killed
//! (`kill -9`) and started again a while later, or starved of CPU for the whole run — in a cpu
//! cgroup with a 50m request's weight beside one CPU hog per core, or under a hard 50m quota
//! (5 ms per 100 ms).

use crate::report::{FaultRun, round};
use anyhow::Context;
use gpushare_testkit::cgroup::CpuCgroup;
use gpushare_testkit::node::{Node, longest_without_kernel, monotonic_ns, shares_in};
use gpushare_testkit::trace::{Trace, Window};
use serde::{Deserialize, Serialize};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// What happens to the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// `SIGSTOP` at `at_ms`, `SIGCONT` `for_ms` later.
    Stop,
    /// `kill -9` at `at_ms`, a new scheduler (same socket and journal) `for_ms` later.
    Kill,
    /// The whole run in a cgroup with a 50m CPU request's weight, beside CPU hogs.
    StarveRequest,
    /// The same under a hard 50m CPU quota.
    StarveQuota,
}

/// A scenario's `[fault]`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    pub kind: FaultKind,
    /// Stop, kill: when, after the tenants start (ms).
    #[serde(default)]
    pub at_ms: u64,
    /// Stop, kill: for how long (ms).
    #[serde(default)]
    pub for_ms: u64,
}

impl FaultSpec {
    /// Whether the scheduler is starved for the whole run (rather than stopped or killed once).
    pub fn starves(&self) -> bool {
        matches!(self.kind, FaultKind::StarveRequest | FaultKind::StarveQuota)
    }
}

/// CPU a starved scheduler gets: a 50m request's weight (and, with a quota, a 50m limit).
const STARVED_MILLICORES: u64 = 50;
/// The requests of the pods' cgroup (as `kubepods`, above this machine's other processes) and
/// of the GPU's (the simulated device, which stands for the GPU and needs no CPU, and the
/// tenants: above the hogs), so that what is measured is the scheduler's starvation alone.
const POD_MILLICORES: u64 = 20_000;
const GPU_MILLICORES: u64 = 8_000;

/// A starved scheduler's cgroups and the hogs beside it, for a whole run: the hogs are killed
/// and the cgroups removed when it is dropped (the children before their parent: field order).
pub struct Starved {
    hogs: Vec<Child>,
    scheduler: CpuCgroup,
    loaders: CpuCgroup,
    tenants: CpuCgroup,
    _pods: CpuCgroup,
}

impl Starved {
    /// Starve `node`'s scheduler as `kind` says, beside one hog (from `hog`) per core, in
    /// cgroups laid out as a kubelet's pods: the scheduler's, the hogs' (a core's request
    /// each), the GPU's (the simulated device and the tenants, [`tenant`](Starved::tenant)).
    pub fn start(
        node: &Node,
        kind: FaultKind,
        tenants: usize,
        hog: impl Fn() -> Command,
    ) -> anyhow::Result<Starved> {
        let cg = |r: Result<CpuCgroup, String>| r.map_err(anyhow::Error::msg);
        let set = |r: Result<(), String>| r.map_err(anyhow::Error::msg);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let pods = cg(CpuCgroup::create("gpushare-bench"))
            .context("a starved scheduler runs in a cpu cgroup")?;
        let scheduler = cg(pods.child("scheduler"))?;
        let loaders = cg(pods.child("loaders"))?;
        let tenant_cg = cg(pods.child("gpu"))?;
        set(scheduler.request_millicores(STARVED_MILLICORES))?;
        if kind == FaultKind::StarveQuota {
            set(scheduler.limit_millicores(STARVED_MILLICORES))?;
        }
        set(pods.request_millicores(POD_MILLICORES))?;
        set(loaders.request_millicores(cores as u64 * 1000))?;
        set(tenant_cg.request_millicores(GPU_MILLICORES.max(tenants as u64 * 1000)))?;
        if let Some(device) = node.device_pid() {
            set(tenant_cg.add(device))?;
        }
        let pid = node.scheduler_pid().context("no scheduler to starve")?;
        set(scheduler.add(pid))?;
        let mut starved = Starved {
            hogs: Vec::new(),
            scheduler,
            loaders,
            tenants: tenant_cg,
            _pods: pods,
        };
        for _ in 0..cores {
            let mut c = hog();
            starved.loaders.enter(&mut c);
            let child = (c.stdin(Stdio::null()).stdout(Stdio::null()).spawn())
                .context("cannot start a CPU hog")?;
            starved.hogs.push(child);
        }
        Ok(starved)
    }

    /// Start a tenant's command in the tenants' cgroup.
    pub fn tenant(&self, cmd: &mut Command) {
        self.tenants.enter(cmd);
    }

    /// Periods the scheduler was throttled in, of those it ran in.
    pub fn throttled_periods(&self) -> (u64, u64) {
        self.scheduler.throttled_periods()
    }
}

impl Drop for Starved {
    fn drop(&mut self) {
        for h in &mut self.hogs {
            let _ = h.kill();
            let _ = h.wait();
        }
    }
}

/// Stop or kill `node`'s scheduler as `f` says, `f.at_ms` after `started` (ms of
/// `CLOCK_MONOTONIC`), and bring it back `f.for_ms` later; the fault's window, and after a kill
/// when every one of `pids` was connected to the new scheduler (ns after it started; `None`:
/// not within 5 s).
pub fn strike(
    node: &mut Node,
    f: &FaultSpec,
    started_ns: u64,
    pids: &[u32],
) -> anyhow::Result<(Window, Option<u64>)> {
    let at = started_ns + f.at_ms * 1_000_000;
    std::thread::sleep(Duration::from_nanos(at.saturating_sub(monotonic_ns())));
    let pid = node.scheduler_pid().context("no scheduler to strike")? as libc::pid_t;
    let start = monotonic_ns();
    match f.kind {
        FaultKind::Stop => {
            // SAFETY: signals to our own child.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            std::thread::sleep(Duration::from_millis(f.for_ms));
            let end = monotonic_ns();
            unsafe { libc::kill(pid, libc::SIGCONT) };
            Ok((Window::new(start, end), None))
        }
        FaultKind::Kill => {
            node.kill_scheduler();
            std::thread::sleep(Duration::from_millis(f.for_ms));
            let end = monotonic_ns();
            node.start_scheduler(&[]);
            let deadline = end + 5_000_000_000;
            let back = loop {
                let status = node.status_json().unwrap_or_default();
                let connected: Vec<u64> = (status["gpus"].as_array().into_iter().flatten())
                    .flat_map(|g| g["groups"].as_array().into_iter().flatten())
                    .flat_map(|g| g["pids"].as_array().into_iter().flatten())
                    .filter_map(serde_json::Value::as_u64)
                    .collect();
                let now = monotonic_ns();
                if pids.iter().all(|p| connected.contains(&u64::from(*p))) {
                    break Some(now - end);
                }
                if now > deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            Ok((Window::new(start, end), back))
        }
        FaultKind::StarveRequest | FaultKind::StarveQuota => {
            anyhow::bail!("a starved scheduler is starved for the whole run, not struck")
        }
    }
}

/// What a fault in `window` cost the tenants `pids` (targets `targets`) of `trace`: the GPU's
/// busy time in it, the longest any tenant started no kernel in it, and, for a fault that
/// ends, the largest share error from a second after it to the last tenant's end.
pub fn figures(
    trace: &Trace,
    pids: &[u32],
    targets: &[f64],
    window: Window,
    ends: bool,
) -> FaultRun {
    let blocked = (pids.iter())
        .map(|p| longest_without_kernel(trace, *p, window))
        .max()
        .unwrap_or(0);
    let end = (pids.iter())
        .filter_map(|p| Some(trace.span_of_pid(*p)?.end_ns))
        .min()
        .unwrap_or(0);
    let after = window.end_ns + 1_000_000_000;
    let drift = (ends && end > after + 500_000_000).then(|| {
        let s = shares_in(trace, pids, Window::new(after, end - 50_000_000));
        (s.iter().zip(targets))
            .map(|(s, t)| (s - t).abs())
            .fold(0.0, f64::max)
    });
    FaultRun {
        window_ms: round(window.len_ns() as f64 / 1e6, 1),
        gpu_busy: round(trace.utilization(0, window), 4),
        longest_blocked_ms: round(blocked as f64 / 1e6, 1),
        drift_after: drift.map(|d| round(d, 4)),
        back_ms: None,
        throttled_periods: None,
    }
}
