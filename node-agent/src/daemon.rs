//! What the node agents' binaries (`vgpu-device-plugin`, `vgpu-dra`) do
//! alike as processes: their logging, their runtime and how they learn to
//! stop.

use tokio::sync::watch;

/// Logs to stderr: the binary's own messages (the `own` targets, and the
/// node libraries they use) at `level`, everything else (gRPC, HTTP, the
/// Kubernetes client) at warnings and errors only.
pub fn init_logging(level: tracing::Level, own: &[&str]) {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::prelude::*;
    let own_level = LevelFilter::from_level(level);
    let filter = own
        .iter()
        .chain(&["vgpu_node_agent", "vgpu_cluster", "vgpu_nvml_host"])
        .fold(
            Targets::new().with_default(own_level.min(LevelFilter::WARN)),
            |filter, target| filter.with_target(*target, own_level),
        );
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(filter)
        .init();
}

/// The agents' async runtime: two workers are plenty for a handful of
/// gRPC calls and API writes, and leave the node's CPUs to its workloads.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// SIGTERM (kubelet stopping the pod) or SIGINT.
pub async fn wait_for_signal() {
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

/// A flag that turns true at the first SIGTERM or SIGINT: what an agent's
/// tasks watch to stop. Call it inside the runtime.
pub fn stop_on_signal() -> watch::Receiver<bool> {
    let (stop, shutdown) = watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("stopping");
        let _ = stop.send(true);
    });
    shutdown
}
