//! Conformance of the simulated driver's checkpoint API (`cuCheckpointProcessLock / Checkpoint
//! / Restore / Unlock / GetState / GetRestoreThreadId`) with NVIDIA's documentation of it
//! (CUDA Driver API, "CUDA Checkpointing", CUDA 12.8+), quoted in each test, and, where the
//! documentation is silent, with what the real driver answered on an H200 (driver
//! 580.159.04). A controlling process drives a target process it forks
//! (`c/checkpoint_tool.c`); every result code is the driver's.

use gpushare_testkit::harness::{Sim, c_dir, describe, json_lines, output_with_timeout};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Output;
use std::sync::OnceLock;
use std::time::Duration;

const MIB: u64 = 1 << 20;
/// `CUresult` values.
const SUCCESS: i64 = 0;
const OUT_OF_MEMORY: i64 = 2;
const NOT_INITIALIZED: i64 = 3;
const OPERATING_SYSTEM: i64 = 304;
const ILLEGAL_STATE: i64 = 401;
const NOT_READY: i64 = 600;
const NOT_SUPPORTED: i64 = 801;
/// `CUprocessState` values.
const RUNNING: i64 = 0;
const LOCKED: i64 = 1;
const CHECKPOINTED: i64 = 2;

fn tool() -> &'static PathBuf {
    static TOOL: OnceLock<PathBuf> = OnceLock::new();
    TOOL.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temporary directory").keep();
        let exe = dir.join("checkpoint_tool");
        Sim::locate()
            .compile_c(&c_dir().join("checkpoint_tool.c"), &exe, true)
            .unwrap_or_else(|e| panic!("{e}"));
        exe
    })
}

/// Run `checkpoint_tool ARGS…` on a simulated GPU of 1 GiB (with `sim_args`); its lines.
fn run(sim_args: &[&str], args: &[&str]) -> (Vec<Value>, Output) {
    let mut device = vec!["--memory", "1GiB"];
    device.extend(sim_args);
    let cmd = Sim::locate().run(
        &device,
        std::iter::once(tool().as_os_str()).chain(args.iter().map(|a| a.as_ref())),
    );
    let out = output_with_timeout(cmd, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "checkpoint_tool failed\n{}",
        describe(&out)
    );
    (json_lines(&out.stdout), out)
}

/// The line `key` = `name` (a controller's "step" or a target's "target").
fn line<'a>(lines: &'a [Value], key: &str, name: &str, out: &Output) -> &'a Value {
    lines
        .iter()
        .find(|v| v[key] == name)
        .unwrap_or_else(|| panic!("no line with {key} = {name}\n{}", describe(out)))
}

fn step<'a>(lines: &'a [Value], name: &str, out: &Output) -> &'a Value {
    line(lines, "step", name, out)
}

fn num(v: &Value, key: &str) -> i64 {
    v[key]
        .as_i64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v}"))
}

/// Step `name` returned `result` and left the target in `state`.
fn expect(lines: &[Value], name: &str, result: i64, state: i64, out: &Output) {
    let v = step(lines, name, out);
    assert_eq!(
        (num(v, "result"), num(v, "state")),
        (result, state),
        "{name}: (result, state after)\n{}",
        describe(out)
    );
}

/// "Lock the CUDA process specified by pid which will block further CUDA API calls." … "Unlocks
/// a process specified by pid allowing it to resume making CUDA API calls."
#[test]
fn a_locked_process_makes_no_call_until_it_is_unlocked() {
    let (lines, out) = run(&[], &["blocks", "300"]);
    expect(&lines, "lock", SUCCESS, LOCKED, &out);
    expect(&lines, "unlock", SUCCESS, RUNNING, &out);
    let call = line(&lines, "target", "call_returned", &out);
    let unlocked = num(step(&lines, "unlocked_at", &out), "unlocked_ns");
    assert_eq!(num(call, "result"), SUCCESS, "{}", describe(&out));
    assert!(
        num(call, "returned_ns") >= unlocked,
        "the call the target made while locked returned before the unlock\n{}",
        describe(&out)
    );
}

/// "If timeoutMs is specified and the timeout is reached the process will be left in the
/// RUNNING state upon return." The code is CUDA_ERROR_NOT_READY (the real driver's, one of the
/// codes the documentation lists). Without a timeout the lock waits for the work already
/// submitted (the real driver: a 2 s kernel's end).
#[test]
fn a_lock_that_times_out_leaves_the_process_running() {
    let (lines, out) = run(&[], &["timeout", "1000", "150"]);
    expect(&lines, "lock_timeout", NOT_READY, RUNNING, &out);
    assert!(
        step(&lines, "lock_timeout", &out)["ms"]
            .as_f64()
            .unwrap_or(0.0)
            >= 150.0,
        "gave up before its timeout\n{}",
        describe(&out)
    );
    expect(&lines, "lock_no_timeout", SUCCESS, LOCKED, &out);
    let kernel = line(&lines, "target", "kernel_done", &out);
    let kernel_end = num(kernel, "launched_ns") + 1_000_000_000;
    assert!(
        num(step(&lines, "lock_no_timeout", &out), "end_ns") >= kernel_end,
        "the lock returned before the target's submitted kernel could have ended\n{}",
        describe(&out)
    );
    expect(&lines, "unlock", SUCCESS, RUNNING, &out);
    let after = line(&lines, "target", "after_unlock", &out);
    assert_eq!(num(after, "result"), SUCCESS, "{}", describe(&out));
}

/// "Restores a CUDA process … from its last checkpoint", and the driver's own account of a
/// resume: "device memory is copied back to the GPU, and GPU memory mappings are restored at
/// their original addresses".
#[test]
fn checkpoint_then_restore_keeps_every_byte_at_its_address() {
    let (lines, out) = run(&[], &["states", &(64 * MIB).to_string()]);
    expect(&lines, "checkpoint", SUCCESS, CHECKPOINTED, &out);
    expect(&lines, "restore", SUCCESS, LOCKED, &out);
    expect(&lines, "unlock", SUCCESS, RUNNING, &out);
    let after = line(&lines, "target", "after", &out);
    let ready = line(&lines, "target", "ready", &out);
    assert_eq!(after["intact"], true, "bytes changed\n{}", describe(&out));
    assert_eq!(after["same_address"], true, "{}", describe(&out));
    assert_eq!(after["ptr"], ready["ptr"], "{}", describe(&out));
}

/// "The GPU memory contents will be brought into host memory and all underlying references
/// will be released": other processes see the memory free while it is checkpointed, and
/// taken again once restored.
#[test]
fn checkpointed_memory_is_free_for_other_processes() {
    let bytes = 64 * MIB;
    let (lines, out) = run(&[], &["states", &bytes.to_string()]);
    let free = |name| num(step(&lines, name, &out), "free") as u64;
    assert_eq!(
        free("free_checkpointed") - free("free_before"),
        bytes,
        "{}",
        describe(&out)
    );
    assert_eq!(
        free("free_restored"),
        free("free_before"),
        "{}",
        describe(&out)
    );
}

/// "Process must be in the RUNNING state in order to lock", "… in the LOCKED state to
/// checkpoint", "… in the CHECKPOINTED state to restore", "… in the LOCKED state" to unlock;
/// each call returns CUDA_ERROR_ILLEGAL_STATE otherwise (a listed code; the real driver's) and
/// changes nothing. "Returns in *state the current state" throughout.
#[test]
fn each_call_is_refused_in_the_wrong_state_and_changes_nothing() {
    let (lines, out) = run(&[], &["states", &MIB.to_string()]);
    for (name, state) in [
        ("checkpoint_running", RUNNING),
        ("restore_running", RUNNING),
        ("unlock_running", RUNNING),
        ("lock_locked", LOCKED),
        ("restore_locked", LOCKED),
        ("lock_checkpointed", CHECKPOINTED),
        ("checkpoint_checkpointed", CHECKPOINTED),
        ("unlock_checkpointed", CHECKPOINTED),
    ] {
        expect(&lines, name, ILLEGAL_STATE, state, &out);
    }
    expect(&lines, "lock", SUCCESS, LOCKED, &out);
    // "args - Optional lock operation arguments": a null pointer locks without a timeout.
    expect(&lines, "lock_null_args", SUCCESS, LOCKED, &out);
    expect(&lines, "unlock_after_null_lock", SUCCESS, RUNNING, &out);
}

/// "Returns in *tid the thread ID of the CUDA restore thread for the process": a thread of the
/// target (on the real driver one of its own, not its main thread), in any state. A process
/// that never initialised CUDA answers CUDA_ERROR_NOT_INITIALIZED, a process id naming no
/// process CUDA_ERROR_OPERATING_SYSTEM, a null out-pointer CUDA_ERROR_INVALID_VALUE (the real
/// driver's answers).
#[test]
fn state_and_restore_thread_queries() {
    let (lines, out) = run(&[], &["states", &MIB.to_string()]);
    let tid = step(&lines, "restore_tid_running", &out);
    assert_eq!(num(tid, "result"), SUCCESS, "{}", describe(&out));
    assert_eq!(tid["tid_in_target"], true, "{}", describe(&out));
    assert_eq!(tid["tid_is_main"], false, "{}", describe(&out));
    let tid = step(&lines, "restore_tid_checkpointed", &out);
    assert_eq!(tid["tid_in_target"], true, "{}", describe(&out));
    let code = |name| num(step(&lines, name, &out), "result");
    assert_eq!(
        code("get_state_no_cuda"),
        NOT_INITIALIZED,
        "{}",
        describe(&out)
    );
    assert_eq!(
        code("get_state_bad_pid"),
        OPERATING_SYSTEM,
        "{}",
        describe(&out)
    );
    assert_eq!(code("get_state_null"), 1, "{}", describe(&out));
}

/// The driver's checkpoint "does not support UVM" memory (NVIDIA's cuda-checkpoint
/// documentation, r570): on the real driver the checkpoint returns CUDA_ERROR_NOT_SUPPORTED,
/// releases nothing and leaves the process locked; unlocked, it runs on intact.
#[test]
fn a_process_holding_managed_memory_is_refused_and_stays_locked() {
    let (lines, out) = run(&[], &["managed", &MIB.to_string()]);
    assert_eq!(
        num(line(&lines, "target", "managed_alloc", &out), "result"),
        SUCCESS
    );
    expect(&lines, "checkpoint", NOT_SUPPORTED, LOCKED, &out);
    let free = |name| num(step(&lines, name, &out), "free");
    assert_eq!(
        free("free_after_checkpoint"),
        free("free_before"),
        "{}",
        describe(&out)
    );
    expect(&lines, "unlock", SUCCESS, RUNNING, &out);
    assert_eq!(
        line(&lines, "target", "after", &out)["intact"],
        true,
        "{}",
        describe(&out)
    );
}

/// A process that exported device memory (`cuIpcGetMemHandle`): the real driver (580.159.04,
/// H200) checkpointed and restored it like any other, and so does the simulator: its memory is
/// free while checkpointed and comes back, bytes and address.
#[test]
fn a_process_that_exported_ipc_memory_is_checkpointed_like_any_other() {
    let bytes = 64 * MIB;
    let (lines, out) = run(&[], &["ipc", &bytes.to_string()]);
    assert_eq!(
        num(line(&lines, "target", "ipc_export", &out), "result"),
        SUCCESS,
        "{}",
        describe(&out)
    );
    expect(&lines, "checkpoint", SUCCESS, CHECKPOINTED, &out);
    let free = |name| num(step(&lines, name, &out), "free");
    assert!(
        free("free_after_checkpoint") >= free("free_before") + bytes as i64,
        "{}",
        describe(&out)
    );
    expect(&lines, "restore", SUCCESS, LOCKED, &out);
    expect(&lines, "unlock", SUCCESS, RUNNING, &out);
    let after = line(&lines, "target", "after", &out);
    assert_eq!(after["intact"], true, "{}", describe(&out));
    assert_eq!(after["same_address"], true, "{}", describe(&out));
}

/// Pitched, stream-ordered (pool) and virtual-memory (`cuMemCreate` + `cuMemMap`) allocations
/// all come back, bytes and addresses, and all their memory is released while checkpointed.
#[test]
fn every_kind_of_device_allocation_comes_back() {
    let (lines, out) = run(&[], &["kinds", &(4 * MIB).to_string()]);
    expect(&lines, "checkpoint", SUCCESS, CHECKPOINTED, &out);
    let free = |name| num(step(&lines, name, &out), "free");
    assert_eq!(
        free("free_checkpointed"),
        1 << 30,
        "all released\n{}",
        describe(&out)
    );
    assert_eq!(
        free("free_restored"),
        free("free_before"),
        "{}",
        describe(&out)
    );
    for kind in ["pitched", "pooled", "vmm"] {
        let v = line(&lines, "target", kind, &out);
        assert_eq!(v["intact"], true, "{kind}\n{}", describe(&out));
        assert_eq!(v["same_address"], true, "{kind}\n{}", describe(&out));
    }
}

/// A restore needs the memory back: without room it fails with CUDA_ERROR_OUT_OF_MEMORY and
/// the process stays checkpointed. The real driver then refuses every later restore of that
/// process with CUDA_ERROR_OPERATING_SYSTEM, even once the memory is free; so does the
/// simulator, so that a controller is tested against it (restore only when the memory fits).
#[test]
fn a_restore_without_room_fails_and_leaves_the_process_checkpointed() {
    let (lines, out) = run(&[], &["restore-oom", &(64 * MIB).to_string()]);
    assert_eq!(num(step(&lines, "take", &out), "result"), SUCCESS);
    expect(&lines, "restore_no_room", OUT_OF_MEMORY, CHECKPOINTED, &out);
    expect(&lines, "restore", OPERATING_SYSTEM, CHECKPOINTED, &out);
}

/// Checkpoints and restores take the device's stated time: a fixed cost, then the bytes at the
/// rate of each direction (`--checkpoint-latency`, `--checkpoint-bandwidth`,
/// `--restore-bandwidth`).
#[test]
fn transfers_take_the_configured_time() {
    let bytes = 256 * MIB;
    let (lines, out) = run(
        &[
            "--checkpoint-latency",
            "50ms",
            "--checkpoint-bandwidth",
            "1GB/s",
            "--restore-bandwidth",
            "2GB/s",
        ],
        &["states", &bytes.to_string()],
    );
    let ms = |name| step(&lines, name, &out)["ms"].as_f64().unwrap_or(0.0);
    let at = |rate: f64| 50.0 + bytes as f64 / rate * 1e3;
    assert!(ms("checkpoint") >= at(1e9), "{}", describe(&out));
    assert!(ms("restore") >= at(2e9), "{}", describe(&out));
}
