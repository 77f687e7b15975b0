//! Whether one GPU can take one vGPU, and why not in words.

use crate::cache::gpus::{NodeGpus, Usage};
use std::fmt::Write as _;
use std::sync::Arc;
use vgpu_cluster::cordon::{CORDONED_GPUS_ANNOTATION, HAMI_DEVICE_CORDON_ANNOTATION};
use vgpu_cluster::decision::InventoryGpu;
use vgpu_cluster::requests::{ContainerRequest, PodRequest, Selectors, TypeMismatch, UuidMismatch};
use vgpu_cluster::resources::{
    GPU_MODEL_ANNOTATION, NOUSE_GPU_TYPE_ANNOTATION, NOUSE_GPU_UUID_ANNOTATION,
    USE_GPU_TYPE_ANNOTATION, USE_GPU_UUID_ANNOTATION,
};

/// A request's type rules applied to each GPU model, once per model.
#[derive(Debug, Default)]
pub struct ModelVerdicts {
    entries: Vec<(Arc<str>, Result<(), TypeMismatch>)>,
}

impl ModelVerdicts {
    pub fn get(&mut self, model: &Arc<str>, selectors: &Selectors) -> Result<(), TypeMismatch> {
        if !selectors.restrict_models() {
            return Ok(());
        }
        // Most nodes have one model: the last one asked about comes first.
        if let Some((_, verdict)) = self
            .entries
            .iter()
            .rev()
            .find(|(m, _)| Arc::ptr_eq(m, model))
        {
            return *verdict;
        }
        let verdict = selectors.model_allowed(model);
        if self.entries.len() >= 256 {
            self.entries.clear();
        }
        self.entries.push((model.clone(), verdict));
        verdict
    }
}

/// Why one GPU cannot take one vGPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuProblem {
    Unhealthy,
    /// Taken out of service by the node's annotation.
    Cordoned,
    TypeNotWanted,
    /// Matches `nouse_types[i]`.
    TypeExcluded(usize),
    /// Not the model the pod names.
    NotTheModel,
    UuidNotWanted,
    UuidExcluded,
    /// The GPU's whole memory is less than the request.
    TooSmall {
        need: u64,
    },
    /// Another container holds it with 100 % compute.
    HeldExclusively,
    /// The request wants it alone, but it already has containers.
    NeedsWholeGpu {
        tasks: u32,
    },
    /// Every slot (split count) is taken.
    TasksFull {
        tasks: u32,
    },
    Memory {
        free: u64,
        need: u64,
    },
    Cores {
        free: u32,
        need: u32,
    },
}

impl GpuProblem {
    /// Whether evicting other pods could never help.
    pub fn is_permanent(self) -> bool {
        matches!(
            self,
            Self::Unhealthy
                | Self::Cordoned
                | Self::TypeNotWanted
                | Self::TypeExcluded(_)
                | Self::NotTheModel
                | Self::UuidNotWanted
                | Self::UuidExcluded
                | Self::TooSmall { .. }
        )
    }
}

/// Checks GPU `index` of `node` for one vGPU of `request`; on success
/// returns the memory the vGPU gets there.
pub fn check_gpu(
    node: &NodeGpus,
    index: usize,
    model_verdict: Result<(), TypeMismatch>,
    usage: &Usage,
    request: &ContainerRequest,
    selectors: &Selectors,
) -> Result<u64, GpuProblem> {
    let gpu = &node.hot[index];
    if !gpu.healthy {
        return Err(GpuProblem::Unhealthy);
    }
    if gpu.cordoned {
        return Err(GpuProblem::Cordoned);
    }
    match model_verdict {
        Ok(()) => {}
        Err(TypeMismatch::NotWanted) => return Err(GpuProblem::TypeNotWanted),
        Err(TypeMismatch::NotTheModel) => return Err(GpuProblem::NotTheModel),
        Err(TypeMismatch::Excluded(i)) => return Err(GpuProblem::TypeExcluded(i)),
    }
    if !selectors.use_uuids.is_empty() || !selectors.nouse_uuids.is_empty() {
        let uuid = node.gpus.get(index).map(|g| g.uuid.as_str()).unwrap_or("");
        match selectors.uuid_allowed(uuid) {
            Ok(()) => {}
            Err(UuidMismatch::NotWanted) => return Err(GpuProblem::UuidNotWanted),
            Err(UuidMismatch::Excluded) => return Err(GpuProblem::UuidExcluded),
        }
    }
    let need = request.memory.bytes_on(gpu.memory_bytes);
    if need > gpu.memory_bytes {
        return Err(GpuProblem::TooSmall { need });
    }
    if usage.exclusive {
        return Err(GpuProblem::HeldExclusively);
    }
    if request.exclusive() && usage.tasks > 0 {
        return Err(GpuProblem::NeedsWholeGpu { tasks: usage.tasks });
    }
    if usage.tasks >= gpu.split_count {
        return Err(GpuProblem::TasksFull { tasks: usage.tasks });
    }
    let free = gpu.memory_bytes.saturating_sub(usage.memory_bytes);
    if need > free {
        return Err(GpuProblem::Memory { free, need });
    }
    let free_cores = 100u32.saturating_sub(usage.cores);
    if request.cores > free_cores {
        return Err(GpuProblem::Cores {
            free: free_cores,
            need: request.cores,
        });
    }
    Ok(need)
}

/// A container that did not fit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Miss {
    /// Index into the request's containers.
    pub container: usize,
    /// GPUs that could take one of its vGPUs.
    pub fitting: usize,
    /// Why the others could not.
    pub problems: Vec<(usize, GpuProblem)>,
    /// No eviction of other pods could make it fit.
    pub permanent: bool,
}

fn mib(bytes: u64) -> u64 {
    bytes >> 20
}

/// Describes one GPU problem in words.
pub fn describe_problem(
    gpu: &InventoryGpu,
    problem: GpuProblem,
    selectors: &Selectors,
    out: &mut String,
) {
    let uuid = &gpu.uuid;
    let _ = match problem {
        GpuProblem::Unhealthy => write!(out, "{uuid} is unhealthy"),
        GpuProblem::Cordoned => write!(
            out,
            "{uuid} is cordoned (node annotation {CORDONED_GPUS_ANNOTATION} or {HAMI_DEVICE_CORDON_ANNOTATION})"
        ),
        GpuProblem::TypeNotWanted => write!(
            out,
            "{uuid} is a {}, not one of {USE_GPU_TYPE_ANNOTATION} ({})",
            gpu.model,
            selectors.use_types.join(", ")
        ),
        GpuProblem::NotTheModel => write!(
            out,
            "{uuid} is a {}, not the {GPU_MODEL_ANNOTATION} {}",
            gpu.model,
            selectors.model.as_deref().unwrap_or("?")
        ),
        GpuProblem::TypeExcluded(i) => write!(
            out,
            "{uuid} is a {}, excluded by {NOUSE_GPU_TYPE_ANNOTATION} ({})",
            gpu.model,
            selectors
                .nouse_types
                .get(i)
                .map(String::as_str)
                .unwrap_or("?")
        ),
        GpuProblem::UuidNotWanted => {
            write!(out, "{uuid} is not in {USE_GPU_UUID_ANNOTATION}")
        }
        GpuProblem::UuidExcluded => {
            write!(out, "{uuid} is excluded by {NOUSE_GPU_UUID_ANNOTATION}")
        }
        GpuProblem::TooSmall { need } => write!(
            out,
            "{uuid} has only {} MiB in all, container needs {} MiB",
            mib(gpu.offered_bytes()),
            mib(need)
        ),
        GpuProblem::HeldExclusively => write!(
            out,
            "{uuid} is taken whole by another container (100 percent compute)"
        ),
        GpuProblem::NeedsWholeGpu { tasks } => write!(
            out,
            "{uuid} already runs {tasks} container(s), container needs it whole (100 percent compute)"
        ),
        GpuProblem::TasksFull { tasks } => write!(
            out,
            "{uuid} already runs {tasks} container(s), its limit (split count {})",
            gpu.split_count
        ),
        GpuProblem::Memory { free, need } => write!(
            out,
            "{uuid} has {} MiB free, container needs {} MiB",
            mib(free),
            mib(need)
        ),
        GpuProblem::Cores { free, need } => write!(
            out,
            "{uuid} has {free} percent compute free, container needs {need} percent"
        ),
    };
}

/// Explains a [`Miss`] in a sentence a user can act on. No `%` in it:
/// kube-scheduler uses an extender's reasons as a format string, so `30%`
/// reaches the pod's events as `30%!c(MISSING)` (seen against the real
/// kube-scheduler); "percent" is written out.
pub fn explain(node: &NodeGpus, request: &PodRequest, miss: &Miss) -> String {
    let container = &request.containers[miss.container];
    let mut out = String::new();
    let plural = |n: usize| if n == 1 { "" } else { "s" };
    let _ = write!(
        out,
        "container {:?} needs {} GPU{} with {} and {} percent compute each",
        container.name,
        container.count,
        plural(container.count as usize),
        container.memory.describe(),
        container.cores
    );
    if node.is_empty() {
        out.push_str("; the node has no GPUs");
        return out;
    }
    let _ = write!(
        out,
        "; {} of the node's {} GPU{} can take it",
        if miss.fitting == 0 {
            "none".to_string()
        } else {
            format!("only {}", miss.fitting)
        },
        node.len(),
        plural(node.len())
    );
    const SHOWN: usize = 4;
    for (n, (gpu, problem)) in miss.problems.iter().enumerate() {
        if n == SHOWN {
            let _ = write!(out, "; and {} more", miss.problems.len() - SHOWN);
            break;
        }
        out.push_str(if n == 0 { ": " } else { "; " });
        if let Some(info) = node.gpus.get(*gpu) {
            describe_problem(info, *problem, &request.selectors, &mut out);
        }
    }
    out
}
