//! End to end: the scheduler under a connection flood, and its per-user bound. While two busy tenants with
//! requests 0.7 / 0.3 run, the test holds 2,000 idle connections (each said Hello, then nothing
//! more), keeps 300 connections sending junk (each dropped by the scheduler and opened again
//! 100 ms later),
//! and leaves 100 with half a frame after their Hello and 100 with half a Hello. The scheduler
//! (a config file, no `--dev` when the test runs as root) serves all of it from one event loop:
//! its threads stay few, the tenants keep their shares within [`margins::SHARE`], and
//! `gpushare status` and `/metrics` answer within 1 s throughout.

use gpushare_testkit::flood::{Flood, FloodSpec, raise_open_files_limit, threads_of};
use gpushare_testkit::harness::target_dir;
use gpushare_testkit::margins;
use gpushare_testkit::node::{
    Node, Spin, Tenant, common_active_window, free_port, gaps_in, metrics_page, shares_in,
};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

const MAX_THREADS: usize = 64;
const ANSWER_WITHIN: Duration = Duration::from_secs(1);
const WARMUP_NS: u64 = 300_000_000;

/// CPU seconds (user + system) process `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, r)| r)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

/// Peak resident memory of process `pid`, in MiB.
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

#[test]
fn a_connection_flood_costs_neither_threads_nor_shares() {
    raise_open_files_limit(4096).unwrap_or_else(|e| panic!("this test: {e}"));
    let mut node = Node::device_only();
    // As root, the tenants are told apart by their gid, as a production config would; otherwise
    // they declare their groups to a --dev scheduler.
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let config = node.tmp.path().join("config.toml");
    std::fs::write(
        &config,
        "# The flood comes from the test's own user, like the tenants and `gpushare status`: the\n\
         # default bound per user would refuse most of it at once, and the test wants the\n\
         # scheduler to carry all of it.\n\
         [connections]\nmax_per_uid = 3000\n\n\
         [[group]]\nname = \"a\"\ngids = [7001]\nrequest = 0.7\n\n\
         [[group]]\nname = \"b\"\ngids = [7002]\nrequest = 0.3\n",
    )
    .unwrap();
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let args = ["--config", config.to_str().unwrap(), "--metrics", &metrics];
    node.start_scheduler_with(!root, &args);
    let pid = node.scheduler_pid().unwrap();
    let socket = node.sched_socket.clone();

    // The flood, before and while the tenants run: 2,000 idle, 300 junk renewed every 100 ms,
    // 100 stalled after Hello, 100 mid-Hello.
    let spec = FloodSpec::default();
    let flood = Flood::start(&socket, &spec).expect("flood the scheduler");

    // Synchronising every 200 ms rather than every 20, the tenants keep work queued across a
    // late wake-up of their own host thread on this busy machine: the shares measure the
    // scheduler, not the tenants' CPU.
    let spin = Spin::for_ms(1.0, 6000.0).sync_every(Some(200)).args();
    let tenant = |group: &str, gid: u32, request: f64| -> Tenant {
        let mut cmd = if root {
            node.run_command(&[], target_dir().join("cudarc-client"), &spin)
        } else {
            node.tenant_command(
                group,
                request,
                1.0,
                1.0,
                target_dir().join("cudarc-client"),
                &spin,
            )
        };
        if root {
            cmd.gid(gid);
        }
        node.spawn(cmd)
    };
    let tenants = [tenant("a", 7001, 0.7), tenant("b", 7002, 0.3)];
    let pids: Vec<u32> = tenants.iter().map(Tenant::pid).collect();

    let (mut threads, mut status_s, mut metrics_s) = (Vec::new(), Vec::new(), Vec::new());
    let mut tenants: Vec<Tenant> = tenants.into();
    while tenants.iter_mut().any(Tenant::running) {
        threads.push(threads_of(pid).expect("the scheduler runs"));
        let t = Instant::now();
        let status = node.status_json();
        status_s.push(t.elapsed().as_secs_f64());
        let status = status.unwrap_or_else(|e| panic!("gpushare status failed in the flood: {e}"));
        assert!(status["gpus"].is_array(), "{status}");
        let t = Instant::now();
        let page = metrics_page(port);
        metrics_s.push(t.elapsed().as_secs_f64());
        assert!(page.starts_with("HTTP/1.0 200"), "{page}");
        std::thread::sleep(Duration::from_millis(250));
    }
    let outputs: Vec<_> = tenants
        .into_iter()
        .map(|t| t.wait_ok(Duration::from_secs(30)))
        .collect();
    let f = flood.stop();
    let (scheduler_cpu, test_cpu) = (cpu_seconds(pid), cpu_seconds(std::process::id()));
    let scheduler_rss = peak_rss_mib(pid);
    let alive = node.scheduler_running();
    let log = node.scheduler_log();
    let trace = node.finish();
    drop(outputs);

    let w = common_active_window(&trace, &pids, WARMUP_NS);
    let shares = shares_in(&trace, &pids, w);
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "flood: {} idle ({} still open), {} junk connections opened, {} stalled mid-frame after Hello ({} open), {} mid-Hello ({} open after {:.2} s); scheduler threads {threads:?}; shares {shares:.4?} over {:.2} s (targets [0.7, 0.3]), utilisation {:.4} ({}); status {:.1} ms max of {} ({status_s:.3?} s), /metrics {:.1} ms max; CPU: scheduler {scheduler_cpu:.2} s, test (flood) {test_cpu:.2} s; scheduler peak RSS {scheduler_rss:.1} MiB",
        spec.idle,
        f.idle_open,
        f.junk_opened,
        spec.stalled_after_hello,
        f.stalled_after_hello_open,
        spec.mid_hello,
        f.mid_hello_open,
        f.mid_hello_age_s,
        w.len_ns() as f64 / 1e9,
        trace.utilization(0, w),
        gaps_in(&trace, w).summary(),
        max(&status_s) * 1e3,
        status_s.len(),
        max(&metrics_s) * 1e3,
    );
    assert_eq!(alive, Some(true), "the scheduler died\n{log}");
    assert!(trace.overlaps().is_empty(), "overlapping kernels");
    let most = threads.iter().copied().max().unwrap_or(0);
    assert!(
        most <= MAX_THREADS,
        "the scheduler ran {most} threads (at most {MAX_THREADS} allowed): {threads:?}"
    );
    for (got, want) in shares.iter().zip([0.7, 0.3]) {
        assert!(
            (got - want).abs() <= margins::SHARE,
            "share {got:.4} vs {want} ± {} under the flood (all: {shares:.4?})",
            margins::SHARE
        );
    }
    assert!(
        max(&status_s) < ANSWER_WITHIN.as_secs_f64(),
        "gpushare status took {status_s:?} s"
    );
    assert!(
        max(&metrics_s) < ANSWER_WITHIN.as_secs_f64(),
        "/metrics took {metrics_s:?} s"
    );
    assert_eq!(
        f.idle_open, spec.idle,
        "idle connections that said Hello were closed"
    );
    assert_eq!(
        f.stalled_after_hello_open, spec.stalled_after_hello,
        "connections with half a frame after their Hello were closed"
    );
    assert_eq!(
        f.mid_hello_open, 0,
        "connections that never finished their Hello are still open after {:.2} s",
        f.mid_hello_age_s
    );
}

/// Opens `n` connections to `socket`, each saying Hello (`hello`, hex), and prints how many
/// were welcomed (answered) rather than closed at once; then holds them until stdin closes.
const CONNECTOR: &str = r#"
import socket, sys
path, n, hello = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
held, welcomed = [], 0
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2.0)
    s.connect(path)
    try:
        s.sendall(hello)
        if s.recv(64):
            welcomed += 1
    except OSError:
        pass
    held.append(s)
print(welcomed, flush=True)
sys.stdin.read()
"#;

/// `max_per_uid` bounds one user's connections in one pid namespace: root in two containers
/// (each its own pid namespace) is two peers, not one. A Kubernetes node runs most containers
/// as root; counted as one user, they shared one allowance (256 connections, i.e. processes, by
/// default) for the whole node.
#[test]
fn the_per_user_bound_counts_each_containers_root_apart() {
    let mut node = Node::device_only();
    let config = node.tmp.path().join("config.toml");
    std::fs::write(&config, "[connections]\nmax_per_uid = 4\n").unwrap();
    node.start_scheduler_with(true, &["--config", config.to_str().unwrap()]);
    let hello: String = gpushare_testkit::flood::hello()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let socket = node.sched_socket.to_str().unwrap().to_string();
    let connector = |in_new_namespace: bool| {
        let mut cmd = if in_new_namespace {
            let mut c = std::process::Command::new("unshare");
            c.args(["--pid", "--fork", "python3"]);
            c
        } else {
            std::process::Command::new("python3")
        };
        cmd.args(["-c", CONNECTOR, &socket, "6", &hello])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("run python3 (and unshare, util-linux)")
    };
    let welcomed = |child: &mut std::process::Child| -> u32 {
        let mut line = String::new();
        let mut out = child.stdout.take().unwrap();
        let mut byte = [0u8; 1];
        while out.read(&mut byte).unwrap_or(0) == 1 && byte[0] != b'\n' {
            line.push(byte[0] as char);
        }
        line.trim()
            .parse()
            .unwrap_or_else(|_| panic!("connector said {line:?}"))
    };
    let mut here = connector(false);
    let in_this_namespace = welcomed(&mut here);
    let mut there = connector(true);
    let in_another_namespace = welcomed(&mut there);
    for mut c in [here, there] {
        drop(c.stdin.take());
        let _ = c.wait();
    }
    eprintln!(
        "max_per_uid 4, same uid: {in_this_namespace} of 6 welcomed in this pid namespace, \
         {in_another_namespace} of 6 in another, while the first held theirs"
    );
    assert_eq!(in_this_namespace, 4, "the bound holds within a namespace");
    assert_eq!(
        in_another_namespace, 4,
        "another pid namespace (container) of the same uid has its own allowance"
    );
}

/// Scrapers are served side by side on `/metrics`: a hundred connections that send nothing
/// (more than it serves at once) do not hold the page up.
#[test]
fn stalled_scrapers_do_not_hold_the_metrics_page_up() {
    let mut node = Node::device_only();
    let port = free_port();
    node.start_scheduler_with(true, &["--metrics", &format!("127.0.0.1:{port}")]);
    let stalled: Vec<_> = (0..100)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    let page = metrics_page(port);
    let waited = t0.elapsed();
    drop(stalled);
    eprintln!("/metrics behind 100 stalled scrapers: {waited:?}");
    assert!(page.contains("gpushare_unhooked_processes"), "{page}");
    assert!(
        waited < ANSWER_WITHIN,
        "the page came {waited:?} after 100 stalled scrapers connected"
    );
}
