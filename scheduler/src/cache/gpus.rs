//! A node's GPUs and what each carries.

use serde::Serialize;
use std::sync::Arc;
use vgpu_cluster::decision::{Decision, InventoryGpu};

/// What is taken on one GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    pub memory_bytes: u64,
    pub cores: u32,
    /// Containers using it.
    pub tasks: u32,
    /// Held by a container with 100 % compute.
    pub exclusive: bool,
}

impl Usage {
    /// Adds one container's grant.
    pub fn add_grant(&mut self, memory_bytes: u64, cores: u32) {
        self.memory_bytes = self.memory_bytes.saturating_add(memory_bytes);
        self.cores = self.cores.saturating_add(cores);
        self.tasks = self.tasks.saturating_add(1);
        self.exclusive |= cores >= 100;
    }

    /// Adds another usage.
    pub fn add(&mut self, other: &Usage) {
        self.memory_bytes = self.memory_bytes.saturating_add(other.memory_bytes);
        self.cores = self.cores.saturating_add(other.cores);
        self.tasks = self.tasks.saturating_add(other.tasks);
        self.exclusive |= other.exclusive;
    }

    /// Takes the larger of each field (things that never run at once).
    pub fn max_with(&mut self, other: &Usage) {
        self.memory_bytes = self.memory_bytes.max(other.memory_bytes);
        self.cores = self.cores.max(other.cores);
        self.tasks = self.tasks.max(other.tasks);
        self.exclusive |= other.exclusive;
    }
}

/// What filtering reads of one GPU, packed together (thousands of nodes are
/// checked per request; the full [`InventoryGpu`] is read only to explain a
/// rejection or write a decision).
#[derive(Clone, Debug)]
pub struct HotGpu {
    /// The memory the GPU offers (its memory times the node's device
    /// memory scaling): what grants, and memory percentages, count against.
    pub memory_bytes: u64,
    pub split_count: u32,
    pub healthy: bool,
    /// Taken out of service by the node's annotation
    /// ([`vgpu_cluster::cordon`]): no new vGPU goes there.
    pub cordoned: bool,
    /// Measured, smoothed utilization in percent, when the agent sent it.
    pub utilization_percent: Option<u32>,
    /// The model in lower case, shared between all GPUs of that model, so a
    /// request's verdict on it is computed once.
    pub model: Arc<str>,
    /// NVLink island and NUMA node, for multi-GPU containers.
    pub nvlink_island: Option<u32>,
    pub numa: Option<u32>,
}

impl HotGpu {
    /// Whether it can take new vGPUs at all: healthy and not cordoned.
    pub fn in_service(&self) -> bool {
        self.healthy && !self.cordoned
    }
}

/// A node's GPUs.
#[derive(Clone, Debug, Default)]
pub struct NodeGpus {
    pub gpus: Vec<InventoryGpu>,
    pub hot: Vec<HotGpu>,
}

impl NodeGpus {
    pub fn new(gpus: Vec<InventoryGpu>) -> Self {
        Self::with_models(gpus, |model| Arc::from(model))
    }

    /// Builds the GPU list, getting each lower-case model from `intern`.
    pub fn with_models(gpus: Vec<InventoryGpu>, mut intern: impl FnMut(&str) -> Arc<str>) -> Self {
        let hot = gpus
            .iter()
            .map(|g| HotGpu {
                memory_bytes: g.offered_bytes(),
                split_count: g.split_count,
                healthy: g.healthy,
                cordoned: false,
                utilization_percent: g.utilization_percent,
                model: intern(&g.model.to_ascii_lowercase()),
                nvlink_island: g.nvlink_island,
                numa: g.numa,
            })
            .collect();
        Self { gpus, hot }
    }

    pub fn len(&self) -> usize {
        self.gpus.len()
    }

    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty()
    }

    /// Index of the GPU with `uuid`.
    pub fn index_of(&self, uuid: &str) -> Option<usize> {
        self.gpus.iter().position(|g| g.uuid == uuid)
    }
}

/// Per GPU, what a decided pod takes. Regular init containers run one at a
/// time before the others and are done once the pod runs (`running`);
/// sidecars (named in `sidecars`) run alongside everything.
pub fn contribution(decision: &Decision, sidecars: &[&str], running: bool) -> Vec<(String, Usage)> {
    #[derive(Default)]
    struct PerGpu {
        sidecars: Usage,
        apps: Usage,
        init_max: Usage,
    }
    let mut per_gpu: Vec<(String, PerGpu)> = Vec::new();
    for container in &decision.containers {
        let sidecar = container.init && sidecars.contains(&container.name.as_str());
        for device in &container.devices {
            let index = match per_gpu.iter().position(|(uuid, _)| *uuid == device.uuid) {
                Some(index) => index,
                None => {
                    per_gpu.push((device.uuid.clone(), PerGpu::default()));
                    per_gpu.len() - 1
                }
            };
            let entry = &mut per_gpu[index].1;
            if sidecar {
                entry
                    .sidecars
                    .add_grant(device.memory_bytes, device.cores_percent);
            } else if container.init {
                let mut alone = Usage::default();
                alone.add_grant(device.memory_bytes, device.cores_percent);
                entry.init_max.max_with(&alone);
            } else {
                entry
                    .apps
                    .add_grant(device.memory_bytes, device.cores_percent);
            }
        }
    }
    per_gpu
        .into_iter()
        .map(|(uuid, entry)| {
            let mut total = entry.sidecars;
            let mut rest = entry.apps;
            if !running {
                rest.max_with(&entry.init_max);
            }
            total.add(&rest);
            (uuid, total)
        })
        .filter(|(_, usage)| usage.tasks > 0)
        .collect()
}
