//! Serving the plugin on `<device-plugin-dir>/gpushare.sock` and registering it with the
//! kubelet (`<device-plugin-dir>/kubelet.sock`, `Registration.Register`).
//!
//! A restarting kubelet deletes the plugins' sockets and makes a new `kubelet.sock`; the
//! directory is looked at every [`WATCH_PERIOD`], and on either sign the plugin serves on a
//! fresh socket and registers again.

use crate::inventory::RESOURCE;
use crate::manager::Shared;
use crate::plugin::{PluginService, options};
use crate::proto::deviceplugin::device_plugin_server::DevicePluginServer;
use crate::proto::deviceplugin::registration_client::RegistrationClient;
use crate::proto::deviceplugin::{KUBELET_SOCKET, RegisterRequest, VERSION};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The plugin's socket, inside the device-plugin directory.
pub const PLUGIN_SOCKET: &str = "gpushare.sock";
/// How often the directory is looked at.
pub const WATCH_PERIOD: Duration = Duration::from_millis(100);

/// Identity of a file: changes when it is deleted and made anew.
fn file_id(p: &Path) -> Option<(u64, i64, i64)> {
    let m = std::fs::metadata(p).ok()?;
    Some((m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Serve and register for ever, re-registering after every kubelet restart.
pub async fn run(shared: Arc<Shared>) {
    let dir = shared.opts.device_plugin_dir.clone();
    let sock = dir.join(PLUGIN_SOCKET);
    let kubelet = dir.join(KUBELET_SOCKET);
    loop {
        let _ = std::fs::remove_file(&sock);
        let listener = match tokio::net::UnixListener::bind(&sock) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(
                    "cannot serve the device plugin on {}: {e}; check --device-plugin-dir (the kubelet's device-plugins directory must be mounted)",
                    sock.display()
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let (stop_tx, stop) = watch::channel(false);
        let service = PluginService {
            shared: shared.clone(),
            stop: stop.clone(),
        };
        let mut stop_server = stop.clone();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(service))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async move {
                        let _ = stop_server.wait_for(|s| *s).await;
                    },
                ),
        );
        let since = Instant::now();
        let registered = register(&kubelet, &sock).await;
        let kubelet_id = file_id(&kubelet);
        if registered {
            shared.registered(since.elapsed());
        }
        // Watch for the kubelet's restart (or our socket's removal).
        loop {
            tokio::time::sleep(WATCH_PERIOD).await;
            if !sock.exists() || file_id(&kubelet) != kubelet_id || !registered {
                break;
            }
        }
        if registered {
            tracing::info!("kubelet restarted (or removed our socket): registering again");
        }
        let _ = stop_tx.send(true);
        if tokio::time::timeout(Duration::from_secs(1), server)
            .await
            .is_err()
        {
            tracing::warn!("the previous plugin server did not stop within 1 s");
        }
    }
}

/// Register with the kubelet, retrying while its socket is missing or it refuses, until our
/// own socket disappears. Returns whether it succeeded.
async fn register(kubelet: &Path, sock: &Path) -> bool {
    let mut complained = false;
    while sock.exists() {
        match try_register(kubelet).await {
            Ok(()) => {
                tracing::info!(resource = RESOURCE, "registered with the kubelet");
                return true;
            }
            Err(e) => {
                if !complained {
                    tracing::warn!("not registered yet (retrying): {e}");
                    complained = true;
                }
                tokio::time::sleep(WATCH_PERIOD).await;
            }
        }
    }
    false
}

async fn try_register(kubelet: &Path) -> Result<(), String> {
    let ch = crate::grpc::channel(kubelet)
        .await
        .map_err(|e| format!("cannot reach the kubelet at {}: {e}", kubelet.display()))?;
    RegistrationClient::new(ch)
        .register(RegisterRequest {
            version: VERSION.to_string(),
            endpoint: PLUGIN_SOCKET.to_string(),
            resource_name: RESOURCE.to_string(),
            options: Some(options()),
        })
        .await
        .map_err(|e| format!("the kubelet refused the registration: {}", e.message()))?;
    Ok(())
}
