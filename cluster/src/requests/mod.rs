//! What a pod asks for, read from its spec and annotations.
//!
//! Per container (init containers too), HAMi's resources:
//! `nvidia.com/gpu` (number of vGPUs, each on a different GPU),
//! `nvidia.com/gpumem` (MiB per vGPU) or `nvidia.com/gpumem-percentage`,
//! `nvidia.com/gpucores` (percent per vGPU; 100 takes the GPU alone),
//! `nvidia.com/priority`; or Elastic GPU's `elasticgpu.io/gpu-memory` (MB,
//! read as MiB) and `elasticgpu.io/gpu-core` (percent; 200 = two whole
//! GPUs). The names are configurable ([`ResourceNames`]).
//!
//! Pod annotations restrict the GPUs: `nvidia.com/use-gputype` /
//! `nvidia.com/nouse-gputype` (comma lists, case-insensitive substring of the
//! model) and `nvidia.com/use-gpuuuid` / `nvidia.com/nouse-gpuuuid`, and
//! choose the policies (see [`crate::policy`]).
//!
//! - [`pod_request`]: the request, once read.
//! - [`parse`]: reading it, and the reasons a request cannot be served.
//! - [`grant_check`]: whether a decision grants no more than the request.
//! - [`priority`]: who runs above the default priority.

pub mod grant_check;
pub mod parse;
pub mod pod_request;
pub mod priority;
#[cfg(test)]
mod tests;

pub use crate::resources::ResourceNames;

use k8s_openapi::api::core::v1::Pod;

/// How a component reads what pods ask for: the extender's resource names
/// and defaults (the chart gives every component the same values).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestRules {
    pub names: ResourceNames,
    pub defaults: RequestDefaults,
}

impl RequestRules {
    /// What `pod` asks for, read by these rules.
    pub fn parse(&self, pod: &Pod) -> Result<PodRequest, RequestError> {
        parse_pod(pod, &self.names, &self.defaults)
    }
}
pub use grant_check::{check_grants, within_request, GrantError};
pub use parse::{
    asks_for_vgpu, elastic_count_to_add, elastic_gpu_count, parse_pod, RequestError,
    MAX_GPUS_PER_CONTAINER,
};
pub use pod_request::{
    model_key, ContainerKind, ContainerRequest, MemoryRequest, PodRequest, RequestDefaultFlags,
    RequestDefaults, Selectors, TypeMismatch, UuidMismatch,
};
