//! Kubernetes `Warning` events (`events.k8s.io/v1`, through kube-runtime's
//! [`Recorder`]) on the objects whose gpushare settings could
//! not be used as written: a pod's annotations (device plugin), a ResourceClaim's allocation or
//! configuration (DRA). `kubectl describe` and `kubectl get events` show them.
//!
//! A [`Reporter`] posts each warning once, while it lasts: warnings that went away are
//! forgotten, so one that comes back is posted again.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{self, EventType, Recorder};
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

impl Object {
    fn reference(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some(self.api_version.into()),
            kind: Some(self.kind.into()),
            name: Some(self.name.clone()),
            namespace: Some(self.namespace.clone()),
            uid: Some(self.uid.clone()),
            ..Default::default()
        }
    }
}

/// One thing wrong with an object, and what was done about it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Warning {
    pub object: Object,
    pub reason: &'static str,
    /// What the agent was doing when it found the problem (the event's `action`).
    pub action: &'static str,
    pub message: String,
}

impl Warning {
    fn event(&self) -> events::Event {
        events::Event {
            type_: EventType::Warning,
            reason: self.reason.into(),
            note: Some(self.message.clone()),
            action: self.action.into(),
            secondary: None,
        }
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
    /// `gpushare.io/<component>` on `<node>`.
    reporter: events::Reporter,
    state: Arc<Mutex<Reported>>,
}

impl Reporter {
    pub fn new(client: kube::Client, component: &'static str, node: &str) -> Reporter {
        Reporter {
            client,
            reporter: events::Reporter {
                controller: format!("gpushare.io/{component}"),
                instance: Some(node.to_string()),
            },
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

    /// Each warning is an event of its own: a recorder folds events of one object, reason and
    /// action into a series whatever their notes, and two warnings may differ in the note only
    /// (two bad annotations of one pod).
    async fn post(&self, w: &Warning) -> Result<(), kube::Error> {
        Recorder::new(self.client.clone(), self.reporter.clone())
            .publish(&w.event(), &w.object.reference())
            .await
    }
}
