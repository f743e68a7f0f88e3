//! `gpushare-queue shim`: the supervisor of one run of a job. The daemon starts it (as root)
//! with the job's log as stderr; it starts the job as the submitting user in a process group
//! of its own with stdout and stderr into the log, prints `pid N` (or `error WHY`) on stdout
//! for the daemon, waits for the job and writes its exit status to the exit file. It needs
//! nothing from the daemon after that, so a restarted daemon finds the outcome in the file.

use crate::daemon::ExitRecord;
use crate::sys;
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};

pub struct ShimArgs {
    pub exit_file: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub cwd: PathBuf,
    pub home: PathBuf,
    pub cmd: Vec<String>,
}

pub fn shim(a: ShimArgs) -> ExitCode {
    let mut out = std::io::stdout();
    let log = || {
        std::io::stderr()
            .as_fd()
            .try_clone_to_owned()
            .map(Stdio::from)
    };
    let (Ok(job_out), Ok(job_err)) = (log(), log()) else {
        let _ = writeln!(out, "error cannot hand the log to the job");
        return ExitCode::FAILURE;
    };
    let mut c = Command::new(&a.cmd[0]);
    c.args(&a.cmd[1..])
        .stdin(Stdio::null())
        .stdout(job_out)
        .stderr(job_err)
        .process_group(0);
    sys::run_as(&mut c, a.uid, a.gid, &a.groups, &a.cwd, &a.home);
    let mut child = match c.spawn() {
        Ok(c) => c,
        Err(e) => {
            let why = format!("cannot start {:?} as uid {}: {e}", a.cmd[0], a.uid);
            eprintln!("gpushare-queue: {why}");
            let _ = writeln!(out, "error {why}");
            return ExitCode::FAILURE;
        }
    };
    let _ = writeln!(out, "pid {}", child.id()).and_then(|_| out.flush());
    let status = loop {
        match child.wait() {
            Ok(s) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                eprintln!("gpushare-queue: lost track of the job: {e}");
                return ExitCode::FAILURE;
            }
        }
    };
    let record = ExitRecord {
        code: status.code(),
        signal: status.signal(),
    };
    // Write, then rename: the daemon never reads half a record.
    let tmp = a.exit_file.with_extension("tmp");
    let body = serde_json::to_vec(&record).expect("serialisable");
    if let Err(e) = std::fs::write(&tmp, body).and_then(|_| std::fs::rename(&tmp, &a.exit_file)) {
        eprintln!(
            "gpushare-queue: cannot record the job's exit in {}: {e}",
            a.exit_file.display()
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
