//! 500 pods in a burst onto 100 nodes of a real API server, with many
//! concurrent filter/prioritize/bind calls, a simulated device plugin
//! admitting pods, heartbeats, and an extender crash and restart in the
//! middle (about 10 s on 2 cores: 2500 pod writes and the heartbeats).
//!
//! Checked: every decision matches its pod's request; at every version of
//! every pod the API server stored (a watch of all pods, from before the
//! first is created to after the last write, in the server's order) no GPU
//! is over-committed (memory, compute, slots, exclusivity) and at most one
//! pod per node is pending; and the restarted extender's state equals what
//! the decisions in the API say.

use crate::harness::*;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use serde_json::Value;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use vgpu_cluster::decision::NodeInventory;
use vgpu_cluster::policy::{GpuPolicy, NodePolicy};
use vgpu_scheduler::extender::Config;
use vgpu_testkit::decisions::pending_entry;
use vgpu_testkit::extender_client::ExtenderClient;

const NODES: usize = 100;
const PODS: usize = 500;
const WORKERS: usize = 24;

fn cluster_node(i: usize) -> Value {
    let name = format!("node-{i:03}");
    let gpus = if i < 30 {
        vec![gpu("NVIDIA A100-SXM4-80GB", 80); 4]
    } else {
        vec![gpu("NVIDIA A10", 24); 4]
    };
    node(&name, &gpus)
}

fn burst_pod(i: usize) -> Value {
    let name = format!("job-{i:03}");
    let mut annotations: Vec<(&str, &str)> = Vec::new();
    if i.is_multiple_of(3) {
        annotations.push(("vgpu.io/node-scheduler-policy", "binpack"));
    }
    if i.is_multiple_of(4) {
        annotations.push(("hami.io/gpu-scheduler-policy", "spread"));
    }
    if i.is_multiple_of(13) {
        annotations.push(("nvidia.com/use-gputype", "A100"));
    }
    let containers = match i % 10 {
        0 => vec![vgpu("main", 2, 8192, 25)],
        1 => vec![vgpu("main", 1, 4096, 100)],
        2 => {
            let mut init = vgpu("prepare", 1, 6144, 50);
            init.init = true;
            vec![init, vgpu("main", 1, 4096, 20)]
        }
        3 => vec![ctr(
            "main",
            &[
                ("nvidia.com/gpu", "1"),
                ("nvidia.com/gpumem-percentage", "30"),
                ("nvidia.com/gpucores", "20"),
            ],
        )],
        4 => vec![vgpu("main", 1, 2048, 10), vgpu("side", 1, 1024, 5)],
        5 => vec![ctr(
            "main",
            &[
                ("elasticgpu.io/gpu-memory", "3000"),
                ("elasticgpu.io/gpu-core", "15"),
                // What the webhook adds.
                ("nvidia.com/gpu", "1"),
            ],
        )],
        _ => vec![vgpu(
            "main",
            1,
            1024 * (1 + (i as u64 % 8)),
            5 + (i as u32 % 8) * 5,
        )],
    };
    pod(&name, &containers, &annotations)
}

/// What a GPU carries.
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
struct Load {
    memory: u64,
    cores: u32,
    tasks: u32,
    /// Containers that take the GPU whole (100 % compute).
    exclusive: u32,
}

impl Load {
    fn add(&mut self, other: &Load) {
        self.memory += other.memory;
        self.cores += other.cores;
        self.tasks += other.tasks;
        self.exclusive += other.exclusive;
    }

    fn remove(&mut self, other: &Load) {
        self.memory -= other.memory;
        self.cores -= other.cores;
        self.tasks -= other.tasks;
        self.exclusive -= other.exclusive;
    }
}

/// What a pod's decision puts on each GPU once the pod runs (regular init
/// containers done).
fn contribution(pod: &Value) -> HashMap<String, Load> {
    let mut loads: HashMap<String, Load> = HashMap::new();
    let Some(decision) = decision_of(pod) else {
        return loads;
    };
    for container in decision.containers.iter().filter(|c| !c.init) {
        for device in &container.devices {
            let load = loads.entry(device.uuid.clone()).or_default();
            load.memory += device.memory_bytes;
            load.cores += device.cores_percent;
            load.tasks += 1;
            load.exclusive += u32::from(device.cores_percent == 100);
        }
    }
    loads
}

/// What every GPU carries according to the decisions of `pods`.
fn oracle<'a>(pods: impl IntoIterator<Item = &'a Value>) -> HashMap<String, Load> {
    let mut loads: HashMap<String, Load> = HashMap::new();
    for pod in pods {
        for (uuid, load) in contribution(pod) {
            loads.entry(uuid).or_default().add(&load);
        }
    }
    loads
}

/// What is wrong with `load` on a GPU of `memory` bytes and `split` slots.
fn overcommitted(load: &Load, memory: u64, split: u32) -> Option<String> {
    (load.memory > memory
        || load.cores > 100
        || load.tasks > split
        || (load.exclusive > 0 && load.tasks > 1))
        .then(|| format!("{load:?} on {memory} bytes, {split} slots"))
}

/// Every GPU of the cluster: UUID → (memory, split count).
fn capacities() -> HashMap<String, (u64, u32)> {
    (0..NODES)
        .flat_map(|i| {
            let node = cluster_node(i);
            let text = node["metadata"]["annotations"]["vgpu.io/node-gpus"]
                .as_str()
                .expect("inventory")
                .to_string();
            NodeInventory::parse(&text).expect("inventory").gpus
        })
        .map(|gpu| (gpu.uuid, (gpu.memory_bytes, gpu.split_count)))
        .collect()
}

/// Every pod version the API server stored, as its watch shows them in
/// order, with the protocol's invariants checked at each.
#[derive(Default)]
struct Watched {
    capacities: HashMap<String, (u64, u32)>,
    /// The latest version of each pod.
    pods: HashMap<String, Value>,
    /// Pod → (node of its decision, pending).
    pending: HashMap<String, (String, bool)>,
    /// Pod → what it puts on each GPU.
    contributions: HashMap<String, HashMap<String, Load>>,
    loads: HashMap<String, Load>,
    versions: usize,
    /// Complete lists: 1 unless the watch broke and had to list again (and
    /// so may have missed versions).
    lists: usize,
    errors: Vec<String>,
    violations: Vec<String>,
    overcommits: Vec<String>,
    max_pending: usize,
}

impl Watched {
    fn saw(&mut self, pod: Value, deleted: bool) {
        self.versions += 1;
        let name = name_of(&pod);
        // At most one pod per node decided and not fully allocated (bound
        // or not: an unbound one is a bind in flight).
        let entry = if deleted { None } else { pending_entry(&pod) };
        match entry {
            Some(entry) => {
                let node = entry.0.clone();
                self.pending.insert(name.clone(), entry);
                let pending: Vec<&str> = self
                    .pending
                    .iter()
                    .filter(|(_, (n, pending))| *pending && *n == node)
                    .map(|(name, _)| name.as_str())
                    .collect();
                self.max_pending = self.max_pending.max(pending.len());
                if pending.len() > 1 {
                    self.violations.push(format!(
                        "version {}: node {node} has {} pending pods: {pending:?}",
                        version_of(&pod),
                        pending.len()
                    ));
                }
            }
            None => {
                self.pending.remove(&name);
            }
        }
        // No GPU over-committed by the decisions.
        let new = if deleted {
            HashMap::new()
        } else {
            contribution(&pod)
        };
        let old = self.contributions.remove(&name).unwrap_or_default();
        for (uuid, load) in &old {
            self.loads.entry(uuid.clone()).or_default().remove(load);
        }
        for (uuid, load) in &new {
            let total = self.loads.entry(uuid.clone()).or_default();
            total.add(load);
            let (memory, split) = self
                .capacities
                .get(uuid)
                .copied()
                .unwrap_or_else(|| panic!("{name} decided on an unknown GPU {uuid}"));
            if let Some(what) = overcommitted(total, memory, split) {
                self.overcommits.push(format!(
                    "version {} of {name}: {uuid} carries {what}",
                    version_of(&pod)
                ));
            }
        }
        self.contributions.insert(name.clone(), new);
        if deleted {
            self.pods.remove(&name);
        } else {
            self.pods.insert(name, pod);
        }
    }
}

/// Follows every pod of the test namespace until the test ends; signals
/// `listed` once the (empty) first list is in and the watch runs.
async fn watch_pods(
    client: kube::Client,
    watched: Arc<Mutex<Watched>>,
    listed: tokio::sync::oneshot::Sender<()>,
) {
    let pods = kube::Api::<Pod>::namespaced(client, NAMESPACE);
    let mut stream = watcher::watcher(pods, watcher::Config::default()).boxed();
    let mut listed = Some(listed);
    while let Some(event) = stream.next().await {
        let value = |pod: &Pod| serde_json::to_value(pod).expect("pod JSON");
        let mut watched = watched.lock().expect("watched");
        match event {
            Ok(Event::Init) => watched.lists += 1,
            Ok(Event::InitApply(pod) | Event::Apply(pod)) => watched.saw(value(&pod), false),
            Ok(Event::Delete(pod)) => watched.saw(value(&pod), true),
            Ok(Event::InitDone) => {
                if let Some(listed) = listed.take() {
                    let _ = listed.send(());
                }
            }
            Err(error) => watched.errors.push(error.to_string()),
        }
    }
}

/// The plugin: admits each bound, decided pod a few milliseconds after it
/// first sees it so (in the watch).
async fn plugin(api: Api, watched: Arc<Mutex<Watched>>, done: Arc<AtomicUsize>) {
    let mut first_seen: HashMap<String, Instant> = HashMap::new();
    let mut admitted: HashSet<String> = HashSet::new();
    while done.load(Ordering::Relaxed) == 0 {
        let due: Vec<String> = {
            let watched = watched.lock().expect("watched");
            watched
                .pods
                .values()
                .filter(|pod| {
                    node_name_of(pod).is_some()
                        && decision_of(pod).is_some_and(|d| !d.is_complete(&allocated_of(pod)))
                })
                .map(name_of)
                .filter(|name| !admitted.contains(name))
                .collect()
        };
        for name in due {
            let seen = *first_seen.entry(name.clone()).or_insert_with(Instant::now);
            if seen.elapsed() >= Duration::from_millis(4) {
                api.mark_allocated(&name).await;
                admitted.insert(name);
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Node plugins keep publishing their inventory.
async fn heartbeats(api: Api, done: Arc<AtomicUsize>) {
    let mut i = 0;
    while done.load(Ordering::Relaxed) == 0 {
        api.put_node(cluster_node(i % NODES)).await;
        i += 7;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits for `condition`, polling, up to `limit`.
async fn wait_for(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !condition() {
        assert!(Instant::now() < deadline, "{what}: not after {limit:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn burst_of_500_pods_on_100_nodes_with_a_restart() {
    let mut h = Harness::start(Config {
        node_policy: NodePolicy::Spread,
        gpu_policy: GpuPolicy::Binpack,
        bind_wait: Duration::from_millis(2000),
        ..test_config()
    })
    .await;
    let started = Instant::now();
    h.add_nodes((0..NODES).map(cluster_node).collect()).await;
    let kube_client = h.api.client().clone();
    let watched = Arc::new(Mutex::new(Watched {
        capacities: capacities(),
        ..Watched::default()
    }));
    let (listed, watching) = tokio::sync::oneshot::channel();
    let watch_task = tokio::spawn(watch_pods(kube_client, watched.clone(), listed));
    tokio::time::timeout(Duration::from_secs(20), watching)
        .await
        .expect("the pod watch starts")
        .expect("watch task");

    // The requests as sent (the API server writes quantities in canonical
    // form, e.g. 3000 as "3k").
    let requests: HashMap<String, Value> =
        (0..PODS).map(burst_pod).map(|p| (name_of(&p), p)).collect();
    let mut names = Vec::new();
    for i in 0..PODS {
        names.push(name_of(&h.api.create_pod(burst_pod(i)).await));
    }
    let created_in = started.elapsed();
    let node_names = h.api.node_names().await;

    let queue: Arc<Mutex<VecDeque<String>>> = Arc::new(Mutex::new(names.into()));
    let current: Arc<RwLock<Arc<ExtenderClient>>> = Arc::new(RwLock::new(h.client.clone()));
    let bound = Arc::new(AtomicUsize::new(0));
    let attempts = Arc::new(AtomicUsize::new(0));
    let refusals = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
    let done = Arc::new(AtomicUsize::new(0));

    let plugin_task = tokio::spawn(plugin(h.api.clone(), watched.clone(), done.clone()));
    let heartbeat_task = tokio::spawn(heartbeats(h.api.clone(), done.clone()));
    let mut workers = Vec::new();
    for _ in 0..WORKERS {
        let (queue, current, bound, attempts, refusals, api, nodes) = (
            queue.clone(),
            current.clone(),
            bound.clone(),
            attempts.clone(),
            refusals.clone(),
            h.api.clone(),
            node_names.clone(),
        );
        workers.push(tokio::spawn(async move {
            loop {
                let next = queue.lock().expect("queue").pop_front();
                let Some(name) = next else {
                    if bound.load(Ordering::SeqCst) >= PODS {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                };
                let pod = api.pod(&name).await.expect("pod exists");
                if node_name_of(&pod).is_some() {
                    // Bound by a bind whose answer was lost in the crash.
                    bound.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                attempts.fetch_add(1, Ordering::Relaxed);
                let client = current.read().expect("client").clone();
                match schedule_with(&client, &pod, &nodes).await {
                    Ok(_) => {
                        bound.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(why) => {
                        // Group by the kind of refusal (pod and node names cut off).
                        let kind = if why.contains("does not fit on node") {
                            "does not fit any more".to_string()
                        } else if why.contains("is still admitting") {
                            "node still admitting".to_string()
                        } else {
                            why.split(':')
                                .next()
                                .unwrap_or("")
                                .chars()
                                .take(40)
                                .collect()
                        };
                        *refusals.lock().expect("refusals").entry(kind).or_default() += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        queue.lock().expect("queue").push_back(name);
                    }
                }
            }
        }));
    }

    // Crash the extender half-way and start a fresh one on the same API.
    let bound_now = bound.clone();
    wait_for(
        "half the pods bound before the restart",
        Duration::from_secs(120),
        || bound_now.load(Ordering::SeqCst) >= PODS / 2,
    )
    .await;
    let bound_at_restart = bound.load(Ordering::SeqCst);
    h.restart().await;
    *current.write().expect("client") = h.client.clone();

    let progress = {
        let (bound, refusals, attempts, done) = (
            bound.clone(),
            refusals.clone(),
            attempts.clone(),
            done.clone(),
        );
        tokio::spawn(async move {
            while done.load(Ordering::Relaxed) == 0 {
                tokio::time::sleep(Duration::from_secs(2)).await;
                eprintln!(
                    "burst progress: {} bound, {} attempts, refusals {:?}",
                    bound.load(Ordering::SeqCst),
                    attempts.load(Ordering::Relaxed),
                    refusals.lock().expect("refusals")
                );
            }
        })
    };
    for worker in workers {
        tokio::time::timeout(Duration::from_secs(180), worker)
            .await
            .expect("burst finishes")
            .expect("worker");
    }
    // Let the plugin admit the last pods (as the watch shows them).
    wait_for("every pod admitted", Duration::from_secs(30), || {
        let watched = watched.lock().expect("watched");
        watched.pods.len() == PODS
            && watched
                .pods
                .values()
                .all(|p| decision_of(p).is_some_and(|d| d.is_complete(&allocated_of(p))))
    })
    .await;
    done.store(1, Ordering::Relaxed);
    plugin_task.await.expect("plugin");
    heartbeat_task.await.expect("heartbeats");
    progress.abort();
    let elapsed = started.elapsed();

    // Every pod bound, with a decision for its node that matches its request.
    let nodes: HashMap<String, Value> = h
        .api
        .nodes()
        .await
        .into_iter()
        .map(|n| (n["metadata"]["name"].as_str().unwrap_or("").to_string(), n))
        .collect();
    let mut decided = 0;
    let final_pods = h.api.pods().await;
    for pod in &final_pods {
        let name = name_of(pod);
        let seen = watched.lock().expect("watched").pods[&name].clone();
        assert_eq!(
            version_of(&seen),
            version_of(pod),
            "{name}: the watch saw its last version, so every version was checked"
        );
        let node = node_name_of(pod).unwrap_or_else(|| panic!("{name} not bound"));
        let decision = decision_of(pod).unwrap_or_else(|| panic!("{name} has no decision"));
        assert_eq!(decision.node, node, "{name}");
        assert!(decision.is_complete(&allocated_of(pod)), "{name} admitted");
        let inventory: vgpu_cluster::decision::NodeInventory =
            vgpu_cluster::decision::NodeInventory::parse(
                nodes[&node]["metadata"]["annotations"]["vgpu.io/node-gpus"]
                    .as_str()
                    .expect("inventory"),
            )
            .expect("inventory");
        let request = &requests[&name];
        let spec_containers: Vec<&Value> = request["spec"]["initContainers"]
            .as_array()
            .into_iter()
            .flatten()
            .chain(
                request["spec"]["containers"]
                    .as_array()
                    .into_iter()
                    .flatten(),
            )
            .collect();
        assert_eq!(decision.containers.len(), spec_containers.len(), "{name}");
        for (container, spec) in decision.containers.iter().zip(&spec_containers) {
            assert_eq!(
                container.name,
                spec["name"].as_str().unwrap_or(""),
                "{name}: admission order"
            );
            let limits = &spec["resources"]["limits"];
            let count = limits["nvidia.com/gpu"]
                .as_str()
                .map_or(1, |c| c.parse::<usize>().expect("count"));
            assert_eq!(container.devices.len(), count, "{name}/{}", container.name);
            let distinct: HashSet<&str> =
                container.devices.iter().map(|d| d.uuid.as_str()).collect();
            assert_eq!(
                distinct.len(),
                count,
                "{name}: a container's vGPUs are on different GPUs"
            );
            for device in &container.devices {
                let gpu = inventory
                    .gpus
                    .iter()
                    .find(|g| g.uuid == device.uuid)
                    .expect("GPU of the node");
                if let Some(mib) = limits["nvidia.com/gpumem"]
                    .as_str()
                    .or(limits["elasticgpu.io/gpu-memory"].as_str())
                {
                    assert_eq!(
                        device.memory_bytes,
                        mib.parse::<u64>().expect("MiB") * MIB,
                        "{name}"
                    );
                }
                if limits["nvidia.com/gpumem-percentage"].is_string() {
                    assert_eq!(
                        device.memory_bytes,
                        (gpu.memory_bytes * 30 / 100) & !(MIB - 1),
                        "{name}"
                    );
                }
                let cores = limits["nvidia.com/gpucores"]
                    .as_str()
                    .or(limits["elasticgpu.io/gpu-core"].as_str());
                assert_eq!(
                    device.cores_percent,
                    cores.map_or(0, |c| c.parse().expect("cores")),
                    "{name}"
                );
                if request["metadata"]["annotations"]["nvidia.com/use-gputype"].is_string() {
                    assert!(gpu.model.contains("A100"), "{name} wanted an A100");
                }
            }
        }
        decided += 1;
    }
    assert_eq!(decided, PODS);

    // The protocol held at every version of every pod, and the watch saw
    // them all (one list, then one unbroken watch).
    watch_task.abort();
    assert!(watch_task.await.is_err_and(|e| e.is_cancelled()));
    let watched = Arc::try_unwrap(watched)
        .ok()
        .expect("the watch is over")
        .into_inner()
        .expect("watched");
    assert_eq!(
        watched.lists, 1,
        "the watch listed again: {:?}",
        watched.errors
    );
    assert!(watched.violations.is_empty(), "{:?}", watched.violations);
    assert!(watched.overcommits.is_empty(), "{:?}", watched.overcommits);
    assert_eq!(watched.max_pending, 1, "pods were pending one at a time");

    // No GPU over-committed in the end either; exclusive GPUs hold one
    // container.
    let loads = oracle(&final_pods);
    let running_totals: HashMap<String, Load> = watched
        .loads
        .iter()
        .filter(|(_, load)| **load != Load::default())
        .map(|(uuid, load)| (uuid.clone(), *load))
        .collect();
    assert_eq!(loads, running_totals, "the watch's running totals");
    let mut busiest = 0.0f64;
    for node in nodes.values() {
        let inventory = NodeInventory::parse(
            node["metadata"]["annotations"]["vgpu.io/node-gpus"]
                .as_str()
                .expect("inventory"),
        )
        .expect("inventory");
        for gpu in &inventory.gpus {
            let load = loads.get(&gpu.uuid).copied().unwrap_or_default();
            assert_eq!(
                overcommitted(&load, gpu.memory_bytes, gpu.split_count),
                None,
                "{}",
                gpu.uuid
            );
            busiest = busiest.max(load.memory as f64 / gpu.memory_bytes as f64);
        }
    }

    // The restarted extender's view equals the API's decisions (once its
    // watch has caught up with the last admissions).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = h.client.get("/debug/state").await.expect("state");
        assert_eq!(status, 200);
        let snapshot: Value = serde_json::from_slice(&body).expect("JSON");
        let mut mismatches = Vec::new();
        if snapshot["pods"] != PODS {
            mismatches.push(format!("{} pods known", snapshot["pods"]));
        }
        for (name, node) in snapshot["nodes"].as_object().expect("nodes") {
            if node["pending"] != serde_json::json!([]) {
                mismatches.push(format!("{name} pending {}", node["pending"]));
            }
            for gpu in node["gpus"].as_array().expect("gpus") {
                let load = loads
                    .get(gpu["uuid"].as_str().unwrap_or(""))
                    .copied()
                    .unwrap_or_default();
                let usage = &gpu["usage"];
                let seen = (
                    usage["memoryBytes"].as_u64(),
                    usage["cores"].as_u64(),
                    usage["tasks"].as_u64(),
                );
                let truth = (
                    Some(load.memory),
                    Some(u64::from(load.cores)),
                    Some(u64::from(load.tasks)),
                );
                if seen != truth {
                    mismatches.push(format!("{} {seen:?} != {truth:?}", gpu["uuid"]));
                }
            }
        }
        if mismatches.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "{mismatches:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "burst: {PODS} pods on {NODES} nodes in {:.1} s (created in {:.1} s), {} scheduling attempts, \
         restart after {bound_at_restart} bound, busiest GPU {:.0}% memory, {} pod versions watched; \
         refusals: {:?}",
        elapsed.as_secs_f64(),
        created_in.as_secs_f64(),
        attempts.load(Ordering::Relaxed),
        busiest * 100.0,
        watched.versions,
        refusals.lock().expect("refusals")
    );
    assert!(bound_at_restart > 0 && bound_at_restart < PODS);
}
