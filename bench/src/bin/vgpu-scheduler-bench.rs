//! `vgpu-scheduler-bench`: how long filter + prioritize take for one pod
//! over a large cluster, and how much memory the extender's state uses.
//!
//! The cluster (default 5000 nodes x 8 GPUs, 20000 vGPU pods placed) is
//! built in memory the way the API watch builds it (Node and Pod objects
//! applied to the state). Each iteration sends kube-scheduler's request
//! bodies (a recorded pod, all node names) through filter and then
//! prioritize for the nodes that passed: in-process (JSON in, JSON out), and
//! over HTTP on loopback.
//!
//! ```sh
//! cargo run --release -p vgpu-scheduler --bin vgpu-scheduler-bench [-- --quick]
//! ```

use anyhow::Context;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vgpu_cluster::decision::{
    ContainerDecision, Decision, DeviceGrant, InventoryGpu, NodeInventory, ALLOCATED_ANNOTATION,
    DECISION_ANNOTATION, FORMAT_VERSION, NODE_INVENTORY_ANNOTATION,
};
use vgpu_scheduler::cache::book::Book;
use vgpu_scheduler::cache::clock::now_unix_ms;
use vgpu_scheduler::cache::state::SharedState;
use vgpu_scheduler::extender::wire::ExtenderFilterResult;
use vgpu_scheduler::extender::{Config, Scheduler};
use vgpu_testkit::extender_client::ExtenderClient;

const GIB: u64 = 1 << 30;
const RECORDED_POD: &str = include_str!("../../../scheduler/tests/fixtures/pod.json");

struct Options {
    nodes: usize,
    gpus: usize,
    pods: usize,
    iterations: usize,
}

fn options() -> anyhow::Result<Options> {
    let mut options = Options {
        nodes: 5000,
        gpus: 8,
        pods: 20_000,
        iterations: 400,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> anyhow::Result<usize> {
            args.next()
                .with_context(|| format!("{name} needs a value"))?
                .parse()
                .with_context(|| format!("{name} needs a number"))
        };
        match arg.as_str() {
            "--quick" => {
                options.nodes = 500;
                options.pods = 2000;
                options.iterations = 50;
            }
            "--nodes" => options.nodes = value("--nodes")?,
            "--gpus" => options.gpus = value("--gpus")?,
            "--pods" => options.pods = value("--pods")?,
            "--iterations" => options.iterations = value("--iterations")?,
            "--help" | "-h" => {
                println!(
                    "vgpu-scheduler-bench [--quick] [--nodes N] [--gpus N] [--pods N] [--iterations N]\n\
                     Times filter + prioritize for one pod over a simulated cluster and reports VmRSS."
                );
                std::process::exit(0);
            }
            other => anyhow::bail!("unknown argument {other:?} (see --help)"),
        }
    }
    Ok(options)
}

fn vm_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn node_name(i: usize) -> String {
    format!("gpu-node-{i:05}")
}

fn model(i: usize) -> &'static str {
    match i % 4 {
        0 => "NVIDIA A100-SXM4-80GB",
        1 => "NVIDIA H100 80GB HBM3",
        2 => "NVIDIA A10",
        _ => "NVIDIA L40S",
    }
}

fn memory_of(model: &str) -> u64 {
    if model.contains("A10") && !model.contains("A100") {
        24 * GIB
    } else if model.contains("L40S") {
        48 * GIB
    } else {
        80 * GIB
    }
}

/// The Lease node `i`'s device plugin renews.
fn build_lease(i: usize) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(vgpu_cluster::node_lease::lease_name(&node_name(i))),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node_name(i)),
            lease_duration_seconds: Some(40),
            renew_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
            ..LeaseSpec::default()
        }),
    }
}

fn build_node(i: usize, gpus: usize) -> Node {
    let name = node_name(i);
    let model = model(i);
    let inventory = NodeInventory {
        version: FORMAT_VERSION,
        gpus: (0..gpus)
            .map(|g| InventoryGpu {
                offered_memory_bytes: None,
                utilization_percent: None,
                uuid: format!("GPU-{i:05}{g:03}-5e1f-4c6e-a1b2-c3d4e5f6a7b8"),
                index: g as u32,
                model: model.to_string(),
                memory_bytes: memory_of(model),
                sm_count: 132,
                split_count: 10,
                numa: Some((g / 4) as u32),
                nvlink_island: None,
                healthy: true,
            })
            .collect(),
        several_pending: false,
    };
    Node {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            resource_version: Some(i.to_string()),
            labels: Some(BTreeMap::from([
                ("kubernetes.io/hostname".to_string(), name),
                ("kubernetes.io/os".to_string(), "linux".to_string()),
            ])),
            annotations: Some(BTreeMap::from([(
                NODE_INVENTORY_ANNOTATION.to_string(),
                inventory.to_json(),
            )])),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }
}

/// A running pod holding one vGPU (a quarter of the GPU's memory, 25 %).
fn build_pod(i: usize, options: &Options) -> Pod {
    let node = i % options.nodes;
    let gpu = (i / options.nodes) % options.gpus;
    let name = format!("job-{i:06}");
    let decision = Decision {
        version: FORMAT_VERSION,
        node: node_name(node),
        decided_unix_ms: now_unix_ms(),
        containers: vec![ContainerDecision {
            name: "main".into(),
            init: false,
            devices: vec![DeviceGrant {
                uuid: format!("GPU-{node:05}{gpu:03}-5e1f-4c6e-a1b2-c3d4e5f6a7b8"),
                memory_bytes: memory_of(model(node)) / 4,
                cores_percent: 25,
                burst_percent: None,
            }],
            priority: None,
        }],
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some("ml-team".into()),
            uid: Some(format!("{i:08x}-7c1e-4b2a-9d3f-0123456789ab")),
            resource_version: Some((1_000_000 + i).to_string()),
            annotations: Some(BTreeMap::from([
                (DECISION_ANNOTATION.to_string(), decision.to_json()),
                (ALLOCATED_ANNOTATION.to_string(), r#"["main"]"#.to_string()),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node_name(node)),
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            ..PodStatus::default()
        }),
    }
}

/// CPU time this thread has used (not counting time it waited for a CPU:
/// this machine is shared, so wall-clock tails include other programs).
fn thread_cpu() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a pointer to a live
    // local variable.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        now.tv_sec.max(0) as u64,
        now.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

struct Timings {
    filter: Vec<Duration>,
    prioritize: Vec<Duration>,
    both: Vec<Duration>,
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * samples.len() as f64).ceil() as usize;
    samples[rank.clamp(1, samples.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1000.0)
}

fn row(label: &str, samples: &mut [Duration]) {
    let p50 = percentile(samples, 50.0);
    let p99 = percentile(samples, 99.0);
    let max = samples.iter().max().copied().unwrap_or_default();
    println!("| {label} | {} | {} | {} |", ms(p50), ms(p99), ms(max));
}

fn passing(result: &[u8]) -> anyhow::Result<(Vec<String>, usize)> {
    let result: ExtenderFilterResult = serde_json::from_slice(result).context("filter result")?;
    anyhow::ensure!(result.error.is_empty(), "filter error: {}", result.error);
    let names = result.node_names.context("NodeNames")?;
    let failed = result.failed_nodes.len() + result.failed_and_unresolvable_nodes.len();
    Ok((names, failed))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let options = options()?;
    let rss_start = vm_rss_kib();

    // The cluster, applied to the state as the watches would.
    let build_started = Instant::now();
    let state = Arc::new(SharedState::new());
    state.update(|s| {
        s.relist((0..options.nodes).map(|i| build_node(i, options.gpus)));
        // Every node's plugin alive, as its Lease shows.
        s.relist((0..options.nodes).map(build_lease));
        s.relist((0..options.pods).map(|i| build_pod(i, &options)));
    });
    let build_time = build_started.elapsed();
    let rss_state = vm_rss_kib();
    let scheduler = Arc::new(Scheduler::new(Config::default(), state.clone(), None));

    // kube-scheduler's filter body: the recorded pod, every node name; the
    // pod asks for GPU models (the slower path: type rules and the
    // preference for nodes with more GPUs of those models). The same pod
    // without the annotation is measured at the end.
    let plain: Value = serde_json::from_str(RECORDED_POD).context("recorded pod")?;
    let mut pod = plain.clone();
    pod["metadata"]["annotations"]["nvidia.com/use-gputype"] = json!("A100,H100,L40S,A10");
    let names: Vec<String> = (0..options.nodes).map(node_name).collect();
    let filter_body =
        serde_json::to_vec(&json!({ "Pod": pod, "Nodes": null, "NodeNames": names }))?;

    let mut local = Timings {
        filter: Vec::new(),
        prioritize: Vec::new(),
        both: Vec::new(),
    };
    let mut passed = 0;
    let mut prioritize_body = Vec::new();
    let mut cpu_both = Vec::new();
    for _ in 0..options.iterations {
        let cpu_started = thread_cpu();
        let started = Instant::now();
        let reply = scheduler.filter(&filter_body);
        let filtered = started.elapsed();
        let cpu_filtered = thread_cpu().saturating_sub(cpu_started);
        anyhow::ensure!(reply.status == 200, "filter answered {}", reply.status);
        let (names, _) = passing(&reply.body)?;
        passed = names.len();
        prioritize_body =
            serde_json::to_vec(&json!({ "Pod": pod, "Nodes": null, "NodeNames": names }))?;
        let cpu_started = thread_cpu();
        let started_prioritize = Instant::now();
        let reply = scheduler.prioritize(&prioritize_body);
        let prioritized = started_prioritize.elapsed();
        cpu_both.push(cpu_filtered + thread_cpu().saturating_sub(cpu_started));
        anyhow::ensure!(reply.status == 200, "prioritize answered {}", reply.status);
        local.filter.push(filtered);
        local.prioritize.push(prioritized);
        local.both.push(filtered + prioritized);
    }
    // Prioritize without a filter call just before (nothing to reuse).
    let mut uncached = Vec::new();
    for _ in 0..options.iterations {
        let started = Instant::now();
        let reply = scheduler.prioritize(&prioritize_body);
        uncached.push(started.elapsed());
        anyhow::ensure!(reply.status == 200, "prioritize answered {}", reply.status);
    }
    let rss_after_local = vm_rss_kib();

    // The same over HTTP on loopback.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = vgpu_scheduler::server::router(
        scheduler.clone(),
        Arc::new(vgpu_scheduler::server::metrics::ServerMetrics::new()?),
        tokio::sync::watch::channel(false).1,
    );
    let server = tokio::spawn(vgpu_scheduler::server::serve(
        listener,
        router,
        None,
        std::future::pending(),
    ));
    let client = ExtenderClient::new(addr);
    let mut http = Timings {
        filter: Vec::new(),
        prioritize: Vec::new(),
        both: Vec::new(),
    };
    for _ in 0..options.iterations {
        let started = Instant::now();
        let (status, body) = client.post("/filter", filter_body.clone()).await?;
        let filtered = started.elapsed();
        anyhow::ensure!(status == 200, "filter answered {status}");
        passing(&body)?;
        let started_prioritize = Instant::now();
        let (status, _) = client.post("/prioritize", prioritize_body.clone()).await?;
        let prioritized = started_prioritize.elapsed();
        anyhow::ensure!(status == 200, "prioritize answered {status}");
        http.filter.push(filtered);
        http.prioritize.push(prioritized);
        http.both.push(filtered + prioritized);
    }
    server.abort();

    // The plain pod (no type rules), in-process.
    let plain_filter_body =
        serde_json::to_vec(&json!({ "Pod": plain, "Nodes": null, "NodeNames": names }))?;
    let mut plain_both = Vec::new();
    for _ in 0..options.iterations {
        let started = Instant::now();
        let reply = scheduler.filter(&plain_filter_body);
        let filtered = started.elapsed();
        let (names, _) = passing(&reply.body)?;
        let body = serde_json::to_vec(&json!({ "Pod": plain, "Nodes": null, "NodeNames": names }))?;
        let started_prioritize = Instant::now();
        let reply = scheduler.prioritize(&body);
        plain_both.push(filtered + started_prioritize.elapsed());
        anyhow::ensure!(reply.status == 200, "prioritize answered {}", reply.status);
    }
    let rss_end = vm_rss_kib();

    println!(
        "vgpu-scheduler-bench: {} nodes x {} GPUs, {} vGPU pods placed, {} iterations; \
         the pod (recorded fixture, 1 vGPU of 3000 MiB / 30 %, nvidia.com/use-gputype with 4 models) fits {} node(s)",
        options.nodes, options.gpus, options.pods, options.iterations, passed
    );
    println!("state built in {:.2} s\n", build_time.as_secs_f64());
    println!(
        "| one pod, {} candidate nodes | p50 ms | p99 ms | max ms |",
        options.nodes
    );
    println!("|---|---:|---:|---:|");
    row("filter, in-process (JSON in and out)", &mut local.filter);
    row(
        "prioritize right after filter, in-process",
        &mut local.prioritize,
    );
    row("filter + prioritize, in-process", &mut local.both);
    row(
        "filter + prioritize, in-process, CPU time of the thread",
        &mut cpu_both,
    );
    row(
        "prioritize alone (no filter before it), in-process",
        &mut uncached,
    );
    row("filter over HTTP (loopback)", &mut http.filter);
    row("prioritize over HTTP (loopback)", &mut http.prioritize);
    row("filter + prioritize over HTTP", &mut http.both);
    row(
        "filter + prioritize, in-process, pod without type rules",
        &mut plain_both,
    );
    println!();
    println!("| memory (VmRSS) | MiB |");
    println!("|---|---:|");
    println!("| at start | {:.1} |", rss_start as f64 / 1024.0);
    println!(
        "| state built ({} nodes, {} pods) | {:.1} |",
        options.nodes,
        options.pods,
        rss_state as f64 / 1024.0
    );
    println!(
        "| after the in-process runs | {:.1} |",
        rss_after_local as f64 / 1024.0
    );
    println!("| at the end | {:.1} |", rss_end as f64 / 1024.0);
    Ok(())
}
