//! How the extender decides and serves, as its flags set it.

use crate::admission::mutate::AdmissionPolicy;
use crate::placement::rules::{Rules, DEFAULT_NODE_LEASE_GRACE, DEFAULT_UNBOUND_GRACE};
use crate::requests::{RequestDefaults, ResourceNames};
use crate::vocabulary::policy::{GpuPolicy, NodePolicy};
use std::time::Duration;

/// The scheduler name vGPU pods use unless configured otherwise.
pub const DEFAULT_SCHEDULER_NAME: &str = "vgpu-scheduler";

/// How the extender decides.
#[derive(Clone, Debug)]
pub struct Config {
    pub resources: ResourceNames,
    pub defaults: RequestDefaults,
    pub gpu_policy: GpuPolicy,
    pub node_policy: NodePolicy,
    /// How long a bind waits for the node's pending pod (kube-scheduler
    /// gives an extender call 5 s by default).
    pub bind_wait: Duration,
    /// How long a decision whose pod is not bound yet keeps its node busy.
    pub unbound_grace: Duration,
    /// The `schedulerName` the admission webhook gives vGPU pods.
    pub scheduler_name: String,
    /// What else the admission webhook allows.
    pub admission: AdmissionPolicy,
    /// How long past its duration a node Lease may go unrenewed before
    /// the node gets no new pods ([`crate::cache::leases`]).
    pub node_lease_grace: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            resources: ResourceNames::default(),
            defaults: RequestDefaults::default(),
            gpu_policy: GpuPolicy::default(),
            node_policy: NodePolicy::default(),
            bind_wait: Duration::from_millis(3000),
            unbound_grace: DEFAULT_UNBOUND_GRACE,
            scheduler_name: DEFAULT_SCHEDULER_NAME.into(),
            admission: AdmissionPolicy::default(),
            node_lease_grace: DEFAULT_NODE_LEASE_GRACE,
        }
    }
}

impl Config {
    /// The rules placement follows under this configuration.
    pub fn rules(&self) -> Rules {
        Rules {
            resources: self.resources.clone(),
            defaults: self.defaults,
            gpu_policy: self.gpu_policy,
            node_policy: self.node_policy,
            node_lease_grace: self.node_lease_grace,
            unbound_grace: self.unbound_grace,
        }
    }
}
