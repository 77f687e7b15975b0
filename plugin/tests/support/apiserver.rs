//! An in-memory Kubernetes API server over real HTTP: just what the plugin
//! uses (list pods by node, patch a pod with a resource-version
//! precondition, get and patch a node), answering with the JSON shapes the
//! real API server sends (objects serialised by k8s-openapi, `Status` on
//! errors, `409 Conflict` on a stale `resourceVersion`).

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::net::TcpListener;

#[derive(Default)]
struct Store {
    resource_version: u64,
    /// (namespace, name) → pod JSON.
    pods: BTreeMap<(String, String), Value>,
    nodes: BTreeMap<String, Value>,
    /// Pod patches still to refuse with a conflict.
    conflicts: usize,
    /// Count of requests per "METHOD path".
    requests: BTreeMap<String, usize>,
}

impl Store {
    fn next_version(&mut self) -> String {
        self.resource_version += 1;
        self.resource_version.to_string()
    }
}

/// The fake API server; dropping it stops it.
pub struct FakeApi {
    pub url: String,
    store: Arc<Mutex<Store>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn status(code: StatusCode, reason: &str, message: String) -> Response<Full<Bytes>> {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    respond(code, &body)
}

fn respond(code: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = code;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(fields) => {
            if !target.is_object() {
                *target = Value::Object(Default::default());
            }
            if let Value::Object(object) = target {
                for (key, value) in fields {
                    if value.is_null() {
                        object.remove(key);
                    } else {
                        merge(object.entry(key.clone()).or_insert(Value::Null), value);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == key).then(|| percent_decode(v))
    })
}

fn handle(
    store: &Mutex<Store>,
    method: &Method,
    path: &str,
    query: Option<&str>,
    content_type: &str,
    body: &[u8],
) -> Response<Full<Bytes>> {
    let mut store = store.lock().unwrap_or_else(|p| p.into_inner());
    *store
        .requests
        .entry(format!("{method} {path}"))
        .or_default() += 1;
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, parts.as_slice()) {
        (&Method::GET, ["api", "v1", "pods"]) => {
            let selector = query_param(query, "fieldSelector");
            let node = selector
                .as_deref()
                .and_then(|s| s.strip_prefix("spec.nodeName="));
            let items: Vec<Value> = store
                .pods
                .values()
                .filter(|pod| match node {
                    Some(node) => pod["spec"]["nodeName"].as_str() == Some(node),
                    None => true,
                })
                .cloned()
                .collect();
            let body = json!({
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": { "resourceVersion": store.resource_version.to_string() },
                "items": items,
            });
            respond(StatusCode::OK, &body)
        }
        (&Method::GET, ["api", "v1", "namespaces", ns, "pods", name]) => {
            match store.pods.get(&(ns.to_string(), name.to_string())) {
                Some(pod) => respond(StatusCode::OK, pod),
                None => status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    format!("pods \"{name}\" not found"),
                ),
            }
        }
        (&Method::PATCH, ["api", "v1", "namespaces", ns, "pods", name]) => {
            if content_type != "application/merge-patch+json" {
                return status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    content_type.to_string(),
                );
            }
            let Ok(mut patch) = serde_json::from_slice::<Value>(body) else {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "patch is not JSON".into(),
                );
            };
            let key = (ns.to_string(), name.to_string());
            let Some(current_version) = store.pods.get(&key).map(|pod| {
                pod["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap_or("")
                    .to_string()
            }) else {
                return status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    format!("pods \"{name}\" not found"),
                );
            };
            let wanted = patch["metadata"]["resourceVersion"]
                .as_str()
                .map(str::to_string);
            if store.conflicts > 0 {
                store.conflicts -= 1;
                return status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    format!("Operation cannot be fulfilled on pods \"{name}\": injected conflict"),
                );
            }
            if wanted.as_ref().is_some_and(|w| *w != current_version) {
                return status(StatusCode::CONFLICT, "Conflict", format!("Operation cannot be fulfilled on pods \"{name}\": the object has been modified; please apply your changes to the latest version and try again"));
            }
            if let Some(meta) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
                meta.remove("resourceVersion");
            }
            let version = store.next_version();
            let pod = store.pods.get_mut(&key).expect("checked above");
            merge(pod, &patch);
            pod["metadata"]["resourceVersion"] = Value::String(version);
            let pod = pod.clone();
            respond(StatusCode::OK, &pod)
        }
        (&Method::GET, ["api", "v1", "nodes", name]) => match store.nodes.get(*name) {
            Some(node) => respond(StatusCode::OK, node),
            None => status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("nodes \"{name}\" not found"),
            ),
        },
        (&Method::PATCH, ["api", "v1", "nodes", name]) => {
            let Ok(patch) = serde_json::from_slice::<Value>(body) else {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "patch is not JSON".into(),
                );
            };
            if !store.nodes.contains_key(*name) {
                return status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    format!("nodes \"{name}\" not found"),
                );
            }
            let version = store.next_version();
            let node = store.nodes.get_mut(*name).expect("checked above");
            merge(node, &patch);
            node["metadata"]["resourceVersion"] = Value::String(version);
            let node = node.clone();
            respond(StatusCode::OK, &node)
        }
        _ => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("{method} {path}: not served by the fake API server"),
        ),
    }
}

impl FakeApi {
    /// Starts serving on a free local port.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let store = Arc::new(Mutex::new(Store::default()));
        let shared = Arc::clone(&store);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let store = Arc::clone(&shared);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                        let store = Arc::clone(&store);
                        async move {
                            let (parts, body) = request.into_parts();
                            let body = body
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            let content_type = parts
                                .headers
                                .get(hyper::header::CONTENT_TYPE)
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                                .to_string();
                            Ok::<_, std::convert::Infallible>(handle(
                                &store,
                                &parts.method,
                                parts.uri.path(),
                                parts.uri.query(),
                                &content_type,
                                &body,
                            ))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { url, store, task }
    }

    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn add_node(&self, name: &str) {
        let mut store = self.store();
        let version = store.next_version();
        let node = Node {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name.into()),
                uid: Some(format!("node-uid-{name}")),
                resource_version: Some(version),
                ..Default::default()
            },
            ..Default::default()
        };
        store
            .nodes
            .insert(name.into(), serde_json::to_value(node).expect("node JSON"));
    }

    /// Stores `pod`, giving it a UID and resource version.
    pub fn add_pod(&self, mut pod: Pod) -> Pod {
        let mut store = self.store();
        let version = store.next_version();
        let meta = &mut pod.metadata;
        meta.namespace.get_or_insert_with(|| "default".into());
        let name = meta.name.clone().expect("pod name");
        meta.uid = Some(format!(
            "{:08x}-0000-4000-8000-{:012x}",
            store.resource_version,
            store.pods.len()
        ));
        meta.resource_version = Some(version);
        let key = (meta.namespace.clone().unwrap_or_default(), name);
        store
            .pods
            .insert(key, serde_json::to_value(&pod).expect("pod JSON"));
        pod
    }

    /// The pod as stored now.
    pub fn pod(&self, namespace: &str, name: &str) -> Pod {
        let store = self.store();
        let value = store
            .pods
            .get(&(namespace.to_string(), name.to_string()))
            .expect("pod exists")
            .clone();
        serde_json::from_value(value).expect("pod parses")
    }

    /// Changes a pod as another client would (new resource version).
    pub fn update_pod(&self, namespace: &str, name: &str, change: impl FnOnce(&mut Pod)) -> Pod {
        let mut pod = self.pod(namespace, name);
        change(&mut pod);
        let mut store = self.store();
        pod.metadata.resource_version = Some(store.next_version());
        store.pods.insert(
            (namespace.to_string(), name.to_string()),
            serde_json::to_value(&pod).expect("pod JSON"),
        );
        pod
    }

    pub fn pod_annotation(&self, namespace: &str, name: &str, key: &str) -> Option<String> {
        self.pod(namespace, name)
            .metadata
            .annotations
            .and_then(|a| a.get(key).cloned())
    }

    pub fn node_annotation(&self, name: &str, key: &str) -> Option<String> {
        let store = self.store();
        store.nodes.get(name)?["metadata"]["annotations"][key]
            .as_str()
            .map(str::to_string)
    }

    /// Refuses the next `count` pod patches with a conflict.
    pub fn inject_conflicts(&self, count: usize) {
        self.store().conflicts = count;
    }

    /// Requests served for "METHOD path".
    pub fn requests(&self, key: &str) -> usize {
        self.store().requests.get(key).copied().unwrap_or(0)
    }
}
