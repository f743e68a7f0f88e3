//! The manager's Prometheus metrics (`--metrics ADDR`, any path): allocatable and allocated
//! units and memory per GPU (DCGM-style `gpu` and `UUID` labels), annotation errors per pod, and kubelet
//! registrations.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Default, Clone)]
pub struct Metrics {
    /// Per GPU UUID: (index, healthy units).
    pub allocatable: BTreeMap<String, (usize, u32)>,
    /// Per GPU UUID: units the kubelet assigned to containers.
    pub allocated: BTreeMap<String, u32>,
    /// Per GPU UUID: its memory in bytes.
    pub memory: BTreeMap<String, u64>,
    /// Per (namespace, pod, annotation): invalid values seen.
    pub annotation_errors: BTreeMap<(String, String, String), u64>,
    pub registrations: u64,
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn label(v: &str) -> String {
    v.replace(['"', '\\', '\n'], "'")
}

impl Metrics {
    pub fn render(&self) -> String {
        let mut out = String::new();
        family(
            &mut out,
            "gpushare_device_manager_allocatable_units",
            "gauge",
            "Healthy gpushare.io/gpu-share units advertised to the kubelet.",
        );
        for (uuid, (i, units)) in &self.allocatable {
            let _ = writeln!(
                out,
                "gpushare_device_manager_allocatable_units{{gpu=\"{i}\",UUID=\"{}\"}} {units}",
                label(uuid)
            );
        }
        family(
            &mut out,
            "gpushare_device_manager_allocated_units",
            "gauge",
            "gpushare.io/gpu-share units the kubelet assigned to containers.",
        );
        for (uuid, (i, _)) in &self.allocatable {
            let units = self.allocated.get(uuid).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "gpushare_device_manager_allocated_units{{gpu=\"{i}\",UUID=\"{}\"}} {units}",
                label(uuid)
            );
        }
        family(
            &mut out,
            "gpushare_device_manager_gpu_memory_bytes",
            "gauge",
            "Memory of each GPU (for placement by the scheduler extender).",
        );
        for (uuid, (i, _)) in &self.allocatable {
            if let Some(bytes) = self.memory.get(uuid) {
                let _ = writeln!(
                    out,
                    "gpushare_device_manager_gpu_memory_bytes{{gpu=\"{i}\",UUID=\"{}\"}} {bytes}",
                    label(uuid)
                );
            }
        }
        family(
            &mut out,
            "gpushare_annotation_errors_total",
            "counter",
            "gpushare.io annotations that could not be used as written.",
        );
        for ((ns, pod, ann), n) in &self.annotation_errors {
            let _ = writeln!(
                out,
                "gpushare_annotation_errors_total{{namespace=\"{}\",pod=\"{}\",annotation=\"{}\"}} {n}",
                label(ns),
                label(pod),
                label(ann)
            );
        }
        family(
            &mut out,
            "gpushare_device_manager_registrations_total",
            "counter",
            "Registrations with the kubelet (one more after each kubelet restart).",
        );
        let _ = writeln!(
            out,
            "gpushare_device_manager_registrations_total {}",
            self.registrations
        );
        out
    }
}

/// Serve `render()` of the current metrics over HTTP on `listener`.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<std::sync::Mutex<Metrics>>) {
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut req = [0u8; 1024];
            let _ =
                tokio::time::timeout(std::time::Duration::from_secs(2), conn.read(&mut req)).await;
            let body = metrics.lock().unwrap_or_else(|e| e.into_inner()).render();
            let head = format!(
                "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(head.as_bytes()).await;
            let _ = conn.write_all(body.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format() {
        let mut m = Metrics::default();
        m.allocatable.insert("GPU-a".into(), (0, 100));
        m.allocated.insert("GPU-a".into(), 30);
        m.memory.insert("GPU-a".into(), 8 << 30);
        m.annotation_errors
            .insert(("ns".into(), "p".into(), "gpushare.io/gpu-limit".into()), 2);
        let t = m.render();
        assert!(
            t.contains("gpushare_device_manager_allocatable_units{gpu=\"0\",UUID=\"GPU-a\"} 100")
        );
        assert!(t.contains("gpushare_device_manager_allocated_units{gpu=\"0\",UUID=\"GPU-a\"} 30"));
        assert!(t.contains(
            "gpushare_device_manager_gpu_memory_bytes{gpu=\"0\",UUID=\"GPU-a\"} 8589934592"
        ));
        assert!(t.contains(
            "gpushare_annotation_errors_total{namespace=\"ns\",pod=\"p\",annotation=\"gpushare.io/gpu-limit\"} 2"
        ));
        assert!(t.contains("# TYPE gpushare_annotation_errors_total counter"));
    }
}
