//! 500 pods in a burst onto 100 nodes, with many concurrent
//! filter/prioritize/bind calls, a simulated device plugin admitting pods,
//! heartbeats, and an extender crash and restart in the middle.
//!
//! Checked: no GPU is ever over-committed (memory, compute, slots,
//! exclusivity), every decision matches its pod's request, at most one pod
//! per node is ever pending (checked by the fake API on every write), and
//! the restarted extender's state equals what the decisions in the API say.

use crate::fake_api::{allocated_of, decision_of, node_name_of, FakeApi};
use crate::harness::*;
use serde_json::Value;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use vgpu_scheduler::policy::{GpuPolicy, NodePolicy};
use vgpu_scheduler::scheduler::Config;
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

#[derive(Default, Clone, Copy, Debug)]
struct Load {
    memory: u64,
    cores: u32,
    tasks: u32,
    exclusive: bool,
}

/// What every GPU carries according to the decisions in the API, with
/// every pod running (regular init containers done).
fn oracle(api: &FakeApi) -> HashMap<String, Load> {
    let mut loads: HashMap<String, Load> = HashMap::new();
    for pod in api.pods() {
        let Some(decision) = decision_of(&pod) else {
            continue;
        };
        for container in decision.containers.iter().filter(|c| !c.init) {
            for device in &container.devices {
                let load = loads.entry(device.uuid.clone()).or_default();
                load.memory += device.memory_bytes;
                load.cores += device.cores_percent;
                load.tasks += 1;
                load.exclusive |= device.cores_percent == 100;
            }
        }
    }
    loads
}

/// The plugin: admits each bound pod a few milliseconds after binding.
async fn plugin(api: Arc<FakeApi>, done: Arc<AtomicUsize>) {
    let mut first_seen: HashMap<String, Instant> = HashMap::new();
    while done.load(Ordering::Relaxed) == 0 {
        for pod in api.pods() {
            let Some(decision) = decision_of(&pod) else {
                continue;
            };
            if node_name_of(&pod).is_none() || decision.is_complete(&allocated_of(&pod)) {
                continue;
            }
            let name = name_of(&pod);
            let seen = *first_seen.entry(name.clone()).or_insert_with(Instant::now);
            if seen.elapsed() >= Duration::from_millis(4) {
                api.mark_allocated("ml-team", &name);
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Node plugins keep publishing their inventory.
async fn heartbeats(api: Arc<FakeApi>, done: Arc<AtomicUsize>) {
    let mut i = 0;
    while done.load(Ordering::Relaxed) == 0 {
        api.put_node(cluster_node(i % NODES));
        i += 7;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn burst_of_500_pods_on_100_nodes_with_a_restart() {
    let started = Instant::now();
    let mut h = Harness::start(Config {
        node_policy: NodePolicy::Spread,
        gpu_policy: GpuPolicy::Binpack,
        bind_wait: Duration::from_millis(2000),
        ..test_config()
    })
    .await;
    h.add_nodes((0..NODES).map(cluster_node).collect()).await;
    let mut pods = Vec::new();
    for i in 0..PODS {
        pods.push(h.api.create_pod(burst_pod(i)));
    }
    let requests: HashMap<String, Value> = pods.iter().map(|p| (name_of(p), p.clone())).collect();
    let node_names = h.api.node_names();

    let queue: Arc<Mutex<VecDeque<String>>> =
        Arc::new(Mutex::new(pods.iter().map(name_of).collect()));
    let current: Arc<RwLock<Arc<ExtenderClient>>> = Arc::new(RwLock::new(h.client.clone()));
    let bound = Arc::new(AtomicUsize::new(0));
    let attempts = Arc::new(AtomicUsize::new(0));
    let refusals = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
    let done = Arc::new(AtomicUsize::new(0));

    let plugin_task = tokio::spawn(plugin(h.api.clone(), done.clone()));
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
                let pod = api.pod("ml-team", &name).expect("pod exists");
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
    while bound.load(Ordering::SeqCst) < PODS / 2 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "stuck before the restart"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
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
        tokio::time::timeout(Duration::from_secs(90), worker)
            .await
            .expect("burst finishes")
            .expect("worker");
    }
    // Let the plugin admit the last pods.
    for _ in 0..500 {
        let pending = h
            .api
            .pods()
            .iter()
            .filter(|p| decision_of(p).is_some_and(|d| !d.is_complete(&allocated_of(p))))
            .count();
        if pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    done.store(1, Ordering::Relaxed);
    plugin_task.await.expect("plugin");
    heartbeat_task.await.expect("heartbeats");
    progress.abort();
    let elapsed = started.elapsed();

    // Every pod bound, with a decision for its node that matches its request.
    let nodes: HashMap<String, Value> = h
        .api
        .nodes()
        .into_iter()
        .map(|n| (n["metadata"]["name"].as_str().unwrap_or("").to_string(), n))
        .collect();
    let mut decided = 0;
    for pod in h.api.pods() {
        let name = name_of(&pod);
        let node = node_name_of(&pod).unwrap_or_else(|| panic!("{name} not bound"));
        let decision = decision_of(&pod).unwrap_or_else(|| panic!("{name} has no decision"));
        assert_eq!(decision.node, node, "{name}");
        assert!(decision.is_complete(&allocated_of(&pod)), "{name} admitted");
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

    // No GPU over-committed; exclusive GPUs hold one container.
    let loads = oracle(&h.api);
    let mut busiest = 0.0f64;
    for node in nodes.values() {
        let inventory = vgpu_cluster::decision::NodeInventory::parse(
            node["metadata"]["annotations"]["vgpu.io/node-gpus"]
                .as_str()
                .expect("inventory"),
        )
        .expect("inventory");
        for gpu in &inventory.gpus {
            let load = loads.get(&gpu.uuid).copied().unwrap_or_default();
            assert!(
                load.memory <= gpu.memory_bytes,
                "{} memory {load:?}",
                gpu.uuid
            );
            assert!(load.cores <= 100, "{} cores {load:?}", gpu.uuid);
            assert!(load.tasks <= gpu.split_count, "{} slots {load:?}", gpu.uuid);
            assert!(
                !load.exclusive || load.tasks == 1,
                "{} exclusive {load:?}",
                gpu.uuid
            );
            busiest = busiest.max(load.memory as f64 / gpu.memory_bytes as f64);
        }
    }

    // The protocol held at every write.
    assert!(h.api.violations().is_empty(), "{:?}", h.api.violations());
    assert_eq!(h.api.max_pending_seen(), 1);

    // The restarted extender's view equals the API's decisions (once its
    // watch has caught up with the last admissions).
    let mut mismatches = Vec::new();
    for _ in 0..200 {
        let (status, body) = h.client.get("/debug/state").await.expect("state");
        assert_eq!(status, 200);
        let snapshot: Value = serde_json::from_slice(&body).expect("JSON");
        mismatches.clear();
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
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(mismatches.is_empty(), "{mismatches:?}");
    let counters = h.api.counters();
    eprintln!(
        "burst: {PODS} pods on {NODES} nodes in {:.1} s, {} scheduling attempts, restart after {bound_at_restart} bound, \
         busiest GPU {:.0}% memory, API: {} patches ({} conflicts), {} bindings, {} lists, {} watches; refusals: {:?}",
        elapsed.as_secs_f64(),
        attempts.load(Ordering::Relaxed),
        busiest * 100.0,
        counters.patches,
        counters.conflicts,
        counters.bindings,
        counters.lists,
        counters.watches,
        refusals.lock().expect("refusals")
    );
    assert!(bound_at_restart > 0 && bound_at_restart < PODS);
}
