//! Programs as users write them for CUDA 12 run unmodified on the simulated GPU, alone and under
//! gpushare: NVIDIA's runtime (`libcudart` 12.9 from PyPI, shared and static) in C programs
//! built with gcc; the CUDA 12 driver features JIT-ing frameworks use (libraries and `CUkernel`,
//! ptxas cubins, `cuLink*`, the stream-capture rules) against NVIDIA's own `cuda.h`; and
//! numba-cuda, CuPy and cuda.core with default settings. Tenants may be different Unix users.
//!
//! The setup installs what it needs into the `python3` on PATH, once (pip, idempotent):
//! `nvidia-cuda-runtime-cu12` (libcudart, headers), `nvidia-cuda-nvcc-cu12` (ptxas and the
//! `crt/` headers), `nvidia-cuda-nvrtc-cu12`, `numba-cuda`, `cupy-cuda12x`, `cuda-core`.
//! The simulated GPU times kernels without executing them: nothing here checks a value a kernel
//! computes. `scripts/conformance` runs numba's own driver test suite for more.

mod common;

use gpushare_testkit::harness::{Sim, describe, json_lines, output_with_timeout, target_dir};
use gpushare_testkit::node::{Node, Tenant, common_active_window, gaps_in, shares_in};
use gpushare_testkit::trace::Trace;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

/// The PyPI packages the programs here need, and a module each provides.
const PACKAGES: &[(&str, &str)] = &[
    ("nvidia-cuda-runtime-cu12==12.9.*", "nvidia.cuda_runtime"),
    ("nvidia-cuda-nvcc-cu12==12.9.*", "nvidia.cuda_nvcc"),
    ("nvidia-cuda-nvrtc-cu12==12.9.*", "nvidia.cuda_nvrtc"),
    ("numba-cuda", "numba.cuda"),
    ("cupy-cuda12x", "cupy"),
    ("cuda-core", "cuda.core"),
];

const TIMEOUT: Duration = Duration::from_secs(120);

/// Everything built for these tests: C programs, the spin kernel as PTX and as a ptxas cubin.
struct Clients {
    /// Scratch directory (searchable by every user), kept for the process.
    dir: tempfile::TempDir,
    runtime_shared: PathBuf,
    runtime_static: PathBuf,
    driver: PathBuf,
    /// Green contexts and IPC handles (`cuda12/sharing_client.c`).
    sharing: PathBuf,
    ptx: PathBuf,
    cubin: PathBuf,
    /// A cubin with other kernel names (`gpushare_spin2`, `touch2`), to link with the PTX.
    other_cubin: PathBuf,
}

fn python(code: &str) -> Output {
    Command::new("python3")
        .args(["-c", code])
        .output()
        .expect("python3 is needed: install Python 3")
}

/// Install the missing packages with pip (once per machine: later runs find them).
fn install_packages() {
    let find = |m: &str| {
        python(&format!(
            "import importlib.util as u, sys; sys.exit(u.find_spec({m:?}) is None)"
        ))
        .status
        .success()
    };
    let missing: Vec<&str> = PACKAGES
        .iter()
        .filter(|(_, m)| !find(m))
        .map(|(p, _)| *p)
        .collect();
    if missing.is_empty() {
        return;
    }
    let out = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet"])
        .args(&missing)
        .output()
        .expect("run pip");
    assert!(
        out.status.success(),
        "cannot install {missing:?} with pip: {}",
        describe(&out)
    );
}

/// Directory of an installed NVIDIA wheel's files (e.g. `nvidia.cuda_runtime`).
fn wheel_dir(module: &str) -> PathBuf {
    let out = python(&format!(
        "import importlib.util as u; print(list(u.find_spec({module:?}).submodule_search_locations)[0])"
    ));
    assert!(out.status.success(), "{module}: {}", describe(&out));
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn run_ok(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(out.status.success(), "{what} failed: {}", describe(&out));
}

fn gcc(src: &Path, out: &Path, include: &[PathBuf], link: &[&std::ffi::OsStr]) {
    let mut c = Command::new("gcc");
    c.args(["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror"]);
    for i in include {
        c.arg("-I").arg(i);
    }
    c.arg(src).arg("-o").arg(out).args(link);
    run_ok(&mut c, &format!("gcc {}", src.display()));
}

fn clients() -> &'static Clients {
    static CLIENTS: OnceLock<Clients> = OnceLock::new();
    CLIENTS.get_or_init(|| {
        install_packages();
        let sim = Sim::locate();
        let dir = tempfile::tempdir().unwrap();
        // Tenants of other users run these programs too.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR"));
        let (rt, nvcc) = (
            wheel_dir("nvidia.cuda_runtime"),
            wheel_dir("nvidia.cuda_nvcc"),
        );
        // cuda_runtime_api.h needs crt/host_defines.h, which the nvcc wheel carries.
        let include = [rt.join("include"), nvcc.join("include")];
        let rt_lib = rt.join("lib");
        let p = |n: &str| dir.path().join(n);
        let runtime_src = src.join("cuda12/runtime_client.c");
        let mut rpath = std::ffi::OsString::from("-Wl,-rpath,");
        rpath.push(&rt_lib);
        let mut lib_dir = std::ffi::OsString::from("-L");
        lib_dir.push(&rt_lib);
        gcc(
            &runtime_src,
            &p("runtime_shared"),
            &include,
            &[&lib_dir, "-l:libcudart.so.12".as_ref(), &rpath],
        );
        gcc(
            &runtime_src,
            &p("runtime_static"),
            &include,
            &[
                rt_lib.join("libcudart_static.a").as_os_str(),
                "-lpthread".as_ref(),
                "-ldl".as_ref(),
                "-lrt".as_ref(),
            ],
        );
        let mut sim_lib = std::ffi::OsString::from("-L");
        sim_lib.push(sim.lib_dir());
        gcc(
            &src.join("cuda12/driver_client.c"),
            &p("driver_client"),
            &include[..1],
            &[&sim_lib, "-lcuda".as_ref(), "-lpthread".as_ref()],
        );
        gcc(
            &src.join("cuda12/sharing_client.c"),
            &p("sharing_client"),
            &include[..1],
            &[&sim_lib, "-lcuda".as_ref()],
        );
        let ptx = p("gpushare_spin.ptx");
        std::fs::copy(src.join("ptx/gpushare_spin.ptx"), &ptx).unwrap();
        let other = std::fs::read_to_string(&ptx)
            .unwrap()
            .replace("gpushare_spin", "gpushare_spin2")
            .replace("touch", "touch2");
        std::fs::write(p("other.ptx"), other).unwrap();
        let ptxas = nvcc.join("bin/ptxas");
        for (from, to) in [
            ("gpushare_spin.ptx", "gpushare_spin.cubin"),
            ("other.ptx", "other.cubin"),
        ] {
            run_ok(
                Command::new(&ptxas)
                    .args(["-arch=sm_90"])
                    .arg(p(from))
                    .arg("-o")
                    .arg(p(to)),
                "ptxas",
            );
        }
        for f in std::fs::read_dir(dir.path()).unwrap() {
            let f = f.unwrap().path();
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        Clients {
            runtime_shared: p("runtime_shared"),
            runtime_static: p("runtime_static"),
            driver: p("driver_client"),
            sharing: p("sharing_client"),
            cubin: p("gpushare_spin.cubin"),
            other_cubin: p("other.cubin"),
            ptx,
            dir,
        }
    })
}

/// `gpushare-sim run --trace FILE -- CMD…`, which must succeed; its JSON lines and the trace.
fn on_sim(cmd: &[&std::ffi::OsStr]) -> (Vec<serde_json::Value>, Trace) {
    let c = clients();
    let trace = c
        .dir
        .path()
        .join(format!("trace-{}.jsonl", std::process::id()));
    let out = output_with_timeout(
        Sim::locate().run(&["--trace", trace.to_str().unwrap()], cmd),
        TIMEOUT,
    );
    assert!(out.status.success(), "{}", describe(&out));
    let t = Trace::read(&trace).unwrap();
    let _ = std::fs::remove_file(&trace);
    (json_lines(&out.stdout), t)
}

fn part<'a>(lines: &'a [serde_json::Value], name: &str) -> Vec<&'a serde_json::Value> {
    lines.iter().filter(|l| l["part"] == name).collect()
}

#[test]
fn libcudart_programs_run_unmodified() {
    let c = clients();
    for program in [&c.runtime_shared, &c.runtime_static] {
        let (lines, trace) = on_sim(&[
            program.as_os_str(),
            "check".as_ref(),
            c.ptx.as_os_str(),
            c.cubin.as_os_str(),
        ]);
        let q = part(&lines, "query")[0];
        assert_eq!(q["name"], "NVIDIA H100 80GB HBM3", "{q}");
        assert_eq!(q["cc"], "9.0");
        assert_eq!(q["sms"], 132);
        assert_eq!(q["total"], 80u64 << 30);
        assert_eq!(q["runtime"], 12090);
        assert_eq!(part(&lines, "round_trip")[0]["ok"], true);
        let events = part(&lines, "events");
        assert_eq!(events.len(), 2, "PTX and cubin: {lines:?}");
        for e in events {
            let ms = common::f64_field(e, "elapsed_ms");
            assert!(
                (ms - 10.0).abs() < 0.05,
                "a 10 ms kernel timed {ms} ms: {e}"
            );
        }
        let g = part(&lines, "graph")[0];
        let ms = common::f64_field(g, "elapsed_ms");
        assert!(
            (ms - 6.0).abs() < 0.05,
            "three 2 ms graph nodes took {ms} ms"
        );
        assert!(trace.overlaps().is_empty());
        let spins = trace
            .records()
            .iter()
            .filter(|r| r.kernel == "gpushare_spin");
        assert_eq!(
            spins.count(),
            2 + 2 + 1 + 3,
            "pads, timed kernels, graph nodes"
        );
    }
}

#[test]
fn cuda12_driver_features_work_with_the_real_header() {
    let c = clients();
    let (lines, _) = on_sim(&[
        c.driver.as_os_str(),
        "library".as_ref(),
        c.ptx.as_os_str(),
        c.cubin.as_os_str(),
    ]);
    assert_eq!(lines.len(), 2);
    for l in &lines {
        for path in ["launch", "launch_ex", "cooperative", "graph"] {
            let ms = common::f64_field(l, path);
            assert!(
                (1.99..2.3).contains(&ms),
                "a 2 ms CUkernel by {path}: {ms} ms ({l})"
            );
        }
    }
    let (lines, _) = on_sim(&[
        c.driver.as_os_str(),
        "link".as_ref(),
        c.ptx.as_os_str(),
        c.other_cubin.as_os_str(),
    ]);
    assert_eq!(lines[0]["linked_functions"], 4);
    let (lines, _) = on_sim(&[c.driver.as_os_str(), "capture".as_ref(), c.ptx.as_os_str()]);
    assert_eq!(lines[0]["capture_cases"], 13);
}

/// Green contexts follow cuda.h's documentation (`sharing_client green`: 42 checks, each
/// quoting the sentence it follows): resources, splits, descriptors, the green context and its
/// context, streams and events. PyTorch's driver table looks these entry points up.
#[test]
fn green_contexts_follow_the_driver_api() {
    let c = clients();
    let (lines, trace) = on_sim(&[c.sharing.as_os_str(), "green".as_ref()]);
    assert_eq!(lines[0]["checks"], 42, "{lines:?}");
    assert!(trace.overlaps().is_empty());
}

/// Interprocess handles follow cuda.h's documentation (`sharing_client ipc`): an allocation and
/// an event exported by one process and opened by another are the same memory and the same
/// event (the child's writes are in the parent's allocation; each waits for the other's
/// records), alone and under gpushare (where DataLoader workers of a capped job hand CUDA
/// tensors to their parent this way).
#[test]
fn ipc_handles_share_memory_and_events_between_processes() {
    let c = clients();
    let check = |lines: &[serde_json::Value]| {
        assert_eq!(lines[0]["checks"], 14, "{lines:?}");
        assert_eq!(lines[0]["child_checks"], 13, "{lines:?}");
    };
    let (lines, _) = on_sim(&[c.sharing.as_os_str(), "ipc".as_ref()]);
    check(&lines);
    let node = Node::start(&[]);
    let mut cmd = node.tenant_command("ipc", 0.5, 1.0, 1.0, &c.sharing, &["ipc"]);
    cmd.stdout(std::process::Stdio::piped());
    let out = Tenant::spawn(cmd).wait_ok(TIMEOUT);
    check(&json_lines(&out.stdout));
    assert!(node.finish().overlaps().is_empty());
}

fn frameworks_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python/frameworks.py")
}

/// `frameworks.py numba cupy cuda_core`'s three lines, checked: the numba kernel ran on the
/// H100, the CuPy and cuda.core 10 ms kernels were timed as 10 ms by events.
fn check_frameworks(lines: &[serde_json::Value]) {
    let by = |f: &str| {
        lines
            .iter()
            .find(|l| l["framework"] == f)
            .unwrap_or_else(|| panic!("no {f} line in {lines:?}"))
    };
    assert_eq!(by("numba")["device"], "NVIDIA H100 80GB HBM3");
    for f in ["cupy", "cuda_core"] {
        let ms = common::f64_field(by(f), "elapsed_ms");
        assert!(
            (ms - 10.0).abs() < 0.05,
            "{f}: a 10 ms kernel timed {ms} ms"
        );
    }
}

const FRAMEWORKS: [&str; 3] = ["numba", "cupy", "cuda_core"];

#[test]
fn python_frameworks_run_unmodified() {
    let script = frameworks_script();
    let mut cmd = vec!["python3".as_ref(), script.as_os_str()];
    cmd.extend(FRAMEWORKS.iter().map(std::ffi::OsStr::new));
    let (lines, trace) = on_sim(&cmd);
    check_frameworks(&lines);
    let count = |f: &dyn Fn(&str) -> bool| trace.records().iter().filter(|r| f(&r.kernel)).count();
    // numba mangles the Python function's name into its kernel's.
    assert_eq!(
        count(&|k| k.contains("scale")),
        10,
        "ten @cuda.jit launches"
    );
    assert!(
        count(&|k| k.starts_with("cupy_")) >= 2,
        "CuPy's elementwise and reduction kernels"
    );
    assert_eq!(
        count(&|k| k == "gpushare_spin"),
        2 + 2 + 2,
        "CuPy and cuda.core: pad and timed kernel each; cuda.core's two graph nodes"
    );
}

#[test]
fn frameworks_runtime_programs_and_cukernels_are_gated_under_gpushare() {
    let c = clients();
    let node = Node::start(&[]);
    let script = frameworks_script();
    let mut py_args = vec![script];
    py_args.extend(FRAMEWORKS.iter().map(PathBuf::from));
    let runs: [(&str, PathBuf, Vec<PathBuf>); 3] = [
        ("python", "python3".into(), py_args),
        (
            "cudart",
            c.runtime_shared.clone(),
            vec!["check".into(), c.ptx.clone(), c.cubin.clone()],
        ),
        // CUkernel handles on every launch path and in a graph node.
        (
            "cukernel",
            c.driver.clone(),
            vec!["library".into(), c.ptx.clone(), c.cubin.clone()],
        ),
    ];
    for (group, program, args) in runs {
        let mut cmd = node.tenant_command(group, 0.5, 1.0, 1.0, program, &args);
        cmd.stdout(std::process::Stdio::piped());
        let out = Tenant::spawn(cmd).wait_ok(TIMEOUT);
        if group == "python" {
            check_frameworks(&json_lines(&out.stdout));
        }
        let g = node
            .status_group(group)
            .unwrap_or_else(|| panic!("the scheduler never saw {group}"));
        assert!(
            g["tokens"].as_u64().unwrap_or(0) >= 1,
            "{group}'s launches were gated: {g}"
        );
    }
    assert!(node.finish().overlaps().is_empty());
}

/// Two `runtime_client spin` tenants (plain launches and captured-graph launches, 4 s) under
/// gpushare with `requests`, run to the end; then the node's trace and each one's share of
/// device time where both ran.
fn two_tenants(
    node: Node,
    program: &Path,
    users: Option<[u32; 2]>,
    requests: [f64; 2],
) -> (Trace, Vec<f64>) {
    let c = clients();
    let tenants: Vec<Tenant> = (0..2)
        .map(|i| {
            let mut cmd = node.tenant_command(
                &format!("t{i}"),
                requests[i],
                1.0,
                1.0,
                program,
                &[
                    "spin".as_ref(),
                    c.ptx.as_os_str(),
                    "1".as_ref(),
                    "4".as_ref(),
                ],
            );
            if let Some(u) = users {
                std::os::unix::process::CommandExt::uid(&mut cmd, u[i]);
            }
            Tenant::spawn(cmd)
        })
        .collect();
    let pids: Vec<u32> = tenants.iter().map(Tenant::pid).collect();
    for t in tenants {
        t.wait_ok(TIMEOUT);
    }
    let trace = node.finish();
    let w = common_active_window(&trace, &pids, 500_000_000);
    let s = shares_in(&trace, &pids, w);
    let busy: f64 = s.iter().sum();
    eprintln!(
        "shares {s:?} over {:.2} s (requests {requests:?}), of busy time {:?}; {}",
        w.len_ns() as f64 / 1e9,
        s.iter().map(|x| x / busy).collect::<Vec<_>>(),
        gaps_in(&trace, w).summary()
    );
    (trace, s)
}

/// The tenants split the device's busy time as requested (±0.05), and kept it busy (≥ 0.8).
/// Busy time, not wall time: these tenants synchronise every 40 ms of work, and on a loaded
/// 2-core machine their host threads then sometimes come late; a gate that failed to hold a
/// tenant's plain or graph launches gives native time-slicing's even split instead.
fn assert_split(shares: &[f64], requests: [f64; 2]) {
    let busy: f64 = shares.iter().sum();
    assert!(
        busy >= 0.8,
        "the GPU was busy only {busy:.3} of the time ({shares:?})"
    );
    for (got, want) in shares.iter().map(|s| s / busy).zip(requests) {
        assert!(
            (got - want).abs() <= 0.05,
            "{got:.3} of the busy time for a request of {want} (shares {shares:?})"
        );
    }
}

#[test]
fn two_libcudart_tenants_get_their_requests() {
    let _serial = common::timing_lock();
    let node = Node::start(&[]);
    let (trace, s) = two_tenants(node, &clients().runtime_shared, None, [0.7, 0.3]);
    assert_split(&s, [0.7, 0.3]);
    assert!(trace.overlaps().is_empty());
}

#[test]
fn a_capture_spanning_several_tokens_succeeds_under_gpushare() {
    let _serial = common::timing_lock();
    let c = clients();
    let node = Node::start(&[]);
    // A busy competitor, so the capturing process's tokens end and come back during the capture.
    let busy = Tenant::spawn(node.tenant_command(
        "busy",
        0.5,
        1.0,
        1.0,
        target_dir().join("cudarc-client"),
        &[
            "spin",
            "--ms-per-kernel",
            "1",
            "--sync-every",
            "20",
            "--duration-ms",
            "1500",
        ],
    ));
    let mut cmd = node.tenant_command(
        "capture",
        0.5,
        1.0,
        1.0,
        &c.driver,
        &["long-capture".as_ref(), c.ptx.as_os_str(), "1".as_ref()],
    );
    cmd.stdout(std::process::Stdio::piped());
    let out = Tenant::spawn(cmd).wait_ok(TIMEOUT);
    busy.wait_ok(TIMEOUT);
    let line = &json_lines(&out.stdout)[0];
    let tokens = node
        .status_group("capture")
        .expect("the scheduler saw the capturing process")["tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        tokens >= 3,
        "the capture spanned {tokens} tokens: too few to show anything"
    );
    assert!(common::u64_field(line, "captured") >= 10, "{line}");
    assert!(node.finish().overlaps().is_empty());
}

/// The uid of `name`, created (a system user without home) if it does not exist.
fn user(name: &str) -> Option<u32> {
    let id = || {
        let out = Command::new("id").args(["-u", name]).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().parse().ok())
            .flatten()
    };
    if let Some(u) = id() {
        return Some(u);
    }
    let _ = Command::new("useradd")
        .args([
            "--system",
            "--no-create-home",
            "--shell",
            "/usr/sbin/nologin",
            name,
        ])
        .status();
    id()
}

#[test]
fn tenants_of_different_users_share_one_gpu() {
    let _serial = common::timing_lock();
    assert_eq!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() },
        0,
        "this test creates users and runs tenants as them, which needs root (run it as root, as CI does)"
    );
    let (Some(a), Some(b)) = (user("gpushare-tenant1"), user("gpushare-tenant2")) else {
        panic!("cannot create the users gpushare-tenant1 and gpushare-tenant2 (useradd)");
    };
    // The tenants' users run copies of the programs, and reach the node's sockets.
    let mut node = Node::for_every_user(&[]);
    node.start_scheduler(&[]);
    // The static runtime: the users cannot read root's Python installation.
    let (trace, s) = two_tenants(node, &clients().runtime_static, Some([a, b]), [0.5, 0.5]);
    assert_split(&s, [0.5, 0.5]);
    assert!(trace.overlaps().is_empty());
}
