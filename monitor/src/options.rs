//! Command-line options of `vgpu-monitor`.

use crate::backstop::{ComputeRule, MemoryRule, OverCapAction};
use crate::config::MonitorConfig;
use crate::discovery::DiscoveryConfig;
use crate::names::ApiSource;
use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use thiserror::Error;
use vgpu_cluster::requests::{RequestDefaultFlags, RequestRules};
use vgpu_cluster::resources::ShareResourceFlags;
use vgpu_node_contract::region::limits::granted::NodeLimits;
use vgpu_node_contract::region::limits::scaling::MemoryScaling;
use vgpu_node_contract::region::UtilizationPolicy;
use vgpu_node_contract::size::{parse_size, SizeError};

/// A `--core-policy` that names none.
#[derive(Debug, Error)]
#[error("'{0}' is not a policy: default, force or disable")]
pub struct PolicyError(String);

fn policy(text: &str) -> Result<UtilizationPolicy, PolicyError> {
    UtilizationPolicy::parse(text).ok_or_else(|| PolicyError(text.to_string()))
}

fn size(text: &str) -> Result<u64, SizeError> {
    parse_size(text)
}

/// vgpu node monitor: reads every container's vGPU region on this node,
/// serves Prometheus metrics (`GET /metrics`, `GET /healthz`) and
/// arbitrates compute shares between containers by priority.
#[derive(Clone, Debug, Parser)]
#[command(name = "vgpu-monitor", version)]
pub struct Options {
    /// Address and port to serve `/metrics` and `/healthz` on.
    #[arg(long, default_value = "0.0.0.0:31992", value_name = "ADDR:PORT")]
    pub listen: SocketAddr,

    /// Connections open at once on `--listen` (a host port any pod of the
    /// node can reach); one more is closed as soon as it is accepted.
    /// Each waits at most 10 s for its request, 120 s idle, and lives at
    /// most 300 s.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65536), value_name = "N")]
    pub max_connections: u32,

    /// Connections open at once from one address (at most
    /// `--max-connections`): Prometheus, kubelet's probes and `vgpu top`
    /// keep one or two each, so no pod can hold them all.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=65536), value_name = "N")]
    pub max_connections_per_client: u32,

    /// Host directory holding one directory per container, named
    /// `<podUID>_<container>` (the device plugin creates them).
    #[arg(long, default_value = "/usr/local/vgpu/containers", value_name = "DIR")]
    pub containers_dir: PathBuf,

    /// Name of the region file inside each container directory (the file
    /// the device plugin points CUDA_DEVICE_MEMORY_SHARED_CACHE at).
    #[arg(long, default_value = "region.cache", value_name = "NAME")]
    pub region_file: String,

    /// Most container directories tracked at once; more are ignored (logged).
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub max_containers: usize,

    /// NVML library to load for host GPU figures.
    #[arg(long, default_value = "libnvidia-ml.so.1", value_name = "PATH")]
    pub nvml_library: PathBuf,

    /// Do not load NVML (no host GPU figures; containers are still read and
    /// arbitrated, grouped by the GPU UUIDs in their regions).
    #[arg(long)]
    pub no_nvml: bool,

    /// Time between passes (rescan, read, arbitrate), in milliseconds.
    #[arg(long, default_value_t = 100, value_name = "MS")]
    pub interval_ms: u64,

    /// A container that launched work within this many milliseconds is
    /// active (it takes precedence by priority, and may borrow idle capacity).
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub active_window_ms: u64,

    /// Achieved utilization is averaged over this many milliseconds.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub utilization_window_ms: u64,

    /// Only observe: never write effective shares into regions.
    #[arg(long)]
    pub no_arbitration: bool,

    /// The compute policy the device plugin writes into containers (give
    /// both its `--core-policy` value): default, force or disable. A region
    /// whose limits or policy were changed from inside gets back what its
    /// pod's decision granted, with this policy.
    #[arg(long, default_value = "default", value_name = "POLICY", value_parser = policy)]
    pub core_policy: UtilizationPolicy,

    /// The host-memory swap the device plugin allows each GPU (give both
    /// its `--swap-limit` value), restored with the limits.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub swap_limit: Option<u64>,

    /// The device plugin's device memory scaling (give both its
    /// `--device-memory-scaling` value): above 1 a grant's cap is its
    /// device part and the rest is swap, as restored and as the memory
    /// over the cap is measured against.
    #[arg(long, value_name = "FACTOR", default_value_t = MemoryScaling::ONE,
          allow_negative_numbers = true)]
    pub device_memory_scaling: MemoryScaling,

    /// Never restore a region's limits (only report its memory over the cap).
    #[arg(long)]
    pub no_restore: bool,

    /// What is done when a container's processes hold more of a GPU than
    /// its grant, as the driver counts it (NVML), for three passes in a
    /// row, shim or not: `kill` the process that took it there (the one
    /// holding most beyond what the shim charged it), or only `report` it
    /// (log, metric and Warning Event either way). The same for compute:
    /// with `kill`, a container that takes more of a GPU's time than its
    /// share while another container uses the GPU has its GPU processes
    /// paused until it has paid the time back, and its busiest process
    /// killed when pausing is not enough; with `report`, it is only
    /// reported.
    #[arg(long, default_value = "kill", value_name = "ACTION")]
    pub over_cap_action: OverCapAction,

    /// What each process of a container may hold beyond the container's
    /// cap before the over-cap action is taken: what the driver counts
    /// that is no allocation the shim charges (a context's own memory).
    #[arg(long, default_value = "256Mi", value_name = "SIZE", value_parser = size)]
    pub over_cap_margin: u64,

    /// Percentage points of a GPU's time a container may take above its
    /// share (as the driver measures it) before it owes time: more than
    /// the shim's own limiter may be off by.
    #[arg(long, default_value_t = 5, value_name = "POINTS",
          value_parser = clap::value_parser!(u32).range(0..=100))]
    pub over_share_tolerance: u32,

    /// The extended resource the GPUs are advertised as (give the device
    /// plugin's `--resource-name`). With the flags below: how pods'
    /// requests are read, as the scheduler extender reads them; a decision
    /// is restored only as far as its pod asks for.
    #[arg(long, default_value = "nvidia.com/gpu", value_name = "NAME")]
    pub resource_name: String,

    #[command(flatten)]
    pub share_resources: ShareResourceFlags,

    #[command(flatten)]
    pub request_defaults: RequestDefaultFlags,

    /// Remove a container's region directory once its pod has been deleted
    /// for this many seconds (and none of its processes lives). Needs the
    /// Kubernetes API; nothing is removed while it is unavailable.
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    pub cleanup_grace_seconds: u64,

    /// Never remove region directories.
    #[arg(long)]
    pub no_cleanup: bool,

    /// This node's name: only its pods are watched.
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,

    /// Reach the API server through this kubeconfig file (default: the
    /// pod's service account when running in a cluster).
    #[arg(long, value_name = "PATH", conflicts_with = "apiserver_url")]
    pub kubeconfig: Option<PathBuf>,

    /// Reach the API server at this URL, without authentication (for
    /// `kubectl proxy` and tests).
    #[arg(long, value_name = "URL")]
    pub apiserver_url: Option<String>,

    /// Do not use the Kubernetes API (pods are named by their directory:
    /// pod label = pod UID; no cleanup of deleted pods).
    #[arg(long)]
    pub no_kubernetes: bool,

    /// Also emit HAMi's metric names (hami_host_gpu_memory_used_bytes,
    /// hami_vgpu_memory_used_bytes, ...) with HAMi's labels, for existing
    /// dashboards.
    #[arg(long)]
    pub hami_metric_names: bool,

    /// Log level: error, warn, info, debug or trace (logs go to stderr).
    #[arg(long, default_value = "info", value_name = "LEVEL")]
    pub log_level: tracing::Level,
}

impl Options {
    /// What `--listen` allows its connections.
    pub fn connection_limits(&self) -> vgpu_served::ConnectionLimits {
        let max = self.max_connections as usize;
        vgpu_served::ConnectionLimits {
            max_connections: max,
            max_connections_per_client: (self.max_connections_per_client as usize).min(max),
            ..vgpu_served::ConnectionLimits::default()
        }
    }

    /// The monitor's configuration.
    pub fn monitor_config(&self) -> MonitorConfig {
        MonitorConfig {
            discovery: DiscoveryConfig {
                root: self.containers_dir.clone(),
                region_file: self.region_file.clone(),
                max_containers: self.max_containers,
            },
            interval: Duration::from_millis(self.interval_ms.max(1)),
            active_window: Duration::from_millis(self.active_window_ms),
            utilization_window: Duration::from_millis(self.utilization_window_ms.max(1)),
            arbitration: !self.no_arbitration,
            cleanup_grace: (!self.no_cleanup)
                .then(|| Duration::from_secs(self.cleanup_grace_seconds)),
            hami_names: self.hami_metric_names,
            nvml: (!self.no_nvml).then(|| Some(self.nvml_library.clone())),
            node: NodeLimits {
                policy: self.core_policy,
                swap_limit: self.swap_limit.filter(|bytes| *bytes > 0),
                memory_scaling: self.device_memory_scaling,
            },
            restore: !self.no_restore,
            memory_rule: MemoryRule {
                margin_per_process: self.over_cap_margin,
                action: self.over_cap_action,
                ..MemoryRule::default()
            },
            compute_rule: ComputeRule {
                tolerance_percent: self.over_share_tolerance,
                action: self.over_cap_action,
                ..ComputeRule::default()
            },
        }
    }

    /// How pods' requests are read: the extender's names and defaults.
    pub fn request_rules(&self) -> RequestRules {
        RequestRules {
            names: self.share_resources.names(&self.resource_name),
            defaults: self.request_defaults.defaults(),
        }
    }

    /// Where the API is, if it is to be used at all.
    pub fn api_source(&self) -> Option<ApiSource> {
        if self.no_kubernetes {
            return None;
        }
        if let Some(url) = &self.apiserver_url {
            return Some(ApiSource::Url(url.clone()));
        }
        if let Some(path) = &self.kubeconfig {
            return Some(ApiSource::Kubeconfig(path.clone()));
        }
        std::env::var_os("KUBERNETES_SERVICE_HOST").map(|_| ApiSource::InCluster)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_deployment() {
        let options = Options::try_parse_from(["vgpu-monitor"]).expect("parse");
        assert_eq!(options.listen.port(), 31992);
        let config = options.monitor_config();
        assert_eq!(
            config.discovery.root,
            PathBuf::from("/usr/local/vgpu/containers")
        );
        assert_eq!(config.discovery.region_file, "region.cache");
        assert_eq!(config.interval, Duration::from_millis(100));
        assert_eq!(config.cleanup_grace, Some(Duration::from_secs(300)));
        assert!(config.arbitration);
        assert!(!config.hami_names);
        assert!(config.restore);
        assert_eq!(config.node, NodeLimits::default());
    }

    #[test]
    fn the_node_limits_are_the_plugins_flags() {
        let options = Options::try_parse_from([
            "vgpu-monitor",
            "--core-policy",
            "force",
            "--swap-limit",
            "1g",
            "--device-memory-scaling",
            "1.5",
            "--no-restore",
        ])
        .expect("parse");
        let config = options.monitor_config();
        assert!(!config.restore);
        assert_eq!(config.node.policy, UtilizationPolicy::Force);
        assert_eq!(config.node.swap_limit, Some(1 << 30));
        assert_eq!(config.node.memory_scaling.get(), 1.5);
        for bad in ["0", "-2", "NaN", "lots"] {
            let error = Options::try_parse_from(["vgpu-monitor", "--device-memory-scaling", bad])
                .expect_err(bad)
                .to_string();
            assert!(error.contains("device memory scaling"), "{bad}: {error}");
        }
        let error = Options::try_parse_from(["vgpu-monitor", "--core-policy", "strict"])
            .expect_err("no such policy")
            .to_string();
        assert!(
            error.contains("'strict' is not a policy: default, force or disable"),
            "{error}"
        );
    }

    #[test]
    fn flags_override() {
        let options = Options::try_parse_from([
            "vgpu-monitor",
            "--listen",
            "127.0.0.1:9000",
            "--no-cleanup",
            "--no-kubernetes",
            "--hami-metric-names",
            "--apiserver-url",
            "http://127.0.0.1:1",
        ])
        .expect("parse");
        assert_eq!(options.monitor_config().cleanup_grace, None);
        assert!(options.monitor_config().hami_names);
        assert_eq!(options.api_source(), None, "--no-kubernetes wins");
    }
}
