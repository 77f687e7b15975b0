//! Pod names for regions, from the Kubernetes API.
//!
//! A region directory is named `<podUID>_<container>`; the metrics are
//! labelled with the pod's namespace and name, which only the API knows.
//! The monitor lists and watches the pods bound to its node
//! (`spec.nodeName=<node>`) and keeps a UID → pod map. When the API cannot
//! be reached the names fall back to the directory name (pod label = pod
//! UID), and [`Presence::Unknown`] keeps the cleanup from deleting anything:
//! a pod is *gone* only when a complete, current list says so.
//!
//! The scheduler extender's decision annotation (`vgpu.io/decision`) also
//! gives each container's priority and, per GPU, its share and burst. A
//! region is written by the container itself, so where the decision exists
//! the monitor uses its figures instead of the region's, and ignores a
//! region device on a GPU the decision did not give the container.

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Instant;
use vgpu_cluster::decision::{Decision, DeviceGrant, DECISION_ANNOTATION};

pub use vgpu_cluster::client::{make_client, ApiSource, ClientError};

/// What the monitor knows about one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRecord {
    pub namespace: String,
    pub name: String,
    /// Container name → priority from the scheduler's decision.
    pub priorities: HashMap<String, i32>,
    /// Container name → the GPUs the scheduler's decision gave it.
    pub grants: HashMap<String, Vec<DeviceGrant>>,
}

/// Whether the API can currently vouch for the pod list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiState {
    /// No API configured.
    Disabled,
    /// Configured, no complete list yet.
    Starting,
    /// A complete list was received and the watch is running.
    Synced,
    /// The last list or watch failed; retrying.
    Failing,
}

/// Whether a pod exists, as far as the API can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presence {
    Present,
    /// Not in a complete, current list of the node's pods.
    Gone,
    /// The API is not available (or not synced): nothing can be concluded.
    Unknown,
}

struct Inner {
    state: ApiState,
    pods: HashMap<String, PodRecord>,
    /// Pods of a relist in progress.
    incoming: Option<HashMap<String, PodRecord>>,
    synced_at: Option<Instant>,
}

/// The UID → pod map, shared between the watch task and the monitor loop.
pub struct PodDirectory {
    inner: RwLock<Inner>,
}

impl PodDirectory {
    /// A directory with no API behind it: every lookup falls back.
    pub fn disabled() -> Arc<Self> {
        Arc::new(Self::with_state(ApiState::Disabled))
    }

    /// A directory a watch task will fill.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::with_state(ApiState::Starting))
    }

    fn with_state(state: ApiState) -> Self {
        Self {
            inner: RwLock::new(Inner {
                state,
                pods: HashMap::new(),
                incoming: None,
                synced_at: None,
            }),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner
            .write()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    pub fn state(&self) -> ApiState {
        self.read().state
    }

    /// The pod with `uid`, if known.
    pub fn lookup(&self, uid: &str) -> Option<PodRecord> {
        self.read().pods.get(uid).cloned()
    }

    /// Whether the pod with `uid` exists.
    pub fn presence(&self, uid: &str) -> Presence {
        let inner = self.read();
        match inner.state {
            ApiState::Synced if inner.pods.contains_key(uid) => Presence::Present,
            ApiState::Synced => Presence::Gone,
            _ if inner.pods.contains_key(uid) => Presence::Present,
            _ => Presence::Unknown,
        }
    }

    /// Number of pods known.
    pub fn len(&self) -> usize {
        self.read().pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Applies one watcher event.
    pub fn apply(&self, event: Event<Pod>) {
        let mut inner = self.write();
        match event {
            Event::Init => inner.incoming = Some(HashMap::new()),
            Event::InitApply(pod) => {
                if let Some((uid, record)) = record_of(&pod) {
                    inner
                        .incoming
                        .get_or_insert_with(HashMap::new)
                        .insert(uid, record);
                }
            }
            Event::InitDone => {
                let pods = inner.incoming.take().unwrap_or_default();
                if inner.state != ApiState::Synced {
                    tracing::info!("Kubernetes API: {} pod(s) on this node", pods.len());
                }
                inner.pods = pods;
                inner.state = ApiState::Synced;
                inner.synced_at = Some(Instant::now());
            }
            Event::Apply(pod) => {
                if let Some((uid, record)) = record_of(&pod) {
                    inner.pods.insert(uid, record);
                }
            }
            Event::Delete(pod) => {
                if let Some(uid) = pod.metadata.uid.as_deref() {
                    inner.pods.remove(uid);
                }
            }
        }
    }

    /// Records a failed list or watch: nothing can be concluded about pods
    /// that are not in the map until the next complete list.
    pub fn failed(&self, error: &dyn std::fmt::Display) {
        let mut inner = self.write();
        if inner.state != ApiState::Failing {
            tracing::warn!(error = %error, "Kubernetes API unavailable (names fall back to directory names, no cleanup)");
        }
        inner.state = ApiState::Failing;
        inner.incoming = None;
    }
}

fn record_of(pod: &Pod) -> Option<(String, PodRecord)> {
    let meta = &pod.metadata;
    let uid = meta.uid.clone()?;
    let mut priorities = HashMap::new();
    let mut grants = HashMap::new();
    if let Some(text) = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(DECISION_ANNOTATION))
    {
        let node = pod.spec.as_ref().and_then(|spec| spec.node_name.as_deref());
        match Decision::parse(text) {
            // A decision made for another node is not this pod's: forged,
            // or left from a placement that did not happen.
            Ok(decision) if node.is_some_and(|node| node != decision.node) => {
                tracing::warn!(
                    "pod {uid}: its decision names node {}, not the pod's {}; ignored",
                    decision.node,
                    node.unwrap_or_default()
                );
            }
            Ok(decision) => {
                for container in decision.containers {
                    if let Some(priority) = container.priority {
                        priorities.insert(container.name.clone(), priority);
                    }
                    grants.insert(container.name, container.devices);
                }
            }
            Err(error) => tracing::debug!(error = &error as &dyn std::error::Error, "pod {uid}"),
        }
    }
    Some((
        uid,
        PodRecord {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            priorities,
            grants,
        },
    ))
}

/// Lists and watches the pods on `node` forever, feeding `directory`.
/// Errors are retried with the watcher's backoff.
pub async fn watch_pods(client: Client, node: String, directory: Arc<PodDirectory>) {
    let pods: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut stream = watcher::watcher(pods, config).default_backoff().boxed();
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => directory.apply(event),
            Err(error) => directory.failed(&error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(uid: &str, name: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    #[test]
    fn presence_is_known_only_after_a_complete_list() {
        let directory = PodDirectory::new();
        assert_eq!(directory.presence("a"), Presence::Unknown);
        directory.apply(Event::Init);
        directory.apply(Event::InitApply(pod("a", "pa")));
        assert_eq!(directory.presence("b"), Presence::Unknown, "list not done");
        directory.apply(Event::InitDone);
        assert_eq!(directory.presence("a"), Presence::Present);
        assert_eq!(directory.presence("b"), Presence::Gone);
        assert_eq!(directory.lookup("a").expect("known").name, "pa");
        directory.apply(Event::Delete(pod("a", "pa")));
        assert_eq!(directory.presence("a"), Presence::Gone);
        directory.failed(&"connection refused");
        assert_eq!(directory.presence("a"), Presence::Unknown);
        directory.apply(Event::Apply(pod("c", "pc")));
        assert_eq!(directory.presence("c"), Presence::Present);
    }

    #[test]
    fn a_relist_replaces_the_map() {
        let directory = PodDirectory::new();
        directory.apply(Event::Init);
        directory.apply(Event::InitApply(pod("a", "pa")));
        directory.apply(Event::InitDone);
        directory.apply(Event::Init);
        directory.apply(Event::InitApply(pod("b", "pb")));
        assert_eq!(
            directory.presence("a"),
            Presence::Present,
            "until the relist is done"
        );
        directory.apply(Event::InitDone);
        assert_eq!(directory.presence("a"), Presence::Gone);
        assert_eq!(directory.presence("b"), Presence::Present);
    }

    #[test]
    fn disabled_directory_never_says_gone() {
        let directory = PodDirectory::disabled();
        assert_eq!(directory.presence("x"), Presence::Unknown);
        assert_eq!(directory.state(), ApiState::Disabled);
    }

    #[test]
    fn priorities_come_from_the_decision_annotation() {
        let mut p = pod("u", "p");
        let device = r#"{"uuid":"GPU-1","memoryBytes":1024,"coresPercent":30}"#;
        let decision = format!(
            r#"{{"version":1,"node":"n","decidedUnixMs":1,"containers":[
            {{"name":"main","init":false,"devices":[{device}],"priority":0}},
            {{"name":"side","init":false,"devices":[{device}],"priority":null}}]}}"#
        );
        p.metadata.annotations = Some(
            [(DECISION_ANNOTATION.to_string(), decision)]
                .into_iter()
                .collect(),
        );
        let (_, record) = record_of(&p).expect("record");
        assert_eq!(record.priorities.get("main"), Some(&0));
        assert_eq!(record.priorities.get("side"), None);
        assert_eq!(record.grants.len(), 2);

        // The same decision on a pod bound to another node grants nothing.
        p.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            node_name: Some("elsewhere".into()),
            ..Default::default()
        });
        let (_, record) = record_of(&p).expect("record");
        assert!(record.grants.is_empty() && record.priorities.is_empty());
        p.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            node_name: Some("n".into()),
            ..Default::default()
        });
        let (_, record) = record_of(&p).expect("record");
        assert_eq!(record.grants.len(), 2, "its own node's decision is kept");
    }
}
