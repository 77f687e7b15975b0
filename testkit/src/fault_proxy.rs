//! A fault-injecting HTTP proxy in front of a real kube-apiserver
//! ([`crate::kube::ApiServer`]), for the faults a real server produces
//! only by chance: a client under test talks to the proxy (plain HTTP on
//! loopback), and the proxy forwards each request to the real server with
//! the admin credentials of the upstream client it was given, unless a
//! [`Fault`] matching the request's verb and path says otherwise:
//!
//! - [`Action::Delay`] / [`Action::Hold`]: the request waits (for a time,
//!   or until the test opens a [`Gate`]) before it is forwarded, e.g. lists
//!   held back so that a client is seen before its first complete list,
//!   or a binding in flight while the client is stopped;
//! - [`Action::Refuse`]: the request is answered with an error `Status`
//!   and never reaches the server (a binding refused with 500, a patch
//!   refused with 409 however current it is);
//! - [`Action::ChangeFirst`]: another writer merge-patches the same object
//!   just before the request is forwarded (so a write with a
//!   `resourceVersion` precondition conflicts for real);
//! - [`Action::LoseAnswer`]: the request is forwarded and stored, but its
//!   answer is replaced by 503, as by a server stopped between storing a
//!   write and answering it.
//!
//! Every request is recorded with its verb, path and the status it was
//! answered with, so a test counts what the client did
//! ([`FaultProxy::count`], [`FaultProxy::count_answered`]).
//!
//! Verbs are Kubernetes' own ([`Verb`]): a `GET` of a collection is a
//! list, and with `watch=true` a watch. Paths are matched segment by
//! segment: `*` matches one segment, a final `**` any number.

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Any pod (its object, not its subresources).
pub const ANY_POD: &str = "/api/v1/namespaces/*/pods/*";
/// The `binding` subresource of any pod.
pub const ANY_POD_BINDING: &str = "/api/v1/namespaces/*/pods/*/binding";
/// Anything at all.
pub const ANYTHING: &str = "/**";

/// The `binding` subresource of the pod named `name`, in any namespace.
pub fn pod_binding(name: &str) -> String {
    format!("/api/v1/namespaces/*/pods/{name}/binding")
}

/// The pod `name`, in any namespace.
pub fn pod_named(name: &str) -> String {
    format!("/api/v1/namespaces/*/pods/{name}")
}

/// What a request does, in Kubernetes' terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
    /// A method the API server does not use for resources.
    Other,
}

impl Verb {
    /// The verb of a request for `path` with `method` and `query`.
    pub fn of(method: &Method, path: &str, query: Option<&str>) -> Self {
        match *method {
            Method::GET => {
                let watching = query
                    .unwrap_or("")
                    .split('&')
                    .any(|pair| matches!(pair, "watch=true" | "watch=1" | "watch=True"));
                if watching {
                    Self::Watch
                } else if names_a_collection(path) {
                    Self::List
                } else {
                    Self::Get
                }
            }
            Method::POST => Self::Create,
            Method::PUT => Self::Update,
            Method::PATCH => Self::Patch,
            Method::DELETE => Self::Delete,
            _ => Self::Other,
        }
    }
}

/// Whether `path` names a collection of resources rather than one object
/// (the API server's own rule: after `/api/v1` or `/apis/<group>/<version>`
/// come a resource, or `namespaces/<namespace>/<resource>`, or the
/// namespaces themselves).
fn names_a_collection(path: &str) -> bool {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segments.as_slice() {
        ["api", _version, rest @ ..] => rest,
        ["apis", _group, _version, rest @ ..] => rest,
        _ => return false,
    };
    matches!(rest, [_resource] | ["namespaces", _, _resource])
}

/// Whether `path` matches `pattern` (`*`: one segment; a final `**`: the
/// rest, however long).
pub fn path_matches(pattern: &str, path: &str) -> bool {
    let mut wanted = pattern.split('/').filter(|s| !s.is_empty());
    let mut given = path.split('/').filter(|s| !s.is_empty());
    loop {
        match (wanted.next(), given.next()) {
            (Some("**"), _) => return wanted.next().is_none(),
            (Some(want), Some(have)) if want == "*" || want == have => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// A gate that held requests wait at until the test opens it.
#[derive(Clone, Debug)]
pub struct Gate {
    open: tokio::sync::watch::Sender<bool>,
    /// How many requests have come to the gate.
    arrived: tokio::sync::watch::Sender<usize>,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            open: tokio::sync::watch::Sender::new(false),
            arrived: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl Gate {
    pub fn new() -> Self {
        Self::default()
    }

    /// Lets every held request (and every later one) through.
    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// Waits until a request has come to the gate (and is held there,
    /// unless it was opened).
    pub async fn reached(&self) {
        let mut arrived = self.arrived.subscribe();
        // The sender lives in `self`, so the wait ends only on an arrival.
        let _ = arrived.wait_for(|count| *count > 0).await;
    }

    async fn passed(&self) {
        self.arrived.send_modify(|count| *count += 1);
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|open| *open).await;
    }
}

/// What the proxy does with a request a fault matches.
#[derive(Clone, Debug)]
pub enum Action {
    /// Forwards it after this long.
    Delay(Duration),
    /// Forwards it once the gate is open.
    Hold(Gate),
    /// Answers with this error and never forwards it.
    Refuse {
        code: u16,
        reason: &'static str,
        message: String,
    },
    /// Another writer merge-patches the object at the request's path (for
    /// a pod's `binding`, the pod) with this first; then the request is
    /// forwarded.
    ChangeFirst(serde_json::Value),
    /// Forwards it (the server stores it), then answers 503 in place of
    /// the server's answer.
    LoseAnswer,
}

impl Action {
    /// 409 Conflict, in the real server's words for a stale write.
    pub fn conflict() -> Self {
        Self::Refuse {
            code: 409,
            reason: "Conflict",
            message: "Operation cannot be fulfilled: the object has been modified; \
                      please apply your changes to the latest version and try again \
                      (injected by the fault proxy)"
                .into(),
        }
    }

    /// 500 Internal Server Error.
    pub fn internal_error(message: &str) -> Self {
        Self::Refuse {
            code: 500,
            reason: "InternalError",
            message: message.into(),
        }
    }
}

/// A fault: what to do with the requests of `verb` to paths matching
/// `path`, for every such request or for the next few.
#[derive(Clone, Debug)]
pub struct Fault {
    verb: Verb,
    path: String,
    action: Action,
    /// `None`: every matching request.
    remaining: Option<usize>,
}

impl Fault {
    /// `action` for every request of `verb` to a path matching `path`.
    pub fn new(verb: Verb, path: impl Into<String>, action: Action) -> Self {
        Self {
            verb,
            path: path.into(),
            action,
            remaining: None,
        }
    }

    /// Only for the next `count` matching requests.
    pub fn times(mut self, count: usize) -> Self {
        self.remaining = Some(count);
        self
    }

    fn matches(&self, verb: Verb, path: &str) -> bool {
        self.remaining != Some(0) && self.verb == verb && path_matches(&self.path, path)
    }
}

/// Names an injected fault, to take it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultId(u64);

/// One request the proxy served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exchange {
    pub verb: Verb,
    pub path: String,
    /// The status the client got (for a watch: when the stream began).
    pub status: u16,
}

#[derive(Default)]
struct Book {
    faults: Vec<(FaultId, Fault)>,
    next_id: u64,
    exchanges: Vec<Exchange>,
}

impl Book {
    /// The action of the first fault matching the request, counting it.
    fn fault_for(&mut self, verb: Verb, path: &str) -> Option<Action> {
        let (_, fault) = self
            .faults
            .iter_mut()
            .find(|(_, fault)| fault.matches(verb, path))?;
        if let Some(remaining) = &mut fault.remaining {
            *remaining -= 1;
        }
        Some(fault.action.clone())
    }
}

/// The proxy; it serves until the test's runtime ends.
pub struct FaultProxy {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    upstream: kube::Client,
    book: Mutex<Book>,
}

fn lock(book: &Mutex<Book>) -> MutexGuard<'_, Book> {
    book.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// A `Status` object as the real API server sends it with an error.
fn status(code: u16, reason: &str, message: &str) -> Response {
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16()
    });
    (
        code,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Headers that belong to one connection, not to the request or answer
/// (RFC 9110 §7.6.1), and the length, which the forwarding sets again.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "host",
    "content-length",
];

fn end_to_end(
    headers: &HeaderMap,
) -> impl Iterator<Item = (&axum::http::HeaderName, &HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| !HOP_BY_HOP.contains(&name.as_str()))
}

impl FaultProxy {
    /// Starts serving on an ephemeral port of 127.0.0.1, forwarding through
    /// `upstream` (a client of the real API server).
    pub async fn start(upstream: kube::Client) -> Arc<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fault proxy");
        let address = listener.local_addr().expect("the fault proxy's address");
        let proxy = Arc::new(Self {
            url: format!("http://{address}"),
            upstream,
            book: Mutex::new(Book::default()),
        });
        let router = Router::new().fallback(serve).with_state(proxy.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        proxy
    }

    /// How a client under test reaches the API server through the proxy.
    pub fn source(&self) -> vgpu_cluster::client::ApiSource {
        vgpu_cluster::client::ApiSource::Url(self.url.clone())
    }

    /// Adds a fault; later ones apply only to requests no earlier one
    /// matches.
    pub fn inject(&self, fault: Fault) -> FaultId {
        let mut book = lock(&self.book);
        book.next_id += 1;
        let id = FaultId(book.next_id);
        book.faults.push((id, fault));
        id
    }

    /// Takes a fault back: the requests it matched are forwarded again.
    /// (Requests it holds or delays now go on as they would have.)
    pub fn remove(&self, id: FaultId) {
        lock(&self.book).faults.retain(|(fault, _)| *fault != id);
    }

    /// Every request served so far, in the order they were answered.
    pub fn exchanges(&self) -> Vec<Exchange> {
        lock(&self.book).exchanges.clone()
    }

    /// How many requests of `verb` to paths matching `path` were answered.
    pub fn count(&self, verb: Verb, path: &str) -> usize {
        lock(&self.book)
            .exchanges
            .iter()
            .filter(|e| e.verb == verb && path_matches(path, &e.path))
            .count()
    }

    /// How many of those were answered with `status`.
    pub fn count_answered(&self, verb: Verb, path: &str, status: u16) -> usize {
        lock(&self.book)
            .exchanges
            .iter()
            .filter(|e| e.verb == verb && e.status == status && path_matches(path, &e.path))
            .count()
    }

    fn record(&self, verb: Verb, path: String, status: StatusCode) {
        lock(&self.book).exchanges.push(Exchange {
            verb,
            path,
            status: status.as_u16(),
        });
    }

    /// Sends the request to the real server; its answer streams back (a
    /// watch stays open for as long as both sides keep it).
    async fn forward(
        &self,
        method: Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Response {
        let mut request = axum::http::Request::builder()
            .method(method)
            .uri(path_and_query);
        for (name, value) in end_to_end(headers) {
            request = request.header(name, value);
        }
        let request = match request.body(kube::client::Body::from(body)) {
            Ok(request) => request,
            Err(error) => return status(400, "BadRequest", &format!("fault proxy: {error}")),
        };
        match self.upstream.send(request).await {
            Ok(answer) => {
                let (parts, body) = answer.into_parts();
                let mut response = Response::new(Body::new(body));
                *response.status_mut() = parts.status;
                for (name, value) in end_to_end(&parts.headers) {
                    response.headers_mut().append(name, value.clone());
                }
                response
            }
            Err(error) => status(
                502,
                "ServiceUnavailable",
                &format!("fault proxy: the API server did not answer: {error}"),
            ),
        }
    }

    /// Another writer's merge patch of the object at `path`.
    async fn change(&self, path: &str, patch: &serde_json::Value) -> Result<(), String> {
        let mut headers = HeaderMap::new();
        headers.insert(
            "content-type",
            HeaderValue::from_static("application/merge-patch+json"),
        );
        let body = Bytes::from(patch.to_string());
        let answer = self.forward(Method::PATCH, path, &headers, body).await;
        let code = answer.status();
        if code.is_success() {
            return Ok(());
        }
        let text = axum::body::to_bytes(answer.into_body(), usize::MAX)
            .await
            .unwrap_or_default();
        Err(format!("{code}: {}", String::from_utf8_lossy(&text)))
    }
}

async fn serve(State(proxy): State<Arc<FaultProxy>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_string();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or_else(|| path.clone(), |p| p.as_str().to_string());
    let verb = Verb::of(&parts.method, &path, parts.uri.query());
    let body = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(body) => body,
        Err(error) => return status(400, "BadRequest", &format!("fault proxy: {error}")),
    };
    let forward = || {
        proxy.forward(
            parts.method.clone(),
            &path_and_query,
            &parts.headers,
            body.clone(),
        )
    };
    let fault = lock(&proxy.book).fault_for(verb, &path);
    let response = match fault {
        None => forward().await,
        Some(Action::Delay(delay)) => {
            tokio::time::sleep(delay).await;
            forward().await
        }
        Some(Action::Hold(gate)) => {
            gate.passed().await;
            forward().await
        }
        Some(Action::Refuse {
            code,
            reason,
            message,
        }) => status(code, reason, &message),
        Some(Action::ChangeFirst(patch)) => match proxy
            .change(path.strip_suffix("/binding").unwrap_or(&path), &patch)
            .await
        {
            Ok(()) => forward().await,
            Err(why) => status(
                500,
                "InternalError",
                &format!("fault proxy: the other writer's change of {path} failed: {why}"),
            ),
        },
        Some(Action::LoseAnswer) => {
            // Read the whole answer: the write is stored once it is given.
            let stored = forward().await;
            let _ = axum::body::to_bytes(stored.into_body(), usize::MAX).await;
            status(503, "ServiceUnavailable", "the server is shutting down")
        }
    };
    proxy.record(verb, path, response.status());
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_are_kubernetes_verbs() {
        let cases = [
            (Method::GET, "/api/v1/pods", None, Verb::List),
            (
                Method::GET,
                "/api/v1/pods",
                Some("watch=true&resourceVersion=5"),
                Verb::Watch,
            ),
            (Method::GET, "/api/v1/namespaces/ns/pods", None, Verb::List),
            (Method::GET, "/api/v1/namespaces/ns/pods/p", None, Verb::Get),
            (Method::GET, "/api/v1/namespaces", None, Verb::List),
            (Method::GET, "/api/v1/namespaces/ns", None, Verb::Get),
            (Method::GET, "/api/v1/nodes/n1", None, Verb::Get),
            (
                Method::GET,
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                Some("labelSelector=a%3Db"),
                Verb::List,
            ),
            (
                Method::GET,
                "/apis/elasticgpu.io/v1alpha1/elasticgpus/e",
                None,
                Verb::Get,
            ),
            (Method::GET, "/version", None, Verb::Get),
            (
                Method::POST,
                "/api/v1/namespaces/ns/pods/p/binding",
                None,
                Verb::Create,
            ),
            (
                Method::PATCH,
                "/api/v1/namespaces/ns/pods/p",
                None,
                Verb::Patch,
            ),
            (Method::PUT, "/api/v1/nodes/n1/status", None, Verb::Update),
            (Method::DELETE, "/api/v1/nodes/n1", None, Verb::Delete),
        ];
        for (method, path, query, verb) in cases {
            assert_eq!(
                Verb::of(&method, path, query),
                verb,
                "{method} {path} {query:?}"
            );
        }
    }

    #[test]
    fn paths_match_segment_by_segment() {
        assert!(path_matches(ANY_POD, "/api/v1/namespaces/ns/pods/p"));
        assert!(!path_matches(
            ANY_POD,
            "/api/v1/namespaces/ns/pods/p/binding"
        ));
        assert!(!path_matches(ANY_POD, "/api/v1/namespaces/ns/pods"));
        assert!(path_matches(
            ANY_POD_BINDING,
            "/api/v1/namespaces/ns/pods/p/binding"
        ));
        assert!(path_matches(
            &pod_binding("p"),
            "/api/v1/namespaces/ns/pods/p/binding"
        ));
        assert!(!path_matches(
            &pod_binding("p"),
            "/api/v1/namespaces/ns/pods/q/binding"
        ));
        assert!(path_matches(&pod_named("p"), "/api/v1/namespaces/x/pods/p"));
        assert!(path_matches(ANYTHING, "/api/v1/pods"));
        assert!(path_matches("/api/**", "/api/v1/namespaces/ns/pods/p"));
        assert!(!path_matches("/apis/**", "/api/v1/pods"));
    }

    #[test]
    fn a_counted_fault_runs_out_and_the_first_match_applies() {
        let mut book = Book::default();
        let binding = "/api/v1/namespaces/ns/pods/p/binding";
        let patch = "/api/v1/namespaces/ns/pods/p";
        book.faults.push((
            FaultId(1),
            Fault::new(Verb::Patch, ANY_POD, Action::conflict()).times(2),
        ));
        book.faults.push((
            FaultId(2),
            Fault::new(Verb::Patch, ANYTHING, Action::LoseAnswer),
        ));
        book.faults.push((
            FaultId(3),
            Fault::new(Verb::Create, pod_binding("p"), Action::internal_error("no")),
        ));
        let refused =
            |action: Option<Action>| matches!(action, Some(Action::Refuse { code: 409, .. }));
        assert!(refused(book.fault_for(Verb::Patch, patch)));
        assert!(refused(book.fault_for(Verb::Patch, patch)));
        // The first is spent: the next matching fault applies, every time.
        for _ in 0..3 {
            assert!(matches!(
                book.fault_for(Verb::Patch, patch),
                Some(Action::LoseAnswer)
            ));
        }
        assert!(book.fault_for(Verb::Get, patch).is_none());
        assert!(matches!(
            book.fault_for(Verb::Create, binding),
            Some(Action::Refuse { code: 500, .. })
        ));
        assert!(book
            .fault_for(Verb::Create, "/api/v1/namespaces/ns/pods/q/binding")
            .is_none());
    }
}
