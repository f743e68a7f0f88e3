//! The node core, scripted in virtual time ([`World`]), and fed hostile input.

use super::sim::{CONFIG, GPUS, MIB, MS, S, Work, World, pod_group, pod_identity};
use super::*;
use crate::memory::ProcessId;
use gpushare_frame::fuzz;
use gpushare_protocol::admin::{AdminReply, ContainerKey, PodGroup};
use gpushare_protocol::status::{GroupReport, MemoryState, Report};
use gpushare_protocol::{GroupSpec, PROTOCOL_VERSION};
use proptest::prelude::*;
use std::collections::BTreeMap;

const GPU: GpuUuid = GPUS[0];

/// A client of group `a` (uid 1000), welcomed.
fn client_a(w: &mut World) -> ConnId {
    let c = w.connect(1000, None);
    w.complete_all();
    w.hello(c, None);
    assert_eq!(w.tenants[&c].welcome.as_deref(), Some("a"));
    c
}

/// Client a, then a second process (uid 1001) greeted after it.
fn clients_a_and_b(w: &mut World) -> (ConnId, ConnId) {
    let a = client_a(w);
    let b = w.connect(1001, None);
    w.complete_all();
    w.hello(b, None);
    (a, b)
}

fn reserve(w: &mut World, c: ConnId, mib: u64) -> u64 {
    let req = w.req(c);
    w.send(
        c,
        ClientMsg::MemReserve {
            req,
            gpu: GPU,
            bytes: mib * MIB,
        },
    );
    req
}

fn last(w: &World, c: ConnId) -> Option<&ServerMsg> {
    w.tenants[&c].received.last()
}

fn persists(w: &World) -> usize {
    (w.work.iter())
        .filter(|x| matches!(x, Work::Persist { .. }))
        .count()
}

#[test]
fn a_granted_reservation_waits_for_its_books_on_disk_and_what_follows_waits_behind_it() {
    let mut w = World::new(CONFIG, false);
    let c = client_a(&mut w);
    let other = client_a(&mut w);
    let req = reserve(&mut w, c, 100);
    assert!(
        !matches!(last(&w, c), Some(ServerMsg::Memory { .. })),
        "not granted before the write"
    );
    assert_eq!(persists(&w), 1, "the books are written at once");
    // Meanwhile: a query of the same client waits behind the grant; another client is served.
    let q = w.req(c);
    w.send(c, ClientMsg::MemQuery { req: q, gpu: GPU });
    let q2 = w.req(other);
    w.send(other, ClientMsg::MemQuery { req: q2, gpu: GPU });
    assert!(
        matches!(last(&w, other), Some(ServerMsg::Memory { req, used, .. }) if *req == q2 && *used == 100 * MIB)
    );
    // A second reservation while the first write is under way goes into the next write.
    let req2 = reserve(&mut w, other, 50);
    assert_eq!(persists(&w), 1, "one write at a time");
    w.complete(0);
    let got: Vec<u64> = (w.tenants[&c].received.iter())
        .filter_map(|m| match m {
            ServerMsg::Memory { req, .. } => Some(*req),
            _ => None,
        })
        .collect();
    assert_eq!(got, vec![req, q], "granted, then the query, in order");
    assert!(
        !matches!(last(&w, other), Some(ServerMsg::Memory { req, .. }) if *req == req2),
        "the second waits for its own write"
    );
    assert_eq!(persists(&w), 1, "which begins as the first ends");
    w.complete(0);
    assert!(
        matches!(last(&w, other), Some(ServerMsg::Memory { req, granted: true, used, .. }) if *req == req2 && *used == 150 * MIB)
    );
    w.settle();
    w.check_settled();
}

#[test]
fn refusals_and_empty_reservations_need_no_write() {
    let mut w = World::new(CONFIG, false);
    let c = client_a(&mut w);
    reserve(&mut w, c, 2048);
    assert!(matches!(
        last(&w, c),
        Some(ServerMsg::Memory { granted: false, .. })
    ));
    reserve(&mut w, c, 0);
    assert!(matches!(
        last(&w, c),
        Some(ServerMsg::Memory { granted: true, .. })
    ));
    assert_eq!(persists(&w), 0);
}

#[test]
fn frees_and_departures_reach_the_journal_within_the_flush_period() {
    let mut w = World::new(CONFIG, false);
    let c = client_a(&mut w);
    reserve(&mut w, c, 100);
    w.complete_all();
    assert_eq!(w.journal.len(), 1);
    w.send(
        c,
        ClientMsg::MemFree {
            gpu: GPU,
            bytes: 100 * MIB,
        },
    );
    assert_eq!(persists(&w), 0, "nothing waits for a free");
    w.advance(FLUSH_EVERY.as_nanos() as u64 - 1);
    assert_eq!(persists(&w), 0);
    w.advance(1);
    assert_eq!(persists(&w), 1, "written once the flush period is over");
    w.complete_all();
    assert!(w.journal.is_empty());
}

/// The journal's file system full: a granted reservation is answered all the same, saying it is
/// not journaled (the hook then follows `GPUSHARE_FAIL`), and the books are written again
/// within the flush period, after which grants are journaled again.
#[test]
fn a_full_journal_answers_grants_as_not_journaled_and_is_tried_again() {
    let mut w = World::new(CONFIG, false);
    let c = client_a(&mut w);
    w.journal_full = true;
    let req = reserve(&mut w, c, 100);
    assert!(!matches!(last(&w, c), Some(ServerMsg::Memory { .. })));
    w.complete_all();
    assert!(
        matches!(last(&w, c), Some(ServerMsg::Memory { req: r, granted: true, journaled: false, used, .. }) if *r == req && *used == 100 * MIB),
        "{:?}",
        last(&w, c)
    );
    assert!(w.journal.is_empty());
    reserve(&mut w, c, 2048);
    assert!(
        matches!(
            last(&w, c),
            Some(ServerMsg::Memory {
                granted: false,
                journaled: true,
                ..
            })
        ),
        "a refusal holds nothing to journal"
    );
    w.journal_full = false;
    w.advance(FLUSH_EVERY.as_nanos() as u64 - 1);
    assert_eq!(persists(&w), 0);
    w.advance(1);
    assert_eq!(persists(&w), 1, "tried again within the flush period");
    w.complete_all();
    assert_eq!(w.journal.len(), 1, "on disk now");
    let req = reserve(&mut w, c, 10);
    w.complete_all();
    assert!(
        matches!(last(&w, c), Some(ServerMsg::Memory { req: r, journaled: true, .. }) if *r == req)
    );
    w.settle();
    w.check_settled();
}

/// A holding stated by a process that neither reserved nor asked for a turn on this connection
/// (it reconnected, or allocated alone while the node did not answer) is in the report.
#[test]
fn a_stated_holding_is_reported() {
    let mut w = World::new(CONFIG, false);
    let c = client_a(&mut w);
    w.send(
        c,
        ClientMsg::MemSync {
            gpu: GPU,
            bytes: 100 * MIB,
        },
    );
    w.send(c, ClientMsg::Status);
    let Some(ServerMsg::Status { report }) = last(&w, c) else {
        panic!("no report: {:?}", last(&w, c))
    };
    let used: u64 = (report.gpus.iter())
        .flat_map(|g| &g.groups)
        .filter(|g| g.name == "a")
        .map(|g| g.memory_used)
        .sum();
    assert_eq!(used, 100 * MIB, "{report:?}");
}

/// A probe is answered at once, in order behind what its connection waits for.
#[test]
fn a_probe_is_answered_at_once_in_order() {
    let mut w = World::new(CONFIG, false);
    let c = client_a(&mut w);
    w.send(c, ClientMsg::Probe { gpu: GPU });
    assert_eq!(last(&w, c), Some(&ServerMsg::Alive { gpu: GPU }));
    let req = reserve(&mut w, c, 100);
    let before = w.tenants[&c].received.len();
    w.send(c, ClientMsg::Probe { gpu: GPU });
    assert_eq!(
        w.tenants[&c].received.len(),
        before,
        "not before the grant it follows"
    );
    w.complete_all();
    let n = w.tenants[&c].received.len();
    assert!(
        matches!(&w.tenants[&c].received[n - 2..], [ServerMsg::Memory { req: r, .. }, ServerMsg::Alive { .. }] if *r == req)
    );
    w.settle();
    w.check_settled();
}

#[test]
fn a_restarted_node_counts_the_journaled_holdings_until_their_process_restates_them() {
    let mut w = World::new(CONFIG, false);
    let a1 = client_a(&mut w);
    let a2 = client_a(&mut w);
    reserve(&mut w, a1, 600);
    reserve(&mut w, a2, 300);
    w.complete_all();
    // Killed before the departure of a2 is written: the journal overstates, the safe side.
    w.hang_up(a2);
    w.restart();
    let back: Vec<ConnId> = (w.tenants.iter())
        .filter(|(_, t)| !t.closed)
        .map(|(c, _)| *c)
        .collect();
    assert_eq!(back.len(), 1, "a1 reconnected and restated 600 MiB");
    assert_eq!(
        w.node.memory.used("a", &GPU),
        900 * MIB,
        "a2's process still runs: its holding counts"
    );
    let c = back[0];
    reserve(&mut w, c, 200);
    assert!(
        matches!(last(&w, c), Some(ServerMsg::Memory { granted: false, .. })),
        "the ghost counts against the cap"
    );
    // a2's process exits: its ghost goes at the next check.
    let pid2 = w.tenants[&a2].peer.pid;
    w.tenants.get_mut(&a2).unwrap().exited = true;
    w.advance(S);
    w.complete_all();
    assert_eq!(
        w.node.memory.used("a", &GPU),
        600 * MIB,
        "pid {pid2} is gone"
    );
    reserve(&mut w, c, 200);
    w.complete_all();
    assert!(matches!(
        last(&w, c),
        Some(ServerMsg::Memory { granted: true, .. })
    ));
    w.settle();
    w.check_settled();
}

#[test]
fn an_exited_process_frees_its_memory_though_a_child_keeps_its_connection() {
    let mut w = World::new(CONFIG, false);
    let c = client_a(&mut w);
    reserve(&mut w, c, 700);
    w.complete_all();
    w.tenants.get_mut(&c).unwrap().exited = true;
    w.advance(2 * S);
    w.complete_all();
    assert_eq!(w.node.memory.used("a", &GPU), 0);
    assert!(!w.tenants[&c].closed, "its connection lives on");
}

#[test]
fn connections_over_the_limits_are_closed_and_a_silent_one_after_its_hello_timeout() {
    let mut w = World::new(
        "[connections]\nmax = 4\nmax_per_uid = 2\nhello_timeout = \"500ms\"\n",
        true,
    );
    let a = w.connect(1000, None);
    let b = w.connect(1000, None);
    let c = w.connect(1000, None);
    w.complete_all();
    assert!(w.tenants[&c].closed, "the third of uid 1000");
    assert!(!w.tenants[&a].closed && !w.tenants[&b].closed);
    let d = w.connect(1001, None);
    let e = w.connect(1001, None);
    assert!(!w.tenants[&e].closed);
    let f = w.connect(1002, None);
    assert!(w.tenants[&f].closed, "over the total: closed at once");
    w.complete_all();
    w.hello(a, None);
    w.hello(d, None);
    w.advance(499 * MS);
    assert!(!w.tenants[&b].closed);
    w.advance(MS);
    assert!(
        w.tenants[&b].closed && w.tenants[&e].closed,
        "no Hello in time"
    );
    assert!(!w.tenants[&a].closed && !w.tenants[&d].closed);
    // Their places are free again.
    let g = w.connect(1000, None);
    w.complete_all();
    assert!(!w.tenants[&g].closed);
}

#[test]
fn a_stalled_daemon_reads_a_waiting_hello_before_closing_its_connection() {
    let mut w = World::new("[connections]\nhello_timeout = \"500ms\"\n", true);
    let a = w.connect(1000, None);
    let b = w.connect(1001, None);
    w.complete_all();
    // The daemon stops for 3 s; both peers said Hello meanwhile, and its timer is the first
    // thing it handles when it runs again.
    w.stall(3 * S);
    w.input(Input::Tick);
    assert!(!w.tenants[&a].closed && !w.tenants[&b].closed);
    w.hello(a, None);
    w.hello(b, None);
    assert!(w.tenants[&a].welcome.is_some() && w.tenants[&b].welcome.is_some());
    // One that stays silent is closed once the daemon has read what came during the stall.
    let c = w.connect(1002, None);
    w.complete_all();
    w.stall(S);
    w.input(Input::Tick);
    assert!(!w.tenants[&c].closed, "its Hello may wait unread");
    w.advance(0);
    assert!(w.tenants[&c].closed, "no Hello in time");
}

#[test]
fn a_hello_waits_for_its_peer_and_what_follows_it_is_read_in_order() {
    let mut w = World::new(CONFIG, false);
    let c = w.connect(1000, None);
    w.hello(c, None);
    w.send(c, ClientMsg::Status);
    assert!(
        w.tenants[&c].received.is_empty(),
        "its peer is not known yet"
    );
    w.complete_all();
    let r = &w.tenants[&c].received;
    assert!(matches!(r[0], ServerMsg::Welcome { .. }), "{r:?}");
    assert!(matches!(r[1], ServerMsg::Status { .. }), "{r:?}");
}

#[test]
fn a_pods_process_waits_for_its_container_and_is_admitted_or_refused() {
    let mut w = World::new(CONFIG, false);
    assert_eq!(
        w.admin(AdminRequest::Sync {
            groups: vec![pod_group(0)],
        }),
        AdminReply::Done
    );
    let known = w.connect(0, Some(pod_identity(0)));
    let late = w.connect(0, Some(pod_identity(1)));
    let never = w.connect(0, Some(pod_identity(2)));
    w.complete_all();
    for c in [known, late, never] {
        w.hello(c, None);
    }
    assert_eq!(w.tenants[&known].welcome.as_deref(), Some("ns/pod0/c0"));
    assert_eq!(w.tenants[&late].welcome, None, "waits for its container");
    w.advance(POD_WAIT.as_nanos() as u64 / 2);
    w.admin(AdminRequest::Upsert {
        group: pod_group(1),
    });
    assert_eq!(w.tenants[&late].welcome.as_deref(), Some("ns/pod1/c1"));
    w.advance(POD_WAIT.as_nanos() as u64 / 2);
    assert!(
        matches!(last(&w, never), Some(ServerMsg::Error { fatal: true, message }) if message.contains("no gpushare policy")),
        "refused after the pod wait, counted from its Hello"
    );
    assert!(w.tenants[&never].closed);
    // The agent's Usage is answered from the latest report.
    assert!(matches!(
        w.admin(AdminRequest::Usage),
        AdminReply::Usage { .. }
    ));
}

/// A removed container's group stays while any of its processes is connected and goes with
/// the last one.
#[test]
fn a_removed_pods_group_goes_with_its_last_process() {
    let mut w = World::new(CONFIG, false);
    let spec: PodGroup = pod_group(0);
    w.admin(AdminRequest::Sync {
        groups: vec![spec.clone()],
    });
    let ids: Vec<ConnId> = (0..2)
        .map(|_| w.connect(0, Some(pod_identity(0))))
        .collect();
    w.complete_all();
    for &c in &ids {
        w.hello(c, None);
    }
    let name = w.tenants[&ids[0]].welcome.clone().unwrap();
    assert!(w.node.groups.contains_key(&name));
    w.admin(AdminRequest::Remove {
        key: ContainerKey {
            pod_uid: spec.pod_uid.clone(),
            container: spec.container.clone(),
        },
    });
    assert!(
        w.node.groups.contains_key(&name),
        "kept while its processes run"
    );
    w.hang_up(ids[0]);
    assert!(w.node.groups.contains_key(&name), "kept while one is left");
    w.hang_up(ids[1]);
    assert!(
        !w.node.groups.contains_key(&name),
        "gone with its last process"
    );
}

#[test]
fn a_reload_changes_caps_and_removes_the_groups_it_drops() {
    let mut w = World::new(CONFIG, false);
    let c = client_a(&mut w);
    reserve(&mut w, c, 300);
    w.complete_all();
    w.reload("[[group]]\nname = \"a\"\nuids = [1000]\nmemory = \"256MiB\"\n");
    assert!(!w.node.groups.contains_key("b"));
    let q = w.req(c);
    w.send(c, ClientMsg::MemQuery { req: q, gpu: GPU });
    assert!(
        matches!(last(&w, c), Some(ServerMsg::Memory { cap: Some(cap), used, .. }) if *cap == 256 * MIB && *used == 300 * MIB)
    );
    reserve(&mut w, c, 1);
    assert!(matches!(
        last(&w, c),
        Some(ServerMsg::Memory { granted: false, .. })
    ));
}

#[test]
fn turns_are_granted_and_a_departure_hands_the_gpu_on() {
    let mut w = World::new(CONFIG, false);
    let (a, b) = clients_a_and_b(&mut w);
    w.send(a, ClientMsg::Acquire { gpu: GPU });
    w.send(b, ClientMsg::Acquire { gpu: GPU });
    assert!(matches!(last(&w, a), Some(ServerMsg::Grant { .. })));
    w.hang_up(a);
    w.advance(MS);
    assert!(
        (w.tenants[&b].received.iter()).any(|m| matches!(m, ServerMsg::Grant { .. })),
        "the waiting client gets the GPU once the holder is gone"
    );
}

/// The shell's heartbeat is due every quarter of the liveness bound while a process waits for
/// a turn (it reads the heartbeat instead of probing), and not while none does.
#[test]
fn the_heartbeat_is_due_every_quarter_bound_while_a_process_waits_for_a_turn() {
    let mut w = World::new(CONFIG, false);
    let (a, b) = clients_a_and_b(&mut w);
    assert_eq!(w.node.heartbeat_every(), None, "nobody waits");
    w.send(a, ClientMsg::Acquire { gpu: GPU });
    assert!(matches!(last(&w, a), Some(ServerMsg::Grant { .. })));
    assert_eq!(w.node.heartbeat_every(), None, "the holder does not wait");
    w.send(b, ClientMsg::Acquire { gpu: GPU });
    assert_eq!(w.node.liveness_ns(), 40 * MS);
    assert_eq!(w.node.heartbeat_every(), Some(10 * MS));
    w.hang_up(a);
    w.advance(MS);
    assert!(matches!(last(&w, b), Some(ServerMsg::Grant { .. })));
    assert_eq!(w.node.heartbeat_every(), None, "granted, nobody waits");
}

#[test]
fn status_reports_are_reused_for_a_moment_and_published_every_second() {
    let mut w = World::new(CONFIG, true);
    let c = client_a(&mut w);
    let status = |w: &mut World| {
        w.send(c, ClientMsg::Status);
        match last(w, c) {
            Some(ServerMsg::Status { report }) => Report::clone(report),
            other => panic!("{other:?}"),
        }
    };
    let first = status(&mut w);
    assert_eq!(
        *w.published, first,
        "what a client is sent is published too"
    );
    w.node.dev = false;
    w.now += STATUS_REUSE_NS - 1;
    assert_eq!(status(&mut w), first, "reused");
    w.now += 1;
    assert_ne!(status(&mut w), first, "rebuilt");
    let published = w.published.clone();
    w.advance(PUBLISH_EVERY_NS);
    assert!(!Arc::ptr_eq(&published, &w.published), "published anew");
}

#[test]
fn a_report_reflects_everything_handled_before_the_question() {
    let mut w = World::new(CONFIG, true);
    let c = client_a(&mut w);
    let gpus = |w: &mut World| {
        w.send(c, ClientMsg::Status);
        match last(w, c) {
            Some(ServerMsg::Status { report }) => report.gpus.len(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(gpus(&mut w), 0);
    w.send(c, ClientMsg::Acquire { gpu: GPU });
    assert_eq!(
        gpus(&mut w),
        1,
        "the GPU acquired a moment ago is in the report"
    );
}

#[test]
fn the_census_lists_unhooked_processes_but_not_one_that_connected_meanwhile() {
    let mut w = World::new(CONFIG, false);
    let census = (w.work.iter())
        .position(|x| matches!(x, Work::Census(_)))
        .expect("a census at start");
    let c = w.connect(1000, None);
    let resolve = (w.work.iter())
        .position(|x| matches!(x, Work::Resolve(_)))
        .unwrap();
    w.complete(resolve);
    w.hello(c, None);
    let pid = w.tenants[&c].peer.pid;
    w.complete(census);
    w.now += STATUS_REUSE_NS;
    w.send(c, ClientMsg::Status);
    let Some(ServerMsg::Status { report }) = last(&w, c) else {
        panic!("no report")
    };
    let pids: Vec<u32> = report.unhooked.iter().map(|u| u.pid).collect();
    assert_eq!(
        pids,
        vec![1],
        "pid {pid} connected while the census was taken"
    );
    assert!(
        !(w.work.iter()).any(|x| matches!(x, Work::Census(_))),
        "the next one is taken later"
    );
    w.advance(CENSUS_EVERY_NS);
    assert!((w.work.iter()).any(|x| matches!(x, Work::Census(_))));
}

#[test]
fn the_loop_latency_the_shell_measures_is_reported() {
    let mut w = World::new(CONFIG, false);
    let c = client_a(&mut w);
    for ns in [5_000, 20_000, 3_000_000] {
        w.node.note_lateness(ns);
    }
    w.now += STATUS_REUSE_NS;
    w.send(c, ClientMsg::Status);
    let Some(ServerMsg::Status { report }) = last(&w, c) else {
        panic!("no report")
    };
    assert_eq!(report.event_loop.count, 3);
    assert_eq!(report.event_loop.max_s, 0.003);
}

/// A loop whose timers fire late grants the next turn earlier by that lateness (so that the
/// grant, sent late, still reaches its holder before the turn starts), and on time again once
/// the lateness is a couple of seconds old.
#[test]
fn a_late_loop_grants_the_next_turn_earlier_by_its_lateness() {
    const STEP: u64 = 10_000;
    // When b, waiting behind a, is granted its turn, after both asked; `late`: the loop's
    // timer fired that late just before.
    let granted_after = |late: u64, forgotten: bool| {
        let mut w = World::new(CONFIG, false);
        let (a, b) = clients_a_and_b(&mut w);
        let now = w.now;
        w.node.note_timer_lateness(late, now);
        if forgotten {
            w.advance(3 * S);
            let now = w.now;
            w.node.note_timer_lateness(0, now);
        }
        w.send(a, ClientMsg::Acquire { gpu: GPU });
        w.send(b, ClientMsg::Acquire { gpu: GPU });
        let start = w.now;
        let granted = |w: &World| {
            (w.tenants[&b].received.iter()).any(|m| matches!(m, ServerMsg::Grant { .. }))
        };
        while !granted(&w) {
            assert!(w.now < start + S, "b is never granted a turn");
            w.advance(STEP);
        }
        w.now - start
    };
    let on_time = granted_after(0, false);
    let late = granted_after(4 * MS, false);
    assert!(
        on_time.abs_diff(late + 4 * MS) <= STEP,
        "granted {on_time} ns after asking on time, {late} ns when 4 ms late"
    );
    let much_later = granted_after(500 * MS, false);
    assert!(
        on_time.abs_diff(much_later + 13 * MS) <= STEP,
        "at most a quota less a minimum quota ahead: {much_later} ns against {on_time} ns"
    );
    assert_eq!(granted_after(4 * MS, true), on_time, "forgotten");
}

#[test]
fn a_connection_flood_costs_no_client_its_turn_or_its_answers() {
    let mut w = World::new(CONFIG, false);
    let a = client_a(&mut w);
    w.send(a, ClientMsg::Acquire { gpu: GPU });
    // Thousands of connections that never say Hello, of many users.
    for i in 0..3_000u32 {
        w.connect(1000 + i % 50, None);
    }
    w.complete_all();
    let req = reserve(&mut w, a, 10);
    w.complete_all();
    assert!(
        matches!(last(&w, a), Some(ServerMsg::Memory { req: r, granted: true, .. }) if *r == req)
    );
    w.advance(3 * S);
    let open = (w.tenants.values()).filter(|t| !t.closed).count();
    assert_eq!(open, 1, "the silent ones are closed at their Hello timeout");
    w.settle();
    w.check_settled();
}

/// Tokens the policy hands out are small numbers: samples use them so that mutated messages
/// reach turns that exist.
fn client_msgs() -> Vec<ClientMsg> {
    let used = gpushare_protocol::TurnUse {
        first_ns: 1_000_000,
        last_ns: 3_000_000,
    };
    vec![
        ClientMsg::Hello {
            version: PROTOCOL_VERSION,
            declared: Some(GroupSpec {
                name: "dev".into(),
                request: 0.5,
                limit: 1.0,
                weight: 2.0,
                memory: Some(1 << 30),
                latency: false,
            }),
        },
        ClientMsg::Acquire { gpu: GPU },
        ClientMsg::Yield {
            gpu: GPU,
            token: 1,
            drained_ns: 2_000_000,
        },
        ClientMsg::Report {
            gpu: GPU,
            token: 2,
            used: Some(used),
            again: true,
        },
        ClientMsg::Report {
            gpu: GPU,
            token: 1,
            used: None,
            again: false,
        },
        ClientMsg::Status,
        ClientMsg::MemReserve {
            req: 1,
            gpu: GPU,
            bytes: 512 << 20,
        },
        ClientMsg::MemFree {
            gpu: GPU,
            bytes: 256 << 20,
        },
        ClientMsg::MemQuery { req: 2, gpu: GPU },
        ClientMsg::MemSync {
            gpu: GPU,
            bytes: 1 << 20,
        },
        ClientMsg::Probe { gpu: GPU },
    ]
}

/// A connection `conn` of pid 1 (uid 1000) as the shell and its `/proc` reader report it.
fn admit(node: &mut Node, conn: ConnId, now: u64) {
    let cred = Credentials {
        pid: 1,
        uid: 1000,
        gid: 1000,
    };
    node.handle(Input::Accepted { conn, cred }, now);
    let peer = Peer {
        pid: 1,
        start: 7,
        uid: 1000,
        gid: 1000,
        cgroup: "/user.slice".into(),
        pod: None,
    };
    let resolved = Input::Resolved {
        conn,
        peer,
        pid_ns: None,
    };
    node.handle(resolved, now);
}

/// A fresh `--dev` node with a connection (driven directly, without a world: hostile clients
/// break the world's model of a tenant, not the node).
fn dev_node() -> (Node, ConnId, u64) {
    let config = Config::parse(CONFIG).unwrap();
    let now = S;
    let mut node = Node::new(
        NodeOptions {
            config,
            dev: true,
            restored: Vec::new(),
            memory_overcommit: None,
        },
        now,
    );
    admit(&mut node, 1, now);
    (node, 1, now)
}

/// Hostile tenants of a `--dev` scheduler: whatever a socket decodes goes to the node, with
/// the clock moving, the books written and the timers served.
#[test]
fn hostile_client_streams_are_handled_without_panicking() {
    let (mut node, mut conn, mut now) = dev_node();
    let mut handled = 0usize;
    let n = 30_000;
    fuzz::frames(51, &client_msgs(), n, |msg| {
        // A fresh node now and then, so that random GPUs and groups do not pile up.
        if handled.is_multiple_of(1_000) {
            (node, conn, now) = dev_node();
        }
        handled += 1;
        now += 500_000;
        node.handle(Input::Message { conn, msg }, now);
        for e in node.take_effects() {
            match e {
                Effect::Persist { seq, .. } => {
                    let written = seq % 3 != 0;
                    node.handle(Input::Persisted { seq, written }, now)
                }
                Effect::Close { .. } => {
                    // Refused: the next messages come from a new connection.
                    conn += 1;
                    admit(&mut node, conn, now);
                }
                _ => {}
            }
        }
        node.handle(Input::Tick, now);
        node.take_effects();
    })
    .assert_exercised(n);
    assert!(handled > n / 10, "{handled} messages handled");
}

/// Hostile admin requests as the agent's socket decodes them; a tenant of those pods keeps
/// using the GPU meanwhile.
#[test]
fn hostile_admin_streams_are_applied_without_panicking() {
    // A second pod of the same name whose UID has a multi-byte character across byte 8,
    // where the group's disambiguating suffix was cut (regression: a slicing panic).
    let mut b = pod_group(1);
    b.pod_uid = "pod-uidé-1".into();
    let a = pod_group(0);
    let samples = [
        AdminRequest::Sync {
            groups: vec![a.clone()],
        },
        AdminRequest::Upsert { group: b.clone() },
        AdminRequest::Upsert { group: a.clone() },
        AdminRequest::Remove {
            key: ContainerKey {
                pod_uid: a.pod_uid.clone(),
                container: a.container.clone(),
            },
        },
        AdminRequest::Remove {
            key: ContainerKey {
                pod_uid: b.pod_uid.clone(),
                container: "c1".into(),
            },
        },
        AdminRequest::Usage,
    ];
    let (mut node, conn, mut now) = dev_node();
    node.handle(
        Input::Message {
            conn,
            msg: ClientMsg::Hello {
                version: PROTOCOL_VERSION,
                declared: None,
            },
        },
        now,
    );
    let (mut token, mut applied) = (0u64, 0usize);
    let n = 100_000;
    fuzz::frames(52, &samples, n, |req| {
        now += 500_000;
        token += 1;
        node.handle(Input::Admin { token, req }, now);
        node.handle(
            Input::Message {
                conn,
                msg: ClientMsg::Acquire { gpu: GPU },
            },
            now,
        );
        for e in node.take_effects() {
            if let Effect::AdminReply {
                token: t,
                reply: AdminReply::Done,
            } = e
            {
                assert_eq!(t, token);
                applied += 1;
            }
        }
    })
    .assert_exercised(n);
    assert!(applied > 0);
}

/// Config files as an administrator might break them: whatever parses is applied to a
/// running node as on reload (anything else keeps the previous config).
#[test]
fn hostile_configs_are_rejected_or_applied_without_panicking() {
    let samples = [
        "[scheduler]\nquota = \"10ms\"\nmin_quota = \"1ms\"\ngrace = \"5ms\"\nwindow = \"5s\"\ngrant_ahead = \"2ms\"\n",
        "[[group]]\nname = \"train\"\nuids = [1000]\ngids = [7]\nrequest = 0.3\nlimit = 0.6\nweight = 1.5\nmemory = \"4GiB\"\n",
        "[[group]]\nname = \"pods\"\ncgroups = [\"kubepods/pod42\"]\nweight = 2\n",
    ];
    let (mut node, conn, mut now) = dev_node();
    node.handle(
        Input::Message {
            conn,
            msg: ClientMsg::Hello {
                version: PROTOCOL_VERSION,
                declared: None,
            },
        },
        now,
    );
    let n = 50_000;
    fuzz::texts(53, &samples, n, |text| {
        let Ok(cfg) = Config::parse(text) else {
            return false;
        };
        now += 500_000;
        node.handle(Input::Config(Box::new(cfg)), now);
        let acquire = ClientMsg::Acquire { gpu: GPU };
        node.handle(Input::Message { conn, msg: acquire }, now);
        node.handle(Input::Tick, now + S);
        now += S;
        node.take_effects();
        true
    })
    .assert_exercised(n);
}

/// Groups `a` (cap 1 GiB) and `b` (512 MiB) under `memory_overcommit = 2` on a GPU of 1 GiB,
/// its memory told by a hook; `extra` goes into `[overcommit]`. The clients of `a` and `b`.
fn overcommitted(extra: &str) -> (World, ConnId, ConnId) {
    let config =
        format!("memory_overcommit = 2\n[overcommit]\nwait = \"100ms\"\n{extra}\n{CONFIG}");
    let mut w = World::new(&config, false);
    let (a, b) = clients_a_and_b(&mut w);
    w.send(
        a,
        ClientMsg::MemTotal {
            gpu: GPU,
            bytes: 1024 * MIB,
        },
    );
    reserve(&mut w, a, 900);
    w.complete_all();
    assert!(matches!(
        last(&w, a),
        Some(ServerMsg::Memory { granted: true, .. })
    ));
    (w, a, b)
}

fn granted(w: &World, c: ConnId, req: u64) -> Option<bool> {
    w.tenants[&c].received.iter().find_map(|m| match m {
        ServerMsg::Memory {
            req: r, granted, ..
        } if *r == req => Some(*granted),
        _ => None,
    })
}

/// The report `c` is sent when it asks.
fn report(w: &mut World, c: ConnId) -> Report {
    w.send(c, ClientMsg::Status);
    match last(w, c) {
        Some(ServerMsg::Status { report }) => Report::clone(report),
        other => panic!("{other:?}"),
    }
}

fn group_report<'r>(r: &'r Report, name: &str) -> &'r GroupReport {
    (r.gpus[0].groups.iter())
        .find(|g| g.name == name)
        .unwrap_or_else(|| panic!("no group {name} in {r:?}"))
}

/// A group swapped out while it holds a turn: its process, locked, hears the turn revoked once,
/// not again when the turn's grace passes without its report (it cannot report while locked).
#[test]
fn a_turn_held_as_its_group_is_swapped_out_is_revoked_once() {
    let (mut w, a, b) = overcommitted("");
    w.send(a, ClientMsg::Acquire { gpu: GPU });
    let Some(&ServerMsg::Grant { token, .. }) = last(&w, a) else {
        panic!("a holds a turn: {:?}", last(&w, a));
    };
    // b's reservation does not fit: a is swapped out after the wait (0.1 s + 400 MiB at
    // 1.5 GB/s), its turn revoked then.
    reserve(&mut w, b, 400);
    w.complete_all();
    w.advance(400 * MS);
    assert!(w.node.policies[&GPU].suspended("a"));
    // Well past the turn's end and grace, a locked all along.
    w.advance(S);
    let revoked: Vec<u64> = (w.tenants[&a].received.iter())
        .filter_map(|m| match m {
            ServerMsg::Revoke { token, .. } => Some(*token),
            _ => None,
        })
        .collect();
    assert_eq!(revoked, vec![token]);
}

#[test]
fn under_overcommit_a_reservation_that_does_not_fit_waits_then_another_group_is_swapped_out() {
    let (mut w, a, b) = overcommitted("");
    let pid_a = w.tenants[&a].peer.pid;
    // a asks for the reports: b's reservation waits for its answer, and answers come in order.
    // 400 MiB within b's cap, but 900 + 400 MiB do not fit in 1 GiB: no answer yet.
    let req = reserve(&mut w, b, 400);
    w.complete_all();
    assert_eq!(granted(&w, b, req), None, "waits");
    assert!(w.swaps.is_empty());
    assert_eq!(
        report(&mut w, a).gpus[0].physical.as_ref().unwrap().waiting,
        1
    );
    // It waits as long as a swap of its bytes would take (0.1 s + 400 MiB at 1.5 GB/s), then
    // a's processes are swapped out.
    w.advance(400 * MS);
    assert_eq!(w.swaps, vec![(1, vec![pid_a], true)]);
    assert!(
        w.node.policies[&GPU].suspended("a"),
        "no turns from the swap-out on"
    );
    assert!(!w.node.policies[&GPU].suspended("b"));
    let r = report(&mut w, a);
    assert_eq!(group_report(&r, "a").memory_state, MemoryState::SwappingOut);
    assert_eq!(group_report(&r, "b").memory_state, MemoryState::Resident);
    // The checkpoint ends at 0.7 s.
    w.advance(300 * MS);
    w.input(Input::SwappedOut {
        swap: 1,
        outcome: Ok(()),
    });
    w.complete_all();
    assert_eq!(granted(&w, b, req), Some(true), "granted once a is out");
    let r = report(&mut w, a);
    let ga = group_report(&r, "a");
    assert_eq!(ga.memory_state, MemoryState::SwappedOut);
    assert_eq!(ga.memory_swapped, 900 * MIB);
    let physical = r.gpus[0].physical.as_ref().unwrap();
    assert_eq!(
        (
            physical.used,
            physical.free,
            physical.swapped,
            physical.waiting
        ),
        (400 * MIB, 624 * MIB, 900 * MIB, 0)
    );
    let s = &r.memory_swaps;
    assert_eq!((s.swap_outs, s.swap_ins, s.allocation_waits), (1, 0, 1));
    assert_eq!(s.swap_out_seconds.count, 1);
    // From the decision, when the wait ran out (0.1 s + 400 MiB at 1.5 GB/s), to 0.7 s.
    let decided_s = 0.1 + (400 * MIB) as f64 / 1.5e9;
    assert!(
        (s.swap_out_seconds.sum_s - (0.7 - decided_s)).abs() < 1e-6,
        "{s:?}"
    );
    assert_eq!(s.allocation_wait_seconds.count, 1);
    assert!(
        (s.allocation_wait_seconds.sum_s - 0.7).abs() < 1e-6,
        "from the reservation to the checkpoint's end: {s:?}"
    );
    // b frees its memory: nothing waits, so a comes back, in 200 ms.
    w.send(
        b,
        ClientMsg::MemFree {
            gpu: GPU,
            bytes: 400 * MIB,
        },
    );
    assert_eq!(w.swaps.last(), Some(&(1, vec![pid_a], false)));
    assert_eq!(
        group_report(&report(&mut w, a), "a").memory_state,
        MemoryState::SwappingIn
    );
    w.advance(200 * MS);
    assert!(
        w.node.policies[&GPU].suspended("a"),
        "none while it comes back"
    );
    w.input(Input::SwappedIn { swap: 1, ok: true });
    assert!(
        !w.node.policies[&GPU].suspended("a"),
        "turns again once back"
    );
    let r = report(&mut w, a);
    assert_eq!(group_report(&r, "a").memory_state, MemoryState::Resident);
    assert_eq!(group_report(&r, "a").memory_swapped, 0);
    let s = &r.memory_swaps;
    assert_eq!((s.swap_ins, s.swap_in_seconds.count), (1, 1));
    assert!((s.swap_in_seconds.sum_s - 0.2).abs() < 1e-6, "{s:?}");
    w.settle();
    w.check_settled();
}

/// Under [`overcommitted`]: `a` (900 MiB) swapped out for `b`'s 400 MiB, the books on disk;
/// then `a`'s process is cut off from the node (it runs on, but never reconnects) and the
/// node restarts: `b` reconnects, restates its 400 MiB and says the GPU's memory, `a` is only
/// in the journal. The world, `a`'s process, and `b`'s new connection.
fn restarted_with_a_swapped_out_and_cut_off() -> (World, ProcessId, ConnId) {
    let (mut w, a, b) = overcommitted("");
    let req = reserve(&mut w, b, 400);
    w.advance(400 * MS);
    let process = w.tenants[&a].peer.process();
    assert_eq!(w.swaps, vec![(1, vec![process.pid], true)]);
    w.input(Input::SwappedOut {
        swap: 1,
        outcome: Ok(()),
    });
    w.complete_all();
    assert_eq!(granted(&w, b, req), Some(true));
    w.tenants.get_mut(&a).expect("a").cut_off = true;
    w.restart();
    let back: Vec<ConnId> = (w.tenants.iter())
        .filter(|(_, t)| !t.closed)
        .map(|(c, _)| *c)
        .collect();
    assert_eq!(back.len(), 1, "b reconnected, a did not");
    let b = back[0];
    w.send(
        b,
        ClientMsg::MemTotal {
            gpu: GPU,
            bytes: 1024 * MIB,
        },
    );
    w.complete_all();
    assert_eq!(w.node.memory.used("a", &GPU), 900 * MIB, "a's ghost counts");
    (w, process, b)
}

/// The ids of the settles the node asked for `process` ([`Effect::Settle`]).
fn settles_of(w: &World, process: ProcessId) -> Vec<u64> {
    (w.settles.iter())
        .filter(|(_, p)| *p == process)
        .map(|(id, _)| *id)
        .collect()
}

/// Answer the settles of `b`'s process (asked as a ghost at the start, then as a client once
/// it restated): its memory is on the GPU.
fn settle_running(w: &mut World, b: ConnId) {
    for id in settles_of(w, w.tenants[&b].peer.process()) {
        w.input(Input::Settled {
            id,
            checkpointed: false,
        });
    }
}

/// The one settle the node asked for `a`'s process, which never reconnected: its id.
fn settle_of_ghost(w: &World, a: ProcessId) -> u64 {
    let ids = settles_of(w, a);
    assert_eq!(
        ids.len(),
        1,
        "the driver asked once about {a:?}: {:?}",
        w.settles
    );
    ids[0]
}

#[test]
fn under_overcommit_a_swapped_out_process_that_never_reconnects_after_a_restart_is_found_in_host_memory_and_restored()
 {
    let (mut w, a, b) = restarted_with_a_swapped_out_and_cut_off();
    settle_running(&mut w, b);
    // The driver is asked about a's process though it never reconnects (pid and start time).
    let id = settle_of_ghost(&w, a);
    assert!(w.swaps.len() == 1, "nothing moves before the driver says");
    w.input(Input::Settled {
        id,
        checkpointed: true,
    });
    let r = report(&mut w, b);
    let ga = group_report(&r, "a");
    assert_eq!(ga.memory_state, MemoryState::SwappedOut);
    assert_eq!(ga.memory_swapped, 900 * MIB);
    let physical = r.gpus[0].physical.as_ref().unwrap();
    assert_eq!(
        (physical.used, physical.swapped),
        (400 * MIB, 900 * MIB),
        "a's memory booked in host memory"
    );
    assert!(w.node.policies[&GPU].suspended("a"), "no turns while out");
    // b frees its memory: a's fits again and is restored, by its pid.
    w.send(
        b,
        ClientMsg::MemFree {
            gpu: GPU,
            bytes: 400 * MIB,
        },
    );
    assert_eq!(w.swaps.len(), 2);
    let (swap, pids, out) = w.swaps[1].clone();
    assert_eq!((pids, out), (vec![a.pid], false), "a restored");
    w.advance(200 * MS);
    w.input(Input::SwappedIn { swap, ok: true });
    let r = report(&mut w, b);
    assert_eq!(group_report(&r, "a").memory_state, MemoryState::Resident);
    let physical = r.gpus[0].physical.as_ref().unwrap();
    assert_eq!((physical.used, physical.swapped), (900 * MIB, 0));
    assert!(!w.node.policies[&GPU].suspended("a"), "turns again");
    w.settle();
    w.check_settled();
}

#[test]
fn under_overcommit_a_process_that_never_reconnects_found_on_the_gpu_after_a_restart_is_a_victim_again()
 {
    let (mut w, a, b) = restarted_with_a_swapped_out_and_cut_off();
    settle_running(&mut w, b);
    // Its swap was cut short before the checkpoint (undone: unlocked by the shell).
    let id = settle_of_ghost(&w, a);
    w.input(Input::Settled {
        id,
        checkpointed: false,
    });
    let r = report(&mut w, b);
    assert_eq!(group_report(&r, "a").memory_state, MemoryState::Resident);
    assert!(!w.node.policies[&GPU].suspended("a"));
    // b's next 400 MiB do not fit beside a's 900: a is swapped out for it, by its pid.
    w.send(
        b,
        ClientMsg::MemFree {
            gpu: GPU,
            bytes: 400 * MIB,
        },
    );
    let req = reserve(&mut w, b, 400);
    w.complete_all();
    assert_eq!(granted(&w, b, req), None, "waits");
    w.advance(400 * MS);
    let (swap, pids, out) = w.swaps.last().cloned().expect("a swap");
    assert_eq!((pids, out), (vec![a.pid], true), "a is the victim");
    w.input(Input::SwappedOut {
        swap,
        outcome: Ok(()),
    });
    w.complete_all();
    assert_eq!(granted(&w, b, req), Some(true));
    w.settle();
    w.check_settled();
}

#[test]
fn under_overcommit_a_wait_is_bounded_and_its_refusal_says_why_and_frees_the_cap() {
    let (mut w, _a, b) = overcommitted("max_wait = \"2s\"");
    let req = reserve(&mut w, b, 400);
    w.advance(400 * MS);
    assert_eq!(w.swaps.len(), 1);
    // The only victim's checkpoint times out: it cools down longer than the bound.
    w.input(Input::SwappedOut {
        swap: 1,
        outcome: Err(SwapOutFailure::TimedOut),
    });
    assert!(
        !w.node.policies[&GPU].suspended("a"),
        "a failed swap-out: it runs on"
    );
    w.advance(1500 * MS);
    assert_eq!(granted(&w, b, req), None, "still within the bound");
    w.advance(100 * MS);
    assert_eq!(granted(&w, b, req), Some(false), "refused at the bound");
    let said = w.tenants[&b].received.iter().any(|m| {
        matches!(m, ServerMsg::Error { message, fatal: false }
            if message.contains("did not come free") && message.contains("max_wait"))
    });
    assert!(said, "{:?}", w.tenants[&b].received);
    // Its reservation no longer counts against b's cap.
    let q = w.req(b);
    w.send(b, ClientMsg::MemQuery { req: q, gpu: GPU });
    assert!(matches!(
        last(&w, b),
        Some(ServerMsg::Memory { used: 0, .. })
    ));
}

#[test]
fn without_overcommit_the_gpus_memory_is_not_checked() {
    // Group a uncapped: capped, its cap would be clamped to the GPU.
    let mut w = World::new("[[group]]\nname = \"a\"\nuids = [1000]\n", false);
    let a = client_a(&mut w);
    w.send(
        a,
        ClientMsg::MemTotal {
            gpu: GPU,
            bytes: 100 * MIB,
        },
    );
    let req = reserve(&mut w, a, 900);
    w.complete_all();
    assert_eq!(granted(&w, a, req), Some(true));
    assert!(w.swaps.is_empty());
}

/// Group a says `said` (it holds memory it cannot be swapped out with): b's reservation that
/// only a's memory could make room for is refused, naming a and `why`, and no checkpoint is
/// tried.
fn never_swapped_out_after(said: ClientMsg, why: &str) {
    let (mut w, a, b) = overcommitted("");
    w.send(a, said);
    let req = reserve(&mut w, b, 400);
    w.complete_all();
    w.advance(400 * MS);
    assert!(w.swaps.is_empty(), "no checkpoint tried: {:?}", w.swaps);
    assert_eq!(
        granted(&w, b, req),
        Some(false),
        "nothing else could make room"
    );
    let said = w.tenants[&b].received.iter().any(|m| {
        matches!(m, ServerMsg::Error { message, fatal: false }
            if message.contains(&format!("group \"a\" holds 900 MiB of {why}")))
    });
    assert!(said, "{:?}", w.tenants[&b].received);
    let s = report(&mut w, a).memory_swaps;
    assert_eq!((s.swap_outs, s.swap_out_failures), (0, 0));
}

#[test]
fn under_overcommit_a_group_that_said_it_holds_managed_memory_is_never_swapped_out() {
    never_swapped_out_after(ClientMsg::MemManaged, "managed memory");
}

#[test]
fn under_overcommit_a_group_that_said_it_shares_memory_over_ipc_is_never_swapped_out() {
    never_swapped_out_after(
        ClientMsg::MemIpc,
        "memory shared with another process (IPC)",
    );
}

/// What `c`'s group may hold on the GPU, as a query answers.
fn cap_of(w: &mut World, c: ConnId) -> Option<u64> {
    let q = w.req(c);
    w.send(c, ClientMsg::MemQuery { req: q, gpu: GPU });
    match last(w, c) {
        Some(ServerMsg::Memory { cap, .. }) => *cap,
        other => panic!("{other:?}"),
    }
}

#[test]
fn caps_past_the_overcommit_ratio_leave_the_group_that_came_last_what_is_left() {
    // a (1 GiB) came before b (512 MiB); caps may sum to 1.5 x 768 MiB = 1152 MiB.
    let config = format!("memory_overcommit = 1.5\n{CONFIG}");
    let mut w = World::new(&config, false);
    let (a, b) = clients_a_and_b(&mut w);
    assert_eq!(
        cap_of(&mut w, b),
        Some(512 * MIB),
        "the GPU's memory not known yet"
    );
    w.send(
        a,
        ClientMsg::MemTotal {
            gpu: GPU,
            bytes: 768 * MIB,
        },
    );
    assert_eq!(
        cap_of(&mut w, a),
        Some(1024 * MIB),
        "the first keeps its cap"
    );
    assert_eq!(
        cap_of(&mut w, b),
        Some(128 * MIB),
        "the last gets what is left"
    );
    // Past the clamped cap, though within the one asked: refused, and told why.
    let req = reserve(&mut w, b, 200);
    w.complete_all();
    assert_eq!(granted(&w, b, req), Some(false));
    let r = report(&mut w, a);
    let (ga, gb) = (group_report(&r, "a"), group_report(&r, "b"));
    assert_eq!((ga.memory_cap, ga.memory_clamped), (Some(1024 * MIB), None));
    assert_eq!(
        (gb.memory_cap, gb.memory_clamped),
        (Some(128 * MIB), Some(512 * MIB))
    );
    let said = w.tenants[&b].received.iter().any(|m| {
        matches!(m, ServerMsg::Error { message, fatal: false }
            if message.contains("group \"b\"'s memory cap of 512 MiB is clamped to 128 MiB")
                && message.contains("already promise 1024 of the 1152 MiB that memory_overcommit = 1.5 allows"))
    });
    assert!(said, "{:?}", w.tenants[&b].received);
    let req = reserve(&mut w, b, 100);
    w.complete_all();
    assert_eq!(granted(&w, b, req), Some(true), "within the clamped cap");

    // A cap that changes keeps its place: a lowered to 768 MiB makes room for b's whole cap.
    w.reload(&config.replace("memory = \"1GiB\"", "memory = \"768MiB\""));
    assert_eq!(cap_of(&mut w, a), Some(768 * MIB));
    assert_eq!(
        cap_of(&mut w, b),
        Some(384 * MIB),
        "still clamped, to what a leaves"
    );
    // A higher ratio gives b its whole cap back.
    w.reload(&config.replace("1.5", "2"));
    assert_eq!(cap_of(&mut w, b), Some(512 * MIB));
    let r = report(&mut w, a);
    assert_eq!(group_report(&r, "b").memory_clamped, None);
    // Without overcommit the caps promise at most the GPU: 1 GiB for a, none left for b.
    w.reload(CONFIG);
    assert_eq!(
        cap_of(&mut w, a),
        Some(768 * MIB),
        "clamped to the GPU itself"
    );
    assert_eq!(cap_of(&mut w, b), Some(0));
    w.settle();
    w.check_settled();
}

/// Where the checkpoint API holds a process (the driver, as the random restarts below see it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Running,
    Locked,
    Checkpointed,
}

/// The driver and the daemon's swap thread, for [`World`]: the node's swaps and settles in the
/// order it asked, carried out as the shell does ([`crate::checkpoint`]).
#[derive(Default)]
struct Driver {
    held: BTreeMap<u32, Held>,
    /// How far into the world's swaps, settles and their order the driver has read.
    swaps: usize,
    settles: usize,
    calls: usize,
}

enum Call {
    Swap(u64, Vec<u32>, bool),
    Settle(u64, ProcessId),
}

impl Driver {
    fn state(&self, pid: u32) -> Held {
        self.held.get(&pid).copied().unwrap_or(Held::Running)
    }

    /// The node's next call not carried out yet.
    fn next(&mut self, w: &World) -> Option<Call> {
        let swap = *w.driver_calls.get(self.calls)?;
        self.calls += 1;
        Some(if swap {
            let (id, pids, out) = w.swaps[self.swaps].clone();
            self.swaps += 1;
            Call::Swap(id, pids, out)
        } else {
            let (id, p) = w.settles[self.settles];
            self.settles += 1;
            Call::Settle(id, p)
        })
    }

    /// Carry out every call the node made, answering each.
    fn answer_all(&mut self, w: &mut World) {
        while let Some(call) = self.next(w) {
            let input = match call {
                Call::Swap(swap, pids, true) => {
                    let ok = pids.iter().all(|p| self.state(*p) == Held::Running);
                    if ok {
                        for p in pids {
                            self.held.insert(p, Held::Checkpointed);
                        }
                    }
                    let outcome = if ok {
                        Ok(())
                    } else {
                        Err(SwapOutFailure::TimedOut)
                    };
                    Input::SwappedOut { swap, outcome }
                }
                Call::Swap(swap, pids, false) => {
                    let ok = pids.iter().all(|p| self.state(*p) != Held::Running);
                    for p in pids {
                        self.held.insert(p, Held::Running);
                    }
                    Input::SwappedIn { swap, ok }
                }
                Call::Settle(id, p) => {
                    let gone = (w.tenants.values()).any(|t| t.peer.process() == p && t.exited);
                    if !gone && self.state(p.pid) == Held::Locked {
                        self.held.insert(p.pid, Held::Running);
                    }
                    Input::Settled {
                        id,
                        checkpointed: !gone && self.state(p.pid) == Held::Checkpointed,
                    }
                }
            };
            w.input(input);
            w.complete_all();
        }
    }

    /// The daemon is killed: the call it was making is done as far as `how` says (0: not
    /// begun, 1: its lock or restore done, 2: all of it), the calls after it never begin.
    fn killed(&mut self, w: &World, how: u8) {
        if let Some(call) = self.next(w) {
            match (call, how % 3) {
                (Call::Swap(_, pids, true), n @ 1..) => {
                    let to = if n == 1 {
                        Held::Locked
                    } else {
                        Held::Checkpointed
                    };
                    for p in pids {
                        if self.state(p) == Held::Running {
                            self.held.insert(p, to);
                        }
                    }
                }
                (Call::Swap(_, pids, false), n @ 1..) => {
                    let to = if n == 1 { Held::Locked } else { Held::Running };
                    for p in pids {
                        if self.state(p) != Held::Running {
                            self.held.insert(p, to);
                        }
                    }
                }
                _ => {}
            }
        }
        self.calls = w.driver_calls.len();
        self.swaps = w.swaps.len();
        self.settles = w.settles.len();
    }
}

#[derive(Debug, Clone)]
enum Step {
    Reserve {
        who: usize,
        mib: u64,
    },
    Free {
        who: usize,
        mib: u64,
    },
    Advance {
        ms: u64,
    },
    Answer,
    /// The daemon killed and restarted; `cut`: that tenant cannot reconnect (at most one per
    /// life is).
    Restart {
        how: u8,
        cut: Option<usize>,
    },
}

/// The tenant a step makes a call of.
fn step_of(s: &Step) -> Option<usize> {
    match *s {
        Step::Reserve { who, .. } | Step::Free { who, .. } => Some(who),
        _ => None,
    }
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..3usize, 1..700u64).prop_map(|(who, mib)| Step::Reserve { who, mib }),
        2 => (0..3usize, 1..700u64).prop_map(|(who, mib)| Step::Free { who, mib }),
        3 => (0..1500u64).prop_map(|ms| Step::Advance { ms }),
        3 => Just(Step::Answer),
        1 => (any::<u8>(), proptest::option::of(0..3usize))
            .prop_map(|(how, cut)| Step::Restart { how, cut }),
    ]
}

/// One random life under [`overcommitted`] (tenants a, a and b on a 1 GiB GPU whose caps sum to
/// 1.5 GiB) with swaps, daemons killed mid-call and a tenant cut off: once the others exit, the
/// driver holds every live process running — none left locked or in host memory. Whether the
/// tenant cut off was in host memory when its daemon was killed.
fn random_restarts_life(steps: &[Step]) -> bool {
    use gpushare_protocol::ServerMsg;
    let (mut w, a1, b) = overcommitted("");
    let a2 = client_a(&mut w);
    let pids: Vec<u32> = [a1, a2, b].iter().map(|c| w.tenants[c].peer.pid).collect();
    let conn = |w: &World, pid: u32| {
        (w.tenants.iter())
            .find(|(_, t)| t.peer.pid == pid && !t.closed)
            .map(|(c, _)| *c)
    };
    let mut d = Driver::default();
    let mut cut: Option<u32> = None;
    let mut cut_out = false;
    for s in steps {
        match *s {
            // A process the driver holds locked or checkpointed makes no call (they block).
            _ if step_of(s).is_some_and(|who| d.state(pids[who]) != Held::Running) => {}
            Step::Reserve { who, mib } => {
                // One allocation at a time per process (the replies' order is checked).
                if let Some(c) = conn(&w, pids[who]).filter(|c| !w.tenants[c].asking()) {
                    reserve(&mut w, c, mib);
                }
            }
            Step::Free { who, mib } => {
                if let Some(c) = conn(&w, pids[who]) {
                    let held = w.tenants[&c].held.get(&GPU).copied().unwrap_or(0);
                    let bytes = (mib * MIB).min(held);
                    w.send(c, ClientMsg::MemFree { gpu: GPU, bytes });
                }
            }
            Step::Advance { ms } => w.advance(ms * MS),
            Step::Answer => d.answer_all(&mut w),
            Step::Restart { how, cut: c } => {
                w.complete_all();
                d.killed(&w, how);
                if let Some(who) = c.filter(|_| cut.is_none())
                    && let Some(conn) = conn(&w, pids[who])
                {
                    w.tenants.get_mut(&conn).expect("live").cut_off = true;
                    cut = Some(pids[who]);
                    cut_out = d.state(pids[who]) == Held::Checkpointed;
                }
                w.restart();
                // The hooks' greeting says the GPU's memory first.
                let back = pids.iter().find_map(|p| conn(&w, *p));
                if let Some(c) = back {
                    let bytes = 1024 * MIB;
                    w.send(c, ClientMsg::MemTotal { gpu: GPU, bytes });
                }
            }
        }
        w.complete_all();
    }
    // The others exit; the cut-off process, if any, is all that is left.
    for t in w.tenants.values_mut() {
        if Some(t.peer.pid) != cut {
            t.exited = true;
        }
    }
    for _ in 0..5 {
        d.answer_all(&mut w);
        w.advance(S);
        w.complete_all();
    }
    d.answer_all(&mut w);
    for pid in &pids {
        let alive = Some(*pid) == cut;
        assert!(
            !alive || d.state(*pid) == Held::Running,
            "pid {pid} (cut off: {cut:?}) left {:?}\n{steps:?}",
            d.state(*pid)
        );
    }
    let lost = (w.tenants.values()).flat_map(|t| &t.received).any(
        |m| matches!(m, ServerMsg::Error { fatal: true, message } if message.contains("restored")),
    );
    assert!(!lost, "a restore failed\n{steps:?}");
    cut_out
}

/// Random lives of [`random_restarts_life`]; among them, some whose tenant cut off was in host
/// memory when the daemon was killed.
#[test]
fn under_overcommit_random_restarts_leave_no_process_locked_or_in_host_memory() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let lives = proptest::collection::vec(step(), 1..60);
    let mut cut_out = 0;
    for _ in 0..1000 {
        let steps = lives.new_tree(&mut runner).expect("a life").current();
        cut_out += u32::from(random_restarts_life(&steps));
    }
    eprintln!("{cut_out} of 1000 lives cut off a process in host memory");
    assert!(
        cut_out >= 20,
        "{cut_out} lives cut off a process in host memory"
    );
}
