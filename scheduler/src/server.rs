//! The HTTP(S) server: `POST /filter`, `/prioritize`, `/bind`,
//! `/webhook/mutate`, `GET /healthz`, `/readyz`, `/debug/state`; also `POST /priorities` and
//! `/scheduler/{filter,priorities,prioritize,bind}` (Elastic GPU
//! Scheduler's URLs).

use crate::scheduler::{Reply, Scheduler};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// Largest request body accepted (a full `NodeList` of thousands of nodes
/// when the extender is not `nodeCacheCapable`).
pub const MAX_BODY_BYTES: usize = 256 << 20;

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("TLS certificate {path}")]
    Certificate {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("TLS certificate {path}: no PEM certificate in the file")]
    NoCertificate { path: PathBuf },
    #[error("TLS key {path}")]
    Key {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("TLS configuration")]
    Tls(#[source] rustls::Error),
}

/// The routes.
pub fn router(scheduler: Arc<Scheduler>) -> Router {
    Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/bind", post(bind))
        // Elastic GPU Scheduler's spellings (urlPrefix .../scheduler,
        // prioritizeVerb "priorities"), so its kube-scheduler configuration
        // works unchanged.
        .route("/priorities", post(prioritize))
        .route("/scheduler/filter", post(filter))
        .route("/scheduler/priorities", post(prioritize))
        .route("/scheduler/prioritize", post(prioritize))
        .route("/scheduler/bind", post(bind))
        .route("/webhook/mutate", post(mutate))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/debug/state", get(debug_state))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(scheduler)
}

fn respond(reply: Reply) -> Response {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from(reply.body),
    )
        .into_response()
}

async fn filter(State(scheduler): State<Arc<Scheduler>>, body: Bytes) -> Response {
    respond(scheduler.filter(&body))
}

async fn prioritize(State(scheduler): State<Arc<Scheduler>>, body: Bytes) -> Response {
    respond(scheduler.prioritize(&body))
}

async fn bind(State(scheduler): State<Arc<Scheduler>>, body: Bytes) -> Response {
    respond(scheduler.bind(&body).await)
}

async fn mutate(State(scheduler): State<Arc<Scheduler>>, body: Bytes) -> Response {
    let config = scheduler.config();
    let reply = crate::webhook::mutate(
        &body,
        &config.scheduler_name,
        &config.resources,
        config.admission,
    );
    respond(Reply {
        status: reply.status,
        body: reply.body,
    })
}

async fn readyz(State(scheduler): State<Arc<Scheduler>>) -> Response {
    if scheduler.ready() {
        (StatusCode::OK, "ok").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "still listing pods and nodes from the Kubernetes API",
        )
            .into_response()
    }
}

async fn debug_state(State(scheduler): State<Arc<Scheduler>>) -> Response {
    respond(scheduler.debug_state())
}

/// Loads a PEM certificate chain and private key for HTTPS.
pub fn tls_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, ServerError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|source| ServerError::Certificate {
            path: cert.to_path_buf(),
            source,
        })?
        .collect::<Result<_, _>>()
        .map_err(|source| ServerError::Certificate {
            path: cert.to_path_buf(),
            source,
        })?;
    if chain.is_empty() {
        return Err(ServerError::NoCertificate {
            path: cert.to_path_buf(),
        });
    }
    let private_key = PrivateKeyDer::from_pem_file(key).map_err(|source| ServerError::Key {
        path: key.to_path_buf(),
        source,
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(ServerError::Tls)?
        .with_no_client_auth()
        .with_single_cert(chain, private_key)
        .map_err(ServerError::Tls)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

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
