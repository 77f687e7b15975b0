//! Coscheduling groups (KubeShare's group labels): no pod of a group is
//! placed until its quorum (`ceil(headcount x threshold)`) fits at once;
//! then room is held for the quorum while its pods are placed.

use crate::harness::*;
use serde_json::{json, Value};

/// A pod of group `group` wanting half a GPU (1 GiB, 50 %).
fn member(name: &str, group: &str, headcount: &str, threshold: &str) -> Value {
    let mut pod = pod(name, &[vgpu("main", 1, 1024, 50)], &[]);
    pod["metadata"]["labels"] = json!({
        "sharedgpu/group_name": group,
        "sharedgpu/group_headcount": headcount,
        "sharedgpu/group_threshold": threshold,
    });
    pod
}

fn passed(result: &vgpu_scheduler::extender::wire::ExtenderFilterResult) -> Vec<String> {
    result.node_names.clone().unwrap_or_default()
}

#[tokio::test]
async fn a_group_is_placed_only_once_its_quorum_fits_at_once() {
    let h = Harness::start(test_config()).await;
    // Room for two halves of a GPU.
    h.add_nodes(vec![node("n1", &[gpu("NVIDIA A10", 24)])])
        .await;
    let mut pods = Vec::new();
    for name in ["a", "b", "c", "d", "e"] {
        pods.push(h.create_pod(member(name, "g", "5", "0.6")).await);
    }
    // 5 x 0.6 = 3 pods needed; only 2 fit: every pod is turned down on
    // every node, saying why, and nothing is held.
    for pod in &pods {
        let result = h.filter(pod, &["n1"]).await;
        assert!(passed(&result).is_empty(), "{result:?}");
        let why = result.failed_nodes.get("n1").expect("a reason");
        let expected = format!("group {NAMESPACE}/g: only 2 of the 3 pods");
        assert!(why.contains(&expected), "{why}");
    }
    let state = h.running().scheduler.state().clone();
    assert_eq!(
        state
            .read()
            .groups()
            .holds_of(&format!("{NAMESPACE}/g"), now())
            .count(),
        0
    );

    // A second GPU: room for 4. The first pod asked holds room for itself
    // and the next two by name; the others wait for them.
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]))
        .await;
    assert_eq!(passed(&h.filter(&pods[2], &["n1"]).await), vec!["n1"]);
    let held: Vec<String> = {
        let state = state.read();
        let mut held: Vec<String> = state
            .groups()
            .holds_of(&format!("{NAMESPACE}/g"), now())
            .map(|h| h.uid.clone())
            .collect();
        held.sort();
        held
    };
    let mut expected = vec![uid_of(&pods[0]), uid_of(&pods[1]), uid_of(&pods[2])];
    expected.sort();
    assert_eq!(held, expected);
    let why = h.filter(&pods[3], &["n1"]).await.failed_nodes["n1"].clone();
    assert!(why.contains("room is held for 3 of its pods"), "{why}");
    // A pod outside the group cannot take the held room: one half is left.
    let outsider = h
        .create_pod(pod("outsider", &[vgpu("main", 1, 1024, 60)], &[]))
        .await;
    assert!(passed(&h.filter(&outsider, &["n1"]).await).is_empty());

    // The quorum is placed, together.
    for pod in &pods[..3] {
        assert_eq!(passed(&h.filter(pod, &["n1"]).await), vec!["n1"]);
        assert_eq!(h.bind(pod, "n1").await.error, "");
        h.allocate(pod).await;
    }
    // Then the rest as any pod: d fits (the last half), e does not.
    assert_eq!(passed(&h.filter(&pods[3], &["n1"]).await), vec!["n1"]);
    assert_eq!(h.bind(&pods[3], "n1").await.error, "");
    h.allocate(&pods[3]).await;
    let why = h.filter(&pods[4], &["n1"]).await.failed_nodes["n1"].clone();
    assert!(!why.contains("group"), "{why}");
}

#[tokio::test]
async fn pods_that_disagree_on_their_group_are_not_placed() {
    let h = Harness::start(test_config()).await;
    h.add_nodes(vec![node(
        "n1",
        &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)],
    )])
    .await;
    let a = h.create_pod(member("a", "g", "2", "1")).await;
    let b = h.create_pod(member("b", "g", "3", "1")).await;
    for pod in [&a, &b] {
        let result = h.filter(pod, &["n1"]).await;
        let why = result.failed_nodes.get("n1").expect("refused");
        assert!(why.contains("its pods disagree"), "{why}");
        assert!(why.contains("headcount"), "{why}");
    }
    // Too few pods for the quorum: said so.
    let lone = h.create_pod(member("lone", "h", "4", "0.5")).await;
    let why = h.filter(&lone, &["n1"]).await.failed_nodes["n1"].clone();
    assert!(
        why.contains("1 of its pods exist and 2 are needed (4 x 0.5)"),
        "{why}"
    );
    // Unreadable group labels (a pod created without the webhook): the
    // filter says which, rather than placing the pod outside its group.
    let bad = h.create_pod(member("bad", "h", "many", "0.5")).await;
    let result = h.filter(&bad, &["n1"]).await;
    assert!(
        result.error.contains("sharedgpu/group_headcount"),
        "{result:?}"
    );
    assert!(passed(&result).is_empty());
}

fn now() -> u64 {
    vgpu_scheduler::cache::clock::now_unix_ms()
}
