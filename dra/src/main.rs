//! `vgpu-dra`: see `--help`.

use anyhow::Context;
use clap::Parser;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use vgpu_dra::driver::{Driver, DriverConfig};
use vgpu_dra::service::{Sockets, DRA_SOCKET, REGISTRATION_SOCKET};
use vgpu_dra::slice::{node_facts, DRIVER_NAME};
use vgpu_node_agent::daemon;
use vgpu_node_agent::flags::{ApiFlags, ContainerFlags, HealthFlags};
use vgpu_node_agent::health::{HealthTracker, NvmlHealth};
use vgpu_node_agent::inventory::inventory_gpus;

/// vgpu DRA driver: shares this node's GPUs between ResourceClaims.
///
/// Publishes each GPU as one device of the node's ResourceSlice (driver
/// `vgpu.io`), shareable between claims (allowMultipleAllocations) with two
/// consumable capacities: `memory` (bytes, requested in MiB steps; a claim
/// naming none gets the whole GPU's memory) and `cores` (percent, 1 %
/// steps; a claim naming none reserves no share). kube-scheduler places
/// claims against them. When kubelet prepares a claim, the driver creates
/// one region with the memory and share the claim consumed and writes a
/// CDI spec (`vgpu.io/claim=<uid>`) that gives the claim's containers the
/// shim's environment and mounts. Unhealthy GPUs leave the slice.
///
/// Example: vgpu-dra --node-name gpu-node-1 --kubeconfig /etc/vgpu/kubeconfig
#[derive(Debug, Parser)]
#[command(name = "vgpu-dra", version)]
struct Options {
    /// This node's name (its pool's name, and the slice's node).
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    node_name: String,

    /// The driver's own directory: its DRA socket and its record of
    /// prepared claims.
    #[arg(
        long,
        default_value = "/var/lib/kubelet/plugins/vgpu.io",
        value_name = "DIR"
    )]
    plugin_dir: PathBuf,

    /// Kubelet's plugin registry (where the registration socket goes).
    #[arg(
        long,
        default_value = "/var/lib/kubelet/plugins_registry",
        value_name = "DIR"
    )]
    registry_dir: PathBuf,

    /// The DRA socket's path as kubelet reaches it (what registration
    /// answers); default: the socket in --plugin-dir.
    #[arg(long, value_name = "PATH")]
    kubelet_plugin_dir: Option<PathBuf>,

    /// Where the container runtime reads CDI specs.
    #[arg(long, default_value = "/var/run/cdi", value_name = "DIR")]
    cdi_dir: PathBuf,

    /// NVML library to load.
    #[arg(long, default_value = "libnvidia-ml.so.1", value_name = "PATH")]
    nvml_library: PathBuf,

    /// Seconds between rewrites of an unchanged ResourceSlice (it is also
    /// written at start and on every health change).
    #[arg(long, default_value_t = 300, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(1..))]
    resync_seconds: u64,

    #[command(flatten)]
    container: ContainerFlags,

    #[command(flatten)]
    health: HealthFlags,

    #[command(flatten)]
    api: ApiFlags,

    /// Log level of the driver's own messages: error, warn, info, debug or
    /// trace (to stderr; its libraries log warnings and errors only).
    #[arg(long, default_value = "info", value_name = "LEVEL")]
    log_level: tracing::Level,
}

fn main() -> anyhow::Result<()> {
    let options = Options::parse();
    daemon::init_logging(options.log_level, &["vgpu_dra"]);

    let nvml = Arc::new(vgpu_nvml_host::open(Some(&options.nvml_library))?);
    // Split count means nothing here: kube-scheduler counts capacity.
    let gpus = inventory_gpus(
        vgpu_nvml_host::describe(&nvml)?,
        u32::MAX,
        options.container.device_memory_scaling,
    );
    let uuids: Vec<String> = gpus.iter().map(|gpu| gpu.uuid.clone()).collect();
    let facts = node_facts(&nvml, &uuids);
    let health = NvmlHealth::new(
        Arc::clone(&nvml),
        uuids,
        HealthTracker::new(
            options.health.ignored_xids.iter().copied(),
            options.health.recovery(),
        ),
        Duration::from_millis(options.health.health_probe_ms),
    );
    let dra_socket = options.plugin_dir.join(DRA_SOCKET);
    let sockets = Sockets {
        dra_endpoint: options
            .kubelet_plugin_dir
            .as_ref()
            .map(|dir| dir.join(DRA_SOCKET))
            .unwrap_or_else(|| dra_socket.clone())
            .display()
            .to_string(),
        dra: dra_socket,
        registration: options.registry_dir.join(REGISTRATION_SOCKET),
    };
    let driver = Arc::new(
        Driver::new(
            DriverConfig {
                node: options.node_name.clone(),
                settings: options.container.settings(),
                cdi_dir: options.cdi_dir.clone(),
                checkpoint: options.plugin_dir.join("prepared-claims.json"),
            },
            gpus,
        )
        .context("starting the driver")?,
    );
    tracing::info!(
        "{DRIVER_NAME} driver for node {} with {} GPU(s)",
        options.node_name,
        driver.gpus().len()
    );

    let runtime = daemon::runtime().context("starting the async runtime")?;
    runtime.block_on(async {
        let client = vgpu_cluster::client::make_client(&options.api.source()).await?;
        let shutdown = daemon::stop_on_signal();
        vgpu_dra::run(
            driver,
            Box::new(health),
            client,
            facts,
            sockets,
            Duration::from_secs(options.resync_seconds),
            shutdown,
        )
        .await?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn defaults_and_help() {
        Options::command().debug_assert();
        let options = Options::try_parse_from(["vgpu-dra", "--node-name", "n"]).expect("parse");
        assert_eq!(options.cdi_dir, PathBuf::from("/var/run/cdi"));
        assert_eq!(
            options.registry_dir,
            PathBuf::from("/var/lib/kubelet/plugins_registry")
        );
        assert!(Options::try_parse_from(["vgpu-dra"]).is_err());
        let help = Options::command().render_long_help().to_string();
        for flag in [
            "--cdi-dir",
            "--containers-dir",
            "--ignored-xids",
            "--kubeconfig",
        ] {
            assert!(help.contains(flag), "{flag}");
        }
    }
}
