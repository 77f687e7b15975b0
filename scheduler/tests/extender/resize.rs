//! A running pod's share and cap changed through `vgpu.io/resize`, on a
//! real API server: applied within the pod's request and its GPU's room,
//! refused in words otherwise, and kept across a restart.

use crate::harness::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use serde_json::{json, Value};
use std::time::Duration;
use vgpu_cluster::resize::{Outcome, ResizeStatus, RESIZE_ANNOTATION, RESIZE_STATUS_ANNOTATION};

async fn ask(h: &Harness, pod: &Value, request: &str) {
    let pods: kube::Api<Pod> = kube::Api::namespaced(h.api.client().clone(), NAMESPACE);
    let patch = json!({ "metadata": { "annotations": { RESIZE_ANNOTATION: request } } });
    pods.patch(
        &name_of(pod),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .expect("annotate the pod");
}

/// The extender's answer to `request`, once it is there.
async fn answer(h: &Harness, pod: &Value, request: &str) -> ResizeStatus {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let current = h.api.pod(&name_of(pod)).await.expect("pod");
        let status = current["metadata"]["annotations"][RESIZE_STATUS_ANNOTATION]
            .as_str()
            .and_then(|text| serde_json::from_str::<ResizeStatus>(text).ok());
        if let Some(status) = status.filter(|s| s.request == request) {
            return status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no answer to {request:?} within 20 s: {:?}",
            current["metadata"]["annotations"]
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn grant_of(decision: &vgpu_cluster::decision::Decision) -> (u64, u32) {
    let grant = &decision.containers[0].devices[0];
    (grant.memory_bytes, grant.cores_percent)
}

#[tokio::test]
async fn a_running_pod_is_resized_within_its_request_and_its_gpus_room() {
    let mut h = Harness::start(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    let a = h
        .create_pod(pod("a", &[vgpu("main", 1, 8192, 70)], &[]))
        .await;
    let placed = h.schedule_and_allocate(&a).await;
    assert_eq!(grant_of(&placed), (8 * GIB, 70));

    // Down: applied, the allocation record kept.
    ask(&h, &a, "cores=20,memory=4Gi").await;
    let status = answer(&h, &a, "cores=20,memory=4Gi").await;
    assert_eq!(status.outcome, Outcome::Applied, "{status:?}");
    assert_eq!(status.message, "resized to 20 % compute and 4 GiB memory");
    let resized = h.decision(&a).await.expect("decision");
    assert_eq!(grant_of(&resized), (4 * GIB, 20));
    assert_eq!(
        resized.containers[0].devices[0].uuid,
        placed.containers[0].devices[0].uuid
    );
    let current = h.api.pod("a").await.expect("pod");
    assert!(
        !allocated_of(&current).is_empty(),
        "the plugin's allocation record is kept"
    );

    // The room it gave back is taken by another pod.
    let b = h
        .create_pod(pod("b", &[vgpu("main", 1, 4096, 80)], &[]))
        .await;
    h.schedule_and_allocate(&b).await;

    // Up past the room left: refused, nothing changed.
    ask(&h, &a, "cores=70").await;
    let refused = answer(&h, &a, "cores=70").await;
    assert_eq!(refused.outcome, Outcome::Refused);
    assert!(
        refused
            .message
            .ends_with("has 20 % of its compute free for this pod, 70 % asked"),
        "{refused:?}"
    );
    assert_eq!(
        grant_of(&h.decision(&a).await.expect("decision")),
        (4 * GIB, 20)
    );

    // Past the pod's own request, and nonsense: refused in words.
    for (request, says) in [
        ("cores=20,memory=12Gi", "more than the pod asks for"),
        ("cores=lots", "cores \"lots\" is not a percentage"),
    ] {
        ask(&h, &a, request).await;
        let refused = answer(&h, &a, request).await;
        assert_eq!(refused.outcome, Outcome::Refused, "{request}");
        assert!(refused.message.contains(says), "{request}: {refused:?}");
    }
    assert_eq!(
        grant_of(&h.decision(&a).await.expect("decision")),
        (4 * GIB, 20)
    );

    // Once the other pod is gone, the same request is applied.
    h.delete_pod(&b).await;
    ask(&h, &a, "cores=70").await;
    let applied = answer(&h, &a, "cores=70").await;
    assert_eq!(applied.outcome, Outcome::Applied, "{applied:?}");
    assert_eq!(
        grant_of(&h.decision(&a).await.expect("decision")),
        (4 * GIB, 70)
    );

    // Each answer is an Event on the pod too (written just after the
    // status: waited for).
    let events: kube::Api<k8s_openapi::api::core::v1::Event> =
        kube::Api::namespaced(h.api.client().clone(), NAMESPACE);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let listed = events.list(&Default::default()).await.expect("events");
        let count = |type_: &str, reason: &str| {
            listed
                .items
                .iter()
                .filter(|e| e.involved_object.name.as_deref() == Some("a"))
                .filter(|e| {
                    e.type_.as_deref() == Some(type_) && e.reason.as_deref() == Some(reason)
                })
                .count()
        };
        let counts = (
            count("Normal", "ResizeApplied"),
            count("Warning", "ResizeRefused"),
        );
        if counts == (2, 3) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Events (applied, refused): {counts:?}, expected (2, 3)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A restart answers nothing again and counts the new grant.
    h.restart().await;
    let (status, body) = h.client.get("/debug/state").await.expect("debug state");
    assert_eq!(status, 200);
    let state: Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(
        answer(&h, &a, "cores=70").await,
        applied,
        "not answered again"
    );
    let c = h
        .create_pod(pod("c", &[vgpu("main", 1, 4096, 40)], &[]))
        .await;
    let bound = h.bind(&c, "n1").await;
    assert!(
        !bound.error.is_empty(),
        "70 % + 40 % does not fit one GPU after the restart: {bound:?}; state {state}"
    );
}
