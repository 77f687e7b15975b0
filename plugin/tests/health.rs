//! GPU health end to end: the plugin binary watches NVML events on the
//! simulated GPU; an XID injected into the simulated driver (its test hook)
//! makes the GPU's devices unhealthy in `ListAndWatch` and in the node
//! inventory, an application XID does not, and the GPU recovers after a
//! quiet window of good probes.
//!
//! Needs the workspace built first (`cargo build --workspace`), like every
//! test on the simulated GPU. One test only: this process configures its
//! own copy of the simulated driver (to inject) through its environment,
//! which the driver reads once.

mod support;

use std::ffi::{c_int, CString};
use std::time::Duration;
use support::kubelet::FakeKubelet;
use support::node::PluginNode;
use support::*;
use vgpu_testkit::simulated_gpu_library;

const WAIT: Duration = Duration::from_secs(15);

type Inject = unsafe extern "C" fn(c_int, u32) -> u64;

/// The simulated driver's XID hook, working on `node`'s simulated GPU.
fn injector(node: &PluginNode, devices: u32, memory: &str) -> Inject {
    std::env::set_var("SIMGPU_STATE", &node.sandbox.sim_state);
    std::env::set_var("SIMGPU_DEVICES", devices.to_string());
    std::env::set_var("SIMGPU_MEMORY", memory);
    std::env::set_var("SIMGPU_UUID_SEED", &node.name);
    let path = CString::new(simulated_gpu_library().display().to_string()).expect("path");
    // SAFETY: dlopen with a valid C string; the handle is kept for the
    // process's life.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!handle.is_null(), "dlopen libsimgpu.so");
    // SAFETY: valid handle and symbol name.
    let symbol = unsafe { libc::dlsym(handle, c"simgpu_inject_xid".as_ptr()) };
    assert!(
        !symbol.is_null(),
        "libsimgpu.so has no simgpu_inject_xid: rebuild the workspace"
    );
    // SAFETY: the symbol is the hook, with this C signature.
    unsafe { std::mem::transmute::<*mut libc::c_void, Inject>(symbol) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_on_the_simulated_gpu_makes_its_devices_unhealthy_until_it_recovers() {
    let api = ControlPlane::start().await;
    api.add_node("gpu-node").await;
    let mut node = PluginNode::new(
        "gpu-node",
        2,
        "8Gi",
        &api.source(),
        &[
            "--health-probe-ms",
            "100",
            "--health-recovery-seconds",
            "1",
            "--split-count",
            "4",
        ],
    );
    node.start();
    let mut kubelet = FakeKubelet::start(&node.plugin_dir);
    let registration = kubelet.next_registration(WAIT).await;
    let mut conn = kubelet.connect(&registration).await;
    let devices = conn.wait_devices(WAIT, |list| list.len() == 8).await;
    assert!(devices.iter().all(|d| d.health == "Healthy"));
    let listed = eventually(WAIT, "the inventory", || async {
        api.inventory("gpu-node").await
    })
    .await;
    assert_eq!(listed.gpus.len(), 2);
    assert_eq!(listed.gpus[0].memory_bytes, 8 * GIB);
    assert_eq!(listed.gpus[0].sm_count, 132);
    assert_eq!(listed.gpus[0].split_count, 4);
    let gpu1 = listed.gpus[1].uuid.clone();
    assert!(devices[4].id.starts_with(&gpu1));
    eventually(WAIT, "the plugin to watch NVML events", || async {
        node.log_text()
            .contains("watching NVML events")
            .then_some(())
    })
    .await;

    let inject = injector(&node, 2, "8Gi");
    // An application error (XID 13) leaves the GPU healthy.
    // SAFETY: the hook takes a device index and an XID.
    assert_ne!(unsafe { inject(1, 13) }, u64::MAX);
    eventually(WAIT, "the plugin to see XID 13", || async {
        node.log_text()
            .contains("XID 13 (an application error")
            .then_some(())
    })
    .await;
    // A GPU error (XID 79, fallen off the bus) does not.
    // SAFETY: as above.
    assert_ne!(unsafe { inject(1, 79) }, u64::MAX);
    conn.wait_devices(WAIT, |list| {
        list.iter()
            .all(|d| (d.health == "Unhealthy") == d.id.starts_with(&gpu1))
    })
    .await;
    eventually(WAIT, "the inventory to show the fault", || async {
        api.inventory("gpu-node")
            .await
            .filter(|i| !i.gpus[1].healthy && i.gpus[0].healthy)
    })
    .await;
    let log = node.log_text();
    assert!(log.contains("is unhealthy: XID 79"), "{log}");

    // A second fault while unhealthy keeps it so; then, a quiet second of
    // good probes later, it is healthy again.
    // SAFETY: as above.
    assert_ne!(unsafe { inject(1, 48) }, u64::MAX);
    conn.wait_devices(Duration::from_secs(10), |list| {
        list.iter().all(|d| d.health == "Healthy")
    })
    .await;
    eventually(WAIT, "the inventory to show the recovery", || async {
        api.inventory("gpu-node")
            .await
            .filter(|i| i.gpus.iter().all(|g| g.healthy))
    })
    .await;
    assert!(node.running());
    let status = node.terminate();
    assert!(status.success(), "clean exit on SIGTERM: {status}");
    assert!(!node.plugin_dir.join("vgpu.sock").exists());
}
