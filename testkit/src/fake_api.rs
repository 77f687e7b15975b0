//! A fake Kubernetes API server over real HTTP, for the few faults a real
//! kube-apiserver cannot produce on demand. Everything else is tested
//! against the real one ([`crate::kube::ApiServer`]).
//!
//! The faults, each a knob on [`FakeApi`]:
//!
//! - [`FakeApi::set_list_delay`]: lists answer late, so a client is seen
//!   before its first complete list (the extender decides nothing then);
//! - [`FakeApi::fail_binding`]: the binding subresource refuses a pod with
//!   500 (the extender takes its decision back);
//! - [`FakeApi::set_binding_delay`]: bindings are held, so a client can be
//!   stopped or crashed while one is in flight;
//! - [`FakeApi::touch_before_next_patch`]: another writer changes a pod
//!   between a client's read and its conditional write (a race a real
//!   server only shows by chance);
//! - [`FakeApi::inject_conflicts`]: the next pod patches get 409 Conflict
//!   however current they are (the device plugin retries, then gives up);
//! - [`FakeApi::lose_patch_answers`]: the next pod patches are stored but
//!   answered 503, as by a server stopped between storing and answering
//!   (a real restart hits that moment only by chance).
//!
//! It serves what the extender and the device plugin use: lists (with a
//! `spec.nodeName` field selector) and watch streams of pods, nodes and the
//! node Leases in `kube-node-lease` (label selectors are ignored: the fake
//! holds only the plugins' Leases); create, and JSON merge PATCH, of a
//! Lease; GET and JSON merge PATCH of one pod (`application/merge-patch+json` only,
//! with the `metadata.resourceVersion` precondition) and of one node and
//! its status (unconditional); and the binding subresource. State lives in memory;
//! every write gets the next resource version and a watch event. Lists are
//! never paginated.
//!
//! After every pod write it also checks the protocol's invariant: at most
//! one vGPU pod per node is decided but not fully allocated.

use crate::decisions::{decision_of, node_name_of, pending_entry};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use vgpu_cluster::decision::ALLOCATED_ANNOTATION;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Pod,
    Node,
    Lease,
}

struct WatchEvent {
    rv: u64,
    kind: Kind,
    kind_text: &'static str,
    object: Arc<Value>,
}

#[derive(Default)]
struct Store {
    rv: u64,
    pods: BTreeMap<(String, String), Value>,
    nodes: BTreeMap<String, Value>,
    /// Leases of `kube-node-lease`, by name.
    leases: BTreeMap<String, Value>,
    events: Vec<WatchEvent>,
    next_uid: u64,
    /// Pod → (node of its decision, pending), kept up to date on every write.
    pending_index: HashMap<(String, String), (String, bool)>,
}

/// Counts of what the fake served.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub patches: u64,
    pub conflicts: u64,
    pub bindings: u64,
}

#[derive(Default)]
struct Faults {
    /// Bindings of these pods fail with 500.
    failing_bindings: HashSet<String>,
    /// Every binding waits this long first.
    binding_delay: Duration,
    /// Lists wait this long first.
    list_delay: Duration,
    /// Pods that another client changes (these annotations) just before
    /// the next patch arrives.
    touch_before_patch: HashMap<String, Vec<(String, String)>>,
    /// Pod patches still to refuse with 409.
    conflicts: usize,
    /// Pod patches still to store but answer with 503.
    lost_answers: usize,
}

/// The fake; it serves until the test's runtime ends.
pub struct FakeApi {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    store: Mutex<Store>,
    changed: tokio::sync::watch::Sender<u64>,
    violations: Mutex<Vec<String>>,
    counters: Mutex<Counters>,
    faults: Mutex<Faults>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A `Status` object as the real API server sends it with an error.
fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    let body = json!({
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

fn not_found(what: &str, name: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{what} \"{name}\" not found"),
    )
}

fn ok_json(value: &Value) -> Response {
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        value.to_string(),
    )
        .into_response()
}

fn with_type(object: &Value, kind: Kind) -> Value {
    let mut object = object.clone();
    if let Some(map) = object.as_object_mut() {
        let (api_version, kind) = match kind {
            Kind::Pod => ("v1", "Pod"),
            Kind::Node => ("v1", "Node"),
            Kind::Lease => ("coordination.k8s.io/v1", "Lease"),
        };
        map.insert("apiVersion".into(), json!(api_version));
        map.insert("kind".into(), json!(kind));
    }
    object
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(entries) => {
            if !target.is_object() {
                *target = json!({});
            }
            if let Some(map) = target.as_object_mut() {
                for (key, value) in entries {
                    if value.is_null() {
                        map.remove(key);
                    } else {
                        merge_patch(map.entry(key.clone()).or_insert(Value::Null), value);
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
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query(uri: &Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn key_of(pod: &Value) -> (String, String) {
    (
        pod["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string(),
        pod["metadata"]["name"].as_str().unwrap_or("").to_string(),
    )
}

impl FakeApi {
    /// Starts serving on an ephemeral port of 127.0.0.1.
    pub async fn start() -> Arc<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake API");
        let addr = listener.local_addr().expect("address");
        let api = Arc::new(Self {
            url: format!("http://{addr}"),
            store: Mutex::new(Store {
                rv: 1000,
                ..Store::default()
            }),
            changed: tokio::sync::watch::Sender::new(0),
            violations: Mutex::new(Vec::new()),
            counters: Mutex::new(Counters::default()),
            faults: Mutex::new(Faults::default()),
        });
        let router = Router::new()
            .route("/api/v1/pods", get(list_or_watch_pods))
            .route("/api/v1/nodes", get(list_or_watch_nodes))
            .route("/api/v1/nodes/{name}", get(get_node).patch(patch_node))
            .route(
                "/api/v1/nodes/{name}/status",
                axum::routing::patch(patch_node),
            )
            .route(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                get(list_or_watch_leases).post(create_lease),
            )
            .route(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}",
                axum::routing::patch(patch_lease),
            )
            .route(
                "/api/v1/namespaces/{namespace}/pods/{name}",
                get(get_pod).patch(patch_pod),
            )
            .route(
                "/api/v1/namespaces/{namespace}/pods/{name}/binding",
                post(bind_pod),
            )
            .fallback(|uri: Uri| async move {
                not_found("path", &format!("{uri} (not served by the fake API)"))
            })
            .with_state(api.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        api
    }

    fn record(&self, store: &mut Store, kind: Kind, kind_text: &'static str, object: Value) {
        let rv = store.rv;
        store.events.push(WatchEvent {
            rv,
            kind,
            kind_text,
            object: Arc::new(with_type(&object, kind)),
        });
        self.changed.send_replace(rv);
    }

    fn bump(store: &mut Store, object: &mut Value) -> u64 {
        store.rv += 1;
        object["metadata"]["resourceVersion"] = json!(store.rv.to_string());
        store.rv
    }

    // ---- faults ----

    /// Bindings of the pod named `pod` fail with 500.
    pub fn fail_binding(&self, pod: &str) {
        lock(&self.faults).failing_bindings.insert(pod.to_string());
    }

    /// Every binding waits `delay` before it is carried out.
    pub fn set_binding_delay(&self, delay: Duration) {
        lock(&self.faults).binding_delay = delay;
    }

    /// Every list waits `delay` before it answers.
    pub fn set_list_delay(&self, delay: Duration) {
        lock(&self.faults).list_delay = delay;
    }

    /// Makes another client change `pod`'s annotations just before the
    /// next patch of it arrives (so a patch with a resourceVersion
    /// precondition conflicts).
    pub fn touch_before_next_patch(&self, pod: &str, annotations: &[(&str, &str)]) {
        lock(&self.faults).touch_before_patch.insert(
            pod.to_string(),
            annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
    }

    /// Refuses the next `count` pod patches with 409 Conflict (0: none).
    pub fn inject_conflicts(&self, count: usize) {
        lock(&self.faults).conflicts = count;
    }

    /// Stores the next `count` pod patches but answers them 503 Service
    /// Unavailable.
    pub fn lose_patch_answers(&self, count: usize) {
        lock(&self.faults).lost_answers = count;
    }

    // ---- what was served ----

    pub fn counters(&self) -> Counters {
        lock(&self.counters).clone()
    }

    /// Breaches of "one pending pod per node", one line each.
    pub fn violations(&self) -> Vec<String> {
        lock(&self.violations).clone()
    }

    // ---- the test's own reads and writes ----

    /// Creates or replaces a node; returns its new resource version.
    pub fn put_node(&self, mut node: Value) -> u64 {
        let mut store = lock(&self.store);
        let name = node["metadata"]["name"].as_str().unwrap_or("").to_string();
        let kind_text = if store.nodes.contains_key(&name) {
            "MODIFIED"
        } else {
            node["metadata"]["uid"] = json!(format!("node-uid-{name}"));
            "ADDED"
        };
        let rv = Self::bump(&mut store, &mut node);
        store.nodes.insert(name, node.clone());
        self.record(&mut store, Kind::Node, kind_text, node);
        rv
    }

    /// Creates or replaces a Lease of `kube-node-lease`; returns its new
    /// resource version.
    pub fn put_lease(&self, mut lease: Value) -> u64 {
        let mut store = lock(&self.store);
        let name = lease["metadata"]["name"].as_str().unwrap_or("").to_string();
        lease["metadata"]["namespace"] = json!("kube-node-lease");
        let kind_text = if store.leases.contains_key(&name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let rv = Self::bump(&mut store, &mut lease);
        store.leases.insert(name, lease.clone());
        self.record(&mut store, Kind::Lease, kind_text, lease);
        rv
    }

    /// A node with nothing but its name.
    pub fn add_node(&self, name: &str) -> u64 {
        self.put_node(json!({ "metadata": { "name": name } }))
    }

    /// Deletes a node; returns the resource version of the deletion.
    pub fn delete_node(&self, name: &str) -> Option<u64> {
        let mut store = lock(&self.store);
        let mut node = store.nodes.remove(name)?;
        let rv = Self::bump(&mut store, &mut node);
        self.record(&mut store, Kind::Node, "DELETED", node);
        Some(rv)
    }

    pub fn node(&self, name: &str) -> Option<Value> {
        lock(&self.store).nodes.get(name).cloned()
    }

    pub fn node_names(&self) -> Vec<String> {
        lock(&self.store).nodes.keys().cloned().collect()
    }

    /// Creates a pod (in `default` when it names no namespace), giving it
    /// a UID when it has none; returns it as stored.
    pub fn create_pod(&self, mut pod: Value) -> Value {
        let mut store = lock(&self.store);
        store.next_uid += 1;
        if pod["metadata"]["uid"].as_str().is_none() {
            pod["metadata"]["uid"] = json!(format!(
                "{:08x}-7c1e-4b2a-9d3f-{:012x}",
                store.next_uid, store.next_uid
            ));
        }
        if pod["metadata"]["namespace"].as_str().is_none() {
            pod["metadata"]["namespace"] = json!("default");
        }
        Self::bump(&mut store, &mut pod);
        let key = key_of(&pod);
        store.pods.insert(key.clone(), pod.clone());
        self.record(&mut store, Kind::Pod, "ADDED", pod.clone());
        self.check_invariant(&mut store, &key);
        pod
    }

    /// Changes a pod in place (as another client would); returns it.
    pub fn update_pod(
        &self,
        namespace: &str,
        name: &str,
        change: impl FnOnce(&mut Value),
    ) -> Option<Value> {
        let mut store = lock(&self.store);
        let key = (namespace.to_string(), name.to_string());
        let mut pod = store.pods.get(&key)?.clone();
        change(&mut pod);
        Self::bump(&mut store, &mut pod);
        store.pods.insert(key.clone(), pod.clone());
        self.record(&mut store, Kind::Pod, "MODIFIED", pod.clone());
        self.check_invariant(&mut store, &key);
        Some(pod)
    }

    /// Deletes a pod; returns the resource version of the deletion.
    pub fn delete_pod(&self, namespace: &str, name: &str) -> Option<u64> {
        let mut store = lock(&self.store);
        let key = (namespace.to_string(), name.to_string());
        let mut pod = store.pods.remove(&key)?;
        let rv = Self::bump(&mut store, &mut pod);
        self.record(&mut store, Kind::Pod, "DELETED", pod);
        self.check_invariant(&mut store, &key);
        Some(rv)
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        lock(&self.store)
            .pods
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    pub fn pods(&self) -> Vec<Value> {
        lock(&self.store).pods.values().cloned().collect()
    }

    /// What the device plugin and kubelet do once every GPU container is
    /// served: the allocation record, and the pod runs. Returns the new
    /// resource version.
    pub fn mark_allocated(&self, namespace: &str, name: &str) -> Option<u64> {
        let pod = self.pod(namespace, name)?;
        let decision = decision_of(&pod)?;
        let names: Vec<String> = decision.containers.iter().map(|c| c.name.clone()).collect();
        self.update_pod(namespace, name, |pod| {
            pod["metadata"]["annotations"][ALLOCATED_ANNOTATION] =
                json!(serde_json::to_string(&names).unwrap_or_default());
            pod["status"]["phase"] = json!("Running");
        })
        .and_then(|pod| pod["metadata"]["resourceVersion"].as_str()?.parse().ok())
    }

    /// At most one pod per node decided and not fully allocated. Called
    /// after every write of pod `key`.
    fn check_invariant(&self, store: &mut Store, key: &(String, String)) {
        let entry = store.pods.get(key).and_then(pending_entry);
        let node = match entry {
            Some(entry) => {
                let node = entry.0.clone();
                store.pending_index.insert(key.clone(), entry);
                node
            }
            None => {
                store.pending_index.remove(key);
                return;
            }
        };
        let pending: Vec<&str> = store
            .pending_index
            .iter()
            .filter(|(_, (n, pending))| *pending && *n == node)
            .map(|((_, name), _)| name.as_str())
            .collect();
        if pending.len() > 1 {
            lock(&self.violations).push(format!(
                "node {node} has {} pending pods: {pending:?}",
                pending.len()
            ));
        }
    }
}

async fn list_or_watch_pods(State(api): State<Arc<FakeApi>>, uri: Uri) -> Response {
    list_or_watch(api, Kind::Pod, uri).await
}

async fn list_or_watch_nodes(State(api): State<Arc<FakeApi>>, uri: Uri) -> Response {
    list_or_watch(api, Kind::Node, uri).await
}

async fn list_or_watch_leases(State(api): State<Arc<FakeApi>>, uri: Uri) -> Response {
    list_or_watch(api, Kind::Lease, uri).await
}

/// The Lease `name` as stored, as the API server answers a write.
fn stored_lease(api: &FakeApi, name: &str) -> Response {
    match lock(&api.store).leases.get(name) {
        Some(lease) => ok_json(&with_type(lease, Kind::Lease)),
        None => not_found("leases", name),
    }
}

async fn create_lease(State(api): State<Arc<FakeApi>>, body: Bytes) -> Response {
    let lease: Value = match serde_json::from_slice(&body) {
        Ok(lease) => lease,
        Err(error) => return invalid_patch(error),
    };
    let name = lease["metadata"]["name"].as_str().unwrap_or("").to_string();
    if lock(&api.store).leases.contains_key(&name) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("leases \"{name}\" already exists"),
        );
    }
    api.put_lease(lease);
    stored_lease(&api, &name)
}

async fn patch_lease(
    State(api): State<Arc<FakeApi>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refused) = unless_merge_patch(&headers) {
        return refused;
    }
    let patch: Value = match serde_json::from_slice(&body) {
        Ok(patch) => patch,
        Err(error) => return invalid_patch(error),
    };
    let Some(mut lease) = lock(&api.store).leases.get(&name).cloned() else {
        return not_found("leases", &name);
    };
    merge_patch(&mut lease, &patch);
    api.put_lease(lease);
    stored_lease(&api, &name)
}

/// The node a `spec.nodeName=<node>` field selector asks for, if any.
fn node_selector(params: &HashMap<String, String>) -> Option<String> {
    params
        .get("fieldSelector")?
        .strip_prefix("spec.nodeName=")
        .map(str::to_string)
}

async fn list_or_watch(api: Arc<FakeApi>, kind: Kind, uri: Uri) -> Response {
    let params = query(&uri);
    let on_node = node_selector(&params);
    if params.get("watch").map(String::as_str) == Some("true") {
        let from: u64 = params
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| lock(&api.store).rv);
        return watch(api, kind, from, on_node);
    }
    let delay = lock(&api.faults).list_delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let store = lock(&api.store);
    let items: Vec<Value> = match kind {
        Kind::Pod => store
            .pods
            .values()
            .filter(|pod| on_node.is_none() || node_name_of(pod) == on_node)
            .cloned()
            .collect(),
        Kind::Node => store.nodes.values().cloned().collect(),
        Kind::Lease => store.leases.values().cloned().collect(),
    };
    ok_json(&json!({
        "kind": match kind {
            Kind::Pod => "PodList",
            Kind::Node => "NodeList",
            Kind::Lease => "LeaseList",
        },
        "apiVersion": if kind == Kind::Lease { "coordination.k8s.io/v1" } else { "v1" },
        "metadata": { "resourceVersion": store.rv.to_string() },
        "items": items,
    }))
}

fn watch(api: Arc<FakeApi>, kind: Kind, from: u64, on_node: Option<String>) -> Response {
    let receiver = api.changed.subscribe();
    let stream = futures_util::stream::unfold(
        (api, receiver, from),
        move |(api, mut receiver, mut last)| {
            let on_node = on_node.clone();
            async move {
                loop {
                    receiver.borrow_and_update();
                    let mut chunk = String::new();
                    {
                        let store = lock(&api.store);
                        let start = store.events.partition_point(|e| e.rv <= last);
                        for event in &store.events[start..] {
                            let selected =
                                on_node.is_none() || node_name_of(&event.object) == on_node;
                            if event.kind == kind && selected {
                                chunk.push_str(
                                    &json!({ "type": event.kind_text, "object": &*event.object })
                                        .to_string(),
                                );
                                chunk.push('\n');
                            }
                            last = event.rv;
                        }
                    }
                    if !chunk.is_empty() {
                        return Some((
                            Ok::<Bytes, std::io::Error>(Bytes::from(chunk)),
                            (api, receiver, last),
                        ));
                    }
                    if receiver.changed().await.is_err() {
                        return None;
                    }
                }
            }
        },
    );
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn get_pod(
    State(api): State<Arc<FakeApi>>,
    Path((namespace, name)): Path<(String, String)>,
) -> Response {
    match api.pod(&namespace, &name) {
        Some(pod) => ok_json(&with_type(&pod, Kind::Pod)),
        None => not_found("pods", &name),
    }
}

/// The refusal of a patch that is not a JSON merge patch, if it is not.
fn unless_merge_patch(headers: &HeaderMap) -> Option<Response> {
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    (content_type != "application/merge-patch+json").then(|| {
        status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            &format!("the fake API takes merge patches only, not {content_type:?}"),
        )
    })
}

fn invalid_patch(error: serde_json::Error) -> Response {
    status(
        StatusCode::BAD_REQUEST,
        "BadRequest",
        &format!("invalid patch: {error}"),
    )
}

async fn patch_pod(
    State(api): State<Arc<FakeApi>>,
    Path((namespace, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refused) = unless_merge_patch(&headers) {
        return refused;
    }
    lock(&api.counters).patches += 1;
    let touch = lock(&api.faults).touch_before_patch.remove(&name);
    if let Some(annotations) = touch {
        api.update_pod(&namespace, &name, |pod| {
            for (key, value) in annotations {
                pod["metadata"]["annotations"][key] = json!(value);
            }
        });
    }
    let mut patch: Value = match serde_json::from_slice(&body) {
        Ok(patch) => patch,
        Err(error) => return invalid_patch(error),
    };
    let mut store = lock(&api.store);
    let key = (namespace.clone(), name.clone());
    let mut pod = match store.pods.get(&key) {
        Some(pod) => pod.clone(),
        None => return not_found("pods", &name),
    };
    let injected = {
        let mut faults = lock(&api.faults);
        let injected = faults.conflicts > 0;
        faults.conflicts = faults.conflicts.saturating_sub(1);
        injected
    };
    let stale = patch["metadata"]["resourceVersion"]
        .as_str()
        .is_some_and(|wanted| Some(wanted) != pod["metadata"]["resourceVersion"].as_str());
    if injected || stale {
        lock(&api.counters).conflicts += 1;
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on pods \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
            ),
        );
    }
    if let Some(metadata) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
        metadata.remove("resourceVersion");
    }
    merge_patch(&mut pod, &patch);
    FakeApi::bump(&mut store, &mut pod);
    store.pods.insert(key.clone(), pod.clone());
    api.record(&mut store, Kind::Pod, "MODIFIED", pod.clone());
    api.check_invariant(&mut store, &key);
    let lost = {
        let mut faults = lock(&api.faults);
        let lost = faults.lost_answers > 0;
        faults.lost_answers = faults.lost_answers.saturating_sub(1);
        lost
    };
    if lost {
        return status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the server is shutting down",
        );
    }
    ok_json(&with_type(&pod, Kind::Pod))
}

async fn get_node(State(api): State<Arc<FakeApi>>, Path(name): Path<String>) -> Response {
    match api.node(&name) {
        Some(node) => ok_json(&with_type(&node, Kind::Node)),
        None => not_found("nodes", &name),
    }
}

async fn patch_node(
    State(api): State<Arc<FakeApi>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refused) = unless_merge_patch(&headers) {
        return refused;
    }
    let mut patch: Value = match serde_json::from_slice(&body) {
        Ok(patch) => patch,
        Err(error) => return invalid_patch(error),
    };
    // Unconditional: what the device plugin sends carries no precondition.
    // The status subresource lands here too: the fake keeps one object.
    if let Some(metadata) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
        metadata.remove("resourceVersion");
    }
    let mut store = lock(&api.store);
    let mut node = match store.nodes.get(&name) {
        Some(node) => node.clone(),
        None => return not_found("nodes", &name),
    };
    merge_patch(&mut node, &patch);
    FakeApi::bump(&mut store, &mut node);
    store.nodes.insert(name, node.clone());
    api.record(&mut store, Kind::Node, "MODIFIED", node.clone());
    ok_json(&with_type(&node, Kind::Node))
}

async fn bind_pod(
    State(api): State<Arc<FakeApi>>,
    Path((namespace, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let (delay, fail) = {
        let faults = lock(&api.faults);
        (
            faults.binding_delay,
            faults.failing_bindings.contains(&name),
        )
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    lock(&api.counters).bindings += 1;
    if fail {
        return status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "injected binding failure",
        );
    }
    let binding: Value = match serde_json::from_slice(&body) {
        Ok(binding) => binding,
        Err(error) => {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("invalid binding: {error}"),
            )
        }
    };
    if binding["kind"] != "Binding" || binding["target"]["kind"] != "Node" {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "not a Binding to a Node",
        );
    }
    let Some(target) = binding["target"]["name"].as_str() else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "binding without target",
        );
    };
    let mut store = lock(&api.store);
    let key = (namespace, name.clone());
    let mut pod = match store.pods.get(&key) {
        Some(pod) => pod.clone(),
        None => return not_found("pods", &name),
    };
    if let Some(uid) = binding["metadata"]["uid"].as_str() {
        if pod["metadata"]["uid"].as_str() != Some(uid) {
            return status(
                StatusCode::CONFLICT,
                "Conflict",
                "Precondition failed: UID in precondition does not match",
            );
        }
    }
    if let Some(bound) = node_name_of(&pod) {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            &format!("pod {name} is already assigned to node \"{bound}\""),
        );
    }
    pod["spec"]["nodeName"] = json!(target);
    FakeApi::bump(&mut store, &mut pod);
    store.pods.insert(key.clone(), pod.clone());
    api.record(&mut store, Kind::Pod, "MODIFIED", pod);
    api.check_invariant(&mut store, &key);
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Success","code":201})
            .to_string(),
    )
        .into_response()
}
