//! The HTTP endpoints: `GET /metrics` (Prometheus text format) and
//! `GET /healthz` (200 while the monitor's loop is running), served within
//! connection limits ([`vgpu_served`]): the port is open to every pod of
//! the node.

use crate::shared::Shared;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use std::future::Future;
use std::sync::Arc;
use vgpu_served::ConnectionLimits;

/// The monitor's routes.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(shared)
}

async fn metrics(
    axum::extract::State(shared): axum::extract::State<Arc<Shared>>,
) -> impl IntoResponse {
    // Rendering is CPU work of a few milliseconds at most; it runs on a
    // blocking thread so it never stalls the runtime.
    let rendered = tokio::task::spawn_blocking(move || shared.render()).await;
    match rendered {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, crate::metrics::content_type())],
            body,
        )
            .into_response(),
        Err(error) => {
            tracing::error!(
                error = &error as &dyn std::error::Error,
                "rendering metrics"
            );
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

async fn healthz(
    axum::extract::State(shared): axum::extract::State<Arc<Shared>>,
) -> impl IntoResponse {
    if shared.healthy() {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "monitor loop stalled\n")
    }
}

/// Serves the routes on `listener` within `limits` until `shutdown`
/// completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    limits: &ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) {
    vgpu_served::serve(listener, router(shared), None, limits, shutdown).await;
}
