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
//! region device on a GPU the decision did not give the container. A
//! decision is only ever as good as what its pod asks for: the monitor
//! reads the pod's request as the extender does ([`RequestRules`]) and
//! holds the decision to it ([`within_request`]; a GPU's offered memory,
//! which bounds a percentage or a whole GPU, from NVML), so a decision
//! rewritten past the admission policy restores no more than was asked.

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Instant;
use vgpu_cluster::decision::{Decision, DeviceGrant, DECISION_ANNOTATION};
use vgpu_cluster::requests::{within_request, PodRequest, RequestRules};

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
    /// When the extender made the decision: a later time on the same pod
    /// is a resize.
    pub decided_unix_ms: Option<u64>,
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

/// What the directory keeps of one pod.
#[derive(Clone, Debug)]
struct Known {
    namespace: String,
    name: String,
    /// Its decision for this node, with what the pod asks for.
    decided: Option<(Decision, PodRequest)>,
}

impl Known {
    /// The record the monitor works with: the decision held to the request,
    /// with `offered` giving a GPU's offered memory where known.
    fn record(&self, offered: impl Fn(&str) -> Option<u64>) -> PodRecord {
        let mut priorities = HashMap::new();
        let mut grants = HashMap::new();
        if let Some((decision, request)) = &self.decided {
            for container in within_request(decision, request, offered).containers {
                if let Some(priority) = container.priority {
                    priorities.insert(container.name.clone(), priority);
                }
                grants.insert(container.name, container.devices);
            }
        }
        PodRecord {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            priorities,
            grants,
            decided_unix_ms: self.decided.as_ref().map(|(d, _)| d.decided_unix_ms),
        }
    }
}

struct Inner {
    state: ApiState,
    pods: HashMap<String, Known>,
    /// Pods of a relist in progress.
    incoming: Option<HashMap<String, Known>>,
    synced_at: Option<Instant>,
    /// The memory each GPU offers containers, by UUID, as last measured.
    offered: HashMap<String, u64>,
}

/// The UID → pod map, shared between the watch task and the monitor loop.
pub struct PodDirectory {
    inner: RwLock<Inner>,
    /// How pods' requests are read (the extender's names and defaults).
    rules: RequestRules,
}

impl PodDirectory {
    /// A directory with no API behind it: every lookup falls back.
    pub fn disabled() -> Arc<Self> {
        Arc::new(Self::with_state(
            ApiState::Disabled,
            RequestRules::default(),
        ))
    }

    /// A directory a watch task will fill, reading pods' requests by
    /// `rules`.
    pub fn new(rules: RequestRules) -> Arc<Self> {
        Arc::new(Self::with_state(ApiState::Starting, rules))
    }

    fn with_state(state: ApiState, rules: RequestRules) -> Self {
        Self {
            inner: RwLock::new(Inner {
                state,
                pods: HashMap::new(),
                incoming: None,
                synced_at: None,
                offered: HashMap::new(),
            }),
            rules,
        }
    }

    /// Notes the memory each GPU offers (`uuid`, bytes), which bounds the
    /// decisions of pods that ask for a percentage or a whole GPU.
    pub fn set_offered(&self, offered: impl IntoIterator<Item = (String, u64)>) {
        let offered: HashMap<String, u64> = offered.into_iter().collect();
        let mut inner = self.write();
        if inner.offered != offered {
            inner.offered = offered;
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
        let inner = self.read();
        let known = inner.pods.get(uid)?;
        Some(known.record(|uuid| inner.offered.get(uuid).copied()))
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
                if let Some((uid, record)) = known_of(&pod, &self.rules) {
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
                if let Some((uid, record)) = known_of(&pod, &self.rules) {
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

fn known_of(pod: &Pod, rules: &RequestRules) -> Option<(String, Known)> {
    let meta = &pod.metadata;
    let uid = meta.uid.clone()?;
    let mut decided = None;
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
            Ok(decision) => match rules.parse(pod) {
                Ok(request) => {
                    if within_request(&decision, &request, |_| None) != decision {
                        tracing::warn!(
                            "pod {uid}: its decision grants more than the pod asks for; only what it asks for is restored"
                        );
                    }
                    decided = Some((decision, request));
                }
                Err(error) => tracing::warn!(
                    error = &error as &dyn std::error::Error,
                    "pod {uid}: its request cannot be read, so its decision is not used"
                ),
            },
            Err(error) => tracing::debug!(error = &error as &dyn std::error::Error, "pod {uid}"),
        }
    }
    Some((
        uid,
        Known {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            decided,
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
    use k8s_openapi::api::core::v1::{Container, PodSpec, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
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
        let directory = PodDirectory::new(RequestRules::default());
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
        let directory = PodDirectory::new(RequestRules::default());
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

    /// A container asking for one vGPU with `limits` beside the count.
    fn asking(name: &str, limits: &[(&str, &str)]) -> Container {
        let mut all = vec![("nvidia.com/gpu", "1")];
        all.extend_from_slice(limits);
        Container {
            name: name.into(),
            resources: Some(ResourceRequirements {
                limits: Some(
                    all.iter()
                        .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                        .collect(),
                ),
                ..ResourceRequirements::default()
            }),
            ..Container::default()
        }
    }

    fn with_decision(mut p: Pod, decision: &str, node: &str, containers: Vec<Container>) -> Pod {
        p.metadata.annotations = Some(
            [(DECISION_ANNOTATION.to_string(), decision.to_string())]
                .into_iter()
                .collect(),
        );
        p.spec = Some(PodSpec {
            node_name: Some(node.into()),
            containers,
            ..PodSpec::default()
        });
        p
    }

    fn record(p: &Pod) -> PodRecord {
        let (_, known) = known_of(p, &RequestRules::default()).expect("record");
        known.record(|_| Some(16 << 30))
    }

    #[test]
    fn priorities_come_from_the_decision_annotation() {
        let device = r#"{"uuid":"GPU-1","memoryBytes":1024,"coresPercent":30}"#;
        let decision = format!(
            r#"{{"version":1,"node":"n","decidedUnixMs":1,"containers":[
            {{"name":"main","init":false,"devices":[{device}],"priority":0}},
            {{"name":"side","init":false,"devices":[{device}],"priority":null}}]}}"#
        );
        let containers = vec![
            asking("main", &[("nvidia.com/priority", "0")]),
            asking("side", &[]),
        ];
        let p = with_decision(pod("u", "p"), &decision, "n", containers.clone());
        let found = record(&p);
        assert_eq!(found.priorities.get("main"), Some(&0));
        assert_eq!(found.priorities.get("side"), None);
        assert_eq!(found.grants.len(), 2);

        // The same decision on a pod bound to another node grants nothing.
        let p = with_decision(pod("u", "p"), &decision, "elsewhere", containers);
        let found = record(&p);
        assert!(found.grants.is_empty() && found.priorities.is_empty());
    }

    #[test]
    fn a_decision_is_held_to_what_its_pod_asks_for() {
        // Rewritten to the whole GPU uncapped, the highest priority and
        // a second GPU, for a pod asking 1 GiB and 30 % of one.
        let forged = r#"{"version":1,"node":"n","decidedUnixMs":1,"containers":[
            {"name":"main","init":false,"priority":-2147483648,"devices":[
            {"uuid":"GPU-1","memoryBytes":0,"coresPercent":100,"burstPercent":100},
            {"uuid":"GPU-2","memoryBytes":0,"coresPercent":100}]}]}"#;
        let containers = vec![asking(
            "main",
            &[("nvidia.com/gpumem", "1024"), ("nvidia.com/gpucores", "30")],
        )];
        let found = record(&with_decision(pod("u", "p"), forged, "n", containers));
        assert_eq!(found.priorities.get("main"), None, "the pod asks for none");
        let grants = &found.grants["main"];
        assert_eq!(grants.len(), 1, "one GPU asked for");
        assert_eq!(
            (
                grants[0].memory_bytes,
                grants[0].cores_percent,
                grants[0].burst_percent
            ),
            (1 << 30, 30, None)
        );
        // A pod asking for a quarter of the GPU's memory: a quarter of what
        // NVML says the GPU offers.
        let containers = vec![asking("main", &[("nvidia.com/gpumem-percentage", "25")])];
        let found = record(&with_decision(pod("u", "p"), forged, "n", containers));
        assert_eq!(found.grants["main"][0].memory_bytes, 4 << 30);
        // A request that cannot be read leaves nothing of the decision.
        let containers = vec![asking("main", &[("nvidia.com/gpumem", "lots")])];
        let found = record(&with_decision(pod("u", "p"), forged, "n", containers));
        assert!(found.grants.is_empty());
    }

    #[test]
    fn lookups_bound_percentages_by_the_measured_gpus() {
        let forged = r#"{"version":1,"node":"n","decidedUnixMs":1,"containers":[
            {"name":"main","init":false,"priority":null,"devices":[
            {"uuid":"GPU-1","memoryBytes":0,"coresPercent":0}]}]}"#;
        let containers = vec![asking("main", &[("nvidia.com/gpumem-percentage", "50")])];
        let directory = PodDirectory::new(RequestRules::default());
        directory.apply(Event::Apply(with_decision(
            pod("u", "p"),
            forged,
            "n",
            containers,
        )));
        let memory =
            |d: &PodDirectory| d.lookup("u").expect("known").grants["main"][0].memory_bytes;
        assert_eq!(
            memory(&directory),
            0,
            "unbounded while the GPU is not measured"
        );
        directory.set_offered([("GPU-1".to_string(), 8 << 30)]);
        assert_eq!(memory(&directory), 4 << 30);
    }
}
