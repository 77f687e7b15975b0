//! `POST /bind`: where the choice becomes real, and where conflicting
//! choices are ruled out by construction. Only pods that ask for vGPUs are
//! bound; any other is refused before anything is written.
//!
//! 1. One in-process lock per node is held while the pod is placed, so two
//!    binds to one node never decide at once (and one per namespace whose
//!    quota limits vGPU resources, taken first).
//! 2. Under it, the bind waits (up to `--bind-wait-ms`) until the node has
//!    no *pending* pod (decided, not yet fully allocated by the device
//!    plugin) unless the node's plugin tells several pending pods apart,
//!    then places the pod on the node's GPUs as they are now
//!    ([`crate::placement::on_node`]).
//! 3. The decision is counted in the state before the lock is released:
//!    the next bind on the node sees this pod pending.
//! 4. Then, with no lock held, one call binds the pod and writes its
//!    decision: the API server merges a Binding's annotations into the
//!    pod, under the pod's UID and `resourceVersion` as read: the copy the
//!    filter call for it sent ([`crate::extender::filtered_pods`]), else
//!    the API server's (a pod changed since is refused, read again and
//!    decided again from what it now is). No pod is
//!    ever bound without its decision, nor carries a decision it was not
//!    bound with. If the binding was refused, the count is taken back; if
//!    its answer was lost, the pod is read back to tell.
//!
//! A second bind of a pod while one runs is refused: two binds of one pod
//! to two nodes would each decide under its own node's lock.
//!
//! The node locks are in memory: of several replicas, only the one holding
//! the extender's Lease serves the verbs ([`crate::leader`]).

use crate::api::{ApiError, KubeApi, PodVersion};
use crate::cache::clock::now_unix_ms;
use crate::cache::pods::version_of;
use crate::extender::reply::Reply;
use crate::extender::scheduler::{NotServing, Scheduler, UnconfinedPod};
use crate::extender::wire::{ExtenderBindingArgs, ExtenderBindingResult};
use crate::placement::on_node::{place_on_node, NodeRefusal, OnNode};
use crate::placement::rules::PodRequestError;
use crate::placement::snapshot::Snapshot;
use crate::vocabulary::claims::claim_keys_held;
use k8s_openapi::api::core::v1::Pod;
use std::sync::atomic::{AtomicUsize, Ordering};
use thiserror::Error;
use vgpu_cluster::decision::{Decision, ALLOCATED_ANNOTATION, DECISION_ANNOTATION};
use vgpu_cluster::report::with_causes;
use vgpu_cluster::requests::PodRequest;

/// Why a pod was not bound (kube-scheduler shows it and retries).
#[derive(Debug, Error)]
pub enum BindError {
    #[error("ExtenderBindingArgs needs PodName, PodNamespace and Node")]
    MissingArgs,
    #[error(transparent)]
    NotServing(#[from] NotServing),
    #[error("vgpu-scheduler runs without a Kubernetes API and cannot bind")]
    NoApi,
    #[error("reading pod {pod} failed")]
    ReadPod {
        pod: String,
        #[source]
        source: ApiError,
    },
    #[error("pod {pod} now has UID {uid}, not {expected} (it was recreated)")]
    Recreated {
        pod: String,
        uid: String,
        expected: String,
    },
    #[error(transparent)]
    Request(#[from] PodRequestError),
    #[error(
        "pod {pod} asks for no vGPU resource: vgpu-scheduler binds only the pods it places on GPUs \
         (kube-scheduler sends it only those that ask for its managedResources)"
    )]
    NotOurs { pod: String },
    #[error("pod {pod} is already bound to node {node}")]
    AlreadyBound { pod: String, node: String },
    #[error("binding pod {pod} to node {node} failed")]
    Bind {
        pod: String,
        node: String,
        #[source]
        source: ApiError,
    },
    #[error(
        "vgpu-scheduler does not know node {0} (it is not in its watch of the Kubernetes API)"
    )]
    UnknownNode(String),
    #[error("other pods holding Elastic GPU claims are being bound for more than {wait_ms} ms; kube-scheduler will retry")]
    ClaimsBusy { wait_ms: u128 },
    #[error("node {node} is busy with other binds for more than {wait_ms} ms; kube-scheduler will retry")]
    NodeBusy { node: String, wait_ms: u128 },
    #[error("other pods of namespace {namespace}, whose quota limits vGPU resources, are being bound for more than {wait_ms} ms; kube-scheduler will retry")]
    NamespaceBusy { namespace: String, wait_ms: u128 },
    #[error(transparent)]
    Refused(#[from] NodeRefusal),
    #[error(transparent)]
    Unconfined(#[from] UnconfinedPod),
    #[error(
        "node {node} is still admitting {pending} (its device plugin has not allocated all its GPUs yet; \
         vGPU pods are admitted one per node at a time); kube-scheduler will retry"
    )]
    StillAdmitting { node: String, pending: String },
    #[error("pod {pod} is being bound by another request; kube-scheduler will retry")]
    BindingMeanwhile { pod: String },
    #[error("pod {pod} was bound by someone else meanwhile")]
    BoundMeanwhile { pod: String },
    #[error("recording the decision on pod {pod} failed")]
    RecordDecision {
        pod: String,
        #[source]
        source: ApiError,
    },
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

impl Scheduler {
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
        match self.bind_pod(args).await {
            Ok(summary) => {
                tracing::info!("bound {key} to {}{summary}", args.node);
                ExtenderBindingResult::default()
            }
            Err(error) => {
                let error = with_causes(&error);
                tracing::info!(error = %error, "bind {key} to {}", args.node);
                ExtenderBindingResult { error }
            }
        }
    }

    /// Binds the pod; answers a summary of its decision for the log.
    async fn bind_pod(&self, args: &ExtenderBindingArgs) -> Result<String, BindError> {
        let (namespace, name, node) = (&args.pod_namespace, &args.pod_name, &args.node);
        if name.is_empty() || namespace.is_empty() || node.is_empty() {
            return Err(BindError::MissingArgs);
        }
        self.check_leading()?;
        let api = self.api.as_ref().ok_or(BindError::NoApi)?;
        let key = format!("{namespace}/{name}");
        let _binding = self
            .start_binding(&key)
            .ok_or_else(|| BindError::BindingMeanwhile { pod: key.clone() })?;
        let deadline = tokio::time::Instant::now() + self.config.bind_wait;

        // The pod as filter saw it, else as the API server has it.
        let mut pod = match self.filtered_pods.take(namespace, name, &args.pod_uid) {
            Some(pod) => pod,
            None => self.fetch(api, args).await?,
        };
        let mut attempt = 1;
        loop {
            let request = self.rules.parse(&pod)?;
            let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
            if attempt > 1 {
                // The pod changed since it was read, so it was read again.
                if bound.is_some() {
                    return Err(BindError::BoundMeanwhile { pod: key });
                }
                if request.is_empty() {
                    // It no longer asks for a vGPU: no decision to record,
                    // and not this bind's to finish.
                    return Err(BindError::NotOurs { pod: key });
                }
            }
            // The extender's binding rights are for the pods it places: a
            // pod that names no vGPU resource (nor, through the webhook, an
            // Elastic GPU claim or KubeShare labels, which become vGPU
            // resources) is not sent here by a kube-scheduler configured
            // with managedResources, so a request to bind one comes from
            // someone else, and would bind any pending pod to any node. One
            // that names them at zero (`nvidia.com/gpu: 0`, as charts render
            // a CPU-only variant) is sent here and bound, with no decision.
            if request.is_empty() && !self.rules.names_a_resource(&pod) {
                return Err(BindError::NotOurs { pod: key });
            }
            if let Some(bound) = bound {
                return if bound == node.as_str() {
                    Ok(" (it already was)".to_string())
                } else {
                    Err(BindError::AlreadyBound {
                        pod: key,
                        node: bound.to_string(),
                    })
                };
            }
            if !self.state.read().node(node).is_some_and(|n| n.in_api) {
                return Err(BindError::UnknownNode(node.clone()));
            }
            if !request.is_empty() {
                if let Some(refusal) = self.confinement_refusal(&pod) {
                    return Err(refusal.into());
                }
            }
            if request.is_empty() {
                api.bind(namespace, name, &args.pod_uid, node)
                    .await
                    .map_err(|source| BindError::Bind {
                        pod: key,
                        node: node.clone(),
                        source,
                    })?;
                return Ok(" (no GPUs)".to_string());
            }
            let outcome = match self.clear_earlier_records(api, pod).await {
                Ok(cleared) => {
                    self.decide_and_bind(api, &cleared, node, &request, deadline)
                        .await
                }
                Err(error) => Err(error),
            };
            match outcome {
                Err(error) if changed_meanwhile(&error) && attempt < 3 => {
                    // Its annotations may now choose other GPUs: decide
                    // again from the pod as it is.
                    attempt += 1;
                    pod = self.fetch(api, args).await?;
                }
                outcome => return outcome,
            }
        }
    }

    /// The pod without vgpu's records of an earlier grant (a decision
    /// whose binding failed, written by an older version of the extender
    /// or by hand): a Binding can add annotations, not remove them.
    async fn clear_earlier_records(&self, api: &KubeApi, pod: Pod) -> Result<Pod, BindError> {
        let carries = pod.metadata.annotations.as_ref().is_some_and(|a| {
            a.contains_key(DECISION_ANNOTATION) || a.contains_key(ALLOCATED_ANNOTATION)
        });
        if !carries {
            return Ok(pod);
        }
        let meta = &pod.metadata;
        let (namespace, name) = (
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default(),
        );
        let version = meta.resource_version.as_deref().unwrap_or_default();
        let cleared = api
            .clear_records(namespace, name, version)
            .await
            .map_err(|source| BindError::RecordDecision {
                pod: format!("{namespace}/{name}"),
                source,
            })?;
        self.state.update(|s| s.apply_written_pod(&cleared));
        Ok(cleared)
    }

    /// Under the node's lock (and the namespace's and claims' where they
    /// apply): places the pod and counts its decision in the state. Then,
    /// with the locks released, binds it and writes the decision in one
    /// call; the count is taken back if that did not happen.
    async fn decide_and_bind(
        &self,
        api: &KubeApi,
        pod: &Pod,
        node: &str,
        request: &PodRequest,
        deadline: tokio::time::Instant,
    ) -> Result<String, BindError> {
        let meta = &pod.metadata;
        let namespace = meta.namespace.as_deref().unwrap_or_default();
        let name = meta.name.as_deref().unwrap_or_default();
        let key = format!("{namespace}/{name}");
        let wait_ms = self.config.bind_wait.as_millis();
        // Binds of pods holding claims go one at a time, so two pods
        // holding the same claim cannot both be placed (the webhook's check
        // at creation can be raced); taken before the node's lock, always.
        let claims_guard = if claim_keys_held(pod).is_empty() {
            None
        } else {
            Some(
                tokio::time::timeout_at(deadline, self.claims_lock.lock())
                    .await
                    .map_err(|_| BindError::ClaimsBusy { wait_ms })?,
            )
        };
        // Binds of a namespace whose quota limits vGPU resources go one at
        // a time, so two pods on two nodes cannot both take its last room;
        // taken before the node's lock, always.
        let quota_lock = self
            .state
            .read()
            .quotas()
            .limits_namespace(namespace)
            .then(|| self.namespace_lock(namespace));
        let quota_guard = match &quota_lock {
            Some(lock) => Some(
                tokio::time::timeout_at(deadline, lock.lock())
                    .await
                    .map_err(|_| BindError::NamespaceBusy {
                        namespace: namespace.to_string(),
                        wait_ms,
                    })?,
            ),
            None => None,
        };
        let lock = self.node_lock(node);
        let node_guard = tokio::time::timeout_at(deadline, lock.lock())
            .await
            .map_err(|_| BindError::NodeBusy {
                node: node.to_string(),
                wait_ms,
            })?;
        let decision = self.wait_and_place(pod, node, request, deadline).await?;
        // The lead may have passed while this bind waited.
        self.check_leading()?;
        let decision_json = decision.to_json();
        let decided = as_bound(pod, node, &decision_json);
        self.state.update(|s| s.count_binding(&decided));
        // The next bind on the node (of the namespace, of a claim) now
        // counts this decision: the binding needs no lock.
        drop(node_guard);
        drop(quota_guard);
        drop(claims_guard);

        let read = PodVersion {
            uid: meta.uid.as_deref().unwrap_or_default(),
            resource_version: meta.resource_version.as_deref().unwrap_or_default(),
        };
        let Err(source) = api
            .bind_with_decision(namespace, name, &read, node, &decision_json)
            .await
        else {
            self.tell_lowered_priorities(api, &decided, request).await;
            return Ok(summarize(&decided));
        };
        let error = |source| BindError::Bind {
            pod: key.clone(),
            node: node.to_string(),
            source,
        };
        if refused_outright(&source) {
            self.forget(&decided);
            return Err(error(source));
        }
        // No answer or a server error, and the binding may have been
        // stored; or a conflict, which answers the client's own retry of
        // a binding stored under a lost answer as well as a pod changed
        // since it was read. The pod tells which.
        match api.get_pod(namespace, name).await {
            Ok(now) if now.metadata.uid == meta.uid && carries(&now, node, &decision_json) => {
                Ok(summarize(&decided))
            }
            Ok(_) => {
                self.forget(&decided);
                Err(error(source))
            }
            Err(read_error) => {
                // Still counted: the watch settles it (the binding's
                // version, or kube-scheduler's record of the failure).
                tracing::warn!(
                    error = &read_error as &dyn std::error::Error,
                    "pod {key}: binding it got no clear answer and reading it back failed; its decision stays counted until the watch shows the pod again"
                );
                Err(error(source))
            }
        }
    }

    /// Where the pod asked to run above the default priority and was
    /// granted the default: logs it and records a Warning Event on the pod
    /// (best effort: the pod is bound whatever becomes of the Event).
    async fn tell_lowered_priorities(&self, api: &KubeApi, pod: &Pod, request: &PodRequest) {
        let Some(message) = self.rules.lowered_priorities(request) else {
            return;
        };
        let key = crate::placement::rules::pod_key(pod);
        tracing::warn!("pod {key}: {message}");
        if let Err(error) = api
            .record_event(pod, "Warning", "GPUPriorityLowered", &message)
            .await
        {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "pod {key}: recording its GPUPriorityLowered Event failed"
            );
        }
    }

    /// Stops counting the decision of a binding that did not happen.
    fn forget(&self, decided: &Pod) {
        let uid = decided.metadata.uid.as_deref().unwrap_or_default();
        self.state
            .update(|s| s.forget_binding(uid, version_of(decided)));
    }

    async fn fetch(&self, api: &KubeApi, args: &ExtenderBindingArgs) -> Result<Pod, BindError> {
        let key = format!("{}/{}", args.pod_namespace, args.pod_name);
        let pod = api
            .get_pod(&args.pod_namespace, &args.pod_name)
            .await
            .map_err(|source| BindError::ReadPod {
                pod: key.clone(),
                source,
            })?;
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        if !args.pod_uid.is_empty() && uid != args.pod_uid {
            return Err(BindError::Recreated {
                pod: key,
                uid: uid.to_string(),
                expected: args.pod_uid.clone(),
            });
        }
        Ok(pod)
    }

    /// Waits until `node` has no pending pod, then places the pod on it.
    async fn wait_and_place(
        &self,
        pod: &Pod,
        node: &str,
        request: &PodRequest,
        deadline: tokio::time::Instant,
    ) -> Result<Decision, BindError> {
        let mut changes = self.state.subscribe();
        loop {
            changes.borrow_and_update();
            let outcome = {
                let state = self.state.read();
                let snapshot = Snapshot::new(&state, &self.rules, now_unix_ms());
                place_on_node(&snapshot, node, pod, request)?
            };
            match outcome {
                OnNode::Decided(decision) => return Ok(decision),
                OnNode::Waiting(pending) => {
                    if tokio::time::timeout_at(deadline, changes.changed())
                        .await
                        .is_err()
                    {
                        return Err(BindError::StillAdmitting {
                            node: node.to_string(),
                            pending: pending.join(", "),
                        });
                    }
                }
            }
        }
    }
}

/// `pod` as the binding will leave it: on `node`, with `decision`.
fn as_bound(pod: &Pod, node: &str, decision: &str) -> Pod {
    let mut decided = pod.clone();
    decided
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(DECISION_ANNOTATION.to_string(), decision.to_string());
    decided.spec.get_or_insert_with(Default::default).node_name = Some(node.to_string());
    decided
}

/// Whether `pod` is bound to `node` with `decision`.
fn carries(pod: &Pod, node: &str, decision: &str) -> bool {
    let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    let recorded = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(DECISION_ANNOTATION));
    bound == Some(node) && recorded.map(String::as_str) == Some(decision)
}

/// The API server refused the write as asked and nothing of it was
/// stored, as opposed to failing while it may have stored it. Not a
/// conflict: the Kubernetes client retries a write answered 503 (as by a
/// server stopping after it stored the write), and the retry of a stored
/// binding conflicts.
fn refused_outright(error: &ApiError) -> bool {
    match error {
        ApiError::NotFound(_) => true,
        ApiError::Refused { code, .. } => *code < 500,
        ApiError::Conflict(_) | ApiError::Client(_) | ApiError::Other(_) => false,
    }
}

/// The pod changed between the extender's read and its conditional write.
fn changed_meanwhile(error: &BindError) -> bool {
    matches!(
        error,
        BindError::Bind {
            source: ApiError::Conflict(_),
            ..
        } | BindError::RecordDecision {
            source: ApiError::Conflict(_),
            ..
        }
    )
}

/// `: main -> GPU-x (4096 MiB, 30%)` for the log.
fn summarize(pod: &Pod) -> String {
    let decision = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(DECISION_ANNOTATION))
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
