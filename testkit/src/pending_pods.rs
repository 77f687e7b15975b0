//! The vGPU protocol's invariant, checked at every version of every pod the
//! API server stores: at most one pod per node is decided and not fully
//! allocated (bound or not: an unbound one is a bind in flight). A watch
//! of the real server shows every version in order, so a breach between
//! two writes is seen even when a later write repairs it.

use crate::decisions::pending_entry;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// How long [`PendingPods::violations_through`] waits for the watch.
const CATCH_UP: Duration = Duration::from_secs(20);

#[derive(Default)]
struct Seen {
    /// Pod name → (node of its decision, pending).
    pending: HashMap<String, (String, bool)>,
    violations: Vec<String>,
    /// The newest resource version the watch brought.
    newest: u64,
    errors: Vec<String>,
}

impl Seen {
    fn saw(&mut self, pod: &Pod, deleted: bool) {
        let value = serde_json::to_value(pod).unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let version = pod
            .metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        self.newest = self.newest.max(version);
        let entry = if deleted { None } else { pending_entry(&value) };
        let Some(entry) = entry else {
            self.pending.remove(&name);
            return;
        };
        let node = entry.0.clone();
        self.pending.insert(name, entry);
        let mut pending: Vec<&str> = self
            .pending
            .iter()
            .filter(|(_, (n, pending))| *pending && *n == node)
            .map(|(name, _)| name.as_str())
            .collect();
        if pending.len() > 1 {
            pending.sort_unstable();
            self.violations.push(format!(
                "version {version}: node {node} has {} pending pods: {pending:?}",
                pending.len()
            ));
        }
    }
}

/// The watch checking the invariant; it stops when dropped.
pub struct PendingPods {
    seen: Arc<Mutex<Seen>>,
    task: tokio::task::JoinHandle<()>,
}

fn lock(seen: &Mutex<Seen>) -> MutexGuard<'_, Seen> {
    seen.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl PendingPods {
    /// Watches the pods of `namespace`; returns once the first list is in.
    pub async fn watch(client: kube::Client, namespace: &str) -> Self {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let pods = kube::Api::<Pod>::namespaced(client, namespace);
        let (listed, first_list) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(follow(pods, seen.clone(), listed));
        tokio::time::timeout(CATCH_UP, first_list)
            .await
            .expect("the pod watch lists within 20 s")
            .expect("the pod watch runs");
        Self { seen, task }
    }

    /// The breaches seen up to pod version `version` (waiting until the
    /// watch has brought it), one line each.
    pub async fn violations_through(&self, version: u64) -> Vec<String> {
        let deadline = tokio::time::Instant::now() + CATCH_UP;
        loop {
            {
                let seen = lock(&self.seen);
                assert!(
                    seen.errors.is_empty(),
                    "the pod watch failed: {:?}",
                    seen.errors
                );
                if seen.newest >= version {
                    return seen.violations.clone();
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the pod watch did not reach version {version}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for PendingPods {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn follow(
    pods: kube::Api<Pod>,
    seen: Arc<Mutex<Seen>>,
    listed: tokio::sync::oneshot::Sender<()>,
) {
    let mut listed = Some(listed);
    let mut events = watcher::watcher(pods, watcher::Config::default()).boxed();
    while let Some(event) = events.next().await {
        let mut seen = lock(&seen);
        match event {
            // A second list would mean the watch broke and versions may
            // have been missed: a failure of the check, not a pass.
            Ok(Event::Init) if listed.is_none() => {
                seen.errors.push("the watch listed again".into())
            }
            Ok(Event::Init) => {}
            Ok(Event::InitApply(pod) | Event::Apply(pod)) => seen.saw(&pod, false),
            Ok(Event::Delete(pod)) => seen.saw(&pod, true),
            Ok(Event::InitDone) => {
                if let Some(listed) = listed.take() {
                    let _ = listed.send(());
                }
            }
            Err(error) => seen.errors.push(error.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use vgpu_cluster::decision::{
        ContainerDecision, Decision, DeviceGrant, ALLOCATED_ANNOTATION, DECISION_ANNOTATION,
        FORMAT_VERSION,
    };

    fn pod(name: &str, version: u64, node: Option<&str>, allocated: bool) -> Pod {
        let decision = Decision {
            version: FORMAT_VERSION,
            node: "n1".into(),
            decided_unix_ms: 1,
            containers: vec![ContainerDecision {
                name: "main".into(),
                init: false,
                devices: vec![DeviceGrant {
                    uuid: "GPU-1".into(),
                    memory_bytes: 1 << 30,
                    cores_percent: 10,
                    burst_percent: None,
                }],
                priority: None,
            }],
        };
        let mut annotations = json!({ DECISION_ANNOTATION: decision.to_json() });
        if allocated {
            annotations[ALLOCATED_ANNOTATION] = json!("[\"main\"]");
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "resourceVersion": version.to_string(), "annotations": annotations},
            "spec": {"nodeName": node, "containers": [{"name": "main"}]},
        }))
        .expect("pod")
    }

    #[test]
    fn two_pending_pods_on_one_node_are_a_breach_even_if_repaired_later() {
        let mut seen = Seen::default();
        seen.saw(&pod("a", 5, Some("n1"), false), false);
        seen.saw(&pod("a", 6, Some("n1"), true), false);
        seen.saw(&pod("b", 7, None, false), false);
        assert!(seen.violations.is_empty(), "{:?}", seen.violations);
        seen.saw(&pod("c", 8, None, false), false);
        seen.saw(&pod("c", 9, None, false), true);
        assert_eq!(
            seen.violations,
            ["version 8: node n1 has 2 pending pods: [\"b\", \"c\"]"]
        );
        assert_eq!(seen.newest, 9);
    }
}
