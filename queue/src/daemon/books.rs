//! The scheduler's books: what is in use on each GPU, read periodically and before each
//! submission, handed to the core and kept for the page's plots.

use super::{JOB_GROUP_PREFIX, Shared, State, now_ns, step};
use crate::core::{GpuLoad, JobId};
use crate::gpus::GpuInfo;
use gpushare_protocol::status::{self, Report, StatusError};
use std::sync::Arc;

/// Read the scheduler's books and hand the core what is in use on each GPU.
pub(super) fn read_books(sh: &Arc<Shared>) {
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

pub(super) fn apply_books(st: &mut State, report: Result<Report, StatusError>, now: u64) {
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

/// Per GPU (by UUID): other tenants' guaranteed shares, memory and measured GPU time, and
/// each job's memory and measured GPU time (the scheduler's achieved shares).
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
                        load.job_busy.insert(id, group.achieved_share);
                    }
                    None => {
                        if !group.pids.is_empty() {
                            load.foreign_request += group.request;
                        }
                        load.foreign_memory += group.memory_used;
                        load.foreign_busy += group.achieved_share;
                    }
                }
            }
            load
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_protocol::status::{Durations, GpuReport, GroupReport};
    use std::collections::BTreeMap;

    fn group(name: &str, request: f64, memory: u64, pids: Vec<u32>) -> GroupReport {
        let achieved_share = memory as f64 / 100.0;
        GroupReport {
            name: name.into(),
            request,
            limit: 1.0,
            weight: 1.0,
            latency: false,
            effective_request: request,
            target_share: 0.0,
            achieved_share,
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
        assert_eq!(loads[1].job_busy, BTreeMap::from([(7, 0.3)]));
        assert_eq!(
            loads[1].foreign_busy, 0.2,
            "what the groups were measured using"
        );
    }
}
