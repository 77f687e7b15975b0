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
//! choose the policies (see [`crate::vocabulary::policy`]).

use crate::vocabulary::policy::{
    GpuPolicy, NodePolicy, GPU_POLICY_ANNOTATION, HAMI_GPU_POLICY_ANNOTATION,
    HAMI_NODE_POLICY_ANNOTATION, NODE_POLICY_ANNOTATION,
};
use k8s_openapi::api::core::v1::{Container, Pod};
use std::collections::BTreeMap;
use thiserror::Error;
use vgpu_cluster::resources::{
    parse_whole_quantity, GPU_CORES_BURST_ANNOTATION, GPU_MODEL_ANNOTATION,
    NOUSE_GPU_TYPE_ANNOTATION, NOUSE_GPU_UUID_ANNOTATION, USE_GPU_TYPE_ANNOTATION,
    USE_GPU_UUID_ANNOTATION,
};

/// The most GPUs one container may ask for (the shim handles 16 devices).
pub const MAX_GPUS_PER_CONTAINER: u64 = 16;

pub use vgpu_cluster::resources::ResourceNames;

/// What a vGPU gets when the container does not say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestDefaults {
    /// Memory per vGPU in MiB; 0 = the whole GPU's memory.
    pub memory_mib: u64,
    /// Compute share per vGPU in percent.
    pub cores: u32,
}

/// Where a container sits in kubelet's admission order and lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContainerKind {
    /// A regular init container: runs alone, before the others.
    Init,
    /// An init container with `restartPolicy: Always`: runs alongside.
    Sidecar,
    /// A regular container.
    App,
}

impl ContainerKind {
    pub fn is_init(self) -> bool {
        matches!(self, Self::Init | Self::Sidecar)
    }
}

/// Device memory wanted on each vGPU. On a node that scales device memory
/// (HAMi's `deviceMemoryScaling`) a GPU's memory here is what it offers,
/// its physical memory times the factor: a percentage is of that, and the
/// whole of it is that.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryRequest {
    Bytes(u64),
    /// Percent of the GPU's memory (1..=100).
    Percent(u32),
    /// The GPU's whole memory.
    Whole,
}

impl MemoryRequest {
    /// Bytes wanted on a GPU with `total` bytes (percentages round down to
    /// whole MiB, as the limits are written in MiB, but to at least 1 MiB).
    pub fn bytes_on(self, total: u64) -> u64 {
        match self {
            Self::Bytes(bytes) => bytes,
            Self::Percent(percent) => {
                let bytes = (u128::from(total) * u128::from(percent) / 100) as u64;
                // Never a zero cap: the shim reads 0 as "uncapped".
                (bytes & !((1 << 20) - 1)).max(1 << 20)
            }
            Self::Whole => total,
        }
    }

    /// How a person reads the request.
    pub fn describe(self) -> String {
        match self {
            Self::Bytes(bytes) => format!("{} MiB", bytes >> 20),
            Self::Percent(percent) => format!("{percent} percent of the memory"),
            Self::Whole => "all the memory".to_string(),
        }
    }
}

/// One GPU-using container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerRequest {
    pub name: String,
    pub kind: ContainerKind,
    /// Number of vGPUs, each on a different physical GPU.
    pub count: u32,
    pub memory: MemoryRequest,
    /// Compute share per vGPU, percent (100: exclusive).
    pub cores: u32,
    pub priority: Option<i32>,
}

impl ContainerRequest {
    pub fn exclusive(&self) -> bool {
        self.cores >= 100
    }
}

/// GPU restrictions from the pod's annotations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selectors {
    /// Lower-cased model substrings; empty = any model.
    pub use_types: Vec<String>,
    pub nouse_types: Vec<String>,
    /// UUIDs; empty = any GPU.
    pub use_uuids: Vec<String>,
    pub nouse_uuids: Vec<String>,
    /// The one model wanted ([`GPU_MODEL_ANNOTATION`]), in the form
    /// [`model_key`] gives.
    pub model: Option<String>,
}

/// A GPU model name as compared with a wanted model: lower case, with
/// spaces and `_` written as `-`.
pub fn model_key(model: &str) -> String {
    model
        .trim()
        .chars()
        .map(|c| match c {
            ' ' | '_' => '-',
            c => c.to_ascii_lowercase(),
        })
        .collect()
}

impl Selectors {
    /// Whether a GPU model (given in lower case) is wanted.
    pub fn model_allowed(&self, model_lowercase: &str) -> Result<(), TypeMismatch> {
        let model = model_lowercase;
        if let Some(index) = self
            .nouse_types
            .iter()
            .position(|p| model.contains(p.as_str()))
        {
            return Err(TypeMismatch::Excluded(index));
        }
        if !self.use_types.is_empty() && !self.use_types.iter().any(|p| model.contains(p.as_str()))
        {
            return Err(TypeMismatch::NotWanted);
        }
        if let Some(wanted) = &self.model {
            if model_key(model) != *wanted {
                return Err(TypeMismatch::NotTheModel);
            }
        }
        Ok(())
    }

    /// Whether any rule on GPU models is given.
    pub fn restrict_models(&self) -> bool {
        !self.use_types.is_empty() || !self.nouse_types.is_empty() || self.model.is_some()
    }

    /// Whether `uuid` is wanted.
    pub fn uuid_allowed(&self, uuid: &str) -> Result<(), UuidMismatch> {
        if self
            .nouse_uuids
            .iter()
            .any(|u| u.eq_ignore_ascii_case(uuid))
        {
            return Err(UuidMismatch::Excluded);
        }
        if !self.use_uuids.is_empty()
            && !self.use_uuids.iter().any(|u| u.eq_ignore_ascii_case(uuid))
        {
            return Err(UuidMismatch::NotWanted);
        }
        Ok(())
    }
}

/// Why a GPU model is not wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TypeMismatch {
    /// Not one of the `use` types.
    NotWanted,
    /// Not the model named by [`GPU_MODEL_ANNOTATION`].
    NotTheModel,
    /// Matches `nouse_types[i]`.
    Excluded(usize),
}

/// Why a GPU UUID is not wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UuidMismatch {
    NotWanted,
    Excluded,
}

/// Everything the extender needs from a pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodRequest {
    /// GPU-using containers in kubelet's admission order: init containers
    /// first, in spec order, then the others.
    pub containers: Vec<ContainerRequest>,
    pub selectors: Selectors,
    pub gpu_policy: Option<GpuPolicy>,
    pub node_policy: Option<NodePolicy>,
    /// Burst share in percent for every capped vGPU of the pod.
    pub burst_percent: Option<u32>,
    /// Drawn from the pod's identity: what the `random` GPU policy draws
    /// by, the same in every verb for the same pod.
    pub seed: u64,
}

impl PodRequest {
    /// Whether the pod uses no GPU at all.
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty()
    }

    /// A one-line summary for logs.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .containers
            .iter()
            .map(|c| {
                format!(
                    "{}: {} x ({}, {} percent compute)",
                    c.name,
                    c.count,
                    c.memory.describe(),
                    c.cores
                )
            })
            .collect();
        parts.join("; ")
    }
}

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
        source: crate::vocabulary::policy::UnknownPolicy,
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

fn policy_annotation<P: std::str::FromStr<Err = crate::vocabulary::policy::UnknownPolicy>>(
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
                    vgpu_cluster::resources::KubeQuantityError::Negative(_) => {
                        "must not be negative".to_string()
                    }
                    vgpu_cluster::resources::KubeQuantityError::Fractional(_) => {
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodSpec, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn container(name: &str, limits: &[(&str, &str)]) -> Container {
        Container {
            name: name.into(),
            resources: Some(ResourceRequirements {
                limits: Some(
                    limits
                        .iter()
                        .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                        .collect(),
                ),
                ..ResourceRequirements::default()
            }),
            ..Container::default()
        }
    }

    fn pod(containers: Vec<Container>, init: Vec<Container>) -> Pod {
        Pod {
            spec: Some(PodSpec {
                containers,
                init_containers: Some(init),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    fn parse(p: &Pod) -> Result<PodRequest, RequestError> {
        parse_pod(p, &ResourceNames::default(), &RequestDefaults::default())
    }

    #[test]
    fn hami_resources_with_canonical_quantities() {
        let p = pod(
            vec![
                container(
                    "main",
                    &[
                        ("nvidia.com/gpu", "2"),
                        ("nvidia.com/gpumem", "3k"),
                        ("nvidia.com/gpucores", "30"),
                        ("nvidia.com/priority", "0"),
                    ],
                ),
                container("sidecar-less", &[("cpu", "1")]),
            ],
            vec![container(
                "setup",
                &[
                    ("nvidia.com/gpu", "1"),
                    ("nvidia.com/gpumem-percentage", "25"),
                ],
            )],
        );
        let request = parse(&p).expect("parse");
        assert_eq!(request.containers.len(), 2);
        let setup = &request.containers[0];
        assert_eq!(
            (setup.name.as_str(), setup.kind),
            ("setup", ContainerKind::Init)
        );
        assert_eq!(setup.memory, MemoryRequest::Percent(25));
        let main = &request.containers[1];
        assert_eq!(main.count, 2);
        assert_eq!(main.memory, MemoryRequest::Bytes(3000 << 20));
        assert_eq!(main.cores, 30);
        assert_eq!(main.priority, Some(0));
        assert!(!main.exclusive());
    }

    #[test]
    fn defaults_apply_when_unset() {
        let p = pod(vec![container("main", &[("nvidia.com/gpu", "1")])], vec![]);
        assert_eq!(
            parse(&p).expect("parse").containers[0].memory,
            MemoryRequest::Whole
        );
        let request = parse_pod(
            &p,
            &ResourceNames::default(),
            &RequestDefaults {
                memory_mib: 1024,
                cores: 10,
            },
        )
        .expect("parse");
        assert_eq!(request.containers[0].memory, MemoryRequest::Bytes(1 << 30));
        assert_eq!(request.containers[0].cores, 10);
    }

    type ElasticCase<'a> = (&'a [(&'a str, &'a str)], u32, u32, MemoryRequest);

    #[test]
    fn elastic_gpu_resources() {
        let cases: &[ElasticCase] = &[
            (
                &[("elasticgpu.io/gpu-memory", "256")],
                1,
                0,
                MemoryRequest::Bytes(256 << 20),
            ),
            (
                &[("elasticgpu.io/gpu-core", "50")],
                1,
                50,
                MemoryRequest::Percent(50),
            ),
            (
                &[
                    ("elasticgpu.io/gpu-core", "30"),
                    ("elasticgpu.io/gpu-memory", "1024"),
                ],
                1,
                30,
                MemoryRequest::Bytes(1 << 30),
            ),
            (
                &[("elasticgpu.io/gpu-core", "200")],
                2,
                100,
                MemoryRequest::Whole,
            ),
        ];
        for (limits, count, cores, memory) in cases {
            // With the GPU count the webhook adds.
            let gpus = count.to_string();
            let mut with_count = limits.to_vec();
            with_count.push(("nvidia.com/gpu", &gpus));
            let request = parse(&pod(vec![container("c", &with_count)], vec![])).expect("parse");
            let c = &request.containers[0];
            assert_eq!(
                (c.count, c.cores, c.memory),
                (*count, *cores, *memory),
                "{limits:?}"
            );
            // Without it, the pod did not pass the webhook: refused.
            let error = parse(&pod(vec![container("c", limits)], vec![])).expect_err("no count");
            assert!(
                error
                    .to_string()
                    .contains("which vgpu's admission webhook adds"),
                "{error}"
            );
        }
        let error = parse(&pod(
            vec![container(
                "c",
                &[("elasticgpu.io/gpu-core", "150"), ("nvidia.com/gpu", "1")],
            )],
            vec![],
        ))
        .expect_err("150");
        assert!(error.to_string().contains("multiple of 100"), "{error}");
    }

    type CountCase<'a> = (&'a [(&'a str, &'a str)], Option<u64>);

    #[test]
    fn the_gpu_count_the_webhook_adds_for_elastic_requests() {
        let names = ResourceNames::default();
        let cases: &[CountCase] = &[
            (&[("elasticgpu.io/gpu-memory", "256")], Some(1)),
            (&[("elasticgpu.io/gpu-core", "30")], Some(1)),
            (&[("elasticgpu.io/gpu-core", "200")], Some(2)),
            (
                &[
                    ("elasticgpu.io/gpu-core", "100"),
                    ("elasticgpu.io/gpu-memory", "1k"),
                ],
                Some(1),
            ),
            // Already counted, nothing Elastic, or nothing at all.
            (
                &[("elasticgpu.io/gpu-core", "200"), ("nvidia.com/gpu", "2")],
                None,
            ),
            (&[("nvidia.com/gpu", "1")], None),
            (&[("elasticgpu.io/gpu-memory", "0")], None),
            (&[], None),
        ];
        for (limits, expected) in cases {
            let container = container("c", limits);
            assert_eq!(
                elastic_count_to_add(&container, &names),
                *expected,
                "{limits:?}"
            );
        }
        // With the count added, the request reads as before.
        let request = parse(&pod(
            vec![container(
                "c",
                &[("elasticgpu.io/gpu-core", "200"), ("nvidia.com/gpu", "2")],
            )],
            vec![],
        ))
        .expect("parse");
        let c = &request.containers[0];
        assert_eq!((c.count, c.cores, c.memory), (2, 100, MemoryRequest::Whole));
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("nvidia.com/gpu", "-1")], "must not be negative"),
            (
                &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "-1")],
                "must not be negative",
            ),
            (&[("nvidia.com/gpu", "500m")], "whole number"),
            (&[("nvidia.com/gpu", "100")], "at most 16 GPUs"),
            (
                &[("nvidia.com/gpu", "1"), ("nvidia.com/gpucores", "150")],
                "from 0 to 100",
            ),
            (
                &[
                    ("nvidia.com/gpu", "1"),
                    ("nvidia.com/gpumem-percentage", "0"),
                ],
                "from 1 to 100",
            ),
            (
                &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "0")],
                "no memory",
            ),
            (
                &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "20E")],
                "too large",
            ),
            (&[("nvidia.com/gpumem", "1024")], "add nvidia.com/gpu: 1"),
            (
                &[
                    ("nvidia.com/gpu", "1"),
                    ("nvidia.com/gpumem", "1"),
                    ("nvidia.com/gpumem-percentage", "1"),
                ],
                "use one",
            ),
            (
                &[("nvidia.com/gpumem", "1"), ("elasticgpu.io/gpu-core", "10")],
                "use one kind",
            ),
            (
                &[("nvidia.com/gpu", "2"), ("elasticgpu.io/gpu-core", "10")],
                "come to 1 GPU(s)",
            ),
            (
                &[("nvidia.com/gpu", "1"), ("elasticgpu.io/gpu-core", "300")],
                "come to 3 GPU(s)",
            ),
            (&[("nvidia.com/gpu", "abc")], "not a Kubernetes quantity"),
        ];
        for (limits, expected) in cases {
            let error = parse(&pod(vec![container("c", limits)], vec![])).expect_err(expected);
            let text = error.to_string();
            assert!(
                text.contains(expected) && text.contains("\"c\""),
                "{limits:?}: {text}"
            );
        }
        // 10^12 MiB is a valid (if absurd) number: no GPU will fit it.
        let huge = parse(&pod(
            vec![container(
                "c",
                &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "1T")],
            )],
            vec![],
        ))
        .expect("parses");
        assert_eq!(
            huge.containers[0].memory,
            MemoryRequest::Bytes(1_000_000_000_000 << 20)
        );
    }

    #[test]
    fn burst_annotation_is_a_whole_percentage() {
        let with = |value: &str| {
            let mut p = pod(
                vec![container(
                    "c",
                    &[("nvidia.com/gpu", "1"), ("nvidia.com/gpucores", "30")],
                )],
                vec![],
            );
            p.metadata.annotations = Some(BTreeMap::from([(
                "vgpu.io/gpucores-burst".to_string(),
                value.to_string(),
            )]));
            parse(&p)
        };
        assert_eq!(with("80").expect("80").burst_percent, Some(80));
        assert_eq!(with(" 100 ").expect("100").burst_percent, Some(100));
        for bad in ["0", "101", "-5", "50%", "lots", ""] {
            let error = with(bad).expect_err(bad).to_string();
            assert!(error.contains("vgpu.io/gpucores-burst"), "{bad}: {error}");
        }
        let plain = pod(vec![container("c", &[("nvidia.com/gpu", "1")])], vec![]);
        assert_eq!(parse(&plain).expect("plain").burst_percent, None);
    }

    #[test]
    fn annotations_select_gpus_and_policies() {
        let mut p = pod(vec![container("c", &[("nvidia.com/gpu", "1")])], vec![]);
        p.metadata.annotations = Some(
            [
                ("nvidia.com/use-gputype", "A100, H100,"),
                ("nvidia.com/nouse-gputype", "MIG"),
                ("nvidia.com/use-gpuuuid", "GPU-a,GPU-b"),
                ("nvidia.com/nouse-gpuuuid", "GPU-c"),
                ("hami.io/gpu-scheduler-policy", "binpack"),
                ("hami.io/node-scheduler-policy", "spread"),
                ("vgpu.io/node-scheduler-policy", "random"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        );
        let request = parse(&p).expect("parse");
        let s = &request.selectors;
        assert_eq!(s.use_types, vec!["a100", "h100"]);
        assert!(s.model_allowed("nvidia a100-sxm4-80gb").is_ok());
        assert_eq!(
            s.model_allowed("nvidia a100 mig 1g.10gb"),
            Err(TypeMismatch::Excluded(0))
        );
        assert_eq!(s.model_allowed("tesla v100"), Err(TypeMismatch::NotWanted));
        assert!(s.uuid_allowed("gpu-a").is_ok());
        assert_eq!(s.uuid_allowed("GPU-c"), Err(UuidMismatch::Excluded));
        assert_eq!(s.uuid_allowed("GPU-d"), Err(UuidMismatch::NotWanted));
        assert_eq!(request.gpu_policy, Some(GpuPolicy::Binpack));
        assert_eq!(
            request.node_policy,
            Some(NodePolicy::Random),
            "vgpu.io wins"
        );

        p.metadata.annotations = Some(
            [(
                "vgpu.io/gpu-scheduler-policy".to_string(),
                "tightest".to_string(),
            )]
            .into(),
        );
        let error = parse(&p).expect_err("unknown policy");
        assert!(
            error.to_string().contains("vgpu.io/gpu-scheduler-policy"),
            "{error}"
        );
    }

    #[test]
    fn sidecars_are_recognised() {
        let mut sidecar = container(
            "proxy",
            &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "100")],
        );
        sidecar.restart_policy = Some("Always".into());
        let request = parse(&pod(vec![], vec![sidecar])).expect("parse");
        assert_eq!(request.containers[0].kind, ContainerKind::Sidecar);
    }

    #[test]
    fn percentages_round_down_to_mib() {
        assert_eq!(MemoryRequest::Percent(50).bytes_on(16 << 30), 8 << 30);
        assert_eq!(MemoryRequest::Percent(33).bytes_on(1000 << 20), 330 << 20);
        assert_eq!(MemoryRequest::Percent(1).bytes_on((1 << 20) + 5), 1 << 20);
        assert_eq!(MemoryRequest::Whole.bytes_on(7), 7);
    }

    #[test]
    fn the_gpu_model_annotation_names_one_whole_model_in_any_spelling() {
        let wanted = |name: &str| Selectors {
            model: Some(model_key(name)),
            ..Selectors::default()
        };
        let label_safe = wanted("NVIDIA-GeForce-GTX-1080");
        assert_eq!(label_safe.model_allowed("nvidia geforce gtx 1080"), Ok(()));
        assert_eq!(
            label_safe.model_allowed("nvidia geforce gtx 1080 ti"),
            Err(TypeMismatch::NotTheModel)
        );
        assert_eq!(
            wanted(" Tesla_V100-SXM2-32GB ").model_allowed("tesla v100-sxm2-32gb"),
            Ok(())
        );
        assert!(wanted("Tesla V100").restrict_models());
        assert!(!Selectors::default().restrict_models());
    }
}
