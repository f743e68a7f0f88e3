//! What a node's gpushare reports, read from its Prometheus series: per GPU its memory and
//! units (the device manager's `gpushare_device_manager_gpu_memory_bytes`,
//! `_allocatable_units`, `_allocated_units`), per pod on a GPU the memory it holds and its cap
//! (the scheduler's `gpushare_group_memory_used_bytes` / `_cap_bytes` with `namespace` and
//! `pod` labels). The same series come from the nodes' endpoints (text format, parsed with
//! `prometheus-parse`) or from a Prometheus server's query API.

use std::collections::BTreeMap;

pub const GPU_MEMORY: &str = "gpushare_device_manager_gpu_memory_bytes";
pub const ALLOCATABLE: &str = "gpushare_device_manager_allocatable_units";
pub const ALLOCATED: &str = "gpushare_device_manager_allocated_units";
pub const POD_USED: &str = "gpushare_group_memory_used_bytes";
pub const POD_CAP: &str = "gpushare_group_memory_cap_bytes";

/// The series the extender reads (a Prometheus selector for them: [`selector`]).
pub const SERIES: [&str; 5] = [GPU_MEMORY, ALLOCATABLE, ALLOCATED, POD_USED, POD_CAP];

/// One GPU of a node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuReport {
    pub memory: u64,
    /// Healthy units advertised to the kubelet (0: the GPU is unhealthy).
    pub units: u32,
    /// Units the kubelet assigned to containers.
    pub allocated: u32,
}

/// One pod's use of one GPU (its containers summed).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodUse {
    pub used: u64,
    pub cap: Option<u64>,
}

/// A node's report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeReport {
    /// By GPU UUID.
    pub gpus: BTreeMap<String, GpuReport>,
    /// By (GPU UUID, namespace, pod).
    pub pods: BTreeMap<(String, String, String), PodUse>,
}

impl NodeReport {
    /// Take in one sample (others than [`SERIES`] are ignored).
    pub fn add(&mut self, metric: &str, label: &dyn Fn(&str) -> Option<String>, value: f64) {
        if !value.is_finite() || value < 0.0 {
            return;
        }
        let Some(uuid) = label("UUID") else {
            return;
        };
        match metric {
            GPU_MEMORY => self.gpus.entry(uuid).or_default().memory = value as u64,
            ALLOCATABLE => self.gpus.entry(uuid).or_default().units = value as u32,
            ALLOCATED => self.gpus.entry(uuid).or_default().allocated = value as u32,
            POD_USED | POD_CAP => {
                let (Some(ns), Some(pod)) = (label("namespace"), label("pod")) else {
                    return;
                };
                let e = self.pods.entry((uuid, ns, pod)).or_default();
                if metric == POD_USED {
                    e.used += value as u64;
                } else {
                    *e.cap.get_or_insert(0) += value as u64;
                }
            }
            _ => {}
        }
    }

    /// Merge another endpoint's report of the same node.
    pub fn merge(&mut self, other: NodeReport) {
        for (uuid, g) in other.gpus {
            let e = self.gpus.entry(uuid).or_default();
            e.memory = e.memory.max(g.memory);
            e.units = e.units.max(g.units);
            e.allocated = e.allocated.max(g.allocated);
        }
        for (k, p) in other.pods {
            let e = self.pods.entry(k).or_default();
            e.used += p.used;
            if let Some(c) = p.cap {
                *e.cap.get_or_insert(0) += c;
            }
        }
    }

    /// Whether it tells what the extender needs: each GPU's memory and units.
    pub fn check(&self) -> Result<(), String> {
        if self.gpus.is_empty() {
            return Err(format!(
                "no GPU in its metrics ({ALLOCATABLE} missing: is gpushare-device-manager running with --metrics?)"
            ));
        }
        if let Some((uuid, _)) = self.gpus.iter().find(|(_, g)| g.memory == 0) {
            return Err(format!(
                "GPU {uuid} has no memory size in its metrics ({GPU_MEMORY} missing)"
            ));
        }
        Ok(())
    }
}

/// A node's report from the text format of its endpoints' pages.
pub fn parse_text(text: &str) -> Result<NodeReport, String> {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines)
        .map_err(|e| format!("not Prometheus text format: {e}"))?;
    let mut r = NodeReport::default();
    for s in &scrape.samples {
        let value = match s.value {
            prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => continue,
        };
        let label = |k: &str| s.labels.get(k).map(str::to_string);
        r.add(&s.metric, &label, value);
    }
    Ok(r)
}

/// A Prometheus selector for every series the extender reads, and Prometheus' own `up` of
/// each target (a node whose endpoint Prometheus cannot scrape is unreadable, not empty).
pub fn selector() -> String {
    format!("{{__name__=~\"{}|up\"}}", SERIES.join("|"))
}

/// Per node (the `node_label` of each series), the reports in a Prometheus instant-query
/// answer (`/api/v1/query`), or why the node cannot be read: a target of the job that exports
/// its gpushare series is down (`up` 0). The pod's `namespace` and `pod` are read from
/// `exported_namespace` / `exported_pod` where Prometheus renamed them (a scrape config that
/// labels each target with the scraped pod's own namespace and name, as the usual Kubernetes
/// ones do).
pub fn parse_prometheus(
    body: &str,
    node_label: &str,
) -> Result<BTreeMap<String, Result<NodeReport, String>>, String> {
    let v: serde_json::Value =
        serde_json::from_str(body).map_err(|e| format!("Prometheus answered no JSON: {e}"))?;
    if v["status"] != "success" {
        return Err(format!(
            "Prometheus answered {}: {}",
            v["status"],
            v["error"].as_str().unwrap_or("no reason given")
        ));
    }
    let results = v["data"]["result"]
        .as_array()
        .ok_or("Prometheus answered no result vector")?;
    let mut out: BTreeMap<String, NodeReport> = BTreeMap::new();
    // Jobs that export gpushare series, and the targets down: (node, job, instance).
    let mut jobs: std::collections::BTreeSet<&str> = Default::default();
    let mut down: Vec<(&str, &str, &str)> = Vec::new();
    for r in results {
        let m = &r["metric"];
        let (Some(name), Some(node)) = (m["__name__"].as_str(), m[node_label].as_str()) else {
            continue;
        };
        let Some(value) = r["value"][1]
            .as_str()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|v| v.is_finite())
        else {
            continue;
        };
        let job = m["job"].as_str().unwrap_or("");
        if name == "up" {
            if value == 0.0 {
                down.push((node, job, m["instance"].as_str().unwrap_or("?")));
            }
            continue;
        }
        jobs.insert(job);
        let label = |k: &str| {
            let exported = match k {
                "namespace" | "pod" => m[format!("exported_{k}")].as_str(),
                _ => None,
            };
            exported.or(m[k].as_str()).map(str::to_string)
        };
        out.entry(node.to_string())
            .or_default()
            .add(name, &label, value);
    }
    let mut out: BTreeMap<String, Result<NodeReport, String>> =
        out.into_iter().map(|(n, r)| (n, Ok(r))).collect();
    for (node, job, instance) in down {
        if jobs.contains(job) {
            out.insert(
                node.to_string(),
                Err(format!(
                    "Prometheus cannot scrape {instance} (job {job}: up is 0)"
                )),
            );
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DM: &str = "# HELP gpushare_device_manager_allocatable_units Healthy units.\n\
# TYPE gpushare_device_manager_allocatable_units gauge\n\
gpushare_device_manager_allocatable_units{gpu=\"0\",UUID=\"GPU-a\"} 100\n\
gpushare_device_manager_allocatable_units{gpu=\"1\",UUID=\"GPU-b\"} 100\n\
# TYPE gpushare_device_manager_allocated_units gauge\n\
gpushare_device_manager_allocated_units{gpu=\"0\",UUID=\"GPU-a\"} 30\n\
# TYPE gpushare_device_manager_gpu_memory_bytes gauge\n\
gpushare_device_manager_gpu_memory_bytes{gpu=\"0\",UUID=\"GPU-a\"} 8589934592\n\
gpushare_device_manager_gpu_memory_bytes{gpu=\"1\",UUID=\"GPU-b\"} 8589934592\n";

    const SCHED: &str = "# TYPE gpushare_group_memory_used_bytes gauge\n\
gpushare_group_memory_used_bytes{gpu=\"0\",UUID=\"GPU-a\",group=\"default/p/main\",namespace=\"default\",pod=\"p\",container=\"main\"} 1000\n\
gpushare_group_memory_used_bytes{gpu=\"0\",UUID=\"GPU-a\",group=\"default/p/side\",namespace=\"default\",pod=\"p\",container=\"side\"} 24\n\
gpushare_group_memory_used_bytes{gpu=\"0\",UUID=\"GPU-a\",group=\"batch\"} 5000\n\
# TYPE gpushare_group_memory_cap_bytes gauge\n\
gpushare_group_memory_cap_bytes{gpu=\"0\",UUID=\"GPU-a\",group=\"default/p/main\",namespace=\"default\",pod=\"p\",container=\"main\"} 4096\n";

    #[test]
    fn a_nodes_two_pages_make_its_report() {
        let mut r = parse_text(DM).unwrap();
        r.merge(parse_text(SCHED).unwrap());
        r.check().unwrap();
        assert_eq!(
            r.gpus["GPU-a"],
            GpuReport {
                memory: 8 << 30,
                units: 100,
                allocated: 30
            }
        );
        assert_eq!(r.gpus["GPU-b"].allocated, 0);
        let p = &r.pods[&("GPU-a".into(), "default".into(), "p".into())];
        assert_eq!(p.used, 1024);
        assert_eq!(p.cap, Some(4096));
        assert_eq!(r.pods.len(), 1, "groups outside pods are not pods");
    }

    #[test]
    fn a_report_without_what_placement_needs_says_so() {
        let e = parse_text(SCHED).unwrap().check().unwrap_err();
        assert!(e.contains("gpushare-device-manager"), "{e}");
        let no_memory = DM
            .lines()
            .filter(|l| !l.contains("memory"))
            .collect::<Vec<_>>()
            .join("\n");
        let e = parse_text(&no_memory).unwrap().check().unwrap_err();
        assert!(e.contains(GPU_MEMORY), "{e}");
        assert_eq!(parse_text("").unwrap(), NodeReport::default());
    }

    #[test]
    fn prometheus_answers_are_split_by_node() {
        let body = serde_json::json!({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"__name__": ALLOCATABLE, "UUID": "GPU-a", "node": "n1"}, "value": [1.0, "100"]},
            {"metric": {"__name__": GPU_MEMORY, "UUID": "GPU-a", "node": "n1"}, "value": [1.0, "1024"]},
            {"metric": {"__name__": POD_USED, "UUID": "GPU-c", "node": "n2", "namespace": "x", "pod": "y"}, "value": [1.0, "7"]},
            {"metric": {"__name__": ALLOCATABLE, "UUID": "GPU-z"}, "value": [1.0, "100"]},
            {"metric": {"__name__": ALLOCATABLE, "UUID": "GPU-q", "node": "n3"}, "value": [1.0, "NaN"]}
        ]}})
        .to_string();
        let r = parse_prometheus(&body, "node").unwrap();
        assert_eq!(r["n1"].as_ref().unwrap().gpus["GPU-a"].memory, 1024);
        assert_eq!(r["n2"].as_ref().unwrap().pods.len(), 1);
        assert!(!r.contains_key("n3"), "a NaN sample is no sample");
        assert_eq!(r.len(), 2);
        let e = parse_prometheus(r#"{"status":"error","error":"bad query"}"#, "node").unwrap_err();
        assert!(e.contains("bad query"), "{e}");
        assert!(parse_prometheus("<html>", "node").is_err());
        assert!(selector().contains(POD_CAP));
    }

    #[test]
    fn prometheus_target_labels_and_down_targets() {
        let body = serde_json::json!({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"__name__": ALLOCATABLE, "UUID": "GPU-a", "node": "n1", "job": "gpushare"}, "value": [1.0, "100"]},
            {"metric": {"__name__": GPU_MEMORY, "UUID": "GPU-a", "node": "n1", "job": "gpushare"}, "value": [1.0, "1024"]},
            {"metric": {"__name__": POD_USED, "UUID": "GPU-a", "node": "n1", "job": "gpushare",
                "namespace": "gpushare-system", "pod": "gpushare-node-x",
                "exported_namespace": "team", "exported_pod": "p"}, "value": [1.0, "7"]},
            {"metric": {"__name__": "up", "node": "n1", "job": "gpushare", "instance": "a:1"}, "value": [1.0, "1"]},
            {"metric": {"__name__": ALLOCATABLE, "UUID": "GPU-b", "node": "n2", "job": "gpushare"}, "value": [1.0, "100"]},
            {"metric": {"__name__": "up", "node": "n2", "job": "gpushare", "instance": "b:2"}, "value": [1.0, "0"]},
            {"metric": {"__name__": "up", "node": "n3", "job": "node-exporter", "instance": "c:3"}, "value": [1.0, "0"]}
        ]}})
        .to_string();
        let r = parse_prometheus(&body, "node").unwrap();
        let n1 = r["n1"].as_ref().unwrap();
        assert_eq!(
            n1.pods[&("GPU-a".into(), "team".into(), "p".into())].used,
            7,
            "the tenant's own namespace and pod, not the scraped pod's"
        );
        let e = r["n2"].as_ref().unwrap_err();
        assert!(e.contains("b:2") && e.contains("up is 0"), "{e}");
        assert!(
            !r.contains_key("n3"),
            "another job's targets are not gpushare's"
        );
    }
}
