//! The pod being placed, as the state knows it.

use crate::cache::gpus::Usage;
use crate::cache::state::ClusterState;
use crate::vocabulary::claims::claim_keys_held;
use k8s_openapi::api::core::v1::Pod;

/// The pod being placed: what of it the state already counts, and what it
/// holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodToPlace<'a> {
    pub uid: &'a str,
    /// Where an earlier decision of it is counted, if anywhere (a pod
    /// being scheduled again must not compete with its own decision).
    pub counted_node: Option<&'a str>,
    /// The Elastic GPU claims it holds, `namespace/name`.
    pub claims: Vec<String>,
    /// Pods taken as gone (the victims of a preemption being weighed).
    pub evicted: Vec<String>,
    /// What its namespace holds, when a quota limits the namespace's vGPU
    /// resources ([`crate::placement::quota`]).
    pub quota: Option<NamespaceHeld>,
}

impl<'a> PodToPlace<'a> {
    pub fn of(state: &'a ClusterState, pod: &'a Pod) -> Self {
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("");
        Self {
            uid,
            counted_node: state.counted_node_of(uid),
            claims: claim_keys_held(pod),
            evicted: Vec::new(),
            quota: NamespaceHeld::of(state, namespace, uid),
        }
    }
}

/// What a pod's namespace holds, for a namespace with a quota on an
/// extended resource (computed once per pod, not per node; checked by
/// [`crate::placement::quota`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceHeld {
    pub namespace: String,
    /// Held by the namespace's pods whose decisions count, this pod's own
    /// earlier decision left out.
    pub held: Usage,
}

impl NamespaceHeld {
    /// `None` when `namespace` has no quota on an extended resource.
    pub fn of(state: &ClusterState, namespace: &str, uid: &str) -> Option<Self> {
        if !state.quotas().limits_namespace(namespace) {
            return None;
        }
        Some(Self {
            namespace: namespace.to_string(),
            held: state.held_in_namespace(namespace, &[uid]),
        })
    }
}
