//! The Kubernetes node agents of gpushare: `gpushare-device-manager`, the device
//! plugin (docs/kubernetes.md), and `gpushare-dra`, the Dynamic Resource Allocation driver
//! (docs/dra.md).
//!
//! Shared by both: the settings, start and GPU watch ([`agent`]; GPUs from the CUDA driver,
//! [`discovery`], [`inventory`]), what a container gets ([`injection`], the hook from a
//! versioned directory: [`hook_install`]), the pods of the node ([`podwatch`]), the scheduler's
//! admin socket ([`admin_client`]), Warning [`events`], gRPC on Unix sockets ([`grpc`],
//! [`proto`]).
//!
//! - the device plugin: [`plugin`] + [`kubelet`] serve `gpushare.io/gpu-share` (100 units per
//!   GPU), which units to prefer ([`allocation`]); pod annotations ([`annotations`]) and who
//!   got which units ([`podresources`]) feed the pure [`reconcile`]; [`metrics`]; [`manager`]
//!   ties it together;
//! - the DRA driver: [`dra`].

pub mod admin_client;
pub mod agent;
pub mod allocation;
pub mod annotations;
pub mod discovery;
pub mod dra;
pub mod events;
pub mod grpc;
pub mod hook_install;
pub mod injection;
pub mod inventory;
pub mod kubelet;
pub mod manager;
pub mod metrics;
pub mod plugin;
pub mod podresources;
pub mod podwatch;
pub mod proto;
pub mod reconcile;
