//! The scheduler's report in Prometheus text format, for its metrics endpoint
//! ([`crate::metrics`]).

use gpushare_protocol::status::{Durations, GpuReport, GroupReport, PhysicalMemory, Report};
use std::fmt::Write;

/// The report in Prometheus text format (`GET /metrics`), with DCGM-style `gpu` and `UUID`
/// labels, a `group` label, and for a Kubernetes container's group `namespace`, `pod` and
/// `container` (as dcgm-exporter labels them).
pub fn render(r: &Report) -> String {
    type Metric = (
        &'static str,
        &'static str,
        &'static str,
        fn(&GroupReport) -> Option<f64>,
    );
    let metrics: [Metric; 13] = [
        (
            "gpushare_group_request",
            "gauge",
            "Guaranteed share of GPU time (effective).",
            |g| Some(g.effective_request),
        ),
        (
            "gpushare_group_limit",
            "gauge",
            "Hard cap on the share of GPU time.",
            |g| Some(g.limit),
        ),
        (
            "gpushare_group_target_share",
            "gauge",
            "Share the group is entitled to right now.",
            |g| Some(g.target_share),
        ),
        (
            "gpushare_group_share",
            "gauge",
            "Share of GPU time achieved over the window.",
            |g| Some(g.achieved_share),
        ),
        (
            "gpushare_group_busy_seconds_total",
            "counter",
            "GPU time charged to the group.",
            |g| Some(g.busy_seconds),
        ),
        (
            "gpushare_group_tokens_total",
            "counter",
            "Tokens granted.",
            |g| Some(g.tokens as f64),
        ),
        (
            "gpushare_group_waits_total",
            "counter",
            "Times a process of the group waited for the token.",
            |g| Some(g.waits as f64),
        ),
        (
            "gpushare_group_overruns_total",
            "counter",
            "Tokens returned after their deadline.",
            |g| Some(g.overruns as f64),
        ),
        (
            "gpushare_group_preempted_total",
            "counter",
            "Tokens cut short because a group owed more came back.",
            |g| Some(g.preempted as f64),
        ),
        (
            "gpushare_group_memory_used_bytes",
            "gauge",
            "GPU memory held by the group.",
            |g| Some(g.memory_used as f64),
        ),
        (
            "gpushare_group_memory_cap_bytes",
            "gauge",
            "GPU memory cap of the group.",
            |g| g.memory_cap.map(|c| c as f64),
        ),
        (
            "gpushare_group_memory_reservations_total",
            "counter",
            "Memory reservations the group's processes waited for (small allocations come from their leases).",
            |g| Some(g.memory_reservations as f64),
        ),
        (
            "gpushare_group_memory_swapped_bytes",
            "gauge",
            "Of the group's GPU memory, bytes swapped to host memory (or on their way out or in) under memory overcommit.",
            |g| Some(g.memory_swapped as f64),
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in metrics {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (i, gpu) in r.gpus.iter().enumerate() {
            for g in &gpu.groups {
                if let Some(v) = value(g) {
                    let pod = g.pod.as_ref().map_or(String::new(), |p| {
                        format!(
                            ",namespace=\"{}\",pod=\"{}\",container=\"{}\"",
                            label(&p.namespace),
                            label(&p.pod),
                            label(&p.container)
                        )
                    });
                    let _ = writeln!(
                        out,
                        "{name}{{gpu=\"{i}\",UUID=\"{}\",group=\"{}\"{pod}}} {v}",
                        gpu.uuid,
                        label(&g.name)
                    );
                }
            }
        }
    }
    let missing = r.unhooked.iter().filter(|u| !u.hook_loaded).count();
    let _ = writeln!(
        out,
        "# HELP gpushare_unhooked_processes Processes using the GPU driver without gpushare's hook (ungated).\n# TYPE gpushare_unhooked_processes gauge\ngpushare_unhooked_processes {missing}"
    );
    physical(&mut out, &r.gpus);
    swaps(&mut out, r);
    histogram(
        &mut out,
        "gpushare_event_loop_lateness_seconds",
        "How late the scheduler's event loop handled a timer, a ready socket or another thread's request, against when it was due.",
        &r.event_loop,
    );
    out
}

/// Each GPU's physical books under memory overcommit (GPUs it does not check have none).
fn physical(out: &mut String, gpus: &[GpuReport]) {
    type Metric = (&'static str, &'static str, fn(&PhysicalMemory) -> f64);
    let metrics: [Metric; 5] = [
        (
            "gpushare_gpu_memory_total_bytes",
            "The GPU's memory, as its hooks told it.",
            |m| m.total as f64,
        ),
        (
            "gpushare_gpu_memory_used_bytes",
            "GPU memory held by processes whose memory is on the GPU.",
            |m| m.used as f64,
        ),
        (
            "gpushare_gpu_memory_swapped_bytes",
            "GPU memory of swapped-out processes, held in host memory.",
            |m| m.swapped as f64,
        ),
        (
            "gpushare_gpu_memory_allocations_waiting",
            "Allocations within their cap waiting for memory on the GPU.",
            |m| m.waiting as f64,
        ),
        (
            "gpushare_gpu_memory_overcommit_ratio",
            "How far the groups' memory caps may sum past the GPU's memory (memory_overcommit).",
            |m| m.overcommit,
        ),
    ];
    for (name, help, value) in metrics {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (i, gpu) in gpus.iter().enumerate() {
            if let Some(m) = &gpu.physical {
                let _ = writeln!(
                    out,
                    "{name}{{gpu=\"{i}\",UUID=\"{}\"}} {}",
                    gpu.uuid,
                    value(m)
                );
            }
        }
    }
}

/// Memory overcommit's swaps, waits and refusals on the node.
fn swaps(out: &mut String, r: &Report) {
    let c = &r.memory_swaps;
    for (name, help, v) in [
        (
            "gpushare_memory_swap_outs_total",
            "Swap-outs begun (a group's memory on a GPU moved to host memory).",
            c.swap_outs,
        ),
        (
            "gpushare_memory_swap_ins_total",
            "Restores begun (a swapped group's memory moved back to its GPU).",
            c.swap_ins,
        ),
        (
            "gpushare_memory_swap_out_bytes_total",
            "Device memory the swap-outs begun moved to host memory.",
            c.swap_out_bytes,
        ),
        (
            "gpushare_memory_swap_in_bytes_total",
            "Host memory the restores begun moved back to the device.",
            c.swap_in_bytes,
        ),
        (
            "gpushare_memory_swap_out_failures_total",
            "Swap-outs that failed (lock timed out, checkpoint refused).",
            c.swap_out_failures,
        ),
        (
            "gpushare_memory_swap_in_failures_total",
            "Restores that failed: the group's processes lost their device memory.",
            c.swap_in_failures,
        ),
        (
            "gpushare_memory_allocation_waits_total",
            "Allocations within their cap that did not fit the GPU and waited.",
            c.allocation_waits,
        ),
        (
            "gpushare_memory_allocations_refused_total",
            "Allocations within their cap refused for lack of physical memory.",
            c.allocations_refused,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
        );
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
    ] {
        histogram(out, name, help, d);
    }
}

/// Durations as a Prometheus histogram (cumulative buckets).
fn histogram(out: &mut String, name: &str, help: &str, l: &Durations) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    let mut below = 0;
    for (bound, n) in l.bounds_s.iter().zip(&l.counts) {
        below += n;
        let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {below}");
    }
    let _ = writeln!(
        out,
        "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
        l.count, l.sum_s, l.count
    );
}

/// A Prometheus label value: quotes and backslashes cannot break out of it.
fn label(v: &str) -> String {
    v.replace(['"', '\\'], "'")
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
                    groups: vec![g, p],
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
            "gpushare_memory_allocation_wait_seconds_sum 12",
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
