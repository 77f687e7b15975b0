//! The pods the extender has decided, as the watch shows them.

use crate::cache::gpus::{contribution, Usage};
use crate::vocabulary::claims::claim_keys_held;
use k8s_openapi::api::core::v1::Pod;
use std::time::{Duration, Instant};
use vgpu_cluster::decision::{
    kubelet_has_admitted, parse_allocated, Decision, FormatError, ALLOCATED_ANNOTATION,
    DECISION_ANNOTATION,
};
use vgpu_cluster::resize::unanswered;

/// How long a decision whose pod is not bound yet holds its node unless
/// configured otherwise ([`PodRecord::unbound_fresh`]).
pub const DEFAULT_UNBOUND_GRACE: Duration = Duration::from_secs(30);

/// A pod's `resourceVersion` as a number, when it is one (etcd's are).
pub(crate) fn version_of(pod: &Pod) -> Option<u64> {
    pod.metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
}

/// `a` is known to be older than or the same as `b`.
pub(crate) fn not_newer(a: Option<u64>, b: Option<u64>) -> bool {
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
    /// Decided by this extender and counted while the binding that writes
    /// the decision runs ([`crate::cache::state::ClusterState::count_binding`]):
    /// `resource_version` is the pod's as read, before the binding.
    pub being_bound: bool,
    /// Not bound, and its decision is older than the unbound grace (or
    /// dated further ahead than any clock of the extender's replicas
    /// could be): its GPUs are not counted until the pod is bound.
    pub unbound_expired: bool,
    /// A resize request no status answers yet (`vgpu.io/resize`).
    pub resize_request: Option<String>,
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
            being_bound: false,
            unbound_expired: false,
            resize_request: unanswered(Some(annotations)).map(str::to_string),
        }))
    }

    /// The node whose GPUs this pod takes, if any: its decision's node,
    /// unless it is finished, was bound somewhere else, or is not bound
    /// and its decision has expired ([`PodRecord::unbound_fresh`]).
    pub fn counted_node(&self) -> Option<&str> {
        if self.terminal {
            return None;
        }
        match &self.node_name {
            Some(bound) if *bound != self.decision.node => None,
            None if self.unbound_expired => None,
            _ => Some(&self.decision.node),
        }
    }

    /// Whether the decision of a pod that is not bound still holds its
    /// node at `now_unix_ms`: it was made less than `unbound_grace` ago
    /// (its bind is in flight; a failed bind is retried with a new
    /// decision), and it is not dated more than `unbound_grace` ahead. The
    /// extender dates its decisions by its own clock, so only a decision
    /// it did not make is dated that far ahead; without that bound, one
    /// dated years ahead would hold its GPUs and keep its node busy for
    /// years.
    pub fn unbound_fresh(&self, now_unix_ms: u64, unbound_grace: Duration) -> bool {
        let grace = u64::try_from(unbound_grace.as_millis()).unwrap_or(u64::MAX);
        let decided = self.decision.decided_unix_ms;
        decided <= now_unix_ms.saturating_add(grace) && now_unix_ms.saturating_sub(decided) < grace
    }

    /// When the decision of this unbound pod stops holding its node, if it
    /// holds it now.
    pub fn unbound_deadline(&self, unbound_grace: Duration) -> Option<u64> {
        if self.node_name.is_some() || self.terminal || self.unbound_expired {
            return None;
        }
        let grace = u64::try_from(unbound_grace.as_millis()).unwrap_or(u64::MAX);
        Some(self.decision.decided_unix_ms.saturating_add(grace))
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
        self.node_name.is_some() || self.unbound_fresh(now_unix_ms, unbound_grace)
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

/// The pod's sidecars: init containers that keep running beside the others.
pub fn sidecar_names(pod: &Pod) -> Vec<&str> {
    pod.spec
        .iter()
        .flat_map(|s| s.init_containers.iter().flatten())
        .filter(|c| c.restart_policy.as_deref() == Some("Always"))
        .map(|c| c.name.as_str())
        .collect()
}
