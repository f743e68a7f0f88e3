//! `gpushare-bench run` on a small scenario, end to end on the simulated GPU (needs the
//! workspace binaries: `cargo build --workspace --bins --lib`).

use serde_json::Value;
use std::process::Command;

const SCENARIO: &str = r#"
name = "e2e-small"
description = "Two training loops, requests 0.6 / 0.2."
duration = "2500ms"

[[tenant]]
name = "big"
workload = "train"
request = 0.6

[[tenant]]
name = "small"
workload = "train"
request = 0.2
"#;

fn in_unit(v: &Value) -> bool {
    v.as_f64().is_some_and(|x| (0.0..=1.0).contains(&x))
}

#[test]
fn small_scenario_end_to_end() {
    let dir = std::env::temp_dir().join(format!("gpushare-bench-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let scenario = dir.join("e2e-small.toml");
    std::fs::write(&scenario, SCENARIO).unwrap();
    let out_dir = dir.join("out");
    let out = Command::new(env!("CARGO_BIN_EXE_gpushare-bench"))
        .arg("run")
        .arg(&scenario)
        .arg("--out")
        .arg(&out_dir)
        .output()
        .expect("run gpushare-bench");
    assert!(
        out.status.success(),
        "gpushare-bench failed ({}); build the workspace first (cargo build --workspace --bins --lib)\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("summary.json")).unwrap()).unwrap();
    let scenarios = summary["scenarios"].as_array().expect("scenarios[]");
    assert_eq!(scenarios.len(), 1);
    let sc = &scenarios[0];
    assert_eq!(sc["name"], "e2e-small");
    let tenants = sc["tenants"].as_array().expect("tenants[]");
    assert_eq!(tenants.len(), 2);
    let mut target_sum = 0.0;
    for t in tenants {
        for k in [
            "name",
            "request",
            "limit",
            "target_share",
            "achieved_share",
            "abs_error",
        ] {
            assert!(!t[k].is_null(), "tenant field {k} missing: {t}");
        }
        for k in [
            "target_share",
            "achieved_share",
            "abs_error",
            "baseline_achieved_share",
        ] {
            assert!(in_unit(&t[k]), "{k} = {} not in [0, 1]", t[k]);
        }
        // Both tenants really ran.
        assert!(t["achieved_share"].as_f64().unwrap() > 0.05, "{t}");
        // Alone, the same workload runs faster than when sharing the GPU.
        assert!(
            t["alone_kernels_per_s"].as_f64().is_some_and(|x| x > 0.0),
            "{t}"
        );
        assert!(
            t["throughput_vs_alone"]
                .as_f64()
                .is_some_and(|x| x > 0.0 && x < 1.0),
            "{t}"
        );
        target_sum += t["target_share"].as_f64().unwrap();
    }
    assert!(
        target_sum <= 1.0 + 1e-9,
        "target shares sum to {target_sum}"
    );
    for k in ["max_abs_error", "device_utilization"] {
        assert!(in_unit(&sc[k]), "{k} = {} not in [0, 1]", sc[k]);
        assert!(
            in_unit(&sc["baseline"][k]),
            "baseline {k} = {}",
            sc["baseline"][k]
        );
    }
    assert!(sc["handoff_p99_us"].as_f64().is_some_and(|x| x >= 0.0));
    assert!(
        sc["scheduler_cpu_percent"]
            .as_f64()
            .is_some_and(|x| (0.0..=200.0).contains(&x)),
        "scheduler_cpu_percent = {}",
        sc["scheduler_cpu_percent"]
    );
    assert!(sc["device_utilization"].as_f64().unwrap() > 0.5);
    assert!(summary.get("launch_overhead").is_some());
    assert!(out_dir.join("summary.md").is_file());
    let svg = std::fs::read_to_string(out_dir.join("e2e-small.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
    let _ = std::fs::remove_dir_all(&dir);
}
