//! The per-container region file.
//!
//! Every process of a container maps the same file (its path comes from
//! `CUDA_DEVICE_MEMORY_SHARED_CACHE`), and so does the node monitor. It holds
//! the container's limits per device, the container's memory use per device,
//! and one slot per process with that process's share of the use.
//!
//! # Invariants and how they are kept
//!
//! - **The cap holds across processes.** A reservation checks and raises the
//!   device total under one process-shared *robust* mutex, before the real
//!   allocation is made; so the sum of all processes' memory never exceeds
//!   the cap, however many allocate at once.
//! - **Nothing is lost when a process dies.** A slot is owned by the process
//!   holding an open-file-description lock (`F_OFD_SETLK`) on one byte of the
//!   file (at [`LIVENESS_LOCK_BASE`] + slot index). The kernel drops that lock
//!   when the process dies, whatever its PID namespace, so any other process
//!   (or the monitor on the host) that can take the lock knows the owner is
//!   gone and returns the slot's memory. PID reuse cannot fool this.
//! - **No lock outlives its holder.** If a process dies inside the mutex, the
//!   next locker gets `EOWNERDEAD`, recomputes every total from the slots
//!   (the slots are the source of truth), and carries on.
//! - **Every field is an atomic** (or the mutex), so other processes writing
//!   the mapping concurrently never cause a data race in this one, and a
//!   corrupt value can only produce a wrong number, never undefined behaviour.
//!
//! - **The limits hold whatever the container writes.** In a container a
//!   node set up, the limits enforced are the node's grant
//!   ([`grant_file`]), a file the container can only read; the region's
//!   own copy of them only tells the container what it was granted.
//!
//! The format is [`layout`]; opening and mapping a file, [`file`]; the
//! locks, [`lock`]; process slots, [`slots`]; charges against the caps,
//! [`charge`]; the limits and the one conversion from a grant to them,
//! [`limits`]; the node's grant, [`grant_file`]; the node's repair of a
//! region its container damaged, [`repair`].
//!
//! The layout is fixed-size; the header carries magic, version and size
//! so a foreign, truncated or older file is refused with a clear error rather
//! than reinterpreted.

mod charge;
mod clock;
mod file;
pub mod grant_file;
pub mod layout;
pub mod limits;
mod limits_in_force;
mod lock;
mod repair;
mod slots;
#[cfg(test)]
mod tests;

pub use charge::{lower_cap, CapExceeded};
pub use clock::{clock_ns, monotonic_ns};
pub use file::{Region, RegionError};
pub use grant_file::{Grant, GrantError, GrantSettings};
pub use layout::*;
pub use limits::{BelowUse, RegionLimits, UtilizationPolicy, DEFAULT_PRIORITY};
pub use repair::{FileExtent, Repaired, REGION_DISK_ALLOWANCE};
