//! The admission webhook over HTTP, with an AdmissionReview as the API
//! server sends it for a Deployment's pod.

use crate::harness::*;
use base64::Engine;
use serde_json::Value;
use vgpu_scheduler::api::ApiSource;
use vgpu_testkit::extender_client::ExtenderClient;

#[tokio::test]
async fn a_vgpu_pod_is_pointed_at_the_vgpu_scheduler() {
    // The webhook reads nothing from the API, so none is needed: the
    // extender is pointed at a port where nothing listens (and, not ready,
    // still answers the webhook).
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let dead_addr = dead.local_addr().expect("addr");
    drop(dead);
    let running = start_extender(
        &test_config(),
        &ApiSource::Url(format!("http://{dead_addr}")),
        None,
    )
    .await;
    let client = ExtenderClient::new(running.local_addr);
    let post = |body: Vec<u8>| {
        let client = &client;
        async move {
            client
                .post("/webhook/mutate", body)
                .await
                .expect("extender answers")
        }
    };
    let (status, body) = post(fixture_bytes("admission_review.json")).await;
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
    // The pod names no scheduler and its container no seccomp profile.
    assert_eq!(
        patch,
        serde_json::json!([
            {"op": "add", "path": "/spec/schedulerName", "value": "vgpu-scheduler"},
            {"op": "add", "path": "/spec/containers/0/securityContext",
             "value": {"seccompProfile": {"type": "RuntimeDefault"}}},
        ])
    );

    let (status, body) = post(b"[]".to_vec()).await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("not an AdmissionReview"));
    running.stop();
}
