//! Serving a router on a listener, HTTP or HTTPS, with a graceful stop,
//! within the connection limits of [`Limits`]: at most `max_connections`
//! at once, and `max_connections_per_client` of them from one address (one
//! more is closed as soon as it is accepted, so it learns at once rather
//! than waiting in the kernel's queue), a first byte and then headers
//! within `header_timeout`, idle kept-alive connections closed after
//! `idle_timeout` ([`crate::server::clock`]), a read buffer of at most
//! [`MAX_READ_BUFFER`] each, answers read by the client without a pause of
//! `write_timeout` ([`crate::server::stall`]), and a life of
//! `max_connection_age` (then the next answer says `connection: close`).

use crate::extender::config::Limits;
use crate::server::clock::{Clocked, ConnectionClock, Expiry, Watched};
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
    let allowances = Allowances {
        header: limits.header_timeout,
        idle: limits.idle_timeout,
        max_age: limits.max_connection_age,
    };
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
                let clock = ConnectionClock::new();
                let stream = StallLimited::new(Watched::new(stream, Arc::clone(&clock)), limits.write_timeout);
                let router = router.clone();
                let acceptor = acceptor.clone();
                let closing = closing_receiver.clone();
                connections.spawn(async move {
                    // Held until the connection ends.
                    let _slots = (slot, client_slot);
                    match acceptor {
                        None => serve_connection(stream, TowerToHyperService::new(router), closing, peer, clock, allowances).await,
                        Some(acceptor) => {
                            match tokio::time::timeout(allowances.header, acceptor.accept(stream)).await {
                                Ok(Ok(tls)) => {
                                    // Verified, when the configuration asks
                                    // for client certificates: the handshake
                                    // fails on one no client CA signed.
                                    let certified = tls.get_ref().1.peer_certificates().is_some_and(|c| !c.is_empty());
                                    let service = TowerToHyperService::new(
                                        router.layer(axum::Extension(ClientCertified(certified))),
                                    );
                                    // The handshake had its own allowance.
                                    clock.reopened();
                                    serve_connection(tls, service, closing, peer, clock, allowances).await
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

/// How long a connection may take over each thing ([`Limits`]).
#[derive(Clone, Copy)]
struct Allowances {
    header: Duration,
    idle: Duration,
    max_age: Duration,
}

async fn serve_connection<I>(
    io: I,
    service: TowerToHyperService<Router>,
    mut closing: tokio::sync::watch::Receiver<bool>,
    peer: std::net::SocketAddr,
    clock: Arc<ConnectionClock>,
    allowances: Allowances,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        // The connection's clock times headers and idleness apart: hyper's
        // own timeout would close an idle connection as a slow request.
        .header_read_timeout(None)
        .max_buf_size(MAX_READ_BUFFER);
    let connection =
        builder.serve_connection(TokioIo::new(io), Clocked::new(service, Arc::clone(&clock)));
    tokio::pin!(connection);
    let aged = tokio::time::sleep(allowances.max_age);
    tokio::pin!(aged);
    let mut old = false;
    let result = loop {
        tokio::select! {
            result = connection.as_mut() => break result,
            _ = async { closing.wait_for(|closing| *closing).await.is_ok() } => {
                connection.as_mut().graceful_shutdown();
                break connection.await;
            }
            () = &mut aged, if !old => {
                // Never closed here, even when idle: a client reusing it at
                // this moment would see its request fail. Its next answer
                // says to close it, or its idle allowance runs out.
                tracing::debug!("connection from {peer}: {:?} old, closed after its next answer", allowances.max_age);
                clock.close_after_answer();
                old = true;
            }
            expiry = clock.expired(allowances.header, allowances.idle) => match expiry {
                Expiry::Idle | Expiry::Silent => {
                    tracing::debug!("connection from {peer}: {expiry:?}, closed");
                    // Idle: hyper closes it at once.
                    connection.as_mut().graceful_shutdown();
                    break connection.await;
                }
                Expiry::SlowHead => {
                    tracing::debug!("connection from {peer}: headers not in within {:?}, closed", allowances.header);
                    return;
                }
            },
        }
    };
    if let Err(error) = result {
        tracing::debug!(
            error = &error as &dyn std::error::Error,
            "connection from {peer}"
        );
    }
}
