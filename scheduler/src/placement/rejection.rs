//! Why a node cannot take a pod, in the words kube-scheduler puts in the
//! pod's events.

use thiserror::Error;
use vgpu_cluster::decision::NODE_INVENTORY_ANNOTATION;
use vgpu_cluster::node_lease::NODE_LEASE_NAMESPACE;

/// Why a node cannot take a pod. No `%` in any: kube-scheduler uses an
/// extender's reasons as a format string.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum Rejection {
    #[error(
        "vgpu-scheduler does not know this node (it is not in its watch of the Kubernetes API)"
    )]
    UnknownNode,
    #[error("node has no vGPU inventory (annotation {NODE_INVENTORY_ANNOTATION}); is the vgpu device plugin running on it?")]
    NoInventory,
    #[error("node's vGPU inventory is unreadable: {0}")]
    UnreadableInventory(String),
    #[error(
        "the vgpu device plugin on this node holds no Lease ({NODE_LEASE_NAMESPACE}/{lease}): \
         it is not running, or may not write Leases"
    )]
    NoLease { lease: String },
    #[error(
        "the vgpu device plugin on this node last renewed its Lease {} s ago (it lasts {} s, \
         plus {grace_s} s grace): no new vGPU pods until it renews it",
        silent_ms / 1000,
        duration_ms / 1000
    )]
    LeaseExpired {
        silent_ms: u64,
        duration_ms: u64,
        grace_s: u64,
    },
    #[error(
        "kubelet reports no allocatable {resource} on this node now (its vgpu device plugin is disconnected, \
         restarting, or all its GPUs are unhealthy); kube-scheduler will retry"
    )]
    PluginDisconnected { resource: String },
    #[error("ElasticGPUClaim {claim} holds its GPU slice (ElasticGPU {elastic_gpu}) on node {node}; pods holding it run there")]
    SliceElsewhere {
        claim: String,
        elastic_gpu: String,
        node: String,
    },
    #[error("the pod's GPU selectors exclude {gpus}, where its claims' slices are held")]
    SlicesExcluded { gpus: String },
    /// The node's GPUs cannot hold the pod: which container, and why each
    /// GPU cannot take it ([`crate::placement::fit::gpu_check::explain`]).
    #[error("{explanation}")]
    NoRoom {
        explanation: String,
        /// Evicting pods would not help.
        permanent: bool,
    },
    /// The pod's namespace would pass a quota ([`QuotaExceeded`]).
    #[error(transparent)]
    NamespaceQuota(Box<QuotaExceeded>),
}

/// A namespace that a pod would take past a quota's limit on a vGPU
/// resource ([`crate::placement::quota`]).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error(
    "namespace {namespace}'s ResourceQuota {quota} allows requests.{resource} {limit} ({unit}): \
     its vGPU pods hold {held} and this pod would take {taken} {at}"
)]
pub struct QuotaExceeded {
    pub namespace: String,
    /// Where the pod's amount was counted.
    pub at: &'static str,
    /// The ResourceQuota's name.
    pub quota: String,
    pub resource: String,
    pub unit: &'static str,
    pub limit: u64,
    pub held: u64,
    pub taken: u64,
}

impl Rejection {
    /// Whether evicting pods could never make the node take the pod.
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::NoRoom { permanent, .. } => *permanent,
            // Ending (or preempting) a pod of the namespace makes room.
            Self::NamespaceQuota(_) => false,
            _ => true,
        }
    }
}
