//! A simulated node with a job queue: the device and the scheduler from
//! [`gpushare_testkit::node::Node`], `gpushare-queue serve` beside them, and the `gpushare`
//! CLI pointed at it.
#![allow(dead_code)] // each test binary uses its own part of this module

use gpushare_testkit::harness::{describe, output_with_timeout, target_dir};
use gpushare_testkit::node::{Node, wait_for};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Poll `f` every 20 ms until it returns `Some`, for at most `within`; panics with `what`.
pub fn eventually<T>(within: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A user account for tests (created once, shared by every test): (uid, gid).
pub fn test_user(name: &str) -> (u32, u32) {
    assert_eq!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() },
        0,
        "this test runs jobs as other users, which needs root"
    );
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").arg(flag).arg(name).output().ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    if id("-u").is_none() {
        // Tests run in parallel processes: one creates the account at a time.
        let lock = std::fs::File::create("/tmp/gpushare-queue-test-users.lock").unwrap();
        // SAFETY: flock on a file descriptor we own; released when `lock` is closed.
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
        if id("-u").is_none() {
            let out = Command::new("useradd")
                .args([
                    "--system",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                ])
                .arg(name)
                .output()
                .expect("run useradd");
            assert!(out.status.success(), "useradd {name}\n{}", describe(&out));
        }
    }
    (id("-u").unwrap(), id("-g").unwrap())
}

pub struct QueueNode {
    pub node: Node,
    daemon: Option<Child>,
    pub socket: PathBuf,
    pub db: PathBuf,
    args: Vec<String>,
    /// The HTTP address, with `--listen`.
    pub http: Option<String>,
}

impl QueueNode {
    /// A node with `gpushare-sim serve SIM_ARGS`, a `--dev` scheduler, and `gpushare-queue serve
    /// QUEUE_ARGS` (the test defaults: books read every 100 ms, 1 s kill grace).
    pub fn start(sim_args: &[&str], queue_args: &[&str]) -> QueueNode {
        // Jobs and commands of other users run copies of the programs, and reach the node's
        // sockets.
        let mut node = Node::for_every_user(sim_args);
        node.start_scheduler(&[]);
        let mut q = QueueNode {
            socket: node.tmp.path().join("queue.sock"),
            db: node.tmp.path().join("queue/queue.db"),
            node,
            daemon: None,
            args: queue_args.iter().map(|s| s.to_string()).collect(),
            http: None,
        };
        q.start_daemon();
        q
    }

    pub fn daemon_log(&self) -> String {
        std::fs::read_to_string(self.node.tmp.path().join("queue.log")).unwrap_or_default()
    }

    /// Start `gpushare-queue serve` (again, on the same database).
    pub fn start_daemon(&mut self) {
        assert!(self.daemon.is_none());
        let _ = std::fs::remove_file(&self.socket);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.node.tmp.path().join("queue.log"))
            .unwrap();
        let mut c = Command::new(target_dir().join("gpushare-queue"));
        c.arg("serve")
            .arg("--db")
            .arg(&self.db)
            .arg("--socket")
            .arg(&self.socket)
            .arg("--scheduler-socket")
            .arg(&self.node.sched_socket)
            .arg("--gpushare")
            .arg(self.node.programs.path("gpushare"))
            .args(["--books-interval", "100ms", "--kill-grace", "1s"])
            .args(["--pass-env", "LD_LIBRARY_PATH,GPUSHARE_SIM_SOCKET"])
            .args(&self.args)
            .env("GPUSHARE_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(log);
        for (k, v) in &self.node.sim_env {
            c.env(k, v);
        }
        let mut child = c.spawn().expect("start gpushare-queue serve");
        if self.args.iter().any(|a| a == "--listen") {
            let mut line = String::new();
            BufReader::new(child.stdout.take().unwrap())
                .read_line(&mut line)
                .unwrap();
            let addr = line.trim().strip_prefix("http ").unwrap_or_else(|| {
                panic!("no address from --listen: {line:?}\n{}", self.daemon_log())
            });
            self.http = Some(addr.to_string());
        }
        self.daemon = Some(child);
        wait_for(&self.socket);
    }

    /// Stop the queue and the node; the device trace.
    pub fn finish(mut self) -> gpushare_testkit::trace::Trace {
        self.kill_daemon();
        std::mem::replace(&mut self.node, Node::on_system_driver()).finish()
    }

    /// `kill -9` the daemon.
    pub fn kill_daemon(&mut self) {
        if let Some(mut c) = self.daemon.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A job command: `cudarc-client ARGS` (the simulated GPU's client, a copy every user may
    /// run).
    pub fn cudarc(&self, args: &[&str]) -> Vec<String> {
        let mut v = vec![
            self.node
                .programs
                .path("cudarc-client")
                .display()
                .to_string(),
        ];
        v.extend(args.iter().map(|s| s.to_string()));
        v
    }

    /// `gpushare ARGS` as root (or as `uid`/`gid`), in the node's directory.
    pub fn cli_as(&self, user: Option<(u32, u32)>, args: &[&str]) -> Output {
        let mut c = Command::new(self.node.programs.path("gpushare"));
        c.args(args)
            .env("GPUSHARE_QUEUE_SOCKET", &self.socket)
            .current_dir(self.node.tmp.path());
        if let Some((uid, gid)) = user {
            c.uid(uid).gid(gid);
        }
        output_with_timeout(c, Duration::from_secs(30))
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        self.cli_as(None, args)
    }

    /// `gpushare submit ARGS` (as `user`); the job's id.
    pub fn submit_as(&self, user: Option<(u32, u32)>, args: &[&str]) -> u64 {
        let mut a = vec!["submit"];
        a.extend_from_slice(args);
        let out = self.cli_as(user, &a);
        assert!(
            out.status.success(),
            "gpushare submit failed\n{}",
            describe(&out)
        );
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("submit printed no id\n{}", describe(&out)))
    }

    pub fn submit(&self, args: &[&str]) -> u64 {
        self.submit_as(None, args)
    }

    /// `gpushare jobs --json`.
    pub fn jobs(&self) -> Vec<Value> {
        let out = self.cli(&["jobs", "--json"]);
        assert!(
            out.status.success(),
            "gpushare jobs failed\n{}",
            describe(&out)
        );
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("jobs --json is not a JSON list ({e})\n{}", describe(&out)))
    }

    pub fn job(&self, id: u64) -> Value {
        self.jobs()
            .into_iter()
            .find(|j| j["id"] == id)
            .unwrap_or_else(|| panic!("no job {id}"))
    }

    /// Wait until job `id` is in `state`; the job.
    pub fn wait_state(&self, id: u64, state: &str, within: Duration) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let last = self.job(id);
            if last["state"] == state {
                return last;
            }
            let over = !matches!(
                last["state"].as_str(),
                Some("queued" | "running" | "killing")
            );
            assert!(
                Instant::now() < deadline && !over,
                "job {id} not {state} after {within:?}: {last}\n--- its output ---\n{}\n--- queue log ---\n{}",
                String::from_utf8_lossy(&self.cli(&["logs", &id.to_string()]).stdout),
                self.daemon_log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The job's output (`gpushare logs ID`, as root).
    pub fn logs(&self, id: u64) -> String {
        let out = self.cli(&["logs", &id.to_string()]);
        assert!(out.status.success(), "{}", describe(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for QueueNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- queue log ---\n{}", self.daemon_log());
        }
        self.kill_daemon();
    }
}

/// A bare HTTP/1.1 exchange (the API and WebDriver both speak JSON over plain HTTP on
/// loopback): status and body.
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    // Read the head, then the body by its length (a server may keep the connection open).
    let mut r = BufReader::new(s);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {head:?}"));
    let field = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    let mut body = Vec::new();
    if let Some(n) = field("content-length").and_then(|n| n.parse::<usize>().ok()) {
        body.resize(n, 0);
        r.read_exact(&mut body).unwrap();
    } else if field("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).unwrap();
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else {
        r.read_to_end(&mut body).unwrap();
    }
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Pids of the simulated device's trace records of `pid` on `device`: whether it ran there.
pub fn ran_on(trace: &gpushare_testkit::trace::Trace, pid: u32, device: u32) -> bool {
    trace
        .records()
        .iter()
        .any(|r| r.pid == pid && r.device == device)
}

/// Borrow a list of arguments.
pub fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}
