//! Keeps the node's ResourceSlice ([`super::slice`]) as the GPUs are: published at start,
//! changed when a GPU appears or disappears, put back when someone else changes or deletes it
//! (the kubelet deletes a node's slices when it starts; drivers publish them again), and other
//! slices of this driver for this node removed. Reconciled, not scripted: each pass compares
//! the API server's slices with the GPUs now.

use super::DRIVER;
use super::slice::{resource_slice, same_devices, slice_name};
use crate::inventory::Gpu;
use futures::StreamExt;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// How often the slice is compared with the GPUs when nothing happens (and after a failure).
const RESYNC: Duration = Duration::from_secs(60);
const RETRY: Duration = Duration::from_secs(1);

/// Keep `node`'s slice for ever.
pub async fn run(
    client: kube::Client,
    node: String,
    units_per_gpu: u32,
    mut gpus: watch::Receiver<Vec<Gpu>>,
) {
    let api: Api<ResourceSlice> = Api::all(client);
    let fields = format!("spec.nodeName={node},spec.driver={DRIVER}");
    let changed = Arc::new(Notify::new());
    tokio::spawn(watch_slices(api.clone(), fields.clone(), changed.clone()));
    let mut failing = false;
    loop {
        let want = gpus.borrow_and_update().clone();
        let wait = match sync(&api, &fields, &node, &want, units_per_gpu).await {
            Ok(done) => {
                if failing {
                    tracing::info!("ResourceSlice published again");
                    failing = false;
                }
                if let Some(done) = done {
                    tracing::info!(slice = %slice_name(&node), gpus = want.len(), "ResourceSlice {done}");
                }
                RESYNC
            }
            Err(e) => {
                if !failing {
                    tracing::warn!("cannot publish the ResourceSlice (retrying): {e}");
                    failing = true;
                }
                RETRY
            }
        };
        tokio::select! {
            _ = gpus.changed() => {}
            _ = changed.notified() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// One pass: what was done, if anything.
async fn sync(
    api: &Api<ResourceSlice>,
    fields: &str,
    node: &str,
    gpus: &[Gpu],
    units_per_gpu: u32,
) -> Result<Option<&'static str>, kube::Error> {
    let name = slice_name(node);
    let slices = api.list(&ListParams::default().fields(fields)).await?.items;
    for s in &slices {
        let other = s.metadata.name.as_deref().unwrap_or_default();
        if other != name {
            tracing::info!(
                slice = other,
                "deleting another ResourceSlice of this node's pool"
            );
            api.delete(other, &DeleteParams::default()).await?;
        }
    }
    match slices
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some(&name))
    {
        None => {
            api.create(
                &PostParams::default(),
                &resource_slice(node, gpus, units_per_gpu, 0),
            )
            .await?;
            Ok(Some("created"))
        }
        Some(s) => {
            let mut want = resource_slice(node, gpus, units_per_gpu, s.spec.pool.generation + 1);
            if same_devices(s, &want) {
                return Ok(None);
            }
            want.metadata.resource_version = s.metadata.resource_version.clone();
            api.replace(&name, &PostParams::default(), &want).await?;
            Ok(Some("updated"))
        }
    }
}

/// Poke `changed` on every change to the node's slices of this driver.
async fn watch_slices(api: Api<ResourceSlice>, fields: String, changed: Arc<Notify>) {
    let cfg = watcher::Config::default().fields(&fields);
    let mut events = watcher(api, cfg).default_backoff().boxed();
    while let Some(ev) = events.next().await {
        match ev {
            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone) => {
                changed.notify_one()
            }
            Ok(_) => {}
            Err(e) => tracing::debug!("ResourceSlice watch: {e}"),
        }
    }
}
