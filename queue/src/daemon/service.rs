//! The requests users make, from the socket or HTTP alike: submit, cancel, tokens, output.

use super::books::apply_books;
use super::views::view;
use super::{Shared, now_ns, step};
use crate::core::JobId;
use crate::db::JobMeta;
use crate::sys;
use gpushare_protocol::status;
use gpushare_queue_protocol::{JobView, Submission};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::Arc;

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
