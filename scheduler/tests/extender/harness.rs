//! Test clusters: a real Kubernetes API server (for the faults a real
//! server shows only by chance, with the fault proxy of testkit in front
//! of it), an extender fed by it over HTTP, pods and nodes made from the
//! recorded fixtures, and kube-scheduler's side of the extender protocol.

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use vgpu_cluster::decision::{
    ContainerDecision, Decision, DeviceGrant, InventoryGpu, NodeInventory, ALLOCATED_ANNOTATION,
    DECISION_ANNOTATION, FORMAT_VERSION, NODE_INVENTORY_ANNOTATION,
};
use vgpu_cluster::node_lease::{
    lease_name, NODE_LEASE_LABEL, NODE_LEASE_LABEL_VALUE, NODE_LEASE_NAMESPACE,
};
use vgpu_scheduler::api::ApiSource;
use vgpu_scheduler::cache::clock::now_unix_ms;
use vgpu_scheduler::cache::leases::Liveness;
use vgpu_scheduler::extender::wire::{
    ExtenderBindingResult, ExtenderFilterResult, HostPriorityList, NodeList,
};
use vgpu_scheduler::extender::Config;
use vgpu_scheduler::Running;
pub use vgpu_testkit::decisions::{allocated_of, decision_of, node_name_of};
use vgpu_testkit::extender_client::ExtenderClient;
pub use vgpu_testkit::fault_proxy::{
    pod_binding, Action, Fault, FaultProxy, Gate, Verb, ANY_POD, ANY_POD_BINDING,
};
use vgpu_testkit::kube::ApiServer;
pub use vgpu_testkit::pending_pods::PendingPods;

/// The namespace of every test pod.
pub const NAMESPACE: &str = "ml-team";

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

pub fn fixture_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

pub fn fixture_bytes(name: &str) -> Vec<u8> {
    std::fs::read(fixture_path(name)).expect("fixture")
}

pub fn fixture(name: &str) -> Value {
    serde_json::from_slice(&fixture_bytes(name)).expect("fixture JSON")
}

/// One GPU of a test node.
#[derive(Clone, Copy, Debug)]
pub struct Gpu {
    pub model: &'static str,
    pub memory_gib: u64,
    pub split: u32,
    pub healthy: bool,
}

pub fn gpu(model: &'static str, memory_gib: u64) -> Gpu {
    Gpu {
        model,
        memory_gib,
        split: 10,
        healthy: true,
    }
}

/// `GPU-<node>-<index>`.
pub fn uuid(node: &str, index: usize) -> String {
    format!("GPU-{node}-{index}")
}

/// A merge patch that pins a pod to the GPU `uuid` (as a user changing
/// their mind between filter and bind would).
pub fn pin_to_gpu(uuid: &str) -> Value {
    json!({ "metadata": { "annotations": {
        "nvidia.com/use-gpuuuid": uuid,
    } } })
}

pub fn inventory(node: &str, gpus: &[Gpu]) -> String {
    NodeInventory {
        version: FORMAT_VERSION,
        gpus: gpus
            .iter()
            .enumerate()
            .map(|(i, g)| InventoryGpu {
                offered_memory_bytes: None,
                utilization_percent: None,
                uuid: uuid(node, i),
                index: i as u32,
                model: g.model.into(),
                memory_bytes: g.memory_gib * GIB,
                sm_count: 72,
                split_count: g.split,
                numa: Some(0),
                nvlink_island: None,
                healthy: g.healthy,
            })
            .collect(),
        several_pending: false,
    }
    .to_json()
}

/// A node object (from the recorded fixture) with `gpus`.
pub fn node(name: &str, gpus: &[Gpu]) -> Value {
    node_with_annotation(name, Some(inventory(name, gpus)))
}

/// The Lease the device plugin on `node` holds, renewed now, lasting
/// `duration_seconds`.
pub fn node_lease(node: &str, duration_seconds: u32) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": lease_name(node),
            "namespace": NODE_LEASE_NAMESPACE,
            "labels": { NODE_LEASE_LABEL: NODE_LEASE_LABEL_VALUE },
        },
        "spec": {
            "holderIdentity": node,
            "leaseDurationSeconds": duration_seconds,
            "renewTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                k8s_openapi::jiff::Timestamp::now()
            ),
        }
    })
}

/// How long the Leases of the nodes the harness puts last: the whole test.
pub const LONG_LEASE_SECONDS: u32 = 3600;

pub fn node_with_annotation(name: &str, annotation: Option<String>) -> Value {
    let mut node = fixture("node.json");
    node["metadata"]["name"] = json!(name);
    node["metadata"]["labels"]["kubernetes.io/hostname"] = json!(name);
    match annotation {
        Some(text) => node["metadata"]["annotations"][NODE_INVENTORY_ANNOTATION] = json!(text),
        None => {
            if let Some(map) = node["metadata"]["annotations"].as_object_mut() {
                map.remove(NODE_INVENTORY_ANNOTATION);
            }
        }
    }
    node
}

/// A container: name and resource limits.
#[derive(Clone, Debug)]
pub struct Ctr {
    pub name: &'static str,
    pub limits: Vec<(&'static str, String)>,
    pub init: bool,
    pub sidecar: bool,
}

pub fn ctr(name: &'static str, limits: &[(&'static str, &str)]) -> Ctr {
    Ctr {
        name,
        limits: limits.iter().map(|(k, v)| (*k, v.to_string())).collect(),
        init: false,
        sidecar: false,
    }
}

/// `nvidia.com/gpu`, `gpumem` (MiB), `gpucores`.
pub fn vgpu(name: &'static str, count: u32, memory_mib: u64, cores: u32) -> Ctr {
    ctr(
        name,
        &[
            ("nvidia.com/gpu", &count.to_string()),
            ("nvidia.com/gpumem", &memory_mib.to_string()),
            ("nvidia.com/gpucores", &cores.to_string()),
        ],
    )
}

/// A pod object (from the recorded fixture) with these containers and
/// annotations, not scheduled yet, without UID (the API server assigns one).
pub fn pod(name: &str, containers: &[Ctr], annotations: &[(&str, &str)]) -> Value {
    let mut pod = fixture("pod.json");
    pod["metadata"]["name"] = json!(name);
    pod["metadata"]["namespace"] = json!(NAMESPACE);
    if let Some(map) = pod["metadata"].as_object_mut() {
        map.remove("uid");
        map.remove("resourceVersion");
    }
    for (key, value) in annotations {
        pod["metadata"]["annotations"][*key] = json!(value);
    }
    let template = pod["spec"]["containers"][0].clone();
    let make = |c: &Ctr| {
        let mut container = template.clone();
        container["name"] = json!(c.name);
        let limits: serde_json::Map<String, Value> = c
            .limits
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        container["resources"] = json!({ "limits": limits, "requests": limits });
        if c.sidecar {
            container["restartPolicy"] = json!("Always");
        }
        container
    };
    pod["spec"]["containers"] =
        Value::Array(containers.iter().filter(|c| !c.init).map(make).collect());
    let init: Vec<Value> = containers.iter().filter(|c| c.init).map(make).collect();
    if !init.is_empty() {
        pod["spec"]["initContainers"] = Value::Array(init);
    }
    pod
}

pub fn name_of(pod: &Value) -> String {
    pod["metadata"]["name"].as_str().unwrap_or("").to_string()
}

pub fn uid_of(pod: &Value) -> String {
    pod["metadata"]["uid"].as_str().unwrap_or("").to_string()
}

pub fn version_of(pod: &Value) -> u64 {
    pod["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The API the extender watches, as the test reads and writes it: a
/// client of the real API server, straight to it (never through the
/// fault proxy, so the proxy counts only the extender's requests).
/// Cheap to clone, for tasks that play the device plugin or heartbeats.
#[derive(Clone)]
pub struct Api {
    client: kube::Client,
}

/// An object as the API server would want it created or applied: the
/// fields only the server sets are removed.
fn for_create(mut object: Value) -> Value {
    if let Some(metadata) = object["metadata"].as_object_mut() {
        for field in [
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "managedFields",
        ] {
            metadata.remove(field);
        }
    }
    object
}

fn version_of_object<K: serde::Serialize>(object: &K) -> u64 {
    version_of(&serde_json::to_value(object).expect("object JSON"))
}

fn to_value<K: serde::Serialize>(object: &K) -> Value {
    serde_json::to_value(object).expect("object JSON")
}

fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 404)
}

impl Api {
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }

    /// The client of the real API server.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    fn pod_api(&self) -> kube::Api<Pod> {
        kube::Api::namespaced(self.client.clone(), NAMESPACE)
    }

    /// Creates or replaces a node (server-side apply: annotations the new
    /// object lacks are removed), then its status as kubelet reports it
    /// (a real server takes a node's status only through the status
    /// subresource); returns its new resource version.
    pub async fn put_node(&self, node: Value) -> u64 {
        let name = node["metadata"]["name"]
            .as_str()
            .expect("node name")
            .to_string();
        let mut node = for_create(node);
        node["apiVersion"] = json!("v1");
        node["kind"] = json!("Node");
        let status = node
            .as_object_mut()
            .and_then(|fields| fields.remove("status"));
        let nodes = kube::Api::<Node>::all(self.client.clone());
        let apply = PatchParams::apply("vgpu-test").force();
        let mut applied = nodes
            .patch(&name, &apply, &Patch::Apply(&node))
            .await
            .unwrap_or_else(|e| panic!("apply node {name}: {e}"));
        if let Some(status) = status {
            let status = json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": { "name": name }, "status": status
            });
            applied = nodes
                .patch_status(&name, &apply, &Patch::Apply(&status))
                .await
                .unwrap_or_else(|e| panic!("apply the status of node {name}: {e}"));
        }
        version_of_object(&applied)
    }

    /// Creates or renews the Lease of `node`'s device plugin.
    pub async fn put_lease(&self, node: &str, duration_seconds: u32) {
        let lease = node_lease(node, duration_seconds);
        kube::Api::<Lease>::namespaced(self.client.clone(), NODE_LEASE_NAMESPACE)
            .patch(
                &lease_name(node),
                &PatchParams::apply("vgpu-test").force(),
                &Patch::Apply(&lease),
            )
            .await
            .unwrap_or_else(|e| panic!("apply the Lease of {node}: {e}"));
    }

    /// Deletes a node; says whether it was there. (A real server answers
    /// a node's deletion with a `Status`, not the object and its last
    /// resource version.)
    pub async fn delete_node(&self, name: &str) -> bool {
        match kube::Api::<Node>::all(self.client.clone())
            .delete(name, &DeleteParams::default())
            .await
        {
            Ok(_) => true,
            Err(e) if is_not_found(&e) => false,
            Err(e) => panic!("delete node {name}: {e}"),
        }
    }

    /// Creates a pod, or says why the API server refuses it.
    pub async fn try_create_pod(&self, pod: Value) -> Result<Value, String> {
        let pod: Pod = serde_json::from_value(for_create(pod)).expect("a Pod");
        self.pod_api()
            .create(&PostParams::default(), &pod)
            .await
            .map(|created| to_value(&created))
            .map_err(|e| e.to_string())
    }

    /// Creates a pod; returns it as the API server stored it (its UID and
    /// resource version).
    pub async fn create_pod(&self, pod: Value) -> Value {
        let name = name_of(&pod);
        self.try_create_pod(pod)
            .await
            .unwrap_or_else(|e| panic!("create pod {name}: {e}"))
    }

    /// Deletes a pod at once (no kubelet is there to finish a graceful
    /// deletion); returns the resource version of the deletion.
    pub async fn delete_pod(&self, name: &str) -> Option<u64> {
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        match self.pod_api().delete(name, &now).await {
            Ok(deleted) => deleted.left().map(|pod| version_of_object(&pod)),
            Err(e) if is_not_found(&e) => None,
            Err(e) => panic!("delete pod {name}: {e}"),
        }
    }

    /// What the device plugin does once it has served every GPU container
    /// (the allocation record), then kubelet (the pod runs; a real server
    /// takes the phase only through the status subresource). Returns the
    /// new resource version, `None` for a pod without a decision.
    pub async fn mark_allocated(&self, name: &str) -> Option<u64> {
        let pod = self.pod(name).await?;
        let decision = decision_of(&pod)?;
        let names: Vec<String> = decision.containers.iter().map(|c| c.name.clone()).collect();
        let record = json!({ "metadata": { "annotations": {
            ALLOCATED_ANNOTATION: serde_json::to_string(&names).expect("names"),
        } } });
        self.pod_api()
            .patch(name, &PatchParams::default(), &Patch::Merge(&record))
            .await
            .unwrap_or_else(|e| panic!("record the allocation of {name}: {e}"));
        Some(self.set_phase(name, "Running").await)
    }

    /// Sets the pod's `status.phase` as kubelet would; returns the new
    /// resource version.
    pub async fn set_phase(&self, name: &str, phase: &str) -> u64 {
        let pod = vgpu_testkit::kube::set_pod_phase(&self.client, NAMESPACE, name, phase).await;
        version_of_object(&pod)
    }

    /// Binds a pod as kube-scheduler would without the extender (the
    /// binding subresource: a real server sets `spec.nodeName` no other
    /// way once the pod exists).
    pub async fn bind_directly(&self, name: &str, node: &str) {
        vgpu_testkit::kube::bind_pod(&self.client, NAMESPACE, name, node).await;
    }

    pub async fn pod(&self, name: &str) -> Option<Value> {
        match self.pod_api().get(name).await {
            Ok(pod) => Some(to_value(&pod)),
            Err(e) if is_not_found(&e) => None,
            Err(e) => panic!("read pod {name}: {e}"),
        }
    }

    /// Every test pod.
    pub async fn pods(&self) -> Vec<Value> {
        self.pod_api()
            .list(&ListParams::default())
            .await
            .expect("list pods")
            .items
            .iter()
            .map(to_value)
            .collect()
    }

    pub async fn node(&self, name: &str) -> Option<Value> {
        match kube::Api::<Node>::all(self.client.clone()).get(name).await {
            Ok(node) => Some(to_value(&node)),
            Err(e) if is_not_found(&e) => None,
            Err(e) => panic!("read node {name}: {e}"),
        }
    }

    pub async fn nodes(&self) -> Vec<Value> {
        kube::Api::<Node>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .expect("list nodes")
            .items
            .iter()
            .map(to_value)
            .collect()
    }

    pub async fn node_names(&self) -> Vec<String> {
        self.nodes()
            .await
            .iter()
            .filter_map(|node| node["metadata"]["name"].as_str().map(str::to_string))
            .collect()
    }
}

/// An extender watching a real API server of its own, directly or
/// through the fault proxy.
pub struct Harness {
    pub api: Api,
    pub config: Config,
    pub running: Option<Running>,
    pub client: Arc<ExtenderClient>,
    source: ApiSource,
    /// The proxy the extender talks through, for a fault test.
    proxy: Option<Arc<FaultProxy>>,
    /// Dropped last: the extender is stopped before its API server.
    _server: RealServer,
}

pub fn test_config() -> Config {
    Config {
        bind_wait: Duration::from_millis(1500),
        ..Config::default()
    }
}

/// A real API server that is stopped, when dropped, on a thread of the
/// blocking pool. Its clients' connections (the extender's watches) are
/// served by tasks of the test's runtime, and kube-apiserver does not stop
/// while they are open: stopped from the runtime's own thread, which then
/// cannot close them, it took the launcher's 20 s timeout (and a kill) per
/// test. The test's runtime, as it shuts down, drops its tasks (closing
/// their connections) and then waits for the blocking pool, so the server
/// is gone before the test ends.
pub struct RealServer(Option<ApiServer>);

impl std::ops::Deref for RealServer {
    type Target = ApiServer;

    fn deref(&self) -> &ApiServer {
        self.0.as_ref().expect("running until dropped")
    }
}

impl Drop for RealServer {
    fn drop(&mut self) {
        let Some(server) = self.0.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn_blocking(move || drop(server));
            }
            Err(_) => drop(server),
        }
    }
}

/// Starts a real API server (etcd and kube-apiserver; blocking, so on a
/// thread of its own) with the test namespace in it.
pub async fn real_api_server() -> (RealServer, kube::Client) {
    let server = tokio::task::spawn_blocking(ApiServer::start)
        .await
        .expect("start the API server");
    let server = RealServer(Some(server));
    let client = server.client().await;
    let namespace: Namespace =
        serde_json::from_value(json!({ "metadata": { "name": NAMESPACE } })).expect("namespace");
    kube::Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("create the test namespace");
    // The API server makes the Leases' namespace itself, but maybe not yet.
    let leases: Namespace =
        serde_json::from_value(json!({ "metadata": { "name": NODE_LEASE_NAMESPACE } }))
            .expect("namespace");
    match kube::Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &leases)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(e) => panic!("create {NODE_LEASE_NAMESPACE}: {e}"),
    }
    (server, client)
}

/// An extender started on `source` without waiting for it to be ready.
pub async fn start_extender(
    config: &Config,
    source: &ApiSource,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind extender");
    vgpu_scheduler::start(config.clone(), source, listener, tls, None)
        .await
        .expect("start extender")
}

impl Harness {
    /// An extender on a real API server of its own.
    pub async fn start(config: Config) -> Self {
        let (server, client) = real_api_server().await;
        Self::start_on(config, server, client).await
    }

    /// An extender on a real API server the test has prepared (e.g. with
    /// definitions installed before the extender starts).
    pub async fn start_on(config: Config, server: RealServer, client: kube::Client) -> Self {
        let source = ApiSource::Kubeconfig(server.kubeconfig().to_path_buf());
        Self::launch_on(config, client, source, None, server).await
    }

    /// An extender on a real API server of its own, through the fault
    /// proxy, for a test that injects faults.
    pub async fn start_behind_proxy(config: Config) -> Self {
        let (server, client) = real_api_server().await;
        let proxy = FaultProxy::start(client.clone()).await;
        let source = proxy.source();
        Self::launch_on(config, client, source, Some(proxy), server).await
    }

    async fn launch_on(
        config: Config,
        client: kube::Client,
        source: ApiSource,
        proxy: Option<Arc<FaultProxy>>,
        server: RealServer,
    ) -> Self {
        let (running, extender) = Self::launch(&config, &source).await;
        Self {
            api: Api::new(client),
            config,
            running: Some(running),
            client: extender,
            source,
            proxy,
            _server: server,
        }
    }

    async fn launch(config: &Config, source: &ApiSource) -> (Running, Arc<ExtenderClient>) {
        let running = start_extender(config, source, None).await;
        assert!(
            running.wait_ready(Duration::from_secs(20)).await,
            "extender never synced"
        );
        let client = Arc::new(ExtenderClient::new(running.local_addr));
        (running, client)
    }

    /// The fault proxy the extender talks through.
    pub fn proxy(&self) -> &Arc<FaultProxy> {
        self.proxy
            .as_ref()
            .expect("this harness was started without the fault proxy (start_behind_proxy)")
    }

    /// Stops the extender as a crash would and starts a fresh one (new
    /// port, empty memory) on the same API.
    pub async fn restart(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop();
        }
        let (running, client) = Self::launch(&self.config, &self.source).await;
        self.running = Some(running);
        self.client = client;
    }

    pub fn running(&self) -> &Running {
        self.running.as_ref().expect("running")
    }

    /// Waits until the extender's watches have seen versions `pods` and `nodes`.
    pub async fn caught_up(&self, pods: u64, nodes: u64) {
        let state = self.running().scheduler.state().clone();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let (seen_pods, seen_nodes) = state.read().seen_versions();
            if seen_pods >= pods && seen_nodes >= nodes {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "extender did not catch up with the API (pods {pods}, nodes {nodes}; \
                 seen {seen_pods}, {seen_nodes})"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Puts a node whose device plugin is alive (its Lease renewed).
    pub async fn put_node(&self, node: Value) {
        self.add_nodes(vec![node]).await;
    }

    /// Puts nodes whose device plugins are alive (their Leases renewed).
    pub async fn add_nodes(&self, nodes: Vec<Value>) {
        let mut rv = 0;
        let mut names = Vec::new();
        for node in nodes {
            names.push(
                node["metadata"]["name"]
                    .as_str()
                    .expect("node name")
                    .to_string(),
            );
            rv = self.api.put_node(node).await;
        }
        self.caught_up(0, rv).await;
        for name in &names {
            self.renew_lease(name, LONG_LEASE_SECONDS).await;
        }
    }

    /// Puts a node whose device plugin holds no Lease.
    pub async fn put_node_without_lease(&self, node: Value) {
        let rv = self.api.put_node(node).await;
        self.caught_up(0, rv).await;
    }

    /// Renews `node`'s Lease (lasting `duration_seconds`) and waits until
    /// the extender has seen the renewal.
    pub async fn renew_lease(&self, node: &str, duration_seconds: u32) {
        let state = self.running().scheduler.state().clone();
        let before = state.read().liveness(node, now_unix_ms(), Duration::ZERO);
        self.api.put_lease(node, duration_seconds).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            match state.read().liveness(node, now_unix_ms(), Duration::ZERO) {
                Liveness::Live { silent_ms } if before == Liveness::Missing || silent_ms < 1000 => {
                    return
                }
                _ => {}
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the extender never saw the renewed Lease of {node}"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Deletes a node and waits until the extender no longer knows it.
    pub async fn delete_node(&self, name: &str) {
        assert!(self.api.delete_node(name).await, "node {name} existed");
        let state = self.running().scheduler.state().clone();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while state.read().node(name).is_some() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the extender still knows the deleted node {name}"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Creates a pod in the API and waits until the extender saw it.
    pub async fn create_pod(&self, pod: Value) -> Value {
        let created = self.api.create_pod(pod).await;
        self.caught_up(version_of(&created), 0).await;
        created
    }

    pub async fn delete_pod(&self, pod: &Value) {
        if let Some(rv) = self.api.delete_pod(&name_of(pod)).await {
            self.caught_up(rv, 0).await;
        }
    }

    /// What the device plugin does after serving the pod's containers.
    pub async fn allocate(&self, pod: &Value) {
        let rv = self
            .api
            .mark_allocated(&name_of(pod))
            .await
            .expect("decided pod");
        self.caught_up(rv, 0).await;
    }

    pub async fn post(&self, path: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
        self.client
            .post(path, body)
            .await
            .expect("extender answers")
    }

    pub async fn filter(&self, pod: &Value, nodes: &[&str]) -> ExtenderFilterResult {
        let body = json!({ "Pod": pod, "Nodes": null, "NodeNames": nodes });
        let (status, body) = self.post("/filter", body.to_string().into_bytes()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).expect("ExtenderFilterResult")
    }

    pub async fn filter_objects(&self, pod: &Value, nodes: &[Value]) -> ExtenderFilterResult {
        let body =
            json!({ "Pod": pod, "Nodes": { "metadata": {}, "items": nodes }, "NodeNames": null });
        let (status, body) = self.post("/filter", body.to_string().into_bytes()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).expect("ExtenderFilterResult")
    }

    pub async fn prioritize(&self, pod: &Value, nodes: &[&str]) -> HostPriorityList {
        let body = json!({ "Pod": pod, "Nodes": null, "NodeNames": nodes });
        let (status, body) = self
            .post("/prioritize", body.to_string().into_bytes())
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).expect("HostPriorityList")
    }

    pub async fn bind(&self, pod: &Value, node: &str) -> ExtenderBindingResult {
        let body = json!({
            "PodName": name_of(pod),
            "PodNamespace": pod["metadata"]["namespace"],
            "PodUID": uid_of(pod),
            "Node": node,
        });
        let (status, body) = self.post("/bind", body.to_string().into_bytes()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).expect("ExtenderBindingResult")
    }

    /// kube-scheduler's side for one pod, as it is in the API now: filter
    /// over every node, prioritize the survivors, bind to the best.
    pub async fn schedule(&self, pod: &Value) -> Result<String, String> {
        let pod = self.api.pod(&name_of(pod)).await.ok_or("pod is gone")?;
        schedule_with(&self.client, &pod, &self.api.node_names().await).await
    }

    /// Schedules, and lets the plugin allocate; returns the decision.
    pub async fn schedule_and_allocate(&self, pod: &Value) -> Decision {
        let node = self.schedule(pod).await.expect("scheduled");
        let decision = self.decision(pod).await.expect("decision");
        assert_eq!(decision.node, node);
        self.allocate(pod).await;
        decision
    }

    /// A running pod, bound to `node` and fully allocated, holding one
    /// container per `(gpu index, GiB, cores)`: created with its decision
    /// and allocation record, bound, then running.
    pub async fn occupy(&self, name: &str, node: &str, grants: &[(usize, u64, u32)]) -> Value {
        let decision = Decision {
            version: FORMAT_VERSION,
            node: node.into(),
            decided_unix_ms: now_unix_ms(),
            containers: grants
                .iter()
                .enumerate()
                .map(|(i, (gpu, gib, cores))| ContainerDecision {
                    name: format!("c{i}"),
                    init: false,
                    devices: vec![DeviceGrant {
                        uuid: uuid(node, *gpu),
                        memory_bytes: gib * GIB,
                        cores_percent: *cores,
                        burst_percent: None,
                    }],
                    priority: None,
                })
                .collect(),
        };
        let names: Vec<String> = decision.containers.iter().map(|c| c.name.clone()).collect();
        let mut p = pod(name, &[vgpu("c0", 1, 1024, 0)], &[]);
        p["metadata"]["annotations"][DECISION_ANNOTATION] = json!(decision.to_json());
        p["metadata"]["annotations"][ALLOCATED_ANNOTATION] =
            json!(serde_json::to_string(&names).expect("names"));
        self.api.create_pod(p).await;
        self.api.bind_directly(name, node).await;
        let rv = self.api.set_phase(name, "Running").await;
        self.caught_up(rv, 0).await;
        self.api.pod(name).await.expect("occupying pod")
    }

    pub async fn decision(&self, pod: &Value) -> Option<Decision> {
        self.api
            .pod(&name_of(pod))
            .await
            .as_ref()
            .and_then(decision_of)
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop();
        }
        // The API server stops when `_server` drops, after this.
    }
}

/// kube-scheduler's calls for one pod against `client`.
pub async fn schedule_with(
    client: &ExtenderClient,
    pod: &Value,
    nodes: &[String],
) -> Result<String, String> {
    let request = json!({ "Pod": pod, "Nodes": null, "NodeNames": nodes });
    let (status, body) = client
        .post("/filter", request.to_string().into_bytes())
        .await
        .map_err(|e| format!("filter: {e}"))?;
    if status != 200 {
        return Err(format!("filter answered {status}"));
    }
    let filtered: ExtenderFilterResult =
        serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    if !filtered.error.is_empty() {
        return Err(filtered.error);
    }
    let passing = filtered.node_names.unwrap_or_else(|| {
        filtered
            .nodes
            .and_then(|n| n.items)
            .unwrap_or_default()
            .iter()
            .filter_map(|n| NodeList::node_name(n).map(str::to_string))
            .collect()
    });
    if passing.is_empty() {
        return Err(format!(
            "no node fits: {:?} {:?}",
            filtered.failed_nodes, filtered.failed_and_unresolvable_nodes
        ));
    }
    let request = json!({ "Pod": pod, "Nodes": null, "NodeNames": passing });
    let (status, body) = client
        .post("/prioritize", request.to_string().into_bytes())
        .await
        .map_err(|e| format!("prioritize: {e}"))?;
    if status != 200 {
        return Err(format!("prioritize answered {status}"));
    }
    let scores: HostPriorityList = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    // The highest score; ties go to the first node (kube-scheduler picks one at random).
    let best = scores
        .iter()
        .rev()
        .max_by_key(|h| h.score)
        .map(|h| h.host.clone())
        .ok_or("no scores")?;
    let request = json!({
        "PodName": pod["metadata"]["name"],
        "PodNamespace": pod["metadata"]["namespace"],
        "PodUID": pod["metadata"]["uid"],
        "Node": best,
    });
    let (status, body) = client
        .post("/bind", request.to_string().into_bytes())
        .await
        .map_err(|e| format!("bind: {e}"))?;
    if status != 200 {
        return Err(format!("bind answered {status}"));
    }
    let bound: ExtenderBindingResult = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    if bound.error.is_empty() {
        Ok(best)
    } else {
        Err(bound.error)
    }
}
