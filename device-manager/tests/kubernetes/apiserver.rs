//! A fake Kubernetes API server on loopback, good enough for kube-rs and the real `kubectl`:
//! discovery (`/api`, `/apis`, `/api/v1`, `/apis/resource.k8s.io/v1`,
//! `/apis/events.k8s.io/v1`, `/version`); for pods, events and the `resource.k8s.io/v1` kinds
//! (ResourceSlices, ResourceClaims, DeviceClasses) get / list / watch (field selectors on any field path, e.g. `spec.nodeName`, resource
//! versions, bookmarks, `410 Gone` for a resource version older than the last compaction),
//! create, replace (with the resource version checked), JSON merge patch and delete; a pod's
//! `binding` subresource (as kube-scheduler or its extender binds); and
//! server-side `Table` output of pods and events for `kubectl get`. Events are stored in their
//! core `v1` form and served in both groups, as a real API server does: one posted as
//! `events.k8s.io/v1` (`regarding`, `note`, `reportingController`) reads as a core `v1` Event
//! (`involvedObject`, `message`, `reportingComponent`). The test changes objects
//! directly ([`FakeApiServer::create`] and friends), compacts the history, or takes the server
//! down.

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get};
use axum::{Json, Router};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::broadcast;

/// The kinds served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Pod,
    Event,
    ResourceSlice,
    ResourceClaim,
    DeviceClass,
}

const KINDS: [Kind; 5] = [
    Kind::Pod,
    Kind::Event,
    Kind::ResourceSlice,
    Kind::ResourceClaim,
    Kind::DeviceClass,
];

impl Kind {
    fn plural(self) -> &'static str {
        match self {
            Kind::Pod => "pods",
            Kind::Event => "events",
            Kind::ResourceSlice => "resourceslices",
            Kind::ResourceClaim => "resourceclaims",
            Kind::DeviceClass => "deviceclasses",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Event => "Event",
            Kind::ResourceSlice => "ResourceSlice",
            Kind::ResourceClaim => "ResourceClaim",
            Kind::DeviceClass => "DeviceClass",
        }
    }

    fn group_version(self) -> &'static str {
        match self {
            Kind::Pod | Kind::Event => "v1",
            _ => "resource.k8s.io/v1",
        }
    }

    fn namespaced(self) -> bool {
        matches!(self, Kind::Pod | Kind::Event | Kind::ResourceClaim)
    }

    fn of(group_version: &str, plural: &str) -> Option<(Kind, Form)> {
        if group_version == EVENTS_V1 && plural == "events" {
            return Some((Kind::Event, Form::EventsV1));
        }
        KINDS
            .into_iter()
            .find(|k| k.group_version() == group_version && k.plural() == plural)
            .map(|k| (k, Form::Stored))
    }
}

const EVENTS_V1: &str = "events.k8s.io/v1";

/// The fields of an Event named differently in `events.k8s.io/v1` and in core `v1`.
const EVENT_FIELDS: [(&str, &str); 7] = [
    ("regarding", "involvedObject"),
    ("note", "message"),
    ("reportingController", "reportingComponent"),
    ("deprecatedSource", "source"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedCount", "count"),
];

/// The form an object is asked for in: as stored, or (Events) as `events.k8s.io/v1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Stored,
    EventsV1,
}

impl Form {
    /// A body (object or merge patch) sent in this form, with the stored form's field names.
    fn to_stored(self, obj: Value) -> Value {
        self.renamed(obj, false)
    }

    /// A stored object as served in this form.
    fn served(self, obj: Value) -> Value {
        self.renamed(obj, true)
    }

    /// `obj` with the Event fields renamed (stored names to served ones when `serving`) and
    /// its `apiVersion`, if it has one, to the other form's.
    fn renamed(self, mut obj: Value, serving: bool) -> Value {
        if self == Form::Stored {
            return obj;
        }
        let Some(o) = obj.as_object_mut() else {
            return obj;
        };
        for (theirs, ours) in EVENT_FIELDS {
            let (from, to) = if serving {
                (ours, theirs)
            } else {
                (theirs, ours)
            };
            if let Some(v) = o.remove(from) {
                o.insert(to.into(), v);
            }
        }
        let version = if serving {
            EVENTS_V1
        } else {
            Kind::Event.group_version()
        };
        if serving || o.contains_key("apiVersion") {
            o.insert("apiVersion".into(), json!(version));
        }
        obj
    }

    fn group_version(self, kind: Kind) -> &'static str {
        match self {
            Form::Stored => kind.group_version(),
            Form::EventsV1 => EVENTS_V1,
        }
    }
}

/// An object's key: kind, namespace (empty for cluster-scoped kinds), name.
type Key = (Kind, String, String);

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    /// (resource version, kind, ADDED | MODIFIED | DELETED, object) since the last compaction.
    history: Vec<(u64, Kind, &'static str, Value)>,
    /// Watches from a resource version older than this get 410 Gone.
    oldest: u64,
    down: bool,
    /// Requests refused while down.
    refused: u64,
    names: u64,
}

impl Store {
    /// Record `obj` under `key` as of a new resource version.
    fn put(&mut self, key: Key, mut obj: Value, how: &'static str) -> Value {
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        self.history.push((self.rv, key.0, how, obj.clone()));
        if how == "DELETED" {
            self.objects.remove(&key);
        } else {
            self.objects.insert(key, obj.clone());
        }
        obj
    }

    /// Fill in what the server sets on creation.
    fn created(&mut self, kind: Kind, ns: &str, mut obj: Value) -> Value {
        self.names += 1;
        obj["apiVersion"] = json!(kind.group_version());
        obj["kind"] = json!(kind.name());
        let m = &mut obj["metadata"];
        if m["name"].is_null() {
            let base = m["generateName"].as_str().unwrap_or("object.").to_string();
            m["name"] = json!(format!("{base}{:05x}", self.names));
        }
        if kind.namespaced() {
            m["namespace"] = json!(ns);
        }
        if m["uid"].is_null() {
            m["uid"] = json!(format!("00000000-0000-4000-9000-{:012x}", self.names));
        }
        m["creationTimestamp"] = json!(now());
        obj
    }
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

fn key(kind: Kind, ns: &str, name: &str) -> Key {
    let ns = if kind.namespaced() { ns } else { "" };
    (kind, ns.to_string(), name.to_string())
}

fn key_of(kind: Kind, obj: &Value) -> Key {
    let m = &obj["metadata"];
    key(
        kind,
        m["namespace"].as_str().unwrap_or("default"),
        m["name"].as_str().unwrap_or_default(),
    )
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
        let collection = || -> MethodRouter<Shared> { get(collection).post(collection) };
        let object =
            || -> MethodRouter<Shared> { get(object).patch(object).put(object).delete(object) };
        let app = Router::new()
            .route("/version", get(version))
            .route("/api", get(api_versions))
            .route("/apis", get(api_groups))
            .route("/api/{version}", get(api_resources))
            .route("/apis/{group}/{version}", get(group_resources))
            .route("/api/{version}/{plural}", collection())
            .route("/api/{version}/namespaces/{ns}/{plural}", collection())
            .route("/api/{version}/namespaces/{ns}/{plural}/{name}", object())
            .route(
                "/api/{version}/namespaces/{ns}/{plural}/{name}/binding",
                axum::routing::post(binding),
            )
            .route("/apis/{group}/{version}/{plural}", collection())
            .route("/apis/{group}/{version}/{plural}/{name}", object())
            .route(
                "/apis/{group}/{version}/namespaces/{ns}/{plural}",
                collection(),
            )
            .route(
                "/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}",
                object(),
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

    fn change<T>(&self, f: impl FnOnce(&mut Store) -> T) -> T {
        let out = f(&mut self.inner.store.lock().unwrap());
        let _ = self.inner.tx.send(Signal::Changed);
        out
    }

    /// Create an object of `kind` (its `metadata.uid` kept if set); the object as stored.
    pub fn create(&self, kind: Kind, obj: Value) -> Value {
        self.change(|s| {
            let ns = obj["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string();
            let obj = s.created(kind, &ns, obj);
            s.put(key_of(kind, &obj), obj, "ADDED")
        })
    }

    /// Change an object as a controller would.
    pub fn update(&self, kind: Kind, ns: &str, name: &str, f: impl FnOnce(&mut Value)) {
        self.change(|s| {
            let k = key(kind, ns, name);
            let mut obj = s
                .objects
                .get(&k)
                .unwrap_or_else(|| panic!("no {kind:?} {ns}/{name}"))
                .clone();
            f(&mut obj);
            s.put(k, obj, "MODIFIED");
        });
    }

    pub fn delete(&self, kind: Kind, ns: &str, name: &str) {
        self.change(|s| {
            let k = key(kind, ns, name);
            if let Some(obj) = s.objects.get(&k).cloned() {
                s.put(k, obj, "DELETED");
            }
        });
    }

    /// The objects of `kind` (in namespace `ns` for a namespaced kind).
    pub fn list(&self, kind: Kind, ns: &str) -> Vec<Value> {
        let s = self.inner.store.lock().unwrap();
        s.objects
            .iter()
            .filter(|((k, n, _), _)| *k == kind && (!kind.namespaced() || n == ns))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Create a pod (its `metadata.uid` kept if set).
    pub fn create_pod(&self, pod: Value) {
        self.create(Kind::Pod, pod);
    }

    /// Change a pod as the kubelet or a controller would.
    pub fn update_pod(&self, ns: &str, name: &str, f: impl FnOnce(&mut Value)) {
        self.update(Kind::Pod, ns, name, f);
    }

    pub fn delete_pod(&self, ns: &str, name: &str) {
        self.delete(Kind::Pod, ns, name);
    }

    /// Events of namespace `ns`.
    pub fn events(&self, ns: &str) -> Vec<Value> {
        self.list(Kind::Event, ns)
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
        json!({"major": "1", "minor": "34", "gitVersion": "v1.34.0-gpushare-fake",
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
    let group = |name: &str| {
        let v = json!({"groupVersion": format!("{name}/v1"), "version": "v1"});
        json!({"name": name, "versions": [v], "preferredVersion": v})
    };
    Json(json!({"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [group("resource.k8s.io"), group("events.k8s.io")]}))
    .into_response()
}

fn resources(group_version: &str) -> Response {
    let verbs = [
        "create", "delete", "get", "list", "patch", "update", "watch",
    ];
    let res: Vec<Value> = KINDS
        .into_iter()
        .filter(|k| k.group_version() == group_version)
        .chain((group_version == EVENTS_V1).then_some(Kind::Event))
        .map(|k| {
            json!({"name": k.plural(), "singularName": k.name().to_lowercase(),
                "namespaced": k.namespaced(), "kind": k.name(), "verbs": verbs})
        })
        .collect();
    if res.is_empty() {
        return status(
            404,
            "NotFound",
            &format!("no group version {group_version}"),
        );
    }
    Json(json!({"kind": "APIResourceList", "groupVersion": group_version, "resources": res}))
        .into_response()
}

async fn api_resources(State(st): State<Shared>, Path(version): Path<String>) -> Response {
    unavailable(&st).unwrap_or_else(|| resources(&version))
}

async fn group_resources(
    State(st): State<Shared>,
    Path((group, version)): Path<(String, String)>,
) -> Response {
    unavailable(&st).unwrap_or_else(|| resources(&format!("{group}/{version}")))
}

/// Kind, namespace (if in the path) and name (if any) from a request's path parameters.
fn target(p: &HashMap<String, String>) -> Option<(Kind, Form, Option<String>, Option<String>)> {
    let gv = match p.get("group") {
        Some(g) => format!("{g}/{}", p.get("version")?),
        None => p.get("version")?.clone(),
    };
    let (kind, form) = Kind::of(&gv, p.get("plural")?)?;
    Some((kind, form, p.get("ns").cloned(), p.get("name").cloned()))
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

/// `kubectl get`'s columns for pods and events.
fn rows(kind: Kind, items: &[Value]) -> Response {
    match kind {
        Kind::Pod => {
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
            table(&["Name", "Ready", "Status", "Restarts", "Age"], rows)
        }
        Kind::Event => {
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
            table(&["Last Seen", "Type", "Reason", "Object", "Message"], rows)
        }
        _ => {
            let rows = items
                .iter()
                .map(|o| (vec![o["metadata"]["name"].clone(), json!("1m")], o.clone()))
                .collect();
            table(&["Name", "Age"], rows)
        }
    }
}

/// The value at a field path (`spec.nodeName`) as text; missing: empty.
fn field<'a>(obj: &'a Value, path: &str) -> &'a str {
    path.split('.')
        .fold(obj, |v, k| &v[k])
        .as_str()
        .unwrap_or("")
}

fn matches_fields(obj: &Value, selector: Option<&String>) -> bool {
    let Some(sel) = selector else {
        return true;
    };
    sel.split(',').filter(|t| !t.is_empty()).all(|term| {
        let (path, want) = term.split_once('=').unwrap_or((term, ""));
        field(obj, path) == want.trim_start_matches('=')
    })
}

/// List, watch or create.
async fn collection(
    State(st): State<Shared>,
    method: Method,
    Path(p): Path<HashMap<String, String>>,
    Query(q): Query<HashMap<String, String>>,
    h: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    let Some((kind, form, ns, _)) = target(&p) else {
        return not_found().await;
    };
    if method == Method::POST {
        let Ok(obj) = serde_json::from_slice::<Value>(&body) else {
            return status(400, "BadRequest", "the body is not JSON");
        };
        let obj = form.to_stored(obj);
        let ns = ns.unwrap_or_else(|| "default".into());
        let created = {
            let mut s = st.store.lock().unwrap();
            let obj = s.created(kind, &ns, obj);
            let k = key_of(kind, &obj);
            if s.objects.contains_key(&k) {
                return status(
                    409,
                    "AlreadyExists",
                    &format!("{} {:?} already exists", kind.plural(), k.2),
                );
            }
            s.put(k, obj, "ADDED")
        };
        let _ = st.tx.send(Signal::Changed);
        return (StatusCode::CREATED, Json(form.served(created))).into_response();
    }
    let fields = q.get("fieldSelector").cloned();
    let wanted = move |k: Kind, o: &Value| {
        k == kind
            && ns
                .as_ref()
                .is_none_or(|n| o["metadata"]["namespace"] == n.as_str())
            && matches_fields(o, fields.as_ref())
    };
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        return watch(st, kind, form, wanted, &q);
    }
    let s = st.store.lock().unwrap();
    let items: Vec<Value> = s
        .objects
        .iter()
        .filter(|((k, _, _), o)| wanted(*k, o))
        .map(|(_, o)| o.clone())
        .collect();
    if wants_table(&h) {
        return rows(kind, &items);
    }
    let items: Vec<Value> = items.into_iter().map(|o| form.served(o)).collect();
    Json(
        json!({"kind": format!("{}List", kind.name()), "apiVersion": form.group_version(kind),
        "metadata": {"resourceVersion": s.rv.to_string()}, "items": items}),
    )
    .into_response()
}

/// Get, merge-patch, replace or delete one object.
async fn object(
    State(st): State<Shared>,
    method: Method,
    Path(p): Path<HashMap<String, String>>,
    h: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    let Some((kind, form, ns, Some(name))) = target(&p) else {
        return not_found().await;
    };
    let k = key(kind, ns.as_deref().unwrap_or(""), &name);
    let missing = || {
        status(
            404,
            "NotFound",
            &format!("{} \"{name}\" not found", kind.plural()),
        )
    };
    let mut s = st.store.lock().unwrap();
    let Some(current) = s.objects.get(&k).cloned() else {
        return missing();
    };
    let done = match method {
        Method::GET => return Json(form.served(current)).into_response(),
        Method::DELETE => s.put(k, current, "DELETED"),
        Method::PUT => {
            let Ok(obj) = serde_json::from_slice::<Value>(&body) else {
                return status(400, "BadRequest", "the body is not JSON");
            };
            let mut obj = form.to_stored(obj);
            let rv = &obj["metadata"]["resourceVersion"];
            if !rv.is_null() && *rv != current["metadata"]["resourceVersion"] {
                return status(
                    409,
                    "Conflict",
                    "the object has been modified; apply your changes to the latest version and try again",
                );
            }
            for keep in ["uid", "creationTimestamp", "namespace"] {
                obj["metadata"][keep] = current["metadata"][keep].clone();
            }
            s.put(k, obj, "MODIFIED")
        }
        Method::PATCH => {
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
            let mut obj = current;
            merge_patch(&mut obj, &form.to_stored(patch));
            s.put(k, obj, "MODIFIED")
        }
        _ => return status(405, "MethodNotAllowed", "method not allowed"),
    };
    drop(s);
    let _ = st.tx.send(Signal::Changed);
    Json(form.served(done)).into_response()
}

/// `POST …/pods/NAME/binding`: the pod gets the target's node, once.
async fn binding(
    State(st): State<Shared>,
    Path(p): Path<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    if let Some(r) = unavailable(&st) {
        return r;
    }
    let (Some(ns), Some(name)) = (p.get("ns"), p.get("name")) else {
        return not_found().await;
    };
    if p.get("plural").map(String::as_str) != Some("pods") {
        return not_found().await;
    }
    let Ok(b) = serde_json::from_slice::<Value>(&body) else {
        return status(400, "BadRequest", "the body is not JSON");
    };
    let Some(node) = b["target"]["name"].as_str().filter(|n| !n.is_empty()) else {
        return status(400, "BadRequest", "a binding needs target.name");
    };
    let k = key(Kind::Pod, ns, name);
    let mut s = st.store.lock().unwrap();
    let Some(mut pod) = s.objects.get(&k).cloned() else {
        return status(404, "NotFound", &format!("pods \"{name}\" not found"));
    };
    if let Some(n) = pod["spec"]["nodeName"].as_str().filter(|n| !n.is_empty()) {
        return status(
            409,
            "Conflict",
            &format!("pod {name} is already assigned to node \"{n}\""),
        );
    }
    pod["spec"]["nodeName"] = json!(node);
    s.put(k, pod, "MODIFIED");
    drop(s);
    let _ = st.tx.send(Signal::Changed);
    (
        StatusCode::CREATED,
        Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})),
    )
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
    kind: Kind,
    form: Form,
    wanted: impl Fn(Kind, &Value) -> bool + Send + 'static,
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
                        .filter(|(r, k, _, o)| *r > rv && wanted(*k, o))
                        .map(|(_, _, how, o)| line(how, &form.served(o.clone())))
                        .collect(),
                ),
                None => (
                    s.rv,
                    s.objects
                        .iter()
                        .filter(|((k, _, _), o)| wanted(*k, o))
                        .map(|(_, o)| line("ADDED", &form.served(o.clone())))
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
                        .filter(|(r, k, _, o)| *r > sent_rv && wanted(*k, o))
                        .map(|(_, _, how, o)| line(how, &form.served(o.clone())))
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
                        &json!({"kind": kind.name(), "apiVersion": form.group_version(kind),
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
