//! gRPC over Unix sockets: a tonic channel to a socket path (the kubelet's registration and
//! pod-resources sockets), and serving on one (the plugins).

use hyper_util::rt::TokioIo;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::transport::server::Router;
use tonic::transport::{Channel, Endpoint};

/// A channel to the gRPC server on the Unix socket `path` (connected now, reconnecting lazily).
pub async fn channel(path: &Path) -> Result<Channel, tonic::transport::Error> {
    // The URI is required by tonic but unused: every connection goes to `path`.
    channel_as(path, "http://[::1]:50051").await
}

/// [`channel`], with the requests' `:authority` taken from `uri` (the kubelet's is
/// `localhost`).
pub async fn channel_as(
    path: &Path,
    uri: &'static str,
) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_path_buf();
    Endpoint::from_static(uri)
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(s))
            }
        }))
        .await
}

/// How often a served socket is checked for.
const WATCH_PERIOD: Duration = Duration::from_millis(100);

/// Serve `router()` on the Unix socket `path` for ever, on a fresh socket whenever the file
/// disappears (a kubelet cleaning its directories, an operator).
pub async fn serve_unix(path: PathBuf, mut router: impl FnMut() -> Router) {
    loop {
        let _ = std::fs::remove_file(&path);
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let listener = match tokio::net::UnixListener::bind(&path) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(
                    "cannot serve on {}: {e}; check that its directory is mounted and writable",
                    path.display()
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        tracing::info!(socket = %path.display(), "serving");
        let (stop_tx, stop) = tokio::sync::oneshot::channel::<()>();
        let mut server = tokio::spawn(router().serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            async move {
                let _ = stop.await;
            },
        ));
        while path.exists() {
            tokio::time::sleep(WATCH_PERIOD).await;
        }
        tracing::info!(socket = %path.display(), "socket removed: serving on a new one");
        let _ = stop_tx.send(());
        // Open connections may keep a graceful stop waiting: 1 s, then they are cut.
        if tokio::time::timeout(Duration::from_secs(1), &mut server)
            .await
            .is_err()
        {
            server.abort();
        }
    }
}
