//! The API server's webhooks: the mutating admission webhook for pods
//! ([`mutate`]) with its parts, and the conversion webhook of Elastic GPU's
//! resources ([`conversion`]).
//!
//! - [`review`]: the envelope the API server sends, and bad requests.
//! - [`patch`]: JSON patch operations.
//! - [`claims`]: a pod's claimed containers given their claims' shares.
//! - [`look_up`]: the claims a pod names, read from the API.
//! - [`kubeshare`]: KubeShare's labels turned into vgpu's requests.
//! - [`seccomp`]: the seccomp profile of containers given vGPUs.
//! - [`reach`]: the capabilities, node namespaces and node paths a pod
//!   given vGPUs may not ask for.
//! - [`confinement`]: what keeps containers given vGPUs in the shim's
//!   reach, checked at admission and again at placement.
//! - [`quota`]: a pod its namespace's quota on vGPU resources cannot take.
//! - [`mutate`]: the answer to one `AdmissionReview`.
//! - [`conversion`]: the answer to one `ConversionReview`.

pub mod claims;
pub mod confinement;
pub mod conversion;
pub mod kubeshare;
pub mod look_up;
pub mod mutate;
pub mod patch;
pub mod quota;
pub mod reach;
pub mod review;
pub mod seccomp;
