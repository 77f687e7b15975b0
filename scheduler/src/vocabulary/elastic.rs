//! Elastic GPU's custom resources (group `elasticgpu.io`): their two served
//! versions, and the annotations where the stored version keeps a class's
//! fields it has no place for ([`crate::admission::conversion`]).

/// The stored version: the published schema.
pub const STORED_VERSION: &str = "elasticgpu.io/v1alpha1";
/// The documentation's form.
pub const README_VERSION: &str = "elasticgpu.io/v1alpha";
/// Where a class's v1alpha `reclaimPolicy` is kept in v1alpha1.
pub const RECLAIM_POLICY_ANNOTATION: &str = "vgpu.io/elasticgpu-reclaim-policy";
/// Where a class's v1alpha `egpuBindingMode` is kept in v1alpha1.
pub const BINDING_MODE_ANNOTATION: &str = "vgpu.io/elasticgpu-binding-mode";
