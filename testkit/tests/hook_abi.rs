//! End to end: how `libgpushare.so` meets the driver's ABI and the process around it — which
//! UUID keys a GPU, which pointer `cuGetProcAddress` hands back, `dlsym(RTLD_NEXT, …)` from
//! another interposer, and a process exiting with work queued — on the simulated driver.

use gpushare_testkit::harness::{describe, json_lines, output_with_timeout, target_dir};
use gpushare_testkit::node::Node;
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
