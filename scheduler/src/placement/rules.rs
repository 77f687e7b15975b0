//! What placement decides by besides the cluster: the extender's
//! settings, and how it reads a pod's request under them.

use k8s_openapi::api::core::v1::Pod;
use std::time::Duration;
use thiserror::Error;
use vgpu_cluster::policy::{GpuPolicy, NodePolicy};
use vgpu_cluster::requests::priority::HighPriorityClasses;
use vgpu_cluster::requests::{parse_pod, PodRequest, RequestDefaults, RequestError, ResourceNames};

/// Grace beyond a node Lease's duration unless configured otherwise.
pub const DEFAULT_NODE_LEASE_GRACE: Duration = Duration::from_secs(10);
pub use crate::cache::pods::DEFAULT_UNBOUND_GRACE;

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
    /// The PriorityClasses whose pods may run vGPU containers above the
    /// default priority; any other pod's containers are granted the
    /// default ([`vgpu_cluster::requests::priority`]).
    pub high_priority_classes: HighPriorityClasses,
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
            high_priority_classes: HighPriorityClasses::default(),
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
    /// Whether any container of `pod` names one of the vGPU resources,
    /// whatever the quantity (`nvidia.com/gpu: 0` included): what makes a
    /// kube-scheduler configured with them as `managedResources` send the
    /// pod to the extender.
    pub fn names_a_resource(&self, pod: &Pod) -> bool {
        let names = &self.resources;
        let all = [
            &names.gpu,
            &names.memory,
            &names.memory_percentage,
            &names.cores,
            &names.priority,
            &names.elastic_memory,
            &names.elastic_cores,
        ];
        let Some(spec) = pod.spec.as_ref() else {
            return false;
        };
        spec.containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .filter_map(|container| container.resources.as_ref())
            .flat_map(|resources| [&resources.limits, &resources.requests])
            .flatten()
            .any(|quantities| all.iter().any(|name| quantities.contains_key(*name)))
    }

    /// What `pod` asks for, as these rules read it.
    pub fn parse(&self, pod: &Pod) -> Result<PodRequest, PodRequestError> {
        parse_pod(pod, &self.resources, &self.defaults).map_err(|source| PodRequestError {
            pod: pod_key(pod),
            source,
        })
    }
}

impl Rules {
    /// The priority `container` of `request` is granted.
    pub fn granted_priority(&self, request: &PodRequest, asked: Option<i32>) -> Option<i32> {
        self.high_priority_classes
            .grant(asked, request.priority_class.as_deref())
    }

    /// Why the containers of `request` that ask to run above the default
    /// priority are granted the default, if any is.
    pub fn lowered_priorities(&self, request: &PodRequest) -> Option<String> {
        self.high_priority_classes
            .lowered(request, &self.resources.priority)
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
