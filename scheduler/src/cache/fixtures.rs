//! Objects as the API server would send them, for tests of the state and
//! of placement over it (a leaf: the state's own tests use it).

use crate::cache::clock::now_unix_ms;
use crate::vocabulary::elastic::ElasticGpu;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, PodSpec, PodStatus, ResourceQuota};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::BTreeMap;
use vgpu_cluster::decision::{
    ContainerDecision, Decision, DeviceGrant, InventoryGpu, NodeInventory, ALLOCATED_ANNOTATION,
    DECISION_ANNOTATION, FORMAT_VERSION, NODE_INVENTORY_ANNOTATION,
};

pub const GIB: u64 = 1 << 30;

/// GPU `index` of node `node` (`GPU-<node>-<index>`): healthy, split 10
/// ways, on no NUMA node or NVLink island.
pub fn gpu(node: &str, index: u32, model: &str, memory_gib: u64) -> InventoryGpu {
    InventoryGpu {
        offered_memory_bytes: None,
        utilization_percent: None,
        uuid: format!("GPU-{node}-{index}"),
        index,
        model: model.into(),
        memory_bytes: memory_gib * GIB,
        sm_count: 72,
        split_count: 10,
        numa: None,
        nvlink_island: None,
        healthy: true,
    }
}

/// Node `name` whose plugin published `gpus` as its inventory.
pub fn node_with(name: &str, gpus: Vec<InventoryGpu>) -> Node {
    let inventory = NodeInventory {
        version: FORMAT_VERSION,
        gpus,
        several_pending: false,
    };
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            annotations: Some(
                [(NODE_INVENTORY_ANNOTATION.to_string(), inventory.to_json())].into(),
            ),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }
}

/// Node `name` with `gpus` A10s of 24 GiB.
pub fn node(name: &str, gpus: u32) -> Node {
    node_with(name, (0..gpus).map(|i| gpu(name, i, "A10", 24)).collect())
}

/// A Lease as the plugin of `node` writes it, renewed at `renewed`
/// (seconds; only its changes matter).
pub fn lease(node: &str, duration_seconds: i32, renewed: i64) -> Lease {
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": format!("vgpu-{node}"), "namespace": "kube-node-lease" },
        "spec": {
            "holderIdentity": node,
            "leaseDurationSeconds": duration_seconds,
            "renewTime": format!("2026-11-24T10:00:{:02}.000000Z", renewed % 60),
        }
    }))
    .expect("Lease")
}

/// Pod `uid` (also its name, in namespace `ns`) at `version`, decided
/// onto `gpu` of `node` with 4 GiB and 30 %; bound and allocated or not.
pub fn decided(
    uid: &str,
    version: u64,
    node: &str,
    gpu: &str,
    bound: bool,
    allocated: bool,
) -> Pod {
    let decision = Decision {
        version: FORMAT_VERSION,
        node: node.into(),
        decided_unix_ms: now_unix_ms(),
        containers: vec![ContainerDecision {
            name: "main".into(),
            init: false,
            devices: vec![DeviceGrant {
                uuid: gpu.into(),
                memory_bytes: 4 * GIB,
                cores_percent: 30,
                burst_percent: None,
            }],
            priority: None,
        }],
    };
    let mut annotations = BTreeMap::from([(DECISION_ANNOTATION.to_string(), decision.to_json())]);
    if allocated {
        annotations.insert(ALLOCATED_ANNOTATION.to_string(), r#"["main"]"#.to_string());
    }
    Pod {
        metadata: ObjectMeta {
            uid: Some(uid.into()),
            name: Some(uid.into()),
            namespace: Some("ns".into()),
            resource_version: Some(version.to_string()),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: bound.then(|| node.to_string()),
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            phase: Some("Pending".into()),
            ..PodStatus::default()
        }),
    }
}

/// Pod `uid` at `version`, with no decision.
pub fn undecided(uid: &str, version: u64) -> Pod {
    Pod {
        metadata: ObjectMeta {
            uid: Some(uid.into()),
            resource_version: Some(version.to_string()),
            ..ObjectMeta::default()
        },
        ..Pod::default()
    }
}

/// ElasticGPU `name` holding 2 GiB and 20 % of `gpu` on n1 for claim ns/c.
pub fn elastic_gpu(name: &str, version: u64, gpu: &str) -> ElasticGpu {
    let decision = Decision {
        version: FORMAT_VERSION,
        node: "n1".into(),
        decided_unix_ms: now_unix_ms(),
        containers: vec![ContainerDecision {
            name: "c".into(),
            init: false,
            devices: vec![DeviceGrant {
                uuid: gpu.into(),
                memory_bytes: 2 * GIB,
                cores_percent: 20,
                burst_percent: None,
            }],
            priority: None,
        }],
    };
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "resourceVersion": version.to_string(),
                     "annotations": {DECISION_ANNOTATION: decision.to_json()}},
        "spec": {"claimRef": {"namespace": "ns", "name": "c"}},
        "status": {"phase": "Bound"},
    }))
    .expect("an ElasticGPU")
}

/// Pod `uid` (also its name, in namespace `ns`), not decided nor bound,
/// whose one container `main` has `limits` (and the same requests).
pub fn asking(uid: &str, limits: &[(&str, &str)]) -> Pod {
    let limits: serde_json::Map<String, serde_json::Value> = limits
        .iter()
        .map(|(name, value)| (name.to_string(), serde_json::json!(value)))
        .collect();
    serde_json::from_value(serde_json::json!({
        "metadata": {"uid": uid, "name": uid, "namespace": "ns", "resourceVersion": "1"},
        "spec": {"containers": [{"name": "main", "image": "cuda",
                                 "resources": {"limits": limits, "requests": limits}}]},
        "status": {"phase": "Pending"},
    }))
    .expect("a pod")
}

/// A vGPU pod asking for `count` vGPUs of `memory_mib` and `cores`
/// percent each (HAMi's resources).
pub fn asking_vgpus(uid: &str, count: u32, memory_mib: u64, cores: u32) -> Pod {
    asking(
        uid,
        &[
            ("nvidia.com/gpu", &count.to_string()),
            ("nvidia.com/gpumem", &memory_mib.to_string()),
            ("nvidia.com/gpucores", &cores.to_string()),
        ],
    )
}

/// `pod` with annotation `key: value`.
pub fn annotated(mut pod: Pod, key: &str, value: &str) -> Pod {
    pod.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(key.into(), value.into());
    pod
}

/// `pod` with label `key: value`.
pub fn labelled(mut pod: Pod, key: &str, value: &str) -> Pod {
    pod.metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(key.into(), value.into());
    pod
}

/// ResourceQuota `name` of `namespace` with `hard` limits.
pub fn quota(namespace: &str, name: &str, hard: &[(&str, &str)]) -> ResourceQuota {
    let hard: serde_json::Map<String, serde_json::Value> = hard
        .iter()
        .map(|(key, value)| (key.to_string(), serde_json::json!(value)))
        .collect();
    serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"hard": hard},
    }))
    .expect("a ResourceQuota")
}
