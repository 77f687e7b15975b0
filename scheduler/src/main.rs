//! `vgpu-scheduler`: the kube-scheduler HTTP extender of vgpu. See `--help`.

use anyhow::Context;
use clap::Parser;
use std::net::SocketAddr;
use vgpu_scheduler::cli::Cli;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_max_level(cli.log_level)
        .with_writer(std::io::stderr)
        .init();

    let tls = match (&cli.tls_cert, &cli.tls_key) {
        (Some(cert), Some(key)) => Some(vgpu_scheduler::server::tls_config(cert, key)?),
        _ => None,
    };
    let address = SocketAddr::new(cli.address, cli.port);
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address}"))?;
    let address = listener.local_addr().unwrap_or(address);
    let config = cli.config();
    let election = cli.leader_config().map_err(anyhow::Error::msg)?;
    tracing::info!(
        "vgpu-scheduler listening on {}://{address} (GPU policy {}, node policy {})",
        if tls.is_some() { "https" } else { "http" },
        config.gpu_policy,
        config.node_policy
    );
    let running = vgpu_scheduler::start(config, &cli.api_source(), listener, tls, election).await?;
    // Binds in flight get the time kube-scheduler gives them (5 s) to finish.
    running
        .serve_until(shutdown_signal(), std::time::Duration::from_secs(5))
        .await;
    tracing::info!("vgpu-scheduler stopped");
    Ok(())
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(error) => {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "cannot watch SIGTERM"
                    );
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
