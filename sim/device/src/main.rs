//! `gpushare-sim`: run a command (and all its descendants) on simulated GPUs.

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use gpushare_sim_device::model::ModelConfig;
use gpushare_sim_device::server::{Server, ServerConfig};
use gpushare_sim_device::trace::Trace;
use gpushare_units::{parse_duration_ns, parse_rate, parse_size};
use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

#[derive(Parser)]
#[command(
    name = "gpushare-sim",
    version,
    about = "Simulated NVIDIA GPUs shared by every process of a command"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run CMD with the simulated driver; its exit code becomes ours.
    Run {
        #[command(flatten)]
        device: DeviceArgs,
        /// Command and arguments to run on the simulated GPUs.
        #[arg(last = true, required = true, value_name = "CMD")]
        cmd: Vec<String>,
    },
    /// Serve simulated GPUs on --socket until interrupted (point clients at it with
    /// GPUSHARE_SIM_SOCKET and the library directory printed at start).
    Serve {
        #[command(flatten)]
        device: DeviceArgs,
    },
    /// Summarise a trace: per device, each process's busy time and share, utilisation, and
    /// where the device idled (at a change of process, or between one process's own kernels).
    Report {
        /// Trace written by --trace.
        trace: PathBuf,
    },
}

#[derive(Args)]
struct DeviceArgs {
    /// Number of simulated GPUs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    gpus: u32,
    /// Memory of each GPU (e.g. 80GiB, 512MiB).
    #[arg(long, default_value = "80GiB", value_parser = parse_size)]
    memory: u64,
    /// Time slice the device gives a context while others wait (e.g. 1ms).
    #[arg(long, default_value = "1ms", value_parser = parse_duration_ns)]
    timeslice: u64,
    /// Idle device time for each switch between contexts.
    #[arg(long, default_value = "25us", value_parser = parse_duration_ns)]
    switch_cost: u64,
    /// Kernels run to completion before a context switch (pre-Pascal behaviour).
    #[arg(long)]
    no_preempt: bool,
    /// Duration of kernels named NAME, e.g. --kernel gemm=2ms (repeatable).
    #[arg(long = "kernel", value_name = "NAME=DURATION", value_parser = parse_kernel)]
    kernels: Vec<(String, u64)>,
    /// Duration of kernels that are neither gpushare_spin* nor named by --kernel
    /// (gpushare_wait_flag* kernels run it once the flag they spin on is set).
    #[arg(long, default_value = "5us", value_parser = parse_duration_ns)]
    default_kernel: u64,
    /// Write the device-side trace (JSON Lines, one object per kernel or preempted slice).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// How fast a checkpoint (cuCheckpointProcessCheckpoint) moves a process's device memory
    /// to host memory.
    #[arg(long, default_value = "1.5GB/s", value_parser = parse_rate)]
    checkpoint_bandwidth: u64,
    /// How fast a restore (cuCheckpointProcessRestore) moves it back.
    #[arg(long, default_value = "4.4GB/s", value_parser = parse_rate)]
    restore_bandwidth: u64,
    /// Fixed cost of each checkpoint and restore, on top of its bytes.
    #[arg(long, default_value = "100ms", value_parser = parse_duration_ns)]
    checkpoint_latency: u64,
    /// Device socket path (default: a fresh one in the temporary directory).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
}

fn parse_kernel(s: &str) -> Result<(String, u64), String> {
    let (name, dur) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} should be NAME=DURATION, e.g. gemm=2ms"))?;
    if name.is_empty() {
        return Err(format!("{s:?} has an empty kernel name"));
    }
    Ok((name.to_string(), parse_duration_ns(dur)?))
}

/// A private directory with the socket and `libcuda.so`/`libcuda.so.1` links, removed on drop.
struct RunDir(PathBuf);

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The simulated driver: `GPUSHARE_SIM_LIBCUDA`, or `libcuda.so` next to this executable.
fn find_driver() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("GPUSHARE_SIM_LIBCUDA") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("GPUSHARE_SIM_LIBCUDA={} does not exist", p.display());
    }
    let exe = std::env::current_exe().context("cannot locate the gpushare-sim executable")?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    for cand in [dir.join("libcuda.so"), dir.join("../lib/libcuda.so")] {
        if cand.is_file() {
            return Ok(cand);
        }
    }
    bail!(
        "the simulated driver libcuda.so is not next to {}; build it with \
         `cargo build -p gpushare-sim-driver` or set GPUSHARE_SIM_LIBCUDA",
        exe.display()
    )
}

fn prepare(device: &DeviceArgs) -> anyhow::Result<(RunDir, Server)> {
    let driver = std::fs::canonicalize(find_driver()?)?;
    let dir = std::env::temp_dir().join(format!("gpushare-sim-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Searchable by every user, so processes of any user reach the socket and their boards.
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let run_dir = RunDir(dir.clone());
    for name in ["libcuda.so", "libcuda.so.1"] {
        std::os::unix::fs::symlink(&driver, dir.join(name))?;
    }
    let model = ModelConfig {
        device_memory: vec![device.memory; device.gpus as usize],
        timeslice_ns: device.timeslice,
        switch_cost_ns: device.switch_cost,
        preempt: !device.no_preempt,
        default_kernel_ns: device.default_kernel,
        kernel_ns: device.kernels.iter().cloned().collect::<HashMap<_, _>>(),
    };
    if model.timeslice_ns == 0 {
        bail!("--timeslice must be greater than zero");
    }
    let socket = device
        .socket
        .clone()
        .unwrap_or_else(|| dir.join("device.sock"));
    let server = Server::start(ServerConfig {
        model,
        socket,
        trace: device.trace.clone(),
        swap: gpushare_sim_wire::SwapCost {
            latency_ns: device.checkpoint_latency,
            checkpoint_bytes_per_s: device.checkpoint_bandwidth,
            restore_bytes_per_s: device.restore_bandwidth,
        },
    })?;
    Ok((run_dir, server))
}

fn prepend_path(var: &str, dir: &Path) -> std::ffi::OsString {
    let mut v = dir.as_os_str().to_owned();
    if let Some(old) = std::env::var_os(var).filter(|o| !o.is_empty()) {
        v.push(":");
        v.push(old);
    }
    v
}

fn run(device: DeviceArgs, cmd: Vec<String>) -> anyhow::Result<ExitCode> {
    let (dir, server) = prepare(&device)?;
    let status = Command::new(&cmd[0])
        .args(&cmd[1..])
        .env("LD_LIBRARY_PATH", prepend_path("LD_LIBRARY_PATH", &dir.0))
        .env(gpushare_sim_wire::SOCKET_ENV, server.socket())
        .status();
    let status = match status {
        Ok(s) => s,
        Err(e) => {
            server.shutdown()?;
            bail!("cannot run {:?}: {e}", cmd[0]);
        }
    };
    server.shutdown()?;
    drop(dir);
    let code = match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(sig)) => 128 + sig,
        _ => 1,
    };
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}

fn serve(device: DeviceArgs) -> anyhow::Result<ExitCode> {
    // SAFETY: a zeroed sigset_t is a valid argument for sigemptyset, which initialises it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: signal-set manipulation on a local sigset. SIGINT/SIGTERM are blocked before any
    // server thread starts (threads inherit the mask), so only sigwait below receives them.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    let (dir, server) = prepare(&device)?;
    println!(
        "{}={}",
        gpushare_sim_wire::SOCKET_ENV,
        server.socket().display()
    );
    println!("LD_LIBRARY_PATH={}", dir.0.display());
    let mut sig: libc::c_int = 0;
    // SAFETY: `set` is initialised above and `sig` is a valid out-pointer.
    unsafe { libc::sigwait(&set, &mut sig) };
    server.shutdown()?;
    drop(dir);
    Ok(ExitCode::SUCCESS)
}

fn report(path: &Path) -> anyhow::Result<ExitCode> {
    let trace = Trace::read(path)?;
    let Some(span) = trace.span() else {
        println!("{}: no kernels", path.display());
        return Ok(ExitCode::SUCCESS);
    };
    for device in trace.devices() {
        let on = trace.filter(|r| r.device == device);
        let w = on.span().unwrap_or(span);
        println!(
            "GPU {device}: {:.3} s from first to last kernel, utilisation {:.3}",
            w.len_ns() as f64 / 1e9,
            trace.utilization(device, w)
        );
        println!(
            "  {:>8} {:>10} {:>7} {:>9}",
            "PID", "BUSY(s)", "SHARE", "KERNELS"
        );
        let busy = trace.busy_by_pid(device, w);
        let shares = trace.shares(device, w);
        for (pid, ns) in busy {
            let kernels = on
                .records()
                .iter()
                .filter(|r| r.pid == pid && !r.preempted)
                .count();
            println!(
                "  {pid:>8} {:>10.3} {:>7.3} {kernels:>9}",
                ns as f64 / 1e9,
                shares[&pid]
            );
        }
        let gaps = trace.idle_gaps(device, w);
        let ms = |(ns, n): (u64, u32)| format!("{:.1} ms in {n} gaps", ns as f64 / 1e6);
        println!("  idle at a change of process: {}", ms(gaps.between));
        for (pid, g) in gaps.within {
            println!("  idle between kernels of {pid}: {}", ms(g));
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    gpushare_logging::init("warn", std::io::stderr);
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Run { device, cmd } => run(device, cmd),
        Cmd::Serve { device } => serve(device),
        Cmd::Report { trace } => report(&trace),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpushare-sim: {e:#}");
            ExitCode::from(125)
        }
    }
}
