//! Names and cleanup through the Kubernetes API: the monitor binary talks
//! to an in-repo fake API server over real HTTP (the real kube client code
//! runs: list, then watch), serving a recorded pod list and pushing watch
//! events.

mod common;

use common::*;
use std::time::Duration;
use vgpu_node_contract::region::RegionLimits;

const NODE: &str = "gpu-node-3";
const UID_NAMED: &str = "3f2a1b0c-9d8e-4f7a-b6c5-d4e3f2a1b0c9";
const UID_GONE: &str = "aa11bb22-cc33-4d44-8e55-66ff77008899";
const UID_BUSY: &str = "b0b0b0b0-1111-4222-8333-444455556666";

fn with_uuid(host: &HostDir, key: &str) -> vgpu_node_contract::region::Region {
    let region = host.create_region(key, &RegionLimits::default());
    region.set_device_uuid(0, "GPU-k8s");
    region
}

/// The monitor binary on `host`'s regions, without NVML, naming pods
/// through the API at `api_url`.
fn monitor_with_api(host: &HostDir, api_url: &str, extra: &[&str]) -> MonitorProcess {
    let root = host.root.to_str().expect("utf8");
    let mut args = vec![
        "--containers-dir",
        root,
        "--no-nvml",
        "--apiserver-url",
        api_url,
        "--node-name",
        NODE,
    ];
    args.extend_from_slice(extra);
    MonitorProcess::start(MonitorProcess::command(), &args)
}

#[test]
fn pods_are_named_from_the_api_and_deleted_pods_cleaned_up() {
    let host = HostDir::new("k8s");
    let annotations = decision_annotations(NODE, "main", 0);
    let api = FakeApiServer::start(pod_list(
        NODE,
        &[(UID_NAMED, "team-a", "trainer-0", &annotations)],
    ));
    let named = with_uuid(&host, &format!("{UID_NAMED}_main"));
    drop(named); // no process of its own: may go once its pod does
    let gone = with_uuid(&host, &format!("{UID_GONE}_main"));
    drop(gone);
    // A pod the API does not list, but with a live process: kept.
    let busy = with_uuid(&host, &format!("{UID_BUSY}_main"));
    let _slot = charge(&busy, 0, 0, 0, MIB);

    let monitor = monitor_with_api(&host, &api.url(), &["--cleanup-grace-seconds", "1"]);
    let labels = [
        ("namespace", "team-a"),
        ("pod", "trainer-0"),
        ("container", "main"),
    ];
    monitor.wait_for_metrics(Duration::from_secs(10), |s| {
        value(s, "vgpu_container_memory_used_bytes", &labels).map(|_| ())
    });
    let samples = monitor.scrape();
    assert_eq!(
        value(&samples, "vgpu_monitor_kubernetes_api_up", &[]),
        Some(1.0)
    );
    assert_eq!(
        value(&samples, "vgpu_container_priority", &labels),
        Some(0.0),
        "the scheduler's decision overrides the priority in the region header"
    );
    let requests = api.requests.lock().expect("requests").clone();
    assert!(
        requests
            .iter()
            .any(|r| r.contains("fieldSelector=spec.nodeName%3Dgpu-node-3")),
        "only this node's pods are asked for: {requests:?}"
    );
    assert!(
        requests.iter().any(|r| r.contains("watch=true")),
        "{requests:?}"
    );

    // The pod the API does not know goes after the grace period; the one
    // with a live process stays.
    let gone_dir = host.root.join(format!("{UID_GONE}_main"));
    assert!(
        wait_for(Duration::from_secs(10), || (!exists(&gone_dir))
            .then_some(()))
        .is_some(),
        "{} was not removed:\n{}",
        gone_dir.display(),
        monitor.log()
    );
    assert!(exists(&host.root.join(format!("{UID_BUSY}_main"))));
    assert!(exists(&host.root.join(format!("{UID_NAMED}_main"))));

    // The named pod is deleted: its directory goes too.
    let object = pod_json(
        pod_template(),
        NODE,
        UID_NAMED,
        "team-a",
        "trainer-0",
        &annotations,
    );
    api.push_event("DELETED", &object);
    let named_dir = host.root.join(format!("{UID_NAMED}_main"));
    assert!(
        wait_for(Duration::from_secs(10), || (!exists(&named_dir))
            .then_some(()))
        .is_some(),
        "{} was not removed after its pod was deleted:\n{}",
        named_dir.display(),
        monitor.log()
    );
    monitor.wait_for_metrics(Duration::from_secs(5), |s| {
        value(s, "vgpu_container_memory_used_bytes", &labels)
            .is_none()
            .then_some(())
    });
    assert!(exists(&host.root.join(format!("{UID_BUSY}_main"))));
    drop(busy);
}

#[test]
fn without_the_api_names_fall_back_and_nothing_is_removed() {
    let host = HostDir::new("k8s-down");
    let region = with_uuid(&host, &format!("{UID_GONE}_main"));
    drop(region);
    // Nothing listens on this port.
    let url = format!("http://127.0.0.1:{}", free_port());
    let monitor = monitor_with_api(&host, &url, &["--cleanup-grace-seconds", "1"]);
    let labels = [("namespace", ""), ("pod", UID_GONE), ("container", "main")];
    monitor.wait_for_metrics(Duration::from_secs(10), |s| {
        (value(s, "vgpu_container_memory_used_bytes", &labels).is_some()
            && value(s, "vgpu_monitor_kubernetes_api_up", &[]) == Some(0.0))
        .then_some(())
    });
    // Sweeps are at least a second apart, so three more after this point
    // span more than the one-second grace: the monitor has had its chance
    // to remove the region.
    let sweeps = |s: &[Sample]| value(s, "vgpu_monitor_cleanup_sweeps_total", &[]);
    let seen = monitor.wait_for_metrics(Duration::from_secs(10), sweeps);
    monitor.wait_for_metrics(Duration::from_secs(15), |s| {
        sweeps(s).filter(|count| *count >= seen + 3.0)
    });
    assert!(
        exists(&host.root.join(format!("{UID_GONE}_main"))),
        "never delete on uncertainty"
    );
    assert!(monitor.log().contains("Kubernetes API unavailable"));
}

#[test]
fn the_decision_not_the_region_says_which_gpus_and_shares_a_container_has() {
    let host = HostDir::new("k8s-claims");
    let annotations = decision_annotations(NODE, "main", 1);
    let api = FakeApiServer::start(pod_list(
        NODE,
        &[(UID_NAMED, "team-a", "trainer-0", &annotations)],
    ));
    // The container wrote itself a 90 % share on its GPU (decided: 30 %)
    // and claims a second GPU it was never given.
    let mut limits = RegionLimits::default();
    limits.sm_limit[0] = 90;
    limits.sm_limit[1] = 50;
    let region = host.create_region(&format!("{UID_NAMED}_main"), &limits);
    region.set_device_uuid(0, "GPU-k8s");
    region.set_device_uuid(1, "GPU-stolen");
    let _slot = charge(&region, 0, 0, 0, MIB);

    let monitor = monitor_with_api(&host, &api.url(), &[]);
    let labels = [
        ("pod", "trainer-0"),
        ("container", "main"),
        ("device_uuid", "GPU-k8s"),
    ];
    let share = monitor.wait_for_metrics(Duration::from_secs(10), |s| {
        value(s, "vgpu_container_compute_share_ratio", &labels).filter(|v| *v < 0.5)
    });
    assert!((share - 0.30).abs() < 1e-9, "decided share: {share}");
    let text = monitor.scrape_text();
    assert!(
        !text.contains("GPU-stolen"),
        "a GPU the pod was not given shows up:\n{text}"
    );
    assert!(
        monitor.log().contains("the scheduler did not give it"),
        "{}",
        monitor.log()
    );
}
