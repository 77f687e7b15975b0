//! GPU capacity held for an Elastic GPU claim while no pod uses it.
//!
//! A provisioned claim's `ElasticGPU` carries, in the same
//! `vgpu.io/decision` annotation a pod's decision uses, the node, GPUs and
//! grants of its slice: chosen by the claim controller when the claim is
//! provisioned (`Immediate`), or taken from the first pod placed with the
//! claim (`WaitForFirstConsumer`). The extender counts that slice as taken
//! on its GPUs, so other pods cannot fill it, until a pod holding the claim
//! is placed there; that pod's own decision then counts instead. A pod
//! holding the claim goes only to that node and those GPUs.
//!
//! An `ElasticGPU` that is being deleted, or `Released` (its claim was
//! deleted under reclaim policy `Retain`), holds nothing: a GPU slice keeps
//! no data worth the capacity, and the object stays only as a record.

use crate::cache::gpus::{contribution, Usage};
use crate::vocabulary::claims::claim_key;
use crate::vocabulary::elastic::ElasticGpu;
use std::time::Instant;
use thiserror::Error;
use vgpu_cluster::decision::{Decision, FormatError, DECISION_ANNOTATION};

/// Why the slice an ElasticGPU records cannot be read.
#[derive(Debug, Error)]
pub enum ReservationError {
    #[error("its decision annotation")]
    Decision(#[from] FormatError),
    #[error("its spec does not have the published shape: {0}")]
    Spec(String),
}

/// The slice one `ElasticGPU` holds.
#[derive(Clone, Debug)]
pub struct Reservation {
    /// The `ElasticGPU`'s name.
    pub elastic_gpu: String,
    /// Its claim, `namespace/name`.
    pub claim: String,
    pub node: String,
    /// GPU UUIDs, in the decision's order.
    pub gpus: Vec<String>,
    /// What it takes per GPU UUID.
    pub contribution: Vec<(String, Usage)>,
    pub resource_version: Option<u64>,
    /// Set while the record comes from the extender's own write and the
    /// watch has not shown it yet.
    pub local_since: Option<Instant>,
}

impl Reservation {
    /// The slice `object` holds; `None` when it holds none (no placement
    /// recorded, released, being deleted, or not bound to a claim).
    pub fn from_elastic_gpu(object: &ElasticGpu) -> Result<Option<Self>, ReservationError> {
        let metadata = &object.metadata;
        let Some(annotation) = metadata
            .annotations
            .as_ref()
            .and_then(|annotations| annotations.get(DECISION_ANNOTATION))
        else {
            return Ok(None);
        };
        if metadata.deletion_timestamp.is_some() || object.phase() == Some("Released") {
            return Ok(None);
        }
        let spec = object
            .spec
            .read()
            .map_err(|why| ReservationError::Spec(why.to_string()))?;
        let Some((namespace, claim)) = spec
            .claim_ref
            .as_ref()
            .and_then(|claim| Some((claim.namespace.as_deref()?, claim.name.as_deref()?)))
        else {
            return Ok(None);
        };
        let decision = Decision::parse(annotation)?;
        let gpus = decision
            .containers
            .iter()
            .flat_map(|c| c.devices.iter().map(|d| d.uuid.clone()))
            .collect();
        Ok(Some(Self {
            elastic_gpu: metadata.name.clone().unwrap_or_default(),
            claim: claim_key(namespace, claim),
            node: decision.node.clone(),
            gpus,
            contribution: contribution(&decision, &[], true),
            resource_version: metadata
                .resource_version
                .as_deref()
                .and_then(|v| v.parse().ok()),
            local_since: None,
        }))
    }

    /// The decision a reservation is recorded as: the slice of `decision`
    /// that container `container` was given (a pod placed with the claim),
    /// or all of it (a placement made for the claim alone).
    pub fn decision_for(decision: &Decision, container: Option<&str>) -> Decision {
        let mut kept = decision.clone();
        if let Some(name) = container {
            kept.containers.retain(|c| c.name == name);
        }
        // Held for as long as the claim lives, as an app container's grant
        // is (an init container's is counted only until its pod runs).
        for container in &mut kept.containers {
            container.init = false;
        }
        kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use vgpu_cluster::decision::{ContainerDecision, DeviceGrant, FORMAT_VERSION};

    fn decision() -> Decision {
        Decision {
            version: FORMAT_VERSION,
            node: "n1".into(),
            decided_unix_ms: 1,
            containers: vec![ContainerDecision {
                name: "claim".into(),
                init: false,
                devices: vec![DeviceGrant {
                    uuid: "GPU-1".into(),
                    memory_bytes: 1 << 30,
                    cores_percent: 40,
                    burst_percent: None,
                }],
                priority: None,
            }],
        }
    }

    fn elastic_gpu(phase: &str) -> serde_json::Value {
        json!({
            "metadata": {"name": "egpu-1", "resourceVersion": "7",
                         "annotations": {DECISION_ANNOTATION: decision().to_json()}},
            "spec": {"claimRef": {"namespace": "ns", "name": "c"}},
            "status": {"phase": phase},
        })
    }

    fn read(object: &serde_json::Value) -> Result<Option<Reservation>, ReservationError> {
        let object: ElasticGpu = serde_json::from_value(object.clone()).expect("an ElasticGPU");
        Reservation::from_elastic_gpu(&object)
    }

    #[test]
    fn a_bound_elastic_gpu_holds_its_slice_and_a_released_one_nothing() {
        let held = read(&elastic_gpu("Bound"))
            .expect("readable")
            .expect("held");
        assert_eq!(held.claim, "ns/c");
        assert_eq!(held.node, "n1");
        assert_eq!(held.gpus, ["GPU-1"]);
        assert_eq!(held.resource_version, Some(7));
        assert_eq!(held.contribution.len(), 1);
        assert_eq!(held.contribution[0].1.memory_bytes, 1 << 30);
        assert!(read(&elastic_gpu("Released")).expect("readable").is_none());
        let mut unplaced = elastic_gpu("Bound");
        unplaced["metadata"]["annotations"] = json!({});
        assert!(read(&unplaced).expect("readable").is_none());
        let mut broken = elastic_gpu("Bound");
        broken["metadata"]["annotations"][DECISION_ANNOTATION] = json!("{");
        assert!(matches!(read(&broken), Err(ReservationError::Decision(_))));
        let mut odd = elastic_gpu("Bound");
        odd["spec"]["claimRef"] = json!("ns/c");
        assert!(matches!(read(&odd), Err(ReservationError::Spec(_))));
    }
}
