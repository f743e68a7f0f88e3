//! A turn on the GPU: one client's token from its start to its end, and what it is charged.

use super::ClientId;

/// What a client measured of a turn, reported once the turn's work drained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnUse {
    /// When it launched its first kernel of the turn (CLOCK_MONOTONIC).
    pub first_ns: u64,
    /// When the turn's last kernel ended (device time, on CLOCK_MONOTONIC).
    pub last_ns: u64,
}

/// A turn granted to a client: running, planned, or ended and awaiting its client's report.
#[derive(Debug, Clone)]
pub(super) struct Turn {
    pub client: ClientId,
    pub group: String,
    pub token: u64,
    /// When it starts: the end of the turn before it, or when it was granted.
    pub start_ns: u64,
    pub deadline_ns: u64,
    /// Its deadline before it was extended for a client alone on the GPU: another group that
    /// asks cuts the extension back.
    pub unextended: Option<u64>,
    /// Its length as granted, extensions included.
    pub quota_ns: u64,
    /// It starts where another turn ends (back to back).
    pub after_turn: bool,
    /// Another group wanted the GPU when it was granted: time it held without using it was
    /// taken from someone.
    pub contested: bool,
    /// When it ended: its deadline, or when its client yielded it or was lost.
    pub end_ns: Option<u64>,
    /// Another turn started where it ended.
    pub followed: bool,
    /// Its client gave it back before its deadline.
    pub yielded: bool,
    /// Its client was told to stop (no report by its end + grace).
    pub revoked: bool,
    /// Its client was told to stop as the turn was ended early (its group suspended, or the
    /// client silent): not told again, nor counted as revoked, at its end + grace.
    pub stopped: bool,
    /// Its client was taken to be stopped (no report long after its end).
    pub silenced: bool,
    /// Debited from credit and bucket so far (the reservation, then the charge).
    pub applied: u64,
    /// Added to the usage statistics so far.
    pub recorded: u64,
    /// GPU work its client may keep queued.
    pub queue_budget_ns: u64,
    /// It starts where a latency-class group's linger ends: its client launches nothing before
    /// its start.
    pub open_at_start: bool,
    /// A latency-class group of another client was connected when it was granted: its client
    /// launches each long kernel just in time ([`crate::Decision::Grant`]).
    pub just_in_time: bool,
}

impl Turn {
    /// The grant that tells its client of it (again, once it moved).
    pub fn grant(&self) -> crate::Decision {
        crate::Decision::Grant {
            client: self.client,
            token: self.token,
            start_ns: self.start_ns,
            deadline_ns: self.deadline_ns,
            quota_ns: self.quota_ns,
            queue_budget_ns: self.queue_budget_ns,
            open_at_start: self.open_at_start,
            just_in_time: self.just_in_time,
        }
    }

    /// When it ends (or ended).
    pub fn end(&self) -> u64 {
        self.end_ns.unwrap_or(self.deadline_ns)
    }

    /// What the turn costs its group, given its client's report (`None`: no report, or no kernel
    /// launched in it).
    ///
    /// Back to back with other turns, a turn is charged from its start to its end, the handoff
    /// instants: the GPU was its client's in between (used, or held while others waited). Where
    /// the GPU was free before it, it is charged from its first launch if that came earlier (its
    /// kernels ran on the idle GPU from then); where the GPU is free after it, until its last
    /// kernel ended (at most a grace beyond its end). A client that launched early to queue its
    /// first kernels behind the previous turn's last ones had about half of that time in
    /// kernels of its own (the GPU time-slices the two), which is charged too.
    pub fn charge(&self, used: Option<TurnUse>, grace_ns: u64) -> u64 {
        let end = self.end();
        let Some(u) = used else {
            return end.saturating_sub(self.start_ns);
        };
        let from = if self.after_turn {
            let early = self.start_ns.saturating_sub(u.first_ns).min(self.quota_ns);
            self.start_ns - early / 2
        } else if self.contested {
            self.start_ns.min(u.first_ns)
        } else {
            u.first_ns
        };
        // A report is the client's word: kernels that all ran after the turn's end and grace
        // (a turn ended while its client's host stalled, then launched in anyway) are not this
        // turn's, and nothing in it may panic the scheduler.
        let to = if self.followed {
            end
        } else {
            u.last_ns.min(end.saturating_add(grace_ns))
        };
        to.saturating_sub(from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(start: u64, end: u64) -> Turn {
        Turn {
            client: 1,
            group: "g".into(),
            token: 1,
            start_ns: start,
            deadline_ns: end,
            unextended: None,
            quota_ns: end - start,
            after_turn: false,
            contested: true,
            end_ns: Some(end),
            followed: false,
            yielded: false,
            revoked: false,
            stopped: false,
            silenced: false,
            applied: 0,
            recorded: 0,
            queue_budget_ns: 2_500_000,
            open_at_start: false,
            just_in_time: false,
        }
    }

    fn used(first_ns: u64, last_ns: u64) -> Option<TurnUse> {
        Some(TurnUse { first_ns, last_ns })
    }

    #[test]
    fn alone_a_turn_costs_the_time_its_kernels_occupied_the_gpu() {
        let t = turn(1_000, 21_000);
        assert_eq!(t.charge(used(900, 20_500), 100), 19_600, "started early");
        assert_eq!(
            t.charge(used(1_300, 21_050), 100),
            20_050,
            "late first launch: held"
        );
        assert_eq!(
            t.charge(used(1_000, 40_000), 100),
            20_100,
            "overrun: at most grace"
        );
        assert_eq!(t.charge(None, 100), 20_000, "no report: as held");
        let alone = Turn {
            contested: false,
            ..t
        };
        assert_eq!(
            alone.charge(used(1_300, 21_050), 100),
            19_750,
            "late first launch, nobody else waiting: not held from anyone"
        );
        // Seen under a connection flood: a turn ended at once while its client's host
        // stalled, and the client's first kernel came after its end and grace.
        assert_eq!(alone.charge(used(40_000, 41_000), 100), 0, "all after");
        assert_eq!(
            alone.charge(used(900, 800), 100),
            0,
            "ended before it began"
        );
        let followed = Turn {
            followed: true,
            ..alone
        };
        assert_eq!(followed.charge(used(30_000, 31_000), 100), 0);
    }

    #[test]
    fn back_to_back_a_turn_costs_its_span_between_handoffs() {
        let mut t = turn(1_000, 21_000);
        (t.after_turn, t.followed) = (true, true);
        assert_eq!(t.charge(used(1_000, 21_800), 100), 20_000);
        assert_eq!(
            t.charge(used(600, 20_500), 100),
            20_200,
            "launched 400 early: half of that is its own"
        );
    }
}
