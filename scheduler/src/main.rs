//! `vgpu-scheduler`: the kube-scheduler HTTP extender of vgpu. See `--help`.

use anyhow::Context;
use clap::Parser;
use std::net::SocketAddr;
use vgpu_scheduler::cli::Cli;
use vgpu_scheduler::Surface;

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
    // With a secure port, the main port is plain HTTP and TLS goes there.
    let (main_tls, secure) = match cli.secure_port {
        Some(port) => (None, Some((port, tls))),
        None => (tls, None),
    };
    let listener = listen(cli.address, cli.port).await?;
    let address = listener.local_addr()?;
    let config = cli.config();
    let election = cli.leader_config()?;
    tracing::info!(
        "vgpu-scheduler listening on {}://{address} (every endpoint; GPU policy {}, node policy {})",
        if main_tls.is_some() { "https" } else { "http" },
        config.gpu_policy,
        config.node_policy
    );
    if !cli.address.is_loopback() {
        tracing::warn!(
            "kube-scheduler's verbs, /debug/state and the views are served on {address}: \
             every client that reaches it can bind pending vGPU pods and read every vGPU pod"
        );
    }
    let mut running =
        vgpu_scheduler::start(config, &cli.api_source(), listener, main_tls, election).await?;
    if let Some((port, tls)) = secure {
        let address = running.serve_also(
            listen(cli.secure_address, port).await?,
            tls,
            Surface::Webhooks,
        )?;
        tracing::info!("vgpu-scheduler listening on https://{address} too (webhooks and probes)");
    }
    if let Some(health) = cli.health_listener() {
        // The port --port got (it may have been 0: any).
        let port = address.port();
        let address = running.serve_also(listen(health, port).await?, None, Surface::Health)?;
        tracing::info!("vgpu-scheduler listening on http://{address} too (probes and metrics)");
    }
    // Binds in flight get the time kube-scheduler gives them (5 s) to finish.
    running
        .serve_until(shutdown_signal(), std::time::Duration::from_secs(5))
        .await;
    tracing::info!("vgpu-scheduler stopped");
    Ok(())
}

async fn listen(ip: std::net::IpAddr, port: u16) -> anyhow::Result<tokio::net::TcpListener> {
    let address = SocketAddr::new(ip, port);
    tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address}"))
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
