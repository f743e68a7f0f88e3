//! End to end: how `libgpushare.so` meets the driver's ABI and the process around it — which
//! UUID keys a GPU, which pointer `cuGetProcAddress` hands back, `dlsym(RTLD_NEXT, …)` from
//! another interposer, and a process exiting with work queued — on the simulated driver.

use gpushare_testkit::harness::{
    Sim, c_dir, describe, json_lines, output_with_timeout, target_dir,
};
use gpushare_testkit::node::{Node, Spin};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Longest any tenant of these tests may run.
const TIMEOUT: Duration = Duration::from_secs(60);

/// How often the simulated driver's call trace (`GPUSHARE_SIM_TRACE`) in `stderr` shows `name`.
fn traced_calls(stderr: &str, name: &str) -> usize {
    let prefix = format!("gpushare-sim libcuda: {name} -> ");
    stderr.lines().filter(|l| l.starts_with(&prefix)).count()
}

/// The hook keys each GPU by `cuDeviceGetUuid_v2` (a MIG instance's own UUID, as `nvidia-smi -L`
/// and `CUDA_VISIBLE_DEVICES` name it), not v1 (the instance's parent GPU's): the driver's call
/// trace of a tenant that never asks for a UUID itself shows the hook's v2 call and no v1 call.
#[test]
fn gpus_are_keyed_by_the_v2_uuid() {
    let node = Node::start(&[]);
    let exe = node.compile_c("spin_procaddr.c", false);
    let mut cmd = node.tenant_command("uuid", 1.0, 1.0, 1.0, &exe, &["0.1", "5", "0"]);
    cmd.env("GPUSHARE_SIM_TRACE", "1");
    let out = node.spawn(cmd).wait_ok(TIMEOUT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        traced_calls(&stderr, "cuLaunchKernel") == 5,
        "the tenant's launches are not in the trace\n{}",
        describe(&out)
    );
    assert!(
        traced_calls(&stderr, "cuDeviceGetUuid_v2") >= 1,
        "the hook never asked for cuDeviceGetUuid_v2\n{}",
        describe(&out)
    );
    assert_eq!(
        traced_calls(&stderr, "cuDeviceGetUuid"),
        0,
        "the hook asked for the v1 UUID\n{}",
        describe(&out)
    );
}

/// `cuGetProcAddress` hands out the hook's wrapper only for the pointer of the exact symbol
/// variant it wraps, and leaves any other pointer as the driver gave it. Here the simulated
/// driver answers `cuMemAlloc` and `cuLaunchKernel` asked for at CUDA 13.0 with a variant newer
/// than the 12.9 table (`GPUSHARE_SIM_NEWER_ABI`), as a newer driver would: the hook must not
/// hand out its wrapper of the 12.9 variant for it (it did: it chose by name and version), and
/// says so under `GPUSHARE_LOG`, only then.
#[test]
fn proc_address_wrappers_are_chosen_by_the_pointer_returned() {
    let node = Node::device_only();
    let exe = node.compile_c("procaddr_variants.c", false);
    let lookups = [
        ("cuMemAlloc@3020/0", "cuMemAlloc_v2@libgpushare.so"),
        (
            "cuLaunchKernel@12000/2",
            "cuLaunchKernel_ptsz@libgpushare.so",
        ),
        ("cuLaunchKernel@4000/0", "cuLaunchKernel@libgpushare.so"),
        (
            "cuGetProcAddress@12000/0",
            "cuGetProcAddress_v2@libgpushare.so",
        ),
        ("cuInit@2000/0", "cuInit@libcuda.so.1"),
        // Newer than the hook knows: the simulated driver's stand-in, at no exported symbol.
        ("cuMemAlloc@13000/0", "?@libcuda.so.1"),
        ("cuLaunchKernel@13000/2", "?@libcuda.so.1"),
    ];
    for log in [false, true] {
        let mut cmd = node.command(&exe);
        cmd.args(lookups.iter().map(|(arg, _)| arg))
            .env("LD_PRELOAD", target_dir().join("libgpushare.so"))
            .env("GPUSHARE_SIM_NEWER_ABI", "cuMemAlloc,cuLaunchKernel");
        if log {
            cmd.env("GPUSHARE_LOG", "1");
        } else {
            cmd.env_remove("GPUSHARE_LOG");
        }
        let out = output_with_timeout(cmd, TIMEOUT);
        assert!(out.status.success(), "{}", describe(&out));
        let got = json_lines(&out.stdout).pop().expect("one JSON line");
        for (arg, want) in lookups {
            assert_eq!(got[arg], want, "{arg}\n{}", describe(&out));
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !log {
            assert!(
                stderr.is_empty(),
                "output without GPUSHARE_LOG\n{}",
                describe(&out)
            );
            continue;
        }
        for said in [
            "cuGetProcAddress(cuMemAlloc, 13000, flags 0)",
            "cuGetProcAddress(cuLaunchKernel, 13000, flags 2)",
        ] {
            assert!(
                stderr
                    .lines()
                    .any(|l| l.contains(said) && l.contains("left unmanaged")),
                "the hook did not say it left {said} alone\n{}",
                describe(&out)
            );
        }
    }
}

/// `c/rtld_next_interposer.c` built as `librtld_next_TAG.so` in `dir`.
fn interposer(dir: &Path, tag: &str) -> PathBuf {
    let out = dir.join(format!("librtld_next_{tag}.so"));
    let gcc = Command::new("gcc")
        .args([
            "-std=gnu11",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-shared",
            "-fPIC",
        ])
        .arg(format!("-DTAG=\"{tag}\""))
        .arg(c_dir().join("rtld_next_interposer.c"))
        .arg("-o")
        .arg(&out)
        .arg("-ldl")
        .output()
        .expect("run gcc");
    assert!(gcc.status.success(), "gcc\n{}", describe(&gcc));
    out
}

/// A library preloaded before or after `libgpushare.so` that interposes a libc function and
/// finds the definition it wraps with `dlsym(RTLD_NEXT, …)` reaches the next definition after
/// *itself* — not itself (an endless recursion), as it did when the hook's `dlsym` asked glibc
/// on its own behalf, which made "next" relative to `libgpushare.so`. Chained interposers reach
/// each other in order. `RTLD_NEXT` lookups of a wrapped `cu*` symbol still get the hook's
/// wrapper.
#[test]
fn rtld_next_is_relative_to_the_interposer_that_asks() {
    let tmp = tempfile::tempdir().expect("temporary directory");
    let main = tmp.path().join("getpid_main");
    Sim::locate()
        .compile_c(&c_dir().join("getpid_main.c"), &main, false)
        .unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = (interposer(tmp.path(), "a"), interposer(tmp.path(), "b"));
    let hook = target_dir().join("libgpushare.so");
    let next = |tag: &str, to: &str| {
        format!("interposer {tag}: next getpid in {to}, next cuLaunchKernel in libgpushare.so")
    };
    let cases: [(Vec<&Path>, Vec<String>); 4] = [
        (vec![&hook, &a], vec![next("a", "libc.so.6")]),
        (vec![&a, &hook], vec![next("a", "libc.so.6")]),
        (
            vec![&hook, &a, &b],
            vec![next("a", "librtld_next_b.so"), next("b", "libc.so.6")],
        ),
        (
            vec![&a, &hook, &b],
            vec![next("a", "librtld_next_b.so"), next("b", "libc.so.6")],
        ),
    ];
    for (preload, want) in cases {
        let preload: Vec<String> = preload.iter().map(|p| p.display().to_string()).collect();
        let mut cmd = Command::new(&main);
        cmd.env("LD_PRELOAD", preload.join(" "))
            .env_remove("GPUSHARE_LOG");
        let out = output_with_timeout(cmd, TIMEOUT);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let said: Vec<&str> = stderr.lines().collect();
        assert_eq!(
            said,
            want,
            "LD_PRELOAD={}\n{}",
            preload.join(" "),
            describe(&out)
        );
        assert!(
            out.status.success(),
            "LD_PRELOAD={}: getpid() through the interposers is not the pid\n{}",
            preload.join(" "),
            describe(&out)
        );
    }
}

/// The hook's driver calls the simulated driver's call trace shows after the driver's teardown
/// at exit (each answered `CUDA_ERROR_DEINITIALIZED`; on a real driver such a call may crash).
fn calls_after_teardown(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .skip_while(|l| !l.contains("gpushare-sim libcuda: torn down at exit"))
        .filter(|l| l.starts_with("gpushare-sim libcuda: cu"))
        .collect()
}

/// A tenant that leaves (returning from `main`, or calling `exit`) while its kernels are queued
/// under its turn exits cleanly, and the hook's own threads make no driver call once the driver
/// has torn down at exit: the hook's exit handler, registered after the driver's, runs before
/// it and stops them. The tenant lingers 200 ms in an exit handler of its own after the
/// driver's teardown (see `c/exit_queued.c`), while another tenant wants the GPU, so turns end
/// and the hook's threads would drain (they did, into the torn-down driver, before). Repeated,
/// since which thread does what at exit is a race.
#[test]
fn a_tenant_exiting_with_work_queued_leaves_the_driver_alone_after_its_teardown() {
    let node = Node::start(&[]);
    let exe = node.compile_c("exit_queued.c", true);
    // Wants the GPU throughout; killed when the test is done.
    let spin = Spin::for_ms(1.0, 60_000.0).sync_every(Some(10));
    let mut other = node.tenant_command(
        "other",
        0.5,
        1.0,
        1.0,
        env!("CARGO_BIN_EXE_cudarc-client"),
        &spin.args(),
    );
    other.env_remove("GPUSHARE_LOG");
    let other = node.spawn(other);
    for run in 0..6 {
        let how = if run % 2 == 0 { "return" } else { "exit" };
        let mut cmd = node.tenant_command("leaver", 0.5, 1.0, 1.0, &exe, &["1", "40", "200", how]);
        cmd.env("GPUSHARE_SIM_TRACE", "1")
            .env_remove("GPUSHARE_LOG");
        let out = node.spawn(cmd).wait_ok(TIMEOUT);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("gpushare-sim libcuda: torn down at exit"),
            "run {run} ({how}): no teardown in the trace\n{}",
            describe(&out)
        );
        let late = calls_after_teardown(&stderr);
        assert!(
            late.is_empty(),
            "run {run} ({how}): driver calls after its teardown: {late:?}\n{}",
            describe(&out)
        );
    }
    drop(other);
}
