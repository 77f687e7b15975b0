//! The node's ResourceSlice: one device per healthy GPU, shareable between
//! claims (`allowMultipleAllocations`), with two consumable capacities:
//!
//! - `memory`, in bytes, requested in MiB steps; a request that names no
//!   amount gets the whole GPU's memory (so such a claim shares the GPU
//!   with nobody);
//! - `cores`, the compute share in percent, in 1 % steps; a request that
//!   names none reserves no share and runs unthrottled beside the others
//!   (what a container that names no `gpucores` gets on the device-plugin
//!   path).
//!
//! kube-scheduler allocates claims against these capacities itself; the
//! driver turns what each claim consumed into the shim's caps at Prepare
//! ([`crate::claim`]). An unhealthy GPU is left out of the slice, so no
//! new claim gets it; so is a cordoned one ([`vgpu_cluster::cordon`]).

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use std::collections::BTreeMap;
use vgpu_cluster::decision::InventoryGpu;

/// The driver's name: the `driver` of its slices, of allocation results
/// and of DeviceClass selectors, and the CDI vendor of its devices.
pub const DRIVER_NAME: &str = "vgpu.io";
/// Device memory, bytes.
pub const CAPACITY_MEMORY: &str = "memory";
/// Compute share, percent of the GPU.
pub const CAPACITY_CORES: &str = "cores";
/// The granularity of memory requests (kube-scheduler rounds a request up
/// to it).
pub const MEMORY_STEP: u64 = 1 << 20;
/// The whole GPU's compute, in [`CAPACITY_CORES`] units.
pub const CORES_FULL: u64 = 100;

/// Attribute names (qualified by the driver's domain when CEL reads them:
/// `device.attributes["vgpu.io"].model`).
pub mod attribute {
    pub const UUID: &str = "uuid";
    pub const MODEL: &str = "model";
    pub const INDEX: &str = "index";
    pub const NUMA_NODE: &str = "numaNode";
    pub const NVLINK_ISLAND: &str = "nvlinkIsland";
    pub const DRIVER_VERSION: &str = "driverVersion";
    pub const COMPUTE_CAPABILITY: &str = "computeCapability";
    pub const SM_COUNT: &str = "smCount";
}

/// The device name of the GPU with NVML index `index`.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The name of the node's slice.
pub fn slice_name(node: &str) -> String {
    format!("{DRIVER_NAME}-{node}")
}

/// What the node says about all its GPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// The NVIDIA driver's version, as NVML reports it.
    pub driver_version: Option<String>,
    /// CUDA compute capability per GPU UUID, `major.minor`.
    pub compute_capability: BTreeMap<String, String>,
}

/// The driver version and compute capabilities NVML reports (left out
/// where it cannot say), for the GPUs `uuids`. Here rather than in the
/// binary so that `vgpu doctor` shows the slice this driver would publish.
pub fn node_facts(nvml: &nvml_wrapper::Nvml, uuids: &[String]) -> NodeFacts {
    let compute_capability: BTreeMap<String, String> = uuids
        .iter()
        .filter_map(|uuid| {
            let device = nvml.device_by_uuid(uuid.as_str()).ok()?;
            let capability = device.cuda_compute_capability().ok()?;
            Some((
                uuid.clone(),
                format!("{}.{}", capability.major, capability.minor),
            ))
        })
        .collect();
    NodeFacts {
        driver_version: nvml.sys_driver_version().ok(),
        compute_capability,
    }
}

fn string(value: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(value.into()),
        ..DeviceAttribute::default()
    }
}

fn int(value: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(value),
        ..DeviceAttribute::default()
    }
}

/// The memory a GPU offers claims: its (scaled) memory, in whole steps.
pub fn offered_memory(gpu: &InventoryGpu) -> u64 {
    let bytes = gpu.offered_memory_bytes.unwrap_or(gpu.memory_bytes);
    bytes / MEMORY_STEP * MEMORY_STEP
}

/// The device for one GPU.
pub fn device(gpu: &InventoryGpu, facts: &NodeFacts) -> Device {
    let memory = offered_memory(gpu);
    let mut attributes = BTreeMap::from([
        (attribute::UUID.to_string(), string(&gpu.uuid)),
        (attribute::MODEL.to_string(), string(&gpu.model)),
        (attribute::INDEX.to_string(), int(i64::from(gpu.index))),
        (
            attribute::SM_COUNT.to_string(),
            int(i64::from(gpu.sm_count)),
        ),
    ]);
    if let Some(numa) = gpu.numa {
        attributes.insert(attribute::NUMA_NODE.into(), int(i64::from(numa)));
    }
    if let Some(island) = gpu.nvlink_island {
        attributes.insert(attribute::NVLINK_ISLAND.into(), int(i64::from(island)));
    }
    // Strings, not `version` attributes: NVIDIA's driver versions
    // ("580.95.05") are not semantic versions.
    if let Some(version) = &facts.driver_version {
        attributes.insert(attribute::DRIVER_VERSION.into(), string(version));
    }
    if let Some(capability) = facts.compute_capability.get(&gpu.uuid) {
        attributes.insert(attribute::COMPUTE_CAPABILITY.into(), string(capability));
    }
    let capacity = BTreeMap::from([
        (
            CAPACITY_MEMORY.to_string(),
            DeviceCapacity {
                value: Quantity(memory.to_string()),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(Quantity(memory.to_string())),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: Quantity(MEMORY_STEP.to_string()),
                        max: None,
                        step: Some(Quantity(MEMORY_STEP.to_string())),
                    }),
                    valid_values: None,
                }),
            },
        ),
        (
            CAPACITY_CORES.to_string(),
            DeviceCapacity {
                value: Quantity(CORES_FULL.to_string()),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(Quantity("0".into())),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: Quantity("0".into()),
                        max: Some(Quantity(CORES_FULL.to_string())),
                        step: Some(Quantity("1".into())),
                    }),
                    valid_values: None,
                }),
            },
        ),
    ]);
    Device {
        name: device_name(gpu.index),
        allow_multiple_allocations: Some(true),
        attributes: Some(attributes),
        capacity: Some(capacity),
        ..Device::default()
    }
}

/// The Node a slice belongs to (deleted with it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeOwner {
    pub name: String,
    pub uid: String,
}

/// The node's slice: its healthy GPUs not in `cordoned`, in NVML order, as pool `node` at
/// `generation`.
pub fn resource_slice(
    node: &str,
    owner: Option<&NodeOwner>,
    gpus: &[InventoryGpu],
    cordoned: &[String],
    facts: &NodeFacts,
    generation: i64,
) -> ResourceSlice {
    let mut healthy: Vec<&InventoryGpu> = gpus
        .iter()
        .filter(|gpu| gpu.healthy && !cordoned.contains(&gpu.uuid))
        .collect();
    healthy.sort_by_key(|gpu| gpu.index);
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node)),
            owner_references: owner.map(|owner| {
                vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name: owner.name.clone(),
                    uid: owner.uid.clone(),
                    controller: Some(true),
                    block_owner_deletion: None,
                }]
            }),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER_NAME.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(healthy.iter().map(|gpu| device(gpu, facts)).collect()),
            ..ResourceSliceSpec::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn gpu(index: u32, memory_gib: u64, healthy: bool) -> InventoryGpu {
        InventoryGpu {
            uuid: format!("GPU-{index}"),
            index,
            model: "NVIDIA H100".into(),
            memory_bytes: memory_gib << 30,
            offered_memory_bytes: None,
            sm_count: 132,
            split_count: 10,
            numa: Some(0),
            nvlink_island: None,
            healthy,
            utilization_percent: None,
        }
    }

    #[test]
    fn one_shareable_device_per_healthy_gpu_with_both_capacities() {
        let gpus = [gpu(1, 24, true), gpu(0, 24, true), gpu(2, 24, false)];
        let facts = NodeFacts {
            driver_version: Some("580.95.05".into()),
            compute_capability: BTreeMap::from([("GPU-0".into(), "9.0".into())]),
        };
        let slice = resource_slice("node-a", None, &gpus, &[], &facts, 3);
        assert_eq!(slice.metadata.name.as_deref(), Some("vgpu.io-node-a"));
        assert_eq!(slice.spec.pool.generation, 3);
        assert_eq!(slice.spec.pool.name, "node-a");
        let devices = slice.spec.devices.expect("devices");
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-0", "gpu-1"], "the unhealthy GPU is left out");
        let cordoned = resource_slice("node-a", None, &gpus, &["GPU-0".to_string()], &facts, 4);
        let names: Vec<String> = cordoned
            .spec
            .devices
            .expect("devices")
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(names, ["gpu-1"], "the cordoned GPU is left out too");
        let first = &devices[0];
        assert_eq!(first.allow_multiple_allocations, Some(true));
        let capacity = first.capacity.as_ref().expect("capacity");
        assert_eq!(capacity[CAPACITY_MEMORY].value.0, (24u64 << 30).to_string());
        let memory_policy = capacity[CAPACITY_MEMORY]
            .request_policy
            .as_ref()
            .expect("policy");
        assert_eq!(
            memory_policy.default.as_ref().map(|q| q.0.as_str()),
            Some("25769803776")
        );
        assert_eq!(capacity[CAPACITY_CORES].value.0, "100");
        let attributes = first.attributes.as_ref().expect("attributes");
        assert_eq!(attributes["uuid"].string.as_deref(), Some("GPU-0"));
        assert_eq!(
            attributes["driverVersion"].string.as_deref(),
            Some("580.95.05")
        );
        assert_eq!(
            attributes["computeCapability"].string.as_deref(),
            Some("9.0")
        );
        assert!(!devices[1]
            .attributes
            .as_ref()
            .expect("attributes")
            .contains_key("computeCapability"));
    }

    #[test]
    fn memory_is_offered_in_whole_steps() {
        let mut odd = gpu(0, 1, true);
        odd.memory_bytes = (1 << 30) + 12345;
        assert_eq!(offered_memory(&odd), 1 << 30);
        odd.offered_memory_bytes = Some(3 << 30);
        assert_eq!(offered_memory(&odd), 3 << 30);
    }
}
