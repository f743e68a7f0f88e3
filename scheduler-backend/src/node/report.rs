//! The report (`gpushare status`, the metrics, the admin socket's `Usage`): built from the
//! node's state on the event loop, published for the other threads.

use super::{Effect, Node, STATUS_REUSE_NS};
use gpushare_policy::{ClientId, GroupClass};
use gpushare_protocol::admin::GpuUsage;
use gpushare_protocol::status::{
    ClientReport, Durations, GpuReport, GroupReport, MemorySwaps, PodLabels, Report, uuid_string,
};
use std::sync::Arc;

/// The report of a node that has seen nothing.
pub(super) fn empty() -> Report {
    Report {
        dev_mode: false,
        gpus: Vec::new(),
        pods: Vec::new(),
        unhooked: Vec::new(),
        event_loop: Durations::default(),
        memory_swaps: MemorySwaps::default(),
    }
}

/// Per GPU: the groups' achieved shares and memory, summed (the admin socket's `Usage`).
pub fn usage(r: &Report) -> Vec<GpuUsage> {
    r.gpus
        .iter()
        .map(|g| GpuUsage {
            gpu: g.uuid.clone(),
            busy: g
                .groups
                .iter()
                .map(|x| x.achieved_share)
                .sum::<f64>()
                .min(1.0),
            memory_used: g.groups.iter().map(|x| x.memory_used).sum(),
        })
        .collect()
}

impl Node {
    /// Build the report and publish it.
    pub(super) fn publish(&mut self, now: u64) {
        let report = Arc::new(self.build_report(now));
        self.report = (now, report.clone());
        self.report_stale = false;
        self.effects.push(Effect::Publish(report));
    }

    /// The report for a client that asks: the last one if only questions came since it was
    /// built and it is recent enough ([`STATUS_REUSE_NS`]), else a new one (published too).
    pub(super) fn fresh_report(&mut self, now: u64) -> Report {
        if self.report_stale || now.saturating_sub(self.report.0) >= STATUS_REUSE_NS {
            self.publish(now);
        }
        Report::clone(&self.report.1)
    }

    /// The latest report built.
    pub fn latest_report(&self) -> &Report {
        &self.report.1
    }

    /// `namespace`, `pod`, `container` of a Kubernetes container's group.
    fn pod_labels(&self, group: &str) -> Option<PodLabels> {
        let (namespace, pod, container) = self.pods.labels(group)?;
        Some(PodLabels {
            namespace: namespace.into(),
            pod: pod.into(),
            container: container.into(),
        })
    }

    fn build_report(&self, now: u64) -> Report {
        let client = |id: &ClientId| {
            self.clients.get(*id).map(|c| ClientReport {
                pid: c.pid,
                group: c.group.clone().unwrap_or_default(),
            })
        };
        let gpus = (self.policies.iter())
            .map(|(uuid, p)| {
                let s = p.status(now);
                GpuReport {
                    uuid: uuid_string(uuid),
                    holder: s.holder.as_ref().and_then(client),
                    waiting: s.waiting.iter().filter_map(client).collect(),
                    groups: (s.groups.iter())
                        .map(|g| GroupReport {
                            name: g.name.clone(),
                            request: g.params.request,
                            limit: g.params.limit,
                            weight: g.params.weight,
                            latency: g.params.class == GroupClass::Latency,
                            effective_request: g.effective_request,
                            target_share: g.target_share,
                            // Clamp float noise (and a negative zero) from the usage window.
                            achieved_share: if g.achieved_share > 0.0 {
                                g.achieved_share
                            } else {
                                0.0
                            },
                            busy_seconds: g.busy_ns as f64 / 1e9,
                            tokens: g.tokens,
                            waits: g.waits,
                            overruns: g.overruns,
                            revocations: g.revocations,
                            preempted: g.preempted,
                            pids: (g.clients.iter())
                                .filter_map(|c| self.clients.get(*c).map(|c| c.pid))
                                .collect(),
                            active: g.active,
                            memory_used: self.memory.used(&g.name, uuid),
                            memory_cap: self.memory.cap(&g.name, uuid),
                            memory_clamped: (self.memory.clamped(&g.name, uuid))
                                .map(|(asked, _)| asked),
                            memory_reservations: self.memory.reservations(&g.name, uuid),
                            memory_swapped: self.overcommit.swapped(&g.name, uuid),
                            memory_state: self.overcommit.memory_state(&g.name),
                            memory_refused: self.overcommit.refusals.get(&g.name).cloned(),
                            pod: self.pod_labels(&g.name),
                        })
                        .collect(),
                    physical: self.overcommit.physical(uuid),
                }
            })
            .collect();
        Report {
            dev_mode: self.dev,
            gpus,
            pods: self.pods.report(),
            unhooked: self.unhooked.clone(),
            event_loop: self.latency.report(),
            memory_swaps: self.overcommit.swaps_report(),
        }
    }
}
