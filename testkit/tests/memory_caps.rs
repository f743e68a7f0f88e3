//! End to end: GPU memory caps per group (docs/memory.md), through the real hook (`libgpushare.so`) and
//! daemon (`gpushare-scheduler --dev`) on the simulated GPU, with C clients linked directly
//! against libcuda (`c/mem_*.c`) and the cudarc client.
//!
//! Every tenant runs as `gpushare run --group G --memory CAP -- PROGRAM`; the simulated device
//! has 80 GiB, so every out-of-memory seen here comes from the cap, not from the device — but
//! in the last test, where caps overcommit a 2 GiB device and no allocation within its cap
//! may fail.

use gpushare_testkit::harness::{describe, json_lines, output_with_timeout, target_dir};
use gpushare_testkit::node::{Node, Spin, free_port, group_in, metrics_page, monotonic_ns};
use serde_json::Value;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Longest any one short-lived client may take.
const RUN: Duration = Duration::from_secs(30);
/// CUDA_ERROR_OUT_OF_MEMORY.
const OOM: i64 = 2;
/// `CUprocessState` values.
const RUNNING: i64 = 0;
const CHECKPOINTED: i64 = 2;

/// `gpushare run --group GROUP [--memory MEMORY] -- PROGRAM ARGS…` on the node, stdout piped.
fn in_group<S: AsRef<OsStr>>(
    node: &Node,
    group: &str,
    memory: Option<&str>,
    program: impl AsRef<OsStr>,
    args: &[S],
) -> Command {
    let mut run_args = vec!["--group", group];
    if let Some(m) = memory {
        run_args.extend(["--memory", m]);
    }
    let mut c = node.run_command(&run_args, program, args);
    c.stdout(Stdio::piped());
    c
}

/// Run to completion (bounded); it must succeed. Its JSON lines and raw output.
fn run_ok(cmd: Command) -> (Vec<Value>, Output) {
    let out = output_with_timeout(cmd, RUN);
    assert!(out.status.success(), "client failed\n{}", describe(&out));
    (json_lines(&out.stdout), out)
}

/// The first JSON line that has `key`.
fn line_with<'a>(lines: &'a [Value], key: &str, out: &Output) -> &'a Value {
    lines
        .iter()
        .find(|v| v.get(key).is_some())
        .unwrap_or_else(|| panic!("no JSON line with {key:?}\n{}", describe(out)))
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v}"))
}

fn i(v: &Value, key: &str) -> i64 {
    v[key]
        .as_i64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v}"))
}

/// A long-running client whose stdout lines can be awaited one by one. Killed when dropped.
struct Proc {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
    stderr: Option<JoinHandle<Vec<u8>>>,
}

impl Proc {
    fn spawn(mut cmd: Command) -> Proc {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", cmd.get_program()));
        let (tx, lines) = channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = Some(std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = err.read_to_end(&mut b);
            b
        }));
        Proc {
            child,
            lines,
            seen: Vec::new(),
            stderr,
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The next JSON line with `key`, waiting at most `timeout`; `Err` says why there was none.
    fn next_json(&mut self, key: &str, timeout: Duration) -> Result<Value, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if let Ok(v) = serde_json::from_str::<Value>(&l)
                        && v.get(key).is_some()
                    {
                        return Ok(v);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!("no {key:?} line within {timeout:?}"));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(format!("no {key:?} line before its stdout closed"));
                }
            }
        }
    }

    /// [`next_json`](Proc::next_json), which must succeed (else the process is killed and its
    /// output shown).
    fn expect_json(&mut self, key: &str, timeout: Duration) -> Value {
        match self.next_json(key, timeout) {
            Ok(v) => v,
            Err(why) => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                let err = self.stderr.take().and_then(|h| h.join().ok());
                panic!(
                    "pid {}: {why}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                    self.pid(),
                    self.seen.join("\n"),
                    String::from_utf8_lossy(&err.unwrap_or_default())
                );
            }
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: plain syscall on our own child, not yet reaped.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// Wait at most `timeout` for it to exit: status (None: had to be killed) and stderr.
    fn finish(mut self, timeout: Duration) -> (Option<ExitStatus>, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break Some(s);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let err = self.stderr.take().and_then(|h| h.join().ok());
        (
            status,
            String::from_utf8_lossy(&err.unwrap_or_default()).into(),
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A node and the C client `c/NAME.c` compiled against its libcuda.
fn node_with(name: &str) -> (Node, PathBuf) {
    let node = Node::start(&[]);
    let exe = node.compile_c(&format!("{name}.c"), true);
    (node, exe)
}

/// Every allocation path of the driver API counts against the cap, through hook and daemon:
/// within the cap succeeds, over it is CUDA_ERROR_OUT_OF_MEMORY and holds nothing, the process
/// goes on allocating, the matching free makes the memory available again (up to the whole
/// cap), and cuMemGetInfo_v2 / cuDeviceTotalMem_v2 report the cap and what is left after every
/// step (all checked inside mem_paths.c).
#[test]
fn every_allocation_path_counts_against_the_cap() {
    let (node, exe) = node_with("mem_paths");
    let cap = (64 * MIB).to_string();
    let (lines, out) = run_ok(in_group(
        &node,
        "paths",
        Some("64MiB"),
        &exe,
        &["paths", &cap],
    ));
    let resolved = line_with(&lines, "resolved", &out)["resolved"].clone();
    eprintln!("resolved through the hook: {resolved}");
    for (route, sym) in resolved.as_object().unwrap() {
        assert!(
            sym.as_str().unwrap().ends_with("@libgpushare.so"),
            "{route} resolved to {sym}, not to the hook's wrapper"
        );
    }
    let paths: Vec<&str> = lines.iter().filter_map(|v| v["path"].as_str()).collect();
    for want in [
        "cuMemAlloc_v2",
        "cuMemAllocPitch_v2",
        "cuMemAllocManaged",
        "cuMemAllocAsync",
        "cuMemAllocAsync_ptsz",
        "cuMemAllocFromPoolAsync",
        "cuMemAllocFromPoolAsync_ptsz",
        "cuMemAlloc(procaddr 3020)",
        "cuMemCreate",
        "cuArrayCreate_v2",
        "cuArray3DCreate_v2",
        "cuMipmappedArrayCreate",
        "boundaries",
    ] {
        assert!(
            paths.contains(&want),
            "path {want} not reported\n{}",
            describe(&out)
        );
    }
    assert!(String::from_utf8_lossy(&out.stdout).contains("PASS"));

    // The same program without gpushare sees the whole device: the checks above can fail.
    let mut bare = node.command(&exe);
    bare.args(["paths", &cap]).env_remove("LD_PRELOAD");
    let bare = output_with_timeout(bare, RUN);
    assert!(
        !bare.status.success()
            && String::from_utf8_lossy(&bare.stderr).contains("cuMemGetInfo_v2 free"),
        "without the hook mem_paths should fail its first cap check\n{}",
        describe(&bare)
    );
}

/// cudarc's `CudaContext::mem_get_info` / `total_mem` and a C program's cuMemGetInfo_v2 /
/// cuDeviceTotalMem_v2 report the cap; cudarc's allocations (dlsym route) count against it; an
/// uncapped group sees the device.
#[test]
fn mem_get_info_reports_the_cap_to_cudarc_and_c() {
    let (node, exe) = node_with("mem_tool");
    let cap = 256 * MIB;
    let cudarc = target_dir().join("cudarc-client");

    let (lines, out) = run_ok(in_group(&node, "info", Some("256MiB"), &cudarc, &["smoke"]));
    let smoke = line_with(&lines, "mem_total", &out);
    eprintln!(
        "cudarc smoke: mem_free {} mem_total {} total_mem {}",
        smoke["mem_free"], smoke["mem_total"], smoke["total_mem"]
    );
    assert_eq!(u(smoke, "mem_total"), cap, "cudarc mem_get_info total");
    assert_eq!(u(smoke, "mem_free"), cap, "cudarc mem_get_info free");
    assert_eq!(u(smoke, "total_mem"), cap, "cudarc total_mem");

    let (lines, out) = run_ok(in_group(
        &node,
        "info",
        Some("256MiB"),
        &cudarc,
        &["oom", "--fill"],
    ));
    let oom = line_with(&lines, "quarters_allocated", &out);
    assert_eq!(u(oom, "total"), cap);
    assert_eq!(u(oom, "quarters_allocated"), 4, "{oom}");

    let (lines, out) = run_ok(in_group(&node, "info", Some("256MiB"), &exe, &["info"]));
    let info = line_with(&lines, "info", &out);
    eprintln!("C cuMemGetInfo_v2 under a 256 MiB cap: {info}");
    assert_eq!(
        (u(info, "free"), u(info, "total"), u(info, "device_total")),
        (cap, cap, cap)
    );

    // Without a cap the group sees the device as it is.
    let mut bare = node.command(&exe);
    bare.arg("info");
    let (lines, out) = run_ok(bare);
    let device = u(line_with(&lines, "info", &out), "total");
    let (lines, out) = run_ok(in_group::<&str>(&node, "uncapped", None, &exe, &["info"]));
    let info = line_with(&lines, "info", &out);
    assert_eq!(
        (u(info, "total"), u(info, "device_total")),
        (device, device),
        "uncapped group"
    );
}

/// One line of a mem_race timeline: (time, process, bytes held by that process from then on).
fn read_timeline(path: &Path, who: usize) -> Vec<(u64, usize, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| {
            let (t, b) = l.split_once(' ').expect("T_NS BYTES");
            (t.parse().unwrap(), who, b.parse().unwrap())
        })
        .collect()
}

/// Two processes of one group allocate and free random sizes (1..16 MiB) as fast as they can
/// for 600 ms against a 256 MiB cap. Their timelines of what each holds (conservatively timed:
/// from after the allocation returned until before the free was called) are merged: the sum
/// never exceeds the cap, while allocations were refused (the cap was really contended).
#[test]
fn racing_processes_of_one_group_never_exceed_the_cap_together() {
    let (node, exe) = node_with("mem_race");
    let cap = 256 * MIB;
    for seed in [1u64, 2, 3] {
        let go = node.tmp.path().join(format!("go-{seed}"));
        let files: Vec<PathBuf> = (0..2)
            .map(|p| node.tmp.path().join(format!("timeline-{seed}-{p}")))
            .collect();
        let runs: Vec<_> = files
            .iter()
            .enumerate()
            .map(|(p, f)| {
                let args = [
                    (seed * 10 + p as u64).to_string(),
                    go.display().to_string(),
                    "600".into(),
                    "16".into(),
                    f.display().to_string(),
                ];
                let cmd = in_group(&node, "race", Some("256MiB"), &exe, &args);
                std::thread::spawn(move || run_ok(cmd))
            })
            .collect();
        // Both racers initialised (however long a busy machine took): start them together.
        let ready = |f: &PathBuf| PathBuf::from(format!("{}.ready", f.display())).exists();
        let waiting_since = std::time::Instant::now();
        while !files.iter().all(ready) {
            assert!(
                waiting_since.elapsed() < Duration::from_secs(30),
                "seed {seed}: the racers never became ready"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::write(&go, b"").expect("create the go file");
        let summaries: Vec<Value> = runs
            .into_iter()
            .map(|h| {
                let (lines, out) = h.join().expect("race client thread");
                line_with(&lines, "allocs", &out).clone()
            })
            .collect();
        let mut events: Vec<(u64, usize, u64)> = files
            .iter()
            .enumerate()
            .flat_map(|(p, f)| read_timeline(f, p))
            .collect();
        // At equal times, decreases first (a holding ends where the next one may begin).
        events.sort_by_key(|&(t, _, b)| (t, b));
        let mut held = [0u64; 2];
        let mut peak = (0u64, 0u64);
        for &(t, p, b) in &events {
            held[p] = b;
            let sum = held[0] + held[1];
            assert!(
                sum <= cap,
                "seed {seed}: at {t} ns the two processes held {} + {} = {sum} bytes, over the {cap}-byte cap",
                held[0],
                held[1]
            );
            if sum > peak.0 {
                peak = (sum, t);
            }
        }
        let span = |p: usize| {
            let ts: Vec<u64> = events.iter().filter(|e| e.1 == p).map(|e| e.0).collect();
            (ts[0], *ts.last().unwrap())
        };
        let ((s0, e0), (s1, e1)) = (span(0), span(1));
        let overlap = e0.min(e1).saturating_sub(s0.max(s1));
        let refused: u64 = summaries.iter().map(|s| u(s, "refused")).sum();
        let allocs: Vec<u64> = summaries.iter().map(|s| u(s, "allocs")).collect();
        eprintln!(
            "seed {seed}: allocs {allocs:?}, refused {refused}, {} events, overlap {:.0} ms, peak together {:.1} MiB of {} MiB",
            events.len(),
            overlap as f64 / 1e6,
            peak.0 as f64 / MIB as f64,
            cap / MIB
        );
        assert!(
            overlap >= 400_000_000,
            "seed {seed}: the processes raced for only {overlap} ns"
        );
        assert!(
            allocs.iter().all(|&a| a > 0) && refused > 0,
            "seed {seed}: no contention ({summaries:?})"
        );
        assert!(
            peak.0 > cap - 16 * MIB,
            "seed {seed}: together they never came near the cap (peak {})",
            peak.0
        );
    }
    let g = node
        .status_group("race")
        .expect("group race in gpushare status");
    assert_eq!(u(&g, "memory_used"), 0, "after both exited: {g}");
}

/// `hold` a client: it holds `bytes` once it printed its "held" line.
fn holder(node: &Node, exe: &Path, group: &str, cap: &str, bytes: u64) -> Proc {
    let mut p = Proc::spawn(in_group(
        node,
        group,
        Some(cap),
        exe,
        &["hold", &bytes.to_string()],
    ));
    p.expect_json("held", RUN);
    p
}

/// `try BYTES RETRY_MS` in the group: the result line.
fn try_alloc(node: &Node, exe: &Path, group: &str, cap: &str, bytes: u64, retry_ms: u64) -> Value {
    let (lines, out) = run_ok(in_group(
        node,
        group,
        Some(cap),
        exe,
        &["try", &bytes.to_string(), &retry_ms.to_string()],
    ));
    line_with(&lines, "result", &out).clone()
}

/// kill -9 of a process holding 3 GiB of a 4 GiB cap: its memory is the group's again at once.
/// A new process allocates 3 GiB on (nearly) its first try, within a second of the kill.
#[test]
fn killed_process_releases_its_memory_at_once() {
    let (node, exe) = node_with("mem_tool");
    let h = holder(&node, &exe, "k", "4GiB", 3 * GIB);
    let refused = try_alloc(&node, &exe, "k", "4GiB", 3 * GIB, 0);
    assert_eq!(
        i(&refused, "result"),
        OOM,
        "3 + 3 GiB of a 4 GiB cap: {refused}"
    );

    let t_kill = monotonic_ns();
    h.signal(libc::SIGKILL);
    let (status, _) = h.finish(Duration::from_secs(5));
    assert!(status.is_some(), "the killed holder did not exit");
    // How soon the daemon's books show the memory free.
    let mut released_ms = None;
    while monotonic_ns() - t_kill < 1_000_000_000 {
        if node
            .status_group("k")
            .is_some_and(|g| g["memory_used"] == 0)
        {
            released_ms = Some((monotonic_ns() - t_kill) as f64 / 1e6);
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let got = try_alloc(&node, &exe, "k", "4GiB", 3 * GIB, 20);
    let after_kill_ms = (u(&got, "t_done_ns") - t_kill) as f64 / 1e6;
    eprintln!(
        "kill -9: books released after {released_ms:?} ms (status poll); a new process got 3 GiB {after_kill_ms:.1} ms after the kill, attempt {}",
        got["attempts"]
    );
    assert_eq!(i(&got, "result"), 0, "3 GiB after the holder died: {got}");
    assert!(
        released_ms.is_some(),
        "books still show the dead process's memory after 1 s"
    );
    assert!(
        after_kill_ms <= 1000.0,
        "a new process got the memory only {after_kill_ms:.0} ms after the kill"
    );
}

/// `mem_tool vmm BYTES`, driven through its stages: `check(stage, free)` at each.
fn vmm_stages(cmd: Command, mut check: impl FnMut(&str, u64)) {
    let stages = [
        "released_mapped",
        "unmapped",
        "retained_unmapped",
        "released",
    ];
    let mut p = Proc::spawn(cmd);
    for (n, want) in stages.iter().enumerate() {
        let v = p.expect_json("stage", RUN);
        assert_eq!(v["stage"], *want, "{v}");
        check(want, u(&v, "free"));
        if n + 1 < stages.len() {
            p.signal(libc::SIGUSR1);
        }
    }
    let (status, stderr) = p.finish(RUN);
    assert!(
        status.is_some_and(|s| s.success()),
        "mem_tool vmm: {stderr}"
    );
}

/// A physical allocation (cuMemCreate) holds its memory until its handle is released AND it is
/// unmapped, in either order, and a handle retained from a mapped address (cuMemRetainAllocationHandle)
/// needs its own release (PyTorch's expandable segments release handles while mapped). The
/// simulated driver frees it exactly then; under a 4 GiB cap, while 3 GiB live, a second process
/// of the group is refused 2 GiB, and granted them once the memory is freed. Each stage's line
/// comes after a cuMemGetInfo_v2 round trip, so the scheduler has seen the stage's frees.
#[test]
fn physical_memory_is_charged_until_released_and_unmapped() {
    let (node, exe) = node_with("mem_tool");
    let bytes = (3 * GIB).to_string();
    let live = |stage: &str| matches!(stage, "released_mapped" | "retained_unmapped");

    let mut bare = node.command(&exe);
    bare.args(["vmm", &bytes]);
    let mut device_free = Vec::new();
    vmm_stages(bare, |stage, free| {
        device_free.push((stage.to_string(), free))
    });
    let all = device_free.iter().map(|(_, f)| *f).max().unwrap();
    for (stage, free) in &device_free {
        let want = if live(stage) { all - 3 * GIB } else { all };
        assert_eq!(
            *free, want,
            "device memory free at {stage}: {device_free:?}"
        );
    }

    let capped = in_group(&node, "vmm", Some("4GiB"), &exe, &["vmm", &bytes]);
    vmm_stages(capped, |stage, free| {
        let used = node.status_group("vmm").map_or(0, |g| u(&g, "memory_used"));
        let other = try_alloc(&node, &exe, "vmm", "4GiB", 2 * GIB, 0);
        eprintln!("{stage}: free {free}, group uses {used}, another process asks 2 GiB: {other}");
        if live(stage) {
            assert_eq!((free, used), (GIB, 3 * GIB), "{stage}: 3 GiB still live");
            assert_eq!(
                i(&other, "result"),
                OOM,
                "{stage}: 2 GiB granted beside 3 GiB live"
            );
        } else {
            assert_eq!((free, used), (4 * GIB, 0), "{stage}: the memory was freed");
            assert_eq!(
                i(&other, "result"),
                0,
                "{stage}: 2 GiB refused after the free"
            );
        }
    });
}

/// The simulated driver's memory pools behave as the driver documents them (`mem_tool
/// pool-api`: 2 MiB granules, reuse of freed bytes, release at a synchronisation down to the
/// threshold, trims, `maxSize`, current pools, destruction with live allocations, high
/// watermarks, each allocation's pool, cuMemGetInfo_v2 after each step), alone; and under the
/// hook with a 1 GiB cap, where cuMemGetInfo_v2 then follows the pools through the hook's
/// charges (a destroyed pool's live allocations included).
#[test]
fn simulated_pools_follow_the_driver_api_and_the_hook_follows_them() {
    let (node, exe) = node_with("mem_tool");
    let mut bare = node.command(&exe);
    bare.arg("pool-api");
    for (name, cmd) in [
        ("bare", bare),
        (
            "hooked",
            in_group(&node, "pool-api", Some("1GiB"), &exe, &["pool-api"]),
        ),
    ] {
        let (lines, out) = run_ok(cmd);
        let v = line_with(&lines, "pool_api", &out);
        assert_eq!(v["pool_api"], "PASS", "{name}: {v}");
    }
    let g = node
        .status_group("pool-api")
        .expect("the group in gpushare status");
    assert_eq!(u(&g, "memory_used"), 0, "after it exited: {g}");
}

/// `mem_tool pool BYTES THRESHOLD` in group `group` under a 4 GiB cap, driven through its
/// stages: `check(stage, line)` at each.
fn pool_stages(
    node: &Node,
    exe: &Path,
    group: &str,
    bytes: u64,
    threshold: u64,
    mut check: impl FnMut(&str, &Value),
) {
    let stages = ["allocated", "freed", "synced", "trimmed"];
    let args = ["pool", &bytes.to_string(), &threshold.to_string()].map(String::from);
    let mut p = Proc::spawn(in_group(node, group, Some("4GiB"), exe, &args));
    for want in stages {
        let v = p.expect_json("stage", RUN);
        assert_eq!(v["stage"], want, "{v}");
        check(want, &v);
        p.signal(libc::SIGUSR1);
    }
    let (status, stderr) = p.finish(RUN);
    assert!(
        status.is_some_and(|s| s.success()),
        "mem_tool pool: {stderr}"
    );
}

/// Wait (at most 3 s) until the group's use on the GPU is `want`: how long it took, in ms.
fn wait_used(node: &Node, group: &str, want: u64) -> Option<f64> {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        if node
            .status_group(group)
            .is_some_and(|g| u(&g, "memory_used") == want)
        {
            return Some(t0.elapsed().as_secs_f64() * 1e3);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// A stream-ordered pool keeps what cuMemFreeAsync frees, and the hook charges what
/// the pool reserves on the device, not what its allocations use. Release threshold 2 GiB under
/// a 4 GiB cap: 3 GiB from cuMemAllocAsync; another process of the group is refused 2 GiB while
/// they are allocated, and still after cuMemFreeAsync (the pool keeps them); at the stream's
/// synchronisation the pool releases down to its threshold, and the hook notices by itself
/// (the process calls nothing more): the group's use drops to 2 GiB, 3 GiB are refused and
/// 2 GiB granted; after cuMemPoolTrimTo(pool, 0) it drops to 0 and 3 GiB are granted.
#[test]
fn a_pool_keeps_freed_bytes_charged_until_it_releases_them() {
    let (node, exe) = node_with("mem_tool");
    let group = "pool";
    let other = |bytes: u64| i(&try_alloc(&node, &exe, group, "4GiB", bytes, 0), "result");
    pool_stages(&node, &exe, group, 3 * GIB, 2 * GIB, |stage, v| {
        let pool = (u(v, "reserved"), u(v, "used"));
        match stage {
            "allocated" | "freed" => {
                let used = if stage == "allocated" { 3 * GIB } else { 0 };
                assert_eq!(pool, (3 * GIB, used), "{stage}: the pool {v}");
                assert_eq!(u(v, "free"), GIB, "{stage}: cuMemGetInfo_v2 {v}");
                let g = node
                    .status_group(group)
                    .expect("the group in gpushare status");
                assert_eq!(u(&g, "memory_used"), 3 * GIB, "{stage}: {g}");
                assert_eq!(
                    other(2 * GIB),
                    OOM,
                    "{stage}: 2 GiB beside 3 GiB in the pool"
                );
            }
            "synced" => {
                assert_eq!(pool, (2 * GIB, 0), "released down to the threshold: {v}");
                let ms = wait_used(&node, group, 2 * GIB);
                eprintln!("synchronised: the group's use is 2 GiB after {ms:?} ms");
                assert!(
                    ms.is_some(),
                    "the pool's release was not given back within 3 s"
                );
                assert_eq!(other(3 * GIB), OOM, "3 GiB beside the 2 GiB the pool keeps");
                assert_eq!(other(2 * GIB), 0, "2 GiB beside the 2 GiB the pool keeps");
            }
            _ => {
                assert_eq!(pool, (0, 0), "trimmed: {v}");
                let ms = wait_used(&node, group, 0);
                eprintln!("trimmed: the group's use is 0 after {ms:?} ms");
                assert!(ms.is_some(), "the trim was not given back within 3 s");
                assert_eq!(other(3 * GIB), 0, "3 GiB after the trim");
            }
        }
    });
    let g = node
        .status_group(group)
        .expect("the group in gpushare status");
    assert_eq!(u(&g, "memory_used"), 0, "after it exited: {g}");
}

/// With the default release threshold (0), what cuMemFreeAsync frees stays in the pool, and
/// charged, until the next synchronisation, and comes back then: 3 GiB under a 4 GiB cap,
/// another process of the group is refused 2 GiB after the free, and gets 3 GiB after the
/// synchronisation (the hook notices by itself).
#[test]
fn the_default_pool_gives_freed_bytes_back_at_the_synchronisation() {
    let (node, exe) = node_with("mem_tool");
    let group = "pool0";
    let other = |bytes: u64| i(&try_alloc(&node, &exe, group, "4GiB", bytes, 0), "result");
    pool_stages(&node, &exe, group, 3 * GIB, 0, |stage, v| {
        let pool = (u(v, "reserved"), u(v, "used"));
        match stage {
            "allocated" | "freed" => {
                assert_eq!(pool.0, 3 * GIB, "{stage}: the pool {v}");
                assert_eq!(
                    other(2 * GIB),
                    OOM,
                    "{stage}: 2 GiB beside 3 GiB in the pool"
                );
            }
            "synced" => {
                assert_eq!(pool, (0, 0), "released at the synchronisation: {v}");
                let ms = wait_used(&node, group, 0);
                eprintln!("synchronised: the group's use is 0 after {ms:?} ms");
                assert!(
                    ms.is_some(),
                    "the pool's release was not given back within 3 s"
                );
                assert_eq!(other(3 * GIB), 0, "3 GiB after the synchronisation");
            }
            _ => assert_eq!(pool, (0, 0), "trimmed: {v}"),
        }
    });
}

/// Host memory from cuMemCreate (location HOST, or HOST_NUMA node 0: NCCL's host buffers) is not
/// the GPU's: the simulated device does not lose it, and under a 4 GiB cap the process holding
/// 2 × 3 GiB of it still gets all 4 GiB of device memory. HOST_NUMA_CURRENT is refused for a
/// physical allocation (CUDA_ERROR_INVALID_VALUE), as by the driver.
#[test]
fn host_located_physical_memory_is_not_charged_to_the_gpu() {
    let (node, exe) = node_with("mem_tool");
    let (host, dev) = ((3 * GIB).to_string(), (4 * GIB).to_string());
    let args = ["vmm-host", host.as_str(), dev.as_str()];
    let mut bare = node.command(&exe);
    bare.args(args);
    let runs = [
        ("bare", run_ok(bare)),
        (
            "capped",
            run_ok(in_group(&node, "hostmem", Some("4GiB"), &exe, &args)),
        ),
    ];
    for (name, (lines, out)) in &runs {
        let v = line_with(lines, "host", out);
        eprintln!("{name}: {v}");
        let results = ["host", "host_numa", "host_numa_current", "device_alloc"].map(|k| i(v, k));
        assert_eq!(results, [0, 0, 1, 0], "{name}: {v}");
        assert_eq!(u(v, "free_after"), u(v, "free_before"), "{name}: {v}");
    }
    assert_eq!(
        u(line_with(&runs[1].1.0, "host", &runs[1].1.1), "free_before"),
        4 * GIB
    );
}

/// A process holding 3 GiB of a 4 GiB cap forks a child that never uses CUDA (a data-loader
/// worker) and exits without freeing anything: its memory is the group's again while the child
/// lives (the child closed its copy of the parent's scheduler connection at the fork), and a new
/// process gets 3 GiB.
#[test]
fn an_exited_parents_memory_is_freed_while_its_forked_child_lives() {
    /// The forked child: killed when the test ends, however it ends.
    struct Child(i32);
    impl Child {
        fn alive(&self) -> bool {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.0));
            // The state follows the command name in parentheses; Z: exited, not yet reaped.
            stat.is_ok_and(|s| {
                s.rsplit_once(") ")
                    .is_some_and(|(_, r)| !r.starts_with('Z'))
            })
        }
    }
    impl Drop for Child {
        fn drop(&mut self) {
            // SAFETY: plain syscall; the pid is the test's grandchild, alive until told to exit.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
    let (node, exe) = node_with("mem_tool");
    let bytes = (3 * GIB).to_string();
    let mut parent = Proc::spawn(in_group(
        &node,
        "fk",
        Some("4GiB"),
        &exe,
        &["fork-hold", &bytes],
    ));
    let held = parent.expect_json("child", RUN);
    let child = Child(i(&held, "child") as i32);
    let (status, stderr) = parent.finish(RUN);
    assert!(status.is_some_and(|s| s.success()), "fork-hold: {stderr}");
    assert!(stderr.is_empty(), "the hook printed something: {stderr}");
    assert!(child.alive(), "the forked child exited early");

    // The daemon learns of the parent's exit from its connection closing.
    let t0 = Instant::now();
    let used = |node: &Node| node.status_group("fk").map_or(0, |g| u(&g, "memory_used"));
    while used(&node) != 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let got = try_alloc(&node, &exe, "fk", "4GiB", 3 * GIB, 0);
    eprintln!(
        "parent exited; after {:.1} ms the group uses {}; a new process asks 3 GiB: {got}",
        t0.elapsed().as_secs_f64() * 1e3,
        used(&node)
    );
    assert!(
        child.alive(),
        "the forked child did not live through the test"
    );
    assert_eq!(
        i(&got, "result"),
        0,
        "3 GiB refused while the exited parent's forked child lives: its 3 GiB are still booked"
    );
}

/// Over the cap: CUDA_ERROR_OUT_OF_MEMORY, and the process keeps working (a spin kernel launched
/// afterwards runs and synchronises, copies round-trip, the whole cap can be allocated later).
#[test]
fn over_cap_is_oom_and_the_process_keeps_working() {
    let (node, exe) = node_with("mem_paths");
    let (lines, out) = run_ok(in_group(
        &node,
        "oomk",
        Some("64MiB"),
        &exe,
        &["oom-kernel", &(64 * MIB).to_string()],
    ));
    let v = line_with(&lines, "oom", &out);
    assert_eq!(i(v, "oom"), OOM);
    assert!(v["kernel_ms"].as_f64().unwrap() >= 2.0, "{v}");
}

/// The scheduler restarts while a process holds 3 GiB of a 4 GiB cap: the hook reconnects
/// (within ~0.5 s) and states what it holds, so another process of the group is refused 2 GiB
/// and granted 1 GiB; the holder keeps working (its free goes through) and the books end at 0.
#[test]
fn scheduler_restart_keeps_the_books() {
    let (mut node, exe) = node_with("mem_tool");
    let mut h = holder(&node, &exe, "r", "4GiB", 3 * GIB);
    node.kill_scheduler();
    node.start_scheduler(&[]);
    // The hook retries every 500 ms; give it a little more.
    std::thread::sleep(Duration::from_millis(1200));
    let big = try_alloc(&node, &exe, "r", "4GiB", 2 * GIB, 0);
    let small = try_alloc(&node, &exe, "r", "4GiB", GIB, 0);
    h.signal(libc::SIGUSR1);
    let freed = h.next_json("freed", Duration::from_secs(5));
    let (status, stderr) = h.finish(Duration::from_secs(5));
    eprintln!("after restart: 2 GiB -> {big}, 1 GiB -> {small}, holder exit {status:?}");
    assert_eq!(
        i(&big, "result"),
        OOM,
        "2 GiB granted while another process holds 3 GiB of the 4 GiB cap: the restarted scheduler lost the books ({big})"
    );
    assert_eq!(i(&small, "result"), 0, "1 GiB after the restart: {small}");
    assert!(
        freed.is_ok() && status.is_some_and(|s| s.success()),
        "the holder could not free its memory after the scheduler restart ({freed:?}, exit {status:?})\n{stderr}"
    );
    let g = node.status_group("r").expect("group r in gpushare status");
    assert_eq!(u(&g, "memory_used"), 0, "{g}");
}

/// Restarts racing allocations: a process holds 3 GiB of a 4 GiB cap and sits idle; the daemon
/// is killed (-9) and restarted 50 times, and each time another process of the group asks for
/// 2 GiB as soon as the new daemon listens, before or after the holder has reconnected (the
/// delay varies). The daemon's journal keeps the holder's 3 GiB on the books: never granted.
/// A holder that dies while the daemon is down does not keep its memory: after the next
/// restart the whole cap is free.
#[test]
fn restarts_racing_allocations_never_exceed_the_cap() {
    let (mut node, exe) = node_with("mem_tool");
    let h = holder(&node, &exe, "race", "4GiB", 3 * GIB);
    let trials = 50;
    let mut granted = Vec::new();
    for trial in 0..trials {
        node.kill_scheduler();
        node.start_scheduler(&[]);
        std::thread::sleep(Duration::from_millis([0, 0, 1, 3, 10][trial % 5]));
        let r = try_alloc(&node, &exe, "race", "4GiB", 2 * GIB, 0);
        if i(&r, "result") != OOM {
            granted.push((trial, r));
        }
    }
    eprintln!(
        "{trials} restarts raced: {} grants over the cap",
        granted.len()
    );
    assert!(
        granted.is_empty(),
        "2 GiB granted beside a 3 GiB holder of a 4 GiB cap after a restart: {granted:?}"
    );
    node.kill_scheduler();
    h.signal(libc::SIGKILL);
    let (status, _) = h.finish(Duration::from_secs(5));
    assert!(status.is_some(), "the killed holder did not exit");
    node.start_scheduler(&[]);
    let all = try_alloc(&node, &exe, "race", "4GiB", 4 * GIB, 0);
    assert_eq!(
        i(&all, "result"),
        0,
        "the dead holder's memory stays on the restored books: {all}"
    );
}

/// `gpushare status --json` (and the table) shows each group's memory used and cap on the GPU.
#[test]
fn status_reports_memory_used_and_cap() {
    let (node, exe) = node_with("mem_tool");
    let mut h = holder(&node, &exe, "st", "512MiB", 300 * MIB);
    let g = node
        .status_group("st")
        .expect("group st in gpushare status --json");
    eprintln!("status --json group entry: {g}");
    assert_eq!(u(&g, "memory_used"), 300 * MIB, "{g}");
    assert_eq!(u(&g, "memory_cap"), 512 * MIB, "{g}");
    let mut c = Command::new(target_dir().join("gpushare"));
    c.arg("status").env("GPUSHARE_SOCKET", &node.sched_socket);
    let table = output_with_timeout(c, RUN);
    let text = String::from_utf8_lossy(&table.stdout);
    eprintln!("{text}");
    assert!(
        text.contains("300/512"),
        "memory column in the table\n{text}"
    );

    h.signal(libc::SIGUSR1);
    let after = h.expect_json("after_free", RUN);
    assert_eq!(u(&after, "free"), 512 * MIB);
    let (status, stderr) = h.finish(RUN);
    assert!(status.is_some_and(|s| s.success()), "{stderr}");
    let g = node.status_group("st").unwrap();
    assert_eq!(u(&g, "memory_used"), 0, "{g}");
}

/// A later process of the group declaring a smaller cap: cuMemGetInfo_v2 reports 0 free, not an
/// underflowed number, and cuDeviceTotalMem_v2 the new cap.
#[test]
fn mem_get_info_never_underflows() {
    let (node, exe) = node_with("mem_tool");
    let _h = holder(&node, &exe, "uf", "4GiB", 3 * GIB);
    let (lines, out) = run_ok(in_group(&node, "uf", Some("1GiB"), &exe, &["info"]));
    let info = line_with(&lines, "info", &out);
    assert_eq!(
        (u(info, "free"), u(info, "total"), u(info, "device_total")),
        (0, GIB, GIB),
        "{info}"
    );
}

/// Small allocations come from the process's lease: 2000 × (cuMemAlloc_v2 +
/// cuMemFree_v2) of 1 MiB under a 4 GiB cap (lease block 64 MiB) ask the scheduler for a
/// reservation a handful of times in all, where without a lease (`GPUSHARE_MEM_LEASE=0`) each
/// allocation waits for one. The scheduler counts the round trips (`memory_reservations` in
/// `gpushare status --json`). Prints what an allocation costs, bare, leased and not.
#[test]
fn small_allocations_take_from_the_lease_without_a_round_trip() {
    let (node, exe) = node_with("mem_tool");
    let (n, warmup) = (2000u64, 100u64);
    let args = ["bench", &n.to_string(), &MIB.to_string()].map(String::from);
    let mut c = node.command(&exe);
    c.args(&args);
    let (lines, out) = run_ok(c);
    let bare = line_with(&lines, "median_alloc_ns", &out).clone();
    let (lines, out) = run_ok(in_group(&node, "lease", Some("4GiB"), &exe, &args));
    let leased = line_with(&lines, "median_alloc_ns", &out).clone();
    let mut c = in_group(&node, "nolease", Some("4GiB"), &exe, &args);
    c.env("GPUSHARE_MEM_LEASE", "0");
    let (lines, out) = run_ok(c);
    let unleased = line_with(&lines, "median_alloc_ns", &out).clone();
    let round_trips = |group: &str| {
        let g = node
            .status_group(group)
            .expect("the group in gpushare status");
        u(&g, "memory_reservations")
    };
    let (with_lease, without) = (round_trips("lease"), round_trips("nolease"));
    eprintln!(
        "{} allocations of 1 MiB: reservations with a lease {with_lease}, without {without}; median ns per allocation: bare {}, leased {}, not leased {}; per free: {}, {}, {}",
        n + warmup,
        bare["median_alloc_ns"],
        leased["median_alloc_ns"],
        unleased["median_alloc_ns"],
        bare["median_free_ns"],
        leased["median_free_ns"],
        unleased["median_free_ns"],
    );
    assert!(
        with_lease <= (n + warmup) / 100,
        "{with_lease} reservations for {} leased allocations",
        n + warmup
    );
    assert!(
        without >= n + warmup,
        "without a lease each allocation reserves: {without} reservations for {}",
        n + warmup
    );
    // One round trip, not a wait: a generous bound for a loaded 2-core debug build.
    let median = |v: &Value| u(v, "median_alloc_ns") as f64;
    assert!(
        median(&unleased) - median(&bare) < 2_000_000.0,
        "a reservation adds {:.0} ns per allocation",
        median(&unleased) - median(&bare)
    );
}

/// Two processes of one group share its whole cap through their leases. Under a
/// 256 MiB cap (lease block 8 MiB) one process allocates the whole cap in 1 MiB pieces (near
/// the cap a refill asks for no more than the allocation needs) and a second is refused; the
/// first frees half and goes idle, and the second then gets that half, 128 × 1 MiB, waiting
/// at most until the first's unused spare comes back (a lease window or two), and not one MiB
/// more: its 129th is refused for 300 ms. A sampler reads the group's use from `gpushare
/// status` all along: never over the cap.
#[test]
fn two_processes_share_the_whole_cap_through_their_leases() {
    let (node, exe) = node_with("mem_tool");
    let cap = 256 * MIB;
    let group = |n: u64, retry_ms: u64, keep: u64| {
        let args = [
            "many",
            &n.to_string(),
            &MIB.to_string(),
            &retry_ms.to_string(),
            &keep.to_string(),
        ]
        .map(String::from);
        Proc::spawn(in_group(&node, "halves", Some("256MiB"), &exe, &args))
    };
    /// Stops the sampler however the test ends.
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop = AtomicBool::new(false);
    let (samples, max_used) = std::thread::scope(|s| {
        let stopper = Stop(&stop);
        let sampler = s.spawn(|| {
            let (mut samples, mut max_used) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                if let Some(g) = node.status_group("halves") {
                    samples += 1;
                    max_used = max_used.max(u(&g, "memory_used"));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            (samples, max_used)
        });
        let mut a = group(256, 0, 128);
        let got = a.expect_json("many", RUN);
        assert_eq!(
            u(&got, "many"),
            256,
            "one process, the whole cap in 1 MiB pieces: {got}"
        );
        let refused = try_alloc(&node, &exe, "halves", "256MiB", MIB, 0);
        assert_eq!(
            i(&refused, "result"),
            OOM,
            "1 MiB beside a full cap: {refused}"
        );

        a.signal(libc::SIGUSR1);
        let freed = a.expect_json("kept", RUN);
        let mut b = group(129, 300, 0);
        let got = b.expect_json("many", RUN);
        let waited_ms = u(&got, "longest_wait_ns") as f64 / 1e6;
        let after_ms = (u(&got, "t_done_ns") - u(&freed, "t_ns")) as f64 / 1e6;
        eprintln!(
            "the second process got {} MiB of the freed half (longest wait for one piece {waited_ms:.1} ms, all of it and the refused 129th {after_ms:.0} ms after the free)",
            got["many"]
        );
        assert_eq!(
            u(&got, "many"),
            128,
            "the freed half, and not one MiB more: {got}"
        );
        // Its 129th piece waited its 300 ms; any piece before waited for leased spare only.
        assert!(
            waited_ms < 1000.0,
            "a piece of the freed half waited {waited_ms:.0} ms for the first process's spare"
        );
        b.signal(libc::SIGUSR1);
        b.expect_json("kept", RUN);
        for mut p in [a, b] {
            p.signal(libc::SIGUSR1);
            p.expect_json("done", RUN);
            let (status, stderr) = p.finish(RUN);
            assert!(status.is_some_and(|s| s.success()), "{stderr}");
        }
        drop(stopper);
        sampler.join().expect("sampler")
    });
    eprintln!("{samples} samples of the group's use, at most {max_used} bytes of {cap}");
    assert!(samples >= 10, "only {samples} samples of the group's use");
    assert!(
        max_used <= cap,
        "the group used {max_used} bytes, over its {cap}-byte cap"
    );
    let g = node
        .status_group("halves")
        .expect("group halves in gpushare status");
    assert_eq!(u(&g, "memory_used"), 0, "after both exited: {g}");
}

/// GPU memory beyond the card: two groups capped at 1500 MiB on a simulated GPU of 2 GiB, under
/// `gpushare-scheduler --memory-overcommit 2`. The first allocates 1200 MiB and fills it; the
/// second's 1200 MiB, within its cap, does not fit beside it: it waits in the allocation call,
/// the scheduler swaps the first group to host memory (the driver's checkpoint API), and the
/// allocation succeeds — never `CUDA_ERROR_OUT_OF_MEMORY`. Once the second is done and gone,
/// the first is restored and finds every byte it wrote. Fail-open (the default): the wait,
/// far past the liveness bound, is the one the scheduler announced (`MemWait`), so the hook
/// does not take the scheduler for unresponsive and allocate alone. While the first is out,
/// `gpushare status` (text and `--json`) and `/metrics` show the GPU's physical books, where
/// each group's memory is, the swap and the wait; once it is back, the restore.
#[test]
fn an_allocation_within_its_cap_waits_for_a_swap_instead_of_failing_when_the_gpu_is_full() {
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let (node, exe) = overcommitted_node(&["--metrics", &metrics]);
    let (mut first, second, waited_s) = second_swaps_first_out(&node, &exe);
    // While it is out, `gpushare status` says so.
    let status = node.status_json().expect("gpushare status --json");
    check_swapped_out(&status, waited_s);
    let text = status_text(&node);
    for line in [
        "  first: memory swapped out, ",
        "  second: memory resident\n",
        "memory swaps: 1 out (0 failed; median ",
    ] {
        assert!(text.contains(line), "{line:?} in gpushare status:\n{text}");
    }
    assert!(
        text.contains("swapped to host memory (caps may sum to 2x); 0 allocation(s) waiting"),
        "{text}"
    );
    check_swap_metrics(port);
    second_checks_its_bytes_and_exits(second);

    // The second gone, the first comes back and reads what it wrote.
    first.signal(libc::SIGUSR1);
    let v = first.next_json("intact", RUN).unwrap_or_else(|why| {
        panic!(
            "the first group, restored: {why}\n--- scheduler ---\n{}",
            node.scheduler_log()
        )
    });
    assert_eq!(
        v["intact"], true,
        "the first group's bytes after a swap to host memory and back: {v}"
    );
    let (status, err) = first.finish(RUN);
    assert!(status.is_some_and(|s| s.success()), "first: {err}");
    let log = node.scheduler_log();
    assert!(log.contains("restoring from host memory"), "{log}");
    // No turns for the first while out, and turns again once back (it ran: it read its bytes).
    for line in [
        "no GPU turns while its memory is out",
        "GPU turns again: its memory is back",
    ] {
        assert!(
            log.contains(line),
            "{line:?} in the scheduler's log:\n{log}"
        );
    }
    // The first ran again, so the scheduler heard that the restore was done.
    let swaps = &node.status_json().expect("gpushare status --json")["memory_swaps"];
    assert_eq!(u(swaps, "swap_ins"), 1, "{swaps}");
    assert_eq!(
        u(swaps, "swap_in_bytes"),
        u(swaps, "swap_out_bytes"),
        "what came back is what went out: {swaps}"
    );
    assert_eq!(u(&swaps["swap_in_seconds"], "count"), 1, "{swaps}");
    assert_eq!(u(swaps, "swap_in_failures"), 0, "{swaps}");
}

/// A busy group swapped out: the first group launches 1 ms kernels (synchronising every 20)
/// with 1200 MiB of the 2 GiB GPU, fail-open, when the second's 1200 MiB makes the scheduler
/// swap it out. Its turn is revoked as the swap begins and its process locked while its
/// launches and the hook's questions about its fence events are under way; it is restored once
/// the second is gone, runs its kernels again and finishes cleanly, and it never takes the
/// scheduler for unresponsive (no fail-open warning on its stderr): its hook heard the
/// scheduler throughout the swap.
#[test]
fn a_busy_group_is_swapped_out_and_back_and_keeps_hearing_the_scheduler() {
    let (node, exe) = overcommitted_node(&[]);
    let args = Spin::for_ms(1.0, 7_000.0).alloc_mib(1200).args();
    let mut cmd = in_group(
        &node,
        "first",
        Some("1500MiB"),
        target_dir().join("cudarc-client"),
        &args,
    );
    cmd.env("GPUSHARE_FAIL", "open");
    // Wide enough that a daemon slowed by a busy host does not trip it, narrower than the
    // checkpoint of 1200 MiB (≈ 0.9 s), so a hook deaf for the swap does.
    cmd.env("GPUSHARE_LIVENESS", "500ms");
    let first = Proc::spawn(cmd);
    let first_pid = first.pid() as u32;
    std::thread::sleep(Duration::from_millis(1_500));
    let mut second = keep(&node, &exe, "second", "2");
    let got = second.expect_json("alloc", RUN);
    assert_eq!(
        i(&got, "alloc"),
        0,
        "1200 MiB within the second's cap, the busy first swapped out: {got}\n{}",
        node.scheduler_log()
    );
    second.expect_json("filled", RUN);
    second_checks_its_bytes_and_exits(second);
    let second_gone = monotonic_ns();
    let (status, err) = first.finish(RUN);
    assert!(status.is_some_and(|s| s.success()), "first: {err}");
    assert!(
        !err.contains("WITHOUT GPU sharing limits"),
        "the first took the scheduler for unresponsive during its swap:\n{err}"
    );
    let log = node.scheduler_log();
    for line in ["swapping out to host memory", "restoring from host memory"] {
        assert!(
            log.contains(line),
            "{line:?} in the scheduler's log:\n{log}"
        );
    }
    let trace = node.finish();
    assert!(
        (trace.records().iter()).any(|r| r.pid == first_pid && r.start_ns > second_gone),
        "the first ran no kernel once restored"
    );
}

/// A 2 GiB simulated GPU, `gpushare-scheduler --memory-overcommit 2 ARGS…` logging its swaps,
/// and the C client `mem_tool`.
fn overcommitted_node(args: &[&str]) -> (Node, PathBuf) {
    let mut node = Node::device_only_with(&["--memory", "2GiB"]);
    node.scheduler_log_filter =
        "warn,gpushare_scheduler::node::overcommit=info,gpushare_scheduler::checkpoint=info".into();
    let mut args = args.to_vec();
    args.extend(["--memory-overcommit", "2"]);
    node.start_scheduler(&args);
    let exe = node.compile_c("mem_tool.c", true);
    (node, exe)
}

/// `mem_tool keep 1200MiB SEED` in `group`, capped at 1500 MiB, fail-open.
fn keep(node: &Node, exe: &Path, group: &str, seed: &str) -> Proc {
    Proc::spawn(keep_command(node, exe, group, seed))
}

fn keep_command(node: &Node, exe: &Path, group: &str, seed: &str) -> Command {
    let mut cmd = in_group(
        node,
        group,
        Some("1500MiB"),
        exe,
        &["keep", &(1200 * MIB).to_string(), seed],
    );
    cmd.env("GPUSHARE_FAIL", "open");
    cmd
}

/// The second group, told to (SIGUSR1), finds every byte it wrote and exits cleanly.
fn second_checks_its_bytes_and_exits(mut second: Proc) {
    second.signal(libc::SIGUSR1);
    let v = second.expect_json("intact", RUN);
    assert_eq!(v["intact"], true, "the second group's bytes: {v}");
    let (status, err) = second.finish(RUN);
    assert!(status.is_some_and(|s| s.success()), "second: {err}");
}

/// Group `first` allocates 1200 MiB of the 2 GiB GPU and fills it; group `second`'s 1200 MiB
/// then waits until `first` is swapped to host memory, and is granted. Both processes, and how
/// long the second's allocation took as it measured it (s).
fn second_swaps_first_out(node: &Node, exe: &Path) -> (Proc, Proc, f64) {
    second_swaps_out(node, exe, keep(node, exe, "first", "1"))
}

/// [`second_swaps_first_out`] with `first` started already.
fn second_swaps_out(node: &Node, exe: &Path, mut first: Proc) -> (Proc, Proc, f64) {
    /// The hook's default liveness bound (the default quota plus grace).
    const LIVENESS_NS: u64 = 40_000_000;
    let got = first.expect_json("alloc", RUN);
    assert_eq!(i(&got, "alloc"), 0, "1200 MiB on an empty 2 GiB GPU: {got}");
    first.expect_json("filled", RUN);

    let mut second = keep(node, exe, "second", "2");
    let got = second.expect_json("alloc", RUN);
    let waited_s = u(&got, "wait_ns") as f64 / 1e9;
    eprintln!("the second group's 1200 MiB came after {waited_s:.2} s");
    assert_eq!(
        i(&got, "alloc"),
        0,
        "1200 MiB within a 1500 MiB cap on a GPU another group filled: {got}\n{}",
        node.scheduler_log()
    );
    // A swap costs 0.1 s and more at the simulated driver's rates: the answer came after it.
    assert!(
        u(&got, "wait_ns") > LIVENESS_NS,
        "the allocation did not wait for the swap: {got}"
    );
    second.expect_json("filled", RUN);
    assert!(
        node.scheduler_log().contains("swapping out to host memory"),
        "the second allocation was served without a swap?\n{}",
        node.scheduler_log()
    );
    (first, second, waited_s)
}

/// The first group, swapped out to host memory, is killed (`SIGKILL`) while out: its host copy
/// goes with it and the scheduler frees its books: nothing is left in host memory, its group's
/// cap is whole again (a new process of it gets 600 MiB of the free memory, 1200 + 600 MiB being
/// past its 1500 MiB cap, and without another swap), the group that made it go out keeps every
/// byte, nothing is restored, nothing fails.
#[test]
fn a_victim_killed_while_swapped_out_frees_its_books_and_nothing_else_breaks() {
    let (mut node, exe) = overcommitted_node(&[]);
    let (first, second, _) = second_swaps_first_out(&node, &exe);
    let status = node.status_json().expect("gpushare status --json");
    let g = group_in(&status, "first").expect("the first group in the status");
    assert_eq!(g["memory_state"], "swapped_out", "{g}");

    first.signal(libc::SIGKILL);
    let (exited, _) = first.finish(RUN);
    assert!(exited.is_some(), "the killed process did not exit");
    // Its books go as its connection closes; 5 s is far beyond that on a loaded machine.
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        let status = node.status_json().expect("gpushare status --json");
        let physical = &status["gpus"][0]["physical"];
        let first_used = group_in(&status, "first").map_or(0, |g| u(g, "memory_used"));
        if u(physical, "swapped") == 0 && first_used == 0 {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "5 s after the kill, the swapped-out process is still on the books: {status}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let physical = &status["gpus"][0]["physical"];
    let second_used = u(group_in(&status, "second").expect("second"), "memory_used");
    assert_eq!(u(physical, "used"), second_used, "{status}");
    assert!(u(physical, "free") >= 600 * MIB, "{status}");

    let got = try_alloc(&node, &exe, "first", "1500MiB", 600 * MIB, 0);
    assert_eq!(
        i(&got, "result"),
        0,
        "600 MiB for a new process of the killed one's group: {got}\n{}",
        node.scheduler_log()
    );
    second_checks_its_bytes_and_exits(second);

    let status = node.status_json().expect("gpushare status --json");
    let swaps = &status["memory_swaps"];
    assert_eq!(u(swaps, "swap_outs"), 1, "no other swap: {swaps}");
    assert_eq!(u(swaps, "swap_ins"), 0, "nothing to restore: {swaps}");
    assert_eq!(u(swaps, "swap_in_failures"), 0, "{swaps}");
    assert_eq!(u(swaps, "allocations_refused"), 0, "{swaps}");
    let physical = &status["gpus"][0]["physical"];
    assert_eq!(
        (u(physical, "used"), u(physical, "swapped")),
        (0, 0),
        "everyone gone: {status}"
    );
    let log = node.scheduler_log();
    assert!(!log.contains("restoring from host memory"), "{log}");
    assert_eq!(node.scheduler_running(), Some(true), "{log}");
}

/// How long a killed scheduler stays down before it is started again: less than the
/// simulated checkpoint or restore of 1200 MiB takes (about a second), so the new scheduler
/// may find it still under way in the driver.
const DOWN: Duration = Duration::from_millis(200);

/// Wait (at most [`RUN`]) until the scheduler's log says `what`.
fn wait_log(node: &Node, what: &str) {
    let deadline = Instant::now() + RUN;
    while !node.scheduler_log().contains(what) {
        assert!(
            Instant::now() < deadline,
            "the scheduler never logged {what:?}\n{}",
            node.scheduler_log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Wait (at most [`RUN`]) until `gpushare status --json` passes `done`; that status.
fn wait_status(node: &Node, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + RUN;
    loop {
        let status = node.status_json().expect("gpushare status --json");
        if done(&status) {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: never seen\n{status}\n--- scheduler ---\n{}",
            node.scheduler_log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The first group, told to check, reads back every byte it wrote before the restart.
fn first_intact_after_restart(node: &Node, first: &mut Proc) {
    first.signal(libc::SIGUSR1);
    let v = first.next_json("intact", RUN).unwrap_or_else(|why| {
        panic!(
            "the first group after the restart: {why}\n--- scheduler ---\n{}",
            node.scheduler_log()
        )
    });
    assert_eq!(v["intact"], true, "the first group's bytes: {v}");
}

/// Both groups end with every byte and the books empty.
fn both_finish_intact(node: &Node, first: Proc, second: Proc) {
    second_checks_its_bytes_and_exits(second);
    let mut first = first;
    first_intact_after_restart(node, &mut first);
    let (status, err) = first.finish(RUN);
    assert!(status.is_some_and(|s| s.success()), "first: {err}");
    let status = wait_status(node, "the books empty once both exited", |s| {
        let p = &s["gpus"][0]["physical"];
        u(p, "used") == 0 && u(p, "swapped") == 0
    });
    let swaps = &status["memory_swaps"];
    assert_eq!(u(swaps, "swap_in_failures"), 0, "{swaps}");
    assert_eq!(u(swaps, "allocations_refused"), 0, "{swaps}");
}

/// The scheduler is killed (`SIGKILL`) while it swaps group `first` out for group `second`'s
/// allocation, and started again: the second's allocation, which the scheduler had told to
/// wait, asks the new one rather than race the swap to the GPU; the new scheduler finds the
/// first checkpointed in the driver and books it in host memory, or locked (killed before
/// the checkpoint; unlocked) or running (killed before it asked the driver anything), and
/// swaps it out anew: either way the books are exact (the
/// second's memory used, the first's swapped), the second is granted, and the first restored
/// once the second is gone. Both keep every byte.
#[test]
fn a_scheduler_killed_mid_swap_out_finishes_the_swap_after_its_restart() {
    let (mut node, exe) = overcommitted_node(&[]);
    let mut first = keep(&node, &exe, "first", "1");
    let got = first.expect_json("alloc", RUN);
    assert_eq!(i(&got, "alloc"), 0, "1200 MiB on an empty 2 GiB GPU: {got}");
    first.expect_json("filled", RUN);
    let mut second = keep(&node, &exe, "second", "2");
    wait_log(&node, "swapping out to host memory");
    node.kill_scheduler();
    std::thread::sleep(DOWN);
    node.start_scheduler(&["--memory-overcommit", "2"]);

    let got = second.expect_json("alloc", RUN);
    assert_eq!(
        i(&got, "alloc"),
        0,
        "1200 MiB within its cap, asked across the restart: {got}\n{}",
        node.scheduler_log()
    );
    second.expect_json("filled", RUN);
    let status = wait_status(&node, "the first found swapped out", |s| {
        group_in(s, "first").is_some_and(|g| g["memory_state"] == "swapped_out")
    });
    let physical = &status["gpus"][0]["physical"];
    let held = |g: &str, key: &str| u(group_in(&status, g).expect("in the status"), key);
    assert_eq!(
        (u(physical, "used"), u(physical, "swapped")),
        (
            held("second", "memory_used"),
            held("first", "memory_swapped")
        ),
        "exact books after the restart: {status}"
    );
    assert!(u(physical, "swapped") >= 1200 * MIB, "{status}");
    // Killed after its checkpoint, the swap is finished ("found in host memory after a
    // restart"); killed during the lock, it is undone ("unlocking a process a swap left
    // locked"); killed before its first call reached the driver, there is nothing to undo:
    // in the last two, the new scheduler swaps the first out for the second anew.
    let log = node.scheduler_log();
    let found = log.contains("found in host memory after a restart");
    let anew = log.matches("swapping out to host memory").count() == 2;
    assert!(found != anew, "finished, or undone and made anew:\n{log}");
    both_finish_intact(&node, first, second);
}

/// The scheduler is killed (`SIGKILL`) while it restores group `first` (swapped out for group
/// `second`, which has exited), and started again: the new scheduler finds the first locked
/// with its memory back on the GPU, or still in host memory, and unlocks it, or restores and
/// unlocks it: it runs on with every byte.
#[test]
fn a_scheduler_killed_mid_swap_in_finishes_the_restore_after_its_restart() {
    let (mut node, exe) = overcommitted_node(&[]);
    let (first, second, _) = second_swaps_first_out(&node, &exe);
    second_checks_its_bytes_and_exits(second);
    wait_log(&node, "restoring from host memory");
    node.kill_scheduler();
    std::thread::sleep(DOWN);
    node.start_scheduler(&["--memory-overcommit", "2"]);

    let mut first = first;
    first_intact_after_restart(&node, &mut first);
    let status = wait_status(&node, "the first resident", |s| {
        group_in(s, "first").is_some_and(|g| g["memory_state"] == "resident")
            && u(&s["gpus"][0]["physical"], "used") == 1200 * MIB
    });
    assert_eq!(u(&status["gpus"][0]["physical"], "swapped"), 0, "{status}");
    let (status, err) = first.finish(RUN);
    assert!(status.is_some_and(|s| s.success()), "first: {err}");
}

/// Group `first`, swapped out to host memory for group `second`, loses its way to the
/// scheduler (its hook reaches the socket through a link, which goes away), and the scheduler
/// is killed (`SIGKILL`) and started again: `first` never reconnects and is only in the
/// memory journal. The new scheduler asks the driver where its memory is all the same (the
/// checkpoint API needs nothing of the process), finds it in host memory, and restores and
/// unlocks it once `second` is gone: the driver holds it running again, its 1200 MiB are
/// resident in `gpushare status`, and it reads back every byte it wrote. (A process stopped
/// with `SIGSTOP` would not do here: the simulated driver's checkpoint calls are answered by a
/// thread of the target process.)
#[test]
fn a_swapped_out_process_that_never_reconnects_is_restored_after_a_scheduler_restart() {
    let (mut node, exe) = overcommitted_node(&[]);
    let tool = node.compile_c("checkpoint_tool.c", true);
    let dir = tempfile::tempdir().expect("temporary directory");
    let link = dir.path().join("gpushare.sock");
    std::os::unix::fs::symlink(&node.sched_socket, &link).expect("link to the socket");
    let mut cmd = keep_command(&node, &exe, "first", "1");
    cmd.env("GPUSHARE_SOCKET", &link);
    let (mut first, second, _) = second_swaps_out(&node, &exe, Proc::spawn(cmd));
    wait_status(&node, "the first swapped out", |s| {
        group_in(s, "first").is_some_and(|g| g["memory_state"] == "swapped_out")
    });
    let state = |node: &Node| {
        let mut cmd = node.command(&tool);
        cmd.args(["state", &first.pid().to_string()]);
        let out = output_with_timeout(cmd, RUN);
        assert!(out.status.success(), "checkpoint_tool\n{}", describe(&out));
        let v = json_lines(&out.stdout).pop().expect("a line");
        assert_eq!(i(&v, "result"), 0, "cuCheckpointProcessGetState: {v}");
        i(&v, "state")
    };
    assert_eq!(state(&node), CHECKPOINTED, "the first in host memory");
    std::fs::remove_file(&link).expect("remove the link");
    node.kill_scheduler();
    std::thread::sleep(DOWN);
    node.start_scheduler(&["--memory-overcommit", "2"]);

    // The second reconnects, checks its bytes and exits; the first fits again.
    second_checks_its_bytes_and_exits(second);
    // The first's 1200 MiB back on the GPU, the only memory there.
    let status = wait_status(&node, "the first restored by the new scheduler", |s| {
        let p = &s["gpus"][0]["physical"];
        u(&s["memory_swaps"]["swap_in_seconds"], "count") == 1
            && u(p, "used") == 1200 * MIB
            && u(p, "swapped") == 0
    });
    assert_eq!(
        u(&status["memory_swaps"], "swap_in_failures"),
        0,
        "{status}"
    );
    assert_eq!(state(&node), RUNNING, "restored and unlocked");
    // Meanwhile it is a GPU process with the hook loaded and no connection.
    let pid = u64::from(first.child.id());
    wait_status(&node, "the first never reconnected", |s| {
        (s["unhooked"].as_array().into_iter().flatten())
            .any(|p| p["pid"] == pid && p["hook_loaded"] == true)
    });
    let log = node.scheduler_log();
    assert!(
        log.contains("found in host memory after a restart"),
        "{log}"
    );
    // Still without the scheduler, it runs on with its bytes.
    first_intact_after_restart(&node, &mut first);
    let (status, err) = first.finish(RUN);
    assert!(status.is_some_and(|s| s.success()), "first: {err}");
    wait_status(&node, "the books empty once both exited", |s| {
        let p = &s["gpus"][0]["physical"];
        u(p, "used") == 0 && u(p, "swapped") == 0
    });
}

/// Group `first` holds memory the scheduler may not swap out besides its 1200 MiB (`tail`:
/// the rest of its `mem_tool keep` arguments), and its hook told the scheduler before it made
/// it: when group `second`'s 1200 MiB needs room that only `first` could make, no checkpoint is
/// even tried (no swap, no failure): the allocation is refused with the reason (`why`), naming
/// the group, and so is a later one of the same group (a third group's cap would be clamped to
/// the 1096 MiB the first two leave of 2 x 2 GiB); `first` runs on with every byte.
fn a_group_that_may_not_be_swapped_out_runs_on_with_its_bytes(tail: &[&str], why: &str) {
    let (node, exe) = overcommitted_node(&[]);
    let mut args = vec!["keep".to_string(), (1200 * MIB).to_string(), "1".into()];
    args.extend(tail.iter().map(|a| a.to_string()));
    let mut cmd = in_group(&node, "first", Some("1500MiB"), &exe, &args);
    cmd.env("GPUSHARE_FAIL", "open");
    let mut first = Proc::spawn(cmd);
    let got = first.expect_json("alloc", RUN);
    assert_eq!(
        i(&got, "alloc"),
        0,
        "1200 MiB on a GPU with 16 MiB used at most: {got}"
    );
    first.expect_json("filled", RUN);

    for n in 0..2 {
        let group = "second";
        let mut p = keep(&node, &exe, group, "2");
        let got = p.expect_json("alloc", RUN);
        assert_eq!(
            i(&got, "alloc"),
            OOM,
            "{group}: 1200 MiB beside 1200 MiB or more that cannot be swapped out: {got}\n{}",
            node.scheduler_log()
        );
        let (exited, _) = p.finish(RUN);
        assert!(exited.is_some(), "{group} did not exit after its refusal");
        let status = node.status_json().expect("gpushare status --json");
        let swaps = &status["memory_swaps"];
        assert_eq!(
            (u(swaps, "swap_outs"), u(swaps, "swap_out_failures")),
            (0, 0),
            "never tried, after {} refusal(s): {swaps}",
            n + 1
        );
        assert_eq!(u(swaps, "allocations_refused"), n as u64 + 1, "{swaps}");
        let f = group_in(&status, "first").expect("the first group in the status");
        assert_eq!(f["memory_state"], "resident", "{f}");
        assert_eq!(u(f, "memory_swapped"), 0, "{f}");
    }
    let log = node.scheduler_log();
    assert!(
        log.contains("within the group's cap refused")
            && log.contains("group \"first\" holds ")
            && log.contains(&format!(" MiB of {why}")),
        "the refusal says why:\n{log}"
    );
    first.signal(libc::SIGUSR1);
    let v = first.expect_json("intact", RUN);
    assert_eq!(v["intact"], true, "the first group's bytes: {v}");
    let (exited, err) = first.finish(RUN);
    assert!(exited.is_some_and(|s| s.success()), "first: {err}");
    assert!(!log.contains("restoring from host memory"), "{log}");
}

/// Managed (unified) memory, which the driver cannot checkpoint: 16 MiB of it, checked intact
/// too.
#[test]
fn a_group_holding_managed_memory_is_not_swapped_out_and_runs_on_with_its_bytes() {
    let managed = (16 * MIB).to_string();
    a_group_that_may_not_be_swapped_out_runs_on_with_its_bytes(&[&managed], "managed memory");
}

/// Memory exported to other processes (`cuIpcGetMemHandle`): swapped out, they would lose it.
#[test]
fn a_group_sharing_memory_over_ipc_is_not_swapped_out_and_runs_on_with_its_bytes() {
    a_group_that_may_not_be_swapped_out_runs_on_with_its_bytes(
        &["0", "ipc"],
        "memory shared with another process (IPC)",
    );
}

/// Caps may sum to 2 x the 2 GiB GPU: groups `first` and `second` keep their 1500 MiB caps,
/// `third`, whose cap came last, gets the 1096 MiB left. Its process sees that cap
/// (`cuMemGetInfo`), an allocation past it fails at once with `CUDA_ERROR_OUT_OF_MEMORY` and the
/// reason (its `GPUSHARE_LOG=debug` output), the scheduler's log says so when the cap is set,
/// and `gpushare status` (text and `--json`: `memory_cap`, `memory_clamped`) shows it.
#[test]
fn a_cap_past_what_the_gpu_may_promise_gets_what_is_left_and_says_so() {
    let (node, exe) = overcommitted_node(&[]);
    for group in ["first", "second"] {
        let got = try_alloc(&node, &exe, group, "1500MiB", 1200 * MIB, 0);
        assert_eq!(i(&got, "result"), 0, "{group}: {got}");
    }
    let mut cmd = in_group(
        &node,
        "third",
        Some("1500MiB"),
        &exe,
        &["try", &(1200 * MIB).to_string(), "0"],
    );
    cmd.env("GPUSHARE_LOG", "debug");
    let (lines, out) = run_ok(cmd);
    let before = line_with(&lines, "before", &out);
    assert_eq!(u(before, "total"), 1096 * MIB, "the clamped cap: {before}");
    let got = line_with(&lines, "result", &out);
    assert_eq!(i(got, "result"), OOM, "1200 MiB past a 1096 MiB cap: {got}");
    let said = String::from_utf8_lossy(&out.stderr);
    let why = "group \"third\"'s memory cap of 1500 MiB is clamped to 1096 MiB on this GPU: the caps of the groups that came before it already promise 3000 of the 4096 MiB that memory_overcommit = 2 allows";
    assert!(said.contains(why), "the process is told why:\n{said}");
    let log = node.scheduler_log();
    assert!(log.contains(why), "the scheduler's log says so:\n{log}");
    let status = node.status_json().expect("gpushare status --json");
    let third = group_in(&status, "third").expect("the third group in the status");
    assert_eq!(
        (u(third, "memory_cap"), u(third, "memory_clamped")),
        (1096 * MIB, 1500 * MIB),
        "{third}"
    );
    let first = group_in(&status, "first").expect("the first group in the status");
    assert!(first["memory_clamped"].is_null(), "{first}");
    let text = status_text(&node);
    assert!(
        text.contains("  third: memory cap clamped to 1096 MiB of the 1500 asked"),
        "{text}"
    );
}

/// `gpushare status` as a person reads it.
fn status_text(node: &Node) -> String {
    let mut c = Command::new(target_dir().join("gpushare"));
    c.arg("status").env("GPUSHARE_SOCKET", &node.sched_socket);
    let out = output_with_timeout(c, Duration::from_secs(5));
    assert!(out.status.success(), "gpushare status\n{}", describe(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `gpushare status --json` with group `first` swapped out of the 2 GiB GPU by group
/// `second`, whose 1200 MiB allocation waited `waited_s` (as the process measured it).
fn check_swapped_out(status: &Value, waited_s: f64) {
    let first = group_in(status, "first").expect("the first group in the status");
    let second = group_in(status, "second").expect("the second group in the status");
    assert!(u(first, "memory_swapped") >= 1200 * MIB, "{first}");
    assert_eq!(first["memory_state"], "swapped_out", "{first}");
    assert_eq!(u(second, "memory_swapped"), 0, "{second}");
    assert_eq!(second["memory_state"], "resident", "{second}");
    let physical = &status["gpus"][0]["physical"];
    let (total, used) = (u(physical, "total"), u(physical, "used"));
    assert_eq!(total, 2 * GIB, "{physical}");
    assert!(
        (1200 * MIB..=total).contains(&used),
        "the second's 1200 MiB on the GPU: {physical}"
    );
    assert_eq!(u(physical, "free"), total - used, "{physical}");
    assert!(u(physical, "swapped") >= 1200 * MIB, "{physical}");
    assert_eq!(physical["overcommit"], 2.0, "{physical}");
    assert_eq!(u(physical, "waiting"), 0, "{physical}");
    let swaps = &status["memory_swaps"];
    assert_eq!(u(swaps, "swap_outs"), 1, "{swaps}");
    assert_eq!(u(swaps, "swap_out_failures"), 0, "{swaps}");
    assert_eq!(u(swaps, "swap_ins"), 0, "the first is still out: {swaps}");
    assert_eq!(
        u(swaps, "swap_out_bytes"),
        u(first, "memory_swapped"),
        "what went out is what the first holds in host memory: {swaps}"
    );
    assert_eq!(u(swaps, "swap_in_bytes"), 0, "{swaps}");
    assert!(u(swaps, "allocation_waits") >= 1, "{swaps}");
    assert_eq!(u(swaps, "allocations_refused"), 0, "{swaps}");
    // The checkpoint took the simulated driver's fixed 0.1 s at least; the scheduler saw the
    // allocation wait within the process's own wait.
    let out = &swaps["swap_out_seconds"];
    assert_eq!(u(out, "count"), 1, "{swaps}");
    assert!(out["sum_s"].as_f64().unwrap() >= 0.1, "{swaps}");
    let wait = &swaps["allocation_wait_seconds"];
    assert!(u(wait, "count") >= 1, "{swaps}");
    let longest = wait["max_s"].as_f64().unwrap();
    assert!(
        longest >= out["sum_s"].as_f64().unwrap() && longest <= waited_s + 0.01,
        "the scheduler's longest wait {longest} s: after the swap, within the process's {waited_s} s\n{swaps}"
    );
}

/// `/metrics` at `port` with group `first` swapped out (published at least once a second).
fn check_swap_metrics(port: u16) {
    const SAMPLES: [&str; 5] = [
        "gpushare_gpu_memory_total_bytes{gpu=\"0\",",
        "gpushare_gpu_memory_overcommit_ratio{gpu=\"0\",",
        "gpushare_memory_swap_outs_total 1\n",
        "gpushare_memory_swap_out_duration_seconds_count 1\n",
        "gpushare_memory_swap_ins_total 0\n",
    ];
    let deadline = Instant::now() + Duration::from_secs(5);
    let swapped = |page: &str, metric: &str, labels: &str| -> u64 {
        (page.lines())
            .find(|l| l.starts_with(metric) && l.contains(labels))
            .and_then(|l| l.rsplit_once(' '))
            .and_then(|(_, v)| v.parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    };
    loop {
        let page = metrics_page(port);
        let group = swapped(
            &page,
            "gpushare_group_memory_swapped_bytes{",
            "group=\"first\"",
        );
        let gpu = swapped(&page, "gpushare_gpu_memory_swapped_bytes{", "gpu=\"0\"");
        if group >= 1200 * MIB && gpu >= 1200 * MIB && SAMPLES.iter().all(|s| page.contains(s)) {
            assert!(
                page.contains("gpushare_memory_allocation_wait_seconds_count "),
                "{page}"
            );
            assert!(
                !page.contains("gpushare_memory_allocation_wait_seconds_count 0\n"),
                "{page}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/metrics did not show the swap within 5 s:\n{page}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The scheduler stopped (`SIGSTOP`) while a connected fail-open process allocates 256 MiB of a
/// 1 GiB cap: the reservation waits at most the liveness bound (the default quota plus grace,
/// 40 ms) and the process decides alone; once the scheduler runs again the process states what
/// it holds, so the books count the 256 MiB exactly once (the reservation the scheduler read
/// late is not counted twice), and nothing after the free.
#[test]
fn an_allocation_while_the_scheduler_is_stopped_is_charged_once_it_answers() {
    const LIVENESS_NS: u64 = 40_000_000;
    let (node, exe) = node_with("mem_tool");
    let bytes = 256 * MIB;
    let mut cmd = in_group(
        &node,
        "stall",
        Some("1GiB"),
        &exe,
        &["hold-later", &bytes.to_string()],
    );
    cmd.env("GPUSHARE_FAIL", "open");
    let mut p = Proc::spawn(cmd);
    let ready = p.expect_json("ready", RUN);
    assert_eq!(
        u(&ready, "free"),
        GIB,
        "connected, and told the cap: {ready}"
    );
    let sched = node.scheduler_pid().expect("a scheduler runs") as libc::pid_t;
    // (The group is listed once it holds memory.)
    let used = || {
        node.status_group("stall")
            .map_or(0, |g| u(&g, "memory_used"))
    };
    assert_eq!(used(), 0, "nothing held before the allocation");
    // SAFETY: plain syscalls on the scheduler, our own child.
    unsafe { libc::kill(sched, libc::SIGSTOP) };
    p.signal(libc::SIGUSR1);
    let held = p.expect_json("held", Duration::from_secs(10));
    unsafe { libc::kill(sched, libc::SIGCONT) };
    let took = u(&held, "t_ns") - u(&held, "t_start_ns");
    // The books settle once the scheduler has read the reservation and the statement after it.
    let deadline = Instant::now() + Duration::from_secs(5);
    while used() != bytes && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let settled = used();
    eprintln!(
        "allocation with the scheduler stopped: {:.1} ms; then the books hold {settled} (of {bytes})",
        took as f64 / 1e6
    );
    assert!(
        took <= LIVENESS_NS + gpushare_testkit::margins::RECOVERY_NS,
        "the allocation waited {:.1} ms for a stopped scheduler",
        took as f64 / 1e6
    );
    assert_eq!(
        settled, bytes,
        "the books count what the process allocated alone, once"
    );
    p.signal(libc::SIGUSR1);
    p.expect_json("freed", RUN);
    let deadline = Instant::now() + Duration::from_secs(5);
    while used() != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(used(), 0, "freed");
    let (status, stderr) = p.finish(RUN);
    assert!(status.is_some_and(|s| s.success()), "{stderr}");
}

/// Fail-open decides alone against what the scheduler last said: here another process of the
/// group took 900 MiB of the 1 GiB cap since, so the 256 MiB allocated while the scheduler is
/// stopped overrun the cap, and the scheduler, running again, refuses the reservation it reads
/// late. The process's statement of what it holds puts the overrun on the books all the same
/// (1,156 MiB used of 1,024): never a silent one.
#[test]
fn an_overrun_decided_alone_is_on_the_books() {
    let (node, exe) = node_with("mem_tool");
    let mut late = in_group(
        &node,
        "overrun",
        Some("1GiB"),
        &exe,
        &["hold-later", &(256 * MIB).to_string()],
    );
    late.env("GPUSHARE_FAIL", "open");
    let mut late = Proc::spawn(late);
    late.expect_json("ready", RUN);
    let mut other = Proc::spawn(in_group(
        &node,
        "overrun",
        Some("1GiB"),
        &exe,
        &["hold", &(900 * MIB).to_string()],
    ));
    other.expect_json("held", RUN);
    let sched = node.scheduler_pid().expect("a scheduler runs") as libc::pid_t;
    // SAFETY: plain syscalls on the scheduler, our own child.
    unsafe { libc::kill(sched, libc::SIGSTOP) };
    late.signal(libc::SIGUSR1);
    late.expect_json("held", Duration::from_secs(10));
    unsafe { libc::kill(sched, libc::SIGCONT) };
    let used = || {
        node.status_group("overrun")
            .map_or(0, |g| u(&g, "memory_used"))
    };
    let want = 1156 * MIB;
    let deadline = Instant::now() + Duration::from_secs(5);
    while used() != want && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let got = used();
    eprintln!(
        "an overrun decided alone: the books hold {} MiB of a 1024 MiB cap",
        got / MIB
    );
    assert_eq!(got, want, "the books hold both processes' allocations");
}
