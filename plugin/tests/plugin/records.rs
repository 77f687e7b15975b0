//! `Allocate` answers once the container's region is on the host, which is
//! its record; the pod's allocation annotation is published after the
//! answer, and retried until the API server takes it. A real API server
//! refuses or loses writes only when it is in trouble, so the plugin talks
//! to the real server through the fault proxy, which refuses the pod
//! patches (500), or loses the answer to one it stored, on cue. A plugin
//! stopped before its record was published reads it back from the
//! regions: the container is not served again, and the record follows. An
//! `Allocate` served with every list of pods refused shows the watch at
//! work. The plugin runs in-process on a fixed GPU list against a fake
//! kubelet (real gRPC over unix sockets).

use crate::support::kubelet::{self, gpus, FakeKubelet, PluginConn};
use crate::support::{eventually, ControlPlane, GIB, NAMESPACE, RECORD_WAIT, RESOURCE};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use vgpu_cluster::decision::{
    ContainerDecision, Decision, DeviceGrant, ALLOCATED_ANNOTATION, DECISION_ANNOTATION,
    FORMAT_VERSION,
};
use vgpu_testkit::fault_proxy::{pod_named, Action, Fault, FaultId, FaultProxy, Verb, ANY_POD};

/// Every list of the pods of all namespaces (the plugin's, by node).
const POD_LISTS: &str = "/api/v1/pods";

const WAIT: Duration = Duration::from_secs(10);
const NODE: &str = "node-c";

type PluginTask = tokio::task::JoinHandle<Result<(), vgpu_device_plugin::PluginError>>;

/// The plugin on `NODE` (talking to a real API server through the fault
/// proxy), a fake kubelet it registered with, and a connection from that
/// kubelet with the full device list in.
struct Node {
    api: ControlPlane,
    proxy: Arc<FaultProxy>,
    dir: PathBuf,
    conn: PluginConn,
    kubelet: FakeKubelet,
    stop: watch::Sender<bool>,
    task: PluginTask,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts the plugin on `dir`; the sender stops it.
async fn start_plugin(
    proxy: &FaultProxy,
    dir: &std::path::Path,
) -> (watch::Sender<bool>, PluginTask) {
    let (_health, stop, task) = kubelet::spawn_in_process(NODE, dir, &proxy.source()).await;
    (stop, task)
}

impl Node {
    async fn start(name: &str) -> Self {
        let api = ControlPlane::start().await;
        api.add_node(NODE).await;
        let proxy = FaultProxy::start(api.client.clone()).await;
        let dir = vgpu_testkit::unique_temp_dir(name);
        let plugin_dir = dir.join("device-plugins");
        std::fs::create_dir_all(&plugin_dir).expect("dirs");
        let (stop, task) = start_plugin(&proxy, &dir).await;
        let mut kubelet = FakeKubelet::start(&plugin_dir);
        let conn = Self::connect(&mut kubelet).await;
        Self {
            api,
            proxy,
            dir,
            conn,
            kubelet,
            stop,
            task,
        }
    }

    async fn connect(kubelet: &mut FakeKubelet) -> PluginConn {
        let registration = kubelet.next_registration(WAIT).await;
        let mut conn = kubelet.connect(&registration).await;
        conn.wait_devices(WAIT, |list| list.len() == 20).await;
        conn
    }

    /// Stops the plugin and starts it again on the same host directories.
    async fn restart_plugin(&mut self) {
        self.stop.send_replace(true);
        let stopped = tokio::time::timeout(WAIT, &mut self.task)
            .await
            .expect("the plugin stops in time");
        stopped
            .expect("plugin task")
            .expect("the plugin stops cleanly");
        let (stop, task) = start_plugin(&self.proxy, &self.dir).await;
        self.stop = stop;
        self.task = task;
        self.conn = Self::connect(&mut self.kubelet).await;
    }

    /// A pod decided onto GPU 0 of `NODE` by the extender, bound there and
    /// waiting for kubelet: a container of one GPU with `cores_percent`
    /// for each of `containers`.
    async fn pending_pod(&self, name: &str, containers: &[(&str, u32)]) -> Pod {
        let decision = decision(containers);
        let specs: Vec<serde_json::Value> = containers
            .iter()
            .map(|(container, _)| {
                json!({
                    "name": container,
                    "image": "cuda-app",
                    "resources": { "limits": { RESOURCE: "1" } },
                })
            })
            .collect();
        // Created bound (a real server takes `spec.nodeName` on create).
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "annotations": { DECISION_ANNOTATION: decision.to_json() },
            },
            "spec": { "nodeName": NODE, "containers": specs },
        }))
        .expect("a Pod");
        self.api.add_pod(pod).await
    }

    /// The containers recorded as allocated on the pod now.
    async fn allocated(&self, name: &str) -> Vec<String> {
        self.api.allocated(name).await
    }

    /// Refuses every pod patch with 500, as an API server whose storage
    /// fails does (a 503 the client would retry itself, for minutes).
    fn refuse_patches(&self) -> FaultId {
        self.proxy.inject(Fault::new(
            Verb::Patch,
            ANY_POD,
            Action::internal_error("pod writes refused by the test"),
        ))
    }
}

/// The extender's decision for `containers` on GPU 0 of `NODE`: 1 GiB
/// each and its cores.
fn decision(containers: &[(&str, u32)]) -> Decision {
    Decision {
        version: FORMAT_VERSION,
        node: NODE.into(),
        decided_unix_ms: 1,
        containers: containers
            .iter()
            .map(|(name, cores_percent)| ContainerDecision {
                name: (*name).into(),
                init: false,
                devices: vec![DeviceGrant {
                    uuid: gpus()[0].uuid.clone(),
                    memory_bytes: GIB,
                    cores_percent: *cores_percent,
                    burst_percent: None,
                }],
                priority: None,
            })
            .collect(),
    }
}

/// Kubelet's answer does not wait for the pod's record: with every pod
/// write refused, the container is served its grant, and its record is
/// published once the API server takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_answers_before_the_record_and_the_record_follows() {
    let mut node = Node::start("plugin-records-follow").await;
    let pod = node.pending_pod("train", &[("main", 20)]).await;
    let refusing = node.refuse_patches();
    let answers = node.conn.admit(&pod, RESOURCE).await.expect("admitted");
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
    // The publisher is trying, and refused.
    eventually(WAIT, "a refused write of the record", || async {
        (node
            .proxy
            .count_answered(Verb::Patch, &pod_named("train"), 500)
            >= 2)
            .then_some(())
    })
    .await;
    assert!(
        node.allocated("train").await.is_empty(),
        "nothing stored yet"
    );
    node.proxy.remove(refusing);
    node.api.wait_allocated("train", &["main"]).await;
}

/// A record stored while its answer was lost (the API server stopping) is
/// written once more, to the same effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_stored_while_its_answer_was_lost_is_written_again_and_kept() {
    let mut node = Node::start("plugin-records-lost-answer").await;
    let pod = node.pending_pod("serve", &[("main", 20)]).await;
    node.proxy
        .inject(Fault::new(Verb::Patch, ANY_POD, Action::LoseAnswer).times(1));
    let answers = node.conn.admit(&pod, RESOURCE).await.expect("admitted");
    assert_eq!(answers[0].2.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "1024m");
    eventually(RECORD_WAIT, "the record written again", || async {
        (node
            .proxy
            .count_answered(Verb::Patch, &pod_named("serve"), 200)
            >= 1)
            .then_some(())
    })
    .await;
    assert_eq!(
        node.proxy
            .count_answered(Verb::Patch, &pod_named("serve"), 503),
        1,
        "the stored write's answer was lost"
    );
    assert_eq!(node.allocated("serve").await, vec!["main"]);
}

/// The plugin stops after serving a pod's first container and before its
/// record is published: started again, it reads the record back from the
/// region on the host, serves the second container (never the first
/// again), and publishes both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_served_before_a_restart_is_not_served_again() {
    let mut node = Node::start("plugin-records-restart").await;
    node.pending_pod("pair", &[("first", 20), ("second", 30)])
        .await;
    let refusing = node.refuse_patches();
    let (_, first) = node.conn.allocate_one(1).await.expect("first served");
    assert_eq!(first.envs["CUDA_DEVICE_SM_LIMIT_0"], "20");
    assert!(
        node.allocated("pair").await.is_empty(),
        "nothing stored yet"
    );
    node.restart_plugin().await;
    let (_, second) = node.conn.allocate_one(1).await.expect("second served");
    assert_eq!(
        second.envs["CUDA_DEVICE_SM_LIMIT_0"], "30",
        "the second container's grant, not the first's again"
    );
    assert!(
        node.allocated("pair").await.is_empty(),
        "nothing stored yet"
    );
    node.proxy.remove(refusing);
    node.api.wait_allocated("pair", &["first", "second"]).await;
    // Both served: kubelet asking once more finds nothing left to serve.
    let error = node.conn.allocate_one(1).await.expect_err("nothing left");
    assert_eq!(
        error.code(),
        tonic::Code::FailedPrecondition,
        "{}",
        error.message()
    );
}

/// A pod deleted and made again under the same name before its record was
/// published: the record is never written onto the new pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_is_never_written_onto_a_new_pod_of_the_same_name() {
    let mut node = Node::start("plugin-records-recreated").await;
    let pod = node.pending_pod("job", &[("main", 20)]).await;
    let refusing = node.refuse_patches();
    node.conn.admit(&pod, RESOURCE).await.expect("admitted");
    let pods: Api<Pod> = Api::namespaced(node.api.client.clone(), NAMESPACE);
    pods.delete("job", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete");
    eventually(WAIT, "the pod gone", || async {
        pods.get_opt("job")
            .await
            .expect("get")
            .is_none()
            .then_some(())
    })
    .await;
    let again = node.pending_pod("job", &[("other", 30)]).await;
    assert_ne!(again.metadata.uid, pod.metadata.uid);
    // The UID a record is written with is what keeps it off the new pod:
    // the server refuses a write carrying the old one.
    let stale = json!({ "metadata": {
        "uid": pod.metadata.uid,
        "annotations": { ALLOCATED_ANNOTATION: r#"["main"]"# },
    } });
    let refused = pods
        .patch("job", &PatchParams::default(), &Patch::Merge(&stale))
        .await
        .expect_err("a write with the old pod's UID");
    assert!(
        matches!(&refused, kube::Error::Api(status) if [409, 422].contains(&status.code)),
        "{refused}"
    );
    node.proxy.remove(refusing);
    // The new pod is served as its own, and its record published.
    let answers = node.conn.admit(&again, RESOURCE).await.expect("admitted");
    assert_eq!(answers[0].2.envs["CUDA_DEVICE_SM_LIMIT_0"], "30");
    node.api.wait_allocated("job", &["other"]).await;
    // A later pod's record published means a later pass of the publisher,
    // which took up the old pod's record too.
    let later = node.pending_pod("later", &[("main", 20)]).await;
    node.conn.admit(&later, RESOURCE).await.expect("admitted");
    node.api.wait_allocated("later", &["main"]).await;
    assert_eq!(
        node.allocated("job").await,
        vec!["other"],
        "the new pod carries no record of the old one"
    );
}

/// Once the plugin's watch of the node's pods is in, an `Allocate` needs no
/// list of them: with every list refused (400, which the plugin does not
/// wait out), a pod the watch has shown is still served. Kubelet asks again
/// while the watch has not shown it yet (what a refused fresh list fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_takes_the_pod_from_the_watch_without_listing_pods() {
    let mut node = Node::start("plugin-records-watched").await;
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
        let pod = node.pending_pod(name, &[("main", 20)]).await;
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
        node.api.wait_allocated(name, &["main"]).await;
    }
    assert_eq!(
        node.proxy.count_answered(Verb::List, POD_LISTS, 200),
        1,
        "only the watch's first list went through"
    );
}
