//! What the extender knows about the cluster, rebuilt from the API alone.
//!
//! Nodes bring their GPU inventory (the plugin's `vgpu.io/node-gpus`
//! annotation), and the plugins' Leases whether they are alive
//! ([`leases`]). Pods bring the decisions the extender wrote
//! (`vgpu.io/decision`) and the containers the plugin has allocated
//! (`vgpu.io/allocated`). From those two the state derives, per node, what
//! every GPU carries and which vGPU pod, if any, is *pending* (decided, not
//! yet fully allocated). Nothing is stored anywhere else, so a restarted
//! extender that has listed pods and nodes again knows exactly what the one
//! before it knew.
//!
//! Versions: the extender applies the pods its own API writes return at
//! once (so a second bind on the same node sees the first pod pending
//! without waiting for the watch), and the watch later confirms them. Every
//! update carries the pod's `resourceVersion`; an update older than what is
//! already known, or older than the deletion of the pod, is ignored, so a
//! late watch event can never undo a newer write.
//!
//! - [`state`]: the cluster ([`state::ClusterState`]) and its lock.
//! - [`book`]: how each kind's watch events are taken.
//! - [`watch`]: the watches that feed the state.
//! - [`expiry`]: the task that ends unbound decisions' grace.
//! - [`pods`], [`nodes`], [`gpus`], [`leases`], [`reservations`],
//!   [`groups`], [`quotas`], [`skipped_namespaces`]: what the state
//!   records of each.
//! - [`clock`], [`fast_map`]: the clock and map everything uses.

pub mod book;
pub mod clock;
pub mod expiry;
pub mod fast_map;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod gpus;
pub mod groups;
pub mod leases;
pub mod nodes;
pub mod pods;
pub mod quotas;
pub mod reservations;
pub mod skipped_namespaces;
pub mod state;
pub mod watch;
