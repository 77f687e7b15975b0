//! A container a node set up: its limits come from the node's grant,
//! mounted read-only in the container, whatever its processes' environment
//! says or its region holds. Each test is an attack from inside such a
//! container (made on the host from the node agent's own plan,
//! `vgpu_testkit::node_container`), on the simulated GPU, with a grant of
//! 1 GiB on an 8 GiB device; before the shim read the grant, each got past
//! its cap (see docs/threat-model.md).

use std::process::Command;
use std::sync::atomic::Ordering;
use vgpu_node_contract::region::{Region, UtilizationPolicy, SHARE_UNLIMITED, UNCAPPED};
use vgpu_testkit::node_container::NodeContainer;
use vgpu_testkit::*;

const POD: &str = "3f9c1e2a-7b4d-4c6e-9a8b-1d2e3f4a5b6c";
const CHUNK: &str = "67108864";
/// 64 MiB chunks under a 1 GiB grant, one context charged 64 MiB.
const CHUNKS_UNDER_THE_GRANT: i128 = 15;

/// The simulated GPU's UUID, as NVML gives it.
/// A sandbox and a container the node prepared on its GPU: 1 GiB, 30 %.
fn container(name: &str) -> (Sandbox, NodeContainer) {
    let sandbox = Sandbox::new(name, 1, "8Gi");
    let uuid = sandbox.gpu_uuid();
    let root = unique_temp_dir(&format!("{name}-containers"));
    let node = NodeContainer::prepare(&root, POD, "main", &[(&uuid, 1 << 30, 30)]);
    (sandbox, node)
}

/// Fills the device in 64 MiB chunks from inside the container, the
/// command changed by `attack` first.
fn fill(sandbox: &Sandbox, node: &NodeContainer, attack: impl FnOnce(&mut Command)) -> i128 {
    let mut command = sandbox.probe("dlsym", &["fill", CHUNK]);
    node.give_env(&mut command);
    attack(&mut command);
    let values = key_values(&run_ok(&mut node.wrap(&command)));
    assert_eq!(
        number(&values, "refusal"),
        2,
        "refused by the cap: {values:?}"
    );
    number(&values, "chunks")
}

#[test]
fn a_process_of_a_node_container_is_held_to_its_grant() {
    let (sandbox, node) = container("grant");
    assert_eq!(fill(&sandbox, &node, |_| {}), CHUNKS_UNDER_THE_GRANT);
}

#[test]
fn with_every_shim_variable_unset_a_process_is_still_held_to_its_grant() {
    let (sandbox, node) = container("unset");
    let chunks = fill(&sandbox, &node, |command| {
        for key in node.plan.envs.keys() {
            command.env_remove(key);
        }
        for key in [
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            "CUDA_DEVICE_MEMORY_LIMIT",
            "CUDA_DEVICE_SM_LIMIT",
            "GPU_CORE_UTILIZATION_POLICY",
            "VGPU_CONTEXT_RESERVE",
        ] {
            command.env_remove(key);
        }
    });
    assert_eq!(chunks, CHUNKS_UNDER_THE_GRANT);
}

#[test]
fn a_region_and_limits_of_its_own_change_nothing() {
    let (sandbox, node) = container("own-region");
    let own = unique_temp_dir("own-region-file").join("mine");
    let chunks = fill(&sandbox, &node, |command| {
        command
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &own)
            .env("CUDA_DEVICE_MEMORY_LIMIT", "6g")
            .env("CUDA_DEVICE_MEMORY_LIMIT_0", "6g");
    });
    assert_eq!(chunks, CHUNKS_UNDER_THE_GRANT);
    assert!(!own.exists(), "no region of its own was made");
}

#[test]
fn a_context_reserve_of_zero_and_policy_disable_are_not_followed() {
    let (sandbox, node) = container("reserve");
    let chunks = fill(&sandbox, &node, |command| {
        command
            .env("VGPU_CONTEXT_RESERVE", "0")
            .env("GPU_CORE_UTILIZATION_POLICY", "disable");
    });
    assert_eq!(chunks, CHUNKS_UNDER_THE_GRANT, "the context is charged");
}

#[test]
fn limits_rewritten_in_the_region_from_inside_change_nothing() {
    let (sandbox, node) = container("rewritten");
    // The region is the container's to write: it lifts every limit its
    // copy holds, as a process inside it can.
    let region = Region::open_existing(node.region()).expect("the region");
    let own = &region.layout().limits;
    own.policy
        .store(UtilizationPolicy::Disable as u32, Ordering::Relaxed);
    own.devices[0]
        .memory_limit
        .store(UNCAPPED, Ordering::Relaxed);
    own.devices[0]
        .sm_effective
        .store(SHARE_UNLIMITED, Ordering::Relaxed);
    own.devices[0].sm_limit.store(0, Ordering::Relaxed);
    assert_eq!(fill(&sandbox, &node, |_| {}), CHUNKS_UNDER_THE_GRANT);
}

#[test]
fn the_environment_may_lower_the_cap_for_its_process() {
    let (sandbox, node) = container("lower");
    let chunks = fill(&sandbox, &node, |command| {
        command.env("CUDA_DEVICE_MEMORY_LIMIT_0", "512m");
    });
    assert_eq!(chunks, 7, "512 MiB less the context's 64 MiB");
}

#[test]
fn a_grant_that_cannot_be_read_fails_closed() {
    let (sandbox, node) = container("unreadable");
    std::fs::write(node.grant(), b"not a grant").expect("overwrite the grant");
    let mut command = sandbox.probe("dlsym", &["fill", CHUNK]);
    node.give_env(&mut command);
    let output = node.wrap(&command).output().expect("run");
    let values = key_values(&output);
    assert!(
        !output.status.success() || values.get("chunks").map(String::as_str) == Some("0"),
        "no allocation without a readable grant: {values:?}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("grant from its node cannot be read"),
        "{stderr}"
    );
}
