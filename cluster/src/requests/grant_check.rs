//! Whether a decision grants a pod no more than the pod asks for: the node's
//! own check, behind the admission policy that lets only the extender write
//! decisions. A decision that fails it was not made by the extender from
//! this pod (a forged annotation, or an extender that is not ours): the
//! device plugin refuses it at `Allocate` instead of honouring it.
//!
//! The extender's placement writes, per GPU-using container and in the
//! pod's admission order, exactly the requested number of distinct GPUs,
//! each with the requested memory on that GPU (never 0, which a region
//! reads as uncapped), the requested compute share (capped at 100), a burst
//! only where the pod asks for one, and the requested priority or a less
//! important one (the default, where the pod may not run above it:
//! [`super::priority`]). The check
//! holds a decision to that, with the same reading of the pod
//! ([`super::parse_pod`]) and the GPUs as the node publishes them.
//! [`within_request`] cuts a decision down to the same bounds: what the node
//! monitor restores, whatever the annotation says.

use super::pod_request::{ContainerRequest, MemoryRequest, PodRequest};
use super::priority::no_more_important;
use crate::decision::{ContainerDecision, Decision, DeviceGrant, InventoryGpu};
use thiserror::Error;

/// How a decision grants more than its pod asks for, or something else.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum GrantError {
    #[error("the decision names containers {decided:?}, but the pod's GPU-using containers are {requested:?}")]
    Containers {
        decided: Vec<String>,
        requested: Vec<String>,
    },
    #[error("container {container}: the decision calls it {decided}, but it is {actual}")]
    ContainerKind {
        container: String,
        decided: &'static str,
        actual: &'static str,
    },
    #[error("container {container}: {decided} GPU(s) decided, {requested} asked for")]
    Count {
        container: String,
        decided: usize,
        requested: u32,
    },
    #[error("container {container}: GPU {uuid} is granted twice")]
    SameGpuTwice { container: String, uuid: String },
    #[error("container {container}: GPU {uuid} is not one of this node's")]
    UnknownGpu { container: String, uuid: String },
    #[error("container {container}: GPU {uuid} is one the pod's annotations exclude")]
    GpuExcluded { container: String, uuid: String },
    #[error("container {container}: GPU {uuid}: memory {decided} bytes granted (0 is uncapped), at most {allowed} asked for")]
    Memory {
        container: String,
        uuid: String,
        decided: u64,
        allowed: u64,
    },
    #[error("container {container}: GPU {uuid}: compute {decided} percent granted (0 is unlimited), {asked} asked for")]
    Cores {
        container: String,
        uuid: String,
        decided: u32,
        asked: u32,
    },
    #[error("container {container}: GPU {uuid}: burst to {decided} percent granted, the pod asks for {asked}")]
    Burst {
        container: String,
        uuid: String,
        decided: u32,
        asked: String,
    },
    #[error("container {container}: priority {decided} granted, more important than the {asked} the pod asks for")]
    Priority {
        container: String,
        decided: String,
        asked: String,
    },
}

fn kind_word(init: bool) -> &'static str {
    if init {
        "an init container"
    } else {
        "a regular container"
    }
}

fn optional<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "none".to_string(), |v| v.to_string())
}

/// Checks that `decision` grants only what `request` asks for, on `gpus`
/// (the node's GPUs as it publishes them: memory percentages and whole
/// GPUs are of what each offers).
pub fn check_grants(
    decision: &Decision,
    request: &PodRequest,
    gpus: &[InventoryGpu],
) -> Result<(), GrantError> {
    let decided: Vec<&str> = decision
        .containers
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    let requested: Vec<&str> = request.containers.iter().map(|c| c.name.as_str()).collect();
    if decided != requested {
        return Err(GrantError::Containers {
            decided: decided.into_iter().map(String::from).collect(),
            requested: requested.into_iter().map(String::from).collect(),
        });
    }
    for (container, asked) in decision.containers.iter().zip(&request.containers) {
        check_container(container, asked, request, gpus)?;
    }
    Ok(())
}

fn check_container(
    container: &ContainerDecision,
    asked: &ContainerRequest,
    request: &PodRequest,
    gpus: &[InventoryGpu],
) -> Result<(), GrantError> {
    let name = || container.name.clone();
    if container.init != asked.kind.is_init() {
        return Err(GrantError::ContainerKind {
            container: name(),
            decided: kind_word(container.init),
            actual: kind_word(asked.kind.is_init()),
        });
    }
    if container.devices.len() != asked.count as usize {
        return Err(GrantError::Count {
            container: name(),
            decided: container.devices.len(),
            requested: asked.count,
        });
    }
    if !no_more_important(container.priority, asked.priority) {
        return Err(GrantError::Priority {
            container: name(),
            decided: optional(container.priority),
            asked: optional(asked.priority),
        });
    }
    for (i, grant) in container.devices.iter().enumerate() {
        if container.devices[..i].iter().any(|g| g.uuid == grant.uuid) {
            return Err(GrantError::SameGpuTwice {
                container: name(),
                uuid: grant.uuid.clone(),
            });
        }
        check_grant(&container.name, grant, asked, request, gpus)?;
    }
    Ok(())
}

fn check_grant(
    container: &str,
    grant: &DeviceGrant,
    asked: &ContainerRequest,
    request: &PodRequest,
    gpus: &[InventoryGpu],
) -> Result<(), GrantError> {
    let who = || container.to_string();
    let uuid = || grant.uuid.clone();
    let Some(gpu) = gpus.iter().find(|g| g.uuid == grant.uuid) else {
        return Err(GrantError::UnknownGpu {
            container: who(),
            uuid: uuid(),
        });
    };
    let selectors = &request.selectors;
    if selectors.uuid_allowed(&gpu.uuid).is_err()
        || selectors
            .model_allowed(&gpu.model.to_ascii_lowercase())
            .is_err()
    {
        return Err(GrantError::GpuExcluded {
            container: who(),
            uuid: uuid(),
        });
    }
    let allowed = asked.memory.bytes_on(gpu.offered_bytes());
    if grant.memory_bytes == 0 || grant.memory_bytes > allowed {
        return Err(GrantError::Memory {
            container: who(),
            uuid: uuid(),
            decided: grant.memory_bytes,
            allowed,
        });
    }
    // A request of 0 is no limit, which any share is within; otherwise the
    // share is capped (0 would lift the cap) and at most what was asked.
    let cores_ok = asked.cores == 0 || (1..=asked.cores.min(100)).contains(&grant.cores_percent);
    if !cores_ok {
        return Err(GrantError::Cores {
            container: who(),
            uuid: uuid(),
            decided: grant.cores_percent,
            asked: asked.cores,
        });
    }
    if let Some(burst) = grant.burst_percent {
        if request.burst_percent.is_none_or(|asked| burst > asked) {
            return Err(GrantError::Burst {
                container: who(),
                uuid: uuid(),
                decided: burst,
                asked: optional(request.burst_percent),
            });
        }
    }
    Ok(())
}

/// `decision` cut down to what `request` asks for, by the rules of
/// [`check_grants`]: only the pod's GPU-using containers, at most the asked
/// number of distinct GPUs each, at most the asked memory (0 becomes it),
/// at most the asked share (0 becomes it where a share was asked), a burst
/// only up to the pod's, and a priority no more important than the asked
/// one. A decision the extender
/// wrote comes back unchanged. `offered(uuid)` is a GPU's offered memory
/// where known; without it a percentage or the whole GPU bounds nothing.
pub fn within_request(
    decision: &Decision,
    request: &PodRequest,
    offered: impl Fn(&str) -> Option<u64>,
) -> Decision {
    let containers = decision
        .containers
        .iter()
        .filter_map(|container| {
            let asked = request
                .containers
                .iter()
                .find(|asked| asked.name == container.name)?;
            let mut devices: Vec<DeviceGrant> = Vec::new();
            for grant in &container.devices {
                if devices.len() == asked.count as usize {
                    break;
                }
                if devices.iter().any(|kept| kept.uuid == grant.uuid) {
                    continue;
                }
                devices.push(grant_within(grant, asked, request, &offered));
            }
            Some(ContainerDecision {
                name: container.name.clone(),
                init: asked.kind.is_init(),
                devices,
                priority: if no_more_important(container.priority, asked.priority) {
                    container.priority
                } else {
                    asked.priority
                },
            })
        })
        .collect();
    Decision {
        containers,
        ..decision.clone()
    }
}

fn grant_within(
    grant: &DeviceGrant,
    asked: &ContainerRequest,
    request: &PodRequest,
    offered: &impl Fn(&str) -> Option<u64>,
) -> DeviceGrant {
    let allowed = match asked.memory {
        MemoryRequest::Bytes(bytes) => Some(bytes),
        memory => offered(&grant.uuid).map(|total| memory.bytes_on(total)),
    };
    let memory_bytes = match allowed {
        Some(allowed) if grant.memory_bytes == 0 => allowed,
        Some(allowed) => grant.memory_bytes.min(allowed),
        None => grant.memory_bytes,
    };
    let cores_percent = match asked.cores.min(100) {
        0 => grant.cores_percent,
        cap if grant.cores_percent == 0 => cap,
        cap => grant.cores_percent.min(cap),
    };
    let burst_percent = grant
        .burst_percent
        .zip(request.burst_percent)
        .map(|(burst, asked)| burst.min(asked));
    DeviceGrant {
        uuid: grant.uuid.clone(),
        memory_bytes,
        cores_percent,
        burst_percent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::FORMAT_VERSION;
    use crate::requests::pod_request::{
        ContainerKind, MemoryRequest, PodRequest, RequestDefaults, Selectors,
    };

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn gpu(uuid: &str, model: &str) -> InventoryGpu {
        InventoryGpu {
            uuid: uuid.into(),
            index: 0,
            model: model.into(),
            memory_bytes: 16 * GIB,
            offered_memory_bytes: None,
            sm_count: 80,
            split_count: 10,
            numa: None,
            nvlink_island: None,
            healthy: true,
            utilization_percent: None,
        }
    }

    fn gpus() -> Vec<InventoryGpu> {
        vec![gpu("GPU-a", "Tesla V100"), gpu("GPU-b", "Tesla T4")]
    }

    fn asked(name: &str, count: u32, memory: MemoryRequest, cores: u32) -> ContainerRequest {
        ContainerRequest {
            name: name.into(),
            kind: ContainerKind::App,
            count,
            memory,
            cores,
            priority: None,
        }
    }

    fn grant(uuid: &str, memory_bytes: u64, cores_percent: u32) -> DeviceGrant {
        DeviceGrant {
            uuid: uuid.into(),
            memory_bytes,
            cores_percent,
            burst_percent: None,
        }
    }

    fn decision(containers: Vec<(&str, Vec<DeviceGrant>)>) -> Decision {
        Decision {
            version: FORMAT_VERSION,
            node: "node-1".into(),
            decided_unix_ms: 1,
            containers: containers
                .into_iter()
                .map(|(name, devices)| ContainerDecision {
                    name: name.into(),
                    init: false,
                    devices,
                    priority: None,
                })
                .collect(),
        }
    }

    fn request(containers: Vec<ContainerRequest>) -> PodRequest {
        PodRequest {
            containers,
            ..PodRequest::default()
        }
    }

    /// A pod asking for one vGPU of 4 GiB and 30 % in `main`, and the
    /// decision the extender writes for it.
    fn hami() -> (PodRequest, Decision) {
        (
            request(vec![asked("main", 1, MemoryRequest::Bytes(4 * GIB), 30)]),
            decision(vec![("main", vec![grant("GPU-a", 4 * GIB, 30)])]),
        )
    }

    #[test]
    fn what_the_extender_writes_passes() {
        let (request, decision) = hami();
        assert_eq!(check_grants(&decision, &request, &gpus()), Ok(()));
        // Percentages and whole GPUs are of what the GPU offers.
        let request = self::request(vec![
            asked("half", 1, MemoryRequest::Percent(50), 0),
            asked("whole", 2, MemoryRequest::Whole, 100),
        ]);
        let decision = self::decision(vec![
            ("half", vec![grant("GPU-b", 8 * GIB, 0)]),
            (
                "whole",
                vec![grant("GPU-a", 16 * GIB, 100), grant("GPU-b", 16 * GIB, 100)],
            ),
        ]);
        assert_eq!(check_grants(&decision, &request, &gpus()), Ok(()));
        let mut scaled = gpus();
        scaled[0].offered_memory_bytes = Some(32 * GIB);
        let request = self::request(vec![asked("main", 1, MemoryRequest::Whole, 10)]);
        let decision = self::decision(vec![("main", vec![grant("GPU-a", 32 * GIB, 10)])]);
        assert_eq!(check_grants(&decision, &request, &scaled), Ok(()));
    }

    #[test]
    fn more_memory_or_none_at_all_is_refused() {
        let (request, mut decision) = hami();
        decision.containers[0].devices[0].memory_bytes = 4 * GIB + MIB;
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::Memory { allowed, .. }) if allowed == 4 * GIB
        ));
        decision.containers[0].devices[0].memory_bytes = 0;
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::Memory { decided: 0, .. })
        ));
        // Less than asked harms no one.
        decision.containers[0].devices[0].memory_bytes = GIB;
        assert_eq!(check_grants(&decision, &request, &gpus()), Ok(()));
    }

    #[test]
    fn more_compute_or_an_unlimited_share_is_refused() {
        let (request, mut decision) = hami();
        for forged in [31, 100, 0] {
            decision.containers[0].devices[0].cores_percent = forged;
            assert!(
                matches!(
                    check_grants(&decision, &request, &gpus()),
                    Err(GrantError::Cores { decided, asked: 30, .. }) if decided == forged
                ),
                "{forged}"
            );
        }
        // A pod that names no share (0: none by default) may run at any.
        let request = self::request(vec![asked("main", 1, MemoryRequest::Bytes(GIB), 0)]);
        let decision = self::decision(vec![("main", vec![grant("GPU-a", GIB, 0)])]);
        assert_eq!(check_grants(&decision, &request, &gpus()), Ok(()));
    }

    #[test]
    fn a_burst_the_pod_did_not_ask_for_is_refused() {
        let (mut request, mut decision) = hami();
        decision.containers[0].devices[0].burst_percent = Some(80);
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::Burst { decided: 80, .. })
        ));
        request.burst_percent = Some(60);
        assert!(check_grants(&decision, &request, &gpus()).is_err());
        request.burst_percent = Some(80);
        assert_eq!(check_grants(&decision, &request, &gpus()), Ok(()));
    }

    #[test]
    fn a_more_important_priority_is_refused_a_less_important_one_granted() {
        let (mut request, mut decision) = hami();
        decision.containers[0].priority = Some(i32::MIN);
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::Priority { .. })
        ));
        request.containers[0].priority = Some(1);
        assert!(check_grants(&decision, &request, &gpus()).is_err());
        decision.containers[0].priority = Some(1);
        assert_eq!(check_grants(&decision, &request, &gpus()), Ok(()));
        // The pod asks for 0 (above the default); the extender granted the
        // default, as it does for a pod whose PriorityClass may not run
        // above it. The monitor restores the default, not the 0 asked.
        request.containers[0].priority = Some(0);
        decision.containers[0].priority = None;
        assert_eq!(check_grants(&decision, &request, &gpus()), Ok(()));
        let restored = within_request(&decision, &request, |_| None);
        assert_eq!(restored.containers[0].priority, None);
        decision.containers[0].priority = Some(-1);
        assert!(check_grants(&decision, &request, &gpus()).is_err());
        let restored = within_request(&decision, &request, |_| None);
        assert_eq!(restored.containers[0].priority, Some(0));
    }

    #[test]
    fn gpus_must_be_the_asked_number_distinct_known_and_wanted() {
        let (request, mut decision) = hami();
        decision.containers[0].devices.push(grant("GPU-b", GIB, 30));
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::Count {
                decided: 2,
                requested: 1,
                ..
            })
        ));
        decision.containers[0].devices = vec![grant("GPU-z", GIB, 30)];
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::UnknownGpu { .. })
        ));
        let request = self::request(vec![asked("main", 2, MemoryRequest::Bytes(GIB), 30)]);
        let decision = self::decision(vec![(
            "main",
            vec![grant("GPU-a", GIB, 30), grant("GPU-a", GIB, 30)],
        )]);
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::SameGpuTwice { .. })
        ));
        let (mut request, decision) = hami();
        request.selectors = Selectors {
            nouse_types: vec!["v100".into()],
            ..Selectors::default()
        };
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::GpuExcluded { .. })
        ));
        request.selectors = Selectors {
            use_uuids: vec!["GPU-b".into()],
            ..Selectors::default()
        };
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::GpuExcluded { .. })
        ));
    }

    #[test]
    fn containers_must_be_the_pods_own_in_order_and_kind() {
        let (request, mut decision) = hami();
        decision.containers[0].name = "other".into();
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::Containers { .. })
        ));
        let (request, mut decision) = hami();
        decision.containers.push(decision.containers[0].clone());
        decision.containers[1].name = "extra".into();
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::Containers { .. })
        ));
        let (request, mut decision) = hami();
        decision.containers[0].init = true;
        assert!(matches!(
            check_grants(&decision, &request, &gpus()),
            Err(GrantError::ContainerKind { .. })
        ));
    }

    #[test]
    fn a_pod_read_with_the_defaults_bounds_what_it_did_not_name() {
        use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
        use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
        let pod = Pod {
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "main".into(),
                    resources: Some(ResourceRequirements {
                        limits: Some([("nvidia.com/gpu".to_string(), Quantity("1".into()))].into()),
                        ..ResourceRequirements::default()
                    }),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            ..Pod::default()
        };
        let defaults = RequestDefaults {
            memory_mib: 2048,
            cores: 20,
        };
        let request = super::super::parse::parse_pod(&pod, &Default::default(), &defaults)
            .expect("a plain request");
        let fits = decision(vec![("main", vec![grant("GPU-a", 2 * GIB, 20)])]);
        assert_eq!(check_grants(&fits, &request, &gpus()), Ok(()));
        let whole = decision(vec![("main", vec![grant("GPU-a", 16 * GIB, 20)])]);
        assert!(check_grants(&whole, &request, &gpus()).is_err());
    }

    #[test]
    fn within_request_leaves_what_the_extender_writes_and_cuts_the_rest() {
        let (request, decision) = hami();
        let offered = |_: &str| Some(16 * GIB);
        assert_eq!(within_request(&decision, &request, offered), decision);
        let mut forged = decision.clone();
        forged.containers[0].devices[0] = DeviceGrant {
            burst_percent: Some(100),
            ..grant("GPU-a", 0, 100)
        };
        forged.containers[0]
            .devices
            .push(grant("GPU-b", 8 * GIB, 50));
        forged.containers[0].priority = Some(i32::MIN);
        let mut stranger = forged.containers[0].clone();
        stranger.name = "stranger".into();
        forged.containers.push(stranger);
        assert_eq!(within_request(&forged, &request, offered), decision);
        // Less than asked stays.
        let mut less = decision.clone();
        less.containers[0].devices[0] = grant("GPU-a", GIB, 10);
        assert_eq!(within_request(&less, &request, offered), less);
    }

    #[test]
    fn within_request_bounds_percentages_only_where_the_gpu_is_known() {
        let request = request(vec![asked("main", 1, MemoryRequest::Percent(25), 0)]);
        let forged = decision(vec![("main", vec![grant("GPU-a", 0, 0)])]);
        let known = within_request(&forged, &request, |_| Some(16 * GIB));
        assert_eq!(known.containers[0].devices[0].memory_bytes, 4 * GIB);
        assert_eq!(
            known.containers[0].devices[0].cores_percent, 0,
            "no share asked"
        );
        let unknown = within_request(&forged, &request, |_| None);
        assert_eq!(unknown.containers[0].devices[0].memory_bytes, 0);
    }
}
