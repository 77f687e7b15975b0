//! Keeping the node's ResourceSlice current: written at start, again on
//! every health change and every change of the node's cordoned GPUs
//! ([`follow_cordon`]; a new pool generation each time), after claims are
//! prepared ([`PREPARED_ANNOTATION`]), and every resync period (repairs a
//! slice someone deleted). Written with server-side apply, so the driver
//! owns exactly the fields it sets.

use crate::driver::Driver;
use crate::slice::{resource_slice, slice_name, NodeFacts, NodeOwner};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_stream::StreamExt;
use vgpu_cluster::cordon::cordoned_gpus;

/// The field manager of the driver's writes.
pub const FIELD_MANAGER: &str = "vgpu-dra";
/// Longest wait before retrying a failed write.
const RETRY: Duration = Duration::from_secs(5);

/// The slice's count of claims the driver has prepared since it started.
/// kube-scheduler sets a pod aside when its claims did not fit and retries
/// it on events that may have made room; in Kubernetes 1.36 some of the
/// moments that make room raise none (a claim's capacity is counted twice
/// while its allocation is both recorded and still in flight, and leaving
/// that state is silent), and such a pod waited for the scheduler's
/// five-minute flush with the capacity idle. Any change to a ResourceSlice
/// retries every pod set aside for DRA, so the driver changes this count
/// after claims are prepared: by then the allocations that were in flight
/// are recorded.
pub const PREPARED_ANNOTATION: &str = "vgpu.io/claims-prepared";
/// How long the count waits after a claim is prepared, so that the claims
/// of a burst cost one write.
const PREPARED_SETTLE: Duration = Duration::from_millis(200);

/// The node's Node as its slice's owner; also takes in the GPUs its
/// annotation cordons, so that a restarted driver's first slice already
/// leaves them out (before [`follow_cordon`] sees the Node).
async fn owner(
    client: &Client,
    node: &str,
    driver: &Driver,
) -> Result<Option<NodeOwner>, kube::Error> {
    let found = Api::<Node>::all(client.clone()).get_opt(node).await?;
    if let Some(found) = &found {
        driver.set_cordoned(
            cordoned_gpus(found.metadata.annotations.as_ref())
                .into_iter()
                .map(str::to_string)
                .collect(),
        );
    }
    Ok(found.and_then(|found| {
        found.metadata.uid.map(|uid| NodeOwner {
            name: node.to_string(),
            uid,
        })
    }))
}

/// Writes the slice until `shutdown`; `changes` ticks on every health
/// change, `prepared` counts the claims prepared. The slice stays when the
/// driver stops (a restarted driver carries on with it; kubelet removes a
/// deregistered driver's slices).
pub async fn keep_published(
    client: Client,
    driver: Arc<Driver>,
    facts: NodeFacts,
    mut changes: watch::Receiver<u64>,
    mut prepared: watch::Receiver<u64>,
    resync: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let node = driver.node().to_string();
    let slices = Api::<ResourceSlice>::all(client.clone());
    let name = slice_name(&node);
    let mut generation: Option<i64> = None;
    let mut owner_of: Option<Option<NodeOwner>> = None;
    let mut written: Option<ResourceSlice> = None;
    let mut counting = true;
    loop {
        let result: Result<(), kube::Error> = async {
            if owner_of.is_none() {
                owner_of = Some(owner(&client, &node, &driver).await?);
            }
            let next = match generation {
                Some(generation) => generation,
                // Above whatever an earlier run wrote: consumers keep
                // only a pool's newest generation.
                None => slices
                    .get_opt(&name)
                    .await?
                    .map(|slice| slice.spec.pool.generation + 1)
                    .unwrap_or(1),
            };
            let gpus = driver.gpus();
            let cordoned = driver.cordoned();
            let mut slice = resource_slice(
                &node,
                owner_of.as_ref().and_then(Option::as_ref),
                &gpus,
                &cordoned,
                &facts,
                next,
            );
            let same_devices = written
                .as_ref()
                .is_some_and(|old| old.spec.devices == slice.spec.devices);
            let next = if same_devices || written.is_none() {
                next
            } else {
                next + 1
            };
            slice.spec.pool.generation = next;
            let prepared_count = *prepared.borrow_and_update();
            slice.metadata.annotations = Some(BTreeMap::from([(
                PREPARED_ANNOTATION.to_string(),
                prepared_count.to_string(),
            )]));
            slices
                .patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&slice),
                )
                .await?;
            let offered = slice.spec.devices.as_ref().map_or(0, Vec::len);
            if same_devices {
                tracing::debug!(
                    "ResourceSlice {name} rewritten: {prepared_count} claims prepared"
                );
            } else {
                tracing::info!(
                    "published ResourceSlice {name}: {offered} of {} GPUs ({} cordoned), generation {next}",
                    gpus.len(),
                    cordoned.len()
                );
            }
            generation = Some(next);
            written = Some(slice);
            Ok(())
        }
        .await;
        let wait = match result {
            Ok(()) => resync,
            Err(error) => {
                tracing::warn!(
                    error = &error as &dyn std::error::Error,
                    "publishing ResourceSlice {name}; retrying"
                );
                RETRY
            }
        };
        let settle = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            changed = changes.changed() => if changed.is_err() { return } else { false },
            counted = prepared.changed(), if counting => {
                // An error: the service is gone (the driver is stopping);
                // the slice is still kept until `shutdown`.
                counting = counted.is_ok();
                counting
            }
            _ = tokio::time::sleep(wait) => false,
        };
        if settle {
            tokio::select! {
                _ = shutdown.wait_for(|stop| *stop) => return,
                _ = tokio::time::sleep(PREPARED_SETTLE) => {}
            }
        }
    }
}

/// Follows the node's cordon annotation ([`vgpu_cluster::cordon`]) until
/// `shutdown`: each change updates the driver's cordoned GPUs and ticks
/// `changed`, so the slice is written again without them (or with them,
/// once uncordoned). The watch retries with kube-runtime's backoff.
pub async fn follow_cordon(
    client: Client,
    driver: Arc<Driver>,
    changed: Arc<watch::Sender<u64>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let node = driver.node().to_string();
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let events = watcher::watcher(Api::<Node>::all(client), config).default_backoff();
    let mut events = std::pin::pin!(events);
    loop {
        let event = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            event = events.next() => event,
        };
        let node_object = match event {
            None => return,
            Some(Ok(watcher::Event::Apply(found) | watcher::Event::InitApply(found))) => found,
            Some(Ok(_)) => continue,
            Some(Err(error)) => {
                tracing::warn!(
                    error = &error as &dyn std::error::Error,
                    "watching node {node} for cordoned GPUs; retrying"
                );
                continue;
            }
        };
        let uuids: Vec<String> = cordoned_gpus(node_object.metadata.annotations.as_ref())
            .into_iter()
            .map(str::to_string)
            .collect();
        let listed = uuids.join(", ");
        if driver.set_cordoned(uuids) {
            if listed.is_empty() {
                tracing::info!(
                    "node {node}: no GPU cordoned; every healthy GPU is in the ResourceSlice"
                );
            } else {
                tracing::info!("node {node}: GPUs cordoned ({listed}); they leave the ResourceSlice, claims on them keep running");
            }
            changed.send_modify(|count| *count += 1);
        }
    }
}
