//! Where a pod's containers go on one node's GPUs.

use crate::cache::gpus::{HotGpu, NodeGpus, Usage};
use crate::placement::fit::gpu_check::{check_gpu, Miss, ModelVerdicts};
use crate::placement::fit::load::expected_percent;
use vgpu_cluster::policy::GpuPolicy;
use vgpu_cluster::requests::{ContainerKind, ContainerRequest, PodRequest};

/// One vGPU granted: container `container` (index into the request) gets
/// GPU `gpu` (index into the node's GPUs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub container: usize,
    pub gpu: usize,
    pub memory_bytes: u64,
    pub cores: u32,
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
        matching += u32::from(gpu.in_service() && verdict.is_ok());
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

/// A well-spread 64-bit hash of `value` (splitmix64's finaliser).
fn mix(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
