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
