//! What a container gets at kubelet's `Allocate`: the region planned for
//! it from the scheduler's decision ([`vgpu_node_agent::allocation`]), in
//! kubelet's words.

use crate::api::v1beta1 as api;
use vgpu_cluster::decision::{ContainerDecision, InventoryGpu};
use vgpu_node_agent::allocation::{
    self, container_dir_name, AllocationError, Grants, Holder, Mount, RegionPlan, Settings,
};

/// Works out what `container` of the pod `pod_uid` gets on this node's
/// `gpus`, in its own directory `<podUID>_<container>`. Pure: nothing is
/// written.
pub fn plan(
    settings: &Settings,
    pod_uid: &str,
    container: &ContainerDecision,
    gpus: &[InventoryGpu],
) -> Result<RegionPlan, AllocationError> {
    let dir_name = container_dir_name(pod_uid, &container.name)?;
    let holder = Holder::Container(container.name.clone());
    let grants = Grants {
        holder: &holder,
        dir_name: &dir_name,
        devices: &container.devices,
        priority: container.priority,
    };
    allocation::plan(settings, grants, gpus)
}

fn kubelet_mount(mount: &Mount) -> api::Mount {
    api::Mount {
        container_path: mount.container_path.display().to_string(),
        host_path: mount.host_path.display().to_string(),
        read_only: mount.read_only,
    }
}

/// The kubelet answer for the container `plan` is for.
pub fn response(plan: &RegionPlan) -> api::ContainerAllocateResponse {
    api::ContainerAllocateResponse {
        envs: plan.envs.clone().into_iter().collect(),
        mounts: plan.mounts.iter().map(kubelet_mount).collect(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_cluster::decision::DeviceGrant;
    use vgpu_node_contract::region::limits::scaling::MemoryScaling;
    use vgpu_node_contract::region::UtilizationPolicy;

    fn settings() -> Settings {
        Settings {
            containers_dir: "/base/containers".into(),
            region_file: "region.cache".into(),
            container_dir: "/usr/local/vgpu/container".into(),
            library_host: "/opt/vgpu/libvgpu.so".into(),
            library_container: "/usr/local/vgpu/libvgpu.so".into(),
            preload_host: Some("/base/ld.so.preload".into()),
            policy: UtilizationPolicy::Default,
            swap_limit: None,
            memory_scaling: MemoryScaling::ONE,
            context_reserve: None,
        }
    }

    fn gpu() -> InventoryGpu {
        InventoryGpu {
            offered_memory_bytes: None,
            utilization_percent: None,
            uuid: "GPU-0".into(),
            index: 0,
            model: "m".into(),
            memory_bytes: 16 << 30,
            sm_count: 132,
            split_count: 10,
            numa: None,
            nvlink_island: None,
            healthy: true,
        }
    }

    fn decision(name: &str) -> ContainerDecision {
        ContainerDecision {
            name: name.into(),
            init: false,
            devices: vec![DeviceGrant {
                uuid: "GPU-0".into(),
                memory_bytes: 1 << 30,
                cores_percent: 30,
                burst_percent: None,
            }],
            priority: Some(1),
        }
    }

    #[test]
    fn a_container_gets_its_own_directory_and_kubelet_its_mounts() {
        let plan = plan(&settings(), "uid-1", &decision("main"), &[gpu()]).expect("plan");
        assert_eq!(plan.holder.name(), "main");
        assert_eq!(
            plan.host_dir,
            std::path::Path::new("/base/containers/uid-1_main")
        );
        assert_eq!(plan.limits.priority, 1);
        let answer = response(&plan);
        let mounts: Vec<(&str, &str, bool)> = answer
            .mounts
            .iter()
            .map(|m| (m.container_path.as_str(), m.host_path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            mounts,
            vec![
                ("/usr/local/vgpu/libvgpu.so", "/opt/vgpu/libvgpu.so", true),
                (
                    "/usr/local/vgpu/container/region.cache",
                    "/base/containers/uid-1_main/region.cache",
                    false
                ),
                // The node's grant, read-only, at the one path the shim
                // looks for it.
                (
                    "/usr/local/vgpu/grant",
                    "/base/containers/uid-1_main/grant",
                    true
                ),
                ("/etc/ld.so.preload", "/base/ld.so.preload", true),
                // Its GPU again, for a runtime that takes a container's
                // GPUs from mounts only.
                ("/var/run/nvidia-container-devices/GPU-0", "/dev/null", true),
            ]
        );
        assert_eq!(
            answer
                .envs
                .get("CUDA_DEVICE_SM_LIMIT_0")
                .map(String::as_str),
            Some("30")
        );
        assert_eq!(answer.envs.len(), plan.envs.len());
    }

    #[test]
    fn a_container_name_that_cannot_name_a_directory_is_refused() {
        let error = plan(&settings(), "uid-1", &decision("../x"), &[gpu()]).expect_err("bad");
        assert!(matches!(error, AllocationError::BadName { .. }), "{error}");
    }
}
