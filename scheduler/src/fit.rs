//! Whether, and where, a pod's containers fit on one node's GPUs.
//!
//! A GPU takes a vGPU when it is healthy, of a wanted model and UUID, has a
//! free slot (fewer containers than its split count), enough free memory and
//! compute, and exclusivity holds both ways: a container asking for 100 %
//! compute takes the GPU alone (it must be empty, and nothing joins it
//! later). A container's vGPUs go to different GPUs; containers of one pod
//! may share a GPU.
//!
//! Init containers follow Kubernetes' lifetime rules: a regular init
//! container runs alone before the others, so it is placed against the
//! node's other pods (and the pod's sidecars) only, and its grant is counted
//! only while the pod has not started; sidecars (`restartPolicy: Always`)
//! run alongside and are placed with the regular containers.
//!
//! A container asking for several GPUs gets them from one NVLink island
//! when one island has enough GPUs that fit, else from one NUMA node, else
//! wherever the policy puts them: of the islands (NUMA nodes) that can hold
//! them all, the one the policy's order completes first, and in it the
//! GPUs the policy prefers.

use crate::cache::gpus::{HotGpu, NodeGpus, Usage};
use crate::requests::{
    ContainerKind, ContainerRequest, PodRequest, Selectors, TypeMismatch, UuidMismatch,
};
use crate::vocabulary::policy::GpuPolicy;
use std::fmt::Write as _;
use std::sync::Arc;
use vgpu_cluster::decision::InventoryGpu;
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

/// One vGPU granted: container `container` (index into the request) gets
/// GPU `gpu` (index into the node's GPUs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub container: usize,
    pub gpu: usize,
    pub memory_bytes: u64,
    pub cores: u32,
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

/// Reusable buffers, so that checking thousands of nodes allocates nothing
/// for the nodes that fit.
#[derive(Debug, Default)]
pub struct Scratch {
    /// The grants of the last successful placement.
    pub grants: Vec<Grant>,
    /// The node's usage with the pod's running containers added.
    pub after: Vec<Usage>,
    init_base: Vec<Usage>,
    init_work: Vec<Usage>,
    candidates: Vec<Candidate>,
    /// The request's verdicts on GPU models.
    pub models: ModelVerdicts,
    /// Healthy GPUs of a wanted model on the node of the last placement.
    pub matching: u32,
}

/// Places every container of `request` on `node`, whose GPUs already carry
/// `base`. On success the grants are in `scratch.grants`.
pub fn place_pod(
    node: &NodeGpus,
    base: &[Usage],
    request: &PodRequest,
    policy: GpuPolicy,
    scratch: &mut Scratch,
) -> Result<(), Miss> {
    let Scratch {
        grants,
        after,
        init_base,
        init_work,
        candidates,
        models,
        matching,
    } = scratch;
    grants.clear();
    *matching = 0;
    after.clear();
    after.extend_from_slice(base);
    // Sidecars and regular containers run together.
    for (index, container) in request.containers.iter().enumerate() {
        if container.kind != ContainerKind::Init {
            *matching = place_container(
                node, after, index, container, request, policy, candidates, grants, models,
            )?;
        }
    }
    // Each regular init container runs alone, next to the sidecars only.
    if request
        .containers
        .iter()
        .any(|c| c.kind == ContainerKind::Init)
    {
        init_base.clear();
        init_base.extend_from_slice(base);
        for grant in grants.iter() {
            if request.containers[grant.container].kind == ContainerKind::Sidecar {
                init_base[grant.gpu].add_grant(grant.memory_bytes, grant.cores);
            }
        }
        for (index, container) in request.containers.iter().enumerate() {
            if container.kind == ContainerKind::Init {
                init_work.clear();
                init_work.extend_from_slice(init_base);
                place_container(
                    node, init_work, index, container, request, policy, candidates, grants, models,
                )?;
            }
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn place_container(
    node: &NodeGpus,
    usage: &mut [Usage],
    index: usize,
    container: &ContainerRequest,
    request: &PodRequest,
    policy: GpuPolicy,
    candidates: &mut Vec<Candidate>,
    grants: &mut Vec<Grant>,
    models: &mut ModelVerdicts,
) -> Result<u32, Miss> {
    candidates.clear();
    let mut matching = 0;
    for (i, gpu) in node.hot.iter().enumerate() {
        let verdict = models.get(&gpu.model, &request.selectors);
        matching += u32::from(gpu.healthy && verdict.is_ok());
        if let Ok(need) = check_gpu(node, i, verdict, &usage[i], container, &request.selectors) {
            let (primary, secondary) = preference(policy, gpu, i, &usage[i], request.seed);
            candidates.push((primary, secondary, i, need));
        }
    }
    let count = container.count as usize;
    if candidates.len() < count {
        let mut problems = Vec::new();
        let mut possible = candidates.len();
        for (i, gpu) in node.hot.iter().enumerate() {
            let verdict = models.get(&gpu.model, &request.selectors);
            if let Err(problem) =
                check_gpu(node, i, verdict, &usage[i], container, &request.selectors)
            {
                if !problem.is_permanent() {
                    possible += 1;
                }
                problems.push((i, problem));
            }
        }
        return Err(Miss {
            container: index,
            fitting: candidates.len(),
            problems,
            permanent: possible < count,
        });
    }
    if count == 1 {
        // The common case: only the best one is needed.
        if let Some(best) = candidates.iter().min().copied() {
            candidates[0] = best;
        }
    } else {
        candidates.sort_unstable();
        gather_one_domain(node, candidates, count);
    }
    for &(_, _, gpu, need) in candidates.iter().take(count) {
        usage[gpu].add_grant(need, container.cores);
        grants.push(Grant {
            container: index,
            gpu,
            memory_bytes: need,
            cores: container.cores,
        });
    }
    Ok(matching)
}

/// A candidate GPU: (policy key, policy key, GPU index, memory it gets).
type Candidate = (u64, u64, usize, u64);

/// The topology levels a multi-GPU container is kept within, closest first.
const DOMAINS: [fn(&HotGpu) -> Option<u32>; 2] = [|gpu| gpu.nvlink_island, |gpu| gpu.numa];

/// Moves to the front of `candidates` (sorted by the policy) the first
/// `count` of them that share an NVLink island, else a NUMA node, keeping
/// the policy's order among them; leaves the order alone when no island or
/// node has `count`. GPUs talk faster within an island, and host memory is
/// closer within a node.
fn gather_one_domain(node: &NodeGpus, candidates: &mut [Candidate], count: usize) {
    for domain_of in DOMAINS {
        if let Some(domain) = first_complete_domain(node, candidates, count, domain_of) {
            let mut front = 0;
            for k in 0..candidates.len() {
                if front == count {
                    break;
                }
                if domain_of(&node.hot[candidates[k].2]) == Some(domain) {
                    candidates.swap(front, k);
                    front += 1;
                }
            }
            return;
        }
    }
}

/// The domain that first has `count` members walking `candidates` in
/// order, if any: the one whose `count`-th best GPU is best. Quadratic in
/// the node's fitting GPUs, which are few; nothing is allocated.
fn first_complete_domain(
    node: &NodeGpus,
    candidates: &[Candidate],
    count: usize,
    domain_of: fn(&HotGpu) -> Option<u32>,
) -> Option<u32> {
    for (k, candidate) in candidates.iter().enumerate() {
        let Some(domain) = domain_of(&node.hot[candidate.2]) else {
            continue;
        };
        let before = candidates[..k]
            .iter()
            .filter(|other| domain_of(&node.hot[other.2]) == Some(domain))
            .count();
        if before + 1 >= count {
            return Some(domain);
        }
    }
    None
}

/// Sort key of GPU `index` under `policy` (smaller is preferred; ties go
/// to the lower index); `seed` is the pod's, for `random`.
fn preference(
    policy: GpuPolicy,
    gpu: &HotGpu,
    index: usize,
    usage: &Usage,
    seed: u64,
) -> (u64, u64) {
    // In MiB, so that the product stays far below 2^64.
    let total = (gpu.memory_bytes >> 20).max(1);
    let used = (usage.memory_bytes.min(gpu.memory_bytes)) >> 20;
    let memory_permille = used * 1000 / total;
    let load = memory_permille + u64::from(usage.cores.min(100)) * 10;
    match policy {
        GpuPolicy::FewestTasks => (u64::from(usage.tasks), load),
        GpuPolicy::Binpack => (2000 - load, u64::MAX - u64::from(usage.tasks)),
        GpuPolicy::Spread => (load, u64::from(usage.tasks)),
        GpuPolicy::Random => (mix(seed ^ index as u64), 0),
        GpuPolicy::LoadAware => {
            let measured = gpu.utilization_percent.unwrap_or(0).min(100);
            // Ties of expected load go to the GPU measured least busy.
            (
                u64::from(expected_percent(gpu, usage)) * 1000 + u64::from(measured),
                load,
            )
        }
    }
}

/// How busy a GPU is expected to be, in percent: its measured utilization
/// or its granted compute, whichever is higher. The measurement lags (it
/// is smoothed and published every 10 s at most), so grants made since
/// count through the grant; a GPU not measured yet counts at its grant.
fn expected_percent(gpu: &HotGpu, usage: &Usage) -> u32 {
    gpu.utilization_percent
        .unwrap_or(0)
        .max(usage.cores)
        .min(100)
}

/// How busy a node's healthy GPUs are expected to be, 0.0 to 1.0 (see
/// [`expected_percent`]); what the load-aware node policy scores by.
pub fn measured_load(node: &NodeGpus, usage: &[Usage]) -> f64 {
    let busy: Vec<u32> = node
        .hot
        .iter()
        .zip(usage)
        .filter(|(gpu, _)| gpu.healthy)
        .map(|(gpu, usage)| expected_percent(gpu, usage))
        .collect();
    if busy.is_empty() {
        return 1.0;
    }
    f64::from(busy.iter().sum::<u32>()) / (100.0 * busy.len() as f64)
}

/// A well-spread 64-bit hash of `value` (splitmix64's finaliser).
fn mix(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// How full a node is, 0.0 to 1.0: the mean of its memory and compute in
/// use over its healthy GPUs.
pub fn node_load(node: &NodeGpus, usage: &[Usage]) -> f64 {
    let mut total_memory = 0f64;
    let mut used_memory = 0f64;
    let mut used_cores = 0u64;
    let mut healthy = 0u64;
    for (gpu, usage) in node.hot.iter().zip(usage) {
        if gpu.healthy {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::requests::MemoryRequest;
    use vgpu_cluster::decision::InventoryGpu;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, model: &str, memory_gib: u64) -> InventoryGpu {
        InventoryGpu {
            offered_memory_bytes: None,
            utilization_percent: None,
            uuid: format!("GPU-{index}"),
            index,
            model: model.into(),
            memory_bytes: memory_gib * GIB,
            sm_count: 100,
            split_count: 10,
            numa: None,
            nvlink_island: None,
            healthy: true,
        }
    }

    fn container(
        name: &str,
        kind: ContainerKind,
        count: u32,
        memory_gib: u64,
        cores: u32,
    ) -> ContainerRequest {
        ContainerRequest {
            name: name.into(),
            kind,
            count,
            memory: MemoryRequest::Bytes(memory_gib * GIB),
            cores,
            priority: None,
        }
    }

    fn request(containers: Vec<ContainerRequest>) -> PodRequest {
        PodRequest {
            containers,
            ..PodRequest::default()
        }
    }

    fn used(memory_gib: u64, cores: u32, tasks: u32) -> Usage {
        Usage {
            memory_bytes: memory_gib * GIB,
            cores,
            tasks,
            exclusive: cores >= 100,
        }
    }

    fn chosen(scratch: &Scratch) -> Vec<usize> {
        scratch.grants.iter().map(|g| g.gpu).collect()
    }

    #[test]
    fn a_scaled_gpu_takes_grants_up_to_its_offer() {
        // One 24 GiB card on a node at device memory scaling 2.
        let card = InventoryGpu {
            offered_memory_bytes: Some(48 * GIB),
            ..gpu(0, "A10", 24)
        };
        let node = NodeGpus::new(vec![card]);
        let whole_card = request(vec![container("c", ContainerKind::App, 1, 24, 10)]);
        let mut scratch = Scratch::default();
        place_pod(
            &node,
            &[Usage::default()],
            &whole_card,
            GpuPolicy::Binpack,
            &mut scratch,
        )
        .expect("the first fits");
        assert_eq!(scratch.grants[0].memory_bytes, 24 * GIB);
        // Two pods of 24 GiB fit the one 24 GiB card...
        let one = used(24, 10, 1);
        place_pod(&node, &[one], &whole_card, GpuPolicy::Binpack, &mut scratch)
            .expect("the second fits");
        // ...and a third does not, the message counting the offer.
        let two = used(48, 20, 2);
        let miss = place_pod(&node, &[two], &whole_card, GpuPolicy::Binpack, &mut scratch)
            .expect_err("the third does not");
        assert_eq!(
            miss.problems,
            vec![(
                0,
                GpuProblem::Memory {
                    free: 0,
                    need: 24 * GIB
                }
            )]
        );
        let too_big = request(vec![container("c", ContainerKind::App, 1, 49, 10)]);
        let miss = place_pod(
            &node,
            &[Usage::default()],
            &too_big,
            GpuPolicy::Binpack,
            &mut scratch,
        )
        .expect_err("more than the offer");
        let text = explain(&node, &too_big, &miss);
        assert!(text.contains("has only 49152 MiB in all"), "{text}");

        // A percentage is of the offer: 50 percent is 24 GiB, twice.
        let mut half = request(vec![container("c", ContainerKind::App, 1, 0, 10)]);
        half.containers[0].memory = MemoryRequest::Percent(50);
        place_pod(&node, &[one], &half, GpuPolicy::Binpack, &mut scratch).expect("fits");
        assert_eq!(scratch.grants[0].memory_bytes, 24 * GIB);
        // The whole memory is the whole offer.
        let mut whole = half.clone();
        whole.containers[0].memory = MemoryRequest::Whole;
        place_pod(
            &node,
            &[Usage::default()],
            &whole,
            GpuPolicy::Binpack,
            &mut scratch,
        )
        .expect("fits");
        assert_eq!(scratch.grants[0].memory_bytes, 48 * GIB);
        // Unscaled, the same card takes one such pod.
        let plain = NodeGpus::new(vec![gpu(0, "A10", 24)]);
        assert!(place_pod(
            &plain,
            &[one],
            &whole_card,
            GpuPolicy::Binpack,
            &mut scratch
        )
        .is_err());
    }

    #[test]
    fn policies_choose_different_gpus() {
        let node = NodeGpus::new(vec![
            gpu(0, "A10", 24),
            gpu(1, "A10", 24),
            gpu(2, "A10", 24),
        ]);
        // GPU 0: one big task; GPU 1: two small tasks; GPU 2: empty.
        let base = vec![used(16, 50, 1), used(2, 10, 2), Usage::default()];
        let req = request(vec![container("c", ContainerKind::App, 1, 4, 10)]);
        let mut scratch = Scratch::default();
        place_pod(&node, &base, &req, GpuPolicy::FewestTasks, &mut scratch).expect("fits");
        assert_eq!(chosen(&scratch), vec![2]);
        place_pod(&node, &base, &req, GpuPolicy::Binpack, &mut scratch).expect("fits");
        assert_eq!(chosen(&scratch), vec![0]);
        place_pod(&node, &base, &req, GpuPolicy::Spread, &mut scratch).expect("fits");
        assert_eq!(chosen(&scratch), vec![2]);
        let base = vec![used(16, 50, 1), used(2, 10, 2), used(1, 0, 3)];
        place_pod(&node, &base, &req, GpuPolicy::FewestTasks, &mut scratch).expect("fits");
        assert_eq!(
            chosen(&scratch),
            vec![0],
            "fewest containers, not least memory"
        );
        place_pod(&node, &base, &req, GpuPolicy::Spread, &mut scratch).expect("fits");
        assert_eq!(chosen(&scratch), vec![2], "least memory and compute");
    }

    /// 4 GPUs: NVLink islands {0,2} and {1,3}; NUMA nodes {0,1} and {2,3}.
    fn islands_node() -> NodeGpus {
        let mut gpus: Vec<InventoryGpu> = (0..4).map(|i| gpu(i, "H100", 80)).collect();
        for (i, gpu) in gpus.iter_mut().enumerate() {
            gpu.nvlink_island = Some(i as u32 % 2);
            gpu.numa = Some(i as u32 / 2);
        }
        NodeGpus::new(gpus)
    }

    #[test]
    fn a_multi_gpu_container_gets_one_nvlink_island() {
        let node = islands_node();
        let two = request(vec![container("c", ContainerKind::App, 2, 8, 10)]);
        let mut scratch = Scratch::default();
        for policy in [
            GpuPolicy::FewestTasks,
            GpuPolicy::Binpack,
            GpuPolicy::Spread,
            GpuPolicy::LoadAware,
        ] {
            // Empty: every GPU ties, the policy's order is 0,1,2,3 and
            // island {0,2} completes first (policy alone would take 0,1).
            place_pod(&node, &[Usage::default(); 4], &two, policy, &mut scratch).expect("fits");
            assert_eq!(chosen(&scratch), vec![0, 2], "{policy:?}");
        }
        // Binpack's fullest GPU is 3: its island is {1,3}, best first.
        let base = [
            used(4, 0, 1),
            used(1, 0, 1),
            Usage::default(),
            used(40, 50, 1),
        ];
        place_pod(&node, &base, &two, GpuPolicy::Binpack, &mut scratch).expect("fits");
        assert_eq!(chosen(&scratch), vec![3, 1]);
        // Spread: 2 and 1 are emptiest, but {0,2} completes (2, then 0)
        // before {1,3} does.
        place_pod(&node, &base, &two, GpuPolicy::Spread, &mut scratch).expect("fits");
        assert_eq!(chosen(&scratch), vec![2, 0]);
        for seed in 0..32 {
            let random = PodRequest {
                seed,
                ..two.clone()
            };
            place_pod(
                &node,
                &[Usage::default(); 4],
                &random,
                GpuPolicy::Random,
                &mut scratch,
            )
            .expect("fits");
            let mut islands: Vec<Option<u32>> = chosen(&scratch)
                .iter()
                .map(|&g| node.hot[g].nvlink_island)
                .collect();
            islands.dedup();
            assert_eq!(islands.len(), 1, "seed {seed}: {:?}", chosen(&scratch));
        }
        // One GPU needs no topology: the policy's own pick.
        let one = request(vec![container("c", ContainerKind::App, 1, 8, 10)]);
        place_pod(
            &node,
            &[Usage::default(); 4],
            &one,
            GpuPolicy::Spread,
            &mut scratch,
        )
        .expect("fits");
        assert_eq!(chosen(&scratch), vec![0]);
    }

    #[test]
    fn without_a_whole_island_one_numa_node_then_the_policy() {
        let node = islands_node();
        let two = request(vec![container("c", ContainerKind::App, 2, 8, 10)]);
        let mut scratch = Scratch::default();
        // GPUs 2 and 1 are taken whole: no island has two free GPUs; NUMA
        // node 0 is {0,1} (1 taken), node 1 {2,3} (2 taken): none either,
        // so the policy's order stands.
        let base = [
            Usage::default(),
            used(8, 100, 1),
            used(8, 100, 1),
            Usage::default(),
        ];
        place_pod(&node, &base, &two, GpuPolicy::Spread, &mut scratch).expect("fits");
        assert_eq!(chosen(&scratch), vec![0, 3]);
        // GPU 2 taken whole only: island {1,3} has both, and wins over
        // NUMA node 0 ({0,1}).
        let base = [
            Usage::default(),
            Usage::default(),
            used(8, 100, 1),
            Usage::default(),
        ];
        place_pod(&node, &base, &two, GpuPolicy::Spread, &mut scratch).expect("fits");
        assert_eq!(chosen(&scratch), vec![1, 3]);
        // Three GPUs: no island or NUMA node has three: policy order.
        let three = request(vec![container("c", ContainerKind::App, 3, 8, 10)]);
        place_pod(
            &node,
            &[Usage::default(); 4],
            &three,
            GpuPolicy::Spread,
            &mut scratch,
        )
        .expect("fits");
        assert_eq!(chosen(&scratch), vec![0, 1, 2]);
        // No islands known: one NUMA node. Spread's order is 1,2,3,0:
        // node {2,3} completes at GPU 3, node {0,1} only at GPU 0.
        let mut gpus = node.gpus.clone();
        for gpu in &mut gpus {
            gpu.nvlink_island = None;
        }
        let numa_only = NodeGpus::new(gpus);
        let base = [
            used(8, 20, 1),
            Usage::default(),
            used(2, 0, 1),
            used(4, 0, 1),
        ];
        place_pod(&numa_only, &base, &two, GpuPolicy::Spread, &mut scratch).expect("fits");
        assert_eq!(chosen(&scratch), vec![2, 3]);
    }

    #[test]
    fn load_aware_takes_the_gpu_measured_least_busy() {
        let mut gpus = vec![gpu(0, "A10", 24), gpu(1, "A10", 24), gpu(2, "A10", 24)];
        // Equal grants everywhere; GPU 0 measured busy, GPU 1 measured at
        // less than its grant, GPU 2 not yet measured.
        gpus[0].utilization_percent = Some(90);
        gpus[1].utilization_percent = Some(12);
        let node = NodeGpus::new(gpus);
        let base = vec![used(4, 30, 1), used(4, 30, 1), used(4, 30, 1)];
        let req = request(vec![container("c", ContainerKind::App, 1, 4, 10)]);
        let mut scratch = Scratch::default();
        place_pod(&node, &base, &req, GpuPolicy::FewestTasks, &mut scratch).expect("fits");
        assert_eq!(
            chosen(&scratch),
            vec![0],
            "the grants alone tie: lowest index"
        );
        place_pod(&node, &base, &req, GpuPolicy::LoadAware, &mut scratch).expect("fits");
        assert_eq!(
            chosen(&scratch),
            vec![2],
            "expected 30 % (granted) on GPUs 1 and 2; GPU 2 measured 0"
        );
        // A grant made since the last measurement counts: GPU 2 now carries
        // more than the others are measured or granted at.
        let base = vec![used(4, 30, 1), used(4, 30, 1), used(8, 60, 2)];
        place_pod(&node, &base, &req, GpuPolicy::LoadAware, &mut scratch).expect("fits");
        assert_eq!(chosen(&scratch), vec![1], "30 % expected, 12 % measured");
        // The node as a whole: each GPU at the higher of measured and granted.
        let expected = measured_load(&node, &base);
        assert!(
            (expected - (90.0 + 30.0 + 60.0) / 300.0).abs() < 1e-9,
            "{expected}"
        );
    }

    #[test]
    fn random_draws_per_pod_and_keeps_the_draw() {
        let node = NodeGpus::new((0..4).map(|i| gpu(i, "A10", 24)).collect());
        let base = vec![Usage::default(); 4];
        let mut scratch = Scratch::default();
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..64u64 {
            let req = PodRequest {
                seed,
                ..request(vec![container("c", ContainerKind::App, 1, 4, 10)])
            };
            place_pod(&node, &base, &req, GpuPolicy::Random, &mut scratch).expect("fits");
            let first = chosen(&scratch);
            place_pod(&node, &base, &req, GpuPolicy::Random, &mut scratch).expect("fits");
            assert_eq!(chosen(&scratch), first, "the same pod draws the same GPU");
            seen.insert(first[0]);
        }
        assert_eq!(seen.len(), 4, "every GPU drawn by some pod: {seen:?}");
    }

    #[test]
    fn multi_gpu_containers_use_distinct_gpus() {
        let node = NodeGpus::new(vec![gpu(0, "A10", 24), gpu(1, "A10", 24)]);
        let base = vec![Usage::default(); 2];
        let req = request(vec![container("c", ContainerKind::App, 2, 1, 0)]);
        let mut scratch = Scratch::default();
        place_pod(&node, &base, &req, GpuPolicy::Binpack, &mut scratch).expect("fits");
        assert_eq!(chosen(&scratch), vec![0, 1]);
        let req = request(vec![container("c", ContainerKind::App, 3, 1, 0)]);
        let miss =
            place_pod(&node, &base, &req, GpuPolicy::Binpack, &mut scratch).expect_err("3 > 2");
        assert_eq!(miss.fitting, 2);
        assert!(miss.permanent);
    }

    #[test]
    fn exclusivity_holds_both_ways() {
        let node = NodeGpus::new(vec![gpu(0, "A10", 24)]);
        let mut scratch = Scratch::default();
        let whole = request(vec![container("w", ContainerKind::App, 1, 1, 100)]);
        let miss = place_pod(
            &node,
            &[used(1, 0, 1)],
            &whole,
            GpuPolicy::FewestTasks,
            &mut scratch,
        )
        .expect_err("busy");
        assert_eq!(
            miss.problems,
            vec![(0, GpuProblem::NeedsWholeGpu { tasks: 1 })]
        );
        assert!(!miss.permanent);
        let small = request(vec![container("s", ContainerKind::App, 1, 0, 0)]);
        let held = Usage {
            exclusive: true,
            ..used(1, 100, 1)
        };
        let miss = place_pod(&node, &[held], &small, GpuPolicy::FewestTasks, &mut scratch)
            .expect_err("held");
        assert_eq!(miss.problems, vec![(0, GpuProblem::HeldExclusively)]);
        place_pod(
            &node,
            &[Usage::default()],
            &whole,
            GpuPolicy::FewestTasks,
            &mut scratch,
        )
        .expect("empty GPU");
    }

    #[test]
    fn init_containers_do_not_add_up_with_the_others() {
        let node = NodeGpus::new(vec![gpu(0, "A10", 24)]);
        let mut scratch = Scratch::default();
        let req = request(vec![
            container("setup", ContainerKind::Init, 1, 20, 100),
            container("main", ContainerKind::App, 1, 20, 50),
        ]);
        place_pod(
            &node,
            &[Usage::default()],
            &req,
            GpuPolicy::FewestTasks,
            &mut scratch,
        )
        .expect("init runs before main");
        assert_eq!(scratch.grants.len(), 2);
        assert_eq!(
            scratch.after[0],
            used(20, 50, 1),
            "only main counts once running"
        );
        // A sidecar runs alongside both.
        let req = request(vec![
            container("proxy", ContainerKind::Sidecar, 1, 8, 10),
            container("setup", ContainerKind::Init, 1, 20, 10),
        ]);
        let miss = place_pod(
            &node,
            &[Usage::default()],
            &req,
            GpuPolicy::FewestTasks,
            &mut scratch,
        )
        .expect_err("8 + 20 > 24");
        assert_eq!(miss.container, 1);
    }

    #[test]
    fn problems_read_like_sentences() {
        let mut small = gpu(1, "Tesla T4", 16);
        small.uuid = "GPU-5e1f".into();
        let mut sick = gpu(2, "Tesla T4", 16);
        sick.healthy = false;
        let node = NodeGpus::new(vec![small, sick]);
        let req = request(vec![container("train", ContainerKind::App, 1, 4, 30)]);
        let mut scratch = Scratch::default();
        let miss = place_pod(
            &node,
            &[used(14, 0, 1), Usage::default()],
            &req,
            GpuPolicy::FewestTasks,
            &mut scratch,
        )
        .expect_err("full");
        let text = explain(&node, &req, &miss);
        assert_eq!(
            text,
            "container \"train\" needs 1 GPU with 4096 MiB and 30 percent compute each; none of the node's 2 GPUs can take it: \
             GPU-5e1f has 2048 MiB free, container needs 4096 MiB; GPU-2 is unhealthy"
        );
        assert!(!miss.permanent, "memory can be freed by eviction");
    }

    #[test]
    fn node_load_averages_memory_and_compute() {
        let node = NodeGpus::new(vec![gpu(0, "A10", 10), gpu(1, "A10", 10)]);
        assert_eq!(node_load(&node, &[Usage::default(); 2]), 0.0);
        let load = node_load(&node, &[used(10, 100, 1), Usage::default()]);
        assert!((load - 0.5).abs() < 1e-9, "{load}");
    }
}
