//! What an allocated ResourceClaim gives on this node: for each of this
//! driver's GPUs in its allocation result, the memory and compute share it
//! consumed (after kube-scheduler applied the request policies of
//! [`crate::slice`]), as the [`DeviceGrant`]s the shim's caps are made
//! from.
//!
//! A claim whose class carries the driver's opaque configuration
//! `{"exclusive": true}` (the `vgpu.io-exclusive` DeviceClass) must have
//! consumed each GPU whole, and gets it uncapped.

use crate::slice::{device_name, offered_memory, CAPACITY_CORES, CAPACITY_MEMORY, DRIVER_NAME};
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use serde::Deserialize;
use std::collections::BTreeMap;
use thiserror::Error;
use vgpu_cluster::decision::{DeviceGrant, InventoryGpu};
use vgpu_cluster::resources::parse_whole_quantity;
use vgpu_node_contract::region::MAX_DEVICES;

/// The `apiVersion` of the driver's opaque configuration.
pub const CONFIG_API_VERSION: &str = "vgpu.io/v1";
/// The `kind` of the driver's opaque configuration.
pub const CONFIG_KIND: &str = "GpuConfig";

/// Why a claim cannot be prepared on this node.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ClaimError {
    #[error("claim {claim} is not allocated")]
    NotAllocated { claim: String },
    #[error("claim {claim} has UID {found}, not {expected}: it was deleted and recreated")]
    UidMismatch {
        claim: String,
        expected: String,
        found: String,
    },
    #[error("claim {claim} has no {DRIVER_NAME} device in its allocation")]
    NoDevices { claim: String },
    #[error(
        "claim {claim} was allocated {device} from pool {pool}, not from this node's pool {node}"
    )]
    OtherPool {
        claim: String,
        device: String,
        pool: String,
        node: String,
    },
    #[error(
        "claim {claim} was allocated {device}, which this node does not have (or not healthy)"
    )]
    UnknownDevice { claim: String, device: String },
    #[error("claim {claim} consumed {capacity} = {value:?} of {device}: {reason}")]
    BadCapacity {
        claim: String,
        device: String,
        capacity: String,
        value: String,
        reason: String,
    },
    #[error("claim {claim} has {count} GPUs; at most {MAX_DEVICES} are supported")]
    TooManyGpus { claim: String, count: usize },
    #[error("claim {claim}: the {DRIVER_NAME} configuration is invalid: {reason}")]
    BadConfig { claim: String, reason: String },
    #[error("claim {claim} asks for {device} exclusively but consumed {memory} of its {offered} bytes: an exclusive claim must name no capacity")]
    ExclusiveNotWhole {
        claim: String,
        device: String,
        memory: u64,
        offered: u64,
    },
}

/// One GPU of a claim, as allocated and as granted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocatedGpu {
    /// The requests of the claim that were given this GPU.
    pub requests: Vec<String>,
    /// The device's name in the slice.
    pub device: String,
    /// The share IDs kube-scheduler gave each allocation of it.
    pub share_ids: Vec<String>,
    pub grant: DeviceGrant,
}

/// The driver's opaque configuration in a claim or class.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuConfig {
    pub api_version: String,
    pub kind: String,
    /// The GPU is the claim's alone: uncapped memory and compute.
    #[serde(default)]
    pub exclusive: bool,
}

fn claim_name(claim: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

fn exclusive(claim: &ResourceClaim, name: &str) -> Result<bool, ClaimError> {
    let configs = claim
        .status
        .as_ref()
        .and_then(|status| status.allocation.as_ref())
        .and_then(|allocation| allocation.devices.as_ref())
        .and_then(|devices| devices.config.as_ref());
    let mut exclusive = false;
    for config in configs.into_iter().flatten() {
        let Some(opaque) = config.opaque.as_ref() else {
            continue;
        };
        if opaque.driver != DRIVER_NAME {
            continue;
        }
        let bad = |reason: String| ClaimError::BadConfig {
            claim: name.to_string(),
            reason,
        };
        let parsed: GpuConfig = serde_json::from_value(opaque.parameters.0.clone())
            .map_err(|error| bad(error.to_string()))?;
        if parsed.api_version != CONFIG_API_VERSION || parsed.kind != CONFIG_KIND {
            return Err(bad(format!(
                "apiVersion {:?} kind {:?}; expected {CONFIG_API_VERSION} {CONFIG_KIND}",
                parsed.api_version, parsed.kind
            )));
        }
        exclusive |= parsed.exclusive;
    }
    Ok(exclusive)
}

fn consumed(
    result: &DeviceRequestAllocationResult,
    capacity: &str,
    name: &str,
) -> Result<Option<u64>, ClaimError> {
    let Some(value) = result
        .consumed_capacity
        .as_ref()
        .and_then(|consumed| consumed.get(capacity))
    else {
        return Ok(None);
    };
    parse_whole_quantity(&value.0)
        .map(Some)
        .map_err(|error| ClaimError::BadCapacity {
            claim: name.to_string(),
            device: result.device.clone(),
            capacity: capacity.to_string(),
            value: value.0.clone(),
            reason: error.to_string(),
        })
}

/// This driver's GPUs in `claim`'s allocation, in NVML order, on the node
/// whose pool is `pool` and whose GPUs are `gpus`. `uid` is the claim
/// kubelet asked for.
pub fn allocated_gpus(
    claim: &ResourceClaim,
    uid: &str,
    pool: &str,
    gpus: &[InventoryGpu],
) -> Result<Vec<AllocatedGpu>, ClaimError> {
    let name = claim_name(claim);
    let found = claim.metadata.uid.as_deref().unwrap_or_default();
    if found != uid {
        return Err(ClaimError::UidMismatch {
            claim: name,
            expected: uid.to_string(),
            found: found.to_string(),
        });
    }
    let results = claim
        .status
        .as_ref()
        .and_then(|status| status.allocation.as_ref())
        .ok_or_else(|| ClaimError::NotAllocated {
            claim: name.clone(),
        })?
        .devices
        .as_ref()
        .and_then(|devices| devices.results.as_ref());
    let exclusive = exclusive(claim, &name)?;
    // A GPU given to several requests of the claim is one grant: the
    // claim's containers share one region, so one cap per GPU.
    let mut by_index: BTreeMap<u32, AllocatedGpu> = BTreeMap::new();
    for result in results.into_iter().flatten() {
        if result.driver != DRIVER_NAME {
            continue;
        }
        if result.pool != pool {
            return Err(ClaimError::OtherPool {
                claim: name,
                device: result.device.clone(),
                pool: result.pool.clone(),
                node: pool.to_string(),
            });
        }
        let gpu = gpus
            .iter()
            .find(|gpu| device_name(gpu.index) == result.device)
            .ok_or_else(|| ClaimError::UnknownDevice {
                claim: name.clone(),
                device: result.device.clone(),
            })?;
        let offered = offered_memory(gpu);
        // Without consumed capacity the device was allocated whole (a
        // scheduler without consumable capacity).
        let whole = result.consumed_capacity.is_none();
        let memory = consumed(result, CAPACITY_MEMORY, &name)?.unwrap_or(offered);
        let cores = consumed(result, CAPACITY_CORES, &name)?.unwrap_or(if whole { 100 } else { 0 });
        if memory > offered || cores > 100 {
            return Err(ClaimError::BadCapacity {
                claim: name,
                device: result.device.clone(),
                capacity: if memory > offered {
                    CAPACITY_MEMORY.into()
                } else {
                    CAPACITY_CORES.into()
                },
                value: if memory > offered {
                    memory.to_string()
                } else {
                    cores.to_string()
                },
                reason: "more than the GPU has".into(),
            });
        }
        let entry = by_index.entry(gpu.index).or_insert_with(|| AllocatedGpu {
            requests: Vec::new(),
            device: result.device.clone(),
            share_ids: Vec::new(),
            grant: DeviceGrant {
                uuid: gpu.uuid.clone(),
                memory_bytes: 0,
                cores_percent: 0,
                burst_percent: None,
            },
        });
        if !entry.requests.contains(&result.request) {
            entry.requests.push(result.request.clone());
        }
        if let Some(share) = &result.share_id {
            entry.share_ids.push(share.clone());
        }
        entry.grant.memory_bytes = (entry.grant.memory_bytes + memory).min(offered);
        entry.grant.cores_percent = (entry.grant.cores_percent + cores as u32).min(100);
    }
    if by_index.is_empty() {
        return Err(ClaimError::NoDevices { claim: name });
    }
    if by_index.len() > MAX_DEVICES {
        return Err(ClaimError::TooManyGpus {
            claim: name,
            count: by_index.len(),
        });
    }
    let mut allocated: Vec<AllocatedGpu> = by_index.into_values().collect();
    if exclusive {
        for gpu in &mut allocated {
            let offered = gpus
                .iter()
                .find(|g| g.uuid == gpu.grant.uuid)
                .map(offered_memory)
                .unwrap_or_default();
            if gpu.grant.memory_bytes < offered {
                return Err(ClaimError::ExclusiveNotWhole {
                    claim: name,
                    device: gpu.device.clone(),
                    memory: gpu.grant.memory_bytes,
                    offered,
                });
            }
            gpu.grant.cores_percent = 100;
        }
    }
    Ok(allocated)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult,
        OpaqueDeviceConfiguration, ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::runtime::RawExtension;

    fn gpus() -> Vec<InventoryGpu> {
        (0..2)
            .map(|index| InventoryGpu {
                uuid: format!("GPU-{index}"),
                index,
                model: "m".into(),
                memory_bytes: 24 << 30,
                offered_memory_bytes: None,
                sm_count: 132,
                split_count: 10,
                numa: None,
                nvlink_island: None,
                healthy: true,
                utilization_percent: None,
            })
            .collect()
    }

    fn result(
        request: &str,
        device: &str,
        consumed: Option<(&str, &str)>,
    ) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            request: request.into(),
            driver: DRIVER_NAME.into(),
            pool: "node-a".into(),
            device: device.into(),
            consumed_capacity: consumed.map(|(memory, cores)| {
                BTreeMap::from([
                    (CAPACITY_MEMORY.to_string(), Quantity(memory.into())),
                    (CAPACITY_CORES.to_string(), Quantity(cores.into())),
                ])
            }),
            share_id: Some(format!("share-{request}")),
            ..DeviceRequestAllocationResult::default()
        }
    }

    fn claim(
        results: Vec<DeviceRequestAllocationResult>,
        config: Option<serde_json::Value>,
    ) -> ResourceClaim {
        let mut claim = ResourceClaim::default();
        claim.metadata.name = Some("c".into());
        claim.metadata.namespace = Some("ns".into());
        claim.metadata.uid = Some("uid-1".into());
        claim.status = Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(results),
                    config: config.map(|parameters| {
                        vec![DeviceAllocationConfiguration {
                            source: "FromClass".into(),
                            requests: None,
                            opaque: Some(OpaqueDeviceConfiguration {
                                driver: DRIVER_NAME.into(),
                                parameters: RawExtension(parameters),
                            }),
                        }]
                    }),
                }),
                ..AllocationResult::default()
            }),
            ..ResourceClaimStatus::default()
        });
        claim
    }

    #[test]
    fn consumed_capacity_becomes_the_grant() {
        let claim = claim(
            vec![
                result("a", "gpu-1", Some(("4Gi", "30"))),
                result("b", "gpu-0", Some(("8Gi", "50"))),
            ],
            None,
        );
        let gpus = allocated_gpus(&claim, "uid-1", "node-a", &gpus()).expect("allocated");
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].device, "gpu-0", "NVML order");
        assert_eq!(gpus[0].grant.memory_bytes, 8 << 30);
        assert_eq!(gpus[0].grant.cores_percent, 50);
        assert_eq!(gpus[1].grant.uuid, "GPU-1");
        assert_eq!(gpus[1].grant.memory_bytes, 4 << 30);
        assert_eq!(gpus[1].grant.cores_percent, 30);
        assert_eq!(gpus[1].requests, ["a"]);
        assert_eq!(gpus[1].share_ids, ["share-a"]);
    }

    #[test]
    fn two_requests_on_one_gpu_add_up() {
        let claim = claim(
            vec![
                result("a", "gpu-0", Some(("4Gi", "30"))),
                result("b", "gpu-0", Some(("2Gi", "10"))),
            ],
            None,
        );
        let gpus = allocated_gpus(&claim, "uid-1", "node-a", &gpus()).expect("allocated");
        assert_eq!(gpus.len(), 1);
        assert_eq!(gpus[0].grant.memory_bytes, 6 << 30);
        assert_eq!(gpus[0].grant.cores_percent, 40);
        assert_eq!(gpus[0].requests, ["a", "b"]);
    }

    #[test]
    fn no_consumed_capacity_is_the_whole_gpu() {
        let claim = claim(vec![result("a", "gpu-0", None)], None);
        let gpus = allocated_gpus(&claim, "uid-1", "node-a", &gpus()).expect("allocated");
        assert_eq!(gpus[0].grant.memory_bytes, 24 << 30);
        assert_eq!(gpus[0].grant.cores_percent, 100);
    }

    #[test]
    fn exclusive_claims_must_be_whole_and_are_uncapped() {
        let config =
            serde_json::json!({"apiVersion": "vgpu.io/v1", "kind": "GpuConfig", "exclusive": true});
        let whole = claim(
            vec![result("a", "gpu-0", Some(("24Gi", "0")))],
            Some(config.clone()),
        );
        let gpus_of = allocated_gpus(&whole, "uid-1", "node-a", &gpus()).expect("allocated");
        assert_eq!(gpus_of[0].grant.cores_percent, 100);
        let part = claim(vec![result("a", "gpu-0", Some(("4Gi", "0")))], Some(config));
        assert!(matches!(
            allocated_gpus(&part, "uid-1", "node-a", &gpus()),
            Err(ClaimError::ExclusiveNotWhole { .. })
        ));
    }

    #[test]
    fn bad_claims_are_refused_with_reasons() {
        let ok = claim(vec![result("a", "gpu-0", Some(("4Gi", "30")))], None);
        assert!(matches!(
            allocated_gpus(&ok, "other", "node-a", &gpus()),
            Err(ClaimError::UidMismatch { .. })
        ));
        assert!(matches!(
            allocated_gpus(&ok, "uid-1", "node-b", &gpus()),
            Err(ClaimError::OtherPool { .. })
        ));
        let unknown = claim(vec![result("a", "gpu-7", Some(("4Gi", "30")))], None);
        assert!(matches!(
            allocated_gpus(&unknown, "uid-1", "node-a", &gpus()),
            Err(ClaimError::UnknownDevice { .. })
        ));
        let garbage = claim(vec![result("a", "gpu-0", Some(("lots", "30")))], None);
        let error = allocated_gpus(&garbage, "uid-1", "node-a", &gpus()).expect_err("garbage");
        assert!(error.to_string().contains("memory = \"lots\""), "{error}");
        let too_much = claim(vec![result("a", "gpu-0", Some(("25Gi", "30")))], None);
        assert!(matches!(
            allocated_gpus(&too_much, "uid-1", "node-a", &gpus()),
            Err(ClaimError::BadCapacity { .. })
        ));
        let bad_config = claim(
            vec![result("a", "gpu-0", Some(("4Gi", "30")))],
            Some(
                serde_json::json!({"apiVersion": "vgpu.io/v1", "kind": "GpuConfig", "exclusiv": true}),
            ),
        );
        let error = allocated_gpus(&bad_config, "uid-1", "node-a", &gpus()).expect_err("typo");
        assert!(error.to_string().contains("exclusiv"), "{error}");
        let mut unallocated = ok.clone();
        unallocated.status = None;
        assert!(matches!(
            allocated_gpus(&unallocated, "uid-1", "node-a", &gpus()),
            Err(ClaimError::NotAllocated { .. })
        ));
        let mut foreign = result("a", "gpu-0", None);
        foreign.driver = "other.example.com".into();
        let none = claim(vec![foreign], None);
        assert!(matches!(
            allocated_gpus(&none, "uid-1", "node-a", &gpus()),
            Err(ClaimError::NoDevices { .. })
        ));
    }
}
