//! A bind uses the pod its filter call sent rather than reading it again,
//! and a copy that is behind costs a refused binding, never a wrong one.

use crate::harness::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use vgpu_scheduler::extender::Config;
use vgpu_testkit::fault_proxy::pod_named;

/// Through the fault proxy, which counts the extender's requests.
#[tokio::test]
async fn a_bind_after_its_filter_reads_nothing_from_the_api_server() {
    let h = Harness::start_behind_proxy(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    let p = h
        .create_pod(pod("copied", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let filtered = h.filter(&p, &["n1"]).await;
    assert!(filtered.error.is_empty(), "{filtered:?}");
    let result = h.bind(&p, "n1").await;
    assert!(result.error.is_empty(), "{result:?}");
    assert_eq!(
        h.proxy().count(Verb::Get, &pod_named("copied")),
        0,
        "the pod was not read again"
    );
    assert_eq!(
        h.proxy().count_answered(Verb::Create, ANY_POD_BINDING, 201),
        1
    );
    let decision = h.decision(&p).await.expect("decision");
    assert_eq!(decision.node, "n1");

    // A bind with no filter before it reads the pod, as before (once the
    // node's plugin has allocated the first).
    h.allocate(&p).await;
    let unfiltered = h
        .create_pod(pod("unfiltered", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    assert!(h.bind(&unfiltered, "n1").await.error.is_empty());
    assert_eq!(h.proxy().count(Verb::Get, &pod_named("unfiltered")), 1);
}

/// Where the verbs are served unauthenticated to every pod, a filter call
/// may come from anyone: its pod is not kept, and a bind reads the pod
/// (a forged copy under the real UID and version would otherwise decide).
#[tokio::test]
async fn a_bind_reads_its_pod_where_anyone_may_call_filter() {
    let h = Harness::start_behind_proxy(Config {
        keep_filtered_pods: false,
        ..test_config()
    })
    .await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    let p = h
        .create_pod(pod("forged", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    // The same pod under its real UID and version, asking for 20 GiB.
    let mut forged = p.clone();
    forged["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] =
        serde_json::json!("20480");
    assert!(h.filter(&forged, &["n1"]).await.error.is_empty());
    assert!(h.bind(&p, "n1").await.error.is_empty());
    assert_eq!(h.proxy().count(Verb::Get, &pod_named("forged")), 1);
    let decision = h.decision(&p).await.expect("decision");
    assert_eq!(
        decision.containers[0].devices[0].memory_bytes,
        1024 << 20,
        "decided from the pod as stored"
    );
}

/// The pod changes between its filter and its bind (here it is pinned to
/// another GPU): the binding under the filter's copy is refused, and the
/// pod is read again and decided from what it now is.
#[tokio::test]
async fn a_pod_changed_after_its_filter_is_read_again_and_decided_as_it_is() {
    let h = Harness::start_behind_proxy(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]))
        .await;
    let p = h
        .create_pod(pod("stale", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    assert!(h.filter(&p, &["n1"]).await.error.is_empty());
    let pinned = uuid("n1", 1);
    let pods: kube::Api<Pod> = kube::Api::namespaced(h.api.client().clone(), NAMESPACE);
    pods.patch(
        "stale",
        &PatchParams::default(),
        &Patch::Merge(&pin_to_gpu(&pinned)),
    )
    .await
    .expect("pin the pod");
    let result = h.bind(&p, "n1").await;
    assert!(result.error.is_empty(), "{result:?}");
    assert_eq!(
        h.proxy().count_answered(Verb::Create, ANY_POD_BINDING, 409),
        1,
        "the binding under the filter's copy was refused"
    );
    // Read twice: to tell a binding refused from one stored under a lost
    // answer (a 409 answers both), then to decide again.
    assert_eq!(h.proxy().count(Verb::Get, &pod_named("stale")), 2);
    let decision = h.decision(&p).await.expect("decision");
    assert_eq!(
        decision.containers[0].devices[0].uuid, pinned,
        "decided from the pod as it is"
    );
}
