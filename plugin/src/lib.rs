//! `vgpu-device-plugin`: the kubelet device plugin of vgpu. What it shares
//! with the DRA driver (planning a container's region, GPU health, the
//! node's GPUs, the shared flags, the daemon's set-up) is
//! [`vgpu_node_agent`]'s; here is what is kubelet's device plugin API's.
//!
//! - [`api`]: kubelet's device plugin and PodResources APIs.
//! - [`devices`]: the `<uuid>::<k>` devices kubelet sees and the preferred
//!   allocation.
//! - [`protocol`]: finding the pod kubelet is admitting and matching
//!   kubelet's requests to its containers (the protocol of
//!   [`vgpu_cluster::decision`]).
//! - [`allocate`]: a container's region plan, as kubelet's answer.
//! - [`records`]: which containers were served: the regions on the host
//!   first, the pods' annotation published after the answer.
//! - [`cluster`]: the Kubernetes API (pods, allocation record, node
//!   inventory).
//! - [`service`]: the `DevicePlugin` gRPC service.
//! - [`kubelet`]: the plugin socket, registration, kubelet restarts.
//! - [`inventory`]: the node annotation.
//! - [`lease`]: the node's Lease, renewed to show the plugin is alive.
//! - [`load`]: the GPUs' measured, smoothed utilization.
//! - [`pod_resources`]: kubelet's PodResources API: which of several
//!   pending pods kubelet is admitting, and the records checked against
//!   kubelet's at start.
//! - [`unix_channel`]: gRPC over kubelet's unix sockets.
//! - [`pod_cache`]: the node's pods as a watch shows them.
//! - [`options`]: the command line.

pub mod allocate;
pub mod api;
pub mod cluster;
pub mod devices;
pub mod inventory;
pub mod kubelet;
pub mod lease;
pub mod load;
pub mod options;
pub mod pod_cache;
pub mod pod_resources;
pub mod protocol;
pub mod records;
pub mod service;
pub mod unix_channel;

use cluster::Cluster;
use service::PluginState;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::sync::watch;
use vgpu_cluster::decision::InventoryGpu;
use vgpu_node_agent::allocation::{self, AllocationError, Settings};
use vgpu_node_agent::health::{self, HealthEvent, HealthSource};

/// Everything a running plugin needs besides its GPUs and the API client.
#[derive(Clone, Debug)]
pub struct PluginConfig {
    pub node: String,
    pub kubelet: kubelet::KubeletSettings,
    pub settings: Settings,
    /// Time between rewrites of an unchanged inventory.
    pub resync: Duration,
    /// `leaseDurationSeconds` of the node's Lease.
    pub lease_duration_seconds: u32,
    /// Kubelet's PodResources socket, to check the records against at
    /// start ([`pod_resources`]); `None`: not checked.
    pub pod_resources_socket: Option<std::path::PathBuf>,
    /// The resource names; those of the shares are offered in the node's
    /// status.
    pub resources: vgpu_cluster::resources::ResourceNames,
    /// What containers get that name no memory or compute share: the
    /// extender's defaults, which decisions are checked against.
    pub request_defaults: vgpu_cluster::requests::RequestDefaults,
    /// The GPUs' measured load ([`load::spawn`]), published in the
    /// inventory; `None`: not measured.
    pub load: Option<watch::Receiver<load::LoadFigures>>,
}

#[derive(Debug, Error)]
pub enum PluginError {
    #[error(transparent)]
    Kubelet(#[from] kubelet::KubeletError),
    #[error("writing ld.so.preload")]
    Preload(#[source] AllocationError),
    #[error("starting the health thread")]
    Health(#[source] std::io::Error),
}

/// Applies a health change to the GPU list (which `ListAndWatch` streams
/// and the inventory follow).
pub fn apply_health(state: &PluginState, event: &HealthEvent) {
    let (uuid, healthy) = match event {
        HealthEvent::Unhealthy { uuid, reason } => {
            tracing::warn!("GPU {uuid} is unhealthy: {reason}");
            (uuid, false)
        }
        HealthEvent::Healthy { uuid } => {
            tracing::info!("GPU {uuid} is healthy again");
            (uuid, true)
        }
    };
    state
        .gpus
        .send_if_modified(|gpus| match gpus.iter_mut().find(|g| &g.uuid == uuid) {
            Some(gpu) if gpu.healthy != healthy => {
                gpu.healthy = healthy;
                true
            }
            Some(_) => false,
            None => {
                tracing::warn!("health event for unknown GPU {uuid}");
                false
            }
        });
}

/// Runs the plugin on `gpus` until `shutdown` becomes true: serves and
/// registers with kubelet, follows `health`, publishes the inventory.
pub async fn run(
    config: PluginConfig,
    gpus: Vec<InventoryGpu>,
    health: Box<dyn HealthSource>,
    client: kube::Client,
    shutdown: watch::Receiver<bool>,
) -> Result<(), PluginError> {
    allocation::write_preload(&config.settings).map_err(PluginError::Preload)?;
    let cluster = Cluster::new(client, config.node.clone());
    tracing::info!(
        "node {}: {} GPU(s), {} device(s) of {}",
        config.node,
        gpus.len(),
        gpus.iter().map(|g| g.split_count as usize).sum::<usize>(),
        config.kubelet.resource_name
    );
    for gpu in &gpus {
        tracing::info!(
            "GPU {} {} ({}, {} MiB, offered as {} MiB, {} SMs, NUMA {:?}, NVLink island {:?})",
            gpu.index,
            gpu.uuid,
            gpu.model,
            gpu.memory_bytes >> 20,
            gpu.offered_bytes() >> 20,
            gpu.sm_count,
            gpu.numa,
            gpu.nvlink_island
        );
    }
    let requests = vgpu_cluster::requests::RequestRules {
        names: config.resources.clone(),
        defaults: config.request_defaults,
    };
    // Several pending pods per node only where kubelet's PodResources API
    // answers now: without it, an `Allocate` among several would fail the
    // pod, while binds that wait for the previous admission cost time only.
    let several_pending = match &config.pod_resources_socket {
        Some(socket) => pod_resources::tells_pods_apart(socket).await,
        None => false,
    };
    // Where the extender binds without waiting for the previous pod's
    // admission, no one reads the pods' allocation records: they stay on
    // the node.
    let keeping = if several_pending {
        records::Keeping::NodeOnly
    } else {
        records::Keeping::PodAnnotation
    };
    tracing::info!(
        "allocation records: {}",
        match keeping {
            records::Keeping::NodeOnly =>
                "kept on the node only (kubelet's PodResources API tells pending pods apart)",
            records::Keeping::PodAnnotation =>
                "also published to each pod until kubelet admits it (the extender waits for them)",
        }
    );
    let records = Arc::new(records::Records::load(
        &config.settings.containers_dir,
        &config.settings.region_file,
        keeping,
    ));
    let (containers_dir, region_file) = (
        config.settings.containers_dir.clone(),
        config.settings.region_file.clone(),
    );
    let state = PluginState::new(
        cluster.clone(),
        config.settings,
        requests,
        gpus,
        config.pod_resources_socket.clone(),
        Arc::clone(&records),
    );

    tokio::spawn(state.pods.clone().follow(
        cluster.client(),
        config.node.clone(),
        shutdown.clone(),
    ));
    let (settled_tx, mut settled) = watch::channel(false);
    let publisher_task = tokio::spawn({
        let cluster = cluster.clone();
        let pods = state.pods.clone();
        let shutdown = shutdown.clone();
        async move { records.publish(cluster, pods, settled_tx, shutdown).await }
    });

    let (events, mut received) = tokio::sync::mpsc::unbounded_channel();
    let stop_health = health::spawn(health, move |event| {
        let _ = events.send(event);
    })
    .map_err(PluginError::Health)?;
    let health_task = tokio::spawn({
        let state = Arc::clone(&state);
        async move {
            while let Some(event) = received.recv().await {
                apply_health(&state, &event);
            }
        }
    });
    let inventory_task = tokio::spawn(inventory::publish(
        cluster.clone(),
        state.gpus.subscribe(),
        config.load,
        config.resources,
        config.resync,
        several_pending,
        shutdown.clone(),
    ));
    if let Some(socket) = config.pod_resources_socket.clone() {
        let cluster = cluster.clone();
        let resource = config.kubelet.resource_name.clone();
        // Checked once the records of containers served before this start
        // are published, so that it compares what was served.
        tokio::spawn(async move {
            if settled.wait_for(|settled| *settled).await.is_ok() {
                let served = records::served_on_node(&containers_dir, &region_file);
                pod_resources::check(&cluster, &socket, &resource, &served).await;
            }
        });
    }
    let lease_task = tokio::spawn(lease::renew(
        cluster.clone(),
        config.lease_duration_seconds,
        shutdown.clone(),
    ));

    let result = kubelet::serve(Arc::clone(&state), config.kubelet, shutdown).await;

    stop_health.store(true, Ordering::Release);
    let _ = inventory_task.await;
    let _ = lease_task.await;
    let _ = publisher_task.await;
    health_task.abort();
    result.map_err(PluginError::from)
}
