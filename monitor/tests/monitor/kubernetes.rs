//! Names and cleanup through the Kubernetes API: the monitor binary talks
//! to a real API server (etcd and kube-apiserver, one per test) through the
//! kube client (list, then watch, the pods bound to its node); the test
//! creates, binds and deletes the pods.

use crate::common::*;
use std::time::Duration;
use vgpu_node_contract::region::RegionLimits;

const NODE: &str = "gpu-node-3";
/// UIDs of pods no API server knows.
const UID_GONE: &str = "aa11bb22-cc33-4d44-8e55-66ff77008899";
const UID_BUSY: &str = "b0b0b0b0-1111-4222-8333-444455556666";

fn with_uuid(host: &HostDir, key: &str) -> vgpu_node_contract::region::Region {
    let region = host.create_region(key, &RegionLimits::default());
    region.set_device_uuid(0, "GPU-k8s");
    region
}

/// How the monitor reaches the API server.
enum ApiArg<'a> {
    /// A real one, through its kubeconfig.
    Kubeconfig(&'a str),
    /// A URL (nothing listening there).
    Url(&'a str),
}

/// The monitor binary on `host`'s regions, without NVML, naming pods
/// through the API.
fn monitor_with_api(host: &HostDir, api: ApiArg, extra: &[&str]) -> MonitorProcess {
    let root = host.root.to_str().expect("utf8");
    let (flag, value) = match api {
        ApiArg::Kubeconfig(path) => ("--kubeconfig", path),
        ApiArg::Url(url) => ("--apiserver-url", url),
    };
    let mut args = vec![
        "--containers-dir",
        root,
        "--no-nvml",
        flag,
        value,
        "--node-name",
        NODE,
    ];
    args.extend_from_slice(extra);
    MonitorProcess::start(MonitorProcess::command(), &args)
}

/// The watches on pods across namespaces open at the API server now (its
/// own informers have some).
fn pod_watches(api: &KubeApi) -> f64 {
    let labels = [
        ("resource", "pods"),
        ("scope", "cluster"),
        ("verb", "WATCH"),
    ];
    value(
        &api.server_metrics(),
        "apiserver_longrunning_requests",
        &labels,
    )
    .unwrap_or(0.0)
}

#[test]
fn pods_are_named_from_the_api_and_deleted_pods_cleaned_up() {
    let host = HostDir::new("k8s");
    let api = KubeApi::start();
    api.add_namespace("team-a");
    api.add_node(NODE);
    api.add_node("gpu-node-4");
    let uid_named = api.add_bound_pod(
        "team-a",
        "trainer-0",
        NODE,
        decision_annotations(NODE, "main", 0),
    );
    // A pod of another node, with a region here (as if left from a pod of
    // that UID): the API knows it, but not as one of this node's pods.
    let uid_elsewhere = api.add_bound_pod(
        "team-a",
        "trainer-1",
        "gpu-node-4",
        decision_annotations("gpu-node-4", "main", 0),
    );
    let named = with_uuid(&host, &format!("{uid_named}_main"));
    drop(named); // no process of its own: may go once its pod does
    let gone = with_uuid(&host, &format!("{UID_GONE}_main"));
    drop(gone);
    let elsewhere = with_uuid(&host, &format!("{uid_elsewhere}_main"));
    drop(elsewhere);
    // A pod the API does not know, but with a live process: kept.
    let busy = with_uuid(&host, &format!("{UID_BUSY}_main"));
    let _slot = charge(&busy, 0, 0, 0, MIB);

    let watches_before = pod_watches(&api);
    let monitor = monitor_with_api(
        &host,
        ApiArg::Kubeconfig(api.kubeconfig()),
        &["--cleanup-grace-seconds", "1"],
    );
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
    // The monitor follows its pods with a watch (a long-running request,
    // across namespaces): the API server counts the watches open on pods,
    // and has one more than its own informers' while the monitor runs.
    // (Which node's pods it asks for is checked by what it cleans up.)
    let monitor_watch = wait_for(Duration::from_secs(10), || {
        (pod_watches(&api) == watches_before + 1.0).then_some(())
    });
    assert!(
        monitor_watch.is_some(),
        "{} watches on pods, {watches_before} before the monitor",
        pod_watches(&api)
    );

    // The pods the API does not know go after the grace period, and so
    // does the one on another node (only this node's pods are asked for:
    // a list of every pod would have it); the one with a live process
    // stays.
    for uid in [UID_GONE, uid_elsewhere.as_str()] {
        let dir = host.root.join(format!("{uid}_main"));
        assert!(
            wait_for(Duration::from_secs(10), || (!exists(&dir)).then_some(())).is_some(),
            "{} was not removed:\n{}",
            dir.display(),
            monitor.log()
        );
    }
    assert!(exists(&host.root.join(format!("{UID_BUSY}_main"))));
    assert!(exists(&host.root.join(format!("{uid_named}_main"))));

    // The named pod is deleted: its directory goes too.
    api.delete_pod("team-a", "trainer-0");
    let named_dir = host.root.join(format!("{uid_named}_main"));
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
    let monitor = monitor_with_api(&host, ApiArg::Url(&url), &["--cleanup-grace-seconds", "1"]);
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
    let api = KubeApi::start();
    api.add_namespace("team-a");
    api.add_node(NODE);
    let uid = api.add_bound_pod(
        "team-a",
        "trainer-0",
        NODE,
        decision_annotations(NODE, "main", 1),
    );
    // The container wrote itself a 90 % share on its GPU (decided: 30 %)
    // and claims a second GPU it was never given.
    let mut limits = RegionLimits::default();
    limits.sm_limit[0] = 90;
    limits.sm_limit[1] = 50;
    let region = host.create_region(&format!("{uid}_main"), &limits);
    region.set_device_uuid(0, "GPU-k8s");
    region.set_device_uuid(1, "GPU-stolen");
    let _slot = charge(&region, 0, 0, 0, MIB);

    let monitor = monitor_with_api(&host, ApiArg::Kubeconfig(api.kubeconfig()), &[]);
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
