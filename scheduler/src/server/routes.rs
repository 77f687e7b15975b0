//! The routes: `POST /filter`, `/prioritize`, `/bind`, `/preempt`,
//! `/webhook/mutate`, `/convert`, `GET /healthz`, `/readyz`, `/metrics`,
//! `/debug/state` and nvidia-gpu-scheduler's views; also `POST
//! /priorities` and `/scheduler/{filter,priorities,prioritize,bind}`
//! (Elastic GPU Scheduler's URLs).

use crate::admission::conversion::convert;
use crate::admission::look_up::{look_up, ClaimAnswers, ClaimLookUpError};
use crate::admission::mutate::{claims_to_look_up, mutate};
use crate::extender::reply::Reply;
use crate::extender::Scheduler;
use crate::server::metrics::{content_type, ServerMetrics, Verb};
use crate::server::views::{self, View};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::sync::Arc;
use std::time::Instant;

/// Largest request body accepted (a full `NodeList` of thousands of nodes
/// when the extender is not `nodeCacheCapable`).
pub const MAX_BODY_BYTES: usize = 256 << 20;

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
        .route("/webhook/mutate", post(mutate_pod))
        .route("/convert", post(convert_resources))
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

async fn mutate_pod(State(served): State<Served>, body: Bytes) -> Response {
    let started = Instant::now();
    let config = served.scheduler.config();
    let claims = match (claims_to_look_up(&body), served.scheduler.api()) {
        (Some((namespace, names)), Some(api)) => look_up(api, &namespace, &names).await,
        (Some((_, names)), None) => names
            .into_iter()
            .map(|name| (name, Err(ClaimLookUpError::NoApi)))
            .collect(),
        (None, _) => ClaimAnswers::new(),
    };
    let reply = mutate(
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

async fn convert_resources(State(served): State<Served>, body: Bytes) -> Response {
    let started = Instant::now();
    let reply = convert(&body);
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
            [(header::CONTENT_TYPE, content_type())],
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
