//! What both node agents (`gpushare-device-manager`, the device plugin, and `gpushare-dra`,
//! the DRA driver) share: the settings for the node, the scheduler and the hook
//! ([`AgentArgs`]); their `main` ([`main`]: logging, `--list-gpus`, the runtime); their start
//! (the hook installed, [`install_hook`]; the first GPUs found, [`first_gpus`]); and the GPUs
//! as discovery keeps looking for them ([`Gpus`], [`watch_gpus`]).

use crate::injection::{Injection, Preload};
use crate::inventory::Gpu;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// The command-line settings both agents take.
#[derive(clap::Args, Debug, Clone)]
pub struct AgentArgs {
    /// This node's name (pods are watched with spec.nodeName=NAME) [default: $NODE_NAME].
    #[arg(
        long,
        env = "NODE_NAME",
        value_name = "NAME",
        required_unless_present = "list_gpus"
    )]
    pub node_name: Option<String>,
    /// gpushare-scheduler's admin socket (its --admin-socket).
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/run/gpushare-admin/admin.sock"
    )]
    pub scheduler_socket: PathBuf,
    /// gpushare-scheduler's tenant socket on the host (its --socket); containers get its
    /// directory mounted at the same path and GPUSHARE_SOCKET set.
    #[arg(long, value_name = "PATH", default_value = gpushare_protocol::DEFAULT_SOCKET)]
    pub tenant_socket: PathBuf,
    /// Kubeconfig file for the API server [default: in-cluster config, else $KUBECONFIG].
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// Share units per GPU: units of gpushare.io/gpu-share (device plugin), the `share`
    /// capacity of each GPU (DRA).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub units_per_gpu: u32,
    /// libgpushare.so to install for containers.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/usr/lib/gpushare/libgpushare.so"
    )]
    pub hook_library: PathBuf,
    /// Host directory of the versioned hook copies (`<DIR>/<version>/libgpushare.so`).
    #[arg(long, value_name = "DIR", default_value = "/var/lib/gpushare/lib")]
    pub hook_dir: PathBuf,
    /// How the hook is injected: ld-preload (LD_PRELOAD variable) or ld-so-preload (a
    /// read-only /etc/ld.so.preload mount).
    #[arg(long, value_enum, default_value = "ld-preload")]
    pub preload: Preload,
    /// Also hand out each GPU as the CDI device `KIND=<UUID>` (e.g. nvidia.com/gpu).
    #[arg(long, value_name = "KIND")]
    pub cdi_kind: Option<String>,
    /// How often GPUs are looked for (a GPU that disappears is no longer offered).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = duration)]
    pub health_interval: Duration,
    /// Print the GPUs the CUDA driver reports, as JSON, and exit.
    #[arg(long)]
    pub list_gpus: bool,
}

impl AgentArgs {
    /// `--node-name` (present unless `--list-gpus`, which never gets this far).
    pub fn node(&self) -> &str {
        self.node_name.as_deref().unwrap_or_default()
    }
}

/// A duration flag (`10s`, `200ms`).
pub fn duration(s: &str) -> Result<std::time::Duration, String> {
    gpushare_units::parse_duration_ns(s).map(std::time::Duration::from_nanos)
}

/// An agent's `main`: logging from `$GPUSHARE_LOG`, `--list-gpus` (GPU discovery runs the
/// agent's own binary with it), else `run` on a two-thread runtime until it fails.
pub fn main<F: Future<Output = anyhow::Result<()>>>(
    name: &str,
    args: &AgentArgs,
    run: impl FnOnce() -> F,
) -> ExitCode {
    gpushare_logging::init("info", std::io::stderr);
    if args.list_gpus {
        return match crate::discovery::list_gpus() {
            Ok(gpus) => {
                println!("{}", serde_json::to_string(&gpus).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!(
                    "{name}: {e}; is the NVIDIA driver installed and libcuda.so.1 on the library path?"
                );
                ExitCode::FAILURE
            }
        };
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Install the hook for containers ([`crate::hook_install`]); what containers then get.
pub fn install_hook(args: &AgentArgs) -> anyhow::Result<Injection> {
    let hook_dir = crate::hook_install::install(&args.hook_library, &args.hook_dir)
        .map_err(|e| anyhow::anyhow!(e))?;
    tracing::info!(dir = %hook_dir.display(), "hook installed");
    Ok(Injection {
        tenant_socket: args.tenant_socket.clone(),
        hook_dir,
        preload: args.preload,
        cdi_kind: args.cdi_kind.clone(),
    })
}

/// The first GPUs found, looking every `interval` until there are some: without GPUs there is
/// nothing to offer.
pub async fn first_gpus(exe: &Path, interval: Duration) -> Vec<Gpu> {
    loop {
        match crate::discovery::probe(exe, Duration::from_secs(30)).await {
            Ok(g) if !g.is_empty() => return g,
            Ok(_) => tracing::warn!("no GPU found; looking again"),
            Err(e) => tracing::warn!("{e}; looking again"),
        }
        tokio::time::sleep(interval).await;
    }
}

/// Look for GPUs every `interval` for ever, handing each result to `found`.
pub async fn watch_gpus(
    exe: PathBuf,
    interval: Duration,
    found: impl Fn(Result<Vec<Gpu>, String>),
) {
    loop {
        tokio::time::sleep(interval).await;
        found(crate::discovery::probe(&exe, Duration::from_secs(30)).await);
    }
}

/// Every GPU ever seen, in the order first seen, and whether the last look found it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Gpus {
    pub seen: Vec<(Gpu, bool)>,
}

impl Gpus {
    /// Take in a discovery result: GPUs found are healthy, known ones missing unhealthy (all of
    /// them when discovery failed). Whether anything changed.
    pub fn update(&mut self, found: Result<Vec<Gpu>, String>) -> bool {
        let before = self.clone();
        match found {
            Ok(list) => {
                for (g, healthy) in self.seen.iter_mut() {
                    *healthy = list.iter().any(|x| x.uuid == g.uuid);
                }
                for g in list {
                    if !self.seen.iter().any(|(x, _)| x.uuid == g.uuid) {
                        tracing::info!(uuid = %g.uuid, name = %g.name, memory = g.memory, "GPU found");
                        self.seen.push((g, true));
                    }
                }
            }
            Err(e) => {
                tracing::warn!("{e}: every GPU is unhealthy until discovery works again");
                for (_, healthy) in self.seen.iter_mut() {
                    *healthy = false;
                }
            }
        }
        *self != before
    }

    /// Every GPU ever seen, healthy or not.
    pub fn all(&self) -> Vec<Gpu> {
        self.seen.iter().map(|(g, _)| g.clone()).collect()
    }

    /// The GPUs the last look found.
    pub fn healthy(&self) -> Vec<Gpu> {
        self.seen
            .iter()
            .filter(|(_, h)| *h)
            .map(|(g, _)| g.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(i: u8) -> Gpu {
        Gpu {
            uuid: format!("GPU-00000000-0000-0000-0000-00000000000{i}"),
            memory: 8 << 30,
            name: "sim".into(),
        }
    }

    #[test]
    fn gpus_turn_unhealthy_when_missing_and_back_when_found() {
        let mut g = Gpus::default();
        assert!(g.update(Ok(vec![gpu(0), gpu(1)])));
        assert!(!g.update(Ok(vec![gpu(1), gpu(0)])), "same GPUs, no change");
        assert!(g.update(Ok(vec![gpu(0)])));
        assert_eq!(g.healthy(), [gpu(0)]);
        assert_eq!(g.all(), [gpu(0), gpu(1)], "order first seen");
        assert!(g.update(Err("driver gone".into())));
        assert!(g.healthy().is_empty());
        assert!(g.update(Ok(vec![gpu(1), gpu(0)])));
        assert_eq!(g.healthy(), [gpu(0), gpu(1)]);
    }
}
