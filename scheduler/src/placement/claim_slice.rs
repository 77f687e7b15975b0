//! Where the GPU slice of an Elastic GPU claim goes when it is provisioned
//! before any pod holds it: where a pod holding the claim would go (the
//! GPU and node policies), asking for what the webhook would give that
//! pod's container.

use crate::placement::fit::load::measured_load;
use crate::placement::fit::packing::Scratch;
use crate::placement::pod_to_place::PodToPlace;
use crate::placement::rejection::Rejection;
use crate::placement::rules::{PodRequestError, Rules};
use crate::placement::scores::node_score;
use crate::placement::snapshot::Snapshot;
use crate::vocabulary::claims::{share_amounts, ClaimShare};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use thiserror::Error;
use vgpu_cluster::decision::Decision;
use vgpu_cluster::policy::NodePolicy;
use vgpu_cluster::report::with_causes;
use vgpu_cluster::requests::PodRequest;

/// Why no slice can be placed for a claim now (the claim controller tries
/// again).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum SliceRefusal {
    #[error("vgpu-scheduler is still listing pods, nodes and ElasticGPUs; retried shortly")]
    NotListed,
    #[error("{}", with_causes(.0))]
    Request(PodRequestError),
    #[error("no node has room for it now{}", example.as_deref().map(|e| format!(" (e.g. {e})")).unwrap_or_default())]
    NoRoom {
        /// One node's reason, `node: why`.
        example: Option<String>,
    },
    #[error("node {node} has no room for it any more: {rejection}")]
    NoRoomAnyMore { node: String, rejection: Rejection },
    #[error("node {0} disappeared")]
    NodeGone(String),
}

/// What a pod holding claim `claim` (`namespace/name`) of `share` asks
/// for: the resources the webhook would give its container (named after
/// the claim).
pub fn slice_request(
    rules: &Rules,
    claim: &str,
    share: &ClaimShare,
) -> Result<PodRequest, SliceRefusal> {
    let (namespace, name) = claim.split_once('/').unwrap_or(("", claim));
    let limits = share_amounts(share, &rules.resources)
        .into_iter()
        .map(|(resource, amount)| (resource, Quantity(amount)))
        .collect();
    let pod = Pod {
        metadata: ObjectMeta {
            namespace: Some(namespace.to_string()),
            name: Some(name.to_string()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: name.to_string(),
                resources: Some(ResourceRequirements {
                    limits: Some(limits),
                    ..ResourceRequirements::default()
                }),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    };
    rules.parse(&pod).map_err(SliceRefusal::Request)
}

/// The claim's slice as the pod being placed.
fn slice_holder(claim: &str) -> PodToPlace<'static> {
    PodToPlace {
        uid: "",
        counted_node: None,
        claims: vec![claim.to_string()],
        evicted: Vec::new(),
        quota: None,
    }
}

/// The node a pod holding `claim` would get: the best score among those
/// where `request` fits. `random` is the claim's random number for a node.
pub fn choose_slice_node(
    snapshot: &Snapshot<'_>,
    claim: &str,
    request: &PodRequest,
    random: impl Fn(&str) -> u64,
) -> Result<String, SliceRefusal> {
    let state = snapshot.state;
    if !state.synced() {
        return Err(SliceRefusal::NotListed);
    }
    let holder = slice_holder(claim);
    let node_policy = snapshot.rules.node_policy;
    let mut scratch = Scratch::default();
    let mut best: Option<(f64, &str)> = None;
    let mut example = None;
    let mut names: Vec<&str> = state.nodes().map(|(name, _)| name.as_str()).collect();
    names.sort_unstable();
    for name in names {
        match snapshot.evaluate(
            name,
            &holder,
            request,
            snapshot.rules.gpu_policy,
            &mut scratch,
        ) {
            Ok(load) => {
                let load = match (node_policy, state.node(name)) {
                    (NodePolicy::LoadAware, Some(node)) => measured_load(&node.gpus, &node.usage),
                    _ => load,
                };
                let score = node_score(node_policy, load, random(name));
                if best.is_none_or(|(top, _)| score > top) {
                    best = Some((score, name));
                }
            }
            Err(rejection) => {
                example.get_or_insert_with(|| format!("{name}: {rejection}"));
            }
        }
    }
    match best {
        Some((_, name)) => Ok(name.to_string()),
        None => Err(SliceRefusal::NoRoom { example }),
    }
}

/// The slice of `claim` on `node`, as the snapshot stands.
pub fn place_slice_on(
    snapshot: &Snapshot<'_>,
    node: &str,
    claim: &str,
    request: &PodRequest,
) -> Result<Decision, SliceRefusal> {
    let mut scratch = Scratch::default();
    let policy = snapshot.rules.gpu_policy;
    match snapshot.evaluate(node, &slice_holder(claim), request, policy, &mut scratch) {
        Ok(_) => snapshot
            .decision(node, request, &scratch)
            .ok_or_else(|| SliceRefusal::NodeGone(node.to_string())),
        Err(rejection) => Err(SliceRefusal::NoRoomAnyMore {
            node: node.to_string(),
            rejection,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::clock::now_unix_ms;
    use crate::cache::fixtures::{decided, node, GIB};
    use crate::cache::state::{listed, ClusterState};

    const SHARE: ClaimShare = ClaimShare {
        count: 1,
        cores: Some(20),
        memory_mib: Some(2048),
    };

    #[test]
    fn a_claims_slice_asks_for_what_the_webhook_would_give_its_pod() {
        let request = slice_request(&Rules::default(), "ns/c", &SHARE).expect("request");
        assert_eq!(request.containers.len(), 1);
        let container = &request.containers[0];
        assert_eq!((container.name.as_str(), container.count), ("c", 1));
        assert_eq!(container.cores, 20);
        assert_eq!(container.memory.bytes_on(24 * GIB), 2 * GIB);
    }

    #[test]
    fn the_slice_goes_where_a_pod_would_and_is_written_as_a_decision() {
        // Binpack (the default node policy): the fuller node.
        let state = listed(
            vec![node("n1", 1), node("n2", 1)],
            vec![decided("d", 5, "n2", "GPU-n2-0", true, true)],
        );
        let rules = Rules::default();
        let request = slice_request(&rules, "ns/c", &SHARE).expect("request");
        let snapshot = Snapshot::new(&state, &rules, now_unix_ms());
        let chosen = choose_slice_node(&snapshot, "ns/c", &request, |_| 0).expect("room");
        assert_eq!(chosen, "n2");
        let decision = place_slice_on(&snapshot, &chosen, "ns/c", &request).expect("placed");
        assert_eq!(decision.node, "n2");
        let grant = &decision.containers[0].devices[0];
        assert_eq!(
            (grant.uuid.as_str(), grant.memory_bytes, grant.cores_percent),
            ("GPU-n2-0", 2 * GIB, 20)
        );
    }

    #[test]
    fn no_room_names_one_nodes_reason() {
        let state = listed(vec![node("n1", 1)], Vec::new());
        let rules = Rules::default();
        let huge = ClaimShare {
            count: 2,
            cores: Some(100),
            memory_mib: None,
        };
        let request = slice_request(&rules, "ns/c", &huge).expect("request");
        let snapshot = Snapshot::new(&state, &rules, now_unix_ms());
        let refusal = choose_slice_node(&snapshot, "ns/c", &request, |_| 0).expect_err("no room");
        assert!(
            refusal
                .to_string()
                .starts_with("no node has room for it now (e.g. n1: container \"c\" needs 2 GPUs"),
            "{refusal}"
        );
        assert_eq!(
            choose_slice_node(
                &Snapshot::new(&ClusterState::new(), &rules, now_unix_ms()),
                "ns/c",
                &request,
                |_| 0
            ),
            Err(SliceRefusal::NotListed)
        );
    }
}
