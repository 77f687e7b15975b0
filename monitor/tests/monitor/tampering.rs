//! A region is writable by the container it limits. A container that raises
//! its own cap, share and policy gets what its decision granted back within
//! a pass; the memory it took above the granted cap meanwhile is reported
//! (restoring the cap frees nothing), with an Event on its pod.

use crate::common::*;
use std::sync::atomic::Ordering;
use std::time::Duration;
use vgpu_node_contract::region::UtilizationPolicy;
use vgpu_node_contract::region::{MemoryKind, RegionLimits, SHARE_UNLIMITED};

const NODE: &str = "gpu-node-5";
/// The pod of the test without an API server (no pod to name it).
const UID: &str = "7c6b5a49-3827-4165-9f0e-d1c2b3a4f5e6";

/// The region of container `main` of pod `namespace/pod`, bound to NODE
/// with the decision `decision_annotations` writes, created as the device
/// plugin creates it with `granted`; with the pod's UID.
fn granted_region(
    host: &HostDir,
    api: &KubeApi,
    namespace: &str,
    pod: &str,
    granted: &RegionLimits,
) -> (String, vgpu_node_contract::region::Region) {
    api.add_namespace(namespace);
    api.add_node(NODE);
    let uid = api.add_bound_pod(namespace, pod, NODE, decision_annotations(NODE, "main", 2));
    let region = host.create_region(&format!("{uid}_main"), granted);
    region.set_device_uuid(0, "GPU-k8s");
    (uid, region)
}

/// The monitor over `host`'s containers as NODE's, naming pods through `api`.
fn monitor_on(host: &HostDir, api: &KubeApi) -> MonitorProcess {
    monitor_with(host, api, &[])
}

/// The monitor on `host`'s regions with the API, and `more` flags.
fn monitor_with(host: &HostDir, api: &KubeApi, more: &[&str]) -> MonitorProcess {
    let root = host.root.to_str().expect("utf8");
    let mut args = vec![
        "--containers-dir",
        root,
        "--no-nvml",
        "--kubeconfig",
        api.kubeconfig(),
        "--node-name",
        NODE,
        "--no-arbitration",
    ];
    args.extend_from_slice(more);
    MonitorProcess::start(MonitorProcess::command(), &args)
}

#[test]
fn limits_changed_from_inside_are_restored_and_the_memory_over_the_cap_reported() {
    let host = HostDir::new("tampering");
    let api = KubeApi::start();
    // Created as the device plugin creates it for the decision (4 GiB, 30 %).
    let mut granted = RegionLimits::default();
    granted.memory_limit[0] = 4 * GIB;
    granted.sm_limit[0] = 30;
    granted.priority = 2;
    let (uid, region) = granted_region(&host, &api, "team-c", "tuner-0", &granted);

    // From inside: the cap raised to 64 GiB, no compute cap, 6 GiB taken.
    let device = &region.layout().limits.devices[0];
    device.memory_limit.store(64 * GIB, Ordering::Relaxed);
    device.sm_limit.store(0, Ordering::Relaxed);
    device.sm_burst.store(100, Ordering::Relaxed);
    device
        .sm_effective
        .store(SHARE_UNLIMITED, Ordering::Relaxed);
    region
        .layout()
        .limits
        .policy
        .store(UtilizationPolicy::Disable as u32, Ordering::Relaxed);
    let slot = charge(&region, 0, 0, 0, 6 * GIB);

    let monitor = monitor_on(&host, &api);
    let labels = [
        ("namespace", "team-c"),
        ("pod", "tuner-0"),
        ("container", "main"),
    ];
    let samples = monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        (value(samples, "vgpu_container_limits_restored_total", &labels) == Some(1.0))
            .then(|| samples.to_vec())
    });
    assert_eq!(
        region.limits(),
        granted.as_stored(),
        "the decision's limits are back"
    );
    assert_eq!(device.sm_effective.load(Ordering::Relaxed), 3000);
    let device_labels = [
        ("namespace", "team-c"),
        ("pod", "tuner-0"),
        ("container", "main"),
        ("device_index", "0"),
    ];
    assert_eq!(
        value(
            &samples,
            "vgpu_container_memory_over_cap_bytes",
            &device_labels
        ),
        Some((2 * GIB) as f64)
    );
    // The restored cap holds for what comes next.
    assert!(region
        .reserve(slot, 0, MemoryKind::Data, MIB)
        .expect("io")
        .is_err());

    // Both recorded on the pod: accepted by the API server, which
    // validates an Event (its object, reason, type, source) on creation.
    let reasons = ["RegionLimitsChanged", "MemoryOverCap"];
    let events = wait_for(Duration::from_secs(10), || {
        let events = api.events("team-c");
        reasons
            .iter()
            .all(|reason| events.iter().any(|e| e.reason.as_deref() == Some(reason)))
            .then_some(events)
    })
    .unwrap_or_else(|| {
        panic!(
            "Events not recorded: {:?}\n{}",
            api.events("team-c"),
            monitor.log()
        )
    });
    for event in &events {
        let object = &event.involved_object;
        assert_eq!(object.kind.as_deref(), Some("Pod"), "{event:?}");
        assert_eq!(object.name.as_deref(), Some("tuner-0"), "{event:?}");
        assert_eq!(object.uid.as_deref(), Some(uid.as_str()), "{event:?}");
        assert_eq!(event.type_.as_deref(), Some("Warning"), "{event:?}");
        let source = event.source.as_ref().expect("source");
        assert_eq!(source.component.as_deref(), Some("vgpu-monitor"));
        assert_eq!(source.host.as_deref(), Some(NODE));
    }

    // Changed again: restored again, counted, logged once.
    device.memory_limit.store(64 * GIB, Ordering::Relaxed);
    monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        (value(samples, "vgpu_container_limits_restored_total", &labels) == Some(2.0)).then_some(())
    });
    assert_eq!(device.memory_limit.load(Ordering::Relaxed), 4 * GIB);
    let log = monitor.log();
    assert_eq!(
        log.matches("changed the limits in its region").count(),
        1,
        "{log}"
    );

    // Once the container frees what it took above the cap, nothing is over.
    region
        .release(slot, 0, MemoryKind::Data, 3 * GIB)
        .expect("release");
    monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        (value(
            samples,
            "vgpu_container_memory_over_cap_bytes",
            &device_labels,
        ) == Some(0.0))
        .then_some(())
    });
}

#[test]
fn without_a_decision_nothing_is_restored() {
    let host = HostDir::new("tampering-no-decision");
    let mut limits = RegionLimits::default();
    limits.memory_limit[0] = 4 * GIB;
    let region = host.create_region(&format!("{UID}_main"), &limits);
    region.set_device_uuid(0, "GPU-k8s");
    region.layout().limits.devices[0]
        .memory_limit
        .store(8 * GIB, Ordering::Relaxed);
    let monitor = MonitorProcess::start(
        MonitorProcess::command(),
        &[
            "--containers-dir",
            host.root.to_str().expect("utf8"),
            "--no-nvml",
            "--no-kubernetes",
        ],
    );
    let generation = monitor.scrape();
    monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        (samples != generation.as_slice()).then_some(())
    });
    // No decision to hold it to (no API): the region is left as it is.
    assert_eq!(region.device_limit(0), 8 * GIB);
}

#[test]
fn on_a_scaled_node_the_cap_restored_is_the_grants_device_part() {
    let host = HostDir::new("tampering-scaled");
    let api = KubeApi::start();
    // A 4 GiB grant on a node at --device-memory-scaling 2 with a node-wide
    // --swap-limit of 1 GiB, created as the device plugin creates it: 2 GiB
    // on the device, 2 GiB of the grant plus the node's 1 GiB as swap.
    let mut granted = RegionLimits::default();
    granted.memory_limit[0] = 2 * GIB;
    granted.swap_limit[0] = 3 * GIB;
    granted.sm_limit[0] = 30;
    granted.priority = 2;
    let (_, region) = granted_region(&host, &api, "team-s", "scaled-0", &granted);

    // From inside: the whole grant moved onto the device, no swap, and
    // 3 GiB taken there.
    let device = &region.layout().limits.devices[0];
    device.memory_limit.store(4 * GIB, Ordering::Relaxed);
    device.swap_limit.store(0, Ordering::Relaxed);
    charge(&region, 0, 0, 0, 3 * GIB);

    let monitor = monitor_with(
        &host,
        &api,
        &["--swap-limit", "1g", "--device-memory-scaling", "2"],
    );
    let device_labels = [
        ("namespace", "team-s"),
        ("pod", "scaled-0"),
        ("container", "main"),
        ("device_index", "0"),
    ];
    let over = monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        value(
            samples,
            "vgpu_container_memory_over_cap_bytes",
            &device_labels,
        )
        .filter(|bytes| *bytes > 0.0)
    });
    // Over the device part (2 GiB), not over the grant (4 GiB).
    assert_eq!(over, GIB as f64);
    assert_eq!(
        region.limits(),
        granted.as_stored(),
        "the plugin's split is back"
    );
    assert_eq!(device.swap_limit.load(Ordering::Relaxed), 3 * GIB);
}

/// The extender resized the pod (a new decision, `vgpu.io/resize`): its
/// limits go into the region as the container's own, with a Normal Event,
/// and are not counted as a restoration. A cap lowered below what the
/// container holds frees nothing: the excess is reported, and the next
/// allocation refused.
#[test]
fn a_resized_decision_becomes_the_regions_limits_and_frees_nothing() {
    let host = HostDir::new("resized");
    let api = KubeApi::start();
    let mut granted = RegionLimits::default();
    granted.memory_limit[0] = 4 * GIB;
    granted.sm_limit[0] = 30;
    granted.priority = 2;
    let (_uid, region) = granted_region(&host, &api, "team-r", "server-0", &granted);
    let slot = charge(&region, 0, 0, 0, 3 * GIB);
    let monitor = monitor_on(&host, &api);
    let labels = [
        ("namespace", "team-r"),
        ("pod", "server-0"),
        ("container", "main"),
    ];
    monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        (value(samples, "vgpu_container_limits_restored_total", &labels) == Some(0.0)).then_some(())
    });

    // The extender's new decision, made later: 2 GiB (below the 3 GiB
    // held) at 10 %.
    let mut resized = decision_annotations(NODE, "main", 2);
    let text = resized
        .get(vgpu_cluster::decision::DECISION_ANNOTATION)
        .expect("decision")
        .replace(
            &format!("\"memoryBytes\":{}", 4 * GIB),
            &format!("\"memoryBytes\":{}", 2 * GIB),
        )
        .replace("\"coresPercent\":30", "\"coresPercent\":10")
        .replace("\"decidedUnixMs\":1,", "\"decidedUnixMs\":2,");
    resized.insert(
        vgpu_cluster::decision::DECISION_ANNOTATION.to_string(),
        text,
    );
    api.set_annotations("team-r", "server-0", resized);

    let device = &region.layout().limits.devices[0];
    wait_for(Duration::from_secs(10), || {
        (device.memory_limit.load(Ordering::Relaxed) == 2 * GIB
            && device.sm_limit.load(Ordering::Relaxed) == 10)
            .then_some(())
    })
    .unwrap_or_else(|| panic!("the region kept {:?}\n{}", region.limits(), monitor.log()));
    let samples = monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        let device_labels = [
            ("namespace", "team-r"),
            ("pod", "server-0"),
            ("container", "main"),
            ("device_index", "0"),
        ];
        (value(
            samples,
            "vgpu_container_memory_over_cap_bytes",
            &device_labels,
        ) == Some(GIB as f64))
        .then(|| samples.to_vec())
    });
    assert_eq!(
        value(&samples, "vgpu_container_limits_restored_total", &labels),
        Some(0.0),
        "a resize is not a restoration"
    );
    assert_eq!(region.device_used(0), 3 * GIB, "nothing freed");
    assert!(region
        .reserve(slot, 0, MemoryKind::Data, MIB)
        .expect("io")
        .is_err());
    let resized_event = wait_for(Duration::from_secs(10), || {
        api.events("team-r")
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("Resized"))
    })
    .unwrap_or_else(|| {
        panic!(
            "no Resized Event: {:?}\n{}",
            api.events("team-r"),
            monitor.log()
        )
    });
    assert_eq!(resized_event.type_.as_deref(), Some("Normal"));
    let log = monitor.log();
    assert!(!log.contains("changed the limits in its region"), "{log}");
}
