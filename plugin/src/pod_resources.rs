//! Kubelet's PodResources API: which pod an `Allocate` serves when several
//! are pending ([`kubelet_pods`]), and checking the plugin's records
//! against kubelet's when the plugin starts:
//! kubelet's PodResources API (v1 `List`) says which devices of the
//! plugin's resource each container holds; the pods' decisions and
//! allocation records ([`vgpu_cluster::decision`]) say what the plugin
//! served. After a plugin restart the two should agree; where they do not,
//! the plugin says so, container by container (it changes nothing: the
//! records are the truth the extender counts by, and kubelet's are its
//! own).
//!
//! Kubelet's `List` leaves init containers out (all but sidecars), so they
//! are not checked.

use crate::api::podresources_v1::pod_resources_lister_client::PodResourcesListerClient;
use crate::api::podresources_v1::{ListPodResourcesRequest, ListPodResourcesResponse};
use crate::cluster::Cluster;
use crate::devices::parse_device_id;
use crate::protocol::KubeletPods;
use k8s_openapi::api::core::v1::Pod;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use thiserror::Error;
use tonic::transport::Channel;
use vgpu_cluster::decision::{
    parse_allocated, Decision, FormatError, ALLOCATED_ANNOTATION, DECISION_ANNOTATION,
};

/// Where kubelet serves its PodResources API.
pub const DEFAULT_POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

#[derive(Debug, Error)]
pub enum PodResourcesError {
    #[error("connecting to kubelet's PodResources API at {socket}")]
    Connect {
        socket: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("kubelet's PodResources List")]
    List(#[source] tonic::Status),
}

/// `(namespace, pod, container)`.
type ContainerKey = (String, String, String);

async fn connect(socket: &Path) -> Result<Channel, PodResourcesError> {
    crate::unix_channel::connect_unix(socket)
        .await
        .map_err(|source| PodResourcesError::Connect {
            socket: socket.to_path_buf(),
            source,
        })
}

/// Kubelet's `List` on `channel`.
async fn list_on(channel: Channel) -> Result<ListPodResourcesResponse, PodResourcesError> {
    Ok(PodResourcesListerClient::new(channel)
        .list(ListPodResourcesRequest {})
        .await
        .map_err(PodResourcesError::List)?
        .into_inner())
}

/// Kubelet's `List`, on a connection of its own.
async fn list(socket: &Path) -> Result<ListPodResourcesResponse, PodResourcesError> {
    list_on(connect(socket).await?).await
}

/// The pods of a `List`: those kubelet runs, and the one it is admitting
/// (kubelet takes a pod into its list before admitting it, and admits one
/// pod at a time).
fn listed_pods(list: ListPodResourcesResponse) -> KubeletPods {
    list.pod_resources
        .into_iter()
        .map(|pod| (pod.namespace, pod.name))
        .collect()
}

/// The pods kubelet lists ([`listed_pods`]), on a connection of its own.
pub async fn kubelet_pods(socket: &Path) -> Result<KubeletPods, PodResourcesError> {
    Ok(listed_pods(list(socket).await?))
}

/// Kubelet's PodResources API over one kept connection. Every
/// `GetPreferredAllocation` and `Allocate` asks which pods kubelet lists,
/// while kubelet waits to admit the node's next pod: a connection made for
/// each question added a handshake with kubelet to every admission. A
/// question that fails on the kept connection (kubelet restarted and made
/// its socket anew) is asked once more on a new one.
pub struct KubeletPodsClient {
    socket: PathBuf,
    kept: tokio::sync::Mutex<Option<Channel>>,
}

impl KubeletPodsClient {
    /// Connects on the first question.
    pub fn new(socket: PathBuf) -> Self {
        Self {
            socket,
            kept: tokio::sync::Mutex::new(None),
        }
    }

    /// The pods kubelet lists now ([`listed_pods`]).
    pub async fn kubelet_pods(&self) -> Result<KubeletPods, PodResourcesError> {
        let kept = self.kept.lock().await.clone();
        if let Some(channel) = kept {
            match list_on(channel).await {
                Ok(list) => return Ok(listed_pods(list)),
                Err(error) => tracing::debug!(
                    error = &error as &dyn std::error::Error,
                    "kubelet's PodResources API failed on the kept connection; connecting again"
                ),
            }
        }
        let channel = connect(&self.socket).await?;
        *self.kept.lock().await = Some(channel.clone());
        Ok(listed_pods(list_on(channel).await?))
    }
}

/// How long the start-up probe of kubelet's PodResources API may take.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether kubelet's PodResources API at `socket` answers, so that an
/// `Allocate` among several pending pods can be matched to its pod; says
/// which way it went.
pub async fn tells_pods_apart(socket: &Path) -> bool {
    match tokio::time::timeout(PROBE_TIMEOUT, kubelet_pods(socket)).await {
        Ok(Ok(pods)) => {
            tracing::info!(
                "kubelet's PodResources API at {} lists {} pod(s): this node takes several vGPU pods at once (each Allocate is matched to the pod kubelet is admitting)",
                socket.display(),
                pods.len()
            );
            true
        }
        Ok(Err(error)) => {
            tracing::info!(
                error = &error as &dyn std::error::Error,
                "kubelet's PodResources API is not usable: this node takes one vGPU pod at a time"
            );
            false
        }
        Err(_) => {
            tracing::info!(
                "kubelet's PodResources API at {} did not answer within {:?}: this node takes one vGPU pod at a time",
                socket.display(),
                PROBE_TIMEOUT
            );
            false
        }
    }
}

/// The device IDs of `resource` that kubelet says each container holds
/// (containers holding none are left out).
pub async fn kubelet_holdings(
    socket: &Path,
    resource: &str,
) -> Result<BTreeMap<ContainerKey, Vec<String>>, PodResourcesError> {
    let list = list(socket).await?;
    let mut held = BTreeMap::new();
    for pod in list.pod_resources {
        for container in pod.containers {
            let ids: Vec<String> = container
                .devices
                .into_iter()
                .filter(|devices| devices.resource_name == resource)
                .flat_map(|devices| devices.device_ids)
                .collect();
            if !ids.is_empty() {
                held.insert(
                    (pod.namespace.clone(), pod.name.clone(), container.name),
                    ids,
                );
            }
        }
    }
    Ok(held)
}

/// One container whose records and kubelet's disagree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// `namespace/name`.
    pub pod: String,
    pub container: String,
    pub what: String,
}

/// The outcome of a check.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Containers whose records and kubelet's agree.
    pub agreeing: usize,
    pub findings: Vec<Finding>,
}

/// What the API says of one pod decided for this node.
struct Recorded {
    decision: Decision,
    allocated: Vec<String>,
}

fn recorded(pod: &Pod, node: &str) -> Option<Result<Recorded, FormatError>> {
    let annotations = pod.metadata.annotations.as_ref()?;
    let decision = match Decision::parse(annotations.get(DECISION_ANNOTATION)?) {
        Ok(decision) => decision,
        Err(error) => return Some(Err(error)),
    };
    if decision.node != node {
        return None;
    }
    let allocated = match annotations
        .get(ALLOCATED_ANNOTATION)
        .map(|t| parse_allocated(t))
    {
        None => Vec::new(),
        Some(Ok(allocated)) => allocated,
        Some(Err(error)) => return Some(Err(error)),
    };
    Some(Ok(Recorded {
        decision,
        allocated,
    }))
}

fn finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Compares kubelet's `held` (for the plugin's `resource`) with the
/// records of `pods`, the pods bound to `node`: their annotations, and the
/// containers `served` on the node (pod UID, container: their regions,
/// the plugin's own record, which is all there is of a container served
/// after kubelet had admitted its pod).
pub fn compare(
    held: &BTreeMap<ContainerKey, Vec<String>>,
    pods: &[Pod],
    served: &BTreeSet<(String, String)>,
    node: &str,
    resource: &str,
) -> Report {
    let mut report = Report::default();
    let mut explained: BTreeSet<&ContainerKey> = BTreeSet::new();
    let find = |pod: &str, container: &str, what: String| Finding {
        pod: pod.to_string(),
        container: container.to_string(),
        what,
    };
    for pod in pods {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let key_of = |container: &str| (namespace.clone(), name.clone(), container.to_string());
        let shown = format!("{namespace}/{name}");
        if finished(pod) {
            // Kubelet may list a finished pod's containers until it is
            // removed; nothing is running to disagree about.
            for (key, _) in held.range(key_of("")..) {
                if key.0 != namespace || key.1 != name {
                    break;
                }
                explained.insert(key);
            }
            continue;
        }
        let recorded = match recorded(pod, node) {
            None => continue,
            Some(Err(error)) => {
                report.findings.push(find(
                    &shown,
                    "",
                    format!("its vGPU records are unreadable: {error}"),
                ));
                continue;
            }
            Some(Ok(recorded)) => recorded,
        };
        for container in recorded.decision.containers.iter().filter(|c| !c.init) {
            let key = key_of(&container.name);
            let ids = held.get_key_value(&key);
            if let Some((key, _)) = ids {
                explained.insert(key);
            }
            let is_allocated = recorded.allocated.contains(&container.name)
                || served.contains(&(uid.clone(), container.name.clone()));
            let decided: BTreeSet<&str> =
                container.devices.iter().map(|d| d.uuid.as_str()).collect();
            match (is_allocated, ids.map(|(_, ids)| ids)) {
                (true, Some(ids)) if ids.len() != container.devices.len() => {
                    report.findings.push(find(
                        &shown,
                        &container.name,
                        format!(
                            "kubelet holds {} {resource} device(s) for it ({}), its decision {} GPU(s)",
                            ids.len(),
                            ids.join(", "),
                            container.devices.len()
                        ),
                    ))
                }
                (true, Some(ids)) => {
                    let outside: Vec<&str> = ids
                        .iter()
                        .filter(|id| {
                            parse_device_id(id).is_none_or(|(uuid, _)| !decided.contains(uuid))
                        })
                        .map(String::as_str)
                        .collect();
                    if outside.is_empty() {
                        report.agreeing += 1;
                    } else {
                        report.findings.push(find(
                            &shown,
                            &container.name,
                            format!(
                                "kubelet counts {} against it, outside its decided GPUs {}; \
                                 the container uses the decided ones",
                                outside.join(", "),
                                decided.iter().copied().collect::<Vec<_>>().join(", ")
                            ),
                        ))
                    }
                }
                (true, None) => report.findings.push(find(
                    &shown,
                    &container.name,
                    format!(
                        "recorded as allocated, but kubelet holds no {resource} for it (its admission \
                         failed after the record was written, or kubelet lost its device checkpoint); \
                         its GPUs count as taken until the pod is deleted"
                    ),
                )),
                (false, Some(ids)) => report.findings.push(find(
                    &shown,
                    &container.name,
                    format!(
                        "kubelet holds {} for it, but no allocation is recorded: it did not get its \
                         vGPU limits from this plugin",
                        ids.join(", ")
                    ),
                )),
                // Decided, not admitted yet.
                (false, None) => {}
            }
        }
        // A container kubelet lists for this pod that its decision does
        // not name falls to the loop below.
    }
    for (key, ids) in held {
        if !explained.contains(key) {
            report.findings.push(find(
                &format!("{}/{}", key.0, key.1),
                &key.2,
                format!(
                    "kubelet holds {} for it, but its pod has no vGPU decision for node {node}: \
                     it runs without vGPU limits",
                    ids.join(", ")
                ),
            ));
        }
    }
    report
}

/// Checks the records of the pods on the plugin's node (their annotations
/// and the containers `served`, from the regions on the node) against what
/// kubelet at `socket` says their containers hold of `resource`, and logs
/// the outcome; `None` when it could not be checked (said why).
pub async fn check(
    cluster: &Cluster,
    socket: &Path,
    resource: &str,
    served: &BTreeSet<(String, String)>,
) -> Option<Report> {
    if !socket.exists() {
        tracing::info!(
            "kubelet's PodResources API is not at {}: the allocation records are not checked against kubelet's",
            socket.display()
        );
        return None;
    }
    let held = match kubelet_holdings(socket, resource).await {
        Ok(held) => held,
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "the allocation records are not checked against kubelet's"
            );
            return None;
        }
    };
    let pods = match cluster.pods_on_node().await {
        Ok(pods) => pods,
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "the allocation records are not checked against kubelet's"
            );
            return None;
        }
    };
    let report = compare(&held, &pods, served, cluster.node(), resource);
    for finding in &report.findings {
        tracing::warn!(
            pod = %finding.pod,
            container = %finding.container,
            "PodResources check: {}",
            finding.what
        );
    }
    tracing::info!(
        "PodResources check: {} container(s) agree with kubelet's records, {} differ",
        report.agreeing,
        report.findings.len()
    );
    Some(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::podresources_v1::pod_resources_lister_server::{
        PodResourcesLister, PodResourcesListerServer,
    };
    use crate::api::podresources_v1::PodResources;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio_stream::wrappers::UnixListenerStream;
    use tokio_stream::StreamExt;
    use vgpu_cluster::decision::{ContainerDecision, DeviceGrant, FORMAT_VERSION};

    fn pod(name: &str, node: &str, containers: &[(&str, &[&str])], allocated: &[&str]) -> Pod {
        let decision = Decision {
            version: FORMAT_VERSION,
            node: node.into(),
            decided_unix_ms: 1,
            containers: containers
                .iter()
                .map(|(name, gpus)| ContainerDecision {
                    name: name.to_string(),
                    init: false,
                    devices: gpus
                        .iter()
                        .map(|uuid| DeviceGrant {
                            uuid: uuid.to_string(),
                            memory_bytes: 1 << 30,
                            cores_percent: 10,
                            burst_percent: None,
                        })
                        .collect(),
                    priority: None,
                })
                .collect(),
        };
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                "annotations": {
                    DECISION_ANNOTATION: decision.to_json(),
                    ALLOCATED_ANNOTATION: serde_json::to_string(allocated).expect("JSON"),
                },
            },
            "status": { "phase": "Running" },
        }))
        .expect("pod")
    }

    fn held(entries: &[(&str, &str, &[&str])]) -> BTreeMap<ContainerKey, Vec<String>> {
        entries
            .iter()
            .map(|(pod, container, ids)| {
                (
                    ("ns".to_string(), pod.to_string(), container.to_string()),
                    ids.iter().map(|id| id.to_string()).collect(),
                )
            })
            .collect()
    }

    const R: &str = "nvidia.com/gpu";

    #[test]
    fn records_that_match_kubelets_agree() {
        let pods = [
            pod("a", "n1", &[("main", &["GPU-0"])], &["main"]),
            pod("b", "n1", &[("x", &["GPU-0", "GPU-1"])], &["x"]),
            // Decided, not admitted: kubelet holds nothing yet.
            pod("c", "n1", &[("main", &["GPU-1"])], &[]),
            // Another node's.
            pod("d", "n2", &[("main", &["GPU-9"])], &["main"]),
        ];
        let kubelet = held(&[
            ("a", "main", &["GPU-0::3"]),
            ("b", "x", &["GPU-0::1", "GPU-1::0"]),
        ]);
        let report = compare(&kubelet, &pods, &BTreeSet::new(), "n1", R);
        assert_eq!(report.findings, vec![]);
        assert_eq!(report.agreeing, 2);
    }

    #[test]
    fn a_region_on_the_node_records_a_container_its_annotation_does_not() {
        // Served after kubelet had admitted the pod: no annotation.
        let pods = [pod("late", "n1", &[("main", &["GPU-0"])], &[])];
        let kubelet = held(&[("late", "main", &["GPU-0::2"])]);
        let served = BTreeSet::from([("uid-late".to_string(), "main".to_string())]);
        let report = compare(&kubelet, &pods, &served, "n1", R);
        assert_eq!(report.findings, vec![]);
        assert_eq!(report.agreeing, 1);
        // Another pod's region records nothing of this one.
        let elsewhere = BTreeSet::from([("uid-other".to_string(), "main".to_string())]);
        let report = compare(&kubelet, &pods, &elsewhere, "n1", R);
        assert_eq!(report.agreeing, 0);
        assert!(report.findings[0]
            .what
            .contains("no allocation is recorded"));
    }

    #[test]
    fn every_kind_of_disagreement_is_named() {
        let pods = [
            pod("lost", "n1", &[("main", &["GPU-0"])], &["main"]),
            pod("unrecorded", "n1", &[("main", &["GPU-0"])], &[]),
            pod("count", "n1", &[("main", &["GPU-0", "GPU-1"])], &["main"]),
            pod("elsewhere", "n1", &[("main", &["GPU-0"])], &["main"]),
        ];
        let kubelet = held(&[
            ("unrecorded", "main", &["GPU-0::0"]),
            ("count", "main", &["GPU-0::1"]),
            ("elsewhere", "main", &["GPU-1::4"]),
            ("stranger", "main", &["GPU-1::5"]),
        ]);
        let report = compare(&kubelet, &pods, &BTreeSet::new(), "n1", R);
        assert_eq!(report.agreeing, 0);
        let said: Vec<(String, &str)> = report
            .findings
            .iter()
            .map(|f| (format!("{} {}", f.pod, f.container), f.what.as_str()))
            .collect();
        let has = |who: &str, words: &str| {
            assert!(
                said.iter()
                    .any(|(w, what)| w == who && what.contains(words)),
                "{who}: {words:?} not in {said:#?}"
            )
        };
        has(
            "ns/lost main",
            "recorded as allocated, but kubelet holds no nvidia.com/gpu",
        );
        has(
            "ns/unrecorded main",
            "kubelet holds GPU-0::0 for it, but no allocation is recorded",
        );
        has(
            "ns/count main",
            "kubelet holds 1 nvidia.com/gpu device(s) for it (GPU-0::1), its decision 2",
        );
        has(
            "ns/elsewhere main",
            "kubelet counts GPU-1::4 against it, outside its decided GPUs GPU-0",
        );
        has(
            "ns/stranger main",
            "its pod has no vGPU decision for node n1",
        );
        assert_eq!(said.len(), 5);
    }

    #[test]
    fn finished_pods_and_unreadable_records() {
        let mut done = pod("done", "n1", &[("main", &["GPU-0"])], &["main"]);
        if let Some(status) = done.status.as_mut() {
            status.phase = Some("Succeeded".into());
        }
        let mut broken = pod("broken", "n1", &[("main", &["GPU-0"])], &["main"]);
        if let Some(annotations) = broken.metadata.annotations.as_mut() {
            annotations.insert(ALLOCATED_ANNOTATION.into(), "main".into());
        }
        let kubelet = held(&[("done", "main", &["GPU-0::0"])]);
        let report = compare(&kubelet, &[done, broken], &BTreeSet::new(), "n1", R);
        assert_eq!(report.agreeing, 0);
        assert_eq!(report.findings.len(), 1, "{:?}", report.findings);
        assert!(report.findings[0].what.contains("unreadable"));
    }

    /// Kubelet's PodResources API on a unix socket, counting the
    /// connections it accepts.
    struct FakeKubelet {
        connections: Arc<AtomicUsize>,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
    }

    struct Lister;

    #[tonic::async_trait]
    impl PodResourcesLister for Lister {
        async fn list(
            &self,
            _request: tonic::Request<ListPodResourcesRequest>,
        ) -> Result<tonic::Response<ListPodResourcesResponse>, tonic::Status> {
            Ok(tonic::Response::new(ListPodResourcesResponse {
                pod_resources: vec![PodResources {
                    name: "admitted".into(),
                    namespace: "team".into(),
                    containers: Vec::new(),
                }],
            }))
        }
    }

    fn serve(socket: &Path) -> FakeKubelet {
        let _ = std::fs::remove_file(socket);
        let listener = tokio::net::UnixListener::bind(socket).expect("bind the socket");
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        let incoming = UnixListenerStream::new(listener).map(move |connection| {
            counted.fetch_add(1, Ordering::SeqCst);
            connection
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(Lister))
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stopped.await;
                }),
        );
        FakeKubelet {
            connections,
            stop: Some(stop),
        }
    }

    #[tokio::test]
    async fn keeps_one_connection_and_connects_again_after_kubelet_restarts() {
        let dir = std::env::temp_dir().join(format!("vgpu-pod-resources-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("make the directory");
        let socket = dir.join("kubelet.sock");
        let mut kubelet = serve(&socket);
        let client = KubeletPodsClient::new(socket.clone());
        let expected: KubeletPods = [("team".to_string(), "admitted".to_string())].into();
        for _ in 0..3 {
            assert_eq!(
                client.kubelet_pods().await.expect("kubelet lists"),
                expected
            );
        }
        assert_eq!(kubelet.connections.load(Ordering::SeqCst), 1);

        // Kubelet restarts: the kept connection ends, the socket is made anew.
        if let Some(stop) = kubelet.stop.take() {
            let _ = stop.send(());
        }
        let restarted = serve(&socket);
        assert_eq!(
            client
                .kubelet_pods()
                .await
                .expect("kubelet lists after its restart"),
            expected
        );
        assert_eq!(client.kubelet_pods().await.expect("and again"), expected);
        assert_eq!(restarted.connections.load(Ordering::SeqCst), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
