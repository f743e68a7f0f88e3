//! A scheduler that stops answering (`SIGSTOP`: a frozen cgroup, a debugger, a swapped-out
//! host) while two busy tenants share the simulated GPU, through the real hook and daemon.
//!
//! The hook's liveness contract (docs/robustness.md): a process waiting for a turn probes the
//! scheduler after half the liveness bound of silence (the scheduler's quota plus its grace:
//! 20 ms + 20 ms here) and, left unanswered for the other half, follows `GPUSHARE_FAIL`:
//! `open` launches without a turn (the device's own time-slicing among the tenants), its queue
//! still paced to a budget, until the scheduler speaks again, `closed` waits for it. So under
//! `open` the GPU keeps working through the stall, and no tenant is blocked for much longer than
//! the bound; after `SIGCONT` the tenants rejoin the schedule within a turn (little of their work
//! is queued) and get their requests again.
//!
//! Margins ([`margins`]): a tenant blocked for the whole stall (a hook that waits for a frozen
//! scheduler) would show a gap of the stall's length, many times [`BLOCKED_NS`].

use gpushare_testkit::harness::describe;
use gpushare_testkit::margins;
use gpushare_testkit::node::{
    Node, Spin, Tenant, common_active_window, longest_without_kernel, monotonic_ns, shares_in,
};
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
/// each says once on stderr that it runs without turns, and a second after `SIGCONT` the
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
        .map(|p| longest_without_kernel(&trace, *p, stopped))
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
            said.len() == 1 && said[0].contains("running without turns"),
            "a fail-open tenant says once that it runs without turns\n{}",
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

/// The requests of a small tenant that queues far ahead and a big one.
const QUEUEING_REQUESTS: [f64; 2] = [0.2, 0.8];
/// How soon after `SIGCONT` the small tenant is back to its request: a couple of the schedule's
/// rounds (its turn, then the other's, about 60 ms together), and the recovery margin.
const REJOINED_NS: u64 = 200 * MS;
/// The most of the GPU the small tenant may have in a 100 ms window once it is back: a window
/// holds one or two of its turns (about 0.12 or 0.24 of it, as before the stop), and a margin.
/// One window of the second observed may hold more: the other tenant's host thread, late on a
/// busy machine, leaves the GPU to the one with work (a turn given back, or extended). Work
/// left queued from the stop, were it not paced, would hold the small tenant near half the GPU
/// in every window.
const WINDOW_SHARE_MAX: f64 = QUEUEING_REQUESTS[0] + 2.0 * margins::SHARE;

/// The share of `pid` in each 100 ms window of `w`.
fn shares_per_100_ms(trace: &Trace, pid: u32, w: Window) -> Vec<f64> {
    (w.start_ns..w.end_ns.saturating_sub(100 * MS - 1))
        .step_by(100 * MS as usize)
        .map(|at| shares_in(trace, &[pid], Window::new(at, at + 100 * MS))[0])
        .collect()
}

/// `SIGSTOP` of the scheduler for 80 ms beside two busy fail-open tenants (1 ms kernels,
/// requests 0.2 / 0.8), the 0.2 one synchronising only every 1,000 kernels (a second of GPU
/// work) and stopped early in its first 1,000. During the stop it runs without a turn, but its
/// launches are still paced to a queue budget: once the scheduler answers, little of its work is
/// queued, and from [`REJOINED_NS`] after `SIGCONT`, in the ten 100 ms windows of the next
/// second, its share is at most [`WINDOW_SHARE_MAX`] in all but one, and within
/// [`margins::SHARE`] of its request over those nine. (Without pacing it would queue the rest of
/// its 1,000 kernels, which the device's time-slicing would run beside the other's turns: about
/// half the GPU in every window for a second and more.)
#[test]
fn a_fail_open_tenant_rejoins_the_schedule_within_a_turn_of_the_scheduler_answering() {
    let node = Node::start(&[]);
    let ts: Vec<Tenant> = (["small", "big"].iter().zip(QUEUEING_REQUESTS))
        .map(|(group, request)| {
            let sync_every = if request < 0.5 { 1_000 } else { 20 };
            let spin = Spin::for_ms(1.0, 3_500.0).sync_every(Some(sync_every));
            let mut cmd = node.tenant_command(group, request, 1.0, 1.0, cudarc(), &spin.args());
            cmd.env("GPUSHARE_FAIL", "open");
            node.spawn(cmd)
        })
        .collect();
    let (small, big) = (ts[0].pid(), ts[1].pid());
    std::thread::sleep(Duration::from_millis(1_000));
    let stopped = stall(&node, 80);
    let outs = wait_all(ts);
    let trace = node.finish();
    assert!(trace.overlaps().is_empty(), "overlapping kernels");
    assert!(
        String::from_utf8_lossy(&outs[0].stderr).contains("running without turns"),
        "the 0.2 tenant ran without a turn while the scheduler was stopped\n{}",
        describe(&outs[0])
    );
    let before = Window::new(stopped.start_ns - 600 * MS, stopped.start_ns);
    let back = Window::new(
        stopped.end_ns + REJOINED_NS,
        stopped.end_ns + REJOINED_NS + 1_000 * MS,
    );
    let windows = shares_per_100_ms(&trace, small, back);
    eprintln!(
        "scheduler stopped {:.0} ms: the 0.2 tenant's share per 100 ms before {:.3?}, from SIGCONT {:.3?} then {windows:.3?} (the 0.8 tenant's then {:.3?})",
        stopped.len_ns() as f64 / 1e6,
        shares_per_100_ms(&trace, small, before),
        shares_per_100_ms(&trace, small, Window::new(stopped.end_ns, back.start_ns)),
        shares_per_100_ms(&trace, big, back),
    );
    assert_eq!(windows.len(), 10, "the tenants ran on after SIGCONT");
    let mut sorted = windows.clone();
    sorted.sort_by(f64::total_cmp);
    let nine = &sorted[..9];
    assert!(
        nine[8] <= WINDOW_SHARE_MAX,
        "from {} ms after SIGCONT the 0.2 tenant had more than {WINDOW_SHARE_MAX:.2} of the GPU in {} of ten 100 ms windows: {windows:.3?}",
        REJOINED_NS / MS,
        windows.iter().filter(|w| **w > WINDOW_SHARE_MAX).count()
    );
    let share = nine.iter().sum::<f64>() / 9.0;
    assert!(
        (share - QUEUEING_REQUESTS[0]).abs() <= margins::SHARE,
        "from {} ms after SIGCONT the 0.2 tenant had {share:.3} of the GPU over the nine 100 ms windows of the lowest shares of ten: {windows:.3?}",
        REJOINED_NS / MS
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
            .map(|p| longest_without_kernel(&trace, *p, w))
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

/// Probes a tenant sent, as its log says (`GPUSHARE_LOG`).
fn probes_sent(out: &std::process::Output) -> usize {
    (String::from_utf8_lossy(&out.stderr).lines())
        .filter(|l| l.contains("probing the scheduler"))
        .count()
}

/// Four busy tenants (requests 0.25 each), three of them waiting for a turn at any moment:
/// while the scheduler runs, they read its heartbeat instead of probing it every half bound of
/// their waits (each would probe every 20 ms, some 25 times a second). What is left: one probe
/// per 500 ms without a word from the scheduler (a waiter here hears a grant every rotation,
/// so few), and one whenever the host delays the scheduler's loop past half the bound.
/// (Its heartbeat stopped, they probe: the stops above.)
#[test]
fn waiting_tenants_read_a_running_schedulers_heartbeat_instead_of_probing() {
    const TENANTS: usize = 4;
    const RUN_MS: f64 = 3_000.0;
    const SPARSE_PROBE_MS: f64 = 500.0;
    let node = Node::start(&[]);
    let ts: Vec<Tenant> = (["a", "b", "c", "d"].iter())
        .map(|group| {
            let mut cmd = node.tenant_command(
                group,
                0.25,
                1.0,
                1.0,
                cudarc(),
                &Spin::for_ms(1.0, RUN_MS).args(),
            );
            cmd.env("GPUSHARE_FAIL", "open").env("GPUSHARE_LOG", "1");
            node.spawn(cmd)
        })
        .collect();
    let pids: Vec<u32> = ts.iter().map(Tenant::pid).collect();
    let outs = wait_all(ts);
    let probes: Vec<usize> = outs.iter().map(probes_sent).collect();
    let trace = node.finish();
    assert!(trace.overlaps().is_empty(), "overlapping kernels");
    // Shares are not judged here: a host that starves the scheduler past the bound ungates
    // fail-open tenants (the stops above judge that).
    let shares = shares_in(&trace, &pids, common_active_window(&trace, &pids, 500 * MS));
    eprintln!("4 tenants for 3 s: shares {shares:.3?}, probes sent {probes:?}");
    // At most one sparse probe per 500 ms of each tenant's run (and one more at its start),
    // and as many again for a loop the host delays past half the bound; probing every half
    // bound, the four send about 180.
    let sparse = TENANTS * (RUN_MS / SPARSE_PROBE_MS) as usize + TENANTS;
    assert!(
        probes.iter().sum::<usize>() <= 2 * sparse,
        "probes sent while the scheduler ran: {probes:?} (bound {})",
        2 * sparse
    );
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

/// The scheduler's entry of `group` on GPU 0: its connected pids and the memory its books hold
/// (nothing if the status does not list it).
fn group_state(node: &Node, group: &str) -> (Vec<u64>, u64) {
    node.status_group(group).map_or((Vec::new(), 0), |g| {
        let pids = (g["pids"].as_array().into_iter().flatten())
            .filter_map(serde_json::Value::as_u64)
            .collect();
        (pids, g["memory_used"].as_u64().unwrap_or(0))
    })
}

/// Poll `ready` every 10 ms for at most 5 s; when it first held (`None`: never).
fn poll_until(mut ready: impl FnMut() -> bool) -> Option<u64> {
    let deadline = monotonic_ns() + 5_000 * MS;
    while monotonic_ns() < deadline {
        if ready() {
            return Some(monotonic_ns());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// The next line of `out` (a `mem_tool` client's stdout) as JSON with `key`.
fn json_line(out: &mut impl std::io::BufRead, key: &str) -> serde_json::Value {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).expect("read mem_tool's output") > 0,
            "mem_tool ended before printing {key}"
        );
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
            && v.get(key).is_some()
        {
            return v;
        }
    }
}

/// `kill -9` of the scheduler beside two busy fail-open tenants that hold device memory, and a
/// third process that allocates 256 MiB while it is gone; a second later a new scheduler starts
/// on the same socket and journal. While it is gone the GPU stays busy and no tenant goes
/// without a kernel past the bound; the tenants are back on the new scheduler within a turn of
/// its start (plus the recovery margin), and get their requests again; and its books hold exactly
/// what each process holds: nothing counted twice (the journal's holdings and the processes'
/// own statements), the allocation made while it was gone charged.
#[test]
fn a_killed_and_restarted_scheduler_costs_fail_open_tenants_a_moment_and_keeps_the_books() {
    const LATE_BYTES: u64 = 256 << 20;
    let mut node = Node::start(&[]);
    let mem_tool = node.compile_c("mem_tool.c", true);
    let ts: Vec<Tenant> = (["a", "b"].iter().zip(REQUESTS))
        .map(|(group, request)| {
            let spin = Spin::for_ms(1.0, 6_500.0).alloc_mib(64);
            let mut cmd = node.tenant_command(group, request, 1.0, 1.0, cudarc(), &spin.args());
            cmd.env("GPUSHARE_FAIL", "open");
            node.spawn(cmd)
        })
        .collect();
    let pids: Vec<u32> = ts.iter().map(Tenant::pid).collect();
    let mut late = node.run_command(
        &["--group", "late", "--memory", "1GiB"],
        &mem_tool,
        &["hold-later", &LATE_BYTES.to_string()],
    );
    late.env("GPUSHARE_FAIL", "open")
        .stdout(std::process::Stdio::piped());
    let mut late = late.spawn().expect("start mem_tool");
    let mut late_out = std::io::BufReader::new(late.stdout.take().unwrap());
    json_line(&mut late_out, "ready");
    std::thread::sleep(Duration::from_millis(1_500));
    let held_before: Vec<u64> = ["a", "b"].map(|g| group_state(&node, g).1).to_vec();
    assert!(
        held_before.iter().all(|&m| m >= 64 << 20),
        "the tenants' memory is on the books before the kill: {held_before:?}"
    );

    let killed = monotonic_ns();
    node.kill_scheduler();
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(late.id() as libc::pid_t, libc::SIGUSR1) };
    let alloc = json_line(&mut late_out, "held");
    let alloc_ns = alloc["t_ns"].as_u64().unwrap() - alloc["t_start_ns"].as_u64().unwrap();
    std::thread::sleep(
        Duration::from_millis(1_000).saturating_sub(Duration::from_nanos(monotonic_ns() - killed)),
    );
    let restarted = monotonic_ns();
    node.start_scheduler(&[]);
    let gone = Window::new(killed, restarted);
    let back: Vec<u64> = (["a", "b"].iter().zip(&pids))
        .map(|(g, p)| {
            poll_until(|| group_state(&node, g).0.contains(&u64::from(*p)))
                .unwrap_or_else(|| panic!("tenant {p} never reconnected"))
                - restarted
        })
        .collect();
    let want = [held_before[0], held_before[1], LATE_BYTES];
    let books = || ["a", "b", "late"].map(|g| group_state(&node, g).1);
    let settled = poll_until(|| books() == want);
    std::thread::sleep(Duration::from_millis(300));
    let books_after = books();
    unsafe { libc::kill(late.id() as libc::pid_t, libc::SIGUSR1) };
    json_line(&mut late_out, "freed");
    assert!(late.wait().expect("mem_tool exits").success());
    let outs = wait_all(ts);
    let trace = node.finish();

    assert!(trace.overlaps().is_empty(), "overlapping kernels");
    let busy = trace.utilization(0, gone);
    let blocked: Vec<u64> = (pids.iter())
        .map(|p| longest_without_kernel(&trace, *p, gone))
        .collect();
    eprintln!(
        "scheduler killed for {:.0} ms: GPU busy {busy:.4}, longest without a kernel {:.1?} ms; an allocation meanwhile took {:.1} ms; tenants back {:.1?} ms after the restart; books {books_after:?} (want {want:?}), settled {:.0?} ms after the restart",
        gone.len_ns() as f64 / 1e6,
        blocked.iter().map(|b| *b as f64 / 1e6).collect::<Vec<_>>(),
        alloc_ns as f64 / 1e6,
        back.iter().map(|b| *b as f64 / 1e6).collect::<Vec<_>>(),
        settled.map(|t| (t - restarted) as f64 / 1e6),
    );
    assert!(
        busy >= margins::UTILISATION,
        "the GPU was busy only {busy:.4} while the scheduler was gone"
    );
    for (pid, b) in pids.iter().zip(&blocked) {
        assert!(
            *b <= BLOCKED_NS,
            "tenant {pid} started no kernel for {:.1} ms while the scheduler was gone (bound {:.0} ms)",
            *b as f64 / 1e6,
            BLOCKED_NS as f64 / 1e6
        );
    }
    assert!(
        alloc_ns <= margins::RECOVERY_NS,
        "an allocation waited {:.1} ms for a scheduler that was gone",
        alloc_ns as f64 / 1e6
    );
    for (pid, b) in pids.iter().zip(&back) {
        assert!(
            *b <= QUOTA_NS + margins::RECOVERY_NS,
            "tenant {pid} was back {:.0} ms after the restart",
            *b as f64 / 1e6
        );
    }
    assert_eq!(
        books_after, want,
        "the restarted scheduler's books (groups a, b, late) hold each process's memory once"
    );
    for out in &outs {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            (stderr.lines()).any(|l| l.contains("WITHOUT GPU sharing limits")),
            "a fail-open tenant says that it runs without limits\n{}",
            describe(out)
        );
    }
    let rejoined = restarted + back.iter().max().unwrap();
    assert_requests_met("after a restart", &trace, &pids, rejoined + 1_000 * MS);
}
