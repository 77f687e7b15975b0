//! What a container gets: its environment (the shim's configuration,
//! HAMi-core's variable names), its mounts (the shim, an `ld.so.preload`
//! naming it, the container's region directory), and, on the host, that
//! directory with the region file already created with the container's
//! limits, so the container's processes only attach to it.

use crate::api::v1beta1 as api;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use thiserror::Error;
use vgpu_cluster::decision::{
    region_limits, ContainerDecision, DeviceGrant, InventoryGpu, NodeLimits,
};
use vgpu_cluster::scaling::MemoryScaling;
use vgpu_node_contract::region::{Region, RegionLimits, MAX_DEVICES};
use vgpu_node_contract::shim_env::{ShimConfig, UtilizationPolicy, DEFAULT_CONTEXT_RESERVE};

/// The GPUs a container may see (NVIDIA container runtime).
pub const ENV_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// CUDA's device numbering; set to PCI order so that device `i` in the
/// container is the `i`-th GPU of `NVIDIA_VISIBLE_DEVICES`, which is what
/// the per-device limit variables are numbered by.
pub use vgpu_node_contract::shim_env::ENV_DEVICE_ORDER;

/// Where things are, on the host and in containers, and the node-wide
/// settings written into every container's environment.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Host directory holding one directory per container,
    /// `<podUID>_<container>`.
    pub containers_dir: PathBuf,
    /// Name of the region file inside a container directory.
    pub region_file: String,
    /// Where a container sees its own directory.
    pub container_dir: PathBuf,
    /// The shim on the host.
    pub library_host: PathBuf,
    /// Where containers see the shim.
    pub library_container: PathBuf,
    /// The `ld.so.preload` the plugin writes on the host; mounted as
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

/// Path of `ld.so.preload` in a container.
pub const CONTAINER_PRELOAD: &str = "/etc/ld.so.preload";

/// Why a container could not be given its GPUs.
#[derive(Debug, Error)]
pub enum AllocateError {
    #[error("the decision gives container {container} GPU {uuid}, which this node does not have")]
    UnknownGpu { container: String, uuid: String },
    #[error("the decision gives container {container} GPU {uuid}, which is unhealthy")]
    UnhealthyGpu { container: String, uuid: String },
    #[error("the decision gives container {container} GPU {uuid} twice")]
    DuplicateGpu { container: String, uuid: String },
    #[error("the decision gives container {container} {count} GPUs; at most {MAX_DEVICES} are supported")]
    TooManyGpus { container: String, count: usize },
    #[error("pod UID {uid:?} or container name {container:?} cannot name a directory")]
    BadName { uid: String, container: String },
    #[error("{path}: {op}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Region(#[from] vgpu_node_contract::region::RegionError),
    #[error("region {path} already exists with other limits; refusing to change the limits of a running container")]
    RegionMismatch { path: PathBuf },
}

fn io_error(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> AllocateError {
    let path = path.to_path_buf();
    move |source| AllocateError::Io { path, op, source }
}

/// Everything one container gets.
#[derive(Clone, Debug, PartialEq)]
pub struct ContainerPlan {
    pub container: String,
    /// The container's directory on the host.
    pub host_dir: PathBuf,
    /// The region file on the host.
    pub region_host: PathBuf,
    /// The limits written into the region (what the shim reads back from
    /// [`Self::envs`]).
    pub limits: RegionLimits,
    pub envs: BTreeMap<String, String>,
    pub mounts: Vec<api::Mount>,
}

impl ContainerPlan {
    /// The kubelet answer for this container.
    pub fn response(&self) -> api::ContainerAllocateResponse {
        api::ContainerAllocateResponse {
            envs: self.envs.clone().into_iter().collect(),
            mounts: self.mounts.clone(),
            ..Default::default()
        }
    }
}

/// The name of a container's directory: `<podUID>_<container>`.
pub fn container_dir_name(pod_uid: &str, container: &str) -> Result<String, AllocateError> {
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
        Err(AllocateError::BadName {
            uid: pod_uid.to_string(),
            container: container.to_string(),
        })
    }
}

/// Works out what `container` of the pod `pod_uid` gets on this node's
/// `gpus`. Pure: nothing is written.
pub fn plan(
    settings: &Settings,
    pod_uid: &str,
    container: &ContainerDecision,
    gpus: &[InventoryGpu],
) -> Result<ContainerPlan, AllocateError> {
    let dir_name = container_dir_name(pod_uid, &container.name)?;
    plan_in_dir(settings, &dir_name, container, gpus)
}

/// [`plan`] for the region directory `dir_name` under the containers
/// directory (the DRA driver keeps one per claim, which all of the claim's
/// containers share).
pub fn plan_in_dir(
    settings: &Settings,
    dir_name: &str,
    container: &ContainerDecision,
    gpus: &[InventoryGpu],
) -> Result<ContainerPlan, AllocateError> {
    let name = &container.name;
    if container.devices.len() > MAX_DEVICES {
        return Err(AllocateError::TooManyGpus {
            container: name.clone(),
            count: container.devices.len(),
        });
    }
    // In the container, CUDA numbers the visible GPUs in PCI order, which
    // is NVML's host order: list them that way so variable `_<i>` is
    // device `i`.
    let mut grants = Vec::with_capacity(container.devices.len());
    for grant in &container.devices {
        let gpu = gpus.iter().find(|g| g.uuid == grant.uuid).ok_or_else(|| {
            AllocateError::UnknownGpu {
                container: name.clone(),
                uuid: grant.uuid.clone(),
            }
        })?;
        if !gpu.healthy {
            return Err(AllocateError::UnhealthyGpu {
                container: name.clone(),
                uuid: grant.uuid.clone(),
            });
        }
        if grants
            .iter()
            .any(|(_, granted): &(u32, &DeviceGrant)| granted.uuid == grant.uuid)
        {
            return Err(AllocateError::DuplicateGpu {
                container: name.clone(),
                uuid: grant.uuid.clone(),
            });
        }
        grants.push((gpu.index, grant));
    }
    grants.sort_by_key(|(index, _)| *index);

    let host_dir = settings.containers_dir.join(dir_name);
    let region_host = host_dir.join(&settings.region_file);
    let region_container = settings.container_dir.join(&settings.region_file);

    // The shim's configuration, typed: the decision's bytes and percents
    // go straight into the region's limits, and the environment is written
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
    let ordered: Vec<&DeviceGrant> = grants.iter().map(|(_, grant)| *grant).collect();
    config.limits = region_limits(&ordered, container.priority, &node);

    let mut envs: BTreeMap<String, String> = config.to_env(grants.len()).into_iter().collect();
    let uuids: Vec<&str> = grants.iter().map(|(_, g)| g.uuid.as_str()).collect();
    envs.insert(ENV_VISIBLE_DEVICES.to_string(), uuids.join(","));
    envs.insert(ENV_DEVICE_ORDER.to_string(), "PCI_BUS_ID".to_string());

    let limits = config.limits;

    let mut mounts = vec![
        api::Mount {
            container_path: settings.library_container.display().to_string(),
            host_path: settings.library_host.display().to_string(),
            read_only: true,
        },
        api::Mount {
            container_path: settings.container_dir.display().to_string(),
            host_path: host_dir.display().to_string(),
            read_only: false,
        },
    ];
    if let Some(preload) = &settings.preload_host {
        mounts.push(api::Mount {
            container_path: CONTAINER_PRELOAD.to_string(),
            host_path: preload.display().to_string(),
            read_only: true,
        });
    }

    Ok(ContainerPlan {
        container: name.clone(),
        host_dir,
        region_host,
        limits,
        envs,
        mounts,
    })
}

/// Creates the container's directory and its region on the host.
/// Idempotent: a region already there with the same limits (an earlier
/// attempt at the same container) is kept.
pub fn prepare(plan: &ContainerPlan) -> Result<(), AllocateError> {
    std::fs::create_dir_all(&plan.host_dir)
        .map_err(io_error(&plan.host_dir, "create directory"))?;
    std::fs::set_permissions(&plan.host_dir, std::fs::Permissions::from_mode(0o755))
        .map_err(io_error(&plan.host_dir, "chmod"))?;
    let region = Region::open_or_create(&plan.region_host, &plan.limits)?;
    if region.limits() != plan.limits.as_stored() {
        return Err(AllocateError::RegionMismatch {
            path: plan.region_host.clone(),
        });
    }
    drop(region);
    // Container processes may run as any user; they need to map the file
    // read-write and take their liveness locks on it.
    std::fs::set_permissions(&plan.region_host, std::fs::Permissions::from_mode(0o666))
        .map_err(io_error(&plan.region_host, "chmod"))?;
    Ok(())
}

/// Writes the host's `ld.so.preload` (one line: the shim's path in
/// containers), replacing it atomically if its content differs.
pub fn write_preload(settings: &Settings) -> Result<(), AllocateError> {
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

    fn container(devices: Vec<DeviceGrant>, priority: Option<i32>) -> ContainerDecision {
        ContainerDecision {
            name: "main".into(),
            init: false,
            devices,
            priority,
        }
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("vgpu-plugin-unit-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn environment_lists_gpus_in_host_order_with_their_limits() {
        let base = PathBuf::from("/base");
        let decision = container(
            vec![
                grant("GPU-1", 3000 << 20, 30),
                grant("GPU-0", (1 << 30) + 1, 0),
            ],
            Some(0),
        );
        let plan = plan(&settings(&base), "uid-1", &decision, &gpus()).expect("plan");
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
        let mounts: Vec<(&str, &str, bool)> = plan
            .mounts
            .iter()
            .map(|m| (m.container_path.as_str(), m.host_path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            mounts,
            vec![
                ("/usr/local/vgpu/libvgpu.so", "/opt/vgpu/libvgpu.so", true),
                (
                    "/usr/local/vgpu/container",
                    "/base/containers/uid-1_main",
                    false
                ),
                ("/etc/ld.so.preload", "/base/ld.so.preload", true),
            ]
        );
    }

    #[test]
    fn a_burst_share_reaches_the_shim_and_the_region() {
        let mut bursting = grant("GPU-1", 1 << 30, 30);
        bursting.burst_percent = Some(80);
        let decision = container(vec![bursting, grant("GPU-0", 1 << 30, 50)], None);
        let plan = plan(&settings(Path::new("/b")), "u", &decision, &gpus()).expect("plan");
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
        let plan = plan(
            &node,
            "u",
            &container(vec![grant("GPU-0", 1 << 30, 50)], None),
            &gpus(),
        )
        .expect("plan");
        let env = |k: &str| plan.envs.get(k).map(String::as_str);
        assert_eq!(env("GPU_CORE_UTILIZATION_POLICY"), Some("force"));
        assert_eq!(env("CUDA_OVERSUBSCRIBE"), Some("true"));
        assert_eq!(env("VGPU_SWAP_LIMIT_0"), Some("8192m"));
        assert_eq!(env("VGPU_CONTEXT_RESERVE"), Some("128m"));
        assert_eq!(env("CUDA_TASK_PRIORITY"), None);
        assert_eq!(plan.limits.swap_limit[0], 8 << 30);
        assert_eq!(plan.limits.policy, UtilizationPolicy::Force as u32);
        assert_eq!(plan.mounts.len(), 2);
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
            let plan = plan(
                &node,
                pod,
                &container(vec![grant("GPU-0", 24 * GIB, 50)], None),
                &gpus,
            )
            .expect("plan");
            let env = |k: &str| plan.envs.get(k).map(String::as_str);
            assert_eq!(env("CUDA_OVERSUBSCRIBE"), Some("true"));
            assert_eq!(env("CUDA_DEVICE_MEMORY_LIMIT_0"), Some("12288m"));
            assert_eq!(env("VGPU_SWAP_LIMIT_0"), Some("12288m"));
            assert_eq!(plan.limits.memory_limit[0], 12 * GIB);
            assert_eq!(plan.limits.swap_limit[0], 12 * GIB);
        }
        // The node-wide swap comes on top, per device.
        node.swap_limit = Some(GIB);
        let plan = plan(
            &node,
            "pod-c",
            &container(
                vec![grant("GPU-1", 2 * GIB, 20), grant("GPU-0", 24 * GIB, 20)],
                None,
            ),
            &gpus,
        )
        .expect("plan");
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
        let plan = plan(
            &node,
            "u",
            &container(vec![grant("GPU-0", 4 << 30, 50)], None),
            &gpus(),
        )
        .expect("plan");
        assert_eq!(plan.envs.get("CUDA_OVERSUBSCRIBE"), None);
        assert_eq!(plan.envs.get("VGPU_SWAP_LIMIT_0"), None);
        assert_eq!(plan.limits.memory_limit[0], 4 << 30);
        assert_eq!(plan.limits.swap_limit[0], 0);
    }

    #[test]
    fn decisions_this_node_cannot_honour_are_refused() {
        let node = settings(Path::new("/b"));
        let cases = [
            (vec![grant("GPU-9", 1, 1)], "does not have"),
            (vec![grant("GPU-2", 1, 1)], "unhealthy"),
            (vec![grant("GPU-0", 1, 1), grant("GPU-0", 1, 1)], "twice"),
        ];
        for (devices, expected) in cases {
            let error = plan(&node, "u", &container(devices, None), &gpus()).expect_err(expected);
            assert!(error.to_string().contains(expected), "{error}");
        }
        let error = plan(
            &node,
            "../x",
            &container(vec![grant("GPU-0", 1, 1)], None),
            &gpus(),
        )
        .expect_err("bad uid");
        assert!(matches!(error, AllocateError::BadName { .. }));
    }

    #[test]
    fn the_region_is_created_with_the_limits_and_kept_on_retry() {
        let base = temp_dir("region");
        let node = settings(&base);
        let decision = container(vec![grant("GPU-1", 1 << 30, 25)], Some(2));
        let plan = plan(&node, "uid-2", &decision, &gpus()).expect("plan");
        prepare(&plan).expect("prepare");
        prepare(&plan).expect("prepare again");
        let region = Region::open_existing(&plan.region_host).expect("region");
        assert_eq!(region.limits(), plan.limits.as_stored());
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
            Err(AllocateError::RegionMismatch { .. })
        ));

        write_preload(&node).expect("preload");
        write_preload(&node).expect("preload again");
        assert_eq!(
            std::fs::read_to_string(base.join("ld.so.preload")).expect("read"),
            "/usr/local/vgpu/libvgpu.so\n"
        );
        let _ = std::fs::remove_dir_all(&base);
    }
}
