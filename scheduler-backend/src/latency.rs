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

/// The worst delay of the last one to two seconds: how late the loop acts on its timers now,
/// which the policies allow for by granting turns that much earlier.
#[derive(Debug, Clone, Copy, Default)]
pub struct Recent {
    /// When the current span began.
    since_ns: u64,
    /// The worst of the current span, and of the one before.
    current_ns: u64,
    previous_ns: u64,
}

impl Recent {
    const SPAN_NS: u64 = 1_000_000_000;

    /// Something was handled `ns` late at `now`; the worst of the last one to two seconds.
    pub fn record(&mut self, ns: u64, now: u64) -> u64 {
        let elapsed = now.saturating_sub(self.since_ns);
        if elapsed >= Self::SPAN_NS {
            self.previous_ns = if elapsed < 2 * Self::SPAN_NS {
                self.current_ns
            } else {
                0
            };
            self.current_ns = 0;
            self.since_ns = now;
        }
        self.current_ns = self.current_ns.max(ns);
        self.current_ns.max(self.previous_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recent_worst_is_forgotten_after_one_to_two_seconds() {
        const MS: u64 = 1_000_000;
        let mut r = Recent::default();
        assert_eq!(r.record(3 * MS, 1_000 * MS), 3 * MS);
        assert_eq!(r.record(MS, 1_500 * MS), 3 * MS);
        assert_eq!(
            r.record(0, 2_100 * MS),
            3 * MS,
            "the span before still counts"
        );
        assert_eq!(r.record(0, 3_200 * MS), 0, "two spans on: forgotten");
        assert_eq!(r.record(7 * MS, 3_300 * MS), 7 * MS);
        assert_eq!(
            r.record(0, 9_000 * MS),
            0,
            "a long quiet: forgotten at once"
        );
    }

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
