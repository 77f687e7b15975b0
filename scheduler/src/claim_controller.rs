//! The Elastic GPU claim controller: binds each `ElasticGPUClaim` of a
//! class vgpu provisions to an `ElasticGPU` it creates, and reclaims that
//! object when the claim goes.
//!
//! - A claim whose class cannot be found, whose request cannot be read, or
//!   whose share no GPU of the cluster could hold stays `Pending` with a
//!   `Ready: False` condition saying why.
//! - Binding mode (the class's `egpuBindingMode`, kept in v1alpha1 as
//!   [`BINDING_MODE_ANNOTATION`]): `Immediate` (default) provisions when the
//!   claim is created: the slice is placed as a pod holding it would be and
//!   held from then on ([`crate::cache::reservations`]); a claim no node has room
//!   for stays `Pending` (`NoCapacity`) and is tried again at each resync.
//!   `WaitForFirstConsumer` provisions when the first pod holding it is
//!   placed, taking that pod's slice. Either way, the slice stays held for
//!   the claim between its pods, and its pods run on it.
//! - The claim carries the finalizer [`FINALIZER`]; when it is deleted the
//!   class's reclaim policy decides: `Delete` (default) deletes the
//!   ElasticGPU, `Retain` leaves it `Released`.
//!
//! It acts only on the replica that leads, reconciles every claim on each
//! change the watch reports and every [`RESYNC`] (which also brings a new
//! leader, or one restarted, up to date), and writes only what differs.

use crate::api::{ApiError, ClaimPart, KubeApi};
use crate::cache::reservations::Reservation;
use crate::cache::state::ElasticSync;
use crate::extender::Scheduler;
use crate::vocabulary::claims::{
    claim_key, claim_share, claim_uses, claims_held, ClaimShare, CLAIM_CORE, CLAIM_MEMORY,
    PROVISIONER,
};
use crate::vocabulary::elastic::{
    BINDING_MODE_ANNOTATION, RECLAIM_POLICY_ANNOTATION, STORED_VERSION,
};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use vgpu_cluster::decision::{Decision, DECISION_ANNOTATION};

/// The finalizer through which a deleted claim is reclaimed.
pub const FINALIZER: &str = "vgpu.io/elasticgpu-reclaim";
/// How often every claim is reconciled even without a change.
pub const RESYNC: Duration = Duration::from_secs(5);

/// Runs until the process ends.
pub async fn run(api: KubeApi, scheduler: Arc<Scheduler>) {
    let mut changes = api.watch_elastic_claims().boxed();
    let mut resync = tokio::time::interval(RESYNC);
    loop {
        tokio::select! {
            change = changes.next() => match change {
                Some(Ok(claim)) => reconcile_if_leading(&api, &scheduler, &claim).await,
                Some(Err(error)) => tracing::debug!(error = %error, "watching ElasticGPUClaims"),
                None => changes = api.watch_elastic_claims().boxed(),
            },
            _ = resync.tick() => {
                // Nothing to list where the API has no Elastic GPU resources.
                let absent = scheduler.state().read().elastic_sync() == ElasticSync::Absent;
                if !scheduler.leads() || absent {
                    continue;
                }
                match api.list_elastic_claims().await {
                    Ok(claims) => {
                        for claim in &claims {
                            reconcile_if_leading(&api, &scheduler, claim).await;
                        }
                    }
                    // No CRDs installed, or no access: nothing to do.
                    Err(error) => tracing::debug!(error = %error, "listing ElasticGPUClaims"),
                }
            }
        }
    }
}

async fn reconcile_if_leading(api: &KubeApi, scheduler: &Scheduler, claim: &Value) {
    if !scheduler.leads() {
        return;
    }
    if let Err(error) = reconcile(api, scheduler, claim).await {
        tracing::warn!(
            error = &error as &dyn std::error::Error,
            claim = %key_of(claim),
            "reconciling an ElasticGPUClaim (tried again at the next change or resync)"
        );
    }
}

fn text<'a>(object: &'a Value, pointer: &str) -> &'a str {
    object
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
}

/// The claim's `namespace/name`.
fn key_of(claim: &Value) -> String {
    claim_key(
        text(claim, "/metadata/namespace"),
        text(claim, "/metadata/name"),
    )
}

/// Brings one claim where it should be.
pub async fn reconcile(
    api: &KubeApi,
    scheduler: &Scheduler,
    claim: &Value,
) -> Result<(), ApiError> {
    let namespace = text(claim, "/metadata/namespace");
    let name = text(claim, "/metadata/name");
    let uid = text(claim, "/metadata/uid");
    let deleting = claim.pointer("/metadata/deletionTimestamp").is_some();
    let finalizers: Vec<&str> = claim
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|list| list.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let ours = finalizers.contains(&FINALIZER);
    let class_name = text(claim, "/spec/elasticGPUClassName");
    let class = if class_name.is_empty() {
        None
    } else {
        match api.get_elastic_class(class_name).await {
            Ok(class) => Some(class),
            Err(ApiError::NotFound(_)) => None,
            Err(error) => return Err(error),
        }
    };
    let provisioner = class.as_ref().map(|c| text(c, "/provisioner"));
    if provisioner.is_some_and(|p| p != PROVISIONER) && !ours {
        return Ok(()); // another provisioner's claim
    }
    let class_setting = |key: &str, default: &'static str| -> String {
        class
            .as_ref()
            .and_then(|c| c.pointer("/metadata/annotations"))
            .and_then(|a| a.get(key))
            .and_then(Value::as_str)
            .unwrap_or(default)
            .to_string()
    };
    let egpu_name = match text(claim, "/spec/elasticGPUName") {
        "" => format!("egpu-{uid}"),
        given => given.to_string(),
    };

    if deleting {
        if ours {
            let policy = class_setting(RECLAIM_POLICY_ANNOTATION, "Delete");
            reclaim(api, &egpu_name, &policy, &key_of(claim)).await?;
            let rest: Vec<&str> = finalizers.into_iter().filter(|f| *f != FINALIZER).collect();
            api.patch_elastic_claim(
                namespace,
                name,
                ClaimPart::Object,
                &json!({"metadata": {"finalizers": rest, "resourceVersion": text(claim, "/metadata/resourceVersion")}}),
            )
            .await?;
        }
        return Ok(());
    }
    if class.is_none() {
        let why = if class_name.is_empty() {
            "the claim names no ElasticGPUClass".to_string()
        } else {
            format!("ElasticGPUClass {class_name} does not exist")
        };
        return set_status(api, claim, "Pending", false, "ClassNotFound", &why).await;
    }
    if !ours {
        let mut with: Vec<&str> = finalizers.clone();
        with.push(FINALIZER);
        api.patch_elastic_claim(
            namespace,
            name,
            ClaimPart::Object,
            &json!({"metadata": {"finalizers": with, "resourceVersion": text(claim, "/metadata/resourceVersion")}}),
        )
        .await?;
        // The patch is a change the watch reports: the rest follows then.
        return Ok(());
    }
    let share = match claim_share(name, claim) {
        Ok(share) => share,
        Err(error) => {
            return set_status(
                api,
                claim,
                "Pending",
                false,
                "InvalidRequest",
                &error.to_string(),
            )
            .await
        }
    };
    if let Some(why) = unsatisfiable(scheduler, &share) {
        return set_status(api, claim, "Pending", false, "Unsatisfiable", &why).await;
    }
    let key = key_of(claim);
    let held = scheduler.state().read().reservation_of(&key).is_some();
    if !held {
        let written = match class_setting(BINDING_MODE_ANNOTATION, "Immediate").as_str() {
            "WaitForFirstConsumer" => match placed_holder(api, namespace, name).await? {
                // The first pod's slice becomes the claim's: kept for the
                // next pod once this one is gone.
                Some(slice) => {
                    let object = write_elastic_gpu(api, &egpu_name, claim, &share, &slice).await?;
                    scheduler
                        .state()
                        .update(|s| s.apply_reservation(&object, true));
                    true
                }
                // Bound before slices were recorded: it stays so.
                None if text(claim, "/status/phase") == "Bound" => false,
                None => {
                    return set_status(
                        api,
                        claim,
                        "Pending",
                        false,
                        "WaitingForFirstConsumer",
                        "provisioned when the first pod holding the claim is placed",
                    )
                    .await
                }
            },
            _ => {
                let egpu = egpu_name.as_str();
                let placed = scheduler
                    .place_slice(&key, &share, |decision| async move {
                        write_elastic_gpu(api, egpu, claim, &share, &decision).await
                    })
                    .await?;
                if let Err(why) = placed {
                    let why = format!("no GPU slice can be provisioned for it: {why}");
                    return set_status(api, claim, "Pending", false, "NoCapacity", &why).await;
                }
                true
            }
        };
        if written {
            api.patch_elastic_gpu_status(
                &egpu_name,
                &json!({"status": {"phase": "Bound", "reason": "", "message": format!("bound to ElasticGPUClaim {key}")}}),
            )
            .await?;
        }
    }
    if text(claim, "/spec/elasticGPUName") != egpu_name {
        api.patch_elastic_claim(
            namespace,
            name,
            ClaimPart::Object,
            &json!({"spec": {"elasticGPUName": egpu_name}}),
        )
        .await?;
    }
    let message = format!("bound to ElasticGPU {egpu_name}");
    set_status(api, claim, "Bound", true, "Provisioned", &message).await
}

/// The slice the first placed pod of `namespace` holding `claim` was
/// given, if one was placed.
async fn placed_holder(
    api: &KubeApi,
    namespace: &str,
    claim: &str,
) -> Result<Option<Decision>, ApiError> {
    let pods = api.pods_in(namespace).await?;
    Ok(pods.iter().find_map(|pod| slice_of(pod, claim)))
}

/// The part of `pod`'s decision given to the container holding `claim`, if
/// the pod holds it and has been decided.
pub fn slice_of(pod: &k8s_openapi::api::core::v1::Pod, claim: &str) -> Option<Decision> {
    let container = claim_uses(pod)
        .ok()?
        .into_iter()
        .find(|claim_use| claim_use.claim == claim)?
        .container;
    if !claims_held(pod).contains(&claim) {
        return None;
    }
    let text = pod
        .metadata
        .annotations
        .as_ref()?
        .get(DECISION_ANNOTATION)?;
    let decision = Decision::parse(text).ok()?;
    let slice = Reservation::decision_for(&decision, Some(&container));
    (!slice.containers.is_empty()).then_some(slice)
}

/// Creates ElasticGPU `name` for `claim` holding `slice` (or, when it
/// exists, records the slice on it); answers it as written.
async fn write_elastic_gpu(
    api: &KubeApi,
    name: &str,
    claim: &Value,
    share: &ClaimShare,
    slice: &Decision,
) -> Result<Value, ApiError> {
    let object = elastic_gpu(name, claim, share, slice);
    match api.create_elastic_gpu(&object).await {
        Err(ApiError::Conflict(_)) => {
            let existing = api.get_elastic_gpu(name).await?;
            let mut patch = object;
            patch["metadata"]["resourceVersion"] =
                json!(text(&existing, "/metadata/resourceVersion"));
            api.patch_elastic_gpu(name, &patch).await
        }
        other => other,
    }
}

/// The ElasticGPU a claim is bound to, holding `slice`.
fn elastic_gpu(name: &str, claim: &Value, share: &ClaimShare, slice: &Decision) -> Value {
    let mut capacity = serde_json::Map::new();
    if let Some(cores) = share.cores {
        capacity.insert(CLAIM_CORE.into(), json!((share.count * cores).to_string()));
    }
    if let Some(mib) = share.memory_mib {
        capacity.insert(CLAIM_MEMORY.into(), json!(format!("{mib}Mi")));
    }
    let gpus: Vec<&str> = slice
        .containers
        .iter()
        .flat_map(|c| c.devices.iter().map(|d| d.uuid.as_str()))
        .collect();
    let mut spec = json!({
        "capacity": capacity,
        "claimRef": {
            "apiVersion": STORED_VERSION,
            "kind": "ElasticGPUClaim",
            "namespace": text(claim, "/metadata/namespace"),
            "name": text(claim, "/metadata/name"),
            "uid": text(claim, "/metadata/uid"),
        },
        "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [slice.node]}
        ]}]}},
    });
    // Published shapes: a share of one GPU, or whole GPUs.
    match gpus.as_slice() {
        [gpu] if share.count == 1 => spec["gpuShare"] = json!({"gpuName": gpu}),
        _ => spec["physicalGPU"] = json!({"gpuNames": gpus}),
    }
    json!({
        "apiVersion": STORED_VERSION,
        "kind": "ElasticGPU",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/managed-by": "vgpu"},
            "annotations": {DECISION_ANNOTATION: slice.to_json()},
        },
        "spec": spec,
    })
}

/// Why no GPU of the cluster could hold `share`, if none could.
fn unsatisfiable(scheduler: &Scheduler, share: &ClaimShare) -> Option<String> {
    let state = scheduler.state().read();
    if !state.synced() {
        return None;
    }
    let mut largest_mib = 0u64;
    let mut most_gpus = 0u64;
    for (_, node) in state.nodes() {
        let healthy = node.gpus.gpus.iter().filter(|g| g.healthy);
        most_gpus = most_gpus.max(healthy.clone().count() as u64);
        largest_mib = largest_mib.max(healthy.map(|g| g.offered_bytes() >> 20).max().unwrap_or(0));
    }
    if share.count > most_gpus {
        return Some(format!(
            "it asks for {} GPUs; no node has more than {most_gpus} healthy",
            share.count
        ));
    }
    match share.memory_mib {
        Some(mib) if mib > largest_mib => Some(format!(
            "it asks for {mib} MiB of one GPU; the largest GPU in the cluster has {largest_mib} MiB"
        )),
        _ => None,
    }
}

async fn reclaim(api: &KubeApi, egpu: &str, policy: &str, claim: &str) -> Result<(), ApiError> {
    let result = if policy == "Retain" {
        let message = format!("ElasticGPUClaim {claim} was deleted; kept (reclaim policy Retain)");
        api.patch_elastic_gpu_status(
            egpu,
            &json!({"status": {"phase": "Released", "reason": "ClaimDeleted", "message": message}}),
        )
        .await
    } else {
        api.delete_elastic_gpu(egpu).await
    };
    match result {
        Err(ApiError::NotFound(_)) => Ok(()),
        other => other,
    }
}

/// Writes the claim's phase and Ready condition, unless they are already so.
async fn set_status(
    api: &KubeApi,
    claim: &Value,
    phase: &str,
    ready: bool,
    reason: &str,
    message: &str,
) -> Result<(), ApiError> {
    let status = if ready { "True" } else { "False" };
    let current = claim
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|list| list.iter().find(|c| text(c, "/type") == "Ready"));
    let same = text(claim, "/status/phase") == phase
        && current.is_some_and(|c| {
            text(c, "/status") == status
                && text(c, "/reason") == reason
                && text(c, "/message") == message
        });
    if same {
        return Ok(());
    }
    if !ready {
        tracing::info!(claim = %key_of(claim), reason, "{message}");
    }
    let now =
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    api.patch_elastic_claim(
        text(claim, "/metadata/namespace"),
        text(claim, "/metadata/name"),
        ClaimPart::Status,
        &json!({"status": {"phase": phase, "conditions": [{
            "type": "Ready", "status": status, "reason": reason, "message": message,
            "lastTransitionTime": now,
        }]}}),
    )
    .await
}
