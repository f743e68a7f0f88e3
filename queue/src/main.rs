//! `gpushare-queue`: the node job queue daemon, and its policies replayed in virtual time.

use clap::{Parser, Subcommand};
use gpushare_queue::core::{OvercommitAdmission, Policy, QueueConfig};
use gpushare_queue::daemon::{ServeOptions, serve};
use gpushare_queue::memory_replay::{MemoryReplayParams, Mix, SwapCost, replay as memory_replay};
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

fn overcommit(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f.is_finite() && f >= 1.0 => Ok(f),
        _ => Err(format!(
            "{s:?} is not a ratio >= 1 (e.g. 1.5: caps may sum to 1.5 times a GPU's memory)"
        )),
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
        /// Jobs' memory caps on a GPU may sum to R times its memory (run the scheduler with
        /// the same --memory-overcommit, so that it swaps jobs to host memory rather than fail
        /// them when they use it all at once).
        #[arg(long, value_name = "R", default_value = "1", value_parser = overcommit)]
        memory_overcommit: f64,
        /// With --memory-overcommit above 1, which jobs start on caps past a GPU's own memory:
        /// `caps` (any whose cap fits in R times it) or `gpu-time` (only while the GPU time
        /// measured in use there plus the job's --limit is at most the whole GPU).
        #[arg(long, value_name = "A", default_value = "caps", value_parser = str::parse::<OvercommitAdmission>)]
        overcommit_admission: OvercommitAdmission,
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
    /// The queue in virtual time. `--workload short-tasks`: the aging paper's experiment
    /// (Poisson arrivals, log-uniform runtimes, timeout = runtime, one whole GPU per job);
    /// prints mean_response_s and mean_finish_s. `--workload memory`: jobs whose memory grows
    /// and shrinks, with caps held to the GPU and overcommitted (--memory-overcommit R):
    /// completion time, memory utilisation, swaps and their cost, out-of-memory errors.
    Replay(ReplayArgs),
}

/// The flags of `replay`.
#[derive(clap::Args)]
struct ReplayArgs {
    /// short-tasks or memory.
    #[arg(long, default_value = "short-tasks", value_parser = ["short-tasks", "memory"])]
    workload: String,
    /// fifo, sjf, aging or shares.
    #[arg(long, value_parser = str::parse::<Policy>)]
    policy: Policy,
    /// Number of GPUs.
    #[arg(long, default_value_t = 1)]
    gpus: u32,
    /// Jobs per draw [default: 20 short tasks, 40 memory jobs].
    #[arg(long)]
    jobs: Option<u32>,
    /// Mean time between arrivals [default: 25s short tasks, 240s memory jobs].
    #[arg(long, value_parser = seconds)]
    mean_interarrival: Option<f64>,
    /// log10 of the runtime in seconds is uniform on A:B [default: 1:3 short tasks, 2:3
    /// memory jobs].
    #[arg(long, value_parser = parse_range)]
    runtime_log10: Option<(f64, f64)>,
    /// Number of random draws (seeds 0..S), averaged [default: 100 short tasks, 20 memory].
    #[arg(long)]
    seeds: Option<u32>,
    /// As `serve --max-jobs-per-gpu`.
    #[arg(long)]
    max_jobs_per_gpu: Option<u32>,
    /// Memory jobs: which jobs. `synthetic`: Poisson arrivals, phases at a peak or a base, on
    /// 80 GiB GPUs (--gpu-demand, --mean-interarrival, --runtime-log10 shape it). `seed002`:
    /// the resource-aware scheduling work's measured engines and arrivals on its V100, memory
    /// requests over-provisioned by --overprov.
    #[arg(long, value_parser = ["synthetic", "seed002"])]
    mix: Option<String>,
    /// Memory jobs, `--mix seed002`: each engine asks for its measured peak over-provisioned by
    /// PCT percent [default: 100].
    #[arg(long, value_name = "PCT")]
    overprov: Option<u32>,
    /// Memory jobs, overcommitted: which jobs start on caps past the GPU's memory, `caps` or
    /// `gpu-time` (as `serve --overcommit-admission`) [default: caps].
    #[arg(long, value_name = "A", value_parser = str::parse::<OvercommitAdmission>)]
    overcommit_admission: Option<OvercommitAdmission>,
    /// Memory jobs: their caps may sum to R times each GPU's memory [default: 2].
    #[arg(long, value_name = "R", value_parser = overcommit)]
    memory_overcommit: Option<f64>,
    /// Memory jobs: the fraction of a GPU's time one can use alone is uniform on A:B
    /// [default: 0.3:0.7].
    #[arg(long, value_name = "A:B", value_parser = parse_range)]
    gpu_demand: Option<(f64, f64)>,
    /// Memory jobs: how fast a checkpoint moves a job's memory to host memory [default:
    /// 1.5GB/s].
    #[arg(long, value_name = "RATE", value_parser = gpushare_units::parse_rate)]
    checkpoint_bandwidth: Option<u64>,
    /// Memory jobs: how fast a restore moves it back [default: 4.4GB/s].
    #[arg(long, value_name = "RATE", value_parser = gpushare_units::parse_rate)]
    restore_bandwidth: Option<u64>,
    /// Memory jobs: fixed cost of each checkpoint and restore [default: 100ms].
    #[arg(long, value_name = "D", value_parser = seconds)]
    checkpoint_latency: Option<f64>,
    /// One JSON object (with per-seed figures) instead of text.
    #[arg(long)]
    json: bool,
}

/// `replay --workload memory`.
fn replay_memory(a: ReplayArgs) -> anyhow::Result<()> {
    if a.max_jobs_per_gpu.is_some() {
        anyhow::bail!(
            "--max-jobs-per-gpu is for --workload short-tasks; memory jobs are limited by their caps"
        );
    }
    let r = a.memory_overcommit.unwrap_or(2.0);
    let d = match a.mix.as_deref() {
        Some("seed002") => {
            if a.gpu_demand.is_some() || a.mean_interarrival.is_some() || a.runtime_log10.is_some()
            {
                anyhow::bail!(
                    "--gpu-demand, --mean-interarrival and --runtime-log10 are for --mix synthetic; \
                     seed002's engines bring their own"
                );
            }
            MemoryReplayParams::seed002(a.policy, r, a.overprov.unwrap_or(100))
        }
        _ if a.overprov.is_some() => anyhow::bail!("--overprov is for --mix seed002"),
        _ => MemoryReplayParams::new(a.policy, r),
    };
    let p = MemoryReplayParams {
        admission: a.overcommit_admission.unwrap_or(d.admission),
        gpus: a.gpus,
        jobs: a.jobs.unwrap_or(d.jobs),
        mean_interarrival_s: a.mean_interarrival.unwrap_or(d.mean_interarrival_s),
        runtime_log10: a.runtime_log10.unwrap_or(d.runtime_log10),
        seeds: a.seeds.unwrap_or(d.seeds),
        gpu_demand: a.gpu_demand.unwrap_or(d.gpu_demand),
        swap: SwapCost {
            latency_s: a.checkpoint_latency.unwrap_or(d.swap.latency_s),
            checkpoint_bytes_per_s: a
                .checkpoint_bandwidth
                .map_or(d.swap.checkpoint_bytes_per_s, |b| b as f64),
            restore_bytes_per_s: a
                .restore_bandwidth
                .map_or(d.swap.restore_bytes_per_s, |b| b as f64),
        },
        ..d
    };
    p.validate().map_err(anyhow::Error::msg)?;
    let r = memory_replay(&p);
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    match r.mix {
        Mix::Synthetic => println!(
            "mix synthetic  policy {}  gpus {}  jobs {}  seeds {}  gpu demand {}:{}",
            r.policy, r.gpus, r.jobs, r.seeds, r.gpu_demand.0, r.gpu_demand.1
        ),
        Mix::Seed002 { overprov_pct } => println!(
            "mix seed002 (requests +{overprov_pct} %)  policy {}  gpus {}  jobs {}  seeds {}",
            r.policy, r.gpus, r.jobs, r.seeds
        ),
    }
    println!(
        "{:>44} {:>14} {:>8} {:>12} {:>10} {:>10} {:>10} {:>10} {:>6}",
        "caps",
        "completion_s",
        "wait_s",
        "memory_util",
        "gpu_util",
        "swap_outs",
        "swap_GiB",
        "swap_s",
        "OOM"
    );
    let one = &r.one_at_a_time;
    for (name, m) in [
        ("", &r.static_caps),
        ("", &r.overcommitted),
        ("1 job at a time, ", one),
    ] {
        println!(
            "{:>44} {:>14.1} {:>8.1} {:>12.3} {:>10.3} {:>10.1} {:>10.1} {:>10.1} {:>6}",
            format!(
                "{name}{} x GPU (caps {:.2}x, peaks {:.2}x)",
                m.memory_overcommit, m.max_caps_over_memory, m.max_peaks_over_memory
            ),
            m.mean_completion_s,
            m.mean_wait_s,
            m.memory_utilisation,
            m.gpu_utilisation,
            m.swap_outs,
            m.swapped_gib,
            m.swap_seconds,
            m.out_of_memory
        );
    }
    let (lo, hi) = r.reduction_range();
    println!(
        "completion {:+.1} % (draws {:+.1} to {:+.1} %), memory utilisation {:+.1} %",
        -100.0 * r.completion_reduction,
        -100.0 * hi,
        -100.0 * lo,
        100.0 * r.memory_utilisation_gain
    );
    println!(
        "against one job at a time: completion {:+.1} %, memory utilisation {:+.1} %",
        -100.0 * r.completion_reduction_vs_one_at_a_time,
        100.0 * r.memory_utilisation_gain_vs_one_at_a_time
    );
    Ok(())
}

/// `replay --workload short-tasks`.
fn replay_short_tasks(a: ReplayArgs) -> anyhow::Result<()> {
    let memory_flags = a.memory_overcommit.is_some()
        || a.overcommit_admission.is_some()
        || a.gpu_demand.is_some()
        || a.mix.is_some()
        || a.overprov.is_some()
        || a.checkpoint_bandwidth.is_some()
        || a.restore_bandwidth.is_some()
        || a.checkpoint_latency.is_some();
    if memory_flags {
        anyhow::bail!(
            "--memory-overcommit, --overcommit-admission, --mix, --overprov, --gpu-demand and the checkpoint flags are for --workload memory"
        );
    }
    let d = ReplayParams::paper(a.policy, a.gpus, 100);
    let p = ReplayParams {
        jobs: a.jobs.unwrap_or(d.jobs),
        mean_interarrival_s: a.mean_interarrival.unwrap_or(d.mean_interarrival_s),
        runtime_log10: a.runtime_log10.unwrap_or(d.runtime_log10),
        seeds: a.seeds.unwrap_or(d.seeds),
        max_jobs_per_gpu: a.max_jobs_per_gpu,
        ..d
    };
    p.validate().map_err(anyhow::Error::msg)?;
    let r = replay(&p);
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "policy {}  gpus {}  jobs {}  seeds {}\nmean_response_s {:.1}\nmean_finish_s {:.1}\ntimed_out {}",
            r.policy, r.gpus, r.jobs, r.seeds, r.mean_response_s, r.mean_finish_s, r.timed_out
        );
    }
    Ok(())
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
    gpushare_logging::init("info", std::io::stderr);
    let result = match cli.cmd {
        Cmd::Shim { .. } => unreachable!("handled above"),
        Cmd::Serve {
            db,
            socket,
            listen,
            policy,
            max_jobs_per_gpu,
            memory_threshold,
            memory_overcommit,
            overcommit_admission,
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
                    memory_overcommit,
                    overcommit_admission,
                },
            };
            serve(opts, gpus)
        })(),
        Cmd::Replay(a) if a.workload == "memory" => replay_memory(a),
        Cmd::Replay(a) => replay_short_tasks(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-queue: {e:#}");
            ExitCode::FAILURE
        }
    }
}
