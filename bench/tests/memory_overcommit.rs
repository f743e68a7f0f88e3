//! The `memory-overcommit` scenario, small (a 4 GiB simulated GPU, caps of 2 GiB overcommitted
//! 2x, peaks 1.75x the GPU), through the real hook, scheduler and simulated driver (needs the
//! workspace binaries: `cargo build --workspace --bins --lib`).

use gpushare_bench::memory::{Mode, Params, run};

#[test]
fn overcommitted_phase_tenants_all_finish_without_oom_and_keep_their_bytes() {
    let dir = tempfile::tempdir().expect("scratch directory");
    let p = Params::small();
    let r = run(&p, Mode::Overcommit, dir.path(), "overcommit").expect("the run");
    let log =
        std::fs::read_to_string(dir.path().join("overcommit.scheduler.log")).unwrap_or_default();
    assert_eq!(r.ooms(), 0, "{r:#?}\n--- scheduler ---\n{log}");
    assert!(r.all_finished(), "{r:#?}\n--- scheduler ---\n{log}");
    assert!(r.all_intact(), "{r:#?}");
    assert!(
        r.swap_outs >= 1,
        "peaks 1.75x the GPU without a swap: {r:#?}"
    );
    assert_eq!(r.swap_out_failures + r.swap_in_failures, 0, "{r:#?}");
    assert_eq!(r.allocations_refused, 0, "{r:#?}");
    // Swapped groups come back: every swap out was followed by a restore (all finished).
    assert_eq!(r.swap_ins, r.swap_outs, "{r:#?}");
    assert!(r.swapped_bytes > 0, "{r:#?}");
}

/// The same tenants under static caps of a quarter of the GPU each: their peaks do not fit
/// their caps, and they fail with out-of-memory errors.
#[test]
fn static_caps_that_split_the_gpu_fail_the_peaks() {
    let dir = tempfile::tempdir().expect("scratch directory");
    let r = run(&Params::small(), Mode::StaticCaps, dir.path(), "static").expect("the run");
    assert_eq!(r.ooms(), 4, "every tenant peaks past 1 GiB: {r:#?}");
    assert_eq!(r.swap_outs, 0, "{r:#?}");
}
