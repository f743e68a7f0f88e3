//! A histogram of durations (ns in, seconds out) with fixed bucket bounds, as the report
//! carries it ([`Durations`]): the event loop's lateness, and memory overcommit's swap and
//! wait times.

use gpushare_protocol::status::Durations;

#[derive(Debug, Clone)]
pub struct Histogram {
    /// Upper bounds of the buckets, ns, ascending.
    bounds_ns: &'static [u64],
    /// One count per bound, and one for the durations beyond the last.
    counts: Vec<u64>,
    count: u64,
    sum_ns: u128,
    max_ns: u64,
}

impl Histogram {
    pub fn new(bounds_ns: &'static [u64]) -> Histogram {
        Histogram {
            bounds_ns,
            counts: vec![0; bounds_ns.len() + 1],
            count: 0,
            sum_ns: 0,
            max_ns: 0,
        }
    }

    /// Something took `ns`.
    pub fn record(&mut self, ns: u64) {
        let i = self.bounds_ns.partition_point(|&b| b < ns);
        self.counts[i] += 1;
        self.count += 1;
        self.sum_ns += u128::from(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    /// As the report carries it.
    pub fn report(&self) -> Durations {
        Durations {
            bounds_s: self.bounds_ns.iter().map(|&b| b as f64 / 1e9).collect(),
            counts: self.counts.clone(),
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
    fn durations_land_in_the_bucket_of_their_bound() {
        let mut h = Histogram::new(&crate::latency::BOUNDS_NS);
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
