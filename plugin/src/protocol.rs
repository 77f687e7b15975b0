//! The plugin's side of the protocol in [`vgpu_cluster::decision`]: finding
//! the one pod pending on this node and matching kubelet's requests to its
//! next unallocated containers. Pure functions over pods as the API server
//! returned them; nothing is guessed: anything that does not fit exactly is
//! an error whose text kubelet shows in the pod's events.

use k8s_openapi::api::core::v1::Pod;
use std::borrow::Borrow;
use thiserror::Error;
use vgpu_cluster::decision::{
    kubelet_has_admitted, parse_allocated, ContainerDecision, Decision, FormatError, InventoryGpu,
    ALLOCATED_ANNOTATION, DECISION_ANNOTATION,
};
use vgpu_cluster::requests::{check_grants, GrantError, RequestError, RequestRules};

/// How this node reads what pods ask for ([`RequestRules`], the
/// extender's), with its GPUs (memory percentages and whole GPUs are of
/// what each offers).
#[derive(Clone, Copy, Debug)]
pub struct Reading<'a> {
    pub rules: &'a RequestRules,
    pub gpus: &'a [InventoryGpu],
}

/// The pod whose containers kubelet is admitting.
#[derive(Clone, Debug, PartialEq)]
pub struct PendingPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub decision: Decision,
    /// Containers already allocated, in order.
    pub allocated: Vec<String>,
}

impl PendingPod {
    pub fn display(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

#[derive(Debug, Error)]
pub enum ProtocolError {
    #[error("no pod bound to node {node} is waiting for vGPUs (no pod with a {DECISION_ANNOTATION} annotation for this node has containers left to allocate): the pod was not placed by the vgpu scheduler extender's bind verb. Give it the vgpu schedulerName (the webhook does for pods naming none), and configure any kube-scheduler that calls the extender with bindVerb: bind (nvidia-gpu-scheduler's configuration calls only filter, prioritize and preempt, which records no GPU decision)")]
    NoPendingPod { node: String },
    #[error("{count} pods are waiting for vGPUs on node {node} ({pods}); the request cannot be matched to one of them (kubelet's PodResources API, which names the pod kubelet is admitting, is not in use or listed several)")]
    SeveralPendingPods {
        node: String,
        count: usize,
        pods: String,
    },
    #[error("pod {pod}: {what}")]
    Unusable { pod: String, what: String },
    #[error("pod {pod}: its {DECISION_ANNOTATION} annotation grants what the pod does not ask for, so the vgpu scheduler extender did not write it for this pod; it is refused, never honoured")]
    NotAsked {
        pod: String,
        #[source]
        source: GrantError,
    },
    #[error("pod {pod}: its GPU request cannot be read, so its {DECISION_ANNOTATION} annotation cannot be checked against it")]
    Request {
        pod: String,
        #[source]
        source: RequestError,
    },
    #[error("pod {pod}")]
    Annotation {
        pod: String,
        #[source]
        source: FormatError,
    },
    #[error("kubelet asks for {requested} device(s), but the next container of pod {pod} to allocate, {container}, was given {decided} GPU(s) by the scheduler extender")]
    CountMismatch {
        pod: String,
        container: String,
        requested: usize,
        decided: usize,
    },
    #[error("kubelet asks for {requests} container(s), but pod {pod} has only {left} container(s) left to allocate")]
    TooManyRequests {
        pod: String,
        requests: usize,
        left: usize,
    },
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

fn pod_name(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Whether kubelet can still be admitting `pod` on `node`: bound there, not
/// being deleted, not yet admitted (see [`kubelet_has_admitted`]: kubelet
/// calls `Allocate` for every container while admitting a pod, before it
/// reports any status), and carrying a decision.
fn may_be_admitting(pod: &Pod, node: &str) -> bool {
    let bound_here = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node);
    bound_here
        && pod.metadata.deletion_timestamp.is_none()
        && !admitted_by_kubelet(pod)
        && annotation(pod, DECISION_ANNOTATION).is_some()
}

/// Whether the pod's status, which kubelet writes, shows that kubelet has
/// admitted it ([`kubelet_has_admitted`]).
pub fn admitted_by_kubelet(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref());
    let reports_statuses = status.is_some_and(|s| {
        (s.container_statuses
            .iter()
            .chain(&s.init_container_statuses))
        .any(|v| !v.is_empty())
    });
    kubelet_has_admitted(phase, reports_statuses)
}

/// Reads one candidate; `Ok(None)` when all its containers are allocated.
/// A decision that grants more than the pod asks for is refused: only the
/// extender may write one, and it never does that.
fn read_pending(
    pod: &Pod,
    node: &str,
    reading: Reading<'_>,
) -> Result<Option<PendingPod>, ProtocolError> {
    let name = pod_name(pod);
    let unusable = |what: String| ProtocolError::Unusable {
        pod: name.clone(),
        what,
    };
    let text = annotation(pod, DECISION_ANNOTATION).unwrap_or_default();
    let annotation_error = |source| ProtocolError::Annotation {
        pod: name.clone(),
        source,
    };
    let decision = Decision::parse(text).map_err(annotation_error)?;
    if decision.node != node {
        return Err(unusable(format!(
            "the scheduler extender decided for node {}, but the pod is bound to {node}",
            decision.node
        )));
    }
    let request = reading
        .rules
        .parse(pod)
        .map_err(|source| ProtocolError::Request {
            pod: name.clone(),
            source,
        })?;
    check_grants(&decision, &request, reading.gpus).map_err(|source| ProtocolError::NotAsked {
        pod: name.clone(),
        source,
    })?;
    let allocated = match annotation(pod, ALLOCATED_ANNOTATION) {
        None => Vec::new(),
        Some(text) => parse_allocated(text).map_err(annotation_error)?,
    };
    if decision.is_complete(&allocated) {
        return Ok(None);
    }
    let uid = pod
        .metadata
        .uid
        .clone()
        .ok_or_else(|| unusable("no UID".to_string()))?;
    Ok(Some(PendingPod {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        uid,
        decision,
        allocated,
    }))
}

/// `(namespace, name)` of each pod kubelet lists in its PodResources API.
pub type KubeletPods = std::collections::BTreeSet<(String, String)>;

/// `pod` as [`KubeletPods`] names it.
pub fn kubelet_key(pod: &Pod) -> (String, String) {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// The one pod pending on `node` among `pods`; with `kubelet_lists`, only
/// among the pods kubelet lists. Kubelet lists a pod from the start of its
/// admission and admits one pod at a time, so of the pods pending by their
/// records (decided, bound, not fully allocated), the one it lists is the
/// one it is admitting; the others are bound but not yet taken up by
/// kubelet.
pub fn pending_pod<P: Borrow<Pod>>(
    node: &str,
    pods: &[P],
    reading: Reading<'_>,
    kubelet_lists: Option<&KubeletPods>,
) -> Result<PendingPod, ProtocolError> {
    let listed = |pod: &Pod| kubelet_lists.is_none_or(|listed| listed.contains(&kubelet_key(pod)));
    let mut pending = Vec::new();
    let mut unusable = Vec::new();
    for pod in pods
        .iter()
        .map(Borrow::borrow)
        .filter(|p| may_be_admitting(p, node))
        .filter(|p| listed(p))
    {
        match read_pending(pod, node, reading) {
            Ok(Some(found)) => pending.push(found),
            Ok(None) => {}
            Err(error) => unusable.push(error),
        }
    }
    match (pending.len(), unusable.len()) {
        (1, 0) => Ok(pending.remove(0)),
        (0, 0) => Err(ProtocolError::NoPendingPod {
            node: node.to_string(),
        }),
        (0, 1) => Err(unusable.remove(0)),
        (count, _) => {
            let mut names: Vec<String> = pending.iter().map(PendingPod::display).collect();
            names.extend(unusable.iter().map(|e| match e {
                ProtocolError::Unusable { pod, what } => format!("{pod}: {what}"),
                other => vgpu_cluster::report::with_causes(other),
            }));
            Err(ProtocolError::SeveralPendingPods {
                node: node.to_string(),
                count: count + unusable.len(),
                pods: names.join("; "),
            })
        }
    }
}

/// Matches kubelet's container requests (their device counts, in order) to
/// the pod's next unallocated containers.
pub fn match_requests<'a>(
    pod: &'a PendingPod,
    request_sizes: &[usize],
) -> Result<Vec<&'a ContainerDecision>, ProtocolError> {
    let left: Vec<&ContainerDecision> = pod
        .decision
        .containers
        .iter()
        .filter(|c| !pod.allocated.contains(&c.name))
        .collect();
    if request_sizes.len() > left.len() {
        return Err(ProtocolError::TooManyRequests {
            pod: pod.display(),
            requests: request_sizes.len(),
            left: left.len(),
        });
    }
    let mut matched = Vec::with_capacity(request_sizes.len());
    for (requested, container) in request_sizes.iter().zip(left) {
        if *requested != container.devices.len() {
            return Err(ProtocolError::CountMismatch {
                pod: pod.display(),
                container: container.name.clone(),
                requested: *requested,
                decided: container.devices.len(),
            });
        }
        matched.push(container);
    }
    Ok(matched)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PodSpec, PodStatus, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use vgpu_cluster::decision::{DeviceGrant, FORMAT_VERSION};

    fn decision(node: &str, containers: &[(&str, usize)]) -> Decision {
        Decision {
            version: FORMAT_VERSION,
            node: node.into(),
            decided_unix_ms: 1,
            containers: containers
                .iter()
                .map(|(name, count)| ContainerDecision {
                    name: name.to_string(),
                    init: false,
                    devices: (0..*count)
                        .map(|i| DeviceGrant {
                            uuid: format!("GPU-{i}"),
                            memory_bytes: 1 << 30,
                            cores_percent: 10,
                            burst_percent: None,
                        })
                        .collect(),
                    priority: None,
                })
                .collect(),
        }
    }

    fn gpus() -> Vec<InventoryGpu> {
        (0..4)
            .map(|i| InventoryGpu {
                uuid: format!("GPU-{i}"),
                index: i,
                model: "Tesla T4".into(),
                memory_bytes: 16 << 30,
                offered_memory_bytes: None,
                sm_count: 40,
                split_count: 10,
                numa: None,
                nvlink_island: None,
                healthy: true,
                utilization_percent: None,
            })
            .collect()
    }

    /// Finds the pending pod as a plugin with the default names and
    /// defaults on a node of four GPUs does.
    fn pending(node: &str, pods: &[Pod]) -> Result<PendingPod, ProtocolError> {
        pending_listed(node, pods, None)
    }

    /// The same, narrowed to the pods kubelet lists, `ns/<name>`.
    fn pending_listed(
        node: &str,
        pods: &[Pod],
        listed: Option<&[&str]>,
    ) -> Result<PendingPod, ProtocolError> {
        let gpus = gpus();
        let reading = Reading {
            rules: &RequestRules::default(),
            gpus: &gpus,
        };
        let listed: Option<KubeletPods> = listed.map(|names| {
            names
                .iter()
                .map(|name| ("ns".to_string(), name.to_string()))
                .collect()
        });
        pending_pod(node, pods, reading, listed.as_ref())
    }

    /// A container asking for what [`decision`] grants: `count` vGPUs of
    /// 1 GiB and 10 %.
    fn asking(name: &str, count: usize) -> Container {
        let limits = [
            ("nvidia.com/gpu", count.to_string()),
            ("nvidia.com/gpumem", "1024".to_string()),
            ("nvidia.com/gpucores", "10".to_string()),
        ];
        Container {
            name: name.into(),
            resources: Some(ResourceRequirements {
                limits: Some(
                    limits
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), Quantity(v)))
                        .collect(),
                ),
                ..ResourceRequirements::default()
            }),
            ..Container::default()
        }
    }

    fn pod(name: &str, node: &str, decision: Option<&Decision>, allocated: Option<&str>) -> Pod {
        let containers = decision
            .map(|d| {
                d.containers
                    .iter()
                    .map(|c| asking(&c.name, c.devices.len()))
                    .collect()
            })
            .unwrap_or_default();
        let mut annotations = std::collections::BTreeMap::new();
        if let Some(d) = decision {
            annotations.insert(DECISION_ANNOTATION.to_string(), d.to_json());
        }
        if let Some(a) = allocated {
            annotations.insert(ALLOCATED_ANNOTATION.to_string(), a.to_string());
        }
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(format!("uid-{name}")),
                resource_version: Some("7".into()),
                annotations: Some(annotations),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                containers,
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Pending".into()),
                ..PodStatus::default()
            }),
        }
    }

    #[test]
    fn the_one_pending_pod_is_found_among_others() {
        let d = decision("n1", &[("a", 1), ("b", 2)]);
        let mut running = pod("running", "n1", Some(&decision("n1", &[("x", 1)])), None);
        running.status = Some(PodStatus {
            phase: Some("Running".into()),
            ..PodStatus::default()
        });
        let mut deleting = pod("deleting", "n1", Some(&d), None);
        deleting.metadata.deletion_timestamp = Some(Time(Default::default()));
        let pods = vec![
            running,
            deleting,
            pod("elsewhere", "n2", Some(&d), None),
            pod("plain", "n1", None, None),
            pod("done", "n1", Some(&d), Some(r#"["a","b"]"#)),
            pod("target", "n1", Some(&d), Some(r#"["a"]"#)),
        ];
        let found = pending("n1", &pods).expect("pending");
        assert_eq!(found.name, "target");
        assert_eq!(found.uid, "uid-target");
        assert_eq!(found.allocated, vec!["a"]);
        let matched = match_requests(&found, &[2]).expect("match");
        assert_eq!(matched[0].name, "b");
    }

    #[test]
    fn nothing_is_guessed() {
        let d = decision("n1", &[("a", 1)]);
        assert!(matches!(
            pending("n1", &[]),
            Err(ProtocolError::NoPendingPod { .. })
        ));
        let two = [
            pod("p", "n1", Some(&d), None),
            pod("q", "n1", Some(&d), None),
        ];
        let error = pending("n1", &two).expect_err("two");
        assert!(error.to_string().contains("ns/p"), "{error}");
        assert!(error.to_string().contains("ns/q"), "{error}");

        let wrong_node = [pod("p", "n1", Some(&decision("n9", &[("a", 1)])), None)];
        let error = pending("n1", &wrong_node).expect_err("wrong node");
        assert!(error.to_string().contains("n9"), "{error}");

        let broken = pod("p", "n1", Some(&d), Some("junk"));
        let error = pending("n1", std::slice::from_ref(&broken)).expect_err("broken record");
        let source = std::error::Error::source(&error).map(ToString::to_string);
        assert!(error.to_string().contains("ns/p"), "{error}");
        assert!(
            source
                .as_deref()
                .is_some_and(|s| s.contains(ALLOCATED_ANNOTATION)),
            "{error}: {source:?}"
        );
        // A broken pod next to a good one: both named, neither picked.
        let error =
            pending("n1", &[broken, pod("q", "n1", Some(&d), None)]).expect_err("ambiguous");
        assert!(matches!(
            error,
            ProtocolError::SeveralPendingPods { count: 2, .. }
        ));
    }

    #[test]
    fn of_several_pending_pods_the_one_kubelet_lists_is_the_one_it_admits() {
        let d = decision("n1", &[("a", 1)]);
        let mut running = pod("running", "n1", Some(&d), Some(r#"["a"]"#));
        running.status = Some(PodStatus {
            phase: Some("Running".into()),
            ..PodStatus::default()
        });
        let pods = [
            running,
            pod("p", "n1", Some(&d), None),
            pod("q", "n1", Some(&d), None),
            pod("r", "n1", Some(&d), None),
        ];
        // Kubelet lists the pods it runs and the one it is admitting; the
        // others are bound, not yet taken up.
        let found = pending_listed("n1", &pods, Some(&["running", "q"])).expect("listed");
        assert_eq!(found.name, "q");
        // Listing none of them, or two: nothing is guessed.
        assert!(matches!(
            pending_listed("n1", &pods, Some(&["running"])),
            Err(ProtocolError::NoPendingPod { .. })
        ));
        assert!(matches!(
            pending_listed("n1", &pods, Some(&["p", "r"])),
            Err(ProtocolError::SeveralPendingPods { count: 2, .. })
        ));
        // A pod in another namespace of the same name is not it.
        let other_namespace: KubeletPods = [("other".to_string(), "q".to_string())].into();
        let gpus = gpus();
        let reading = Reading {
            rules: &RequestRules::default(),
            gpus: &gpus,
        };
        assert!(matches!(
            pending_pod("n1", &pods, reading, Some(&other_namespace)),
            Err(ProtocolError::NoPendingPod { .. })
        ));
    }

    #[test]
    fn requests_must_match_the_next_containers_by_count() {
        let d = decision("n1", &[("a", 1), ("b", 2)]);
        let found = pending("n1", &[pod("p", "n1", Some(&d), None)]).expect("pending");
        assert!(matches!(
            match_requests(&found, &[2]),
            Err(ProtocolError::CountMismatch {
                requested: 2,
                decided: 1,
                ..
            })
        ));
        let both = match_requests(&found, &[1, 2]).expect("both");
        assert_eq!(
            both.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert!(matches!(
            match_requests(&found, &[1, 2, 1]),
            Err(ProtocolError::TooManyRequests { .. })
        ));
    }

    #[test]
    fn a_decision_granting_more_than_the_pod_asks_for_is_refused() {
        let d = decision("n1", &[("a", 1)]);
        let mut forged = d.clone();
        forged.containers[0].devices[0].memory_bytes = 0;
        let mut p = pod("p", "n1", Some(&d), None);
        p.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(DECISION_ANNOTATION.into(), forged.to_json());
        let error = pending("n1", &[p.clone()]).expect_err("uncapped");
        assert!(matches!(
            &error,
            ProtocolError::NotAsked {
                source: GrantError::Memory { decided: 0, .. },
                ..
            }
        ));
        let text = vgpu_cluster::report::with_causes(&error);
        assert!(
            text.contains("ns/p") && text.contains("memory 0 bytes"),
            "{text}"
        );
        // Next to a pod of its own, it is named, and neither is picked.
        let error = pending("n1", &[p, pod("q", "n1", Some(&d), None)]).expect_err("two");
        assert!(error.to_string().contains("memory 0 bytes"), "{error}");
        // A pod whose request cannot be read cannot have its decision checked.
        let mut unreadable = pod("r", "n1", Some(&d), None);
        if let Some(spec) = unreadable.spec.as_mut() {
            spec.containers[0]
                .resources
                .get_or_insert_with(Default::default)
                .limits
                .get_or_insert_with(Default::default)
                .insert("nvidia.com/gpumem".into(), Quantity("lots".into()));
        }
        assert!(matches!(
            pending("n1", &[unreadable]),
            Err(ProtocolError::Request { .. })
        ));
    }
}
