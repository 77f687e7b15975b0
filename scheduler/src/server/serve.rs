//! Serving a router on a listener, HTTP or HTTPS, with a graceful stop,
//! within the connection limits of [`Limits`]: at most `max_connections`
//! at once, and `max_connections_per_client` of them from one address (one
//! more is closed as soon as it is accepted, so it learns at once rather
//! than waiting in the kernel's queue), headers within
//! `header_timeout` (which also closes idle kept-alive connections), a
//! read buffer of at most [`MAX_READ_BUFFER`] each, answers read by the
//! client without a pause of `write_timeout` ([`crate::server::stall`]),
//! and a life of `max_connection_age` (then closed once the request in
//! hand is answered).

use crate::extender::config::Limits;
use crate::server::stall::StallLimited;
use crate::server::tls::ClientCertified;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// The most a connection buffers of what its client sends before it is
/// handled: headers must fit (kube-scheduler's and the API server's are a
/// few hundred bytes), and bodies pass through it in pieces this large.
/// hyper's default (about 400 KiB) would let each slow client pin that
/// much with unfinished headers.
pub const MAX_READ_BUFFER: usize = 16 << 10;

/// Connections open per client address on one listener.
#[derive(Default)]
struct PerClient(Mutex<HashMap<IpAddr, usize>>);

/// One client's connection, counted while it is held.
struct ClientSlot {
    clients: Arc<PerClient>,
    address: IpAddr,
}

impl PerClient {
    /// Counts one more connection from `address`, unless it holds `limit`.
    fn take(self: &Arc<Self>, address: IpAddr, limit: usize) -> Option<ClientSlot> {
        let mut open = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let count = open.entry(address).or_insert(0);
        if *count >= limit {
            return None;
        }
        *count += 1;
        Some(ClientSlot {
            clients: Arc::clone(self),
            address,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self
            .clients
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = open.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.address);
            }
        }
    }
}

/// Serves `router` on `listener` (HTTPS when `tls` is given) with the
/// default [`Limits`] until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()>,
) {
    serve_with(listener, router, tls, &Limits::default(), shutdown).await;
}

/// Serves `router` on `listener` (HTTPS when `tls` is given) within
/// `limits` until `shutdown` completes; then stops accepting, lets
/// requests in flight finish and closes idle connections. Dropping the
/// future closes every connection at once.
pub async fn serve_with(
    listener: TcpListener,
    router: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: &Limits,
    shutdown: impl Future<Output = ()>,
) {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let (closing, closing_receiver) = tokio::sync::watch::channel(false);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let clients = Arc::new(PerClient::default());
    let header_timeout = limits.header_timeout;
    let max_age = limits.max_connection_age;
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
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    tracing::debug!(
                        "connection from {peer} closed: {} connections are open already",
                        limits.max_connections
                    );
                    drop(stream);
                    continue;
                };
                let Some(client_slot) = clients.take(peer.ip(), limits.max_connections_per_client) else {
                    // debug, as above: a client that floods would flood the log.
                    tracing::debug!(
                        "connection from {peer} closed: {} connections from {} are open already",
                        limits.max_connections_per_client,
                        peer.ip()
                    );
                    drop(stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let stream = StallLimited::new(stream, limits.write_timeout);
                let router = router.clone();
                let acceptor = acceptor.clone();
                let closing = closing_receiver.clone();
                connections.spawn(async move {
                    // Held until the connection ends.
                    let _slots = (slot, client_slot);
                    match acceptor {
                        None => serve_connection(stream, TowerToHyperService::new(router), closing, peer, header_timeout, max_age).await,
                        Some(acceptor) => {
                            match tokio::time::timeout(header_timeout, acceptor.accept(stream)).await {
                                Ok(Ok(tls)) => {
                                    // Verified, when the configuration asks
                                    // for client certificates: the handshake
                                    // fails on one no client CA signed.
                                    let certified = tls.get_ref().1.peer_certificates().is_some_and(|c| !c.is_empty());
                                    let service = TowerToHyperService::new(
                                        router.layer(axum::Extension(ClientCertified(certified))),
                                    );
                                    serve_connection(tls, service, closing, peer, header_timeout, max_age).await
                                }
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
    header_timeout: Duration,
    max_age: Duration,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_buf_size(MAX_READ_BUFFER);
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        _ = async { closing.wait_for(|closing| *closing).await.is_ok() } => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
        () = tokio::time::sleep(max_age) => {
            tracing::debug!("connection from {peer}: {max_age:?} old, closed after its request in hand");
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
