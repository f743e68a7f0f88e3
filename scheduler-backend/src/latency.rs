//! How late the event loop handles what it has to do: a [`Histogram`](crate::histogram::Histogram) of
//! delays with these bounds, kept by the node core from what the event loop measures, shown in
//! `gpushare status` and as a Prometheus histogram; and the worst of the last moments. Pure:
//! the loop reads the clock.

/// Upper bounds of the buckets, ns: 10 µs to 2.5 s, in 1-2.5-5 steps.
pub const BOUNDS_NS: [u64; 17] = [
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
}
