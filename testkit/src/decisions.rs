//! The vGPU protocol's records in a pod as JSON (what the extender and
//! the device plugin write into it), for tests that check them.

use serde_json::Value;
use vgpu_cluster::decision::{Decision, ALLOCATED_ANNOTATION, DECISION_ANNOTATION};

/// The pod's decision annotation, parsed.
pub fn decision_of(pod: &Value) -> Option<Decision> {
    pod["metadata"]["annotations"][DECISION_ANNOTATION]
        .as_str()
        .and_then(|t| Decision::parse(t).ok())
}

/// The pod's allocated containers (the device plugin's record).
pub fn allocated_of(pod: &Value) -> Vec<String> {
    pod["metadata"]["annotations"][ALLOCATED_ANNOTATION]
        .as_str()
        .and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or_default()
}

/// `spec.nodeName`.
pub fn node_name_of(pod: &Value) -> Option<String> {
    pod["spec"]["nodeName"].as_str().map(str::to_string)
}

/// Whether `pod` (one version of it) is decided and still to be allocated
/// on its decision's node: `(node, pending)`, `None` without a decision.
/// An unbound decided pod is pending too (its bind is in flight).
pub fn pending_entry(pod: &Value) -> Option<(String, bool)> {
    let decision = decision_of(pod)?;
    let deleting = pod["metadata"]["deletionTimestamp"].is_string();
    let elsewhere = node_name_of(pod).is_some_and(|bound| bound != decision.node);
    let pending = !deleting && !elsewhere && !decision.is_complete(&allocated_of(pod));
    Some((decision.node, pending))
}
