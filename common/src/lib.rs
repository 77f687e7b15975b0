//! Formats that more than one vgpu part depends on.
//!
//! - [`quantity`]: byte sizes and percentages as users write them.
//! - [`config`]: the container environment the device plugin writes and the
//!   shim reads (HAMi-core compatible names).
//! - [`decision`]: the node inventory and per-pod decisions the scheduler
//!   extender and the device plugin exchange through annotations, and the
//!   protocol that matches kubelet's `Allocate` calls to pods.
//! - [`region`]: the per-container shared-memory region file.

pub mod config;
pub mod decision;
pub mod quantity;
pub mod region;
pub mod resources;
