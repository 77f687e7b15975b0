//! Command-line options of `vgpu-device-plugin`.

use crate::cluster::ApiSource;
use crate::kubelet::KubeletSettings;
use crate::pod_resources::DEFAULT_POD_RESOURCES_SOCKET;
use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;
use vgpu_cluster::node_lease::DEFAULT_LEASE_DURATION_SECONDS;
use vgpu_node_agent::allocation::Settings;
use vgpu_node_agent::flags::{ApiFlags, ContainerFlags, HealthFlags};

/// vgpu kubelet device plugin: shares this node's GPUs between containers.
///
/// Advertises each GPU of this node as `--split-count` devices of `--resource-name`, publishes the node's GPU
/// inventory for the vgpu scheduler extender (node annotation
/// `vgpu.io/node-gpus`), and at `Allocate` gives each container the GPUs,
/// memory caps and compute shares the extender decided for it (pod
/// annotation `vgpu.io/decision`): environment for the vgpu shim, mounts of
/// the shim, an `ld.so.preload` and the container's region directory.
#[derive(Clone, Debug, Parser)]
#[command(name = "vgpu-device-plugin", version)]
pub struct Options {
    /// This node's name (the pods bound to it are the ones served).
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: String,

    /// Extended resource the GPUs are advertised as.
    #[arg(long, default_value = "nvidia.com/gpu", value_name = "NAME")]
    pub resource_name: String,

    /// The names of the resources that say how much of a GPU a container
    /// gets: the plugin offers each in the node's status (see
    /// `vgpu_device_plugin::inventory::share_capacity`).
    #[command(flatten)]
    pub share_resources: vgpu_cluster::resources::ShareResourceFlags,

    /// What containers get that name no memory or compute share: give
    /// the scheduler extender's values. A pod's decision is checked
    /// against what the pod asks for, read with these.
    #[command(flatten)]
    pub request_defaults: vgpu_cluster::requests::RequestDefaultFlags,

    /// Devices advertised per GPU: the most containers that may share one.
    #[arg(long, default_value_t = 10, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub split_count: u32,

    /// Kubelet's device plugin directory (holds kubelet.sock and the
    /// plugin's own socket).
    #[arg(
        long,
        default_value = "/var/lib/kubelet/device-plugins",
        value_name = "DIR"
    )]
    pub device_plugin_dir: PathBuf,

    /// Name of the plugin's socket in the device plugin directory.
    #[arg(long, default_value = "vgpu.sock", value_name = "NAME")]
    pub socket_name: String,

    /// How often to check whether kubelet restarted (kubelet.sock
    /// recreated, the plugin's socket removed), in milliseconds.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub kubelet_poll_ms: u64,

    /// NVML library to load.
    #[arg(long, default_value = "libnvidia-ml.so.1", value_name = "PATH")]
    pub nvml_library: PathBuf,

    #[command(flatten)]
    pub container: ContainerFlags,

    /// leaseDurationSeconds of the node's Lease
    /// (kube-node-lease/vgpu-<node>), renewed every quarter of it: the
    /// scheduler extender places no new vGPU pods on the node once the
    /// Lease has gone unrenewed this long (plus its grace).
    #[arg(long, default_value_t = DEFAULT_LEASE_DURATION_SECONDS, value_name = "SECONDS",
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub lease_duration_seconds: u32,

    /// Kubelet's PodResources API socket: at start the plugin checks its
    /// allocation records against what kubelet says each container holds,
    /// and logs every difference; when it answers then, the node takes
    /// several vGPU pods at once (an `Allocate` among several pending pods
    /// goes to the one kubelet lists as admitting). Not there: not checked,
    /// and one pod at a time.
    #[arg(long, default_value = DEFAULT_POD_RESOURCES_SOCKET, value_name = "PATH")]
    pub pod_resources_socket: PathBuf,

    /// Seconds between rewrites of an unchanged inventory annotation and
    /// share capacities (they are also written at start and on every
    /// change; the rewrite repairs a node object that was recreated).
    /// Whether the plugin is alive is told by its Lease, not by this.
    #[arg(long, default_value_t = 300, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub resync_seconds: u64,

    /// Seconds between samples of each GPU's utilization, which is
    /// smoothed and published in the node inventory (when it moved by 5
    /// points or more, at most every 10 s) for the extender's load-aware
    /// policies; 0: not measured.
    #[arg(long, default_value_t = 5, value_name = "SECONDS")]
    pub load_sample_seconds: u64,

    #[command(flatten)]
    pub health: HealthFlags,

    #[command(flatten)]
    pub api: ApiFlags,

    /// Log level of the plugin's own messages: error, warn, info, debug or
    /// trace (to stderr; the libraries it uses log warnings and errors only).
    #[arg(long, default_value = "info", value_name = "LEVEL")]
    pub log_level: tracing::Level,
}

impl Options {
    pub fn api_source(&self) -> ApiSource {
        self.api.source()
    }

    pub fn allocate_settings(&self) -> Settings {
        self.container.settings()
    }

    pub fn kubelet_settings(&self) -> KubeletSettings {
        KubeletSettings {
            dir: self.device_plugin_dir.clone(),
            endpoint: self.socket_name.clone(),
            resource_name: self.resource_name.clone(),
            poll: Duration::from_millis(self.kubelet_poll_ms.max(10)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use vgpu_node_agent::health::DEFAULT_IGNORED_XIDS;
    use vgpu_node_contract::region::limits::scaling::MemoryScaling;
    use vgpu_node_contract::region::UtilizationPolicy;

    #[test]
    fn defaults_and_help() {
        Options::command().debug_assert();
        let options = Options::try_parse_from(["p", "--node-name", "n1"]).expect("parse");
        assert_eq!(options.resource_name, "nvidia.com/gpu");
        assert_eq!(options.split_count, 10);
        assert_eq!(options.health.ignored_xids, DEFAULT_IGNORED_XIDS);
        assert_eq!(options.api_source(), ApiSource::InCluster);
        let settings = options.allocate_settings();
        assert_eq!(
            settings.containers_dir,
            PathBuf::from("/usr/local/vgpu/containers")
        );
        assert!(settings.preload_host.is_some());
        assert_eq!(settings.swap_limit, None);
        assert_eq!(settings.memory_scaling, MemoryScaling::ONE);
        assert_eq!(
            options.kubelet_settings().dir,
            PathBuf::from("/var/lib/kubelet/device-plugins")
        );
        let help = Options::command().render_long_help().to_string();
        for flag in [
            "--split-count",
            "--swap-limit",
            "--device-memory-scaling",
            "--ignored-xids",
            "--containers-dir",
        ] {
            assert!(help.contains(flag), "{flag}");
        }
    }

    #[test]
    fn sizes_and_lists_parse() {
        let options = Options::try_parse_from([
            "p",
            "--node-name",
            "n",
            "--swap-limit",
            "8Gi",
            "--context-reserve",
            "128m",
            "--ignored-xids",
            "13,43",
            "--core-policy",
            "force",
            "--apiserver-url",
            "http://127.0.0.1:1",
        ])
        .expect("parse");
        assert_eq!(options.container.swap_limit, Some(8 << 30));
        assert_eq!(options.container.context_reserve, Some(128 << 20));
        assert_eq!(options.health.ignored_xids, vec![13, 43]);
        assert_eq!(options.allocate_settings().policy, UtilizationPolicy::Force);
        assert!(matches!(options.api_source(), ApiSource::Url(_)));
        assert!(
            Options::try_parse_from(["p", "--node-name", "n", "--swap-limit", "1.5g"]).is_err()
        );
        assert!(Options::try_parse_from(["p", "--node-name", "n", "--split-count", "0"]).is_err());
    }

    #[test]
    fn device_memory_scaling_takes_a_positive_number() {
        let parse = |value: &str| {
            Options::try_parse_from(["p", "--node-name", "n", "--device-memory-scaling", value])
        };
        let options = parse("2").expect("2");
        assert_eq!(options.allocate_settings().memory_scaling.get(), 2.0);
        assert_eq!(
            parse("0.75")
                .expect("0.75")
                .container
                .device_memory_scaling
                .get(),
            0.75
        );
        for (bad, words) in [
            ("0", "above 0"),
            ("-1", "above 0"),
            ("NaN", "above 0"),
            ("inf", "above 0"),
            ("two", "not a number"),
            ("", "not a number"),
        ] {
            let error = parse(bad).expect_err(bad).to_string();
            assert!(
                error.contains("--device-memory-scaling") && error.contains(words),
                "{bad}: {error}"
            );
        }
    }
}
