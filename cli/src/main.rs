//! `gpushare`: run programs under the hook, and see what the scheduler sees.

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use gpushare_protocol::{ClientMsg, PROTOCOL_VERSION, ServerMsg};
use gpushare_scheduler::status::{Report, render};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Duration;

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
    let path = socket();
    let mut s = UnixStream::connect(&path).with_context(|| {
        format!("cannot reach gpushare-scheduler at {}; is it running? (set GPUSHARE_SOCKET if it listens elsewhere)", path.display())
    })?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    gpushare_protocol::send(
        &mut s,
        &ClientMsg::Hello {
            version: PROTOCOL_VERSION,
            declared: None,
        },
    )?;
    gpushare_protocol::send(&mut s, &ClientMsg::Status)?;
    let mut buf = Vec::new();
    loop {
        match gpushare_protocol::recv::<ServerMsg>(&mut s, &mut buf)? {
            Some(ServerMsg::Status { json }) => return Ok(serde_json::from_str(&json)?),
            Some(ServerMsg::Error { message, .. }) => bail!("scheduler: {message}"),
            Some(_) => continue,
            None => bail!("the scheduler closed the connection"),
        }
    }
}

fn main() -> ExitCode {
    let result = match Cli::parse().cmd {
        Cmd::Run {
            group,
            request,
            limit,
            weight,
            memory,
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
