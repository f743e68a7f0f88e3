//! `gpushare`: run programs under the hook, see what the scheduler sees, and use the node's
//! job queue (`gpushare-queue`).

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use gpushare_protocol::status::Report;
use gpushare_queue_protocol::{Demand, JobView, QueueClient, Submission, WaitMode, queue_socket};
use status::render;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Duration;

mod status;

#[derive(Parser)]
#[command(
    name = "gpushare",
    version,
    about = "Share GPUs with guaranteed and capped slices of GPU time"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run CMD with libgpushare.so preloaded.
    Run {
        /// Group to run in (honoured when the scheduler runs with --dev).
        #[arg(long)]
        group: Option<String>,
        /// Guaranteed share of GPU time, 0..1 (with --group).
        #[arg(long, default_value_t = 0.0)]
        request: f64,
        /// Hard cap on the share of GPU time, request..1 (with --group).
        #[arg(long, default_value_t = 1.0)]
        limit: f64,
        /// Weight for splitting spare GPU time (with --group).
        #[arg(long, default_value_t = 1.0)]
        weight: f64,
        /// GPU memory cap, e.g. 4GiB (with --group).
        #[arg(long, value_parser = gpushare_units::parse_size)]
        memory: Option<u64>,
        /// The latency class: a request server whose tail latency matters; the others keep
        /// little work queued and hand it the GPU at their next kernel (with --group).
        #[arg(long, requires = "group")]
        latency: bool,
        #[arg(last = true, required = true, value_name = "CMD")]
        cmd: Vec<String>,
    },
    /// Print the scheduler's view once.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// The scheduler's view, refreshed every second.
    Top,
    /// Queue CMD on the node's job queue; prints the job's ID.
    Submit {
        /// Name shown in listings [default: the command's name].
        #[arg(long)]
        name: Option<String>,
        /// Number of GPUs, all started at once [default: 1].
        #[arg(long)]
        gpus: Option<u32>,
        /// Guaranteed share of each GPU, 0..1 [default: 1, a whole GPU].
        #[arg(long)]
        share: Option<f64>,
        /// Cap on the share of each GPU, share..1 [default: 1].
        #[arg(long)]
        limit: Option<f64>,
        /// GPU memory cap on each GPU, e.g. 4GiB.
        #[arg(long, value_parser = gpushare_units::parse_size)]
        memory: Option<u64>,
        /// The latency class: a request server whose tail latency matters (`gpushare run
        /// --latency`).
        #[arg(long)]
        latency: bool,
        /// Preferred GPUs, most preferred first, e.g. 0,2.
        #[arg(long, value_delimiter = ',')]
        prefer: Vec<u32>,
        /// queue: wait for the preferred GPUs; schedule: take any GPU that can take the job
        /// when they cannot [default: schedule].
        #[arg(long, value_parser = str::parse::<WaitMode>)]
        wait_mode: Option<WaitMode>,
        /// Priority p of P = α·p − β·T − γ·t (aging and shares policies) [default: 0].
        #[arg(long, allow_negative_numbers = true)]
        priority: Option<i32>,
        /// Kill the job after this much running time, e.g. 600s (T in the priority).
        #[arg(long, value_parser = gpushare_units::parse_duration_ns)]
        timeout: Option<u64>,
        /// Run again after a failure up to N times [default: 0].
        #[arg(long, value_name = "N")]
        retries: Option<u32>,
        /// Give the job NAME=VALUE (or NAME, from this environment); repeatable.
        #[arg(long, value_name = "NAME[=VALUE]")]
        env: Vec<String>,
        /// Stream the job's output and exit with its exit code.
        #[arg(long)]
        attach: bool,
        #[arg(last = true, required = true, value_name = "CMD")]
        cmd: Vec<String>,
    },
    /// List the queue's jobs (unfinished ones and the 20 latest finished).
    Jobs {
        /// Every job, as JSON.
        #[arg(long)]
        json: bool,
        /// Every finished job too.
        #[arg(long)]
        all: bool,
    },
    /// Cancel a job: a queued one is dropped, a running one killed.
    Cancel { id: u64 },
    /// Print a job's output.
    Logs {
        id: u64,
        /// Keep printing until the job has finished.
        #[arg(long, short)]
        follow: bool,
    },
    /// Print your token for the queue's HTTP API.
    Token {
        /// Replace it with a new one.
        #[arg(long)]
        renew: bool,
    },
}

fn socket() -> PathBuf {
    std::env::var_os(gpushare_protocol::SOCKET_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| gpushare_protocol::DEFAULT_SOCKET.into())
}

/// `GPUSHARE_HOOK`, or libgpushare.so next to this executable (or in ../lib).
fn hook_path() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("GPUSHARE_HOOK") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no directory")?;
    for cand in [
        dir.join("libgpushare.so"),
        dir.join("../lib/libgpushare.so"),
    ] {
        if cand.is_file() {
            return Ok(std::fs::canonicalize(cand)?);
        }
    }
    bail!(
        "libgpushare.so is not next to {}; set GPUSHARE_HOOK to its path",
        exe.display()
    )
}

fn fetch_status() -> anyhow::Result<Report> {
    Ok(gpushare_protocol::status::fetch(&socket())?)
}

fn queue() -> anyhow::Result<QueueClient> {
    Ok(QueueClient::connect(&queue_socket())?)
}

/// `--env` entries as (name, value) pairs; a bare NAME takes this process's value.
fn env_pairs(entries: Vec<String>) -> anyhow::Result<Vec<(String, String)>> {
    entries
        .into_iter()
        .map(|e| match e.split_once('=') {
            Some((k, v)) => Ok((k.to_string(), v.to_string())),
            None => match std::env::var(&e) {
                Ok(v) => Ok((e, v)),
                Err(_) => bail!("--env {e}: {e} is not set here; give NAME=VALUE"),
            },
        })
        .collect()
}

fn jobs_table(jobs: &[JobView], all: bool) -> String {
    let mut out = format!(
        "{:>5} {:<16} {:<10} {:<10} {:>4} {:>5} {:>5} {:<8} {:>5} {:>9}  {}\n",
        "ID", "NAME", "USER", "STATE", "POS", "GPUS", "SHARE", "MODE", "PRIO", "TIMEOUT", "ON"
    );
    let finished: Vec<&JobView> = jobs.iter().filter(|j| j.finished()).collect();
    let keep_from = if all {
        0
    } else {
        finished.len().saturating_sub(20)
    };
    let shown = jobs
        .iter()
        .filter(|j| !j.finished() || finished[keep_from..].iter().any(|f| f.id == j.id));
    for j in shown {
        let on: Vec<String> = j.gpus.iter().map(u32::to_string).collect();
        out.push_str(&format!(
            "{:>5} {:<16} {:<10} {:<10} {:>4} {:>5} {:>5.2} {:<8} {:>5} {:>9}  {}\n",
            j.id,
            j.name.chars().take(16).collect::<String>(),
            j.user.chars().take(10).collect::<String>(),
            j.state,
            j.queue_position.map_or("-".into(), |p| p.to_string()),
            j.demand.gpus,
            j.demand.share,
            j.demand.wait_mode,
            j.demand.priority,
            j.demand
                .timeout_ns
                .map_or("-".into(), |t| format!("{:.0}s", t as f64 / 1e9)),
            if on.is_empty() {
                "-".into()
            } else {
                on.join(",")
            }
        ));
    }
    out
}

fn main() -> ExitCode {
    let result = match Cli::parse().cmd {
        Cmd::Run {
            group,
            request,
            limit,
            weight,
            memory,
            latency,
            cmd,
        } => (|| -> anyhow::Result<ExitCode> {
            let hook = hook_path()?;
            let mut c = Command::new(&cmd[0]);
            c.args(&cmd[1..]);
            let preload = match std::env::var("LD_PRELOAD") {
                Ok(old) if !old.is_empty() => format!("{}:{old}", hook.display()),
                _ => hook.display().to_string(),
            };
            c.env("LD_PRELOAD", preload).env("GPUSHARE_HOOK", &hook);
            if let Some(g) = group {
                if !(0.0..=1.0).contains(&request)
                    || !(request..=1.0).contains(&limit)
                    || weight <= 0.0
                {
                    bail!("need 0 <= --request <= --limit <= 1 and --weight > 0");
                }
                c.env("GPUSHARE_GROUP", g)
                    .env("GPUSHARE_REQUEST", request.to_string())
                    .env("GPUSHARE_LIMIT", limit.to_string())
                    .env("GPUSHARE_WEIGHT", weight.to_string());
                if let Some(m) = memory {
                    c.env("GPUSHARE_MEMORY", m.to_string());
                }
                if latency {
                    c.env("GPUSHARE_CLASS", "latency");
                }
            }
            let err = c.exec();
            bail!("cannot run {:?}: {err}", cmd[0])
        })(),
        Cmd::Status { json } => fetch_status().map(|r| {
            if json {
                println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
            } else {
                print!("{}", render(&r));
            }
            ExitCode::SUCCESS
        }),
        Cmd::Submit {
            name,
            gpus,
            share,
            limit,
            memory,
            latency,
            prefer,
            wait_mode,
            priority,
            timeout,
            retries,
            env,
            attach,
            cmd,
        } => (|| -> anyhow::Result<ExitCode> {
            let d = Demand::default();
            let submission = Submission {
                name,
                demand: Demand {
                    gpus: gpus.unwrap_or(d.gpus),
                    share: share.unwrap_or(d.share),
                    limit: limit.unwrap_or(d.limit),
                    memory,
                    latency,
                    prefer,
                    wait_mode: wait_mode.unwrap_or(d.wait_mode),
                    priority: priority.unwrap_or(d.priority),
                    timeout_ns: timeout,
                    retries: retries.unwrap_or(d.retries),
                },
                cmd,
                env: env_pairs(env)?,
                cwd: std::env::current_dir()
                    .ok()
                    .map(|p| p.display().to_string()),
            };
            let mut q = queue()?;
            let id = q.submit(submission)?;
            if !attach {
                println!("{id}");
                return Ok(ExitCode::SUCCESS);
            }
            eprintln!("gpushare: job {id} queued; its output follows");
            let job = q.logs(id, true, &mut std::io::stdout())?;
            Ok(ExitCode::from(job.exit_status()))
        })(),
        Cmd::Jobs { json, all } => (|| -> anyhow::Result<ExitCode> {
            let jobs = queue()?.jobs()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&jobs)?);
            } else {
                print!("{}", jobs_table(&jobs, all));
            }
            Ok(ExitCode::SUCCESS)
        })(),
        Cmd::Cancel { id } => (|| -> anyhow::Result<ExitCode> {
            let j = queue()?.cancel(id)?;
            println!("job {id}: {}", j.state);
            Ok(ExitCode::SUCCESS)
        })(),
        Cmd::Logs { id, follow } => (|| -> anyhow::Result<ExitCode> {
            let mut out = std::io::stdout();
            queue()?.logs(id, follow, &mut out)?;
            out.flush()?;
            Ok(ExitCode::SUCCESS)
        })(),
        Cmd::Token { renew } => (|| -> anyhow::Result<ExitCode> {
            println!("{}", queue()?.token(renew)?);
            Ok(ExitCode::SUCCESS)
        })(),
        Cmd::Top => (|| loop {
            let r = fetch_status()?;
            print!("\x1b[2J\x1b[H{}", render(&r));
            std::thread::sleep(Duration::from_secs(1));
        })(),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpushare: {e:#}");
            ExitCode::FAILURE
        }
    }
}
