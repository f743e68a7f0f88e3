//! Virtual-time tests of the device model.

use super::*;
use crate::trace::Record;
use gpushare_sim_wire::Op;

const MS: u64 = 1_000_000;
const US: u64 = 1_000;

fn model(preempt: bool) -> Model {
    Model::new(ModelConfig {
        device_memory: vec![1 << 30, 1 << 30],
        preempt,
        ..ModelConfig::default()
    })
}

/// One client with one context on `device` and one stream (id 1) that has spin function 1.
fn client(m: &mut Model, conn: ConnId, device: u32) {
    m.connect(conn, 100 + conn);
    assert!(m.create_context((conn, 1), device));
    assert!(m.create_stream((conn, 1), (conn, 1), 0));
    m.register_function((conn, 1), "gpushare_spin");
}

fn spin(m: &mut Model, now: u64, conn: ConnId, stream: u64, seq: u64, ns: u64) {
    let op = Op::Kernel {
        function: 1,
        arg0: Some(ns),
    };
    m.submit(now, (conn, stream), seq, &[], &op).unwrap();
}

fn busy_by_conn(trace: &[Record], pid: u32, from: u64, to: u64) -> u64 {
    trace
        .iter()
        .filter(|r| r.pid == pid)
        .map(|r| r.end_ns.min(to).saturating_sub(r.start_ns.max(from)))
        .sum()
}

fn assert_no_overlap(trace: &[Record]) {
    let mut t: Vec<_> = trace.to_vec();
    t.sort_by_key(|r| (r.device, r.start_ns));
    for w in t.windows(2) {
        if w[0].device == w[1].device {
            assert!(
                w[0].end_ns <= w[1].start_ns,
                "overlap: {:?} {:?}",
                w[0],
                w[1]
            );
        }
    }
}

#[test]
fn lone_kernels_run_back_to_back_and_complete_on_time() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    let t0 = 10 * MS;
    for seq in 1..=3 {
        spin(&mut m, t0, 1, 1, seq, 100 * US);
    }
    m.advance(t0);
    assert_eq!(m.completion((1, 1), 1), Some(t0 + 100 * US));
    assert_eq!(m.completion((1, 1), 3), Some(t0 + 300 * US));
    let trace = m.take_trace();
    assert_eq!(trace.len(), 3);
    assert_eq!(trace[0].kernel.as_str(), "gpushare_spin");
}

#[test]
fn work_is_not_committed_beyond_the_current_slice() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    for seq in 1..=10 {
        spin(&mut m, 0, 1, 1, seq, 500 * US);
    }
    m.advance(0);
    assert!(m.completion((1, 1), 2).is_some());
    assert!(
        m.completion((1, 1), 3).is_none(),
        "third kernel is past the 1 ms slice"
    );
    assert_eq!(m.next_wakeup(0), Some(MS));
    m.advance(5 * MS);
    assert_eq!(m.completion((1, 1), 10), Some(5 * MS));
}

#[test]
fn a_device_whose_work_is_all_decided_needs_no_wake_up() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    spin(&mut m, 0, 1, 1, 1, 100 * US);
    m.advance(0);
    assert_eq!(m.completion((1, 1), 1), Some(100 * US));
    // The kernel's end is decided and nothing else is queued: no reason for the device's clock
    // to look at the model again (each wake-up costs the device process a thread switch).
    assert_eq!(m.next_wakeup(0), None);
    // A kernel cut at the slice's end still needs one, by then.
    spin(&mut m, 0, 1, 1, 2, 2 * MS);
    m.advance(0);
    assert!(m.next_wakeup(0).is_some_and(|t| t <= MS));
}

#[test]
fn two_busy_contexts_time_slice_evenly_without_overlap() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    client(&mut m, 2, 0);
    // Each keeps 2 ms kernels queued for a simulated second.
    let mut seqs = [0u64; 3];
    let mut now = 0;
    while now < 1000 * MS {
        for conn in 1..=2u32 {
            let s = &mut seqs[conn as usize];
            while m.completion((conn, 1), s.saturating_sub(1)).is_some() && *s < 1000 {
                *s += 1;
                spin(&mut m, now, conn, 1, *s, 2 * MS);
            }
        }
        m.advance(now);
        now = m.next_wakeup(now).unwrap_or(now + MS).min(now + MS);
    }
    let trace = m.take_trace();
    assert_no_overlap(&trace);
    let a = busy_by_conn(&trace, 101, 100 * MS, 900 * MS) as f64;
    let b = busy_by_conn(&trace, 102, 100 * MS, 900 * MS) as f64;
    let share = a / (a + b);
    assert!((share - 0.5).abs() < 0.02, "share {share}");
    // Preemption at 1 ms slices splits 2 ms kernels.
    assert!(trace.iter().any(|r| r.preempted));
    // Switch costs leave the device idle a little: 25 µs per 1 ms slice.
    let util = (a + b) / (800 * MS) as f64;
    assert!(util > 0.95 && util < 0.99, "utilisation {util}");
}

#[test]
fn without_preemption_kernels_finish_before_the_switch() {
    let mut m = model(false);
    client(&mut m, 1, 0);
    client(&mut m, 2, 0);
    spin(&mut m, 0, 1, 1, 1, 5 * MS);
    spin(&mut m, 0, 2, 1, 1, 5 * MS);
    m.advance(20 * MS);
    let trace = m.take_trace();
    assert_eq!(trace.len(), 2);
    assert!(
        trace
            .iter()
            .all(|r| !r.preempted && r.end_ns - r.start_ns == 5 * MS)
    );
    assert_no_overlap(&trace);
}

#[test]
fn a_context_arriving_mid_slice_waits_for_the_slice_end() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    client(&mut m, 2, 0);
    spin(&mut m, 0, 1, 1, 1, 10 * MS);
    m.advance(0);
    spin(&mut m, 300 * US, 2, 1, 1, 100 * US);
    m.advance(300 * US);
    m.advance(2 * MS);
    let done = m.completion((2, 1), 1).expect("second context ran");
    assert_eq!(done, MS + 25 * US + 100 * US);
}

#[test]
fn dependencies_order_streams() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    assert!(m.create_stream((1, 2), (1, 1), 0));
    spin(&mut m, 0, 1, 1, 1, 300 * US);
    let op = Op::Kernel {
        function: 1,
        arg0: Some(100 * US),
    };
    m.submit(0, (1, 2), 1, &[(1, 1)], &op).unwrap();
    m.submit(0, (1, 2), 2, &[], &Op::Marker).unwrap();
    m.advance(MS);
    assert_eq!(m.completion((1, 2), 1), Some(400 * US));
    assert_eq!(m.completion((1, 2), 2), Some(400 * US));
}

#[test]
fn higher_priority_stream_goes_first() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    assert!(m.create_stream((1, 2), (1, 1), -1));
    spin(&mut m, 0, 1, 1, 1, 100 * US);
    spin(&mut m, 0, 1, 2, 1, 100 * US);
    m.advance(MS);
    assert_eq!(m.completion((1, 2), 1), Some(100 * US));
    assert_eq!(m.completion((1, 1), 1), Some(200 * US));
}

#[test]
fn host_function_holds_its_stream_until_done() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    spin(&mut m, 0, 1, 1, 1, 100 * US);
    m.submit(0, (1, 1), 2, &[], &Op::HostFunc).unwrap();
    spin(&mut m, 0, 1, 1, 3, 100 * US);
    m.advance(50 * US);
    assert!(
        m.take_host_calls().is_empty(),
        "kernel before it still runs"
    );
    m.advance(150 * US);
    assert_eq!(m.take_host_calls(), vec![((1, 1), 2)]);
    m.advance(400 * US);
    assert!(m.completion((1, 1), 3).is_none());
    m.host_func_done(500 * US, (1, 1), 2);
    m.advance(500 * US);
    assert_eq!(m.completion((1, 1), 3), Some(600 * US));
}

#[test]
fn devices_are_independent() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    client(&mut m, 2, 1);
    spin(&mut m, 0, 1, 1, 1, MS);
    spin(&mut m, 0, 2, 1, 1, MS);
    m.advance(MS);
    assert_eq!(m.completion((1, 1), 1), Some(MS));
    assert_eq!(m.completion((2, 1), 1), Some(MS));
}

#[test]
fn configured_and_default_kernel_durations() {
    let mut cfg = ModelConfig::default();
    cfg.kernel_ns.insert("gemm".into(), 70 * US);
    let mut m = Model::new(cfg);
    client(&mut m, 1, 0);
    m.register_function((1, 2), "gemm");
    m.register_function((1, 3), "other");
    m.submit(
        0,
        (1, 1),
        1,
        &[],
        &Op::Kernel {
            function: 2,
            arg0: None,
        },
    )
    .unwrap();
    m.submit(
        0,
        (1, 1),
        2,
        &[],
        &Op::Kernel {
            function: 3,
            arg0: Some(9),
        },
    )
    .unwrap();
    m.advance(MS);
    assert_eq!(m.completion((1, 1), 1), Some(70 * US));
    assert_eq!(m.completion((1, 1), 2), Some(75 * US));
    assert_eq!(
        m.submit(
            0,
            (1, 1),
            3,
            &[],
            &Op::Kernel {
                function: 9,
                arg0: None
            }
        ),
        Err(SubmitError::UnknownFunction)
    );
}

#[test]
fn memory_capacity_and_release_on_disconnect() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    client(&mut m, 2, 0);
    assert!(m.alloc(1, 0, 600 << 20));
    assert!(!m.alloc(2, 0, 600 << 20), "over capacity");
    assert_eq!(m.mem_info(0), Some(((1 << 30) - (600 << 20), 1 << 30)));
    m.disconnect(1, 0);
    assert!(m.alloc(2, 0, 600 << 20));
    m.free(2, 0, 600 << 20);
    assert_eq!(m.mem_info(0), Some((1 << 30, 1 << 30)));
}

#[test]
fn a_killed_client_frees_the_device() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    client(&mut m, 2, 0);
    spin(&mut m, 0, 1, 1, 1, 50 * MS);
    m.advance(0);
    spin(&mut m, 100 * US, 2, 1, 1, 100 * US);
    m.advance(100 * US);
    m.disconnect(1, 200 * US);
    m.advance(200 * US);
    m.advance(MS);
    let done = m.completion((2, 1), 1).unwrap();
    assert!(done <= 200 * US + 25 * US + 100 * US, "done at {done}");
    assert_no_overlap(&m.take_trace());
}

#[test]
fn event_times_survive_any_amount_of_later_work() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    let event = |slot, generation| Op::Event { slot, generation };
    spin(&mut m, 0, 1, 1, 1, 10 * US);
    m.submit(0, (1, 1), 2, &[], &event(0, 1)).unwrap();
    for seq in 3..1000 {
        spin(&mut m, 0, 1, 1, seq, 10 * US);
    }
    m.submit(0, (1, 1), 1000, &[], &event(1, 1)).unwrap();
    m.advance(100 * MS);
    assert_eq!(
        m.completion((1, 1), 2),
        Some(10 * US),
        "exact after 997 later kernels"
    );
    assert_eq!(m.completion((1, 1), 1000), Some(998 * 10 * US));
    let posted: Vec<_> = m
        .take_decided_events()
        .iter()
        .map(|e| (e.slot, e.generation, e.end_ns))
        .collect();
    assert_eq!(posted, [(0, 1, 10 * US), (1, 1, 998 * 10 * US)]);
    // Recording slot 0 again retires its first record: that old, it is only known to be long
    // done; the new record is exact, and the only one posted.
    spin(&mut m, 100 * MS, 1, 1, 1001, 10 * US);
    m.submit(100 * MS, (1, 1), 1002, &[], &event(0, 2)).unwrap();
    m.advance(200 * MS);
    assert_eq!(m.completion((1, 1), 2), Some(0));
    assert_eq!(m.completion((1, 1), 1002), Some(100 * MS + 10 * US));
    let posted: Vec<_> = m
        .take_decided_events()
        .iter()
        .map(|e| e.generation)
        .collect();
    assert_eq!(posted, [2]);
}

#[test]
fn only_the_latest_record_of_a_slot_is_posted() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    // Recorded behind a long kernel, then recorded again before that record is decided.
    spin(&mut m, 0, 1, 1, 1, 10 * MS);
    m.submit(
        0,
        (1, 1),
        2,
        &[],
        &Op::Event {
            slot: 5,
            generation: 1,
        },
    )
    .unwrap();
    m.submit(
        0,
        (1, 1),
        3,
        &[],
        &Op::Event {
            slot: 5,
            generation: 2,
        },
    )
    .unwrap();
    m.advance(20 * MS);
    let posted: Vec<_> = m
        .take_decided_events()
        .iter()
        .map(|e| (e.slot, e.generation))
        .collect();
    assert_eq!(posted, [(5, 2)]);
}

/// Regression (found fuzzing the device socket): a context or stream created again under a
/// key in use left a context naming a stream the device had dropped, and the next kernel
/// search panicked. Reused keys are refused; the first objects keep working.
#[test]
fn reused_context_and_stream_keys_are_refused() {
    let mut m = model(false);
    client(&mut m, 1, 0);
    assert!(m.create_context((1, 2), 0));
    assert!(!m.create_context((1, 2), 1));
    assert!(!m.create_stream((1, 1), (1, 2), 0));
    m.destroy_stream((1, 1));
    assert!(m.create_stream((1, 1), (1, 2), 0));
    spin(&mut m, 0, 1, 1, 1, MS);
    m.advance(2 * MS);
    assert_eq!(m.completion((1, 1), 1), Some(MS));
}

/// Peer waits: client `conn` gets a second context on device 1 with stream 2, and the
/// `gpushare_wait_flag` (function 2) and `gpushare_set_flag` (function 3) kernels.
fn two_gpu_client(m: &mut Model, conn: ConnId) {
    client(m, conn, 0);
    assert!(m.create_context((conn, 2), 1));
    assert!(m.create_stream((conn, 2), (conn, 2), 0));
    peer_kernels(m, conn);
}

fn peer_kernels(m: &mut Model, conn: ConnId) {
    m.register_function((conn, 2), "gpushare_wait_flag");
    m.register_function((conn, 3), "gpushare_set_flag");
}

fn wait_flag(m: &mut Model, now: u64, conn: ConnId, stream: u64, seq: u64, flag: u64) {
    let op = Op::Kernel {
        function: 2,
        arg0: Some(flag),
    };
    m.submit(now, (conn, stream), seq, &[], &op).unwrap();
}

fn set_flag(m: &mut Model, now: u64, conn: ConnId, stream: u64, seq: u64, flag: u64) {
    let op = Op::Kernel {
        function: 3,
        arg0: Some(flag),
    };
    m.submit(now, (conn, stream), seq, &[], &op).unwrap();
}

/// Default kernel duration: what a peer kernel runs once it may (after its flag, for a wait).
const K: u64 = 5 * US;
const FLAG: u64 = 0x7f00_0000_1000;

#[test]
fn a_peer_wait_ends_when_another_gpu_sets_its_flag() {
    let mut m = model(true);
    two_gpu_client(&mut m, 1);
    wait_flag(&mut m, 0, 1, 1, 1, FLAG);
    m.advance(0);
    for now in [100 * US, 3 * MS, 20 * MS] {
        m.advance(now);
        assert_eq!(m.completion((1, 1), 1), None, "still spinning at {now}");
    }
    // Set on device 1 at 20 ms: seen as the setter completes, then the waiter's own 5 µs.
    set_flag(&mut m, 20 * MS, 1, 2, 1, FLAG);
    m.advance(20 * MS);
    assert_eq!(m.completion((1, 2), 1), Some(20 * MS + K));
    m.advance(20 * MS + K);
    assert_eq!(m.completion((1, 1), 1), Some(20 * MS + 2 * K));
    let trace = m.take_trace();
    let wait: Vec<_> = trace
        .iter()
        .filter(|r| r.kernel == "gpushare_wait_flag")
        .collect();
    // Alone on its device it kept it: one record, from its start to its end.
    assert_eq!(wait.len(), 1, "{trace:?}");
    assert_eq!((wait[0].device, wait[0].start_ns), (0, 0));
    assert_eq!(wait[0].end_ns, 20 * MS + 2 * K);
    assert!(!wait[0].preempted);
    assert_eq!(m.next_wakeup(20 * MS), None);
}

#[test]
fn a_spinning_kernel_is_not_committed_beyond_what_is_known() {
    let mut m = model(true);
    two_gpu_client(&mut m, 1);
    wait_flag(&mut m, 0, 1, 1, 1, FLAG);
    m.advance(0);
    m.advance(500 * US);
    // Set mid-slice: the waiter sees it then, not at its slice's end.
    set_flag(&mut m, 500 * US, 1, 2, 1, FLAG);
    m.advance(500 * US);
    // The set is decided (ahead, within device 1's slice) but the spinner is not: another
    // launch might still set its flag sooner. The device looks again when the set lands.
    assert_eq!(m.completion((1, 2), 1), Some(500 * US + K));
    assert_eq!(m.completion((1, 1), 1), None);
    assert_eq!(m.next_wakeup(500 * US), Some(500 * US + K));
    m.advance(500 * US + K);
    assert_eq!(m.completion((1, 1), 1), Some(500 * US + 2 * K));
}

#[test]
fn a_flag_set_before_the_wait_starts_lets_it_run_at_once() {
    let mut m = model(true);
    two_gpu_client(&mut m, 1);
    set_flag(&mut m, 0, 1, 2, 1, FLAG);
    m.advance(MS);
    wait_flag(&mut m, MS, 1, 1, 1, FLAG);
    m.advance(MS);
    assert_eq!(m.completion((1, 1), 1), Some(MS + K));
}

#[test]
fn a_spinning_kernel_is_time_sliced_and_preempted_like_any_other() {
    let mut m = model(true);
    two_gpu_client(&mut m, 1);
    client(&mut m, 2, 0);
    // Process 1 spins on device 0 until 10 ms; process 2 has 20 ms of work there.
    wait_flag(&mut m, 0, 1, 1, 1, FLAG);
    for seq in 1..=10 {
        spin(&mut m, 0, 2, 1, seq, 2 * MS);
    }
    let mut now = 0;
    while now < 10 * MS {
        m.advance(now);
        now += 100 * US;
    }
    set_flag(&mut m, 10 * MS, 1, 2, 1, FLAG);
    m.advance(10 * MS);
    m.advance(40 * MS);
    let trace = m.take_trace();
    assert_no_overlap(&trace);
    let on0: Vec<_> = trace.iter().filter(|r| r.device == 0).collect();
    // Alternating 1 ms slices while both have work: the spinning kernel is preempted each time.
    let waits: Vec<_> = on0
        .iter()
        .filter(|r| r.kernel == "gpushare_wait_flag")
        .collect();
    assert!(waits.len() >= 4, "{waits:?}");
    assert!(waits[..waits.len() - 1].iter().all(|r| r.preempted));
    for r in &waits[..waits.len() - 1] {
        assert_eq!(r.end_ns - r.start_ns, MS, "a full slice: {r:?}");
    }
    let busy2 = busy_by_conn(&trace, 102, 0, 10 * MS) as f64;
    assert!(
        (busy2 / (10 * MS) as f64 - 0.5).abs() < 0.05,
        "process 2 got {busy2} ns of the first 10 ms"
    );
    // The waiter saw the flag when it next had the device, then ran its 5 µs.
    let done = m.completion((1, 1), 1).expect("the wait completed");
    assert!(
        done > 10 * MS + K && done <= 11 * MS + 25 * US + K,
        "{done}"
    );
    assert_eq!(waits.last().unwrap().end_ns, done);
    assert!(m.completion((2, 1), 10).is_some());
}

#[test]
fn without_preemption_a_spinning_kernel_holds_the_device_until_its_flag() {
    let mut m = model(false);
    two_gpu_client(&mut m, 1);
    client(&mut m, 2, 0);
    wait_flag(&mut m, 0, 1, 1, 1, FLAG);
    m.advance(0);
    spin(&mut m, 100 * US, 2, 1, 1, 100 * US);
    m.advance(100 * US);
    m.advance(30 * MS);
    assert_eq!(m.completion((2, 1), 1), None, "the device is held");
    set_flag(&mut m, 30 * MS, 1, 2, 1, FLAG);
    m.advance(30 * MS);
    m.advance(31 * MS);
    assert_eq!(m.completion((1, 1), 1), Some(30 * MS + 2 * K));
    assert_eq!(
        m.completion((2, 1), 1),
        Some(30 * MS + 2 * K + 25 * US + 100 * US)
    );
}

#[test]
fn a_context_of_the_same_process_on_the_same_gpu_may_set_the_flag() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    assert!(m.create_context((1, 2), 0));
    assert!(m.create_stream((1, 2), (1, 2), 0));
    peer_kernels(&mut m, 1);
    wait_flag(&mut m, 0, 1, 1, 1, FLAG);
    set_flag(&mut m, 0, 1, 2, 1, FLAG);
    // Everything is decided in one step: the spinner gives the device up at its slice's end,
    // the other context sets the flag, and the spinner sees it when it is back.
    m.advance(10 * MS);
    let set_end = MS + 25 * US + K;
    assert_eq!(m.completion((1, 2), 1), Some(set_end));
    assert_eq!(m.completion((1, 1), 1), Some(set_end + 25 * US + K));
    assert_no_overlap(&m.take_trace());
}

#[test]
fn flags_are_per_process() {
    let mut m = model(true);
    two_gpu_client(&mut m, 1);
    client(&mut m, 2, 1);
    peer_kernels(&mut m, 2);
    wait_flag(&mut m, 0, 1, 1, 1, FLAG);
    set_flag(&mut m, 0, 2, 1, 1, FLAG);
    m.advance(5 * MS);
    assert_eq!(m.completion((2, 1), 1), Some(K));
    assert_eq!(
        m.completion((1, 1), 1),
        None,
        "another process's address is not this one's flag"
    );
}

#[test]
fn a_killed_spinner_frees_the_device_and_its_time_is_traced() {
    let mut m = model(true);
    two_gpu_client(&mut m, 1);
    wait_flag(&mut m, 0, 1, 1, 1, FLAG);
    m.advance(0);
    m.advance(2 * MS);
    client(&mut m, 2, 0);
    spin(&mut m, 2 * MS + 500 * US, 2, 1, 1, 100 * US);
    // Killed at 2.7 ms (no advance since 2.5 ms): its time on the device ends then.
    m.disconnect(1, 2700 * US);
    m.advance(2700 * US);
    let done = m.completion((2, 1), 1).unwrap();
    let trace = m.take_trace();
    assert_no_overlap(&trace);
    let spun: u64 = trace
        .iter()
        .filter(|r| r.pid == 101)
        .map(|r| r.end_ns - r.start_ns)
        .sum();
    // Slices to 3 ms were its own; process 2 arrived at 2.5 ms and waits for the slice end,
    // but the spinner died first.
    assert_eq!(spun, 2700 * US, "{trace:?}");
    assert_eq!(done, 2700 * US + 25 * US + 100 * US);
}

/// Two GPUs hand a flag back and forth (a ring of two, as NCCL's kernels do): each round,
/// device 1 sets A, device 0 waits for A then sets B, device 1 waits for B. All queued at
/// once and decided in one step, or step by step in small increments: the same exact times.
#[test]
fn ping_pong_between_two_gpus_has_exact_times_however_the_model_is_stepped() {
    const ROUNDS: u64 = 50;
    let run = |step: Option<u64>| {
        let mut m = model(true);
        two_gpu_client(&mut m, 1);
        for i in 0..ROUNDS {
            let (a, b) = (FLAG + 16 * i, FLAG + 16 * i + 8);
            set_flag(&mut m, 0, 1, 2, 2 * i + 1, a);
            wait_flag(&mut m, 0, 1, 1, 2 * i + 1, a);
            set_flag(&mut m, 0, 1, 1, 2 * i + 2, b);
            wait_flag(&mut m, 0, 1, 2, 2 * i + 2, b);
        }
        match step {
            None => m.advance(10 * MS),
            Some(d) => {
                let mut now = 0;
                while now <= 10 * MS {
                    m.advance(now);
                    now += d;
                }
            }
        }
        let trace = m.take_trace();
        assert_no_overlap(&trace);
        (
            (1..=2 * ROUNDS)
                .map(|q| (m.completion((1, 1), q), m.completion((1, 2), q)))
                .collect::<Vec<_>>(),
            trace,
        )
    };
    let (at_once, trace) = run(None);
    // Round i: set A ends at 20i+5 µs, wait A at +10, set B at +15, wait B at +20.
    for i in 0..ROUNDS {
        let base = 4 * K * i;
        let q = (2 * i + 1) as usize - 1;
        assert_eq!(
            at_once[q],
            (Some(base + 2 * K), Some(base + K)),
            "round {i}"
        );
        assert_eq!(
            at_once[q + 1],
            (Some(base + 3 * K), Some(base + 4 * K)),
            "round {i}"
        );
    }
    assert!(trace.iter().all(|r| !r.preempted));
    for step in [7 * US, 100 * US, 1100 * US] {
        assert_eq!(run(Some(step)).0, at_once, "stepped by {step} ns");
    }
}

#[test]
fn a_kernel_waits_for_an_event_recorded_on_another_gpu() {
    let mut m = model(true);
    two_gpu_client(&mut m, 1);
    // Device 1 runs 3 ms; device 0's stream waits for it (cuStreamWaitEvent on an event
    // recorded on device 1's stream), then runs 1 ms.
    spin(&mut m, 0, 1, 2, 1, 3 * MS);
    m.submit(
        0,
        (1, 2),
        2,
        &[],
        &Op::Event {
            slot: 0,
            generation: 1,
        },
    )
    .unwrap();
    m.submit(0, (1, 1), 1, &[(2, 2)], &Op::Marker).unwrap();
    spin(&mut m, 0, 1, 1, 2, MS);
    let mut now = 0;
    while now <= 5 * MS {
        m.advance(now);
        now += 250 * US;
    }
    assert_eq!(m.completion((1, 1), 2), Some(4 * MS));
    let trace = m.take_trace();
    let r = trace.iter().find(|r| r.device == 0).unwrap();
    assert_eq!((r.start_ns, r.end_ns), (3 * MS, 4 * MS));
}

/// An event shared between processes (IPC): a wait on it in one process follows its latest
/// record made before the wait, by whichever process; a later record does not move an earlier
/// wait; it goes with its sharer.
#[test]
fn a_shared_event_orders_work_across_processes() {
    let mut m = model(true);
    client(&mut m, 1, 0);
    client(&mut m, 2, 1);
    let shared = |slot, event| Op::SharedEvent {
        slot,
        generation: 1,
        event,
    };
    let event = m.share_event(1, None);
    assert!(m.shared_event_exists(event));
    assert_eq!(m.shared_record(event), None, "no record yet");
    // Nothing recorded: a wait is satisfied at once.
    m.submit(0, (2, 1), 1, &[], &Op::WaitShared { event })
        .unwrap();
    m.advance(0);
    assert_eq!(m.completion((2, 1), 1), Some(0));
    // Process 1 records after 10 ms of work; process 2 waits, then records after 3 ms of its
    // own; process 1 then waits for that.
    spin(&mut m, 0, 1, 1, 1, 10 * MS);
    m.submit(0, (1, 1), 2, &[], &shared(0, event)).unwrap();
    m.submit(0, (2, 1), 2, &[], &Op::WaitShared { event })
        .unwrap();
    spin(&mut m, 0, 2, 1, 3, 3 * MS);
    m.submit(0, (2, 1), 4, &[], &shared(7, event)).unwrap();
    m.submit(0, (1, 1), 3, &[], &Op::WaitShared { event })
        .unwrap();
    m.advance(100 * MS);
    assert_eq!(
        m.completion((2, 1), 2),
        Some(10 * MS),
        "waits for process 1"
    );
    assert_eq!(m.completion((2, 1), 4), Some(13 * MS));
    assert_eq!(
        m.completion((1, 1), 3),
        Some(13 * MS),
        "waits for process 2"
    );
    assert_eq!(m.shared_record(event), Some(((2, 1), 4)));
    // Only the sharer unshares it; its exit does too.
    m.unshare_event(2, event);
    assert!(m.shared_event_exists(event));
    let other = m.share_event(1, Some((1, 2)));
    assert_eq!(m.shared_record(other), Some(((1, 1), 2)));
    m.unshare_event(1, event);
    assert!(!m.shared_event_exists(event));
    m.disconnect(1, 100 * MS);
    assert!(!m.shared_event_exists(other));
}
