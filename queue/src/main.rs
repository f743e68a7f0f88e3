//! `gpushare-queue`: the node job queue daemon, and its policies replayed in virtual time.

use clap::{Parser, Subcommand};
use gpushare_queue::core::{Policy, QueueConfig};
use gpushare_queue::daemon::{ServeOptions, serve};
use gpushare_queue::replay::{ReplayParams, parse_range, replay};
use gpushare_queue::shim::{ShimArgs, shim};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

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

fn duration(s: &str) -> Result<Duration, String> {
    gpushare_units::parse_duration_ns(s).map(Duration::from_nanos)
}

fn fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!("{s:?} is not a fraction in (0, 1], e.g. 0.9")),
    }
}

fn weight(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f.is_finite() && f >= 0.0 => Ok(f),
        _ => Err(format!("{s:?} is not a number >= 0")),
    }
}

fn at_least_one(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?} is not a whole number >= 1")),
    }
}

/// `gpushare` next to this executable, else the one on PATH.
fn default_gpushare() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("gpushare")))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| "gpushare".into())
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the queue: the CLI's Unix socket, and with --listen the HTTP API and web page.
    Serve {
        /// SQLite database of jobs and tokens; job logs go to a `jobs/` directory beside it.
        #[arg(
            long,
            value_name = "PATH",
            default_value = "/var/lib/gpushare/queue.db"
        )]
        db: PathBuf,
        /// Unix socket for `gpushare submit/jobs/cancel/logs/token` [default: $GPUSHARE_QUEUE_SOCKET or /run/gpushare/queue.sock].
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Serve the web page and HTTP API at ADDR (e.g. 127.0.0.1:9480).
        #[arg(long, value_name = "ADDR")]
        listen: Option<SocketAddr>,
        /// fifo, sjf, aging or shares.
        #[arg(long, default_value = "aging", value_parser = str::parse::<Policy>)]
        policy: Policy,
        /// At most N of the queue's jobs per GPU [default: no limit; 4 jobs started beside others under shares].
        #[arg(long, value_name = "N", value_parser = at_least_one)]
        max_jobs_per_gpu: Option<u32>,
        /// A GPU whose memory in use (the scheduler's books) reaches this fraction takes no job.
        #[arg(long, value_name = "F", default_value = "0.9", value_parser = fraction)]
        memory_threshold: f64,
        /// α of P = α·p − β·T − γ·t (aging, shares).
        #[arg(long, default_value = "10000", value_parser = weight)]
        alpha: f64,
        /// β of P = α·p − β·T − γ·t.
        #[arg(long, default_value = "1", value_parser = weight)]
        beta: f64,
        /// γ of P = α·p − β·T − γ·t.
        #[arg(long, default_value = "1", value_parser = weight)]
        gamma: f64,
        /// The scheduler's socket [default: $GPUSHARE_SOCKET or /run/gpushare/gpushare.sock].
        #[arg(long, value_name = "PATH")]
        scheduler_socket: Option<PathBuf>,
        /// The gpushare command jobs run under [default: next to gpushare-queue, else on PATH].
        #[arg(long, value_name = "PATH")]
        gpushare: Option<PathBuf>,
        /// Variables of the daemon's environment jobs inherit (comma-separated, repeatable),
        /// e.g. LD_LIBRARY_PATH.
        #[arg(long, value_name = "NAMES", value_delimiter = ',')]
        pass_env: Vec<String>,
        /// Between SIGTERM and SIGKILL when a job is killed.
        #[arg(long, value_name = "D", default_value = "5s", value_parser = duration)]
        kill_grace: Duration,
        /// How often the scheduler's books are read.
        #[arg(long, value_name = "D", default_value = "1s", value_parser = duration)]
        books_interval: Duration,
    },
    /// Supervise one run of a job (started by `serve`).
    #[command(hide = true)]
    Shim {
        #[arg(long)]
        exit_file: PathBuf,
        #[arg(long)]
        uid: u32,
        #[arg(long)]
        gid: u32,
        #[arg(long, value_delimiter = ',')]
        groups: Vec<u32>,
        #[arg(long)]
        cwd: PathBuf,
        #[arg(long)]
        home: PathBuf,
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
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
    let cli = Cli::parse();
    if let Cmd::Shim {
        exit_file,
        uid,
        gid,
        groups,
        cwd,
        home,
        cmd,
    } = cli.cmd
    {
        return shim(ShimArgs {
            exit_file,
            uid,
            gid,
            groups,
            cwd,
            home,
            cmd,
        });
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("GPUSHARE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.cmd {
        Cmd::Shim { .. } => unreachable!("handled above"),
        Cmd::Serve {
            db,
            socket,
            listen,
            policy,
            max_jobs_per_gpu,
            memory_threshold,
            alpha,
            beta,
            gamma,
            scheduler_socket,
            gpushare,
            pass_env,
            kill_grace,
            books_interval,
        } => (|| -> anyhow::Result<()> {
            let gpus = gpushare_queue::gpus::discover().map_err(anyhow::Error::msg)?;
            let opts = ServeOptions {
                db,
                socket: socket.unwrap_or_else(gpushare_queue_protocol::queue_socket),
                listen,
                scheduler_socket: scheduler_socket.unwrap_or_else(|| {
                    std::env::var_os(gpushare_protocol::SOCKET_ENV)
                        .map(PathBuf::from)
                        .unwrap_or_else(|| gpushare_protocol::DEFAULT_SOCKET.into())
                }),
                gpushare: gpushare.unwrap_or_else(default_gpushare),
                pass_env,
                kill_grace,
                books_interval,
                config: QueueConfig {
                    policy,
                    max_jobs_per_gpu,
                    memory_threshold,
                    alpha,
                    beta,
                    gamma,
                },
            };
            serve(opts, gpus)
        })(),
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
                    r.policy,
                    r.gpus,
                    r.jobs,
                    r.seeds,
                    r.mean_response_s,
                    r.mean_finish_s,
                    r.timed_out
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
