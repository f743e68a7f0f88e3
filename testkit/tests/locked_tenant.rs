//! A tenant that the driver holds locked (`cuCheckpointProcessLock`, what a swap to host memory
//! begins with: docs/memory-overcommit.md) while it holds a turn with work queued, through the
//! real hook and daemon on the simulated GPU. A locked process's CUDA calls block until it is
//! unlocked, the hook's own too (its questions about its fence events); the hook makes none of
//! them under its gate's lock, so its connection thread goes on taking in what the scheduler
//! says (a deadline cut short, a revocation, the answer to a probe) while the process is locked,
//! and the process rejoins the schedule as soon as it is unlocked.

use gpushare_testkit::harness::{json_lines, target_dir};
use gpushare_testkit::margins;
use gpushare_testkit::node::{Node, Spin, longest_without_kernel, monotonic_ns, shares_in};
use gpushare_testkit::trace::Window;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MS: u64 = 1_000_000;
/// How long the victim is held locked.
const HOLD_MS: u64 = 4_000;
/// `CUprocessState` of a locked process.
const LOCKED: i64 = 1;

fn cudarc() -> std::path::PathBuf {
    target_dir().join("cudarc-client")
}

/// A child killed if the test fails before it exits.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Running {
    /// Wait at most `timeout` for it to exit; whether it exited successfully.
    fn wait_ok(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.0.try_wait().expect("wait") {
                return status.success();
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn num(v: &Value, key: &str) -> i64 {
    v[key]
        .as_i64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v}"))
}

/// The victim, busy alone on the GPU (1 ms kernels, its queue paced by fence events), holds a
/// turn with work queued when `checkpoint_tool hold` locks it for 4 s; then another group asks
/// for the GPU, and the scheduler cuts the victim's turn short and, with no report by its end
/// plus the grace (the victim cannot drain its work while locked), revokes it. The victim's hook
/// takes the revocation in while it is still locked (its `GPUSHARE_LOG` says so, read as it
/// comes), the other group runs its kernels meanwhile, and both finish.
#[test]
fn a_tenant_locked_by_the_driver_still_hears_the_scheduler() {
    let mut node = Node::device_only();
    node.scheduler_log_filter = "info".into();
    node.start_scheduler(&[]);
    let tool = node.compile_c("checkpoint_tool.c", true);
    let mut cmd = node.tenant_command(
        "victim",
        0.5,
        1.0,
        1.0,
        cudarc(),
        &Spin::for_ms(1.0, 8_000.0).args(),
    );
    cmd.env("GPUSHARE_FAIL", "open")
        .env("GPUSHARE_LOG", "debug")
        .stderr(Stdio::piped());
    let mut victim = Running(cmd.spawn().expect("start the victim"));
    let stderr = victim.0.stderr.take().expect("piped");
    let lines: Arc<Mutex<Vec<(u64, String)>>> = Arc::default();
    let reader = {
        let lines = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let at = monotonic_ns();
                lines.lock().expect("lines").push((at, line));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(1_500));

    let mut hold = node.command(&tool);
    hold.args(["hold", &victim.0.id().to_string(), &HOLD_MS.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut holder = Running(hold.spawn().expect("start checkpoint_tool"));
    let mut out = BufReader::new(holder.0.stdout.take().expect("piped"));
    let mut first = String::new();
    out.read_line(&mut first).expect("the lock's line");
    let lock: Value = serde_json::from_str(&first)
        .unwrap_or_else(|e| panic!("checkpoint_tool said {first:?}: {e}"));
    assert_eq!(
        (num(&lock, "result"), num(&lock, "state")),
        (0, LOCKED),
        "the victim locked: {lock}"
    );
    let locked_ns = num(&lock, "end_ns") as u64;

    let mut other = node.tenant_command(
        "other",
        0.5,
        1.0,
        1.0,
        cudarc(),
        &Spin::for_ms(1.0, 1_500.0).args(),
    );
    other.stderr(Stdio::null());
    let mut other = Running(other.spawn().expect("start the other tenant"));
    let other_pid = other.0.id();

    let mut rest = String::new();
    out.read_to_string(&mut rest)
        .expect("checkpoint_tool's output");
    assert!(
        holder.wait_ok(Duration::from_secs(30)),
        "checkpoint_tool hold failed: {first}{rest}"
    );
    let unlock = json_lines(rest.as_bytes())
        .into_iter()
        .find(|v| v["step"] == "unlock")
        .unwrap_or_else(|| panic!("no unlock step: {first}{rest}"));
    assert_eq!(num(&unlock, "result"), 0, "the unlock: {unlock}");
    let unlocking_ns =
        num(&unlock, "end_ns") as u64 - (unlock["ms"].as_f64().unwrap_or(0.0) * 1e6) as u64;
    assert!(
        other.wait_ok(Duration::from_secs(30)),
        "the other tenant failed"
    );
    let victim_pid = victim.0.id();
    assert!(
        victim.wait_ok(Duration::from_secs(60)),
        "the victim did not finish its work after the unlock"
    );
    reader.join().expect("stderr reader");
    let scheduler_log = node.scheduler_log();
    let trace = node.finish();
    let lines = lines.lock().expect("lines");
    let log: String = lines
        .iter()
        .map(|(at, l)| format!("{:+.3} s {l}\n", (*at as f64 - locked_ns as f64) / 1e9))
        .collect();
    let since_lock = |t: u64| (t as f64 - locked_ns as f64) / 1e9;
    let heard = lines.iter().find(|(at, l)| {
        *at > locked_ns && *at < unlocking_ns && l.contains("revoked by the scheduler")
    });
    assert!(
        heard.is_some(),
        "the victim's hook took in no revocation while it was locked (until {:+.3} s):\n{log}\n--- scheduler ---\n{scheduler_log}",
        since_lock(unlocking_ns),
    );

    // The other group had the GPU meanwhile, and the victim ran again once unlocked.
    let first_kernel = (trace.records().iter())
        .filter(|r| r.pid == other_pid)
        .map(|r| r.start_ns)
        .min()
        .expect("the other tenant ran kernels");
    let spell = Window::new(first_kernel, (first_kernel + 1_200 * MS).min(unlocking_ns));
    let gap = longest_without_kernel(&trace, other_pid, spell);
    eprintln!(
        "the other tenant's first kernel {:+.3} s after the lock, unlocked at {:+.3} s; over its first {:.2} s its share {:.3}, longest without a kernel {:.3} s",
        since_lock(first_kernel),
        since_lock(unlocking_ns),
        spell.len_ns() as f64 / 1e9,
        shares_in(&trace, &[other_pid], spell)[0],
        gap as f64 / 1e9,
    );
    assert!(
        gap <= margins::RECOVERY_NS,
        "the other tenant went {:.3} s without a kernel while the victim was locked",
        gap as f64 / 1e9
    );
    assert!(
        (trace.records().iter()).any(|r| r.pid == victim_pid && r.start_ns > unlocking_ns),
        "the victim ran no kernel after the unlock"
    );
}
