//! What the extender knows about the cluster, rebuilt from the API alone.
//!
//! Nodes bring their GPU inventory (the plugin's `vgpu.io/node-gpus`
//! annotation), and the plugins' Leases whether they are alive
//! ([`crate::node_leases`]). Pods bring the decisions the extender
//! wrote (`vgpu.io/decision`) and the containers the plugin has allocated
//! (`vgpu.io/allocated`). From those two the state derives, per node, what
//! every GPU carries and which vGPU pod, if any, is *pending* (decided, not
//! yet fully allocated). Nothing is stored anywhere else, so a restarted
//! extender that has listed pods and nodes again knows exactly what the one
//! before it knew.
//!
//! Versions: the extender applies the pods its own API writes return at
//! once (so a second bind on the same node sees the first pod pending
//! without waiting for the watch), and the watch later confirms them. Every
//! update carries the pod's `resourceVersion`; an update older than what is
//! already known, or older than the deletion of the pod, is ignored, so a
//! late watch event can never undo a newer write.

use crate::fit::{NodeGpus, Usage};
use crate::groups::GroupBook;
use crate::node_leases::{LeaseBook, Liveness};
use crate::reservation::Reservation;
use crate::vocabulary::claims::claim_keys_held;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Serialize;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use vgpu_cluster::decision::{
    kubelet_has_admitted, parse_allocated, Decision, FormatError, NodeInventory,
    ALLOCATED_ANNOTATION, DECISION_ANNOTATION, NODE_INVENTORY_ANNOTATION,
};
use vgpu_cluster::report::with_causes;
use vgpu_cluster::resources::parse_whole_quantity;

/// A record written by the extender itself and never confirmed by the
/// watch is trusted this long.
const LOCAL_RECORD_TRUST: Duration = Duration::from_secs(300);
/// Versions of removed pods are remembered this long (to ignore late events).
const FLOOR_MEMORY: Duration = Duration::from_secs(600);

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A pod's `resourceVersion` as a number, when it is one (etcd's are).
fn version_of(pod: &Pod) -> Option<u64> {
    pod.metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
}

/// `a` is known to be older than or the same as `b`.
fn not_newer(a: Option<u64>, b: Option<u64>) -> bool {
    matches!((a, b), (Some(a), Some(b)) if a <= b)
}

/// A pod with a decision.
#[derive(Clone, Debug)]
pub struct PodRecord {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub resource_version: Option<u64>,
    /// `spec.nodeName`: where the pod is bound, if it is.
    pub node_name: Option<String>,
    pub decision: Decision,
    pub allocated: Vec<String>,
    /// Succeeded or failed: its GPUs are free.
    pub terminal: bool,
    /// Being deleted: it will not be admitted any more.
    pub deleting: bool,
    /// Kubelet is done admitting it: no more `Allocate` calls will come.
    pub admitted: bool,
    /// What it takes per GPU UUID.
    pub contribution: Vec<(String, Usage)>,
    /// The Elastic GPU claims it holds, `namespace/name`.
    pub claims: Vec<String>,
    /// Set while the record comes from the extender's own write and the
    /// watch has not shown this version yet.
    pub local_since: Option<Instant>,
}

impl PodRecord {
    /// The record of a pod, `None` when it has no decision.
    pub fn from_pod(pod: &Pod) -> Result<Option<Self>, FormatError> {
        let meta = &pod.metadata;
        let annotations = match &meta.annotations {
            Some(annotations) => annotations,
            None => return Ok(None),
        };
        let text = match annotations.get(DECISION_ANNOTATION) {
            Some(text) => text,
            None => return Ok(None),
        };
        let decision = Decision::parse(text)?;
        let allocated = match annotations.get(ALLOCATED_ANNOTATION) {
            Some(text) => parse_allocated(text)?,
            None => Vec::new(),
        };
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let terminal = matches!(phase, Some("Succeeded") | Some("Failed"));
        let running = phase == Some("Running");
        let reports_statuses = pod.status.as_ref().is_some_and(|s| {
            (s.container_statuses
                .iter()
                .chain(&s.init_container_statuses))
            .any(|v| !v.is_empty())
        });
        let admitted = kubelet_has_admitted(phase, reports_statuses);
        let contribution = contribution(&decision, &sidecar_names(pod), running);
        Ok(Some(Self {
            uid: meta.uid.clone().unwrap_or_default(),
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            resource_version: version_of(pod),
            node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            decision,
            allocated,
            terminal,
            deleting: meta.deletion_timestamp.is_some(),
            admitted,
            contribution,
            claims: claim_keys_held(pod),
            local_since: None,
        }))
    }

    /// The node whose GPUs this pod takes, if any: its decision's node,
    /// unless it is finished or was bound somewhere else.
    pub fn counted_node(&self) -> Option<&str> {
        if self.terminal {
            return None;
        }
        match &self.node_name {
            Some(bound) if *bound != self.decision.node => None,
            _ => Some(&self.decision.node),
        }
    }

    /// Whether the pod is pending on its node: decided, still to be
    /// admitted, not all its GPU containers allocated. A pod not yet bound
    /// is pending only for `unbound_grace` after its decision (its bind is
    /// in flight or failed; a failed one is retried with a new decision).
    pub fn is_pending(&self, now_unix_ms: u64, unbound_grace: Duration) -> bool {
        if self.counted_node().is_none() || self.deleting || self.admitted {
            return false;
        }
        if self.decision.is_complete(&self.allocated) {
            return false;
        }
        self.node_name.is_some()
            || now_unix_ms.saturating_sub(self.decision.decided_unix_ms)
                < unbound_grace.as_millis() as u64
    }

    /// Whether it holds its claims: placed, not finished, not going away.
    pub fn holds_claims(&self) -> bool {
        !self.claims.is_empty() && self.counted_node().is_some() && !self.deleting
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// Per GPU, what a decided pod takes. Regular init containers run one at a
/// time before the others and are done once the pod runs; sidecars run
/// alongside everything.
/// The pod's sidecars: init containers that keep running beside the others.
pub(crate) fn sidecar_names(pod: &Pod) -> Vec<&str> {
    pod.spec
        .iter()
        .flat_map(|s| s.init_containers.iter().flatten())
        .filter(|c| c.restart_policy.as_deref() == Some("Always"))
        .map(|c| c.name.as_str())
        .collect()
}

pub(crate) fn contribution(
    decision: &Decision,
    sidecars: &[&str],
    running: bool,
) -> Vec<(String, Usage)> {
    #[derive(Default)]
    struct PerGpu {
        sidecars: Usage,
        apps: Usage,
        init_max: Usage,
    }
    let mut per_gpu: Vec<(String, PerGpu)> = Vec::new();
    for container in &decision.containers {
        let sidecar = container.init && sidecars.contains(&container.name.as_str());
        for device in &container.devices {
            let index = match per_gpu.iter().position(|(uuid, _)| *uuid == device.uuid) {
                Some(index) => index,
                None => {
                    per_gpu.push((device.uuid.clone(), PerGpu::default()));
                    per_gpu.len() - 1
                }
            };
            let entry = &mut per_gpu[index].1;
            if sidecar {
                entry
                    .sidecars
                    .add_grant(device.memory_bytes, device.cores_percent);
            } else if container.init {
                let mut alone = Usage::default();
                alone.add_grant(device.memory_bytes, device.cores_percent);
                entry.init_max.max_with(&alone);
            } else {
                entry
                    .apps
                    .add_grant(device.memory_bytes, device.cores_percent);
            }
        }
    }
    per_gpu
        .into_iter()
        .map(|(uuid, entry)| {
            let mut total = entry.sidecars;
            let mut rest = entry.apps;
            if !running {
                rest.max_with(&entry.init_max);
            }
            total.add(&rest);
            (uuid, total)
        })
        .filter(|(_, usage)| usage.tasks > 0)
        .collect()
}

/// What is known of a node's inventory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Inventory {
    /// The node has no `vgpu.io/node-gpus` annotation (or is not known).
    Missing,
    /// The annotation could not be read.
    Invalid(String),
    Valid,
}

/// One node.
#[derive(Debug)]
pub struct NodeEntry {
    pub in_api: bool,
    pub inventory: Inventory,
    pub gpus: NodeGpus,
    /// What each GPU carries (same order as `gpus`).
    pub usage: Vec<Usage>,
    /// Decided GPUs that the inventory does not list (gone, or not yet
    /// published).
    pub unlisted: Vec<(String, Usage)>,
    /// UIDs of the pods whose GPUs are counted here.
    pub pods: Vec<String>,
    /// Names of the ElasticGPUs whose slices lie here.
    pub reservations: Vec<String>,
    /// The node's allocatable extended resources (`<domain>/<name>`), as
    /// kubelet last reported them: a device plugin's count drops to zero
    /// while kubelet has it disconnected.
    pub extended_allocatable: Vec<(String, u64)>,
}

impl NodeEntry {
    fn new() -> Self {
        Self {
            in_api: false,
            inventory: Inventory::Missing,
            gpus: NodeGpus::default(),
            usage: Vec::new(),
            unlisted: Vec::new(),
            pods: Vec::new(),
            reservations: Vec::new(),
            extended_allocatable: Vec::new(),
        }
    }

    /// Whether kubelet reports `resource` with nothing allocatable (its
    /// device plugin disconnected, or every device unhealthy). A node that
    /// does not report it at all is not judged here.
    pub fn offers_none_of(&self, resource: &str) -> bool {
        self.extended_allocatable
            .iter()
            .any(|(name, amount)| name == resource && *amount == 0)
    }
}

/// A hash map with a fast (seeded) hasher: node names and pod UIDs are
/// looked up thousands of times per request.
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Whether the ElasticGPUs (and the slices they hold) are known.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ElasticSync {
    /// Nobody watches them (tests of pods and nodes alone).
    #[default]
    NotWatched,
    /// Watched, not listed completely yet: placing now could give away a
    /// slice a claim holds.
    Waiting,
    /// Listed.
    Known,
    /// The API has no ElasticGPUs for this extender (the definitions are
    /// not installed, or it may not read them): none hold anything.
    Absent,
}

/// A relist of pods in progress.
#[derive(Debug, Default)]
struct PodRelist {
    records: FastMap<String, PodRecord>,
    /// Every listed pod's version, decided or not.
    seen: FastMap<String, Option<u64>>,
}

/// The cluster as the extender sees it.
#[derive(Debug, Default)]
pub struct ClusterState {
    nodes: FastMap<String, NodeEntry>,
    pods: FastMap<String, PodRecord>,
    /// Versions of pods whose records were removed.
    floors: FastMap<String, (Option<u64>, Instant)>,
    /// GPU models in lower case, shared by all nodes that have them.
    models: FastMap<String, Arc<str>>,
    pod_relist: Option<PodRelist>,
    /// Slices held by ElasticGPUs, by ElasticGPU name ([`crate::reservation`]).
    reservations: FastMap<String, Reservation>,
    reservation_relist: Option<FastMap<String, Reservation>>,
    elastic: ElasticSync,
    node_relist: Option<Vec<String>>,
    pods_synced: bool,
    nodes_synced: bool,
    updates: u64,
    /// Newest resource version seen on the pod and node streams.
    seen_pod_version: u64,
    seen_node_version: u64,
    /// Coscheduling groups' pods and held room ([`crate::groups`]).
    groups: GroupBook,
    /// The device plugins' node Leases ([`crate::node_leases`]).
    leases: LeaseBook,
}

impl ClusterState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether pods, nodes and node Leases have been listed completely
    /// once (and ElasticGPUs, when watched).
    pub fn synced(&self) -> bool {
        self.pods_synced
            && self.nodes_synced
            && self.leases.synced()
            && self.elastic != ElasticSync::Waiting
    }

    pub fn node(&self, name: &str) -> Option<&NodeEntry> {
        self.nodes.get(name)
    }

    pub fn nodes(&self) -> impl Iterator<Item = (&String, &NodeEntry)> {
        self.nodes.iter()
    }

    pub fn pod(&self, uid: &str) -> Option<&PodRecord> {
        self.pods.get(uid)
    }

    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// Every pod with a decision.
    pub fn pods(&self) -> impl Iterator<Item = &PodRecord> {
        self.pods.values()
    }

    /// How many changes the state has taken (grows with every one).
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// The newest resource versions seen from the API, pods and nodes (how
    /// far the watches have got).
    pub fn seen_versions(&self) -> (u64, u64) {
        (self.seen_pod_version, self.seen_node_version)
    }

    fn saw_pod(&mut self, pod: &Pod) {
        if let Some(version) = version_of(pod) {
            self.seen_pod_version = self.seen_pod_version.max(version);
        }
    }

    /// The node whose GPUs pod `uid` takes, if it has a decision that counts.
    pub fn counted_node_of(&self, uid: &str) -> Option<&str> {
        self.pods.get(uid)?.counted_node()
    }

    /// The usage of a node's GPUs without the pods `uids` (a pod being
    /// scheduled again must not compete with its own earlier decision; the
    /// victims of a preemption are gone) and without the slices of `claims`
    /// (held for the very pod that holds them).
    pub fn usage_without<'a>(
        &'a self,
        node: &'a NodeEntry,
        uids: &[&str],
        claims: &[String],
    ) -> Cow<'a, [Usage]> {
        let own_pod = uids
            .iter()
            .any(|uid| !uid.is_empty() && node.pods.iter().any(|p| p == uid));
        let own_slice = node.reservations.iter().any(|name| {
            self.reservations
                .get(name)
                .is_some_and(|r| claims.contains(&r.claim))
        });
        if !own_pod && !own_slice {
            return Cow::Borrowed(&node.usage);
        }
        let mut usage = vec![Usage::default(); node.gpus.len()];
        let mut unlisted = Vec::new();
        add_up(
            node,
            node.pods
                .iter()
                .filter(|p| !uids.contains(&p.as_str()))
                .filter_map(|p| self.pods.get(p)),
            node.reservations
                .iter()
                .filter_map(|name| self.reservations.get(name))
                .filter(|r| !claims.contains(&r.claim)),
            &mut usage,
            &mut unlisted,
        );
        Cow::Owned(usage)
    }

    /// Coscheduling groups' pods and held room.
    pub fn groups(&self) -> &GroupBook {
        &self.groups
    }

    pub fn groups_mut(&mut self) -> &mut GroupBook {
        &mut self.groups
    }

    /// Whether pod `uid` has a decision that is placed or has run.
    pub fn placed(&self, uid: &str) -> bool {
        self.pods
            .get(uid)
            .is_some_and(|r| r.terminal || r.counted_node().is_some())
    }

    /// Adds to `usage` (node `name`'s) the room held there for groups' pods
    /// other than `gone` that are not placed yet.
    pub fn add_holds(
        &self,
        name: &str,
        node: &NodeEntry,
        gone: &[&str],
        now_unix_ms: u64,
        usage: &mut Cow<'_, [Usage]>,
    ) {
        if !self.groups.any_holds() {
            return;
        }
        for hold in self.groups.holds_on(name, now_unix_ms) {
            if gone.contains(&hold.uid.as_str()) || self.placed(&hold.uid) {
                continue;
            }
            for (uuid, taken) in &hold.contribution {
                if let Some(index) = node.gpus.index_of(uuid) {
                    usage.to_mut()[index].add(taken);
                }
            }
        }
    }

    /// The slice held for `claim` (`namespace/name`), if it has one.
    pub fn reservation_of(&self, claim: &str) -> Option<&Reservation> {
        self.reservations.values().find(|r| r.claim == claim)
    }

    /// A pod other than `uid` that holds `claim` now, if one does.
    pub fn holder_of(&self, claim: &str, uid: &str) -> Option<&PodRecord> {
        self.pods
            .values()
            .find(|r| r.uid != uid && r.holds_claims() && r.claims.iter().any(|c| c == claim))
    }

    /// The pods pending on `node`, other than `exclude`.
    pub fn pending_on(
        &self,
        node: &str,
        now_unix_ms: u64,
        unbound_grace: Duration,
        exclude: &str,
    ) -> Vec<&PodRecord> {
        let entry = match self.nodes.get(node) {
            Some(entry) => entry,
            None => return Vec::new(),
        };
        entry
            .pods
            .iter()
            .filter(|uid| *uid != exclude)
            .filter_map(|uid| self.pods.get(uid))
            .filter(|record| record.is_pending(now_unix_ms, unbound_grace))
            .collect()
    }

    // ---- nodes ----

    /// Starts a complete list of nodes.
    pub fn begin_node_relist(&mut self) {
        self.node_relist = Some(Vec::new());
    }

    /// Applies a node (from a list or the watch).
    pub fn apply_node(&mut self, node: &Node) {
        let name = match &node.metadata.name {
            Some(name) => name.clone(),
            None => return,
        };
        self.note_node_version(node);
        if let Some(seen) = &mut self.node_relist {
            seen.push(name.clone());
        }
        let parsed = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NODE_INVENTORY_ANNOTATION))
            .map(|text| NodeInventory::parse(text));
        let entry = self
            .nodes
            .entry(name.clone())
            .or_insert_with(NodeEntry::new);
        entry.in_api = true;
        entry.extended_allocatable = node
            .status
            .as_ref()
            .and_then(|status| status.allocatable.as_ref())
            .map(|allocatable| {
                allocatable
                    .iter()
                    .filter(|(name, _)| name.contains('/'))
                    .filter_map(|(name, quantity)| {
                        parse_whole_quantity(&quantity.0)
                            .ok()
                            .map(|amount| (name.clone(), amount))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let (inventory, gpus) = match parsed {
            None => (Inventory::Missing, Vec::new()),
            Some(Err(error)) => {
                if !matches!(entry.inventory, Inventory::Invalid(_)) {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "node {name}: unreadable GPU inventory"
                    );
                }
                (Inventory::Invalid(with_causes(&error)), Vec::new())
            }
            Some(Ok(inventory)) => (Inventory::Valid, inventory.gpus),
        };
        entry.inventory = inventory;
        if entry.gpus.gpus != gpus {
            let models = &mut self.models;
            entry.gpus = NodeGpus::with_models(gpus, |model| {
                models
                    .entry(model.to_string())
                    .or_insert_with(|| Arc::from(model))
                    .clone()
            });
            recompute_node(&mut self.nodes, &self.pods, &self.reservations, &name);
        }
        self.updates += 1;
    }

    /// Ends a complete list of nodes: nodes it did not contain are gone.
    pub fn finish_node_relist(&mut self) {
        if let Some(seen) = self.node_relist.take() {
            let seen: std::collections::HashSet<String> = seen.into_iter().collect();
            let gone: Vec<String> = self
                .nodes
                .keys()
                .filter(|name| !seen.contains(*name))
                .cloned()
                .collect();
            for name in gone {
                self.remove_node(&name);
            }
        }
        if !self.nodes_synced {
            tracing::info!("Kubernetes API: {} node(s) listed", self.nodes.len());
        }
        self.nodes_synced = true;
    }

    /// Remembers the newest node version seen (a relist must not go back
    /// before it).
    fn note_node_version(&mut self, node: &Node) {
        if let Some(version) = node
            .metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse::<u64>().ok())
        {
            self.seen_node_version = self.seen_node_version.max(version);
        }
    }

    /// A node was deleted.
    pub fn delete_node(&mut self, node: &Node) {
        self.note_node_version(node);
        if let Some(name) = &node.metadata.name {
            self.remove_node(name);
        }
    }

    fn remove_node(&mut self, name: &str) {
        let keep = match self.nodes.get_mut(name) {
            Some(entry) => {
                entry.in_api = false;
                entry.inventory = Inventory::Missing;
                entry.gpus = NodeGpus::default();
                !entry.pods.is_empty() || !entry.reservations.is_empty()
            }
            None => return,
        };
        if keep {
            recompute_node(&mut self.nodes, &self.pods, &self.reservations, name);
        } else {
            self.nodes.remove(name);
        }
        self.updates += 1;
    }

    // ---- node Leases ----

    /// Starts a complete list of the plugins' node Leases.
    pub fn begin_lease_relist(&mut self) {
        self.leases.begin_relist();
    }

    /// Applies a node Lease (from a list or the watch).
    pub fn apply_lease(&mut self, lease: &Lease) {
        self.leases.apply(lease, now_unix_ms());
        self.updates += 1;
    }

    /// Ends a complete list of node Leases.
    pub fn finish_lease_relist(&mut self) {
        self.leases.finish_relist();
        self.updates += 1;
    }

    /// A node Lease was deleted.
    pub fn delete_lease(&mut self, lease: &Lease) {
        self.leases.delete(lease);
        self.updates += 1;
    }

    /// Whether `node`'s device plugin is alive ([`crate::node_leases`]).
    pub fn liveness(&self, node: &str, now_unix_ms: u64, grace: Duration) -> Liveness {
        self.leases.liveness(node, now_unix_ms, grace)
    }

    // ---- pods ----

    /// Starts a complete list of pods.
    pub fn begin_pod_relist(&mut self) {
        self.pod_relist = Some(PodRelist::default());
        self.groups.begin_relist();
    }

    /// One pod of a complete list.
    pub fn relist_pod(&mut self, pod: &Pod) {
        self.saw_pod(pod);
        self.groups.apply(pod);
        let relist = self.pod_relist.get_or_insert_with(PodRelist::default);
        let uid = match &pod.metadata.uid {
            Some(uid) => uid.clone(),
            None => return,
        };
        relist.seen.insert(uid.clone(), version_of(pod));
        match PodRecord::from_pod(pod) {
            Ok(Some(record)) => {
                relist.records.insert(uid, record);
            }
            Ok(None) => {}
            Err(error) => warn_unreadable(pod, &error),
        }
    }

    /// Ends a complete list of pods: the list replaces what was known,
    /// except the extender's own recent writes that the list predates.
    pub fn finish_pod_relist(&mut self) {
        let relist = self.pod_relist.take().unwrap_or_default();
        self.groups.finish_relist();
        let mut pods = relist.records;
        for (uid, old) in self.pods.drain() {
            let trusted = old
                .local_since
                .is_some_and(|since| since.elapsed() < LOCAL_RECORD_TRUST);
            if !trusted {
                continue;
            }
            let keep = match relist.seen.get(&uid) {
                None => true,
                Some(listed) => !not_newer(old.resource_version, *listed),
            };
            if keep {
                pods.insert(uid, old);
            }
        }
        self.pods = pods;
        self.rebuild_all();
        if !self.pods_synced {
            tracing::info!(
                "Kubernetes API: {} pod(s) with vGPU decisions listed",
                self.pods.len()
            );
        }
        self.pods_synced = true;
        self.prune();
    }

    /// Applies a pod from the watch (`local: false`) or from the answer to
    /// the extender's own write (`local: true`).
    pub fn apply_pod(&mut self, pod: &Pod, local: bool) {
        if !local {
            self.saw_pod(pod);
        }
        let uid = match &pod.metadata.uid {
            Some(uid) => uid.clone(),
            None => return,
        };
        let version = version_of(pod);
        if let Some((floor, _)) = self.floors.get(&uid) {
            if not_newer(version, *floor) {
                return;
            }
        }
        if let Some(existing) = self.pods.get_mut(&uid) {
            match (version, existing.resource_version) {
                (Some(new), Some(old)) if new < old => return,
                (Some(new), Some(old)) if new == old => {
                    if !local {
                        existing.local_since = None;
                    }
                    return;
                }
                _ => {}
            }
        }
        self.groups.apply(pod);
        let record = match PodRecord::from_pod(pod) {
            Ok(record) => record,
            Err(error) => {
                warn_unreadable(pod, &error);
                None
            }
        };
        let old_node = self
            .pods
            .get(&uid)
            .and_then(|r| r.counted_node().map(str::to_string));
        let new_node = record
            .as_ref()
            .and_then(|r| r.counted_node().map(str::to_string));
        match record {
            Some(mut record) => {
                if local {
                    record.local_since = Some(Instant::now());
                }
                self.pods.insert(uid.clone(), record);
                self.floors.remove(&uid);
            }
            None => {
                if self.pods.remove(&uid).is_some() {
                    self.floors.insert(uid.clone(), (version, Instant::now()));
                }
            }
        }
        self.move_pod(&uid, old_node, new_node);
        self.updates += 1;
        if self.updates.is_multiple_of(1024) {
            self.prune();
        }
    }

    /// A pod was deleted.
    pub fn delete_pod(&mut self, pod: &Pod) {
        self.saw_pod(pod);
        self.groups.delete(pod);
        let uid = match &pod.metadata.uid {
            Some(uid) => uid.clone(),
            None => return,
        };
        self.floors
            .insert(uid.clone(), (version_of(pod), Instant::now()));
        if let Some(record) = self.pods.remove(&uid) {
            let old_node = record.counted_node().map(str::to_string);
            self.move_pod(&uid, old_node, None);
        }
        self.updates += 1;
    }

    // ---- ElasticGPU slices ----

    /// ElasticGPUs are watched: placements wait until they are listed.
    pub fn expect_reservations(&mut self) {
        if self.elastic == ElasticSync::NotWatched {
            self.elastic = ElasticSync::Waiting;
        }
    }

    /// The API has no ElasticGPUs for this extender: none hold anything.
    pub fn no_reservations(&mut self) {
        self.elastic = ElasticSync::Absent;
        self.reservation_relist = None;
        let names: Vec<String> = self.reservations.keys().cloned().collect();
        for name in names {
            self.remove_reservation(&name);
        }
        self.updates += 1;
    }

    /// What is known of the ElasticGPUs.
    pub fn elastic_sync(&self) -> ElasticSync {
        self.elastic
    }

    /// Starts a complete list of ElasticGPUs.
    pub fn begin_reservation_relist(&mut self) {
        self.reservation_relist = Some(FastMap::default());
    }

    /// One ElasticGPU of a complete list.
    pub fn relist_reservation(&mut self, object: &serde_json::Value) {
        let relist = self.reservation_relist.get_or_insert_with(FastMap::default);
        if let Some(reservation) = read_reservation(object) {
            relist.insert(reservation.elastic_gpu.clone(), reservation);
        }
    }

    /// Ends a complete list of ElasticGPUs: it replaces what was known,
    /// except the extender's own recent writes that the list predates.
    pub fn finish_reservation_relist(&mut self) {
        let mut listed = self.reservation_relist.take().unwrap_or_default();
        for (name, old) in &self.reservations {
            let trusted = old
                .local_since
                .is_some_and(|since| since.elapsed() < LOCAL_RECORD_TRUST);
            if trusted && !listed.contains_key(name) {
                listed.insert(name.clone(), old.clone());
            }
        }
        let names: Vec<String> = self.reservations.keys().cloned().collect();
        for name in names {
            self.remove_reservation(&name);
        }
        for (_, reservation) in listed {
            self.insert_reservation(reservation);
        }
        if self.elastic == ElasticSync::Waiting {
            tracing::info!(
                "Kubernetes API: {} ElasticGPU slice(s) held for claims listed",
                self.reservations.len()
            );
        }
        self.elastic = ElasticSync::Known;
        self.updates += 1;
    }

    /// Applies an ElasticGPU from the watch (`local: false`) or from the
    /// answer to the extender's own write (`local: true`).
    pub fn apply_reservation(&mut self, object: &serde_json::Value, local: bool) {
        let Some(name) = object.pointer("/metadata/name").and_then(|n| n.as_str()) else {
            return;
        };
        let reservation = read_reservation(object);
        if let (Some(new), Some(old)) = (&reservation, self.reservations.get(name)) {
            // An event older than what is known changes nothing.
            if matches!((new.resource_version, old.resource_version), (Some(n), Some(o)) if n < o) {
                return;
            }
        }
        self.remove_reservation(name);
        if let Some(mut reservation) = reservation {
            if local {
                reservation.local_since = Some(Instant::now());
            }
            self.insert_reservation(reservation);
        }
        self.updates += 1;
    }

    /// An ElasticGPU was deleted.
    pub fn delete_reservation(&mut self, object: &serde_json::Value) {
        if let Some(name) = object.pointer("/metadata/name").and_then(|n| n.as_str()) {
            self.remove_reservation(name);
            self.updates += 1;
        }
    }

    fn insert_reservation(&mut self, reservation: Reservation) {
        let name = reservation.elastic_gpu.clone();
        let node = reservation.node.clone();
        self.reservations.insert(name.clone(), reservation);
        let entry = self
            .nodes
            .entry(node.clone())
            .or_insert_with(NodeEntry::new);
        if !entry.reservations.contains(&name) {
            entry.reservations.push(name);
        }
        recompute_node(&mut self.nodes, &self.pods, &self.reservations, &node);
    }

    fn remove_reservation(&mut self, name: &str) {
        let Some(old) = self.reservations.remove(name) else {
            return;
        };
        if let Some(entry) = self.nodes.get_mut(&old.node) {
            entry.reservations.retain(|r| r != name);
        }
        recompute_node(&mut self.nodes, &self.pods, &self.reservations, &old.node);
        let unused = self
            .nodes
            .get(&old.node)
            .is_some_and(|e| !e.in_api && e.pods.is_empty() && e.reservations.is_empty());
        if unused {
            self.nodes.remove(&old.node);
        }
    }

    /// Records that the extender bound pod `uid` to `node` (the binding
    /// answer carries no pod; the watch brings the new version later).
    pub fn mark_bound(&mut self, uid: &str, node: &str) {
        let old_node = match self.pods.get_mut(uid) {
            Some(record) if record.node_name.is_none() => {
                let old = record.counted_node().map(str::to_string);
                record.node_name = Some(node.to_string());
                old
            }
            _ => return,
        };
        let new_node = self
            .pods
            .get(uid)
            .and_then(|r| r.counted_node().map(str::to_string));
        self.move_pod(uid, old_node, new_node);
        self.updates += 1;
    }

    fn move_pod(&mut self, uid: &str, old: Option<String>, new: Option<String>) {
        if let Some(old) = &old {
            if let Some(entry) = self.nodes.get_mut(old) {
                entry.pods.retain(|p| p != uid);
            }
        }
        if let Some(new) = &new {
            let entry = self.nodes.entry(new.clone()).or_insert_with(NodeEntry::new);
            if !entry.pods.iter().any(|p| p == uid) {
                entry.pods.push(uid.to_string());
            }
        }
        for name in [old.as_deref(), new.as_deref()].into_iter().flatten() {
            recompute_node(&mut self.nodes, &self.pods, &self.reservations, name);
        }
        if let Some(old) = &old {
            let unused = self
                .nodes
                .get(old)
                .is_some_and(|e| !e.in_api && e.pods.is_empty() && e.reservations.is_empty());
            if unused {
                self.nodes.remove(old);
            }
        }
    }

    fn rebuild_all(&mut self) {
        for entry in self.nodes.values_mut() {
            entry.pods.clear();
        }
        let mut placed: Vec<(String, String)> = Vec::new();
        for (uid, record) in &self.pods {
            if let Some(node) = record.counted_node() {
                placed.push((node.to_string(), uid.clone()));
            }
        }
        for (node, uid) in placed {
            self.nodes
                .entry(node)
                .or_insert_with(NodeEntry::new)
                .pods
                .push(uid);
        }
        self.nodes
            .retain(|_, e| e.in_api || !e.pods.is_empty() || !e.reservations.is_empty());
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for name in names {
            recompute_node(&mut self.nodes, &self.pods, &self.reservations, &name);
        }
        self.updates += 1;
    }

    /// Forgets old floors and own writes the watch never confirmed.
    fn prune(&mut self) {
        self.floors
            .retain(|_, (_, since)| since.elapsed() < FLOOR_MEMORY);
        let stale: Vec<String> = self
            .pods
            .iter()
            .filter(|(_, r)| {
                r.local_since
                    .is_some_and(|s| s.elapsed() >= LOCAL_RECORD_TRUST)
            })
            .map(|(uid, _)| uid.clone())
            .collect();
        let stale_slices: Vec<String> = self
            .reservations
            .iter()
            .filter(|(_, r)| {
                r.local_since
                    .is_some_and(|s| s.elapsed() >= LOCAL_RECORD_TRUST)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in stale_slices {
            tracing::warn!(
                "ElasticGPU {name}: the API never confirmed the slice written {} s ago; forgetting it",
                LOCAL_RECORD_TRUST.as_secs()
            );
            self.remove_reservation(&name);
        }
        for uid in stale {
            if let Some(record) = self.pods.remove(&uid) {
                tracing::warn!(
                    "pod {}: the API never confirmed the decision written {} s ago; forgetting it",
                    record.key(),
                    LOCAL_RECORD_TRUST.as_secs()
                );
                let old = record.counted_node().map(str::to_string);
                self.move_pod(&uid, old, None);
            }
        }
    }

    /// A view for the debug endpoint and tests.
    pub fn snapshot(
        &self,
        now_unix_ms: u64,
        unbound_grace: Duration,
        lease_grace: Duration,
    ) -> Snapshot {
        let mut nodes = BTreeMap::new();
        for (name, entry) in &self.nodes {
            let gpus = entry
                .gpus
                .gpus
                .iter()
                .zip(&entry.usage)
                .map(|(gpu, usage)| GpuSnapshot {
                    uuid: gpu.uuid.clone(),
                    model: gpu.model.clone(),
                    memory_bytes: gpu.memory_bytes,
                    offered_memory_bytes: gpu.offered_bytes(),
                    split_count: gpu.split_count,
                    healthy: gpu.healthy,
                    usage: *usage,
                })
                .collect();
            let mut pods: Vec<String> = entry
                .pods
                .iter()
                .filter_map(|uid| self.pods.get(uid))
                .map(PodRecord::key)
                .collect();
            pods.sort();
            let mut pending: Vec<String> = self
                .pending_on(name, now_unix_ms, unbound_grace, "")
                .into_iter()
                .map(PodRecord::key)
                .collect();
            pending.sort();
            let mut reservations: Vec<String> = entry
                .reservations
                .iter()
                .filter_map(|name| self.reservations.get(name))
                .map(|r| format!("{} ({})", r.elastic_gpu, r.claim))
                .collect();
            reservations.sort();
            nodes.insert(
                name.clone(),
                NodeSnapshot {
                    in_api: entry.in_api,
                    inventory: match &entry.inventory {
                        Inventory::Missing => "missing".to_string(),
                        Inventory::Invalid(error) => format!("invalid: {error}"),
                        Inventory::Valid => "valid".to_string(),
                    },
                    lease: match self.liveness(name, now_unix_ms, lease_grace) {
                        Liveness::Missing => "missing".to_string(),
                        Liveness::Live { silent_ms } => {
                            format!("live (renewed {} s ago)", silent_ms / 1000)
                        }
                        Liveness::Expired { silent_ms, .. } => {
                            format!("expired (renewed {} s ago)", silent_ms / 1000)
                        }
                    },
                    gpus,
                    unlisted_gpus: entry.unlisted.clone().into_iter().collect(),
                    pods,
                    pending,
                    reservations,
                },
            );
        }
        Snapshot {
            synced: self.synced(),
            pods: self.pods.len(),
            nodes,
        }
    }
}

/// The slice an ElasticGPU holds; an unreadable one holds nothing (logged).
fn read_reservation(object: &serde_json::Value) -> Option<Reservation> {
    match Reservation::from_elastic_gpu(object) {
        Ok(reservation) => reservation,
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "ElasticGPU {}: unreadable annotation; the slice it records is not counted",
                object
                    .pointer("/metadata/name")
                    .and_then(|n| n.as_str())
                    .unwrap_or("")
            );
            None
        }
    }
}

fn warn_unreadable(pod: &Pod, error: &FormatError) {
    tracing::warn!(
        error = error as &dyn std::error::Error,
        "pod {}/{}: unreadable annotation; its GPUs are not counted",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    );
}

/// Recomputes what a node's GPUs carry from its pods and the slices held
/// on it.
fn recompute_node(
    nodes: &mut FastMap<String, NodeEntry>,
    pods: &FastMap<String, PodRecord>,
    reservations: &FastMap<String, Reservation>,
    name: &str,
) {
    let entry = match nodes.get_mut(name) {
        Some(entry) => entry,
        None => return,
    };
    let mut usage = vec![Usage::default(); entry.gpus.len()];
    let mut unlisted: Vec<(String, Usage)> = Vec::new();
    add_up(
        entry,
        entry.pods.iter().filter_map(|uid| pods.get(uid)),
        entry
            .reservations
            .iter()
            .filter_map(|name| reservations.get(name)),
        &mut usage,
        &mut unlisted,
    );
    entry.usage = usage;
    entry.unlisted = unlisted;
}

/// Adds up what `records` and `slices` take on `node`'s GPUs. A slice
/// whose claim a pod counted on this node holds is that pod's now: only
/// the pod is counted.
fn add_up<'a>(
    node: &NodeEntry,
    records: impl Iterator<Item = &'a PodRecord>,
    slices: impl Iterator<Item = &'a Reservation>,
    usage: &mut [Usage],
    unlisted: &mut Vec<(String, Usage)>,
) {
    let mut held: Vec<&str> = Vec::new();
    let mut add = |uuid: &String, taken: &Usage| match node.gpus.index_of(uuid) {
        Some(index) => usage[index].add(taken),
        None => match unlisted.iter_mut().find(|(u, _)| u == uuid) {
            Some((_, total)) => total.add(taken),
            None => unlisted.push((uuid.clone(), *taken)),
        },
    };
    for record in records {
        if record.holds_claims() {
            held.extend(record.claims.iter().map(String::as_str));
        }
        for (uuid, taken) in &record.contribution {
            add(uuid, taken);
        }
    }
    for slice in slices.filter(|slice| !held.contains(&slice.claim.as_str())) {
        for (uuid, taken) in &slice.contribution {
            add(uuid, taken);
        }
    }
}

/// The shared state, with a change counter that binds waiting for a
/// node's pending pod listen to.
#[derive(Debug)]
pub struct SharedState {
    inner: RwLock<ClusterState>,
    changes: tokio::sync::watch::Sender<u64>,
}

impl Default for SharedState {
    fn default() -> Self {
        Self::new()
    }
}

impl SharedState {
    pub fn new() -> Self {
        Self {
            inner: RwLock::new(ClusterState::new()),
            changes: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Reads the state (a poisoned lock still holds consistent data: every
    /// update is applied under it in one step).
    pub fn read(&self) -> RwLockReadGuard<'_, ClusterState> {
        self.inner
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Changes the state and wakes the waiters.
    pub fn update<R>(&self, change: impl FnOnce(&mut ClusterState) -> R) -> R {
        let result = {
            let mut state = self
                .inner
                .write()
                .unwrap_or_else(|poison| poison.into_inner());
            change(&mut state)
        };
        self.changes
            .send_modify(|generation| *generation = generation.wrapping_add(1));
        result
    }

    /// A receiver that sees every later change.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

/// The state as JSON (`GET /debug/state`).
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub synced: bool,
    pub pods: usize,
    pub nodes: BTreeMap<String, NodeSnapshot>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeSnapshot {
    pub in_api: bool,
    pub inventory: String,
    /// The device plugin's node Lease: missing, live or expired.
    pub lease: String,
    pub gpus: Vec<GpuSnapshot>,
    pub unlisted_gpus: Vec<(String, Usage)>,
    pub pods: Vec<String>,
    pub pending: Vec<String>,
    /// Slices held here for Elastic GPU claims: `ElasticGPU (namespace/claim)`.
    pub reservations: Vec<String>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GpuSnapshot {
    pub uuid: String,
    pub model: String,
    /// Physical memory.
    pub memory_bytes: u64,
    /// What grants count against (`usage.memoryBytes` is out of this).
    pub offered_memory_bytes: u64,
    pub split_count: u32,
    pub healthy: bool,
    pub usage: Usage,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocabulary::claims::USES_CLAIMS_ANNOTATION;
    use k8s_openapi::api::core::v1::{PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use vgpu_cluster::decision::{ContainerDecision, DeviceGrant, InventoryGpu, FORMAT_VERSION};

    const GIB: u64 = 1 << 30;

    fn node(name: &str, gpus: u32) -> Node {
        let inventory = NodeInventory {
            version: FORMAT_VERSION,
            gpus: (0..gpus)
                .map(|i| InventoryGpu {
                    offered_memory_bytes: None,
                    utilization_percent: None,
                    uuid: format!("GPU-{name}-{i}"),
                    index: i,
                    model: "A10".into(),
                    memory_bytes: 24 * GIB,
                    sm_count: 72,
                    split_count: 10,
                    numa: None,
                    nvlink_island: None,
                    healthy: true,
                })
                .collect(),
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

    fn decided(
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
        let mut annotations =
            BTreeMap::from([(DECISION_ANNOTATION.to_string(), decision.to_json())]);
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

    fn undecided(uid: &str, version: u64) -> Pod {
        Pod {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                resource_version: Some(version.to_string()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    fn synced_state() -> ClusterState {
        let mut state = ClusterState::new();
        state.begin_node_relist();
        state.apply_node(&node("n1", 2));
        state.finish_node_relist();
        state.begin_lease_relist();
        state.apply_lease(&crate::node_leases::tests::lease("n1", 40, 0));
        state.finish_lease_relist();
        state.begin_pod_relist();
        state.finish_pod_relist();
        state
    }

    const GRACE: Duration = Duration::from_secs(30);

    /// ElasticGPU `name` holding 2 GiB and 20 % of `gpu` on n1 for claim ns/c.
    fn elastic_gpu(name: &str, version: u64, gpu: &str) -> serde_json::Value {
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
        serde_json::json!({
            "metadata": {"name": name, "resourceVersion": version.to_string(),
                         "annotations": {DECISION_ANNOTATION: decision.to_json()}},
            "spec": {"claimRef": {"namespace": "ns", "name": "c"}},
            "status": {"phase": "Bound"},
        })
    }

    fn gpu_usage(state: &ClusterState, index: usize) -> Usage {
        state.node("n1").expect("n1").usage[index]
    }

    #[test]
    fn a_claims_slice_is_taken_until_a_pod_holding_the_claim_is_placed_on_it() {
        let mut state = synced_state();
        state.apply_reservation(&elastic_gpu("egpu-1", 5, "GPU-n1-0"), false);
        assert_eq!(gpu_usage(&state, 0).memory_bytes, 2 * GIB);
        assert_eq!(gpu_usage(&state, 0).cores, 20);
        assert_eq!(
            state.reservation_of("ns/c").map(|r| r.gpus.clone()),
            Some(vec!["GPU-n1-0".to_string()])
        );
        // Placing a pod that holds the claim: the slice is not in its way.
        let node = state.node("n1").expect("n1");
        let without = state.usage_without(node, &[], &["ns/c".to_string()]);
        assert_eq!(without[0], Usage::default());
        assert_eq!(state.usage_without(node, &[], &[])[0].memory_bytes, 2 * GIB);

        // The holder placed: its own grant (4 GiB, 30 %) counts instead.
        let mut holder = decided("p", 10, "n1", "GPU-n1-0", true, true);
        holder
            .metadata
            .annotations
            .as_mut()
            .expect("annotations")
            .insert(USES_CLAIMS_ANNOTATION.into(), "c".into());
        state.apply_pod(&holder, false);
        assert_eq!(gpu_usage(&state, 0).memory_bytes, 4 * GIB);
        assert_eq!(gpu_usage(&state, 0).cores, 30);
        assert_eq!(
            state.holder_of("ns/c", "other").map(|r| r.key()),
            Some("ns/p".into())
        );
        assert!(state.holder_of("ns/c", "p").is_none());

        // The holder done: the slice is held again for the next pod.
        holder.metadata.resource_version = Some("11".into());
        holder.status.as_mut().expect("status").phase = Some("Succeeded".into());
        state.apply_pod(&holder, false);
        assert!(state.holder_of("ns/c", "other").is_none());
        assert_eq!(gpu_usage(&state, 0).memory_bytes, 2 * GIB);

        // An older event does not undo a newer one; a release frees it.
        state.apply_reservation(&elastic_gpu("egpu-1", 4, "GPU-n1-1"), false);
        assert_eq!(gpu_usage(&state, 0).memory_bytes, 2 * GIB);
        let mut released = elastic_gpu("egpu-1", 6, "GPU-n1-0");
        released["status"]["phase"] = "Released".into();
        state.apply_reservation(&released, false);
        assert_eq!(gpu_usage(&state, 0), Usage::default());
        assert!(state.reservation_of("ns/c").is_none());
    }

    #[test]
    fn placements_wait_for_the_elastic_gpus_unless_the_api_has_none() {
        let mut state = ClusterState::new();
        state.expect_reservations();
        state.begin_node_relist();
        state.apply_node(&node("n1", 2));
        state.finish_node_relist();
        state.begin_pod_relist();
        state.finish_pod_relist();
        state.begin_lease_relist();
        assert!(!state.synced(), "the plugins' Leases are not known yet");
        state.finish_lease_relist();
        assert!(!state.synced(), "slices held for claims are not known yet");
        state.begin_reservation_relist();
        state.relist_reservation(&elastic_gpu("egpu-1", 5, "GPU-n1-1"));
        state.finish_reservation_relist();
        assert!(state.synced());
        assert_eq!(gpu_usage(&state, 1).memory_bytes, 2 * GIB);
        // A relist without it: gone.
        state.begin_reservation_relist();
        state.finish_reservation_relist();
        assert_eq!(gpu_usage(&state, 1), Usage::default());
        // The definitions removed: none held, and still synced.
        state.apply_reservation(&elastic_gpu("egpu-2", 7, "GPU-n1-1"), false);
        state.no_reservations();
        assert!(state.synced());
        assert_eq!(state.elastic_sync(), ElasticSync::Absent);
        assert_eq!(gpu_usage(&state, 1), Usage::default());
        // Its own write survives a list that predates it.
        state.apply_reservation(&elastic_gpu("egpu-3", 9, "GPU-n1-0"), true);
        state.begin_reservation_relist();
        state.finish_reservation_relist();
        assert_eq!(gpu_usage(&state, 0).memory_bytes, 2 * GIB);
        let snapshot = state.snapshot(now_unix_ms(), GRACE, GRACE);
        assert_eq!(snapshot.nodes["n1"].reservations, ["egpu-3 (ns/c)"]);
    }

    #[test]
    fn a_node_whose_kubelet_offers_none_of_the_gpus_is_known_as_such() {
        use k8s_openapi::api::core::v1::NodeStatus;
        use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
        let mut state = synced_state();
        let mut offline = node("n1", 2);
        offline.status = Some(NodeStatus {
            allocatable: Some(
                [
                    ("cpu".to_string(), Quantity("8".into())),
                    ("nvidia.com/gpu".to_string(), Quantity("0".into())),
                    ("nvidia.com/gpumem".to_string(), Quantity("48k".into())),
                ]
                .into(),
            ),
            ..NodeStatus::default()
        });
        state.apply_node(&offline);
        let entry = state.node("n1").expect("n1");
        assert!(entry.offers_none_of("nvidia.com/gpu"));
        assert!(!entry.offers_none_of("nvidia.com/gpumem"));
        assert_eq!(
            entry.extended_allocatable,
            vec![
                ("nvidia.com/gpu".to_string(), 0),
                ("nvidia.com/gpumem".to_string(), 48_000)
            ],
            "only extended resources, quantities read"
        );
        // Back: the plugin registered again.
        let mut online = offline.clone();
        if let Some(allocatable) = online.status.as_mut().and_then(|s| s.allocatable.as_mut()) {
            allocatable.insert("nvidia.com/gpu".into(), Quantity("20".into()));
        }
        state.apply_node(&online);
        assert!(!state
            .node("n1")
            .expect("n1")
            .offers_none_of("nvidia.com/gpu"));
        // A node without a status is not judged.
        state.apply_node(&node("n2", 1));
        assert!(!state
            .node("n2")
            .expect("n2")
            .offers_none_of("nvidia.com/gpu"));
    }

    #[test]
    fn usage_and_pending_follow_the_pods() {
        let mut state = synced_state();
        assert!(state.synced());
        state.apply_pod(&decided("a", 10, "n1", "GPU-n1-0", true, false), false);
        let entry = state.node("n1").expect("node");
        assert_eq!(entry.usage[0].memory_bytes, 4 * GIB);
        assert_eq!(entry.usage[0].tasks, 1);
        let now = now_unix_ms();
        assert_eq!(state.pending_on("n1", now, GRACE, "").len(), 1);
        assert!(state.pending_on("n1", now, GRACE, "a").is_empty());
        // Allocated: no longer pending, still counted.
        state.apply_pod(&decided("a", 11, "n1", "GPU-n1-0", true, true), false);
        assert!(state.pending_on("n1", now, GRACE, "").is_empty());
        assert_eq!(state.node("n1").expect("node").usage[0].tasks, 1);
        // A late, older event changes nothing.
        state.apply_pod(&decided("a", 10, "n1", "GPU-n1-0", true, false), false);
        assert!(state.pending_on("n1", now, GRACE, "").is_empty());
        // Deleted: gone, and an older event cannot bring it back.
        state.delete_pod(&decided("a", 12, "n1", "GPU-n1-0", true, true));
        assert_eq!(state.node("n1").expect("node").usage[0], Usage::default());
        state.apply_pod(&decided("a", 11, "n1", "GPU-n1-0", true, true), true);
        assert_eq!(state.pod_count(), 0);
    }

    #[test]
    fn an_admitted_pod_stops_blocking_its_node_but_keeps_its_gpus() {
        use k8s_openapi::api::core::v1::{ContainerStatus, PodStatus};
        let mut state = synced_state();
        let now = now_unix_ms();
        state.apply_pod(&decided("e", 30, "n1", "GPU-n1-0", true, false), false);
        assert_eq!(state.pending_on("n1", now, GRACE, "").len(), 1);
        // Kubelet admitted it (image still pulling) but no Allocate came,
        // as for a resource no vgpu plugin serves.
        let mut pod = decided("e", 31, "n1", "GPU-n1-0", true, false);
        pod.status = Some(PodStatus {
            phase: Some("Pending".into()),
            container_statuses: Some(vec![ContainerStatus {
                name: "main".into(),
                ..ContainerStatus::default()
            }]),
            ..PodStatus::default()
        });
        state.apply_pod(&pod, false);
        assert!(state.pending_on("n1", now, GRACE, "").is_empty());
        assert_eq!(state.node("n1").expect("node").usage[0].tasks, 1);
        // Running without statuses (as a fake API may report): admitted too.
        let mut pod = decided("e", 32, "n1", "GPU-n1-0", true, false);
        pod.status = Some(PodStatus {
            phase: Some("Running".into()),
            ..PodStatus::default()
        });
        state.apply_pod(&pod, false);
        assert!(state.pending_on("n1", now, GRACE, "").is_empty());
        assert_eq!(state.node("n1").expect("node").usage[0].tasks, 1);
    }

    #[test]
    fn own_writes_count_at_once_and_survive_an_older_relist() {
        let mut state = synced_state();
        state.apply_pod(&decided("b", 20, "n1", "GPU-n1-1", false, false), true);
        let now = now_unix_ms();
        assert_eq!(
            state.pending_on("n1", now, GRACE, "").len(),
            1,
            "unbound, decided now"
        );
        assert!(
            state.pending_on("n1", now + 31_000, GRACE, "").is_empty(),
            "an unbound decision stops blocking after the grace"
        );
        state.mark_bound("b", "n1");
        assert_eq!(state.pending_on("n1", now + 31_000, GRACE, "").len(), 1);
        // A relist that predates the write keeps it.
        state.begin_pod_relist();
        state.relist_pod(&undecided("b", 19));
        state.finish_pod_relist();
        assert_eq!(state.pending_on("n1", now, GRACE, "").len(), 1);
        // A relist that has a newer version replaces it.
        state.begin_pod_relist();
        state.relist_pod(&decided("b", 21, "n1", "GPU-n1-1", true, true));
        state.finish_pod_relist();
        assert!(state.pending_on("n1", now, GRACE, "").is_empty());
        assert_eq!(state.node("n1").expect("node").usage[1].tasks, 1);
    }

    #[test]
    fn a_pod_bound_elsewhere_or_finished_takes_nothing() {
        let mut state = synced_state();
        let mut pod = decided("c", 5, "n1", "GPU-n1-0", true, false);
        if let Some(spec) = pod.spec.as_mut() {
            spec.node_name = Some("n2".into());
        }
        state.apply_pod(&pod, false);
        assert_eq!(state.node("n1").expect("node").usage[0], Usage::default());
        let mut pod = decided("c", 6, "n1", "GPU-n1-0", true, true);
        if let Some(status) = pod.status.as_mut() {
            status.phase = Some("Succeeded".into());
        }
        state.apply_pod(&pod, false);
        assert_eq!(state.node("n1").expect("node").usage[0], Usage::default());
    }

    #[test]
    fn decisions_for_unknown_nodes_wait_for_their_inventory() {
        let mut state = synced_state();
        state.apply_pod(&decided("d", 5, "n9", "GPU-n9-0", true, false), false);
        let entry = state.node("n9").expect("placeholder");
        assert!(!entry.in_api);
        assert_eq!(entry.unlisted.len(), 1);
        state.apply_node(&node("n9", 1));
        let entry = state.node("n9").expect("node");
        assert_eq!(entry.usage[0].tasks, 1);
        assert!(entry.unlisted.is_empty());
        state.delete_pod(&decided("d", 6, "n9", "GPU-n9-0", true, false));
        state.begin_node_relist();
        state.apply_node(&node("n1", 2));
        state.finish_node_relist();
        assert!(state.node("n9").is_none());
    }

    #[test]
    fn init_containers_count_until_the_pod_runs() {
        let decision = Decision {
            version: FORMAT_VERSION,
            node: "n1".into(),
            decided_unix_ms: 0,
            containers: vec![
                ContainerDecision {
                    name: "setup".into(),
                    init: true,
                    devices: vec![DeviceGrant {
                        uuid: "G".into(),
                        memory_bytes: 10,
                        cores_percent: 100,
                        burst_percent: None,
                    }],
                    priority: None,
                },
                ContainerDecision {
                    name: "proxy".into(),
                    init: true,
                    devices: vec![DeviceGrant {
                        uuid: "G".into(),
                        memory_bytes: 1,
                        cores_percent: 5,
                        burst_percent: None,
                    }],
                    priority: None,
                },
                ContainerDecision {
                    name: "main".into(),
                    init: false,
                    devices: vec![DeviceGrant {
                        uuid: "G".into(),
                        memory_bytes: 4,
                        cores_percent: 20,
                        burst_percent: None,
                    }],
                    priority: None,
                },
            ],
        };
        let pending = contribution(&decision, &["proxy"], false);
        assert_eq!(
            pending,
            vec![(
                "G".to_string(),
                Usage {
                    memory_bytes: 11,
                    cores: 105,
                    tasks: 2,
                    exclusive: true
                }
            )]
        );
        let running = contribution(&decision, &["proxy"], true);
        assert_eq!(
            running,
            vec![(
                "G".to_string(),
                Usage {
                    memory_bytes: 5,
                    cores: 25,
                    tasks: 2,
                    exclusive: false
                }
            )]
        );
    }
}
