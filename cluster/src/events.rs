//! The core/v1 Event vgpu's parts record on a pod (`kubectl describe pod`
//! shows it): one shape for the node monitor and the scheduler extender.

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

/// The pod an Event is about.
pub struct PodRef<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub uid: &'a str,
}

/// Which part says it: its name, and where it runs (a node's name, or
/// none).
pub struct Reporter<'a> {
    pub component: &'a str,
    pub host: Option<&'a str>,
}

/// An Event of `type_` (`Normal` or `Warning`) on `pod`, dated now.
pub fn pod_event(
    pod: &PodRef,
    reporter: &Reporter,
    type_: &str,
    reason: &str,
    message: String,
) -> Event {
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    Event {
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
        type_: Some(type_.to_string()),
        count: Some(1),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        source: Some(EventSource {
            component: Some(reporter.component.to_string()),
            host: reporter.host.map(str::to_string),
        }),
        reporting_component: Some(reporter.component.to_string()),
        reporting_instance: Some(reporter.host.unwrap_or(reporter.component).to_string()),
        ..Event::default()
    }
}
