//! Reading a pod's request from its spec and annotations.

use crate::policy::{
    GPU_POLICY_ANNOTATION, HAMI_GPU_POLICY_ANNOTATION, HAMI_NODE_POLICY_ANNOTATION,
    NODE_POLICY_ANNOTATION,
};
use crate::requests::pod_request::{
    model_key, ContainerKind, ContainerRequest, MemoryRequest, PodRequest, RequestDefaults,
    Selectors,
};
use crate::resources::{
    parse_whole_quantity, ResourceNames, GPU_CORES_BURST_ANNOTATION, GPU_MODEL_ANNOTATION,
    NOUSE_GPU_TYPE_ANNOTATION, NOUSE_GPU_UUID_ANNOTATION, USE_GPU_TYPE_ANNOTATION,
    USE_GPU_UUID_ANNOTATION,
};
use k8s_openapi::api::core::v1::{Container, Pod};
use std::collections::BTreeMap;
use thiserror::Error;

/// The most GPUs one container may ask for (the shim handles 16 devices).
pub const MAX_GPUS_PER_CONTAINER: u64 = 16;

/// A pod whose GPU request cannot be served as written.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum RequestError {
    #[error("container {container:?}: {resource} {value:?}: {reason}")]
    Value {
        container: String,
        resource: String,
        value: String,
        reason: String,
    },
    #[error("container {container:?}: {reason}")]
    Container { container: String, reason: String },
    #[error("annotation {annotation}: {reason}")]
    AnnotationValue {
        annotation: &'static str,
        reason: String,
    },
    #[error("annotation {annotation}")]
    Annotation {
        annotation: &'static str,
        #[source]
        source: crate::policy::UnknownPolicy,
    },
}

/// A number fixed for a pod: a hash of its UID (or, before it has one, its
/// namespace and name).
fn identity_seed(pod: &Pod) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    match pod.metadata.uid.as_deref() {
        Some(uid) => uid.hash(&mut hasher),
        None => (&pod.metadata.namespace, &pod.metadata.name).hash(&mut hasher),
    }
    hasher.finish()
}

/// Reads a pod's GPU request.
pub fn parse_pod(
    pod: &Pod,
    names: &ResourceNames,
    defaults: &RequestDefaults,
) -> Result<PodRequest, RequestError> {
    let mut request = PodRequest {
        seed: identity_seed(pod),
        priority_class: pod
            .spec
            .as_ref()
            .and_then(|spec| spec.priority_class_name.clone()),
        ..PodRequest::default()
    };
    if let Some(spec) = &pod.spec {
        for container in spec.init_containers.iter().flatten() {
            let kind = if container.restart_policy.as_deref() == Some("Always") {
                ContainerKind::Sidecar
            } else {
                ContainerKind::Init
            };
            if let Some(parsed) = parse_container(container, kind, names, defaults)? {
                request.containers.push(parsed);
            }
        }
        for container in &spec.containers {
            if let Some(parsed) = parse_container(container, ContainerKind::App, names, defaults)? {
                request.containers.push(parsed);
            }
        }
    }
    let empty = BTreeMap::new();
    let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    let list = |key: &str, lower: bool| -> Vec<String> {
        annotations
            .get(key)
            .map(|text| {
                text.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| {
                        if lower {
                            s.to_ascii_lowercase()
                        } else {
                            s.to_string()
                        }
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    request.selectors = Selectors {
        use_types: list(USE_GPU_TYPE_ANNOTATION, true),
        nouse_types: list(NOUSE_GPU_TYPE_ANNOTATION, true),
        use_uuids: list(USE_GPU_UUID_ANNOTATION, false),
        nouse_uuids: list(NOUSE_GPU_UUID_ANNOTATION, false),
        model: match annotations.get(GPU_MODEL_ANNOTATION) {
            None => None,
            Some(text) if text.trim().is_empty() => {
                return Err(RequestError::AnnotationValue {
                    annotation: GPU_MODEL_ANNOTATION,
                    reason: "empty; name a GPU model, e.g. \"Tesla V100-SXM2-32GB\"".to_string(),
                })
            }
            Some(text) => Some(model_key(text)),
        },
    };
    request.gpu_policy = policy_annotation(
        annotations,
        GPU_POLICY_ANNOTATION,
        HAMI_GPU_POLICY_ANNOTATION,
    )?;
    request.node_policy = policy_annotation(
        annotations,
        NODE_POLICY_ANNOTATION,
        HAMI_NODE_POLICY_ANNOTATION,
    )?;
    if let Some(text) = annotations.get(GPU_CORES_BURST_ANNOTATION) {
        let burst = text
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|percent| (1..=100).contains(percent))
            .ok_or_else(|| RequestError::AnnotationValue {
                annotation: GPU_CORES_BURST_ANNOTATION,
                reason: format!("{text:?} is not a whole percentage from 1 to 100"),
            })?;
        request.burst_percent = Some(burst);
    }
    Ok(request)
}

fn policy_annotation<P: std::str::FromStr<Err = crate::policy::UnknownPolicy>>(
    annotations: &BTreeMap<String, String>,
    ours: &'static str,
    hami: &'static str,
) -> Result<Option<P>, RequestError> {
    for key in [ours, hami] {
        if let Some(value) = annotations.get(key) {
            return value
                .parse()
                .map(Some)
                .map_err(|source| RequestError::Annotation {
                    annotation: key,
                    source,
                });
        }
    }
    Ok(None)
}

/// One resource of one container, as a whole number (limits first, as
/// kubelet and the device plugin read them, then requests).
fn quantity(container: &Container, resource: &str) -> Result<Option<u64>, RequestError> {
    let resources = match &container.resources {
        Some(resources) => resources,
        None => return Ok(None),
    };
    let raw = resources
        .limits
        .as_ref()
        .and_then(|l| l.get(resource))
        .or_else(|| resources.requests.as_ref().and_then(|r| r.get(resource)));
    match raw {
        None => Ok(None),
        Some(value) => parse_whole_quantity(&value.0)
            .map(Some)
            .map_err(|e| RequestError::Value {
                container: container.name.clone(),
                resource: resource.to_string(),
                value: value.0.clone(),
                reason: match e {
                    crate::resources::KubeQuantityError::Negative(_) => {
                        "must not be negative".to_string()
                    }
                    crate::resources::KubeQuantityError::Fractional(_) => {
                        "must be a whole number".to_string()
                    }
                    other => other.to_string(),
                },
            }),
    }
}

/// How many GPUs an Elastic GPU request comes to: `gpu-core` above 100
/// asks for whole GPUs (200 = two), anything else for a share of one. (A
/// count that is not a whole multiple is refused when the request is read.)
pub fn elastic_gpu_count(elastic_cores: Option<u64>) -> u64 {
    match elastic_cores {
        Some(cores) if cores > 100 => cores / 100,
        _ => 1,
    }
}

/// The GPU count the webhook adds to `container` so that kubelet calls the
/// device plugin for it: `Some` for a container that asks for Elastic GPU
/// resources and names no GPU count; `None` otherwise, and for requests
/// that cannot be read (the extender explains those when it places the
/// pod).
pub fn elastic_count_to_add(container: &Container, names: &ResourceNames) -> Option<u64> {
    let read = |resource: &str| quantity(container, resource).ok().flatten();
    if quantity(container, &names.gpu).ok()?.is_some() {
        return None;
    }
    let cores = read(&names.elastic_cores).filter(|&v| v > 0);
    let memory = read(&names.elastic_memory).filter(|&v| v > 0);
    (cores.is_some() || memory.is_some()).then(|| elastic_gpu_count(cores))
}

/// Whether `container` asks for one of the vGPU resources.
pub fn asks_for_vgpu(container: &Container, names: &ResourceNames) -> bool {
    let vgpu_resources = [&names.gpu, &names.elastic_memory, &names.elastic_cores];
    container.resources.as_ref().is_some_and(|resources| {
        [&resources.limits, &resources.requests]
            .into_iter()
            .flatten()
            .any(|quantities| {
                vgpu_resources
                    .iter()
                    .any(|name| quantities.contains_key(*name))
            })
    })
}

fn parse_container(
    container: &Container,
    kind: ContainerKind,
    names: &ResourceNames,
    defaults: &RequestDefaults,
) -> Result<Option<ContainerRequest>, RequestError> {
    let gpu = quantity(container, &names.gpu)?;
    let memory = quantity(container, &names.memory)?;
    let percentage = quantity(container, &names.memory_percentage)?;
    let cores = quantity(container, &names.cores)?;
    let priority = quantity(container, &names.priority)?;
    let elastic_memory = quantity(container, &names.elastic_memory)?.filter(|&v| v > 0);
    let elastic_cores = quantity(container, &names.elastic_cores)?.filter(|&v| v > 0);

    let name = container.name.clone();
    let value_error = |resource: &str, value: u64, reason: &str| RequestError::Value {
        container: name.clone(),
        resource: resource.to_string(),
        value: value.to_string(),
        reason: reason.to_string(),
    };
    let container_error = |reason: String| RequestError::Container {
        container: name.clone(),
        reason,
    };
    let priority = priority
        .map(|p| i32::try_from(p).map_err(|_| value_error(&names.priority, p, "too large")))
        .transpose()?;
    let mib = |resource: &str, value: u64| -> Result<u64, RequestError> {
        if value == 0 {
            return Err(value_error(
                resource,
                value,
                "0 MiB is no memory; leave the resource out to get the default",
            ));
        }
        value
            .checked_mul(1 << 20)
            .ok_or_else(|| value_error(resource, value, "too large"))
    };

    let wants_nvidia = gpu.is_some_and(|g| g > 0);
    let nvidia_extras = memory.is_some() || percentage.is_some() || cores.is_some();
    let wants_elastic = elastic_memory.is_some() || elastic_cores.is_some();
    if wants_elastic && nvidia_extras {
        return Err(container_error(format!(
            "asks for both {} resources and {}/{}; use one kind",
            names.gpu, names.elastic_memory, names.elastic_cores
        )));
    }

    if wants_elastic {
        // The webhook adds the GPU count an Elastic GPU request implies
        // (kubelet calls the device plugin only for a device resource); a
        // count that says something else is a contradiction.
        let implied = elastic_gpu_count(elastic_cores);
        match gpu {
            Some(count) if count != implied => {
                return Err(container_error(format!(
                    "asks for {count} {} beside {}/{}, which come to {implied} GPU(s); leave {} out (vgpu's webhook adds it) or use one kind",
                    names.gpu, names.elastic_memory, names.elastic_cores, names.gpu
                )))
            }
            Some(_) => {}
            // Without the count kubelet would hand the container no GPU
            // (or, under a runtime that exposes every GPU, all of them
            // uncapped): placing it would give nothing that holds.
            None => {
                return Err(container_error(format!(
                    "asks for {}/{} without {}: {implied}, which vgpu's admission webhook adds and kubelet allocates by; was the pod created while the webhook was off, or in a namespace labelled vgpu.io/webhook=ignore? Create it again (or add {}: {implied})",
                    names.elastic_memory, names.elastic_cores, names.gpu, names.gpu
                )))
            }
        }
        let (count, cores, memory) = match (elastic_cores, elastic_memory) {
            (Some(c), Some(_)) if c > 100 => {
                return Err(container_error(format!(
                    "{} {c} asks for whole GPUs, which come with all their memory; leave {} out",
                    names.elastic_cores, names.elastic_memory
                )))
            }
            (Some(c), None) if c > 100 => {
                if c % 100 != 0 {
                    return Err(value_error(
                        &names.elastic_cores,
                        c,
                        "above 100 it must be a multiple of 100 (whole GPUs)",
                    ));
                }
                let count = c / 100;
                if count > MAX_GPUS_PER_CONTAINER {
                    return Err(value_error(
                        &names.elastic_cores,
                        c,
                        &format!("at most {MAX_GPUS_PER_CONTAINER} GPUs per container"),
                    ));
                }
                (count as u32, 100, MemoryRequest::Whole)
            }
            (Some(c), Some(m)) => (
                1,
                c as u32,
                MemoryRequest::Bytes(mib(&names.elastic_memory, m)?),
            ),
            // A compute share alone gets the same share of the memory.
            (Some(c), None) => (1, c as u32, MemoryRequest::Percent(c as u32)),
            (None, Some(m)) => (
                1,
                defaults.cores,
                MemoryRequest::Bytes(mib(&names.elastic_memory, m)?),
            ),
            (None, None) => return Ok(None),
        };
        return Ok(Some(ContainerRequest {
            name: container.name.clone(),
            kind,
            count,
            memory,
            cores,
            priority,
        }));
    }

    if !wants_nvidia {
        if let Some((resource, value)) = [
            (&names.memory, memory),
            (&names.memory_percentage, percentage),
            (&names.cores, cores),
        ]
        .into_iter()
        .find_map(|(r, v)| v.map(|v| (r, v)))
        {
            return Err(container_error(format!(
                "sets {resource} ({value}) without {}; add {}: 1 (kubelet only hands GPUs to containers that ask for {})",
                names.gpu, names.gpu, names.gpu
            )));
        }
        return Ok(None);
    }
    let count = gpu.unwrap_or(0);
    if count > MAX_GPUS_PER_CONTAINER {
        return Err(value_error(
            &names.gpu,
            count,
            &format!("at most {MAX_GPUS_PER_CONTAINER} GPUs per container"),
        ));
    }
    let memory = match (memory, percentage) {
        (Some(_), Some(_)) => {
            return Err(container_error(format!(
                "sets both {} and {}; use one",
                names.memory, names.memory_percentage
            )))
        }
        (Some(m), None) => MemoryRequest::Bytes(mib(&names.memory, m)?),
        (None, Some(p)) if (1..=100).contains(&p) => MemoryRequest::Percent(p as u32),
        (None, Some(p)) => {
            return Err(value_error(
                &names.memory_percentage,
                p,
                "must be from 1 to 100",
            ))
        }
        (None, None) if defaults.memory_mib > 0 => {
            MemoryRequest::Bytes(defaults.memory_mib.saturating_mul(1 << 20))
        }
        (None, None) => MemoryRequest::Whole,
    };
    let cores = match cores {
        Some(c) if c > 100 => {
            return Err(value_error(
                &names.cores,
                c,
                "must be from 0 to 100 (percent of one GPU)",
            ))
        }
        Some(c) => c as u32,
        None => defaults.cores,
    };
    Ok(Some(ContainerRequest {
        name: container.name.clone(),
        kind,
        count: count as u32,
        memory,
        cores,
        priority,
    }))
}
