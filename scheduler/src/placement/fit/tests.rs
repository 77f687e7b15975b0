//! Placement on one node's GPUs: policies, topology, exclusivity, init
//! containers, and the reasons a container does not fit.

use super::gpu_check::*;
use super::load::*;
use super::packing::*;
use crate::cache::gpus::{NodeGpus, Usage};
use vgpu_cluster::decision::InventoryGpu;
use vgpu_cluster::policy::GpuPolicy;
use vgpu_cluster::requests::{ContainerKind, ContainerRequest, MemoryRequest, PodRequest};

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
    let miss = place_pod(&node, &base, &req, GpuPolicy::Binpack, &mut scratch).expect_err("3 > 2");
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
    let miss =
        place_pod(&node, &[held], &small, GpuPolicy::FewestTasks, &mut scratch).expect_err("held");
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
