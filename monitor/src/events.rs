//! Kubernetes Events on pods, for what an operator must hear about even
//! when nobody reads the monitor's log or metrics (`kubectl describe pod`
//! shows them).

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::PostParams;
use kube::{Api, Client};

/// Posts core/v1 Events from the monitor's (blocking) loop through the
/// async runtime; a failure is logged, never retried.
#[derive(Clone)]
pub struct EventRecorder {
    client: Client,
    runtime: tokio::runtime::Handle,
    node: String,
}

/// The pod an Event is about.
pub struct PodRef<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub uid: &'a str,
}

impl EventRecorder {
    pub fn new(client: Client, runtime: tokio::runtime::Handle, node: String) -> Self {
        Self {
            client,
            runtime,
            node,
        }
    }

    /// A Warning Event on `pod`.
    pub fn warn(&self, pod: &PodRef, reason: &str, message: String) {
        self.record(pod, "Warning", reason, message);
    }

    /// A Normal Event on `pod`: something it asked for was done.
    pub fn normal(&self, pod: &PodRef, reason: &str, message: String) {
        self.record(pod, "Normal", reason, message);
    }

    fn record(&self, pod: &PodRef, type_: &str, reason: &str, message: String) {
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}.", pod.name)),
                namespace: Some(pod.namespace.to_string()),
                ..ObjectMeta::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.name.to_string()),
                namespace: Some(pod.namespace.to_string()),
                uid: Some(pod.uid.to_string()),
                ..ObjectReference::default()
            },
            reason: Some(reason.to_string()),
            message: Some(message),
            type_: Some(type_.into()),
            count: Some(1),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            source: Some(EventSource {
                component: Some("vgpu-monitor".into()),
                host: Some(self.node.clone()),
            }),
            reporting_component: Some("vgpu-monitor".into()),
            reporting_instance: Some(self.node.clone()),
            ..Event::default()
        };
        let api: Api<Event> = Api::namespaced(self.client.clone(), pod.namespace);
        let (namespace, name) = (pod.namespace.to_string(), pod.name.to_string());
        self.runtime.spawn(async move {
            if let Err(error) = api.create(&PostParams::default(), &event).await {
                tracing::warn!(
                    error = &error as &dyn std::error::Error,
                    "cannot record an Event on pod {namespace}/{name}"
                );
            }
        });
    }
}
