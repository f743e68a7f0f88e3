//! End to end: how `libgpushare.so` meets the driver's ABI and the process around it — which
//! UUID keys a GPU, which pointer `cuGetProcAddress` hands back, `dlsym(RTLD_NEXT, …)` from
//! another interposer, and a process exiting with work queued — on the simulated driver.

use gpushare_testkit::harness::describe;
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
