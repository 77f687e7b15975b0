//! What, besides a claim's own changes, brings claims back to the
//! reconciler: this replica starting to lead, a change of any class, and
//! a change of the cluster while a claim waits for one.

use crate::cache::state::{ClusterState, ElasticSync};
use crate::claim_controller::standing::Standing;
use crate::extender::Scheduler;
use crate::vocabulary::claims::claim_key;
use crate::vocabulary::elastic::{ElasticGpuClaim, ElasticGpuClass, FINALIZER};
use futures_util::stream::BoxStream;
use futures_util::{Stream, StreamExt};
use kube::runtime::reflector::Store;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// The least time between two sweeps for waiting claims: a busy cluster
/// changes many times a second, and each sweep reads every claim's class.
const SWEEP_GAP: Duration = Duration::from_secs(5);

/// Whether `claim` waits for the cluster to change: its class does not
/// exist (it may be created at any time, and watching classes takes a
/// permission the chart may not grant); or it carries the finalizer and
/// stands where room on a GPU or a pod placed would move it on; or it is
/// bound and the extender holds no slice for it although it knows the
/// ElasticGPUs (its ElasticGPU was deleted or released).
pub fn waits_for_the_cluster(claim: &ElasticGpuClaim, state: &ClusterState) -> bool {
    if claim.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let finalized = claim.finalizers().iter().any(|f| f == FINALIZER);
    match Standing::of(claim) {
        Some(Standing::ClassNotFound) => true,
        Some(standing) if standing.waits_for_the_cluster() => finalized,
        Some(Standing::Provisioned) if finalized => {
            let key = claim_key(&claim.namespace().unwrap_or_default(), &claim.name_any());
            state.elastic_sync() == ElasticSync::Known && state.reservation_of(&key).is_none()
        }
        _ => false,
    }
}

/// One event of the classes' watch.
type ClassEvent = Result<Event<ElasticGpuClass>, watcher::Error>;

/// What wakes a sweep.
struct Wakers {
    claims: Store<ElasticGpuClaim>,
    scheduler: Arc<Scheduler>,
    cache: watch::Receiver<u64>,
    terms: Option<watch::Receiver<u64>>,
    /// The classes' watch. Its failures (no definitions, no permission to
    /// watch) are retried with its own backoff: they must not hold up the
    /// controller's other triggers, as a failing watch given to the
    /// controller would (it pauses all of them after any failure).
    classes: BoxStream<'static, ClassEvent>,
    /// Whether the classes have been listed once (what the first list
    /// brings is no change).
    classes_listed: bool,
    /// Whether the classes' watch fails (logged once until it recovers).
    classes_failing: bool,
    last_sweep: Option<Instant>,
}

/// Completes when this replica starts to lead again; never without an
/// election (it always leads) or once the election is gone.
async fn next_term(terms: &mut Option<watch::Receiver<u64>>) {
    let started = match terms {
        Some(receiver) => receiver.changed().await.is_ok(),
        None => false,
    };
    if !started {
        std::future::pending::<()>().await;
    }
}

impl Wakers {
    fn some_claim_waits(&self) -> bool {
        if !self.scheduler.leads() {
            return false;
        }
        let state = self.scheduler.state().read();
        self.claims
            .state()
            .iter()
            .any(|claim| waits_for_the_cluster(claim, &state))
    }

    /// Whether a class event is a change to look at every claim for.
    fn class_changed(&mut self, event: Option<ClassEvent>) -> bool {
        match event {
            Some(Ok(Event::Apply(_) | Event::Delete(_))) => {
                self.classes_failing = false;
                true
            }
            // A list after a failure may bring changes the watch missed.
            Some(Ok(Event::InitDone)) => {
                self.classes_failing = false;
                let again = self.classes_listed;
                self.classes_listed = true;
                again
            }
            Some(Ok(Event::Init | Event::InitApply(_))) => false,
            Some(Err(error)) => {
                if !self.classes_failing {
                    tracing::debug!(
                        error = &error as &dyn std::error::Error,
                        "watching ElasticGPUClasses (claims naming a class that does not exist \
                         are looked at again when the cluster changes)"
                    );
                }
                self.classes_failing = true;
                false
            }
            // The watch never ends; should it, classes are heard of no more.
            None => {
                self.classes = futures_util::stream::pending().boxed();
                false
            }
        }
    }

    /// Waits for the next reason to look at every claim again.
    async fn next(&mut self) {
        loop {
            tokio::select! {
                _ = next_term(&mut self.terms) => return,
                event = self.classes.next() => {
                    if self.class_changed(event) && self.scheduler.leads() {
                        return;
                    }
                }
                changed = self.cache.changed() => {
                    if changed.is_err() {
                        // The cache is gone: the process is ending.
                        std::future::pending::<()>().await;
                    }
                    if !self.some_claim_waits() {
                        continue;
                    }
                    if let Some(last) = self.last_sweep {
                        tokio::time::sleep_until(last + SWEEP_GAP).await;
                    }
                    // Changes during the pause are taken in by this sweep.
                    self.cache.borrow_and_update();
                    if self.some_claim_waits() {
                        return;
                    }
                }
            }
        }
    }
}

/// Fires (for a reconciliation of every claim) when this replica starts to
/// lead, when a class changes, and when the extender's view of the
/// cluster changed while a claim waits for it (at most every
/// [`SWEEP_GAP`]).
pub fn sweeps(
    claims: Store<ElasticGpuClaim>,
    classes: Api<ElasticGpuClass>,
    scheduler: Arc<Scheduler>,
) -> impl Stream<Item = ()> + Send + 'static {
    let wakers = Wakers {
        cache: scheduler.state().subscribe(),
        terms: scheduler.leadership_terms(),
        classes: watcher::watcher(classes, watcher::Config::default())
            .default_backoff()
            .boxed(),
        classes_listed: false,
        classes_failing: false,
        claims,
        scheduler,
        last_sweep: None,
    };
    futures_util::stream::unfold(wakers, |mut wakers| async move {
        wakers.next().await;
        wakers.last_sweep = Some(Instant::now());
        Some(((), wakers))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::book::Book;
    use crate::cache::fixtures::elastic_gpu;
    use crate::vocabulary::elastic::ElasticGpu;
    use serde_json::json;

    fn claim(reason: &str, finalized: bool) -> ElasticGpuClaim {
        let finalizers: Vec<&str> = if finalized { vec![FINALIZER] } else { vec![] };
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "finalizers": finalizers},
            "spec": {"elasticGPUClassName": "gpushare"},
            "status": {"phase": "Pending", "conditions": [
                {"type": "Ready", "status": "False", "reason": reason}]},
        }))
        .expect("a claim")
    }

    #[test]
    fn claims_waiting_for_room_a_consumer_a_class_or_their_lost_slice_wait_for_the_cluster() {
        let mut state = ClusterState::new();
        state.expect_reservations();
        for reason in ["NoCapacity", "Unsatisfiable", "WaitingForFirstConsumer"] {
            assert!(
                waits_for_the_cluster(&claim(reason, true), &state),
                "{reason}"
            );
            assert!(
                !waits_for_the_cluster(&claim(reason, false), &state),
                "{reason} without the finalizer"
            );
        }
        for reason in ["InvalidRequest", "InvalidObject"] {
            assert!(
                !waits_for_the_cluster(&claim(reason, true), &state),
                "{reason}"
            );
        }
        // A class may be created at any time (no finalizer is added
        // before it exists).
        assert!(waits_for_the_cluster(
            &claim("ClassNotFound", false),
            &state
        ));
        let mut deleting = claim("NoCapacity", true);
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ));
        assert!(!waits_for_the_cluster(&deleting, &state));

        // Bound: it waits only when the ElasticGPUs are known and none
        // holds its slice.
        let bound = claim("Provisioned", true);
        assert!(
            !waits_for_the_cluster(&bound, &state),
            "ElasticGPUs not listed yet"
        );
        state.relist(vec![elastic_gpu("egpu-1", 5, "GPU-n1-0")]);
        assert!(
            !waits_for_the_cluster(&bound, &state),
            "its slice is held (ns/c)"
        );
        state.relist(Vec::<ElasticGpu>::new());
        assert!(waits_for_the_cluster(&bound, &state), "its slice is gone");
    }
}
