//! A fake Kubernetes API server over real HTTP, enough for the extender's
//! client (kube-rs) to run unchanged: paginated lists and watch streams of
//! pods and nodes, GET and merge PATCH of pods (with the `resourceVersion`
//! precondition), and the binding subresource. State lives in memory; every
//! write gets the next resource version and a watch event.
//!
//! It also checks the protocol's invariant after every write: at most one
//! vGPU pod per node is decided but not fully allocated.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use vgpu_cluster::decision::{Decision, ALLOCATED_ANNOTATION, DECISION_ANNOTATION};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Pod,
    Node,
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
    events: Vec<WatchEvent>,
    /// Lists being paged through: id → (resource version, objects).
    snapshots: HashMap<u64, (u64, Vec<Value>)>,
    next_snapshot: u64,
    next_uid: u64,
    /// Pod → (node of its decision, pending), kept up to date on every write.
    pending_index: HashMap<(String, String), (String, bool)>,
}

/// Counters of what the fake served.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub lists: u64,
    pub watches: u64,
    pub gets: u64,
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
}

pub struct FakeApi {
    store: Mutex<Store>,
    changed: tokio::sync::watch::Sender<u64>,
    violations: Mutex<Vec<String>>,
    counters: Mutex<Counters>,
    faults: Mutex<Faults>,
    max_pending_seen: Mutex<usize>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

fn status(code: u16, reason: &str, message: &str) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code
    });
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
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
        map.insert("apiVersion".into(), json!("v1"));
        map.insert(
            "kind".into(),
            json!(match kind {
                Kind::Pod => "Pod",
                Kind::Node => "Node",
            }),
        );
    }
    object
}

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
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

fn query(uri: &Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (k.to_string(), v.replace("%3A", ":").replace("%3a", ":"))
        })
        .collect()
}

pub fn decision_of(pod: &Value) -> Option<Decision> {
    pod["metadata"]["annotations"][DECISION_ANNOTATION]
        .as_str()
        .and_then(|t| Decision::parse(t).ok())
}

pub fn allocated_of(pod: &Value) -> Vec<String> {
    pod["metadata"]["annotations"][ALLOCATED_ANNOTATION]
        .as_str()
        .and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or_default()
}

pub fn node_name_of(pod: &Value) -> Option<String> {
    pod["spec"]["nodeName"].as_str().map(str::to_string)
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
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            store: Mutex::new(Store {
                rv: 1000,
                ..Store::default()
            }),
            changed: tokio::sync::watch::Sender::new(0),
            violations: Mutex::new(Vec::new()),
            counters: Mutex::new(Counters::default()),
            faults: Mutex::new(Faults::default()),
            max_pending_seen: Mutex::new(0),
        })
    }

    /// Serves on an ephemeral port of 127.0.0.1.
    pub async fn serve(self: &Arc<Self>) -> SocketAddr {
        let router = Router::new()
            .route("/api/v1/pods", get(list_or_watch_pods))
            .route("/api/v1/nodes", get(list_or_watch_nodes))
            .route(
                "/api/v1/namespaces/{namespace}/pods/{name}",
                get(get_pod).patch(patch_pod),
            )
            .route(
                "/api/v1/namespaces/{namespace}/pods/{name}/binding",
                post(bind_pod),
            )
            .with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fake API");
        let addr = listener.local_addr().expect("address");
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        addr
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

    // ---- test-side API ----

    pub fn counters(&self) -> Counters {
        lock(&self.counters).clone()
    }

    pub fn violations(&self) -> Vec<String> {
        lock(&self.violations).clone()
    }

    /// The most pods seen pending on one node at once.
    pub fn max_pending_seen(&self) -> usize {
        *lock(&self.max_pending_seen)
    }

    pub fn fail_binding(&self, pod: &str) {
        lock(&self.faults).failing_bindings.insert(pod.to_string());
    }

    pub fn set_binding_delay(&self, delay: Duration) {
        lock(&self.faults).binding_delay = delay;
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

    pub fn set_list_delay(&self, delay: Duration) {
        lock(&self.faults).list_delay = delay;
    }

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

    pub fn delete_node(&self, name: &str) -> Option<u64> {
        let mut store = lock(&self.store);
        let mut node = store.nodes.remove(name)?;
        let rv = Self::bump(&mut store, &mut node);
        self.record(&mut store, Kind::Node, "DELETED", node);
        Some(rv)
    }

    /// Creates a pod (a UID is assigned when it has none); returns it.
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

    /// Changes a pod in place (as another client would).
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

    pub fn node(&self, name: &str) -> Option<Value> {
        lock(&self.store).nodes.get(name).cloned()
    }

    pub fn nodes(&self) -> Vec<Value> {
        lock(&self.store).nodes.values().cloned().collect()
    }

    pub fn node_names(&self) -> Vec<String> {
        lock(&self.store).nodes.keys().cloned().collect()
    }

    /// What the device plugin does once it has served every GPU container
    /// (the pod then runs); returns the new resource version.
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

    /// At most one pod per node decided and not fully allocated (bound or
    /// not: an unbound one is a bind in flight). Called after every write
    /// of pod `key`.
    fn check_invariant(&self, store: &mut Store, key: &(String, String)) {
        let entry = store.pods.get(key).and_then(|pod| {
            let decision = decision_of(pod)?;
            let deleting = pod["metadata"]["deletionTimestamp"].is_string();
            let elsewhere = node_name_of(pod).is_some_and(|bound| bound != decision.node);
            let pending = !deleting && !elsewhere && !decision.is_complete(&allocated_of(pod));
            Some((decision.node, pending))
        });
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
        {
            let mut max = lock(&self.max_pending_seen);
            *max = (*max).max(pending.len());
        }
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

async fn list_or_watch(api: Arc<FakeApi>, kind: Kind, uri: Uri) -> Response {
    let params = query(&uri);
    if params.get("watch").map(String::as_str) == Some("true") {
        lock(&api.counters).watches += 1;
        let from: u64 = params
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| lock(&api.store).rv);
        return watch(api, kind, from);
    }
    let delay = lock(&api.faults).list_delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    lock(&api.counters).lists += 1;
    let limit: usize = params
        .get("limit")
        .and_then(|v| v.parse().ok())
        .filter(|&l| l > 0)
        .unwrap_or(usize::MAX);
    let mut store = lock(&api.store);
    let (snapshot_id, offset) = match params.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let parsed = token.split_once('-').and_then(|(id, offset)| {
                Some((id.parse::<u64>().ok()?, offset.parse::<usize>().ok()?))
            });
            match parsed {
                Some(parsed) if store.snapshots.contains_key(&parsed.0) => parsed,
                _ => return status(410, "Expired", "continue token expired"),
            }
        }
        None => {
            let items: Vec<Value> = match kind {
                Kind::Pod => store.pods.values().cloned().collect(),
                Kind::Node => store.nodes.values().cloned().collect(),
            };
            let rv = store.rv;
            store.next_snapshot += 1;
            let id = store.next_snapshot;
            store.snapshots.insert(id, (rv, items));
            (id, 0)
        }
    };
    let (rv, objects) = store
        .snapshots
        .get(&snapshot_id)
        .cloned()
        .unwrap_or_default();
    let end = offset.saturating_add(limit).min(objects.len());
    let items: Vec<Value> = objects[offset.min(end)..end].to_vec();
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
    if end < objects.len() {
        metadata["continue"] = json!(format!("{snapshot_id}-{end}"));
    } else {
        store.snapshots.remove(&snapshot_id);
    }
    ok_json(&json!({
        "kind": match kind { Kind::Pod => "PodList", Kind::Node => "NodeList" },
        "apiVersion": "v1",
        "metadata": metadata,
        "items": items,
    }))
}

fn watch(api: Arc<FakeApi>, kind: Kind, from: u64) -> Response {
    let receiver = api.changed.subscribe();
    let stream = futures_util::stream::unfold(
        (api, receiver, from),
        move |(api, mut receiver, mut last)| async move {
            loop {
                receiver.borrow_and_update();
                let mut chunk = String::new();
                {
                    let store = lock(&api.store);
                    let start = store.events.partition_point(|e| e.rv <= last);
                    for event in &store.events[start..] {
                        if event.kind == kind {
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
    lock(&api.counters).gets += 1;
    match api.pod(&namespace, &name) {
        Some(pod) => ok_json(&with_type(&pod, Kind::Pod)),
        None => status(404, "NotFound", &format!("pods \"{name}\" not found")),
    }
}

async fn patch_pod(
    State(api): State<Arc<FakeApi>>,
    Path((namespace, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
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
        Err(error) => return status(400, "BadRequest", &format!("invalid patch: {error}")),
    };
    let mut store = lock(&api.store);
    let key = (namespace.clone(), name.clone());
    let mut pod = match store.pods.get(&key) {
        Some(pod) => pod.clone(),
        None => return status(404, "NotFound", &format!("pods \"{name}\" not found")),
    };
    if let Some(wanted) = patch["metadata"]["resourceVersion"].as_str() {
        let current = pod["metadata"]["resourceVersion"].as_str().unwrap_or("");
        if wanted != current {
            lock(&api.counters).conflicts += 1;
            return status(
                409,
                "Conflict",
                &format!(
                    "Operation cannot be fulfilled on pods \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
                ),
            );
        }
    }
    if let Some(metadata) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
        metadata.remove("resourceVersion");
    }
    merge_patch(&mut pod, &patch);
    FakeApi::bump(&mut store, &mut pod);
    store.pods.insert(key.clone(), pod.clone());
    api.record(&mut store, Kind::Pod, "MODIFIED", pod.clone());
    api.check_invariant(&mut store, &key);
    ok_json(&with_type(&pod, Kind::Pod))
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
        return status(500, "InternalError", "injected binding failure");
    }
    let binding: Value = match serde_json::from_slice(&body) {
        Ok(binding) => binding,
        Err(error) => return status(400, "BadRequest", &format!("invalid binding: {error}")),
    };
    if binding["kind"] != "Binding" || binding["target"]["kind"] != "Node" {
        return status(400, "BadRequest", "not a Binding to a Node");
    }
    let target = match binding["target"]["name"].as_str() {
        Some(target) => target.to_string(),
        None => return status(400, "BadRequest", "binding without target"),
    };
    let mut store = lock(&api.store);
    let key = (namespace, name.clone());
    let mut pod = match store.pods.get(&key) {
        Some(pod) => pod.clone(),
        None => return status(404, "NotFound", &format!("pods \"{name}\" not found")),
    };
    if let Some(uid) = binding["metadata"]["uid"].as_str() {
        if pod["metadata"]["uid"].as_str() != Some(uid) {
            return status(
                409,
                "Conflict",
                "Precondition failed: UID in precondition does not match",
            );
        }
    }
    if let Some(bound) = node_name_of(&pod) {
        return status(
            409,
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
