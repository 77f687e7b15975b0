//! The kube-scheduler extender wire format (`k8s.io/kube-scheduler/extender/v1`).
//!
//! The Go types carry no JSON tags, so their field names are the JSON keys
//! (`Pod`, `NodeNames`, `FailedAndUnresolvableNodes`, ...). Go's decoder
//! matches keys case-insensitively; the aliases below accept the lower-case
//! spellings some hand-written clients send. kube-scheduler reads only a
//! `200` response; anything else becomes "failed <verb> with extender at URL
//! ..., code N" without the body, so request problems are answered with
//! `200` and the `Error` field, and only undecodable bodies get a `400`.

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::BTreeMap;

/// Highest score an extender may give (`MaxExtenderPriority`).
pub const MAX_EXTENDER_PRIORITY: i64 = 10;

/// `ExtenderArgs`: the pod and its candidate nodes, for filter and
/// prioritize (node names are borrowed from the request body when they
/// can be: thousands of them come with every call).
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct ExtenderArgs<'a> {
    #[serde(rename = "Pod", alias = "pod", default)]
    pub pod: Option<Pod>,
    /// Full node objects, when the extender is not `nodeCacheCapable`.
    #[serde(rename = "Nodes", alias = "nodes", default)]
    pub nodes: Option<NodeList>,
    /// Node names, when the extender is `nodeCacheCapable`.
    #[serde(
        rename = "NodeNames",
        alias = "nodeNames",
        alias = "nodenames",
        default,
        borrow
    )]
    pub node_names: Option<Vec<Cow<'a, str>>>,
}

/// A `v1.NodeList` as kube-scheduler sends it. The nodes are kept as raw
/// JSON: the extender needs only their names (its own state comes from the
/// API watch), and the ones that pass are sent back unchanged.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct NodeList {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Value>,
    /// Go writes `null` for an empty list.
    #[serde(default)]
    pub items: Option<Vec<serde_json::Value>>,
}

impl NodeList {
    /// The name of a node object (`metadata.name`).
    pub fn node_name(node: &serde_json::Value) -> Option<&str> {
        node.get("metadata")?.get("name")?.as_str()
    }
}

/// `FailedNodesMap`: node name → why the pod cannot go there.
pub type FailedNodesMap = BTreeMap<String, String>;

/// `ExtenderFilterResult`.
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct ExtenderFilterResult {
    #[serde(rename = "Nodes", alias = "nodes", default)]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames", alias = "nodeNames", default)]
    pub node_names: Option<Vec<String>>,
    /// Nodes that do not fit now, but might after preemption.
    #[serde(rename = "FailedNodes", alias = "failedNodes", default)]
    pub failed_nodes: FailedNodesMap,
    /// Nodes that preemption cannot help.
    #[serde(
        rename = "FailedAndUnresolvableNodes",
        alias = "failedAndUnresolvableNodes",
        default
    )]
    pub failed_and_unresolvable_nodes: FailedNodesMap,
    #[serde(rename = "Error", alias = "error", default)]
    pub error: String,
}

impl ExtenderFilterResult {
    /// A result carrying only an error.
    pub fn error(message: impl Into<String>) -> Self {
        Self {
            error: message.into(),
            ..Self::default()
        }
    }
}

/// `HostPriority`: one node's score, 0 to [`MAX_EXTENDER_PRIORITY`].
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct HostPriority {
    #[serde(rename = "Host", alias = "host")]
    pub host: String,
    #[serde(rename = "Score", alias = "score")]
    pub score: i64,
}

/// `HostPriorityList`.
pub type HostPriorityList = Vec<HostPriority>;

/// `ExtenderBindingArgs`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct ExtenderBindingArgs {
    #[serde(rename = "PodName", alias = "podName", default)]
    pub pod_name: String,
    #[serde(rename = "PodNamespace", alias = "podNamespace", default)]
    pub pod_namespace: String,
    #[serde(rename = "PodUID", alias = "podUID", alias = "podUid", default)]
    pub pod_uid: String,
    #[serde(rename = "Node", alias = "node", default)]
    pub node: String,
}

/// `ExtenderBindingResult`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct ExtenderBindingResult {
    #[serde(rename = "Error", alias = "error", default)]
    pub error: String,
}

/// `ExtenderPreemptionArgs`: the pod kube-scheduler would place by
/// evicting, and per node the pods its own dry run would evict: whole pods
/// (`NodeNameToVictims`), or their UIDs when the extender is
/// `nodeCacheCapable` (`NodeNameToMetaVictims`).
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct ExtenderPreemptionArgs {
    #[serde(rename = "Pod", alias = "pod", default)]
    pub pod: Option<Pod>,
    #[serde(rename = "NodeNameToVictims", alias = "nodeNameToVictims", default)]
    pub node_name_to_victims: Option<BTreeMap<String, Option<Victims>>>,
    #[serde(
        rename = "NodeNameToMetaVictims",
        alias = "nodeNameToMetaVictims",
        default
    )]
    pub node_name_to_meta_victims: Option<BTreeMap<String, Option<MetaVictims>>>,
}

impl ExtenderPreemptionArgs {
    /// Per node: the UIDs of the pods proposed for eviction and the PDB
    /// violations they make, from whichever form kube-scheduler sent.
    pub fn proposed(&self) -> Vec<(&str, Vec<&str>, i64)> {
        if let Some(meta) = &self.node_name_to_meta_victims {
            return meta
                .iter()
                .map(|(node, v)| {
                    (
                        node.as_str(),
                        v.as_ref().map(MetaVictims::uids).unwrap_or_default(),
                        v.as_ref().map_or(0, |v| v.num_pdb_violations),
                    )
                })
                .collect();
        }
        self.node_name_to_victims
            .iter()
            .flatten()
            .map(|(node, v)| {
                (
                    node.as_str(),
                    v.as_ref().map(Victims::uids).unwrap_or_default(),
                    v.as_ref().map_or(0, |v| v.num_pdb_violations),
                )
            })
            .collect()
    }
}

/// The pods to evict on one node, whole.
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct Victims {
    #[serde(rename = "Pods", alias = "pods", default)]
    pub pods: Option<Vec<Pod>>,
    #[serde(rename = "NumPDBViolations", alias = "numPDBViolations", default)]
    pub num_pdb_violations: i64,
}

impl Victims {
    fn uids(&self) -> Vec<&str> {
        self.pods
            .iter()
            .flatten()
            .filter_map(|p| p.metadata.uid.as_deref())
            .collect()
    }
}

/// The pods to evict on one node, by UID.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct MetaVictims {
    #[serde(rename = "Pods", alias = "pods", default)]
    pub pods: Option<Vec<MetaPod>>,
    #[serde(rename = "NumPDBViolations", alias = "numPDBViolations", default)]
    pub num_pdb_violations: i64,
}

impl MetaVictims {
    fn uids(&self) -> Vec<&str> {
        self.pods.iter().flatten().map(|p| p.uid.as_str()).collect()
    }
}

/// A pod named by its UID.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct MetaPod {
    #[serde(rename = "UID", alias = "uid", default)]
    pub uid: String,
}

/// `ExtenderPreemptionResult`: the nodes where evicting still helps, each
/// with the pods to evict (kube-scheduler drops every node left out).
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct ExtenderPreemptionResult {
    #[serde(
        rename = "NodeNameToMetaVictims",
        alias = "nodeNameToMetaVictims",
        default
    )]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_field_names_round_trip() {
        let result = ExtenderFilterResult {
            node_names: Some(vec!["a".into()]),
            failed_nodes: [("b".to_string(), "full".to_string())].into(),
            ..ExtenderFilterResult::default()
        };
        let json = serde_json::to_value(&result).expect("serialise");
        assert_eq!(json["NodeNames"][0], "a");
        assert_eq!(json["FailedNodes"]["b"], "full");
        assert_eq!(json["FailedAndUnresolvableNodes"], serde_json::json!({}));
        assert_eq!(json["Error"], "");
        assert!(json["Nodes"].is_null());

        let priorities = vec![HostPriority {
            host: "a".into(),
            score: 7,
        }];
        assert_eq!(
            serde_json::to_string(&priorities).expect("serialise"),
            r#"[{"Host":"a","Score":7}]"#
        );
        let binding: ExtenderBindingArgs =
            serde_json::from_str(r#"{"PodName":"p","PodNamespace":"ns","PodUID":"u","Node":"n"}"#)
                .expect("parse");
        assert_eq!(
            (
                binding.pod_name.as_str(),
                binding.pod_namespace.as_str(),
                binding.pod_uid.as_str(),
                binding.node.as_str()
            ),
            ("p", "ns", "u", "n")
        );
    }

    #[test]
    fn go_null_lists_are_accepted() {
        let args: ExtenderArgs =
            serde_json::from_str(r#"{"Pod":{"metadata":{"name":"p"}},"Nodes":{"metadata":{},"items":null},"NodeNames":null}"#)
                .expect("parse");
        assert!(args.pod.is_some());
        assert!(args.nodes.expect("nodes").items.is_none());
        assert!(args.node_names.is_none());
    }
}
