//! Warnings about misbehaving peers, throttled: at most [`Throttle::BURST`] per
//! [`Throttle::PERIOD_NS`], so that a flood of connections does not become a flood of log
//! lines; the others are logged at debug level and counted in the next warning. Pure: the
//! caller says when.

#[derive(Default)]
pub struct Throttle {
    period_start: u64,
    warned: u32,
    suppressed: u64,
}

impl Throttle {
    pub const BURST: u32 = 20;
    pub const PERIOD_NS: u64 = 10_000_000_000;

    /// Warn of `what`, which happened at `now`, unless too many warnings went out lately.
    /// Whether it was logged at warning level.
    pub fn warn(&mut self, now: u64, what: std::fmt::Arguments) -> bool {
        if now.saturating_sub(self.period_start) >= Self::PERIOD_NS {
            self.period_start = now;
            self.warned = 0;
        }
        if self.warned < Self::BURST {
            self.warned += 1;
            match std::mem::take(&mut self.suppressed) {
                0 => tracing::warn!("{what}"),
                n => tracing::warn!("{what} ({n} similar warnings suppressed before this one)"),
            }
            true
        } else {
            self.suppressed += 1;
            tracing::debug!("{what}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_per_period_then_silence() {
        let mut t = Throttle::default();
        let logged = (0..100)
            .filter(|i| t.warn(1_000 + i, format_args!("x")))
            .count();
        assert_eq!(logged, Throttle::BURST as usize);
        assert!(t.warn(1_000 + Throttle::PERIOD_NS, format_args!("x")));
        assert_eq!(t.suppressed, 0, "counted in the warning after the silence");
    }
}
