//! Shared plumbing of the plugin's integration tests: a fake API server, a
//! fake kubelet, plugin processes on simulated GPUs, and the scheduler
//! extender's part (decisions), played by the tests.

#![allow(dead_code)]

pub mod apiserver;
pub mod kubelet;
pub mod node;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};
use vgpu_cluster::decision::{
    parse_allocated, ContainerDecision, Decision, DeviceGrant, NodeInventory, ALLOCATED_ANNOTATION,
    DECISION_ANNOTATION, FORMAT_VERSION, NODE_INVENTORY_ANNOTATION,
};

pub use apiserver::FakeApi;

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

/// An unbound pod with the given init and regular containers.
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

/// The extender's bind: the decision first, then the node.
pub fn bind(api: &FakeApi, name: &str, decision: &Decision) -> Pod {
    api.update_pod(NAMESPACE, name, |pod| {
        pod.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(DECISION_ANNOTATION.into(), decision.to_json());
        pod.spec.as_mut().expect("spec").node_name = Some(decision.node.clone());
    })
}

/// Kubelet started the pod's containers.
pub fn mark_running(api: &FakeApi, name: &str) {
    api.update_pod(NAMESPACE, name, |pod| {
        pod.status = Some(PodStatus {
            phase: Some("Running".into()),
            ..Default::default()
        });
    });
}

/// The containers the plugin recorded as allocated.
pub fn allocated(api: &FakeApi, name: &str) -> Vec<String> {
    api.pod_annotation(NAMESPACE, name, ALLOCATED_ANNOTATION)
        .map(|text| parse_allocated(&text).expect("allocated record parses"))
        .unwrap_or_default()
}

/// The node's published inventory, if any.
pub fn inventory(api: &FakeApi, node: &str) -> Option<NodeInventory> {
    api.node_annotation(node, NODE_INVENTORY_ANNOTATION)
        .map(|text| NodeInventory::parse(&text).expect("inventory parses"))
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

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;
