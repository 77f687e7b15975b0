//! `Allocate` when the pod's allocation record cannot be written because
//! the pod keeps changing (409 Conflict on the resource-version
//! precondition): the plugin reads the pod again and retries, and gives up
//! with `Aborted` after its attempts. A real API server answers 409 only
//! when another writer happens to get in between, so the plugin talks to
//! the real server through the fault proxy, which refuses the next patches
//! on cue ([`Action::conflict`]); the same holds for a write stored while
//! its answer was lost to a stopping server ([`Action::LoseAnswer`]),
//! which the plugin must recognise as its own. `Allocate` takes the pod
//! from its watch of the node's pods where it can, so the same holds for a
//! pod changed after the watch showed it, and an `Allocate` served with
//! every list of pods refused shows the watch at work. The plugin runs in-process
//! on a fixed GPU list against a fake kubelet (real gRPC over unix
//! sockets).

use crate::support::kubelet::{self, gpus, FakeKubelet, PluginConn};
use crate::support::{ControlPlane, GIB, NAMESPACE, RESOURCE};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use vgpu_cluster::decision::{
    ContainerDecision, Decision, DeviceGrant, DECISION_ANNOTATION, FORMAT_VERSION,
};
use vgpu_device_plugin::cluster::make_client;
use vgpu_node_agent::health::{HealthTracker, ManualHealth};
use vgpu_testkit::fault_proxy::{pod_named, Action, Fault, FaultId, FaultProxy, Verb, ANY_POD};

/// Every list of the pods of all namespaces (the plugin's, by node).
const POD_LISTS: &str = "/api/v1/pods";

const WAIT: Duration = Duration::from_secs(10);
const NODE: &str = "node-c";
/// The plugin's attempts at recording one allocation (`MAX_ATTEMPTS` in
/// its service).
const ATTEMPTS: usize = 5;

/// The plugin on `NODE` (talking to a real API server through the fault
/// proxy), a fake kubelet it registered with, and a connection from that
/// kubelet with the full device list in.
struct Node {
    api: ControlPlane,
    proxy: Arc<FaultProxy>,
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
        let api = ControlPlane::start().await;
        api.add_node(NODE).await;
        let proxy = FaultProxy::start(api.client.clone()).await;
        let dir = vgpu_testkit::unique_temp_dir(name);
        let plugin_dir = dir.join("device-plugins");
        std::fs::create_dir_all(&plugin_dir).expect("dirs");
        let config = kubelet::in_process_config(NODE, &dir, RESOURCE);
        let (source, _health) = ManualHealth::new(HealthTracker::new([13], Some(Duration::ZERO)));
        let client = make_client(&proxy.source()).await.expect("client");
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
            proxy,
            dir,
            conn,
            _kubelet: kubelet,
            _stop: stop,
            task,
        }
    }

    /// A pod of one container asking for one GPU, decided onto GPU 0 of
    /// `NODE` by the extender, bound there and waiting for kubelet.
    async fn pending_pod(&self, name: &str, container: &str) -> Pod {
        self.pending_pod_with(name, container, 20).await
    }

    /// The same, given `cores_percent` of the GPU.
    async fn pending_pod_with(&self, name: &str, container: &str, cores_percent: u32) -> Pod {
        let decision = decision(container, cores_percent);
        // Created bound (a real server takes `spec.nodeName` on create).
        let pod: Pod = serde_json::from_value(json!({
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
        }))
        .expect("a Pod");
        self.api.add_pod(pod).await
    }

    /// The containers the plugin recorded as allocated.
    async fn allocated(&self, name: &str) -> Vec<String> {
        self.api.allocated(name).await
    }

    /// The pod patches the plugin sent, and those answered 409.
    fn patches(&self) -> (usize, usize) {
        (
            self.proxy.count(Verb::Patch, ANY_POD),
            self.proxy.count_answered(Verb::Patch, ANY_POD, 409),
        )
    }

    /// Refuses the plugin's next `count` pod patches with 409 Conflict.
    fn inject_conflicts(&self, count: usize) -> FaultId {
        self.proxy
            .inject(Fault::new(Verb::Patch, ANY_POD, Action::conflict()).times(count))
    }
}

/// The extender's decision for one `container` on GPU 0 of `NODE`: 1 GiB
/// and `cores_percent`.
fn decision(container: &str, cores_percent: u32) -> Decision {
    Decision {
        version: FORMAT_VERSION,
        node: NODE.into(),
        decided_unix_ms: 1,
        containers: vec![ContainerDecision {
            name: container.into(),
            init: false,
            devices: vec![DeviceGrant {
                uuid: gpus()[0].uuid.clone(),
                memory_bytes: GIB,
                cores_percent,
                burst_percent: None,
            }],
            priority: None,
        }],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_reads_the_pod_again_after_a_conflict_and_succeeds() {
    let mut node = Node::start("plugin-conflicts-retry").await;
    let pod = node.pending_pod("train", "main").await;
    let (patches, conflicts) = node.patches();
    // Two writes refused: the plugin reads the pod again each time and the
    // third write goes through.
    node.inject_conflicts(2);
    let answers = node.conn.admit(&pod, RESOURCE).await.expect("admitted");
    let (patches_now, conflicts_now) = node.patches();
    assert_eq!(conflicts_now - conflicts, 2);
    assert_eq!(
        patches_now - patches,
        3,
        "two refused writes and the one that went through"
    );
    assert_eq!(node.allocated("train").await, vec!["main"]);
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
    let pod = node.pending_pod("serve", "main").await;
    let (patches, conflicts) = node.patches();
    // The write is stored, but the answer is a 503 (the API server going
    // down); the plugin asks again with the same precondition, which now
    // conflicts with its own stored write (a real 409 of the real server).
    node.proxy
        .inject(Fault::new(Verb::Patch, ANY_POD, Action::LoseAnswer).times(1));
    let answers = node.conn.admit(&pod, RESOURCE).await.expect("admitted");
    let (patches_now, conflicts_now) = node.patches();
    assert_eq!(patches_now - patches, 2, "the write and its retry");
    assert_eq!(conflicts_now - conflicts, 1);
    assert_eq!(
        node.proxy.count_answered(Verb::Patch, ANY_POD, 503),
        1,
        "the stored write's answer was lost"
    );
    assert_eq!(node.allocated("serve").await, vec!["main"]);
    assert_eq!(answers[0].2.envs["NVIDIA_VISIBLE_DEVICES"], gpus()[0].uuid);
    assert_eq!(answers[0].2.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "1024m");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_is_aborted_while_the_pod_keeps_changing() {
    let mut node = Node::start("plugin-conflicts-abort").await;
    node.pending_pod("infer", "server").await;
    let (patches, conflicts) = node.patches();
    // Every write refused: after its attempts the plugin gives up, with
    // Aborted (kubelet fails the container, and the pod is retried).
    let refusing = node.inject_conflicts(100);
    let error = node.conn.allocate_one(1).await.expect_err("conflicts");
    assert_eq!(error.code(), tonic::Code::Aborted, "{}", error.message());
    assert!(
        error
            .message()
            .contains(&format!("kept changing during {ATTEMPTS} attempts")),
        "{}",
        error.message()
    );
    let (patches_now, conflicts_now) = node.patches();
    assert_eq!(patches_now - patches, ATTEMPTS);
    assert_eq!(conflicts_now - conflicts, ATTEMPTS);
    assert!(node.allocated("infer").await.is_empty(), "nothing recorded");
    // Once the pod holds still, kubelet's next try is served.
    node.proxy.remove(refusing);
    let (_, answer) = node.conn.allocate_one(1).await.expect("served after all");
    assert_eq!(answer.envs["NVIDIA_VISIBLE_DEVICES"], gpus()[0].uuid);
    assert_eq!(node.allocated("infer").await, vec!["server"]);
}

/// The pod's decision changes (another writer) after the plugin's watch
/// showed it and just before the plugin records its allocation: the
/// record's precondition fails on the changed pod, the plugin reads it
/// afresh, and the container gets the decision as it now is, never the
/// one the watch showed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_changed_after_the_watch_showed_it_is_served_as_it_now_is() {
    let mut node = Node::start("plugin-conflicts-stale-watch").await;
    let pod = node.pending_pod_with("tune", "main", 20).await;
    let (patches, conflicts) = node.patches();
    node.proxy.inject(
        Fault::new(
            Verb::Patch,
            pod_named("tune"),
            Action::ChangeFirst(json!({
                "metadata": { "annotations": { DECISION_ANNOTATION: decision("main", 30).to_json() } }
            })),
        )
        .times(1),
    );
    let answers = node.conn.admit(&pod, RESOURCE).await.expect("admitted");
    let (patches_now, conflicts_now) = node.patches();
    assert_eq!(conflicts_now - conflicts, 1, "the write on the changed pod");
    // The refused record and the record (the other writer's patch is not
    // the plugin's).
    assert_eq!(patches_now - patches, 2);
    assert_eq!(answers[0].2.envs["CUDA_DEVICE_SM_LIMIT_0"], "30");
    assert_eq!(node.allocated("tune").await, vec!["main"]);
}

/// Once the plugin's watch of the node's pods is in, an `Allocate` needs no
/// list of them: with every list refused (400, which the plugin does not
/// wait out), a pod the watch has shown is still served. Kubelet asks again
/// while the watch has not shown it yet (what a refused fresh list fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_takes_the_pod_from_the_watch_without_listing_pods() {
    let mut node = Node::start("plugin-conflicts-watched").await;
    // The watch's first list.
    let deadline = tokio::time::Instant::now() + WAIT;
    while node.proxy.count_answered(Verb::List, POD_LISTS, 200) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the plugin never listed the node's pods"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    node.proxy.inject(Fault::new(
        Verb::List,
        POD_LISTS,
        Action::Refuse {
            code: 400,
            reason: "BadRequest",
            message: "lists refused by the test".into(),
        },
    ));
    for name in ["first", "second", "third"] {
        let pod = node.pending_pod(name, "main").await;
        let answers = loop {
            match node.conn.admit(&pod, RESOURCE).await {
                Ok(answers) => break answers,
                Err(status) => {
                    assert!(
                        status.message().contains("lists refused by the test"),
                        "{}",
                        status.message()
                    );
                    assert!(
                        tokio::time::Instant::now() < deadline + WAIT,
                        "{name} never served"
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        };
        assert_eq!(answers[0].2.envs["CUDA_DEVICE_SM_LIMIT_0"], "20");
        assert_eq!(node.allocated(name).await, vec!["main"]);
    }
    assert_eq!(
        node.proxy.count_answered(Verb::List, POD_LISTS, 200),
        1,
        "only the watch's first list went through"
    );
}
