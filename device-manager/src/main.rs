//! `gpushare-device-manager`: Kubernetes node agent (device plugin, per-pod quotas).

use clap::Parser;
use gpushare_device_manager::manager::{Options, run};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gpushare-device-manager",
    version,
    about = "gpushare's Kubernetes node agent: the gpushare.io/gpu-share device plugin, and pod quotas from annotations pushed to gpushare-scheduler"
)]
struct Cli {
    #[command(flatten)]
    opts: Options,
}

fn main() -> ExitCode {
    let Cli { opts } = Cli::parse();
    let agent = opts.agent.clone();
    gpushare_device_manager::agent::main("gpushare-device-manager", &agent, || run(opts))
}
