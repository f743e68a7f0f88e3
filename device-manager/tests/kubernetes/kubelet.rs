//! Stand-ins for the kubelet's gRPC sockets: the device-plugin `Registration` server with a
//! client of the registered plugin, and the `PodResourcesLister` server.

use gpushare_device_manager::grpc;
use gpushare_device_manager::proto::deviceplugin::device_plugin_client::DevicePluginClient;
use gpushare_device_manager::proto::deviceplugin::registration_server::{
    Registration, RegistrationServer,
};
use gpushare_device_manager::proto::deviceplugin::{Empty, RegisterRequest};
use gpushare_device_manager::proto::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpushare_device_manager::proto::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::server::Router;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

/// A server on a Unix socket, stopped on drop.
struct Served {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Served {
    fn start(path: &Path, router: Router) -> Served {
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path).expect("bind a fake kubelet socket");
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(async move {
            let _ = router
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async {
                        let _ = rx.await;
                    },
                )
                .await;
        });
        Served {
            stop: Some(tx),
            task,
        }
    }

    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone, Default)]
struct Registrar {
    seen: Arc<Mutex<Vec<(Instant, RegisterRequest)>>>,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let r = req.into_inner();
        if r.version != "v1beta1" {
            return Err(Status::invalid_argument("unsupported version"));
        }
        self.seen.lock().unwrap().push((Instant::now(), r));
        Ok(Response::new(Empty {}))
    }
}

/// The kubelet's device-plugin side: `<dir>/kubelet.sock`.
pub struct FakeKubelet {
    pub dir: PathBuf,
    registrar: Registrar,
    server: Option<Served>,
}

impl FakeKubelet {
    pub fn start(dir: &Path) -> FakeKubelet {
        std::fs::create_dir_all(dir).unwrap();
        let registrar = Registrar::default();
        let server = Served::start(
            &dir.join("kubelet.sock"),
            Server::builder().add_service(RegistrationServer::new(registrar.clone())),
        );
        FakeKubelet {
            dir: dir.to_path_buf(),
            registrar,
            server: Some(server),
        }
    }

    /// Registrations so far.
    pub fn registrations(&self) -> Vec<(Instant, RegisterRequest)> {
        self.registrar.seen.lock().unwrap().clone()
    }

    /// Wait (at most `timeout`) until there are `n` registrations; the time of the `n`th.
    pub async fn wait_registrations(&self, n: usize, timeout: Duration) -> Instant {
        wait_nth(n, timeout, || {
            self.registrations().iter().map(|(t, _)| *t).collect()
        })
        .await
    }

    /// A client of the plugin that registered last.
    pub async fn plugin(&self) -> DevicePluginClient<Channel> {
        let (_, r) = self
            .registrations()
            .last()
            .cloned()
            .expect("no plugin registered");
        let ch = grpc::channel(&self.dir.join(&r.endpoint))
            .await
            .expect("connect to the plugin's socket");
        DevicePluginClient::new(ch)
    }

    /// Restart as the kubelet does: stop, delete every socket in the directory, serve a new
    /// `kubelet.sock`. Returns when the new socket is up.
    pub async fn restart(&mut self) -> Instant {
        if let Some(s) = self.server.take() {
            s.stop().await;
        }
        for e in std::fs::read_dir(&self.dir).unwrap() {
            let _ = std::fs::remove_file(e.unwrap().path());
        }
        self.server = Some(Served::start(
            &self.dir.join("kubelet.sock"),
            Server::builder().add_service(RegistrationServer::new(self.registrar.clone())),
        ));
        Instant::now()
    }
}

/// The plugin's current device list (the first `ListAndWatch` message).
pub async fn devices(
    plugin: &mut DevicePluginClient<Channel>,
) -> Vec<gpushare_device_manager::proto::deviceplugin::Device> {
    plugin
        .list_and_watch(Empty {})
        .await
        .expect("ListAndWatch")
        .into_inner()
        .message()
        .await
        .expect("a device list")
        .expect("a device list")
        .devices
}

#[derive(Clone, Default)]
struct Lister {
    pods: Arc<Mutex<Vec<PodResources>>>,
}

#[tonic::async_trait]
impl PodResourcesLister for Lister {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        Ok(Response::new(ListPodResourcesResponse {
            pod_resources: self.pods.lock().unwrap().clone(),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not needed by gpushare"))
    }

    async fn get(
        &self,
        req: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        let r = req.into_inner();
        let pod = self
            .pods
            .lock()
            .unwrap()
            .iter()
            .find(|p| p.name == r.pod_name && p.namespace == r.pod_namespace)
            .cloned();
        match pod {
            Some(p) => Ok(Response::new(GetPodResourcesResponse {
                pod_resources: Some(p),
            })),
            None => Err(Status::not_found("no such pod")),
        }
    }
}

/// The kubelet's PodResources socket, listing what the test assigned.
pub struct FakePodResources {
    pub socket: PathBuf,
    lister: Lister,
    _server: Served,
}

impl FakePodResources {
    pub fn start(socket: &Path) -> FakePodResources {
        let lister = Lister::default();
        let server = Served::start(
            socket,
            Server::builder().add_service(PodResourcesListerServer::new(lister.clone())),
        );
        FakePodResources {
            socket: socket.to_path_buf(),
            lister,
            _server: server,
        }
    }

    /// Record that `container` of `namespace/pod` holds `device_ids` of `resource`.
    pub fn assign(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        resource: &str,
        device_ids: Vec<String>,
    ) {
        let mut pods = self.lister.pods.lock().unwrap();
        let idx = match pods
            .iter()
            .position(|p| p.name == pod && p.namespace == namespace)
        {
            Some(i) => i,
            None => {
                pods.push(PodResources {
                    name: pod.into(),
                    namespace: namespace.into(),
                    ..Default::default()
                });
                pods.len() - 1
            }
        };
        pods[idx].containers.push(ContainerResources {
            name: container.into(),
            devices: vec![ContainerDevices {
                resource_name: resource.into(),
                device_ids,
                topology: None,
            }],
            ..Default::default()
        });
    }

    /// The pod is gone from the kubelet.
    pub fn forget(&self, namespace: &str, pod: &str) {
        self.lister
            .pods
            .lock()
            .unwrap()
            .retain(|p| !(p.name == pod && p.namespace == namespace));
    }
}

/// Wait (at most `timeout`) until `times()` has `n` entries; the `n`th.
pub async fn wait_nth(n: usize, timeout: Duration, times: impl Fn() -> Vec<Instant>) -> Instant {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = times();
        if let Some(t) = seen.get(n - 1) {
            return *t;
        }
        assert!(
            Instant::now() < deadline,
            "only {} registration(s) within {timeout:?}, expected {n}",
            seen.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
