//! The state as `GET /debug/state` shows it.

use super::ClusterState;
use crate::cache::gpus::Usage;
use crate::cache::leases::Liveness;
use crate::cache::nodes::Inventory;
use crate::cache::pods::PodRecord;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

impl ClusterState {
    /// A view for the debug endpoint and tests.
    pub fn debug_state(
        &self,
        now_unix_ms: u64,
        unbound_grace: Duration,
        lease_grace: Duration,
    ) -> DebugState {
        let mut nodes = BTreeMap::new();
        for (name, entry) in &self.nodes {
            let gpus = entry
                .gpus
                .gpus
                .iter()
                .zip(&entry.usage)
                .zip(&entry.gpus.hot)
                .map(|((gpu, usage), hot)| GpuState {
                    uuid: gpu.uuid.clone(),
                    model: gpu.model.clone(),
                    memory_bytes: gpu.memory_bytes,
                    offered_memory_bytes: gpu.offered_bytes(),
                    split_count: gpu.split_count,
                    healthy: gpu.healthy,
                    cordoned: hot.cordoned,
                    usage: *usage,
                })
                .collect();
            let mut pods: Vec<String> = entry
                .pods
                .iter()
                .filter_map(|uid| self.pods.get(uid))
                .map(PodRecord::key)
                .collect();
            pods.sort();
            let mut pending: Vec<String> = self
                .pending_on(name, now_unix_ms, unbound_grace, "")
                .into_iter()
                .map(PodRecord::key)
                .collect();
            pending.sort();
            let mut reservations: Vec<String> = entry
                .reservations
                .iter()
                .filter_map(|name| self.reservations.get(name))
                .map(|r| format!("{} ({})", r.elastic_gpu, r.claim))
                .collect();
            reservations.sort();
            nodes.insert(
                name.clone(),
                NodeState {
                    in_api: entry.in_api,
                    inventory: match &entry.inventory {
                        Inventory::Missing => "missing".to_string(),
                        Inventory::Invalid(error) => format!("invalid: {error}"),
                        Inventory::Valid => "valid".to_string(),
                    },
                    lease: match self.liveness(name, now_unix_ms, lease_grace) {
                        Liveness::Missing => "missing".to_string(),
                        Liveness::Live { silent_ms } => {
                            format!("live (renewed {} s ago)", silent_ms / 1000)
                        }
                        Liveness::Expired { silent_ms, .. } => {
                            format!("expired (renewed {} s ago)", silent_ms / 1000)
                        }
                    },
                    gpus,
                    unlisted_gpus: entry.unlisted.clone().into_iter().collect(),
                    pods,
                    pending,
                    reservations,
                },
            );
        }
        DebugState {
            synced: self.synced(),
            pods: self.pods.len(),
            nodes,
        }
    }
}

/// The state as JSON (`GET /debug/state`).
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DebugState {
    pub synced: bool,
    pub pods: usize,
    pub nodes: BTreeMap<String, NodeState>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeState {
    pub in_api: bool,
    pub inventory: String,
    /// The device plugin's node Lease: missing, live or expired.
    pub lease: String,
    pub gpus: Vec<GpuState>,
    pub unlisted_gpus: Vec<(String, Usage)>,
    pub pods: Vec<String>,
    pub pending: Vec<String>,
    /// Slices held here for Elastic GPU claims: `ElasticGPU (namespace/claim)`.
    pub reservations: Vec<String>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GpuState {
    pub uuid: String,
    pub model: String,
    /// Physical memory.
    pub memory_bytes: u64,
    /// What grants count against (`usage.memoryBytes` is out of this).
    pub offered_memory_bytes: u64,
    pub split_count: u32,
    pub healthy: bool,
    /// Taken out of service by the node's annotation.
    pub cordoned: bool,
    pub usage: Usage,
}
