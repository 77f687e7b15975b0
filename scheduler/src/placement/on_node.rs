//! Placing a pod on the node kube-scheduler chose, as a bind does: only
//! once the node has no pending pod (decided, not yet allocated by its
//! device plugin), so the plugin always knows which pod an allocation is
//! for.

use crate::placement::claims::{claim_in_use, ClaimInUse};
use crate::placement::fit::packing::Scratch;
use crate::placement::pod_to_place::PodToPlace;
use crate::placement::rejection::Rejection;
use crate::placement::rules::pod_key;
use crate::placement::snapshot::Snapshot;
use k8s_openapi::api::core::v1::Pod;
use thiserror::Error;
use vgpu_cluster::decision::Decision;
use vgpu_cluster::requests::PodRequest;

/// Where a pod stands on its chosen node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OnNode {
    /// Placed: the decision to record.
    Decided(Decision),
    /// The node is still admitting these pods (`namespace/name`); try again
    /// when the state changes.
    Waiting(Vec<String>),
}

/// Why the pod cannot go on its chosen node.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum NodeRefusal {
    #[error(
        "vgpu-scheduler is still listing pods and nodes from the Kubernetes API; retry shortly"
    )]
    NotListed,
    #[error("pod {pod}: {in_use}")]
    ClaimInUse { pod: String, in_use: ClaimInUse },
    #[error("pod {pod} does not fit on node {node} any more: {rejection}")]
    NoLongerFits {
        pod: String,
        node: String,
        rejection: Rejection,
    },
    #[error("node {0} disappeared")]
    NodeGone(String),
}

/// `request` of `pod` on `node`, as the snapshot stands.
pub fn place_on_node(
    snapshot: &Snapshot<'_>,
    node: &str,
    pod: &Pod,
    request: &PodRequest,
) -> Result<OnNode, NodeRefusal> {
    let state = snapshot.state;
    if !state.synced() {
        return Err(NodeRefusal::NotListed);
    }
    let uid = pod.metadata.uid.as_deref().unwrap_or("");
    let pending: Vec<String> = state
        .pending_on(
            node,
            snapshot.now_unix_ms,
            snapshot.rules.unbound_grace,
            uid,
        )
        .into_iter()
        .map(|p| p.key())
        .collect();
    let placing = PodToPlace::of(state, pod);
    if let Some(in_use) = claim_in_use(state, &placing) {
        return Err(NodeRefusal::ClaimInUse {
            pod: pod_key(pod),
            in_use,
        });
    }
    let several_pending = state.node(node).is_some_and(|n| n.several_pending);
    if !pending.is_empty() && !several_pending {
        return Ok(OnNode::Waiting(pending));
    }
    let policy = request.gpu_policy.unwrap_or(snapshot.rules.gpu_policy);
    let mut scratch = Scratch::default();
    match snapshot.evaluate(node, &placing, request, policy, &mut scratch) {
        Ok(_) => snapshot
            .decision(node, request, &scratch)
            .map(OnNode::Decided)
            .ok_or_else(|| NodeRefusal::NodeGone(node.to_string())),
        Err(rejection) => Err(NodeRefusal::NoLongerFits {
            pod: pod_key(pod),
            node: node.to_string(),
            rejection,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::clock::now_unix_ms;
    use crate::cache::fixtures::{annotated, asking_vgpus, decided, node, GIB};
    use crate::cache::state::{listed, ClusterState};
    use crate::placement::rules::Rules;
    use crate::vocabulary::claims::USES_CLAIMS_ANNOTATION;

    fn place(state: &ClusterState, pod: &Pod) -> Result<OnNode, NodeRefusal> {
        let rules = Rules::default();
        let request = rules.parse(pod).expect("request");
        place_on_node(
            &Snapshot::new(state, &rules, now_unix_ms()),
            "n1",
            pod,
            &request,
        )
    }

    #[test]
    fn a_pod_waits_while_its_node_admits_another() {
        let admitting = decided("a", 5, "n1", "GPU-n1-0", true, false);
        let state = listed(vec![node("n1", 2)], vec![admitting]);
        assert_eq!(
            place(&state, &asking_vgpus("p", 1, 1024, 10)),
            Ok(OnNode::Waiting(vec!["ns/a".into()]))
        );
        // Allocated: the next pod is decided, on the emptier GPU.
        let allocated = decided("a", 6, "n1", "GPU-n1-0", true, true);
        let state = listed(vec![node("n1", 2)], vec![allocated]);
        match place(&state, &asking_vgpus("p", 1, 1024, 10)) {
            Ok(OnNode::Decided(decision)) => {
                assert_eq!(decision.node, "n1");
                let grant = &decision.containers[0].devices[0];
                assert_eq!(
                    (grant.uuid.as_str(), grant.memory_bytes, grant.cores_percent),
                    ("GPU-n1-1", GIB, 10)
                );
            }
            other => panic!("expected a decision, got {other:?}"),
        }
    }

    #[test]
    fn a_node_whose_plugin_tells_pending_pods_apart_takes_the_next_pod_at_once() {
        let mut several = node("n1", 1);
        let annotations = several.metadata.annotations.get_or_insert_default();
        let inventory = annotations
            .get(vgpu_cluster::decision::NODE_INVENTORY_ANNOTATION)
            .map(|text| vgpu_cluster::decision::NodeInventory::parse(text).expect("inventory"))
            .expect("inventory annotation");
        let inventory = vgpu_cluster::decision::NodeInventory {
            several_pending: true,
            ..inventory
        };
        annotations.insert(
            vgpu_cluster::decision::NODE_INVENTORY_ANNOTATION.to_string(),
            inventory.to_json(),
        );
        let admitting = decided("a", 5, "n1", "GPU-n1-0", true, false);
        let state = listed(vec![several], vec![admitting]);
        match place(&state, &asking_vgpus("p", 1, 1024, 10)) {
            Ok(OnNode::Decided(decision)) => assert_eq!(decision.node, "n1"),
            other => panic!("expected a decision, got {other:?}"),
        }
        // The pending pod's grant still counts: a pod asking for what only
        // the whole GPU has left does not fit beside it.
        assert!(matches!(
            place(&state, &asking_vgpus("q", 1, 1024, 100)),
            Err(NodeRefusal::NoLongerFits { .. })
        ));
    }

    #[test]
    fn a_pod_that_no_longer_fits_or_whose_claim_is_taken_is_refused() {
        let state = listed(vec![node("n1", 1)], Vec::new());
        match place(&state, &asking_vgpus("p", 2, 1024, 10)) {
            Err(NodeRefusal::NoLongerFits { pod, node, .. }) => {
                assert_eq!((pod.as_str(), node.as_str()), ("ns/p", "n1"))
            }
            other => panic!("expected no room, got {other:?}"),
        }
        let holder = annotated(
            decided("h", 5, "n1", "GPU-n1-0", true, true),
            USES_CLAIMS_ANNOTATION,
            "c",
        );
        let state = listed(vec![node("n1", 1)], vec![holder]);
        let pod = annotated(asking_vgpus("p", 1, 1024, 10), USES_CLAIMS_ANNOTATION, "c");
        assert!(matches!(
            place(&state, &pod),
            Err(NodeRefusal::ClaimInUse { .. })
        ));
        assert_eq!(
            place(&ClusterState::new(), &asking_vgpus("p", 1, 1024, 10)),
            Err(NodeRefusal::NotListed)
        );
    }

    /// `node` with annotation `key: value`.
    fn node_annotated(
        mut node: k8s_openapi::api::core::v1::Node,
        key: &str,
        value: &str,
    ) -> k8s_openapi::api::core::v1::Node {
        node.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(key.into(), value.into());
        node
    }

    fn granted_gpu(outcome: Result<OnNode, NodeRefusal>) -> String {
        match outcome {
            Ok(OnNode::Decided(decision)) => decision.containers[0].devices[0].uuid.clone(),
            other => panic!("expected a decision, got {other:?}"),
        }
    }

    #[test]
    fn a_cordoned_gpu_takes_no_new_pod_and_keeps_what_runs_on_it() {
        use crate::cache::book::Book;
        use vgpu_cluster::cordon::{CORDONED_GPUS_ANNOTATION, HAMI_DEVICE_CORDON_ANNOTATION};
        // GPU 1 is emptier, so an uncordoned node would get the pod there.
        let running = decided("r", 5, "n1", "GPU-n1-0", true, true);
        let mut state = listed(vec![node("n1", 2)], vec![running]);
        assert_eq!(
            granted_gpu(place(&state, &asking_vgpus("p", 1, 1024, 10))),
            "GPU-n1-1"
        );
        // HAMi's spelling cordons GPU 1: the pod goes beside the running one.
        state.apply(node_annotated(
            node("n1", 2),
            HAMI_DEVICE_CORDON_ANNOTATION,
            "GPU-n1-1",
        ));
        assert_eq!(
            granted_gpu(place(&state, &asking_vgpus("p", 1, 1024, 10))),
            "GPU-n1-0"
        );
        // Both cordoned (vgpu's spelling too): refused in words, and the
        // running pod still counts on its GPU.
        let both = node_annotated(
            node_annotated(node("n1", 2), HAMI_DEVICE_CORDON_ANNOTATION, "GPU-n1-1"),
            CORDONED_GPUS_ANNOTATION,
            "GPU-n1-0",
        );
        state.apply(both);
        match place(&state, &asking_vgpus("p", 1, 1024, 10)) {
            Err(NodeRefusal::NoLongerFits { rejection, .. }) => {
                let reason = rejection.to_string();
                assert!(reason.contains("GPU-n1-0 is cordoned"), "{reason}");
                assert!(reason.contains("GPU-n1-1 is cordoned"), "{reason}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert_eq!(state.node("n1").expect("n1").usage[0].memory_bytes, 4 * GIB);
        // Uncordoned: back in service at once.
        state.apply(node("n1", 2));
        assert_eq!(
            granted_gpu(place(&state, &asking_vgpus("p", 1, 1024, 10))),
            "GPU-n1-1"
        );
    }
}
