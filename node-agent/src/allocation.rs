//! What the workloads a region holds get: their environment (the shim's
//! configuration, HAMi-core's variable names), their mounts (the shim, an
//! `ld.so.preload` naming it, the region file, and the node's grant, read
//! only, at the one path the shim looks for it), and, on the host, the
//! region's directory with the region and the grant already created with
//! the limits, so that their processes only attach to them.
//!
//! The containers get the two files alone, never the directory holding
//! them: a container could otherwise replace or rewrite its grant through
//! the directory, or fill the node's disk there.
//!
//! The device plugin plans one region per container (from the scheduler's
//! decision), the DRA driver one per claim, shared by the claim's
//! containers (from the claim's allocation); each writes the plan in its
//! own form for kubelet (`Allocate`'s mounts, a CDI spec).

use std::collections::BTreeMap;
use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use thiserror::Error;
use vgpu_cluster::decision::{DeviceGrant, InventoryGpu};
use vgpu_cluster::file_error::{io_error, FileError};
use vgpu_node_contract::region::grant_file::{GRANT_CONTAINER_PATH, GRANT_FILE};
use vgpu_node_contract::region::limits::granted::{device_order, region_limits, NodeLimits};
use vgpu_node_contract::region::limits::scaling::MemoryScaling;
use vgpu_node_contract::region::{
    Grant, GrantError, GrantSettings, Region, RegionLimits, UtilizationPolicy, MAX_DEVICES,
};
use vgpu_node_contract::shim_env::{ShimConfig, DEFAULT_CONTEXT_RESERVE};

/// The GPUs a container may see (NVIDIA container runtime).
pub const ENV_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// CUDA's device numbering; set to PCI order so that device `i` in the
/// container is the `i`-th GPU of `NVIDIA_VISIBLE_DEVICES`, which is what
/// the per-device limit variables are numbered by.
pub use vgpu_node_contract::shim_env::ENV_DEVICE_ORDER;

/// Path of `ld.so.preload` in a container.
pub const CONTAINER_PRELOAD: &str = "/etc/ld.so.preload";

/// Where NVIDIA's container runtime reads a container's GPUs from mounts
/// (its `accept-nvidia-visible-devices-as-volume-mounts`): one mount of
/// `/dev/null` here per GPU, named by its UUID. A node whose toolkit
/// ignores `NVIDIA_VISIBLE_DEVICES` in unprivileged containers
/// (`accept-nvidia-visible-devices-envvar-when-unprivileged = false`, so
/// that no container names GPUs of its own in its image or spec) gives a
/// container only the GPUs mounted here, which only the node grants.
pub const DEVICE_LIST_DIR: &str = "/var/run/nvidia-container-devices";

/// What each device-list mount is a bind of.
const DEVICE_LIST_SOURCE: &str = "/dev/null";

/// Where things are, on the host and in containers, and the node-wide
/// settings written into every container's environment.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Host directory holding one directory per region: a container's
    /// `<podUID>_<container>`, a claim's `claim-<uid>`.
    pub containers_dir: PathBuf,
    /// Name of the region file inside a region's directory.
    pub region_file: String,
    /// Where a container sees its region's directory.
    pub container_dir: PathBuf,
    /// The shim on the host.
    pub library_host: PathBuf,
    /// Where containers see the shim.
    pub library_container: PathBuf,
    /// The `ld.so.preload` the agent writes on the host; mounted as
    /// `/etc/ld.so.preload`. `None`: no preload mount (the shim is then
    /// loaded only where the image sets `LD_PRELOAD` itself).
    pub preload_host: Option<PathBuf>,
    pub policy: UtilizationPolicy,
    /// Host memory each GPU may lend a container as swap beyond its grant;
    /// `Some` turns on `CUDA_OVERSUBSCRIBE`.
    pub swap_limit: Option<u64>,
    /// HAMi's `deviceMemoryScaling`: the GPUs offer their memory times
    /// this, and above 1 each grant is split into device memory and swap
    /// (`CUDA_OVERSUBSCRIBE` on).
    pub memory_scaling: MemoryScaling,
    /// `VGPU_CONTEXT_RESERVE` for every container, if set.
    pub context_reserve: Option<u64>,
}

impl Settings {
    /// What this node adds to every container's limits.
    pub fn node_limits(&self) -> NodeLimits {
        NodeLimits {
            policy: self.policy,
            swap_limit: self.swap_limit,
            memory_scaling: self.memory_scaling,
        }
    }
}

/// Who a region is for, as a refusal names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    /// A pod's container, by its name in the scheduler's decision.
    Container(String),
    /// A ResourceClaim, `namespace/name`: its containers share the region.
    Claim(String),
}

impl Holder {
    /// The holder's name (a container's, or a claim's `namespace/name`).
    pub fn name(&self) -> &str {
        match self {
            Self::Container(name) | Self::Claim(name) => name,
        }
    }
}

/// "the decision gives container main", "the allocation gives claim
/// ns/c": who gave the GPUs a refusal is about, to whom.
struct GivenTo<'a>(&'a Holder);

impl fmt::Display for GivenTo<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Holder::Container(name) => write!(f, "the decision gives container {name}"),
            Holder::Claim(name) => write!(f, "the allocation gives claim {name}"),
        }
    }
}

/// Why a region could not be planned or prepared.
#[derive(Debug, Error)]
pub enum AllocationError {
    #[error("{} GPU {uuid}, which this node does not have", GivenTo(.holder))]
    UnknownGpu { holder: Holder, uuid: String },
    #[error("{} GPU {uuid}, which is unhealthy", GivenTo(.holder))]
    UnhealthyGpu { holder: Holder, uuid: String },
    #[error("{} GPU {uuid} twice", GivenTo(.holder))]
    DuplicateGpu { holder: Holder, uuid: String },
    #[error("{} {count} GPUs; at most {MAX_DEVICES} are supported", GivenTo(.holder))]
    TooManyGpus { holder: Holder, count: usize },
    #[error("pod UID {uid:?} or container name {container:?} cannot name a directory")]
    BadName { uid: String, container: String },
    #[error(transparent)]
    Io(#[from] FileError),
    #[error(transparent)]
    Region(#[from] vgpu_node_contract::region::RegionError),
    #[error("region {path} already exists with other limits; refusing to change the limits of a running container")]
    RegionMismatch { path: PathBuf },
    #[error(transparent)]
    Grant(#[from] GrantError),
}

/// A bind mount into the containers, in neither kubelet's nor CDI's words
/// (each agent writes it in its own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub host_path: PathBuf,
    pub container_path: PathBuf,
    pub read_only: bool,
}

/// What one region's holder gets.
#[derive(Clone, Debug, PartialEq)]
pub struct RegionPlan {
    pub holder: Holder,
    /// The region's directory on the host.
    pub host_dir: PathBuf,
    /// The region file on the host.
    pub region_host: PathBuf,
    /// The node's grant on the host, beside the region.
    pub grant_host: PathBuf,
    /// What the grant says besides the limits.
    pub grant: GrantSettings,
    /// The limits written into the region (what the shim reads back from
    /// [`Self::envs`]).
    pub limits: RegionLimits,
    pub envs: BTreeMap<String, String>,
    pub mounts: Vec<Mount>,
}

/// What a region is planned for.
#[derive(Clone, Copy, Debug)]
pub struct Grants<'a> {
    pub holder: &'a Holder,
    /// The region's directory under [`Settings::containers_dir`].
    pub dir_name: &'a str,
    /// One grant per GPU, in any order.
    pub devices: &'a [DeviceGrant],
    /// `CUDA_TASK_PRIORITY`, when the holder has one.
    pub priority: Option<i32>,
}

/// The name of a container's directory: `<podUID>_<container>`.
pub fn container_dir_name(pod_uid: &str, container: &str) -> Result<String, AllocationError> {
    let safe = |text: &str| {
        !text.is_empty()
            && text.len() <= 253
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
            && text != "."
            && text != ".."
    };
    if safe(pod_uid) && safe(container) {
        Ok(format!("{pod_uid}_{container}"))
    } else {
        Err(AllocationError::BadName {
            uid: pod_uid.to_string(),
            container: container.to_string(),
        })
    }
}

/// Works out what `grants` come to on this node's `gpus`. Pure: nothing
/// is written.
pub fn plan(
    settings: &Settings,
    grants: Grants<'_>,
    gpus: &[InventoryGpu],
) -> Result<RegionPlan, AllocationError> {
    let holder = grants.holder;
    if grants.devices.len() > MAX_DEVICES {
        return Err(AllocationError::TooManyGpus {
            holder: holder.clone(),
            count: grants.devices.len(),
        });
    }
    // In the container, CUDA numbers the visible GPUs in PCI order, which
    // is NVML's host order: list them that way so variable `_<i>` is
    // device `i`.
    let mut ordered: Vec<(u32, &DeviceGrant)> = Vec::with_capacity(grants.devices.len());
    for grant in grants.devices {
        let gpu = gpus.iter().find(|g| g.uuid == grant.uuid).ok_or_else(|| {
            AllocationError::UnknownGpu {
                holder: holder.clone(),
                uuid: grant.uuid.clone(),
            }
        })?;
        if !gpu.healthy {
            return Err(AllocationError::UnhealthyGpu {
                holder: holder.clone(),
                uuid: grant.uuid.clone(),
            });
        }
        if ordered
            .iter()
            .any(|(_, granted)| granted.uuid == grant.uuid)
        {
            return Err(AllocationError::DuplicateGpu {
                holder: holder.clone(),
                uuid: grant.uuid.clone(),
            });
        }
        ordered.push((gpu.index, grant));
    }
    device_order(&mut ordered, |(index, _)| Some(*index));

    let host_dir = settings.containers_dir.join(grants.dir_name);
    let region_host = host_dir.join(&settings.region_file);
    let region_container = settings.container_dir.join(&settings.region_file);
    let grant_host = host_dir.join(GRANT_FILE);

    // The shim's configuration, typed: the grants' bytes and percents go
    // straight into the region's limits, and the environment is written
    // from the same value the region is created with.
    let node = settings.node_limits();
    let mut config = ShimConfig {
        region_path: region_container.display().to_string(),
        region_path_set: true,
        oversubscribe: node.oversubscribes(),
        context_reserve: settings.context_reserve.unwrap_or(DEFAULT_CONTEXT_RESERVE),
        measure_contexts: settings.context_reserve.is_none(),
        ..ShimConfig::default()
    };
    config.limits = region_limits(
        ordered.iter().map(|(_, grant)| grant.share()),
        grants.priority,
        &node,
    );

    let mut envs: BTreeMap<String, String> = config.to_env(ordered.len()).into_iter().collect();
    let uuids: Vec<&str> = ordered.iter().map(|(_, g)| g.uuid.as_str()).collect();
    envs.insert(ENV_VISIBLE_DEVICES.to_string(), uuids.join(","));
    envs.insert(ENV_DEVICE_ORDER.to_string(), "PCI_BUS_ID".to_string());

    let mut mounts = vec![
        Mount {
            host_path: settings.library_host.clone(),
            container_path: settings.library_container.clone(),
            read_only: true,
        },
        Mount {
            host_path: region_host.clone(),
            container_path: region_container.clone(),
            read_only: false,
        },
        Mount {
            host_path: grant_host.clone(),
            container_path: PathBuf::from(GRANT_CONTAINER_PATH),
            read_only: true,
        },
    ];
    if let Some(preload) = &settings.preload_host {
        mounts.push(Mount {
            host_path: preload.clone(),
            container_path: PathBuf::from(CONTAINER_PRELOAD),
            read_only: true,
        });
    }
    // The same GPUs as the variable names, for a runtime that reads them
    // from mounts (and ignores the variable).
    mounts.extend(uuids.iter().map(|uuid| Mount {
        host_path: PathBuf::from(DEVICE_LIST_SOURCE),
        container_path: Path::new(DEVICE_LIST_DIR).join(uuid),
        read_only: true,
    }));

    let grant = GrantSettings {
        region_path: config.region_path.clone(),
        context_reserve: config.context_reserve,
        measure_contexts: config.measure_contexts,
        oversubscribe: config.oversubscribe,
        device_uuids: uuids.iter().map(|uuid| uuid.to_string()).collect(),
    };
    Ok(RegionPlan {
        holder: holder.clone(),
        host_dir,
        region_host,
        grant_host,
        grant,
        limits: config.limits,
        envs,
        mounts,
    })
}

/// Creates the region's directory, its region and its grant on the host.
/// Idempotent: a region and grant already there with the same limits (an
/// earlier attempt at the same holder) are kept.
pub fn prepare(plan: &RegionPlan) -> Result<(), AllocationError> {
    std::fs::create_dir_all(&plan.host_dir)
        .map_err(io_error(&plan.host_dir, "create directory"))?;
    std::fs::set_permissions(&plan.host_dir, std::fs::Permissions::from_mode(0o755))
        .map_err(io_error(&plan.host_dir, "chmod"))?;
    let region = Region::open_or_create(&plan.region_host, &plan.limits)?;
    if region.limits() != plan.limits.as_stored() {
        return Err(AllocationError::RegionMismatch {
            path: plan.region_host.clone(),
        });
    }
    drop(region);
    // Container processes may run as any user; they need to map the file
    // read-write and take their liveness locks on it.
    std::fs::set_permissions(&plan.region_host, std::fs::Permissions::from_mode(0o666))
        .map_err(io_error(&plan.region_host, "chmod"))?;
    match Grant::create(&plan.grant_host, &plan.grant, &plan.limits) {
        Ok(_) => Ok(()),
        Err(GrantError::Mismatch { .. }) => Err(AllocationError::RegionMismatch {
            path: plan.grant_host.clone(),
        }),
        Err(error) => Err(error.into()),
    }
}

/// Writes the host's `ld.so.preload` (one line: the shim's path in
/// containers), replacing it atomically if its content differs.
pub fn write_preload(settings: &Settings) -> Result<(), AllocationError> {
    let Some(path) = &settings.preload_host else {
        return Ok(());
    };
    let content = format!("{}\n", settings.library_container.display());
    if std::fs::read_to_string(path).is_ok_and(|current| current == content) {
        return Ok(());
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io_error(parent, "create directory"))?;
    }
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(format!(".tmp.{}", std::process::id()));
    let temporary = PathBuf::from(temporary);
    std::fs::write(&temporary, content).map_err(io_error(&temporary, "write"))?;
    std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(0o644))
        .map_err(io_error(&temporary, "chmod"))?;
    std::fs::rename(&temporary, path).map_err(io_error(path, "rename"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn settings(base: &Path) -> Settings {
        Settings {
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
        }
    }

    fn gpus() -> Vec<InventoryGpu> {
        (0..3)
            .map(|index| InventoryGpu {
                offered_memory_bytes: None,
                utilization_percent: None,
                uuid: format!("GPU-{index}"),
                index,
                model: "m".into(),
                memory_bytes: 16 << 30,
                sm_count: 132,
                split_count: 10,
                numa: None,
                nvlink_island: None,
                healthy: index != 2,
            })
            .collect()
    }

    fn grant(uuid: &str, memory_bytes: u64, cores_percent: u32) -> DeviceGrant {
        DeviceGrant {
            uuid: uuid.into(),
            memory_bytes,
            cores_percent,
            burst_percent: None,
        }
    }

    /// The plan of container `main` of the pod `pod_uid`.
    fn plan_main(
        settings: &Settings,
        pod_uid: &str,
        devices: &[DeviceGrant],
        priority: Option<i32>,
        gpus: &[InventoryGpu],
    ) -> Result<RegionPlan, AllocationError> {
        let holder = Holder::Container("main".into());
        let dir_name = container_dir_name(pod_uid, holder.name())?;
        let grants = Grants {
            holder: &holder,
            dir_name: &dir_name,
            devices,
            priority,
        };
        plan(settings, grants, gpus)
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("vgpu-node-agent-unit-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn environment_lists_gpus_in_host_order_with_their_limits() {
        let base = PathBuf::from("/base");
        let devices = [
            grant("GPU-1", 3000 << 20, 30),
            grant("GPU-0", (1 << 30) + 1, 0),
        ];
        let plan = plan_main(&settings(&base), "uid-1", &devices, Some(0), &gpus()).expect("plan");
        let env = |k: &str| plan.envs.get(k).map(String::as_str);
        assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), Some("GPU-0,GPU-1"));
        assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_0"), Some("1073741825"));
        assert_eq!(env("CUDA_DEVICE_SM_LIMIT_0"), Some("0"));
        assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_1"), Some("3000m"));
        assert_eq!(env("CUDA_DEVICE_SM_LIMIT_1"), Some("30"));
        assert_eq!(
            env("CUDA_DEVICE_MEMORY_SHARED_CACHE"),
            Some("/usr/local/vgpu/container/region.cache")
        );
        assert_eq!(env("GPU_CORE_UTILIZATION_POLICY"), Some("default"));
        assert_eq!(env("CUDA_TASK_PRIORITY"), Some("0"));
        assert_eq!(env("CUDA_OVERSUBSCRIBE"), None);
        assert_eq!(plan.limits.memory_limit[0], (1 << 30) + 1);
        assert_eq!(plan.limits.memory_limit[1], 3000 << 20);
        assert_eq!(plan.limits.memory_limit[2], 0);
        assert_eq!(plan.limits.sm_limit[..3], [0, 30, 0]);
        assert_eq!(plan.limits.priority, 0);
        assert_eq!(plan.host_dir, base.join("containers/uid-1_main"));
        assert_eq!(plan.holder, Holder::Container("main".into()));
        let mounts: Vec<(&Path, &Path, bool)> = plan
            .mounts
            .iter()
            .map(|m| {
                (
                    m.container_path.as_path(),
                    m.host_path.as_path(),
                    m.read_only,
                )
            })
            .collect();
        assert_eq!(
            mounts,
            vec![
                (
                    Path::new("/usr/local/vgpu/libvgpu.so"),
                    Path::new("/opt/vgpu/libvgpu.so"),
                    true
                ),
                (
                    Path::new("/usr/local/vgpu/container/region.cache"),
                    Path::new("/base/containers/uid-1_main/region.cache"),
                    false
                ),
                (
                    Path::new("/usr/local/vgpu/grant"),
                    Path::new("/base/containers/uid-1_main/grant"),
                    true
                ),
                (
                    Path::new("/etc/ld.so.preload"),
                    Path::new("/base/ld.so.preload"),
                    true
                ),
                // The GPUs the variable names, in its order, as mounts.
                (
                    Path::new("/var/run/nvidia-container-devices/GPU-0"),
                    Path::new("/dev/null"),
                    true
                ),
                (
                    Path::new("/var/run/nvidia-container-devices/GPU-1"),
                    Path::new("/dev/null"),
                    true
                ),
            ]
        );
    }

    #[test]
    fn a_burst_share_reaches_the_shim_and_the_region() {
        let mut bursting = grant("GPU-1", 1 << 30, 30);
        bursting.burst_percent = Some(80);
        let devices = [bursting, grant("GPU-0", 1 << 30, 50)];
        let plan =
            plan_main(&settings(Path::new("/b")), "u", &devices, None, &gpus()).expect("plan");
        assert_eq!(
            plan.envs.get("VGPU_SM_BURST_LIMIT_1").map(String::as_str),
            Some("80")
        );
        assert_eq!(plan.envs.get("VGPU_SM_BURST_LIMIT_0"), None);
        assert_eq!(plan.limits.sm_limit[..2], [50, 30]);
        assert_eq!(plan.limits.sm_burst[..2], [0, 80]);
    }

    #[test]
    fn node_settings_reach_every_container() {
        let mut node = settings(Path::new("/b"));
        node.policy = UtilizationPolicy::Force;
        node.swap_limit = Some(8 << 30);
        node.context_reserve = Some(128 << 20);
        node.preload_host = None;
        let plan =
            plan_main(&node, "u", &[grant("GPU-0", 1 << 30, 50)], None, &gpus()).expect("plan");
        let env = |k: &str| plan.envs.get(k).map(String::as_str);
        assert_eq!(env("GPU_CORE_UTILIZATION_POLICY"), Some("force"));
        assert_eq!(env("CUDA_OVERSUBSCRIBE"), Some("true"));
        assert_eq!(env("VGPU_SWAP_LIMIT_0"), Some("8192m"));
        assert_eq!(env("VGPU_CONTEXT_RESERVE"), Some("128m"));
        assert_eq!(env("CUDA_TASK_PRIORITY"), None);
        assert_eq!(plan.limits.swap_limit[0], 8 << 30);
        assert_eq!(plan.limits.policy, UtilizationPolicy::Force as u32);
        // The library, the region, the grant (no preload mount) and the
        // one GPU's device-list mount.
        assert_eq!(plan.mounts.len(), 4, "no preload mount");
        let device = &plan.mounts[3];
        assert_eq!(
            (
                device.host_path.as_path(),
                device.container_path.as_path(),
                device.read_only
            ),
            (
                Path::new("/dev/null"),
                Path::new("/var/run/nvidia-container-devices/GPU-0"),
                true
            )
        );
    }

    #[test]
    fn at_scaling_two_a_whole_card_grant_is_half_device_half_swap() {
        const GIB: u64 = 1 << 30;
        let mut node = settings(Path::new("/b"));
        node.memory_scaling = "2".parse().expect("2");
        let card = |index: u32| InventoryGpu {
            memory_bytes: 24 * GIB,
            offered_memory_bytes: Some(48 * GIB),
            ..gpus()[index as usize].clone()
        };
        let gpus = [card(0), card(1)];
        // Two pods of 24 GiB on the one 24 GiB card.
        for pod in ["pod-a", "pod-b"] {
            let plan =
                plan_main(&node, pod, &[grant("GPU-0", 24 * GIB, 50)], None, &gpus).expect("plan");
            let env = |k: &str| plan.envs.get(k).map(String::as_str);
            assert_eq!(env("CUDA_OVERSUBSCRIBE"), Some("true"));
            assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_0"), Some("12288m"));
            assert_eq!(env("VGPU_SWAP_LIMIT_0"), Some("12288m"));
            assert_eq!(plan.limits.memory_limit[0], 12 * GIB);
            assert_eq!(plan.limits.swap_limit[0], 12 * GIB);
        }
        // The node-wide swap comes on top, per device.
        node.swap_limit = Some(GIB);
        let devices = [grant("GPU-1", 2 * GIB, 20), grant("GPU-0", 24 * GIB, 20)];
        let plan = plan_main(&node, "pod-c", &devices, None, &gpus).expect("plan");
        let env = |k: &str| plan.envs.get(k).map(String::as_str);
        assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_0"), Some("12288m"));
        assert_eq!(env("VGPU_SWAP_LIMIT_0"), Some("13312m"));
        assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_1"), Some("1024m"));
        assert_eq!(env("VGPU_SWAP_LIMIT_1"), Some("2048m"));
        // What the shim reads back from the environment is the region's.
        let read = ShimConfig::from_lookup(|key| plan.envs.get(key).cloned()).expect("env");
        assert_eq!(read.limits.memory_limit, plan.limits.memory_limit);
        assert_eq!(read.limits.swap_limit, plan.limits.swap_limit);
    }

    #[test]
    fn without_scaling_or_swap_nothing_is_oversubscribed() {
        let mut node = settings(Path::new("/b"));
        node.memory_scaling = "0.5".parse().expect("0.5");
        let plan =
            plan_main(&node, "u", &[grant("GPU-0", 4 << 30, 50)], None, &gpus()).expect("plan");
        assert_eq!(plan.envs.get("CUDA_OVERSUBSCRIBE"), None);
        assert_eq!(plan.envs.get("VGPU_SWAP_LIMIT_0"), None);
        assert_eq!(plan.limits.memory_limit[0], 4 << 30);
        assert_eq!(plan.limits.swap_limit[0], 0);
    }

    #[test]
    fn grants_this_node_cannot_honour_are_refused() {
        let node = settings(Path::new("/b"));
        let cases = [
            (
                vec![grant("GPU-9", 1, 1)],
                "the decision gives container main GPU GPU-9, which this node does not have",
            ),
            (
                vec![grant("GPU-2", 1, 1)],
                "the decision gives container main GPU GPU-2, which is unhealthy",
            ),
            (
                vec![grant("GPU-0", 1, 1), grant("GPU-0", 1, 1)],
                "the decision gives container main GPU GPU-0 twice",
            ),
        ];
        for (devices, expected) in cases {
            let error = plan_main(&node, "u", &devices, None, &gpus()).expect_err(expected);
            assert_eq!(error.to_string(), expected);
        }
        let error =
            plan_main(&node, "../x", &[grant("GPU-0", 1, 1)], None, &gpus()).expect_err("bad uid");
        assert!(matches!(error, AllocationError::BadName { .. }));
        // A claim's refusal names the claim.
        let claim = Holder::Claim("ns/c".into());
        let grants = Grants {
            holder: &claim,
            dir_name: "claim-0b1c",
            devices: &[grant("GPU-2", 1, 1)],
            priority: None,
        };
        let error = plan(&node, grants, &gpus()).expect_err("unhealthy");
        assert_eq!(
            error.to_string(),
            "the allocation gives claim ns/c GPU GPU-2, which is unhealthy"
        );
        let many: Vec<DeviceGrant> = (0..=MAX_DEVICES)
            .map(|i| grant(&format!("GPU-{i}"), 1, 1))
            .collect();
        let error = plan(
            &node,
            Grants {
                devices: &many,
                ..grants
            },
            &gpus(),
        )
        .expect_err("too many");
        assert!(
            matches!(error, AllocationError::TooManyGpus { count, .. } if count == MAX_DEVICES + 1)
        );
    }

    #[test]
    fn a_claims_region_is_in_the_directory_it_names() {
        let claim = Holder::Claim("ns/c".into());
        let grants = Grants {
            holder: &claim,
            dir_name: "claim-0b1c",
            devices: &[grant("GPU-1", 1 << 30, 40)],
            priority: None,
        };
        let plan = plan(&settings(Path::new("/b")), grants, &gpus()).expect("plan");
        assert_eq!(plan.host_dir, Path::new("/b/containers/claim-0b1c"));
        assert_eq!(
            plan.region_host,
            Path::new("/b/containers/claim-0b1c/region.cache")
        );
        assert_eq!(plan.holder.name(), "ns/c");
        assert_eq!(plan.limits.sm_limit[0], 40);
    }

    #[test]
    fn the_region_is_created_with_the_limits_and_kept_on_retry() {
        let base = temp_dir("region");
        let node = settings(&base);
        let plan = plan_main(
            &node,
            "uid-2",
            &[grant("GPU-1", 1 << 30, 25)],
            Some(2),
            &gpus(),
        )
        .expect("plan");
        prepare(&plan).expect("prepare");
        prepare(&plan).expect("prepare again");
        let region = Region::open_existing(&plan.region_host).expect("region");
        assert_eq!(region.limits(), plan.limits.as_stored());
        // The grant says the same, and is the node's alone to write.
        let grant = Grant::open_read_only(&plan.grant_host).expect("grant");
        assert_eq!(grant.limits().load(), plan.limits.as_stored());
        assert_eq!(grant.settings().expect("settings"), plan.grant);
        assert_eq!(
            grant.settings().expect("settings").region_path,
            "/usr/local/vgpu/container/region.cache"
        );
        let grant_mode = std::fs::metadata(&plan.grant_host)
            .expect("metadata")
            .permissions()
            .mode();
        assert_eq!(grant_mode & 0o777, 0o644);
        assert_eq!(region.limits().sm_limit[0], 25);
        assert_eq!(region.limits().priority, 2);
        assert_eq!(region.device_limit(0), 1 << 30);
        let mode = std::fs::metadata(&plan.region_host)
            .expect("metadata")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o666);

        let mut other = plan.clone();
        other.limits.memory_limit[0] = 2 << 30;
        assert!(matches!(
            prepare(&other),
            Err(AllocationError::RegionMismatch { .. })
        ));

        write_preload(&node).expect("preload");
        write_preload(&node).expect("preload again");
        assert_eq!(
            std::fs::read_to_string(base.join("ld.so.preload")).expect("read"),
            "/usr/local/vgpu/libvgpu.so\n"
        );
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn a_file_that_cannot_be_written_is_named_with_what_was_done() {
        let base = temp_dir("unwritable");
        // The preload's folder is a file: creating it fails.
        std::fs::write(base.join("file"), "").expect("write");
        let mut node = settings(&base);
        node.preload_host = Some(base.join("file/ld.so.preload"));
        let error = write_preload(&node).expect_err("not a folder");
        assert_eq!(
            error.to_string(),
            format!("{}: create directory", base.join("file").display())
        );
        assert!(
            std::error::Error::source(&error).is_some(),
            "the cause is kept"
        );
        let _ = std::fs::remove_dir_all(&base);
    }
}
