//! A container as a node sets one up, made on the host for tests: the
//! node agent's own plan and preparation (`vgpu_node_agent::allocation`)
//! write the region and the grant into a host directory, and processes run
//! in a mount namespace of their own that gets exactly the plan's mounts
//! (the shim, the region file, the grant read-only at the one path the
//! shim looks for it), over a private tmpfs on `/usr/local` so that nothing
//! on the host changes. Needs root, as the real-node tests do.

use std::path::{Path, PathBuf};
use std::process::Command;
use vgpu_cluster::decision::{DeviceGrant, InventoryGpu};
use vgpu_node_agent::allocation::{self, Grants, Holder, RegionPlan, Settings, DEVICE_LIST_DIR};
use vgpu_node_contract::region::limits::scaling::MemoryScaling;
use vgpu_node_contract::region::UtilizationPolicy;

/// A node-prepared container's host side.
pub struct NodeContainer {
    pub plan: RegionPlan,
    /// The region's directory name (`<pod uid>_<container>`).
    pub key: String,
}

impl NodeContainer {
    /// What the node charges each context (the node agent's
    /// `--context-reserve`).
    pub const CONTEXT_RESERVE: u64 = 64 << 20;

    /// Prepares container `name` of pod `pod_uid` under `root` (the node's
    /// containers directory) with one grant per GPU: `(uuid, memory bytes,
    /// cores percent)`, the GPUs in the order given being NVML's.
    pub fn prepare(root: &Path, pod_uid: &str, name: &str, grants: &[(&str, u64, u32)]) -> Self {
        let settings = Settings {
            containers_dir: root.to_path_buf(),
            region_file: "region.cache".into(),
            container_dir: "/usr/local/vgpu/container".into(),
            library_host: crate::shim_library(),
            library_container: "/usr/local/vgpu/libvgpu.so".into(),
            preload_host: None,
            policy: UtilizationPolicy::Default,
            swap_limit: None,
            memory_scaling: MemoryScaling::ONE,
            context_reserve: Some(Self::CONTEXT_RESERVE),
        };
        let gpus: Vec<InventoryGpu> = grants
            .iter()
            .enumerate()
            .map(|(index, (uuid, _, _))| InventoryGpu {
                uuid: uuid.to_string(),
                index: index as u32,
                model: "simulated".into(),
                memory_bytes: 0,
                offered_memory_bytes: None,
                sm_count: 132,
                split_count: 10,
                numa: None,
                nvlink_island: None,
                healthy: true,
                utilization_percent: None,
            })
            .collect();
        let devices: Vec<DeviceGrant> = grants
            .iter()
            .map(|(uuid, memory_bytes, cores_percent)| DeviceGrant {
                uuid: uuid.to_string(),
                memory_bytes: *memory_bytes,
                cores_percent: *cores_percent,
                burst_percent: None,
            })
            .collect();
        let holder = Holder::Container(name.to_string());
        let key = allocation::container_dir_name(pod_uid, name).expect("a valid name");
        let plan = allocation::plan(
            &settings,
            Grants {
                holder: &holder,
                dir_name: &key,
                devices: &devices,
                priority: None,
            },
            &gpus,
        )
        .expect("plan");
        allocation::prepare(&plan).expect("prepare");
        Self { plan, key }
    }

    /// The region file on the host.
    pub fn region(&self) -> &Path {
        &self.plan.region_host
    }

    /// The grant on the host.
    pub fn grant(&self) -> &Path {
        &self.plan.grant_host
    }

    /// Gives `command` the environment the plan gives the container, over
    /// what it had (as kubelet gives a container its device plugin's).
    pub fn give_env(&self, command: &mut Command) {
        for (key, value) in &self.plan.envs {
            command.env(key, value);
        }
    }

    /// `command` as a process of this container: in a mount namespace of
    /// its own with the plan's mounts, and the command's own environment
    /// (give it the plan's with [`Self::give_env`]).
    pub fn wrap(&self, command: &Command) -> Command {
        // Each mount: host path, container path, "ro" or "rw".
        let script = r#"set -e
mount -t tmpfs vgpu-test-node /usr/local
while [ "$1" != "--" ]; do
    mkdir -p "$(dirname "$2")"
    if [ -d "$1" ]; then mkdir -p "$2"; else touch "$2"; fi
    mount --bind "$1" "$2"
    if [ "$3" = ro ]; then mount -o remount,bind,ro "$2"; fi
    shift 3
done
shift
exec "$@""#;
        let mut wrapped = Command::new("unshare");
        wrapped.args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
            "sh",
        ]);
        // The device-list mounts are the container runtime's to read (the
        // GPUs it gives the container), nothing the container's programs
        // use: outside /usr/local they would land on the host's own /var/run.
        let for_programs = self
            .plan
            .mounts
            .iter()
            .filter(|mount| !mount.container_path.starts_with(DEVICE_LIST_DIR));
        for mount in for_programs {
            wrapped
                .arg(&mount.host_path)
                .arg(&mount.container_path)
                .arg(if mount.read_only { "ro" } else { "rw" });
        }
        wrapped
            .arg("--")
            .arg(command.get_program())
            .args(command.get_args())
            .env_clear()
            .env("PATH", "/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin");
        for (key, value) in command.get_envs() {
            match value {
                Some(value) => wrapped.env(key, value),
                None => wrapped.env_remove(key),
            };
        }
        wrapped
    }

    /// The host directory holding the region and the grant.
    pub fn dir(&self) -> PathBuf {
        self.plan.host_dir.clone()
    }
}
