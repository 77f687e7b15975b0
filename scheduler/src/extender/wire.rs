//! The kube-scheduler extender wire format (`k8s.io/kube-scheduler/extender/v1`).
//!
//! The Go types carry no JSON tags, so their field names are the JSON keys
//! (`Pod`, `NodeNames`, `FailedAndUnresolvableNodes`, ...). Go's decoder
//! matches keys case-insensitively; the aliases below accept the lower-case
//! spellings some hand-written clients send. kube-scheduler reads only a
//! `200` response; anything else becomes "failed <verb> with extender at URL
//! ..., code N" without the body, so request problems are answered with
//! `200` and the `Error` field, and only undecodable bodies get a `400`
//! (`413` for one too large to read).
//!
//! Requests are read within bounds ([`crate::bounded`]): the pod is kept
//! as raw JSON until its shape has been checked, lists of nodes and
//! victims are read up to [`MAX_NODES`] and [`MAX_VICTIMS_PER_NODE`], and
//! full node objects (without `nodeCacheCapable`) stay raw JSON, read only
//! for their names and sent back as they came.

use crate::bounded::{optional_map, optional_vec, read_pod, PodJsonError, Text};
use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::collections::BTreeMap;
use thiserror::Error;

/// Highest score an extender may give (`MaxExtenderPriority`).
pub const MAX_EXTENDER_PRIORITY: i64 = 10;

/// The most nodes one request may name: three times the 5,000 nodes
/// Kubernetes is tested to (clusters of 15,000 run). A list of node names
/// costs 24 bytes a name here, borrowed from the body.
pub const MAX_NODES: usize = 15_000;

/// The most pods proposed for eviction on one node (kubelet's default
/// limit is 110 pods, and few clusters raise it past 250).
pub const MAX_VICTIMS_PER_NODE: usize = 1_000;

/// A request body that cannot be read as the verb's arguments.
#[derive(Debug, Error)]
pub enum WireError {
    #[error("request body is not {kind} JSON: {error}")]
    NotJson {
        kind: &'static str,
        error: serde_json::Error,
    },
    #[error("request body is not {kind} JSON: the Pod: {error}")]
    Pod {
        kind: &'static str,
        error: PodJsonError,
    },
}

impl WireError {
    /// The HTTP status: `413` for a pod too large to read, else `400`.
    pub fn status(&self) -> u16 {
        match self {
            Self::Pod { error, .. } if error.too_large() => 413,
            _ => 400,
        }
    }
}

/// Parses the raw pod of a request, if it has one.
fn pod_of(raw: Option<&RawValue>, kind: &'static str) -> Result<Option<Pod>, WireError> {
    raw.map(|raw| read_pod(raw.get()))
        .transpose()
        .map_err(|error| WireError::Pod { kind, error })
}

/// `ExtenderArgs`: the pod and its candidate nodes, for filter and
/// prioritize (node names are borrowed from the request body when they
/// can be: thousands of them come with every call).
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct ExtenderArgs<'a> {
    /// The pod, read by [`ExtenderArgs::read`] once its shape is checked.
    #[serde(rename = "Pod", alias = "pod", default, borrow)]
    pub pod: Option<&'a RawValue>,
    /// Full node objects, when the extender is not `nodeCacheCapable`.
    #[serde(rename = "Nodes", alias = "nodes", default, borrow)]
    pub nodes: Option<RawNodeList<'a>>,
    /// Node names, when the extender is `nodeCacheCapable`.
    #[serde(
        rename = "NodeNames",
        alias = "nodeNames",
        alias = "nodenames",
        default,
        borrow,
        deserialize_with = "node_names"
    )]
    pub node_names: Option<Vec<Text<'a>>>,
}

impl<'a> ExtenderArgs<'a> {
    /// Reads a filter or prioritize body: the arguments, and the pod
    /// parsed.
    pub fn read(body: &'a [u8]) -> Result<(Self, Option<Pod>), WireError> {
        const KIND: &str = "ExtenderArgs";
        let args: Self = serde_json::from_slice(body)
            .map_err(|error| WireError::NotJson { kind: KIND, error })?;
        let pod = pod_of(args.pod, KIND)?;
        Ok((args, pod))
    }
}

fn node_names<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<Text<'de>>>, D::Error> {
    optional_vec(deserializer, MAX_NODES, "node names")
}

fn raw_nodes<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<&'de RawValue>>, D::Error> {
    optional_vec(deserializer, MAX_NODES, "nodes")
}

/// A `v1.NodeList` in a request, its nodes as raw JSON: the extender needs
/// only their names (its own state comes from the API watch), and the ones
/// that pass are sent back as they came.
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct RawNodeList<'a> {
    #[serde(default, borrow, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<&'a RawValue>,
    /// Go writes `null` for an empty list.
    #[serde(default, borrow, deserialize_with = "raw_nodes")]
    pub items: Option<Vec<&'a RawValue>>,
}

/// As much of a node as is read: its name.
#[derive(Deserialize)]
struct NamedObject<'a> {
    #[serde(default, borrow)]
    metadata: Option<Name<'a>>,
}

#[derive(Deserialize)]
struct Name<'a> {
    #[serde(default, borrow)]
    name: Option<Text<'a>>,
}

impl RawNodeList<'_> {
    /// The name of a node object (`metadata.name`); `None` for one without
    /// a name or that is not an object.
    pub fn node_name(node: &RawValue) -> Option<Cow<'_, str>> {
        let named: NamedObject = serde_json::from_str(node.get()).ok()?;
        named.metadata?.name.map(|name| name.0)
    }
}

/// A `v1.NodeList` as kube-scheduler sends it, read whole (for clients and
/// tests reading the extender's answers).
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
/// (`NodeNameToVictims`, of which only the UIDs are read), or their UIDs
/// when the extender is `nodeCacheCapable` (`NodeNameToMetaVictims`).
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct ExtenderPreemptionArgs<'a> {
    /// The pod, read by [`ExtenderPreemptionArgs::read`].
    #[serde(rename = "Pod", alias = "pod", default, borrow)]
    pub pod: Option<&'a RawValue>,
    #[serde(
        rename = "NodeNameToVictims",
        alias = "nodeNameToVictims",
        default,
        deserialize_with = "victims_by_node"
    )]
    pub node_name_to_victims: Option<BTreeMap<String, Option<Victims>>>,
    #[serde(
        rename = "NodeNameToMetaVictims",
        alias = "nodeNameToMetaVictims",
        default,
        deserialize_with = "meta_victims_by_node"
    )]
    pub node_name_to_meta_victims: Option<BTreeMap<String, Option<MetaVictims>>>,
}

fn victims_by_node<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<BTreeMap<String, Option<Victims>>>, D::Error> {
    optional_map(deserializer, MAX_NODES, "nodes")
}

fn meta_victims_by_node<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<BTreeMap<String, Option<MetaVictims>>>, D::Error> {
    optional_map(deserializer, MAX_NODES, "nodes")
}

fn victim_pods<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<VictimPod>>, D::Error> {
    optional_vec(deserializer, MAX_VICTIMS_PER_NODE, "victims on a node")
}

fn meta_victim_pods<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<MetaPod>>, D::Error> {
    optional_vec(deserializer, MAX_VICTIMS_PER_NODE, "victims on a node")
}

impl<'a> ExtenderPreemptionArgs<'a> {
    /// Reads a preempt body: the arguments, and the pod parsed.
    pub fn read(body: &'a [u8]) -> Result<(Self, Option<Pod>), WireError> {
        const KIND: &str = "ExtenderPreemptionArgs";
        let args: Self = serde_json::from_slice(body)
            .map_err(|error| WireError::NotJson { kind: KIND, error })?;
        let pod = pod_of(args.pod, KIND)?;
        Ok((args, pod))
    }

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

/// The pods to evict on one node, whole as kube-scheduler sends them; only
/// their UIDs are read.
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct Victims {
    #[serde(
        rename = "Pods",
        alias = "pods",
        default,
        deserialize_with = "victim_pods"
    )]
    pub pods: Option<Vec<VictimPod>>,
    #[serde(rename = "NumPDBViolations", alias = "numPDBViolations", default)]
    pub num_pdb_violations: i64,
}

impl Victims {
    fn uids(&self) -> Vec<&str> {
        self.pods
            .iter()
            .flatten()
            .filter_map(|p| p.metadata.as_ref()?.uid.as_deref())
            .collect()
    }
}

/// A pod proposed for eviction, as much of it as is read.
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct VictimPod {
    #[serde(default)]
    pub metadata: Option<VictimMeta>,
}

/// A victim's metadata: its UID.
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct VictimMeta {
    #[serde(default)]
    pub uid: Option<String>,
}

/// The pods to evict on one node, by UID.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct MetaVictims {
    #[serde(
        rename = "Pods",
        alias = "pods",
        default,
        deserialize_with = "meta_victim_pods"
    )]
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
        let body = br#"{"Pod":{"metadata":{"name":"p"}},"Nodes":{"metadata":{},"items":null},"NodeNames":null}"#;
        let (args, pod) = ExtenderArgs::read(body).expect("parse");
        assert_eq!(pod.expect("pod").metadata.name.as_deref(), Some("p"));
        assert!(args.nodes.expect("nodes").items.is_none());
        assert!(args.node_names.is_none());
    }
}
