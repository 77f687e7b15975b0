//! How loaded a node's GPUs are: what the node policies score by.

use crate::cache::gpus::{HotGpu, NodeGpus, Usage};

/// How busy a GPU is expected to be, in percent: its measured utilization
/// or its granted compute, whichever is higher. The measurement lags (it
/// is smoothed and published every 10 s at most), so grants made since
/// count through the grant; a GPU not measured yet counts at its grant.
pub(crate) fn expected_percent(gpu: &HotGpu, usage: &Usage) -> u32 {
    gpu.utilization_percent
        .unwrap_or(0)
        .max(usage.cores)
        .min(100)
}

/// How busy a node's GPUs in service (healthy, not cordoned) are expected to be, 0.0 to 1.0 (see
/// `expected_percent`); what the load-aware node policy scores by.
pub fn measured_load(node: &NodeGpus, usage: &[Usage]) -> f64 {
    let busy: Vec<u32> = node
        .hot
        .iter()
        .zip(usage)
        .filter(|(gpu, _)| gpu.in_service())
        .map(|(gpu, usage)| expected_percent(gpu, usage))
        .collect();
    if busy.is_empty() {
        return 1.0;
    }
    f64::from(busy.iter().sum::<u32>()) / (100.0 * busy.len() as f64)
}

/// How full a node is, 0.0 to 1.0: the mean of its memory and compute in
/// use over its GPUs in service (healthy, not cordoned).
pub fn node_load(node: &NodeGpus, usage: &[Usage]) -> f64 {
    let mut total_memory = 0f64;
    let mut used_memory = 0f64;
    let mut used_cores = 0u64;
    let mut healthy = 0u64;
    for (gpu, usage) in node.hot.iter().zip(usage) {
        if gpu.in_service() {
            healthy += 1;
            total_memory += gpu.memory_bytes as f64;
            used_memory += usage.memory_bytes.min(gpu.memory_bytes) as f64;
            used_cores += u64::from(usage.cores.min(100));
        }
    }
    if healthy == 0 || total_memory == 0.0 {
        return 1.0;
    }
    let memory = used_memory / total_memory;
    let cores = used_cores as f64 / (100 * healthy) as f64;
    (memory + cores) / 2.0
}
