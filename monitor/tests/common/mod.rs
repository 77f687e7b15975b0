//! Helpers for the monitor's integration tests: the monitor binary as a
//! child process, plain HTTP over loopback, Prometheus text parsing, region
//! set-up, a real Kubernetes API server with the pods the tests need, and a
//! real Prometheus server (`prometheus_server`).

#![allow(dead_code)]

pub mod prometheus_server;

use k8s_openapi::api::core::v1::{
    Container, Event, Namespace, Node, Pod, PodSpec, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vgpu_cluster::decision::{ContainerDecision, Decision, DeviceGrant, DECISION_ANNOTATION};
use vgpu_node_contract::region::{MemoryKind, Region, RegionLimits};
use vgpu_testkit::kube::ApiServer;

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

pub use vgpu_testkit::free_port;

/// `GET path` over HTTP/1.1; returns the status and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no header end in {text:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line in {head:?}"))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// Polls `check` until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(timeout: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check() {
            return Some(value);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One sample of a Prometheus text exposition.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parses the text format (enough of it for the monitor's output).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample line");
        let value: f64 = value.parse().expect("sample value");
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => (name, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let mut map = BTreeMap::new();
        let mut rest = labels;
        while let Some((key, after)) = rest.split_once("=\"") {
            let mut value = String::new();
            let mut chars = after.char_indices();
            let mut end = after.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, escaped)) = chars.next() {
                            value.push(match escaped {
                                'n' => '\n',
                                other => other,
                            });
                        }
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    other => value.push(other),
                }
            }
            map.insert(key.trim_start_matches(',').to_string(), value);
            rest = &after[end..];
        }
        out.push(Sample {
            name: name.to_string(),
            labels: map,
            value,
        });
    }
    out
}

/// The value of the one sample of `name` whose labels include `labels`.
pub fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let matching: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .collect();
    assert!(
        matching.len() <= 1,
        "{name}{labels:?} matches several samples: {matching:?}"
    );
    matching.first().map(|s| s.value)
}

/// A temporary host directory laid out like `/usr/local/vgpu/containers`.
pub struct HostDir {
    pub root: PathBuf,
}

impl HostDir {
    pub fn new(name: &str) -> Self {
        let root =
            std::env::temp_dir().join(format!("vgpu-monitor-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("create host dir");
        Self { root }
    }

    /// `<root>/<key>/region.cache`, its directory created.
    pub fn region_path(&self, key: &str) -> PathBuf {
        let dir = self.root.join(key);
        std::fs::create_dir_all(&dir).expect("container dir");
        dir.join("region.cache")
    }

    /// A region made through the region API, as the shim would.
    pub fn create_region(&self, key: &str, limits: &RegionLimits) -> Region {
        Region::open_or_create(&self.region_path(key), limits).expect("create region")
    }
}

impl Drop for HostDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Charges memory of every kind to a fresh slot of `region`.
pub fn charge(region: &Region, device: usize, context: u64, module: u64, data: u64) -> usize {
    let slot = region.claim_slot(std::process::id(), 0).expect("slot");
    for (kind, bytes) in [
        (MemoryKind::Context, context),
        (MemoryKind::Module, module),
        (MemoryKind::Data, data),
    ] {
        region
            .reserve(slot, device, kind, bytes)
            .expect("io")
            .expect("fits");
    }
    slot
}

/// The built monitor binary.
pub fn monitor_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_vgpu-monitor"))
}

/// The monitor running as a child process.
pub struct MonitorProcess {
    pub child: Child,
    pub addr: SocketAddr,
    log: PathBuf,
}

impl MonitorProcess {
    /// Starts `vgpu-monitor` on a free loopback port with `args`, using
    /// `command` (for its environment), and waits until it serves.
    pub fn start(mut command: Command, args: &[&str]) -> Self {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let log = std::env::temp_dir().join(format!(
            "vgpu-monitor-test-{}-{}.log",
            std::process::id(),
            addr.port()
        ));
        let log_file = std::fs::File::create(&log).expect("log file");
        let child = command
            .arg("--listen")
            .arg(addr.to_string())
            .args(args)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("spawn vgpu-monitor");
        let mut process = Self { child, addr, log };
        let ready = wait_for(Duration::from_secs(20), || {
            if let Ok(Some(status)) = process.child.try_wait() {
                panic!("vgpu-monitor exited with {status}:\n{}", process.log());
            }
            http_get(process.addr, "/healthz")
                .ok()
                .filter(|(status, _)| *status == 200)
        });
        assert!(
            ready.is_some(),
            "vgpu-monitor did not serve:\n{}",
            process.log()
        );
        process
    }

    /// A plain command for the monitor binary (inherits this environment).
    pub fn command() -> Command {
        Command::new(monitor_exe())
    }

    /// The monitor on `host`'s regions, reading NVML from `sandbox`'s
    /// simulated GPU, with `extra` arguments.
    pub fn on_simulated_gpu(
        sandbox: &vgpu_testkit::Sandbox,
        host: &HostDir,
        extra: &[&str],
    ) -> Self {
        let mut command = sandbox.command_without_shim(&monitor_exe());
        // The monitor is no container process: no region of its own.
        command.env_remove("CUDA_DEVICE_MEMORY_SHARED_CACHE");
        let nvml = sandbox.lib_dir.join("libnvidia-ml.so.1");
        let mut args = vec![
            "--containers-dir",
            host.root.to_str().expect("utf8"),
            "--nvml-library",
            nvml.to_str().expect("utf8"),
        ];
        args.extend_from_slice(extra);
        Self::start(command, &args)
    }

    /// `GET /metrics`, parsed.
    pub fn scrape(&self) -> Vec<Sample> {
        parse_metrics(&self.scrape_text())
    }

    pub fn scrape_text(&self) -> String {
        let (status, body) = http_get(self.addr, "/metrics").expect("scrape");
        assert_eq!(status, 200, "{body}");
        body
    }

    /// Scrapes until `check` accepts the samples.
    pub fn wait_for_metrics<T>(
        &self,
        timeout: Duration,
        mut check: impl FnMut(&[Sample]) -> Option<T>,
    ) -> T {
        let mut last = Vec::new();
        match wait_for(timeout, || {
            last = self.scrape();
            check(&last)
        }) {
            Some(value) => value,
            None => panic!(
                "metrics never matched; last scrape:\n{}\nmonitor log:\n{}",
                last.iter()
                    .map(|s| format!("{} {:?} {}", s.name, s.labels, s.value))
                    .collect::<Vec<_>>()
                    .join("\n"),
                self.log()
            ),
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and wait for a clean exit.
    pub fn stop(mut self) -> std::process::ExitStatus {
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        wait_for(Duration::from_secs(10), || {
            self.child.try_wait().ok().flatten()
        })
        .expect("monitor stops on SIGTERM")
    }
}

impl Drop for MonitorProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A real Kubernetes API server for one test (etcd and kube-apiserver,
/// stopped on drop) and an admin client of it, driven from these blocking
/// tests through a runtime of its own. The monitor reaches it through the
/// admin kubeconfig.
pub struct KubeApi {
    server: ApiServer,
    client: kube::Client,
    runtime: tokio::runtime::Runtime,
}

impl KubeApi {
    pub fn start() -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the API client");
        let server = ApiServer::start();
        let client = runtime.block_on(server.client());
        Self {
            server,
            client,
            runtime,
        }
    }

    /// The admin kubeconfig, for `--kubeconfig`.
    pub fn kubeconfig(&self) -> &str {
        self.server.kubeconfig().to_str().expect("utf8")
    }

    /// A namespace (only `default` and the system ones exist at first).
    pub fn add_namespace(&self, name: &str) {
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        self.runtime
            .block_on(
                Api::<Namespace>::all(self.client.clone())
                    .create(&PostParams::default(), &namespace),
            )
            .unwrap_or_else(|error| panic!("create namespace {name}: {error}"));
    }

    /// The node object, as its kubelet registers it.
    pub fn add_node(&self, name: &str) {
        let node = Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        self.runtime
            .block_on(Api::<Node>::all(self.client.clone()).create(&PostParams::default(), &node))
            .unwrap_or_else(|error| panic!("create node {name}: {error}"));
    }

    /// Creates pod `namespace/name` (one GPU container, `main`) with
    /// `annotations` and binds it to `node` through the `binding`
    /// subresource, as the scheduler does; answers the UID the server gave
    /// it (what the pod's region directories are named by).
    pub fn add_bound_pod(
        &self,
        namespace: &str,
        name: &str,
        node: &str,
        annotations: BTreeMap<String, String>,
    ) -> String {
        let limits = asking_for_the_decision(&annotations, "main");
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                annotations: Some(annotations),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "main".into(),
                    image: Some("nvcr.io/nvidia/pytorch:24.08-py3".into()),
                    resources: Some(ResourceRequirements {
                        limits: Some(limits),
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            status: None,
        };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let created = self
            .runtime
            .block_on(pods.create(&PostParams::default(), &pod))
            .unwrap_or_else(|error| panic!("create pod {namespace}/{name}: {error}"));
        self.runtime.block_on(vgpu_testkit::kube::bind_pod(
            &self.client,
            namespace,
            name,
            node,
        ));
        created
            .metadata
            .uid
            .expect("the server gives every pod a UID")
    }

    /// Sets `annotations` on pod `namespace/name` (others are kept), as
    /// the extender writes a new decision.
    pub fn set_annotations(
        &self,
        namespace: &str,
        name: &str,
        annotations: BTreeMap<String, String>,
    ) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let patch = serde_json::json!({ "metadata": { "annotations": annotations } });
        self.runtime
            .block_on(pods.patch(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            ))
            .unwrap_or_else(|error| panic!("annotate pod {namespace}/{name}: {error}"));
    }

    /// Deletes a bound pod as it happens in a cluster: the user's delete
    /// only marks it (a bound pod waits for its kubelet), and the kubelet,
    /// once the containers have stopped, deletes it for good (grace 0).
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        self.runtime
            .block_on(pods.delete(name, &DeleteParams::default()))
            .unwrap_or_else(|error| panic!("delete pod {namespace}/{name}: {error}"));
        self.runtime
            .block_on(pods.delete(name, &DeleteParams::default().grace_period(0)))
            .unwrap_or_else(|error| panic!("finish deleting pod {namespace}/{name}: {error}"));
    }

    /// The Events recorded in `namespace`.
    pub fn events(&self, namespace: &str) -> Vec<Event> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        self.runtime
            .block_on(events.list(&ListParams::default()))
            .unwrap_or_else(|error| panic!("list Events in {namespace}: {error}"))
            .items
    }

    /// The API server's own metrics (Prometheus text).
    pub fn server_metrics(&self) -> Vec<Sample> {
        let request = http::Request::get("/metrics")
            .body(Vec::new())
            .expect("request");
        let text = self
            .runtime
            .block_on(self.client.request_text(request))
            .unwrap_or_else(|error| panic!("the API server's /metrics: {error}"));
        parse_metrics(&text)
    }
}

/// Whether `path` exists.
pub fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// The limits of a container `container` asking for what the decision in
/// `annotations` grants it (one vGPU when there is none): the monitor
/// restores a decision only as far as its pod asks for.
fn asking_for_the_decision(
    annotations: &BTreeMap<String, String>,
    container: &str,
) -> BTreeMap<String, Quantity> {
    let mut limits = BTreeMap::from([("nvidia.com/gpu".to_string(), Quantity("1".into()))]);
    let decided = annotations
        .get(DECISION_ANNOTATION)
        .and_then(|text| Decision::parse(text).ok())
        .and_then(|d| d.containers.into_iter().find(|c| c.name == container));
    if let Some(decided) = decided {
        let mut ask = |name: &str, value: String| {
            limits.insert(name.to_string(), Quantity(value));
        };
        ask("nvidia.com/gpu", decided.devices.len().to_string());
        if let Some(grant) = decided.devices.first() {
            ask("nvidia.com/gpumem", (grant.memory_bytes >> 20).to_string());
            ask("nvidia.com/gpucores", grant.cores_percent.to_string());
        }
        if let Some(priority) = decided.priority {
            ask("nvidia.com/priority", priority.to_string());
        }
    }
    limits
}

/// Pod annotations holding the scheduler's decision for `container` on
/// `node`: GPU `GPU-k8s`, 4 GiB, 30 %, at `priority`.
pub fn decision_annotations(
    node: &str,
    container: &str,
    priority: i32,
) -> BTreeMap<String, String> {
    let decision = Decision {
        version: 1,
        node: node.into(),
        decided_unix_ms: 1,
        containers: vec![ContainerDecision {
            name: container.into(),
            init: false,
            devices: vec![DeviceGrant {
                uuid: "GPU-k8s".into(),
                memory_bytes: 4 * GIB,
                cores_percent: 30,
                burst_percent: None,
            }],
            priority: Some(priority),
        }],
    };
    BTreeMap::from([(DECISION_ANNOTATION.to_string(), decision.to_json())])
}
