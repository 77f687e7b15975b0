//! `vgpu-monitor`, the node daemon of vgpu, as a library (the binary in
//! `main.rs` only parses options and wires these together).
//!
//! - [`discovery`]: finds container regions under the host directory and
//!   reads them (untrusted input: checked, bounded, clamped).
//! - [`guard`]: survives region files truncated while mapped (`SIGBUS`).
//! - [`names`]: pod names from the Kubernetes API (list + watch of the
//!   node's pods), falling back to directory names.
//! - [`arbitration`]: the effective-share rule, a pure function.
//! - [`cleanup`]: dead process slots and regions of deleted pods.
//! - [`metrics`]: the Prometheus exposition.
//! - [`host_proc`]: what the host's `/proc` says of a process;
//!   [`owners`]: which container a GPU process belongs to, from that.
//! - [`unenforced`]: GPU processes no container's shim accounts for.
//! - [`backstop`]: caps held from the driver's own accounting, whatever a
//!   container's processes loaded.
//! - [`events`]: Kubernetes Events on pods.
//! - [`daemon`]: the pass that ties them together, in stages: collect,
//!   assess each region ([`assess`], remembering each container device in
//!   [`activity`] and each anomaly reported in [`reported`]), act, publish
//!   ([`shared`], served by [`server`] over HTTP).
//! - [`config`]: what the monitor does; [`options`]: command-line flags.

pub mod activity;
pub mod arbitration;
pub mod assess;
pub mod backstop;
pub mod cleanup;
pub mod config;
pub mod daemon;
pub mod discovery;
pub mod events;
pub mod guard;
pub mod host_proc;
pub mod metrics;
pub mod names;
pub mod options;
pub mod owners;
pub mod reported;
pub mod server;
pub mod shared;
pub mod unenforced;
