//! What users see: the jobs as views, the web page's snapshot and the usage plots, each taken
//! from the state at one moment.

use super::{JOB_GROUP_PREFIX, State};
use crate::core::{JobId, JobState};
use crate::usage::GpuUsage;
use crate::web::{GpuView, Snapshot};
use gpushare_queue_protocol::JobView;
use std::collections::BTreeMap;

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
