//! Test clusters: the fake API, an extender fed by it over HTTP, pods and
//! nodes made from the recorded fixtures, and kube-scheduler's side of the
//! extender protocol.

use crate::fake_api::{decision_of, FakeApi};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use vgpu_cluster::decision::{
    ContainerDecision, Decision, DeviceGrant, InventoryGpu, NodeInventory, ALLOCATED_ANNOTATION,
    DECISION_ANNOTATION, FORMAT_VERSION, NODE_INVENTORY_ANNOTATION,
};
use vgpu_scheduler::api::ApiSource;
use vgpu_scheduler::extender::{
    ExtenderBindingResult, ExtenderFilterResult, HostPriorityList, NodeList,
};
use vgpu_scheduler::scheduler::Config;
use vgpu_scheduler::state::now_unix_ms;
use vgpu_scheduler::Running;
use vgpu_testkit::extender_client::ExtenderClient;

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

pub fn inventory(node: &str, gpus: &[Gpu], heartbeat_unix_ms: u64) -> String {
    NodeInventory {
        version: FORMAT_VERSION,
        heartbeat_unix_ms,
        gpus: gpus
            .iter()
            .enumerate()
            .map(|(i, g)| InventoryGpu {
                uuid: uuid(node, i),
                index: i as u32,
                model: g.model.into(),
                memory_bytes: g.memory_gib * GIB,
                sm_count: 72,
                split_count: g.split,
                numa: Some(0),
                healthy: g.healthy,
            })
            .collect(),
    }
    .to_json()
}

/// A node object (from the recorded fixture) with `gpus` and a fresh heartbeat.
pub fn node(name: &str, gpus: &[Gpu]) -> Value {
    node_with_annotation(name, Some(inventory(name, gpus, now_unix_ms())))
}

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
/// annotations, not scheduled yet, without UID (the fake API assigns one).
pub fn pod(name: &str, containers: &[Ctr], annotations: &[(&str, &str)]) -> Value {
    let mut pod = fixture("pod.json");
    pod["metadata"]["name"] = json!(name);
    pod["metadata"]["namespace"] = json!("ml-team");
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

/// A fake API with an extender watching it.
pub struct Harness {
    pub api: Arc<FakeApi>,
    pub api_addr: SocketAddr,
    pub config: Config,
    pub running: Option<Running>,
    pub client: Arc<ExtenderClient>,
}

pub fn test_config() -> Config {
    Config {
        bind_wait: Duration::from_millis(1500),
        ..Config::default()
    }
}

impl Harness {
    pub async fn start(config: Config) -> Self {
        let api = FakeApi::new();
        let api_addr = api.serve().await;
        let (running, client) = Self::launch(&config, api_addr).await;
        Self {
            api,
            api_addr,
            config,
            running: Some(running),
            client,
        }
    }

    async fn launch(config: &Config, api_addr: SocketAddr) -> (Running, Arc<ExtenderClient>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind extender");
        let running = vgpu_scheduler::start(
            config.clone(),
            &ApiSource::Url(format!("http://{api_addr}")),
            listener,
            None,
            None,
        )
        .await
        .expect("start extender");
        assert!(
            running.wait_ready(Duration::from_secs(10)).await,
            "extender never synced"
        );
        let client = Arc::new(ExtenderClient::new(running.local_addr));
        (running, client)
    }

    /// Stops the extender as a crash would and starts a fresh one (new
    /// port, empty memory) on the same API.
    pub async fn restart(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop();
        }
        let (running, client) = Self::launch(&self.config, self.api_addr).await;
        self.running = Some(running);
        self.client = client;
    }

    pub fn running(&self) -> &Running {
        self.running.as_ref().expect("running")
    }

    /// Waits until the extender's watches have seen versions `pods` and `nodes`.
    pub async fn caught_up(&self, pods: u64, nodes: u64) {
        let state = self.running().scheduler.state().clone();
        for _ in 0..5000 {
            let (seen_pods, seen_nodes) = state.read().seen_versions();
            if seen_pods >= pods && seen_nodes >= nodes {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("extender did not catch up with the API (pods {pods}, nodes {nodes})");
    }

    pub async fn put_node(&self, node: Value) {
        let rv = self.api.put_node(node);
        self.caught_up(0, rv).await;
    }

    pub async fn add_nodes(&self, nodes: Vec<Value>) {
        let mut rv = 0;
        for node in nodes {
            rv = self.api.put_node(node);
        }
        self.caught_up(0, rv).await;
    }

    /// Creates a pod in the API and waits until the extender saw it.
    pub async fn create_pod(&self, pod: Value) -> Value {
        let created = self.api.create_pod(pod);
        self.caught_up(version_of(&created), 0).await;
        created
    }

    pub async fn delete_pod(&self, pod: &Value) {
        if let Some(rv) = self.api.delete_pod("ml-team", &name_of(pod)) {
            self.caught_up(rv, 0).await;
        }
    }

    /// What the device plugin does after serving the pod's containers.
    pub async fn allocate(&self, pod: &Value) {
        let rv = self
            .api
            .mark_allocated("ml-team", &name_of(pod))
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
        let pod = self
            .api
            .pod("ml-team", &name_of(pod))
            .ok_or("pod is gone")?;
        schedule_with(&self.client, &pod, &self.api.node_names()).await
    }

    /// Schedules, and lets the plugin allocate; returns the decision.
    pub async fn schedule_and_allocate(&self, pod: &Value) -> Decision {
        let node = self.schedule(pod).await.expect("scheduled");
        let decision = self.decision(pod).expect("decision");
        assert_eq!(decision.node, node);
        self.allocate(pod).await;
        decision
    }

    /// A running pod, bound to `node` and fully allocated, holding one
    /// container per `(gpu index, GiB, cores)`.
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
        p["spec"]["nodeName"] = json!(node);
        p["status"]["phase"] = json!("Running");
        self.create_pod(p).await
    }

    pub fn decision(&self, pod: &Value) -> Option<Decision> {
        self.api
            .pod("ml-team", &name_of(pod))
            .as_ref()
            .and_then(decision_of)
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
