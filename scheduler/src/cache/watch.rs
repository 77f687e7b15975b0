//! The watches that feed the state: one generic watch per kind, each
//! handing its events to the kind's [`Book`] under the state's lock. A
//! complete, current list is taken on start and after any failure
//! (kube-runtime's watcher, retried with its backoff).

use crate::api::elastic_gpus;
use crate::cache::book::{Book, WatchRefusal};
use crate::cache::skipped_namespaces::skip_selector;
use crate::cache::state::{ClusterState, SharedState};
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ResourceQuota};
use kube::runtime::watcher::{self, Event, ListSemantic};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use std::sync::Arc;
use tokio::task::JoinHandle;
use vgpu_cluster::node_lease::{lease_selector, NODE_LEASE_NAMESPACE};

/// Starts the watches of pods, nodes, the device plugins' node Leases,
/// ElasticGPUs and ResourceQuotas, and, where placement checks
/// confinement (`skipped_namespaces`: those skipped whatever their
/// labels), of the namespaces labelled to be skipped by admission.
/// Placements wait for the ElasticGPUs', the quotas' and those
/// namespaces' first lists, unless the API refuses them to this extender.
pub fn watch_cluster(
    client: &Client,
    state: &Arc<SharedState>,
    skipped_namespaces: Option<&[String]>,
) -> Vec<JoinHandle<()>> {
    state.update(|s| {
        s.expect_reservations();
        s.expect_quotas();
        if let Some(named) = skipped_namespaces {
            s.expect_skipped_namespaces(named.iter().cloned());
        }
    });
    let leases = Api::<Lease>::namespaced(client.clone(), NODE_LEASE_NAMESPACE);
    let mut watches = Vec::with_capacity(6);
    if skipped_namespaces.is_some() {
        watches.push(tokio::spawn(watch(
            Api::<Namespace>::all(client.clone()),
            watcher::Config::default().labels(&skip_selector()),
            state.clone(),
        )));
    }
    watches.extend([
        tokio::spawn(watch(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default(),
            state.clone(),
        )),
        tokio::spawn(watch(
            Api::<Node>::all(client.clone()),
            watcher::Config::default(),
            state.clone(),
        )),
        tokio::spawn(watch(
            leases,
            watcher::Config::default().labels(&lease_selector()),
            state.clone(),
        )),
        tokio::spawn(watch(
            elastic_gpus(client.clone()),
            watcher::Config::default(),
            state.clone(),
        )),
        tokio::spawn(watch(
            Api::<ResourceQuota>::all(client.clone()),
            watcher::Config::default(),
            state.clone(),
        )),
    ]);
    watches
}

/// Lists and watches `api` forever, applying every event to the state. A
/// failure is logged once until the watch recovers (or fails otherwise).
pub async fn watch<K>(api: Api<K>, config: watcher::Config, state: Arc<SharedState>)
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    ClusterState: Book<K>,
{
    let what = <ClusterState as Book<K>>::KIND;
    let config = config.list_semantic(ListSemantic::MostRecent);
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    // While failing: the HTTP status of the failure last logged, if the
    // API server answered with one.
    let mut failing: Option<Option<u16>> = None;
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                // A relist starts with Init before anything is read.
                if failing.is_some() && !matches!(event, Event::Init) {
                    tracing::info!("Kubernetes API: {what} watch recovered");
                    failing = None;
                }
                state.update(|s| s.apply_event(event));
            }
            Err(error) => {
                let code = refusal_code(&error);
                let refusal = code.and_then(|code| state.update(|s| s.refused(code)));
                if failing != Some(code) {
                    match refusal {
                        Some(WatchRefusal::Info(meaning)) => tracing::info!("{meaning}"),
                        Some(WatchRefusal::Warn(meaning)) => tracing::warn!("{meaning}"),
                        None => tracing::warn!(
                            error = &error as &dyn std::error::Error,
                            "Kubernetes API: {what} watch failed (retrying)"
                        ),
                    }
                }
                failing = Some(code);
            }
        }
    }
}

/// The HTTP status the API server refused a watch with, if it did.
fn refusal_code(error: &watcher::Error) -> Option<u16> {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => Some(status.code),
        watcher::Error::WatchError(status) => Some(status.code),
        _ => None,
    }
}
