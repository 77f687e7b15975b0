//! The Kubernetes API: the pods bound to this node (read fresh where the
//! watched ones in [`crate::pod_cache`] may not be trusted), the allocation
//! record on a pod ([`crate::records`]), the node's GPU inventory, and the
//! node's Lease.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use thiserror::Error;
use vgpu_cluster::decision::{NodeInventory, ALLOCATED_ANNOTATION, NODE_INVENTORY_ANNOTATION};
use vgpu_cluster::node_lease::{
    lease_name, NODE_LEASE_LABEL, NODE_LEASE_LABEL_VALUE, NODE_LEASE_NAMESPACE,
};

pub use vgpu_cluster::client::{ApiSource, ClientError};

#[derive(Debug, Error)]
pub enum ClusterError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("{what}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
}

impl ClusterError {
    /// Whether the object is not there (HTTP 404).
    pub fn is_gone(&self) -> bool {
        matches!(self, Self::Api { source: kube::Error::Api(status), .. } if status.code == 404)
    }

    /// Whether the API server could not answer (unreachable, restarting,
    /// overloaded, or its storage down) rather than refused: asking again
    /// shortly may succeed. 401 and 403 count too: an API server that has
    /// just restarted serves requests before its token and RBAC caches are
    /// filled and refuses them meanwhile; a refusal that lasts is reported
    /// once the wait is over.
    pub fn is_outage(&self) -> bool {
        match self {
            Self::Client(_) => false,
            Self::Api { source, .. } => match source {
                kube::Error::Api(status) => {
                    status.code >= 500 || matches!(status.code, 401 | 403 | 429)
                }
                _ => true,
            },
        }
    }
}

/// Builds a client for `source`.
pub async fn make_client(source: &ApiSource) -> Result<Client, ClusterError> {
    Ok(vgpu_cluster::client::make_client(source).await?)
}

/// This node's view of the API.
#[derive(Clone)]
pub struct Cluster {
    client: Client,
    node: String,
}

fn api_error(what: String) -> impl FnOnce(kube::Error) -> ClusterError {
    move |source| ClusterError::Api { what, source }
}

impl Cluster {
    pub fn new(client: Client, node: String) -> Self {
        Self { client, node }
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The pods bound to this node, as the API server has them now.
    pub async fn pods_on_node(&self) -> Result<Vec<Pod>, ClusterError> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let params = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        let list = pods
            .list(&params)
            .await
            .map_err(api_error(format!("list pods on node {}", self.node)))?;
        Ok(list.items)
    }

    /// The pod `namespace/name` as the API server has it now; `None`: none.
    pub async fn pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, ClusterError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        pods.get_opt(name)
            .await
            .map_err(api_error(format!("pod {namespace}/{name}")))
    }

    /// Records `allocated` as the allocated containers of the pod
    /// `namespace/name`, provided it is still the pod with UID `uid` (a pod
    /// of the same name made since is refused); answers the pod written.
    pub async fn record_allocated(
        &self,
        (namespace, name): (&str, &str),
        uid: &str,
        allocated: &[String],
    ) -> Result<Pod, ClusterError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let record = serde_json::to_string(allocated).unwrap_or_else(|_| "[]".to_string());
        let patch = serde_json::json!({
            "metadata": {
                "uid": uid,
                "annotations": { ALLOCATED_ANNOTATION: record },
            }
        });
        pods.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(format!("pod {namespace}/{name}")))
    }

    /// Sets, in the node's status, the capacity (and allocatable: no
    /// reservation applies) of each resource in `amounts`, leaving every
    /// other resource as kubelet wrote it.
    pub async fn publish_capacity(
        &self,
        amounts: &std::collections::BTreeMap<String, u64>,
    ) -> Result<(), ClusterError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let quantities: serde_json::Map<String, serde_json::Value> = amounts
            .iter()
            .map(|(name, amount)| (name.clone(), serde_json::Value::String(amount.to_string())))
            .collect();
        let patch = serde_json::json!({
            "status": { "capacity": quantities, "allocatable": quantities }
        });
        nodes
            .patch_status(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(format!("status of node {}", self.node)))?;
        Ok(())
    }

    /// Writes the node's inventory annotation.
    pub async fn publish_inventory(&self, inventory: &NodeInventory) -> Result<(), ClusterError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let patch = serde_json::json!({
            "metadata": {
                "annotations": { NODE_INVENTORY_ANNOTATION: inventory.to_json() },
            }
        });
        nodes
            .patch(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(format!("node {}", self.node)))?;
        Ok(())
    }

    /// Renews the node's Lease ([`vgpu_cluster::node_lease`]), creating it
    /// when it is missing (first start, or deleted by someone).
    pub async fn renew_lease(&self, duration_seconds: u32) -> Result<(), ClusterError> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), NODE_LEASE_NAMESPACE);
        let name = lease_name(&self.node);
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let duration = i32::try_from(duration_seconds).unwrap_or(i32::MAX);
        // A merge patch needs no read first and cannot conflict: this
        // plugin is the Lease's only writer.
        let patch = serde_json::json!({
            "spec": {
                "holderIdentity": self.node,
                "leaseDurationSeconds": duration,
                "renewTime": now,
            }
        });
        let what = || format!("Lease {NODE_LEASE_NAMESPACE}/{name}");
        match leases
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(source) => return Err(api_error(what())(source)),
        }
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(NODE_LEASE_NAMESPACE.to_string()),
                labels: Some(
                    [(
                        NODE_LEASE_LABEL.to_string(),
                        NODE_LEASE_LABEL_VALUE.to_string(),
                    )]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.node.clone()),
                lease_duration_seconds: Some(duration),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                ..LeaseSpec::default()
            }),
        };
        leases
            .create(&PostParams::default(), &lease)
            .await
            .map_err(api_error(what()))?;
        Ok(())
    }
}
