//! What placement decides by besides the cluster: the extender's
//! settings, and how it reads a pod's request under them.

use crate::requests::{parse_pod, PodRequest, RequestDefaults, RequestError, ResourceNames};
use crate::vocabulary::policy::{GpuPolicy, NodePolicy};
use k8s_openapi::api::core::v1::Pod;
use std::time::Duration;
use thiserror::Error;

/// Grace beyond a node Lease's duration unless configured otherwise.
pub const DEFAULT_NODE_LEASE_GRACE: Duration = Duration::from_secs(10);
/// How long an unbound decision keeps its node busy unless configured
/// otherwise.
pub const DEFAULT_UNBOUND_GRACE: Duration = Duration::from_secs(30);

/// The settings placement follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rules {
    /// The resource names pods ask for vGPUs by.
    pub resources: ResourceNames,
    /// What a vGPU gets when its container does not say.
    pub defaults: RequestDefaults,
    /// The GPU policy of pods that name none.
    pub gpu_policy: GpuPolicy,
    /// The node policy of pods that name none.
    pub node_policy: NodePolicy,
    /// How long past its duration a node Lease may go unrenewed before
    /// the node gets no new pods ([`crate::cache::leases`]).
    pub node_lease_grace: Duration,
    /// How long a decision whose pod is not bound yet keeps its node busy.
    pub unbound_grace: Duration,
}

impl Default for Rules {
    fn default() -> Self {
        Self {
            resources: ResourceNames::default(),
            defaults: RequestDefaults::default(),
            gpu_policy: GpuPolicy::default(),
            node_policy: NodePolicy::default(),
            node_lease_grace: DEFAULT_NODE_LEASE_GRACE,
            unbound_grace: DEFAULT_UNBOUND_GRACE,
        }
    }
}

/// A pod whose GPU request cannot be read.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("pod {pod}")]
pub struct PodRequestError {
    /// `namespace/name`.
    pub pod: String,
    #[source]
    pub source: RequestError,
}

impl Rules {
    /// What `pod` asks for, as these rules read it.
    pub fn parse(&self, pod: &Pod) -> Result<PodRequest, PodRequestError> {
        parse_pod(pod, &self.resources, &self.defaults).map_err(|source| PodRequestError {
            pod: pod_key(pod),
            source,
        })
    }
}

/// `namespace/name` of a pod.
pub fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}
