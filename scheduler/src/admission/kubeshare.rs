//! The JSON patch turning a KubeShare pod's `sharedgpu/` labels
//! ([`crate::vocabulary::kubeshare`]) into vgpu's own resources and
//! annotations, which everything downstream reads as it reads any other
//! vGPU pod.

use crate::admission::patch::{json_pointer_token, resource_patch};
use crate::vocabulary::kubeshare::{
    KubeShareError, KubeShareMemory, KubeShareRequest, LABEL_PREFIX, OPPORTUNISTIC_TASK_PRIORITY,
};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use vgpu_cluster::requests::{asks_for_vgpu, model_key, ResourceNames};
use vgpu_cluster::resources::{GPU_CORES_BURST_ANNOTATION, GPU_MODEL_ANNOTATION};

/// JSON patch operations, and a warning for the user if there is one.
pub type PatchAndWarning = (Vec<Value>, Option<String>);

/// The patch turning a KubeShare pod's `sharedgpu/` labels into vgpu's
/// requests, with a warning when the pod has several containers; `None`
/// for a pod without such labels; or why the labels cannot be served.
pub fn kubeshare_patch(
    pod: &Pod,
    names: &ResourceNames,
    opportunistic_class: Option<(&str, i32)>,
    uses_claims: bool,
) -> Result<Option<PatchAndWarning>, KubeShareError> {
    let Some(labels) = &pod.metadata.labels else {
        return Ok(None);
    };
    let Some(request) = KubeShareRequest::from_labels(labels)? else {
        return Ok(None);
    };
    let spec = pod.spec.as_ref();
    let asking = spec
        .into_iter()
        .flat_map(|spec| {
            spec.containers
                .iter()
                .chain(spec.init_containers.iter().flatten())
        })
        .find(|container| asks_for_vgpu(container, names) || uses_claims);
    if let Some(container) = asking {
        return Err(KubeShareError::AlsoResources(container.name.clone()));
    }
    let patch = request_patch(&request, pod, names, opportunistic_class)?;
    let warning = spec.filter(|spec| spec.containers.len() > 1).map(|spec| {
        format!(
            "vgpu: the {} labels were given to container {:?}, the first of the pod's {}",
            LABEL_PREFIX,
            spec.containers[0].name,
            spec.containers.len()
        )
    });
    Ok(Some((patch, warning)))
}

/// The resources `request` comes to, as `names` spells them.
fn amounts(request: &KubeShareRequest, names: &ResourceNames) -> BTreeMap<String, String> {
    let mut amounts = BTreeMap::new();
    amounts.insert(names.gpu.clone(), request.gpus.to_string());
    amounts.insert(names.cores.clone(), request.cores.to_string());
    match request.memory {
        KubeShareMemory::Mib(mib) => amounts.insert(names.memory.clone(), mib.to_string()),
        KubeShareMemory::Percent(percent) => {
            amounts.insert(names.memory_percentage.clone(), percent.to_string())
        }
    };
    if request.opportunistic() {
        amounts.insert(
            names.priority.clone(),
            OPPORTUNISTIC_TASK_PRIORITY.to_string(),
        );
    }
    amounts
}

/// JSON patch operations giving the pod's first container `request`
/// as vgpu's resources and annotations; `opportunistic_class` (name,
/// value) is the PriorityClass opportunistic pods are given, where
/// they name none. The caller has checked the pod asks for no vGPU
/// resource itself.
fn request_patch(
    request: &KubeShareRequest,
    pod: &Pod,
    names: &ResourceNames,
    opportunistic_class: Option<(&str, i32)>,
) -> Result<Vec<Value>, KubeShareError> {
    let spec = pod.spec.as_ref().ok_or(KubeShareError::NoContainer)?;
    let container = spec.containers.first().ok_or(KubeShareError::NoContainer)?;
    let mut patch = resource_patch(
        container,
        "/spec/containers/0/resources",
        &amounts(request, names),
    );
    let mut annotations = BTreeMap::new();
    if let Some(burst) = request.burst {
        annotations.insert(GPU_CORES_BURST_ANNOTATION, burst.to_string());
    }
    let existing = pod.metadata.annotations.as_ref();
    if let Some(model) = &request.model {
        match existing.and_then(|a| a.get(GPU_MODEL_ANNOTATION)) {
            Some(annotation) if model_key(annotation) != model_key(model) => {
                return Err(KubeShareError::TwoModels {
                    label: model.clone(),
                    annotation: annotation.clone(),
                })
            }
            Some(_) => {}
            None => {
                annotations.insert(GPU_MODEL_ANNOTATION, model.clone());
            }
        }
    }
    if !annotations.is_empty() && existing.is_none() {
        patch.push(json!({"op": "add", "path": "/metadata/annotations", "value": {}}));
    }
    for (key, value) in annotations {
        patch.push(json!({
            "op": "add",
            "path": format!("/metadata/annotations/{}", json_pointer_token(key)),
            "value": value,
        }));
    }
    if let Some((class, value)) = opportunistic_class.filter(|_| request.opportunistic()) {
        let named = spec
            .priority_class_name
            .as_deref()
            .is_some_and(|n| !n.is_empty());
        if !named {
            // The API server's Priority admission ran before this
            // webhook and filled in the default priority; the three
            // fields must agree with the class should it run again.
            patch.push(json!({"op": "add", "path": "/spec/priorityClassName", "value": class}));
            patch.push(json!({"op": "add", "path": "/spec/priority", "value": value}));
            patch.push(json!({"op": "add", "path": "/spec/preemptionPolicy", "value": "Never"}));
        }
    }
    Ok(patch)
}
