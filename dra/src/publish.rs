//! Keeping the node's ResourceSlice current: written at start, again on
//! every health change and every change of the node's cordoned GPUs
//! ([`follow_cordon`]; a new pool generation each time), and every
//! resync period (repairs a slice someone deleted). Written with
//! server-side apply, so the driver owns exactly the fields it sets.

use crate::driver::Driver;
use crate::slice::{resource_slice, slice_name, NodeFacts, NodeOwner};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_stream::StreamExt;
use vgpu_cluster::cordon::cordoned_gpus;

/// The field manager of the driver's writes.
pub const FIELD_MANAGER: &str = "vgpu-dra";
/// Longest wait before retrying a failed write.
const RETRY: Duration = Duration::from_secs(5);

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
/// change. The slice stays when the driver stops (a restarted driver
/// carries on with it; kubelet removes a deregistered driver's slices).
pub async fn keep_published(
    client: Client,
    driver: Arc<Driver>,
    facts: NodeFacts,
    mut changes: watch::Receiver<u64>,
    resync: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let node = driver.node().to_string();
    let slices = Api::<ResourceSlice>::all(client.clone());
    let name = slice_name(&node);
    let mut generation: Option<i64> = None;
    let mut owner_of: Option<Option<NodeOwner>> = None;
    let mut written: Option<ResourceSlice> = None;
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
            slices
                .patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&slice),
                )
                .await?;
            let offered = slice.spec.devices.as_ref().map_or(0, Vec::len);
            tracing::info!(
                "published ResourceSlice {name}: {offered} of {} GPUs ({} cordoned), generation {next}",
                gpus.len(),
                cordoned.len()
            );
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
        tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            changed = changes.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(wait) => {}
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
