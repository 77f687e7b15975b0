//! `vgpu-monitor`: the node daemon (see `--help` and the crate docs).

use anyhow::Context;
use clap::Parser;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use vgpu_monitor::daemon::Monitor;
use vgpu_monitor::events::EventRecorder;
use vgpu_monitor::names::{self, PodDirectory};
use vgpu_monitor::options::Options;

fn main() -> anyhow::Result<()> {
    let options = Options::parse();
    tracing_subscriber::fmt()
        .with_max_level(options.log_level)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run(options))
}

async fn run(options: Options) -> anyhow::Result<()> {
    let (pods, events) = match (options.api_source(), options.node_name.clone()) {
        (None, _) => {
            tracing::info!("Kubernetes API not used: pods are named by their directory");
            (PodDirectory::disabled(), None)
        }
        (Some(_), None) => {
            tracing::warn!(
                "no node name (--node-name or NODE_NAME): Kubernetes API not used, pods are named by their directory"
            );
            (PodDirectory::disabled(), None)
        }
        (Some(source), Some(node)) => match names::make_client(&source).await {
            Ok(client) => {
                let directory = PodDirectory::new(options.request_rules());
                let events = EventRecorder::new(
                    client.clone(),
                    tokio::runtime::Handle::current(),
                    node.clone(),
                );
                tokio::spawn(names::watch_pods(client, node, Arc::clone(&directory)));
                (directory, Some(events))
            }
            Err(error) => {
                tracing::warn!(
                    error = &error as &dyn std::error::Error,
                    "no Kubernetes client: pods are named by their directory, no cleanup"
                );
                (PodDirectory::disabled(), None)
            }
        },
    };

    let config = options.monitor_config();
    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .with_context(|| format!("listening on {}", options.listen))?;
    tracing::info!(
        "serving /metrics on {}, reading {}/*/{}",
        listener.local_addr().unwrap_or(options.listen),
        config.discovery.root.display(),
        config.discovery.region_file
    );
    let mut monitor = Monitor::new(config, pods);
    if let Some(events) = events {
        monitor = monitor.with_events(events);
    }
    let shared = monitor.shared();
    let stop = Arc::new(AtomicBool::new(false));
    let stop_loop = Arc::clone(&stop);
    let loop_thread = std::thread::Builder::new()
        .name("vgpu-monitor-loop".into())
        .spawn(move || monitor.run(&stop_loop))
        .context("starting the monitor loop")?;

    vgpu_monitor::server::serve(
        listener,
        shared,
        &options.connection_limits(),
        shutdown_signal(),
    )
    .await;
    stop.store(true, Ordering::Release);
    if loop_thread.join().is_err() {
        tracing::error!("the monitor loop panicked");
    }
    tracing::info!("stopped");
    Ok(())
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(term) => term,
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "cannot watch SIGTERM"
            );
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down");
}
