//! Region files are written by containers: random bytes, mutated valid
//! regions, a file truncated under the monitor's mapping and a mutex held
//! forever must cost a log line, never a crash, a hang of the monitor's
//! loop, or another container's figures. (Debug builds check arithmetic
//! overflow, so these also prove the reader saturates.)

use crate::common::*;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher::Event;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vgpu_cluster::decision::{ContainerDecision, Decision, DeviceGrant, DECISION_ANNOTATION};
use vgpu_cluster::requests::RequestRules;
use vgpu_monitor::daemon::{Monitor, MonitorConfig};
use vgpu_monitor::metrics::Snapshot;
use vgpu_monitor::names::PodDirectory;
use vgpu_node_contract::region::UtilizationPolicy;
use vgpu_node_contract::region::DEFAULT_PRIORITY;
use vgpu_node_contract::region::{
    Region, RegionLimits, MAX_DEVICES, MAX_SLOTS, REGION_BYTES, SHARE_FULL,
};

const GOOD: &str = "u-good_c";

fn monitor(host: &HostDir) -> Monitor {
    let config = MonitorConfig {
        cleanup_grace: None,
        ..MonitorConfig::for_root(host.root.clone())
    };
    Monitor::new(config, PodDirectory::disabled())
}

/// A well-behaved neighbour whose figures must never change.
fn good_region(host: &HostDir) -> Region {
    let mut limits = RegionLimits::default();
    limits.memory_limit[0] = 8 * GIB;
    limits.sm_limit[0] = 40;
    let region = host.create_region(GOOD, &limits);
    region.set_device_uuid(0, "GPU-good");
    charge(&region, 0, MIB, 2 * MIB, 3 * MIB);
    region
}

fn assert_good_intact(snapshot: &Snapshot) {
    let good: Vec<_> = snapshot
        .devices
        .iter()
        .filter(|d| d.container == "c" && d.pod == "u-good")
        .collect();
    assert_eq!(good.len(), 1, "the good region is exported once");
    let figures = &good[0].figures;
    assert_eq!(figures.memory_used, 6 * MIB);
    assert_eq!(figures.memory_limit, 8 * GIB);
    assert_eq!(
        (figures.context, figures.module, figures.data),
        (MIB, 2 * MIB, 3 * MIB)
    );
    assert_eq!(figures.uuid, "GPU-good");
}

/// Checks a rendered exposition is bounded and parses.
fn assert_bounded(monitor: &Monitor) {
    let snapshot = monitor.shared().snapshot();
    assert!(snapshot.devices.len() <= 2 * MAX_DEVICES);
    for container in &snapshot.containers {
        assert!(container.processes <= MAX_SLOTS);
    }
    let text = monitor.shared().render_uncached();
    assert!(text.len() < 1 << 20, "exposition of {} bytes", text.len());
    let text = String::from_utf8(text).expect("utf8");
    let _ = parse_metrics(&text);
}

#[derive(Clone, Debug)]
enum Mutation {
    Byte(usize, u8),
    Word(usize, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    // Mostly the header, mutex, bitmap and device records (the first few
    // KiB), sometimes anywhere in the slot table.
    let hot = 0..8192usize;
    let anywhere = 0..REGION_BYTES;
    prop_oneof![
        (hot.clone(), any::<u8>()).prop_map(|(o, b)| Mutation::Byte(o, b)),
        (hot, any::<u64>()).prop_map(|(o, w)| Mutation::Word(o & !7, w)),
        (anywhere.clone(), any::<u8>()).prop_map(|(o, b)| Mutation::Byte(o, b)),
        (
            anywhere,
            prop_oneof![Just(u64::MAX), Just(0), Just(1 << 63), any::<u64>()]
        )
            .prop_map(|(o, w)| Mutation::Word(o & !7, w)),
    ]
}

fn apply(path: &std::path::Path, mutations: &[Mutation]) {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open for mutation");
    for m in mutations {
        match m {
            Mutation::Byte(offset, byte) => file.write_at(&[*byte], *offset as u64),
            Mutation::Word(offset, word) => {
                let end = (*offset + 8).min(REGION_BYTES);
                file.write_at(&word.to_le_bytes()[..end - offset], *offset as u64)
            }
        }
        .expect("mutate");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn mutated_regions_never_crash_the_monitor(mutations in proptest::collection::vec(mutation(), 1..64)) {
        let host = HostDir::new("mutated");
        let _good = good_region(&host);
        let mut limits = RegionLimits::default();
        limits.sm_limit[0] = 30;
        limits.sm_burst[0] = 80;
        let victim = host.create_region("u-bad_c", &limits);
        victim.set_device_uuid(0, "GPU-good");
        charge(&victim, 0, 1, 2, 3);
        drop(victim);
        apply(&host.root.join("u-bad_c/region.cache"), &mutations);
        let mut monitor = monitor(&host);
        for _ in 0..3 {
            monitor.tick();
        }
        assert_good_intact(&monitor.shared().snapshot());
        assert_bounded(&monitor);
    }

    #[test]
    fn random_files_never_crash_the_monitor(
        size in prop_oneof![Just(0usize), 1..4096usize, Just(REGION_BYTES - 1), Just(REGION_BYTES), Just(REGION_BYTES + 1)],
        seed in any::<u64>(),
    ) {
        let host = HostDir::new("random");
        let _good = good_region(&host);
        let mut state = seed | 1;
        let bytes: Vec<u8> = (0..size)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        std::fs::write(host.region_path("u-random_c"), &bytes).expect("write");
        let mut monitor = monitor(&host);
        monitor.tick();
        monitor.tick();
        let snapshot = monitor.shared().snapshot();
        assert_good_intact(&snapshot);
        prop_assert_eq!(snapshot.regions, 1, "only the good region is open");
        assert_bounded(&monitor);
    }
}

#[test]
fn every_field_at_its_extreme_is_clamped() {
    let host = HostDir::new("extreme");
    let _good = good_region(&host);
    let region = host.create_region("u-max_c", &RegionLimits::default());
    region.set_device_uuid(0, "GPU-good");
    charge(&region, 0, 1, 1, 1);
    let layout = region.layout();
    for word in &layout.active.words {
        word.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
    }
    for slot in layout.slots.iter() {
        slot.state.store(1, std::sync::atomic::Ordering::Relaxed);
        for device in &slot.devices {
            device
                .context
                .store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
            device
                .module
                .store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
            device
                .data
                .store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
        }
    }
    for (device, limits) in layout.devices.iter().zip(&layout.limits.devices) {
        for word in [
            &limits.memory_limit,
            &device.used,
            &device.swap_used,
            &device.peak_used,
            &device.oom_events,
            &device.compute.credited_ns,
            &device.compute.throttled_ns,
            &device.compute.launches,
            &device.compute.last_launch_at,
        ] {
            word.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
        }
        device
            .compute
            .tokens
            .store(i64::MIN, std::sync::atomic::Ordering::Relaxed);
        limits
            .sm_limit
            .store(u32::MAX, std::sync::atomic::Ordering::Relaxed);
        limits
            .sm_burst
            .store(u32::MAX, std::sync::atomic::Ordering::Relaxed);
    }
    layout
        .limits
        .priority
        .store(i32::MIN, std::sync::atomic::Ordering::Relaxed);
    let mut monitor = monitor(&host);
    for _ in 0..3 {
        monitor.tick();
    }
    let snapshot = monitor.shared().snapshot();
    assert_good_intact(&snapshot);
    let extreme = snapshot
        .devices
        .iter()
        .find(|d| d.pod == "u-max")
        .expect("the extreme region is read");
    assert_eq!(extreme.figures.context, u64::MAX, "sums saturate");
    assert!(extreme.utilization.is_none_or(|u| (0.0..=1.0).contains(&u)));
    assert_bounded(&monitor);
}

#[test]
fn a_region_truncated_under_the_mapping_is_dropped_not_fatal() {
    let host = HostDir::new("truncated");
    let _good = good_region(&host);
    let victim = host.create_region("u-trunc_c", &RegionLimits::default());
    victim.set_device_uuid(0, "GPU-good");
    // A live slot far into the file, so reading it touches a page the
    // truncation removes.
    let other = Region::open_existing(&host.region_path("u-trunc_c")).expect("handle");
    for pid in 0..600 {
        other.claim_slot(pid, 0).expect("slot");
    }
    drop(victim);
    let mut monitor = monitor(&host);
    monitor.tick();
    assert_eq!(monitor.shared().snapshot().regions, 2);
    let truncate = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open(host.root.join("u-trunc_c/region.cache"))
            .expect("open")
            .set_len(4096)
            .expect("truncate")
    };

    // Between the monitor's check of the file and its reads: the reads
    // fault (SIGBUS), which the guard turns into zeros.
    let mut discovery = vgpu_monitor::discovery::Discovery::new(monitor.config().discovery.clone());
    discovery.rescan(Instant::now());
    truncate();
    let region = discovery.get("u-trunc_c").expect("open");
    let figures = region.read();
    assert!(region.faulted(), "the read faulted and was caught");
    assert!(figures.devices.is_empty(), "the mapping now reads zeros");
    discovery.rescan(Instant::now());
    assert!(
        discovery.get("u-trunc_c").is_none(),
        "dropped on the next pass"
    );

    // Before the check: the monitor notices the new size and drops it.
    for _ in 0..2 {
        monitor.tick();
    }
    let snapshot = monitor.shared().snapshot();
    assert_eq!(snapshot.regions, 1, "the truncated region is dropped");
    assert!(snapshot.refused_total >= 1, "and refused when reopened");
    assert_good_intact(&snapshot);
    drop(other);
}

#[test]
fn a_mutex_held_forever_stalls_neither_the_loop_nor_other_regions() {
    let host = HostDir::new("stuck");
    // Two regions, each with a dead process slot to reclaim; the first
    // (in scan order) has its mutex held forever.
    let make = |key: &str| {
        let region = host.create_region(key, &RegionLimits::default());
        region.set_device_uuid(0, "GPU-good");
        let other = Region::open_existing(&host.region_path(key)).expect("second handle");
        charge(&other, 0, 0, 0, 7 * MIB);
        drop(other); // its owner "dies": the slot is dead, its memory charged
        region
    };
    let stuck = make("a-stuck_c");
    let fine = make("b-fine_c");
    // The robust mutex sits right after the 56-byte header, cache-line
    // aligned; a lock word naming some other owner is held as far as
    // pthread_mutex_lock can tell, and nobody will ever release it.
    std::fs::OpenOptions::new()
        .write(true)
        .open(host.root.join("a-stuck_c/region.cache"))
        .expect("open")
        .write_at(&0x3039u32.to_le_bytes(), 64)
        .expect("hold the mutex");
    let mut monitor = monitor(&host);
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    while started.elapsed() < Duration::from_secs(15) {
        let tick = Instant::now();
        monitor.tick();
        slowest = slowest.max(tick.elapsed());
        if fine.device_used(0) == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        fine.device_used(0),
        0,
        "the other region's dead slot is reclaimed despite the stuck one"
    );
    assert_eq!(
        stuck.device_used(0),
        7 * MIB,
        "the stuck region is left alone"
    );
    assert!(
        slowest < Duration::from_secs(1),
        "the loop never waits on a region's mutex (slowest pass {slowest:?})"
    );
    let snapshot = monitor.shared().snapshot();
    assert_eq!(snapshot.regions, 2, "the stuck region is still exported");
}

/// A pod on this node, as the API lists it, whose decision gives `container`
/// `cores` percent of GPU `uuid` and names no priority.
fn pod_with_decision(uid: &str, container: &str, uuid: &str, cores: u32) -> Pod {
    let decision = Decision {
        version: 1,
        node: "node-a".into(),
        decided_unix_ms: 1,
        containers: vec![ContainerDecision {
            name: container.into(),
            init: false,
            devices: vec![DeviceGrant {
                uuid: uuid.into(),
                memory_bytes: 4 * GIB,
                cores_percent: cores,
                burst_percent: None,
            }],
            priority: None,
        }],
    };
    Pod {
        metadata: ObjectMeta {
            uid: Some(uid.into()),
            namespace: Some("tenants".into()),
            name: Some(uid.into()),
            annotations: Some(BTreeMap::from([(
                DECISION_ANNOTATION.to_string(),
                decision.to_json(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some("node-a".into()),
            // What the decision grants is what it asks for.
            containers: vec![Container {
                name: container.into(),
                resources: Some(ResourceRequirements {
                    limits: Some(BTreeMap::from([
                        ("nvidia.com/gpu".to_string(), Quantity("1".into())),
                        ("nvidia.com/gpumem".to_string(), Quantity("4096".into())),
                        (
                            "nvidia.com/gpucores".to_string(),
                            Quantity(cores.to_string()),
                        ),
                    ])),
                    ..ResourceRequirements::default()
                }),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// A directory as a synced watch of the node's pods leaves it.
fn synced_directory(pods: Vec<Pod>) -> Arc<PodDirectory> {
    let directory = PodDirectory::new(RequestRules::default());
    directory.apply(Event::Init);
    for pod in pods {
        directory.apply(Event::InitApply(pod));
    }
    directory.apply(Event::InitDone);
    directory
}

fn launch(region: &Region) {
    region.layout().devices[0]
        .compute
        .launches
        .fetch_add(1, Ordering::Relaxed);
}

#[test]
fn a_priority_and_policy_forged_in_a_region_take_no_share_from_a_neighbour() {
    let host = HostDir::new("forged-priority");
    let limits = |cores: u32| {
        let mut limits = RegionLimits::default();
        limits.memory_limit[0] = 4 * GIB;
        limits.sm_limit[0] = cores;
        limits
    };
    let attacker = host.create_region("u-attacker_c", &limits(50));
    let victim = host.create_region("u-victim_c", &limits(50));
    for region in [&attacker, &victim] {
        region.set_device_uuid(0, "GPU-shared");
    }
    let directory = synced_directory(vec![
        pod_with_decision("u-attacker", "c", "GPU-shared", 50),
        pod_with_decision("u-victim", "c", "GPU-shared", 50),
    ]);
    let config = MonitorConfig {
        cleanup_grace: None,
        ..MonitorConfig::for_root(host.root.clone())
    };
    let mut monitor = Monitor::new(config, directory);
    let effective = |region: &Region| {
        region.layout().limits.devices[0]
            .sm_effective
            .load(Ordering::Relaxed)
    };
    let mut lowest = u32::MAX;
    for _ in 0..10 {
        // Between every two passes the attacker writes the most important
        // priority and another policy into its region and keeps launching,
        // as does its neighbour.
        let own = &attacker.layout().limits;
        own.priority.store(i32::MIN, Ordering::Relaxed);
        own.policy
            .store(UtilizationPolicy::Force as u32, Ordering::Relaxed);
        launch(&attacker);
        launch(&victim);
        monitor.tick();
        lowest = lowest.min(effective(&victim));
    }
    assert!(
        lowest >= 50 * SHARE_FULL / 100,
        "the neighbour keeps its own share (lowest effective share {lowest} of {SHARE_FULL})"
    );
    let snapshot = monitor.shared().snapshot();
    let attacker_priority = snapshot
        .devices
        .iter()
        .find(|d| d.pod == "u-attacker")
        .map(|d| d.priority);
    assert_eq!(
        attacker_priority,
        Some(DEFAULT_PRIORITY),
        "the priority in force is the decision's (none: the default), not the region's"
    );
}

/// The monitor's peak resident memory, in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

#[test]
fn a_claim_owner_file_that_is_a_fifo_or_a_link_neither_hangs_the_monitor_nor_leaks() {
    let host = HostDir::new("claim-owner");
    let secret = host.root.join("service-account-token");
    std::fs::write(&secret, "s3cr3t-token-value\n").expect("secret");
    let mut regions = Vec::new();
    for name in ["claim-fifo", "claim-zero", "claim-secret", "claim-good"] {
        let region = host.create_region(name, &RegionLimits::default());
        region.set_device_uuid(0, "GPU-claims");
        regions.push(region);
    }
    // What a root container can do to the owner file in its own claim
    // directory (where older drivers kept it).
    let legacy = |name: &str| host.root.join(name).join("claim.owner");
    let fifo =
        std::ffi::CString::new(legacy("claim-fifo").as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: `fifo` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o666) }, 0);
    std::os::unix::fs::symlink("/dev/zero", legacy("claim-zero")).expect("link");
    std::os::unix::fs::symlink(&secret, legacy("claim-secret")).expect("link");
    // The driver's record of the good claim, where containers cannot reach.
    let records = host.root.join(".claims");
    std::fs::create_dir_all(&records).expect("records");
    std::fs::write(
        records.join("claim-good.owner"),
        "namespace=ml\nclaim=good\npod=train-0\n",
    )
    .expect("record");
    let monitor = MonitorProcess::start(
        MonitorProcess::command(),
        &[
            "--containers-dir",
            host.root.to_str().expect("utf8"),
            "--no-nvml",
            "--no-kubernetes",
        ],
    );
    // Every region is exported, the good claim by its record, the others
    // by their directory: the monitor's passes neither hung on the FIFO
    // nor read /dev/zero.
    monitor.wait_for_metrics(Duration::from_secs(10), |s| {
        let good = value(
            s,
            "vgpu_container_memory_used_bytes",
            &[("namespace", "ml"), ("container", "good")],
        );
        let others = ["claim-fifo", "claim-zero", "claim-secret"]
            .iter()
            .all(|pod| value(s, "vgpu_container_memory_used_bytes", &[("pod", pod)]).is_some());
        (good.is_some() && others).then_some(())
    });
    let peak = peak_rss_kib(monitor.child.id());
    assert!(peak < 256 * 1024, "peak resident memory {peak} KiB");
    let log = monitor.log();
    assert!(
        !log.contains("s3cr3t"),
        "the secret reached the log:\n{log}"
    );
    assert!(
        log.contains("claim-fifo") && log.contains("not a regular file"),
        "the refusal is logged:\n{log}"
    );
    let (status, _) = http_get(monitor.addr, "/healthz").expect("healthz");
    assert_eq!(status, 200);
    drop(regions);
}

#[test]
fn a_monitor_killed_while_it_paused_containers_gives_their_shares_back_on_its_first_pass() {
    let host = HostDir::new("killed-with-paused");
    let mut limits = RegionLimits::default();
    limits.memory_limit[0] = 4 * GIB;
    limits.sm_limit[0] = 30;
    // What a monitor SIGKILLed mid-arbitration leaves behind: containers
    // paused (share 0) or lent more than their share, nobody to undo it.
    let paused = host.create_region("u-paused_c", &limits);
    let lent = host.create_region("u-lent_c", &limits);
    for region in [&paused, &lent] {
        region.set_device_uuid(0, "GPU-shared");
    }
    fn effective(region: &Region) -> &std::sync::atomic::AtomicU32 {
        &region.layout().limits.devices[0].sm_effective
    }
    effective(&paused).store(0, Ordering::Relaxed);
    effective(&lent).store(90 * SHARE_FULL / 100, Ordering::Relaxed);
    let mut monitor = monitor(&host);
    monitor.tick();
    for (name, region) in [("paused", &paused), ("lent", &lent)] {
        assert_eq!(
            effective(region).load(Ordering::Relaxed),
            30 * SHARE_FULL / 100,
            "the {name} container has its own share again after one pass"
        );
    }
}

#[test]
fn a_dra_claims_region_changed_from_inside_gets_its_recorded_grant_back() {
    let host = HostDir::new("claim-restore");
    let mut granted = RegionLimits::default();
    granted.memory_limit[0] = 4 * GIB;
    granted.sm_limit[0] = 30;
    let region = host.create_region("claim-0b1c", &granted);
    region.set_device_uuid(0, "GPU-claims");
    let records = host.root.join(".claims");
    std::fs::create_dir_all(&records).expect("records");
    std::fs::write(
        records.join("claim-0b1c.owner"),
        format!(
            "namespace=ml\nclaim=train\npod=train-0\ndevice=GPU-claims,{},30,\n",
            4 * GIB
        ),
    )
    .expect("record");
    // The claim's container lifts its own caps.
    let mut lifted = granted;
    lifted.memory_limit[0] = 0;
    lifted.sm_limit[0] = 100;
    region.restore_limits(&lifted).expect("writable");
    assert_eq!(region.limits().sm_limit[0], 100);
    let config = MonitorConfig {
        cleanup_grace: None,
        ..MonitorConfig::for_root(host.root.clone())
    };
    let mut monitor = Monitor::new(config, synced_directory(Vec::new()));
    monitor.tick();
    let restored = region.limits();
    assert_eq!(
        (restored.memory_limit[0], restored.sm_limit[0]),
        (4 * GIB, 30),
        "the driver's record, not the region, says what the claim has"
    );
}

#[test]
fn a_decision_rewritten_past_the_admission_policy_restores_only_what_the_pod_asks_for() {
    // The pod asks for 4 GiB and 30 % (pod_with_decision); its decision is
    // rewritten to the whole GPU uncapped and its container lifts its own
    // caps too.
    let host = HostDir::new("forged-decision");
    let mut granted = RegionLimits::default();
    granted.memory_limit[0] = 4 * GIB;
    granted.sm_limit[0] = 30;
    let region = host.create_region("u-greedy_c", &granted);
    region.set_device_uuid(0, "GPU-shared");
    let mut pod = pod_with_decision("u-greedy", "c", "GPU-shared", 30);
    let annotations = pod.metadata.annotations.as_mut().expect("annotations");
    let mut forged = Decision::parse(&annotations[DECISION_ANNOTATION]).expect("decision");
    forged.containers[0].devices[0].memory_bytes = 0;
    forged.containers[0].devices[0].cores_percent = 100;
    forged.containers[0].priority = Some(i32::MIN);
    annotations.insert(DECISION_ANNOTATION.to_string(), forged.to_json());
    let mut lifted = granted;
    lifted.memory_limit[0] = 0;
    lifted.sm_limit[0] = 100;
    region.restore_limits(&lifted).expect("writable");
    let config = MonitorConfig {
        cleanup_grace: None,
        ..MonitorConfig::for_root(host.root.clone())
    };
    let mut monitor = Monitor::new(config, synced_directory(vec![pod]));
    monitor.tick();
    let restored = region.limits();
    assert_eq!(
        (restored.memory_limit[0], restored.sm_limit[0]),
        (4 * GIB, 30),
        "what the pod asks for, not what its decision says"
    );
    let priority = monitor
        .shared()
        .snapshot()
        .devices
        .iter()
        .find(|d| d.pod == "u-greedy")
        .map(|d| d.priority);
    assert_eq!(priority, Some(DEFAULT_PRIORITY), "no priority asked for");
}
