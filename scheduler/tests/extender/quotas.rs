//! A namespace's ResourceQuota on vGPU memory, held by the extender as the
//! API server's own quota cannot (it counts a container's `gpumem` once,
//! whatever its `nvidia.com/gpu` multiplies it by).

use crate::harness::*;
use k8s_openapi::api::core::v1::ResourceQuota;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use std::time::Duration;

/// Creates ResourceQuota `gpu` allowing `memory_mib` of nvidia.com/gpumem
/// in the test namespace, with the status kube-controller-manager would
/// give it (the API server's quota admission refuses pods until a quota
/// has one), and waits until the extender has it.
async fn quota_gpu_memory(h: &Harness, memory_mib: u64) {
    let quotas = kube::Api::<ResourceQuota>::namespaced(h.api.client().clone(), NAMESPACE);
    let hard = json!({ "requests.nvidia.com/gpumem": memory_mib.to_string() });
    let quota: ResourceQuota = serde_json::from_value(json!({
        "metadata": { "name": "gpu", "namespace": NAMESPACE },
        "spec": { "hard": hard },
    }))
    .expect("a ResourceQuota");
    quotas
        .create(&PostParams::default(), &quota)
        .await
        .expect("create the quota");
    let status =
        json!({ "status": { "hard": hard, "used": { "requests.nvidia.com/gpumem": "0" } } });
    quotas
        .patch_status("gpu", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("the quota's status");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let expected = format!(
        "vgpu_namespace_gpu_memory_quota_bytes{{namespace=\"{NAMESPACE}\"}} {}",
        memory_mib << 20
    );
    loop {
        if metrics(h).await.contains(&expected) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the extender never showed the quota"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn metrics(h: &Harness) -> String {
    let (status, body) = h.client.get("/metrics").await.expect("metrics");
    assert_eq!(status, 200);
    String::from_utf8(body).expect("utf-8")
}

/// The reason node n1 refused `pod`.
async fn refusal(h: &Harness, pod: &Value) -> String {
    let filtered = h.filter(pod, &["n1"]).await;
    assert!(
        filtered
            .node_names
            .as_deref()
            .unwrap_or_default()
            .is_empty(),
        "{filtered:?}"
    );
    filtered
        .failed_nodes
        .get("n1")
        .or_else(|| filtered.failed_and_unresolvable_nodes.get("n1"))
        .cloned()
        .unwrap_or_default()
}

#[tokio::test]
async fn a_namespace_at_its_gpu_memory_quota_gets_no_more_until_a_pod_of_it_ends() {
    let h = Harness::start(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]))
        .await;
    quota_gpu_memory(&h, 12288).await;
    // Two vGPUs of 4 GiB: 8 GiB of the 12 (the API server counts 4).
    let first = h
        .create_pod(pod("first", &[vgpu("main", 2, 4096, 10)], &[]))
        .await;
    h.schedule_and_allocate(&first).await;
    assert!(metrics(&h).await.contains(&format!(
        "vgpu_namespace_gpu_memory_bytes{{namespace=\"{NAMESPACE}\"}} {}",
        8u64 << 30
    )));

    // 6 GiB more: the API server's quota admits it (4 + 6 of 12), vgpu's
    // count does not (8 + 6), and kube-scheduler hears the numbers.
    let second = h
        .create_pod(pod("second", &[vgpu("main", 1, 6144, 10)], &[]))
        .await;
    let reason = refusal(&h, &second).await;
    assert!(
        reason.contains(&format!(
            "namespace {NAMESPACE}'s ResourceQuota gpu allows requests.nvidia.com/gpumem 12288 (MiB): \
             its vGPU pods hold 8192 and this pod would take 6144"
        )),
        "{reason}"
    );
    // A bind kube-scheduler tried anyway is refused too.
    let bound = h.bind(&second, "n1").await;
    assert!(bound.error.contains("ResourceQuota gpu"), "{}", bound.error);

    // The webhook refuses a pod whose numbers alone pass the quota.
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "d1c2b3a4-0000-4000-8000-000000000001",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": NAMESPACE,
            "object": pod("third", &[vgpu("main", 2, 4096, 10)], &[]),
        }
    });
    let (status, body) = h
        .client
        .post("/webhook/mutate", review.to_string().into_bytes())
        .await
        .expect("webhook answers");
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_slice(&body).expect("review");
    assert_eq!(answer["response"]["allowed"], false, "{answer}");
    let message = answer["response"]["status"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.starts_with("exceeded quota: ")
            && message.contains("hold 8192 and this pod would take 8192"),
        "{message}"
    );

    // The first pod ends: the second fits.
    h.delete_pod(&first).await;
    assert_eq!(h.schedule(&second).await, Ok("n1".to_string()));
}
