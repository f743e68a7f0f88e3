//! The kube-scheduler extender API's messages (`k8s.io/kube-scheduler/extender/v1`), as JSON.

use k8s_openapi::api::core::v1::{Node, Pod};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The nodes of a filter or prioritize call: names only when the extender is node-cache
/// capable (`nodeCacheCapable: true`), whole nodes otherwise.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct NodeList {
    #[serde(default)]
    pub items: Vec<Node>,
}

/// `ExtenderArgs`: the pod being scheduled and the candidate nodes.
#[derive(Debug, Clone, Deserialize)]
pub struct ExtenderArgs {
    pub pod: Pod,
    #[serde(default)]
    pub nodes: Option<NodeList>,
    #[serde(default)]
    pub nodenames: Option<Vec<String>>,
}

impl ExtenderArgs {
    pub fn node_names(&self) -> Vec<String> {
        match (&self.nodenames, &self.nodes) {
            (Some(n), _) => n.clone(),
            (None, Some(l)) => l
                .items
                .iter()
                .filter_map(|n| n.metadata.name.clone())
                .collect(),
            (None, None) => Vec::new(),
        }
    }
}

/// `ExtenderFilterResult`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FilterResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodeList>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodenames: Option<Vec<String>>,
    #[serde(
        rename = "failedNodes",
        default,
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub failed_nodes: BTreeMap<String, String>,
    #[serde(
        rename = "failedAndUnresolvableNodes",
        default,
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

impl FilterResult {
    /// The nodes `keep` of `args`, answered in the form they came in.
    pub fn keep(args: &ExtenderArgs, keep: Vec<String>, failed: BTreeMap<String, String>) -> Self {
        let (nodes, nodenames) = match (&args.nodenames, &args.nodes) {
            (None, Some(l)) => (
                Some(NodeList {
                    items: l
                        .items
                        .iter()
                        .filter(|n| n.metadata.name.as_ref().is_some_and(|x| keep.contains(x)))
                        .cloned()
                        .collect(),
                }),
                None,
            ),
            _ => (None, Some(keep)),
        };
        FilterResult {
            nodes,
            nodenames,
            failed_nodes: failed,
            ..Default::default()
        }
    }
}

/// `HostPriority`: a node's score, 0–10 (`MaxExtenderPriority`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostPriority {
    pub host: String,
    pub score: i64,
}

/// `ExtenderBindingArgs`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct BindingArgs {
    #[serde(rename = "podName")]
    pub pod_name: String,
    #[serde(rename = "podNamespace", default)]
    pub pod_namespace: String,
    #[serde(rename = "podUID", default)]
    pub pod_uid: String,
    pub node: String,
}

/// `ExtenderBindingResult`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct BindingResult {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}
