//! Faults of the scheduler during a run with gpushare (a scenario's `[fault]`), and what they
//! cost the tenants: stopped (`SIGSTOP`, a frozen cgroup or a debugger) for a while, killed
//! (`kill -9`) and started again a while later, starved of CPU for the whole run — in a cpu
//! cgroup with a 50m request's weight beside one CPU hog per core, or under a hard 50m quota
//! (5 ms per 100 ms) —, its socket's path removed (its directory replaced), or its memory
//! journal's file system full while a process allocates.

use crate::report::{FaultRun, JournalRun, round};
use anyhow::Context;
use gpushare_testkit::cgroup::CpuCgroup;
use gpushare_testkit::node::{Node, Tenant, longest_without_kernel, monotonic_ns, shares_in};
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
    /// The tenant socket's path removed at `at_ms` (its directory replaced, as a remounted
    /// host path): the window lasts until every tenant is listed by a `gpushare status` that
    /// reached the scheduler through the path again.
    ReplaceSocket,
    /// The memory journal's file system (a 1 MiB tmpfs) full from `at_ms` for `for_ms`, while
    /// a third process (fail-open) allocates 256 MiB.
    JournalFull,
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

/// A small file system for the scheduler's memory journal (a tmpfs mounted in the node's
/// scratch directory, unmounted when dropped), to be filled.
pub struct JournalFs {
    dir: std::path::PathBuf,
}

/// The journal file system's size: the journal of a few processes takes a few hundred bytes.
const JOURNAL_FS_SIZE: &str = "size=1m";
/// The allocation made while the journal's file system is full.
const JOURNAL_FULL_ALLOC_MIB: &str = "256";

/// The `cudarc-client` arguments of the process that allocates while the journal is full: a
/// few kernels holding [`JOURNAL_FULL_ALLOC_MIB`].
pub fn journal_full_alloc_args() -> [&'static str; 9] {
    [
        "spin",
        "--ms-per-kernel",
        "1",
        "--kernels",
        "10",
        "--sync-every",
        "10",
        "--alloc-mib",
        JOURNAL_FULL_ALLOC_MIB,
    ]
}

impl JournalFs {
    /// Mount it in `node`'s scratch directory (needs root).
    pub fn mount(node: &Node) -> anyhow::Result<JournalFs> {
        let dir = node.tmp.path().join("journal-fs");
        std::fs::create_dir_all(&dir)?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", JOURNAL_FS_SIZE, "tmpfs"])
            .arg(&dir)
            .output()
            .context("cannot run mount")?;
        anyhow::ensure!(
            out.status.success(),
            "the journal-full fault mounts a tmpfs for the scheduler's journal (needs root): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(JournalFs { dir })
    }

    /// The journal's path in it (the scheduler's `--books`).
    pub fn books(&self) -> std::path::PathBuf {
        self.dir.join("books.json")
    }

    fn filler(&self) -> std::path::PathBuf {
        self.dir.join("filler")
    }

    /// Fill it: a file written until the file system is full.
    fn fill(&self) -> anyhow::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(self.filler())?;
        let block = [0u8; 4096];
        loop {
            if let Err(e) = f.write_all(&block) {
                anyhow::ensure!(
                    e.raw_os_error() == Some(libc::ENOSPC),
                    "cannot fill the journal's file system: {e}"
                );
                return Ok(());
            }
        }
    }

    /// Make room again.
    fn empty(&self) {
        let _ = std::fs::remove_file(self.filler());
    }
}

impl Drop for JournalFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
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

/// What a fault that strikes once did: its window, when every tenant was back (after a kill, ns
/// after the new scheduler started; with the socket removed, ns after its removal), and for a
/// full journal what became of the allocation.
pub struct Struck {
    pub window: Window,
    pub back_ns: Option<u64>,
    pub journal: Option<JournalRun>,
}

/// Whether every one of `pids` is connected, by `gpushare status` through `node`'s socket.
fn all_connected(node: &Node, pids: &[u32]) -> bool {
    let Ok(status) = node.status_json() else {
        return false;
    };
    let connected: Vec<u64> = (status["gpus"].as_array().into_iter().flatten())
        .flat_map(|g| g["groups"].as_array().into_iter().flatten())
        .flat_map(|g| g["pids"].as_array().into_iter().flatten())
        .filter_map(serde_json::Value::as_u64)
        .collect();
    pids.iter().all(|p| connected.contains(&u64::from(*p)))
}

/// Poll until every one of `pids` is connected, at most 5 s: when (`CLOCK_MONOTONIC` ns).
fn wait_connected(node: &Node, pids: &[u32]) -> Option<u64> {
    let deadline = monotonic_ns() + 5_000_000_000;
    loop {
        if all_connected(node, pids) {
            return Some(monotonic_ns());
        }
        if monotonic_ns() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Strike `node`'s scheduler as `f` says, `f.at_ms` after `started` (ms of
/// `CLOCK_MONOTONIC`), and bring it back `f.for_ms` later (for a full journal, `fs` is its file
/// system, and `alloc` the command of the process that allocates meanwhile).
pub fn strike(
    node: &mut Node,
    f: &FaultSpec,
    started_ns: u64,
    pids: &[u32],
    journal: Option<(&JournalFs, Command)>,
) -> anyhow::Result<Struck> {
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
            Ok(Struck {
                window: Window::new(start, end),
                back_ns: None,
                journal: None,
            })
        }
        FaultKind::Kill => {
            node.kill_scheduler();
            std::thread::sleep(Duration::from_millis(f.for_ms));
            let end = monotonic_ns();
            node.start_scheduler(&[]);
            let back = wait_connected(node, pids).map(|at| at - end);
            Ok(Struck {
                window: Window::new(start, end),
                back_ns: back,
                journal: None,
            })
        }
        FaultKind::ReplaceSocket => {
            std::fs::remove_file(&node.sched_socket)
                .context("cannot remove the scheduler's socket")?;
            let end = wait_connected(node, pids)
                .context("the tenants were not listed through the socket's path within 5 s")?;
            Ok(Struck {
                window: Window::new(start, end),
                back_ns: Some(end - start),
                journal: None,
            })
        }
        FaultKind::JournalFull => {
            let (fs, mut alloc) = journal.context("a full journal needs its file system")?;
            fs.fill()?;
            alloc.env("GPUSHARE_FAIL", "open");
            let (out, killed) =
                Tenant::spawn(alloc).finish_within(Duration::from_millis(f.for_ms.max(5_000)));
            let rest = (start + f.for_ms * 1_000_000).saturating_sub(monotonic_ns());
            std::thread::sleep(Duration::from_nanos(rest));
            fs.empty();
            let end = monotonic_ns();
            let stderr = String::from_utf8_lossy(&out.stderr);
            Ok(Struck {
                window: Window::new(start, end),
                back_ns: None,
                journal: Some(JournalRun {
                    allocated: !killed && out.status.success(),
                    hook_said: stderr.contains("could not journal"),
                    scheduler_said: node
                        .scheduler_log()
                        .contains("cannot write the memory journal"),
                }),
            })
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
        journal: None,
    }
}
