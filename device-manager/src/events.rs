//! Kubernetes `Warning` events on the objects whose gpushare settings could not be used as
//! written: a pod's annotations (device plugin), a ResourceClaim's allocation or configuration
//! (DRA). `kubectl describe` and `kubectl get events` show them.
//!
//! A [`Reporter`] posts each warning once, while it lasts: warnings that went away are
//! forgotten, so one that comes back is posted again.

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::Api;
use kube::api::PostParams;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The object a warning is about.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Object {
    pub api_version: &'static str,
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// One thing wrong with an object, and what was done about it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Warning {
    pub object: Object,
    pub reason: &'static str,
    pub message: String,
}

/// The event telling `w`, from `component` on `node`.
pub fn event(w: &Warning, component: &str, node: &str, now: Time) -> Event {
    let o = &w.object;
    Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}.", o.name)),
            namespace: Some(o.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some(o.api_version.into()),
            kind: Some(o.kind.into()),
            name: Some(o.name.clone()),
            namespace: Some(o.namespace.clone()),
            uid: Some(o.uid.clone()),
            ..Default::default()
        },
        reason: Some(w.reason.into()),
        message: Some(w.message.clone()),
        type_: Some("Warning".into()),
        source: Some(EventSource {
            component: Some(component.into()),
            host: Some(node.into()),
        }),
        reporting_component: Some(format!("gpushare.io/{component}")),
        reporting_instance: Some(node.into()),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        count: Some(1),
        ..Default::default()
    }
}

/// Warnings whose event was posted, and those being posted.
#[derive(Default)]
struct Reported {
    posted: HashSet<Warning>,
    in_flight: HashSet<Warning>,
}

/// Posts the events of an agent.
#[derive(Clone)]
pub struct Reporter {
    client: kube::Client,
    component: &'static str,
    node: String,
    state: Arc<Mutex<Reported>>,
}

impl Reporter {
    pub fn new(client: kube::Client, component: &'static str, node: &str) -> Reporter {
        Reporter {
            client,
            component,
            node: node.to_string(),
            state: Arc::default(),
        }
    }

    /// `now` is everything wrong at present: post an event for each warning not posted yet,
    /// each in its own task (the API server may be slow or down; the caller does not wait).
    pub fn report(&self, now: &HashSet<Warning>) {
        let mut r = self.state.lock().unwrap_or_else(|e| e.into_inner());
        r.posted.retain(|w| now.contains(w));
        for w in now {
            if r.posted.contains(w) || !r.in_flight.insert(w.clone()) {
                continue;
            }
            let (me, w) = (self.clone(), w.clone());
            tokio::spawn(async move {
                let res = tokio::time::timeout(Duration::from_secs(10), me.post(&w)).await;
                let mut r = me.state.lock().unwrap_or_else(|e| e.into_inner());
                r.in_flight.remove(&w);
                let what = format!("{}/{}", w.object.namespace, w.object.name);
                match res {
                    Ok(Ok(())) => {
                        r.posted.insert(w);
                    }
                    Ok(Err(e)) => tracing::warn!("cannot post an event on {what}: {e}"),
                    Err(_) => tracing::warn!("posting an event on {what} timed out"),
                }
            });
        }
    }

    async fn post(&self, w: &Warning) -> Result<(), kube::Error> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), &w.object.namespace);
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        api.create(
            &PostParams::default(),
            &event(w, self.component, &self.node, now),
        )
        .await
        .map(|_| ())
    }
}
