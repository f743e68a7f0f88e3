//! `gpushare-queue serve`: the I/O shell around the [`Core`]. It owns the socket, the database,
//! the jobs' processes and the clock; every decision comes from the core.
//!
//! A job runs as `gpushare-queue shim … -- gpushare run --group gpushare-job-ID --request R
//! --limit L [--memory M] [--latency] -- CMD…`. The shim (a small supervisor, root) starts the job in its
//! own process group as the submitting user and writes the job's exit status to a file when it
//! ends; it does not depend on the daemon, so a daemon killed mid-run finds every run again when
//! it restarts: still running (its shim alive), finished (its exit file) or lost (neither).

use crate::core::{Action, Core, Exit, GpuLoad, JobId, JobState, QueueConfig};
use crate::db::{Db, JobMeta, StoredJob};
use crate::gpus::GpuInfo;
use crate::sys;
use crate::usage::{GpuUsage, UsageHistory};
use crate::web::{GpuView, Snapshot};
use gpushare_protocol::status::{self, Report, StatusError};
use gpushare_queue_protocol::{JobView, QUEUE_PROTOCOL_VERSION, Request, Response, Submission};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::SocketAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Scheduler group of job `id`: `gpushare-job-ID`.
pub const JOB_GROUP_PREFIX: &str = "gpushare-job-";

pub struct ServeOptions {
    pub db: PathBuf,
    pub socket: PathBuf,
    pub listen: Option<SocketAddr>,
    /// The scheduler's socket (jobs' `GPUSHARE_SOCKET`, and where the books are read).
    pub scheduler_socket: PathBuf,
    /// The `gpushare` command jobs run under.
    pub gpushare: PathBuf,
    /// Variables of the daemon's own environment that jobs inherit.
    pub pass_env: Vec<String>,
    /// Between SIGTERM and SIGKILL when a job is killed.
    pub kill_grace: Duration,
    /// How often the scheduler's books are read.
    pub books_interval: Duration,
    pub config: QueueConfig,
}

pub(crate) struct State {
    pub core: Core,
    pub meta: BTreeMap<JobId, JobMeta>,
    db: Db,
    pub gpus: Vec<GpuInfo>,
    /// The scheduler's last report, or why it could not be read.
    pub books: Result<Report, String>,
    /// The last minutes of the books, for the web page's plots.
    usage: UsageHistory,
    /// Bumped at every visible change (the web page's live updates).
    pub version: u64,
    /// Jobs sent SIGTERM, and when they get SIGKILL (ns since the epoch).
    escalate: BTreeMap<JobId, u64>,
    /// Running jobs whose shim is not our child (found running at start).
    adopted: BTreeSet<JobId>,
}

pub(crate) struct Shared {
    state: Mutex<State>,
    pub changed: Condvar,
    pub opts: ServeOptions,
    jobs_dir: PathBuf,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Wall-clock time, ns since the epoch: the core's clock (it survives daemon restarts).
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// What the shim writes when the job's process has ended.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ExitRecord {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

/// Run the queue until the process is killed.
pub fn serve(opts: ServeOptions, gpus: Vec<GpuInfo>) -> anyhow::Result<()> {
    opts.config.validate().map_err(anyhow::Error::msg)?;
    let dir = opts
        .db
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();
    std::fs::create_dir_all(&dir)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}; pick another --db", dir.display()))?;
    let jobs_dir = dir.join("jobs");
    std::fs::create_dir_all(&jobs_dir)?;
    std::fs::set_permissions(&jobs_dir, std::fs::Permissions::from_mode(0o700))?;
    let db = Db::open(&opts.db)?;
    std::fs::set_permissions(&opts.db, std::fs::Permissions::from_mode(0o600))?;
    let stored = db.jobs()?;
    let mut meta = BTreeMap::new();
    let mut jobs = Vec::new();
    for s in stored {
        meta.insert(s.job.id, s.meta);
        jobs.push(s.job);
    }
    let adopted: BTreeSet<JobId> = jobs
        .iter()
        .filter(|j| j.running().is_some())
        .map(|j| j.id)
        .collect();
    let core_gpus = gpus
        .iter()
        .map(|g| crate::core::Gpu { memory: g.memory })
        .collect();
    let core = Core::restore(opts.config.clone(), core_gpus, jobs);
    tracing::info!(
        gpus = gpus.len(),
        jobs = meta.len(),
        running = adopted.len(),
        policy = %opts.config.policy,
        "gpushare-queue starting"
    );

    // Every user may submit; who they are comes from SO_PEERCRED.
    let listener = gpushare_frame::listen_at(&opts.socket, 0o666)
        .map_err(|e| anyhow::anyhow!("{e}; pick another --socket"))?;
    let http = match opts.listen {
        Some(addr) => Some(tiny_http::Server::http(addr).map_err(|e| {
            anyhow::anyhow!("cannot serve HTTP on {addr}: {e}; pick another --listen address")
        })?),
        None => None,
    };
    if let Some(addr) = http.as_ref().and_then(|s| s.server_addr().to_ip()) {
        // On stdout, for whoever started us with --listen 127.0.0.1:0.
        println!("http {addr}");
        let _ = std::io::stdout().flush();
    }

    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            core,
            meta,
            db,
            usage: UsageHistory::new(gpus.len()),
            gpus,
            books: Err("not read yet".into()),
            version: 1,
            escalate: BTreeMap::new(),
            adopted,
        }),
        changed: Condvar::new(),
        opts,
        jobs_dir,
    });
    read_books(&shared);
    {
        let mut st = shared.lock();
        step(&shared, &mut st, now_ns());
    }
    let s = shared.clone();
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || control_loop(s))?;
    let s = shared.clone();
    std::thread::Builder::new()
        .name("books".into())
        .spawn(move || {
            loop {
                std::thread::sleep(s.opts.books_interval);
                read_books(&s);
            }
        })?;
    if let Some(server) = http {
        let s = shared.clone();
        std::thread::Builder::new()
            .name("http".into())
            .spawn(move || crate::http::serve_http(s, server))?;
    }
    tracing::info!(socket = %shared.opts.socket.display(), "listening");
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let s = shared.clone();
        let _ = std::thread::Builder::new()
            .name("client".into())
            .spawn(move || client(s, stream));
    }
    Ok(())
}

/// Timeouts, kill escalation and adopted runs: wake when the next one is due.
fn control_loop(sh: Arc<Shared>) {
    let mut st = sh.lock();
    loop {
        let now = now_ns();
        step(&sh, &mut st, now);
        let mut wake = [
            st.core.next_wakeup(),
            st.escalate.values().min().copied(),
            // Adopted runs are not our children: look at them a few times a second.
            (!st.adopted.is_empty()).then_some(now + 200_000_000),
        ]
        .into_iter()
        .flatten()
        .min()
        .map_or(Duration::from_secs(5), |t| {
            Duration::from_nanos(t.saturating_sub(now))
        });
        wake = wake.clamp(Duration::from_millis(1), Duration::from_secs(5));
        st = sh
            .changed
            .wait_timeout(st, wake)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// Feed the core the time, carry out its actions, persist what changed.
pub(crate) fn step(sh: &Arc<Shared>, st: &mut State, now: u64) {
    for id in st.adopted.clone() {
        poll_adopted(st, &sh.jobs_dir, id, now);
    }
    let due: Vec<JobId> = st
        .escalate
        .iter()
        .filter(|&(_, &t)| t <= now)
        .map(|(&j, _)| j)
        .collect();
    for id in due {
        st.escalate.remove(&id);
        if let Some(pid) = st.meta.get(&id).and_then(|m| m.pid) {
            tracing::info!(job = id, "killing (SIGKILL) after the grace period");
            sys::signal_group(pid, libc::SIGKILL);
        }
    }
    loop {
        st.core.tick(now);
        let actions = st.core.take_actions();
        if actions.is_empty() {
            break;
        }
        for a in actions {
            match a {
                Action::Start {
                    job,
                    gpus,
                    share,
                    limit,
                } => start(sh, st, job, &gpus, share, limit, now),
                Action::Kill { job, reason } => {
                    tracing::info!(job, ?reason, "killing (SIGTERM)");
                    if let Some(pid) = st.meta.get(&job).and_then(|m| m.pid) {
                        sys::signal_group(pid, libc::SIGTERM);
                    }
                    st.escalate
                        .insert(job, now + sh.opts.kill_grace.as_nanos() as u64);
                }
            }
        }
    }
    persist(st, now);
}

/// Write changed jobs to the database; a change of state is a visible change.
fn persist(st: &mut State, now: u64) {
    let dirty = st.core.take_dirty();
    if dirty.is_empty() {
        return;
    }
    let mut records = Vec::new();
    for id in dirty {
        let (Some(job), Some(meta)) = (st.core.job(id), st.meta.get_mut(&id)) else {
            continue;
        };
        meta.updated_ns = now;
        records.push(StoredJob {
            job: job.clone(),
            meta: meta.clone(),
        });
    }
    let refs: Vec<&StoredJob> = records.iter().collect();
    if let Err(e) = st.db.save(&refs) {
        tracing::error!("cannot save jobs: {e}");
    }
    st.version += 1;
}

/// The environment a job starts with: a login-like base, the daemon's `--pass-env`
/// variables, the submitter's, then the queue's own (which nobody overrides).
fn job_env(
    opts: &ServeOptions,
    user: &sys::User,
    meta: &JobMeta,
    id: JobId,
    uuids: &[String],
) -> Vec<(String, String)> {
    let path = if user.uid == 0 {
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    } else {
        "/usr/local/bin:/usr/bin:/bin"
    };
    let mut env: BTreeMap<String, String> = [
        ("PATH", path),
        ("HOME", &user.home),
        ("USER", &user.name),
        ("LOGNAME", &user.name),
        ("SHELL", &user.shell),
        ("LANG", "C.UTF-8"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for name in &opts.pass_env {
        if let Ok(v) = std::env::var(name) {
            env.insert(name.clone(), v);
        }
    }
    env.extend(meta.env.iter().cloned());
    env.insert("CUDA_VISIBLE_DEVICES".into(), uuids.join(","));
    env.insert(
        gpushare_protocol::SOCKET_ENV.into(),
        opts.scheduler_socket.display().to_string(),
    );
    env.insert("GPUSHARE_QUEUE_JOB".into(), id.to_string());
    env.into_iter().collect()
}

/// Start a run of job `id`: its shim, which starts the job and reports its pid.
#[allow(clippy::too_many_arguments)]
fn start(
    sh: &Arc<Shared>,
    st: &mut State,
    id: JobId,
    gpus: &[u32],
    share: f64,
    limit: f64,
    now: u64,
) {
    let run = st.core.job(id).map_or(0, |j| j.runs);
    let uuids: Vec<String> = gpus
        .iter()
        .filter_map(|&g| st.gpus.get(g as usize).map(|g| g.uuid.clone()))
        .collect();
    let (memory, latency) = st
        .core
        .job(id)
        .map_or((None, false), |j| (j.demand.memory, j.demand.latency));
    let Some(meta) = st.meta.get_mut(&id) else {
        tracing::error!(job = id, "no record of the job to start");
        return;
    };
    match spawn(sh, meta, id, run, &uuids, share, limit, memory, latency) {
        Ok((child, pid)) => {
            tracing::info!(job = id, run, pid, ?gpus, share, "started");
            meta.shim_pid = Some(child.id());
            meta.shim_start = sys::start_time(child.id());
            meta.pid = Some(pid);
            meta.error = None;
            meta.exit_code = None;
            meta.signal = None;
            let s = sh.clone();
            let _ = std::thread::Builder::new()
                .name("reaper".into())
                .spawn(move || reap(s, id, run, child));
        }
        Err(e) => {
            tracing::warn!(job = id, "cannot start: {e}");
            meta.error = Some(e);
            meta.pid = None;
            let _ = st.core.job_exited(id, Exit::SpawnFailed, now);
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn spawn(
    sh: &Shared,
    meta: &JobMeta,
    id: JobId,
    run: u32,
    uuids: &[String],
    share: f64,
    limit: f64,
    memory: Option<u64>,
    latency: bool,
) -> Result<(Child, u32), String> {
    let user = sys::user_by_uid(meta.uid)
        .ok_or_else(|| format!("uid {} is not in the user database", meta.uid))?;
    if sys::euid() != 0 && meta.uid != sys::euid() {
        return Err(format!(
            "this queue runs as uid {} and can start only that user's jobs; run gpushare-queue as root",
            sys::euid()
        ));
    }
    let dir = sh.jobs_dir.join(id.to_string());
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let exit_file = dir.join(format!("exit-{run}"));
    let _ = std::fs::remove_file(&exit_file);
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(dir.join("log"))
        .map_err(|e| format!("cannot open the job's log: {e}"))?;
    if run > 1 {
        let _ = writeln!(log, "--- gpushare-queue: run {run} of job {id} ---");
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find gpushare-queue: {e}"))?;
    let groups: Vec<String> = sys::groups_of(&user).iter().map(u32::to_string).collect();
    let mut c = Command::new(exe);
    c.arg("shim")
        .arg("--exit-file")
        .arg(&exit_file)
        .args(["--uid", &meta.uid.to_string()])
        .args(["--gid", &user.gid.to_string()])
        .args(["--groups", &groups.join(",")])
        .arg("--cwd")
        .arg(meta.cwd.as_deref().unwrap_or(&user.home))
        .arg("--home")
        .arg(&user.home)
        .arg("--")
        .arg(&sh.opts.gpushare)
        .arg("run")
        .args(["--group", &format!("{JOB_GROUP_PREFIX}{id}")])
        .args(["--request", &share.to_string()])
        .args(["--limit", &limit.to_string()]);
    if let Some(m) = memory {
        c.args(["--memory", &m.to_string()]);
    }
    if latency {
        c.arg("--latency");
    }
    c.arg("--")
        .args(&meta.cmd)
        .env_clear()
        .envs(job_env(&sh.opts, &user, meta, id, uuids))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        // Its own process group: signals to the daemon's group do not reach it.
        .process_group(0);
    let mut child = c
        .spawn()
        .map_err(|e| format!("cannot start gpushare-queue shim: {e}"))?;
    let mut line = String::new();
    let out = child.stdout.take().expect("piped");
    let _ = BufReader::new(out).read_line(&mut line);
    match line.trim().strip_prefix("pid ").map(str::parse::<u32>) {
        Some(Ok(pid)) => Ok((child, pid)),
        _ => {
            let _ = child.wait();
            Err(line
                .trim()
                .strip_prefix("error ")
                .unwrap_or("the shim exited before starting the job")
                .to_string())
        }
    }
}

/// A run's shim, our child, ended.
fn reap(sh: Arc<Shared>, id: JobId, run: u32, mut child: Child) {
    let _ = child.wait();
    let mut st = sh.lock();
    let now = now_ns();
    finish_run(&mut st, &sh.jobs_dir, id, run, now);
    step(&sh, &mut st, now);
    drop(st);
    sh.changed.notify_all();
}

/// A run found at start (its shim not our child): finished, still going, or lost.
fn poll_adopted(st: &mut State, jobs_dir: &Path, id: JobId, now: u64) {
    let Some(job) = st.core.job(id) else {
        st.adopted.remove(&id);
        return;
    };
    let run = job.runs;
    if job.running().is_none() {
        st.adopted.remove(&id);
        return;
    }
    let meta = &st.meta[&id];
    let exited = exit_file(jobs_dir, id, run).exists();
    let shim_alive =
        matches!((meta.shim_pid, meta.shim_start), (Some(p), Some(t)) if sys::alive_since(p, t));
    let job_alive = meta.pid.is_some_and(sys::group_alive);
    if exited || !(shim_alive || job_alive) {
        finish_run(st, jobs_dir, id, run, now);
    }
}

fn exit_file(jobs_dir: &Path, id: JobId, run: u32) -> PathBuf {
    jobs_dir.join(id.to_string()).join(format!("exit-{run}"))
}

/// Tell the core how run `run` of job `id` ended (from the shim's exit file; none: lost).
fn finish_run(st: &mut State, jobs_dir: &Path, id: JobId, run: u32, now: u64) {
    st.adopted.remove(&id);
    st.escalate.remove(&id);
    match st.core.job(id) {
        Some(j) if j.runs == run && j.running().is_some() => {}
        _ => return,
    }
    let record: Option<ExitRecord> = std::fs::read(exit_file(jobs_dir, id, run))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let exit = match record {
        Some(ExitRecord { code: Some(c), .. }) => Exit::Code(c),
        Some(ExitRecord {
            signal: Some(s), ..
        }) => Exit::Signal(s),
        _ => Exit::Lost,
    };
    if let Some(m) = st.meta.get_mut(&id) {
        m.exit_code = record.and_then(|r| r.code);
        m.signal = record.and_then(|r| r.signal);
    }
    tracing::info!(job = id, run, ?exit, "run ended");
    let _ = st.core.job_exited(id, exit, now);
}

/// Read the scheduler's books and hand the core what is in use on each GPU.
fn read_books(sh: &Arc<Shared>) {
    let report = status::fetch(&sh.opts.scheduler_socket);
    let mut st = sh.lock();
    let now = now_ns();
    let before = st.version;
    apply_books(&mut st, report, now);
    step(sh, &mut st, now);
    let changed = st.version != before;
    drop(st);
    if changed {
        sh.changed.notify_all();
    }
}

fn apply_books(st: &mut State, report: Result<Report, StatusError>, now: u64) {
    match report {
        Ok(r) => {
            let loads = loads_from(&st.gpus, &r);
            st.core.gpu_state(loads, now);
            st.usage.record(now, &st.gpus, &r);
            if st.books.as_ref().ok() != Some(&r) {
                st.version += 1;
            }
            st.books = Ok(r);
        }
        Err(e) => {
            let e = e.to_string();
            if st.books.as_ref().err() != Some(&e) {
                tracing::warn!("{e}; GPUs count as free of other tenants until it answers");
                st.version += 1;
            }
            st.books = Err(e);
        }
    }
}

/// Per GPU (by UUID): other tenants' guaranteed shares and memory, and each job's memory.
pub fn loads_from(gpus: &[GpuInfo], r: &Report) -> Vec<GpuLoad> {
    gpus.iter()
        .map(|g| {
            let mut load = GpuLoad::default();
            let Some(gr) = r.gpus.iter().find(|x| x.uuid == g.uuid) else {
                return load;
            };
            for group in &gr.groups {
                match group
                    .name
                    .strip_prefix(JOB_GROUP_PREFIX)
                    .and_then(|id| id.parse::<JobId>().ok())
                {
                    Some(id) => {
                        load.job_memory.insert(id, group.memory_used);
                    }
                    None => {
                        if !group.pids.is_empty() {
                            load.foreign_request += group.request;
                        }
                        load.foreign_memory += group.memory_used;
                    }
                }
            }
            load
        })
        .collect()
}

/// The state name users see.
fn state_name(state: &JobState) -> &'static str {
    match state {
        JobState::Queued => "queued",
        JobState::Running(r) if r.kill.is_some() => "killing",
        JobState::Running(_) => "running",
        JobState::Finished { outcome, .. } => outcome.name(),
    }
}

fn unix_s(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// Every job as users see it, oldest first.
pub(crate) fn views(st: &State) -> Vec<JobView> {
    let order: BTreeMap<JobId, u32> = st
        .core
        .queue_order()
        .into_iter()
        .enumerate()
        .map(|(i, id)| (id, i as u32 + 1))
        .collect();
    st.core
        .jobs()
        .filter_map(|j| {
            let m = st.meta.get(&j.id)?;
            let (run, ended) = match &j.state {
                JobState::Running(r) => (Some(r), None),
                JobState::Finished { run, ended_ns, .. } => (run.as_ref(), Some(*ended_ns)),
                JobState::Queued => (None, None),
            };
            Some(JobView {
                id: j.id,
                name: m.name.clone(),
                user: m.user.clone(),
                uid: m.uid,
                state: state_name(&j.state).into(),
                queue_position: order.get(&j.id).copied(),
                demand: j.demand.clone(),
                gpus: run.map(|r| r.gpus.clone()).unwrap_or_default(),
                pid: run.and(m.pid),
                runs: j.runs,
                submitted_unix: unix_s(j.submitted_ns),
                started_unix: run.map(|r| unix_s(r.started_ns)),
                ended_unix: ended.map(unix_s),
                updated_unix: unix_s(m.updated_ns),
                exit_code: m.exit_code,
                signal: m.signal,
                error: m.error.clone(),
                cmd: m.cmd.clone(),
            })
        })
        .collect()
}

pub(crate) fn view(st: &State, id: JobId) -> Option<JobView> {
    views(st).into_iter().find(|v| v.id == id)
}

/// What the web page shows, taken now: the page renders this, never the state itself.
pub(crate) fn snapshot(st: &State) -> Snapshot {
    let books = st.books.as_ref().ok();
    let gpus = st
        .gpus
        .iter()
        .zip(st.core.loads())
        .map(|(g, load)| {
            let report = books.and_then(|r| r.gpus.iter().find(|x| x.uuid == g.uuid));
            GpuView {
                index: g.index,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                memory_total: g.memory,
                memory_used: load.memory_used(),
                queue_share: st.core.on_gpu(g.index).fold(0.0, |s, j| s + j.demand.share),
                others_request: load.foreign_request,
                achieved: report
                    .map(|r| {
                        r.groups
                            .iter()
                            .filter(|x| x.achieved_share > 0.0005)
                            .map(|x| (x.name.clone(), x.achieved_share))
                            .collect()
                    })
                    .unwrap_or_default(),
                jobs: st.core.on_gpu(g.index).map(|j| j.id).collect(),
            }
        })
        .collect();
    Snapshot {
        policy: st.core.config().policy.to_string(),
        gpus,
        jobs: views(st),
        books_error: st.books.as_ref().err().cloned(),
    }
}

/// Each GPU's use by group over the last minutes (the samples after `since` only, if given), a
/// job's group labelled with the job and its owner.
pub(crate) fn usage(st: &State, since: Option<f64>) -> Vec<GpuUsage> {
    st.usage.view(&st.gpus, since, |group| {
        let job = group
            .strip_prefix(JOB_GROUP_PREFIX)
            .and_then(|id| id.parse::<JobId>().ok());
        match job.map(|id| (id, st.meta.get(&id))) {
            Some((id, Some(m))) => format!("job {id} ({})", m.user),
            Some((id, None)) => format!("job {id}"),
            None => group.to_string(),
        }
    })
}

/// Check and queue a submission from `uid`; its id.
pub(crate) fn submit(sh: &Arc<Shared>, uid: u32, s: Submission) -> Result<JobId, String> {
    if s.cmd.is_empty() || s.cmd[0].is_empty() {
        return Err("nothing to run: give the command after `--`".into());
    }
    if let Some(n) = &s.name
        && (n.is_empty() || n.len() > 64 || n.chars().any(char::is_control))
    {
        return Err("--name must be 1 to 64 printable characters".into());
    }
    for (k, v) in &s.env {
        let valid = !k.is_empty()
            && !k.starts_with(|c: char| c.is_ascii_digit())
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid || v.contains('\0') {
            return Err(format!(
                "environment variable {k:?} is not NAME=VALUE with a name of letters, digits and _"
            ));
        }
    }
    if s.cmd.iter().any(|a| a.contains('\0')) {
        return Err("the command contains a NUL byte".into());
    }
    if let Some(cwd) = &s.cwd
        && !cwd.starts_with('/')
    {
        return Err(format!(
            "working directory {cwd:?} must be an absolute path"
        ));
    }
    if sys::euid() != 0 && uid != sys::euid() {
        return Err(format!(
            "this queue runs as uid {} and can run only that user's jobs; ask the administrator to run gpushare-queue as root",
            sys::euid()
        ));
    }
    let user = sys::user_by_uid(uid).ok_or_else(|| {
        format!("uid {uid} is not in the user database; jobs run as their submitter")
    })?;
    let name = s.name.clone().unwrap_or_else(|| {
        Path::new(&s.cmd[0])
            .file_name()
            .map_or(s.cmd[0].clone(), |n| n.to_string_lossy().into_owned())
    });
    // Place it by what is in use now, not at the last periodic look.
    let books = status::fetch(&sh.opts.scheduler_socket);
    let mut st = sh.lock();
    let now = now_ns();
    st.core.check(&s.demand).map_err(|e| e.to_string())?;
    apply_books(&mut st, books, now);
    let id = st.core.submit(s.demand, now).map_err(|e| e.to_string())?;
    st.meta.insert(
        id,
        JobMeta {
            name,
            uid,
            gid: user.gid,
            user: user.name,
            cmd: s.cmd,
            env: s.env,
            cwd: s.cwd,
            shim_pid: None,
            shim_start: None,
            pid: None,
            updated_ns: now,
            error: None,
            exit_code: None,
            signal: None,
        },
    );
    tracing::info!(job = id, uid, "submitted");
    step(sh, &mut st, now);
    drop(st);
    sh.changed.notify_all();
    Ok(id)
}

/// Cancel job `id` for `uid` (its owner, or root).
pub(crate) fn cancel(sh: &Arc<Shared>, uid: u32, id: JobId) -> Result<JobView, String> {
    let mut st = sh.lock();
    let owner = st.meta.get(&id).map(|m| m.uid);
    match owner {
        None => return Err(format!("no job {id}; `gpushare jobs` lists them")),
        Some(o) if o != uid && uid != 0 => {
            return Err(format!(
                "job {id} is not yours; only its owner or root may cancel it"
            ));
        }
        _ => {}
    }
    let now = now_ns();
    st.core.cancel(id, now).map_err(|e| e.to_string())?;
    step(sh, &mut st, now);
    let v = view(&st, id).expect("the job exists");
    drop(st);
    sh.changed.notify_all();
    Ok(v)
}

/// `uid`'s HTTP token.
pub(crate) fn token(sh: &Shared, uid: u32, renew: bool) -> Result<String, String> {
    let fresh: String = rand::random::<[u8; 16]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    sh.lock()
        .db
        .token(uid, renew, &fresh)
        .map_err(|e| e.to_string())
}

/// The user a token belongs to.
pub(crate) fn token_user(sh: &Shared, token: &str) -> Option<u32> {
    sh.lock().db.token_user(token).ok().flatten()
}

/// Whether `uid` may read job `id`'s output (its owner, or root); the error says why not.
pub(crate) fn may_read_logs(sh: &Shared, uid: u32, id: JobId) -> Result<(), String> {
    match sh.lock().meta.get(&id).map(|m| m.uid) {
        None => Err(format!("no job {id}; `gpushare jobs` lists them")),
        Some(o) if o != uid && uid != 0 => Err(format!(
            "job {id} is not yours; only its owner or root may read its output"
        )),
        _ => Ok(()),
    }
}

/// Job `id`'s output from `offset` (at most `max` bytes); empty at the end so far.
pub(crate) fn read_log(sh: &Shared, id: JobId, offset: u64, max: usize) -> Vec<u8> {
    let path = sh.jobs_dir.join(id.to_string()).join("log");
    let Ok(mut f) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let mut buf = vec![0; max];
    let n = f
        .seek(SeekFrom::Start(offset))
        .and_then(|_| f.read(&mut buf))
        .unwrap_or(0);
    buf.truncate(n);
    buf
}

/// One connection on the Unix socket.
fn client(sh: Arc<Shared>, mut stream: UnixStream) {
    let Ok(peer) = gpushare_frame::peer_credentials(&stream) else {
        return;
    };
    let mut buf = Vec::new();
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let reply = |stream: &mut UnixStream, r: &Response| gpushare_frame::send(stream, r).is_ok();
    match gpushare_frame::recv::<Request>(&mut stream, &mut buf) {
        Ok(Some(Request::Hello { version })) if version == QUEUE_PROTOCOL_VERSION => {
            if !reply(&mut stream, &Response::Welcome) {
                return;
            }
        }
        Ok(Some(Request::Hello { version })) => {
            reply(
                &mut stream,
                &Response::Error(format!(
                    "this gpushare speaks queue protocol {version}, gpushare-queue {QUEUE_PROTOCOL_VERSION}: install both from one release"
                )),
            );
            return;
        }
        _ => {
            reply(
                &mut stream,
                &Response::Error("the first request must be Hello".into()),
            );
            return;
        }
    }
    let _ = stream.set_read_timeout(None);
    loop {
        let req = match gpushare_frame::recv::<Request>(&mut stream, &mut buf) {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => {
                reply(
                    &mut stream,
                    &Response::Error(format!("malformed request: {e}")),
                );
                return;
            }
        };
        let r = match req {
            Request::Hello { .. } => Response::Error("Hello sent twice".into()),
            Request::Submit(s) => match submit(&sh, peer.uid, s) {
                Ok(id) => Response::Submitted { id },
                Err(e) => Response::Error(e),
            },
            Request::Jobs => Response::Jobs(views(&sh.lock())),
            Request::Cancel { id } => match cancel(&sh, peer.uid, id) {
                Ok(v) => Response::Cancelled(v),
                Err(e) => Response::Error(e),
            },
            Request::Token { renew } => match token(&sh, peer.uid, renew) {
                Ok(t) => Response::Token(t),
                Err(e) => Response::Error(e),
            },
            Request::Logs { id, follow } => {
                if let Err(e) = may_read_logs(&sh, peer.uid, id) {
                    Response::Error(e)
                } else if !stream_logs(&sh, &mut stream, id, follow) {
                    return;
                } else {
                    continue;
                }
            }
        };
        if !reply(&mut stream, &r) {
            return;
        }
    }
}

/// Send job `id`'s output, then [`Response::LogEnd`]; with `follow`, until the job has
/// finished. False if the client went away.
fn stream_logs(sh: &Arc<Shared>, stream: &mut UnixStream, id: JobId, follow: bool) -> bool {
    let mut offset = 0u64;
    loop {
        let chunk = read_log(sh, id, offset, 64 << 10);
        if !chunk.is_empty() {
            offset += chunk.len() as u64;
            if gpushare_frame::send(stream, &Response::LogChunk(chunk)).is_err() {
                return false;
            }
            continue;
        }
        let st = sh.lock();
        let Some(v) = view(&st, id) else {
            return false;
        };
        if !follow || v.finished() {
            drop(st);
            // Whatever the job wrote before it ended is in the file now.
            loop {
                let rest = read_log(sh, id, offset, 64 << 10);
                if rest.is_empty() {
                    break;
                }
                offset += rest.len() as u64;
                if gpushare_frame::send(stream, &Response::LogChunk(rest)).is_err() {
                    return false;
                }
            }
            return gpushare_frame::send(stream, &Response::LogEnd(v)).is_ok();
        }
        // The job writes without telling anyone: look again shortly, or at its end.
        let _ = sh
            .changed
            .wait_timeout(st, Duration::from_millis(100))
            .unwrap_or_else(|e| e.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_protocol::status::{Durations, GpuReport, GroupReport};

    fn group(name: &str, request: f64, memory: u64, pids: Vec<u32>) -> GroupReport {
        GroupReport {
            name: name.into(),
            request,
            limit: 1.0,
            weight: 1.0,
            latency: false,
            effective_request: request,
            target_share: 0.0,
            achieved_share: 0.0,
            busy_seconds: 0.0,
            tokens: 0,
            waits: 0,
            overruns: 0,
            revocations: 0,
            preempted: 0,
            pids,
            active: false,
            memory_used: memory,
            memory_cap: None,
            memory_clamped: None,
            memory_reservations: 0,
            memory_swapped: 0,
            memory_state: Default::default(),
            memory_refused: None,
            pod: None,
        }
    }

    #[test]
    fn books_split_into_jobs_and_other_tenants() {
        let gpus = vec![
            GpuInfo {
                index: 0,
                uuid: "GPU-a".into(),
                name: "a".into(),
                memory: 100,
            },
            GpuInfo {
                index: 1,
                uuid: "GPU-b".into(),
                name: "b".into(),
                memory: 100,
            },
        ];
        let r = Report {
            dev_mode: true,
            pods: vec![],
            unhooked: vec![],
            event_loop: Durations::default(),
            memory_swaps: Default::default(),
            gpus: vec![GpuReport {
                uuid: "GPU-b".into(),
                holder: None,
                waiting: vec![],
                groups: vec![
                    group("gpushare-job-7", 0.5, 30, vec![1]),
                    group("training", 0.3, 20, vec![2]),
                    group("gone", 0.4, 0, vec![]),
                ],
                physical: None,
            }],
        };
        let loads = loads_from(&gpus, &r);
        assert_eq!(loads[0], GpuLoad::default(), "GPU 0 is not in the books");
        assert_eq!(
            loads[1].foreign_request, 0.3,
            "a group without processes holds nothing"
        );
        assert_eq!(loads[1].foreign_memory, 20);
        assert_eq!(loads[1].job_memory, BTreeMap::from([(7, 30)]));
        assert_eq!(loads[1].memory_used(), 50);
    }
}
