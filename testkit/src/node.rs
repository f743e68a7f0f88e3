//! A simulated node for end-to-end tests: the simulated device (`gpushare-sim serve`), the
//! scheduler (`gpushare-scheduler --dev`), and tenants started with `gpushare run`.

use crate::harness::{Programs, Sim, describe, output_with_timeout, target_dir};
use crate::trace::{Trace, Window, common_window};
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A simulated node: a device serving one GPU and a scheduler in development mode (or, from
/// [`Node::on_system_driver`], a scheduler on this machine's own GPUs).
pub struct Node {
    /// The simulated device; `None` on the system's driver.
    device: Option<Child>,
    scheduler: Option<Child>,
    /// `GPUSHARE_SIM_SOCKET` and `LD_LIBRARY_PATH` for processes on the simulated GPU.
    pub sim_env: Vec<(String, String)>,
    /// The scheduler's socket (`GPUSHARE_SOCKET`).
    pub sched_socket: PathBuf,
    trace: PathBuf,
    /// The scheduler's `GPUSHARE_LOG` filter (default `warn`; the benchmark's
    /// `--scheduler-log` asks for its decisions and reports too).
    pub scheduler_log_filter: String,
    /// Scratch directory, removed with the node.
    pub tmp: tempfile::TempDir,
    /// The programs its tenants run (`gpushare`, `cudarc-client`).
    pub programs: Programs,
}

/// Poll until `path` exists (a socket being bound), for at most 10 s.
pub fn wait_for(path: &Path) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Node {
    /// A node with its device and a `gpushare-scheduler --dev SCHED_ARGS…`.
    pub fn start(sched_args: &[&str]) -> Node {
        let mut node = Node::device_only();
        node.start_scheduler(sched_args);
        node
    }

    /// A node with its device but no scheduler yet (start one with
    /// [`start_scheduler`](Node::start_scheduler) or [`start_scheduler_with`](Node::start_scheduler_with)).
    pub fn device_only() -> Node {
        Node::device_only_with(&[])
    }

    /// [`device_only`](Node::device_only) with extra `gpushare-sim serve` arguments (e.g.
    /// `["--gpus", "4"]`).
    pub fn device_only_with(serve_args: &[&str]) -> Node {
        Node::device_only_running(serve_args, Programs::own())
    }

    /// [`device_only_with`](Node::device_only_with) for tests whose tenants run as other users:
    /// they run copies of `gpushare`, the hook, the simulated driver and `cudarc-client` that
    /// every user may run (see [`Programs`]), and the node's directory, which holds its sockets,
    /// is open to every user.
    pub fn for_every_user(serve_args: &[&str]) -> Node {
        use std::os::unix::fs::PermissionsExt;
        let programs = Programs::for_every_user(&[
            "gpushare",
            "libgpushare.so",
            "libcuda.so",
            "cudarc-client",
        ]);
        let node = Node::device_only_running(serve_args, programs);
        std::fs::set_permissions(node.tmp.path(), std::fs::Permissions::from_mode(0o755))
            .expect("open the node's directory to every user");
        node
    }

    fn device_only_running(serve_args: &[&str], programs: Programs) -> Node {
        let sim = Sim::locate();
        let tmp = tempfile::tempdir().unwrap();
        let trace = tmp.path().join("trace.jsonl");
        let mut device = Command::new(&sim.bin);
        if let Some(driver) = programs.copied("libcuda.so") {
            device.env("GPUSHARE_SIM_LIBCUDA", driver);
        }
        let mut device = device
            .arg("serve")
            .args(serve_args)
            .arg("--trace")
            .arg(&trace)
            .arg("--socket")
            .arg(tmp.path().join("sim.sock"))
            .stdout(Stdio::piped())
            .spawn()
            .expect("start gpushare-sim serve");
        let mut lines = BufReader::new(device.stdout.take().unwrap()).lines();
        let sim_env = (0..2)
            .map(|_| {
                let l = lines.next().unwrap().unwrap();
                let (k, v) = l.split_once('=').unwrap();
                (k.to_string(), v.to_string())
            })
            .collect();
        let sched_socket = tmp.path().join("gpushare.sock");
        Node {
            device: Some(device),
            scheduler: None,
            sim_env,
            sched_socket,
            trace,
            scheduler_log_filter: "warn".into(),
            tmp,
            programs,
        }
    }

    /// A node on this machine's own CUDA driver (`libcuda.so.1` as the loader finds it: a real
    /// GPU): no simulated device, so no device trace; processes inherit the environment.
    pub fn on_system_driver() -> Node {
        let tmp = tempfile::tempdir().unwrap();
        Node {
            device: None,
            scheduler: None,
            sim_env: Vec::new(),
            sched_socket: tmp.path().join("gpushare.sock"),
            trace: tmp.path().join("trace.jsonl"),
            scheduler_log_filter: "warn".into(),
            tmp,
            programs: Programs::own(),
        }
    }

    /// Start `gpushare-scheduler --dev ARGS… --socket <node socket>` and wait for its socket.
    pub fn start_scheduler(&mut self, args: &[&str]) {
        self.start_scheduler_with(true, args);
    }

    /// Start `gpushare-scheduler [--dev] ARGS… --socket <node socket>` and wait for its socket.
    /// Its stderr (log filter [`scheduler_log_filter`](Node::scheduler_log_filter)) is appended
    /// to [`scheduler_log`](Node::scheduler_log).
    pub fn start_scheduler_with(&mut self, dev: bool, args: &[&str]) {
        assert!(self.scheduler.is_none(), "a scheduler is already running");
        let _ = std::fs::remove_file(&self.sched_socket);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.scheduler_log_path())
            .expect("open the scheduler log");
        let mut c = Command::new(target_dir().join("gpushare-scheduler"));
        if dev {
            c.arg("--dev");
        }
        // The simulated driver too: the scheduler swaps tenants to host memory through it.
        for (k, v) in &self.sim_env {
            c.env(k, v);
        }
        let child = c
            .args(args)
            .arg("--socket")
            .arg(&self.sched_socket)
            .env("GPUSHARE_LOG", &self.scheduler_log_filter)
            .stderr(log)
            .spawn()
            .expect("start gpushare-scheduler");
        self.scheduler = Some(child);
        wait_for(&self.sched_socket);
    }

    /// Where the scheduler's stderr goes.
    pub fn scheduler_log_path(&self) -> PathBuf {
        self.tmp.path().join("scheduler.log")
    }

    /// Everything the node's schedulers have logged so far.
    pub fn scheduler_log(&self) -> String {
        std::fs::read_to_string(self.scheduler_log_path()).unwrap_or_default()
    }

    /// Pid of the simulated device (`None` on the system's driver).
    pub fn device_pid(&self) -> Option<u32> {
        self.device.as_ref().map(Child::id)
    }

    /// Pid of the running scheduler.
    pub fn scheduler_pid(&self) -> Option<u32> {
        self.scheduler.as_ref().map(Child::id)
    }

    /// Whether the scheduler started last is still running (`None`: none was started).
    pub fn scheduler_running(&mut self) -> Option<bool> {
        let c = self.scheduler.as_mut()?;
        Some(matches!(c.try_wait(), Ok(None)))
    }

    /// `gpushare status --json` against the node's scheduler (at most 5 s).
    /// `gpushare status --json`: the entry of `group` on GPU 0, if the status lists it.
    pub fn status_group(&self, group: &str) -> Option<serde_json::Value> {
        group_in(&self.status_json().ok()?, group).cloned()
    }

    pub fn status_json(&self) -> Result<serde_json::Value, String> {
        status_json_at(&self.sched_socket)
    }

    /// Pid of the process holding GPU 0's token, from `gpushare status --json`.
    pub fn token_holder(&self) -> Option<u32> {
        let v = self.status_json().ok()?;
        v["gpus"][0]["holder"]["pid"].as_u64().map(|p| p as u32)
    }

    pub fn kill_scheduler(&mut self) {
        if let Some(mut c) = self.scheduler.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A command on the simulated GPU with the node's environment, not under gpushare.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(program);
        c.env("GPUSHARE_SOCKET", &self.sched_socket);
        for (k, v) in &self.sim_env {
            c.env(k, v);
        }
        c
    }

    /// A cudarc tenant: `gpushare run --group NAME … -- cudarc-client ARGS`.
    pub fn tenant(
        &self,
        group: &str,
        request: f64,
        limit: f64,
        weight: f64,
        args: &[&str],
    ) -> Child {
        self.tenant_command(
            group,
            request,
            limit,
            weight,
            self.programs.path("cudarc-client"),
            args,
        )
        .spawn()
        .expect("start tenant")
    }

    /// `gpushare run RUN_ARGS… -- PROGRAM ARGS…` on the simulated GPU, not yet started: with the
    /// node's scheduler socket, `GPUSHARE_FAIL=closed`, stdout discarded.
    pub fn run_command<S: AsRef<OsStr>>(
        &self,
        run_args: &[&str],
        program: impl AsRef<OsStr>,
        args: &[S],
    ) -> Command {
        let mut c = self.command(self.programs.path("gpushare"));
        c.arg("run")
            .args(run_args)
            .arg("--")
            .arg(program)
            .args(args)
            .env("GPUSHARE_FAIL", "closed")
            .stdout(Stdio::null());
        c
    }

    /// [`run_command`](Node::run_command) with `--group NAME --request R --limit L --weight W`.
    pub fn tenant_command<S: AsRef<OsStr>>(
        &self,
        group: &str,
        request: f64,
        limit: f64,
        weight: f64,
        program: impl AsRef<OsStr>,
        args: &[S],
    ) -> Command {
        let (r, l, w) = (request.to_string(), limit.to_string(), weight.to_string());
        let run_args = [
            "--group",
            group,
            "--request",
            &r,
            "--limit",
            &l,
            "--weight",
            &w,
        ];
        self.run_command(&run_args, program, args)
    }

    /// Start a [`Tenant`] from `cmd` (e.g. [`tenant_command`](Node::tenant_command)), collecting
    /// its stdout and stderr.
    pub fn spawn(&self, cmd: Command) -> Tenant {
        Tenant::spawn(cmd)
    }

    /// Compile the C client `c/NAME` into the node's scratch directory (see
    /// [`Sim::compile_c`]); returns the executable.
    pub fn compile_c(&self, name: &str, link_libcuda: bool) -> PathBuf {
        let out = self.tmp.path().join(name.trim_end_matches(".c"));
        Sim::locate()
            .compile_c(&crate::harness::c_dir().join(name), &out, link_libcuda)
            .unwrap_or_else(|e| panic!("{e}"));
        out
    }

    /// Path of the device trace (complete once [`finish`](Node::finish) stopped the device).
    pub fn trace_path(&self) -> &Path {
        &self.trace
    }

    /// Stop the device (flushing its trace) and read the trace.
    pub fn finish(self) -> Trace {
        self.stop()
            .expect("a node on the system's driver has no device trace")
    }

    /// Stop the scheduler and the device; the device trace (`None` on the system's driver).
    pub fn stop(mut self) -> Option<Trace> {
        self.kill_scheduler();
        let mut device = self.device.take()?;
        // SAFETY: sending SIGTERM to our own child process.
        unsafe { libc::kill(device.id() as i32, libc::SIGTERM) };
        let _ = device.wait();
        Some(Trace::read(&self.trace).expect("device trace"))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.scheduler_log();
            if !log.is_empty() {
                eprintln!("--- scheduler log ---\n{log}");
            }
        }
        self.kill_scheduler();
        let Some(device) = self.device.as_mut() else {
            return; // stopped by `stop`, or none
        };
        if !matches!(device.try_wait(), Ok(None)) {
            return;
        }
        // SIGTERM first: the device then removes its run directory.
        // SAFETY: sending SIGTERM to our own child process, which has not been reaped.
        unsafe { libc::kill(device.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(2);
        while matches!(device.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = device.kill();
        let _ = device.wait();
    }
}

/// A process started by a test (a tenant, usually `gpushare run … -- CLIENT`) whose stdout and
/// stderr are collected. It is killed if dropped while still running, so a failing test leaves
/// no tenant behind.
pub struct Tenant {
    child: Child,
    stdout: Option<JoinHandle<Vec<u8>>>,
    stderr: Option<JoinHandle<Vec<u8>>>,
    status: Option<ExitStatus>,
}

impl Tenant {
    /// Start `cmd` with stdout and stderr piped to collector threads.
    pub fn spawn(mut cmd: Command) -> Tenant {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", cmd.get_program()));
        let collect = |pipe: Option<Box<dyn Read + Send>>| {
            pipe.map(|mut p| {
                std::thread::spawn(move || {
                    let mut buf = Vec::new();
                    let _ = p.read_to_end(&mut buf);
                    buf
                })
            })
        };
        let stdout = collect(child.stdout.take().map(|p| Box::new(p) as _));
        let stderr = collect(child.stderr.take().map(|p| Box::new(p) as _));
        Tenant {
            child,
            stdout,
            stderr,
            status: None,
        }
    }

    /// The process id (`gpushare run` execs its command, so this is the client's pid).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("wait for tenant");
        }
        self.status.is_none()
    }

    /// Send `signal` (e.g. `libc::SIGSTOP`) if it is still running.
    pub fn signal(&mut self, signal: i32) {
        if self.running() {
            // SAFETY: plain syscall on our own, not yet reaped, child.
            unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        }
    }

    /// Wait at most `timeout` for it to exit: its output, and whether it had to be killed.
    pub fn finish_within(mut self, timeout: Duration) -> (Output, bool) {
        let deadline = Instant::now() + timeout;
        let mut killed = false;
        while self.running() {
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                self.status = Some(self.child.wait().expect("wait for killed tenant"));
                killed = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let join =
            |h: Option<JoinHandle<Vec<u8>>>| h.and_then(|h| h.join().ok()).unwrap_or_default();
        let output = Output {
            status: self.status.expect("exited"),
            stdout: join(self.stdout.take()),
            stderr: join(self.stderr.take()),
        };
        (output, killed)
    }

    /// Wait at most `timeout`; it must exit successfully. Returns its output.
    pub fn wait_ok(self, timeout: Duration) -> Output {
        let pid = self.pid();
        let (out, killed) = self.finish_within(timeout);
        assert!(
            !killed,
            "tenant {pid} did not finish within {timeout:?}; killed\n{}",
            describe(&out)
        );
        assert!(
            out.status.success(),
            "tenant {pid} failed\n{}",
            describe(&out)
        );
        out
    }
}

impl Drop for Tenant {
    fn drop(&mut self) {
        if self.running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the time base of the device trace.
pub use gpushare_units::monotonic_ns;

/// Arguments of `cudarc-client spin`.
#[derive(Debug, Clone, PartialEq)]
pub struct Spin {
    pub ms_per_kernel: f64,
    pub kernels: Option<u64>,
    pub duration_ms: Option<f64>,
    pub sync_every: Option<u64>,
    pub idle_ms: Option<f64>,
    pub threads: u32,
    pub prelaunch: bool,
    pub alloc_mib: Option<usize>,
}

impl Spin {
    /// `kernels` kernels of `ms` each, synchronising every 20 (a typical training step).
    pub fn kernels(ms: f64, kernels: u64) -> Spin {
        Spin {
            ms_per_kernel: ms,
            kernels: Some(kernels),
            duration_ms: None,
            sync_every: Some(20),
            idle_ms: None,
            threads: 1,
            prelaunch: false,
            alloc_mib: None,
        }
    }

    /// Kernels of `ms` each for `duration_ms` of wall time, synchronising every 20.
    pub fn for_ms(ms: f64, duration_ms: f64) -> Spin {
        Spin {
            kernels: None,
            duration_ms: Some(duration_ms),
            ..Spin::kernels(ms, 0)
        }
    }

    /// Synchronise every `k` kernels (`None`: only at the end).
    pub fn sync_every(self, k: Option<u64>) -> Spin {
        Spin {
            sync_every: k,
            ..self
        }
    }

    /// Sleep `ms` on the host after every synchronisation.
    pub fn idle_ms(self, ms: f64) -> Spin {
        Spin {
            idle_ms: Some(ms),
            ..self
        }
    }

    /// Launch from `n` threads, each on its own stream.
    pub fn threads(self, n: u32) -> Spin {
        Spin { threads: n, ..self }
    }

    /// Launch one kernel on the main thread before the launcher threads start.
    pub fn prelaunch(self) -> Spin {
        Spin {
            prelaunch: true,
            ..self
        }
    }

    /// Hold `mib` MiB of device memory while spinning.
    pub fn alloc_mib(self, mib: usize) -> Spin {
        Spin {
            alloc_mib: Some(mib),
            ..self
        }
    }

    pub fn args(&self) -> Vec<String> {
        let mut a = vec![
            "spin".to_string(),
            "--ms-per-kernel".into(),
            self.ms_per_kernel.to_string(),
        ];
        let mut opt = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                a.extend([k.to_string(), v]);
            }
        };
        opt("--kernels", self.kernels.map(|v| v.to_string()));
        opt("--duration-ms", self.duration_ms.map(|v| v.to_string()));
        opt("--sync-every", self.sync_every.map(|v| v.to_string()));
        opt("--idle-ms", self.idle_ms.map(|v| v.to_string()));
        opt(
            "--threads",
            (self.threads != 1).then(|| self.threads.to_string()),
        );
        opt("--alloc-mib", self.alloc_mib.map(|v| v.to_string()));
        if self.prelaunch {
            a.push("--prelaunch".into());
        }
        a
    }
}

/// The longest time `pid` started no kernel within `w` (from `w`'s start to its first kernel
/// there, between its kernels, from its last to `w`'s end).
pub fn longest_without_kernel(trace: &Trace, pid: u32, w: Window) -> u64 {
    let mut starts: Vec<u64> = (trace.records().iter())
        .filter(|r| r.pid == pid && r.start_ns >= w.start_ns && r.start_ns < w.end_ns)
        .map(|r| r.start_ns)
        .collect();
    starts.sort_unstable();
    let mut last = w.start_ns;
    let mut longest = 0;
    for s in starts.into_iter().chain([w.end_ns]) {
        longest = longest.max(s - last);
        last = s;
    }
    longest
}

/// Busy share of each of `pids` on device 0 over `window`.
pub fn shares_in(trace: &Trace, pids: &[u32], window: Window) -> Vec<f64> {
    let by = trace.busy_by_pid(0, window);
    pids.iter()
        .map(|p| by.get(p).copied().unwrap_or(0) as f64 / window.len_ns().max(1) as f64)
        .collect()
}

/// The window in which all `pids` ran kernels, without its first `warmup_ns` and its last 50 ms.
pub fn common_active_window(trace: &Trace, pids: &[u32], warmup_ns: u64) -> Window {
    let spans = pids.iter().map(|p| {
        trace
            .span_of_pid(*p)
            .unwrap_or_else(|| panic!("pid {p} ran no kernels"))
    });
    let w = common_window(spans).expect("the tenants never ran at the same time");
    let (start, end) = (w.start_ns + warmup_ns, w.end_ns.saturating_sub(50_000_000));
    assert!(
        start + 200_000_000 <= end,
        "the tenants overlapped only for {w}: too short to measure shares"
    );
    Window::new(start, end)
}

/// Idle time of device 0 inside a window, split by what surrounds each gap.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Gaps {
    /// Idle gaps (ns) between records of different processes: token handoffs. Handoffs without
    /// a gap count as 0.
    pub switches: Vec<u64>,
    /// Idle ns between records of the same process (its host was late, or it paused).
    pub same_ns: u64,
    /// The idle gaps between records of the same process, each: `(pid, ns)`.
    pub same_gaps: Vec<(u32, u64)>,
}

impl Gaps {
    /// Total idle ns at handoffs.
    pub fn switch_ns(&self) -> u64 {
        self.switches.iter().sum()
    }

    /// Idle ns at handoffs beyond `allowance_ns` each: what a handoff cost more than it should.
    pub fn switch_excess_ns(&self, allowance_ns: u64) -> u64 {
        self.switches
            .iter()
            .map(|g| g.saturating_sub(allowance_ns))
            .sum()
    }

    /// Longest handoff gap.
    pub fn max_switch_ns(&self) -> u64 {
        self.switches.iter().copied().max().unwrap_or(0)
    }

    /// One line: handoffs, their mean / median / max gap, idle time within a process.
    pub fn summary(&self) -> String {
        let mut v = self.switches.clone();
        v.sort_unstable();
        let n = v.len().max(1) as f64;
        format!(
            "{} turns idling {:.2} ms (mean {:.0} µs, median {:.0} µs, max {:.0} µs), {:.2} ms idle within a process",
            v.len(),
            self.switch_ns() as f64 / 1e6,
            self.switch_ns() as f64 / n / 1e3,
            v.get(v.len() / 2).copied().unwrap_or(0) as f64 / 1e3,
            self.max_switch_ns() as f64 / 1e3,
            self.same_ns as f64 / 1e6
        )
    }
}

/// Classify the idle gaps of device 0 inside `window`.
pub fn gaps_in(trace: &Trace, window: Window) -> Gaps {
    let mut g = Gaps::default();
    let mut prev: Option<(u32, u64)> = None; // (pid, end) of the record ending last so far
    for r in trace.records().iter().filter(|r| r.device == 0) {
        if r.end_ns <= window.start_ns || r.start_ns >= window.end_ns {
            continue;
        }
        if let Some((pid, end)) = prev {
            let gap = if r.start_ns > end {
                Window::new(end, r.start_ns).overlap_ns(&window)
            } else {
                0
            };
            if pid != r.pid {
                g.switches.push(gap);
            } else if gap > 0 {
                g.same_ns += gap;
                g.same_gaps.push((r.pid, gap));
            }
            if r.end_ns <= end {
                continue;
            }
        }
        prev = Some((r.pid, r.end_ns));
    }
    g
}

/// A TCP port on 127.0.0.1 free a moment ago (for a daemon's `--metrics 127.0.0.1:PORT`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a free port")
        .port()
}

/// `GET /metrics` from 127.0.0.1:`port` (at most 5 s): the whole response, headers included.
pub fn metrics_page(port: u16) -> String {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to /metrics");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read /metrics");
    body
}

/// `gpushare status --json` against the scheduler socket `socket` (at most 5 s: it panics
/// beyond).
pub fn status_json_at(socket: &Path) -> Result<serde_json::Value, String> {
    let mut c = Command::new(target_dir().join("gpushare"));
    c.args(["status", "--json"]).env("GPUSHARE_SOCKET", socket);
    let out = output_with_timeout(c, Duration::from_secs(5));
    if !out.status.success() {
        return Err(describe(&out));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("status --json is not JSON ({e})\n{}", describe(&out)))
}

/// The entry of `group` on GPU 0 in a `gpushare status --json` report.
pub fn group_in<'a>(status: &'a serde_json::Value, group: &str) -> Option<&'a serde_json::Value> {
    status["gpus"][0]["groups"]
        .as_array()?
        .iter()
        .find(|g| g["name"] == group)
}
