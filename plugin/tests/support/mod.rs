//! Shared plumbing of the plugin's integration tests: a real Kubernetes API
//! server per test (etcd and kube-apiserver, [`ControlPlane`]), a fake
//! kubelet, plugin processes on simulated GPUs, and the scheduler
//! extender's part (decisions, binding), played by the tests.
//!
//! The API server is the real one, so what the tests do to it is what a
//! cluster allows: the node object exists before the plugin annotates it
//! (kubelet registers it), a pod is bound only through its `binding`
//! subresource, its phase changes only through `status`, and UIDs and
//! resource versions are the server's.

#![allow(dead_code)]

pub mod kubelet;
pub mod node;

use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec, PodStatus, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kube::Client;
use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};
use vgpu_cluster::client::ApiSource;
use vgpu_cluster::decision::{
    parse_allocated, ContainerDecision, Decision, DeviceGrant, NodeInventory, ALLOCATED_ANNOTATION,
    DECISION_ANNOTATION, FORMAT_VERSION, NODE_INVENTORY_ANNOTATION,
};
use vgpu_testkit::kube::ApiServer;

pub const RESOURCE: &str = "nvidia.com/gpu";
pub const NAMESPACE: &str = "default";

/// A container asking for `gpus` vGPUs.
pub fn container(name: &str, gpus: usize) -> Container {
    Container {
        name: name.into(),
        image: Some("cuda-app".into()),
        resources: Some(ResourceRequirements {
            limits: Some(BTreeMap::from([(
                RESOURCE.to_string(),
                Quantity(gpus.to_string()),
            )])),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `container` also asking for `amount` of resource `name` (what the
/// extender then grants, and the plugin checks the grants against).
pub fn asking(mut container: Container, name: &str, amount: &str) -> Container {
    container
        .resources
        .get_or_insert_with(Default::default)
        .limits
        .get_or_insert_with(Default::default)
        .insert(name.into(), Quantity(amount.into()));
    container
}

/// An unbound pod with the given init and regular containers. The status
/// is what the API server gives a new pod anyway (it ignores a client's).
pub fn pod(name: &str, init: Vec<Container>, containers: Vec<Container>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NAMESPACE.into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            init_containers: (!init.is_empty()).then_some(init),
            containers,
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Pending".into()),
            ..Default::default()
        }),
    }
}

/// The extender's decision for `pod` on `node`: each GPU container gets
/// `grants(container index, count)`.
pub fn decide(
    pod: &Pod,
    node: &str,
    mut grants: impl FnMut(usize, usize) -> (Vec<DeviceGrant>, Option<i32>),
) -> Decision {
    let spec = pod.spec.as_ref().expect("spec");
    let init_names: Vec<&str> = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    let containers = kubelet::gpu_containers(pod, RESOURCE)
        .into_iter()
        .enumerate()
        .map(|(i, (name, count))| {
            let (devices, priority) = grants(i, count);
            assert_eq!(devices.len(), count);
            ContainerDecision {
                init: init_names.contains(&name.as_str()),
                name,
                devices,
                priority,
            }
        })
        .collect();
    Decision {
        version: FORMAT_VERSION,
        node: node.into(),
        decided_unix_ms: 1,
        containers,
    }
}

/// A real API server for one test and an admin client of it.
pub struct ControlPlane {
    pub server: ApiServer,
    pub client: Client,
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver (seconds; on a blocking thread, so
    /// the test's runtime keeps serving meanwhile).
    pub async fn start() -> Self {
        let server = tokio::task::spawn_blocking(ApiServer::start)
            .await
            .expect("start the test API server");
        let client = server.client().await;
        Self { server, client }
    }

    /// How a plugin reaches it: the admin kubeconfig.
    pub fn source(&self) -> ApiSource {
        ApiSource::Kubeconfig(self.server.kubeconfig().to_path_buf())
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), NAMESPACE)
    }

    /// The node object, as kubelet registers it before any plugin runs
    /// there (the plugin only patches it).
    pub async fn add_node(&self, name: &str) {
        let node = Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Node>::all(self.client.clone())
            .create(&PostParams::default(), &node)
            .await
            .unwrap_or_else(|error| panic!("create node {name}: {error}"));
    }

    /// Creates `pod`; the answer carries the UID and resource version the
    /// server gave it.
    pub async fn add_pod(&self, pod: Pod) -> Pod {
        let name = pod.metadata.name.clone().unwrap_or_default();
        self.pods()
            .create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|error| panic!("create pod {name}: {error}"))
    }

    /// The pod as the server has it now.
    pub async fn pod(&self, name: &str) -> Pod {
        self.pods()
            .get(name)
            .await
            .unwrap_or_else(|error| panic!("get pod {name}: {error}"))
    }

    /// The extender's bind: the node and the decision in one Binding (the
    /// `binding` subresource, the only way to set `spec.nodeName`), whose
    /// annotations the API server merges into the pod.
    pub async fn bind(&self, name: &str, decision: &Decision) -> Pod {
        let annotations = [(DECISION_ANNOTATION.to_string(), decision.to_json())].into();
        vgpu_testkit::kube::bind_pod_annotated(
            &self.client,
            NAMESPACE,
            name,
            &decision.node,
            annotations,
        )
        .await;
        self.pod(name).await
    }

    /// Sets the pod's phase as kubelet does, through `status`.
    pub async fn set_phase(&self, name: &str, phase: &str) {
        vgpu_testkit::kube::set_pod_phase(&self.client, NAMESPACE, name, phase).await;
    }

    /// Kubelet started the pod's containers.
    pub async fn mark_running(&self, name: &str) {
        self.set_phase(name, "Running").await;
    }

    /// The containers the plugin recorded as allocated.
    pub async fn allocated(&self, name: &str) -> Vec<String> {
        self.pod(name)
            .await
            .metadata
            .annotations
            .and_then(|a| a.get(ALLOCATED_ANNOTATION).cloned())
            .map(|text| parse_allocated(&text).expect("allocated record parses"))
            .unwrap_or_default()
    }

    /// Waits until the pod's allocation record names exactly `containers`,
    /// in order (the plugin publishes it after answering kubelet); panics
    /// after [`RECORD_WAIT`].
    pub async fn wait_allocated(&self, name: &str, containers: &[impl AsRef<str>]) {
        let expected: Vec<&str> = containers.iter().map(AsRef::as_ref).collect();
        eventually(
            RECORD_WAIT,
            &format!("pod {name}'s record {expected:?}"),
            || async { (self.allocated(name).await == expected).then_some(()) },
        )
        .await;
    }

    /// The node's published inventory, if any.
    pub async fn inventory(&self, node: &str) -> Option<NodeInventory> {
        Api::<Node>::all(self.client.clone())
            .get(node)
            .await
            .unwrap_or_else(|error| panic!("get node {node}: {error}"))
            .metadata
            .annotations
            .and_then(|a| a.get(NODE_INVENTORY_ANNOTATION).cloned())
            .map(|text| NodeInventory::parse(&text).expect("inventory parses"))
    }

    /// The node's Lease as its plugin keeps it, if it exists.
    pub async fn lease(&self, node: &str) -> Option<k8s_openapi::api::coordination::v1::Lease> {
        use vgpu_cluster::node_lease::{lease_name, NODE_LEASE_NAMESPACE};
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
            self.client.clone(),
            NODE_LEASE_NAMESPACE,
        )
        .get_opt(&lease_name(node))
        .await
        .unwrap_or_else(|error| panic!("get the Lease of {node}: {error}"))
    }
}

/// Polls `check` until it gives `Some`, or panics after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Longer than the plugin's longest wait between attempts at publishing
/// a record (5 s).
pub const RECORD_WAIT: Duration = Duration::from_secs(20);

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;
