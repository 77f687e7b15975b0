//! The JSON patch giving a pod's claimed containers their claims' shares
//! ([`crate::vocabulary::claims`]).

use crate::admission::patch::{json_pointer_token, resource_patch};
use crate::vocabulary::claims::{share_amounts, ClaimShare, ClaimUse, USES_CLAIMS_ANNOTATION};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};
use thiserror::Error;
use vgpu_cluster::resources::ResourceNames;

/// Why a claim's share cannot be written into its container.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ClaimPatchError {
    #[error(
        "container {container} asks for vGPU resources itself and names claim {claim}; use one or the other"
    )]
    AlreadyAsks { container: String, claim: String },
}

/// JSON patch operations giving each claimed container its claim's share
/// (in limits and requests, as `names` spells the resources), and the pod
/// [`USES_CLAIMS_ANNOTATION`]. `shares` holds each use's share, in order.
pub fn claim_patch(
    pod: &Pod,
    uses: &[ClaimUse],
    shares: &[ClaimShare],
    names: &ResourceNames,
) -> Result<Vec<Value>, ClaimPatchError> {
    let mut patch = Vec::new();
    let spec = pod.spec.as_ref();
    for (use_, share) in uses.iter().zip(shares) {
        let container = spec.and_then(|spec| {
            if use_.init {
                spec.init_containers.as_ref()?.get(use_.index)
            } else {
                spec.containers.get(use_.index)
            }
        });
        let Some(container) = container else { continue };
        let resources = container.resources.as_ref();
        let mentioned = |name: &str| {
            resources.is_some_and(|r| {
                [&r.limits, &r.requests]
                    .into_iter()
                    .flatten()
                    .any(|m| m.contains_key(name))
            })
        };
        let own = [
            &names.gpu,
            &names.memory,
            &names.memory_percentage,
            &names.cores,
            &names.elastic_memory,
            &names.elastic_cores,
        ];
        if own.iter().any(|name| mentioned(name)) {
            return Err(ClaimPatchError::AlreadyAsks {
                container: use_.container.clone(),
                claim: use_.claim.clone(),
            });
        }
        let amounts = share_amounts(share, names);
        let list = if use_.init {
            "initContainers"
        } else {
            "containers"
        };
        let base = format!("/spec/{list}/{}/resources", use_.index);
        patch.extend(resource_patch(container, &base, &amounts));
    }
    let claims: Vec<&str> = uses.iter().map(|u| u.claim.as_str()).collect();
    patch.push(json!({
        "op": "add",
        "path": format!("/metadata/annotations/{}", json_pointer_token(USES_CLAIMS_ANNOTATION)),
        "value": claims.join(","),
    }));
    Ok(patch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocabulary::claims::claim_uses;

    fn pod(annotation: (&str, &str), container: &str) -> Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "annotations": {annotation.0: annotation.1}},
            "spec": {"containers": [{"name": container, "image": "cuda"}]},
        }))
        .expect("pod")
    }

    #[test]
    fn the_patch_gives_the_container_its_share_and_records_the_claim() {
        let names = ResourceNames::default();
        let readme = pod(
            ("egpuc.elasticgpu.io/test1", "gpushare-egpuc-1"),
            "test-cuda",
        );
        let uses = claim_uses(&readme).expect("uses");
        let share = ClaimShare {
            count: 1,
            cores: Some(10),
            memory_mib: Some(4096),
        };
        let patch = claim_patch(&readme, &uses, &[share], &names).expect("patch");
        let amounts = json!({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "10", "nvidia.com/gpumem": "4096"});
        assert_eq!(
            patch,
            vec![
                json!({"op": "add", "path": "/spec/containers/0/resources", "value": {}}),
                json!({"op": "add", "path": "/spec/containers/0/resources/limits", "value": amounts}),
                json!({"op": "add", "path": "/spec/containers/0/resources/requests", "value": amounts}),
                json!({"op": "add", "path": "/metadata/annotations/vgpu.io~1elasticgpu-claims", "value": "gpushare-egpuc-1"}),
            ]
        );
        // A container that asks for vGPUs itself cannot also take a claim.
        let mut asking = readme.clone();
        if let Some(spec) = asking.spec.as_mut() {
            spec.containers[0].resources = Some(
                serde_json::from_value(json!({"limits": {"nvidia.com/gpu": "1"}}))
                    .expect("resources"),
            );
        }
        let error = claim_patch(&asking, &uses, &[share], &names).expect_err("both");
        assert!(
            error.to_string().contains("use one or the other"),
            "{error}"
        );
    }
}
