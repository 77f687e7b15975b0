//! The Kubernetes API client: the reads and writes the extender, the
//! webhook and the claim controller make. It knows nothing of the
//! extender's state; the watches that feed it are [`crate::cache::watch`].

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use serde_json::json;
use thiserror::Error;
use vgpu_cluster::decision::{ALLOCATED_ANNOTATION, DECISION_ANNOTATION};

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
    #[error("unreadable object: {0}")]
    Decode(#[source] serde_json::Error),
    #[error("watch: {0}")]
    Watch(String),
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

/// Elastic GPU's resource `kind` (plural `plural`) in its stored version.
fn elastic_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("elasticgpu.io", "v1alpha1", kind),
        plural,
    )
}

/// Every `ElasticGPU` of the cluster, read as dynamic objects.
pub fn elastic_gpus(client: Client) -> Api<DynamicObject> {
    Api::all_with(client, &elastic_resource("ElasticGPU", "elasticgpus"))
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
    ) -> Result<serde_json::Value, ApiError> {
        let resource = elastic_resource("ElasticGPUClaim", "elasticgpuclaims");
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, &resource);
        serde_json::to_value(api.get(name).await?).map_err(ApiError::Decode)
    }

    fn elastic_claims_all(&self) -> Api<DynamicObject> {
        Api::all_with(
            self.client.clone(),
            &elastic_resource("ElasticGPUClaim", "elasticgpuclaims"),
        )
    }

    fn elastic_claims(&self, namespace: &str) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.client.clone(),
            namespace,
            &elastic_resource("ElasticGPUClaim", "elasticgpuclaims"),
        )
    }

    fn elastic_gpus(&self) -> Api<DynamicObject> {
        elastic_gpus(self.client.clone())
    }

    /// Every `ElasticGPUClaim`, as JSON.
    pub async fn list_elastic_claims(&self) -> Result<Vec<serde_json::Value>, ApiError> {
        let list = self
            .elastic_claims_all()
            .list(&ListParams::default())
            .await?;
        list.items
            .into_iter()
            .map(|item| serde_json::to_value(item).map_err(ApiError::Decode))
            .collect()
    }

    /// The claims as they change (each one as JSON, after every change).
    pub fn watch_elastic_claims(
        &self,
    ) -> impl futures_util::Stream<Item = Result<serde_json::Value, ApiError>> + Send + 'static
    {
        watcher::watcher(self.elastic_claims_all(), watcher::Config::default())
            .default_backoff()
            .applied_objects()
            .map(|item| match item {
                Ok(object) => serde_json::to_value(object).map_err(ApiError::Decode),
                Err(error) => Err(ApiError::Watch(error.to_string())),
            })
    }

    /// A JSON merge patch of a claim's object or of its status (a
    /// `metadata.resourceVersion` in it is a precondition).
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

    /// Creates an `ElasticGPU` (given as JSON); answers it as created.
    pub async fn create_elastic_gpu(
        &self,
        object: &serde_json::Value,
    ) -> Result<serde_json::Value, ApiError> {
        let object: DynamicObject =
            serde_json::from_value(object.clone()).map_err(ApiError::Decode)?;
        let created = self
            .elastic_gpus()
            .create(&PostParams::default(), &object)
            .await?;
        serde_json::to_value(created).map_err(ApiError::Decode)
    }

    /// An `ElasticGPU`, as JSON.
    pub async fn get_elastic_gpu(&self, name: &str) -> Result<serde_json::Value, ApiError> {
        serde_json::to_value(self.elastic_gpus().get(name).await?).map_err(ApiError::Decode)
    }

    /// A JSON merge patch of an `ElasticGPU` (a `metadata.resourceVersion`
    /// in it is a precondition); answers it as patched.
    pub async fn patch_elastic_gpu(
        &self,
        name: &str,
        patch: &serde_json::Value,
    ) -> Result<serde_json::Value, ApiError> {
        let patched = self
            .elastic_gpus()
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await?;
        serde_json::to_value(patched).map_err(ApiError::Decode)
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
    pub async fn get_elastic_class(&self, name: &str) -> Result<serde_json::Value, ApiError> {
        let resource = elastic_resource("ElasticGPUClass", "elasticgpuclasses");
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &resource);
        serde_json::to_value(api.get(name).await?).map_err(ApiError::Decode)
    }

    /// Writes `decision` (JSON) as the pod's decision annotation, clearing
    /// any allocation record, if the pod is still at `resource_version`.
    pub async fn write_decision(
        &self,
        namespace: &str,
        name: &str,
        resource_version: &str,
        decision: &str,
    ) -> Result<Pod, ApiError> {
        let patch = json!({
            "metadata": {
                "resourceVersion": resource_version,
                "annotations": {
                    DECISION_ANNOTATION: decision,
                    ALLOCATED_ANNOTATION: null,
                }
            }
        });
        Ok(self
            .pods(namespace)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?)
    }

    /// Removes the decision annotation, if the pod is still at
    /// `resource_version` (a pod that changed since, e.g. got bound after
    /// all, keeps it).
    pub async fn clear_decision(
        &self,
        namespace: &str,
        name: &str,
        resource_version: &str,
    ) -> Result<Pod, ApiError> {
        let patch = json!({
            "metadata": {
                "resourceVersion": resource_version,
                "annotations": { DECISION_ANNOTATION: null }
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
        let binding = json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": { "name": name, "namespace": namespace, "uid": uid },
            "target": { "apiVersion": "v1", "kind": "Node", "name": node }
        });
        let _status: serde_json::Value = self
            .pods(namespace)
            .create_subresource("binding", name, &PostParams::default(), &binding)
            .await?;
        Ok(())
    }
}
