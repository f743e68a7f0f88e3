//! The lease arithmetic: how much of its group's memory cap this process holds at the scheduler
//! on one GPU, and how much of that its allocations use. Pure (no I/O, no clock): the caller
//! does the round trips and calls [`Lease::expire`] once per window.
//!
//! Why: without a lease every allocation waits for a round trip to the scheduler (which
//! journals the reservation before it answers). With one, a small allocation takes bytes the
//! process already holds, and only a refill waits: it asks for what is missing plus one
//! *block* (min(`GPUSHARE_MEM_LEASE`, cap / 32)), so the next allocations of the block are
//! local. The scheduler counts the whole lease as used, so the cap holds whatever the process
//! does with it; the spare is bounded so that another process of the group is not refused for
//! long because of it:
//!
//! - allocations larger than a block are reserved exactly, and their frees given back at once;
//! - the spare (held, not allocated) never stays above one block: a free that takes it above
//!   is given back down to one block, so small alloc/free loops cost nothing, bursts of frees
//!   one message per free beyond the block;
//! - spare that no allocation needed for a whole window (the least spare seen in it) is given
//!   back when the window ends, so an idle process holds nothing after at most two windows.
//!
//! At every step: allocations ≤ held, and held plus the asks in flight ≤ allocations plus
//! the allocations waiting for those asks plus one block per ask in flight and one spare block
//! (property-tested below).
//!
//! When the scheduler owes an answer past the liveness bound, or cannot be reached, a
//! fail-open process decides on its own ([`Lease::grant_alone`]): against the group's cap and
//! the others' use as the scheduler last told them, for exactly what the allocation needs. What
//! it holds then differs from the scheduler's books, so it owes the scheduler a statement of
//! its holding ([`Lease::sync_due`]), made once no ask is in flight (an answer to one would
//! count twice) and the scheduler answers again: its books are then exact.

/// One GPU's lease.
#[derive(Debug, Default, Clone)]
pub struct Lease {
    /// The spare a refill leaves; 0: no lease, every allocation is reserved exactly.
    block: u64,
    /// Reserved at the scheduler and not given back: what the scheduler books for this process
    /// (and what it restates after a reconnection).
    held: u64,
    /// Of `held`, what allocations use or asks in flight have set aside.
    used: u64,
    /// The least spare since the window began.
    low: u64,
    /// Asks sent and not yet answered or decided.
    asks: u32,
    /// What the scheduler books for this process may differ from `held`: a statement is owed.
    unsynced: bool,
    /// The group's cap and the others' use on this GPU, as the scheduler last said.
    known: Option<Known>,
}

/// What the scheduler last said of the group's memory on this GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Known {
    cap: Option<u64>,
    /// The group's use less this process's holding.
    others: u64,
}

/// What an allocation of some bytes needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Taken from the spare: no round trip.
    Local,
    /// Ask the scheduler, then report the answer with [`Lease::granted`] or [`Lease::refused`].
    Ask(Ask),
}

/// A reservation to ask the scheduler for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// The allocation's bytes.
    pub bytes: u64,
    /// Spare set aside for the allocation meanwhile (no other allocation takes it).
    pub claimed: u64,
    /// Bytes to reserve: what is missing, plus a block of spare for a small allocation.
    pub ask: u64,
}

/// What follows a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Ask the scheduler again, for this.
    Retry(Ask),
    /// The allocation fails; give back these bytes.
    Failed { give_back: u64 },
}

impl Ask {
    /// Whether this ask is already the least the allocation needs.
    fn minimal(&self) -> bool {
        self.ask == self.bytes - self.claimed
    }
}

impl Lease {
    pub fn new(block: u64) -> Lease {
        Lease {
            block,
            ..Lease::default()
        }
    }

    /// What the scheduler books for this process.
    #[cfg(test)]
    pub fn held(&self) -> u64 {
        self.held
    }

    /// Held and not used: what this process may still allocate without asking.
    pub fn spare(&self) -> u64 {
        self.held - self.used
    }

    /// A new block size (the group's cap became known or changed); the bytes to give back now.
    pub fn set_block(&mut self, block: u64) -> u64 {
        self.block = block;
        self.trim(block)
    }

    /// An allocation of `bytes`: local, or an ask (the spare is then set aside for it).
    pub fn take(&mut self, bytes: u64) -> Take {
        if bytes <= self.spare() {
            self.used += bytes;
            self.low = self.low.min(self.spare());
            return Take::Local;
        }
        let claimed = self.spare();
        self.used += claimed;
        self.low = 0;
        self.asks += 1;
        let extra = if bytes <= self.block { self.block } else { 0 };
        Take::Ask(Ask {
            bytes,
            claimed,
            ask: bytes - claimed + extra,
        })
    }

    /// The scheduler granted `a`: the allocation may go ahead. The bytes to give back now
    /// (spare over one block, when other frees or refills came meanwhile).
    pub fn granted(&mut self, a: &Ask) -> u64 {
        self.asks -= 1;
        self.held += a.ask;
        self.used += a.bytes - a.claimed;
        self.trim(self.block)
    }

    /// The scheduler's answer to an ask: the group's cap on this GPU and its use, this
    /// process's holding included (as [`Lease::held`] is now).
    pub fn learn(&mut self, cap: Option<u64>, used: u64) {
        self.known = Some(Known {
            cap,
            others: used.saturating_sub(self.held),
        });
    }

    /// The group's cap and its use as far as this process knows: what the scheduler last said,
    /// with this process's holding as it is now.
    pub fn known(&self) -> Option<(Option<u64>, u64)> {
        self.known.map(|k| (k.cap, k.others + self.held))
    }

    /// `a` gets no answer (fail-open): granted if what the allocation needs fits under the
    /// cap as last known (or none is known), with no spare added; else the allocation fails
    /// (`Err`: the bytes to give back). Either way the scheduler is owed a statement (it may
    /// yet book the ask).
    pub fn grant_alone(&mut self, a: &Ask) -> Result<(), u64> {
        let need = a.bytes - a.claimed;
        let fits = self.known.is_none_or(|k| {
            k.cap
                .is_none_or(|c| k.others.saturating_add(self.held + need) <= c)
        });
        self.unsynced = true;
        if !fits {
            return Err(self.fail(a));
        }
        self.asks -= 1;
        self.held += need;
        self.used += need;
        Ok(())
    }

    /// The statement of its holding this process owes the scheduler, if it owes one and no
    /// ask is in flight: send it now (under the lease's lock, with nothing sent between).
    pub fn sync_due(&mut self) -> Option<u64> {
        (self.unsynced && self.asks == 0).then(|| {
            self.unsynced = false;
            self.held
        })
    }

    /// The scheduler may not have what this process holds (a message to it was lost, or it
    /// is stated on a new connection).
    pub fn owe_sync(&mut self) {
        self.unsynced = true;
    }

    /// The holding was stated to a new connection (asks in flight, if any, were on the last
    /// one: their outcome is owed when they end).
    pub fn stated(&mut self) -> u64 {
        self.unsynced = self.asks > 0;
        self.held
    }

    /// The scheduler refused `a`: ask for the least the allocation needs if `a` asked for more
    /// (near the cap a refill's extra block may not fit); else the allocation fails, its
    /// set-aside spare is spare again, and the spare over one block goes back.
    pub fn refused(&mut self, a: &Ask) -> Refused {
        if !a.minimal() {
            return Refused::Retry(Ask {
                ask: a.bytes - a.claimed,
                ..*a
            });
        }
        Refused::Failed {
            give_back: self.fail(a),
        }
    }

    /// `a`'s allocation fails: its set-aside spare is spare again; the bytes to give back.
    pub fn fail(&mut self, a: &Ask) -> u64 {
        self.asks -= 1;
        self.used -= a.claimed;
        self.trim(self.block)
    }

    /// Allocations of `bytes` ended (freed, or the driver failed them); the bytes to give back.
    /// More than a block was reserved exactly and goes back whole; smaller frees refill the
    /// spare up to one block.
    pub fn free(&mut self, bytes: u64) -> u64 {
        let bytes = bytes.min(self.used);
        let keep = if bytes > self.block {
            self.spare().min(self.block)
        } else {
            self.block
        };
        self.used -= bytes;
        self.trim(keep)
    }

    /// The window ended: the spare no allocation needed in it (the least seen) goes back.
    pub fn expire(&mut self) -> u64 {
        let unused = self.low.min(self.spare());
        self.held -= unused;
        self.low = self.spare();
        unused
    }

    /// Give back the spare over `keep`.
    fn trim(&mut self, keep: u64) -> u64 {
        let over = self.spare().saturating_sub(keep);
        self.held -= over;
        self.low = self.low.min(self.spare());
        over
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    /// Grant an ask (as the scheduler would); the bytes given back.
    fn grant(l: &mut Lease, bytes: u64) -> (Take, u64) {
        match l.take(bytes) {
            Take::Local => (Take::Local, 0),
            Take::Ask(a) => (Take::Ask(a), l.granted(&a)),
        }
    }

    #[test]
    fn small_allocations_refill_a_block_and_then_stay_local() {
        let mut l = Lease::new(8 * MIB);
        let (t, back) = grant(&mut l, MIB);
        assert_eq!(
            t,
            Take::Ask(Ask {
                bytes: MIB,
                claimed: 0,
                ask: 9 * MIB
            })
        );
        assert_eq!((back, l.held(), l.spare()), (0, 9 * MIB, 8 * MIB));
        for _ in 0..8 {
            assert_eq!(l.take(MIB), Take::Local);
        }
        assert_eq!(l.spare(), 0);
        // The next one claims nothing and refills.
        assert!(matches!(l.take(MIB), Take::Ask(a) if a.ask == 9 * MIB));
    }

    #[test]
    fn alloc_free_loops_cost_nothing_and_frees_beyond_a_block_go_back() {
        let mut l = Lease::new(8 * MIB);
        grant(&mut l, MIB);
        for _ in 0..1000 {
            assert_eq!(l.take(MIB), Take::Local);
            assert_eq!(l.free(MIB), 0);
        }
        assert_eq!(l.free(MIB), MIB, "the spare stays at one block");
        assert_eq!((l.held(), l.spare()), (8 * MIB, 8 * MIB));
    }

    #[test]
    fn large_allocations_are_exact_and_go_back_whole() {
        let mut l = Lease::new(8 * MIB);
        grant(&mut l, MIB);
        l.free(MIB);
        assert_eq!(l.spare(), 8 * MIB);
        let (t, _) = grant(&mut l, 100 * MIB);
        assert_eq!(
            t,
            Take::Ask(Ask {
                bytes: 100 * MIB,
                claimed: 8 * MIB,
                ask: 92 * MIB
            }),
            "the spare is used, no block added"
        );
        assert_eq!(l.spare(), 0);
        assert_eq!(l.free(100 * MIB), 100 * MIB, "freed whole, no spare kept");
        assert_eq!(l.held(), 0);
    }

    #[test]
    fn near_the_cap_a_refused_refill_asks_for_the_least() {
        let mut l = Lease::new(8 * MIB);
        grant(&mut l, MIB);
        for _ in 0..8 {
            l.take(MIB);
        }
        let Take::Ask(a) = l.take(2 * MIB) else {
            panic!("no spare left")
        };
        let Refused::Retry(least) = l.refused(&a) else {
            panic!("no smaller ask")
        };
        assert_eq!(least.ask, 2 * MIB);
        assert_eq!(
            l.refused(&least),
            Refused::Failed { give_back: 0 },
            "nothing smaller"
        );
        assert_eq!((l.held(), l.spare()), (9 * MIB, 0));
    }

    #[test]
    fn an_idle_lease_is_given_back_within_two_windows() {
        let mut l = Lease::new(8 * MIB);
        grant(&mut l, MIB);
        l.free(MIB);
        assert_eq!(l.expire(), 0, "the refill used the spare in this window");
        assert_eq!(l.expire(), 8 * MIB, "unused for a whole window");
        assert_eq!(l.held(), 0);
        // A busy process keeps what it uses and gives back the rest.
        grant(&mut l, MIB);
        l.expire();
        for _ in 0..10 {
            l.take(3 * MIB);
            l.free(3 * MIB);
        }
        assert_eq!(l.expire(), 5 * MIB, "8 MiB spare, 3 MiB of it used");
        assert_eq!(l.spare(), 3 * MIB);
    }

    #[test]
    fn without_a_block_every_allocation_is_exact() {
        let mut l = Lease::new(0);
        let (t, _) = grant(&mut l, MIB);
        assert!(matches!(t, Take::Ask(a) if a.ask == MIB));
        assert_eq!(l.free(MIB), MIB);
        assert_eq!(l.held(), 0);
    }

    #[test]
    fn a_smaller_block_gives_back_at_once() {
        let mut l = Lease::new(8 * MIB);
        grant(&mut l, MIB);
        assert_eq!(l.set_block(2 * MIB), 6 * MIB);
        assert_eq!(l.spare(), 2 * MIB);
    }

    /// One step of a process's memory life.
    #[derive(Debug, Clone)]
    enum Op {
        /// An allocation of some MiB starts (local, or its ask is sent).
        Alloc(u64),
        /// The oldest ask in flight is answered (granted if the cap allows).
        Answer,
        /// A live allocation (by index) is freed.
        Free(usize),
        /// The driver fails the newest local or granted allocation.
        DriverFails,
        Expire,
        Block(u64),
        /// The oldest ask in flight gets no answer (the scheduler stopped): the process decides
        /// alone; the scheduler books the ask all the same if `booked` (it read it before it
        /// stopped) and it fits.
        Unanswered {
            booked: bool,
        },
        /// The scheduler answers again: the statement owed, if due, is sent.
        Sync,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u64..40).prop_map(Op::Alloc),
            3 => Just(Op::Answer),
            3 => any::<usize>().prop_map(Op::Free),
            1 => Just(Op::DriverFails),
            1 => Just(Op::Expire),
            1 => (0u64..16).prop_map(Op::Block),
            1 => any::<bool>().prop_map(|booked| Op::Unanswered { booked }),
            1 => Just(Op::Sync),
        ]
    }

    proptest! {
        /// Random allocations, frees, answers (asks interleaved with other steps), failures,
        /// windows and block changes, against a scheduler enforcing a cap, which now and then
        /// leaves an ask unanswered (the process decides alone, against the cap it knows):
        /// never an allocation outside the lease, never more held (plus asks in flight) than
        /// allocations (plus those waiting) plus one spare block and one block per ask in
        /// flight, the scheduler's books exact whenever no statement is owed, over the cap by
        /// no more than what was decided alone, and after the last window and statement
        /// nothing held that no allocation uses, there or here.
        #[test]
        fn never_more_held_than_used_plus_a_block_and_never_an_allocation_outside_it(
            ops in proptest::collection::vec(op(), 1..300),
            block in 0u64..16,
            cap in 32u64..200,
        ) {
            let mut l = Lease::new(block * MIB);
            let mut block = block * MIB;
            let mut max_block = block;
            let cap = cap * MIB;
            l.learn(Some(cap), 0);
            // Bytes granted alone (not by the scheduler) so far.
            let mut alone = 0u64;
            let mut live: Vec<u64> = Vec::new();
            let mut pending: std::collections::VecDeque<Ask> = Default::default();
            // What the scheduler books: held, plus what it granted but the hook has not yet
            // counted (none here: answers are applied at once), minus gives.
            let mut booked = 0u64;
            for op in ops {
                match op {
                    Op::Alloc(mib) => match l.take(mib * MIB) {
                        Take::Local => live.push(mib * MIB),
                        Take::Ask(a) => pending.push_back(a),
                    },
                    Op::Answer => {
                        if let Some(mut a) = pending.pop_front() {
                            loop {
                                if booked + a.ask <= cap {
                                    booked += a.ask;
                                    booked = booked.saturating_sub(l.granted(&a));
                                    l.learn(Some(cap), booked);
                                    live.push(a.bytes);
                                    break;
                                }
                                l.learn(Some(cap), booked);
                                match l.refused(&a) {
                                    Refused::Retry(next) => a = next,
                                    // (The scheduler's books saturate: they may hold less
                                    // than the lease after it decided alone.)
                                    Refused::Failed { give_back } => {
                                        booked = booked.saturating_sub(give_back);
                                        break;
                                    }
                                }
                            }
                        }
                    }
                    Op::Unanswered { booked: read } => {
                        if let Some(a) = pending.pop_front() {
                            if read && booked + a.ask <= cap {
                                booked += a.ask;
                            }
                            // (Refused alone: what it gives back goes to a scheduler that is
                            // not there to hear it.)
                            if l.grant_alone(&a).is_ok() {
                                alone += a.bytes - a.claimed;
                                live.push(a.bytes);
                            }
                        }
                    }
                    Op::Sync => {
                        if let Some(held) = l.sync_due() {
                            booked = held;
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let bytes = live.swap_remove(i % live.len());
                        booked = booked.saturating_sub(l.free(bytes));
                    }
                    Op::Free(_) => {}
                    Op::DriverFails => {
                        if let Some(bytes) = live.pop() {
                            booked = booked.saturating_sub(l.free(bytes));
                        }
                    }
                    Op::Expire => booked = booked.saturating_sub(l.expire()),
                    Op::Block(b) => {
                        block = b * MIB;
                        max_block = max_block.max(block);
                        booked = booked.saturating_sub(l.set_block(block));
                    }
                }
                let allocated: u64 = live.iter().sum();
                let claimed: u64 = pending.iter().map(|a| a.claimed).sum();
                let asked: u64 = pending.iter().map(|a| a.ask).sum();
                let waiting: u64 = pending.iter().map(|a| a.bytes).sum();
                if !l.unsynced {
                    prop_assert_eq!(booked, l.held(), "the scheduler's books and the lease agree");
                }
                prop_assert_eq!(l.used, allocated + claimed);
                prop_assert!(allocated + claimed <= l.held(), "an allocation outside the lease");
                prop_assert!(booked <= cap + alone, "booked {booked}, cap {cap}, alone {alone}");
                prop_assert_eq!(l.asks as usize, pending.len());
                // Each ask in flight adds at most the block of its day.
                let extra: u64 = pending.iter().map(|a| a.ask - (a.bytes - a.claimed)).sum();
                prop_assert!(pending.iter().all(|a| a.ask - (a.bytes - a.claimed) <= max_block));
                prop_assert!(l.spare() <= block, "spare {} over the block {block}", l.spare());
                prop_assert!(
                    l.held() + asked <= allocated + waiting + block + extra,
                    "held {} + asked {asked} > allocated {allocated} + waiting {waiting} + block {block} + extra {extra}",
                    l.held()
                );
                if max_block == block {
                    prop_assert!(l.held() + asked <= allocated + waiting + block * (1 + pending.len() as u64));
                }
            }
            // Answer everything, free everything: two windows later nothing is held, and the
            // statement owed says so.
            while let Some(mut a) = pending.pop_front() {
                loop {
                    match l.refused(&a) {
                        Refused::Retry(next) => a = next,
                        Refused::Failed { give_back } => {
                            booked = booked.saturating_sub(give_back);
                            break;
                        }
                    }
                }
            }
            for bytes in live.drain(..) {
                booked = booked.saturating_sub(l.free(bytes));
            }
            booked = booked.saturating_sub(l.expire());
            booked = booked.saturating_sub(l.expire());
            if let Some(held) = l.sync_due() {
                booked = held;
            }
            prop_assert_eq!(l.held(), 0);
            prop_assert_eq!(booked, 0);
        }
    }
}
