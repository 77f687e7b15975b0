//! One claim brought where it should be: the reconciler the controller
//! runs, with kube-runtime's finalizer helper between provisioning and
//! reclaiming.

use crate::api::{ApiError, ClaimPart, KubeApi};
use crate::claim_controller::provision::{
    mark_bound, placed_holder, reclaim, unsatisfiable, write_elastic_gpu,
};
use crate::claim_controller::standing::{set_standing, Standing};
use crate::extender::Scheduler;
use crate::vocabulary::claims::{claim_key, claim_share, PROVISIONER};
use crate::vocabulary::elastic::{
    ElasticGpuClaim, ElasticGpuClass, BINDING_MODE_ANNOTATION, FINALIZER, RECLAIM_POLICY_ANNOTATION,
};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{finalizer, Error as FinalizerError, Event};
use kube::ResourceExt;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// How long a claim whose reconciliation failed waits before the next try
/// (unless it changes first).
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(5);

/// What the reconciler works with.
pub struct Context {
    pub api: KubeApi,
    pub scheduler: Arc<Scheduler>,
}

/// Why a claim could not be brought where it should be (it is tried
/// again).
#[derive(Debug, Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Api(#[from] ApiError),
    /// Provisioning or reclaiming failed, or the finalizer could not be
    /// added or removed.
    #[error(transparent)]
    Finalizer(Box<FinalizerError<ReconcileError>>),
}

/// The controller's answer to a failed reconciliation: try again after a
/// pause.
pub fn error_policy(
    _claim: Arc<ElasticGpuClaim>,
    _error: &ReconcileError,
    _context: Arc<Context>,
) -> Action {
    Action::requeue(RETRY_AFTER_FAILURE)
}

/// Brings one claim where it should be.
pub async fn reconcile(
    claim: Arc<ElasticGpuClaim>,
    context: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let Context { api, scheduler } = &*context;
    if !scheduler.leads() {
        // Every claim is looked at again when this replica leads.
        return Ok(Action::await_change());
    }
    let ours = claim.finalizers().iter().any(|f| f == FINALIZER);
    let deleting = claim.metadata.deletion_timestamp.is_some();
    let class = match claim.class_name() {
        None => None,
        Some(name) => match api.get_elastic_class(name).await {
            Ok(class) => Some(class),
            Err(ApiError::NotFound(_)) => None,
            Err(error) => return Err(error.into()),
        },
    };
    if class
        .as_ref()
        .is_some_and(|c| c.provisioner() != PROVISIONER)
        && !ours
    {
        return Ok(Action::await_change()); // another provisioner's claim
    }
    if !deleting {
        if let Err(why) = claim.spec.read() {
            let why = format!("its spec does not have the published shape: {why}");
            set_standing(api, &claim, Standing::InvalidObject, &why).await?;
            return Ok(Action::await_change());
        }
        if class.is_none() {
            let why = match claim.class_name() {
                None => "the claim names no ElasticGPUClass".to_string(),
                Some(name) => format!("ElasticGPUClass {name} does not exist"),
            };
            set_standing(api, &claim, Standing::ClassNotFound, &why).await?;
            return Ok(Action::await_change());
        }
    }
    let claims = api.elastic_claims(&claim.namespace().unwrap_or_default());
    // Adds the finalizer first (that change brings the claim back here),
    // and removes it only once the claim's ElasticGPU is reclaimed.
    finalizer(&claims, FINALIZER, claim, |event| async {
        match event {
            Event::Apply(claim) => provision(&context, &claim, class.as_ref()).await,
            Event::Cleanup(claim) => release(&context, &claim, class.as_ref()).await,
        }
    })
    .await
    .map_err(|error| ReconcileError::Finalizer(Box::new(error)))
}

/// Binds a claim carrying the finalizer to its ElasticGPU, provisioning
/// the slice when none is held for it.
async fn provision(
    context: &Context,
    claim: &ElasticGpuClaim,
    class: Option<&ElasticGpuClass>,
) -> Result<Action, ReconcileError> {
    let Context { api, scheduler } = context;
    let namespace = claim.namespace().unwrap_or_default();
    let name = claim.name_any();
    let key = claim_key(&namespace, &name);
    let spec = match claim.spec.read() {
        Ok(spec) => spec,
        Err(why) => {
            let why = format!("its spec does not have the published shape: {why}");
            set_standing(api, claim, Standing::InvalidObject, &why).await?;
            return Ok(Action::await_change());
        }
    };
    let share = match claim_share(&name, spec) {
        Ok(share) => share,
        Err(error) => {
            set_standing(api, claim, Standing::InvalidRequest, &error.to_string()).await?;
            return Ok(Action::await_change());
        }
    };
    if let Some(why) = unsatisfiable(scheduler, &share) {
        set_standing(api, claim, Standing::Unsatisfiable, &why).await?;
        return Ok(Action::await_change());
    }
    let egpu_name = claim.elastic_gpu_name().map_or_else(
        || format!("egpu-{}", claim.uid().unwrap_or_default()),
        str::to_string,
    );
    let held = scheduler.state().read().reservation_of(&key).is_some();
    if !held {
        let mode = class.map_or("Immediate", |c| {
            c.setting(BINDING_MODE_ANNOTATION, "Immediate")
        });
        let written = if mode == "WaitForFirstConsumer" {
            match placed_holder(api, &namespace, &name).await? {
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
                None if claim.phase() == Some("Bound") => false,
                None => {
                    let why = "provisioned when the first pod holding the claim is placed";
                    set_standing(api, claim, Standing::WaitingForFirstConsumer, why).await?;
                    return Ok(Action::await_change());
                }
            }
        } else {
            let egpu = egpu_name.as_str();
            let share = &share;
            let placed = scheduler
                .place_slice(&key, share, |decision| async move {
                    write_elastic_gpu(api, egpu, claim, share, &decision).await
                })
                .await?;
            if let Err(why) = placed {
                let why = format!("no GPU slice can be provisioned for it: {why}");
                set_standing(api, claim, Standing::NoCapacity, &why).await?;
                return Ok(Action::await_change());
            }
            true
        };
        if written {
            mark_bound(api, &egpu_name, &key).await?;
        }
    }
    if claim.elastic_gpu_name() != Some(egpu_name.as_str()) {
        let named = json!({ "spec": { "elasticGPUName": egpu_name } });
        api.patch_elastic_claim(&namespace, &name, ClaimPart::Object, &named)
            .await?;
    }
    let message = format!("bound to ElasticGPU {egpu_name}");
    set_standing(api, claim, Standing::Provisioned, &message).await?;
    Ok(Action::await_change())
}

/// Reclaims the ElasticGPU of a deleted claim as its class's policy says
/// (`Delete` when the class is gone).
async fn release(
    context: &Context,
    claim: &ElasticGpuClaim,
    class: Option<&ElasticGpuClass>,
) -> Result<Action, ReconcileError> {
    let Context { api, scheduler } = context;
    let key = claim_key(&claim.namespace().unwrap_or_default(), &claim.name_any());
    // The name it records; else (its spec unreadable) the one whose slice
    // is held for it; else the one it would have been given.
    let egpu_name = match claim.elastic_gpu_name() {
        Some(name) => name.to_string(),
        None => scheduler
            .state()
            .read()
            .reservation_of(&key)
            .map(|held| held.elastic_gpu.clone())
            .unwrap_or_else(|| format!("egpu-{}", claim.uid().unwrap_or_default())),
    };
    let policy = class.map_or("Delete", |c| c.setting(RECLAIM_POLICY_ANNOTATION, "Delete"));
    reclaim(api, &egpu_name, policy, &key).await?;
    Ok(Action::await_change())
}
