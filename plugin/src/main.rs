//! `vgpu-device-plugin`: see `--help`.

use anyhow::Context;
use clap::Parser;
use std::sync::Arc;
use std::time::Duration;
use vgpu_device_plugin::load::{self, NvmlLoad};
use vgpu_device_plugin::options::Options;
use vgpu_device_plugin::{cluster, PluginConfig};
use vgpu_node_agent::daemon;
use vgpu_node_agent::health::{HealthTracker, NvmlHealth};
use vgpu_node_agent::inventory::inventory_gpus;

fn main() -> anyhow::Result<()> {
    let options = Options::parse();
    daemon::init_logging(options.log_level, &["vgpu_device_plugin"]);

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
        request_defaults: options.request_defaults.defaults(),
        load,
    };

    let runtime = daemon::runtime().context("starting the async runtime")?;
    runtime.block_on(async {
        let client = cluster::make_client(&options.api_source()).await?;
        let shutdown = daemon::stop_on_signal();
        vgpu_device_plugin::run(config, gpus, Box::new(health), client, shutdown).await?;
        Ok(())
    })
}
