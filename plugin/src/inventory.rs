//! Publishing the node's GPUs as the node annotation
//! [`vgpu_cluster::decision::NODE_INVENTORY_ANNOTATION`]: at start, on every
//! health change, when the GPUs' measured load moved ([`crate::load`]), and
//! again after a while unchanged (a node object deleted and recreated has
//! lost it); and the share resources' capacities in the node's status
//! ([`share_capacity`]). Whether the plugin is alive is its Lease's to say
//! ([`crate::lease`]), not this annotation's.

use crate::cluster::Cluster;
use crate::load::LoadFigures;
use crate::service::stopped;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::watch;
use vgpu_cluster::decision::{InventoryGpu, NodeInventory, FORMAT_VERSION};
use vgpu_cluster::resources::ResourceNames;

/// Longest wait before retrying a failed write.
const RETRY: Duration = Duration::from_secs(5);

/// The inventory for `gpus` with their measured `load`; `several_pending`:
/// whether this plugin tells pending pods apart through kubelet's
/// PodResources API ([`NodeInventory::several_pending`]).
pub fn inventory(
    gpus: &[InventoryGpu],
    load: &LoadFigures,
    several_pending: bool,
) -> NodeInventory {
    NodeInventory {
        several_pending,
        version: FORMAT_VERSION,
        gpus: gpus
            .iter()
            .map(|gpu| InventoryGpu {
                utilization_percent: load.get(&gpu.uuid).copied(),
                ..gpu.clone()
            })
            .collect(),
    }
}

/// What the node's status offers of each share resource (memory, memory
/// percentage, cores, priority, Elastic GPU's memory and cores).
///
/// kube-scheduler configured with the Elastic GPU Scheduler's stanza
/// counts the Elastic GPU ones against these. The chart's kube-scheduler is
/// told to ignore all of them (the extender decides them:
/// `ignoredByScheduler`), but the hint that decides when to retry a pod
/// after a node's resources change does not know that: it compares every
/// resource the pod asks for with the node's allocatable, so with these
/// missing a pod rejected while the node's GPUs were briefly gone (the
/// plugin restarting: kubelet counts its devices unhealthy) was not retried
/// when they came back, but only after kube-scheduler's 5-minute flush.
/// Each amount is the most that the containers placed on this node can ask
/// for in total (the extender never over-commits a GPU), so kubelet's
/// admission, which does count them, never refuses what the extender
/// placed: memory in MiB and Elastic GPU memory: the memory the GPUs offer
/// (their memory times the node's device memory scaling); memory
/// percentage (of that offer), cores and Elastic GPU cores: 100 per GPU;
/// priority, which is not an amount: the most it could sum to, every slot
/// at the largest priority.
pub fn share_capacity(gpus: &[InventoryGpu], names: &ResourceNames) -> BTreeMap<String, u64> {
    let count = gpus.len() as u64;
    let memory_mib: u64 = gpus.iter().map(|gpu| gpu.offered_bytes() >> 20).sum();
    let slots: u64 = gpus.iter().map(|gpu| u64::from(gpu.split_count)).sum();
    let mut amounts = BTreeMap::new();
    for (name, amount) in [
        (&names.memory, memory_mib),
        (&names.memory_percentage, 100 * count),
        (&names.cores, 100 * count),
        (&names.priority, slots.saturating_mul(i32::MAX as u64)),
        (&names.elastic_memory, memory_mib),
        (&names.elastic_cores, 100 * count),
    ] {
        // The GPU count is the device plugin's own resource: kubelet
        // reports it.
        if *name != names.gpu {
            amounts.insert(name.clone(), amount);
        }
    }
    amounts
}

/// Writes the inventory, and the share resources' capacities, until
/// `shutdown` becomes true; `load`, when measured, rides in the inventory.
pub async fn publish(
    cluster: Cluster,
    mut gpus: watch::Receiver<Vec<InventoryGpu>>,
    mut load: Option<watch::Receiver<LoadFigures>>,
    names: ResourceNames,
    resync: Duration,
    several_pending: bool,
    mut shutdown: watch::Receiver<bool>,
) {
    let (mut failing, mut capacity_failing) = (false, false);
    let mut load_moved = false;
    loop {
        let figures = load
            .as_mut()
            .map(|load| load.borrow_and_update().clone())
            .unwrap_or_default();
        let current = inventory(&gpus.borrow_and_update(), &figures, several_pending);
        // Written at every resync too: a kubelet that finds its node
        // object recreated resets extended resources it does not manage.
        // Not needed for placing pods, only for kube-scheduler's retries:
        // a failure is reported and does not hold the inventory back. A
        // change of load alone changes no capacity.
        if !load_moved {
            match cluster
                .publish_capacity(&share_capacity(&current.gpus, &names))
                .await
            {
                Ok(()) => capacity_failing = false,
                Err(error) => {
                    if !capacity_failing {
                        tracing::warn!(
                            error = &error as &dyn std::error::Error,
                            "offering the share resources in the node's status (retrying at each resync)"
                        );
                    }
                    capacity_failing = true;
                }
            }
        }
        let wait = match cluster.publish_inventory(&current).await {
            Ok(()) => {
                if failing {
                    tracing::info!("node inventory published again");
                }
                failing = false;
                tracing::debug!("node inventory published ({} GPUs)", current.gpus.len());
                resync
            }
            Err(error) => {
                if !failing {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "publishing the node inventory (retrying)"
                    );
                }
                failing = true;
                resync.min(RETRY)
            }
        };
        load_moved = false;
        tokio::select! {
            () = stopped(&mut shutdown) => return,
            changed = gpus.changed() => if changed.is_err() { return },
            // A sampler that stopped leaves the last figures in place.
            Ok(()) = async { match load.as_mut() {
                Some(load) => load.changed().await,
                None => std::future::pending().await,
            } } => load_moved = true,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_node_agent::inventory::inventory_gpus;
    use vgpu_node_contract::region::limits::scaling::MemoryScaling;
    use vgpu_nvml_host::GpuFacts;

    fn gpu(index: u32, mib: u64, split_count: u32) -> InventoryGpu {
        InventoryGpu {
            offered_memory_bytes: None,
            utilization_percent: None,
            uuid: format!("GPU-{index}"),
            index,
            model: "Simulated".into(),
            memory_bytes: mib << 20,
            sm_count: 132,
            split_count,
            numa: None,
            nvlink_island: None,
            healthy: true,
        }
    }

    #[test]
    fn shares_are_offered_as_the_most_the_node_can_hold() {
        let gpus = [gpu(0, 16384, 10), gpu(1, 8192, 4)];
        let amounts = share_capacity(&gpus, &ResourceNames::default());
        assert_eq!(amounts["nvidia.com/gpumem"], 24576);
        assert_eq!(amounts["elasticgpu.io/gpu-memory"], 24576);
        assert_eq!(amounts["nvidia.com/gpumem-percentage"], 200);
        assert_eq!(amounts["nvidia.com/gpucores"], 200);
        assert_eq!(amounts["elasticgpu.io/gpu-core"], 200);
        assert_eq!(amounts["nvidia.com/priority"], 14 * i32::MAX as u64);
        // The GPU count is kubelet's to report.
        assert!(!amounts.contains_key("nvidia.com/gpu"));
        assert_eq!(amounts.len(), 6);
    }

    fn facts(index: u32, mib: u64) -> GpuFacts {
        GpuFacts {
            uuid: format!("GPU-{index}"),
            index,
            model: "Simulated".into(),
            memory_bytes: mib << 20,
            sm_count: 132,
            numa: None,
            nvlink_peers: Vec::new(),
            nvlink_island: None,
        }
    }

    #[test]
    fn a_scaled_node_offers_its_memory_times_the_factor() {
        let two: MemoryScaling = "2".parse().expect("2");
        let gpus = inventory_gpus(vec![facts(0, 24576), facts(1, 8192)], 10, two);
        assert_eq!(gpus[0].memory_bytes, 24576 << 20, "physical kept");
        assert_eq!(gpus[0].offered_memory_bytes, Some(49152 << 20));
        assert_eq!(gpus[1].offered_bytes(), 16384 << 20);
        let amounts = share_capacity(&gpus, &ResourceNames::default());
        // Kubelet admits two pods of 24 GiB on the one 24 GiB card.
        assert_eq!(amounts["nvidia.com/gpumem"], 65536);
        assert_eq!(amounts["elasticgpu.io/gpu-memory"], 65536);
        // Percentages are of the offer: still 100 per GPU.
        assert_eq!(amounts["nvidia.com/gpumem-percentage"], 200);

        let plain = inventory_gpus(vec![facts(0, 24576)], 10, MemoryScaling::ONE);
        assert_eq!(plain[0].offered_memory_bytes, None);
        assert_eq!(
            share_capacity(&plain, &ResourceNames::default())["nvidia.com/gpumem"],
            24576
        );
    }

    #[test]
    fn a_share_named_like_the_gpu_count_is_left_to_kubelet() {
        let names = ResourceNames {
            cores: "nvidia.com/gpu".into(),
            ..ResourceNames::default()
        };
        let amounts = share_capacity(&[gpu(0, 1024, 2)], &names);
        assert!(!amounts.contains_key("nvidia.com/gpu"));
        assert_eq!(amounts.len(), 5);
    }

    #[test]
    fn a_node_without_gpus_offers_none() {
        let amounts = share_capacity(&[], &ResourceNames::default());
        assert!(amounts.values().all(|amount| *amount == 0), "{amounts:?}");
    }
}
