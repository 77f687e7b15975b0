//! The cluster as the extender sees it ([`ClusterState`]), and the lock it
//! is shared under ([`SharedState`]). Each kind the watches bring applies
//! its own events, in a file of its own (`pod_events`, `node_events`,
//! `lease_events`, `elastic_gpu_events`, `quota_events`,
//! `namespace_events`); [`debug`] renders the state for
//! `GET /debug/state`.

pub mod debug;
mod elastic_gpu_events;
mod lease_events;
mod namespace_events;
mod node_events;
mod pod_events;
mod quota_events;
#[cfg(test)]
mod tests;

use crate::cache::fast_map::FastMap;
use crate::cache::gpus::Usage;
use crate::cache::groups::GroupBook;
use crate::cache::leases::{LeaseBook, Liveness};
use crate::cache::nodes::NodeEntry;
use crate::cache::pods::PodRecord;
use crate::cache::pods::DEFAULT_UNBOUND_GRACE;
use crate::cache::quotas::QuotaBook;
use crate::cache::reservations::Reservation;
use crate::cache::skipped_namespaces::SkippedNamespaces;
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

/// A record written by the extender itself and never confirmed by the
/// watch is trusted this long.
const LOCAL_RECORD_TRUST: Duration = Duration::from_secs(300);
/// Versions of removed pods are remembered this long (to ignore late events).
const FLOOR_MEMORY: Duration = Duration::from_secs(600);

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

/// How long a decision whose pod is not bound holds its node.
#[derive(Clone, Copy, Debug)]
struct UnboundGrace(Duration);

impl Default for UnboundGrace {
    fn default() -> Self {
        Self(DEFAULT_UNBOUND_GRACE)
    }
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
    /// Slices held by ElasticGPUs, by ElasticGPU name ([`crate::cache::reservations`]).
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
    /// Coscheduling groups' pods and held room ([`crate::cache::groups`]).
    groups: GroupBook,
    /// The device plugins' node Leases ([`crate::cache::leases`]).
    leases: LeaseBook,
    /// The namespaces' quotas on vGPU resources ([`crate::cache::quotas`]).
    quotas: QuotaBook,
    /// The namespaces vgpu's admission skips
    /// ([`crate::cache::skipped_namespaces`]).
    skipped_namespaces: SkippedNamespaces,
    unbound_grace: UnboundGrace,
    /// When the decisions of pods not bound yet stop holding their nodes,
    /// earliest first: `(deadline in Unix ms, pod UID)`. An entry whose
    /// pod has been bound, deleted or decided again since is skipped.
    unbound_deadlines: BTreeSet<(u64, String)>,
}

impl ClusterState {
    pub fn new() -> Self {
        Self::default()
    }

    /// A state in which a decision whose pod is not bound holds its node
    /// for `unbound_grace` ([`PodRecord::unbound_fresh`]).
    pub fn with_unbound_grace(unbound_grace: Duration) -> Self {
        Self {
            unbound_grace: UnboundGrace(unbound_grace),
            ..Self::default()
        }
    }

    /// When the next decision of a pod not bound yet stops holding its
    /// node ([`ClusterState::expire_unbound`]), if any holds one.
    pub fn next_unbound_deadline(&self) -> Option<u64> {
        self.unbound_deadlines
            .first()
            .map(|(deadline, _)| *deadline)
    }

    /// Stops counting the decisions of pods still not bound whose grace
    /// has ended by `now_unix_ms`: their GPUs are free for others (a bind
    /// that failed is retried with a new decision; a decision nobody binds
    /// was not worth holding). Answers how many stopped.
    pub fn expire_unbound(&mut self, now_unix_ms: u64) -> usize {
        let grace = self.unbound_grace.0;
        let mut expired = 0;
        while self
            .next_unbound_deadline()
            .is_some_and(|deadline| deadline <= now_unix_ms)
        {
            let Some((_, uid)) = self.unbound_deadlines.pop_first() else {
                break;
            };
            let Some(record) = self.pods.get_mut(&uid) else {
                continue;
            };
            if record.unbound_deadline(grace).is_none() || record.unbound_fresh(now_unix_ms, grace)
            {
                continue;
            }
            let old = record.counted_node().map(str::to_string);
            record.unbound_expired = true;
            tracing::info!(
                "pod {}: decided for node {} more than {} s ago and still not bound; its GPUs are no longer counted",
                record.key(),
                record.decision.node,
                grace.as_secs()
            );
            self.move_pod(&uid, old, None);
            expired += 1;
        }
        if expired > 0 {
            self.updates += 1;
        }
        expired
    }

    /// Drops the deadline queued for `record` of pod `uid` (a pod deleted
    /// in its grace), so the queue holds no more than the pods there are.
    fn forget_unbound_deadline(&mut self, uid: &str, record: &PodRecord) {
        if let Some(deadline) = record.unbound_deadline(self.unbound_grace.0) {
            self.unbound_deadlines.remove(&(deadline, uid.to_string()));
        }
    }

    /// Marks a record about to be taken in whose pod is not bound and
    /// whose decision no longer holds its node, or queues when it stops.
    fn age_unbound(&mut self, uid: &str, record: &mut PodRecord, now_unix_ms: u64) {
        let grace = self.unbound_grace.0;
        let Some(deadline) = record.unbound_deadline(grace) else {
            return;
        };
        if record.unbound_fresh(now_unix_ms, grace) {
            self.unbound_deadlines.insert((deadline, uid.to_string()));
            return;
        }
        record.unbound_expired = true;
        let ahead = record.decision.decided_unix_ms.saturating_sub(now_unix_ms);
        if ahead > 0 {
            tracing::warn!(
                "pod {}: its decision is dated {} s ahead of this extender's clock, which no decision the extender made is; its GPUs are not counted",
                record.key(),
                ahead / 1000
            );
        }
    }

    /// Whether pods, nodes and node Leases have been listed completely
    /// once (and ElasticGPUs, when watched).
    pub fn synced(&self) -> bool {
        self.pods_synced
            && self.nodes_synced
            && self.leases.synced()
            && self.quotas.ready()
            && self.skipped_namespaces.ready()
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

    /// The namespaces' quotas on vGPU resources.
    pub fn quotas(&self) -> &QuotaBook {
        &self.quotas
    }

    /// ResourceQuotas are watched: placements wait until they are listed.
    pub fn expect_quotas(&mut self) {
        self.quotas.expect();
    }

    /// The namespaces vgpu's admission skips.
    pub fn skipped_namespaces(&self) -> &SkippedNamespaces {
        &self.skipped_namespaces
    }

    /// The namespaces labelled to be skipped by admission are watched
    /// (besides the `named` ones): placements wait until they are listed.
    pub fn expect_skipped_namespaces(&mut self, named: impl IntoIterator<Item = String>) {
        self.skipped_namespaces.expect(named);
    }

    /// What the pods of `namespace` whose decisions count hold, in all,
    /// leaving out the pods `except` (the pod being placed, the victims of
    /// a preemption being weighed).
    pub fn held_in_namespace(&self, namespace: &str, except: &[&str]) -> Usage {
        let mut held = Usage::default();
        for record in self.pods.values() {
            if record.namespace != namespace
                || record.counted_node().is_none()
                || except.contains(&record.uid.as_str())
            {
                continue;
            }
            for (_, taken) in &record.contribution {
                held.add(taken);
            }
        }
        held
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

    /// Whether `node`'s device plugin is alive ([`crate::cache::leases`]).
    pub fn liveness(&self, node: &str, now_unix_ms: u64, grace: Duration) -> Liveness {
        self.leases.liveness(node, now_unix_ms, grace)
    }

    /// What is known of the ElasticGPUs.
    pub fn elastic_sync(&self) -> ElasticSync {
        self.elastic
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

/// The state after complete lists of `nodes`, a live Lease for each, and
/// `pods`: a cluster for tests.
#[cfg(test)]
pub(crate) fn listed(
    nodes: Vec<k8s_openapi::api::core::v1::Node>,
    pods: Vec<k8s_openapi::api::core::v1::Pod>,
) -> ClusterState {
    use crate::cache::book::Book;
    let mut state = ClusterState::new();
    let leases: Vec<_> = nodes
        .iter()
        .filter_map(|node| node.metadata.name.as_deref())
        .map(|name| crate::cache::fixtures::lease(name, 40, 0))
        .collect();
    state.relist(nodes);
    state.relist(leases);
    state.relist(pods);
    state
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
        Self::with_unbound_grace(DEFAULT_UNBOUND_GRACE)
    }

    /// A state in which a decision whose pod is not bound holds its node
    /// for `unbound_grace`.
    pub fn with_unbound_grace(unbound_grace: Duration) -> Self {
        Self {
            inner: RwLock::new(ClusterState::with_unbound_grace(unbound_grace)),
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
