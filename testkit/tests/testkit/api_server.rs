//! The test API server is the real one: it validates, enforces
//! preconditions and only binds through the binding subresource.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use vgpu_testkit::kube::ApiServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_api_server_validates_like_a_cluster() {
    let server = ApiServer::start();
    let pods: Api<Pod> = Api::namespaced(server.client().await, "default");
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "main", "image": "busybox",
                 "resources": {"limits": {"nvidia.com/gpu": "0.5"}}}]}
    }))
    .expect("pod JSON");
    let refused = pods
        .create(&PostParams::default(), &pod)
        .await
        .expect_err("a fractional extended resource is invalid");
    assert!(refused.to_string().contains("nvidia.com/gpu"), "{refused}");
    let control_plane = server.dir().to_path_buf();
    drop(server);
    assert!(!control_plane.exists(), "its files are removed with it");
}
