//! The overcommit core's rules one by one, then random mixes of groups replayed in virtual
//! time against invariants (books within the GPU, victims as the rules allow, refusals only
//! when nothing could make room, restores only when the memory is there, every allocation
//! decided and every group that wants to run resident within bounded time).

use super::*;
use proptest::prelude::*;

const GIB: Bytes = 1 << 30;
const MS: Nanos = 1_000_000;
const S: Nanos = 1_000_000_000;

/// Swaps that cost nothing beyond the waits and turns the rules set (the random mixes give
/// their own costs).
fn params() -> Params {
    Params {
        alloc_wait_ns: 100 * MS,
        window_ns: 5 * S,
        memory_turn_ns: S,
        retry_after_ns: S,
        max_wait_ns: 3600 * S,
        swap_cost: SwapCost {
            latency_ns: 0,
            checkpoint_bytes_per_s: 1e15,
            restore_bytes_per_s: 1e15,
        },
        exit_release_ns: 50 * MS,
    }
}

/// A node with one GPU of `capacity` and `n` groups of one process each (group i, process i).
fn node(capacity: Bytes, n: u64) -> Overcommit {
    let mut o = Overcommit::new(params(), vec![capacity]);
    for i in 0..n {
        o.attach(ProcessId(i), GroupId(i));
    }
    o
}

fn grant(o: &mut Overcommit, now: Nanos, p: u64, bytes: Bytes) {
    let e = o.request(now, RequestId(1000 + p), ProcessId(p), 0, bytes);
    assert_eq!(e, vec![Effect::Grant(RequestId(1000 + p))], "{o:#?}");
}

fn swap_outs(e: &[Effect]) -> Vec<(SwapId, GroupId)> {
    e.iter()
        .filter_map(|e| match e {
            Effect::SwapOut { swap, group, .. } => Some((*swap, *group)),
            _ => None,
        })
        .collect()
}

fn swap_ins(e: &[Effect]) -> Vec<(SwapId, GroupId)> {
    e.iter()
        .filter_map(|e| match e {
            Effect::SwapIn { swap, group, .. } => Some((*swap, *group)),
            _ => None,
        })
        .collect()
}

#[test]
fn an_allocation_that_fits_is_granted_at_once_and_one_that_does_not_waits() {
    let mut o = node(10 * GIB, 2);
    grant(&mut o, 0, 0, 8 * GIB);
    assert_eq!(o.request(0, RequestId(1), ProcessId(1), 0, 4 * GIB), vec![]);
    assert_eq!(o.waiting().len(), 1);
    assert_eq!(o.next_wakeup(0), Some(100 * MS));
    // Memory freed within the wait serves it, no swap.
    let e = o.free(50 * MS, ProcessId(0), 0, 2 * GIB);
    assert_eq!(e, vec![Effect::Grant(RequestId(1))]);
    assert_eq!(o.books(0).used, 10 * GIB);
    assert_eq!(o.counters().swap_outs, 0);
}

#[test]
fn an_allocation_waits_no_longer_than_the_bound_then_is_refused_saying_why() {
    let mut o = Overcommit::new(
        Params {
            max_wait_ns: 500 * MS,
            ..params()
        },
        vec![10 * GIB],
    );
    for i in 0..2 {
        o.attach(ProcessId(i), GroupId(i));
    }
    grant(&mut o, 0, 0, 8 * GIB);
    o.request(0, RequestId(1), ProcessId(1), 0, 4 * GIB);
    assert_eq!(swap_outs(&o.tick(100 * MS)), vec![(SwapId(1), GroupId(0))]);
    // The only victim's checkpoint times out: it cools down past the bound.
    assert_eq!(
        o.swapped_out(150 * MS, SwapId(1), Err(SwapOutFailure::TimedOut)),
        vec![]
    );
    assert_eq!(o.next_wakeup(150 * MS), Some(500 * MS));
    assert_eq!(o.tick(499 * MS), vec![]);
    let e = o.tick(500 * MS);
    let [Effect::Refuse(RequestId(1), r @ Refusal::WaitedTooLong { .. })] = e.as_slice() else {
        panic!("{e:?}");
    };
    let text = r.describe(&|g| g.0.to_string());
    assert!(text.contains("within 0.5 s"), "{text}");
    assert!(o.waiting().is_empty());
    assert_eq!(o.next_wakeup(500 * MS), None);
}

#[test]
fn a_cancelled_request_stops_waiting() {
    let mut o = node(10 * GIB, 2);
    grant(&mut o, 0, 0, 8 * GIB);
    o.request(0, RequestId(1), ProcessId(1), 0, 4 * GIB);
    assert_eq!(o.cancel(10 * MS, RequestId(1)), vec![]);
    assert!(o.waiting().is_empty());
    assert_eq!(o.tick(100 * MS), vec![], "no swap for a request gone");
}

#[test]
fn when_the_wait_runs_out_a_victim_is_swapped_out_and_the_asker_served_once_it_is_gone() {
    let mut o = node(10 * GIB, 2);
    grant(&mut o, 0, 0, 8 * GIB);
    o.request(0, RequestId(1), ProcessId(1), 0, 4 * GIB);
    let e = o.tick(100 * MS);
    assert_eq!(swap_outs(&e), vec![(SwapId(1), GroupId(0))]);
    assert!(
        !o.resident(GroupId(0)),
        "no turns while it is being swapped out"
    );
    assert_eq!(
        o.books(0).used,
        8 * GIB,
        "the memory is free only once the swap is done"
    );
    let e = o.swapped_out(600 * MS, SwapId(1), Ok(()));
    assert_eq!(e, vec![Effect::Grant(RequestId(1))]);
    assert_eq!(
        o.books(0),
        GpuBooks {
            capacity: 10 * GIB,
            used: 4 * GIB,
            swapped: 8 * GIB
        }
    );
}

#[test]
fn the_asker_is_never_its_own_victim_and_a_request_that_can_never_fit_is_refused_with_why() {
    let mut o = node(10 * GIB, 2);
    o.attach(ProcessId(5), GroupId(1));
    grant(&mut o, 0, 1, 7 * GIB);
    o.request(0, RequestId(1), ProcessId(5), 0, 4 * GIB);
    let e = o.tick(100 * MS);
    match &e[..] {
        [Effect::Refuse(RequestId(1), Refusal::NeverFits { own, .. })] => {
            assert_eq!(*own, 7 * GIB)
        }
        other => panic!("{other:?}"),
    }
    let text = Refusal::NeverFits {
        bytes: 4 * GIB,
        capacity: 10 * GIB,
        own: 7 * GIB,
        unswappable: vec![(GroupId(3), Unswappable::Managed, GIB)],
    }
    .describe(&|g| format!("\"g{}\"", g.0));
    assert!(
        text.contains("group \"g3\" holds 1024 MiB of managed memory")
            && text.contains("lower the group's memory cap"),
        "{text}"
    );
}

#[test]
fn groups_with_memory_the_driver_cannot_checkpoint_are_never_victims() {
    let mut o = node(10 * GIB, 3);
    grant(&mut o, 0, 0, 5 * GIB);
    grant(&mut o, 0, 1, 4 * GIB);
    o.mark_unswappable(0, ProcessId(0), Unswappable::Managed);
    o.request(0, RequestId(1), ProcessId(2), 0, 3 * GIB);
    let e = o.tick(100 * MS);
    assert_eq!(
        swap_outs(&e),
        vec![(SwapId(1), GroupId(1))],
        "not the managed group"
    );
    o.swapped_out(200 * MS, SwapId(1), Ok(()));
    // 6 GiB now: 5 of them managed, the asker's 3 and 1 free; a further 4 GiB for group 2 can
    // never fit.
    o.request(300 * MS, RequestId(2), ProcessId(2), 0, 4 * GIB);
    let e = o.tick(400 * MS);
    match &e[..] {
        [Effect::Refuse(RequestId(2), Refusal::NeverFits { unswappable, .. })] => {
            assert_eq!(
                unswappable,
                &vec![(GroupId(0), Unswappable::Managed, 5 * GIB)]
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn victims_are_chosen_by_turn_priority_weight_memory_and_last_run() {
    // Five groups of 2 GiB each on 10 GiB; group 5 asks for 2 GiB: one victim.
    let victim = |setup: &dyn Fn(&mut Overcommit)| {
        let mut o = node(10 * GIB, 6);
        for p in 0..5 {
            grant(&mut o, 0, p, 2 * GIB);
        }
        setup(&mut o);
        o.request(0, RequestId(1), ProcessId(5), 0, 2 * GIB);
        let e = o.tick(100 * MS);
        let v = swap_outs(&e);
        assert_eq!(v.len(), 1, "{e:?}");
        v[0].1
    };
    // All equal: the one that ran least recently.
    assert_eq!(
        victim(&|o| {
            for g in 0..5 {
                o.ran(GroupId(g), 10 + g);
            }
            o.ran(GroupId(0), 50);
        }),
        GroupId(1)
    );
    // Not holding a turn comes first, whatever else.
    assert_eq!(
        victim(&|o| {
            for g in 0..5 {
                if g != 3 {
                    o.set_turn(GroupId(g), 0, true);
                }
            }
        }),
        GroupId(3)
    );
    // Then lower priority, then lower weight.
    assert_eq!(
        victim(&|o| {
            for g in 0..5 {
                o.set_group(
                    GroupId(g),
                    GroupRank {
                        priority: 1,
                        weight: 1.0,
                    },
                );
            }
            o.set_group(
                GroupId(4),
                GroupRank {
                    priority: 0,
                    weight: 9.0,
                },
            );
        }),
        GroupId(4)
    );
    assert_eq!(
        victim(&|o| o.set_group(
            GroupId(2),
            GroupRank {
                priority: 0,
                weight: 0.5
            }
        )),
        GroupId(2)
    );
}

#[test]
fn the_fewest_victims_that_make_room_holding_more_memory_first() {
    let mut o = node(10 * GIB, 4);
    grant(&mut o, 0, 0, GIB);
    grant(&mut o, 0, 1, 3 * GIB);
    grant(&mut o, 0, 2, 6 * GIB);
    o.request(0, RequestId(1), ProcessId(3), 0, 5 * GIB);
    let e = o.tick(100 * MS);
    assert_eq!(
        swap_outs(&e),
        vec![(SwapId(1), GroupId(2))],
        "one victim suffices"
    );
}

#[test]
fn a_swapped_group_comes_back_as_soon_as_its_memory_fits() {
    let mut o = node(10 * GIB, 2);
    grant(&mut o, 0, 0, 8 * GIB);
    o.request(0, RequestId(1), ProcessId(1), 0, 4 * GIB);
    o.tick(100 * MS);
    o.swapped_out(200 * MS, SwapId(1), Ok(()));
    let c = o.counters();
    assert_eq!((c.swap_out_bytes, c.swap_in_bytes), (8 * GIB, 0));
    assert!(swap_ins(&o.free(300 * MS, ProcessId(1), 0, GIB)).is_empty());
    let e = o.free(400 * MS, ProcessId(1), 0, 3 * GIB);
    assert_eq!(swap_ins(&e), vec![(SwapId(1), GroupId(0))]);
    let c = o.counters();
    assert_eq!((c.swap_out_bytes, c.swap_in_bytes), (8 * GIB, 8 * GIB));
    assert_eq!(
        o.books(0).used,
        8 * GIB,
        "booked at once, while it is restored"
    );
    o.swapped_in(900 * MS, SwapId(1), true);
    assert!(o.resident(GroupId(0)));
    assert_eq!(
        o.process(ProcessId(0), 0),
        Some((Residence::Resident, 8 * GIB))
    );
}

/// A daemon restarted mid-swap: group 0's process restates 8 GiB but the driver holds it
/// checkpointed, group 1's restates 6 GiB on the GPU. Until the driver answers, group 0 is no
/// victim (its memory may be out already), so group 1's allocation waits past its wait without
/// a swap; once the driver says checkpointed, the books hold group 0 in host memory, the
/// allocation fits, and group 0 comes back as soon as its memory fits again, books exact.
#[test]
fn after_a_restart_a_process_the_driver_holds_checkpointed_is_swapped_out_until_it_fits() {
    let mut o = node(10 * GIB, 2);
    o.restate(0, ProcessId(0), 0, 8 * GIB);
    o.await_driver(ProcessId(0));
    o.restate(0, ProcessId(1), 0, 6 * GIB);
    assert_eq!(o.books(0).used, 14 * GIB, "restated as they are");
    assert_eq!(o.request(0, RequestId(1), ProcessId(1), 0, 3 * GIB), vec![]);
    for t in [100 * MS, 500 * MS, 2 * S] {
        assert!(
            swap_outs(&o.tick(t)).is_empty(),
            "no victim awaits the driver"
        );
    }
    let e = o.recover(2 * S, ProcessId(0), true);
    assert_eq!(e, vec![Effect::Grant(RequestId(1))], "{o:#?}");
    assert_eq!(
        (o.books(0).used, o.books(0).swapped),
        (9 * GIB, 8 * GIB),
        "group 0's bytes in host memory"
    );
    assert!(!o.resident(GroupId(0)));
    assert_eq!(o.counters().swap_outs, 0, "no swap was started");
    assert!(swap_ins(&o.free(3 * S, ProcessId(1), 0, 3 * GIB)).is_empty());
    let e = o.free(4 * S, ProcessId(1), 0, 6 * GIB);
    let swap = match swap_ins(&e)[..] {
        [(swap, GroupId(0))] => swap,
        _ => panic!("group 0 restored once it fits: {e:?}"),
    };
    o.swapped_in(5 * S, swap, true);
    assert!(o.resident(GroupId(0)));
    assert_eq!((o.books(0).used, o.books(0).swapped), (8 * GIB, 0));
}

/// A process the driver holds with its memory on the GPU (locked by a swap a previous daemon
/// began, or restored by one it did not finish: the caller unlocked it) stays resident, and is
/// a victim like any other once the driver has answered.
#[test]
fn after_a_restart_a_process_with_its_memory_on_the_gpu_runs_on_and_may_be_swapped_again() {
    let mut o = node(10 * GIB, 2);
    o.restate(0, ProcessId(0), 0, 8 * GIB);
    o.await_driver(ProcessId(0));
    assert_eq!(o.request(0, RequestId(1), ProcessId(1), 0, 4 * GIB), vec![]);
    assert!(swap_outs(&o.tick(200 * MS)).is_empty());
    let e = o.recover(300 * MS, ProcessId(0), false);
    assert_eq!((o.books(0).used, o.books(0).swapped), (8 * GIB, 0), "{e:?}");
    // Its wait long over, the asker has room made at once.
    assert_eq!(swap_outs(&e), vec![(SwapId(1), GroupId(0))]);
}

/// Two processes of one group found checkpointed come back together, in one restore.
#[test]
fn recovered_processes_of_a_group_are_restored_together() {
    let mut o = node(10 * GIB, 1);
    o.attach(ProcessId(1), GroupId(0));
    for p in [0, 1] {
        o.restate(0, ProcessId(p), 0, 3 * GIB);
        o.await_driver(ProcessId(p));
    }
    o.set_capacity(0, 0, 5 * GIB);
    assert!(
        swap_ins(&o.recover(S, ProcessId(0), true)).is_empty(),
        "3 + 3 > 5 GiB on the GPU"
    );
    let e = o.recover(S, ProcessId(1), true);
    assert_eq!(o.books(0).swapped, 6 * GIB, "{e:?}");
    let e = o.set_capacity(2 * S, 0, 10 * GIB);
    match &e[..] {
        [Effect::SwapIn { processes, .. }] => {
            assert_eq!(processes, &vec![ProcessId(0), ProcessId(1)])
        }
        _ => panic!("one restore of both: {e:?}"),
    }
}

#[test]
fn a_group_that_wants_to_run_is_resident_at_least_once_per_window() {
    // Two groups of 8 GiB on 10 GiB, both always busy: they take turns in memory.
    let mut o = node(10 * GIB, 2);
    grant(&mut o, 0, 0, 8 * GIB);
    o.set_pending(0, GroupId(0), true);
    o.set_pending(0, GroupId(1), true);
    o.request(0, RequestId(1), ProcessId(1), 0, 8 * GIB);
    o.tick(100 * MS);
    o.swapped_out(200 * MS, SwapId(1), Ok(()));
    assert!(o.resident(GroupId(1)) && !o.resident(GroupId(0)));
    // Group 0 wants to run from 200 ms; its window ends at 5.2 s, when group 1 is swapped out
    // for it (its memory turn of 1 s ended long before).
    assert!(swap_outs(&o.tick(5 * S)).is_empty());
    assert_eq!(o.next_wakeup(5 * S), Some(5 * S + 200 * MS));
    let e = o.tick(5 * S + 200 * MS);
    assert_eq!(swap_outs(&e), vec![(SwapId(2), GroupId(1))]);
    let e = o.swapped_out(5 * S + 700 * MS, SwapId(2), Ok(()));
    assert_eq!(swap_ins(&e), vec![(SwapId(1), GroupId(0))]);
}

#[test]
fn a_checkpoint_that_times_out_tries_the_next_victim_and_a_refused_one_marks_the_group() {
    let mut o = node(10 * GIB, 3);
    grant(&mut o, 0, 0, 5 * GIB);
    grant(&mut o, 0, 1, 4 * GIB);
    o.request(0, RequestId(1), ProcessId(2), 0, 3 * GIB);
    assert_eq!(swap_outs(&o.tick(100 * MS)), vec![(SwapId(1), GroupId(0))]);
    let e = o.swapped_out(300 * MS, SwapId(1), Err(SwapOutFailure::TimedOut));
    assert_eq!(
        swap_outs(&e),
        vec![(SwapId(2), GroupId(1))],
        "the next one, at once"
    );
    assert!(
        o.resident(GroupId(0)),
        "a timed-out lock leaves the group running"
    );
    let e = o.swapped_out(400 * MS, SwapId(2), Err(SwapOutFailure::Refused));
    assert!(
        swap_outs(&e).is_empty(),
        "group 0 cools down, group 1 is unswappable"
    );
    // Once group 0's cool-down ends it is tried again.
    assert_eq!(o.next_wakeup(400 * MS), Some(1300 * MS));
    assert_eq!(swap_outs(&o.tick(1300 * MS)), vec![(SwapId(3), GroupId(0))]);
}

#[test]
fn a_process_that_exits_while_swapped_out_frees_its_books() {
    let mut o = node(10 * GIB, 2);
    grant(&mut o, 0, 0, 8 * GIB);
    o.request(0, RequestId(1), ProcessId(1), 0, 4 * GIB);
    o.tick(100 * MS);
    o.swapped_out(200 * MS, SwapId(1), Ok(()));
    o.exit(300 * MS, ProcessId(0));
    assert_eq!(o.books(0).swapped, 0);
    assert!(o.swaps().is_empty());
    assert!(swap_ins(&o.free(400 * MS, ProcessId(1), 0, 4 * GIB)).is_empty());
}

/// The driver releases an exited process's memory some time after the exit is seen; a restore
/// that finds too little memory breaks the restored process for good, so the memory counts as
/// used for [`Params::exit_release_ns`].
#[test]
fn memory_of_an_exited_process_is_used_until_the_driver_has_released_it() {
    let mut o = node(10 * GIB, 3);
    grant(&mut o, 0, 0, 8 * GIB);
    o.request(0, RequestId(1), ProcessId(1), 0, 4 * GIB);
    o.tick(100 * MS);
    let e = o.swapped_out(200 * MS, SwapId(1), Ok(()));
    assert_eq!(e, vec![Effect::Grant(RequestId(1))]);
    o.set_pending(300 * MS, GroupId(0), true);
    // Process 1 ends holding its 4 GiB: group 0's 8 GiB fit only once they are released.
    let e = o.exit(1000 * MS, ProcessId(1));
    assert!(swap_ins(&e).is_empty(), "restored at the exit: {e:?}");
    assert_eq!(o.next_wakeup(1000 * MS), Some(1050 * MS));
    assert!(swap_ins(&o.tick(1049 * MS)).is_empty());
    // A 7 GiB allocation in the meantime (6 GiB free) waits too, and no victim is swapped out
    // for memory that is on its way.
    let e = o.request(1010 * MS, RequestId(2), ProcessId(2), 0, 7 * GIB);
    assert!(e.is_empty(), "{e:?}");
    assert!(swap_outs(&o.tick(1049 * MS)).is_empty());
    // Released: the older demand, group 0's restore, goes first.
    let e = o.tick(1050 * MS);
    assert_eq!(swap_ins(&e), vec![(SwapId(1), GroupId(0))], "{e:?}");
}

#[test]
fn a_failed_restore_loses_the_processes_and_refuses_their_waits() {
    let mut o = node(10 * GIB, 2);
    grant(&mut o, 0, 0, 8 * GIB);
    o.request(0, RequestId(1), ProcessId(1), 0, 4 * GIB);
    o.tick(100 * MS);
    o.swapped_out(200 * MS, SwapId(1), Ok(()));
    o.free(300 * MS, ProcessId(1), 0, 4 * GIB);
    o.request(310 * MS, RequestId(2), ProcessId(0), 0, GIB);
    let e = o.swapped_in(400 * MS, SwapId(1), false);
    assert!(
        e.contains(&Effect::Refuse(RequestId(2), Refusal::Lost)),
        "{e:?}"
    );
    assert!(e.iter().any(|e| matches!(
        e,
        Effect::Lost {
            group: GroupId(0),
            ..
        }
    )));
    assert_eq!(o.books(0).used, 0);
}

#[test]
fn a_swapped_processs_own_allocation_waits_for_its_restore() {
    let mut o = node(10 * GIB, 2);
    grant(&mut o, 0, 0, 6 * GIB);
    o.request(0, RequestId(1), ProcessId(1), 0, 6 * GIB);
    o.tick(100 * MS);
    o.swapped_out(200 * MS, SwapId(1), Ok(()));
    // The swapped process's hook asks (its driver calls are locked, its hook is not).
    assert!(
        o.request(300 * MS, RequestId(2), ProcessId(0), 0, GIB)
            .is_empty()
    );
    let e = o.free(400 * MS, ProcessId(1), 0, 6 * GIB);
    assert_eq!(swap_ins(&e), vec![(SwapId(1), GroupId(0))]);
    let e = o.swapped_in(900 * MS, SwapId(1), true);
    assert_eq!(e, vec![Effect::Grant(RequestId(2))]);
}

// --- random mixes in virtual time ------------------------------------------------------------

/// One process's program: each phase allocates `bytes` more, holds for `hold_ns` of resident
/// time, then frees all it holds or keeps it (its working set grows).
#[derive(Debug, Clone)]
struct Program {
    phases: Vec<(Bytes, Nanos, bool)>,
    unswappable: bool,
}

#[derive(Debug, Clone)]
struct Mix {
    capacity: Bytes,
    programs: Vec<Program>,
    /// Swap cost: fixed + per GiB.
    swap_fixed: Nanos,
    swap_per_gib: Nanos,
    /// Checkpoints that time out, by the index of the swap (every n-th), 0: none.
    timeout_every: u64,
}

fn mixes() -> impl Strategy<Value = Mix> {
    let program = (
        proptest::collection::vec((1u64..8, 1u64..40, any::<bool>()), 1..5),
        proptest::bool::weighted(0.3),
    )
        .prop_map(|(phases, unswappable)| Program {
            phases: phases
                .into_iter()
                .map(|(g, t, free)| (g * GIB / 2, t * 100 * MS, free))
                .collect(),
            unswappable,
        });
    (
        4u64..12,
        proptest::collection::vec(program, 2..6),
        0u64..300,
        0u64..200,
        0u64..4,
    )
        .prop_map(|(cap, programs, fixed, per, timeout_every)| Mix {
            capacity: cap * GIB,
            programs,
            swap_fixed: fixed * MS,
            swap_per_gib: per * MS,
            timeout_every,
        })
}

/// What a replay saw.
#[derive(Debug, Default)]
struct Seen {
    /// Longest a request waited for its answer.
    longest_wait: Nanos,
    /// Longest a group that wanted to run stayed out.
    longest_out: Nanos,
    refused: usize,
    finished: usize,
    swap_outs: u64,
}

/// Where a process of a replay is in its program.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Run {
    /// About to ask for phase `i`.
    Ask(usize),
    /// Waiting for the request of phase `i`, asked at `since`.
    Asked(usize, Nanos),
    /// Holding phase `i` until `until` (resident time only).
    Hold(usize, Nanos),
    Done,
}

/// A replay's world: the processes' programs and what they hold, the swaps in flight.
struct World<'a> {
    mix: &'a Mix,
    p: Params,
    run: Vec<Run>,
    held: Vec<Bytes>,
    /// Swaps in flight: (due, swap, a swap-out?, succeeds?).
    due: Vec<(Nanos, SwapId, bool, bool)>,
    protected_until: Vec<Nanos>,
    out_since: Vec<Option<Nanos>>,
    swaps_started: u64,
    /// Memory of exited processes the driver has not released yet: (until, bytes).
    releasing: Vec<(Nanos, Bytes)>,
    seen: Seen,
}

impl World<'_> {
    fn swap_ns(&self, i: usize) -> Nanos {
        (self.mix.swap_fixed + self.mix.swap_per_gib * self.held[i] / GIB).max(1)
    }

    /// Carry out what the core decided, checking each decision against the rules and the
    /// world as it was when it was decided (a batch is decided at once: the processes that
    /// give up in it exit after it, and what that decides is the next batch).
    fn apply(
        &mut self,
        o: &mut Overcommit,
        now: Nanos,
        effects: Vec<Effect>,
    ) -> Result<(), TestCaseError> {
        let n = self.run.len();
        let mut exits = Vec::new();
        for e in effects {
            match e {
                Effect::Grant(RequestId(r)) => {
                    let (i, k) = ((r / 1000) as usize, (r % 1000) as usize);
                    let Run::Asked(kk, since) = self.run[i] else {
                        return Err(TestCaseError::fail(format!("grant of {r} not asked")));
                    };
                    prop_assert_eq!(kk, k);
                    self.seen.longest_wait = self.seen.longest_wait.max(now - since);
                    self.held[i] += self.mix.programs[i].phases[k].0;
                    self.run[i] = Run::Hold(k, now + self.mix.programs[i].phases[k].1);
                }
                Effect::Refuse(RequestId(r), why) => {
                    let (i, k) = ((r / 1000) as usize, (r % 1000) as usize);
                    let bytes = self.mix.programs[i].phases[k].0;
                    // Only what can never fit: the group's own and unswappable memory fill the
                    // rest (checked against the replay's own books).
                    let unswappable: Bytes = (0..n)
                        .filter(|&j| j != i && self.mix.programs[j].unswappable)
                        .map(|j| self.held[j])
                        .sum();
                    prop_assert!(
                        bytes + self.held[i] + unswappable > self.mix.capacity,
                        "refused {} bytes that could fit: {:?}",
                        bytes,
                        why
                    );
                    self.seen.refused += 1;
                    // The process gives up this phase and goes on.
                    if k + 1 < self.mix.programs[i].phases.len() {
                        self.run[i] = Run::Ask(k + 1);
                    } else {
                        self.run[i] = Run::Done;
                        self.seen.finished += 1;
                        exits.push(i);
                    }
                }
                Effect::SwapOut {
                    swap,
                    group,
                    processes,
                    ..
                } => {
                    let i = group.0 as usize;
                    prop_assert!(
                        !self.mix.programs[i].unswappable,
                        "unswappable victim {}",
                        i
                    );
                    prop_assert!(
                        now >= self.protected_until[i],
                        "victim {} in its memory turn",
                        i
                    );
                    prop_assert_eq!(processes, vec![ProcessId(i as u64)]);
                    self.swaps_started += 1;
                    let every = self.mix.timeout_every;
                    let ok = every == 0 || !self.swaps_started.is_multiple_of(every + 1);
                    self.due.push((now + self.swap_ns(i), swap, true, ok));
                    if ok {
                        self.out_since[i] = Some(now);
                    }
                }
                Effect::SwapIn { swap, group, .. } => {
                    let i = group.0 as usize;
                    let cost = self.swap_ns(i);
                    self.due.push((now + cost, swap, false, true));
                    self.protected_until[i] = now + cost + self.p.memory_turn_ns;
                    if let Some(t) = self.out_since[i].take() {
                        self.seen.longest_out = self.seen.longest_out.max(now - t);
                    }
                }
                Effect::Lost { .. } => {
                    return Err(TestCaseError::fail("lost without a failed restore"));
                }
            }
        }
        // The books never promise more than the GPU, and the processes never hold more on it,
        // counting what exited processes hold until the driver has released it.
        let b = o.books(0);
        prop_assert!(b.used <= b.capacity, "books over the GPU: {:?}", b);
        self.releasing.retain(|r| r.0 > now);
        let releasing: Bytes = self.releasing.iter().map(|r| r.1).sum();
        let on_gpu: Bytes = releasing
            + (0..n)
                .filter(|&i| {
                    o.process(ProcessId(i as u64), 0)
                        .is_some_and(|(r, _)| !matches!(r, Residence::Out(_)))
                })
                .map(|i| self.held[i])
                .sum::<Bytes>();
        prop_assert!(
            on_gpu <= self.mix.capacity,
            "allocated {} on {}",
            on_gpu,
            self.mix.capacity
        );
        for i in exits {
            if !matches!(
                o.process(ProcessId(i as u64), 0),
                Some((Residence::Out(_), _))
            ) {
                let until = now + self.p.exit_release_ns;
                self.releasing
                    .push((until, std::mem::take(&mut self.held[i])));
            }
            self.held[i] = 0;
            let e = o.exit(now, ProcessId(i as u64));
            self.apply(o, now, e)?;
        }
        Ok(())
    }
}

/// Replay `mix`: each process runs its phases while resident (each phase allocates, holds,
/// frees or keeps); swaps take their cost; every decision is checked as it is made.
fn replay(mix: &Mix, p: Params) -> Result<Seen, TestCaseError> {
    let n = mix.programs.len();
    let mut o = Overcommit::new(p, vec![mix.capacity]);
    let mut w = World {
        mix,
        p,
        run: vec![Run::Ask(0); n],
        held: vec![0; n],
        due: Vec::new(),
        protected_until: vec![0; n],
        out_since: vec![None; n],
        swaps_started: 0,
        releasing: Vec::new(),
        seen: Seen::default(),
    };
    for (i, prog) in mix.programs.iter().enumerate() {
        o.attach(ProcessId(i as u64), GroupId(i as u64));
        o.set_group(
            GroupId(i as u64),
            GroupRank {
                priority: (i % 3) as i64,
                weight: 1.0 + (i % 2) as f64,
            },
        );
        if prog.unswappable {
            let e = o.mark_unswappable(0, ProcessId(i as u64), Unswappable::Managed);
            w.apply(&mut o, 0, e)?;
        }
    }
    let step_ns = 10 * MS;
    let horizon = 900 * S;
    let mut now: Nanos = 0;
    while now < horizon {
        // Swaps ending now.
        w.due.sort();
        while let Some(&(t, swap, out, ok)) = w.due.first() {
            if t > now {
                break;
            }
            w.due.remove(0);
            let e = if out {
                let r = if ok {
                    Ok(())
                } else {
                    Err(SwapOutFailure::TimedOut)
                };
                o.swapped_out(now, swap, r)
            } else {
                o.swapped_in(now, swap, true)
            };
            w.apply(&mut o, now, e)?;
        }
        // Processes move on.
        for i in 0..n {
            let (pid, group) = (ProcessId(i as u64), GroupId(i as u64));
            let resident = o.resident(group);
            o.set_turn(group, 0, resident && w.run[i] != Run::Done);
            match w.run[i] {
                Run::Ask(k) => {
                    let bytes = mix.programs[i].phases[k].0;
                    w.run[i] = Run::Asked(k, now);
                    let e = o.request(now, RequestId(i as u64 * 1000 + k as u64), pid, 0, bytes);
                    w.apply(&mut o, now, e)?;
                }
                Run::Hold(k, until) if resident && now >= until => {
                    // A last phase that does not free exits holding its memory.
                    let last = k + 1 == mix.programs[i].phases.len();
                    if mix.programs[i].phases[k].2 {
                        let e = o.free(now, pid, 0, w.held[i]);
                        w.held[i] = 0;
                        w.apply(&mut o, now, e)?;
                    }
                    o.ran(group, now);
                    if last {
                        w.run[i] = Run::Done;
                        w.seen.finished += 1;
                        let e = o.set_pending(now, group, false);
                        w.apply(&mut o, now, e)?;
                        if w.held[i] > 0 {
                            let until = now + w.p.exit_release_ns;
                            w.releasing.push((until, std::mem::take(&mut w.held[i])));
                        }
                        let e = o.exit(now, pid);
                        w.apply(&mut o, now, e)?;
                    } else {
                        w.run[i] = Run::Ask(k + 1);
                    }
                }
                // Time out of memory does not count towards the hold.
                Run::Hold(k, until) if !resident => w.run[i] = Run::Hold(k, until + step_ns),
                _ => {}
            }
            if w.run[i] != Run::Done {
                let e = o.set_pending(now, group, true);
                w.apply(&mut o, now, e)?;
            }
        }
        let e = o.tick(now);
        w.apply(&mut o, now, e)?;
        if w.run.iter().all(|r| *r == Run::Done) && w.due.is_empty() {
            break;
        }
        now += step_ns;
    }
    prop_assert!(
        w.run.iter().all(|r| *r == Run::Done),
        "not all finished by {} s: {:?}\n{:#?}",
        now / S,
        w.run,
        o
    );
    w.seen.swap_outs = o.counters().swap_outs;
    Ok(w.seen)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Every mix finishes; the books never exceed the GPU; victims, refusals and restores
    /// follow the rules; waits and times out of memory are bounded.
    #[test]
    fn random_mixes_follow_the_rules_and_everyone_finishes(mix in mixes()) {
        let p = params();
        let seen = replay(&mix, p)?;
        let swap_max = mix.swap_fixed + mix.swap_per_gib * mix.capacity / GIB;
        // A wait: its own wait, victims' memory turns, a cool-down, the swaps themselves; and
        // demands older than it served first (each bounded the same way).
        let bound = (mix.programs.len() as u64 + 1)
            * (p.alloc_wait_ns + p.memory_turn_ns + p.retry_after_ns + 3 * swap_max)
            + p.window_ns;
        prop_assert!(seen.longest_wait <= bound, "waited {} ms > {} ms", seen.longest_wait / MS, bound / MS);
        prop_assert!(seen.longest_out <= bound, "out {} ms > {} ms", seen.longest_out / MS, bound / MS);
    }
}

/// The random mixes exercise swaps and refusals, not only grants.
#[test]
fn random_mixes_swap_and_refuse() {
    use proptest::test_runner::{Config, TestRunner};
    let mut runner = TestRunner::new(Config {
        cases: 200,
        ..Config::default()
    });
    let (swapped, refused) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    runner
        .run(&mixes(), |mix| {
            let seen = replay(&mix, params())?;
            swapped.set(swapped.get() + (seen.swap_outs > 0) as u32);
            refused.set(refused.get() + (seen.refused > 0) as u32);
            Ok(())
        })
        .expect("replays");
    let (swapped, refused) = (swapped.get(), refused.get());
    assert!(
        swapped >= 80 && refused >= 20,
        "{swapped} of 200 mixes swapped, {refused} refused"
    );
}

/// A fixed mix replayed twice decides the same, and its figures are what they were: two
/// groups whose working sets peak together past the GPU, a third that cannot be swapped.
#[test]
fn a_deterministic_replay() {
    let mix = Mix {
        capacity: 10 * GIB,
        programs: vec![
            Program {
                phases: vec![
                    (2 * GIB, 2 * S, false),
                    (4 * GIB, 4 * S, true),
                    (GIB, S, true),
                ],
                unswappable: false,
            },
            Program {
                phases: vec![(5 * GIB, 3 * S, true), (6 * GIB, 2 * S, true)],
                unswappable: false,
            },
            Program {
                phases: vec![(2 * GIB, 10 * S, true)],
                unswappable: true,
            },
        ],
        swap_fixed: 100 * MS,
        swap_per_gib: 200 * MS,
        timeout_every: 0,
    };
    let a = replay(&mix, params()).expect("replay");
    let b = replay(&mix, params()).expect("replay");
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
    assert_eq!(a.refused, 0, "everything fits with swaps");
    assert_eq!(a.finished, 3);
    assert!(a.swap_outs >= 1, "{a:?}");
}

/// Groups that are always busy and cannot all fit take turns in memory: none is kept out
/// longer than the window, plus the swaps and memory turn it waits for.
#[test]
fn always_busy_groups_each_get_the_memory_once_per_window() {
    let long = Program {
        phases: vec![(4 * GIB, 40 * S, true)],
        unswappable: false,
    };
    let mix = Mix {
        capacity: 10 * GIB,
        programs: vec![long; 4],
        swap_fixed: 100 * MS,
        swap_per_gib: 100 * MS,
        timeout_every: 0,
    };
    let p = params();
    let seen = replay(&mix, p).expect("replay");
    let swap = mix.swap_fixed + 4 * mix.swap_per_gib;
    let bound = p.window_ns + p.memory_turn_ns + 2 * swap + 20 * MS;
    assert!(
        seen.longest_out <= bound,
        "out {} ms > {} ms: {seen:?}",
        seen.longest_out / MS,
        bound / MS
    );
    assert!(seen.swap_outs >= 4, "{seen:?}");
    assert_eq!(seen.refused, 0);
}

/// An allocation waits for memory as long as making room would take, and a group keeps memory
/// it got by a swap for four times what swapping costs; the costs follow the swaps seen.
#[test]
fn waits_and_memory_turns_follow_what_swaps_cost() {
    let rates = SwapCost {
        latency_ns: 0,
        checkpoint_bytes_per_s: GIB as f64,
        restore_bytes_per_s: 2.0 * GIB as f64,
    };
    let mut o = Overcommit::new(
        Params {
            swap_cost: rates,
            ..params()
        },
        vec![10 * GIB],
    );
    for i in 0..3 {
        o.attach(ProcessId(i), GroupId(i));
    }
    grant(&mut o, 0, 0, 8 * GIB);
    o.request(0, RequestId(1), ProcessId(1), 0, 4 * GIB);
    assert_eq!(o.next_wakeup(0), Some(4 * S), "4 GiB out at 1 GiB/s");
    assert!(swap_outs(&o.tick(4 * S - 1)).is_empty());
    assert_eq!(swap_outs(&o.tick(4 * S)), vec![(SwapId(1), GroupId(0))]);
    // The 8 GiB went out in 4 s: 2 GiB/s from now on.
    o.swapped_out(8 * S, SwapId(1), Ok(()));
    assert_eq!(o.swap_cost().checkpoint_bytes_per_s, 1.5 * GIB as f64);
    // Group 1's memory turn, from 4 s: 4 × (its 4 GiB out at 1 GiB/s + back at 2 GiB/s), the
    // costs then: until 28 s. Group 2's 7 GiB (6 are free) wait 7 / 1.5 s, then for the
    // turn's end.
    o.request(9 * S, RequestId(2), ProcessId(2), 0, 7 * GIB);
    assert!(swap_outs(&o.tick(14 * S)).is_empty());
    assert_eq!(o.next_wakeup(14 * S), Some(28 * S));
    assert_eq!(swap_outs(&o.tick(28 * S)), vec![(SwapId(2), GroupId(1))]);
}

/// What the link is said to carry (the configuration's bandwidths) replaces what swaps taught
/// when it changes, and only then: a reload that leaves it alone keeps what was learned.
#[test]
fn a_changed_swap_cost_replaces_the_learned_one_and_an_unchanged_one_keeps_it() {
    let slow = SwapCost {
        latency_ns: 0,
        checkpoint_bytes_per_s: GIB as f64,
        restore_bytes_per_s: 2.0 * GIB as f64,
    };
    let p = Params {
        swap_cost: slow,
        ..params()
    };
    let mut o = Overcommit::new(p, vec![10 * GIB]);
    for i in 0..2 {
        o.attach(ProcessId(i), GroupId(i));
    }
    grant(&mut o, 0, 0, 8 * GIB);
    o.request(0, RequestId(1), ProcessId(1), 0, 4 * GIB);
    assert_eq!(swap_outs(&o.tick(4 * S)), vec![(SwapId(1), GroupId(0))]);
    // 8 GiB out in 2 s: halfway from 1 to 4 GiB/s.
    o.swapped_out(6 * S, SwapId(1), Ok(()));
    let learned = o.swap_cost();
    assert_eq!(learned.checkpoint_bytes_per_s, 2.5 * GIB as f64);
    o.set_params(
        7 * S,
        Params {
            max_wait_ns: 60 * S,
            ..p
        },
    );
    assert_eq!(
        o.swap_cost(),
        learned,
        "the same link: what was learned stays"
    );
    let fast = SwapCost {
        checkpoint_bytes_per_s: 16.0 * GIB as f64,
        ..slow
    };
    o.set_params(
        8 * S,
        Params {
            swap_cost: fast,
            ..p
        },
    );
    assert_eq!(o.swap_cost(), fast);
    // An allocation now waits as long as its bytes take at the new rate, not the old.
    o.request(9 * S, RequestId(2), ProcessId(1), 0, 8 * GIB);
    assert_eq!(
        o.next_wakeup(9 * S),
        Some(9 * S + params().alloc_wait_ns.max(S / 2))
    );
}

/// Swaps started to make room for the oldest allocation free memory for it, not for the
/// victims to come straight back into: three groups that each hold a part of the GPU and each
/// ask for half of it finish, one after the other (swaps cost nothing here, so a victim's
/// memory comes free and "fits" again in the same instant).
#[test]
fn room_made_by_swaps_goes_to_the_demand_it_was_made_for() {
    let program = |first: Bytes, hold: Nanos| Program {
        phases: vec![(first, hold, false), (3 * GIB, 100 * MS, false)],
        unswappable: false,
    };
    let mix = Mix {
        capacity: 6 * GIB,
        programs: vec![
            program(3 * GIB / 2, 1400 * MS),
            program(2 * GIB, 400 * MS),
            program(2 * GIB, 100 * MS),
        ],
        swap_fixed: 0,
        swap_per_gib: 0,
        timeout_every: 0,
    };
    let seen = replay(&mix, params()).expect("replay");
    assert_eq!(seen.finished, 3, "{seen:?}");
    assert_eq!(seen.refused, 0, "{seen:?}");
}

/// A swapped-out group that can never come back while an unswappable one holds the GPU is
/// owed no memory: the unswappable group's own small allocation is granted, it finishes, and
/// then the other comes back.
#[test]
fn a_demand_that_can_never_fit_holds_no_memory_back() {
    let mix = Mix {
        capacity: 7 * GIB,
        programs: vec![
            Program {
                phases: vec![
                    (3 * GIB, 1400 * MS, false),
                    (2 * GIB, 3100 * MS, false),
                    (GIB / 2, 100 * MS, false),
                ],
                unswappable: true,
            },
            Program {
                phases: vec![(5 * GIB / 2, 2100 * MS, false)],
                unswappable: false,
            },
            Program {
                phases: vec![(2 * GIB, 100 * MS, true), (5 * GIB / 2, 1600 * MS, false)],
                unswappable: false,
            },
        ],
        swap_fixed: 121 * MS,
        swap_per_gib: 64 * MS,
        timeout_every: 1,
    };
    let seen = replay(&mix, params()).expect("replay");
    assert_eq!(seen.finished, 3, "{seen:?}");
}
