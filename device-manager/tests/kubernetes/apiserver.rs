//! A fake Kubernetes API server on loopback, good enough for kube-rs and the real `kubectl`:
//! discovery (`/api`, `/apis`, `/api/v1`, `/version`), pods get / list / watch (field selector
//! `spec.nodeName`, resource versions, bookmarks, `410 Gone` for a resource version older than
//! the last compaction), JSON merge patch on pods, events create / list, and server-side
//! `Table` output for `kubectl get`. The test changes pods directly ([`FakeApiServer::create_pod`]
//! and friends), compacts the history, or takes the server down.

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::broadcast;

#[derive(Default)]
struct Store {
    rv: u64,
    pods: BTreeMap<(String, String), Value>,
    events: Vec<Value>,
    /// (resource version, ADDED | MODIFIED | DELETED, pod) since the last compaction.
    history: Vec<(u64, &'static str, Value)>,
    /// Watches from a resource version older than this get 410 Gone.
    oldest: u64,
    down: bool,
    /// Requests refused while down.
    refused: u64,
    names: u64,
}

#[derive(Clone, Copy, Debug)]
enum Signal {
    Changed,
    /// End every open watch (compaction, or the server going down).
    CloseWatches,
}

struct Inner {
    store: Mutex<Store>,
    tx: broadcast::Sender<Signal>,
}

type Shared = Arc<Inner>;

pub struct FakeApiServer {
    pub addr: SocketAddr,
    inner: Shared,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

impl FakeApiServer {
    pub async fn start() -> FakeApiServer {
        let (tx, _) = broadcast::channel(1024);
        let inner = Arc::new(Inner {
            store: Mutex::new(Store {
                rv: 100,
                ..Default::default()
            }),
            tx,
        });
        let app = Router::new()
            .route("/version", get(version))
            .route("/api", get(api_versions))
            .route("/apis", get(api_groups))
            .route("/api/v1", get(api_resources))
            .route("/api/v1/pods", get(list_pods_all))
            .route("/api/v1/namespaces/{ns}/pods", get(list_pods_ns))
            .route(
                "/api/v1/namespaces/{ns}/pods/{name}",
                get(get_pod).patch(patch_pod),
            )
            .route("/api/v1/events", get(list_events_all))
            .route(
                "/api/v1/namespaces/{ns}/events",
                get(list_events_ns).post(create_event),
            )
            .fallback(not_found)
            .with_state(inner.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeApiServer { addr, inner, task }
    }

    /// A kubeconfig for this server (plain HTTP, no credentials, namespace `default`).
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\nusers:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\ncurrent-context: fake\n",
            self.addr
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    fn change(&self, f: impl FnOnce(&mut Store)) {
        f(&mut self.inner.store.lock().unwrap());
        let _ = self.inner.tx.send(Signal::Changed);
    }

    /// Create a pod (its `metadata.uid` kept if set).
    pub fn create_pod(&self, mut pod: Value) {
        self.change(|s| {
            s.rv += 1;
            let m = &mut pod["metadata"];
            m["resourceVersion"] = json!(s.rv.to_string());
            m["creationTimestamp"] = json!(now());
            if m["uid"].is_null() {
                m["uid"] = json!(format!("00000000-0000-4000-8000-{:012x}", s.rv));
            }
            let key = key_of(&pod);
            s.history.push((s.rv, "ADDED", pod.clone()));
            s.pods.insert(key, pod);
        });
    }

    /// Change a pod as the kubelet or a controller would.
    pub fn update_pod(&self, ns: &str, name: &str, f: impl FnOnce(&mut Value)) {
        self.change(|s| {
            let Some(pod) = s.pods.get_mut(&(ns.to_string(), name.to_string())) else {
                panic!("no pod {ns}/{name}");
            };
            f(pod);
            s.rv += 1;
            pod["metadata"]["resourceVersion"] = json!(s.rv.to_string());
            let pod = pod.clone();
            s.history.push((s.rv, "MODIFIED", pod));
        });
    }

    pub fn delete_pod(&self, ns: &str, name: &str) {
        self.change(|s| {
            if let Some(mut pod) = s.pods.remove(&(ns.to_string(), name.to_string())) {
                s.rv += 1;
                pod["metadata"]["resourceVersion"] = json!(s.rv.to_string());
                s.history.push((s.rv, "DELETED", pod));
            }
        });
    }

    /// Forget the watch history (as etcd compaction does) and end every watch: clients must
    /// relist after a 410 Gone.
    pub fn compact(&self) {
        {
            let mut s = self.inner.store.lock().unwrap();
            s.oldest = s.rv + 1;
            s.history.clear();
        }
        let _ = self.inner.tx.send(Signal::CloseWatches);
    }

    /// Take the server down (every request answers 503, watches end) or back up.
    pub fn set_down(&self, down: bool) {
        self.inner.store.lock().unwrap().down = down;
        let _ = self.inner.tx.send(Signal::CloseWatches);
    }

    /// Requests answered 503 so far.
    pub fn refused(&self) -> u64 {
        self.inner.store.lock().unwrap().refused
    }

    /// Events of namespace `ns`.
    pub fn events(&self, ns: &str) -> Vec<Value> {
        let s = self.inner.store.lock().unwrap();
        s.events
            .iter()
            .filter(|e| e["metadata"]["namespace"] == ns)
            .cloned()
            .collect()
    }
}

fn key_of(pod: &Value) -> (String, String) {
    let m = &pod["metadata"];
    (
        m["namespace"].as_str().unwrap_or("default").to_string(),
        m["name"].as_str().unwrap_or_default().to_string(),
    )
}

fn status(code: u16, reason: &str, message: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code});
    (StatusCode::from_u16(code).unwrap(), Json(body)).into_response()
}

/// 503 while the server is down.
fn unavailable(st: &Shared) -> Option<Response> {
    let mut s = st.store.lock().unwrap();
    s.refused += u64::from(s.down);
    s.down
        .then(|| status(503, "ServiceUnavailable", "the fake API server is down"))
}

async fn not_found() -> Response {
    status(
        404,
        "NotFound",
        "the server could not find the requested resource",
    )
}

async fn version(State(st): State<Shared>) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    Json(
        json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-gpushare-fake",
        "platform": "linux/amd64"}),
    )
    .into_response()
}

async fn api_versions(State(st): State<Shared>) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    Json(json!({"kind": "APIVersions", "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}))
    .into_response()
}

async fn api_groups(State(st): State<Shared>) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    Json(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": []})).into_response()
}

async fn api_resources(State(st): State<Shared>) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    let res = |name: &str, kind: &str, short: &[&str], verbs: &[&str]| {
        json!({"name": name, "singularName": kind.to_lowercase(), "namespaced": true,
            "kind": kind, "verbs": verbs, "shortNames": short})
    };
    Json(
        json!({"kind": "APIResourceList", "groupVersion": "v1", "resources": [
            res("pods", "Pod", &["po"], &["get", "list", "watch", "patch"]),
            res("events", "Event", &["ev"], &["create", "get", "list", "patch"]),
        ]}),
    )
    .into_response()
}

fn wants_table(h: &HeaderMap) -> bool {
    h.get("accept")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("as=Table"))
}

fn table(columns: &[&str], rows: Vec<(Vec<Value>, Value)>) -> Response {
    let defs: Vec<Value> = columns
        .iter()
        .map(|c| json!({"name": c, "type": "string", "format": "", "description": "", "priority": 0}))
        .collect();
    let rows: Vec<Value> = rows
        .into_iter()
        .map(|(cells, object)| json!({"cells": cells, "object": object}))
        .collect();
    Json(
        json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {},
        "columnDefinitions": defs, "rows": rows}),
    )
    .into_response()
}

fn matches_fields(pod: &Value, selector: Option<&String>) -> bool {
    let Some(sel) = selector else {
        return true;
    };
    sel.split(',').filter(|t| !t.is_empty()).all(|term| {
        let (field, want) = term.split_once('=').unwrap_or((term, ""));
        let want = want.trim_start_matches('=');
        let have = match field {
            "spec.nodeName" => pod["spec"]["nodeName"].as_str().unwrap_or(""),
            "metadata.name" => pod["metadata"]["name"].as_str().unwrap_or(""),
            "metadata.namespace" => pod["metadata"]["namespace"].as_str().unwrap_or(""),
            _ => return true,
        };
        have == want
    })
}

async fn list_pods_all(
    State(st): State<Shared>,
    Query(q): Query<HashMap<String, String>>,
    h: HeaderMap,
) -> Response {
    list_or_watch(st, None, q, h).await
}

async fn list_pods_ns(
    State(st): State<Shared>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    h: HeaderMap,
) -> Response {
    list_or_watch(st, Some(ns), q, h).await
}

async fn list_or_watch(
    st: Shared,
    ns: Option<String>,
    q: HashMap<String, String>,
    h: HeaderMap,
) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    let fields = q.get("fieldSelector").cloned();
    let wanted = move |p: &Value| {
        ns.as_ref()
            .is_none_or(|n| p["metadata"]["namespace"] == n.as_str())
            && matches_fields(p, fields.as_ref())
    };
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        return watch(st, wanted, &q);
    }
    let s = st.store.lock().unwrap();
    let items: Vec<Value> = s.pods.values().filter(|p| wanted(p)).cloned().collect();
    if wants_table(&h) {
        let rows = items
            .iter()
            .map(|p| {
                let ready = p["status"]["containerStatuses"]
                    .as_array()
                    .map_or(0, |c| c.iter().filter(|c| c["ready"] == true).count());
                let total = p["spec"]["containers"].as_array().map_or(0, Vec::len);
                let cells = vec![
                    p["metadata"]["name"].clone(),
                    json!(format!("{ready}/{total}")),
                    p["status"]["phase"].clone(),
                    json!(0),
                    json!("1m"),
                ];
                (cells, p.clone())
            })
            .collect();
        return table(&["Name", "Ready", "Status", "Restarts", "Age"], rows);
    }
    Json(json!({"kind": "PodList", "apiVersion": "v1",
        "metadata": {"resourceVersion": s.rv.to_string()}, "items": items}))
    .into_response()
}

fn line(kind: &str, object: &Value) -> Bytes {
    let mut b = serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap();
    b.push(b'\n');
    Bytes::from(b)
}

/// A watch: a stream of JSON lines, from after the resource version in `q` (or the current
/// state first, without one), with bookmarks when asked for, until `timeoutSeconds`.
fn watch(
    st: Shared,
    wanted: impl Fn(&Value) -> bool + Send + 'static,
    q: &HashMap<String, String>,
) -> Response {
    let from: Option<u64> = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .filter(|v| *v != 0);
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(300u64);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(256);
    let mut signals = st.tx.subscribe();
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
        // First what the client missed (or everything, without a resource version).
        let (mut sent_rv, first): (u64, Vec<Bytes>) = {
            let s = st.store.lock().unwrap();
            match from {
                Some(rv) if rv < s.oldest => {
                    let gone = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Failure", "reason": "Expired", "code": 410,
                        "message": format!("too old resource version: {rv} ({})", s.oldest)});
                    (0, vec![line("ERROR", &gone)])
                }
                Some(rv) => (
                    s.rv,
                    s.history
                        .iter()
                        .filter(|(r, _, p)| *r > rv && wanted(p))
                        .map(|(_, k, p)| line(k, p))
                        .collect(),
                ),
                None => (
                    s.rv,
                    s.pods
                        .values()
                        .filter(|p| wanted(p))
                        .map(|p| line("ADDED", p))
                        .collect(),
                ),
            }
        };
        let expired = sent_rv == 0;
        for b in first {
            if tx.send(Ok(b)).await.is_err() {
                return;
            }
        }
        if expired {
            return;
        }
        loop {
            let wait = tokio::time::timeout(Duration::from_millis(500), signals.recv());
            let signal = tokio::select! {
                s = wait => s,
                _ = tokio::time::sleep_until(deadline) => return,
            };
            let out: Vec<Bytes> = match signal {
                Ok(Ok(Signal::CloseWatches)) | Ok(Err(broadcast::error::RecvError::Closed)) => {
                    return;
                }
                Ok(_) => {
                    let s = st.store.lock().unwrap();
                    let new: Vec<Bytes> = s
                        .history
                        .iter()
                        .filter(|(r, _, p)| *r > sent_rv && wanted(p))
                        .map(|(_, k, p)| line(k, p))
                        .collect();
                    sent_rv = s.rv;
                    new
                }
                // Quiet: a bookmark carries the client's resource version forward.
                Err(_) if bookmarks => {
                    let rv = st.store.lock().unwrap().rv;
                    sent_rv = sent_rv.max(rv);
                    vec![line(
                        "BOOKMARK",
                        &json!({"kind": "Pod", "apiVersion": "v1",
                            "metadata": {"resourceVersion": rv.to_string()}}),
                    )]
                }
                Err(_) => vec![],
            };
            for b in out {
                if tx.send(Ok(b)).await.is_err() {
                    return;
                }
            }
        }
    });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap()
}

async fn get_pod(State(st): State<Shared>, Path((ns, name)): Path<(String, String)>) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    match st.store.lock().unwrap().pods.get(&(ns, name.clone())) {
        Some(p) => Json(p.clone()).into_response(),
        None => status(404, "NotFound", &format!("pods \"{name}\" not found")),
    }
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            let t = target.as_object_mut().unwrap();
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

async fn patch_pod(
    State(st): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    h: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    let ct = h
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !(ct.starts_with("application/merge-patch+json")
        || ct.starts_with("application/strategic-merge-patch+json"))
    {
        return status(
            415,
            "UnsupportedMediaType",
            &format!("patch type {ct} is not supported"),
        );
    }
    let Ok(patch) = serde_json::from_slice::<Value>(&body) else {
        return status(400, "BadRequest", "the patch is not JSON");
    };
    let updated = {
        let mut s = st.store.lock().unwrap();
        let rv = s.rv + 1;
        let Some(pod) = s.pods.get_mut(&(ns, name.clone())) else {
            return status(404, "NotFound", &format!("pods \"{name}\" not found"));
        };
        merge_patch(pod, &patch);
        pod["metadata"]["resourceVersion"] = json!(rv.to_string());
        let pod = pod.clone();
        s.rv = rv;
        s.history.push((rv, "MODIFIED", pod.clone()));
        pod
    };
    let _ = st.tx.send(Signal::Changed);
    Json(updated).into_response()
}

async fn list_events_all(State(st): State<Shared>, h: HeaderMap) -> Response {
    list_events(st, None, h)
}

async fn list_events_ns(
    State(st): State<Shared>,
    Path(ns): Path<String>,
    h: HeaderMap,
) -> Response {
    list_events(st, Some(ns), h)
}

fn list_events(st: Shared, ns: Option<String>, h: HeaderMap) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    let s = st.store.lock().unwrap();
    let items: Vec<Value> = s
        .events
        .iter()
        .filter(|e| {
            ns.as_ref()
                .is_none_or(|n| e["metadata"]["namespace"] == n.as_str())
        })
        .cloned()
        .collect();
    if wants_table(&h) {
        let rows = items
            .iter()
            .map(|e| {
                let obj = &e["involvedObject"];
                let cells = vec![
                    json!("1s"),
                    e["type"].clone(),
                    e["reason"].clone(),
                    json!(format!(
                        "{}/{}",
                        obj["kind"].as_str().unwrap_or("").to_lowercase(),
                        obj["name"].as_str().unwrap_or("")
                    )),
                    e["message"].clone(),
                ];
                (cells, e.clone())
            })
            .collect();
        return table(&["Last Seen", "Type", "Reason", "Object", "Message"], rows);
    }
    Json(json!({"kind": "EventList", "apiVersion": "v1",
        "metadata": {"resourceVersion": s.rv.to_string()}, "items": items}))
    .into_response()
}

async fn create_event(
    State(st): State<Shared>,
    Path(ns): Path<String>,
    Json(mut ev): Json<Value>,
) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    let mut s = st.store.lock().unwrap();
    s.rv += 1;
    s.names += 1;
    let m = &mut ev["metadata"];
    if m["name"].is_null() {
        let base = m["generateName"].as_str().unwrap_or("event.").to_string();
        m["name"] = json!(format!("{base}{:05x}", s.names));
    }
    m["namespace"] = json!(ns);
    m["uid"] = json!(format!("00000000-0000-4000-9000-{:012x}", s.names));
    m["resourceVersion"] = json!(s.rv.to_string());
    m["creationTimestamp"] = json!(now());
    s.events.push(ev.clone());
    (StatusCode::CREATED, Json(ev)).into_response()
}
