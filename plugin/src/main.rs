//! `vgpu-device-plugin`: see `--help`.

use anyhow::Context;
use clap::Parser;
use std::sync::Arc;
use std::time::Duration;
use vgpu_device_plugin::health::{HealthTracker, NvmlHealth};
use vgpu_device_plugin::inventory::inventory_gpus;
use vgpu_device_plugin::load::{self, NvmlLoad};
use vgpu_device_plugin::options::Options;
use vgpu_device_plugin::{cluster, PluginConfig};

fn main() -> anyhow::Result<()> {
    let options = Options::parse();
    init_logging(options.log_level);

    let nvml = Arc::new(vgpu_nvml_host::open(Some(&options.nvml_library))?);
    let gpus = inventory_gpus(
        vgpu_nvml_host::describe(&nvml)?,
        options.split_count,
        options.container.device_memory_scaling,
    );
    let health = NvmlHealth::new(
        Arc::clone(&nvml),
        gpus.iter().map(|g| g.uuid.clone()).collect(),
        HealthTracker::new(
            options.health.ignored_xids.iter().copied(),
            options.health.recovery(),
        ),
        Duration::from_millis(options.health.health_probe_ms),
    );
    let load = match options.load_sample_seconds {
        0 => None,
        seconds => {
            let source = NvmlLoad::new(
                Arc::clone(&nvml),
                gpus.iter().map(|g| g.uuid.clone()).collect(),
            );
            Some(
                load::spawn(Box::new(source), Duration::from_secs(seconds))
                    .context("starting the GPU load sampler")?,
            )
        }
    };
    let config = PluginConfig {
        node: options.node_name.clone(),
        kubelet: options.kubelet_settings(),
        settings: options.allocate_settings(),
        resync: Duration::from_secs(options.resync_seconds),
        lease_duration_seconds: options.lease_duration_seconds,
        pod_resources_socket: Some(options.pod_resources_socket.clone()),
        resources: options.share_resources.names(&options.resource_name),
        load,
    };

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let client = cluster::make_client(&options.api_source()).await?;
        let (stop, shutdown) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("stopping");
            let _ = stop.send(true);
        });
        vgpu_device_plugin::run(config, gpus, Box::new(health), client, shutdown).await?;
        Ok(())
    })
}

/// Logs to stderr: the plugin's own messages at `level`, its libraries'
/// (gRPC, HTTP, Kubernetes client) at warnings and errors only.
fn init_logging(level: tracing::Level) {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::prelude::*;
    let own = LevelFilter::from_level(level);
    let filter = Targets::new()
        .with_default(own.min(LevelFilter::WARN))
        .with_target("vgpu_device_plugin", own)
        .with_target("vgpu_cluster", own)
        .with_target("vgpu_nvml_host", own);
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(filter)
        .init();
}

/// SIGTERM (kubelet stopping the pod) or SIGINT.
async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "cannot watch SIGTERM"
            );
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
