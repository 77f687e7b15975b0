//! How the extender decides and serves, as its flags set it.

use crate::admission::mutate::AdmissionPolicy;
use crate::placement::rules::{Rules, DEFAULT_NODE_LEASE_GRACE, DEFAULT_UNBOUND_GRACE};
use std::time::Duration;
use vgpu_cluster::policy::{GpuPolicy, NodePolicy};
use vgpu_cluster::requests::{RequestDefaults, ResourceNames};

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
    /// What the servers take from each client.
    pub limits: Limits,
    /// Whether a bind may use the pod its filter call sent instead of
    /// reading it ([`crate::extender::filtered_pods`]): only where no one
    /// but kube-scheduler calls filter. A caller that reaches the verbs
    /// unauthenticated (`--address 0.0.0.0`) could otherwise send a forged
    /// pod under a real pod's UID and version, and the bind would decide
    /// from its requests rather than the pod's.
    pub keep_filtered_pods: bool,
    /// Placement's own check of vGPU containers' confinement, for pods
    /// that never went through admission
    /// ([`crate::admission::confinement`]); `None`: admission's alone.
    pub placement_confinement: Option<PlacementConfinement>,
}

/// Placement refuses pods whose vGPU containers are privileged, run
/// seccomp `Unconfined` or name no profile, except in the namespaces
/// admission skips.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlacementConfinement {
    /// Skipped whatever their labels (the chart's
    /// `scheduler.webhook.ignoreNamespaces`); those labelled
    /// `vgpu.io/webhook=ignore` are watched.
    pub skipped_namespaces: Vec<String>,
}

/// The largest body of filter, prioritize, preempt and the webhooks by
/// default: what a 5,000-node cluster needs with `nodeCacheCapable`
/// (which the chart sets). A filter or prioritize call carries the pod
/// (at most 3 MiB: the API server takes no larger JSON body, and stores
/// at most 1.5 MiB) and the candidates' names (5,000 of at most 253
/// characters, quoted and separated: 1.22 MiB): 4.22 MiB. A preempt call
/// carries the pod and, for each of kube-scheduler's candidate nodes (10 %
/// of 5,000 by default: 500), its name and the UIDs of up to 110 pods
/// (`{"UID":"<36>"},`, 46 bytes): 500 × (256 + 40 + 110 × 46) = 2.56 MiB,
/// 5.56 MiB with the pod. An admission review carries one pod (3 MiB).
/// 8 MiB covers them all. Without `nodeCacheCapable`, kube-scheduler sends
/// whole Node objects (5 to 20 kB each): raise it (`--max-request-bytes`).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;

/// What the servers take from each client: time, bytes, connections and
/// watches, so that no client, slow or large, takes the extender's memory
/// or keeps kube-scheduler's calls from being answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The largest request body of filter, prioritize, preempt and the
    /// webhooks (a bind's is a few hundred bytes: at most 64 KiB).
    pub max_body_bytes: usize,
    /// How long a new connection may send nothing, and how long a
    /// request's headers may take from their first byte.
    pub header_timeout: Duration,
    /// How long a kept-alive connection may stay idle between requests:
    /// longer than its clients keep an idle one (Go's 90 s), so that the
    /// client, not the server, closes it and no request meets a connection
    /// closing under it.
    pub idle_timeout: Duration,
    /// How long a request's body may take to arrive in full.
    pub body_timeout: Duration,
    /// How long an answer (a watch's events too) may wait for its client
    /// to read on: a client that reads nothing for longer is cut off.
    pub write_timeout: Duration,
    /// Connections open at once on each listener; one more is closed as
    /// soon as it is accepted.
    pub max_connections: usize,
    /// Connections open at once on each listener from one client address,
    /// so that no one client (a pod that reaches the webhook port) holds
    /// them all while the API server's or kube-scheduler's calls wait.
    pub max_connections_per_client: usize,
    /// Watches of nvidia-gpu-scheduler's views open at once; one more is
    /// answered 429.
    pub max_watches: usize,
    /// How long a connection is kept: then its next answer tells the
    /// client to close it (an idle one is left to its idle allowance), so
    /// a client that keeps sending requests does not hold its connection
    /// (and its place under `max_connections_per_client`) for ever.
    pub max_connection_age: Duration,
}

impl Limits {
    /// What each listener allows its connections.
    pub fn connections(&self) -> vgpu_served::ConnectionLimits {
        vgpu_served::ConnectionLimits {
            header_timeout: self.header_timeout,
            idle_timeout: self.idle_timeout,
            write_timeout: self.write_timeout,
            max_connections: self.max_connections,
            max_connections_per_client: self.max_connections_per_client,
            max_connection_age: self.max_connection_age,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        let connections = vgpu_served::ConnectionLimits::default();
        Self {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            header_timeout: connections.header_timeout,
            idle_timeout: connections.idle_timeout,
            body_timeout: Duration::from_secs(10),
            write_timeout: connections.write_timeout,
            max_connections: connections.max_connections,
            max_connections_per_client: connections.max_connections_per_client,
            max_watches: 64,
            max_connection_age: connections.max_connection_age,
        }
    }
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
            limits: Limits::default(),
            keep_filtered_pods: true,
            placement_confinement: None,
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
            high_priority_classes: self.admission.high_priority_classes.clone(),
        }
    }
}
