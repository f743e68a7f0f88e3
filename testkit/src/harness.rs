//! Find the built simulator and run client programs on it.
//!
//! Tests and benchmarks do not build the simulator themselves: `gpushare-sim` and `libcuda.so`
//! must already be in the target directory the running executable lives in (`cargo build
//! --workspace`, which `scripts/test` runs first). [`Sim::locate`] finds them there and fails
//! with [`BUILD_HINT`] otherwise.
//!
//! ```no_run
//! use gpushare_testkit::harness::Sim;
//!
//! let sim = Sim::locate();
//! let out = sim.run(&["--gpus", "2"], ["sh", "-c", "exit 3"]).output().unwrap();
//! assert_eq!(out.status.code(), Some(3));
//! ```

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// What to do when the simulator has not been built.
pub const BUILD_HINT: &str = "run `cargo build --workspace` first (scripts/test does this)";

/// The cargo target profile directory (e.g. `target/debug`) of the running executable.
///
/// Test executables live in `target/debug/deps/`, benchmarks and examples one level down too;
/// plain binaries in `target/debug/` itself.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("cannot locate the running executable");
    let mut dir = exe
        .parent()
        .expect("executable has a directory")
        .to_path_buf();
    if matches!(
        dir.file_name().and_then(OsStr::to_str),
        Some("deps" | "examples")
    ) {
        dir.pop();
    }
    dir
}

/// The programs and libraries a test's processes run: the target directory's own, or copies of
/// some of them that every user may run. Processes of other users (tenants and jobs run as
/// test accounts) cannot reach the target directory when the checkout is private to its owner,
/// as a clone under `/root` (mode 0700) is; they run the copies, which live in a fresh
/// directory of the system's temporary directory, removed with this value.
#[derive(Debug)]
pub struct Programs {
    dir: PathBuf,
    /// The copies' directory, with the names copied into it.
    copies: Option<(tempfile::TempDir, Vec<String>)>,
}

impl Programs {
    /// The target directory's programs, for processes of the test's own user.
    pub fn own() -> Programs {
        Programs {
            dir: target_dir(),
            copies: None,
        }
    }

    /// Copies of `names` (files of the target directory, e.g. `gpushare`, `libgpushare.so`) that
    /// every user may read and run.
    pub fn for_every_user(names: &[&str]) -> Programs {
        use std::os::unix::fs::PermissionsExt;
        let copies = tempfile::Builder::new()
            .prefix("gpushare-programs-")
            .tempdir_in(std::env::temp_dir())
            .expect("create a directory for the programs other users run");
        let every_user = |p: &Path| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))
                .unwrap_or_else(|e| panic!("cannot open {} to every user: {e}", p.display()))
        };
        every_user(copies.path());
        let from = target_dir();
        for name in names {
            let (src, dst) = (from.join(name), copies.path().join(name));
            std::fs::copy(&src, &dst)
                .unwrap_or_else(|e| panic!("cannot copy {}: {e} ({BUILD_HINT})", src.display()));
            every_user(&dst);
        }
        Programs {
            dir: copies.path().to_path_buf(),
            copies: Some((copies, names.iter().map(|n| n.to_string()).collect())),
        }
    }

    /// The copy of `name`, if it is one of the copies for every user.
    pub fn copied(&self, name: &str) -> Option<PathBuf> {
        let (_, names) = self.copies.as_ref()?;
        names.iter().any(|n| n == name).then(|| self.dir.join(name))
    }

    /// The path of program (or library) `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        if let Some((_, names)) = &self.copies {
            assert!(
                names.iter().any(|n| n == name),
                "{name} is not among the programs copied for every user ({names:?})"
            );
        }
        self.dir.join(name)
    }
}

/// The built simulator.
#[derive(Debug, Clone)]
pub struct Sim {
    /// The `gpushare-sim` launcher.
    pub bin: PathBuf,
    /// The simulated driver, `libcuda.so`.
    pub libcuda: PathBuf,
}

impl Sim {
    /// Find `gpushare-sim` and `libcuda.so` in [`target_dir`], or explain what is missing.
    pub fn try_locate() -> Result<Sim, String> {
        let dir = target_dir();
        let sim = Sim {
            bin: dir.join("gpushare-sim"),
            libcuda: dir.join("libcuda.so"),
        };
        for p in [&sim.bin, &sim.libcuda] {
            if !p.is_file() {
                return Err(format!("{} is missing: {BUILD_HINT}", p.display()));
            }
        }
        Ok(sim)
    }

    /// [`try_locate`](Sim::try_locate), panicking with [`BUILD_HINT`] if the simulator is not built.
    pub fn locate() -> Sim {
        Sim::try_locate().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Directory holding `libcuda.so`, for linking C clients (`-L`).
    pub fn lib_dir(&self) -> &Path {
        self.libcuda.parent().expect("libcuda.so has a directory")
    }

    /// `gpushare-sim run SIM_ARGS... -- CMD...`, ready to spawn.
    pub fn run<I, S>(&self, sim_args: &[&str], cmd: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut c = Command::new(&self.bin);
        c.arg("run").args(sim_args).arg("--").args(cmd);
        c
    }

    /// Compile a C client with gcc (warnings are errors). With `link_libcuda` it is linked
    /// against the simulated `libcuda.so` (found at run time through `gpushare-sim run`'s
    /// `LD_LIBRARY_PATH`), otherwise against `libdl` only. The directory of `source` and
    /// [`c_dir`] are on the include path.
    pub fn compile_c(&self, source: &Path, out: &Path, link_libcuda: bool) -> Result<(), String> {
        let mut gcc = Command::new("gcc");
        gcc.args(["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror"])
            .arg("-I")
            .arg(source.parent().unwrap_or(Path::new(".")))
            .arg("-I")
            .arg(c_dir())
            .arg(source)
            .arg("-o")
            .arg(out);
        if link_libcuda {
            gcc.arg("-L").arg(self.lib_dir()).arg("-lcuda");
        }
        gcc.arg("-ldl");
        let output = gcc.output().map_err(|e| format!("cannot run gcc: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "gcc {} failed ({}):\n{}",
                source.display(),
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        Ok(())
    }
}

/// The C clients' sources (`testkit/c`).
pub fn c_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("c")
}

/// Human-readable exit status, stdout and stderr of a finished command, for assertion messages.
pub fn describe(output: &Output) -> String {
    format!(
        "status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Every line of `stdout` that parses as a JSON object, in order.
pub fn json_lines(stdout: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok())
        .filter(|v| v.is_object())
        .collect()
}

/// Run `cmd` to completion in a process group of its own, collecting stdout and stderr. If it is
/// still running after `timeout`, the whole group (e.g. `gpushare-sim` and the clients it
/// started) is killed and this panics with what was printed so far.
pub fn output_with_timeout(mut cmd: Command, timeout: Duration) -> Output {
    use std::io::Read;
    use std::os::unix::process::CommandExt;

    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", cmd.get_program()));
    let reader = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = pipe.read_to_end(&mut buf);
            buf
        })
    };
    let out = reader(Box::new(child.stdout.take().expect("piped stdout")));
    let err = reader(Box::new(child.stderr.take().expect("piped stderr")));
    let deadline = Instant::now() + timeout;
    let (status, timed_out) = loop {
        match child.try_wait().expect("wait for child") {
            Some(status) => break (status, false),
            None if Instant::now() >= deadline => {
                // SAFETY: plain syscall; the group is the one this function created (pgid = pid).
                unsafe { libc::killpg(child.id() as libc::pid_t, libc::SIGKILL) };
                break (child.wait().expect("wait for killed child"), true);
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    let output = Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    };
    if timed_out {
        panic!(
            "{:?} did not finish within {timeout:?}; killed\n{}",
            cmd.get_program(),
            describe(&output)
        );
    }
    output
}
