//! What the monitor does, as the binary's options or a test set it.

use crate::backstop::{ComputeRule, MemoryRule};
use crate::discovery::DiscoveryConfig;
use std::path::PathBuf;
use std::time::Duration;
use vgpu_node_contract::region::limits::granted::NodeLimits;

/// What the monitor does, independent of how it was configured.
#[derive(Clone, Debug)]
pub struct MonitorConfig {
    pub discovery: DiscoveryConfig,
    /// Time between passes.
    pub interval: Duration,
    /// A container launched work within this long ago is active.
    pub active_window: Duration,
    /// Achieved utilization is measured over this long.
    pub utilization_window: Duration,
    /// Write effective shares (otherwise only observe).
    pub arbitration: bool,
    /// Remove regions of deleted pods after this long; `None`: never.
    pub cleanup_grace: Option<Duration>,
    /// Also emit HAMi's metric names.
    pub hami_names: bool,
    /// Load NVML (from this path, or the default name when `None`).
    pub nvml: Option<Option<PathBuf>>,
    /// What the node adds to the limits a decision grants (the device
    /// plugin's policy, swap and memory scaling): what a grant comes to in
    /// a region.
    pub node: NodeLimits,
    /// Restore the limits a region's decision granted when they were
    /// changed from inside.
    pub restore: bool,
    /// When a container's processes hold more of a GPU than it was
    /// granted, as NVML counts it, and what is done.
    pub memory_rule: MemoryRule,
    /// When a container's processes take more of a GPU's time than its
    /// share, as NVML measures it, and what is done.
    pub compute_rule: ComputeRule,
}

impl MonitorConfig {
    /// Defaults for a region directory (tests, the bench).
    pub fn for_root(root: PathBuf) -> Self {
        Self {
            discovery: DiscoveryConfig {
                root,
                region_file: "region.cache".into(),
                max_containers: 1024,
            },
            interval: Duration::from_millis(100),
            active_window: Duration::from_secs(1),
            utilization_window: Duration::from_secs(1),
            arbitration: true,
            cleanup_grace: Some(Duration::from_secs(300)),
            hami_names: false,
            nvml: None,
            node: NodeLimits::default(),
            restore: true,
            memory_rule: MemoryRule::default(),
            compute_rule: ComputeRule::default(),
        }
    }
}
