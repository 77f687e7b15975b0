//! The command-line groups both node agents take: what every container
//! gets and where ([`ContainerFlags`]), when a GPU counts as unhealthy
//! ([`HealthFlags`]), and how the API server is reached ([`ApiFlags`]).

use crate::allocation::Settings;
use crate::health::DEFAULT_IGNORED_XIDS;
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;
use vgpu_cluster::client::ApiSource;
use vgpu_node_contract::region::limits::scaling::MemoryScaling;
use vgpu_node_contract::region::UtilizationPolicy;
use vgpu_node_contract::size::{parse_size, SizeError};

/// `GPU_CORE_UTILIZATION_POLICY` written into containers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Policy {
    /// The share the node monitor grants (the configured share without one).
    Default,
    /// The configured share is a hard cap, whatever the monitor says.
    Force,
    /// No compute cap.
    Disable,
}

impl From<Policy> for UtilizationPolicy {
    fn from(policy: Policy) -> Self {
        match policy {
            Policy::Default => UtilizationPolicy::Default,
            Policy::Force => UtilizationPolicy::Force,
            Policy::Disable => UtilizationPolicy::Disable,
        }
    }
}

fn size(text: &str) -> Result<u64, SizeError> {
    parse_size(text)
}

/// What every container gets, and where: the shim, its `ld.so.preload`,
/// the containers' region directories, and the node-wide settings of the
/// shim (shared by the device plugin and the DRA driver).
#[derive(Clone, Debug, Args)]
pub struct ContainerFlags {
    /// The shim (libvgpu.so) on the host; mounted read-only into containers.
    #[arg(
        long,
        default_value = "/usr/local/vgpu/libvgpu.so",
        value_name = "PATH"
    )]
    pub library: PathBuf,

    /// Where containers see the shim (the path written into ld.so.preload).
    #[arg(
        long,
        default_value = "/usr/local/vgpu/libvgpu.so",
        value_name = "PATH"
    )]
    pub container_library: PathBuf,

    /// The ld.so.preload file the plugin writes on the host (one line: the
    /// shim's path in containers); mounted read-only as /etc/ld.so.preload.
    #[arg(
        long,
        default_value = "/usr/local/vgpu/ld.so.preload",
        value_name = "PATH"
    )]
    pub preload_file: PathBuf,

    /// Do not mount an ld.so.preload (the shim is then loaded only by
    /// images that set LD_PRELOAD themselves).
    #[arg(long)]
    pub no_preload: bool,

    /// Host directory holding one directory per container,
    /// `<podUID>_<container>`, with its region file (read by vgpu-monitor).
    #[arg(long, default_value = "/usr/local/vgpu/containers", value_name = "DIR")]
    pub containers_dir: PathBuf,

    /// Where a container sees its own directory.
    #[arg(long, default_value = "/usr/local/vgpu/container", value_name = "DIR")]
    pub container_dir: PathBuf,

    /// Name of the region file in a container directory
    /// (CUDA_DEVICE_MEMORY_SHARED_CACHE points at it).
    #[arg(long, default_value = "region.cache", value_name = "NAME")]
    pub region_file: String,

    /// GPU_CORE_UTILIZATION_POLICY for every container.
    #[arg(long, value_enum, default_value_t = Policy::Default)]
    pub core_policy: Policy,

    /// Host memory each GPU may lend a container as swap beyond its grant
    /// (sets CUDA_OVERSUBSCRIBE=true and VGPU_SWAP_LIMIT). Sizes take
    /// k/m/g/t suffixes (binary). With --device-memory-scaling above 1 it
    /// is added to the swap part of each grant.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub swap_limit: Option<u64>,

    /// HAMi's deviceMemoryScaling: each GPU offers its memory times this
    /// factor (a number above 0; 1: no scaling). Above 1 the GPU is
    /// oversubscribed: a container granted G bytes gets G / FACTOR of
    /// device memory as its cap and the rest as host-memory swap
    /// (CUDA_OVERSUBSCRIBE=true, VGPU_SWAP_LIMIT). Memory percentages are
    /// of the offered memory. Give the monitor the same value.
    #[arg(long, value_name = "FACTOR", default_value_t = MemoryScaling::ONE,
          allow_negative_numbers = true)]
    pub device_memory_scaling: MemoryScaling,

    /// VGPU_CONTEXT_RESERVE for every container: device memory charged per
    /// CUDA context. Unset, the shim measures what each context holds
    /// (at least 256 MiB); set, exactly this is charged.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub context_reserve: Option<u64>,
}

impl ContainerFlags {
    pub fn settings(&self) -> Settings {
        Settings {
            containers_dir: self.containers_dir.clone(),
            region_file: self.region_file.clone(),
            container_dir: self.container_dir.clone(),
            library_host: self.library.clone(),
            library_container: self.container_library.clone(),
            preload_host: (!self.no_preload).then(|| self.preload_file.clone()),
            policy: self.core_policy.into(),
            swap_limit: self.swap_limit.filter(|bytes| *bytes > 0),
            memory_scaling: self.device_memory_scaling,
            context_reserve: self.context_reserve,
        }
    }
}

/// When a GPU counts as unhealthy, and as recovered.
#[derive(Clone, Debug, Args)]
pub struct HealthFlags {
    /// XIDs that do not make a GPU unhealthy (application errors), comma
    /// separated.
    #[arg(long, value_delimiter = ',', value_name = "LIST",
          default_values_t = DEFAULT_IGNORED_XIDS)]
    pub ignored_xids: Vec<u64>,

    /// An unhealthy GPU that answered every probe for this many seconds
    /// with no new fault is healthy again; 0: never (until the plugin
    /// restarts).
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    pub health_recovery_seconds: u64,

    /// Milliseconds between health probes of every GPU.
    #[arg(long, default_value_t = 5000, value_name = "MS")]
    pub health_probe_ms: u64,
}

impl HealthFlags {
    pub fn recovery(&self) -> Option<Duration> {
        (self.health_recovery_seconds > 0)
            .then(|| Duration::from_secs(self.health_recovery_seconds))
    }
}

/// How the API server is reached.
#[derive(Clone, Debug, Args)]
pub struct ApiFlags {
    /// Reach the API server through this kubeconfig file (default: the
    /// pod's service account).
    #[arg(long, value_name = "PATH", conflicts_with = "apiserver_url")]
    pub kubeconfig: Option<PathBuf>,

    /// Reach the API server at this URL, without authentication (for
    /// `kubectl proxy` and tests).
    #[arg(long, value_name = "URL")]
    pub apiserver_url: Option<String>,
}

impl ApiFlags {
    pub fn source(&self) -> ApiSource {
        match (&self.apiserver_url, &self.kubeconfig) {
            (Some(url), _) => ApiSource::Url(url.clone()),
            (None, Some(path)) => ApiSource::Kubeconfig(path.clone()),
            (None, None) => ApiSource::InCluster,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    /// The three groups as an agent takes them.
    #[derive(Debug, Parser)]
    struct Agent {
        #[command(flatten)]
        container: ContainerFlags,
        #[command(flatten)]
        health: HealthFlags,
        #[command(flatten)]
        api: ApiFlags,
    }

    fn parse(args: &[&str]) -> Result<Agent, clap::Error> {
        Agent::try_parse_from(std::iter::once("agent").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_give_the_charts_layout() {
        Agent::command().debug_assert();
        let agent = parse(&[]).expect("parse");
        let settings = agent.container.settings();
        assert_eq!(
            settings.containers_dir,
            PathBuf::from("/usr/local/vgpu/containers")
        );
        assert_eq!(
            settings.preload_host,
            Some(PathBuf::from("/usr/local/vgpu/ld.so.preload"))
        );
        assert_eq!(settings.policy, UtilizationPolicy::Default);
        assert_eq!(settings.swap_limit, None);
        assert_eq!(settings.memory_scaling, MemoryScaling::ONE);
        assert_eq!(settings.context_reserve, None);
        assert_eq!(agent.health.ignored_xids, DEFAULT_IGNORED_XIDS);
        assert_eq!(agent.health.recovery(), Some(Duration::from_secs(300)));
        assert_eq!(agent.api.source(), ApiSource::InCluster);
    }

    #[test]
    fn flags_reach_the_settings() {
        let agent = parse(&[
            "--no-preload",
            "--swap-limit",
            "8Gi",
            "--context-reserve",
            "128m",
            "--core-policy",
            "force",
            "--health-recovery-seconds",
            "0",
            "--kubeconfig",
            "/k",
        ])
        .expect("parse");
        let settings = agent.container.settings();
        assert_eq!(settings.preload_host, None);
        assert_eq!(settings.swap_limit, Some(8 << 30));
        assert_eq!(settings.context_reserve, Some(128 << 20));
        assert_eq!(settings.policy, UtilizationPolicy::Force);
        assert_eq!(agent.health.recovery(), None, "0: never");
        assert_eq!(
            agent.api.source(),
            ApiSource::Kubeconfig(PathBuf::from("/k"))
        );
        // No swap is no swap, not a swap of 0 bytes.
        let none = parse(&["--swap-limit", "0"]).expect("parse");
        assert_eq!(none.container.settings().swap_limit, None);
        // A URL wins over the service account; with a kubeconfig it is refused.
        let url = parse(&["--apiserver-url", "http://127.0.0.1:1"]).expect("parse");
        assert!(matches!(url.api.source(), ApiSource::Url(_)));
        assert!(parse(&["--apiserver-url", "http://x", "--kubeconfig", "/k"]).is_err());
        assert!(parse(&["--swap-limit", "1.5g"]).is_err());
    }
}
