//! The device plugin gRPC service (kubelet device-plugin API v1beta1) for
//! `gpushare.io/gpu-share`. `Allocate` never calls the API server: it answers from the units
//! it is given and the manager's fixed settings alone.

use crate::allocation::{self, Load};
use crate::manager::Shared;
use crate::proto::deviceplugin::device_plugin_server::DevicePlugin;
use crate::proto::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, DevicePluginOptions,
    Empty, ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse,
};
use futures::{Stream, StreamExt};
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

/// One serving instance of the plugin (a new one after each kubelet restart).
pub struct PluginService {
    pub shared: Arc<Shared>,
    /// Becomes `true` when this instance shuts down: its `ListAndWatch` streams end.
    pub stop: watch::Receiver<bool>,
}

pub fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<DeviceStream>, Status> {
        let mut stop = self.stop.clone();
        let devices = tokio_stream::wrappers::WatchStream::new(self.shared.devices.subscribe())
            .map(|devices| Ok(ListAndWatchResponse { devices }))
            .take_until(async move {
                let _ = stop.wait_for(|s| *s).await;
            });
        Ok(Response::new(Box::pin(devices)))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let load = self.shared.measured_load().await;
        let opts = &self.shared.opts;
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            let size = usize::try_from(c.allocation_size).unwrap_or(0);
            let chosen = self.shared.recorded_choice(size).await;
            let on_chosen = chosen.as_ref().and_then(|gpus| {
                let ids = allocation::preferred_on(
                    gpus,
                    &c.available_device_i_ds,
                    &c.must_include_device_i_ds,
                    size,
                    opts.agent.units_per_gpu,
                );
                if ids.is_none() {
                    tracing::warn!(
                        "the GPU the scheduler extender chose ({}) lacks {size} free units here: choosing another",
                        gpus.join(",")
                    );
                }
                ids
            });
            let ids = match on_chosen {
                Some(ids) => ids,
                None => allocation::preferred(
                    &c.available_device_i_ds,
                    &c.must_include_device_i_ds,
                    size,
                    opts.agent.units_per_gpu,
                    opts.placement,
                    &load,
                )
                .map_err(Status::invalid_argument)?,
            };
            container_responses.push(ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        req: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            let gpus = allocation::gpus_of(&c.devices_ids, self.shared.opts.agent.units_per_gpu)
                .map_err(|e| {
                    tracing::warn!("Allocate refused: {e}");
                    Status::invalid_argument(format!("gpushare: {e}"))
                })?;
            container_responses.push(allocation::container_response(
                &gpus,
                &self.shared.injection,
            ));
        }
        tracing::info!(containers = container_responses.len(), "allocated");
        self.shared.allocated();
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// Measured load per GPU from the scheduler's usage report and the GPUs' memory sizes.
pub fn loads(
    usage: &[gpushare_protocol::admin::GpuUsage],
    gpus: &[crate::inventory::Gpu],
) -> std::collections::BTreeMap<String, Load> {
    usage
        .iter()
        .map(|u| {
            let total = gpus
                .iter()
                .find(|g| g.uuid == u.gpu)
                .map_or(0, |g| g.memory);
            let memory = if total > 0 {
                u.memory_used as f64 / total as f64
            } else {
                0.0
            };
            (
                u.gpu.clone(),
                Load {
                    busy: u.busy,
                    memory,
                },
            )
        })
        .collect()
}
