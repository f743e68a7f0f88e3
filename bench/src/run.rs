//! One run of (some of) a scenario's tenants on a fresh node, with gpushare or natively, and
//! its figures.

use crate::analysis::{RunFigures, analyse};
use crate::client::ClientResult;
use crate::expected;
use crate::fault::{self, FaultKind, FaultSpec, JournalFs, Starved};
use crate::noise::{self, Disturbance, NoiseRecord};
use crate::report::{EventLoopRun, FLOOD_SAMPLE_MS, FaultRun, FloodRun, round};
use crate::scenario::Scenario;
use crate::settings::{Settings, Source};
use anyhow::{Context, bail};
use gpushare_policy::GroupClass;
use gpushare_testkit::cpu;
use gpushare_testkit::flood::{self, Flood, FloodSpec, Watch, Watched};
use gpushare_testkit::harness::target_dir;
use gpushare_testkit::node::{Node, Tenant};
use gpushare_testkit::trace::{Trace, Window};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// With gpushare or without.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A scheduler, tenants under `gpushare run`.
    Gpushare,
    /// The same tenants on the bare device (its own time-slicing).
    Native,
}

impl Mode {
    pub fn label(self) -> &'static str {
        match self {
            Mode::Gpushare => "gpushare",
            Mode::Native => "native",
        }
    }
}

/// What to run.
pub struct RunSpec<'a> {
    pub sc: &'a Scenario,
    /// Indices of the tenants of `sc` to run.
    pub which: &'a [usize],
    pub mode: Mode,
    pub duration_ns: u64,
    /// Where to keep the kernel records (the device trace, `…trace.jsonl`; with `--source
    /// events` also the tenants' timelines next to it, `…timeline.jsonl`).
    pub keep_trace: Option<&'a Path>,
    /// Names the run for its noise seed (e.g. `three-requests/gpushare/2`).
    pub label: &'a str,
    /// A connection flood against the scheduler's socket while the tenants run (with gpushare).
    pub flood: Option<&'a FloodSpec>,
    /// A fault of the scheduler while the tenants run (with gpushare).
    pub fault: Option<&'a FaultSpec>,
}

/// One run's results.
pub struct RunOutcome {
    pub figures: RunFigures,
    /// Measuring from the tenants' timelines on the simulator: the device trace's figures.
    pub device_check: Option<RunFigures>,
    /// Each tenant's result line.
    pub outputs: Vec<Option<ClientResult>>,
    /// With gpushare: the scheduler's CPU time while the tenants ran, and the wall time it was
    /// measured over (s).
    pub scheduler_cpu: Option<(f64, f64)>,
    pub noise: Option<NoiseRecord>,
    /// Under a flood: the scheduler's threads, `gpushare status` latency, the connections.
    pub flood: Option<FloodRun>,
    /// Under a fault: what it cost the tenants.
    pub fault: Option<FaultRun>,
    /// With gpushare: how late the scheduler's event loop ran.
    pub event_loop: Option<EventLoopRun>,
}

/// Run `spec` on a fresh node.
pub fn run(spec: &RunSpec, s: &Settings) -> anyhow::Result<RunOutcome> {
    let RunSpec {
        sc,
        which,
        mode,
        duration_ns,
        ..
    } = *spec;
    let mut node = s.node(sc.gpus)?;
    if s.scheduler_log {
        node.scheduler_log_filter = crate::settings::SCHEDULER_LOG_FILTER.into();
    }
    let flood_spec = spec.flood.filter(|_| mode == Mode::Gpushare);
    // A journal to fill: on a file system of its own (unmounted before the node goes).
    let journal_fs = match spec.fault {
        Some(f) if mode == Mode::Gpushare && f.kind == FaultKind::JournalFull => {
            Some(JournalFs::mount(&node)?)
        }
        _ => None,
    };
    if mode == Mode::Gpushare {
        match (flood_spec, &journal_fs) {
            (Some(f), _) => start_flooded_scheduler(&mut node, f)?,
            (None, Some(fs)) => {
                let books = fs.books();
                node.start_scheduler(&["--books", &books.to_string_lossy()]);
            }
            (None, None) => node.start_scheduler(&[]),
        }
    }
    // The flood from before the tenants start to after they end, and its watch.
    let flooded = match (flood_spec, node.scheduler_pid()) {
        (Some(f), Some(pid)) => {
            let socket = node.sched_socket.clone();
            let flood = Flood::start(&socket, f).context("cannot flood the scheduler's socket")?;
            let watch = Watch::start(pid, socket, Duration::from_millis(FLOOD_SAMPLE_MS));
            Some((flood, watch))
        }
        _ => None,
    };
    let fault = spec.fault.filter(|_| mode == Mode::Gpushare);
    if let Some(f) = fault
        && !f.starves()
        && (f.at_ms + f.for_ms) * 1_000_000 >= duration_ns
    {
        bail!(
            "its [fault] ends after the run ({duration_ns} ns; --quick shortens runs to 3 s): run it at its full duration"
        );
    }
    // Starved for the whole run: the scheduler in its cgroup and the hogs from before the
    // tenants start until the run ends.
    let starved = match fault {
        Some(f) if f.starves() => Some(Starved::start(
            &node,
            f.kind,
            which.len(),
            noise::hog_command,
        )?),
        _ => None,
    };
    let client = target_dir().join("cudarc-client");
    let duration_ms = duration_ns as f64 / 1e6;
    let sched_cpu0 = node
        .scheduler_pid()
        .and_then(cpu::read)
        .map(|c| (c, Instant::now()));
    let timelines: Vec<PathBuf> = (0..which.len())
        .map(|k| node.tmp.path().join(format!("timeline-{k}.jsonl")))
        .collect();
    let mut running: Vec<Tenant> = Vec::new();
    for (k, &i) in which.iter().enumerate() {
        let t = &sc.tenants[i];
        let mut args = Vec::new();
        if s.source == Source::Events {
            args.push("--timeline".to_string());
            args.push(timelines[k].display().to_string());
        }
        args.extend(t.client_args(duration_ms, k as u64 + 1));
        let cmd = match mode {
            Mode::Gpushare => {
                // As a user starts it: `gpushare run --group … [--latency] -- client …`.
                let (r, l, w) = (
                    t.request.to_string(),
                    t.limit.to_string(),
                    t.weight.to_string(),
                );
                let mut run_args = vec![
                    "--group",
                    &t.name,
                    "--request",
                    &r,
                    "--limit",
                    &l,
                    "--weight",
                    &w,
                ];
                if t.class == GroupClass::Latency {
                    run_args.push("--latency");
                }
                let mut c = node.run_command(&run_args, &client, &args);
                if let Some(s) = &starved {
                    s.tenant(&mut c);
                }
                // Under a fault, as users run by default: the schedule is lost a moment, not
                // the GPU.
                if fault.is_some() {
                    c.env("GPUSHARE_FAIL", "open");
                }
                c
            }
            Mode::Native => {
                let mut c = node.command(&client);
                c.args(&args);
                c
            }
        };
        running.push(node.spawn(cmd));
    }
    let pids: Vec<u32> = running.iter().map(Tenant::pid).collect();
    let started_ns = gpushare_testkit::node::monotonic_ns();
    // Dropped (continuing any stopped process, killing the hogs) before the node on every path.
    let noise = match s.noise {
        Some(params) => {
            let mut victims: Vec<(String, u32)> = which
                .iter()
                .zip(&pids)
                .map(|(&i, &pid)| (sc.tenants[i].name.clone(), pid))
                .collect();
            // A scheduler that a fault kills is no victim (its pid may be another's then).
            if fault.is_none() {
                victims.extend(node.scheduler_pid().map(|p| ("scheduler".to_string(), p)));
            }
            let seed = noise::run_seed(params.seed, spec.label);
            Some(
                Disturbance::start(&params, seed, &victims, noise::hog_command)
                    .context("cannot start the noisy-host mode's hog or stall thread")?,
            )
        }
        None => None,
    };
    let struck = match fault {
        Some(f) if !f.starves() => {
            // A full journal: a process of a third group allocates meanwhile (beyond its lease,
            // so that it asks the scheduler).
            let alloc = journal_fs.as_ref().map(|fs| {
                let args = fault::journal_full_alloc_args();
                let cmd = node.tenant_command("journal-full", 0.0, 1.0, 1.0, &client, &args);
                (fs, cmd)
            });
            Some(fault::strike(&mut node, f, started_ns, &pids, alloc)?)
        }
        _ => None,
    };
    let deadline = Duration::from_nanos(duration_ns) + Duration::from_secs(30);
    let t0 = Instant::now();
    let mut outputs = Vec::new();
    let mut failures = Vec::new();
    for (k, t) in running.into_iter().enumerate() {
        let (out, killed) = t.finish_within(deadline.saturating_sub(t0.elapsed()));
        let name = &sc.tenants[which[k]].name;
        if killed || !out.status.success() {
            failures.push(format!(
                "tenant {name} {}: {}",
                if killed {
                    "did not finish in time".to_string()
                } else {
                    format!("failed ({})", out.status)
                },
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        outputs.push(ClientResult::last_in(&out.stdout));
    }
    let noise = noise.map(Disturbance::stop);
    let flood = flooded.map(|(flood, watch)| flood_run(watch.stop(), flood));
    if let Some(f) = &flood
        && !f.status_failures.is_empty()
    {
        crate::progress(format!(
            "{}: gpushare status failed {} time(s) under the flood: {}",
            spec.label,
            f.status_failures.len(),
            f.status_failures[0]
        ));
    }
    // A scheduler killed and started again: not one process's CPU.
    let restarted = fault.is_some_and(|f| f.kind == FaultKind::Kill);
    let scheduler_cpu = sched_cpu0.filter(|_| !restarted).and_then(|(c0, t)| {
        let c1 = cpu::read(node.scheduler_pid()?)?;
        Some((cpu::delta(c0, c1), t.elapsed().as_secs_f64()))
    });
    let event_loop = match mode {
        Mode::Gpushare => node.status_json().ok().and_then(|v| EventLoopRun::of(&v)),
        Mode::Native => None,
    };
    let throttled = starved.as_ref().map(Starved::throttled_periods);
    drop(starved);
    let log = match mode {
        Mode::Gpushare => node.scheduler_log(),
        Mode::Native => String::new(),
    };
    // The tenants' timelines (read before the node's scratch directory goes), or the device's.
    let timeline = if s.source == Source::Events && failures.is_empty() {
        let mut records = Vec::new();
        for (path, &i) in timelines.iter().zip(which) {
            let t = Trace::read(path).with_context(|| {
                format!(
                    "tenant {}: no timeline ({})",
                    sc.tenants[i].name,
                    path.display()
                )
            })?;
            records.extend_from_slice(t.records());
        }
        Some(Trace::from_records(records))
    } else {
        None
    };
    let device_trace = node.stop();
    if let Some(dest) = spec.keep_trace {
        let write = |trace: &Trace, dest: &Path| {
            trace
                .write(dest)
                .with_context(|| format!("cannot write {}", dest.display()))
        };
        if let Some(t) = &device_trace {
            write(t, dest)?;
        }
        if let Some(t) = &timeline {
            write(t, &timeline_path(dest))?;
        }
        if s.scheduler_log && mode == Mode::Gpushare {
            let path = beside_trace(dest, "scheduler.log");
            std::fs::write(&path, &log)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    if !failures.is_empty() {
        bail!("{}\n{}", failures.join("\n"), log.trim());
    }
    let (trace, check) = match timeline {
        Some(t) => (t, device_trace),
        None => (
            device_trace.context("no device trace (running on the system's driver)")?,
            None,
        ),
    };
    // Targets per window: a latency tenant demands the work its requests would run in it alone
    // (it reports their arrival times); the others their nominal demand.
    let targets = |w: Window| -> Vec<f64> {
        let all = expected::targets(sc, |i| {
            let t = &sc.tenants[i];
            let arrivals = which
                .iter()
                .position(|&j| j == i)
                .and_then(|k| outputs[k].as_ref()?.arrivals_ns.as_ref());
            match arrivals {
                Some(a) => t.demand_in(a, w),
                None => t.demand(),
            }
        });
        which.iter().map(|&i| all[i]).collect()
    };
    let gpus: Vec<u32> = which.iter().map(|&i| sc.tenants[i].gpu).collect();
    let figures = analyse(&trace, &pids, &gpus, &targets);
    let fault = fault.map(|f| {
        let (window, back, journal) = match &struck {
            Some(s) => (s.window, s.back_ns, s.journal),
            None => (
                Window::new(figures.measure_ns.0, figures.measure_ns.1),
                None,
                None,
            ),
        };
        let mut run = fault::figures(&trace, &pids, &figures.target, window, !f.starves());
        run.back_ms = back.map(|ns| round(ns as f64 / 1e6, 1));
        run.journal = journal;
        run.throttled_periods = throttled;
        run
    });
    Ok(RunOutcome {
        figures,
        device_check: check.map(|t| analyse(&t, &pids, &gpus, &targets)),
        outputs,
        scheduler_cpu,
        noise,
        flood,
        fault,
        event_loop,
    })
}

/// Start the node's scheduler (`--dev`) for a flood of `f`: the flood comes from the bench's
/// own uid, like the tenants and `gpushare status`, so the config raises `[connections]
/// max_per_uid` (and `max` if needed) above it; and this process may hold that many sockets.
fn start_flooded_scheduler(node: &mut Node, f: &FloodSpec) -> anyhow::Result<()> {
    let n = f.connections();
    flood::raise_open_files_limit(n as u64 + 1024)
        .map_err(|e| anyhow::anyhow!("the flood: {e}"))?;
    let config = node.tmp.path().join("flood-config.toml");
    std::fs::write(
        &config,
        format!(
            "# The bench's [flood]: its connections come from the bench's own uid, like the\n\
             # tenants'; the bounds leave room for all of them and the tenants beside.\n\
             [connections]\nmax = {}\nmax_per_uid = {}\n",
            (n + 512).max(4096),
            n + 256
        ),
    )
    .with_context(|| format!("cannot write {}", config.display()))?;
    node.start_scheduler(&["--config", &config.display().to_string()]);
    Ok(())
}

/// A flooded run's record from what its watch saw and its flood.
fn flood_run(w: Watched, flood: Flood) -> FloodRun {
    let mut ms: Vec<f64> = w.status_s.iter().map(|s| s * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let median = match ms.len() {
        0 => 0.0,
        n if n % 2 == 1 => ms[n / 2],
        n => (ms[n / 2 - 1] + ms[n / 2]) / 2.0,
    };
    FloodRun {
        threads_max: w.threads.iter().copied().max().unwrap_or(0),
        status_calls: ms.len(),
        status_max_ms: round(ms.last().copied().unwrap_or(0.0), 1),
        status_median_ms: round(median, 1),
        status_failures: w.status_failures,
        connections: flood.stop(),
    }
}

/// Where the timeline a kept trace `NAME.trace.jsonl` comes with goes: `NAME.timeline.jsonl`.
pub fn timeline_path(trace: &Path) -> PathBuf {
    beside_trace(trace, "timeline.jsonl")
}

/// A file that goes with a kept trace `NAME.trace.jsonl`: `NAME.SUFFIX`.
fn beside_trace(trace: &Path, suffix: &str) -> PathBuf {
    let name = trace.file_name().unwrap_or_default().to_string_lossy();
    let stem = name.strip_suffix(".trace.jsonl").unwrap_or(&name);
    trace.with_file_name(format!("{stem}.{suffix}"))
}
