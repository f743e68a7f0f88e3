//! `gpushare-bench`'s command line (the work is in the `gpushare_bench` library).

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use gpushare_bench::noise::{self, NoiseParams};
use gpushare_bench::scenario::Scenario;
use gpushare_bench::settings::{Settings, Source};
use gpushare_bench::{memory, progress, real_gpu, suite, tail};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gpushare-bench",
    about = "Fairness and overhead benchmark, on the simulated GPU or this machine's GPUs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one scenario (with gpushare, then natively as the baseline), --repeat times each.
    Run {
        scenario: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// Shorten the scenario to 3 s.
        #[arg(long)]
        quick: bool,
        /// Also measure launch overhead.
        #[arg(long)]
        overhead: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Run every scenario in --scenarios (default: bench/scenarios) and the launch overhead.
    Suite {
        #[arg(long)]
        out: PathBuf,
        /// 3 s per scenario, scenarios marked full_only skipped.
        #[arg(long)]
        quick: bool,
        #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios"))]
        scenarios: PathBuf,
        /// Only scenarios whose name contains one of these (repeatable).
        #[arg(long)]
        only: Vec<String>,
        #[command(flatten)]
        common: Common,
    },
    /// The latency tail table: latency-class servers beside trainers over request rates and
    /// kernel sizes, against native time-slicing and the server alone (docs/benchmarks.md).
    Tail {
        #[arg(long)]
        out: PathBuf,
        /// 3 s per run instead of 6.
        #[arg(long)]
        quick: bool,
        #[command(flatten)]
        common: Common,
    },
    /// GPU memory beyond the card: four tenants whose working sets grow and shrink in phases
    /// (peaks 1.8x an 80 GiB simulated GPU) with caps overcommitted 2x, against the same four one
    /// after another and under static caps of 20 GiB each (docs/benchmarks.md).
    MemoryOvercommit {
        #[arg(long)]
        out: PathBuf,
        /// Runs of each of the three.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
        repeat: u32,
        /// The small version of the tests (a 4 GiB GPU, seconds per run).
        #[arg(long)]
        small: bool,
    },
    /// A CPU hog of the noisy-host mode: spins on one core until killed or PARENT dies.
    #[command(hide = true)]
    Hog {
        #[arg(long)]
        parent: u32,
    },
}

/// Options of both `run` and `suite`.
#[derive(clap::Args, Clone, Copy)]
struct Common {
    /// Runs of each scenario, with gpushare and natively each; the report gives min / median /
    /// max over them.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
    /// Skip the native (no gpushare) baseline runs.
    #[arg(long)]
    no_baseline: bool,
    /// Skip running each tenant alone (throughput and latency vs alone).
    #[arg(long)]
    no_alone: bool,
    /// Keep the scheduler's log of its decisions and of every turn's report (with its clock,
    /// CLOCK_MONOTONIC ns, as the trace's) next to each run's trace: NAME-runK.scheduler.log.
    #[arg(long)]
    scheduler_log: bool,
    #[command(flatten)]
    gpu: GpuOpts,
    #[command(flatten)]
    noise: NoiseOpts,
}

/// Which GPU, and where the figures come from.
#[derive(clap::Args, Clone, Copy)]
struct GpuOpts {
    /// Where the figures come from: `device`, the simulated device's trace (exact; the default
    /// on the simulator), or `events`, each tenant's CUDA timing events (the only source on a
    /// real GPU; on the simulator the device trace's figures are reported next to them).
    #[arg(long, value_enum)]
    source: Option<Source>,
    /// Run on the simulated GPU even on a machine with a real one (by default the benchmark runs
    /// on the GPUs `libcuda.so.1` reports).
    #[arg(long)]
    simulated: bool,
}

/// The noisy-host mode.
#[derive(clap::Args, Clone, Copy)]
struct NoiseOpts {
    /// Disturb every run: CPU hog(s) and random stalls (SIGSTOP/SIGCONT) of the tenants and the
    /// scheduler, from a seed (see --noise-seed and the stall options).
    #[arg(long)]
    noisy: bool,
    /// Seed of the stall sequences (the same seed gives the same stalls).
    #[arg(long, default_value_t = 1, requires = "noisy")]
    noise_seed: u64,
    /// CPU hog processes, each spinning on one core for the whole run.
    #[arg(long, default_value_t = 1, requires = "noisy")]
    hogs: u32,
    /// Mean time between stalls (ms; exponential: a Poisson process).
    #[arg(long, default_value_t = 50.0, requires = "noisy")]
    stall_mean_interval_ms: f64,
    /// Shortest stall (ms); stall durations are uniform in [min, max].
    #[arg(long, default_value_t = 0.1, requires = "noisy")]
    stall_min_ms: f64,
    /// Longest stall (ms).
    #[arg(long, default_value_t = 5.0, requires = "noisy")]
    stall_max_ms: f64,
}

impl NoiseOpts {
    fn resolve(self) -> anyhow::Result<Option<NoiseParams>> {
        if !self.noisy {
            return Ok(None);
        }
        let p = NoiseParams {
            seed: self.noise_seed,
            hogs: self.hogs,
            stall_mean_interval_ms: self.stall_mean_interval_ms,
            stall_min_ms: self.stall_min_ms,
            stall_max_ms: self.stall_max_ms,
        };
        p.validate().map_err(anyhow::Error::msg)?;
        Ok(Some(p))
    }
}

impl GpuOpts {
    /// Where the figures come from, and this machine's GPU count when running on them.
    fn resolve(self) -> anyhow::Result<(Source, Option<u32>)> {
        let system = if self.simulated {
            None
        } else {
            real_gpu::device_count()
        };
        Ok(match (system, self.source) {
            (Some(_), Some(Source::Device)) => bail!(
                "--source device needs the simulated GPU: this machine has a real one (add --simulated)"
            ),
            (Some(n), _) => {
                progress(format!(
                    "running on this machine's {n} GPU(s) (libcuda.so.1), measuring from the \
                     tenants' CUDA timing events (--simulated: use the simulated GPU instead)"
                ));
                (Source::Events, system)
            }
            (None, source) => (source.unwrap_or(Source::Device), None),
        })
    }
}

impl Common {
    fn settings(self, quick: bool, overhead: bool) -> anyhow::Result<Settings> {
        let (source, system_gpus) = self.gpu.resolve()?;
        Ok(Settings {
            quick,
            repeat: self.repeat,
            baseline: !self.no_baseline,
            overhead,
            alone: !self.no_alone,
            source,
            system_gpus,
            noise: self.noise.resolve()?,
            scheduler_log: self.scheduler_log,
        })
    }
}

fn main() -> ExitCode {
    let r = match Cli::parse().cmd {
        Cmd::Run {
            scenario,
            out,
            quick,
            overhead,
            common,
        } => Scenario::load(&scenario)
            .and_then(|sc| suite::bench(vec![sc], &out, &common.settings(quick, overhead)?)),
        Cmd::Suite {
            out,
            quick,
            scenarios,
            only,
            common,
        } => load_dir(&scenarios).and_then(|all| {
            let list = all
                .into_iter()
                .filter(|s| !(quick && s.full_only))
                .filter(|s| only.is_empty() || only.iter().any(|o| s.name.contains(o.as_str())))
                .collect();
            suite::bench(list, &out, &common.settings(quick, true)?)
        }),
        Cmd::Tail { out, quick, common } => common
            .settings(quick, false)
            .and_then(|s| tail::bench(&out, &s)),
        Cmd::MemoryOvercommit { out, repeat, small } => {
            let p = if small {
                memory::Params::small()
            } else {
                memory::Params::full()
            };
            memory::bench(&p, &out, repeat).map(|s| print!("{}", s.markdown()))
        }
        Cmd::Hog { parent } => noise::hog(parent),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load_dir(dir: &Path) -> anyhow::Result<Vec<Scenario>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    files.iter().map(|p| Scenario::load(p)).collect()
}
