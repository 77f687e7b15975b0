//! Publishing the node's GPUs as the node annotation
//! [`vgpu_cluster::decision::NODE_INVENTORY_ANNOTATION`]: at start, on every
//! health change, and as a heartbeat, so the scheduler extender can tell a
//! live plugin from a dead one.

use crate::cluster::Cluster;
use crate::service::stopped;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;
use vgpu_cluster::decision::{InventoryGpu, NodeInventory, FORMAT_VERSION};
use vgpu_nvml_host::GpuFacts;

/// Longest wait before retrying a failed write.
const RETRY: Duration = Duration::from_secs(5);

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The inventory entries for the GPUs NVML describes, each shared by at
/// most `split_count` containers, all healthy to start with.
pub fn inventory_gpus(facts: Vec<GpuFacts>, split_count: u32) -> Vec<InventoryGpu> {
    facts
        .into_iter()
        .map(|gpu| InventoryGpu {
            uuid: gpu.uuid,
            index: gpu.index,
            model: gpu.model,
            memory_bytes: gpu.memory_bytes,
            sm_count: gpu.sm_count,
            split_count,
            numa: gpu.numa,
            healthy: true,
        })
        .collect()
}

/// The inventory for `gpus`, stamped now.
pub fn inventory(gpus: &[InventoryGpu]) -> NodeInventory {
    NodeInventory {
        version: FORMAT_VERSION,
        heartbeat_unix_ms: now_unix_ms(),
        gpus: gpus.to_vec(),
    }
}

/// Writes the inventory until `shutdown` becomes true.
pub async fn publish(
    cluster: Cluster,
    mut gpus: watch::Receiver<Vec<InventoryGpu>>,
    heartbeat: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut failing = false;
    loop {
        let current = inventory(&gpus.borrow_and_update());
        let wait = match cluster.publish_inventory(&current).await {
            Ok(()) => {
                if failing {
                    tracing::info!("node inventory published again");
                }
                failing = false;
                tracing::debug!("node inventory published ({} GPUs)", current.gpus.len());
                heartbeat
            }
            Err(error) => {
                if !failing {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "publishing the node inventory (retrying)"
                    );
                }
                failing = true;
                heartbeat.min(RETRY)
            }
        };
        tokio::select! {
            () = stopped(&mut shutdown) => return,
            changed = gpus.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(wait) => {}
        }
    }
}
