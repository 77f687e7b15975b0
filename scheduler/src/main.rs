//! `vgpu-scheduler`: the kube-scheduler HTTP extender of vgpu. See `--help`.

use anyhow::Context;
use clap::Parser;
use std::net::SocketAddr;
use std::time::Duration;
use vgpu_scheduler::cli::Cli;
use vgpu_scheduler::server::tls::RELOAD_PERIOD;
use vgpu_scheduler::server::CertificateFiles;
use vgpu_scheduler::Surface;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_max_level(cli.log_level)
        .with_writer(std::io::stderr)
        .init();

    // Up to three listeners of --max-connections each, the watches and the
    // API client: more than the 1,024 open files a container's soft limit
    // often is.
    raise_open_files_limit(3 * u64::from(cli.max_connections) + 256);

    let tls = match (&cli.tls_cert, &cli.tls_key) {
        (Some(cert), Some(key)) => {
            let files = CertificateFiles::load(cert, key)?;
            files.log_validity();
            let config = match &cli.client_ca {
                Some(client_ca) => files.server_config_verifying_clients(client_ca)?,
                None => files.server_config()?,
            };
            // A renewed certificate (the Secret updated in place) is
            // served without a restart.
            let warn_before = Duration::from_secs(u64::from(cli.tls_expiry_warning_days) * 86_400);
            tokio::spawn(files.clone().keep_reloading(RELOAD_PERIOD, warn_before));
            Some((config, files))
        }
        _ => None,
    };
    let certificate = tls.as_ref().map(|(_, files)| files.clone());
    let tls = tls.map(|(config, _)| config);
    // With a secure port, the main port is plain HTTP and TLS goes there.
    let (main_tls, secure) = match cli.secure_port {
        Some(port) => (None, Some((port, tls))),
        None => (tls, None),
    };
    let secure_surface = if cli.client_ca.is_some() {
        Surface::WebhooksAndCertifiedClients
    } else {
        Surface::Webhooks
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
    if let Some(files) = certificate {
        running.report_certificate(files);
    }
    if let Some((port, tls)) = secure {
        let address =
            running.serve_also(listen(cli.secure_address, port).await?, tls, secure_surface)?;
        tracing::info!(
            "vgpu-scheduler listening on https://{address} too (webhooks and probes{})",
            if cli.client_ca.is_some() {
                "; kube-scheduler's verbs for clients certified by --client-ca"
            } else {
                ""
            }
        );
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

/// Raises the soft limit on open files toward `wanted`, as far as the hard
/// limit allows (no privilege needed), and says when that is short of it:
/// past the soft limit, accepting fails and kube-scheduler's calls with it.
fn raise_open_files_limit(wanted: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `limit`, which we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        tracing::warn!(
            "cannot read the open-files limit: {}",
            std::io::Error::last_os_error()
        );
        return;
    }
    let before = limit.rlim_cur;
    if before >= wanted {
        return;
    }
    let raised = libc::rlimit {
        rlim_cur: wanted.min(limit.rlim_max),
        rlim_max: limit.rlim_max,
    };
    // SAFETY: setrlimit reads one rlimit from `raised`, which we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        tracing::warn!(
            "cannot raise the open-files limit from {before}: {}",
            std::io::Error::last_os_error()
        );
        return;
    }
    if raised.rlim_cur < wanted {
        tracing::warn!(
            "open files limited to {} (hard limit), short of the {wanted} the connection limits \
             allow: lower --max-connections or raise the container's limit",
            raised.rlim_cur
        );
    } else {
        tracing::info!(
            "open-files limit raised from {before} to {}",
            raised.rlim_cur
        );
    }
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
