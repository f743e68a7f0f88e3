//! `gpushare-queue`: the node job queue daemon, and its policies replayed in virtual time.

use clap::{Parser, Subcommand};
use gpushare_queue::core::Policy;
use gpushare_queue::replay::{ReplayParams, parse_range, replay};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gpushare-queue",
    version,
    about = "Job queue for shared GPUs: jobs run under gpushare with their share and memory"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

fn seconds(s: &str) -> Result<f64, String> {
    gpushare_units::parse_duration_ns(s).map(|ns| ns as f64 / 1e9)
}

#[derive(Subcommand)]
enum Cmd {
    /// The short-task experiment (Poisson arrivals, log-uniform runtimes, timeout = runtime,
    /// one GPU per job) in virtual time; prints mean_response_s and mean_finish_s.
    Replay {
        /// fifo, sjf, aging or shares.
        #[arg(long, value_parser = str::parse::<Policy>)]
        policy: Policy,
        /// Number of GPUs.
        #[arg(long, default_value_t = 1)]
        gpus: u32,
        /// Jobs per draw.
        #[arg(long, default_value_t = 20)]
        jobs: u32,
        /// Mean time between arrivals (e.g. 25s).
        #[arg(long, default_value = "25s", value_parser = seconds)]
        mean_interarrival: f64,
        /// log10 of the runtime in seconds is uniform on A:B.
        #[arg(long, default_value = "1:3", value_parser = parse_range)]
        runtime_log10: (f64, f64),
        /// Number of random draws (seeds 0..S), averaged.
        #[arg(long, default_value_t = 100)]
        seeds: u32,
        /// As `serve --max-jobs-per-gpu`.
        #[arg(long)]
        max_jobs_per_gpu: Option<u32>,
        /// One JSON object (with per-seed figures) instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().cmd {
        Cmd::Replay {
            policy,
            gpus,
            jobs,
            mean_interarrival,
            runtime_log10,
            seeds,
            max_jobs_per_gpu,
            json,
        } => (|| -> anyhow::Result<()> {
            let p = ReplayParams {
                policy,
                gpus,
                jobs,
                mean_interarrival_s: mean_interarrival,
                runtime_log10,
                seeds,
                max_jobs_per_gpu,
            };
            p.validate().map_err(anyhow::Error::msg)?;
            let r = replay(&p);
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "policy {}  gpus {}  jobs {}  seeds {}\nmean_response_s {:.1}\nmean_finish_s {:.1}\ntimed_out {}",
                    r.policy, r.gpus, r.jobs, r.seeds, r.mean_response_s, r.mean_finish_s, r.timed_out
                );
            }
            Ok(())
        })(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-queue: {e:#}");
            ExitCode::FAILURE
        }
    }
}
