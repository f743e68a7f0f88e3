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
