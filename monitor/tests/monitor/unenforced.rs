//! A process that skips the shim while its container's region exists is
//! seen: exported per GPU and per container, logged once, and recorded as
//! an Event on its pod. Both processes run in a PID namespace of their own,
//! as in a pod, on the simulated GPU (which, like NVML, lists host PIDs).

use crate::common::*;
use std::process::Child;
use std::sync::atomic::Ordering;
use std::time::Duration;
use vgpu_node_contract::region::Region;
use vgpu_testkit::namespaces::{
    forked_child, in_new_pid_namespace, in_new_pid_namespace_with_own_proc, in_pid_namespace_of,
};
use vgpu_testkit::{programs_dir, spawn_until_ready, Sandbox};

/// The pod of the test without an API server (no pod to name it).
const UID: &str = "5b2e8f0a-1c3d-4e5f-8a9b-0c1d2e3f4a5b";
const NODE: &str = "gpu-node-7";

/// A simulated GPU and the container `<uid>_main` on `host`: its region
/// path, a 4 GiB cap.
fn container(host: &HostDir, uid: &str, name: &str) -> (Sandbox, std::path::PathBuf) {
    let region = host.region_path(&format!("{uid}_main"));
    let mut sandbox = Sandbox::new(name, 1, "16Gi");
    sandbox
        .set(
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            &region.display().to_string(),
        )
        .set("CUDA_DEVICE_MEMORY_LIMIT", "4Gi");
    (sandbox, region)
}

fn release(mut child: Child) {
    drop(child.stdin.take());
    assert!(child.wait().expect("exit").success());
}

#[test]
fn a_process_without_the_shim_is_exported_logged_once_and_recorded_on_its_pod() {
    let host = HostDir::new("unenforced");
    let api = KubeApi::start();
    api.add_namespace("team-b");
    api.add_node(NODE);
    let uid = api.add_bound_pod("team-b", "trainer-1", NODE, Default::default());
    let (sandbox, _) = container(&host, &uid, "unenforced");

    // The container's process under the shim, in its own PID namespace.
    let enforced = spawn_until_ready(&mut in_new_pid_namespace(
        &sandbox.probe("linked", &["hold", &(256 * MIB).to_string()]),
    ));
    let enforced_pid = forked_child(enforced.id());
    // Another process of the same container that skipped the preload.
    let mut bare = sandbox.command_without_shim(&programs_dir().join("probe_linked"));
    bare.args(["linked", "hold", &(512 * MIB).to_string()]);
    let skipped = spawn_until_ready(&mut in_pid_namespace_of(enforced_pid, &bare));
    let skipped_pid = forked_child(skipped.id());

    let monitor = MonitorProcess::on_simulated_gpu(
        &sandbox,
        &host,
        &["--kubeconfig", api.kubeconfig(), "--node-name", NODE],
    );
    let container = [
        ("namespace", "team-b"),
        ("pod", "trainer-1"),
        ("container", "main"),
    ];
    let samples = monitor.wait_for_metrics(Duration::from_secs(15), |samples| {
        (value(samples, "vgpu_container_unenforced_processes", &container) == Some(1.0))
            .then(|| samples.to_vec())
    });
    let gpu = [("device_index", "0")];
    assert_eq!(
        value(&samples, "vgpu_gpu_unenforced_processes", &gpu),
        Some(1.0),
        "only the process without the shim is unaccounted"
    );
    let held = value(&samples, "vgpu_gpu_unenforced_memory_bytes", &gpu).expect("memory");
    assert!(held >= (512 * MIB) as f64, "{held}");
    assert_eq!(
        value(
            &samples,
            "vgpu_container_unenforced_memory_bytes",
            &container
        ),
        Some(held)
    );

    // Logged once, however many passes see it; an Event on the pod, which
    // the API server accepted (it validates Events on creation).
    let event = wait_for(Duration::from_secs(10), || {
        api.events("team-b")
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("UnenforcedGPUProcess"))
    })
    .unwrap_or_else(|| {
        panic!(
            "no Event recorded: {:?}\n{}",
            api.events("team-b"),
            monitor.log()
        )
    });
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert_eq!(event.involved_object.kind.as_deref(), Some("Pod"));
    assert_eq!(event.involved_object.name.as_deref(), Some("trainer-1"));
    assert_eq!(event.involved_object.uid.as_deref(), Some(uid.as_str()));
    let message = event.message.as_deref().expect("message");
    assert!(
        message.contains(&format!("process {skipped_pid} ")),
        "{message}"
    );
    let generation = monitor.scrape();
    monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        (samples != generation.as_slice()).then_some(())
    });
    let log = monitor.log();
    assert_eq!(
        log.matches("without the vgpu shim").count(),
        1,
        "logged once:\n{log}"
    );
    assert!(!log.contains(&format!("process {enforced_pid} ")), "{log}");

    // Once it is gone, nothing is unaccounted.
    release(skipped);
    monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        (value(samples, "vgpu_gpu_unenforced_processes", &gpu) == Some(0.0)).then_some(())
    });
    release(enforced);
}

#[test]
fn a_shim_process_that_cannot_see_its_host_pid_is_found_by_its_region_and_not_reported() {
    let host = HostDir::new("own-proc");
    let (sandbox, region_path) = container(&host, UID, "own-proc");
    // With its own /proc the process sees itself only as PID 1.
    let enforced = spawn_until_ready(&mut in_new_pid_namespace_with_own_proc(
        &sandbox.probe("linked", &["hold", &(256 * MIB).to_string()]),
    ));
    let host_pid = forked_child(enforced.id());
    let region = Region::open_existing(&region_path).expect("region");
    let slot = region.active_slots().next().expect("the holder's slot");
    let recorded = || region.layout().slots[slot].host_pid.load(Ordering::Relaxed);
    assert_eq!(
        recorded(),
        1,
        "the shim could only record what its /proc shows"
    );

    let monitor = MonitorProcess::on_simulated_gpu(&sandbox, &host, &["--no-kubernetes"]);
    // The monitor finds it by the region it maps and records its host PID.
    assert!(
        wait_for(Duration::from_secs(10), || (recorded() == host_pid)
            .then_some(()))
        .is_some(),
        "host PID {host_pid} never recorded (slot says {}):\n{}",
        recorded(),
        monitor.log()
    );
    let samples = monitor.scrape();
    assert_eq!(
        value(
            &samples,
            "vgpu_gpu_unenforced_processes",
            &[("device_index", "0")]
        ),
        Some(0.0)
    );
    assert!(
        !monitor.log().contains("without the vgpu shim"),
        "{}",
        monitor.log()
    );
    release(enforced);
}
