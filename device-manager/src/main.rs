//! `gpushare-device-manager`: Kubernetes node agent (device plugin, per-pod quotas).

use clap::Parser;
use gpushare_device_manager::allocation::{Placement, Preload};
use gpushare_device_manager::manager::{Options, run};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gpushare-device-manager",
    version,
    about = "gpushare's Kubernetes node agent: the gpushare.io/gpu-share device plugin, and pod quotas from annotations pushed to gpushare-scheduler"
)]
struct Cli {
    /// This node's name (pods are watched with spec.nodeName=NAME) [default: $NODE_NAME].
    #[arg(
        long,
        env = "NODE_NAME",
        value_name = "NAME",
        required_unless_present = "list_gpus"
    )]
    node_name: Option<String>,
    /// The kubelet's device-plugin directory (kubelet.sock; our gpushare.sock goes there).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    device_plugin_dir: PathBuf,
    /// The kubelet's PodResources socket.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/var/lib/kubelet/pod-resources/kubelet.sock"
    )]
    pod_resources_socket: PathBuf,
    /// gpushare-scheduler's admin socket (its --admin-socket).
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/run/gpushare-admin/admin.sock"
    )]
    scheduler_socket: PathBuf,
    /// gpushare-scheduler's tenant socket on the host (its --socket); Allocate mounts its
    /// directory into containers at the same path and sets GPUSHARE_SOCKET.
    #[arg(long, value_name = "PATH", default_value = gpushare_protocol::DEFAULT_SOCKET)]
    tenant_socket: PathBuf,
    /// Kubeconfig file for the API server [default: in-cluster config, else $KUBECONFIG].
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// Units of gpushare.io/gpu-share per GPU.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    units_per_gpu: u32,
    /// Which GPU a request's units come from: binpack (fullest that fits) or spread (emptiest).
    #[arg(long, value_enum, default_value = "binpack")]
    placement: Placement,
    /// libgpushare.so to install for containers.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/usr/lib/gpushare/libgpushare.so"
    )]
    hook_library: PathBuf,
    /// Host directory of the versioned hook copies (<DIR>/<version>/libgpushare.so).
    #[arg(long, value_name = "DIR", default_value = "/var/lib/gpushare/lib")]
    hook_dir: PathBuf,
    /// How the hook is injected: ld-preload (LD_PRELOAD variable) or ld-so-preload (a
    /// read-only /etc/ld.so.preload mount).
    #[arg(long, value_enum, default_value = "ld-preload")]
    preload: Preload,
    /// Also hand out each GPU as the CDI device KIND=<UUID> (e.g. nvidia.com/gpu).
    #[arg(long, value_name = "KIND")]
    cdi_kind: Option<String>,
    /// Serve Prometheus metrics at ADDR (e.g. 0.0.0.0:9401).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// How often GPUs are looked for (a GPU that disappears turns Unhealthy).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = duration)]
    health_interval: std::time::Duration,
    /// How often PodResources is read besides after each allocation and pod change.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = duration)]
    pod_resources_interval: std::time::Duration,
    /// Print the GPUs the CUDA driver reports, as JSON, and exit.
    #[arg(long)]
    list_gpus: bool,
}

fn duration(s: &str) -> Result<std::time::Duration, String> {
    gpushare_units::parse_duration_ns(s).map(std::time::Duration::from_nanos)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("GPUSHARE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    if cli.list_gpus {
        return match gpushare_device_manager::discovery::list_gpus() {
            Ok(gpus) => {
                println!("{}", serde_json::to_string(&gpus).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!(
                    "gpushare-device-manager: {e}; is the NVIDIA driver installed and libcuda.so.1 on the library path?"
                );
                ExitCode::FAILURE
            }
        };
    }
    let opts = Options {
        node_name: cli.node_name.unwrap_or_default(),
        device_plugin_dir: cli.device_plugin_dir,
        pod_resources_socket: cli.pod_resources_socket,
        scheduler_socket: cli.scheduler_socket,
        tenant_socket: cli.tenant_socket,
        kubeconfig: cli.kubeconfig,
        units_per_gpu: cli.units_per_gpu,
        placement: cli.placement,
        hook_library: cli.hook_library,
        hook_dir: cli.hook_dir,
        preload: cli.preload,
        cdi_kind: cli.cdi_kind,
        metrics: cli.metrics,
        health_interval: cli.health_interval,
        pod_resources_interval: cli.pod_resources_interval,
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpushare-device-manager: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(opts)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-device-manager: {e:#}");
            ExitCode::FAILURE
        }
    }
}
