//! An axum router served on a TCP listener, HTTP or HTTPS, with a graceful
//! stop, within [`ConnectionLimits`]: every vgpu endpoint a pod can reach
//! (the extender's and webhooks' ports, the node monitor's `/metrics`) is
//! served this way, so no client can hold them all or hold one for ever.
//!
//! At most `max_connections` at once, and `max_connections_per_client` of
//! them from one address (one more is closed as soon as it is accepted, so
//! it learns at once rather than waiting in the kernel's queue); with all
//! taken, a client holding fewer than the one holding the most gets the
//! place of that one's oldest connection, so no set of clients starves
//! another however many addresses they have; a first
//! byte and then headers within `header_timeout`, idle kept-alive
//! connections closed after `idle_timeout` ([`clock`]), a read buffer of at
//! most [`MAX_READ_BUFFER`] each, answers read by the client without a
//! pause of `write_timeout` ([`stall`]), and a life of `max_connection_age`
//! (then the next answer says `connection: close`).

pub mod clock;
pub mod stall;

use crate::clock::{Clocked, ConnectionClock, Expiry, Watched};
use crate::stall::StallLimited;
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

/// What one listener allows its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// How long a new connection may send nothing, and how long a
    /// request's headers may take from their first byte.
    pub header_timeout: Duration,
    /// How long a kept-alive connection may stay idle between requests:
    /// longer than its clients keep an idle one (Go's 90 s), so that the
    /// client, not the server, closes it and no request meets a connection
    /// closing under it.
    pub idle_timeout: Duration,
    /// How long an answer (a watch's events too) may wait for its client
    /// to read on: a client that reads nothing for longer is cut off.
    pub write_timeout: Duration,
    /// Connections open at once; one more is closed as soon as it is
    /// accepted.
    pub max_connections: usize,
    /// Connections open at once from one client address, so that no one
    /// client holds them all while others' calls wait.
    pub max_connections_per_client: usize,
    /// How long a connection is kept: then its next answer tells the
    /// client to close it (an idle one is left to its idle allowance), so
    /// a client that keeps sending requests does not hold its connection
    /// (and its place under `max_connections_per_client`) for ever.
    pub max_connection_age: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            write_timeout: Duration::from_secs(10),
            max_connections: 1024,
            max_connections_per_client: 256,
            max_connection_age: Duration::from_secs(300),
        }
    }
}

/// Whether the client of a connection presented a certificate that a
/// client CA signed (where the TLS configuration asks for client
/// certificates, the handshake fails on any other): put by the server into
/// each request of a TLS connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientCertified(pub bool);

/// The most a connection buffers of what its client sends before it is
/// handled: headers must fit (kube-scheduler's and the API server's are a
/// few hundred bytes), and bodies pass through it in pieces this large.
/// hyper's default (about 400 KiB) would let each slow client pin that
/// much with unfinished headers.
pub const MAX_READ_BUFFER: usize = 16 << 10;

/// How long a new connection waits for the place of one it asked to close.
const EVICTION_WAIT: Duration = Duration::from_millis(200);

/// One open connection of a client, as its address's list holds it.
struct Held {
    id: u64,
    /// Asked to close (at most once) to make room for another client.
    evict: Arc<tokio::sync::Notify>,
    asked: bool,
}

/// The connections open per client address on one listener, oldest first.
#[derive(Default)]
struct PerClient {
    open: Mutex<HashMap<IpAddr, Vec<Held>>>,
    next_id: std::sync::atomic::AtomicU64,
}

/// One client's connection, counted while it is held.
struct ClientSlot {
    clients: Arc<PerClient>,
    address: IpAddr,
    id: u64,
    evict: Arc<tokio::sync::Notify>,
}

impl PerClient {
    /// Counts one more connection from `address`, unless it holds `limit`.
    fn take(self: &Arc<Self>, address: IpAddr, limit: usize) -> Option<ClientSlot> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let held = open.entry(address).or_default();
        if held.len() >= limit {
            return None;
        }
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let evict = Arc::new(tokio::sync::Notify::new());
        held.push(Held {
            id,
            evict: Arc::clone(&evict),
            asked: false,
        });
        Some(ClientSlot {
            clients: Arc::clone(self),
            address,
            id,
            evict,
        })
    }

    /// With every connection taken, makes room for one more from
    /// `newcomer`: asks the oldest connection of the client holding the
    /// most to close, where that client holds at least two more than
    /// `newcomer` (which must be under `limit`). So clients share the
    /// listener: however many addresses hold connections, one that holds
    /// few (the API server's webhook calls, Prometheus' scrape) always gets
    /// one. Returns whether a connection was asked.
    fn evict_for(&self, newcomer: IpAddr, limit: usize) -> bool {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let mine = open.get(&newcomer).map_or(0, Vec::len);
        if mine >= limit {
            return false;
        }
        let Some(heaviest) = open
            .values_mut()
            .filter(|held| held.iter().any(|h| !h.asked))
            .max_by_key(|held| held.iter().filter(|h| !h.asked).count())
        else {
            return false;
        };
        if heaviest.iter().filter(|h| !h.asked).count() < mine + 2 {
            return false;
        }
        match heaviest.iter_mut().find(|h| !h.asked) {
            Some(oldest) => {
                oldest.asked = true;
                oldest.evict.notify_one();
                true
            }
            None => false,
        }
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self
            .clients
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = open.get_mut(&self.address) {
            held.retain(|h| h.id != self.id);
            if held.is_empty() {
                open.remove(&self.address);
            }
        }
    }
}

/// Serves `router` on `listener` (HTTPS when `tls` is given) within
/// `limits` until `shutdown` completes; then stops accepting, lets
/// requests in flight finish and closes idle connections. Dropping the
/// future closes every connection at once.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: &ConnectionLimits,
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
                let slot = match slots.clone().try_acquire_owned() {
                    Ok(slot) => slot,
                    Err(_) if clients.evict_for(peer.ip(), limits.max_connections_per_client) => {
                        match tokio::time::timeout(EVICTION_WAIT, slots.clone().acquire_owned()).await {
                            Ok(Ok(slot)) => slot,
                            _ => {
                                tracing::debug!("connection from {peer} closed: no connection was freed for it");
                                drop(stream);
                                continue;
                            }
                        }
                    }
                    Err(_) => {
                        tracing::debug!(
                            "connection from {peer} closed: {} connections are open already",
                            limits.max_connections
                        );
                        drop(stream);
                        continue;
                    }
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
                let evict = Arc::clone(&client_slot.evict);
                connections.spawn(async move {
                    // Held until the connection ends.
                    let _slots = (slot, client_slot);
                    match acceptor {
                        None => serve_connection(stream, TowerToHyperService::new(router), closing, evict, peer, clock, allowances).await,
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
                                    serve_connection(tls, service, closing, evict, peer, clock, allowances).await
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

/// How long a connection may take over each thing ([`ConnectionLimits`]).
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
    evict: Arc<tokio::sync::Notify>,
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
            () = evict.notified() => {
                // Its client holds the most connections, and another
                // client, holding fewer, needs one.
                tracing::debug!("connection from {peer} closed: its client holds the most connections and another needs one");
                return;
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
