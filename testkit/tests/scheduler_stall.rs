//! A scheduler that stops answering (`SIGSTOP`: a frozen cgroup, a debugger, a swapped-out
//! host) while two busy tenants share the simulated GPU, through the real hook and daemon.
//!
//! The hook's liveness contract (docs/robustness.md): a process waiting for a turn probes the
//! scheduler after half the liveness bound of silence (the scheduler's quota plus its grace:
//! 20 ms + 20 ms here) and, left unanswered for the other half, follows `GPUSHARE_FAIL`:
//! `open` launches without limits (the device's own time-slicing among the tenants) until the
//! scheduler speaks again, `closed` waits for it. So under `open` the GPU keeps working through
//! the stall, and no tenant is blocked for much longer than the bound; after `SIGCONT` the
//! tenants rejoin the schedule and get their requests again.
//!
//! Margins ([`margins`]): a tenant blocked for the whole stall (a hook that waits for a frozen
//! scheduler) would show a gap of the stall's length, many times [`BLOCKED_NS`].

use gpushare_testkit::harness::describe;
use gpushare_testkit::margins;
use gpushare_testkit::node::{Node, Spin, Tenant, monotonic_ns, shares_in};
use gpushare_testkit::trace::{Trace, Window};
use std::path::PathBuf;
use std::time::Duration;

const MS: u64 = 1_000_000;
/// The liveness bound of the default quota (20 ms) and grace (20 ms).
const LIVENESS_NS: u64 = 40 * MS;
/// The default quota: a tenant may wait for up to a couple of the other's turns in the schedule.
const QUOTA_NS: u64 = 20 * MS;
/// Longest a tenant may go without starting a kernel while the scheduler is stopped: the
/// bound, the turns it waited for before the stop, and the recovery margin of a loaded machine.
const BLOCKED_NS: u64 = LIVENESS_NS + 2 * QUOTA_NS + margins::RECOVERY_NS;
/// The requests of the two tenants.
const REQUESTS: [f64; 2] = [0.7, 0.3];
const TENANT_TIMEOUT: Duration = Duration::from_secs(40);

fn cudarc() -> PathBuf {
    gpushare_testkit::harness::target_dir().join("cudarc-client")
}

/// Two busy tenants (1 ms kernels, requests 0.7 / 0.3) for `run_ms`, under `GPUSHARE_FAIL=fail`.
fn two_tenants(node: &Node, fail: &str, run_ms: f64) -> Vec<Tenant> {
    (["a", "b"].iter().zip(REQUESTS))
        .map(|(group, request)| {
            let mut cmd = node.tenant_command(
                group,
                request,
                1.0,
                1.0,
                cudarc(),
                &Spin::for_ms(1.0, run_ms).args(),
            );
            cmd.env("GPUSHARE_FAIL", fail);
            node.spawn(cmd)
        })
        .collect()
}

/// Stop the node's scheduler for `ms`; the stop's window (`SIGSTOP` .. `SIGCONT`).
fn stall(node: &Node, ms: u64) -> Window {
    let pid = node.scheduler_pid().expect("a scheduler runs") as libc::pid_t;
    // SAFETY: plain syscalls on the scheduler, our own child.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stop = monotonic_ns();
    std::thread::sleep(Duration::from_millis(ms));
    let cont = monotonic_ns();
    unsafe { libc::kill(pid, libc::SIGCONT) };
    Window::new(stop, cont)
}

/// The longest time `pid` started no kernel within `w` (from `w`'s start to its first kernel
/// there, between its kernels, from its last to `w`'s end).
fn longest_blocked(trace: &Trace, pid: u32, w: Window) -> u64 {
    let mut starts: Vec<u64> = (trace.records().iter())
        .filter(|r| r.pid == pid && r.start_ns >= w.start_ns && r.start_ns < w.end_ns)
        .map(|r| r.start_ns)
        .collect();
    starts.sort_unstable();
    let mut last = w.start_ns;
    let mut longest = 0;
    for s in starts.into_iter().chain([w.end_ns]) {
        longest = longest.max(s - last);
        last = s;
    }
    longest
}

fn wait_all(tenants: Vec<Tenant>) -> Vec<std::process::Output> {
    tenants
        .into_iter()
        .map(|t| t.wait_ok(TENANT_TIMEOUT))
        .collect()
}

/// The shares from `from_ns` to the first tenant's last 50 ms, each within [`margins::SHARE`]
/// of its request.
fn assert_requests_met(what: &str, trace: &Trace, pids: &[u32], from_ns: u64) {
    let end = (pids.iter())
        .map(|p| trace.span_of_pid(*p).expect("the tenant ran").end_ns)
        .min()
        .expect("tenants");
    let w = Window::new(from_ns, end - 50 * MS);
    assert!(
        w.len_ns() >= 500 * MS,
        "{what}: the tenants ran on only {w} after the stall"
    );
    let s = shares_in(trace, pids, w);
    eprintln!(
        "{what}: over {:.2} s, shares {s:.4?} (requests {REQUESTS:?})",
        w.len_ns() as f64 / 1e9,
    );
    for (got, want) in s.iter().zip(REQUESTS) {
        assert!(
            (got - want).abs() <= margins::SHARE,
            "{what}: share {got:.4} vs request {want} ± {} (all {s:.4?})",
            margins::SHARE
        );
    }
}

/// `SIGSTOP` of the scheduler for 3 s beside two busy fail-open tenants: the GPU stays busy
/// through the stall, no tenant goes without a kernel for much longer than the liveness bound,
/// each says once on stderr that it runs without limits, and a second after `SIGCONT` the
/// shares are their requests again.
#[test]
fn a_stopped_scheduler_leaves_fail_open_tenants_running_and_shares_return() {
    let node = Node::start(&[]);
    let ts = two_tenants(&node, "open", 6_500.0);
    let pids: Vec<u32> = ts.iter().map(Tenant::pid).collect();
    std::thread::sleep(Duration::from_millis(1_500));
    let stopped = stall(&node, 3_000);
    let outs = wait_all(ts);
    let trace = node.finish();
    assert!(trace.overlaps().is_empty(), "overlapping kernels");
    let busy = trace.utilization(0, stopped);
    let during = shares_in(&trace, &pids, stopped);
    let blocked: Vec<u64> = (pids.iter())
        .map(|p| longest_blocked(&trace, *p, stopped))
        .collect();
    eprintln!(
        "scheduler stopped {:.0} ms: GPU busy {busy:.4}, shares meanwhile {during:.4?}, longest without a kernel {:.1?} ms",
        stopped.len_ns() as f64 / 1e6,
        blocked.iter().map(|b| *b as f64 / 1e6).collect::<Vec<_>>()
    );
    assert!(
        busy >= margins::UTILISATION,
        "the GPU was busy only {busy:.4} of the stall"
    );
    for (pid, b) in pids.iter().zip(&blocked) {
        assert!(
            *b <= BLOCKED_NS,
            "tenant {pid} started no kernel for {:.1} ms of the stall (bound {:.0} ms)",
            *b as f64 / 1e6,
            BLOCKED_NS as f64 / 1e6
        );
    }
    for out in &outs {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let said: Vec<&str> = stderr.lines().filter(|l| l.contains("gpushare")).collect();
        assert!(
            said.len() == 1 && said[0].contains("WITHOUT GPU sharing limits"),
            "a fail-open tenant says once that it runs without limits\n{}",
            describe(out)
        );
    }
    assert_requests_met(
        "after a 3 s stop",
        &trace,
        &pids,
        stopped.end_ns + 1_000 * MS,
    );
}

/// Stops of 0.1 s and 1 s: neither blocks a fail-open tenant past the bound.
#[test]
fn short_scheduler_stalls_block_no_fail_open_tenant_past_the_bound() {
    let node = Node::start(&[]);
    let ts = two_tenants(&node, "open", 4_000.0);
    let pids: Vec<u32> = ts.iter().map(Tenant::pid).collect();
    std::thread::sleep(Duration::from_millis(1_000));
    let short = stall(&node, 100);
    std::thread::sleep(Duration::from_millis(700));
    let long = stall(&node, 1_000);
    wait_all(ts);
    let trace = node.finish();
    assert!(trace.overlaps().is_empty(), "overlapping kernels");
    for (what, w) in [("0.1 s", short), ("1 s", long)] {
        let blocked: Vec<u64> = (pids.iter())
            .map(|p| longest_blocked(&trace, *p, w))
            .collect();
        eprintln!(
            "scheduler stopped {what}: GPU busy {:.4}, longest without a kernel {:.1?} ms",
            trace.utilization(0, w),
            blocked.iter().map(|b| *b as f64 / 1e6).collect::<Vec<_>>()
        );
        for (pid, b) in pids.iter().zip(&blocked) {
            assert!(
                *b <= BLOCKED_NS,
                "a {what} stop: tenant {pid} started no kernel for {:.1} ms (bound {:.0} ms)",
                *b as f64 / 1e6,
                BLOCKED_NS as f64 / 1e6
            );
        }
    }
}

/// `SIGSTOP` of the scheduler for 1 s beside two busy fail-closed tenants: once the turns
/// granted before the stop end, nothing runs until `SIGCONT`; then both run again and get their
/// requests.
#[test]
fn a_stopped_scheduler_holds_fail_closed_tenants_until_it_resumes() {
    let node = Node::start(&[]);
    let ts = two_tenants(&node, "closed", 4_000.0);
    let pids: Vec<u32> = ts.iter().map(Tenant::pid).collect();
    std::thread::sleep(Duration::from_millis(1_000));
    let stopped = stall(&node, 1_000);
    wait_all(ts);
    let trace = node.finish();
    assert!(trace.overlaps().is_empty(), "overlapping kernels");
    // A turn granted ahead of its start may begin just after the stop and run its quota.
    let held = Window::new(
        stopped.start_ns + 2 * QUOTA_NS + margins::RECOVERY_NS,
        stopped.end_ns,
    );
    let ran = (trace.records().iter())
        .filter(|r| r.start_ns >= held.start_ns && r.start_ns < held.end_ns)
        .count();
    let back: Vec<u64> = (pids.iter())
        .map(|p| {
            (trace.records().iter())
                .filter(|r| r.pid == *p && r.start_ns >= stopped.end_ns)
                .map(|r| r.start_ns - stopped.end_ns)
                .min()
                .expect("ran after SIGCONT")
        })
        .collect();
    eprintln!(
        "scheduler stopped 1 s, fail-closed: {ran} kernels started while it was stopped; back {:.1?} ms after SIGCONT",
        back.iter().map(|b| *b as f64 / 1e6).collect::<Vec<_>>()
    );
    assert_eq!(
        ran, 0,
        "fail-closed tenants ran while the scheduler was stopped"
    );
    for b in &back {
        assert!(
            *b <= 500 * MS,
            "a tenant came back {:.0} ms after SIGCONT",
            *b as f64 / 1e6
        );
    }
    assert_requests_met(
        "fail-closed, after a 1 s stop",
        &trace,
        &pids,
        stopped.end_ns + 500 * MS,
    );
}
