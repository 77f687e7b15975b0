//! The node's GPUs as the agents publish them: NVML's facts turned into
//! inventory entries (the device plugin's node annotation, the DRA
//! driver's ResourceSlice, `vgpu doctor`'s view).

use vgpu_cluster::decision::InventoryGpu;
use vgpu_node_contract::region::limits::scaling::MemoryScaling;
use vgpu_nvml_host::GpuFacts;

/// The inventory entries for the GPUs NVML describes, each shared by at
/// most `split_count` containers, offering their memory times `scaling`,
/// all healthy to start with.
pub fn inventory_gpus(
    facts: Vec<GpuFacts>,
    split_count: u32,
    scaling: MemoryScaling,
) -> Vec<InventoryGpu> {
    facts
        .into_iter()
        .map(|gpu| InventoryGpu {
            // Left out unscaled, so such a node's annotation reads as it
            // always did.
            offered_memory_bytes: (scaling != MemoryScaling::ONE)
                .then(|| scaling.offered(gpu.memory_bytes)),
            utilization_percent: None,
            uuid: gpu.uuid,
            index: gpu.index,
            model: gpu.model,
            memory_bytes: gpu.memory_bytes,
            sm_count: gpu.sm_count,
            split_count,
            numa: gpu.numa,
            nvlink_island: gpu.nvlink_island,
            healthy: true,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn nvml_facts_become_healthy_entries_with_numa_and_island() {
        let facts = vec![GpuFacts {
            index: 3,
            uuid: "GPU-d".into(),
            model: "H100".into(),
            memory_bytes: 80 << 30,
            sm_count: 132,
            numa: Some(1),
            nvlink_peers: vec![1],
            nvlink_island: Some(1),
        }];
        let gpus = inventory_gpus(facts, 7, MemoryScaling::default());
        assert_eq!(gpus.len(), 1);
        let gpu = &gpus[0];
        assert_eq!((gpu.index, gpu.uuid.as_str()), (3, "GPU-d"));
        assert_eq!((gpu.numa, gpu.nvlink_island), (Some(1), Some(1)));
        assert_eq!(gpu.split_count, 7);
        assert_eq!(gpu.offered_memory_bytes, None);
        assert!(gpu.healthy);
    }

    #[test]
    fn a_scaled_node_offers_its_memory_times_the_factor() {
        let two: MemoryScaling = "2".parse().expect("2");
        let gpus = inventory_gpus(vec![facts(0, 24576), facts(1, 8192)], 10, two);
        assert_eq!(gpus[0].memory_bytes, 24576 << 20, "physical kept");
        assert_eq!(gpus[0].offered_memory_bytes, Some(49152 << 20));
        assert_eq!(gpus[1].offered_bytes(), 16384 << 20);
        let plain = inventory_gpus(vec![facts(0, 24576)], 10, MemoryScaling::ONE);
        assert_eq!(plain[0].offered_memory_bytes, None);
        assert_eq!(plain[0].offered_bytes(), 24576 << 20);
    }
}
