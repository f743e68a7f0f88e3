//! What a container sharing GPUs gets, whichever frontend hands them out (the device plugin's
//! `Allocate` answer, or the CDI devices of a prepared DRA claim): its GPUs
//! (`NVIDIA_VISIBLE_DEVICES`, and each GPU as the CDI device `<kind>=<UUID>` with
//! `--cdi-kind`), the scheduler's socket directory with `GPUSHARE_SOCKET`, and the hook,
//! mounted read-only from its versioned host directory and preloaded. Pure.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// How the hook gets into a container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Preload {
    /// `LD_PRELOAD` in the container's environment.
    LdPreload,
    /// A read-only `/etc/ld.so.preload` mounted over the image's.
    LdSoPreload,
}

/// Where the hook's versioned host directory is mounted in containers.
pub const HOOK_MOUNT: &str = "/usr/lib/gpushare";

/// Paths on the host and options: everything a container's edits depend on besides its GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct Injection {
    /// The scheduler's tenant socket; its directory is mounted at the same path.
    pub tenant_socket: PathBuf,
    /// Versioned host directory holding `libgpushare.so` (and `ld.so.preload`).
    pub hook_dir: PathBuf,
    pub preload: Preload,
    /// CDI kind (e.g. `nvidia.com/gpu`): each GPU also as the CDI device `<kind>=<UUID>`.
    pub cdi_kind: Option<String>,
}

/// A bind mount from the host into the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    pub read_only: bool,
}

/// What the container runtime must add to a container.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ContainerEdits {
    pub env: BTreeMap<String, String>,
    pub mounts: Vec<Mount>,
    /// Fully qualified CDI device names (`<kind>=<name>`) of devices owned by others.
    pub cdi_devices: Vec<String>,
}

impl Injection {
    /// The edits for a container given `gpus` (`GPU-…` UUIDs).
    pub fn edits(&self, gpus: &[String]) -> ContainerEdits {
        let mut env = BTreeMap::new();
        env.insert("NVIDIA_VISIBLE_DEVICES".to_string(), gpus.join(","));
        env.insert(
            gpushare_protocol::SOCKET_ENV.to_string(),
            self.tenant_socket.display().to_string(),
        );
        let socket_dir = self
            .tenant_socket
            .parent()
            .unwrap_or(Path::new("/"))
            .display()
            .to_string();
        let mut mounts = vec![
            Mount {
                container_path: socket_dir.clone(),
                host_path: socket_dir,
                read_only: false,
            },
            Mount {
                container_path: HOOK_MOUNT.to_string(),
                host_path: self.hook_dir.display().to_string(),
                read_only: true,
            },
        ];
        match self.preload {
            Preload::LdPreload => {
                env.insert(
                    "LD_PRELOAD".to_string(),
                    format!("{HOOK_MOUNT}/{}", crate::hook_install::LIBRARY),
                );
            }
            Preload::LdSoPreload => mounts.push(Mount {
                container_path: "/etc/ld.so.preload".to_string(),
                host_path: self.hook_dir.join("ld.so.preload").display().to_string(),
                read_only: true,
            }),
        }
        let cdi_devices = self
            .cdi_kind
            .iter()
            .flat_map(|kind| gpus.iter().map(move |g| format!("{kind}={g}")))
            .collect();
        ContainerEdits {
            env,
            mounts,
            cdi_devices,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "GPU-00000000-0000-0000-0000-00000000000a";
    const B: &str = "GPU-00000000-0000-0000-0000-00000000000b";

    fn injection(preload: Preload) -> Injection {
        Injection {
            tenant_socket: "/run/gpushare/gpushare.sock".into(),
            hook_dir: "/var/lib/gpushare/lib/0.1.0-abc".into(),
            preload,
            cdi_kind: Some("nvidia.com/gpu".into()),
        }
    }

    #[test]
    fn gpus_socket_and_hook() {
        let e = injection(Preload::LdPreload).edits(&[A.to_string(), B.to_string()]);
        assert_eq!(e.env["NVIDIA_VISIBLE_DEVICES"], format!("{A},{B}"));
        assert_eq!(e.env["GPUSHARE_SOCKET"], "/run/gpushare/gpushare.sock");
        assert_eq!(e.env["LD_PRELOAD"], "/usr/lib/gpushare/libgpushare.so");
        assert!(e.mounts.contains(&Mount {
            host_path: "/run/gpushare".into(),
            container_path: "/run/gpushare".into(),
            read_only: false
        }));
        assert!(e.mounts.contains(&Mount {
            host_path: "/var/lib/gpushare/lib/0.1.0-abc".into(),
            container_path: HOOK_MOUNT.into(),
            read_only: true
        }));
        assert_eq!(
            e.cdi_devices,
            [format!("nvidia.com/gpu={A}"), format!("nvidia.com/gpu={B}")]
        );
        let e = injection(Preload::LdSoPreload).edits(&[A.to_string()]);
        assert!(!e.env.contains_key("LD_PRELOAD"));
        assert!(e.mounts.contains(&Mount {
            host_path: "/var/lib/gpushare/lib/0.1.0-abc/ld.so.preload".into(),
            container_path: "/etc/ld.so.preload".into(),
            read_only: true
        }));
    }
}
