//! The Kubernetes API client: the reads and writes the extender, the
//! webhook and the claim controller make. It knows nothing of the
//! extender's state; the watches that feed it are [`crate::cache::watch`].

use crate::vocabulary::elastic::{ElasticGpu, ElasticGpuClaim, ElasticGpuClass};
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use thiserror::Error;
use vgpu_cluster::decision::{ALLOCATED_ANNOTATION, DECISION_ANNOTATION};
use vgpu_cluster::events::{pod_event, PodRef, Reporter};
use vgpu_cluster::resize::RESIZE_STATUS_ANNOTATION;

pub use vgpu_cluster::client::{ApiSource, ClientError};

/// A failed API call or client set-up.
#[derive(Debug, Error)]
pub enum ApiError {
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The object changed since it was read (resourceVersion precondition).
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("API server answered {code} {reason}: {message}")]
    Refused {
        code: u16,
        reason: String,
        message: String,
    },
    #[error("Kubernetes API call")]
    Other(#[source] kube::Error),
}

impl From<kube::Error> for ApiError {
    fn from(error: kube::Error) -> Self {
        match &error {
            kube::Error::Api(status) if status.code == 409 => {
                Self::Conflict(status.message.clone())
            }
            kube::Error::Api(status) if status.code == 404 => {
                Self::NotFound(status.message.clone())
            }
            kube::Error::Api(status) => Self::Refused {
                code: status.code,
                reason: status.reason.clone(),
                message: status.message.clone(),
            },
            _ => Self::Other(error),
        }
    }
}

/// The pod as it was read: a write made from it is refused once it
/// changed.
#[derive(Clone, Copy, Debug)]
pub struct PodVersion<'a> {
    pub uid: &'a str,
    pub resource_version: &'a str,
}

/// Every `ElasticGPU` of the cluster.
pub fn elastic_gpus(client: Client) -> Api<ElasticGpu> {
    Api::all(client)
}

/// Builds a client for `source`.
pub async fn make_client(source: &ApiSource) -> Result<Client, ApiError> {
    Ok(vgpu_cluster::client::make_client(source).await?)
}

/// Which part of an `ElasticGPUClaim` a patch writes: the object
/// (metadata, spec) or the status subresource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimPart {
    Object,
    Status,
}

/// The extender's API calls.
#[derive(Clone)]
pub struct KubeApi {
    client: Client,
}

impl KubeApi {
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), namespace)
    }

    pub async fn get_pod(&self, namespace: &str, name: &str) -> Result<Pod, ApiError> {
        Ok(self.pods(namespace).get(name).await?)
    }

    /// The pods of `namespace`.
    pub async fn pods_in(&self, namespace: &str) -> Result<Vec<Pod>, ApiError> {
        Ok(self
            .pods(namespace)
            .list(&ListParams::default())
            .await?
            .items)
    }

    /// An `ElasticGPUClaim` as the API stores it (`elasticgpu.io/v1alpha1`).
    pub async fn get_elastic_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<ElasticGpuClaim, ApiError> {
        Ok(self.elastic_claims(namespace).get(name).await?)
    }

    /// The claims of every namespace (what the claim controller watches).
    pub fn elastic_claims_all(&self) -> Api<ElasticGpuClaim> {
        Api::all(self.client.clone())
    }

    /// The claims of `namespace` (where a claim's own writes go).
    pub fn elastic_claims(&self, namespace: &str) -> Api<ElasticGpuClaim> {
        Api::namespaced(self.client.clone(), namespace)
    }

    /// The classes (cluster-wide).
    pub fn elastic_classes(&self) -> Api<ElasticGpuClass> {
        Api::all(self.client.clone())
    }

    fn elastic_gpus(&self) -> Api<ElasticGpu> {
        elastic_gpus(self.client.clone())
    }

    /// A JSON merge patch of a claim's object or of its status (a
    /// `metadata.resourceVersion` in it is a precondition): only what it
    /// names is written, so nothing else of the claim is lost.
    pub async fn patch_elastic_claim(
        &self,
        namespace: &str,
        name: &str,
        part: ClaimPart,
        patch: &serde_json::Value,
    ) -> Result<(), ApiError> {
        let claims = self.elastic_claims(namespace);
        let (params, patch) = (PatchParams::default(), Patch::Merge(patch));
        match part {
            ClaimPart::Object => claims.patch(name, &params, &patch).await?,
            ClaimPart::Status => claims.patch_status(name, &params, &patch).await?,
        };
        Ok(())
    }

    /// Creates an `ElasticGPU`; answers it as created.
    pub async fn create_elastic_gpu(&self, object: &ElasticGpu) -> Result<ElasticGpu, ApiError> {
        Ok(self
            .elastic_gpus()
            .create(&PostParams::default(), object)
            .await?)
    }

    pub async fn get_elastic_gpu(&self, name: &str) -> Result<ElasticGpu, ApiError> {
        Ok(self.elastic_gpus().get(name).await?)
    }

    /// A JSON merge patch of an `ElasticGPU` (a `metadata.resourceVersion`
    /// in it is a precondition); answers it as patched.
    pub async fn patch_elastic_gpu(
        &self,
        name: &str,
        patch: &serde_json::Value,
    ) -> Result<ElasticGpu, ApiError> {
        Ok(self
            .elastic_gpus()
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await?)
    }

    /// A JSON merge patch of an `ElasticGPU`'s status.
    pub async fn patch_elastic_gpu_status(
        &self,
        name: &str,
        patch: &serde_json::Value,
    ) -> Result<(), ApiError> {
        self.elastic_gpus()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(patch))
            .await?;
        Ok(())
    }

    pub async fn delete_elastic_gpu(&self, name: &str) -> Result<(), ApiError> {
        self.elastic_gpus()
            .delete(name, &kube::api::DeleteParams::default())
            .await?;
        Ok(())
    }

    /// An `ElasticGPUClass` as the API stores it (`elasticgpu.io/v1alpha1`).
    pub async fn get_elastic_class(&self, name: &str) -> Result<ElasticGpuClass, ApiError> {
        Ok(self.elastic_classes().get(name).await?)
    }

    /// Answers a pod's resize request: its status, and the new decision
    /// when one was made (the device plugin's record of what it
    /// allocated is kept: the containers run), if the pod is still at
    /// `resource_version`.
    pub async fn write_resize(
        &self,
        namespace: &str,
        name: &str,
        resource_version: &str,
        decision: Option<&str>,
        status: &str,
    ) -> Result<Pod, ApiError> {
        let mut annotations = serde_json::Map::new();
        annotations.insert(RESIZE_STATUS_ANNOTATION.into(), status.into());
        if let Some(decision) = decision {
            annotations.insert(DECISION_ANNOTATION.into(), decision.into());
        }
        let patch = json!({
            "metadata": {
                "resourceVersion": resource_version,
                "annotations": annotations,
            }
        });
        Ok(self
            .pods(namespace)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?)
    }

    /// Records an Event on `pod` (`kubectl describe pod` shows it), of
    /// type `Normal` or `Warning`.
    pub async fn record_event(
        &self,
        pod: &Pod,
        type_: &str,
        reason: &str,
        message: &str,
    ) -> Result<(), ApiError> {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
        let event = pod_event(
            &PodRef {
                namespace,
                name: pod.metadata.name.as_deref().unwrap_or_default(),
                uid: pod.metadata.uid.as_deref().unwrap_or_default(),
            },
            &Reporter {
                component: "vgpu-scheduler",
                host: None,
            },
            type_,
            reason,
            message.to_string(),
        );
        Api::<Event>::namespaced(self.client.clone(), namespace)
            .create(&PostParams::default(), &event)
            .await?;
        Ok(())
    }

    /// Removes vgpu's records of an earlier grant (the decision and the
    /// device plugin's allocation) from a pod not bound yet, if it is still
    /// at `resource_version`: a Binding can add annotations but not remove
    /// them.
    pub async fn clear_records(
        &self,
        namespace: &str,
        name: &str,
        resource_version: &str,
    ) -> Result<Pod, ApiError> {
        let patch = json!({
            "metadata": {
                "resourceVersion": resource_version,
                "annotations": { DECISION_ANNOTATION: null, ALLOCATED_ANNOTATION: null }
            }
        });
        Ok(self
            .pods(namespace)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?)
    }

    /// Binds the pod (`POST .../pods/{name}/binding`; the UID makes the API
    /// server refuse a different pod of the same name).
    pub async fn bind(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        node: &str,
    ) -> Result<(), ApiError> {
        let metadata = json!({ "name": name, "namespace": namespace, "uid": uid });
        self.post_binding(namespace, name, metadata, node).await
    }

    /// Binds the pod and records its decision in one write: the API server
    /// merges a Binding's annotations into the pod, under the Binding's UID
    /// and `resourceVersion` as preconditions (so a pod changed since it
    /// was read is refused with a conflict, and nothing is written).
    pub async fn bind_with_decision(
        &self,
        namespace: &str,
        name: &str,
        read: &PodVersion<'_>,
        node: &str,
        decision: &str,
    ) -> Result<(), ApiError> {
        let metadata = json!({
            "name": name,
            "namespace": namespace,
            "uid": read.uid,
            "resourceVersion": read.resource_version,
            "annotations": { DECISION_ANNOTATION: decision },
        });
        self.post_binding(namespace, name, metadata, node).await
    }

    async fn post_binding(
        &self,
        namespace: &str,
        name: &str,
        metadata: serde_json::Value,
        node: &str,
    ) -> Result<(), ApiError> {
        let binding = json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": metadata,
            "target": { "apiVersion": "v1", "kind": "Node", "name": node }
        });
        let _status: serde_json::Value = self
            .pods(namespace)
            .create_subresource("binding", name, &PostParams::default(), &binding)
            .await?;
        Ok(())
    }
}
