//! End to end, issue 3: isolation between tenants under `gpushare run` (hook + scheduler) on one
//! simulated GPU, measured on the device trace. Caps, weights, work conservation, every route to
//! the driver, clients that never synchronise or launch from many threads, and the failures a
//! node sees (a tenant killed or stopped while holding the token, the scheduler restarted,
//! malformed messages, no scheduler at all, a tenant no group matches).
//!
//! Shares are busy time on the device divided by the window's length, in the window where the
//! tenants concerned were all active, without the first 300 ms (warm-up) and the last 50 ms.

use gpushare_sim_clients::harness::{describe, json_lines, output_with_timeout, target_dir};
use gpushare_sim_clients::node::{
    Node, Spin, Tenant, common_active_window, gaps_in, monotonic_ns, shares_in,
};
use gpushare_sim_clients::trace::{Trace, Window};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

const WARMUP_NS: u64 = 300_000_000;
const MS: u64 = 1_000_000;
/// Longest any tenant of these tests may run.
const TENANT_TIMEOUT: Duration = Duration::from_secs(30);

fn cudarc() -> PathBuf {
    target_dir().join("cudarc-client")
}

/// A cudarc `spin` tenant in group `group`.
fn spin_tenant(node: &Node, group: &str, request: f64, limit: f64, weight: f64, spin: &Spin) -> Tenant {
    node.spawn(node.tenant_command(group, request, limit, weight, cudarc(), &spin.args()))
}

fn wait_all(tenants: Vec<Tenant>) {
    for t in tenants {
        t.wait_ok(TENANT_TIMEOUT);
    }
}

/// Assert each share is within `tol` of its target.
fn assert_shares(what: &str, got: &[f64], want: &[f64], tol: f64) {
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= tol,
            "{what}: share {g:.4} vs target {w} ± {tol} (all: {got:.4?}, targets {want:?})"
        );
    }
}

/// Shares of `pids` while all were active; prints them with their errors.
fn measure(what: &str, trace: &Trace, pids: &[u32], want: &[f64]) -> (Window, Vec<f64>) {
    assert!(trace.overlaps().is_empty(), "{what}: overlapping kernels");
    let w = common_active_window(trace, pids, WARMUP_NS);
    let s = shares_in(trace, pids, w);
    let err: Vec<f64> = s.iter().zip(want).map(|(g, w)| g - w).collect();
    eprintln!(
        "{what}: window {:.2} s, shares {s:.4?} (targets {want:?}, errors {err:+.4?}), utilisation {:.4}, {:?}",
        w.len_ns() as f64 / 1e9,
        trace.utilization(0, w),
        gaps_in(trace, w),
    );
    (w, s)
}

/// DESIGN §2.2: a lone tenant with limit 0.3 gets 0.3 of the GPU, although it is otherwise idle.
#[test]
fn lone_tenant_is_capped_at_its_limit() {
    let node = Node::start(&[]);
    let t = spin_tenant(&node, "capped", 0.0, 0.3, 1.0, &Spin::kernels(1.0, 650));
    let pid = t.pid();
    wait_all(vec![t]);
    let trace = node.finish();
    let span = trace.span_of_pid(pid).expect("the tenant ran");
    let w = Window::new(span.start_ns + WARMUP_NS, span.end_ns - 50 * MS);
    let s = shares_in(&trace, &[pid], w);
    eprintln!(
        "limit 0.3 alone: window {:.2} s, share {:.4} (error {:+.4})",
        w.len_ns() as f64 / 1e9,
        s[0],
        s[0] - 0.3
    );
    assert_shares("limit 0.3 alone", &s, &[0.3], 0.02);
}

/// DESIGN §2.3: requests 0.2 / 0.2, weights 1 / 3: the spare 0.6 is split 1:3, 0.35 / 0.65.
#[test]
fn spare_time_is_split_by_weight() {
    let node = Node::start(&[]);
    let ts = vec![
        spin_tenant(&node, "w1", 0.2, 1.0, 1.0, &Spin::kernels(1.0, 950)),
        spin_tenant(&node, "w3", 0.2, 1.0, 3.0, &Spin::kernels(1.0, 1750)),
    ];
    let pids: Vec<u32> = ts.iter().map(Tenant::pid).collect();
    wait_all(ts);
    let trace = node.finish();
    let want = [0.35, 0.65];
    let (_, s) = measure("weights 1:3", &trace, &pids, &want);
    assert_shares("weights 1:3", &s, &want, 0.02);
}

/// DESIGN §2.4-5: a mostly idle tenant's unused share goes to the busy one; the GPU does not
/// idle while the busy tenant waits, beyond the handoff cost.
#[test]
fn idle_share_goes_to_the_busy_tenant() {
    let node = Node::start(&[]);
    // 4 ms of work, then 20 ms asleep on the host: about a sixth of the GPU.
    let bursty = Spin::for_ms(1.0, 3000.0)
        .sync_every(Some(4))
        .idle_ms(20.0);
    let ts = vec![
        spin_tenant(&node, "busy", 0.5, 1.0, 1.0, &Spin::kernels(1.0, 2000)),
        spin_tenant(&node, "bursty", 0.5, 1.0, 1.0, &bursty),
    ];
    let pids: Vec<u32> = ts.iter().map(Tenant::pid).collect();
    wait_all(ts);
    let trace = node.finish();
    let (w, s) = measure("busy + bursty", &trace, &pids, &[0.5, 0.5]);
    let util = trace.utilization(0, w);
    let gaps = gaps_in(&trace, w);
    let len = w.len_ns() as f64;
    // Handoffs between the two are the price of sharing; beyond them the GPU must be busy.
    let util_without_switches = (util * len) / (len - gaps.switch_ns as f64);
    eprintln!(
        "busy {:.4} + bursty {:.4}: utilisation {util:.4}, {:.4} excluding {} handoffs ({:.2} ms, mean {:.1} µs, max {:.1} µs)",
        s[0],
        s[1],
        util_without_switches,
        gaps.switches,
        gaps.switch_ns as f64 / 1e6,
        gaps.switch_ns as f64 / gaps.switches.max(1) as f64 / 1e3,
        gaps.max_switch_ns as f64 / 1e3,
    );
    assert!(
        s[1] < 0.3,
        "the bursty tenant should use well under its 0.5: {s:?}"
    );
    assert!(
        util_without_switches >= 0.97,
        "GPU idle while the busy tenant waited: utilisation {util:.4}, {util_without_switches:.4} without handoffs ({gaps:?})"
    );
    assert!(
        s[0] >= 1.0 - s[1] - 0.03 - gaps.switch_ns as f64 / len,
        "the busy tenant got {:.4}, the bursty one used {:.4}: the rest was lost",
        s[0],
        s[1]
    );
}

/// The launch fast path: host time per `cuLaunchKernel`, bare on the simulator and through the
/// hook with the token held (a lone tenant with request 1.0).
#[test]
fn hook_fast_path_overhead() {
    let node = Node::start(&[]);
    let args = ["launch-latency", "--n", "20000"];
    let mut bare = node.command(cudarc());
    bare.args(args);
    let bare = output_with_timeout(bare, TENANT_TIMEOUT);
    assert!(bare.status.success(), "bare run failed\n{}", describe(&bare));
    let hooked = node.tenant_command("solo", 1.0, 1.0, 1.0, cudarc(), &args);
    let hooked = output_with_timeout(hooked, TENANT_TIMEOUT);
    assert!(hooked.status.success(), "hooked run failed\n{}", describe(&hooked));
    let field = |o: &std::process::Output, k: &str| {
        json_lines(&o.stdout)[0][k]
            .as_f64()
            .unwrap_or_else(|| panic!("no {k}\n{}", describe(o)))
    };
    let (b, h) = (field(&bare, "ns_per_launch"), field(&hooked, "ns_per_launch"));
    let (bb, hb) = (
        field(&bare, "ns_per_launch_builder"),
        field(&hooked, "ns_per_launch_builder"),
    );
    eprintln!(
        "cuLaunchKernel: bare {b:.0} ns, hooked {h:.0} ns (+{:.0} ns, x{:.2}); via cudarc's builder: bare {bb:.0} ns, hooked {hb:.0} ns (x{:.2})",
        h - b,
        h / b,
        hb / bb
    );
    assert!(h < 3.0 * b, "hooked launch {h:.0} ns vs bare {b:.0} ns");
}
