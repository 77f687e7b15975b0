//! Placement's own check of vGPU containers' confinement
//! (`--confine-at-placement`): a tenant who creates a pod while vgpu's
//! admission is not in force (before the install, in the second after it,
//! while the webhook is off) and names the vgpu scheduler itself gets no
//! decision for a privileged or unprofiled vGPU container; a namespace
//! admission skips (labelled `vgpu.io/webhook=ignore`) is placed as before.

use crate::harness::*;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Patch, PatchParams};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use vgpu_scheduler::extender::config::PlacementConfinement;
use vgpu_scheduler::extender::Config;

fn with_security(mut pod: Value, container: Value, pod_level: Value) -> Value {
    pod["spec"]["containers"][0]["securityContext"] = container;
    pod["spec"]["securityContext"] = pod_level;
    pod
}

fn unresolvable(result: &vgpu_scheduler::extender::wire::ExtenderFilterResult) -> String {
    result
        .failed_and_unresolvable_nodes
        .get("n1")
        .cloned()
        .unwrap_or_default()
}

#[tokio::test]
async fn a_pod_that_never_went_through_admission_gets_no_decision() {
    let h = Harness::start(Config {
        placement_confinement: Some(PlacementConfinement::default()),
        ..test_config()
    })
    .await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    let runtime_default = json!({"seccompProfile": {"type": "RuntimeDefault"}});

    let privileged = h
        .create_pod(with_security(
            pod("privileged", &[vgpu("main", 1, 1024, 10)], &[]),
            json!({"privileged": true, "seccompProfile": {"type": "RuntimeDefault"}}),
            json!({}),
        ))
        .await;
    let result = h.filter(&privileged, &["n1"]).await;
    assert!(
        result.node_names.clone().unwrap_or_default().is_empty(),
        "{result:?}"
    );
    let why = unresolvable(&result);
    assert!(
        why.contains("not admitted by vgpu")
            && why.contains("container main asks for vGPUs and is privileged"),
        "{why}"
    );
    // Nor bound by a bind that skips filter.
    let bound = h.bind(&privileged, "n1").await;
    assert!(bound.error.contains("is privileged"), "{}", bound.error);

    let unprofiled = h
        .create_pod(pod("unprofiled", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let why = unresolvable(&h.filter(&unprofiled, &["n1"]).await);
    assert!(why.contains("names no seccomp profile"), "{why}");

    let unconfined = h
        .create_pod(with_security(
            pod("unconfined", &[vgpu("main", 1, 1024, 10)], &[]),
            json!({}),
            json!({"seccompProfile": {"type": "Unconfined"}}),
        ))
        .await;
    let why = unresolvable(&h.filter(&unconfined, &["n1"]).await);
    assert!(why.contains("runs seccomp Unconfined"), "{why}");

    // As admission leaves a pod: placed.
    let admitted = h
        .create_pod(with_security(
            pod("admitted", &[vgpu("main", 1, 1024, 10)], &[]),
            runtime_default.clone(),
            json!({}),
        ))
        .await;
    let result = h.filter(&admitted, &["n1"]).await;
    assert_eq!(
        result.node_names.as_deref(),
        Some(&["n1".to_string()][..]),
        "{result:?}"
    );

    // The namespace labelled for admission to skip: its pods are placed
    // as they are, once the extender's watch shows the label.
    kube::Api::<Namespace>::all(h.api.client().clone())
        .patch(
            NAMESPACE,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"vgpu.io/webhook": "ignore"}}})),
        )
        .await
        .expect("label the namespace");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let result = h.filter(&privileged, &["n1"]).await;
        if result.node_names.clone().unwrap_or_default() == ["n1"] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the label never counted: {result:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn without_the_check_placement_leaves_confinement_to_admission() {
    let h = Harness::start(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    let unprofiled = h
        .create_pod(pod("unprofiled", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let result = h.filter(&unprofiled, &["n1"]).await;
    assert_eq!(
        result.node_names.as_deref(),
        Some(&["n1".to_string()][..]),
        "{result:?}"
    );
}
