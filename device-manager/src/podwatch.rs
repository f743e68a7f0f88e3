//! The pods on this node, from kube-runtime's reflector over a watch of the API server
//! (`spec.nodeName=<node>`). The reflector swaps in a relist (after a 410 Gone, say) whole once
//! it is complete; while the API server is unreachable its store keeps what it last saw, so the
//! last known policy stays in force. The reconcile loops read it as [`PodView`]s.

use crate::reconcile::PodView;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use tokio::sync::Notify;

/// The node's pods, as the reflector's store holds them.
#[derive(Clone)]
pub struct Pods(Store<Pod>);

impl Pods {
    /// The first complete list arrived.
    pub fn ready(&self) -> bool {
        matches!(self.0.wait_until_ready().now_or_never(), Some(Ok(())))
    }

    /// What the store holds, by UID.
    pub fn views(&self) -> Vec<PodView> {
        let mut v: Vec<PodView> = self.0.state().iter().filter_map(|p| view(p)).collect();
        v.sort_by(|a, b| a.uid.cmp(&b.uid));
        v
    }
}

/// What the manager needs of a pod.
pub fn view(p: &Pod) -> Option<PodView> {
    let m = &p.metadata;
    let container_ids = p
        .status
        .iter()
        .flat_map(|s| s.container_statuses.iter().flatten())
        .filter_map(|c| {
            let id = c.container_id.as_deref()?;
            // `containerd://<id>`, `cri-o://<id>`, `docker://<id>`
            let id = id.split_once("://").map_or(id, |(_, id)| id);
            Some((c.name.clone(), id.to_string()))
        })
        .collect();
    let units = p
        .spec
        .iter()
        .flat_map(|s| &s.containers)
        .filter_map(|c| {
            let q = c
                .resources
                .as_ref()?
                .limits
                .as_ref()?
                .get(crate::inventory::RESOURCE)?;
            Some((c.name.clone(), q.0.trim().parse().ok()?))
        })
        .collect();
    Some(PodView {
        uid: m.uid.clone()?,
        namespace: m.namespace.clone()?,
        name: m.name.clone()?,
        annotations: m.annotations.clone().unwrap_or_default(),
        container_ids,
        units,
        created: m.creation_timestamp.as_ref().map_or(0, |t| t.0.as_second()),
        claims: claims(p),
        terminating: m.deletion_timestamp.is_some(),
    })
}

/// Container name → the ResourceClaims it uses: a container names the pod's claim entries
/// (`spec.resourceClaims`), each either a claim's name or a template, whose claim the pod's
/// status names once it was made. Entries not resolved yet are left out.
fn claims(p: &Pod) -> BTreeMap<String, Vec<String>> {
    let Some(spec) = &p.spec else {
        return BTreeMap::new();
    };
    let statuses = p
        .status
        .iter()
        .flat_map(|s| s.resource_claim_statuses.iter().flatten());
    let made: BTreeMap<&str, &str> = statuses
        .filter_map(|s| Some((s.name.as_str(), s.resource_claim_name.as_deref()?)))
        .collect();
    let resolved: BTreeMap<&str, &str> = spec
        .resource_claims
        .iter()
        .flatten()
        .filter_map(|c| {
            let claim = c
                .resource_claim_name
                .as_deref()
                .or_else(|| made.get(c.name.as_str()).copied())?;
            Some((c.name.as_str(), claim))
        })
        .collect();
    let containers = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers);
    let mut out = BTreeMap::new();
    for c in containers {
        let mut names: Vec<String> = c
            .resources
            .iter()
            .flat_map(|r| r.claims.iter().flatten())
            .filter_map(|r| resolved.get(r.name.as_str()).map(|n| n.to_string()))
            .collect();
        names.sort();
        names.dedup();
        if !names.is_empty() {
            out.insert(c.name.clone(), names);
        }
    }
    out
}

/// A client from `--kubeconfig`, or else the in-cluster config (or `$KUBECONFIG`).
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p).map_err(|e| {
                anyhow::anyhow!("cannot read --kubeconfig {}: {e}", p.display())
            })?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer().await.map_err(|e| {
            anyhow::anyhow!(
                "no Kubernetes API config: {e}; run in a pod with a service account or pass --kubeconfig"
            )
        })?,
    };
    Ok(kube::Client::try_from(config)?)
}

/// The node's pods now (one list), as the watch shows them.
pub async fn list(client: kube::Client, node: &str) -> Result<Vec<PodView>, kube::Error> {
    let api: Api<Pod> = Api::all(client);
    let lp = kube::api::ListParams::default().fields(&format!("spec.nodeName={node}"));
    Ok(api.list(&lp).await?.items.iter().filter_map(view).collect())
}

/// The node's pods, and the task that keeps them: it watches for ever (reconnecting with
/// backoff) and pokes `changed` after each change the store takes in.
pub fn watch(
    client: kube::Client,
    node: &str,
    changed: Arc<Notify>,
) -> (Pods, impl Future<Output = ()> + Send + 'static) {
    let api: Api<Pod> = Api::all(client);
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let (reader, writer) = reflector::store();
    // Managed fields are half of a pod's metadata and nothing here reads them.
    let events = watcher(api, cfg)
        .default_backoff()
        .map(|ev| ev.map(|ev| ev.modify(|p| p.managed_fields_mut().clear())));
    let task = async move {
        let mut events = reflector::reflector(writer, events).boxed();
        let mut failing = false;
        while let Some(ev) = events.next().await {
            match ev {
                Ok(ev) => {
                    if failing {
                        tracing::info!("API server reachable again");
                        failing = false;
                    }
                    if matches!(
                        ev,
                        watcher::Event::Apply(_)
                            | watcher::Event::Delete(_)
                            | watcher::Event::InitDone
                    ) {
                        changed.notify_one();
                    }
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!("pod watch failing (keeping the last known pods): {e}");
                        failing = true;
                    }
                }
            }
        }
    };
    (Pods(reader), task)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containers_name_their_claims_directly_or_through_a_template() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"uid": "u", "namespace": "ns", "name": "p"},
            "spec": {
                "resourceClaims": [
                    {"name": "shared", "resourceClaimName": "team-gpu"},
                    {"name": "own", "resourceClaimTemplateName": "gpu-30"},
                    {"name": "pending", "resourceClaimTemplateName": "gpu-30"}
                ],
                "initContainers": [{"name": "warmup", "resources": {"claims": [{"name": "own"}]}}],
                "containers": [
                    {"name": "main", "resources": {"claims": [{"name": "own"}, {"name": "shared"}, {"name": "own", "request": "gpu"}]}},
                    {"name": "waiting", "resources": {"claims": [{"name": "pending"}]}},
                    {"name": "sidecar"}
                ]
            },
            "status": {"resourceClaimStatuses": [
                {"name": "own", "resourceClaimName": "p-own-x7k2q"},
                {"name": "pending"}
            ]}
        }))
        .unwrap();
        let v = view(&pod).unwrap();
        let want = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(
            v.claims,
            BTreeMap::from([
                ("main".to_string(), want(&["p-own-x7k2q", "team-gpu"])),
                ("warmup".to_string(), want(&["p-own-x7k2q"])),
            ])
        );
    }
}
