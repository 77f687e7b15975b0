//! The extender's three verbs.
//!
//! *Filter* and *prioritize* read the state only. *Bind* is where the
//! choice becomes real, and where conflicting choices are ruled out by
//! construction:
//!
//! 1. One in-process lock per node is held across check, record and bind,
//!    so two binds to one node never interleave.
//! 2. Under it, the bind waits (up to `--bind-wait-ms`) until the node has
//!    no *pending* pod (decided, not yet fully allocated by the device
//!    plugin), then places the pod on the node's GPUs as they are now.
//! 3. The decision is written to the pod with its `resourceVersion` as a
//!    precondition, and applied to the state at once, before the lock is
//!    released: the next bind on the node sees this pod pending.
//! 4. Only then is the pod bound. If binding fails, the decision is removed
//!    again (with the new `resourceVersion` as precondition, so a pod that
//!    was bound after all keeps it).
//!
//! The node locks are in memory: of several replicas, only the one holding
//! the extender's Lease serves the verbs ([`crate::leader`]).

use crate::admission::mutate::AdmissionPolicy;
use crate::api::{ApiError, KubeApi};
use crate::cache::clock::now_unix_ms;
use crate::cache::fast_map::FastMap;
use crate::cache::leases::Liveness;
use crate::cache::nodes::Inventory;
use crate::cache::state::debug::DebugState;
use crate::cache::state::{ClusterState, SharedState};
use crate::extender::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
    ExtenderPreemptionArgs, ExtenderPreemptionResult, FailedNodesMap, MetaPod, MetaVictims,
    NodeList, MAX_EXTENDER_PRIORITY,
};
use crate::fit::{explain, measured_load, node_load, place_pod, Scratch};
use crate::leader::Leadership;
use crate::requests::{parse_pod, PodRequest, RequestDefaults, ResourceNames};
use crate::vocabulary::claims::{claim_keys_held, share_amounts, ClaimShare};
use crate::vocabulary::policy::{node_score, GpuPolicy, NodePolicy};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use std::time::Instant;
use vgpu_cluster::decision::{
    ContainerDecision, Decision, DeviceGrant, FORMAT_VERSION, NODE_INVENTORY_ANNOTATION,
};
use vgpu_cluster::node_lease::{lease_name, NODE_LEASE_NAMESPACE};
use vgpu_cluster::report::with_causes;

/// How the extender decides.
#[derive(Clone, Debug)]
pub struct Config {
    pub resources: ResourceNames,
    pub defaults: RequestDefaults,
    pub gpu_policy: GpuPolicy,
    pub node_policy: NodePolicy,
    /// How long a bind waits for the node's pending pod (kube-scheduler
    /// gives an extender call 5 s by default).
    pub bind_wait: Duration,
    /// How long a decision whose pod is not bound yet keeps its node busy.
    pub unbound_grace: Duration,
    /// The `schedulerName` the admission webhook gives vGPU pods.
    pub scheduler_name: String,
    /// What else the admission webhook allows.
    pub admission: AdmissionPolicy,
    /// How long past its duration a node Lease may go unrenewed before
    /// the node gets no new pods ([`crate::cache::leases`]).
    pub node_lease_grace: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            resources: ResourceNames::default(),
            defaults: RequestDefaults::default(),
            gpu_policy: GpuPolicy::default(),
            node_policy: NodePolicy::default(),
            bind_wait: Duration::from_millis(3000),
            unbound_grace: Duration::from_secs(30),
            scheduler_name: DEFAULT_SCHEDULER_NAME.into(),
            admission: AdmissionPolicy::default(),
            node_lease_grace: DEFAULT_NODE_LEASE_GRACE,
        }
    }
}

/// Grace beyond a node Lease's duration unless configured otherwise.
pub const DEFAULT_NODE_LEASE_GRACE: Duration = Duration::from_secs(10);

/// The scheduler name vGPU pods use unless configured otherwise.
pub const DEFAULT_SCHEDULER_NAME: &str = "vgpu-scheduler";

/// An HTTP answer: status and JSON body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Reply {
    fn json<T: Serialize>(status: u16, value: &T) -> Self {
        Self::json_sized(status, value, 256)
    }

    /// Like [`Reply::json`], with room for about `capacity` bytes up front
    /// (answers listing thousands of nodes are not grown step by step).
    fn json_sized<T: Serialize>(status: u16, value: &T, capacity: usize) -> Self {
        let mut body = Vec::with_capacity(capacity);
        if serde_json::to_writer(&mut body, value).is_err() {
            body = b"{}".to_vec();
        }
        Self { status, body }
    }
}

/// How long, and for how many pods, the loads a filter call computed are
/// kept for the prioritize call that follows it.
const SCORE_CACHE_TTL: Duration = Duration::from_secs(5);
const SCORE_CACHE_ENTRIES: usize = 16;

/// The loads of the nodes a pod fits, by node name hash.
struct ScoreEntry {
    uid: String,
    version: String,
    at: Instant,
    loads: FastMap<u64, (f64, u32)>,
}

/// What a filter call found.
struct FilterOutcome<'a> {
    passed: Vec<&'a str>,
    failed: FailedNodesMap,
    unresolvable: FailedNodesMap,
}

/// `ExtenderFilterResult`, written from borrowed parts.
#[derive(Serialize)]
struct FilterReply<'a> {
    #[serde(rename = "Nodes")]
    nodes: Option<NodeList>,
    #[serde(rename = "NodeNames")]
    node_names: Option<&'a [&'a str]>,
    #[serde(rename = "FailedNodes")]
    failed_nodes: &'a FailedNodesMap,
    #[serde(rename = "FailedAndUnresolvableNodes")]
    failed_and_unresolvable_nodes: &'a FailedNodesMap,
    #[serde(rename = "Error")]
    error: &'a str,
}

/// `HostPriority`, written from a borrowed name.
#[derive(Serialize)]
struct Score<'a> {
    #[serde(rename = "Host")]
    host: &'a str,
    #[serde(rename = "Score")]
    score: i64,
}

#[derive(Serialize)]
struct ErrorBody {
    #[serde(rename = "Error")]
    error: String,
}

/// Why a node cannot take a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub message: String,
    /// Evicting pods would not help.
    pub permanent: bool,
}

impl Rejection {
    fn permanent(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            permanent: true,
        }
    }
}

/// The extender.
pub struct Scheduler {
    config: Config,
    state: Arc<SharedState>,
    api: Option<KubeApi>,
    node_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    hasher: foldhash::fast::RandomState,
    score_cache: Mutex<Vec<ScoreEntry>>,
    binds_in_flight: AtomicUsize,
    /// Held while a pod holding Elastic GPU claims is bound.
    claims_lock: tokio::sync::Mutex<()>,
    stopping: AtomicBool,
    /// Set when this is one of several replicas: serve only while leading.
    leadership: Option<Arc<Leadership>>,
}

/// Counts a bind while it runs.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn enter(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The pod being placed, as the state knows it.
pub(crate) struct Own<'a> {
    pub(crate) uid: &'a str,
    /// Where an earlier decision of it is counted, if anywhere.
    pub(crate) counted_node: Option<&'a str>,
    /// The Elastic GPU claims it holds, `namespace/name`.
    pub(crate) claims: Vec<String>,
    /// Pods taken as gone (the victims of a preemption being weighed).
    pub(crate) evicted: Vec<String>,
}

impl<'a> Own<'a> {
    pub(crate) fn of(state: &'a ClusterState, pod: &'a Pod) -> Self {
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        Self {
            uid,
            counted_node: state.counted_node_of(uid),
            claims: claim_keys_held(pod),
            evicted: Vec::new(),
        }
    }
}

/// Why the pod cannot be placed while another pod holds one of its claims.
fn claim_in_use(state: &ClusterState, own: &Own<'_>) -> Option<String> {
    own.claims.iter().find_map(|claim| {
        state.holder_of(claim, own.uid).map(|holder| {
            format!(
                "ElasticGPUClaim {claim} is in use by pod {}; one claim serves one pod at a time",
                holder.key()
            )
        })
    })
}

/// For a pod holding claims whose slices are held: `request` limited to
/// those slices' GPUs, or why it cannot run on node `name`. `None`: no
/// slice is held for its claims, so it may go anywhere.
fn pin_to_slices(
    state: &ClusterState,
    name: &str,
    claims: &[String],
    request: &PodRequest,
) -> Result<Option<PodRequest>, Rejection> {
    let mut gpus: Vec<&str> = Vec::new();
    for claim in claims {
        let Some(slice) = state.reservation_of(claim) else {
            continue;
        };
        if slice.node != name {
            return Err(Rejection::permanent(format!(
                "ElasticGPUClaim {claim} holds its GPU slice (ElasticGPU {}) on node {}; pods holding it run there",
                slice.elastic_gpu, slice.node
            )));
        }
        gpus.extend(slice.gpus.iter().map(String::as_str));
    }
    if gpus.is_empty() {
        return Ok(None);
    }
    let allowed: Vec<String> = gpus
        .iter()
        .filter(|uuid| request.selectors.uuid_allowed(uuid).is_ok())
        .map(|uuid| uuid.to_string())
        .collect();
    if allowed.is_empty() {
        return Err(Rejection::permanent(format!(
            "the pod's GPU selectors exclude {}, where its claims' slices are held",
            gpus.join(", ")
        )));
    }
    let mut pinned = request.clone();
    pinned.selectors.use_uuids = allowed;
    Ok(Some(pinned))
}

pub(crate) fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}

/// Candidate node names, in the order kube-scheduler sent them.
fn candidates<'a>(args: &'a ExtenderArgs<'a>) -> Result<Vec<&'a str>, String> {
    if let Some(names) = &args.node_names {
        return Ok(names.iter().map(|n| n.as_ref()).collect());
    }
    if let Some(nodes) = &args.nodes {
        return Ok(nodes
            .items
            .iter()
            .flatten()
            .filter_map(NodeList::node_name)
            .collect());
    }
    Err("ExtenderArgs has neither NodeNames nor Nodes".to_string())
}

impl Scheduler {
    pub fn new(config: Config, state: Arc<SharedState>, api: Option<KubeApi>) -> Self {
        Self {
            config,
            state,
            api,
            node_locks: Mutex::new(HashMap::new()),
            hasher: foldhash::fast::RandomState::default(),
            score_cache: Mutex::new(Vec::new()),
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

    /// `Err(why)` when another replica serves the verbs.
    /// Whether this replica leads (always, without an election) and is
    /// not stopping.
    pub fn leads(&self) -> bool {
        self.check_leading().is_ok()
    }

    fn check_leading(&self) -> Result<(), String> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(
                "this vgpu-scheduler replica is stopping; kube-scheduler will retry".to_string(),
            );
        }
        match &self.leadership {
            Some(leadership) if !leadership.serving() => Err(leadership.standing_by()),
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

    /// `GET /debug/state`.
    /// The state as `GET /debug/state` shows it.
    pub fn snapshot(&self) -> DebugState {
        self.state.read().debug_state(
            now_unix_ms(),
            self.config.unbound_grace,
            self.config.node_lease_grace,
        )
    }

    pub fn debug_state(&self) -> Reply {
        Reply::json(200, &self.snapshot())
    }

    pub(crate) fn parse(&self, pod: &Pod) -> Result<PodRequest, String> {
        parse_pod(pod, &self.config.resources, &self.config.defaults)
            .map_err(|e| format!("pod {}: {}", pod_key(pod), with_causes(&e)))
    }

    /// Whether `request` fits on node `name`; on success returns the node's
    /// load after placing it (0.0 to 1.0).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn evaluate(
        &self,
        state: &ClusterState,
        name: &str,
        own: &Own<'_>,
        request: &PodRequest,
        policy: GpuPolicy,
        now_unix_ms: u64,
        scratch: &mut Scratch,
    ) -> Result<f64, Rejection> {
        let node = match state.node(name) {
            Some(node) if node.in_api => node,
            _ => {
                return Err(Rejection::permanent(
                    "vgpu-scheduler does not know this node (it is not in its watch of the Kubernetes API)",
                ))
            }
        };
        match &node.inventory {
            Inventory::Missing => {
                return Err(Rejection::permanent(format!(
                    "node has no vGPU inventory (annotation {NODE_INVENTORY_ANNOTATION}); is the vgpu device plugin running on it?"
                )))
            }
            Inventory::Invalid(error) => {
                return Err(Rejection::permanent(format!(
                    "node's vGPU inventory is unreadable: {error}"
                )))
            }
            Inventory::Valid => {}
        }
        match state.liveness(name, now_unix_ms, self.config.node_lease_grace) {
            Liveness::Live { .. } => {}
            Liveness::Missing => {
                return Err(Rejection::permanent(format!(
                    "the vgpu device plugin on this node holds no Lease ({NODE_LEASE_NAMESPACE}/{}): \
                     it is not running, or may not write Leases",
                    lease_name(name)
                )))
            }
            Liveness::Expired {
                silent_ms,
                duration_ms,
            } => {
                return Err(Rejection::permanent(format!(
                    "the vgpu device plugin on this node last renewed its Lease {} s ago (it lasts {} s, \
                     plus {} s grace): no new vGPU pods until it renews it",
                    silent_ms / 1000,
                    duration_ms / 1000,
                    self.config.node_lease_grace.as_secs()
                )))
            }
        }
        if node.offers_none_of(&self.config.resources.gpu) {
            return Err(Rejection::permanent(format!(
                "kubelet reports no allocatable {} on this node now (its vgpu device plugin is disconnected, \
                 restarting, or all its GPUs are unhealthy); kube-scheduler will retry",
                self.config.resources.gpu
            )));
        }
        let pinned = pin_to_slices(state, name, &own.claims, request)?;
        let request = pinned.as_ref().unwrap_or(request);
        let recount = own.counted_node == Some(name)
            || !own.claims.is_empty()
            || !own.evicted.is_empty()
            || state.groups().holds_on(name, now_unix_ms).next().is_some();
        let base = if recount {
            let mut gone: Vec<&str> = Vec::with_capacity(1 + own.evicted.len());
            gone.push(own.uid);
            gone.extend(own.evicted.iter().map(String::as_str));
            let mut base = state.usage_without(node, &gone, &own.claims);
            state.add_holds(name, node, &gone, now_unix_ms, &mut base);
            base
        } else {
            std::borrow::Cow::Borrowed(&node.usage[..])
        };
        match place_pod(&node.gpus, &base, request, policy, scratch) {
            Ok(()) => Ok(node_load(&node.gpus, &scratch.after)),
            Err(miss) => Err(Rejection {
                message: explain(&node.gpus, request, &miss),
                permanent: miss.permanent,
            }),
        }
    }

    // ---- filter ----

    /// `POST /filter`.
    pub fn filter(&self, body: &[u8]) -> Reply {
        let args = match serde_json::from_slice::<ExtenderArgs>(body) {
            Ok(args) => args,
            Err(error) => {
                return Reply::json(
                    400,
                    &ExtenderFilterResult::error(format!(
                        "request body is not ExtenderArgs JSON: {error}"
                    )),
                )
            }
        };
        let outcome = match self.filter_outcome(&args) {
            Ok(outcome) => outcome,
            Err(error) => return Reply::json(200, &ExtenderFilterResult::error(error)),
        };
        let mut reply = FilterReply {
            nodes: None,
            node_names: None,
            failed_nodes: &outcome.failed,
            failed_and_unresolvable_nodes: &outcome.unresolvable,
            error: "",
        };
        if args.node_names.is_some() {
            reply.node_names = Some(&outcome.passed);
        } else if let Some(nodes) = &args.nodes {
            let keep: std::collections::HashSet<&str> = outcome.passed.iter().copied().collect();
            reply.nodes = Some(NodeList {
                metadata: nodes.metadata.clone(),
                items: Some(
                    nodes
                        .items
                        .iter()
                        .flatten()
                        .filter(|n| NodeList::node_name(n).is_some_and(|name| keep.contains(name)))
                        .cloned()
                        .collect(),
                ),
            });
        }
        let capacity = 64
            + 24 * outcome.passed.len()
            + 256 * (outcome.failed.len() + outcome.unresolvable.len());
        Reply::json_sized(200, &reply, capacity)
    }

    /// Which candidates fit; remembers their loads for the prioritize call
    /// that follows.
    fn filter_outcome<'a>(&self, args: &'a ExtenderArgs<'a>) -> Result<FilterOutcome<'a>, String> {
        self.check_leading()?;
        let pod = args.pod.as_ref().ok_or("ExtenderArgs has no Pod")?;
        let names = candidates(args)?;
        let request = self
            .parse(pod)
            .inspect_err(|error| tracing::info!(error = %error, "filter"))?;
        let mut outcome = FilterOutcome {
            passed: Vec::with_capacity(names.len()),
            failed: FailedNodesMap::new(),
            unresolvable: FailedNodesMap::new(),
        };
        if request.is_empty() {
            outcome.passed = names;
            return Ok(outcome);
        }
        let mut state = self.state.read();
        if !state.synced() {
            return Err(
                "vgpu-scheduler is still listing pods and nodes from the Kubernetes API; retry shortly"
                    .to_string(),
            );
        }
        let group = crate::vocabulary::kubeshare::group_of(pod)
            .map_err(|e| format!("pod {}: {e}", pod_key(pod)))?;
        if let Some((key, labels)) = group {
            drop(state);
            if let Err(why) = self.pass_group_gate(pod, &request, &key, &labels, now_unix_ms()) {
                tracing::info!("filter {}: {why}", pod_key(pod));
                for name in names {
                    outcome.failed.insert(name.to_string(), why.clone());
                }
                return Ok(outcome);
            }
            state = self.state.read();
        }
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        let own = Own::of(&state, pod);
        if let Some(why) = claim_in_use(&state, &own) {
            drop(state);
            tracing::info!("filter {}: {why}", pod_key(pod));
            for name in names {
                outcome.failed.insert(name.to_string(), why.clone());
            }
            return Ok(outcome);
        }
        let policy = request.gpu_policy.unwrap_or(self.config.gpu_policy);
        let now = now_unix_ms();
        let mut scratch = Scratch::default();
        let mut loads = FastMap::with_capacity_and_hasher(names.len(), self.hasher.clone());
        for name in names {
            match self.evaluate(&state, name, &own, &request, policy, now, &mut scratch) {
                Ok(load) => {
                    loads.insert(self.hasher.hash_one(name), (load, scratch.matching));
                    outcome.passed.push(name);
                }
                Err(rejection) if rejection.permanent => {
                    outcome
                        .unresolvable
                        .insert(name.to_string(), rejection.message);
                }
                Err(rejection) => {
                    outcome.failed.insert(name.to_string(), rejection.message);
                }
            }
        }
        drop(state);
        let key = pod_key(pod);
        if outcome.passed.is_empty() {
            let example = outcome
                .failed
                .iter()
                .chain(&outcome.unresolvable)
                .next()
                .map(|(node, why)| format!(" (e.g. {node}: {why})"))
                .unwrap_or_default();
            tracing::info!("filter {key}: no node fits{example}");
        } else {
            tracing::debug!("filter {key}: {} node(s) fit", outcome.passed.len());
            if !uid.is_empty() {
                self.remember(ScoreEntry {
                    uid: uid.to_string(),
                    version: pod.metadata.resource_version.clone().unwrap_or_default(),
                    at: Instant::now(),
                    loads,
                });
            }
        }
        Ok(outcome)
    }

    fn remember(&self, entry: ScoreEntry) {
        let mut cache = self
            .score_cache
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        cache.retain(|e| e.uid != entry.uid && e.at.elapsed() < SCORE_CACHE_TTL);
        if cache.len() >= SCORE_CACHE_ENTRIES {
            cache.remove(0);
        }
        cache.push(entry);
    }

    /// The loads the filter call for this pod version computed, if recent.
    fn recall(&self, uid: &str, version: &str) -> Option<ScoreEntry> {
        let mut cache = self
            .score_cache
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let index = cache.iter().position(|e| e.uid == uid)?;
        let entry = cache.remove(index);
        (entry.version == version && entry.at.elapsed() < SCORE_CACHE_TTL).then_some(entry)
    }

    // ---- preempt ----

    /// `POST /preempt`: kube-scheduler found no node for a pod and proposes,
    /// per node, the lower-priority pods its own dry run would evict. Its
    /// dry run sees only the resources it counts, not which GPU holds what,
    /// so the answer keeps only the nodes where those evictions make room
    /// for the pod on the GPUs (memory, compute and slots of one GPU per
    /// vGPU), and on each the fewest of the pods holding vGPUs there: they
    /// are spared in kube-scheduler's order, most important first, while
    /// the pod still fits. Victims holding no vGPU on the node are kept:
    /// kube-scheduler needed them for something else.
    pub fn preempt(&self, body: &[u8]) -> Reply {
        let args = match serde_json::from_slice::<ExtenderPreemptionArgs>(body) {
            Ok(args) => args,
            Err(error) => {
                return Reply::json(
                    400,
                    &ErrorBody {
                        error: format!("request body is not ExtenderPreemptionArgs JSON: {error}"),
                    },
                )
            }
        };
        match self.preemption(&args) {
            Ok(result) => Reply::json(200, &result),
            Err(error) => {
                tracing::info!(error = %error, "preempt");
                Reply::json(503, &ErrorBody { error })
            }
        }
    }

    fn preemption(
        &self,
        args: &ExtenderPreemptionArgs,
    ) -> Result<ExtenderPreemptionResult, String> {
        self.check_leading()?;
        let pod = args
            .pod
            .as_ref()
            .ok_or("ExtenderPreemptionArgs has no Pod")?;
        let proposed = args.proposed();
        let as_proposed = |node: &str, victims: &[&str], violations: i64| {
            (
                node.to_string(),
                MetaVictims {
                    pods: Some(
                        victims
                            .iter()
                            .map(|uid| MetaPod {
                                uid: uid.to_string(),
                            })
                            .collect(),
                    ),
                    num_pdb_violations: violations,
                },
            )
        };
        let request = self.parse(pod)?;
        if request.is_empty() {
            // Not a vGPU pod: nothing of ours to weigh.
            return Ok(ExtenderPreemptionResult {
                node_name_to_meta_victims: proposed
                    .iter()
                    .filter(|(_, victims, _)| !victims.is_empty())
                    .map(|(node, victims, violations)| as_proposed(node, victims, *violations))
                    .collect(),
            });
        }
        let state = self.state.read();
        if !state.synced() {
            return Err(
                "vgpu-scheduler is still listing pods and nodes from the Kubernetes API; retry shortly"
                    .to_string(),
            );
        }
        let key = pod_key(pod);
        if let Ok(Some((group, labels))) = crate::vocabulary::kubeshare::group_of(pod) {
            let uid = pod.metadata.uid.as_deref().unwrap_or("");
            let gate = crate::coscheduling::gate(&state, &group, &labels, uid, now_unix_ms());
            if gate != crate::coscheduling::Gate::Open {
                tracing::info!(
                    "preempt {key}: its group {group} is not placed yet; no eviction for it"
                );
                return Ok(ExtenderPreemptionResult::default());
            }
        }
        let mut own = Own::of(&state, pod);
        if let Some(why) = claim_in_use(&state, &own) {
            tracing::info!("preempt {key}: no eviction helps: {why}");
            return Ok(ExtenderPreemptionResult::default());
        }
        let policy = request.gpu_policy.unwrap_or(self.config.gpu_policy);
        let now = now_unix_ms();
        let mut scratch = Scratch::default();
        let mut result = ExtenderPreemptionResult::default();
        for (node, victims, violations) in proposed {
            let (holding, other): (Vec<&str>, Vec<&str>) = victims
                .iter()
                .partition(|uid| state.counted_node_of(uid) == Some(node));
            own.evicted = holding.iter().map(|uid| uid.to_string()).collect();
            if let Err(rejection) =
                self.evaluate(&state, node, &own, &request, policy, now, &mut scratch)
            {
                tracing::info!(
                    "preempt {key}: evicting {} pod(s) on {node} does not make room: {}",
                    victims.len(),
                    rejection.message
                );
                continue;
            }
            for spared in &holding {
                let without: Vec<String> = own
                    .evicted
                    .iter()
                    .filter(|uid| uid.as_str() != *spared)
                    .cloned()
                    .collect();
                let evicted = std::mem::replace(&mut own.evicted, without);
                if self
                    .evaluate(&state, node, &own, &request, policy, now, &mut scratch)
                    .is_err()
                {
                    own.evicted = evicted;
                }
            }
            let mut evict: Vec<&str> = other;
            evict.extend(own.evicted.iter().map(String::as_str));
            if evict.is_empty() {
                tracing::info!("preempt {key}: fits on {node} without evicting anyone");
                continue;
            }
            tracing::info!(
                "preempt {key}: on {node} evict {} of the {} proposed pod(s)",
                evict.len(),
                victims.len()
            );
            let kept = i64::try_from(evict.len()).unwrap_or(i64::MAX);
            let (name, meta) = as_proposed(node, &evict, violations.min(kept));
            result.node_name_to_meta_victims.insert(name, meta);
        }
        Ok(result)
    }

    // ---- prioritize ----

    /// `POST /prioritize`.
    pub fn prioritize(&self, body: &[u8]) -> Reply {
        match serde_json::from_slice::<ExtenderArgs>(body) {
            Ok(args) => match self.prioritize_scores(&args) {
                Ok(list) => Reply::json_sized(200, &list, 16 + 40 * list.len()),
                Err(error) => Reply::json(400, &ErrorBody { error }),
            },
            Err(error) => Reply::json(
                400,
                &ErrorBody {
                    error: format!("request body is not ExtenderArgs JSON: {error}"),
                },
            ),
        }
    }

    /// Scores 0 to 10; nodes the pod does not fit get 0. The loads come
    /// from the filter call just before, when there was one for this pod
    /// version in the last seconds (the binding re-checks everything, so a
    /// score a few milliseconds old is only ever advice).
    fn prioritize_scores<'a>(&self, args: &'a ExtenderArgs<'a>) -> Result<Vec<Score<'a>>, String> {
        self.check_leading()?;
        let pod = args.pod.as_ref().ok_or("ExtenderArgs has no Pod")?;
        let names = candidates(args)?;
        let zero = |names: Vec<&'a str>| {
            names
                .into_iter()
                .map(|host| Score { host, score: 0 })
                .collect()
        };
        let request = match self.parse(pod) {
            Ok(request) if !request.is_empty() => request,
            Ok(_) => return Ok(zero(names)),
            Err(error) => {
                tracing::info!(error = %error, "prioritize");
                return Ok(zero(names));
            }
        };
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        let version = pod.metadata.resource_version.as_deref().unwrap_or("");
        let cached = self.recall(uid, version);
        let state = self.state.read();
        if !state.synced() {
            return Ok(zero(names));
        }
        let own = Own::of(&state, pod);
        let gpu_policy = request.gpu_policy.unwrap_or(self.config.gpu_policy);
        let node_policy = request.node_policy.unwrap_or(self.config.node_policy);
        let wants_model =
            !request.selectors.use_types.is_empty() || request.selectors.model.is_some();
        let now = now_unix_ms();
        let mut scratch = Scratch::default();
        let mut evaluated: Vec<Option<(f64, u32)>> = Vec::with_capacity(names.len());
        for name in &names {
            let known = cached
                .as_ref()
                .and_then(|c| c.loads.get(&self.hasher.hash_one(name)).copied());
            let result = match known {
                Some(known) => Some(known),
                None => self
                    .evaluate(&state, name, &own, &request, gpu_policy, now, &mut scratch)
                    .ok()
                    .map(|load| (load, scratch.matching)),
            };
            evaluated.push(result);
        }
        // The load-aware node policy scores by what the nodes measure.
        let measured: Vec<Option<f64>> = if node_policy == NodePolicy::LoadAware {
            names
                .iter()
                .map(|name| {
                    state
                        .node(name)
                        .map(|node| measured_load(&node.gpus, &node.usage))
                })
                .collect()
        } else {
            Vec::new()
        };
        drop(state);
        let most_matching = evaluated
            .iter()
            .flatten()
            .map(|(_, m)| *m)
            .max()
            .unwrap_or(0);
        Ok(names
            .into_iter()
            .zip(evaluated)
            .enumerate()
            .map(|(index, (host, result))| {
                let score = match result {
                    None => 0,
                    Some((load, matching)) => {
                        let load = measured.get(index).copied().flatten().unwrap_or(load);
                        let seed = if node_policy == NodePolicy::Random {
                            self.random(uid, host)
                        } else {
                            0
                        };
                        let score = node_score(node_policy, load, seed);
                        // Prefer nodes with more GPUs of a requested model.
                        let combined = if wants_model && most_matching > 0 {
                            (score + f64::from(matching) / f64::from(most_matching)) / 2.0
                        } else {
                            score
                        };
                        (combined * MAX_EXTENDER_PRIORITY as f64).round() as i64
                    }
                };
                Score {
                    host,
                    score: score.clamp(0, MAX_EXTENDER_PRIORITY),
                }
            })
            .collect())
    }

    /// A number that is random across pods and nodes, but the same for one
    /// pod and node within this process.
    fn random(&self, uid: &str, node: &str) -> u64 {
        self.hasher.hash_one((uid, node))
    }

    // ---- bind ----

    /// `POST /bind`.
    pub async fn bind(&self, body: &[u8]) -> Reply {
        match serde_json::from_slice::<ExtenderBindingArgs>(body) {
            Ok(args) => Reply::json(200, &self.bind_args(&args).await),
            Err(error) => Reply::json(
                400,
                &ExtenderBindingResult {
                    error: format!("request body is not ExtenderBindingArgs JSON: {error}"),
                },
            ),
        }
    }

    pub async fn bind_args(&self, args: &ExtenderBindingArgs) -> ExtenderBindingResult {
        let _in_flight = InFlight::enter(&self.binds_in_flight);
        let key = format!("{}/{}", args.pod_namespace, args.pod_name);
        match self.bind_inner(args).await {
            Ok(summary) => {
                tracing::info!("bound {key} to {}{summary}", args.node);
                ExtenderBindingResult::default()
            }
            Err(error) => {
                tracing::info!(error = %error, "bind {key} to {}", args.node);
                ExtenderBindingResult { error }
            }
        }
    }

    fn node_lock(&self, node: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self
            .node_locks
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        locks.entry(node.to_string()).or_default().clone()
    }

    async fn bind_inner(&self, args: &ExtenderBindingArgs) -> Result<String, String> {
        let (namespace, name, node) = (&args.pod_namespace, &args.pod_name, &args.node);
        if name.is_empty() || namespace.is_empty() || node.is_empty() {
            return Err("ExtenderBindingArgs needs PodName, PodNamespace and Node".to_string());
        }
        self.check_leading()?;
        let api = self
            .api
            .as_ref()
            .ok_or("vgpu-scheduler runs without a Kubernetes API and cannot bind")?;
        let key = format!("{namespace}/{name}");
        let deadline = tokio::time::Instant::now() + self.config.bind_wait;

        let mut pod = self.fetch(api, args).await?;
        let request = self.parse(&pod)?;
        if let Some(bound) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
            return if bound == node.as_str() {
                Ok(" (it already was)".to_string())
            } else {
                Err(format!("pod {key} is already bound to node {bound}"))
            };
        }
        if request.is_empty() {
            api.bind(namespace, name, &args.pod_uid, node)
                .await
                .map_err(|e| {
                    format!(
                        "binding pod {key} to node {node} failed: {}",
                        with_causes(&e)
                    )
                })?;
            return Ok(" (no GPUs)".to_string());
        }

        // Check, record and bind under the node's lock.
        if !self.state.read().node(node).is_some_and(|n| n.in_api) {
            return Err(format!(
                "vgpu-scheduler does not know node {node} (it is not in its watch of the Kubernetes API)"
            ));
        }
        // Binds of pods holding claims go one at a time, so two pods
        // holding the same claim cannot both be placed (the webhook's check
        // at creation can be raced); taken before the node's lock, always.
        let _claims_guard = if claim_keys_held(&pod).is_empty() {
            None
        } else {
            Some(
                tokio::time::timeout_at(deadline, self.claims_lock.lock())
                    .await
                    .map_err(|_| {
                        format!(
                            "other pods holding Elastic GPU claims are being bound for more than {} ms; kube-scheduler will retry",
                            self.config.bind_wait.as_millis()
                        )
                    })?,
            )
        };
        let lock = self.node_lock(node);
        let _guard = tokio::time::timeout_at(deadline, lock.lock())
            .await
            .map_err(|_| {
                format!(
                    "node {node} is busy with other binds for more than {} ms; kube-scheduler will retry",
                    self.config.bind_wait.as_millis()
                )
            })?;
        let mut request = request;
        let mut attempt = 0;
        let written = loop {
            attempt += 1;
            let decision = self
                .wait_and_place(&key, &pod, node, &request, deadline)
                .await?;
            let version = pod.metadata.resource_version.clone().unwrap_or_default();
            // The lead may have passed while this bind waited.
            self.check_leading()?;
            match api
                .write_decision(namespace, name, &version, &decision.to_json())
                .await
            {
                Ok(written) => break written,
                Err(ApiError::Conflict(_)) if attempt < 3 => {
                    // The pod changed since it was read: read it again (its
                    // annotations may choose other GPUs) and decide again.
                    pod = self.fetch(api, args).await?;
                    if pod
                        .spec
                        .as_ref()
                        .and_then(|s| s.node_name.as_deref())
                        .is_some()
                    {
                        return Err(format!("pod {key} was bound by someone else meanwhile"));
                    }
                    request = self.parse(&pod)?;
                }
                Err(error) => {
                    return Err(format!(
                        "recording the decision on pod {key} failed: {error}"
                    ))
                }
            }
        };
        self.state.update(|s| s.apply_written_pod(&written));
        let uid = written.metadata.uid.clone().unwrap_or_default();
        match api.bind(namespace, name, &uid, node).await {
            Ok(()) => {
                self.state.update(|s| s.mark_bound(&uid, node));
                Ok(summarize(&written))
            }
            Err(error) => {
                let version = written
                    .metadata
                    .resource_version
                    .clone()
                    .unwrap_or_default();
                match api.clear_decision(namespace, name, &version).await {
                    Ok(cleared) => self.state.update(|s| s.apply_written_pod(&cleared)),
                    Err(clear_error) => tracing::warn!(
                        error = &clear_error as &dyn std::error::Error,
                        "pod {key}: binding failed and the decision could not be removed; it expires after {} s",
                        self.config.unbound_grace.as_secs()
                    ),
                }
                Err(format!(
                    "binding pod {key} to node {node} failed: {}",
                    with_causes(&error)
                ))
            }
        }
    }

    async fn fetch(&self, api: &KubeApi, args: &ExtenderBindingArgs) -> Result<Pod, String> {
        let key = format!("{}/{}", args.pod_namespace, args.pod_name);
        let pod = api
            .get_pod(&args.pod_namespace, &args.pod_name)
            .await
            .map_err(|e| format!("reading pod {key} failed: {}", with_causes(&e)))?;
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        if !args.pod_uid.is_empty() && uid != args.pod_uid {
            return Err(format!(
                "pod {key} now has UID {uid}, not {} (it was recreated)",
                args.pod_uid
            ));
        }
        Ok(pod)
    }

    /// Waits until `node` has no pending pod, then places the pod on it.
    async fn wait_and_place(
        &self,
        key: &str,
        pod: &Pod,
        node: &str,
        request: &PodRequest,
        deadline: tokio::time::Instant,
    ) -> Result<Decision, String> {
        let mut changes = self.state.subscribe();
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        let policy = request.gpu_policy.unwrap_or(self.config.gpu_policy);
        let mut scratch = Scratch::default();
        loop {
            changes.borrow_and_update();
            let outcome = {
                let state = self.state.read();
                if !state.synced() {
                    Err(
                        "vgpu-scheduler is still listing pods and nodes from the Kubernetes API; retry shortly"
                            .to_string(),
                    )
                } else {
                    let now = now_unix_ms();
                    let pending: Vec<String> = state
                        .pending_on(node, now, self.config.unbound_grace, uid)
                        .into_iter()
                        .map(|p| p.key())
                        .collect();
                    let own = Own::of(&state, pod);
                    if let Some(why) = claim_in_use(&state, &own) {
                        Err(format!("pod {key}: {why}"))
                    } else if !pending.is_empty() {
                        Ok(Err(pending.join(", ")))
                    } else {
                        match self.evaluate(&state, node, &own, request, policy, now, &mut scratch)
                        {
                            Ok(_) => Ok(Ok(self.decision(&state, node, request, &scratch, now))),
                            Err(rejection) => Err(format!(
                                "pod {key} does not fit on node {node} any more: {}",
                                rejection.message
                            )),
                        }
                    }
                }
            };
            match outcome? {
                Ok(Some(decision)) => return Ok(decision),
                Ok(None) => return Err(format!("node {node} disappeared")),
                Err(pending) => {
                    if tokio::time::timeout_at(deadline, changes.changed())
                        .await
                        .is_err()
                    {
                        return Err(format!(
                            "node {node} is still admitting {pending} (its device plugin has not allocated all its GPUs yet; \
                             vGPU pods are admitted one per node at a time); kube-scheduler will retry"
                        ));
                    }
                }
            }
        }
    }

    /// Places the GPU slice of Elastic GPU claim `claim` (`namespace/name`)
    /// asking for `share`, as a pod holding it would be placed (the
    /// configured GPU and node policies), and has `record` write it (the
    /// ElasticGPU, answered as written), under the chosen node's lock so
    /// that no bind there races it. The outer error is the API's; the inner
    /// says why no node has room now.
    pub async fn place_slice<F, Fut>(
        &self,
        claim: &str,
        share: &ClaimShare,
        record: F,
    ) -> Result<Result<(), String>, ApiError>
    where
        F: FnOnce(Decision) -> Fut,
        Fut: std::future::Future<Output = Result<serde_json::Value, ApiError>>,
    {
        let request = match self.slice_request(claim, share) {
            Ok(request) => request,
            Err(why) => return Ok(Err(why)),
        };
        let policy = self.config.gpu_policy;
        let own = Own {
            uid: "",
            counted_node: None,
            claims: vec![claim.to_string()],
            evicted: Vec::new(),
        };
        let mut scratch = Scratch::default();
        // The node a pod would get: the best score among those that fit.
        let chosen = {
            let state = self.state.read();
            if !state.synced() {
                return Ok(Err(
                    "vgpu-scheduler is still listing pods, nodes and ElasticGPUs; retried shortly"
                        .to_string(),
                ));
            }
            let now = now_unix_ms();
            let mut best: Option<(f64, &str)> = None;
            let mut example = None;
            let mut names: Vec<&str> = state.nodes().map(|(name, _)| name.as_str()).collect();
            names.sort_unstable();
            for name in names {
                match self.evaluate(&state, name, &own, &request, policy, now, &mut scratch) {
                    Ok(load) => {
                        let load = match (self.config.node_policy, state.node(name)) {
                            (NodePolicy::LoadAware, Some(node)) => {
                                measured_load(&node.gpus, &node.usage)
                            }
                            _ => load,
                        };
                        let score =
                            node_score(self.config.node_policy, load, self.random(claim, name));
                        if best.is_none_or(|(top, _)| score > top) {
                            best = Some((score, name));
                        }
                    }
                    Err(rejection) => {
                        example.get_or_insert_with(|| format!("{name}: {}", rejection.message));
                    }
                }
            }
            match best {
                Some((_, name)) => name.to_string(),
                None => {
                    return Ok(Err(format!(
                        "no node has room for it now{}",
                        example.map(|e| format!(" (e.g. {e})")).unwrap_or_default()
                    )))
                }
            }
        };
        let lock = self.node_lock(&chosen);
        let _guard = lock.lock().await;
        let decision = {
            let state = self.state.read();
            let now = now_unix_ms();
            match self.evaluate(&state, &chosen, &own, &request, policy, now, &mut scratch) {
                Ok(_) => self.decision(&state, &chosen, &request, &scratch, now),
                Err(rejection) => {
                    return Ok(Err(format!(
                        "node {chosen} has no room for it any more: {}",
                        rejection.message
                    )))
                }
            }
        };
        let Some(decision) = decision else {
            return Ok(Err(format!("node {chosen} disappeared")));
        };
        let written = record(decision).await?;
        self.state.update(|s| s.apply_reservation(&written, true));
        Ok(Ok(()))
    }

    /// What a pod holding a claim of `share` asks for: the resources the
    /// webhook would give its container (named after the claim).
    fn slice_request(&self, claim: &str, share: &ClaimShare) -> Result<PodRequest, String> {
        let (namespace, name) = claim.split_once('/').unwrap_or(("", claim));
        let limits = share_amounts(share, &self.config.resources)
            .into_iter()
            .map(|(resource, amount)| (resource, Quantity(amount)))
            .collect();
        let pod = Pod {
            metadata: ObjectMeta {
                namespace: Some(namespace.to_string()),
                name: Some(name.to_string()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: name.to_string(),
                    resources: Some(ResourceRequirements {
                        limits: Some(limits),
                        ..ResourceRequirements::default()
                    }),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            ..Pod::default()
        };
        self.parse(&pod)
    }

    pub(crate) fn decision(
        &self,
        state: &ClusterState,
        node: &str,
        request: &PodRequest,
        scratch: &Scratch,
        now_unix_ms: u64,
    ) -> Option<Decision> {
        let gpus = &state.node(node)?.gpus;
        let containers = request
            .containers
            .iter()
            .enumerate()
            .map(|(index, container)| {
                let mut grants: Vec<_> = scratch
                    .grants
                    .iter()
                    .filter(|g| g.container == index)
                    .collect();
                grants.sort_by_key(|g| gpus.gpus.get(g.gpu).map(|info| info.index));
                ContainerDecision {
                    name: container.name.clone(),
                    init: container.kind.is_init(),
                    devices: grants
                        .into_iter()
                        .filter_map(|g| {
                            gpus.gpus.get(g.gpu).map(|info| DeviceGrant {
                                uuid: info.uuid.clone(),
                                memory_bytes: g.memory_bytes,
                                cores_percent: g.cores.min(100),
                                burst_percent: burst_above(g.cores, request.burst_percent),
                            })
                        })
                        .collect(),
                    priority: container.priority,
                }
            })
            .collect();
        Some(Decision {
            version: FORMAT_VERSION,
            node: node.to_string(),
            decided_unix_ms: now_unix_ms,
            containers,
        })
    }
}

/// `: main → GPU-x (4096 MiB, 30%)` for the log.
fn summarize(pod: &Pod) -> String {
    let decision = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(vgpu_cluster::decision::DECISION_ANNOTATION))
        .and_then(|text| Decision::parse(text).ok());
    let Some(decision) = decision else {
        return String::new();
    };
    let parts: Vec<String> = decision
        .containers
        .iter()
        .map(|c| {
            let devices: Vec<String> = c
                .devices
                .iter()
                .map(|d| {
                    format!(
                        "{} ({} MiB, {}%)",
                        d.uuid,
                        d.memory_bytes >> 20,
                        d.cores_percent
                    )
                })
                .collect();
            format!("{} -> {}", c.name, devices.join(" + "))
        })
        .collect();
    format!(": {}", parts.join("; "))
}

/// The burst share a vGPU of `cores` percent gets from the pod's burst
/// annotation: only a capped share (1-99 %) below the burst can burst.
fn burst_above(cores: u32, burst: Option<u32>) -> Option<u32> {
    burst.filter(|&burst| cores > 0 && cores < 100 && burst > cores)
}

#[cfg(test)]
mod tests {
    use super::burst_above;

    #[test]
    fn only_capped_shares_below_the_burst_burst() {
        assert_eq!(burst_above(30, Some(80)), Some(80));
        assert_eq!(burst_above(30, Some(100)), Some(100));
        assert_eq!(burst_above(30, Some(30)), None, "no higher than the share");
        assert_eq!(burst_above(50, Some(20)), None, "below the share");
        assert_eq!(burst_above(0, Some(80)), None, "uncapped");
        assert_eq!(burst_above(100, Some(100)), None, "exclusive");
        assert_eq!(burst_above(30, None), None);
    }
}
