//! Serving a router on a listener, HTTP or HTTPS, with a graceful stop.

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// Serves `router` on `listener` (HTTPS when `tls` is given) until
/// `shutdown` completes; then stops accepting, lets requests in flight
/// finish and closes idle connections. Dropping the future closes every
/// connection at once.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()>,
) {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let (closing, closing_receiver) = tokio::sync::watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(error = &error as &dyn std::error::Error, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let service = TowerToHyperService::new(router.clone());
                let acceptor = acceptor.clone();
                let closing = closing_receiver.clone();
                connections.spawn(async move {
                    match acceptor {
                        None => serve_connection(stream, service, closing, peer).await,
                        Some(acceptor) => {
                            match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await {
                                Ok(Ok(tls)) => serve_connection(tls, service, closing, peer).await,
                                Ok(Err(error)) => tracing::debug!(error = &error as &dyn std::error::Error, "TLS handshake with {peer} failed"),
                                Err(_) => tracing::debug!("TLS handshake with {peer} timed out"),
                            }
                        }
                    }
                });
            }
        }
    }
    let _ = closing.send(true);
    while connections.join_next().await.is_some() {}
}

async fn serve_connection<I>(
    io: I,
    service: TowerToHyperService<Router>,
    mut closing: tokio::sync::watch::Receiver<bool>,
    peer: std::net::SocketAddr,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        _ = async { closing.wait_for(|closing| *closing).await.is_ok() } => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = result {
        tracing::debug!(
            error = &error as &dyn std::error::Error,
            "connection from {peer}"
        );
    }
}
