//! Which units the kubelet gave each container: the kubelet's PodResources API (v1 `List`) on
//! its local socket. It needs no API server.

use crate::inventory::RESOURCE;
use crate::proto::podresources::ListPodResourcesRequest;
use crate::proto::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::reconcile::Assignment;
use std::path::Path;
use std::time::Duration;

/// Every container holding units of [`RESOURCE`], from the socket at `path`.
pub async fn list(path: &Path) -> Result<Vec<Assignment>, String> {
    let fail = |e: &dyn std::fmt::Display| {
        format!(
            "kubelet PodResources at {}: {e}; check --pod-resources-socket and that the directory is mounted",
            path.display()
        )
    };
    let call = async {
        let ch = crate::grpc::channel(path).await.map_err(|e| fail(&e))?;
        let resp = PodResourcesListerClient::new(ch)
            .list(ListPodResourcesRequest {})
            .await
            .map_err(|e| fail(&e))?;
        Ok::<_, String>(resp.into_inner())
    };
    let resp = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .map_err(|_| fail(&"no answer within 5 s"))??;
    let mut out = Vec::new();
    for pod in resp.pod_resources {
        for c in pod.containers {
            let device_ids: Vec<String> = c
                .devices
                .into_iter()
                .filter(|d| d.resource_name == RESOURCE)
                .flat_map(|d| d.device_ids)
                .collect();
            if !device_ids.is_empty() {
                out.push(Assignment {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: c.name,
                    device_ids,
                });
            }
        }
    }
    out.sort();
    Ok(out)
}
