//! `gpushare-device-manager`: the Kubernetes node agent of gpushare (docs/kubernetes.md).
//!
//! - [`plugin`] + [`kubelet`]: the device plugin for `gpushare.io/gpu-share` (100 units per
//!   GPU, [`inventory`]), which units to prefer and what `Allocate` injects ([`allocation`],
//!   the hook from a versioned directory: [`hook_install`]);
//! - [`podwatch`] (annotations, [`annotations`]) and [`podresources`] (who got which units)
//!   feed the pure [`reconcile`], whose groups go to the scheduler over its admin socket
//!   ([`admin_client`]); problems become Warning [`events`] and [`metrics`];
//! - [`discovery`]: GPUs from the CUDA driver; [`manager`]: the tasks that tie it together.

pub mod admin_client;
pub mod allocation;
pub mod annotations;
pub mod discovery;
pub mod events;
pub mod grpc;
pub mod hook_install;
pub mod inventory;
pub mod kubelet;
pub mod manager;
pub mod metrics;
pub mod plugin;
pub mod podresources;
pub mod podwatch;
pub mod proto;
pub mod reconcile;
