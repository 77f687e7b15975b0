//! Publishing the node's GPUs as the node annotation
//! [`vgpu_common::decision::NODE_INVENTORY_ANNOTATION`]: at start, on every
//! health change, and as a heartbeat, so the scheduler extender can tell a
//! live plugin from a dead one.

use crate::cluster::Cluster;
use crate::service::stopped;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;
use vgpu_common::decision::{GpuInfo, NodeInventory, FORMAT_VERSION};

/// Longest wait before retrying a failed write.
const RETRY: Duration = Duration::from_secs(5);

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The inventory for `gpus`, stamped now.
pub fn inventory(gpus: &[GpuInfo]) -> NodeInventory {
    NodeInventory {
        version: FORMAT_VERSION,
        heartbeat_unix_ms: now_unix_ms(),
        gpus: gpus.to_vec(),
    }
}

/// Writes the inventory until `shutdown` becomes true.
pub async fn publish(
    cluster: Cluster,
    mut gpus: watch::Receiver<Vec<GpuInfo>>,
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
                    tracing::warn!("publishing the node inventory: {error} (retrying)");
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
