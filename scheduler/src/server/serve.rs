//! The extender's listeners served within its [`Limits`]: the connection
//! limits are [`vgpu_served`]'s, shared with every vgpu endpoint a pod can
//! reach.

use crate::extender::config::Limits;
use axum::Router;
use std::future::Future;
use std::sync::Arc;
use tokio::net::TcpListener;

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
    vgpu_served::serve(listener, router, tls, &limits.connections(), shutdown).await;
}
