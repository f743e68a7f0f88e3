//! `gpushare-dra`: the Kubernetes DRA driver `gpushare.io` (each GPU a shareable device).

use clap::Parser;
use gpushare_device_manager::dra::driver::{Options, run};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gpushare-dra",
    version,
    about = "gpushare's Kubernetes DRA driver gpushare.io: each GPU a device with share and memory capacities that many claims take parts of; each prepared claim's containers get its share, memory cap, limit and weight from gpushare-scheduler"
)]
struct Cli {
    #[command(flatten)]
    opts: Options,
}

fn main() -> ExitCode {
    let Cli { opts } = Cli::parse();
    let agent = opts.agent.clone();
    gpushare_device_manager::agent::main("gpushare-dra", &agent, || run(opts))
}
