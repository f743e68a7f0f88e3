//! The kubelet's gRPC APIs, generated at build time from the vendored `.proto` files in
//! `proto/` (see `build.rs`).

/// Device plugin API v1beta1: `Registration` (served by the kubelet) and `DevicePlugin`
/// (served by us).
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");

    /// The API version we register with.
    pub const VERSION: &str = "v1beta1";
    /// The kubelet's registration socket, inside the device-plugin directory.
    pub const KUBELET_SOCKET: &str = "kubelet.sock";
    /// Health values of [`Device::health`].
    pub const HEALTHY: &str = "Healthy";
    pub const UNHEALTHY: &str = "Unhealthy";
}

/// Pod resources API v1: `PodResourcesLister` (served by the kubelet).
pub mod podresources {
    tonic::include_proto!("v1");
}

/// Plugin registration API v1: `Registration`, served by a plugin on its socket in the
/// kubelet's `plugins_registry` directory; the kubelet calls `GetInfo`, then
/// `NotifyRegistrationStatus`.
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");

    /// [`PluginInfo::type`] of a DRA driver.
    pub const DRA_PLUGIN: &str = "DRAPlugin";
}

/// DRA plugin API v1: `DRAPlugin` (served by the DRA driver, Kubernetes 1.34 and later).
pub mod dra {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");

    /// The service version a driver lists in [`super::pluginregistration::PluginInfo`].
    pub const SERVICE: &str = "v1.DRAPlugin";
}
