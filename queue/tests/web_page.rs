//! The queue's web page in a real browser: Debian's headless Chromium, driven over WebDriver
//! (chromedriver, plain HTTP on loopback). It lists running and finished jobs and follows
//! changes without a reload.

mod common;

use common::*;
use serde_json::{Value, json};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// Debian's chromium and chromium-driver, installed if missing (scripts/test installs them
/// first; this is for a test run on its own).
fn ensure_browser() {
    if Path::new(CHROMIUM).exists() && Path::new(CHROMEDRIVER).exists() {
        return;
    }
    let lock = std::fs::File::create("/tmp/gpushare-queue-apt.lock").unwrap();
    // SAFETY: flock on a file descriptor we own; released when `lock` is closed.
    unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
    if Path::new(CHROMIUM).exists() && Path::new(CHROMEDRIVER).exists() {
        return;
    }
    let apt = |args: &[&str]| {
        let st = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .expect("run apt-get");
        assert!(
            st.success(),
            "apt-get {args:?} failed: install chromium and chromium-driver"
        );
    };
    apt(&["update", "-qq"]);
    apt(&["install", "-y", "-qq", "chromium", "chromium-driver"]);
}

/// A chromedriver process, killed when dropped (also when starting the session fails).
struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A chromedriver on a free loopback port and one headless Chromium session.
struct Browser {
    _driver: Driver,
    addr: String,
    session: String,
    _profile: tempfile::TempDir,
}

impl Browser {
    fn start() -> Browser {
        ensure_browser();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = Driver(
            Command::new(CHROMEDRIVER)
                .arg(format!("--port={port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start chromedriver"),
        );
        let addr = format!("127.0.0.1:{port}");
        eventually(Duration::from_secs(30), "chromedriver to answer", || {
            std::net::TcpStream::connect(&addr).ok()?;
            let (s, b) = http(&addr, "GET", "/status", &[], "");
            (s == 200 && b.contains("\"ready\":true")).then_some(())
        });
        let profile = tempfile::tempdir().unwrap();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", "--no-first-run",
                    format!("--user-data-dir={}", profile.path().display()),
                ],
            },
        }}});
        let (s, b) = http(&addr, "POST", "/session", &[], &caps.to_string());
        assert_eq!(s, 200, "WebDriver session refused: {b}");
        let v: Value = serde_json::from_str(&b).unwrap();
        let session = v["value"]["sessionId"]
            .as_str()
            .expect("session id")
            .to_string();
        Browser {
            _driver: driver,
            addr,
            session,
            _profile: profile,
        }
    }

    fn command(&self, method: &str, what: &str, body: Value) -> Value {
        let path = format!("/session/{}/{what}", self.session);
        let (s, b) = http(&self.addr, method, &path, &[], &body.to_string());
        assert_eq!(s, 200, "WebDriver {what}: {b}");
        serde_json::from_str::<Value>(&b).unwrap()["value"].clone()
    }

    fn open(&self, url: &str) {
        self.command("POST", "url", json!({ "url": url }));
    }

    /// Run `script` (a function body) in the page; its return value.
    fn eval(&self, script: &str) -> Value {
        self.command(
            "POST",
            "execute/sync",
            json!({ "script": script, "args": [] }),
        )
    }

    /// `id:state` of every job row of table `#table`.
    fn rows(&self, table: &str) -> Vec<String> {
        let v = self.eval(&format!(
            "return Array.from(document.querySelectorAll('#{table} tr[id]')).map(r => r.id + ':' + r.dataset.state);"
        ));
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap().to_string())
            .collect()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let path = format!("/session/{}", self.session);
        // Ends Chromium; chromedriver goes with `_driver`.
        let _ = std::panic::catch_unwind(|| http(&self.addr, "DELETE", &path, &[], ""));
    }
}

#[test]
fn the_page_lists_jobs_and_follows_them_without_a_reload() {
    let q = QueueNode::start(&[], &["--policy", "fifo", "--listen", "127.0.0.1:0"]);
    let first = q.submit(&["--name", "first", "--", "true"]);
    q.wait_state(first, "succeeded", Duration::from_secs(60));

    let browser = Browser::start();
    browser.open(&format!("http://{}/", q.http.as_ref().unwrap()));
    assert_eq!(
        browser.rows("finished"),
        vec![format!("job-{first}:succeeded")]
    );
    assert!(browser.rows("working").is_empty());
    let gpus = browser.eval("return document.querySelectorAll('#gpus tr[id]').length;");
    assert_eq!(gpus, 1, "the GPU is listed");
    // Anything set now is lost if the page reloads.
    browser.eval("window.noReload = 42; return null;");

    // A job that runs until the test lets it go.
    let go = q.node.tmp.path().join("go");
    let script = format!("while [ ! -e {} ]; do sleep 0.05; done", go.display());
    let second = q.submit(&[
        "--name", "second", "--share", "0.5", "--", "sh", "-c", &script,
    ]);
    let running = format!("job-{second}:running");
    eventually(
        Duration::from_secs(30),
        "the running job on the page",
        || browser.rows("working").contains(&running).then_some(()),
    );
    let cells = browser.eval(&format!(
        "return Array.from(document.querySelectorAll('#job-{second} td')).map(c => c.textContent);"
    ));
    let cells: Vec<&str> = cells
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert!(
        cells.contains(&"second") && cells.contains(&"0.50"),
        "{cells:?}"
    );
    let gpu_row = browser.eval("return document.querySelector('#gpu-0').textContent;");
    assert!(
        gpu_row.as_str().unwrap().contains("0.50"),
        "the GPU shows the job's share: {gpu_row}"
    );

    std::fs::write(&go, "").unwrap();
    let done = format!("job-{second}:succeeded");
    eventually(
        Duration::from_secs(30),
        "the job to move to the finished queue",
        || {
            (browser.rows("finished").first() == Some(&done) && browser.rows("working").is_empty())
                .then_some(())
        },
    );
    assert_eq!(
        browser.eval("return window.noReload;"),
        42,
        "updated in place, not reloaded"
    );
}
