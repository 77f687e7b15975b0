//! The HTTP(S) server: `POST /filter`, `/prioritize`, `/bind`,
//! `/webhook/mutate`, `GET /healthz`, `/readyz`, `/metrics`, `/debug/state`; also `POST /priorities` and
//! `/scheduler/{filter,priorities,prioritize,bind}` (Elastic GPU
//! Scheduler's URLs).

use crate::admission::look_up::{ClaimAnswers, ClaimLookUpError};
use crate::metrics::{ServerMetrics, Verb};
use crate::scheduler::{Reply, Scheduler};
use crate::views::{self, View};
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
use std::time::{Duration, Instant};
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

/// What every route is served with.
#[derive(Clone)]
struct Served {
    scheduler: Arc<Scheduler>,
    metrics: Arc<ServerMetrics>,
    /// Becomes true when the servers stop: open watches end.
    stopping: tokio::sync::watch::Receiver<bool>,
}

/// The routes; `metrics` records each verb's time and is served at
/// `GET /metrics`.
pub fn router(
    scheduler: Arc<Scheduler>,
    metrics: Arc<ServerMetrics>,
    stopping: tokio::sync::watch::Receiver<bool>,
) -> Router {
    Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/bind", post(bind))
        .route("/preempt", post(preempt))
        // Elastic GPU Scheduler's spellings (urlPrefix .../scheduler,
        // prioritizeVerb "priorities"), so its kube-scheduler configuration
        // works unchanged.
        .route("/priorities", post(prioritize))
        .route("/scheduler/filter", post(filter))
        .route("/scheduler/priorities", post(prioritize))
        .route("/scheduler/prioritize", post(prioritize))
        .route("/scheduler/bind", post(bind))
        .route("/scheduler/preempt", post(preempt))
        // nvidia-gpu-scheduler's urlPrefix (.../apis/nvidia-gpu-scheduler/v1/schedule).
        .route("/apis/nvidia-gpu-scheduler/v1/schedule/bind", post(bind))
        .route(
            "/apis/nvidia-gpu-scheduler/v1/schedule/filter",
            post(filter),
        )
        .route(
            "/apis/nvidia-gpu-scheduler/v1/schedule/prioritize",
            post(prioritize),
        )
        .route(
            "/apis/nvidia-gpu-scheduler/v1/schedule/preempt",
            post(preempt),
        )
        .route("/webhook/mutate", post(mutate))
        .route("/convert", post(convert))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(serve_metrics))
        .route("/debug/state", get(debug_state))
        .route("/apis/nvidia-gpu-scheduler/v1/gpupods", get(gpu_pods))
        .route("/apis/nvidia-gpu-scheduler/v1/gpunodes", get(gpu_nodes))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(Served {
            scheduler,
            metrics,
            stopping,
        })
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

async fn filter(State(served): State<Served>, body: Bytes) -> Response {
    let started = Instant::now();
    let reply = served.scheduler.filter(&body);
    served.metrics.observe(Verb::Filter, started.elapsed());
    respond(reply)
}

async fn preempt(State(served): State<Served>, body: Bytes) -> Response {
    let started = Instant::now();
    let reply = served.scheduler.preempt(&body);
    served.metrics.observe(Verb::Preempt, started.elapsed());
    respond(reply)
}

async fn prioritize(State(served): State<Served>, body: Bytes) -> Response {
    let started = Instant::now();
    let reply = served.scheduler.prioritize(&body);
    served.metrics.observe(Verb::Prioritize, started.elapsed());
    respond(reply)
}

async fn bind(State(served): State<Served>, body: Bytes) -> Response {
    let started = Instant::now();
    let reply = served.scheduler.bind(&body).await;
    served.metrics.observe(Verb::Bind, started.elapsed());
    respond(reply)
}

async fn mutate(State(served): State<Served>, body: Bytes) -> Response {
    let started = Instant::now();
    let config = served.scheduler.config();
    let claims = match (
        crate::admission::mutate::claims_to_look_up(&body),
        served.scheduler.api(),
    ) {
        (Some((namespace, names)), Some(api)) => {
            crate::admission::look_up::look_up(api, &namespace, &names).await
        }
        (Some((_, names)), None) => names
            .into_iter()
            .map(|name| (name, Err(ClaimLookUpError::NoApi)))
            .collect(),
        (None, _) => ClaimAnswers::new(),
    };
    let reply = crate::admission::mutate::mutate(
        &body,
        &config.scheduler_name,
        &config.resources,
        &config.admission,
        &claims,
    );
    served.metrics.observe(Verb::Mutate, started.elapsed());
    respond(Reply {
        status: reply.status,
        body: reply.body,
    })
}

async fn convert(State(served): State<Served>, body: Bytes) -> Response {
    let started = Instant::now();
    let reply = crate::admission::conversion::convert(&body);
    served.metrics.observe(Verb::Convert, started.elapsed());
    respond(Reply {
        status: reply.status,
        body: reply.body,
    })
}

async fn readyz(State(served): State<Served>) -> Response {
    if served.scheduler.ready() {
        (StatusCode::OK, "ok").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "still listing pods and nodes from the Kubernetes API",
        )
            .into_response()
    }
}

async fn serve_metrics(State(served): State<Served>) -> Response {
    match served.metrics.render() {
        Ok(text) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, crate::metrics::content_type())],
            Body::from(text),
        )
            .into_response(),
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "rendering /metrics failed"
            );
            (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response()
        }
    }
}

async fn debug_state(State(served): State<Served>) -> Response {
    respond(served.scheduler.debug_state())
}

async fn gpu_pods(State(served): State<Served>, uri: axum::http::Uri) -> Response {
    views::serve(
        View::GpuPods,
        served.scheduler,
        uri.query(),
        served.stopping,
    )
}

async fn gpu_nodes(State(served): State<Served>, uri: axum::http::Uri) -> Response {
    views::serve(
        View::GpuNodes,
        served.scheduler,
        uri.query(),
        served.stopping,
    )
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
