//! The ElasticGPU a claim is bound to: the slice it records, how it is
//! written and reclaimed, and whether any GPU could hold a claim's share.

use crate::api::{ApiError, KubeApi};
use crate::cache::reservations::Reservation;
use crate::extender::Scheduler;
use crate::vocabulary::claims::{claim_uses, claims_held, ClaimShare, CLAIM_CORE, CLAIM_MEMORY};
use crate::vocabulary::elastic::{
    Amount, Amounts, ElasticGpu, ElasticGpuClaim, ElasticGpuNodeAffinity, ElasticGpuSpec,
    ElasticGpuStatus, GpuShare, PhysicalGpu, STORED_VERSION,
};
use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectReference, Pod,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::json;
use std::collections::BTreeMap;
use vgpu_cluster::decision::{Decision, DECISION_ANNOTATION};

/// The slice the first placed pod of `namespace` holding `claim` was
/// given, if one was placed.
pub async fn placed_holder(
    api: &KubeApi,
    namespace: &str,
    claim: &str,
) -> Result<Option<Decision>, ApiError> {
    let pods = api.pods_in(namespace).await?;
    Ok(pods.iter().find_map(|pod| slice_of(pod, claim)))
}

/// The part of `pod`'s decision given to the container holding `claim`, if
/// the pod holds it and has been decided.
fn slice_of(pod: &Pod, claim: &str) -> Option<Decision> {
    let container = claim_uses(pod)
        .ok()?
        .into_iter()
        .find(|claim_use| claim_use.claim == claim)?
        .container;
    if !claims_held(pod).contains(&claim) {
        return None;
    }
    let text = pod
        .metadata
        .annotations
        .as_ref()?
        .get(DECISION_ANNOTATION)?;
    let decision = Decision::parse(text).ok()?;
    let slice = Reservation::decision_for(&decision, Some(&container));
    (!slice.containers.is_empty()).then_some(slice)
}

/// Creates ElasticGPU `name` for `claim` holding `slice` (or, when it
/// exists, records the slice on it); answers it as written.
pub async fn write_elastic_gpu(
    api: &KubeApi,
    name: &str,
    claim: &ElasticGpuClaim,
    share: &ClaimShare,
    slice: &Decision,
) -> Result<ElasticGpu, ApiError> {
    let object = elastic_gpu(name, claim, share, slice);
    match api.create_elastic_gpu(&object).await {
        Err(ApiError::Conflict(_)) => {
            let existing = api.get_elastic_gpu(name).await?;
            // A merge patch: what the existing object holds beyond what
            // vgpu writes is kept; its version is the precondition.
            let mut patch = json!(object);
            patch["metadata"]["resourceVersion"] = json!(existing.metadata.resource_version);
            api.patch_elastic_gpu(name, &patch).await
        }
        other => other,
    }
}

/// The ElasticGPU a claim is bound to, holding `slice`.
fn elastic_gpu(
    name: &str,
    claim: &ElasticGpuClaim,
    share: &ClaimShare,
    slice: &Decision,
) -> ElasticGpu {
    let mut capacity = Amounts::new();
    if let Some(cores) = share.cores {
        capacity.insert(
            CLAIM_CORE.into(),
            Amount::Text((share.count * cores).to_string()),
        );
    }
    if let Some(mib) = share.memory_mib {
        capacity.insert(CLAIM_MEMORY.into(), Amount::Text(format!("{mib}Mi")));
    }
    let gpus: Vec<String> = slice
        .containers
        .iter()
        .flat_map(|c| c.devices.iter().map(|d| d.uuid.clone()))
        .collect();
    let on_its_node = NodeSelectorTerm {
        match_fields: Some(vec![NodeSelectorRequirement {
            key: "metadata.name".into(),
            operator: "In".into(),
            values: Some(vec![slice.node.clone()]),
        }]),
        match_expressions: None,
    };
    let mut spec = ElasticGpuSpec {
        capacity: Some(capacity),
        claim_ref: Some(ObjectReference {
            api_version: Some(STORED_VERSION.into()),
            kind: Some("ElasticGPUClaim".into()),
            namespace: claim.metadata.namespace.clone(),
            name: claim.metadata.name.clone(),
            uid: claim.metadata.uid.clone(),
            ..ObjectReference::default()
        }),
        node_affinity: Some(ElasticGpuNodeAffinity {
            required: Some(NodeSelector {
                node_selector_terms: vec![on_its_node],
            }),
        }),
        ..ElasticGpuSpec::default()
    };
    // Published shapes: a share of one GPU, or whole GPUs.
    match gpus.as_slice() {
        [gpu] if share.count == 1 => {
            spec.gpu_share = Some(GpuShare {
                gpu_name: Some(gpu.clone()),
            })
        }
        _ => spec.physical_gpu = Some(PhysicalGpu { gpu_names: gpus }),
    }
    let metadata = ObjectMeta {
        name: Some(name.into()),
        labels: Some(BTreeMap::from([(
            "app.kubernetes.io/managed-by".to_string(),
            "vgpu".to_string(),
        )])),
        annotations: Some(BTreeMap::from([(
            DECISION_ANNOTATION.to_string(),
            slice.to_json(),
        )])),
        ..ObjectMeta::default()
    };
    ElasticGpu::new(metadata, spec)
}

/// Marks ElasticGPU `name` bound to `claim` (`namespace/name`).
pub async fn mark_bound(api: &KubeApi, name: &str, claim: &str) -> Result<(), ApiError> {
    let status = ElasticGpuStatus {
        phase: Some("Bound".into()),
        reason: Some(String::new()),
        message: Some(format!("bound to ElasticGPUClaim {claim}")),
    };
    api.patch_elastic_gpu_status(name, &json!({ "status": status }))
        .await
}

/// Why no GPU of the cluster could hold `share`, if none could.
pub fn unsatisfiable(scheduler: &Scheduler, share: &ClaimShare) -> Option<String> {
    let state = scheduler.state().read();
    if !state.synced() {
        return None;
    }
    let mut largest_mib = 0u64;
    let mut most_gpus = 0u64;
    for (_, node) in state.nodes() {
        let healthy = node.gpus.gpus.iter().filter(|g| g.healthy);
        most_gpus = most_gpus.max(healthy.clone().count() as u64);
        largest_mib = largest_mib.max(healthy.map(|g| g.offered_bytes() >> 20).max().unwrap_or(0));
    }
    if share.count > most_gpus {
        return Some(format!(
            "it asks for {} GPUs; no node has more than {most_gpus} healthy",
            share.count
        ));
    }
    match share.memory_mib {
        Some(mib) if mib > largest_mib => Some(format!(
            "it asks for {mib} MiB of one GPU; the largest GPU in the cluster has {largest_mib} MiB"
        )),
        _ => None,
    }
}

/// What the class's reclaim policy `policy` does with ElasticGPU `egpu`
/// once its claim (`namespace/name`) is deleted: `Retain` leaves it
/// `Released`, anything else deletes it. One already gone is reclaimed.
pub async fn reclaim(api: &KubeApi, egpu: &str, policy: &str, claim: &str) -> Result<(), ApiError> {
    let result = if policy == "Retain" {
        let status = ElasticGpuStatus {
            phase: Some("Released".into()),
            reason: Some("ClaimDeleted".into()),
            message: Some(format!(
                "ElasticGPUClaim {claim} was deleted; kept (reclaim policy Retain)"
            )),
        };
        api.patch_elastic_gpu_status(egpu, &json!({ "status": status }))
            .await
    } else {
        api.delete_elastic_gpu(egpu).await
    };
    match result {
        Err(ApiError::NotFound(_)) => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_cluster::decision::{ContainerDecision, DeviceGrant, FORMAT_VERSION};

    fn slice(gpus: &[&str]) -> Decision {
        Decision {
            version: FORMAT_VERSION,
            node: "n1".into(),
            decided_unix_ms: 1,
            containers: vec![ContainerDecision {
                name: "claim".into(),
                init: false,
                devices: gpus
                    .iter()
                    .map(|uuid| DeviceGrant {
                        uuid: uuid.to_string(),
                        memory_bytes: 1 << 30,
                        cores_percent: 100,
                        burst_percent: None,
                    })
                    .collect(),
                priority: None,
            }],
        }
    }

    fn claim() -> ElasticGpuClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "u-1"},
            "spec": {"elasticGPUClassName": "gpushare"},
        }))
        .expect("a claim")
    }

    #[test]
    fn a_share_of_one_gpu_and_whole_gpus_are_written_in_the_published_shapes() {
        let share = ClaimShare {
            count: 1,
            cores: Some(30),
            memory_mib: Some(512),
        };
        let written = json!(elastic_gpu(
            "egpu-u-1",
            &claim(),
            &share,
            &slice(&["GPU-1"])
        ));
        assert_eq!(written["apiVersion"], STORED_VERSION);
        assert_eq!(written["kind"], "ElasticGPU");
        assert_eq!(
            written["spec"]["capacity"],
            json!({CLAIM_CORE: "30", CLAIM_MEMORY: "512Mi"})
        );
        assert_eq!(written["spec"]["gpuShare"], json!({"gpuName": "GPU-1"}));
        assert!(written["spec"].get("physicalGPU").is_none());
        assert_eq!(
            written["spec"]["claimRef"],
            json!({"apiVersion": STORED_VERSION, "kind": "ElasticGPUClaim",
                   "namespace": "ns", "name": "c", "uid": "u-1"})
        );
        assert_eq!(
            written["spec"]["nodeAffinity"],
            json!({"required": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}})
        );
        assert_eq!(
            written["metadata"]["labels"]["app.kubernetes.io/managed-by"],
            "vgpu"
        );
        let recorded = written["metadata"]["annotations"][DECISION_ANNOTATION]
            .as_str()
            .expect("the slice");
        assert_eq!(Decision::parse(recorded).expect("parses").node, "n1");

        let whole = ClaimShare {
            count: 2,
            cores: Some(100),
            memory_mib: None,
        };
        let written = json!(elastic_gpu(
            "e",
            &claim(),
            &whole,
            &slice(&["GPU-1", "GPU-2"])
        ));
        assert_eq!(written["spec"]["capacity"], json!({CLAIM_CORE: "200"}));
        assert_eq!(
            written["spec"]["physicalGPU"],
            json!({"gpuNames": ["GPU-1", "GPU-2"]})
        );
        assert!(written["spec"].get("gpuShare").is_none());
    }
}
