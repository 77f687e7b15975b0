//! The extender: what its verbs share (configuration, state, API client,
//! locks, leadership).

use crate::admission::confinement::{unconfined_for_placement, Breach};
use crate::admission::quota::AdmissionQuota;
use crate::api::KubeApi;
use crate::cache::clock::now_unix_ms;
use crate::cache::state::debug::DebugState;
use crate::cache::state::SharedState;
use crate::extender::config::Config;
use crate::extender::filtered_pods::FilteredPods;
use crate::extender::reply::Reply;
use crate::extender::score_cache::ScoreCache;
use crate::leader::Leadership;
use crate::placement::quota::{namespace_quota_use, quota_use, NamespaceQuotaUse};
use crate::placement::rules::{pod_key, Rules};
use crate::placement::snapshot::Snapshot;
use k8s_openapi::api::core::v1::Pod;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use thiserror::Error;

/// Why this replica does not serve filter, prioritize, preempt and bind
/// now (kube-scheduler retries the pod).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum NotServing {
    #[error("this vgpu-scheduler replica is stopping; kube-scheduler will retry")]
    Stopping,
    /// Another replica leads: the words name it.
    #[error("{0}")]
    StandingBy(String),
}

/// A pod placement refuses: a vGPU container of it is not confined to the
/// shim's reach ([`crate::admission::confinement`]).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error(
    "pod {pod} was not admitted by vgpu (it was created while vgpu's admission was not in force) \
     and is not placed: {breach}. Delete it and create it again"
)]
pub struct UnconfinedPod {
    pub pod: String,
    pub breach: Breach,
}

/// Async locks by name, made on first use.
type Locks = Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>;

/// The extender.
pub struct Scheduler {
    pub(super) config: Config,
    /// What placement follows, from `config`.
    pub(super) rules: Rules,
    pub(super) state: Arc<SharedState>,
    pub(super) api: Option<KubeApi>,
    node_locks: Locks,
    /// Held while a pod of a namespace with a vGPU quota is bound.
    namespace_locks: Locks,
    /// Pods (`namespace/name`) a bind is running for: a second bind of the
    /// same pod is refused while the first runs.
    binding: Mutex<std::collections::HashSet<String>>,
    /// Seeds the random node policy and keys the score cache.
    pub(super) hasher: foldhash::fast::RandomState,
    pub(super) score_cache: ScoreCache,
    /// The pods filter passed, for their binds.
    pub(super) filtered_pods: FilteredPods,
    pub(super) binds_in_flight: AtomicUsize,
    /// Held while a pod holding Elastic GPU claims is bound.
    pub(super) claims_lock: tokio::sync::Mutex<()>,
    stopping: AtomicBool,
    /// Set when this is one of several replicas: serve only while leading.
    leadership: Option<Arc<Leadership>>,
}

impl Scheduler {
    pub fn new(config: Config, state: Arc<SharedState>, api: Option<KubeApi>) -> Self {
        Self {
            rules: config.rules(),
            config,
            state,
            api,
            node_locks: Mutex::new(HashMap::new()),
            namespace_locks: Mutex::new(HashMap::new()),
            binding: Mutex::new(std::collections::HashSet::new()),
            hasher: foldhash::fast::RandomState::default(),
            score_cache: ScoreCache::default(),
            filtered_pods: FilteredPods::default(),
            binds_in_flight: AtomicUsize::new(0),
            claims_lock: tokio::sync::Mutex::new(()),
            stopping: AtomicBool::new(false),
            leadership: None,
        }
    }

    /// Serves the verbs only while `leadership` says this replica leads.
    pub fn with_leadership(mut self, leadership: Arc<Leadership>) -> Self {
        self.leadership = Some(leadership);
        self
    }

    /// A receiver that sees every start of this replica's terms as
    /// leader; `None` without an election (it always leads).
    pub fn leadership_terms(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.leadership
            .as_ref()
            .map(|leadership| leadership.terms())
    }

    /// Whether this replica leads (always, without an election) and is
    /// not stopping.
    pub fn leads(&self) -> bool {
        self.check_leading().is_ok()
    }

    /// Why `pod` may not be placed though it asks for vGPUs, where
    /// placement checks confinement: a vGPU container admission would have
    /// refused or given a seccomp profile, in a namespace admission does
    /// not skip. Such a pod never went through admission.
    pub(super) fn confinement_refusal(&self, pod: &Pod) -> Option<UnconfinedPod> {
        self.config.placement_confinement.as_ref()?;
        let breach = unconfined_for_placement(
            pod,
            &self.config.resources,
            &self.config.admission.guarded_paths,
        )?;
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("");
        if self.state.read().skipped_namespaces().skips(namespace) {
            return None;
        }
        Some(UnconfinedPod {
            pod: pod_key(pod),
            breach,
        })
    }

    /// Why this replica does not serve the verbs now, if it does not.
    pub(super) fn check_leading(&self) -> Result<(), NotServing> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(NotServing::Stopping);
        }
        match &self.leadership {
            Some(leadership) if !leadership.serving() => {
                Err(NotServing::StandingBy(leadership.standing_by()))
            }
            _ => Ok(()),
        }
    }

    /// A stopping replica takes no new filter, prioritize or bind.
    pub fn stop_serving(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// The API client, when the extender has one.
    pub fn api(&self) -> Option<&KubeApi> {
        self.api.as_ref()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn state(&self) -> &Arc<SharedState> {
        &self.state
    }

    /// Binds running now (a stopping extender lets them finish).
    pub fn binds_in_flight(&self) -> usize {
        self.binds_in_flight.load(Ordering::SeqCst)
    }

    /// Whether the first lists of pods and nodes are in.
    pub fn ready(&self) -> bool {
        self.state.read().synced()
    }

    /// The state as `GET /debug/state` shows it.
    pub fn snapshot(&self) -> DebugState {
        self.state.read().debug_state(
            now_unix_ms(),
            self.config.unbound_grace,
            self.config.node_lease_grace,
        )
    }

    /// What each namespace with a quota on vGPU resources holds, and may
    /// hold (for `/metrics`).
    pub fn quota_use(&self) -> Vec<NamespaceQuotaUse> {
        let state = self.state.read();
        quota_use(&Snapshot::new(&state, &self.rules, now_unix_ms()))
    }

    /// What the webhook checks a pod being created in `namespace` against,
    /// when a quota limits the namespace's vGPU resources.
    pub fn admission_quota(&self, namespace: &str) -> Option<AdmissionQuota> {
        let state = self.state.read();
        if !state.quotas().limits_namespace(namespace) {
            return None;
        }
        let snapshot = Snapshot::new(&state, &self.rules, now_unix_ms());
        Some(AdmissionQuota {
            usage: namespace_quota_use(&snapshot, namespace)?,
            defaults: self.rules.defaults,
        })
    }

    /// `GET /debug/state`.
    pub fn debug_state(&self) -> Reply {
        Reply::json(200, &self.snapshot())
    }

    /// The lock a bind (or a slice's placement) holds on `node`.
    pub(super) fn node_lock(&self, node: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock_of(&self.node_locks, node)
    }

    /// The lock a bind of a pod of `namespace` holds while the namespace
    /// has a quota on vGPU resources.
    pub(super) fn namespace_lock(&self, namespace: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock_of(&self.namespace_locks, namespace)
    }

    /// Marks a bind of `pod` running until the guard is dropped; `None`
    /// when one already runs.
    pub(super) fn start_binding(&self, pod: &str) -> Option<BindingPod<'_>> {
        let mut binding = self
            .binding
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        binding.insert(pod.to_string()).then(|| BindingPod {
            binding: &self.binding,
            pod: pod.to_string(),
        })
    }

    /// A number that is random across pods and nodes, but the same for one
    /// pod and node within this process.
    pub(super) fn random(&self, uid: &str, node: &str) -> u64 {
        self.hasher.hash_one((uid, node))
    }
}

/// A bind of one pod running; see [`Scheduler::start_binding`].
pub(super) struct BindingPod<'a> {
    binding: &'a Mutex<std::collections::HashSet<String>>,
    pod: String,
}

impl Drop for BindingPod<'_> {
    fn drop(&mut self) {
        let mut binding = self
            .binding
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        binding.remove(&self.pod);
    }
}

/// The lock of `key` in `locks`, made on first use.
fn lock_of(locks: &Locks, key: &str) -> Arc<tokio::sync::Mutex<()>> {
    let mut locks = locks.lock().unwrap_or_else(|poison| poison.into_inner());
    locks.entry(key.to_string()).or_default().clone()
}
