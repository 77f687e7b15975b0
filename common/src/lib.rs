//! Formats that more than one vgpu part depends on.
//!
//! - [`quantity`]: byte sizes and percentages as users write them.
//! - [`config`]: the container environment the device plugin writes and the
//!   shim reads (HAMi-core compatible names).
//! - [`region`]: the per-container shared-memory region file.

pub mod config;
pub mod quantity;
pub mod region;
