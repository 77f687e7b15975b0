//! Preparing and releasing claims on this node: what kubelet's
//! `NodePrepareResources` and `NodeUnprepareResources` do, without gRPC or
//! the API server (the claim is given).
//!
//! Prepare turns the claim's allocation into one region (per claim: all
//! the containers that use the claim share its caps, as processes of one
//! container do), created with the consumed memory and share, and a CDI
//! spec that gives each of those containers the shim's environment and
//! mounts. Both are named by the claim's UID, so preparing again gives the
//! same answer and releasing needs nothing but the UID.

use crate::cdi::{self, CdiError};
use crate::checkpoint::{Checkpoint, CheckpointError, PreparedClaim, PreparedDevice};
use crate::claim::{allocated_gpus, ClaimError};
use k8s_openapi::api::resource::v1::ResourceClaim;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError, RwLock};
use thiserror::Error;
use vgpu_cluster::decision::{DeviceGrant, InventoryGpu};
use vgpu_cluster::file_error::{io_error, FileError};
use vgpu_node_agent::allocation::{self, AllocationError, Grants, Holder, Settings};
use vgpu_node_contract::claim_owner::{self, ClaimGrant, ClaimOwner, CLAIM_DIR_PREFIX};

#[derive(Debug, Error)]
pub enum DriverError {
    #[error(transparent)]
    Claim(#[from] ClaimError),
    #[error(transparent)]
    Allocation(#[from] AllocationError),
    #[error(transparent)]
    Cdi(#[from] CdiError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The claim's owner file could not be written, or its region
    /// directory removed.
    #[error(transparent)]
    Io(#[from] FileError),
}

/// What the owner file's writes are told by.
const WRITE_OWNER: &str = "write the claim's owner file";

/// Where things go on this node.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// The node's name, which is also its pool's.
    pub node: String,
    pub settings: Settings,
    /// Where CDI specs are written (the container runtime reads them).
    pub cdi_dir: PathBuf,
    /// The record of prepared claims.
    pub checkpoint: PathBuf,
}

/// The node's GPUs and its prepared claims.
#[derive(Debug)]
pub struct Driver {
    config: DriverConfig,
    gpus: RwLock<Vec<InventoryGpu>>,
    /// UUIDs the node's annotation cordons ([`vgpu_cluster::cordon`]),
    /// sorted: left out of the slice, still prepared for claims that have
    /// them.
    cordoned: RwLock<Vec<String>>,
    checkpoint: Mutex<Checkpoint>,
}

/// Writes the owner file (replaced whole: the monitor never reads half).
fn write_owner(path: &Path, owner: &ClaimOwner) -> Result<(), FileError> {
    let text = owner
        .to_text()
        .map_err(|error| io_error(path, WRITE_OWNER)(std::io::Error::other(error)))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_error(dir, WRITE_OWNER))?;
    }
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    std::fs::write(&temporary, text).map_err(io_error(path, WRITE_OWNER))?;
    std::fs::rename(&temporary, path).map_err(io_error(path, WRITE_OWNER))
}

/// The name of a claim's region directory.
pub fn claim_dir_name(uid: &str) -> Result<String, CdiError> {
    Ok(format!("{CLAIM_DIR_PREFIX}{}", cdi::checked(uid)?))
}

impl Driver {
    /// Loads the record of prepared claims (one that cannot be read is
    /// moved aside and logged) and writes the node's `ld.so.preload`.
    pub fn new(config: DriverConfig, gpus: Vec<InventoryGpu>) -> Result<Self, DriverError> {
        let (checkpoint, aside) = Checkpoint::load(&config.checkpoint)?;
        if let Some((path, reason)) = aside {
            tracing::error!(
                "the record of prepared claims could not be read ({reason}); moved to {} and starting afresh: claims are prepared again as kubelet asks",
                path.display()
            );
        }
        allocation::write_preload(&config.settings)?;
        Ok(Self {
            config,
            gpus: RwLock::new(gpus),
            cordoned: RwLock::new(Vec::new()),
            checkpoint: Mutex::new(checkpoint),
        })
    }

    pub fn node(&self) -> &str {
        &self.config.node
    }

    pub fn cdi_dir(&self) -> &Path {
        &self.config.cdi_dir
    }

    /// The node's GPUs with their health now.
    pub fn gpus(&self) -> Vec<InventoryGpu> {
        self.gpus
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The GPUs the node's annotation cordons now.
    pub fn cordoned(&self) -> Vec<String> {
        self.cordoned
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Sets the GPUs the node's annotation cordons; whether that changed
    /// anything.
    pub fn set_cordoned(&self, mut uuids: Vec<String>) -> bool {
        uuids.sort();
        uuids.dedup();
        let mut cordoned = self
            .cordoned
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if *cordoned == uuids {
            return false;
        }
        *cordoned = uuids;
        true
    }

    /// Marks a GPU healthy or not; whether that changed anything.
    pub fn set_health(&self, uuid: &str, healthy: bool) -> bool {
        let mut gpus = self.gpus.write().unwrap_or_else(PoisonError::into_inner);
        match gpus.iter_mut().find(|gpu| gpu.uuid == uuid) {
            Some(gpu) if gpu.healthy != healthy => {
                gpu.healthy = healthy;
                true
            }
            _ => false,
        }
    }

    /// What kubelet was told for `uid`, if it was prepared.
    pub fn prepared(&self, uid: &str) -> Option<PreparedClaim> {
        self.checkpoint
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(uid)
            .cloned()
    }

    /// The UIDs of every prepared claim.
    pub fn prepared_uids(&self) -> Vec<String> {
        self.checkpoint
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .claims()
            .keys()
            .cloned()
            .collect()
    }

    /// Prepares the claim kubelet named by `uid`, whose current object is
    /// `claim`. A claim prepared before gets the same answer.
    pub fn prepare(&self, uid: &str, claim: &ResourceClaim) -> Result<PreparedClaim, DriverError> {
        let mut checkpoint = self
            .checkpoint
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(prepared) = checkpoint.get(uid) {
            return Ok(prepared.clone());
        }
        let gpus = self.gpus();
        let allocated = allocated_gpus(claim, uid, &self.config.node, &gpus)?;
        let namespace = claim.metadata.namespace.clone().unwrap_or_default();
        let name = claim.metadata.name.clone().unwrap_or_default();
        let holder = Holder::Claim(format!("{namespace}/{name}"));
        let devices: Vec<DeviceGrant> = allocated.iter().map(|gpu| gpu.grant.clone()).collect();
        let grants = Grants {
            holder: &holder,
            dir_name: &claim_dir_name(uid)?,
            devices: &devices,
            // A claim names no priority: its containers get the shim's default.
            priority: None,
        };
        let plan = allocation::plan(&self.config.settings, grants, &gpus)?;
        // Who the region belongs to and what it was granted, for the node
        // monitor's series and for restoring the claim's limits; kept
        // outside the claim's directory, which its containers can write.
        let owner = ClaimOwner {
            namespace: namespace.clone(),
            claim: name.clone(),
            pods: claim
                .status
                .as_ref()
                .and_then(|status| status.reserved_for.as_ref())
                .into_iter()
                .flatten()
                .filter(|consumer| consumer.resource == "pods")
                .map(|consumer| consumer.name.clone())
                .collect(),
            grants: devices
                .iter()
                .map(|grant| ClaimGrant {
                    uuid: grant.uuid.clone(),
                    memory_bytes: grant.memory_bytes,
                    cores_percent: grant.cores_percent,
                    burst_percent: grant.burst_percent,
                })
                .collect(),
        };
        // The record first: the monitor reads it when it first sees the
        // claim's region, which may be as soon as the region exists.
        let record = self.record_path(uid)?;
        write_owner(&record, &owner)?;
        if let Err(error) = allocation::prepare(&plan) {
            // Nothing of the claim is left but what kubelet will retry.
            let _ = std::fs::remove_file(&record);
            return Err(error.into());
        }
        let mounts = plan
            .mounts
            .iter()
            .map(|mount| cdi::Mount::bind(&mount.host_path, &mount.container_path, mount.read_only))
            .collect();
        cdi::write_spec(
            &self.config.cdi_dir,
            uid,
            &cdi::claim_spec(uid, &plan.envs, mounts),
        )?;
        // The spec's edits are the claim's, whatever GPU a container's
        // request got: name the CDI device once per request, so that a
        // container is given it once.
        let id = cdi::device_id(uid)?;
        let mut named: BTreeSet<&str> = BTreeSet::new();
        let devices = allocated
            .iter()
            .map(|gpu| {
                // Every request is marked named (no short circuit).
                let fresh = gpu
                    .requests
                    .iter()
                    .map(|request| named.insert(request.as_str()))
                    .filter(|inserted| *inserted)
                    .count()
                    > 0;
                PreparedDevice {
                    requests: gpu.requests.clone(),
                    pool: self.config.node.clone(),
                    device: gpu.device.clone(),
                    cdi_device_ids: if fresh { vec![id.clone()] } else { Vec::new() },
                    share_id: gpu.share_ids.first().cloned(),
                }
            })
            .collect();
        let prepared = PreparedClaim {
            namespace,
            name,
            devices,
        };
        checkpoint.insert(uid, prepared.clone())?;
        tracing::info!(
            "prepared claim {}/{} ({uid}): {}",
            prepared.namespace,
            prepared.name,
            allocated
                .iter()
                .map(|gpu| format!(
                    "{} {} MiB {} %",
                    gpu.device,
                    gpu.grant.memory_bytes >> 20,
                    gpu.grant.cores_percent
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(prepared)
    }

    /// Where the record of claim `uid` is kept for the node monitor.
    fn record_path(&self, uid: &str) -> Result<PathBuf, DriverError> {
        Ok(claim_owner::record_path(
            &self.config.settings.containers_dir,
            &claim_dir_name(uid)?,
        ))
    }

    /// Releases the claim `uid`: its CDI spec, its region directory and
    /// its record. Releasing a claim that is not prepared succeeds.
    pub fn unprepare(&self, uid: &str) -> Result<(), DriverError> {
        let mut checkpoint = self
            .checkpoint
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        cdi::remove_spec(&self.config.cdi_dir, uid)?;
        let dir = self
            .config
            .settings
            .containers_dir
            .join(claim_dir_name(uid)?);
        match std::fs::remove_dir_all(&dir) {
            Err(source) if source.kind() != std::io::ErrorKind::NotFound => {
                return Err(io_error(&dir, "remove the claim's region directory")(source).into())
            }
            _ => {}
        }
        let record = self.record_path(uid)?;
        match std::fs::remove_file(&record) {
            Err(source) if source.kind() != std::io::ErrorKind::NotFound => {
                return Err(io_error(&record, "remove the claim's record")(source).into())
            }
            _ => {}
        }
        let known = checkpoint.get(uid).cloned();
        checkpoint.remove(uid)?;
        match known {
            Some(claim) => {
                tracing::info!("released claim {}/{} ({uid})", claim.namespace, claim.name)
            }
            None => tracing::info!("released claim {uid}, which was not prepared here"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slice::{device_name, CAPACITY_CORES, CAPACITY_MEMORY, DRIVER_NAME};
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult,
        ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use std::collections::BTreeMap;
    use vgpu_node_contract::region::limits::scaling::MemoryScaling;
    use vgpu_node_contract::region::Region;
    use vgpu_node_contract::region::UtilizationPolicy;

    const UID: &str = "0b1c-22";

    fn driver(base: &Path, healthy: bool) -> Driver {
        let settings = Settings {
            containers_dir: base.join("containers"),
            region_file: "region.cache".into(),
            container_dir: "/usr/local/vgpu/container".into(),
            library_host: "/opt/vgpu/libvgpu.so".into(),
            library_container: "/usr/local/vgpu/libvgpu.so".into(),
            preload_host: Some(base.join("ld.so.preload")),
            policy: UtilizationPolicy::Default,
            swap_limit: None,
            memory_scaling: MemoryScaling::ONE,
            context_reserve: None,
        };
        let gpu = InventoryGpu {
            uuid: "GPU-0".into(),
            index: 0,
            model: "m".into(),
            memory_bytes: 24 << 30,
            offered_memory_bytes: None,
            sm_count: 132,
            split_count: u32::MAX,
            numa: None,
            nvlink_island: None,
            healthy,
            utilization_percent: None,
        };
        let config = DriverConfig {
            node: "node-a".into(),
            settings,
            cdi_dir: base.join("cdi"),
            checkpoint: base.join("prepared-claims.json"),
        };
        Driver::new(config, vec![gpu]).expect("driver")
    }

    /// Claim `ns/c` given 4 GiB and 30 % of the node's GPU 0.
    fn claim() -> ResourceClaim {
        let mut claim = ResourceClaim::default();
        claim.metadata.name = Some("c".into());
        claim.metadata.namespace = Some("ns".into());
        claim.metadata.uid = Some(UID.into());
        let result = DeviceRequestAllocationResult {
            request: "gpu".into(),
            driver: DRIVER_NAME.into(),
            pool: "node-a".into(),
            device: device_name(0),
            consumed_capacity: Some(BTreeMap::from([
                (CAPACITY_MEMORY.to_string(), Quantity("4Gi".into())),
                (CAPACITY_CORES.to_string(), Quantity("30".into())),
            ])),
            ..DeviceRequestAllocationResult::default()
        };
        claim.status = Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(vec![result]),
                    config: None,
                }),
                ..AllocationResult::default()
            }),
            ..ResourceClaimStatus::default()
        });
        claim
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("vgpu-dra-driver-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn a_claims_grants_become_its_region_and_cdi_spec() {
        let base = temp_dir("prepare");
        let driver = driver(&base, true);
        let prepared = driver.prepare(UID, &claim()).expect("prepare");
        assert_eq!(prepared.devices.len(), 1);
        assert_eq!(
            prepared.devices[0].cdi_device_ids,
            ["vgpu.io/claim=0b1c-22"]
        );

        let region_dir = base
            .join("containers")
            .join(claim_dir_name(UID).expect("a claim's directory"));
        assert!(
            region_dir.ends_with("claim-0b1c-22"),
            "{}",
            region_dir.display()
        );
        let region_path = region_dir.join("region.cache");
        let region = Region::open_existing(&region_path).expect("the claim's region");
        assert_eq!(region.device_limit(0), 4 << 30);
        assert_eq!(region.limits().sm_limit[0], 30);

        let spec: cdi::Spec = serde_json::from_slice(
            &std::fs::read(cdi::spec_path(&base.join("cdi"), UID).expect("path")).expect("spec"),
        )
        .expect("parse the spec");
        let edits = &spec.devices[0].container_edits;
        assert!(
            edits.env.iter().any(|e| e == "CUDA_DEVICE_SM_LIMIT_0=30"),
            "{:?}",
            edits.env
        );
        assert!(edits
            .env
            .iter()
            .any(|e| e == "NVIDIA_VISIBLE_DEVICES=GPU-0"));
        let mounts: Vec<(&str, &str, bool)> = edits
            .mounts
            .iter()
            .map(|m| {
                (
                    m.host_path.as_str(),
                    m.container_path.as_str(),
                    m.options.iter().any(|o| o == "ro"),
                )
            })
            .collect();
        // The monitor's record: outside the directory the containers get,
        // with what the claim was granted.
        let record_path = driver.record_path(UID).expect("record path");
        assert!(!record_path.starts_with(&region_dir));
        let record = claim_owner::read_record(&record_path).expect("the claim's record");
        assert_eq!(record.grants.len(), 1);
        assert_eq!(record.grants[0].uuid, "GPU-0");
        assert_eq!(record.grants[0].cores_percent, 30);
        let region_file = region_dir.join("region.cache").display().to_string();
        let grant = region_dir.join("grant").display().to_string();
        let preload = base.join("ld.so.preload").display().to_string();
        assert_eq!(
            mounts,
            vec![
                ("/opt/vgpu/libvgpu.so", "/usr/local/vgpu/libvgpu.so", true),
                (
                    region_file.as_str(),
                    "/usr/local/vgpu/container/region.cache",
                    false
                ),
                (grant.as_str(), "/usr/local/vgpu/grant", true),
                (preload.as_str(), "/etc/ld.so.preload", true),
                // The claim's GPU, for a runtime that takes a container's
                // GPUs from mounts only.
                ("/dev/null", "/var/run/nvidia-container-devices/GPU-0", true),
            ]
        );

        driver.unprepare(UID).expect("unprepare");
        assert!(!region_path.exists());
        assert!(!record_path.exists(), "the record goes with the claim");
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn a_claim_on_an_unhealthy_gpu_is_refused_in_its_own_name() {
        let base = temp_dir("unhealthy");
        let driver = driver(&base, false);
        let error = driver.prepare(UID, &claim()).expect_err("unhealthy");
        assert_eq!(
            vgpu_cluster::report::with_causes(&error),
            "the allocation gives claim ns/c GPU GPU-0, which is unhealthy"
        );
        assert!(driver.prepared(UID).is_none());
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn a_cordoned_gpu_still_serves_the_claims_allocated_on_it() {
        let base = temp_dir("cordoned");
        let driver = driver(&base, true);
        assert!(driver.set_cordoned(vec!["GPU-0".into(), "GPU-0".into()]));
        assert!(!driver.set_cordoned(vec!["GPU-0".into()]), "no change");
        assert_eq!(driver.cordoned(), ["GPU-0"]);
        // A claim kube-scheduler allocated before the cordon (or whose
        // pod restarts) is prepared as before: only new claims avoid it.
        driver.prepare(UID, &claim()).expect("prepared");
        assert!(driver.prepared(UID).is_some());
        assert!(driver.set_cordoned(Vec::new()));
        let _ = std::fs::remove_dir_all(&base);
    }
}
