//! The hook is a guest that must stay correct across `fork`: a tenant forking mid-run (an idle
//! child, and a child that touches CUDA) finishes, its children exit cleanly and say nothing, and
//! the scheduler still serves the parent and another tenant afterwards.

use gpushare_testkit::harness::describe;
use gpushare_testkit::node::Node;
use std::time::Duration;

#[test]
fn a_tenant_that_forks_keeps_its_share_and_its_children_stay_quiet() {
    let node = Node::start(&[]);
    let forker = node.compile_c("fork_tenant.c", true);
    let mut cmd = node.tenant_command("forker", 0.5, 1.0, 1.0, &forker, &["400"]);
    cmd.env_remove("GPUSHARE_LOG");
    let forking = node.spawn(cmd);
    let other = node.spawn(node.tenant_command(
        "other",
        0.5,
        1.0,
        1.0,
        env!("CARGO_BIN_EXE_cudarc-client"),
        &[
            "spin",
            "--ms-per-kernel",
            "1",
            "--kernels",
            "400",
            "--sync-every",
            "10",
        ],
    ));
    let (out, killed) = forking.finish_within(Duration::from_secs(60));
    assert!(
        !killed && out.status.success(),
        "forking tenant: {}",
        describe(&out)
    );
    assert!(
        out.stderr.is_empty(),
        "the hook printed something: {}",
        describe(&out)
    );
    let (o2, killed2) = other.finish_within(Duration::from_secs(60));
    assert!(
        !killed2 && o2.status.success(),
        "other tenant: {}",
        describe(&o2)
    );
    let trace = node.finish();
    let kernels = trace
        .records()
        .iter()
        .filter(|r| !r.preempted && r.kernel == "gpushare_spin")
        .count();
    assert!(kernels >= 800, "both tenants' 800 kernels ran: {kernels}");
}
