//! Kubernetes `Warning` events on a pod whose gpushare annotations could not be used as
//! written (`kubectl describe pod`, `kubectl get events` show them).

use crate::reconcile::PodProblem;
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::Api;
use kube::api::PostParams;

/// The event's reason.
pub const REASON: &str = "InvalidGpushareAnnotation";
/// The component the events come from.
pub const COMPONENT: &str = "gpushare-device-manager";

/// The event telling what is wrong with one annotation.
pub fn event(p: &PodProblem, node: &str, now: Time) -> Event {
    Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}.", p.pod)),
            namespace: Some(p.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(p.pod.clone()),
            namespace: Some(p.namespace.clone()),
            uid: Some(p.pod_uid.clone()),
            ..Default::default()
        },
        reason: Some(REASON.into()),
        message: Some(format!(
            "{}={:?}: {}",
            p.problem.annotation, p.problem.value, p.problem.message
        )),
        type_: Some("Warning".into()),
        source: Some(EventSource {
            component: Some(COMPONENT.into()),
            host: Some(node.into()),
        }),
        reporting_component: Some(format!("gpushare.io/{COMPONENT}")),
        reporting_instance: Some(node.into()),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        count: Some(1),
        ..Default::default()
    }
}

/// Post the event for `p`.
pub async fn post(client: kube::Client, p: &PodProblem, node: &str) -> Result<(), kube::Error> {
    let api: Api<Event> = Api::namespaced(client, &p.namespace);
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    api.create(&PostParams::default(), &event(p, node, now))
        .await
        .map(|_| ())
}
