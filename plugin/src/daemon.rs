//! What the node agents' binaries (`vgpu-device-plugin`, `vgpu-dra`) do
//! alike as processes: their logging and how they learn to stop.

/// Logs to stderr: the binary's own messages (the `own` targets, and the
/// node libraries they use) at `level`, everything else (gRPC, HTTP, the
/// Kubernetes client) at warnings and errors only.
pub fn init_logging(level: tracing::Level, own: &[&str]) {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::prelude::*;
    let own_level = LevelFilter::from_level(level);
    let filter = own
        .iter()
        .chain(&["vgpu_device_plugin", "vgpu_cluster", "vgpu_nvml_host"])
        .fold(
            Targets::new().with_default(own_level.min(LevelFilter::WARN)),
            |filter, target| filter.with_target(*target, own_level),
        );
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(filter)
        .init();
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
