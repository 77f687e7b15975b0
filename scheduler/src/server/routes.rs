//! The routes, and which listener serves which ([`Surface`]):
//!
//! - [`Surface::All`]: `POST /filter`, `/prioritize`, `/bind`,
//!   `/preempt` (also `POST /priorities` and
//!   `/scheduler/{filter,priorities,prioritize,bind,preempt}`, Elastic GPU
//!   Scheduler's URLs, and nvidia-gpu-scheduler's
//!   `/apis/nvidia-gpu-scheduler/v1/schedule/...`), `/webhook/mutate`,
//!   `/convert`, `GET /healthz`, `/readyz`, `/metrics`, `/debug/state` and
//!   nvidia-gpu-scheduler's views. Served on loopback by default: these
//!   bind pods and show every vGPU pod, and kube-scheduler calls them from
//!   the same pod.
//! - [`Surface::Webhooks`]: what the API server calls
//!   (`POST /webhook/mutate`, `/convert`) and the probes (`GET /healthz`,
//!   `/readyz`); the HTTPS port every pod of the cluster can reach.
//! - [`Surface::WebhooksAndCertifiedClients`]: the same, and for a client
//!   whose certificate a client CA signed (`--client-ca`), what
//!   [`Surface::All`] serves besides: a kube-scheduler elsewhere reaches
//!   the verbs over HTTPS, and nobody else does.
//! - [`Surface::Health`]: `GET /healthz`, `/readyz`, `/metrics`, for
//!   kubelet's probes and Prometheus on the pod's own address.
//!
//! Every body is read within the listener's budget and the limits of
//! [`Limits`] ([`super::body`]); filter, prioritize, preempt and the
//! webhooks parse one body at a time per listener, so that what parsing
//! takes (bounded per body by [`crate::bounded`]) is bounded per
//! listener too.

use crate::admission::conversion::convert;
use crate::admission::look_up::{look_up, ClaimAnswers, ClaimLookUpError};
use crate::admission::mutate::{mutate, to_look_up};
use crate::extender::config::Limits;
use crate::extender::reply::{ErrorBody, Reply};
use crate::extender::Scheduler;
use crate::server::body::{read_body, BodyError, Budget, ReadBody};
use crate::server::metrics::{content_type, ServerMetrics, Verb};
use crate::server::tls::ClientCertified;
use crate::server::views::{self, View};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{Semaphore, SemaphorePermit};

/// The largest body of a bind: `ExtenderBindingArgs` is four names of at
/// most 253 characters.
pub const MAX_BIND_BODY_BYTES: usize = 64 << 10;

/// The least a listener's budget of body bytes held at once is: four
/// bodies of the default limit (a larger limit gets one body at a time).
pub const MIN_BODY_BUDGET_BYTES: usize = 32 << 20;

/// Which routes a listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Surface {
    /// Everything: kube-scheduler's verbs, the webhooks, the probes,
    /// metrics, `/debug/state` and the views.
    All,
    /// The webhooks the API server calls, and the probes.
    Webhooks,
    /// The webhooks and the probes for everyone; kube-scheduler's verbs,
    /// `/debug/state` and the views for clients that presented a
    /// certificate a client CA signed ([`ClientCertified`]), `403` for
    /// others.
    WebhooksAndCertifiedClients,
    /// The probes and metrics.
    Health,
}

/// What the routers of every listener share.
#[derive(Clone)]
pub struct Shared {
    scheduler: Arc<Scheduler>,
    metrics: Arc<ServerMetrics>,
    /// Becomes true when the servers stop: open watches end.
    stopping: tokio::sync::watch::Receiver<bool>,
    /// Watches of the views open at once, across listeners.
    watches: Arc<Semaphore>,
}

impl Shared {
    pub fn new(
        scheduler: Arc<Scheduler>,
        metrics: Arc<ServerMetrics>,
        stopping: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        let watches = Arc::new(Semaphore::new(scheduler.config().limits.max_watches));
        Self {
            scheduler,
            metrics,
            stopping,
            watches,
        }
    }

    /// The extender's own figures.
    pub fn metrics(&self) -> &ServerMetrics {
        &self.metrics
    }

    /// The limits the extender was configured with.
    pub fn limits(&self) -> &Limits {
        &self.scheduler.config().limits
    }
}

/// What every route of one listener is served with.
#[derive(Clone)]
struct Served {
    shared: Shared,
    /// Body bytes held at once by this listener's requests.
    budget: Budget,
    /// One body parsed at a time on this listener.
    parsing: Arc<Semaphore>,
}

/// Every route ([`Surface::All`]); `metrics` records each verb's time and
/// is served at `GET /metrics`.
pub fn router(
    scheduler: Arc<Scheduler>,
    metrics: Arc<ServerMetrics>,
    stopping: tokio::sync::watch::Receiver<bool>,
) -> Router {
    routes(Surface::All, &Shared::new(scheduler, metrics, stopping))
}

/// The routes of `surface`, with a body budget of their own.
pub fn routes(surface: Surface, shared: &Shared) -> Router {
    let served = Served {
        budget: Budget::new(shared.limits().max_body_bytes.max(MIN_BODY_BUDGET_BYTES)),
        parsing: Arc::new(Semaphore::new(1)),
        shared: shared.clone(),
    };
    let health = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz));
    let webhooks = Router::new()
        .route("/webhook/mutate", post(mutate_pod))
        .route("/convert", post(convert_resources));
    let router = match surface {
        Surface::Health => health.route("/metrics", get(serve_metrics)),
        Surface::Webhooks => health.merge(webhooks),
        Surface::WebhooksAndCertifiedClients => health
            .merge(webhooks)
            .merge(scheduling().route_layer(axum::middleware::from_fn(require_client_certificate))),
        Surface::All => health
            .merge(webhooks)
            .route("/metrics", get(serve_metrics))
            .merge(scheduling()),
    };
    router.with_state(served)
}

/// What only kube-scheduler calls or should see: its verbs, and what the
/// extender knows of every vGPU pod.
fn scheduling() -> Router<Served> {
    verbs()
        .route("/debug/state", get(debug_state))
        .route("/apis/nvidia-gpu-scheduler/v1/gpupods", get(gpu_pods))
        .route("/apis/nvidia-gpu-scheduler/v1/gpunodes", get(gpu_nodes))
}

/// Lets a request through only from a connection whose client presented
/// a certificate a client CA signed.
async fn require_client_certificate(request: Request, next: axum::middleware::Next) -> Response {
    let certified = request
        .extensions()
        .get::<ClientCertified>()
        .is_some_and(|certified| certified.0);
    if certified {
        return next.run(request).await;
    }
    respond(Reply::json(
        StatusCode::FORBIDDEN.as_u16(),
        &ErrorBody {
            error: "this endpoint answers only clients presenting a certificate signed by the \
                    extender's --client-ca"
                .to_string(),
        },
    ))
}

/// kube-scheduler's verbs under every URL prefix answered.
fn verbs() -> Router<Served> {
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
}

impl Served {
    /// Reads a request's body of at most `limit` bytes; the deadline its
    /// handling keeps to.
    async fn body(
        &self,
        request: Request,
        limit: usize,
    ) -> Result<(ReadBody, tokio::time::Instant), Response> {
        let deadline = tokio::time::Instant::now() + self.shared.limits().body_timeout;
        let announced = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.parse::<u64>().ok());
        match read_body(
            request.into_body(),
            announced,
            limit,
            deadline,
            &self.budget,
        )
        .await
        {
            Ok(body) => Ok((body, deadline)),
            Err(error) => Err(refused(&error)),
        }
    }

    /// This listener's turn to parse, waited for until `deadline`.
    async fn parse_turn(
        &self,
        deadline: tokio::time::Instant,
    ) -> Result<SemaphorePermit<'_>, Response> {
        match tokio::time::timeout_at(deadline, self.parsing.acquire()).await {
            Ok(Ok(turn)) => Ok(turn),
            Ok(Err(_)) | Err(_) => Err(refused(&BodyError::Busy)),
        }
    }

    /// A verb answered from its body alone, in one turn of parsing.
    async fn parsed(
        &self,
        request: Request,
        verb: Verb,
        answer: impl FnOnce(&Scheduler, &[u8]) -> Reply,
    ) -> Response {
        let started = Instant::now();
        let (body, deadline) = match self
            .body(request, self.shared.limits().max_body_bytes)
            .await
        {
            Ok(read) => read,
            Err(response) => return response,
        };
        let reply = match self.parse_turn(deadline).await {
            Ok(_turn) => answer(&self.shared.scheduler, &body.bytes),
            Err(response) => return response,
        };
        self.shared.metrics.observe(verb, started.elapsed());
        respond(reply)
    }
}

/// The answer to a body that was not read; the connection is closed after
/// it, as what is left of the body is not read.
fn refused(error: &BodyError) -> Response {
    let status = StatusCode::from_u16(error.status()).unwrap_or(StatusCode::BAD_REQUEST);
    tracing::debug!(error = error as &dyn std::error::Error, "request refused");
    let reply = Reply::json(
        status.as_u16(),
        &ErrorBody {
            error: error.to_string(),
        },
    );
    let mut response = respond(reply);
    response.headers_mut().insert(
        header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    response
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

async fn filter(State(served): State<Served>, request: Request) -> Response {
    served
        .parsed(request, Verb::Filter, |scheduler, body| {
            scheduler.filter(body)
        })
        .await
}

async fn preempt(State(served): State<Served>, request: Request) -> Response {
    served
        .parsed(request, Verb::Preempt, |scheduler, body| {
            scheduler.preempt(body)
        })
        .await
}

async fn prioritize(State(served): State<Served>, request: Request) -> Response {
    served
        .parsed(request, Verb::Prioritize, |scheduler, body| {
            scheduler.prioritize(body)
        })
        .await
}

async fn convert_resources(State(served): State<Served>, request: Request) -> Response {
    served
        .parsed(request, Verb::Convert, |_, body| {
            let reply = convert(body);
            Reply {
                status: reply.status,
                body: reply.body,
            }
        })
        .await
}

async fn bind(State(served): State<Served>, request: Request) -> Response {
    let started = Instant::now();
    // Binds are not parsed in turns: their bodies are small, and a bind
    // may wait seconds for its node.
    let (body, _) = match served.body(request, MAX_BIND_BODY_BYTES).await {
        Ok(read) => read,
        Err(response) => return response,
    };
    let reply = served.shared.scheduler.bind(&body.bytes).await;
    served.shared.metrics.observe(Verb::Bind, started.elapsed());
    respond(reply)
}

async fn mutate_pod(State(served): State<Served>, request: Request) -> Response {
    let started = Instant::now();
    let (body, deadline) = match served
        .body(request, served.shared.limits().max_body_bytes)
        .await
    {
        Ok(read) => read,
        Err(response) => return response,
    };
    let scheduler = &served.shared.scheduler;
    let config = scheduler.config();
    // Parsed in two turns, the claims looked up between them.
    let wanted = match served.parse_turn(deadline).await {
        Ok(_turn) => to_look_up(&body.bytes),
        Err(response) => return response,
    };
    let quota = wanted
        .as_ref()
        .and_then(|(namespace, _)| scheduler.admission_quota(namespace));
    let claims = match (wanted, scheduler.api()) {
        (Some((_, names)), _) if names.is_empty() => ClaimAnswers::new(),
        (Some((namespace, names)), Some(api)) => look_up(api, &namespace, &names).await,
        (Some((_, names)), None) => names
            .into_iter()
            .map(|name| (name, Err(ClaimLookUpError::NoApi)))
            .collect(),
        (None, _) => ClaimAnswers::new(),
    };
    let reply = match served.parse_turn(deadline).await {
        Ok(_turn) => mutate(
            &body.bytes,
            &config.scheduler_name,
            &config.resources,
            &config.admission,
            &claims,
            quota.as_ref(),
        ),
        Err(response) => return response,
    };
    served
        .shared
        .metrics
        .observe(Verb::Mutate, started.elapsed());
    respond(Reply {
        status: reply.status,
        body: reply.body,
    })
}

async fn readyz(State(served): State<Served>) -> Response {
    if served.shared.scheduler.ready() {
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
    let quotas = served.shared.scheduler.quota_use();
    match served.shared.metrics.render(&quotas) {
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
    respond(served.shared.scheduler.debug_state())
}

async fn gpu_pods(State(served): State<Served>, uri: axum::http::Uri) -> Response {
    views::serve(
        View::GpuPods,
        served.shared.scheduler,
        uri.query(),
        served.shared.stopping,
        &served.shared.watches,
    )
}

async fn gpu_nodes(State(served): State<Served>, uri: axum::http::Uri) -> Response {
    views::serve(
        View::GpuNodes,
        served.shared.scheduler,
        uri.query(),
        served.shared.stopping,
        &served.shared.watches,
    )
}
