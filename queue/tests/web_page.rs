//! The queue's web page in a real browser: Debian's headless Chromium, driven over WebDriver
//! (chromedriver, plain HTTP on loopback). It lists running and finished jobs and follows
//! changes without a reload, plots each group's use of the GPU, and links each job to its
//! output for its owner only.

mod common;

use common::*;
use gpushare_testkit::harness::{describe, target_dir};
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

    /// Save a screenshot of the page as PNG at `path`.
    fn screenshot(&self, path: &Path) {
        use base64::Engine;
        let path_ = format!("/session/{}/screenshot", self.session);
        let (s, b) = http(&self.addr, "GET", &path_, &[], "");
        assert_eq!(s, 200, "WebDriver screenshot: {b}");
        let v: Value = serde_json::from_str(&b).unwrap();
        let png = base64::engine::general_purpose::STANDARD
            .decode(v["value"].as_str().expect("a base64 PNG"))
            .expect("base64");
        std::fs::write(path, png).unwrap();
    }

    /// The text of the page now shown.
    fn text(&self) -> String {
        self.eval("return document.body.innerText;")
            .as_str()
            .unwrap_or_default()
            .to_string()
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

#[test]
fn the_page_plots_each_groups_use_and_links_output_to_its_owner_only() {
    let alice = test_user("gpsq-alice");
    let bob = test_user("gpsq-bob");
    let q = QueueNode::start(&[], &["--policy", "fifo", "--listen", "127.0.0.1:0"]);
    let addr = q.http.clone().unwrap();
    // Each job says whose it is, then holds 64 MiB and keeps the GPU busy until cancelled.
    let job = |share: &str| -> Vec<String> {
        let spin = q.cudarc(&[
            "spin",
            "--ms-per-kernel",
            "1",
            "--duration-ms",
            "120000",
            "--sync-every",
            "20",
            "--alloc-mib",
            "64",
        ]);
        let mut v: Vec<String> = [
            "--share",
            share,
            "--",
            "sh",
            "-c",
            "echo \"output of $(id -un)\"; exec \"$@\"",
            "job",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(spin);
        v
    };
    let a = q.submit_as(Some(alice), &strs(&job("0.6")));
    let b = q.submit_as(Some(bob), &strs(&job("0.4")));
    q.wait_state(a, "running", Duration::from_secs(60));
    q.wait_state(b, "running", Duration::from_secs(60));

    let browser = Browser::start();
    browser.open(&format!("http://{addr}/"));
    // The URLs the page fetches from now on.
    browser.eval(
        "window.fetched = []; const f = window.fetch; window.fetch = (u, o) => { window.fetched.push(String(u)); return f(u, o); }; return null;",
    );
    // Both groups in both plots of GPU 0, each with GPU time and memory over several samples.
    let groups = [format!("gpushare-job-{a}"), format!("gpushare-job-{b}")];
    let series = |plot: &str| -> Vec<(String, u64, f64)> {
        let v = browser.eval(&format!(
            "return Array.from(document.querySelectorAll('#{plot} path[data-group]')).map(p => [p.dataset.group, +p.dataset.points, +p.dataset.max]);"
        ));
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| {
                (
                    x[0].as_str().unwrap().to_string(),
                    x[1].as_u64().unwrap(),
                    x[2].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let plotted = |plot: &str, least: f64| {
        let s = series(plot);
        groups.iter().all(|g| {
            s.iter()
                .any(|(name, points, max)| name == g && *points >= 5 && *max >= least)
        })
    };
    eventually(
        Duration::from_secs(60),
        "both jobs' GPU time and memory in the plots",
        || {
            (plotted("share-gpu-0", 0.05) && plotted("memory-gpu-0", (64 << 20) as f64))
                .then_some(())
        },
    );
    page_history_is_the_daemons(&browser, &addr);
    let legend = browser.eval(
        "return Array.from(document.querySelectorAll('#usage-gpu-0 .legend li')).map(l => l.textContent);",
    );
    for (id, user) in [(a, "gpsq-alice"), (b, "gpsq-bob")] {
        assert!(
            legend
                .as_array()
                .unwrap()
                .iter()
                .any(|l| l == &json!(format!("job {id} ({user})"))),
            "the legend names job {id} and its owner: {legend}"
        );
    }
    browser.command(
        "POST",
        "window/rect",
        json!({"width": 1280, "height": 1300}),
    );
    let shot = target_dir().join("gpushare-queue-page.png");
    browser.screenshot(&shot);
    eprintln!("screenshot of the page: {}", shot.display());
    eprintln!("share plot: {:?}", series("share-gpu-0"));

    // Alice saves her token on the page; her job's output link shows her its output.
    let token = |user| {
        let out = q.cli_as(Some(user), &["token"]);
        assert!(out.status.success(), "{}", describe(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let (alice_token, bob_token) = (token(alice), token(bob));
    browser.eval(&format!(
        "document.getElementById('token').value = '{alice_token}'; document.getElementById('token-form').requestSubmit(); return null;"
    ));
    eventually(Duration::from_secs(10), "the page to know Alice", || {
        let me = browser.eval("return document.getElementById('me').textContent;");
        me.as_str()?.contains("gpsq-alice").then_some(())
    });
    let link = |id: u64| {
        browser
            .eval(&format!(
                "const a = document.querySelector('#job-{id} a.output'); return a && a.href;"
            ))
            .as_str()
            .unwrap_or_else(|| panic!("no output link for job {id}"))
            .to_string()
    };
    let (link_a, link_b) = (link(a), link(b));
    browser.open(&link_a);
    let text = browser.text();
    assert!(
        text.contains("output of gpsq-alice"),
        "Alice's output: {text:?}"
    );
    // Bob's job's link, followed with Alice's token: refused, and nothing of Bob's output.
    browser.open(&link_b);
    let text = browser.text();
    assert!(
        text.contains("not yours") && !text.contains("output of"),
        "Bob's output refused to Alice: {text:?}"
    );
    // The same from a browser without a token, and over plain HTTP with each cookie.
    browser.open(&format!("http://{addr}/"));
    browser.eval("document.getElementById('forget').click(); return null;");
    eventually(Duration::from_secs(10), "the token forgotten", || {
        let me = browser.eval("return document.getElementById('me').textContent;");
        me.as_str()?.contains("no token").then_some(())
    });
    browser.open(&link_a);
    let text = browser.text();
    assert!(
        text.contains("needs a token") && !text.contains("output of"),
        "no token, no output: {text:?}"
    );
    let path_a = format!("/api/jobs/{a}/logs");
    let cookie = |t: &str| format!("gpushare_token={t}");
    let (s, body) = http(
        &addr,
        "GET",
        &path_a,
        &[("Cookie", &cookie(&alice_token))],
        "",
    );
    assert!(
        s == 200 && body.contains("output of gpsq-alice"),
        "{s} {body}"
    );
    let (s, body) = http(
        &addr,
        "GET",
        &path_a,
        &[("Cookie", &cookie(&bob_token))],
        "",
    );
    assert_eq!(s, 403, "{body}");
    // The cookie reads; it never acts.
    let (s, _) = http(
        &addr,
        "POST",
        &format!("/api/jobs/{a}/cancel"),
        &[("Cookie", &cookie(&alice_token))],
        "",
    );
    assert_eq!(s, 401);
    assert_eq!(q.job(a)["state"], "running");

    for id in [a, b] {
        let out = q.cli(&["cancel", &id.to_string()]);
        assert!(out.status.success(), "{}", describe(&out));
    }
}

/// The page asks `/api/usage` only for the samples after its last one, and what it has put
/// together from those answers is the daemon's whole history, sample for sample.
fn page_history_is_the_daemons(browser: &Browser, addr: &str) {
    eventually(
        Duration::from_secs(30),
        "the page to ask for the samples after its last",
        || {
            let fetched = browser.eval("return window.fetched;");
            fetched
                .as_array()?
                .iter()
                .any(|u| u.as_str().is_some_and(|u| u.contains("api/usage?since=")))
                .then_some(())
        },
    );
    let both = browser.eval(
        "return fetch('api/usage').then(r => r.json()).then(full => ({ page: usageSeen.get(0), full: full[0] }));",
    );
    let (page, full) = (&both["page"], &both["full"]);
    let times = |v: &Value| -> Vec<f64> {
        v["times"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_f64().unwrap())
            .collect()
    };
    let (page_times, full_times) = (times(page), times(full));
    // The value of `key` of group `name` at time `t` (0 where the group has no sample).
    let at = |v: &Value, times: &[f64], name: &str, key: &str, t: f64| -> f64 {
        let i = times.iter().position(|&x| x == t).unwrap();
        v["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["name"] == name)
            .map_or(0.0, |g| g[key][i].as_f64().unwrap())
    };
    let names = |v: &Value| -> Vec<String> {
        v["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["name"].as_str().unwrap().to_string())
            .collect()
    };
    let common: Vec<f64> = page_times
        .iter()
        .copied()
        .filter(|t| full_times.contains(t))
        .collect();
    assert!(
        common.len() >= 5,
        "the page's samples {page_times:?}, the daemon's {full_times:?}"
    );
    let mut all = names(page);
    all.extend(names(full));
    for name in &all {
        for key in ["share", "memory"] {
            for &t in &common {
                assert_eq!(
                    at(page, &page_times, name, key, t),
                    at(full, &full_times, name, key, t),
                    "{name}'s {key} at {t}: the page has {page}, the daemon {full}"
                );
            }
        }
    }
    // Over plain HTTP: only what is after `since`, and a `since` that is no time is refused.
    // `since` falls between two samples: a time read back from JSON may be a unit in the last
    // place off the daemon's own.
    let next = common[common.len() - 2];
    let since = (common[common.len() - 3] + next) / 2.0;
    let (s, body) = http(addr, "GET", &format!("/api/usage?since={since}"), &[], "");
    assert_eq!(s, 200, "{body}");
    let later: Value = serde_json::from_str(&body).unwrap();
    let later = times(&later[0]);
    assert!(
        later.first().is_some_and(|&t| (t - next).abs() < 1e-6) && later.iter().all(|&t| t > since),
        "after {since}: {later:?}"
    );
    let (s, body) = http(addr, "GET", "/api/usage?since=soon", &[], "");
    assert!(s == 400 && body.contains("since=SECONDS"), "{s} {body}");
}
