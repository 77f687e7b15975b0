//! `vgpu-dra`: vgpu's Dynamic Resource Allocation driver.
//!
//! It publishes each GPU of its node as one device of a ResourceSlice,
//! shareable between claims by amount (consumable capacity: `memory` in
//! bytes, `cores` in percent; [`slice`]), so that kube-scheduler itself
//! decides which claims share a GPU. At kubelet's `NodePrepareResources`
//! it turns what a claim consumed into a region with those caps and a CDI
//! spec giving the claim's containers the shim ([`driver`]); at
//! `NodeUnprepareResources` it removes both. What it shares with the
//! device plugin (planning a region, GPU health, the node's GPUs, the
//! shared flags, the daemon's set-up) is [`vgpu_node_agent`]'s.

pub mod api;
pub mod authority;
pub mod cdi;
pub mod checkpoint;
pub mod claim;
pub mod driver;
pub mod publish;
pub mod service;
pub mod slice;

use driver::Driver;
use service::{Claims, ServiceError, Sockets};
use slice::NodeFacts;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use vgpu_node_agent::health::{self, HealthEvent, HealthSource};

/// Runs the driver until `shutdown` turns true: GPU health, the
/// ResourceSlice, and kubelet's services.
pub async fn run(
    driver: Arc<Driver>,
    health_source: Box<dyn HealthSource>,
    client: kube::Client,
    facts: NodeFacts,
    sockets: Sockets,
    resync: Duration,
    shutdown: watch::Receiver<bool>,
) -> Result<(), ServiceError> {
    let (changed, changes) = watch::channel(0u64);
    let (prepared_count, prepared) = watch::channel(0u64);
    let changed = Arc::new(changed);
    let health_changed = Arc::clone(&changed);
    let health_driver = Arc::clone(&driver);
    let stop_health = health::spawn(health_source, move |event| {
        let (uuid, healthy) = match &event {
            HealthEvent::Unhealthy { uuid, reason } => {
                tracing::warn!("GPU {uuid} is unhealthy: {reason}; it leaves the ResourceSlice");
                (uuid, false)
            }
            HealthEvent::Healthy { uuid } => {
                tracing::info!("GPU {uuid} is healthy again; it returns to the ResourceSlice");
                (uuid, true)
            }
        };
        if health_driver.set_health(uuid, healthy) {
            health_changed.send_modify(|count| *count += 1);
        }
    })
    .map_err(ServiceError::HealthThread)?;
    let cordon = tokio::spawn(publish::follow_cordon(
        client.clone(),
        Arc::clone(&driver),
        changed,
        shutdown.clone(),
    ));
    let publisher = tokio::spawn(publish::keep_published(
        client.clone(),
        Arc::clone(&driver),
        facts,
        changes,
        prepared,
        resync,
        shutdown.clone(),
    ));
    let claims: Arc<dyn Claims> = Arc::new(client);
    let served = service::serve(driver, claims, prepared_count, &sockets, shutdown).await;
    stop_health.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = publisher.await;
    let _ = cordon.await;
    served
}
