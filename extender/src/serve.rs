//! `gpushare-extender serve`: the I/O shell around [`Books`]. kube-runtime's reflector over a
//! watch of the API server's pods (the books follow the pods asking for `gpushare.io/gpu-share`;
//! the scrape loop reads the `gpushare-node` pods' metrics ports from its store), a loop reading
//! every node's metrics (directly, or from Prometheus), the extender's HTTP API as
//! kube-scheduler calls it: `POST /filter`, `/prioritize`, `/bind` under the configured prefix,
//! plus `GET /metrics` and `/healthz`, and `Warning` events (`events.k8s.io/v1`, through
//! kube-runtime's [`Recorder`]) on the pods whose annotation a binding replaced.

use crate::api::{BindingArgs, BindingResult, ExtenderArgs, FilterResult, HostPriority};
use crate::books::{self, Books, GPU_ANNOTATION, PodInfo};
use crate::policy::Policy;
use crate::report::{self, NodeReport};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Where kube-scheduler reaches the extender.
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:12345")]
    pub listen: SocketAddr,
    /// How the memory left on a GPU is judged.
    #[arg(long, value_enum, default_value = "predicted")]
    pub policy: Policy,
    /// Read the nodes' series from this Prometheus server instead of from the nodes.
    #[arg(long, value_name = "URL")]
    pub prometheus: Option<String>,
    /// The label that names the node on the series in Prometheus.
    #[arg(long, value_name = "LABEL", default_value = "node")]
    pub prometheus_node_label: String,
    /// How often the nodes' metrics are read.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = duration)]
    pub scrape_interval: Duration,
    /// A node whose metrics are older than this is not chosen.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = duration)]
    pub stale_after: Duration,
    /// The label selector of gpushare's node pods (their named ports are scraped).
    #[arg(
        long,
        value_name = "SELECTOR",
        default_value = "app.kubernetes.io/name=gpushare-node"
    )]
    pub node_pods: String,
    /// Names of the node pods' container ports that serve gpushare's metrics.
    #[arg(
        long,
        value_name = "NAME,…",
        default_value = "metrics,dm-metrics",
        value_delimiter = ','
    )]
    pub metrics_ports: Vec<String>,
    /// Kubeconfig file for the API server [default: in-cluster config, else $KUBECONFIG].
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
}

fn duration(s: &str) -> Result<Duration, String> {
    gpushare_units::parse_duration_ns(s).map(Duration::from_nanos)
}

/// What the handlers and loops share.
pub struct Shared {
    pub books: Mutex<Books>,
    start: Instant,
    client: Option<kube::Client>,
}

impl Shared {
    pub fn new(books: Books, client: Option<kube::Client>) -> Shared {
        Shared {
            books: Mutex::new(books),
            start: Instant::now(),
            client,
        }
    }

    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The extender's routes, under `prefix` (`/` or e.g. `/gpushare`).
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/bind", post(bind))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(shared)
}

fn json<T: serde::Serialize>(v: &T) -> Response {
    (
        [("content-type", "application/json")],
        serde_json::to_vec(v).unwrap_or_default(),
    )
        .into_response()
}

fn bad_request(shared: &Shared, what: &str, e: impl std::fmt::Display) -> Response {
    shared.books().counters.bad_requests += 1;
    tracing::warn!("malformed {what} request: {e}");
    (
        StatusCode::BAD_REQUEST,
        format!("malformed {what} request: {e}"),
    )
        .into_response()
}

/// The pod and candidate node names of a filter or prioritize call.
fn parse_args(body: &[u8]) -> Result<(ExtenderArgs, Option<PodInfo>, Vec<String>), String> {
    let args: ExtenderArgs = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let info = books::pod_info(&args.pod)?;
    let names = args.node_names();
    Ok((args, info, names))
}

async fn filter(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let (args, info, names) = match parse_args(&body) {
        Ok(v) => v,
        Err(e) if e.contains("units") => {
            // A pod that can never be placed: every node fails, with the reason.
            let failed = names_of(&body)
                .into_iter()
                .map(|n| (n, e.clone()))
                .collect();
            return json(&FilterResult {
                failed_nodes: failed,
                ..Default::default()
            });
        }
        Err(e) => return bad_request(&shared, "filter", e),
    };
    let Some(pod) = info else {
        // Not ours: every node is fine.
        return json(&FilterResult::keep(&args, names, BTreeMap::new()));
    };
    let now = shared.now();
    let (ok, failed) = shared.books().filter(&pod, &names, now);
    for (n, why) in &failed {
        tracing::info!(pod = %format!("{}/{}", pod.namespace, pod.name), node = %n, "not kept: {why}");
    }
    json(&FilterResult::keep(&args, ok, failed))
}

/// Node names of a request that failed to parse as a pod (for per-node failures).
fn names_of(body: &[u8]) -> Vec<String> {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            let names = v["nodenames"].as_array().cloned().or_else(|| {
                v["nodes"]["items"].as_array().map(|items| {
                    items
                        .iter()
                        .map(|n| n["metadata"]["name"].clone())
                        .collect()
                })
            })?;
            Some(
                names
                    .iter()
                    .filter_map(|n| n.as_str().map(str::to_string))
                    .collect(),
            )
        })
        .unwrap_or_default()
}

async fn prioritize(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let (_, info, names) = match parse_args(&body) {
        Ok(v) => v,
        Err(e) => return bad_request(&shared, "prioritize", e),
    };
    let scores: Vec<HostPriority> = match info {
        None => names
            .into_iter()
            .map(|host| HostPriority { host, score: 0 })
            .collect(),
        Some(pod) => {
            let now = shared.now();
            shared
                .books()
                .prioritize(&pod, &names, now)
                .into_iter()
                .map(|(host, score)| HostPriority { host, score })
                .collect()
        }
    };
    json(&scores)
}

async fn bind(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let args: BindingArgs = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return bad_request(&shared, "bind", e),
    };
    let result = do_bind(&shared, &args).await;
    if let Err(e) = &result {
        shared.books().counters.binding_errors += 1;
        tracing::warn!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node, "not bound: {e}");
    }
    json(&BindingResult {
        error: result.err().unwrap_or_default(),
    })
}

async fn do_bind(shared: &Shared, a: &BindingArgs) -> Result<(), String> {
    if a.pod_name.is_empty() || a.node.is_empty() {
        return Err("a binding needs podName and node".into());
    }
    let client = shared
        .client
        .clone()
        .ok_or("no API server connection: cannot bind")?;
    let ns = if a.pod_namespace.is_empty() {
        "default"
    } else {
        &a.pod_namespace
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod = pods
        .get(&a.pod_name)
        .await
        .map_err(|e| format!("cannot read pod {ns}/{}: {e}", a.pod_name))?;
    if !a.pod_uid.is_empty() && pod.metadata.uid.as_deref() != Some(a.pod_uid.as_str()) {
        return Err(format!(
            "pod {ns}/{} is not the pod {} kube-scheduler placed (it was recreated): not bound",
            a.pod_name, a.pod_uid
        ));
    }
    if let Some(n) = pod.spec.as_ref().and_then(|s| s.node_name.as_ref())
        && !n.is_empty()
    {
        return Err(format!(
            "pod {ns}/{} is already bound to node {n}",
            a.pod_name
        ));
    }
    let mut replaced = None;
    let gpus = match books::pod_info(&pod)? {
        None => Vec::new(),
        Some(info) => {
            let now = shared.now();
            let books = shared.books();
            // The annotation is the extender's to write: one written on the pod beforehand
            // that its choice contradicts is replaced, and the pod gets a Warning event.
            let chosen = books.choose(&info, &a.node, now)?;
            if !info.gpus.is_empty() && info.gpus != chosen.gpus {
                let why = format!(
                    "{GPU_ANNOTATION}={} replaced by {} on node {}: the extender chooses the GPU",
                    info.gpus.join(","),
                    chosen.gpus.join(","),
                    a.node
                );
                tracing::warn!(pod = %format!("{ns}/{}", a.pod_name), "{why}");
                replaced = Some(why);
            }
            chosen.gpus
        }
    };
    if !gpus.is_empty() {
        let patch =
            serde_json::json!({"metadata": {"annotations": {GPU_ANNOTATION: gpus.join(",")}}});
        pods.patch(&a.pod_name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| format!("cannot record the chosen GPU on {ns}/{}: {e}", a.pod_name))?;
    }
    let binding = serde_json::json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": a.pod_name, "namespace": ns},
        "target": {"apiVersion": "v1", "kind": "Node", "name": a.node}
    });
    pods.create_subresource::<_, serde_json::Value>(
        "binding",
        &a.pod_name,
        &PostParams::default(),
        &binding,
    )
    .await
    .map_err(|e| format!("cannot bind {ns}/{} to {}: {e}", a.pod_name, a.node))?;
    if !gpus.is_empty()
        && let Some(info) = books::pod_info(&pod)?
    {
        let now = shared.now();
        shared.books().bound(&info, &a.node, gpus.clone(), now);
    }
    tracing::info!(pod = %format!("{ns}/{}", a.pod_name), node = %a.node, gpus = %gpus.join(","), "bound");
    if let Some(why) = replaced {
        warn_event(client, &pod, "GpuAnnotationReplaced", why);
    }
    Ok(())
}

/// Publish a `Warning` event on `pod` (`kubectl describe pod` shows it), without waiting: the
/// binding is made whether or not the API server takes it. Each warning gets a recorder of its
/// own: a recorder folds events of one object, reason and action into a series that keeps the
/// first note.
fn warn_event(client: kube::Client, pod: &Pod, reason: &'static str, note: String) {
    let regarding = pod.object_ref(&());
    let event = Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(note),
        action: "Bind".into(),
        secondary: None,
    };
    tokio::spawn(async move {
        // The instance is the host's name: the extender's pod.
        let recorder = Recorder::new(client, Reporter::from("gpushare.io/extender"));
        let posted = tokio::time::timeout(
            Duration::from_secs(10),
            recorder.publish(&event, &regarding),
        )
        .await;
        if !matches!(posted, Ok(Ok(_))) {
            tracing::warn!(
                "cannot post the {reason} event on pod {:?}/{:?}",
                regarding.namespace,
                regarding.name
            );
        }
    });
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    let b = shared.books();
    let c = &b.counters;
    let mut out = String::new();
    let mut family = |name: &str, help: &str, rows: Vec<(String, f64)>| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} counter\n"));
        for (labels, v) in rows {
            out.push_str(&format!("{name}{labels} {v}\n"));
        }
    };
    let per_node = |m: &BTreeMap<String, u64>| {
        m.iter()
            .map(|(n, v)| {
                (
                    format!("{{node=\"{}\"}}", n.replace(['"', '\\'], "'")),
                    *v as f64,
                )
            })
            .collect()
    };
    family(
        "gpushare_extender_scrape_failures_total",
        "Reads of a node's metrics that failed.",
        per_node(&c.scrape_failures),
    );
    family(
        "gpushare_extender_unreadable_node_total",
        "Times a node was not kept because its metrics could not be read.",
        per_node(&c.unreadable),
    );
    family(
        "gpushare_extender_bindings_total",
        "Pods bound.",
        vec![(String::new(), c.bindings as f64)],
    );
    family(
        "gpushare_extender_binding_errors_total",
        "Bindings refused or failed.",
        vec![(String::new(), c.binding_errors as f64)],
    );
    family(
        "gpushare_extender_bad_requests_total",
        "Requests that were not valid extender calls.",
        vec![(String::new(), c.bad_requests as f64)],
    );
    family(
        "gpushare_extender_gpu_annotation_conflicts_total",
        "Pods whose gpushare.io/gpu annotation their node's report contradicted (the books follow the node).",
        vec![(String::new(), c.annotation_conflicts as f64)],
    );
    family(
        "gpushare_extender_mispredictions_total",
        "Pods whose use grew past what the predicted policy believed.",
        vec![(String::new(), b.learner().mispredictions as f64)],
    );
    out.into_response()
}

/// An HTTP client for metrics pages and Prometheus.
type Http = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Empty<Bytes>,
>;

fn http() -> Http {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// `GET url` within `timeout`: the body, or why not.
async fn get_text(client: &Http, url: &str, timeout: Duration) -> Result<String, String> {
    let uri: hyper::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let fetch = async {
        let resp = client.get(uri).await.map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{url}: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("{url}: HTTP {status}"));
        }
        String::from_utf8(body.to_vec()).map_err(|_| format!("{url}: not UTF-8"))
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| format!("{url}: no answer within {timeout:?}"))?
}

/// Endpoints of a gpushare node pod: `http://<podIP>:<port>/metrics` for its named ports.
fn endpoints_of(p: &Pod, names: &[String]) -> Option<(String, Vec<String>)> {
    let node = p.spec.as_ref()?.node_name.clone()?;
    let ip = p.status.as_ref()?.pod_ip.clone()?;
    let ports: Vec<String> = p
        .spec
        .as_ref()?
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .filter(|port| port.name.as_ref().is_some_and(|n| names.contains(n)))
        .map(|port| format!("http://{ip}:{}/metrics", port.container_port))
        .collect();
    (!ports.is_empty()).then_some((node, ports))
}

fn matches_selector(p: &Pod, selector: &str) -> bool {
    let labels = p.metadata.labels.clone().unwrap_or_default();
    selector
        .split(',')
        .filter(|t| !t.trim().is_empty())
        .all(|term| match term.split_once('=') {
            Some((k, v)) => labels.get(k.trim()).map(String::as_str) == Some(v.trim()),
            None => labels.contains_key(term.trim()),
        })
}

/// Per node: the metrics endpoints of its gpushare node pod, from the reflector's store (a
/// node pod being deleted gives way to its successor on the node).
fn node_endpoints(pods: &Store<Pod>, args: &ServeArgs) -> BTreeMap<String, Vec<String>> {
    let mut node_pods: Vec<Arc<Pod>> = pods
        .state()
        .into_iter()
        .filter(|p| matches_selector(p, &args.node_pods))
        .collect();
    node_pods.sort_by_key(|p| p.metadata.deletion_timestamp.is_none());
    node_pods
        .iter()
        .filter_map(|p| endpoints_of(p, &args.metrics_ports))
        .collect()
}

/// The pods of the API server, and the task that keeps them: kube-runtime's reflector over a
/// watch of every pod (relisting when the watch breaks; managed fields dropped, as nothing here
/// reads them). The books take each change the store takes in, and the store whole once a
/// relist is complete.
fn watch_pods(
    shared: Arc<Shared>,
    client: kube::Client,
) -> (Store<Pod>, impl Future<Output = ()> + Send + 'static) {
    let api: Api<Pod> = Api::all(client);
    let (reader, writer) = reflector::store();
    let store = reader.clone();
    let events = watcher(api, watcher::Config::default())
        .default_backoff()
        .map(|ev| ev.map(|ev| ev.modify(|p| p.managed_fields_mut().clear())));
    let task = async move {
        let info = |p: &Pod| match books::pod_info(p) {
            Ok(i) => i,
            Err(e) => {
                tracing::debug!("pod {:?}: {e}", p.metadata.name);
                None
            }
        };
        let mut events = reflector::reflector(writer, events).boxed();
        while let Some(ev) = events.next().await {
            match ev {
                Err(e) => tracing::warn!("pod watch: {e}"),
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                Ok(watcher::Event::InitDone) => {
                    let pods = store.state().iter().filter_map(|p| info(p)).collect();
                    shared.books().set_pods(pods, shared.now());
                }
                Ok(watcher::Event::Apply(p)) => match info(&p) {
                    Some(i) => shared.books().upsert_pod(i),
                    None => {
                        if let Some(uid) = &p.metadata.uid {
                            shared.books().remove_pod(uid, shared.now());
                        }
                    }
                },
                Ok(watcher::Event::Delete(p)) => {
                    if let Some(uid) = &p.metadata.uid {
                        shared.books().remove_pod(uid, shared.now());
                    }
                }
            }
        }
    };
    (reader, task)
}

/// Read every node's metrics every `scrape_interval`.
async fn scrape_loop(shared: Arc<Shared>, pods: Store<Pod>, args: ServeArgs) {
    let client = http();
    let timeout = args.scrape_interval.max(Duration::from_millis(500));
    let mut tick = tokio::time::interval(args.scrape_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let reports: Vec<(String, Result<NodeReport, String>)> = match &args.prometheus {
            Some(url) => {
                from_prometheus(&client, url, &args.prometheus_node_label, &shared, timeout).await
            }
            None => {
                let reads = node_endpoints(&pods, &args)
                    .into_iter()
                    .map(|(node, urls)| {
                        let client = client.clone();
                        async move {
                            let mut r = NodeReport::default();
                            for u in &urls {
                                match get_text(&client, u, timeout)
                                    .await
                                    .and_then(|t| report::parse_text(&t))
                                {
                                    Ok(x) => r.merge(x),
                                    Err(e) => return (node, Err(e)),
                                }
                            }
                            (node, Ok(r))
                        }
                    });
                futures::future::join_all(reads).await
            }
        };
        let now = shared.now();
        let mut books = shared.books();
        for (node, r) in reports {
            if let Err(e) = &r {
                tracing::warn!(node = %node, "metrics unreadable: {e}");
            }
            books.node_report(&node, r, now);
        }
        for w in books.take_warnings() {
            tracing::warn!("{w}");
        }
    }
}

async fn from_prometheus(
    client: &Http,
    base: &str,
    node_label: &str,
    shared: &Shared,
    timeout: Duration,
) -> Vec<(String, Result<NodeReport, String>)> {
    let query: String = report::selector()
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect();
    let url = format!("{}/api/v1/query?query={query}", base.trim_end_matches('/'));
    let known: BTreeSet<String> = shared.books().known_nodes();
    match get_text(client, &url, timeout)
        .await
        .and_then(|body| report::parse_prometheus(&body, node_label))
    {
        Ok(by_node) => {
            let mut out: Vec<(String, Result<NodeReport, String>)> = Vec::new();
            for n in known {
                if !by_node.contains_key(&n) {
                    out.push((
                        n.clone(),
                        Err(format!(
                            "no gpushare series for node {n} in Prometheus (label {node_label})"
                        )),
                    ));
                }
            }
            out.extend(by_node);
            out
        }
        Err(e) => known.into_iter().map(|n| (n, Err(e.clone()))).collect(),
    }
}

/// Run the extender until the process is killed.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer().await.map_err(|e| {
            anyhow::anyhow!("no API server configuration ({e}); pass --kubeconfig FILE")
        })?,
    };
    let client = kube::Client::try_from(config)?;
    let books = Books::new(args.policy, args.stale_after.as_secs_f64());
    let shared = Arc::new(Shared::new(books, Some(client.clone())));
    let (pods, watch) = watch_pods(shared.clone(), client);
    tokio::spawn(watch);
    tokio::spawn(scrape_loop(shared.clone(), pods, args.clone()));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot listen on {}: {e}; pick another --listen address",
                args.listen
            )
        })?;
    tracing::info!(addr = %args.listen, policy = args.policy.name(), source = args.prometheus.as_deref().unwrap_or("the nodes"), "serving");
    axum::serve(listener, router(shared)).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{GpuReport, NodeReport};
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    fn shared() -> Arc<Shared> {
        let mut books = Books::new(Policy::Predicted, 10.0);
        let mut r = NodeReport::default();
        r.gpus.insert(
            "GPU-a".into(),
            GpuReport {
                memory: 8 << 30,
                units: 100,
                allocated: 0,
            },
        );
        books.node_report("n1", Ok(r), 0.0);
        books.node_report("n2", Err("connection refused".into()), 0.0);
        Arc::new(Shared::new(books, None))
    }

    async fn call(s: &Arc<Shared>, path: &str, body: &str) -> (StatusCode, String) {
        let resp = router(s.clone())
            .oneshot(
                Request::post(path)
                    .header("content-type", "application/json")
                    .body(Body::from(body.to_string()))
                    .unwrap(),
            )
            .await
            .unwrap();
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    fn args(units: &str, nodes: &[&str]) -> String {
        serde_json::json!({
            "pod": {"metadata": {"name": "p", "namespace": "default", "uid": "u1"},
                "spec": {"containers": [{"name": "main",
                    "resources": {"limits": {"gpushare.io/gpu-share": units}}}]}},
            "nodenames": nodes
        })
        .to_string()
    }

    #[tokio::test]
    async fn filter_keeps_fitting_nodes_and_says_why_of_the_others() {
        let s = shared();
        let (st, body) = call(&s, "/filter", &args("30", &["n1", "n2", "n3"])).await;
        assert_eq!(st, StatusCode::OK);
        let r: FilterResult = serde_json::from_str(&body).unwrap();
        assert_eq!(r.nodenames, Some(vec!["n1".to_string()]));
        assert!(
            r.failed_nodes["n2"].contains("connection refused"),
            "{body}"
        );
        assert!(
            r.failed_nodes["n3"].contains("no gpushare metrics"),
            "{body}"
        );
        assert_eq!(s.books().counters.unreadable["n2"], 1);
        let (_, body) = call(&s, "/prioritize", &args("30", &["n1", "n2"])).await;
        let p: Vec<HostPriority> = serde_json::from_str(&body).unwrap();
        assert!(p[0].score > 0 && p[1].score == 0, "{body}");
    }

    fn node_pod(name: &str, node: &str, ip: &str, deleting: bool) -> Pod {
        let mut p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "gpushare-system", "uid": name,
                "labels": {"app.kubernetes.io/name": "gpushare-node"}},
            "spec": {"nodeName": node, "containers": [{"name": "node", "ports": [
                {"name": "metrics", "containerPort": 9400},
                {"name": "other", "containerPort": 8080}]}]},
            "status": {"podIP": ip}
        }))
        .unwrap();
        if deleting {
            p.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                ));
        }
        p
    }

    #[test]
    fn the_node_pods_in_the_store_give_the_endpoints_a_leaving_one_gives_way() {
        let (reader, mut writer) = reflector::store();
        let mut other = node_pod("tenant", "n3", "10.0.0.9", false);
        other.metadata.labels = None;
        for p in [
            node_pod("a-new", "n1", "10.0.0.2", false),
            node_pod("z-old", "n1", "10.0.0.1", true),
            node_pod("b", "n2", "10.0.0.3", false),
            other,
        ] {
            writer.apply_watcher_event(&watcher::Event::Apply(p));
        }
        let args = ServeArgs {
            listen: "127.0.0.1:0".parse().unwrap(),
            policy: Policy::Predicted,
            prometheus: None,
            prometheus_node_label: "node".into(),
            scrape_interval: Duration::from_secs(1),
            stale_after: Duration::from_secs(10),
            node_pods: "app.kubernetes.io/name=gpushare-node".into(),
            metrics_ports: vec!["metrics".into()],
            kubeconfig: None,
        };
        let eps = node_endpoints(&reader, &args);
        assert_eq!(
            eps,
            BTreeMap::from([
                (
                    "n1".to_string(),
                    vec!["http://10.0.0.2:9400/metrics".to_string()]
                ),
                (
                    "n2".to_string(),
                    vec!["http://10.0.0.3:9400/metrics".to_string()]
                ),
            ])
        );
        writer.apply_watcher_event(&watcher::Event::Delete(node_pod(
            "b", "n2", "10.0.0.3", false,
        )));
        assert_eq!(node_endpoints(&reader, &args).len(), 1);
    }

    #[tokio::test]
    async fn bad_requests_are_refused_clearly_and_counted() {
        let s = shared();
        for (path, body) in [
            ("/filter", "{"),
            ("/filter", r#"{"nodenames": ["n1"]}"#),
            ("/prioritize", "[]"),
            ("/bind", r#"{"podName": 3}"#),
        ] {
            let (st, text) = call(&s, path, body).await;
            assert_eq!(st, StatusCode::BAD_REQUEST, "{path} {body}: {text}");
            assert!(text.contains("malformed"), "{text}");
        }
        assert_eq!(s.books().counters.bad_requests, 4);
        // Units that can never be placed: every node fails, with the reason.
        let (st, body) = call(&s, "/filter", &args("150", &["n1"])).await;
        assert_eq!(st, StatusCode::OK);
        assert!(body.contains("whole GPUs"), "{body}");
        let (_, body) = call(&s, "/filter", &args("many", &["n1"])).await;
        assert!(body.contains("whole number of units"), "{body}");
        // A pod that asks for no units passes everywhere.
        let (_, body) = call(&s, "/filter", &args("0", &["n1", "n9"])).await;
        let r: FilterResult = serde_json::from_str(&body).unwrap();
        assert_eq!(r.nodenames.unwrap().len(), 2);
        // A binding without an API server, or without a node, is an error, not a panic.
        let (st, body) = call(
            &s,
            "/bind",
            r#"{"podName": "p", "podNamespace": "default", "podUID": "u1", "node": "n1"}"#,
        )
        .await;
        assert_eq!(st, StatusCode::OK);
        assert!(body.contains("no API server"), "{body}");
        let (_, body) = call(&s, "/bind", r#"{"podName": "p", "node": ""}"#).await;
        assert!(body.contains("needs podName and node"), "{body}");
        assert_eq!(s.books().counters.binding_errors, 2);
    }
}
