//! `gpushare-extender`: the kube-scheduler extender (`serve`) and the policies' replay
//! (`replay`).

use clap::{Parser, Subcommand};
use gpushare_extender::replay::{self, ReplayArgs};
use gpushare_extender::serve;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gpushare-extender",
    version,
    about = "gpushare's kube-scheduler extender: places pods on the GPU whose books (units, memory caps, measured use) can take them"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve kube-scheduler's extender calls (filter, prioritize, bind).
    Serve(serve::ServeArgs),
    /// Replay the placement policies on a workload in virtual time; medians over seeds.
    Replay(ReplayArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(a) => {
            gpushare_logging::init("info", std::io::stderr);
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("gpushare-extender: cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(serve::run(a)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("gpushare-extender: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Replay(a) => {
            let summary = replay::run(&a);
            if a.json {
                println!("{}", serde_json::to_string(&summary).unwrap_or_default());
            } else {
                let (o, lo, hi) = (&summary.median, &summary.min, &summary.max);
                println!(
                    "{} {} overprov {}%: pending mean {:.1} s ({:.1}–{:.1}), p99 {:.1} s; completion p99 {:.1} s ({:.1}–{:.1}); memory used {:.3}; GPU busy {:.3}; out-of-memory {} ({}–{}); unallocated GPU fragments at peak {:.2} ({:.2}–{:.2}); never placed {} ({}–{}) (medians of {} seeds, smallest–largest in brackets)",
                    a.policy.name(),
                    a.workload.to_possible_value_name(),
                    a.overprov,
                    o.pending_mean_s,
                    lo.pending_mean_s,
                    hi.pending_mean_s,
                    o.pending_p99_s,
                    o.jct_p99_s,
                    lo.jct_p99_s,
                    hi.jct_p99_s,
                    o.memory_used_frac,
                    o.gpu_busy_frac,
                    o.oom,
                    lo.oom,
                    hi.oom,
                    o.unallocated_gpus_peak,
                    lo.unallocated_gpus_peak,
                    hi.unallocated_gpus_peak,
                    o.unplaced,
                    lo.unplaced,
                    hi.unplaced,
                    a.seeds
                );
            }
            ExitCode::SUCCESS
        }
    }
}
