//! How late the event loop handles what it has to do: a histogram of delays (ns in, seconds
//! out), kept by the node core from what the event loop measures, shown in `gpushare status`
//! and as a Prometheus histogram. Pure: the loop reads the clock.

use gpushare_protocol::status::LoopLatency;

/// Upper bounds of the buckets, ns: 10 µs to 2.5 s, in 1-2.5-5 steps.
const BOUNDS_NS: [u64; 17] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
];

#[derive(Debug, Clone, Default)]
pub struct Histogram {
    /// One count per bound, and one for the delays beyond the last.
    counts: [u64; BOUNDS_NS.len() + 1],
    count: u64,
    sum_ns: u128,
    max_ns: u64,
}

impl Histogram {
    /// Something was handled `ns` after it was due.
    pub fn record(&mut self, ns: u64) {
        let i = BOUNDS_NS.partition_point(|&b| b < ns);
        self.counts[i] += 1;
        self.count += 1;
        self.sum_ns += u128::from(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    /// As the report carries it.
    pub fn report(&self) -> LoopLatency {
        LoopLatency {
            bounds_s: BOUNDS_NS.iter().map(|&b| b as f64 / 1e9).collect(),
            counts: self.counts.to_vec(),
            count: self.count,
            sum_s: self.sum_ns as f64 / 1e9,
            max_s: self.max_ns as f64 / 1e9,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_land_in_the_bucket_of_their_bound() {
        let mut h = Histogram::default();
        for ns in [0, 10_000, 10_001, 3_000_000_000] {
            h.record(ns);
        }
        let r = h.report();
        assert_eq!(r.counts.len(), r.bounds_s.len() + 1);
        assert_eq!(&r.counts[..3], &[2, 1, 0], "a bound is inclusive");
        assert_eq!(r.counts.last(), Some(&1), "beyond the last bound");
        assert_eq!(r.count, 4);
        assert_eq!(r.max_s, 3.0);
        assert!((r.sum_s - 3.000_020_001).abs() < 1e-9);
        assert_eq!(r.quantile(0.5), Some(10e-6));
    }
}
