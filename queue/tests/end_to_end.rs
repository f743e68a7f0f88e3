//! The job queue end to end on a simulated node: jobs run under gpushare as their submitters,
//! with their shares (the device trace is the judge); wait modes and the memory threshold;
//! timeouts; a daemon killed with SIGKILL; bad input.

mod common;

use common::*;
use gpushare_testkit::harness::{describe, target_dir};
use gpushare_testkit::node::{Spin, Tenant, common_active_window, shares_in};
use std::time::Duration;

const SPIN: Duration = Duration::from_secs(60);

fn pid_of(job: &serde_json::Value) -> u32 {
    job["pid"].as_u64().expect("a started job has a pid") as u32
}

#[test]
fn jobs_of_two_users_run_as_them_with_their_shares() {
    let alice = test_user("gpsq-alice");
    let bob = test_user("gpsq-bob");
    let q = QueueNode::start(&[], &["--policy", "fifo"]);
    // Each job says who it runs as, then keeps the GPU busy for 3.5 s.
    let job = |share: &str| -> Vec<String> {
        let spin = q.cudarc(&[
            "spin",
            "--ms-per-kernel",
            "1",
            "--duration-ms",
            "3500",
            "--sync-every",
            "20",
        ]);
        let mut v: Vec<String> = [
            "--share",
            share,
            "--",
            "sh",
            "-c",
            "id -u; id -g; exec \"$@\"",
            "job",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(spin);
        v
    };
    let a_args = job("0.7");
    let b_args = job("0.3");
    let a = q.submit_as(Some(alice), &strs(&a_args));
    let b = q.submit_as(Some(bob), &strs(&b_args));
    let ja = q.wait_state(a, "succeeded", SPIN);
    let jb = q.wait_state(b, "succeeded", SPIN);
    assert_eq!(ja["user"], "gpsq-alice");
    assert_eq!(jb["user"], "gpsq-bob");
    for (id, (uid, gid)) in [(a, alice), (b, bob)] {
        let out = q.logs(id);
        let mut lines = out.lines();
        assert_eq!(
            lines.next(),
            Some(uid.to_string().as_str()),
            "job {id} ran as its submitter:\n{out}"
        );
        assert_eq!(
            lines.next(),
            Some(gid.to_string().as_str()),
            "with the submitter's group:\n{out}"
        );
    }
    // Both fit on the GPU at once (0.7 + 0.3), and the scheduler held them to their shares.
    let pids = [pid_of(&ja), pid_of(&jb)];
    let trace = q.finish();
    let window = common_active_window(&trace, &pids, 300_000_000);
    let shares = shares_in(&trace, &pids, window);
    // Of the time the GPU was busy: a loaded host leaves gaps (a starved holder wastes part of
    // its turns, and the bigger share holds more of them). The GPU's own time-slicing would
    // split it 0.5 / 0.5.
    let of_busy = shares[0] / (shares[0] + shares[1]);
    eprintln!("the 0.7 job had {of_busy:.3} of the busy time (shares {shares:?})");
    assert!(
        (of_busy - 0.7).abs() < gpushare_testkit::margins::SPLIT,
        "the 0.7 job had {of_busy:.3} of the busy time (shares {shares:?} over {window}); {}",
        gpushare_testkit::node::gaps_in(&trace, window).summary()
    );
}

#[test]
fn users_may_touch_only_their_own_jobs() {
    let alice = test_user("gpsq-alice");
    let bob = test_user("gpsq-bob");
    let q = QueueNode::start(&[], &["--policy", "fifo"]);
    let a = q.submit_as(Some(alice), &["--", "sh", "-c", "echo secret; sleep 30"]);
    q.wait_state(a, "running", SPIN);
    let id = a.to_string();
    let out = q.cli_as(Some(bob), &["cancel", &id]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not yours"),
        "{}",
        describe(&out)
    );
    let out = q.cli_as(Some(bob), &["logs", &id]);
    assert!(!out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("secret"));
    assert_eq!(q.job(a)["state"], "running", "bob changed nothing");
    let out = q.cli_as(Some(alice), &["cancel", &id]);
    assert!(out.status.success(), "{}", describe(&out));
    q.wait_state(a, "cancelled", SPIN);
}

#[test]
fn queue_and_schedule_wait_modes_and_the_memory_threshold() {
    // Two GPUs of 1 GiB; a tenant outside the queue holds 950 MiB of GPU 0 (over 0.9).
    let q = QueueNode::start(&["--gpus", "2", "--memory", "1GiB"], &["--policy", "fifo"]);
    // It holds the memory until it is killed.
    let hog = Spin::for_ms(1.0, 120_000.0).alloc_mib(950);
    let mut c = q.node.tenant_command(
        "other",
        0.0,
        1.0,
        1.0,
        target_dir().join("cudarc-client"),
        &hog.args(),
    );
    c.env("CUDA_VISIBLE_DEVICES", "0");
    let mut hog = Tenant::spawn(c);
    eventually(
        Duration::from_secs(20),
        "the tenant's memory in the books",
        || {
            let g = q.node.status_json().ok()?;
            let used = g["gpus"].as_array()?.iter().find_map(|gpu| {
                gpu["groups"]
                    .as_array()?
                    .iter()
                    .find(|x| x["name"] == "other")?["memory_used"]
                    .as_u64()
            })?;
            (used >= 950 << 20).then_some(())
        },
    );
    let spin = q.cudarc(&["spin", "--ms-per-kernel", "1", "--kernels", "200"]);
    let with = |mode: &str| -> Vec<String> {
        let mut v: Vec<String> = ["--prefer", "0", "--wait-mode", mode, "--"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(spin.clone());
        v
    };
    let qa = with("queue");
    let sa = with("schedule");
    let waits = q.submit(&strs(&qa));
    let moves = q.submit(&strs(&sa));
    let moved = q.wait_state(moves, "succeeded", SPIN);
    assert_eq!(
        moved["gpus"],
        serde_json::json!([1]),
        "schedule took the other GPU"
    );
    let w = q.job(waits);
    assert_eq!(
        w["state"],
        "queued",
        "queue waits for GPU 0 while it is over its threshold: {w}\n{}",
        q.daemon_log()
    );
    hog.signal(libc::SIGKILL);
    hog.finish_within(SPIN);
    let waited = q.wait_state(waits, "succeeded", SPIN);
    assert_eq!(waited["gpus"], serde_json::json!([0]));
    let (moved_pid, waited_pid) = (pid_of(&moved), pid_of(&waited));
    let trace = q.finish();
    assert!(
        ran_on(&trace, moved_pid, 1) && !ran_on(&trace, moved_pid, 0),
        "CUDA_VISIBLE_DEVICES"
    );
    assert!(ran_on(&trace, waited_pid, 0) && !ran_on(&trace, waited_pid, 1));
}

#[test]
fn a_timeout_kills_the_job() {
    let q = QueueNode::start(&[], &[]);
    let spin = q.cudarc(&[
        "spin",
        "--ms-per-kernel",
        "1",
        "--duration-ms",
        "60000",
        "--sync-every",
        "20",
    ]);
    let mut args = vec!["--timeout", "1s", "--"];
    args.extend(spin.iter().map(String::as_str));
    let id = q.submit(&args);
    let running = q.wait_state(id, "running", SPIN);
    let pid = pid_of(&running);
    let done = q.wait_state(id, "timed out", Duration::from_secs(30));
    assert_eq!(done["signal"], libc::SIGTERM, "{done}");
    let ran = done["ended_unix"].as_f64().unwrap() - done["started_unix"].as_f64().unwrap();
    assert!(
        (1.0..20.0).contains(&ran),
        "killed after {ran} s, timeout 1 s"
    );
    // The process is gone and its kernels stopped.
    eventually(
        Duration::from_secs(10),
        "the job's process to be gone",
        || (!std::path::Path::new(&format!("/proc/{pid}")).exists()).then_some(()),
    );
    let trace = q.finish();
    let span = trace.span_of_pid(pid).expect("the job ran kernels");
    assert!(span.len_ns() < 20_000_000_000, "it ran for {span}");
}

#[test]
fn attach_streams_output_and_exits_with_the_jobs_code() {
    let q = QueueNode::start(&[], &[]);
    let out = q.cli(&[
        "submit",
        "--attach",
        "--",
        "sh",
        "-c",
        "echo hello from the job; exit 7",
    ]);
    assert_eq!(out.status.code(), Some(7), "{}", describe(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from the job\n");
    let jobs = q.jobs();
    assert_eq!(jobs[0]["state"], "failed");
    assert_eq!(jobs[0]["exit_code"], 7);
}

#[test]
fn kill_9_of_the_daemon_loses_nothing() {
    let mut q = QueueNode::start(&["--gpus", "2"], &["--policy", "fifo"]);
    let done = q.submit(&["--", "true"]);
    q.wait_state(done, "succeeded", SPIN);
    // GPU 0: a job that outlives the daemon; GPU 1: one that ends while it is down; a third
    // waits for a whole GPU.
    let spin = q.cudarc(&[
        "spin",
        "--ms-per-kernel",
        "1",
        "--duration-ms",
        "3000",
        "--sync-every",
        "20",
    ]);
    let mut long = vec!["--prefer", "0", "--wait-mode", "queue", "--"];
    long.extend(spin.iter().map(String::as_str));
    let outlives = q.submit(&long);
    let ends = q.submit(&[
        "--prefer",
        "1",
        "--wait-mode",
        "queue",
        "--",
        "sh",
        "-c",
        "sleep 0.5; exit 3",
    ]);
    let waits = q.submit(&["--", "sh", "-c", "echo third"]);
    let r1 = q.wait_state(outlives, "running", SPIN);
    let r2 = q.wait_state(ends, "running", SPIN);
    assert_eq!(q.job(waits)["state"], "queued");
    q.kill_daemon();
    let ends_pid = pid_of(&r2);
    eventually(
        Duration::from_secs(20),
        "the short job to end while the queue is down",
        || (!std::path::Path::new(&format!("/proc/{ends_pid}")).exists()).then_some(()),
    );
    assert!(
        std::path::Path::new(&format!("/proc/{}", pid_of(&r1))).exists(),
        "the long job runs on without the daemon"
    );
    q.start_daemon();
    // Everything is where it was, or finished as it really did.
    assert_eq!(q.job(done)["state"], "succeeded");
    let ended = q.wait_state(ends, "failed", Duration::from_secs(10));
    assert_eq!(
        ended["exit_code"], 3,
        "the exit status written while the daemon was down"
    );
    assert_eq!(
        q.job(outlives)["pid"],
        r1["pid"],
        "re-adopted, not restarted"
    );
    let third = q.wait_state(waits, "succeeded", SPIN);
    assert_eq!(q.logs(waits), "third\n");
    let long_done = q.wait_state(outlives, "succeeded", SPIN);
    for j in [&ended, &third, &long_done] {
        assert_eq!(j["runs"], 1, "no job ran twice: {j}");
    }
    assert!(!q.daemon_log().contains("ERROR"), "{}", q.daemon_log());
}

#[test]
fn bad_input_is_refused_clearly_and_changes_nothing() {
    let q = QueueNode::start(&["--gpus", "2"], &["--listen", "127.0.0.1:0"]);
    let refused = |args: &[&str], says: &str| {
        let out = q.cli(args);
        assert!(
            !out.status.success(),
            "{args:?} was accepted\n{}",
            describe(&out)
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    };
    refused(&["submit", "--gpus", "3", "--", "true"], "this node has 2");
    refused(
        &["submit", "--wait-mode", "later", "--", "true"],
        "unknown wait mode",
    );
    refused(
        &["submit", "--share", "1.5", "--", "true"],
        "between 0 and 1",
    );
    refused(
        &["submit", "--prefer", "7", "--", "true"],
        "GPU 7 does not exist",
    );
    refused(
        &["submit", "--memory", "2TiB", "--", "true"],
        "ask for less --memory",
    );
    refused(&["submit", "--timeout", "10", "--", "true"], "needs a unit");
    refused(
        &[
            "submit",
            "--gpus",
            "2",
            "--prefer",
            "1",
            "--wait-mode",
            "queue",
            "--",
            "true",
        ],
        "prefer more GPUs",
    );
    refused(&["cancel", "42"], "no job 42");
    refused(&["logs", "42"], "no job 42");

    let addr = q.http.clone().unwrap();
    let token = String::from_utf8(q.cli(&["token"]).stdout)
        .unwrap()
        .trim()
        .to_string();
    let auth = format!("Bearer {token}");
    let post =
        |body: &str, headers: &[(&str, &str)]| http(&addr, "POST", "/api/jobs", headers, body);
    let (s, b) = post(r#"{"cmd": ["true"]}"#, &[]);
    assert_eq!(s, 401, "{b}");
    let (s, b) = post(r#"{"cmd": ["true"]}"#, &[("Authorization", "Bearer nope")]);
    assert_eq!(s, 401, "{b}");
    assert!(b.contains("unknown token"));
    for (body, says) in [
        (r#"{"cmd": ["true"], "gpus": 9}"#, "this node has 2"),
        (r#"{"cmd": "true"}"#, "malformed job"),
        (
            r#"{"cmd": ["true"], "colour": "red"}"#,
            "unknown field `colour`",
        ),
        (r#"{"cmd": ["true""#, "malformed job"),
        (r#"{"cmd": []}"#, "nothing to run"),
    ] {
        let (s, b) = post(body, &[("Authorization", &auth)]);
        assert_eq!(s, 400, "{body}: {b}");
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert!(v["error"].as_str().unwrap().contains(says), "{body}: {b}");
    }
    let (s, _) = http(&addr, "DELETE", "/api/jobs", &[], "");
    assert_eq!(s, 405);
    let (s, _) = http(&addr, "GET", "/nowhere", &[], "");
    assert_eq!(s, 404);
    assert!(q.jobs().is_empty(), "nothing was queued");
    // And a good one goes through, as the token's user, with id 1: no id was used up.
    let (s, b) = post(
        r#"{"cmd": ["sh", "-c", "echo via http"], "share": 0.5}"#,
        &[("Authorization", &auth)],
    );
    assert_eq!((s, b.as_str()), (201, r#"{"id":1}"#));
    q.wait_state(1, "succeeded", SPIN);
    let (s, b) = http(
        &addr,
        "GET",
        "/api/jobs/1/logs",
        &[("Authorization", &auth)],
        "",
    );
    assert_eq!((s, b.as_str()), (200, "via http\n"));
}

/// The queue runs a PyTorch job under gpushare with its share and memory cap: the job trains,
/// sees its 2 GiB cap as the GPU's memory, gets PyTorch's own out-of-memory error past it and
/// recovers; its kernels are on the device.
#[test]
fn a_pytorch_job_runs_with_its_share_and_memory_cap() {
    let python = gpushare_testkit::python::torch();
    let script = gpushare_testkit::python::script("torch_capabilities.py");
    let q = QueueNode::start(&[], &[]);
    let (python, script) = (python.to_string_lossy(), script.to_string_lossy());
    let id = q.submit(&[
        "--share", "0.5", "--memory", "2GiB", "--", &python, &script, "matmul", "train", "oom",
    ]);
    let job = q.wait_state(id, "succeeded", Duration::from_secs(300));
    let lines = gpushare_testkit::harness::json_lines(q.logs(id).as_bytes());
    let case = |name: &str| {
        lines
            .iter()
            .find(|l| l["case"] == name)
            .unwrap_or_else(|| panic!("no {name} line in {lines:?}"))
            .clone()
    };
    assert_eq!(case("train")["steps"], 10);
    let oom = case("oom");
    assert_eq!(
        oom["total"],
        2u64 << 30,
        "the job's cap is its GPU's memory: {oom}"
    );
    assert_eq!(oom["error"], "OutOfMemoryError");
    assert_eq!(oom["recovered"], true);
    let pid = pid_of(&job);
    assert!(
        q.finish().records().iter().any(|r| r.pid == pid),
        "the job's kernels ran on the device"
    );
}
