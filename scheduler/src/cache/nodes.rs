//! The nodes as the watch shows them: their GPU inventory, what their
//! GPUs carry, and what kubelet reports allocatable.

use crate::cache::gpus::{NodeGpus, Usage};

/// What is known of a node's inventory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Inventory {
    /// The node has no `vgpu.io/node-gpus` annotation (or is not known).
    Missing,
    /// The annotation could not be read.
    Invalid(String),
    Valid,
}

/// One node.
#[derive(Debug)]
pub struct NodeEntry {
    pub in_api: bool,
    pub inventory: Inventory,
    /// Its plugin tells pending pods apart, so binds need not wait for the
    /// previous pod's admission ([`vgpu_cluster::decision::NodeInventory::several_pending`]).
    pub several_pending: bool,
    pub gpus: NodeGpus,
    /// What each GPU carries (same order as `gpus`).
    pub usage: Vec<Usage>,
    /// Decided GPUs that the inventory does not list (gone, or not yet
    /// published).
    pub unlisted: Vec<(String, Usage)>,
    /// UIDs of the pods whose GPUs are counted here.
    pub pods: Vec<String>,
    /// Names of the ElasticGPUs whose slices lie here.
    pub reservations: Vec<String>,
    /// The node's allocatable extended resources (`<domain>/<name>`), as
    /// kubelet last reported them: a device plugin's count drops to zero
    /// while kubelet has it disconnected.
    pub extended_allocatable: Vec<(String, u64)>,
}

impl NodeEntry {
    pub(crate) fn new() -> Self {
        Self {
            in_api: false,
            inventory: Inventory::Missing,
            several_pending: false,
            gpus: NodeGpus::default(),
            usage: Vec::new(),
            unlisted: Vec::new(),
            pods: Vec::new(),
            reservations: Vec::new(),
            extended_allocatable: Vec::new(),
        }
    }

    /// Whether kubelet reports `resource` with nothing allocatable (its
    /// device plugin disconnected, or every device unhealthy). A node that
    /// does not report it at all is not judged here.
    pub fn offers_none_of(&self, resource: &str) -> bool {
        self.extended_allocatable
            .iter()
            .any(|(name, amount)| name == resource && *amount == 0)
    }
}
