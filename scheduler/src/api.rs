//! The Kubernetes API: the client, the watches that feed the state, and
//! the three writes the extender makes (decision, binding, and removing a
//! decision whose binding failed).

use crate::state::SharedState;
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{
    ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::runtime::watcher::{self, Event, ListSemantic};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use serde_json::json;
use std::sync::Arc;
use thiserror::Error;
use vgpu_cluster::decision::{ALLOCATED_ANNOTATION, DECISION_ANNOTATION};
use vgpu_cluster::node_lease::{lease_selector, NODE_LEASE_NAMESPACE};

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
        Api::all_with(
            self.client.clone(),
            &elastic_resource("ElasticGPU", "elasticgpus"),
        )
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

/// Lists and watches every pod forever, feeding `state`. A complete,
/// current list is taken on start and after any watch failure.
pub async fn watch_pods(client: Client, state: Arc<SharedState>) {
    watch_forever(
        Api::<Pod>::all(client),
        watcher::Config::default(),
        "pod",
        |event| match event {
            Event::Init => state.update(|s| s.begin_pod_relist()),
            Event::InitApply(pod) => state.update(|s| s.relist_pod(&pod)),
            Event::InitDone => state.update(|s| s.finish_pod_relist()),
            Event::Apply(pod) => state.update(|s| s.apply_pod(&pod, false)),
            Event::Delete(pod) => state.update(|s| s.delete_pod(&pod)),
        },
    )
    .await
}

/// Lists and watches every node forever, feeding `state`.
pub async fn watch_nodes(client: Client, state: Arc<SharedState>) {
    watch_forever(
        Api::<Node>::all(client),
        watcher::Config::default(),
        "node",
        |event| match event {
            Event::Init => state.update(|s| s.begin_node_relist()),
            Event::InitApply(node) | Event::Apply(node) => state.update(|s| s.apply_node(&node)),
            Event::InitDone => state.update(|s| s.finish_node_relist()),
            Event::Delete(node) => state.update(|s| s.delete_node(&node)),
        },
    )
    .await
}

/// Lists and watches the device plugins' node Leases forever, feeding
/// `state` ([`crate::node_leases`]).
pub async fn watch_node_leases(client: Client, state: Arc<SharedState>) {
    let leases = Api::<Lease>::namespaced(client, NODE_LEASE_NAMESPACE);
    let config = watcher::Config::default().labels(&lease_selector());
    watch_forever(leases, config, "node Lease", |event| match event {
        Event::Init => state.update(|s| s.begin_lease_relist()),
        Event::InitApply(lease) | Event::Apply(lease) => state.update(|s| s.apply_lease(&lease)),
        Event::InitDone => state.update(|s| s.finish_lease_relist()),
        Event::Delete(lease) => state.update(|s| s.delete_lease(&lease)),
    })
    .await
}

/// Lists and watches every `ElasticGPU` forever, feeding the slices they
/// hold for claims into `state` (whose caller has called
/// `expect_reservations` first). Placements wait for the first list,
/// unless the API has no ElasticGPUs for this extender (404: the
/// definitions are not installed; 403: it may not read them), which means
/// no slice is held; the watch keeps retrying (with kube's backoff), so
/// definitions installed later are picked up.
pub async fn watch_elastic_gpus(client: Client, state: Arc<SharedState>) {
    let api: Api<DynamicObject> =
        Api::all_with(client, &elastic_resource("ElasticGPU", "elasticgpus"));
    let config = watcher::Config::default().list_semantic(ListSemantic::MostRecent);
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let mut failing: Option<Option<u16>> = None;
    while let Some(item) = stream.next().await {
        let event = match item {
            Ok(event) => event,
            Err(error) => {
                let code = refusal_code(&error);
                if failing != Some(code) {
                    match code {
                        Some(404) => tracing::info!(
                            "Kubernetes API: no ElasticGPU resource (the elasticgpu.io definitions are not installed); \
                             no GPU slices are held for claims"
                        ),
                        Some(403) => tracing::warn!(
                            "Kubernetes API: this extender may not list ElasticGPUs (RBAC); \
                             GPU slices held for Elastic GPU claims are not counted"
                        ),
                        _ => tracing::warn!(
                            error = &error as &dyn std::error::Error,
                            "Kubernetes API: ElasticGPU watch failed (retrying)"
                        ),
                    }
                }
                if matches!(code, Some(404 | 403)) {
                    state.update(|s| s.no_reservations());
                }
                failing = Some(code);
                continue;
            }
        };
        if failing.is_some() && !matches!(event, Event::Init) {
            tracing::info!("Kubernetes API: ElasticGPU watch recovered");
            failing = None;
        }
        let json = |object: DynamicObject| serde_json::to_value(object).unwrap_or_default();
        match event {
            Event::Init => state.update(|s| s.begin_reservation_relist()),
            Event::InitApply(object) => state.update(|s| s.relist_reservation(&json(object))),
            Event::InitDone => state.update(|s| s.finish_reservation_relist()),
            Event::Apply(object) => state.update(|s| s.apply_reservation(&json(object), false)),
            Event::Delete(object) => state.update(|s| s.delete_reservation(&json(object))),
        }
    }
}

/// The HTTP status the API server refused a watch with, if it did.
fn refusal_code(error: &watcher::Error) -> Option<u16> {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => Some(status.code),
        watcher::Error::WatchError(status) => Some(status.code),
        _ => None,
    }
}

/// Runs a watch of `api` forever, handing every event to `on_event`; a
/// failure is logged once until the watch recovers (kube's backoff retries).
async fn watch_forever<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &str,
    mut on_event: impl FnMut(Event<K>),
) where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    let config = config.list_semantic(ListSemantic::MostRecent);
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let mut failing = false;
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                // A relist starts with Init before anything is read.
                if failing && !matches!(event, Event::Init) {
                    tracing::info!("Kubernetes API: {what} watch recovered");
                    failing = false;
                }
                on_event(event);
            }
            Err(error) => {
                if !failing {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "Kubernetes API: {what} watch failed (retrying)"
                    );
                }
                failing = true;
            }
        }
    }
}
