//! `Allocate` when the pod's allocation record cannot be written because
//! the pod keeps changing (409 Conflict on the resource-version
//! precondition): the plugin reads the pod again and retries, and gives up
//! with `Aborted` after its attempts. A real API server answers 409 only
//! when another writer happens to get in between, so these tests run on
//! the shared fake, which refuses the next patches on cue
//! ([`FakeApi::inject_conflicts`]); the same holds for a write stored while
//! its answer was lost to a stopping server ([`FakeApi::lose_patch_answers`]),
//! which the plugin must recognise as its own. The plugin runs in-process on a fixed
//! GPU list against a fake kubelet (real gRPC over unix sockets).

// Only the fake kubelet of the shared test support: the rest of it is
// about the real API server.
#[allow(dead_code)]
#[path = "support/kubelet.rs"]
mod kubelet;

use k8s_openapi::api::core::v1::Pod;
use kubelet::{gpus, FakeKubelet, PluginConn};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use vgpu_cluster::decision::{
    parse_allocated, ContainerDecision, Decision, DeviceGrant, ALLOCATED_ANNOTATION,
    DECISION_ANNOTATION, FORMAT_VERSION,
};
use vgpu_device_plugin::cluster::{make_client, ApiSource};
use vgpu_device_plugin::health::{HealthTracker, ManualHealth};
use vgpu_testkit::fake_api::FakeApi;

const WAIT: Duration = Duration::from_secs(10);
const RESOURCE: &str = "nvidia.com/gpu";
const NAMESPACE: &str = "default";
const NODE: &str = "node-c";
const GIB: u64 = 1 << 30;
/// The plugin's attempts at recording one allocation (`MAX_ATTEMPTS` in
/// its service).
const ATTEMPTS: u64 = 5;

/// The plugin on `NODE`, a fake kubelet it registered with, and a
/// connection from that kubelet with the full device list in.
struct Node {
    api: Arc<FakeApi>,
    dir: PathBuf,
    conn: PluginConn,
    // Kept for their lifetime: the kubelet serving the plugin's
    // registration, and the plugin's stop signal.
    _kubelet: FakeKubelet,
    _stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), vgpu_device_plugin::PluginError>>,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Node {
    async fn start(name: &str) -> Self {
        let api = FakeApi::start().await;
        api.add_node(NODE);
        let dir = vgpu_testkit::unique_temp_dir(name);
        let plugin_dir = dir.join("device-plugins");
        std::fs::create_dir_all(&plugin_dir).expect("dirs");
        let config = kubelet::in_process_config(NODE, &dir, RESOURCE);
        let (source, _health) = ManualHealth::new(HealthTracker::new([13], Some(Duration::ZERO)));
        let client = make_client(&ApiSource::Url(api.url.clone()))
            .await
            .expect("client");
        let (stop, shutdown) = watch::channel(false);
        let task = tokio::spawn(vgpu_device_plugin::run(
            config,
            gpus(),
            Box::new(source),
            client,
            shutdown,
        ));
        let mut kubelet = FakeKubelet::start(&plugin_dir);
        let registration = kubelet.next_registration(WAIT).await;
        let mut conn = kubelet.connect(&registration).await;
        conn.wait_devices(WAIT, |list| list.len() == 20).await;
        Self {
            api,
            dir,
            conn,
            _kubelet: kubelet,
            _stop: stop,
            task,
        }
    }

    /// A pod of one container asking for one GPU, decided onto GPU 0 of
    /// `NODE` by the extender, bound there and waiting for kubelet.
    fn pending_pod(&self, name: &str, container: &str) -> Pod {
        let decision = Decision {
            version: FORMAT_VERSION,
            node: NODE.into(),
            decided_unix_ms: 1,
            containers: vec![ContainerDecision {
                name: container.into(),
                init: false,
                devices: vec![DeviceGrant {
                    uuid: gpus()[0].uuid.clone(),
                    memory_bytes: GIB,
                    cores_percent: 20,
                    burst_percent: None,
                }],
                priority: None,
            }],
        };
        let pod = self.api.create_pod(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "annotations": { DECISION_ANNOTATION: decision.to_json() },
            },
            "spec": {
                "nodeName": NODE,
                "containers": [{
                    "name": container,
                    "image": "cuda-app",
                    "resources": { "limits": { RESOURCE: "1" } },
                }],
            },
            "status": { "phase": "Pending" },
        }));
        serde_json::from_value(pod).expect("a Pod")
    }

    /// The containers the plugin recorded as allocated.
    fn allocated(&self, name: &str) -> Vec<String> {
        let pod: Value = self.api.pod(NAMESPACE, name).expect("pod exists");
        pod["metadata"]["annotations"][ALLOCATED_ANNOTATION]
            .as_str()
            .map(|text| parse_allocated(text).expect("allocated record parses"))
            .unwrap_or_default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_reads_the_pod_again_after_a_conflict_and_succeeds() {
    let mut node = Node::start("plugin-conflicts-retry").await;
    let pod = node.pending_pod("train", "main");
    let before = node.api.counters();
    // Two writes refused: the plugin reads the pod again each time and the
    // third write goes through.
    node.api.inject_conflicts(2);
    let answers = node.conn.admit(&pod, RESOURCE).await.expect("admitted");
    let counters = node.api.counters();
    assert_eq!(counters.conflicts - before.conflicts, 2);
    assert_eq!(
        counters.patches - before.patches,
        3,
        "two refused writes and the one that went through"
    );
    assert_eq!(node.allocated("train"), vec!["main"]);
    let (name, ids, answer) = &answers[0];
    assert_eq!(name, "main");
    let gpu0 = &gpus()[0].uuid;
    assert!(
        ids[0].starts_with(gpu0.as_str()),
        "the decided GPU: {ids:?}"
    );
    assert_eq!(answer.envs["NVIDIA_VISIBLE_DEVICES"], *gpu0);
    assert_eq!(answer.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "1024m");
    assert_eq!(answer.envs["CUDA_DEVICE_SM_LIMIT_0"], "20");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_stored_while_its_answer_was_lost_counts_as_written() {
    let mut node = Node::start("plugin-conflicts-lost-answer").await;
    let pod = node.pending_pod("serve", "main");
    let before = node.api.counters();
    // The write is stored, but the answer is a 503 (the API server going
    // down); the plugin asks again with the same precondition, which now
    // conflicts with its own stored write.
    node.api.lose_patch_answers(1);
    let answers = node.conn.admit(&pod, RESOURCE).await.expect("admitted");
    let counters = node.api.counters();
    assert_eq!(
        counters.patches - before.patches,
        2,
        "the write and its retry"
    );
    assert_eq!(counters.conflicts - before.conflicts, 1);
    assert_eq!(node.allocated("serve"), vec!["main"]);
    assert_eq!(answers[0].2.envs["NVIDIA_VISIBLE_DEVICES"], gpus()[0].uuid);
    assert_eq!(answers[0].2.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "1024m");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_is_aborted_while_the_pod_keeps_changing() {
    let mut node = Node::start("plugin-conflicts-abort").await;
    node.pending_pod("infer", "server");
    let before = node.api.counters();
    // Every write refused: after its attempts the plugin gives up, with
    // Aborted (kubelet fails the container, and the pod is retried).
    node.api.inject_conflicts(100);
    let error = node.conn.allocate_one(1).await.expect_err("conflicts");
    assert_eq!(error.code(), tonic::Code::Aborted, "{}", error.message());
    assert!(
        error
            .message()
            .contains(&format!("kept changing during {ATTEMPTS} attempts")),
        "{}",
        error.message()
    );
    let counters = node.api.counters();
    assert_eq!(counters.patches - before.patches, ATTEMPTS);
    assert_eq!(counters.conflicts - before.conflicts, ATTEMPTS);
    assert!(node.allocated("infer").is_empty(), "nothing recorded");
    // Once the pod holds still, kubelet's next try is served.
    node.api.inject_conflicts(0);
    let (_, answer) = node.conn.allocate_one(1).await.expect("served after all");
    assert_eq!(answer.envs["NVIDIA_VISIBLE_DEVICES"], gpus()[0].uuid);
    assert_eq!(node.allocated("infer"), vec!["server"]);
}
