//! What the tenants (`cudarc-client`) report: the JSON line each prints at its end.

use crate::report::Latency;
use serde::Deserialize;

/// The result line of `cudarc-client spin` or `cudarc-client latency` (the fields the
/// benchmark uses).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ClientResult {
    /// spin: kernels launched, over `wall_ms`.
    pub kernels: Option<u64>,
    pub wall_ms: Option<f64>,
    /// latency: requests served, each `kernels_per_request` kernels.
    pub requests: Option<u64>,
    pub kernels_per_request: Option<u64>,
    /// CLOCK_MONOTONIC ns.
    pub start_ns: Option<u64>,
    pub end_ns: Option<u64>,
    pub latency_p50_ms: Option<f64>,
    pub latency_p90_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
    pub latency_p999_ms: Option<f64>,
    /// latency: when each request arrived (CLOCK_MONOTONIC ns).
    pub arrivals_ns: Option<Vec<u64>>,
}

impl ClientResult {
    /// The last line of `stdout` that is a result.
    pub fn last_in(stdout: &[u8]) -> Option<ClientResult> {
        String::from_utf8_lossy(stdout)
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str(l).ok())
    }

    /// Kernels per second: kernels over wall time (spin), or requests × kernels per request
    /// over the run (latency).
    pub fn throughput(&self) -> Option<f64> {
        if let (Some(k), Some(wall)) = (self.kernels, self.wall_ms) {
            return (wall > 0.0).then(|| k as f64 / wall * 1e3);
        }
        let k = self.requests? * self.kernels_per_request?;
        let ns = self.end_ns?.checked_sub(self.start_ns?)?;
        (ns > 0).then(|| k as f64 / ns as f64 * 1e9)
    }

    /// Request latency (latency tenants).
    pub fn latency(&self) -> Option<Latency> {
        Some(Latency {
            p50_ms: self.latency_p50_ms?,
            p90_ms: self.latency_p90_ms?,
            p99_ms: self.latency_p99_ms?,
            p999_ms: self.latency_p999_ms?,
            requests: self.requests?,
        })
    }
}

/// The result line of `cudarc-client launch-latency`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct LaunchLatency {
    /// Through the entry point the program resolves (the hook's wrapper when preloaded).
    pub ns_per_launch: f64,
    /// Through the driver's own entry point, in the same process.
    pub ns_per_launch_direct: f64,
    /// Median over block pairs of direct / linked time: the throughput ratio.
    pub direct_over_linked: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throughput_of_spin_and_latency_results() {
        let spin = ClientResult::last_in(b"noise\n{\"kernels\": 500, \"wall_ms\": 1000.0}\n");
        assert_eq!(spin.and_then(|r| r.throughput()), Some(500.0));
        let lat = ClientResult::last_in(
            br#"{"requests": 40, "kernels_per_request": 4, "start_ns": 0, "end_ns": 2000000000, "latency_p50_ms": 1.5, "latency_p90_ms": 2.0, "latency_p99_ms": 3.0, "latency_p999_ms": 4.0}"#,
        )
        .unwrap();
        assert_eq!(lat.throughput(), Some(80.0));
        assert_eq!(
            lat.latency(),
            Some(Latency {
                p50_ms: 1.5,
                p90_ms: 2.0,
                p99_ms: 3.0,
                p999_ms: 4.0,
                requests: 40
            })
        );
        assert_eq!(ClientResult::last_in(b"no result\n"), None);
        assert_eq!(ClientResult::default().throughput(), None);
    }
}
