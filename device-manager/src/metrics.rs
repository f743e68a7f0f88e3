//! The manager's Prometheus metrics (`--metrics ADDR`, any path): allocatable and allocated
//! units and memory per GPU (DCGM-style `gpu` and `UUID` labels), annotation errors per pod, and kubelet
//! registrations; served by axum, encoded by `prometheus-client`.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

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

impl Metrics {
    /// The metrics in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(self.clone()));
        let mut out = String::new();
        prometheus_text::encode(&mut out, &registry).expect("writing to a String cannot fail");
        out
    }

    /// Each GPU's labels with `value(uuid, units)` (`None`: no sample for that GPU).
    fn per_gpu(
        &self,
        value: impl Fn(&str, u32) -> Option<u64>,
    ) -> Vec<([(&'static str, String); 2], u64)> {
        (self.allocatable.iter())
            .filter_map(|(uuid, &(i, units))| {
                let v = value(uuid, units)?;
                Some(([("gpu", i.to_string()), ("UUID", uuid.clone())], v))
            })
            .collect()
    }
}

impl Collector for Metrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        for (name, help, samples) in [
            (
                "gpushare_device_manager_allocatable_units",
                "Healthy gpushare.io/gpu-share units advertised to the kubelet.",
                self.per_gpu(|_, units| Some(u64::from(units))),
            ),
            (
                "gpushare_device_manager_allocated_units",
                "gpushare.io/gpu-share units the kubelet assigned to containers.",
                self.per_gpu(|uuid, _| {
                    Some(u64::from(self.allocated.get(uuid).copied().unwrap_or(0)))
                }),
            ),
            (
                "gpushare_device_manager_gpu_memory_bytes",
                "Memory of each GPU (for placement by the scheduler extender).",
                self.per_gpu(|uuid, _| self.memory.get(uuid).copied()),
            ),
        ] {
            let mut metric = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (labels, v) in samples {
                metric.encode_family(&labels)?.encode_gauge(&v)?;
            }
        }
        let mut errors = enc.encode_descriptor(
            "gpushare_annotation_errors",
            "gpushare.io annotations that could not be used as written.",
            None,
            MetricType::Counter,
        )?;
        for ((ns, pod, annotation), n) in &self.annotation_errors {
            let labels = [
                ("namespace", ns.as_str()),
                ("pod", pod.as_str()),
                ("annotation", annotation.as_str()),
            ];
            errors
                .encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(n, None)?;
        }
        enc.encode_descriptor(
            "gpushare_device_manager_registrations",
            "Registrations with the kubelet (one more after each kubelet restart).",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<NoLabelSet, _, u64>(&self.registrations, None)
    }
}

/// Serve `render()` of the current metrics over HTTP on `listener`, whatever the path.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Mutex<Metrics>>) {
    let page = move || {
        let body = metrics.lock().unwrap_or_else(|e| e.into_inner()).render();
        async move {
            (
                [(
                    axum::http::header::CONTENT_TYPE,
                    prometheus_text::CONTENT_TYPE,
                )],
                body,
            )
        }
    };
    if let Err(e) = axum::serve(listener, axum::Router::new().fallback(page)).await {
        tracing::error!("the metrics endpoint stopped: {e}");
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
