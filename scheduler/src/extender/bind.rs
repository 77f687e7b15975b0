//! `POST /bind`: where the choice becomes real, and where conflicting
//! choices are ruled out by construction. Only pods that ask for vGPUs are
//! bound; any other is refused before anything is written.
//!
//! 1. One in-process lock per node is held across check, record and bind,
//!    so two binds to one node never interleave (and one per namespace
//!    whose quota limits vGPU resources, taken first).
//! 2. Under it, the bind waits (up to `--bind-wait-ms`) until the node has
//!    no *pending* pod (decided, not yet fully allocated by the device
//!    plugin), then places the pod on the node's GPUs as they are now
//!    ([`crate::placement::on_node`]).
//! 3. The decision is written to the pod with its `resourceVersion` as a
//!    precondition, and applied to the state at once, before the lock is
//!    released: the next bind on the node sees this pod pending.
//! 4. Only then is the pod bound, after the locks are released: the next
//!    bind on the node already counts this pod's decision, so binding it
//!    needs no lock (two binds of one pod never run at once, see below). If
//!    binding fails, the decision is removed again (with the new
//!    `resourceVersion` as precondition, so a pod that was bound after all
//!    keeps it).
//!
//! A second bind of a pod while one runs is refused: two binds of one pod
//! to two nodes would each decide under its own node's lock.
//!
//! The node locks are in memory: of several replicas, only the one holding
//! the extender's Lease serves the verbs ([`crate::leader`]).

use crate::api::{ApiError, KubeApi};
use crate::cache::clock::now_unix_ms;
use crate::extender::reply::Reply;
use crate::extender::scheduler::{NotServing, Scheduler};
use crate::extender::wire::{ExtenderBindingArgs, ExtenderBindingResult};
use crate::placement::on_node::{place_on_node, NodeRefusal, OnNode};
use crate::placement::rules::PodRequestError;
use crate::placement::snapshot::Snapshot;
use crate::vocabulary::claims::claim_keys_held;
use k8s_openapi::api::core::v1::Pod;
use std::sync::atomic::{AtomicUsize, Ordering};
use thiserror::Error;
use vgpu_cluster::decision::{Decision, DECISION_ANNOTATION};
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

        let mut pod = self.fetch(api, args).await?;
        let request = self.rules.parse(&pod)?;
        // The extender's binding rights are for the pods it places: a pod
        // that names no vGPU resource (nor, through the webhook, an Elastic
        // GPU claim or KubeShare labels, which become vGPU resources) is
        // not sent here by a kube-scheduler configured with
        // managedResources, so a request to bind one comes from someone
        // else, and would bind any pending pod to any node. One that names
        // them at zero (`nvidia.com/gpu: 0`, as charts render a CPU-only
        // variant) is sent here and bound, with no decision.
        let named = self.rules.names_a_resource(&pod);
        if request.is_empty() && !named {
            return Err(BindError::NotOurs { pod: key });
        }
        if let Some(bound) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
            return if bound == node.as_str() {
                Ok(" (it already was)".to_string())
            } else {
                Err(BindError::AlreadyBound {
                    pod: key,
                    node: bound.to_string(),
                })
            };
        }
        if request.is_empty() {
            if !self.state.read().node(node).is_some_and(|n| n.in_api) {
                return Err(BindError::UnknownNode(node.clone()));
            }
            api.bind(namespace, name, &args.pod_uid, node)
                .await
                .map_err(|source| BindError::Bind {
                    pod: key,
                    node: node.clone(),
                    source,
                })?;
            return Ok(" (no GPUs)".to_string());
        }

        // Check, record and bind under the node's lock.
        if !self.state.read().node(node).is_some_and(|n| n.in_api) {
            return Err(BindError::UnknownNode(node.clone()));
        }
        let wait_ms = self.config.bind_wait.as_millis();
        // Binds of pods holding claims go one at a time, so two pods
        // holding the same claim cannot both be placed (the webhook's check
        // at creation can be raced); taken before the node's lock, always.
        let claims_guard = if claim_keys_held(&pod).is_empty() {
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
                        namespace: namespace.clone(),
                        wait_ms,
                    })?,
            ),
            None => None,
        };
        let lock = self.node_lock(node);
        let node_guard = tokio::time::timeout_at(deadline, lock.lock())
            .await
            .map_err(|_| BindError::NodeBusy {
                node: node.clone(),
                wait_ms,
            })?;
        let mut request = request;
        let mut attempt = 0;
        let written = loop {
            attempt += 1;
            let decision = self.wait_and_place(&pod, node, &request, deadline).await?;
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
                        return Err(BindError::BoundMeanwhile { pod: key });
                    }
                    request = self.rules.parse(&pod)?;
                    if request.is_empty() {
                        // It no longer asks for a vGPU: no decision to
                        // record, and not this bind's to finish.
                        return Err(BindError::NotOurs { pod: key });
                    }
                }
                Err(source) => return Err(BindError::RecordDecision { pod: key, source }),
            }
        };
        self.state.update(|s| s.apply_written_pod(&written));
        // The next bind on the node (of the namespace, of a claim) now
        // counts this decision: the binding itself needs no lock.
        drop(node_guard);
        drop(quota_guard);
        drop(claims_guard);
        let uid = written.metadata.uid.clone().unwrap_or_default();
        match api.bind(namespace, name, &uid, node).await {
            Ok(()) => {
                self.state.update(|s| s.mark_bound(&uid, node));
                Ok(summarize(&written))
            }
            Err(source) => {
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
                Err(BindError::Bind {
                    pod: key,
                    node: node.clone(),
                    source,
                })
            }
        }
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
