//! Answering a running pod's resize request (`vgpu.io/resize`,
//! [`vgpu_cluster::resize`]): the extender alone turns it into a new
//! decision, under the node's lock like a bind, so a resize and a bind on
//! one node never both take the same room.
//!
//! A request is applied when the pod asked for at least the new amounts
//! (its request bounds every decision, here as in the device plugin and
//! the node monitor) and the pod's GPUs have the room: the other pods'
//! grants plus the new one within what each GPU offers, compute within
//! 100 %, and a whole GPU (100 %) only where no other container is. Else
//! it is refused in words. Either way the answer goes in
//! `vgpu.io/resize-status`, written with the pod's `resourceVersion`, and in
//! an Event on the pod (`ResizeApplied`, or a Warning `ResizeRefused`); the
//! node monitor carries an applied one into the containers' regions.

use crate::api::{ApiError, KubeApi};
use crate::cache::clock::now_unix_ms;
use crate::cache::gpus::Usage;
use crate::extender::scheduler::Scheduler;
use k8s_openapi::api::core::v1::Pod;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use vgpu_cluster::decision::{Decision, DECISION_ANNOTATION};
use vgpu_cluster::report::with_causes;
use vgpu_cluster::requests::within_request;
use vgpu_cluster::resize::{unanswered, Outcome, ResizeRequest, ResizeStatus};

/// How often pending requests are looked for besides every change of the
/// cache: a request that met a busy node, or came while another replica
/// led, is answered this long after at the latest.
const RETRY_PERIOD: Duration = Duration::from_secs(5);

/// Why a request could not be answered now (it is tried again).
#[derive(Debug, Error)]
pub enum ResizeError {
    #[error("reading pod {pod}")]
    Read {
        pod: String,
        #[source]
        source: ApiError,
    },
    #[error("writing the answer to pod {pod}")]
    Write {
        pod: String,
        #[source]
        source: ApiError,
    },
    #[error("node {0} is busy with binds")]
    NodeBusy(String),
}

/// A pending request, as the cache shows it.
struct Pending {
    namespace: String,
    name: String,
    uid: String,
    node: String,
}

/// Runs until the runtime stops: answers every pending resize request
/// whenever the cache changes (and every [`RETRY_PERIOD`]), while this
/// replica leads.
pub async fn answer_resizes(scheduler: Arc<Scheduler>) {
    let mut changes = scheduler.state.subscribe();
    loop {
        if scheduler.check_leading().is_ok() {
            scheduler.answer_pending().await;
        }
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = tokio::time::sleep(RETRY_PERIOD) => {}
        }
    }
}

impl Scheduler {
    async fn answer_pending(&self) {
        let Some(api) = self.api.as_ref() else {
            return;
        };
        // Until the first complete lists are in (a restart), a node's GPUs
        // and their other pods may be missing: no answer is given on them.
        if !self.state.read().synced() {
            return;
        }
        let pending: Vec<Pending> = self
            .state
            .read()
            .pods()
            .filter(|pod| pod.resize_request.is_some())
            .filter_map(|pod| {
                Some(Pending {
                    namespace: pod.namespace.clone(),
                    name: pod.name.clone(),
                    uid: pod.uid.clone(),
                    node: pod.node_name.clone()?,
                })
            })
            .collect();
        for pod in pending {
            let key = format!("{}/{}", pod.namespace, pod.name);
            if let Err(error) = self.answer(api, &pod).await {
                tracing::info!(error = %with_causes(&error), "resize of {key}: tried again later");
            }
        }
    }

    /// Answers one pod's request under its node's lock.
    async fn answer(&self, api: &KubeApi, pending: &Pending) -> Result<(), ResizeError> {
        let key = format!("{}/{}", pending.namespace, pending.name);
        let lock = self.node_lock(&pending.node);
        let _guard = tokio::time::timeout(self.config.bind_wait, lock.lock())
            .await
            .map_err(|_| ResizeError::NodeBusy(pending.node.clone()))?;
        for _ in 0..3 {
            let pod = api
                .get_pod(&pending.namespace, &pending.name)
                .await
                .map_err(|source| ResizeError::Read {
                    pod: key.clone(),
                    source,
                })?;
            if pod.metadata.uid.as_deref() != Some(pending.uid.as_str()) {
                return Ok(());
            }
            let Some(text) = unanswered(pod.metadata.annotations.as_ref()).map(str::to_string)
            else {
                return Ok(());
            };
            let (decision, outcome, message) = match self.resized(&pod, &text) {
                Ok((decision, request)) => {
                    let message = format!("resized to {}", request.describe());
                    (Some(decision), Outcome::Applied, message)
                }
                Err(refusal) => (None, Outcome::Refused, refusal),
            };
            let status = ResizeStatus {
                request: text,
                outcome,
                message: message.clone(),
                answered_unix_ms: now_unix_ms(),
            };
            let version = pod.metadata.resource_version.clone().unwrap_or_default();
            self.check_leading()
                .map_err(|_| ResizeError::NodeBusy(pending.node.clone()))?;
            match api
                .write_resize(
                    &pending.namespace,
                    &pending.name,
                    &version,
                    decision.as_ref().map(Decision::to_json).as_deref(),
                    &status.to_json(),
                )
                .await
            {
                Ok(written) => {
                    self.state.update(|s| s.apply_written_pod(&written));
                    let (type_, reason) = match outcome {
                        Outcome::Applied => {
                            tracing::info!("pod {key}: {message}");
                            ("Normal", "ResizeApplied")
                        }
                        Outcome::Refused => {
                            tracing::info!("pod {key}: resize refused: {message}");
                            ("Warning", "ResizeRefused")
                        }
                    };
                    // The answer is in the status already: an Event that
                    // cannot be written is only logged.
                    if let Err(error) = api.record_event(&written, type_, reason, &message).await {
                        tracing::warn!(
                            error = &error as &dyn std::error::Error,
                            "pod {key}: the resize answer's Event was not recorded"
                        );
                    }
                    return Ok(());
                }
                // Changed since read (a new request, a status): read again.
                Err(ApiError::Conflict(_)) => continue,
                Err(source) => {
                    return Err(ResizeError::Write {
                        pod: key.clone(),
                        source,
                    })
                }
            }
        }
        Err(ResizeError::Write {
            pod: key,
            source: ApiError::Conflict("the pod changed under three answers in a row".into()),
        })
    }

    /// The pod's new decision for request `text`, or why there is none.
    fn resized(&self, pod: &Pod, text: &str) -> Result<(Decision, ResizeRequest), String> {
        let request = ResizeRequest::parse(text).map_err(|error| error.to_string())?;
        let annotations = pod.metadata.annotations.as_ref();
        let decision = annotations
            .and_then(|a| a.get(DECISION_ANNOTATION))
            .ok_or("the pod has no vGPU decision: only a placed vGPU pod is resized")?;
        let decision = Decision::parse(decision).map_err(|error| error.to_string())?;
        let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        if bound != Some(decision.node.as_str()) {
            return Err(
                "the pod is not bound to its decision's node yet: ask again once it runs".into(),
            );
        }
        let asked = self.rules.parse(pod).map_err(|error| error.to_string())?;
        let state = self.state.read();
        let node = state
            .node(&decision.node)
            .ok_or_else(|| format!("node {} is not known", decision.node))?;
        let offered = |uuid: &str| {
            node.gpus
                .gpus
                .iter()
                .find(|gpu| gpu.uuid == uuid)
                .map(|gpu| gpu.offered_bytes())
        };
        let resized = request.apply(&decision, now_unix_ms());
        if within_request(&resized, &asked, offered) != resized {
            return Err(format!(
                "{} is more than the pod asks for: a pod is resized within its resources' request",
                request.describe()
            ));
        }
        // What the pod's regular containers would hold on each GPU.
        let mut wanted: BTreeMap<&str, Usage> = BTreeMap::new();
        for container in resized.containers.iter().filter(|c| !c.init) {
            for grant in &container.devices {
                wanted
                    .entry(grant.uuid.as_str())
                    .or_default()
                    .add_grant(grant.memory_bytes, grant.cores_percent);
            }
        }
        let others = state.usage_without(node, &[pod.metadata.uid.as_deref().unwrap_or("")], &[]);
        for (uuid, want) in &wanted {
            let Some(index) = node.gpus.gpus.iter().position(|gpu| gpu.uuid == *uuid) else {
                return Err(format!(
                    "GPU {uuid} is no longer listed by node {}",
                    decision.node
                ));
            };
            let gpu = &node.gpus.gpus[index];
            let held = others.get(index).copied().unwrap_or_default();
            let free_memory = gpu.offered_bytes().saturating_sub(held.memory_bytes);
            if want.memory_bytes > free_memory {
                return Err(format!(
                    "GPU {uuid} has {} MiB free for this pod, {} MiB asked",
                    free_memory >> 20,
                    want.memory_bytes >> 20
                ));
            }
            if want.cores.saturating_add(held.cores) > 100 {
                return Err(format!(
                    "GPU {uuid} has {} % of its compute free for this pod, {} % asked",
                    100u32.saturating_sub(held.cores),
                    want.cores
                ));
            }
            if (want.exclusive && held.tasks > 0) || held.exclusive {
                return Err(format!(
                    "GPU {uuid}: 100 % takes a GPU alone, and {} other container(s) hold it",
                    held.tasks
                ));
            }
        }
        Ok((resized, request))
    }
}
