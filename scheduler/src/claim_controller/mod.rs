//! The Elastic GPU claim controller: binds each `ElasticGPUClaim` of a
//! class vgpu provisions to an `ElasticGPU` it creates, and reclaims that
//! object when the claim goes. It runs on kube-runtime's `Controller`.
//!
//! - A claim whose class cannot be found, whose request cannot be read, or
//!   whose share no GPU of the cluster could hold stays `Pending` with a
//!   `Ready: False` condition saying why ([`standing::Standing`]).
//! - Binding mode (the class's `egpuBindingMode`, kept in v1alpha1 as
//!   [`BINDING_MODE_ANNOTATION`]): `Immediate` (default) provisions when the
//!   claim is created: the slice is placed as a pod holding it would be and
//!   held from then on ([`crate::cache::reservations`]); a claim no node
//!   has room for stays `Pending` (`NoCapacity`) and is tried again when
//!   the cluster changes. `WaitForFirstConsumer` provisions when the first
//!   pod holding it is placed, taking that pod's slice. Either way, the
//!   slice stays held for the claim between its pods, and its pods run on
//!   it.
//! - The claim carries the finalizer [`FINALIZER`] (kube-runtime's
//!   finalizer helper); when it is deleted the class's reclaim policy
//!   decides: `Delete` (default) deletes the ElasticGPU, `Retain` leaves it
//!   `Released`.
//!
//! It acts only on the replica that leads, and writes only what differs.
//! A claim is reconciled when it changes; every claim is, when this
//! replica starts to lead, when a class changes, and when the extender's
//! view of the cluster changes while a claim waits for it (room on a GPU,
//! a first consumer, its class, its slice gone), at most every 5 s then
//! ([`triggers`]).

mod provision;
mod reconcile;
mod standing;
mod triggers;

use crate::api::KubeApi;
use crate::extender::Scheduler;
use futures_util::StreamExt;
use kube::runtime::controller::{Controller, Error as ControllerError};
use kube::runtime::watcher;
use reconcile::{error_policy, reconcile, Context};
use std::sync::Arc;

#[cfg(doc)]
use crate::vocabulary::elastic::{BINDING_MODE_ANNOTATION, FINALIZER};

/// Runs until the process ends.
pub async fn run(api: KubeApi, scheduler: Arc<Scheduler>) {
    let controller = Controller::new(api.elastic_claims_all(), watcher::Config::default());
    let sweeps = triggers::sweeps(controller.store(), api.elastic_classes(), scheduler.clone());
    let outcomes = controller.reconcile_all_on(sweeps).run(
        reconcile,
        error_policy,
        Arc::new(Context { api, scheduler }),
    );
    outcomes
        .for_each(|outcome| async move {
            match outcome {
                Ok(_) => {}
                Err(ControllerError::ReconcilerFailed(error, claim)) => tracing::warn!(
                    error = &error as &dyn std::error::Error,
                    claim = %claim,
                    "reconciling an ElasticGPUClaim (tried again after a pause, or at its next change)"
                ),
                // No definitions installed, or no access: nothing to do
                // (the watches keep trying, so definitions installed later
                // are picked up).
                Err(error) => tracing::debug!(
                    error = &error as &dyn std::error::Error,
                    "the ElasticGPUClaim controller"
                ),
            }
        })
        .await;
}
