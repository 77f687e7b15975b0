//! nvidia-gpu-scheduler's watchable views of GPU pods and GPU nodes,
//! answered from the extender's state:
//! `GET /apis/nvidia-gpu-scheduler/v1/gpupods` and `.../gpunodes`.
//!
//! Without `watch`, a list: `{"apiVersion", "kind": "GPUPodList",
//! "metadata": {"resourceVersion"}, "items": [...]}`. With `?watch=true`
//! (or `1`), a stream of watch events as the Kubernetes API server sends
//! them, one JSON object per line, `{"type": "ADDED" | "MODIFIED" |
//! "DELETED", "object": {...}}`: first every current object as `ADDED`,
//! then each change as the state changes. A watch ends after
//! `timeoutSeconds` (default 1800, as the API server's; at most 3600), or
//! when the extender stops; clients watch again, as they do with the API
//! server. At most `--max-watches` are open at once (another is answered
//! 429). Both answer 503 until the extender has listed the cluster once.
//!
//! A `GPUPod` is a pod with a vGPU decision: `spec` holds the node and,
//! per container, the GPUs with memory and compute it was given; `status`
//! whether it is bound, which containers the device plugin has allocated,
//! whether it is pending on its node, finished or being deleted. A
//! `GPUNode` is a node the extender knows: `status` is its `/debug/state`
//! entry (inventory, Lease, GPUs with what they carry, pods).

use crate::cache::clock::now_unix_ms;
use crate::extender::Scheduler;
use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

/// The views' group and version.
pub const API_VERSION: &str = "nvidia-gpu-scheduler/v1";
/// How long a watch lasts unless `timeoutSeconds` says otherwise.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);
/// The longest `timeoutSeconds` honoured: a longer one is cut to it (the
/// client then watches again, as after any timeout), so a deadline never
/// lies beyond what an `Instant` can hold.
pub const MAX_WATCH_TIMEOUT: Duration = Duration::from_secs(3600);

/// Which view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    GpuPods,
    GpuNodes,
}

impl View {
    fn kind(self) -> &'static str {
        match self {
            Self::GpuPods => "GPUPod",
            Self::GpuNodes => "GPUNode",
        }
    }

    /// The view's objects now, by `namespace/name` (pods) or name (nodes).
    pub fn objects(self, scheduler: &Scheduler) -> BTreeMap<String, Value> {
        match self {
            Self::GpuPods => gpu_pods(scheduler),
            Self::GpuNodes => scheduler
                .snapshot()
                .nodes
                .into_iter()
                .map(|(name, node)| {
                    let object = json!({
                        "apiVersion": API_VERSION,
                        "kind": "GPUNode",
                        "metadata": { "name": name },
                        "status": node,
                    });
                    (name, object)
                })
                .collect(),
        }
    }
}

fn gpu_pods(scheduler: &Scheduler) -> BTreeMap<String, Value> {
    let now = now_unix_ms();
    let grace = scheduler.config().unbound_grace;
    let state = scheduler.state().read();
    state
        .pods()
        .map(|pod| {
            let object = json!({
                "apiVersion": API_VERSION,
                "kind": "GPUPod",
                "metadata": { "namespace": pod.namespace, "name": pod.name, "uid": pod.uid },
                "spec": {
                    "nodeName": pod.decision.node,
                    "containers": pod.decision.containers,
                },
                "status": {
                    "bound": pod.node_name.is_some(),
                    // The device plugin's record; a pod kubelet admitted
                    // before the plugin wrote it has none (`admitted`).
                    "allocatedContainers": pod.allocated,
                    "admitted": pod.admitted,
                    "pending": pod.is_pending(now, grace),
                    "finished": pod.terminal,
                    "deleting": pod.deleting,
                },
            });
            (pod.key(), object)
        })
        .collect()
}

/// What a request's query asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Query {
    pub watch: bool,
    pub timeout: Duration,
}

/// A query parameter the views cannot read (400, naming it).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum QueryError {
    #[error("watch={0:?}: use true or false")]
    Watch(String),
    #[error("timeoutSeconds={0:?}: not a whole number of seconds")]
    Timeout(String),
}

/// Reads `watch` and `timeoutSeconds` from a query string; other
/// parameters (`resourceVersion`, selectors) are accepted and ignored.
pub fn parse_query(query: Option<&str>) -> Result<Query, QueryError> {
    let mut parsed = Query {
        watch: false,
        timeout: DEFAULT_WATCH_TIMEOUT,
    };
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "watch" => {
                parsed.watch = match value {
                    "true" | "1" => true,
                    "false" | "0" | "" => false,
                    other => return Err(QueryError::Watch(other.to_string())),
                }
            }
            "timeoutSeconds" => {
                let seconds: u64 = value
                    .parse()
                    .map_err(|_| QueryError::Timeout(value.to_string()))?;
                parsed.timeout = Duration::from_secs(seconds).min(MAX_WATCH_TIMEOUT);
            }
            _ => {}
        }
    }
    Ok(parsed)
}

/// The watch events that take `before` to `after`.
pub fn changes(before: &BTreeMap<String, Value>, after: &BTreeMap<String, Value>) -> Vec<Value> {
    let mut events = Vec::new();
    for (key, object) in after {
        match before.get(key) {
            None => events.push(json!({ "type": "ADDED", "object": object })),
            Some(old) if old != object => {
                events.push(json!({ "type": "MODIFIED", "object": object }))
            }
            Some(_) => {}
        }
    }
    for (key, object) in before {
        if !after.contains_key(key) {
            events.push(json!({ "type": "DELETED", "object": object }));
        }
    }
    events
}

fn lines(events: &[Value]) -> Bytes {
    let mut text = String::new();
    for event in events {
        text.push_str(&event.to_string());
        text.push('\n');
    }
    Bytes::from(text)
}

fn error(status: StatusCode, message: &str) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure",
        "message": message, "code": status.as_u16(),
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Answers `GET` of `view` with `query`; a watch ends when `stopping`
/// becomes true, and holds one of `watches` while it lasts.
pub fn serve(
    view: View,
    scheduler: Arc<Scheduler>,
    query: Option<&str>,
    stopping: watch::Receiver<bool>,
    watches: &Arc<Semaphore>,
) -> Response {
    let query = match parse_query(query) {
        Ok(query) => query,
        Err(why) => return error(StatusCode::BAD_REQUEST, &why.to_string()),
    };
    if !scheduler.state().read().synced() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "vgpu-scheduler is still listing pods and nodes from the Kubernetes API; retry shortly",
        );
    }
    if !query.watch {
        let items: Vec<Value> = view.objects(&scheduler).into_values().collect();
        let version = scheduler.state().read().updates();
        let list = json!({
            "apiVersion": API_VERSION,
            "kind": format!("{}List", view.kind()),
            "metadata": { "resourceVersion": version.to_string() },
            "items": items,
        });
        return (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            list.to_string(),
        )
            .into_response();
    }
    let Ok(slot) = watches.clone().try_acquire_owned() else {
        let open = scheduler.config().limits.max_watches;
        return error(
            StatusCode::TOO_MANY_REQUESTS,
            &format!("vgpu-scheduler serves {open} watches at once, all open now; retry shortly"),
        );
    };
    let stream = watch_stream(view, scheduler, query.timeout, stopping, slot);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// Where a watch stands between two chunks.
struct Watching {
    view: View,
    scheduler: Arc<Scheduler>,
    changes: watch::Receiver<u64>,
    stopping: watch::Receiver<bool>,
    deadline: tokio::time::Instant,
    sent: BTreeMap<String, Value>,
    /// One of the watches open at once, given back when the watch ends.
    _slot: OwnedSemaphorePermit,
}

fn watch_stream(
    view: View,
    scheduler: Arc<Scheduler>,
    timeout: Duration,
    stopping: watch::Receiver<bool>,
    slot: OwnedSemaphorePermit,
) -> impl futures_util::Stream<Item = Result<Bytes, std::convert::Infallible>> {
    let now = tokio::time::Instant::now();
    let watching = Watching {
        view,
        changes: scheduler.state().subscribe(),
        scheduler,
        stopping,
        // Checked: a query cannot make the deadline overflow, whatever
        // it asks for.
        deadline: now.checked_add(timeout).unwrap_or(now + MAX_WATCH_TIMEOUT),
        sent: BTreeMap::new(),
        _slot: slot,
    };
    futures_util::stream::unfold(watching, |mut watching| async move {
        loop {
            // Marked seen before reading, so a change made while the
            // objects are computed wakes the next round.
            watching.changes.borrow_and_update();
            let now = watching.view.objects(&watching.scheduler);
            let events = changes(&watching.sent, &now);
            watching.sent = now;
            if !events.is_empty() {
                return Some((Ok(lines(&events)), watching));
            }
            tokio::select! {
                changed = watching.changes.changed() => if changed.is_err() { return None },
                _ = watching.stopping.wait_for(|stopping| *stopping) => return None,
                () = tokio::time::sleep_until(watching.deadline) => return None,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_read_and_bad_values_named() {
        assert_eq!(
            parse_query(None),
            Ok(Query {
                watch: false,
                timeout: DEFAULT_WATCH_TIMEOUT
            })
        );
        let query = parse_query(Some("watch=true&timeoutSeconds=5&resourceVersion=0"));
        assert_eq!(
            query,
            Ok(Query {
                watch: true,
                timeout: Duration::from_secs(5)
            })
        );
        assert!(parse_query(Some("watch=1")).is_ok_and(|q| q.watch));
        let bad = parse_query(Some("watch=yes"))
            .expect_err("refused")
            .to_string();
        assert!(bad.contains("watch=\"yes\""), "{bad}");
        let bad = parse_query(Some("timeoutSeconds=-1"))
            .expect_err("refused")
            .to_string();
        assert!(bad.contains("timeoutSeconds=\"-1\""), "{bad}");
        // The largest number there is: cut to the longest watch, not an
        // overflow when the deadline is computed.
        let longest = parse_query(Some("watch=true&timeoutSeconds=18446744073709551615"));
        assert_eq!(longest.map(|q| q.timeout), Ok(MAX_WATCH_TIMEOUT));
    }

    #[test]
    fn changes_are_added_modified_and_deleted_events() {
        let before: BTreeMap<String, Value> = [
            ("a".to_string(), json!({ "v": 1 })),
            ("b".to_string(), json!({ "v": 1 })),
            ("c".to_string(), json!({ "v": 1 })),
        ]
        .into();
        let after: BTreeMap<String, Value> = [
            ("a".to_string(), json!({ "v": 1 })),
            ("b".to_string(), json!({ "v": 2 })),
            ("d".to_string(), json!({ "v": 1 })),
        ]
        .into();
        let events = changes(&before, &after);
        let kinds: Vec<(&str, &Value)> = events
            .iter()
            .map(|e| (e["type"].as_str().unwrap_or(""), &e["object"]))
            .collect();
        assert_eq!(
            kinds,
            vec![
                ("MODIFIED", &json!({ "v": 2 })),
                ("ADDED", &json!({ "v": 1 })),
                ("DELETED", &json!({ "v": 1 })),
            ]
        );
        assert!(changes(&after, &after).is_empty());
    }
}
