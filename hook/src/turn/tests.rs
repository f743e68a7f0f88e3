//! The turn state machine in virtual time: scripted races, and seeded random interleavings of
//! grants, revocations, cut-short and extended deadlines, launchers, the watcher, drains and
//! disconnections, checked against the invariants the scheduler and the fast path rely on.

use super::*;
use rand::{RngExt as _, SeedableRng as _};
use rand_xoshiro::SplitMix64;
use std::collections::HashMap;

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;
/// The queue budget the scheduler gives a 20 ms turn that another group may cut short.
const BUDGET: u64 = 2_500_000;

/// What a grant says: the usual budget, opening at the start if `open_at_start`.
fn plan(open_at_start: bool) -> Plan {
    Plan {
        queue_budget_ns: BUDGET,
        open_at_start,
        just_in_time: false,
    }
}
const CFG: TurnConfig = TurnConfig {
    idle_release_ns: 2 * MS,
    handoff_lead_ns: MS,
    fail_open: true,
};
/// The liveness bound of the default quota and grace.
const LIVENESS: u64 = 40 * MS;

fn busy() -> Activity {
    Activity {
        launches: 0,
        quiet: false,
        waiters: 0,
    }
}

fn quiet(launches: u64) -> Activity {
    Activity {
        launches,
        quiet: true,
        waiters: 0,
    }
}

/// A machine holding turn `token` (opened at `start`, 20 ms long).
fn holding(token: u64, start: u64) -> Turns {
    let mut t = Turns::new(CFG, LIVENESS);
    assert_eq!(t.admit(start - 10 * MS, &mut Waiter::default()), Step::Ask);
    t.asked(true, start - 10 * MS);
    t.grant(token, start, start + 20 * MS, plan(false), start - 5 * MS);
    assert_eq!(t.admit(start, &mut Waiter::default()), Step::Opened);
    assert_eq!(t.gate_deadline(), start + 20 * MS);
    assert!(t.take_said().is_empty());
    t
}

/// Close the held turn and report its drain at `at`.
fn close(t: &mut Turns, at: u64, again: bool) -> Turn {
    let turn = t.begin_close().expect("a turn to close");
    assert_eq!(t.gate_deadline(), 0, "closed: launches take the slow path");
    t.end_close(turn, at, again);
    turn
}

/// The watcher finds the holder, quiet after `launches`, idle at `at`: it yields the turn,
/// drained, and reports it without asking again.
fn given_back_idle(t: &mut Turns, at: u64, launches: u64) {
    assert_eq!(
        t.watch(at, quiet(launches), &mut || Some(0)),
        Watch::Close {
            yield_at: Some(at),
            busy: false
        }
    );
    let turn = t.begin_close().unwrap();
    t.yield_turn(&turn, at, at);
    t.end_close(turn, at, false);
}

/// A process whose first launch asked for a turn at time 0, the request sent.
fn asked_at_zero() -> (Turns, Waiter) {
    let mut t = Turns::new(CFG, LIVENESS);
    let mut w = Waiter::default();
    assert_eq!(t.admit(0, &mut w), Step::Ask);
    t.asked(true, 0);
    (t, w)
}

#[test]
fn a_turn_opens_a_lead_before_its_start_and_closes_before_its_deadline() {
    let (mut t, mut w) = asked_at_zero();
    assert_eq!(
        t.admit(0, &mut w),
        Step::Wait {
            until_ns: LIVENESS / 2
        },
        "looks again when a probe would be due"
    );
    t.grant(1, 10 * MS, 30 * MS, plan(false), MS);
    assert_eq!(t.admit(MS, &mut w), Step::Wait { until_ns: 9 * MS });
    assert_eq!(t.gate_deadline(), 0);
    // Woke 0.5 ms late: opens, and the lead learns it.
    assert_eq!(t.admit(9 * MS + MS / 2, &mut w), Step::Opened);
    assert_eq!(t.gate_deadline(), 30 * MS);
    assert_eq!(
        t.lead_ns(),
        MS,
        "0.5 ms late + 0.2 ms is under the least lead"
    );
    // Busy all along: the watcher closes a queue's worth before the deadline.
    let mut queued = || Some(MS);
    assert_eq!(
        t.watch(20 * MS, busy(), &mut queued),
        Watch::At(22 * MS),
        "launching: looks again an idle release later"
    );
    assert_eq!(t.watch(26 * MS, busy(), &mut queued), Watch::At(27_500_000));
    assert_eq!(
        t.watch(29 * MS, busy(), &mut queued),
        Watch::Close {
            yield_at: None,
            busy: true
        }
    );
    let turn = close(&mut t, 30 * MS, true);
    assert_eq!(t.token(), Token::Requested, "asks again in its report");
    assert_eq!(
        t.take_said(),
        vec![Say::Report {
            token: 1,
            used: Some(TurnUse {
                first_ns: turn.opened_ns.unwrap(),
                last_ns: 30 * MS
            }),
            again: true
        }]
    );
}

/// A turn that starts where a latency-class group's linger ends opens at its start, not a
/// lead before: that group may still take the GPU back. Moved earlier, it opens at the new
/// start.
#[test]
fn a_turn_after_a_latency_linger_opens_at_its_start() {
    let (mut t, mut w) = asked_at_zero();
    t.grant(1, 30 * MS, 50 * MS, plan(true), MS);
    assert_eq!(t.admit(MS, &mut w), Step::Wait { until_ns: 30 * MS });
    t.grant(1, 10 * MS, 30 * MS, plan(true), 2 * MS);
    assert_eq!(t.admit(2 * MS, &mut w), Step::Wait { until_ns: 10 * MS });
    assert_eq!(
        t.admit(10 * MS - 1, &mut w),
        Step::Wait { until_ns: 10 * MS }
    );
    assert_eq!(t.admit(10 * MS, &mut w), Step::Opened);
    assert_eq!(t.gate_deadline(), 30 * MS);
}

/// A process whose timed waits wake late opens a turn after a linger as much before its start
/// as they typically do (the median of its recent ones), so that its first kernel reaches the
/// GPU about at the start rather than that late; an odd late wake-up does not move it.
#[test]
fn a_turn_after_a_linger_opens_early_by_the_typical_lateness() {
    let mut t = holding(1, 100 * MS);
    let mut end = 121 * MS;
    for token in 2..=11 {
        close(&mut t, end, true);
        let start = token * 100 * MS;
        t.grant(token, start, start + 20 * MS, plan(false), start - 50 * MS);
        let mut w = Waiter::default();
        let Step::Wait { until_ns } = t.admit(start - 50 * MS, &mut w) else {
            panic!("waits for the opening")
        };
        let late = if token == 5 { 5 * MS } else { 100_000 };
        assert_eq!(t.admit(until_ns + late, &mut w), Step::Opened);
        end = start + 21 * MS;
    }
    close(&mut t, end, true);
    let start = 1200 * MS;
    t.grant(12, start, start + 20 * MS, plan(true), start - 50 * MS);
    let mut w = Waiter::default();
    assert_eq!(
        t.admit(start - 50 * MS, &mut w),
        Step::Wait {
            until_ns: start - 100_000
        }
    );
    assert_eq!(t.admit(start - 100_000, &mut w), Step::Opened);
    assert_eq!(t.gate_deadline(), start + 20 * MS);
}

#[test]
fn late_wake_ups_raise_the_lead_up_to_its_bound() {
    let mut t = holding(1, 100 * MS);
    close(&mut t, 121 * MS, true);
    t.grant(2, 200 * MS, 220 * MS, plan(false), 150 * MS);
    let mut w = Waiter::default();
    assert_eq!(t.admit(150 * MS, &mut w), Step::Wait { until_ns: 199 * MS });
    assert_eq!(
        t.admit(200 * MS + MS / 2, &mut w),
        Step::Opened,
        "1.5 ms late"
    );
    assert_eq!(t.lead_ns(), 1_700_000);
    close(&mut t, 221 * MS, true);
    t.grant(3, 300 * MS, 320 * MS, plan(false), 250 * MS);
    let mut w = Waiter::default();
    let Step::Wait { until_ns } = t.admit(250 * MS, &mut w) else {
        panic!("waits for the opening")
    };
    assert_eq!(until_ns, 300 * MS - 1_700_000);
    assert_eq!(t.admit(until_ns + 10 * MS, &mut w), Step::Opened);
    assert_eq!(t.lead_ns(), MAX_LEAD_NS, "bounded");
}

/// Found in review: a revoked turn was reopened by the next launcher (the fast path's deadline
/// was 0, the launcher saw its start passed and opened it again, with the old deadline).
#[test]
fn a_revoked_open_turn_admits_nothing_until_closed_and_reported() {
    let mut t = holding(7, 100 * MS);
    t.revoke(7, true, 105 * MS);
    assert_eq!(t.gate_deadline(), 0, "the fast path stops at once");
    let mut w = Waiter::default();
    assert!(
        matches!(t.admit(105 * MS, &mut w), Step::Wait { .. }),
        "not reopened"
    );
    assert_eq!(
        t.watch(105 * MS, busy(), &mut || Some(MS)),
        Watch::Close {
            yield_at: None,
            busy: true
        }
    );
    close(&mut t, 106 * MS, true);
    assert!(matches!(
        t.take_said().as_slice(),
        [Say::Report {
            token: 7,
            again: true,
            ..
        }]
    ));
}

#[test]
fn a_turn_withdrawn_before_it_opened_is_asked_for_again() {
    let (mut t, mut w) = asked_at_zero();
    t.grant(3, 10 * MS, 30 * MS, plan(false), 0);
    // No launcher waits for it any more: forgotten, the next launcher asks.
    t.revoke(3, false, MS);
    assert_eq!(t.token(), Token::None);
    assert_eq!(t.admit(MS, &mut w), Step::Ask);
    assert!(
        !t.take_said()
            .iter()
            .any(|s| matches!(s, Say::Report { .. })),
        "an unstarted turn is not reported"
    );
}

/// The scheduler withdraws a planned turn to serve a latency-class group first and keeps its
/// process waiting, first in its group: it may grant it a turn again before the launcher that
/// waited would have asked. That grant is taken, not given straight back as unwanted (which
/// would have the scheduler take the process out of its queue, a turn lost each time).
#[test]
fn a_turn_withdrawn_while_a_launcher_waits_is_asked_for_again_and_the_next_grant_taken() {
    let (mut t, mut w) = asked_at_zero();
    t.grant(3, 10 * MS, 30 * MS, plan(false), 0);
    assert!(matches!(t.admit(MS, &mut w), Step::Wait { .. }));
    t.revoke(3, true, 2 * MS);
    assert_eq!(t.token(), Token::Requested);
    assert_eq!(t.take_said(), vec![Say::Acquire], "asked for again at once");
    t.grant(4, 12 * MS, 32 * MS, plan(false), 2 * MS);
    assert!(t.take_said().is_empty(), "neither given back nor reported");
    let Step::Wait { until_ns } = t.admit(2 * MS, &mut w) else {
        panic!("waits for the new turn's opening")
    };
    assert_eq!(t.admit(until_ns, &mut w), Step::Opened);
    assert!(matches!(t.token(), Token::Held(h) if h.token == 4));
}

#[test]
fn a_revocation_or_new_deadline_during_the_drain_only_shortens_it() {
    let mut t = holding(4, 100 * MS);
    let turn = t.begin_close().unwrap();
    assert_eq!(t.closing_deadline(), Some(120 * MS));
    t.deadline(4, 500 * MS, 121 * MS);
    assert_eq!(
        t.closing_deadline(),
        Some(120 * MS),
        "extended: the drain is not"
    );
    t.deadline(4, 115 * MS, 121 * MS);
    assert_eq!(
        t.closing_deadline(),
        Some(115 * MS),
        "cut short: so is the drain"
    );
    t.revoke(4, false, 121 * MS);
    assert_eq!(t.closing_deadline(), Some(1), "revoked: report at once");
    assert_eq!(t.gate_deadline(), 0);
    t.end_close(turn, 122 * MS, false);
    assert_eq!(t.token(), Token::None);
    assert_eq!(
        t.take_said(),
        vec![Say::Report {
            token: 4,
            used: Some(TurnUse {
                first_ns: 100 * MS,
                last_ns: 122 * MS
            }),
            again: false
        }]
    );
}

/// Found with the two-GPU ring: a turn yielded with a long queue estimate (a kernel waiting for
/// its peer) was waited for until the estimate, while the scheduler ends a yielded turn a
/// minimum quota after the yield at most — and revoked it. The drain is bounded from the yield.
#[test]
fn a_yielded_turns_drain_is_bounded_from_the_yield() {
    let mut t = holding(4, 100 * MS);
    let turn = t.begin_close().unwrap();
    t.yield_turn(&turn, 110 * MS, 140 * MS);
    assert_eq!(t.closing_deadline(), Some(110 * MS));
    assert!(matches!(
        t.take_said().as_slice(),
        [Say::Yield {
            token: 4,
            drained_ns
        }] if *drained_ns == 140 * MS
    ));
}

#[test]
fn a_grant_during_the_drain_is_the_next_turn() {
    let mut t = holding(4, 100 * MS);
    let turn = t.begin_close().unwrap();
    t.grant(5, 125 * MS, 145 * MS, plan(false), 120 * MS);
    t.end_close(turn, 121 * MS, true);
    assert!(matches!(t.token(), Token::Held(n) if n.token == 5 && n.opened_ns.is_none()));
    assert_eq!(t.admit(124 * MS, &mut Waiter::default()), Step::Opened);
}

#[test]
fn disconnection_during_the_drain_stands() {
    let mut t = holding(4, 100 * MS);
    let turn = t.begin_close().unwrap();
    assert!(t.disconnected());
    t.end_close(turn, 121 * MS, true);
    assert_eq!(
        t.token(),
        Token::None,
        "no grant will come on this connection"
    );
    t.unthrottled();
    let turn = Turn::new(9, 0, 0, BUDGET);
    t.end_close(turn, 0, false);
    assert_eq!(t.token(), Token::Unthrottled);
    assert_eq!(t.gate_deadline(), UNLIMITED);
}

#[test]
fn a_turn_nobody_wants_is_given_straight_back() {
    let mut t = Turns::new(CFG, LIVENESS);
    t.grant(8, 10 * MS, 30 * MS, plan(false), 5 * MS);
    assert_eq!(
        t.take_said(),
        vec![
            Say::Yield {
                token: 8,
                drained_ns: 5 * MS
            },
            Say::Report {
                token: 8,
                used: None,
                again: false
            }
        ]
    );
}

#[test]
fn an_idle_holder_yields_and_a_bursty_one_is_learnt() {
    let mut t = holding(1, 100 * MS);
    // Launched 10 times, synchronised at 103 ms, nothing since; the work drained.
    assert_eq!(
        t.before_sync(103 * MS, quiet(10)),
        None,
        "nothing learnt yet"
    );
    t.after_sync(104 * MS, 10);
    assert_eq!(
        t.watch(104 * MS, quiet(10), &mut || Some(0)),
        Watch::At(106 * MS),
        "idle release runs from the synchronisation's return"
    );
    given_back_idle(&mut t, 106 * MS, 10);
    assert!(matches!(
        t.take_said().as_slice(),
        [
            Say::Yield { token: 1, .. },
            Say::Report {
                token: 1,
                again: false,
                ..
            }
        ]
    ));
    // Next request: it went idle after synchronising last time, so its next synchronisation
    // hands the turn over at once.
    next_request_opens_turn_2(&mut t);
    assert_eq!(t.before_sync(112 * MS, quiet(20)), Some(2));
    assert_eq!(
        t.before_sync(112 * MS, busy()),
        None,
        "not while another thread launches"
    );
}

/// The next request at 110 ms: asked, granted turn 2 (111–131 ms), opened at 111 ms.
fn next_request_opens_turn_2(t: &mut Turns) {
    let mut w = Waiter::default();
    t.launcher_arrives(110 * MS, 10);
    assert_eq!(t.admit(110 * MS, &mut w), Step::Ask);
    t.asked(true, 110 * MS);
    t.grant(2, 111 * MS, 131 * MS, plan(false), 110 * MS);
    assert_eq!(t.admit(111 * MS, &mut w), Step::Opened);
}

/// The gate lets its lock go between deciding at a synchronisation to give the turn back and
/// closing it (to ask the driver what is queued): the decision holds only for the same turn,
/// still open, with no launcher come since.
#[test]
fn a_turn_given_back_at_a_synchronisation_is_the_one_decided_on() {
    let mut t = holding(1, 100 * MS);
    assert_eq!(t.before_sync(103 * MS, quiet(10)), None);
    t.after_sync(104 * MS, 10);
    given_back_idle(&mut t, 106 * MS, 10);
    t.take_said();
    next_request_opens_turn_2(&mut t);
    assert_eq!(t.before_sync(112 * MS, quiet(20)), Some(2));
    assert!(t.still_gives_back(2, quiet(20)));
    assert!(!t.still_gives_back(2, busy()), "a launcher came meanwhile");
    // Meanwhile turn 2 ended and turn 3 followed it without closing.
    t.grant(3, 131 * MS, 151 * MS, plan(false), 112 * MS);
    assert_eq!(t.watch(131 * MS, busy(), &mut || Some(MS)), Watch::RollOver);
    t.roll_over();
    assert!(
        !t.still_gives_back(2, quiet(20)),
        "turn 3 was never found idle"
    );
}

#[test]
fn going_idle_after_synchronising_is_learnt() {
    let mut t = Turns::new(CFG, LIVENESS);
    assert_eq!(t.learn_after_sync(1, 0), 0, "no synchronisation before");
    t.sync.idled_after = true;
    assert_eq!(t.learn_after_sync(2, 0), IDLE);
    assert_eq!(
        t.learn_after_sync(3, 0),
        IDLE,
        "twice in a row teaches nothing"
    );
    // Launched again after each of the next ones: still expected idle for 8 of them (a
    // request server working through a queue), not after the 9th.
    let scores: Vec<u32> = (1..=9).map(|n| t.learn_after_sync(3 + n, n)).collect();
    assert!(scores[..8].iter().all(|&s| s > IDLE_RECENTLY), "{scores:?}");
    assert!(scores[8] <= IDLE_RECENTLY, "{scores:?}");
    t.sync.idled_after = true;
    assert_eq!(t.learn_after_sync(20, 9), IDLE, "one idle is enough again");
}

/// Idleness counts from a synchronisation's return, not from the launches before it (a paced
/// one may be a whole queue budget earlier) nor from its start: a training loop is not idle
/// the moment the work it synchronises on drains, nor while the host is slow to wake it.
#[test]
fn idleness_counts_from_a_synchronisation_not_the_launches_before_it() {
    let mut t = Turns::new(CFG, LIVENESS);
    t.paced(20, 1_000);
    assert_eq!(t.last_active(9_000, 20, true), (1_000, false));
    t.sync.began_at = 3_000;
    t.sync.launches_at_begin = 20;
    assert_eq!(
        t.last_active(9_000, 20, false),
        (9_000, false),
        "under way, its work not drained: waiting for the GPU"
    );
    assert_eq!(t.last_active(10_000, 20, true), (10_000, false));
    assert_eq!(
        t.last_active(12_000, 20, true),
        (10_000, false),
        "under way: from when its work was first seen drained"
    );
    t.sync.returned_at = 11_000;
    assert_eq!(t.last_active(12_000, 20, true), (11_000, true));
    assert_eq!(
        t.last_active(13_000, 21, true),
        (13_000, false),
        "an unpaced launch since: when the watcher saw it"
    );
}

/// A training loop whose thread the host wakes late from a synchronisation (its work long
/// drained) gives its turn back — the GPU idles — but is not taken for a request server that
/// went idle: its next synchronisations keep the turn.
#[test]
fn a_loop_woken_late_from_a_synchronisation_is_not_learnt_idle() {
    let mut t = holding(1, 100 * MS);
    assert_eq!(t.before_sync(103 * MS, quiet(10)), None);
    // Its work drains at 104 ms; the thread is not run again until 109 ms.
    assert_eq!(
        t.watch(104 * MS, quiet(10), &mut || Some(0)),
        Watch::At(106 * MS)
    );
    given_back_idle(&mut t, 106 * MS, 10);
    t.after_sync(109 * MS, 10);
    let mut w = Waiter::default();
    t.launcher_arrives(109 * MS, 10);
    assert_eq!(t.admit(109 * MS, &mut w), Step::Ask);
    t.asked(true, 109 * MS);
    t.grant(2, 110 * MS, 130 * MS, plan(false), 109 * MS);
    assert_eq!(t.admit(110 * MS, &mut w), Step::Opened);
    assert_eq!(
        t.before_sync(112 * MS, quiet(20)),
        None,
        "not idle after the last synchronisation: keeps its turn"
    );
}

#[test]
fn back_to_back_turns_roll_over_without_closing() {
    let mut t = holding(1, 100 * MS);
    t.grant(2, 120 * MS, 140 * MS, plan(false), 115 * MS);
    assert_eq!(
        t.watch(119 * MS, busy(), &mut || Some(MS)),
        Watch::At(120 * MS)
    );
    assert_eq!(t.watch(120 * MS, busy(), &mut || Some(MS)), Watch::RollOver);
    t.roll_over();
    assert_eq!(t.gate_deadline(), 140 * MS, "open all along");
    assert_eq!(
        t.take_said(),
        vec![Say::Report {
            token: 1,
            used: Some(TurnUse {
                first_ns: 100 * MS,
                last_ns: 120 * MS
            }),
            again: true
        }]
    );
}

#[test]
fn an_extended_turn_is_not_given_back_for_idleness() {
    let mut t = holding(1, 100 * MS);
    t.deadline(1, 200 * MS, 101 * MS);
    assert_eq!(t.gate_deadline(), 200 * MS);
    assert_eq!(
        t.watch(150 * MS, quiet(0), &mut || Some(0)),
        Watch::At(200 * MS - BUDGET)
    );
    // Someone asked: the scheduler cuts the turn short to now.
    t.deadline(1, 150 * MS, 150 * MS);
    assert_eq!(t.gate_deadline(), 0);
}

/// A launcher waiting at `now`, woken at each time the machine names until it is admitted
/// (or `until`); `answer(t)`: whether a probe sent at `t` is answered (at once), and the
/// scheduler's grant, if any, at `grant_at`. When it was admitted, and the probes sent.
fn wait_for_turn(
    t: &mut Turns,
    now: u64,
    until: u64,
    answer: impl Fn(u64) -> bool,
    grant_at: Option<u64>,
) -> (Option<u64>, u32) {
    wait_with_heartbeat(t, now, until, |_| None, answer, grant_at)
}

/// [`wait_for_turn`] with the scheduler's heartbeat: `beat(now)`, the latest beat the launcher
/// reads at `now` (`None`: no heartbeat), before each step.
fn wait_with_heartbeat(
    t: &mut Turns,
    mut now: u64,
    until: u64,
    beat: impl Fn(u64) -> Option<u64>,
    answer: impl Fn(u64) -> bool,
    grant_at: Option<u64>,
) -> (Option<u64>, u32) {
    let mut w = Waiter::default();
    let mut probes = 0;
    while now <= until {
        if grant_at.is_some_and(|g| now >= g) && t.token() == Token::Requested {
            t.grant(99, now, now + 20 * MS, plan(false), now);
        }
        if let Some(at) = beat(now) {
            t.heartbeat(at, now);
        }
        match t.admit(now, &mut w) {
            Step::Ungated | Step::Admit | Step::Opened => return (Some(now), probes),
            Step::Wait { until_ns } => {
                for say in t.take_said() {
                    if say == Say::Probe {
                        probes += 1;
                        if answer(now) {
                            t.alive(now);
                        }
                    }
                }
                assert!(until_ns > now, "a wait that ends at once");
                now = until_ns.min(grant_at.filter(|&g| g > now).unwrap_or(u64::MAX));
            }
            other => panic!("{other:?} while waiting for a turn"),
        }
    }
    (None, probes)
}

/// A machine that asked for a turn at `at`.
fn waiting(cfg: TurnConfig, at: u64) -> Turns {
    let mut t = Turns::new(cfg, LIVENESS);
    assert_eq!(t.admit(at, &mut Waiter::default()), Step::Ask);
    t.asked(true, at);
    t
}

/// A scheduler that answers its probes keeps a launcher waiting as long as the schedule says
/// (other groups' turns): it probes once per half bound of silence, and is never ungated.
#[test]
fn a_live_scheduler_is_probed_and_waited_for() {
    let mut t = waiting(CFG, 0);
    let (admitted, probes) = wait_for_turn(&mut t, 0, 300 * MS, |_| true, Some(300 * MS));
    assert_eq!(
        admitted,
        Some(300 * MS),
        "admitted with its grant, not before"
    );
    assert_eq!(probes, 14, "one per half bound of silence");
    assert!(matches!(t.token(), Token::Held(_)));
}

/// A probe left unanswered for half the bound (the scheduler stopped): a fail-open launcher
/// runs without a turn once the bound has passed since it last heard of the scheduler, and
/// probes on; the scheduler's next word puts it back in the queue for its turn.
#[test]
fn an_unanswered_probe_ungates_a_fail_open_waiter_within_the_bound() {
    let mut t = waiting(CFG, 0);
    let (admitted, probes) = wait_for_turn(&mut t, 0, S, |_| false, None);
    assert_eq!((admitted, probes), (Some(LIVENESS), 1));
    assert_eq!(t.token(), Token::Ungated);
    assert_eq!(t.gate_deadline(), UNLIMITED, "the fast path admits");
    assert!(t.overdue(LIVENESS));
    let mut w = Waiter::default();
    assert_eq!(t.admit(LIVENESS + MS, &mut w), Step::Admit);
    // The watcher probes every bound.
    assert_eq!(
        t.watch(LIVENESS, busy(), &mut || None),
        Watch::At(LIVENESS / 2 + LIVENESS)
    );
    assert_eq!(
        t.watch(LIVENESS / 2 + LIVENESS, busy(), &mut || None),
        Watch::At(LIVENESS / 2 + 2 * LIVENESS)
    );
    assert_eq!(t.take_said(), vec![Say::Probe]);
    // The scheduler is back: the process waits for its turn again, and asks for it.
    t.alive(3 * S);
    assert_eq!(t.token(), Token::Requested);
    assert_eq!(t.gate_deadline(), 0);
    assert!(!t.overdue(3 * S));
    assert_eq!(t.take_said(), vec![Say::Acquire]);
    t.grant(5, 3 * S + MS, 3 * S + 21 * MS, plan(false), 3 * S);
    assert_eq!(t.admit(3 * S + MS, &mut w), Step::Opened);
    // Only the turn it was granted since is ever reported.
    close(&mut t, 3 * S + 21 * MS, false);
    assert!(matches!(
        t.take_said().as_slice(),
        [Say::Report { token: 5, .. }]
    ));
}

/// A grant ends an ungated spell by itself: no second request.
#[test]
fn a_grant_ends_an_ungated_spell() {
    let mut t = waiting(CFG, 0);
    wait_for_turn(&mut t, 0, S, |_| false, None);
    assert_eq!(t.token(), Token::Ungated);
    t.take_said();
    t.grant(3, S, S + 20 * MS, plan(false), S - MS);
    assert!(matches!(t.token(), Token::Held(_)));
    assert_eq!(t.gate_deadline(), 0, "closed until its start");
    assert!(t.take_said().is_empty());
    assert_eq!(t.admit(S, &mut Waiter::default()), Step::Opened);
}

/// A fail-open spell has no turn gate but keeps its queue within the budget of the latest turn
/// granted (the scheduler's default before any): once the scheduler answers, at most that much
/// of its work runs on beside the others' turns. The answer drops the budget with the spell
/// (the process waits for its turn, launching nothing), a grant replaces it with the turn's.
#[test]
fn a_fail_open_spell_keeps_the_latest_turns_queue_budget() {
    // Before any grant: the scheduler's default budget.
    let mut t = waiting(CFG, 0);
    assert_eq!(t.queue_budget(), None, "waiting: no launches to pace");
    wait_for_turn(&mut t, 0, S, |_| false, None);
    assert_eq!(t.token(), Token::Ungated);
    assert_eq!(t.gate_deadline(), UNLIMITED, "no turn gate");
    assert_eq!(t.queue_budget(), Some(CUT_TURN_QUEUE_BUDGET_NS as f64));
    assert_eq!(t.just_in_time(), None);

    // After a turn of a 0.4 ms budget (a latency-class group about): that budget.
    let mut t = holding(1, 100 * MS);
    t.grant(
        1,
        100 * MS,
        120 * MS,
        Plan {
            queue_budget_ns: 400_000,
            ..plan(false)
        },
        100 * MS,
    );
    close(&mut t, 120 * MS, true);
    t.take_said();
    assert_eq!(t.queue_budget(), None);
    let (admitted, _) = wait_for_turn(&mut t, 120 * MS, S, |_| false, None);
    assert_eq!(admitted, Some(120 * MS + LIVENESS));
    assert_eq!(t.queue_budget(), Some(400_000.0));
    // Every launch of the spell sees it: the watcher probing changes nothing.
    let mut w = Waiter::default();
    for at in [200 * MS, 300 * MS, 500 * MS] {
        assert_eq!(t.admit(at, &mut w), Step::Admit);
        t.watch(at, busy(), &mut || None);
        assert_eq!(t.queue_budget(), Some(400_000.0));
    }

    // The scheduler answers: no turn, nothing to pace (launches wait for the grant).
    t.alive(600 * MS);
    assert_eq!(t.token(), Token::Requested);
    assert_eq!(t.queue_budget(), None);
    assert_eq!(t.gate_deadline(), 0);
    // A grant ends a spell with its own budget.
    wait_for_turn(&mut t, 600 * MS, 2 * S, |_| false, None);
    assert_eq!(t.queue_budget(), Some(400_000.0));
    t.grant(7, S, S + 20 * MS, plan(false), S - MS);
    assert_eq!(t.queue_budget(), Some(BUDGET as f64));
    assert_eq!(t.admit(S, &mut w), Step::Opened);
}

/// A fail-open spell ended by the connection closing runs without a scheduler: no limits and no
/// pacing (no schedule to rejoin); the next connection starts without a budget until a turn.
#[test]
fn a_closed_connection_ends_a_spell_and_its_pacing() {
    for unthrottled_at_once in [false, true] {
        let mut t = waiting(CFG, 0);
        wait_for_turn(&mut t, 0, S, |_| false, None);
        assert_eq!(t.queue_budget(), Some(CUT_TURN_QUEUE_BUDGET_NS as f64));
        if !unthrottled_at_once {
            assert!(t.disconnected(), "the gate forgets its queue");
            assert_eq!(t.token(), Token::None);
            assert_eq!(t.queue_budget(), None);
        }
        t.unthrottled();
        assert_eq!(t.gate_deadline(), UNLIMITED);
        assert_eq!(t.queue_budget(), None, "no scheduler: unpaced");
        t.connected(2 * S);
        assert_eq!(t.token(), Token::None);
        assert_eq!(t.queue_budget(), None);
        assert_eq!(t.gate_deadline(), 0);
    }
}

/// Fail-closed, a process the scheduler owes an answer launches nothing: no budget either.
#[test]
fn fail_closed_overdue_has_no_budget() {
    let cfg = TurnConfig {
        fail_open: false,
        ..CFG
    };
    let mut t = waiting(cfg, 0);
    wait_for_turn(&mut t, 0, 2 * LIVENESS, |_| false, None);
    assert!(t.overdue(2 * LIVENESS));
    assert_eq!((t.gate_deadline(), t.queue_budget()), (0, None));
}

/// Fail-closed: the launcher waits on past the bound, for the scheduler, and goes on with the
/// grant when it comes.
#[test]
fn fail_closed_waits_for_the_scheduler() {
    let cfg = TurnConfig {
        fail_open: false,
        ..CFG
    };
    let mut t = waiting(cfg, 0);
    let (admitted, probes) = wait_for_turn(&mut t, 0, 3 * S, |_| false, Some(3 * S));
    assert_eq!(admitted, Some(3 * S));
    assert!(probes >= 1);
    assert!(matches!(t.token(), Token::Held(_)));
}

/// Wherever a freeze of the scheduler begins — before the request, during a wait, just after
/// a probe — a fail-open launcher waits at most the bound for it beyond what the schedule
/// made it wait.
#[test]
fn a_frozen_scheduler_blocks_a_waiter_at_most_the_bound() {
    let mut rng = Rng::new(7);
    for _ in 0..2_000 {
        let asked = rng.below(100 * MS);
        let frozen = rng.below(400 * MS);
        let mut t = waiting(CFG, asked);
        let (admitted, _) = wait_for_turn(&mut t, asked, 10 * S, |at| at < frozen, None);
        let admitted = admitted.expect("admitted");
        assert!(
            admitted <= asked.max(frozen) + LIVENESS,
            "asked at {asked}, frozen at {frozen}: admitted at {admitted}"
        );
        assert!(admitted >= frozen, "ungated while the scheduler answered");
    }
}

/// Answers slower than half the bound but within it still count: a starved scheduler keeps
/// its waiters.
#[test]
fn a_slow_answer_within_the_bound_keeps_the_waiter_waiting() {
    let mut t = waiting(CFG, 0);
    let mut w = Waiter::default();
    let mut now = 0;
    for _ in 0..50 {
        let Step::Wait { until_ns } = t.admit(now, &mut w) else {
            panic!("ungated by a live scheduler")
        };
        if t.take_said().contains(&Say::Probe) {
            // Answered just before the bound runs out.
            t.alive(now + LIVENESS / 2 - 1);
        }
        now = until_ns;
    }
    assert_eq!(t.token(), Token::Requested);
}

/// The heartbeat of a scheduler whose loop runs every quarter of the bound (or more often):
/// the beat at `now`, `late` after its due time.
fn beating(now: u64, late: u64) -> u64 {
    let quarter = LIVENESS / 4;
    (now.saturating_sub(late) / quarter * quarter + late).min(now)
}

/// A scheduler whose heartbeat runs stands in for all but one probe every
/// [`SPARSE_PROBE_NS`] without a word: the launcher waits as long as the schedule says, and
/// is never ungated, however late in its quarter each beat is.
#[test]
fn a_running_heartbeat_stands_in_for_probes() {
    for late in [0, MS, LIVENESS / 4 - 1] {
        let mut t = waiting(CFG, 3 * MS);
        let (admitted, probes) = wait_with_heartbeat(
            &mut t,
            3 * MS,
            2 * S,
            |now| Some(beating(now, late)),
            |at| {
                assert_eq!(at % SPARSE_PROBE_NS, 0, "a probe at {at} while beats come");
                true
            },
            Some(2 * S),
        );
        assert_eq!((admitted, probes), (Some(2 * S), 3), "late {late}");
        assert!(matches!(t.token(), Token::Held(_)));
    }
}

/// A fresh heartbeat with the connection's round trip broken (the scheduler's loop runs, but
/// this process's probes are never answered: its writer or reader stuck, or the loop
/// neglecting this connection): the sparse probe goes unanswered, and the waiter is ungated
/// (fail-open) within [`SPARSE_PROBE_NS`] and the bound of the last word, wherever the
/// request and the last word fall; fail-closed, it is overdue as soon.
#[test]
fn a_fresh_heartbeat_without_answers_ungates_within_the_sparse_interval_and_the_bound() {
    let mut rng = Rng::new(31);
    for _ in 0..2_000 {
        let heard = rng.below(S);
        let asked = heard + rng.below(SPARSE_PROBE_NS + LIVENESS);
        let mut t = Turns::new(CFG, LIVENESS);
        t.connected(heard);
        assert_eq!(t.admit(asked, &mut Waiter::default()), Step::Ask);
        t.asked(true, asked);
        let (admitted, probes) = wait_with_heartbeat(&mut t, asked, 10 * S, Some, |_| false, None);
        let admitted = admitted.expect("admitted");
        // The sparse probe, or half the bound after a request sent that late.
        let probed = (heard + SPARSE_PROBE_NS).max(asked + LIVENESS / 2);
        assert!(
            admitted <= probed + LIVENESS / 2,
            "heard at {heard}, asked at {asked}: admitted at {admitted}"
        );
        assert!(
            admitted >= heard + SPARSE_PROBE_NS,
            "ungated at {admitted} while beats came"
        );
        assert_eq!(probes, 1);
        assert_eq!(t.token(), Token::Ungated);
    }
    let closed = TurnConfig {
        fail_open: false,
        ..CFG
    };
    let mut t = waiting(closed, 0);
    let (admitted, _) = wait_with_heartbeat(&mut t, 0, 2 * S, Some, |_| false, None);
    assert_eq!(admitted, None, "fail-closed waits on");
    assert!(t.overdue(SPARSE_PROBE_NS + LIVENESS));
}

/// A heartbeat that stops (the scheduler frozen, or starved of CPU): the launcher probes half
/// the bound after the last beat and, unanswered, is ungated (fail-open) once the bound has
/// passed since the last sign of the scheduler, wherever the stop falls: the bound as without
/// a heartbeat. A probe out is ended by its answer, not by a beat.
#[test]
fn a_stopped_heartbeat_is_probed_and_ungates_within_the_bound() {
    let mut rng = Rng::new(11);
    for _ in 0..2_000 {
        let asked = rng.below(100 * MS);
        let frozen = rng.below(400 * MS);
        let late = rng.below(LIVENESS / 4);
        let mut t = waiting(CFG, asked);
        let beat = |now: u64| Some(beating(now.min(frozen), late));
        let (admitted, probes) =
            wait_with_heartbeat(&mut t, asked, 10 * S, beat, |at| at < frozen, None);
        let admitted = admitted.expect("admitted");
        let last_sign = asked.max(beating(frozen, late));
        assert!(
            admitted <= last_sign + LIVENESS,
            "asked at {asked}, frozen at {frozen}: admitted at {admitted}"
        );
        assert!(admitted >= frozen, "ungated while the scheduler ran");
        assert_eq!(probes, 1, "one probe, after the heartbeat stopped");
        assert_eq!(t.token(), Token::Ungated);
    }
    // A beat after a probe went out does not answer it: ungated at the bound all the same.
    let mut t = waiting(CFG, 0);
    let (admitted, probes) = wait_with_heartbeat(
        &mut t,
        0,
        S,
        |now| (now > LIVENESS / 2).then_some(now),
        |_| false,
        None,
    );
    assert_eq!((admitted, probes), (Some(LIVENESS), 1));
}

/// Without a heartbeat (none published, or a page that could not be mapped) the waiter probes
/// every half bound of silence; a beat more than [`BEAT_SLACK_NS`] ahead of its own clock
/// (from a clock it does not share) is not trusted, one within it is.
#[test]
fn without_a_trusted_heartbeat_the_waiter_probes() {
    let mut t = waiting(CFG, 0);
    let (_, probes) = wait_with_heartbeat(&mut t, 0, 300 * MS, |_| None, |_| true, Some(300 * MS));
    assert_eq!(probes, 14, "one per half bound of silence");

    let mut t = waiting(CFG, 0);
    let ahead = |now: u64| Some(now + BEAT_SLACK_NS + 1);
    let (admitted, probes) = wait_with_heartbeat(&mut t, 0, S, ahead, |_| false, None);
    assert_eq!((admitted, probes), (Some(LIVENESS), 1));

    let mut t = waiting(CFG, 0);
    let slack = |now: u64| Some(now + BEAT_SLACK_NS);
    let (admitted, probes) = wait_with_heartbeat(&mut t, 0, S, slack, |_| false, None);
    // Its sparse probe half a bound after the request sent again at 0.5 s, ungated half a
    // bound later.
    assert_eq!((admitted, probes), (Some(SPARSE_PROBE_NS + LIVENESS), 1));
}

/// A request left without a grant (its probes answered) is sent again after a while: the
/// scheduler may have taken this process for a stopped one.
#[test]
fn a_request_without_a_grant_is_sent_again() {
    let mut t = waiting(CFG, 0);
    wait_for_turn(&mut t, 0, ASK_AGAIN_NS - 1, |_| true, None);
    let mut w = Waiter::default();
    t.take_said();
    t.admit(ASK_AGAIN_NS, &mut w);
    assert_eq!(t.take_said().first(), Some(&Say::Acquire));
}

#[test]
fn pacing_keeps_the_queue_within_the_budget() {
    let budget = 2_500_000.0;
    for est in [
        10.0,
        1_000.0,
        100_000.0,
        400_000.0,
        1_000_000.0,
        1_250_000.0,
    ] {
        let (k, wait_above) = pacing(budget, est);
        // The most a launcher leaves queued when it stops waiting, plus K more launches.
        let most = (wait_above / est).floor() + k as f64;
        assert!(
            most * est <= budget,
            "{est} ns per launch: K {k}, up to {} ns queued",
            most * est
        );
        assert!(
            k == 4096 || k as f64 * est >= budget / 2.0 - est,
            "K {k} too small"
        );
    }
    assert_eq!(queue_budget_within(2_500_000), 2_500_000);
    assert_eq!(queue_budget_within(0), 100_000);
    assert_eq!(queue_budget_within(u64::MAX), 10_000_000);
}

/// A trainer launching 1 ms kernels back to back just in time (queue budget 0.25 ms), its
/// launcher waking up to 0.2 ms late, or, on busier hosts, up to 0.45 or 0.7 ms: the GPU never
/// idles (up to 0.5 % of the time with the later wake-ups), a launch never finds more than the
/// budget and the lateness queued before it, and a kernel waits queued behind the running one
/// for at most (budget + lateness) / kernel of the time (launched as soon as the fences let it,
/// one kernel behind the running one, a kernel would wait queued all the time). Waking up to
/// 1.5 ms late, the launcher aims at most one kernel ahead: never more queued than the fences
/// would leave.
#[test]
fn launching_just_in_time_keeps_the_gpu_busy_with_one_kernel_queued() {
    const KERNEL: u64 = MS;
    const B: u64 = MS / 4;
    for late in [MS / 5, 450_000, 700_000, 1_500_000] {
        let mut rng = Rng::new(7);
        let mut runway = Runway::default();
        // When the GPU's work ends; its idle time; the time kernels waited queued.
        let (mut gpu_end, mut idle, mut waiting) = (0u64, 0u64, 0u64);
        let (mut now, mut n) = (0u64, 0u64);
        let mut waited_for = None;
        while n < 2000 {
            if let Some(at) = runway.launch_at(now, B as f64, KERNEL as f64) {
                assert!(at > now);
                now = at + rng.below(late);
                waited_for = Some(at);
                continue;
            }
            if let Some(at) = waited_for.take() {
                runway.woke(at, now);
            }
            let queued = gpu_end.saturating_sub(now);
            assert!(
                queued <= (B + late).min(KERNEL),
                "launch {n} at {now} behind {queued} ns queued (lateness up to {late} ns)"
            );
            if n > 10 {
                idle += now.saturating_sub(gpu_end);
            }
            waiting += queued;
            gpu_end = gpu_end.max(now) + KERNEL;
            n += 1;
            runway.launched(now, n, KERNEL as f64);
            // The next launch call comes right after.
            now += 1_000;
        }
        if late >= KERNEL - B {
            continue;
        }
        // Up to a budget late, never idle; later, hardly ever (when a run of prompt wake-ups
        // has lowered the margin).
        let most = if late <= B { 0 } else { gpu_end / 200 };
        assert!(
            idle <= most,
            "the GPU idled {idle} ns (lateness up to {late} ns)"
        );
        let share = waiting as f64 / gpu_end as f64;
        assert!(share <= (B + late) as f64 / KERNEL as f64, "{share}");
        assert!(share > 0.0);
    }
}

/// A launcher launching 1 ms kernels just in time (queue budget 0.25 ms) that wakes 50 us late,
/// and 0.6 ms late once every 100 wake-ups (a busy host): the late wake-up is remembered until
/// the next, so that the GPU does not idle at each (at most 0.05 % of the time).
#[test]
fn launching_just_in_time_remembers_a_late_wake_up_until_the_next() {
    const KERNEL: u64 = MS;
    const B: u64 = MS / 4;
    let mut runway = Runway::default();
    let (mut gpu_end, mut idle) = (0u64, 0u64);
    let (mut now, mut n, mut wakes) = (0u64, 0u64, 0u64);
    let mut waited_for = None;
    while n < 5000 {
        if let Some(at) = runway.launch_at(now, B as f64, KERNEL as f64) {
            wakes += 1;
            now = at + if wakes % 100 == 0 { 600_000 } else { 50_000 };
            waited_for = Some(at);
            continue;
        }
        if let Some(at) = waited_for.take() {
            runway.woke(at, now);
        }
        if n > 10 {
            idle += now.saturating_sub(gpu_end);
        }
        gpu_end = gpu_end.max(now) + KERNEL;
        n += 1;
        runway.launched(now, n, KERNEL as f64);
        now += 1_000;
    }
    assert!(wakes > 4000, "{wakes}");
    assert!(idle <= gpu_end / 2000, "the GPU idled {idle} ns");
}

/// Kernels no longer than half the budget are left to the fences (they keep the queue within
/// it); a GPU found behind the runway (the turn's first kernels queued behind the previous
/// holder's) moves it; a drain empties it.
#[test]
fn the_runway_waits_only_for_long_kernels_and_follows_the_gpu() {
    const B: f64 = 250_000.0;
    let mut r = Runway::default();
    r.launched(0, 3, 100_000.0);
    assert_eq!(r.launch_at(0, B, 100_000.0), None, "short kernels");
    r.drained(3);
    r.launched(10 * MS, 4, MS as f64);
    assert_eq!(r.launch_at(10 * MS, B, MS as f64), Some(10 * MS + 750_000));
    // The GPU reached that kernel's fence only at 12 ms, one kernel queued after it.
    r.reached(12 * MS, MS);
    assert_eq!(r.launch_at(12 * MS, B, MS as f64), Some(13 * MS - 250_000));
    assert_eq!(r.launch_at(13 * MS, B, MS as f64), None);
    r.drained(5);
    assert_eq!(r.launch_at(12 * MS, B, MS as f64), None);
    // Launches already drained are not counted again.
    r.launched(20 * MS, 5, MS as f64);
    assert_eq!(r.launch_at(20 * MS, B, MS as f64), None);
}

/// A grant says whether the turn's long kernels go just in time; a moved grant may change it.
#[test]
fn a_grant_says_whether_to_launch_just_in_time() {
    let mut t = Turns::new(CFG, LIVENESS);
    assert_eq!(t.admit(0, &mut Waiter::default()), Step::Ask);
    t.asked(true, 0);
    let jit = Plan {
        just_in_time: true,
        ..plan(false)
    };
    t.grant(1, MS, 21 * MS, jit, 0);
    assert_eq!(t.just_in_time(), Some(BUDGET as f64));
    t.grant(1, MS, 21 * MS, plan(false), 0);
    assert_eq!(t.just_in_time(), None);
    assert_eq!(t.queue_budget(), Some(BUDGET as f64));
}

/// A seeded generator of a fixed algorithm, so the random runs repeat exactly.
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(SplitMix64::seed_from_u64(seed))
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        self.0.random_range(0..n)
    }
}

/// Random interleavings, thousands of turns each: a scheduler that grants ahead, moves, cuts
/// short, extends, revokes and withdraws turns at random; launchers, a watcher, drains that
/// end before or after other events, synchronisations and disconnections; and a scheduler that
/// beats and answers probes, and stops for a while now and then (its heartbeat with it; its
/// waiters ungated). Invariants:
/// - the fast path's deadline is non-zero only while a turn is open (or without limits);
/// - launches are paced while a turn is held or through a fail-open spell, not otherwise;
/// - nothing is admitted in a turn stopped, closed or not yet opened;
/// - a turn that opens at its start (after a latency-class group's linger) never opens
///   before it;
/// - every turn that opened is reported exactly once, with its first launch, after it opened;
/// - an unopened turn is reported (unused) only when given back;
/// - no report for a token this process never held.
#[test]
fn random_interleavings_keep_every_invariant() {
    for seed in 1..=40u64 {
        let mut rng = Rng::new(seed);
        let mut t = Turns::new(CFG, LIVENESS);
        let mut now = MS;
        let mut next_token = 1u64;
        let mut granted: HashMap<u64, u64> = HashMap::new(); // token → start
        let mut opened: HashMap<u64, u64> = HashMap::new(); // token → opened at
        let mut reported: HashMap<u64, u32> = HashMap::new();
        let mut draining: Option<Turn> = None;
        let mut launches = 0u64;
        let mut waiter = Waiter::default();
        let mut turns_opened = 0u32;
        let mut lost: Vec<u64> = Vec::new();
        let mut epoch = 1u64;
        let mut spells = 0u32;
        for _ in 0..20_000 {
            now += rng.below(2 * MS);
            // The scheduler stops for the last quarter of every 2 s: it says nothing.
            let stopped = now % (2 * S) >= 3 * S / 2;
            match rng.below(13) {
                0..=4 if stopped => {}
                0 | 1 => {
                    let start = now + rng.below(8 * MS);
                    t.grant(
                        next_token,
                        start,
                        start + 1 + rng.below(20 * MS),
                        plan(rng.below(2) == 0),
                        now,
                    );
                    granted.insert(next_token, start);
                    next_token += 1;
                }
                2 => {
                    // Move a planned or held turn (same token).
                    let token = next_token.saturating_sub(1 + rng.below(2));
                    if token >= epoch
                        && let Some(&s) = granted.get(&token)
                    {
                        let start = s.min(now + rng.below(4 * MS));
                        let end = start + 1 + rng.below(20 * MS);
                        t.grant(token, start, end, plan(rng.below(2) == 0), now);
                    }
                }
                3 => {
                    let token = next_token.saturating_sub(1 + rng.below(3));
                    // A launcher waits for it if the last one was told to wait for its opening.
                    t.revoke(token, waiter.waited_for.is_some(), now);
                }
                4 => {
                    let token = next_token.saturating_sub(1 + rng.below(3));
                    let d = if rng.below(2) == 0 {
                        now
                    } else {
                        now + rng.below(40 * MS)
                    };
                    t.deadline(token, d, now);
                }
                5..=7 => {
                    t.launcher_arrives(now, launches);
                    let early = t.typical_lateness_ns();
                    match t.admit(now, &mut waiter) {
                        Step::Admit | Step::Opened => {
                            let Token::Held(h) = t.token() else {
                                assert!(
                                    matches!(t.token(), Token::Unthrottled | Token::Ungated),
                                    "seed {seed}: {:?}",
                                    t.token()
                                );
                                continue;
                            };
                            assert!(h.is_open(), "admitted outside an open turn: {h:?}");
                            assert!(
                                !(h.open_at_start && h.opened_ns == Some(now))
                                    || now + early >= h.start_ns,
                                "opened before the start of a turn opening at its start (less \
                                 the typical lateness {early}): {h:?}"
                            );
                            if let Some(o) = h.opened_ns
                                && opened.insert(h.token, o).is_none()
                            {
                                turns_opened += 1;
                            }
                            launches += 1;
                        }
                        Step::Ask => t.asked(rng.below(10) != 0, now),
                        Step::Ungated => {
                            assert_eq!(t.gate_deadline(), UNLIMITED);
                            spells += 1;
                        }
                        Step::Refuse | Step::Wait { .. } => {}
                    }
                }
                8 | 9 => {
                    if draining.is_none() {
                        let a = Activity {
                            launches,
                            quiet: rng.below(2) == 0,
                            waiters: rng.below(2) as u32,
                        };
                        let q = rng.below(3 * MS);
                        match t.watch(now, a, &mut || Some(q)) {
                            Watch::Close { yield_at, .. } => {
                                draining = t.begin_close();
                                let turn = draining.as_ref().expect("a turn to close");
                                if let Some(at) = yield_at {
                                    t.yield_turn(turn, at, at + q);
                                }
                            }
                            Watch::RollOver => {
                                t.roll_over();
                                if let Token::Held(h) = t.token() {
                                    opened.insert(h.token, h.opened_ns.unwrap());
                                    turns_opened += 1;
                                }
                            }
                            Watch::At(_) | Watch::Nothing => {}
                        }
                    }
                }
                10 => {
                    if let Some(turn) = draining.take() {
                        t.end_close(turn, now, rng.below(2) == 0);
                    }
                }
                11 => {
                    if t.before_sync(now, quiet(launches)).is_some() && draining.is_none() {
                        draining = t.begin_close();
                        t.yield_turn(draining.as_ref().expect("open"), now, now);
                    }
                    t.after_sync(now + rng.below(MS), launches);
                }
                _ => match rng.below(20) {
                    0 | 1 => {
                        // The connection (and the scheduler's view of its turns) is gone.
                        if let Token::Held(h) = t.token() {
                            lost.push(h.token);
                        }
                        // The next scheduler's turns are new ones.
                        epoch = next_token;
                        if rng.below(2) == 0 {
                            t.disconnected();
                        } else {
                            t.unthrottled();
                        }
                    }
                    2 => {
                        // A new connection: its scheduler's turns are new ones.
                        t.connected(now);
                        epoch = next_token;
                    }
                    3..=5 if !stopped => t.alive(now),
                    // Its heartbeat, read a while after the beat.
                    6..=9 if !stopped => {
                        t.heartbeat(now.saturating_sub(rng.below(LIVENESS / 4)), now)
                    }
                    _ => {}
                },
            }
            let d = t.gate_deadline();
            match t.token() {
                Token::Held(h) if h.is_open() => assert_eq!(d, h.deadline_ns.max(1)),
                Token::Unthrottled | Token::Ungated => assert_eq!(d, UNLIMITED),
                other => assert_eq!(d, 0, "seed {seed}: {other:?}"),
            }
            // Paced while a turn is held or through a fail-open spell (the latest budget
            // granted), never without a scheduler or while waiting.
            let budget = t.queue_budget();
            match t.token() {
                Token::Held(h) => assert_eq!(budget, Some(h.queue_budget_ns as f64)),
                Token::Ungated => assert_eq!(budget, Some(t.spell_budget_ns as f64)),
                other => assert_eq!(budget, None, "seed {seed}: {other:?}"),
            }
            for say in t.take_said() {
                if let Say::Report { token, used, .. } = say {
                    assert!(granted.contains_key(&token), "seed {seed}: unknown {token}");
                    *reported.entry(token).or_default() += 1;
                    match (used, opened.get(&token)) {
                        (Some(u), Some(&o)) => {
                            assert_eq!(u.first_ns, o, "seed {seed}: first launch of {token}");
                            assert!(u.last_ns >= o, "seed {seed}: {u:?}");
                        }
                        (None, None) => {}
                        (u, o) => panic!("seed {seed}: token {token} used {u:?}, opened {o:?}"),
                    }
                }
            }
        }
        assert!(
            reported.values().all(|&n| n == 1),
            "seed {seed}: a turn reported twice: {:?}",
            reported.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
        );
        for token in opened.keys().filter(|k| !reported.contains_key(k)) {
            let current = matches!(t.token(), Token::Held(h) if h.token == *token)
                || draining.is_some_and(|d| d.token == *token);
            assert!(
                current || lost.contains(token),
                "seed {seed}: turn {token} opened, never reported"
            );
        }
        assert!(turns_opened > 200, "seed {seed}: only {turns_opened} turns");
        assert!(spells > 5, "seed {seed}: only {spells} fail-open spells");
    }
}
