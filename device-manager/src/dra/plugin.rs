//! The kubelet's two ways in: the registration socket in its `plugins_registry` directory,
//! where it learns the driver's name and DRA socket (`GetInfo`) and says whether it took them
//! (`NotifyRegistrationStatus`), and the DRA socket it prepares and unprepares claims on
//! (`v1.DRAPlugin`). The kubelet finds the registration socket whenever it starts; either
//! socket removed is served anew ([`crate::grpc::serve_unix`]).

use super::DRIVER;
use super::driver::Driver;
use crate::proto::dra::dra_plugin_server::{DraPlugin, DraPluginServer};
use crate::proto::dra::{
    NodePrepareResourcesRequest, NodePrepareResourcesResponse, NodeUnprepareResourcesRequest,
    NodeUnprepareResourcesResponse,
};
use crate::proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use crate::proto::pluginregistration::{
    DRA_PLUGIN, InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

/// `Registration`: who we are and where the kubelet reaches us.
#[derive(Clone)]
pub struct Registrar {
    /// The DRA socket's path, as the kubelet sees it.
    pub endpoint: String,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: DRA_PLUGIN.to_string(),
            name: DRIVER.to_string(),
            endpoint: self.endpoint.clone(),
            supported_versions: vec![crate::proto::dra::SERVICE.to_string()],
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let s = req.into_inner();
        if s.plugin_registered {
            tracing::info!(driver = DRIVER, "registered with the kubelet");
        } else {
            tracing::error!(
                "the kubelet refused the registration: {}; is it Kubernetes 1.34 or newer (resource.k8s.io/v1, v1.DRAPlugin)?",
                s.error
            );
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// `v1.DRAPlugin`.
pub struct DraService {
    pub driver: Arc<Driver>,
}

#[tonic::async_trait]
impl DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        req: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let claims = self.driver.prepare(req.into_inner().claims).await;
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let claims = self.driver.unprepare(req.into_inner().claims).await;
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}

/// Serve both sockets for ever: the DRA socket first, so that the kubelet can call it as soon
/// as it finds the registration socket.
pub async fn serve(driver: Arc<Driver>) {
    let dra = driver.opts.dra_socket();
    let registration = driver.opts.registration_socket();
    let d = driver.clone();
    tokio::spawn(crate::grpc::serve_unix(dra.clone(), move || {
        Server::builder().add_service(DraPluginServer::new(DraService { driver: d.clone() }))
    }));
    while !dra.exists() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let registrar = Registrar {
        endpoint: dra.display().to_string(),
    };
    crate::grpc::serve_unix(registration, move || {
        Server::builder().add_service(RegistrationServer::new(registrar.clone()))
    })
    .await;
}
