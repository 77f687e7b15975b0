//! Placement: pure functions over a [`snapshot::Snapshot`] of the cache,
//! deciding where pods (and claims' slices) go and why not elsewhere. No
//! API server, no lock, no clock: everything is given, so every policy,
//! topology rule and rejection is tested on states built from objects.
//!
//! - [`rules`], [`snapshot`]: what placement reads.
//! - [`fit`]: a pod's containers on one node's GPUs.
//! - [`pod_to_place`], [`rejection`], [`evaluate`]: one pod on one node.
//! - [`claims`]: Elastic GPU claims in the way or pinning the pod.
//! - [`quota`]: the pod's namespace within its quotas of GPU memory and
//!   cores.
//! - [`decision`]: a placement written down.
//! - [`filter`], [`scores`], [`preemption`], [`on_node`]: what the
//!   extender's verbs ask.
//! - [`coscheduling`]: groups placed by quorum.
//! - [`claim_slice`]: claims' slices provisioned before any pod holds
//!   them.

pub mod claim_slice;
pub mod claims;
pub mod coscheduling;
pub mod decision;
pub mod evaluate;
pub mod filter;
pub mod fit;
pub mod on_node;
pub mod pod_to_place;
pub mod preemption;
pub mod quota;
pub mod rejection;
pub mod rules;
pub mod scores;
pub mod snapshot;
