//! The test kit's Python programs (`python/`) and the PyPI packages they need, installed by
//! `scripts/python-env` into virtual environments under the user's cache directory, one per
//! requirement set: the first run on a machine installs (torch 2.10.0, the newest on CUDA 12,
//! with its CUDA wheels: ~3.8 GB), later runs reuse it. `scripts/test` prepares them before the
//! timed tests.

use crate::harness::describe;
use std::path::{Path, PathBuf};
use std::process::Command;

/// PyTorch 2.10.0, the newest PyPI wheel built on CUDA 12.
pub const TORCH: &[&str] = &["torch==2.10.0", "numpy"];
/// cuBLAS alone, at the versions torch 2.10.0 pins (both environments share pip's cache).
pub const CUBLAS: &[&str] = &[
    "nvidia-cublas-cu12==12.8.4.1",
    "nvidia-cuda-runtime-cu12==12.8.90",
];

/// The Python of the virtual environment holding `reqs`, created by `scripts/python-env` if
/// this machine has none yet.
pub fn venv(name: &str, reqs: &[&str]) -> PathBuf {
    let tool = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/python-env");
    let out = Command::new(tool)
        .arg(name)
        .args(reqs)
        .output()
        .expect("run scripts/python-env");
    assert!(
        out.status.success(),
        "python-env {name}: {}",
        describe(&out)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// The Python with [`TORCH`].
pub fn torch() -> PathBuf {
    venv("torch", TORCH)
}

/// The program `python/NAME` of the test kit.
pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(name)
}
