//! Helpers shared by this package's integration tests.
#![allow(dead_code)] // each test binary uses a different subset

use gpushare_testkit::harness::{Sim, describe, json_lines, output_with_timeout};
use gpushare_testkit::trace::Trace;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

/// Serialises the timing-sensitive tests of one test binary: on a 2-core machine, tests running
/// alongside can stall a client's host thread for longer than the pad kernels hide.
pub fn timing_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Longest any single simulator run may take before it is killed.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// One test's simulator, client binary and scratch directory.
pub struct Env {
    pub sim: Sim,
    /// The `cudarc-client` binary of this package.
    pub client: PathBuf,
    pub tmp: tempfile::TempDir,
}

pub fn env() -> Env {
    Env {
        sim: Sim::locate(),
        client: PathBuf::from(env!("CARGO_BIN_EXE_cudarc-client")),
        tmp: tempfile::tempdir().expect("create a temporary directory"),
    }
}

impl Env {
    /// Where [`Env::run`] makes the device write its trace.
    pub fn trace_path(&self) -> PathBuf {
        self.tmp.path().join("trace.jsonl")
    }

    /// `gpushare-sim run --trace <tmp>/trace.jsonl SIM_ARGS... -- CMD...`, with a timeout.
    pub fn run<I, S>(&self, sim_args: &[&str], cmd: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let trace = self.trace_path();
        let mut args = vec!["--trace", trace.to_str().expect("UTF-8 temp path")];
        args.extend_from_slice(sim_args);
        output_with_timeout(self.sim.run(&args, cmd), RUN_TIMEOUT)
    }

    /// [`Env::run`], which must succeed.
    pub fn run_ok<I, S>(&self, sim_args: &[&str], cmd: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let out = self.run(sim_args, cmd);
        assert!(out.status.success(), "run failed\n{}", describe(&out));
        out
    }

    /// `cudarc-client ARGS...` on the simulator; must succeed and print one JSON object.
    pub fn client_json(&self, sim_args: &[&str], client_args: &[&str]) -> serde_json::Value {
        let mut cmd: Vec<&OsStr> = vec![self.client.as_os_str()];
        cmd.extend(client_args.iter().map(OsStr::new));
        let out = self.run_ok(sim_args, cmd);
        let mut lines = json_lines(&out.stdout);
        assert_eq!(lines.len(), 1, "expected one JSON line\n{}", describe(&out));
        lines.remove(0)
    }

    /// The trace of the last run.
    pub fn trace(&self) -> Trace {
        Trace::read(self.trace_path()).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Compile `c/NAME.c` into the scratch directory; see [`Sim::compile_c`].
    pub fn compile_c(&self, name: &str, link_libcuda: bool) -> PathBuf {
        let src = gpushare_testkit::harness::c_dir().join(format!("{name}.c"));
        let out = self.tmp.path().join(name);
        self.sim
            .compile_c(&src, &out, link_libcuda)
            .unwrap_or_else(|e| panic!("{e}"));
        out
    }
}

/// `v[key]` as f64, or a panic naming the key.
pub fn f64_field(v: &serde_json::Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("no number {key:?} in {v}"))
}

/// `v[key]` as u64, or a panic naming the key.
pub fn u64_field(v: &serde_json::Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no integer {key:?} in {v}"))
}

/// Assert `got` is within `tol` (relative) of `want`.
pub fn assert_near(got: f64, want: f64, tol: f64, what: &str) {
    assert!(
        (got - want).abs() <= tol * want,
        "{what}: {got} is not within {:.0}% of {want}",
        tol * 100.0
    );
}

/// Stringify a path for a shell command line.
pub fn sh_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}
