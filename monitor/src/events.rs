//! Kubernetes Events on pods, for what an operator must hear about even
//! when nobody reads the monitor's log or metrics (`kubectl describe pod`
//! shows them).

use k8s_openapi::api::core::v1::Event;
use kube::api::PostParams;
use kube::{Api, Client};
use vgpu_cluster::events::{pod_event, Reporter};

pub use vgpu_cluster::events::PodRef;

/// Posts core/v1 Events from the monitor's (blocking) loop through the
/// async runtime; a failure is logged, never retried.
#[derive(Clone)]
pub struct EventRecorder {
    client: Client,
    runtime: tokio::runtime::Handle,
    node: String,
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
        let reporter = Reporter {
            component: "vgpu-monitor",
            host: Some(&self.node),
        };
        let event = pod_event(pod, &reporter, type_, reason, message);
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
