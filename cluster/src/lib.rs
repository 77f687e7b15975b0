//! What the control-plane parts (scheduler extender, device plugin, node
//! monitor) agree on.
//!
//! - [`client`]: how a daemon reaches the API server.
//! - [`resources`]: the extended resources and pod annotations vgpu reads,
//!   and Kubernetes quantities.
//! - [`cordon`]: the node annotation that takes single GPUs out of service.
//! - [`requests`]: what a pod asks for, read from its spec and
//!   annotations, and whether a decision stays within it; [`policy`]: the
//!   placement policies a pod may name.
//! - [`decision`]: the node inventory and per-pod decisions the extender and
//!   the device plugin exchange through annotations, and the protocol that
//!   matches kubelet's `Allocate` calls to pods; [`resize`]: a running
//!   pod's request for a new share or cap, and the extender's answer.
//! - [`node_lease`]: the Lease per node by which the device plugin shows
//!   it is alive.
//! - [`report`]: errors written as one message for Kubernetes components;
//!   [`events`]: the Event they record on a pod.
//! - [`file_error`]: an I/O failure told by its file and operation.

pub mod client;
pub mod cordon;
pub mod decision;
pub mod events;
pub mod file_error;
pub mod node_lease;
pub mod policy;
pub mod report;
pub mod requests;
pub mod resize;
pub mod resources;
