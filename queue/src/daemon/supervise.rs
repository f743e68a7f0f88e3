//! Running jobs: each run's shim started as its user with its environment, reaped when it
//! ends, or found again at start and watched (adopted); how each run ended, from its exit file.

use super::{ExitRecord, JOB_GROUP_PREFIX, ServeOptions, Shared, State, now_ns, step};
use crate::core::{Exit, JobId};
use crate::db::JobMeta;
use crate::sys;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

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
pub(super) fn start(
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
pub(super) fn poll_adopted(st: &mut State, jobs_dir: &Path, id: JobId, now: u64) {
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
