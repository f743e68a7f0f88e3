//! What `gpushare status` shows: built by the daemon, sent as JSON, rendered by the CLI.

use serde::{Deserialize, Serialize};
use std::fmt::Write;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Report {
    pub dev_mode: bool,
    pub gpus: Vec<GpuReport>,
    /// Kubernetes containers the node agent registered (empty without one).
    #[serde(default)]
    pub pods: Vec<PodReport>,
    /// Processes of the node that use the GPU driver without a connection here: ungated.
    #[serde(default)]
    pub unhooked: Vec<crate::census::Unhooked>,
}

/// A Kubernetes container known to the scheduler through the admin socket.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PodReport {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub pod_uid: String,
    pub container_id: Option<String>,
    /// Its scheduler group.
    pub group: String,
    pub gpus: Vec<String>,
    pub request: f64,
    pub limit: f64,
    pub weight: f64,
    pub memory: Option<u64>,
    /// Removed from the node; the group lives until its last process disconnects.
    pub removed: bool,
}

/// `namespace`, `pod`, `container` of a group that is a Kubernetes container.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PodLabels {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GpuReport {
    /// `GPU-xxxxxxxx-xxxx-…`, as nvidia-smi prints it.
    pub uuid: String,
    pub holder: Option<ClientReport>,
    pub waiting: Vec<ClientReport>,
    pub groups: Vec<GroupReport>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClientReport {
    pub pid: u32,
    pub group: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GroupReport {
    pub name: String,
    pub request: f64,
    pub limit: f64,
    pub weight: f64,
    pub effective_request: f64,
    pub target_share: f64,
    pub achieved_share: f64,
    pub busy_seconds: f64,
    pub tokens: u64,
    pub waits: u64,
    pub overruns: u64,
    pub revocations: u64,
    /// Tokens cut short for a returning group owed more.
    #[serde(default)]
    pub preempted: u64,
    pub pids: Vec<u32>,
    pub active: bool,
    /// GPU memory the group's processes hold on this GPU, and its cap (`None`: uncapped).
    pub memory_used: u64,
    pub memory_cap: Option<u64>,
    /// Memory reservations (round trips) its processes asked for on this GPU since the daemon
    /// started, granted or not.
    #[serde(default)]
    pub memory_reservations: u64,
    /// Set when the group is a Kubernetes container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodLabels>,
}

pub use gpushare_protocol::admin::gpu_uuid_string as uuid_string;

/// The human-readable table of `gpushare status`.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    if r.gpus.is_empty() {
        out.push_str("no GPU has been used through gpushare yet\n");
    }
    for g in &r.gpus {
        let holder = g
            .holder
            .as_ref()
            .map_or("-".to_string(), |c| format!("pid {} ({})", c.pid, c.group));
        let waiting: Vec<String> = g
            .waiting
            .iter()
            .map(|c| format!("{} ({})", c.pid, c.group))
            .collect();
        let _ = writeln!(
            out,
            "{}  holder: {holder}  waiting: {}",
            g.uuid,
            if waiting.is_empty() {
                "-".into()
            } else {
                waiting.join(", ")
            }
        );
        let _ = writeln!(
            out,
            "  {:<16} {:>7} {:>6} {:>6} {:>7} {:>8} {:>9} {:>7} {:>6} {:>8} {:>9} {:>17}  pids",
            "GROUP",
            "REQUEST",
            "LIMIT",
            "WEIGHT",
            "TARGET",
            "ACHIEVED",
            "BUSY(s)",
            "TOKENS",
            "WAITS",
            "OVERRUNS",
            "PREEMPTED",
            "MEMORY(MiB)"
        );
        for x in &g.groups {
            let pids: Vec<String> = x.pids.iter().map(u32::to_string).collect();
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            let memory = match x.memory_cap {
                Some(cap) => format!("{:.0}/{:.0}", mib(x.memory_used), mib(cap)),
                None => format!("{:.0}", mib(x.memory_used)),
            };
            let _ = writeln!(
                out,
                "  {:<16} {:>7.2} {:>6.2} {:>6.2} {:>7.3} {:>8.3} {:>9.3} {:>7} {:>6} {:>8} {:>9} {:>17}  {}",
                x.name,
                x.effective_request,
                x.limit,
                x.weight,
                x.target_share,
                x.achieved_share,
                x.busy_seconds,
                x.tokens,
                x.waits,
                x.overruns,
                x.preempted,
                memory,
                pids.join(",")
            );
        }
    }
    if !r.pods.is_empty() {
        render_pods(&mut out, &r.pods);
    }
    render_unhooked(&mut out, &r.unhooked);
    out
}

/// The warning about GPU processes without the hook's connection.
fn render_unhooked(out: &mut String, unhooked: &[crate::census::Unhooked]) {
    let (loaded, missing): (Vec<_>, Vec<_>) = unhooked.iter().partition(|u| u.hook_loaded);
    let list = |v: &[&crate::census::Unhooked]| {
        v.iter()
            .map(|u| format!("{} ({})", u.pid, u.command))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !missing.is_empty() {
        let _ = writeln!(
            out,
            "\nWARNING: these processes use the GPU driver WITHOUT gpushare's hook (ungated, uncapped): {}\n  Run them with `gpushare run`, or check that LD_PRELOAD names libgpushare.so and that their glibc is 2.34 or newer.",
            list(&missing)
        );
    }
    if !loaded.is_empty() {
        let _ = writeln!(
            out,
            "\nNot connected yet (the hook connects at the first launch or allocation; refused processes stay here): {}",
            list(&loaded)
        );
    }
}

/// The Kubernetes section of `gpushare status`: every container the node agent registered.
fn render_pods(out: &mut String, pods: &[PodReport]) {
    let _ = writeln!(
        out,
        "\nKubernetes containers:\n  {:<20} {:<28} {:<16} {:>7} {:>6} {:>6} {:>11}  {:<8}  GPU",
        "NAMESPACE", "POD", "CONTAINER", "REQUEST", "LIMIT", "WEIGHT", "MEMORY(MiB)", "STATE"
    );
    for p in pods {
        let memory = p.memory.map_or("-".to_string(), |m| {
            format!("{:.0}", m as f64 / (1u64 << 20) as f64)
        });
        let state = if p.removed {
            "removed"
        } else if p.container_id.is_some() {
            "running"
        } else {
            "starting"
        };
        let _ = writeln!(
            out,
            "  {:<20} {:<28} {:<16} {:>7.2} {:>6.2} {:>6.2} {:>11}  {:<8}  {}",
            p.namespace,
            p.pod,
            p.container,
            p.request,
            p.limit,
            p.weight,
            memory,
            state,
            p.gpus.join(",")
        );
    }
}

/// The report in Prometheus text format (`GET /metrics`), with DCGM-style `gpu` and `UUID`
/// labels, a `group` label, and for a Kubernetes container's group `namespace`, `pod` and
/// `container` (as dcgm-exporter labels them).
pub fn prometheus(r: &Report) -> String {
    type Metric = (
        &'static str,
        &'static str,
        &'static str,
        fn(&GroupReport) -> Option<f64>,
    );
    let metrics: [Metric; 12] = [
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
    out
}

/// A Prometheus label value: quotes and backslashes cannot break out of it.
fn label(v: &str) -> String {
    v.replace(['"', '\\'], "'")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::census::Unhooked;

    #[test]
    fn prometheus_text() {
        let g = GroupReport {
            name: "a".into(),
            request: 0.5,
            limit: 1.0,
            weight: 1.0,
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
            memory_reservations: 0,
            pod: None,
        };
        let mut p = g.clone();
        p.name = "ns/train/main".into();
        p.pod = Some(PodLabels {
            namespace: "ns".into(),
            pod: "train".into(),
            container: "main".into(),
        });
        let r = Report {
            dev_mode: true,
            gpus: vec![GpuReport {
                uuid: "GPU-x".into(),
                holder: None,
                waiting: vec![],
                groups: vec![g, p],
            }],
            pods: vec![],
            unhooked: vec![Unhooked {
                pid: 42,
                command: "python3".into(),
                hook_loaded: false,
            }],
        };
        let text = prometheus(&r);
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
        let table = render(&r);
        assert!(
            table.contains("WITHOUT gpushare's hook (ungated, uncapped): 42 (python3)"),
            "{table}"
        );
    }

    #[test]
    fn uuid_format() {
        let u = *b"gpushare-sim-gpu";
        assert_eq!(uuid_string(&u), "GPU-67707573-6861-7265-2d73-696d2d677075");
    }
}
