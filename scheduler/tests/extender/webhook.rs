//! The admission webhook over HTTP, with an AdmissionReview as the API
//! server sends it for a Deployment's pod.

use crate::harness::*;
use base64::Engine;
use serde_json::Value;

#[tokio::test]
async fn a_vgpu_pod_is_pointed_at_the_vgpu_scheduler() {
    let h = Harness::start(test_config()).await;
    let (status, body) = h
        .post("/webhook/mutate", fixture_bytes("admission_review.json"))
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let review: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(review["kind"], "AdmissionReview");
    let response = &review["response"];
    assert_eq!(response["uid"], "0b6c6f5e-2d3a-4c4b-9d8e-1f2a3b4c5d6e");
    assert_eq!(response["allowed"], true);
    assert_eq!(response["patchType"], "JSONPatch");
    let patch = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().expect("patch"))
        .expect("base64");
    let patch: Value = serde_json::from_slice(&patch).expect("patch json");
    assert_eq!(
        patch,
        serde_json::json!([{"op": "add", "path": "/spec/schedulerName", "value": "vgpu-scheduler"}])
    );

    let (status, body) = h.post("/webhook/mutate", b"[]".to_vec()).await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("not an AdmissionReview"));
}
