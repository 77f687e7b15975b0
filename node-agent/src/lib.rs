//! `vgpu-node-agent`: what the node agents, `vgpu-device-plugin` and
//! `vgpu-dra`, have in common. Each gives workloads parts of this node's
//! GPUs through the shim; they differ only in how kubelet asks (a
//! container's `Allocate`, a claim's `NodePrepareResources`) and in how
//! the answer is written (kubelet mounts, a CDI spec).
//!
//! - [`allocation`]: a region's plan (the shim's environment, its mounts,
//!   the region's limits) from the GPUs granted, and the region created on
//!   the host;
//! - [`health`]: GPU health (NVML XID/ECC events and probes, or injected
//!   signals) and the recovery policy;
//! - [`inventory`]: the node's GPUs as inventory entries;
//! - [`flags`]: the command-line groups both agents take (containers,
//!   health, the API server);
//! - [`daemon`]: their logging, runtime and stop signal;
//! - [`driver_libraries`]: the names the NVIDIA driver's libraries are
//!   loaded by.
//!
//! Nothing here talks to kubelet or the API server: the agents do.

pub mod allocation;
pub mod daemon;
pub mod driver_libraries;
pub mod flags;
pub mod health;
pub mod inventory;
