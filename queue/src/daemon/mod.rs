//! `gpushare-queue serve`: the I/O shell around the [`Core`]. It owns the socket, the database,
//! the jobs' processes and the clock; every decision comes from the core.
//!
//! A job runs as `gpushare-queue shim … -- gpushare run --group gpushare-job-ID --request R
//! --limit L [--memory M] [--latency] -- CMD…`. The shim (a small supervisor, root) starts the job in its
//! own process group as the submitting user and writes the job's exit status to a file when it
//! ends; it does not depend on the daemon, so a daemon killed mid-run finds every run again when
//! it restarts: still running (its shim alive), finished (its exit file) or lost (neither).

mod books;
mod service;
mod socket;
mod supervise;
mod views;

pub use books::loads_from;
pub(crate) use service::{cancel, may_read_logs, read_log, submit, token_user};
pub(crate) use views::{snapshot, usage, view, views};

use crate::core::{Action, Core, JobId, QueueConfig};
use crate::db::{Db, JobMeta, StoredJob};
use crate::gpus::GpuInfo;
use crate::sys;
use crate::usage::UsageHistory;
use gpushare_protocol::status::Report;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
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
    books::read_books(&shared);
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
                books::read_books(&s);
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
            .spawn(move || socket::client(s, stream));
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
        supervise::poll_adopted(st, &sh.jobs_dir, id, now);
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
                } => supervise::start(sh, st, job, &gpus, share, limit, now),
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
