//! Caps held from outside the container: from the driver's own accounting
//! (NVML's per-process memory and device time), whatever a container's processes loaded or
//! wrote. The shim refuses an allocation before the driver is asked; a
//! process that never goes through the shim (it unset nothing the node
//! set, but it found the driver's entry points itself, or runs without the
//! preload, or forged its region) is held here instead, after the fact:
//!
//! - [`memory`]: a container whose processes hold more of a GPU's memory
//!   than its grant (plus a margin for what a context holds outside any
//!   allocation), for [`MemoryRule::samples`] samples in a row, has the
//!   process that took it there killed (or, with
//!   [`OverCapAction::Report`], reported).
//! - [`compute`]: a container whose processes take more of a GPU's time
//!   than its share while another container waits for it has them paused
//!   and resumed in a duty cycle until it has paid for what it took
//!   (killed, or reported, when pausing is not enough).
//! - [`groups`]: a GPU's processes summed by owner, with its grant there.
//! - [`signal`]: signals a host process only while it is still the one
//!   judged (a PID reused in between is never signalled).

pub mod compute;
pub mod groups;
pub mod memory;
pub mod signal;

pub use compute::{ComputeBackstop, ComputeRule, ComputeVerdict, OwnerTime};
pub use memory::{Breach, MemoryBackstop, MemoryRule, OverCapAction};
