//! What the parts on one node agree on. The shim links this crate into
//! every container process, so it stays small and serde-free.
//!
//! - [`size`]: byte sizes and percentages as the environment writes them.
//! - [`shim_env`]: the container environment the device plugin writes and the
//!   shim reads (HAMi-core compatible names), and its one conversion to the
//!   region's limits.
//! - [`region`]: the per-container shared-memory region file.
//! - [`figures`]: what a region holds, read as figures (monitor, `vgpu`).
//! - [`process`]: a process's PID as NVML and the host know it.
//! - [`claim_owner`]: who a DRA claim's region belongs to.

pub mod claim_owner;
pub mod figures;
pub mod process;
pub mod region;
pub mod shim_env;
pub mod size;
