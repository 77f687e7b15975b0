//! The state as the watches and the extender's own writes change it.

use super::*;
use crate::cache::book::Book;
use crate::cache::book::WatchRefusal;
use crate::cache::clock::now_unix_ms;
use crate::cache::fixtures::{decided, elastic_gpu, node, undecided, GIB};
use crate::cache::gpus::{contribution, Usage};
use crate::vocabulary::claims::USES_CLAIMS_ANNOTATION;
use crate::vocabulary::elastic::{ElasticGpu, ElasticGpuStatus, Shaped};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::Event;
use vgpu_cluster::decision::{ContainerDecision, Decision, DeviceGrant, FORMAT_VERSION};

fn synced_state() -> ClusterState {
    listed(vec![node("n1", 2)], Vec::new())
}

const GRACE: Duration = Duration::from_secs(30);

fn gpu_usage(state: &ClusterState, index: usize) -> Usage {
    state.node("n1").expect("n1").usage[index]
}

#[test]
fn a_claims_slice_is_taken_until_a_pod_holding_the_claim_is_placed_on_it() {
    let mut state = synced_state();
    state.apply(elastic_gpu("egpu-1", 5, "GPU-n1-0"));
    assert_eq!(gpu_usage(&state, 0).memory_bytes, 2 * GIB);
    assert_eq!(gpu_usage(&state, 0).cores, 20);
    assert_eq!(
        state.reservation_of("ns/c").map(|r| r.gpus.clone()),
        Some(vec!["GPU-n1-0".to_string()])
    );
    // Placing a pod that holds the claim: the slice is not in its way.
    let node = state.node("n1").expect("n1");
    let without = state.usage_without(node, &[], &["ns/c".to_string()]);
    assert_eq!(without[0], Usage::default());
    assert_eq!(state.usage_without(node, &[], &[])[0].memory_bytes, 2 * GIB);

    // The holder placed: its own grant (4 GiB, 30 %) counts instead.
    let mut holder = decided("p", 10, "n1", "GPU-n1-0", true, true);
    holder
        .metadata
        .annotations
        .as_mut()
        .expect("annotations")
        .insert(USES_CLAIMS_ANNOTATION.into(), "c".into());
    state.apply(holder.clone());
    assert_eq!(gpu_usage(&state, 0).memory_bytes, 4 * GIB);
    assert_eq!(gpu_usage(&state, 0).cores, 30);
    assert_eq!(
        state.holder_of("ns/c", "other").map(|r| r.key()),
        Some("ns/p".into())
    );
    assert!(state.holder_of("ns/c", "p").is_none());

    // The holder done: the slice is held again for the next pod.
    holder.metadata.resource_version = Some("11".into());
    holder.status.as_mut().expect("status").phase = Some("Succeeded".into());
    state.apply(holder.clone());
    assert!(state.holder_of("ns/c", "other").is_none());
    assert_eq!(gpu_usage(&state, 0).memory_bytes, 2 * GIB);

    // An older event does not undo a newer one; a release frees it.
    state.apply(elastic_gpu("egpu-1", 4, "GPU-n1-1"));
    assert_eq!(gpu_usage(&state, 0).memory_bytes, 2 * GIB);
    let mut released = elastic_gpu("egpu-1", 6, "GPU-n1-0");
    released.status = Some(Shaped::Read(ElasticGpuStatus {
        phase: Some("Released".into()),
        ..ElasticGpuStatus::default()
    }));
    state.apply_reservation(&released, false);
    assert_eq!(gpu_usage(&state, 0), Usage::default());
    assert!(state.reservation_of("ns/c").is_none());
}

#[test]
fn placements_wait_for_the_elastic_gpus_unless_the_api_has_none() {
    let mut state = ClusterState::new();
    state.expect_reservations();
    state.relist(vec![node("n1", 2)]);
    state.relist(Vec::<Pod>::new());
    state.apply_event(Event::<Lease>::Init);
    assert!(!state.synced(), "the plugins' Leases are not known yet");
    state.apply_event(Event::<Lease>::InitDone);
    assert!(!state.synced(), "slices held for claims are not known yet");
    state.relist(vec![elastic_gpu("egpu-1", 5, "GPU-n1-1")]);
    assert!(state.synced());
    assert_eq!(gpu_usage(&state, 1).memory_bytes, 2 * GIB);
    // A relist without it: gone.
    state.relist(Vec::<ElasticGpu>::new());
    assert_eq!(gpu_usage(&state, 1), Usage::default());
    // The definitions removed: none held, and still synced.
    state.apply(elastic_gpu("egpu-2", 7, "GPU-n1-1"));
    let refusal = Book::<ElasticGpu>::refused(&mut state, 404);
    assert!(
        matches!(refusal, Some(WatchRefusal::Info(_))),
        "{refusal:?}"
    );
    assert!(state.synced());
    assert_eq!(state.elastic_sync(), ElasticSync::Absent);
    assert_eq!(gpu_usage(&state, 1), Usage::default());
    // Its own write survives a list that predates it.
    state.apply_reservation(&elastic_gpu("egpu-3", 9, "GPU-n1-0"), true);
    state.relist(Vec::<ElasticGpu>::new());
    assert_eq!(gpu_usage(&state, 0).memory_bytes, 2 * GIB);
    let report = state.debug_state(now_unix_ms(), GRACE, GRACE);
    assert_eq!(report.nodes["n1"].reservations, ["egpu-3 (ns/c)"]);
}

#[test]
fn a_node_whose_kubelet_offers_none_of_the_gpus_is_known_as_such() {
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let mut state = synced_state();
    let mut offline = node("n1", 2);
    offline.status = Some(NodeStatus {
        allocatable: Some(
            [
                ("cpu".to_string(), Quantity("8".into())),
                ("nvidia.com/gpu".to_string(), Quantity("0".into())),
                ("nvidia.com/gpumem".to_string(), Quantity("48k".into())),
            ]
            .into(),
        ),
        ..NodeStatus::default()
    });
    state.apply(offline.clone());
    let entry = state.node("n1").expect("n1");
    assert!(entry.offers_none_of("nvidia.com/gpu"));
    assert!(!entry.offers_none_of("nvidia.com/gpumem"));
    assert_eq!(
        entry.extended_allocatable,
        vec![
            ("nvidia.com/gpu".to_string(), 0),
            ("nvidia.com/gpumem".to_string(), 48_000)
        ],
        "only extended resources, quantities read"
    );
    // Back: the plugin registered again.
    let mut online = offline.clone();
    if let Some(allocatable) = online.status.as_mut().and_then(|s| s.allocatable.as_mut()) {
        allocatable.insert("nvidia.com/gpu".into(), Quantity("20".into()));
    }
    state.apply(online);
    assert!(!state
        .node("n1")
        .expect("n1")
        .offers_none_of("nvidia.com/gpu"));
    // A node without a status is not judged.
    state.apply(node("n2", 1));
    assert!(!state
        .node("n2")
        .expect("n2")
        .offers_none_of("nvidia.com/gpu"));
}

#[test]
fn usage_and_pending_follow_the_pods() {
    let mut state = synced_state();
    assert!(state.synced());
    state.apply(decided("a", 10, "n1", "GPU-n1-0", true, false));
    let entry = state.node("n1").expect("node");
    assert_eq!(entry.usage[0].memory_bytes, 4 * GIB);
    assert_eq!(entry.usage[0].tasks, 1);
    let now = now_unix_ms();
    assert_eq!(state.pending_on("n1", now, GRACE, "").len(), 1);
    assert!(state.pending_on("n1", now, GRACE, "a").is_empty());
    // Allocated: no longer pending, still counted.
    state.apply(decided("a", 11, "n1", "GPU-n1-0", true, true));
    assert!(state.pending_on("n1", now, GRACE, "").is_empty());
    assert_eq!(state.node("n1").expect("node").usage[0].tasks, 1);
    // A late, older event changes nothing.
    state.apply(decided("a", 10, "n1", "GPU-n1-0", true, false));
    assert!(state.pending_on("n1", now, GRACE, "").is_empty());
    // Deleted: gone, and an older event cannot bring it back.
    state.delete(decided("a", 12, "n1", "GPU-n1-0", true, true));
    assert_eq!(state.node("n1").expect("node").usage[0], Usage::default());
    state.apply_written_pod(&decided("a", 11, "n1", "GPU-n1-0", true, true));
    assert_eq!(state.pod_count(), 0);
}

#[test]
fn an_admitted_pod_stops_blocking_its_node_but_keeps_its_gpus() {
    use k8s_openapi::api::core::v1::{ContainerStatus, PodStatus};
    let mut state = synced_state();
    let now = now_unix_ms();
    state.apply(decided("e", 30, "n1", "GPU-n1-0", true, false));
    assert_eq!(state.pending_on("n1", now, GRACE, "").len(), 1);
    // Kubelet admitted it (image still pulling) but no Allocate came,
    // as for a resource no vgpu plugin serves.
    let mut pod = decided("e", 31, "n1", "GPU-n1-0", true, false);
    pod.status = Some(PodStatus {
        phase: Some("Pending".into()),
        container_statuses: Some(vec![ContainerStatus {
            name: "main".into(),
            ..ContainerStatus::default()
        }]),
        ..PodStatus::default()
    });
    state.apply(pod);
    assert!(state.pending_on("n1", now, GRACE, "").is_empty());
    assert_eq!(state.node("n1").expect("node").usage[0].tasks, 1);
    // Running without statuses (as a fake API may report): admitted too.
    let mut pod = decided("e", 32, "n1", "GPU-n1-0", true, false);
    pod.status = Some(PodStatus {
        phase: Some("Running".into()),
        ..PodStatus::default()
    });
    state.apply(pod);
    assert!(state.pending_on("n1", now, GRACE, "").is_empty());
    assert_eq!(state.node("n1").expect("node").usage[0].tasks, 1);
}

#[test]
fn own_writes_count_at_once_and_survive_an_older_relist() {
    let mut state = synced_state();
    state.apply_written_pod(&decided("b", 20, "n1", "GPU-n1-1", false, false));
    let now = now_unix_ms();
    assert_eq!(
        state.pending_on("n1", now, GRACE, "").len(),
        1,
        "unbound, decided now"
    );
    assert!(
        state.pending_on("n1", now + 31_000, GRACE, "").is_empty(),
        "an unbound decision stops blocking after the grace"
    );
    state.apply_written_pod(&decided("b", 21, "n1", "GPU-n1-1", true, false));
    assert_eq!(state.pending_on("n1", now + 31_000, GRACE, "").len(), 1);
    // A relist that predates the write keeps it.
    state.relist(vec![undecided("b", 19)]);
    assert_eq!(state.pending_on("n1", now, GRACE, "").len(), 1);
    // A relist that has a newer version replaces it.
    state.relist(vec![decided("b", 22, "n1", "GPU-n1-1", true, true)]);
    assert!(state.pending_on("n1", now, GRACE, "").is_empty());
    assert_eq!(state.node("n1").expect("node").usage[1].tasks, 1);
}

/// The pod as read, decided for `GPU-n1-1` of n1 as a binding would
/// write it.
fn being_bound(name: &str, version: u64) -> Pod {
    decided(name, version, "n1", "GPU-n1-1", true, false)
}

#[test]
fn a_decision_being_bound_counts_until_a_newer_version_or_its_failure() {
    let now = now_unix_ms();
    let mut state = synced_state();
    state.apply(undecided("b", 20));
    state.count_binding(&being_bound("b", 20));
    assert_eq!(state.pending_on("n1", now, GRACE, "").len(), 1);
    // The watch or a relist still showing the version read keeps it.
    state.apply(undecided("b", 20));
    state.relist(vec![undecided("b", 20)]);
    assert_eq!(state.pending_on("n1", now, GRACE, "").len(), 1);
    assert_eq!(gpu_usage(&state, 1).memory_bytes, 4 * GIB);
    // The binding's own version replaces it.
    state.apply(decided("b", 21, "n1", "GPU-n1-1", true, true));
    assert!(!state.pod("b").expect("b").being_bound);
    assert_eq!(gpu_usage(&state, 1).tasks, 1);
    // A failure reported late does not take back the confirmed decision.
    state.forget_binding("b", Some(20));
    assert_eq!(gpu_usage(&state, 1).memory_bytes, 4 * GIB);

    // Another pod: its binding fails, and the GPU is free again.
    state.count_binding(&being_bound("c", 30));
    assert_eq!(gpu_usage(&state, 1).memory_bytes, 8 * GIB);
    state.forget_binding("c", Some(30));
    assert_eq!(gpu_usage(&state, 1).memory_bytes, 4 * GIB);
    assert!(state.pod("c").is_none());

    // A pod the watch already showed deleted is not counted (its binding
    // will fail).
    state.apply_event(Event::Delete(undecided("d", 41)));
    state.count_binding(&being_bound("d", 40));
    assert!(state.pod("d").is_none());
    // A change after the count replaces the record (the binding fails).
    state.count_binding(&being_bound("e", 50));
    state.apply(undecided("e", 51));
    assert!(state.pod("e").is_none());
    assert_eq!(gpu_usage(&state, 1).memory_bytes, 4 * GIB);
}

#[test]
fn a_pod_bound_elsewhere_or_finished_takes_nothing() {
    let mut state = synced_state();
    let mut pod = decided("c", 5, "n1", "GPU-n1-0", true, false);
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = Some("n2".into());
    }
    state.apply(pod);
    assert_eq!(state.node("n1").expect("node").usage[0], Usage::default());
    let mut pod = decided("c", 6, "n1", "GPU-n1-0", true, true);
    if let Some(status) = pod.status.as_mut() {
        status.phase = Some("Succeeded".into());
    }
    state.apply(pod);
    assert_eq!(state.node("n1").expect("node").usage[0], Usage::default());
}

#[test]
fn decisions_for_unknown_nodes_wait_for_their_inventory() {
    let mut state = synced_state();
    state.apply(decided("d", 5, "n9", "GPU-n9-0", true, false));
    let entry = state.node("n9").expect("placeholder");
    assert!(!entry.in_api);
    assert_eq!(entry.unlisted.len(), 1);
    state.apply(node("n9", 1));
    let entry = state.node("n9").expect("node");
    assert_eq!(entry.usage[0].tasks, 1);
    assert!(entry.unlisted.is_empty());
    state.delete(decided("d", 6, "n9", "GPU-n9-0", true, false));
    state.relist(vec![node("n1", 2)]);
    assert!(state.node("n9").is_none());
}

#[test]
fn init_containers_count_until_the_pod_runs() {
    let decision = Decision {
        version: FORMAT_VERSION,
        node: "n1".into(),
        decided_unix_ms: 0,
        containers: vec![
            ContainerDecision {
                name: "setup".into(),
                init: true,
                devices: vec![DeviceGrant {
                    uuid: "G".into(),
                    memory_bytes: 10,
                    cores_percent: 100,
                    burst_percent: None,
                }],
                priority: None,
            },
            ContainerDecision {
                name: "proxy".into(),
                init: true,
                devices: vec![DeviceGrant {
                    uuid: "G".into(),
                    memory_bytes: 1,
                    cores_percent: 5,
                    burst_percent: None,
                }],
                priority: None,
            },
            ContainerDecision {
                name: "main".into(),
                init: false,
                devices: vec![DeviceGrant {
                    uuid: "G".into(),
                    memory_bytes: 4,
                    cores_percent: 20,
                    burst_percent: None,
                }],
                priority: None,
            },
        ],
    };
    let pending = contribution(&decision, &["proxy"], false);
    assert_eq!(
        pending,
        vec![(
            "G".to_string(),
            Usage {
                memory_bytes: 11,
                cores: 105,
                tasks: 2,
                exclusive: true
            }
        )]
    );
    let running = contribution(&decision, &["proxy"], true);
    assert_eq!(
        running,
        vec![(
            "G".to_string(),
            Usage {
                memory_bytes: 5,
                cores: 25,
                tasks: 2,
                exclusive: false
            }
        )]
    );
}

/// `pod` with its decision dated `decided_unix_ms`.
fn dated(mut pod: Pod, decided_unix_ms: u64) -> Pod {
    let annotations = pod.metadata.annotations.as_mut().expect("annotations");
    let text = annotations
        .get(vgpu_cluster::decision::DECISION_ANNOTATION)
        .expect("a decision");
    let mut decision = Decision::parse(text).expect("a decision");
    decision.decided_unix_ms = decided_unix_ms;
    annotations.insert(
        vgpu_cluster::decision::DECISION_ANNOTATION.to_string(),
        decision.to_json(),
    );
    pod
}

#[test]
fn an_unbound_decision_stops_holding_its_node_when_its_grace_ends() {
    let mut state = synced_state();
    let now = now_unix_ms();
    state.apply(dated(decided("a", 5, "n1", "GPU-n1-0", false, false), now));
    assert_eq!(gpu_usage(&state, 0).memory_bytes, 4 * GIB);
    assert_eq!(state.pending_on("n1", now, GRACE, "").len(), 1);
    let deadline = now + GRACE.as_millis() as u64;
    assert_eq!(state.next_unbound_deadline(), Some(deadline));

    assert_eq!(state.expire_unbound(deadline - 1), 0, "still in its grace");
    assert_eq!(gpu_usage(&state, 0).memory_bytes, 4 * GIB);

    let updates = state.updates();
    assert_eq!(state.expire_unbound(deadline), 1);
    assert_eq!(gpu_usage(&state, 0), Usage::default(), "its GPU is free");
    assert!(state.pending_on("n1", deadline, GRACE, "").is_empty());
    assert_eq!(state.counted_node_of("a"), None);
    assert!(state.updates() > updates, "waiters hear of the change");
    assert_eq!(state.next_unbound_deadline(), None);
    assert_eq!(state.expire_unbound(deadline + 1), 0);

    // Bound after all (a bind that took long): counted again.
    state.apply(dated(decided("a", 6, "n1", "GPU-n1-0", true, false), now));
    assert_eq!(gpu_usage(&state, 0).memory_bytes, 4 * GIB);
}

#[test]
fn a_pod_bound_or_decided_again_within_its_grace_is_not_expired() {
    let mut state = synced_state();
    let now = now_unix_ms();
    let grace = GRACE.as_millis() as u64;
    state.apply(dated(decided("a", 5, "n1", "GPU-n1-0", false, false), now));
    state.apply(dated(decided("b", 6, "n1", "GPU-n1-1", false, false), now));
    state.apply(dated(decided("a", 6, "n1", "GPU-n1-0", true, false), now));
    // b is decided again 10 s later (its first bind failed).
    state.apply(dated(
        decided("b", 7, "n1", "GPU-n1-1", false, false),
        now + 10_000,
    ));
    assert_eq!(state.expire_unbound(now + grace), 0);
    assert_eq!(gpu_usage(&state, 0).memory_bytes, 4 * GIB);
    assert_eq!(gpu_usage(&state, 1).memory_bytes, 4 * GIB);
    assert_eq!(state.expire_unbound(now + grace + 10_000), 1);
    assert_eq!(gpu_usage(&state, 0).memory_bytes, 4 * GIB, "a is bound");
    assert_eq!(gpu_usage(&state, 1), Usage::default());
}

#[test]
fn a_decision_dated_ahead_of_the_extenders_clock_holds_nothing_until_bound() {
    let mut state = synced_state();
    let now = now_unix_ms();
    let a_year = 365 * 24 * 3600 * 1000;
    let forged = dated(
        decided("f", 5, "n1", "GPU-n1-0", false, false),
        now + a_year,
    );
    state.apply(forged);
    assert_eq!(gpu_usage(&state, 0), Usage::default());
    assert!(
        state.pending_on("n1", now, GRACE, "").is_empty(),
        "n1 is not kept busy"
    );
    assert_eq!(state.next_unbound_deadline(), None);
    // Within the grace ahead (another replica's clock): held as usual.
    state.apply(dated(
        decided("g", 6, "n1", "GPU-n1-1", false, false),
        now + 5_000,
    ));
    assert_eq!(gpu_usage(&state, 1).memory_bytes, 4 * GIB);
    // Bound, a pod's decision counts whatever its date: the node checks
    // it against the pod before anything runs.
    state.apply(dated(
        decided("f", 7, "n1", "GPU-n1-0", true, false),
        now + a_year,
    ));
    assert_eq!(gpu_usage(&state, 0).memory_bytes, 4 * GIB);
}

#[test]
fn a_relisted_unbound_decision_past_its_grace_holds_nothing() {
    let now = now_unix_ms();
    let state = listed(
        vec![node("n1", 2)],
        vec![
            dated(
                decided("old", 5, "n1", "GPU-n1-0", false, false),
                now - 60_000,
            ),
            dated(
                decided("running", 6, "n1", "GPU-n1-1", true, true),
                now - 3_600_000,
            ),
        ],
    );
    assert_eq!(gpu_usage(&state, 0), Usage::default());
    assert_eq!(gpu_usage(&state, 1).memory_bytes, 4 * GIB);
    assert_eq!(state.next_unbound_deadline(), None);
}
