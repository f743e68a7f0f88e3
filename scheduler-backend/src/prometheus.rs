//! The scheduler's report in the Prometheus text format, for its metrics endpoint
//! ([`crate::metrics`]), encoded by `prometheus-client` from a snapshot of the report.

use gpushare_protocol::status::{Durations, GpuReport, GroupReport, PhysicalMemory, Report};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::fmt;

/// The `Content-Type` of [`render`]'s page.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// The report in the Prometheus text format (`GET /metrics`), with DCGM-style `gpu` and `UUID`
/// labels, a `group` label, and for a Kubernetes container's group `namespace`, `pod` and
/// `container` (as dcgm-exporter labels them).
pub fn render(r: &Report) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(r.clone())));
    let mut out = String::new();
    prometheus_text::encode(&mut out, &registry).expect("writing to a String cannot fail");
    out
}

/// One report, encoded at a scrape.
#[derive(Debug)]
struct Snapshot(Report);

/// A sample's value: a count, or a measure.
enum Value {
    Count(u64),
    Measure(f64),
}

/// A metric of each group: name (a counter's without `_total`), type, help, value (`None`: no
/// sample for that group).
type GroupMetric = (
    &'static str,
    MetricType,
    &'static str,
    fn(&GroupReport) -> Option<Value>,
);

const GROUP_METRICS: [GroupMetric; 13] = [
    (
        "gpushare_group_request",
        MetricType::Gauge,
        "Guaranteed share of GPU time (effective).",
        |g| Some(Value::Measure(g.effective_request)),
    ),
    (
        "gpushare_group_limit",
        MetricType::Gauge,
        "Hard cap on the share of GPU time.",
        |g| Some(Value::Measure(g.limit)),
    ),
    (
        "gpushare_group_target_share",
        MetricType::Gauge,
        "Share the group is entitled to right now.",
        |g| Some(Value::Measure(g.target_share)),
    ),
    (
        "gpushare_group_share",
        MetricType::Gauge,
        "Share of GPU time achieved over the window.",
        |g| Some(Value::Measure(g.achieved_share)),
    ),
    (
        "gpushare_group_busy_seconds",
        MetricType::Counter,
        "GPU time charged to the group.",
        |g| Some(Value::Measure(g.busy_seconds)),
    ),
    (
        "gpushare_group_tokens",
        MetricType::Counter,
        "Tokens granted.",
        |g| Some(Value::Count(g.tokens)),
    ),
    (
        "gpushare_group_waits",
        MetricType::Counter,
        "Times a process of the group waited for the token.",
        |g| Some(Value::Count(g.waits)),
    ),
    (
        "gpushare_group_overruns",
        MetricType::Counter,
        "Tokens returned after their deadline.",
        |g| Some(Value::Count(g.overruns)),
    ),
    (
        "gpushare_group_preempted",
        MetricType::Counter,
        "Tokens cut short because a group owed more came back.",
        |g| Some(Value::Count(g.preempted)),
    ),
    (
        "gpushare_group_memory_used_bytes",
        MetricType::Gauge,
        "GPU memory held by the group.",
        |g| Some(Value::Count(g.memory_used)),
    ),
    (
        "gpushare_group_memory_cap_bytes",
        MetricType::Gauge,
        "GPU memory cap of the group.",
        |g| g.memory_cap.map(Value::Count),
    ),
    (
        "gpushare_group_memory_reservations",
        MetricType::Counter,
        "Memory reservations the group's processes waited for (small allocations come from their leases).",
        |g| Some(Value::Count(g.memory_reservations)),
    ),
    (
        "gpushare_group_memory_swapped_bytes",
        MetricType::Gauge,
        "Of the group's GPU memory, bytes swapped to host memory (or on their way out or in) under memory overcommit.",
        |g| Some(Value::Count(g.memory_swapped)),
    ),
];

/// Each GPU's physical books under memory overcommit (GPUs it does not check have none).
type PhysicalMetric = (&'static str, &'static str, fn(&PhysicalMemory) -> Value);

const PHYSICAL_METRICS: [PhysicalMetric; 5] = [
    (
        "gpushare_gpu_memory_total_bytes",
        "The GPU's memory, as its hooks told it.",
        |m| Value::Count(m.total),
    ),
    (
        "gpushare_gpu_memory_used_bytes",
        "GPU memory held by processes whose memory is on the GPU.",
        |m| Value::Count(m.used),
    ),
    (
        "gpushare_gpu_memory_swapped_bytes",
        "GPU memory of swapped-out processes, held in host memory.",
        |m| Value::Count(m.swapped),
    ),
    (
        "gpushare_gpu_memory_allocations_waiting",
        "Allocations within their cap waiting for memory on the GPU.",
        |m| Value::Count(m.waiting),
    ),
    (
        "gpushare_gpu_memory_overcommit_ratio",
        "How far the groups' memory caps may sum past the GPU's memory (memory_overcommit).",
        |m| Value::Measure(m.overcommit),
    ),
];

/// A GPU's labels: its index and UUID.
fn gpu_labels(i: usize, gpu: &GpuReport) -> Vec<(&'static str, String)> {
    vec![("gpu", i.to_string()), ("UUID", gpu.uuid.clone())]
}

/// A group's labels: its GPU's, its name, and its pod's if it is a Kubernetes container.
fn group_labels(i: usize, gpu: &GpuReport, g: &GroupReport) -> Vec<(&'static str, String)> {
    let mut labels = gpu_labels(i, gpu);
    labels.push(("group", g.name.clone()));
    if let Some(p) = &g.pod {
        labels.push(("namespace", p.namespace.clone()));
        labels.push(("pod", p.pod.clone()));
        labels.push(("container", p.container.clone()));
    }
    labels
}

/// A gauge or counter: its HELP and TYPE, then each of its samples (labels, value).
fn metric(
    enc: &mut DescriptorEncoder,
    (name, kind, help): (&str, MetricType, &str),
    samples: impl IntoIterator<Item = (Vec<(&'static str, String)>, Value)>,
) -> fmt::Result {
    let mut metric = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in samples {
        let mut family = metric.encode_family(&labels)?;
        match (kind, value) {
            (MetricType::Counter, Value::Count(v)) => {
                family.encode_counter::<NoLabelSet, _, u64>(&v, None)?
            }
            (MetricType::Counter, Value::Measure(v)) => {
                family.encode_counter::<NoLabelSet, _, f64>(&v, None)?
            }
            (_, Value::Count(v)) => family.encode_gauge(&v)?,
            (_, Value::Measure(v)) => family.encode_gauge(&v)?,
        }
    }
    Ok(())
}

/// Durations as a histogram.
fn histogram(enc: &mut DescriptorEncoder, name: &str, help: &str, d: &Durations) -> fmt::Result {
    let buckets: Vec<(f64, u64)> = d
        .bounds_s
        .iter()
        .copied()
        .zip(d.counts.iter().copied())
        .collect();
    enc.encode_descriptor(name, help, None, MetricType::Histogram)?
        .encode_histogram::<NoLabelSet>(d.sum_s, d.count, &buckets, None)
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let r = &self.0;
        for (name, kind, help, value) in GROUP_METRICS {
            let samples = r.gpus.iter().enumerate().flat_map(|(i, gpu)| {
                gpu.groups
                    .iter()
                    .filter_map(move |g| Some((group_labels(i, gpu, g), value(g)?)))
            });
            metric(&mut enc, (name, kind, help), samples)?;
        }
        let missing = r.unhooked.iter().filter(|u| !u.hook_loaded).count() as u64;
        metric(
            &mut enc,
            (
                "gpushare_unhooked_processes",
                MetricType::Gauge,
                "Processes using the GPU driver without gpushare's hook (ungated).",
            ),
            [(vec![], Value::Count(missing))],
        )?;
        for (name, help, value) in PHYSICAL_METRICS {
            let samples = r.gpus.iter().enumerate().filter_map(|(i, gpu)| {
                gpu.physical
                    .as_ref()
                    .map(|m| (gpu_labels(i, gpu), value(m)))
            });
            metric(&mut enc, (name, MetricType::Gauge, help), samples)?;
        }
        let c = &r.memory_swaps;
        for (name, help, v) in [
            (
                "gpushare_memory_swap_outs",
                "Swap-outs begun (a group's memory on a GPU moved to host memory).",
                c.swap_outs,
            ),
            (
                "gpushare_memory_swap_ins",
                "Restores begun (a swapped group's memory moved back to its GPU).",
                c.swap_ins,
            ),
            (
                "gpushare_memory_swap_out_bytes",
                "Device memory the swap-outs begun moved to host memory.",
                c.swap_out_bytes,
            ),
            (
                "gpushare_memory_swap_in_bytes",
                "Host memory the restores begun moved back to the device.",
                c.swap_in_bytes,
            ),
            (
                "gpushare_memory_swap_out_failures",
                "Swap-outs that failed (lock timed out, checkpoint refused).",
                c.swap_out_failures,
            ),
            (
                "gpushare_memory_swap_in_failures",
                "Restores that failed: the group's processes lost their device memory.",
                c.swap_in_failures,
            ),
            (
                "gpushare_memory_allocation_waits",
                "Allocations within their cap that did not fit the GPU and waited.",
                c.allocation_waits,
            ),
            (
                "gpushare_memory_allocations_refused",
                "Allocations within their cap refused for lack of physical memory.",
                c.allocations_refused,
            ),
        ] {
            metric(
                &mut enc,
                (name, MetricType::Counter, help),
                [(vec![], Value::Count(v))],
            )?;
        }
        for (name, help, d) in [
            (
                "gpushare_memory_swap_out_duration_seconds",
                "How long swap-outs that succeeded took, from the decision to the memory free on the GPU.",
                &c.swap_out_seconds,
            ),
            (
                "gpushare_memory_swap_in_duration_seconds",
                "How long restores that succeeded took, from the decision to the group running again.",
                &c.swap_in_seconds,
            ),
            (
                "gpushare_memory_allocation_wait_seconds",
                "How long allocations within their cap that did not fit the GPU waited, until granted or refused.",
                &c.allocation_wait_seconds,
            ),
            (
                "gpushare_event_loop_lateness_seconds",
                "How late the scheduler's event loop handled a timer, a ready socket or another thread's request, against when it was due.",
                &r.event_loop,
            ),
        ] {
            histogram(&mut enc, name, help, d)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_protocol::status::{MemoryState, MemorySwaps, PodLabels, Unhooked};

    #[test]
    fn prometheus_text() {
        let g = GroupReport {
            name: "a".into(),
            request: 0.5,
            limit: 1.0,
            weight: 1.0,
            latency: false,
            effective_request: 0.5,
            target_share: 0.5,
            achieved_share: 0.49,
            busy_seconds: 2.0,
            tokens: 3,
            waits: 4,
            overruns: 0,
            revocations: 0,
            preempted: 0,
            pids: vec![7],
            active: true,
            memory_used: 10,
            memory_cap: None,
            memory_clamped: None,
            memory_reservations: 0,
            memory_swapped: 1024,
            memory_state: MemoryState::SwappedOut,
            memory_refused: None,
            pod: None,
        };
        let mut odd = g.clone();
        odd.name = "quote\" backslash\\ newline\n".into();
        let mut p = g.clone();
        p.memory_swapped = 0;
        p.memory_state = MemoryState::Resident;
        p.name = "ns/train/main".into();
        p.pod = Some(PodLabels {
            namespace: "ns".into(),
            pod: "train".into(),
            container: "main".into(),
        });
        let r = Report {
            dev_mode: true,
            gpus: vec![
                GpuReport {
                    uuid: "GPU-x".into(),
                    holder: None,
                    waiting: vec![],
                    groups: vec![g, p, odd],
                    physical: Some(PhysicalMemory {
                        total: 2048,
                        used: 1536,
                        free: 512,
                        swapped: 1024,
                        overcommit: 1.5,
                        waiting: 1,
                    }),
                },
                GpuReport {
                    uuid: "GPU-y".into(),
                    holder: None,
                    waiting: vec![],
                    groups: vec![],
                    physical: None,
                },
            ],
            pods: vec![],
            unhooked: vec![Unhooked {
                pid: 42,
                command: "python3".into(),
                hook_loaded: false,
            }],
            event_loop: Durations {
                bounds_s: vec![0.001, 0.01],
                counts: vec![5, 1, 1],
                count: 7,
                sum_s: 0.5,
                max_s: 0.4,
            },
            memory_swaps: MemorySwaps {
                swap_outs: 3,
                swap_ins: 2,
                swap_out_bytes: 3072,
                swap_in_bytes: 2048,
                swap_out_failures: 1,
                swap_in_failures: 0,
                allocation_waits: 5,
                allocations_refused: 1,
                swap_out_seconds: Durations {
                    bounds_s: vec![0.1, 1.0],
                    counts: vec![0, 1, 1],
                    count: 2,
                    sum_s: 3.5,
                    max_s: 3.0,
                },
                swap_in_seconds: Durations {
                    bounds_s: vec![0.1, 1.0],
                    counts: vec![0, 1, 0],
                    count: 1,
                    sum_s: 0.25,
                    max_s: 0.25,
                },
                allocation_wait_seconds: Durations {
                    bounds_s: vec![0.1, 1.0],
                    counts: vec![1, 0, 4],
                    count: 5,
                    sum_s: 12.0,
                    max_s: 4.0,
                },
            },
        };
        let text = render(&r);
        assert!(text.contains("# TYPE gpushare_group_share gauge"));
        assert!(text.contains("gpushare_group_share{gpu=\"0\",UUID=\"GPU-x\",group=\"a\"} 0.49"));
        assert!(
            !text.contains("gpushare_group_memory_cap_bytes{"),
            "uncapped: no sample"
        );
        assert!(text.contains(
            "gpushare_group_share{gpu=\"0\",UUID=\"GPU-x\",group=\"ns/train/main\",namespace=\"ns\",pod=\"train\",container=\"main\"} 0.49"
        ));
        assert!(text.contains("\ngpushare_unhooked_processes 1\n"));
        // A label value is escaped as the text format defines, never cut short or rewritten.
        assert!(text.contains(
            "gpushare_group_share{gpu=\"0\",UUID=\"GPU-x\",group=\"quote\\\" backslash\\\\ newline\\n\"} 0.49\n"
        ));
        for line in [
            "# TYPE gpushare_event_loop_lateness_seconds histogram",
            "gpushare_event_loop_lateness_seconds_bucket{le=\"0.001\"} 5",
            "gpushare_event_loop_lateness_seconds_bucket{le=\"0.01\"} 6",
            "gpushare_event_loop_lateness_seconds_bucket{le=\"+Inf\"} 7",
            "gpushare_event_loop_lateness_seconds_sum 0.5",
            "gpushare_event_loop_lateness_seconds_count 7",
            // The physical books of a GPU under overcommit.
            "# TYPE gpushare_gpu_memory_total_bytes gauge",
            "gpushare_gpu_memory_total_bytes{gpu=\"0\",UUID=\"GPU-x\"} 2048",
            "gpushare_gpu_memory_used_bytes{gpu=\"0\",UUID=\"GPU-x\"} 1536",
            "# TYPE gpushare_gpu_memory_swapped_bytes gauge",
            "gpushare_gpu_memory_swapped_bytes{gpu=\"0\",UUID=\"GPU-x\"} 1024",
            "gpushare_gpu_memory_allocations_waiting{gpu=\"0\",UUID=\"GPU-x\"} 1",
            "gpushare_gpu_memory_overcommit_ratio{gpu=\"0\",UUID=\"GPU-x\"} 1.5",
            // Per group.
            "# TYPE gpushare_group_memory_swapped_bytes gauge",
            "gpushare_group_memory_swapped_bytes{gpu=\"0\",UUID=\"GPU-x\",group=\"a\"} 1024",
            "gpushare_group_memory_swapped_bytes{gpu=\"0\",UUID=\"GPU-x\",group=\"ns/train/main\",namespace=\"ns\",pod=\"train\",container=\"main\"} 0",
            // The node's counters.
            "# TYPE gpushare_memory_swap_outs_total counter",
            "gpushare_memory_swap_outs_total 3",
            "gpushare_memory_swap_ins_total 2",
            "gpushare_memory_swap_out_bytes_total 3072",
            "gpushare_memory_swap_in_bytes_total 2048",
            "gpushare_memory_swap_out_failures_total 1",
            "gpushare_memory_swap_in_failures_total 0",
            "gpushare_memory_allocation_waits_total 5",
            "gpushare_memory_allocations_refused_total 1",
            // Durations: cumulative buckets, sum and count.
            "# TYPE gpushare_memory_swap_out_duration_seconds histogram",
            "gpushare_memory_swap_out_duration_seconds_bucket{le=\"0.1\"} 0",
            "gpushare_memory_swap_out_duration_seconds_bucket{le=\"1\"} 1",
            "gpushare_memory_swap_out_duration_seconds_bucket{le=\"+Inf\"} 2",
            "gpushare_memory_swap_out_duration_seconds_sum 3.5",
            "gpushare_memory_swap_out_duration_seconds_count 2",
            "# TYPE gpushare_memory_swap_in_duration_seconds histogram",
            "gpushare_memory_swap_in_duration_seconds_bucket{le=\"1\"} 1",
            "gpushare_memory_swap_in_duration_seconds_sum 0.25",
            "gpushare_memory_swap_in_duration_seconds_count 1",
            "# TYPE gpushare_memory_allocation_wait_seconds histogram",
            "gpushare_memory_allocation_wait_seconds_bucket{le=\"0.1\"} 1",
            "gpushare_memory_allocation_wait_seconds_bucket{le=\"1\"} 1",
            "gpushare_memory_allocation_wait_seconds_bucket{le=\"+Inf\"} 5",
            "gpushare_memory_allocation_wait_seconds_sum 12.0",
            "gpushare_memory_allocation_wait_seconds_count 5",
        ] {
            assert!(text.contains(&format!("{line}\n")), "{line} in {text}");
        }
        assert!(
            !text.contains("UUID=\"GPU-y\""),
            "a GPU without overcommit (and no groups) has no physical samples: {text}"
        );
        // Every sample of a metric follows its own HELP and TYPE, once each.
        for name in [
            "gpushare_gpu_memory_swapped_bytes",
            "gpushare_memory_allocation_wait_seconds",
        ] {
            assert_eq!(
                text.matches(&format!("# TYPE {name} ")).count(),
                1,
                "{name}"
            );
        }
    }
}
