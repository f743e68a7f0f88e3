//! gRPC over Unix sockets: a tonic channel to a socket path (the kubelet's registration and
//! pod-resources sockets), and serving on one (the plugin).

use hyper_util::rt::TokioIo;
use std::path::{Path, PathBuf};
use tonic::transport::{Channel, Endpoint};

/// A channel to the gRPC server on the Unix socket `path` (connected now, reconnecting lazily).
pub async fn channel(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_path_buf();
    // The URI is required by tonic but unused: every connection goes to `path`.
    Endpoint::from_static("http://[::1]:50051")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(s))
            }
        }))
        .await
}
