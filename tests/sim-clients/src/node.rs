//! A simulated node for end-to-end tests: the simulated device (`gpushare-sim serve`), the
//! scheduler (`gpushare-scheduler --dev`), and tenants started with `gpushare run`.

use crate::harness::{Sim, target_dir};
use crate::trace::Trace;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A simulated node: a device serving one GPU and a scheduler in development mode.
pub struct Node {
    device: Child,
    scheduler: Option<Child>,
    /// `GPUSHARE_SIM_SOCKET` and `LD_LIBRARY_PATH` for processes on the simulated GPU.
    pub sim_env: Vec<(String, String)>,
    /// The scheduler's socket (`GPUSHARE_SOCKET`).
    pub sched_socket: PathBuf,
    trace: PathBuf,
    /// Scratch directory, removed with the node.
    pub tmp: tempfile::TempDir,
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
    pub fn start(sched_args: &[&str]) -> Node {
        let sim = Sim::locate();
        let tmp = tempfile::tempdir().unwrap();
        let trace = tmp.path().join("trace.jsonl");
        let mut device = Command::new(&sim.bin)
            .args(["serve", "--trace"])
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
        let mut node = Node {
            device,
            scheduler: None,
            sim_env,
            sched_socket,
            trace,
            tmp,
        };
        node.start_scheduler(sched_args);
        node
    }

    pub fn start_scheduler(&mut self, args: &[&str]) {
        let _ = std::fs::remove_file(&self.sched_socket);
        let child = Command::new(target_dir().join("gpushare-scheduler"))
            .arg("--dev")
            .args(args)
            .arg("--socket")
            .arg(&self.sched_socket)
            .env("GPUSHARE_LOG", "warn")
            .spawn()
            .expect("start gpushare-scheduler");
        self.scheduler = Some(child);
        wait_for(&self.sched_socket);
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
    pub fn tenant(&self, group: &str, request: f64, limit: f64, weight: f64, args: &[&str]) -> Child {
        let mut c = Command::new(target_dir().join("gpushare"));
        c.args(["run", "--group", group])
            .args([
                "--request",
                &request.to_string(),
                "--limit",
                &limit.to_string(),
            ])
            .args(["--weight", &weight.to_string(), "--"])
            .arg(target_dir().join("cudarc-client"))
            .args(args)
            .env("GPUSHARE_SOCKET", &self.sched_socket)
            .env("GPUSHARE_FAIL", "closed")
            .stdout(Stdio::null());
        for (k, v) in &self.sim_env {
            c.env(k, v);
        }
        c.spawn().expect("start tenant")
    }

    /// Stop the device (flushing its trace) and read the trace.
    pub fn finish(mut self) -> Trace {
        self.kill_scheduler();
        // SAFETY: sending SIGTERM to our own child process.
        unsafe { libc::kill(self.device.id() as i32, libc::SIGTERM) };
        let _ = self.device.wait();
        Trace::read(&self.trace).expect("device trace")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill_scheduler();
        let _ = self.device.kill();
    }
}

