//! How kube-scheduler should rank the nodes a pod fits on: by the node
//! policy, and for a pod asking for GPU models, by how many GPUs of those
//! models a node has.

use crate::placement::fit::load::measured_load;
use crate::placement::fit::packing::Scratch;
use crate::placement::pod_to_place::PodToPlace;
use crate::placement::snapshot::Snapshot;
use vgpu_cluster::policy::NodePolicy;
use vgpu_cluster::requests::PodRequest;

/// A node's score from its load (0.0 empty to 1.0 full), in `0.0..=1.0`:
/// for binpack and spread the granted load after placing the pod, for
/// load-aware the measured one; `random` is a number derived from `seed`.
pub fn node_score(policy: NodePolicy, load: f64, seed: u64) -> f64 {
    let load = load.clamp(0.0, 1.0);
    match policy {
        NodePolicy::Binpack => load,
        NodePolicy::Spread | NodePolicy::LoadAware => 1.0 - load,
        NodePolicy::Random => (seed % 1001) as f64 / 1000.0,
    }
}

/// The score, 0.0 to 1.0, of each of `names` for `request` of `pod`; 0
/// where it does not fit. `known` answers a node's load after placing
/// the pod and its GPUs of a wanted model when a filter call just
/// computed them (the bind re-checks everything, so a score a few
/// milliseconds old is only ever advice); `random` is the pod's random
/// number for a node, for the random node policy.
pub fn score_nodes(
    snapshot: &Snapshot<'_>,
    names: &[&str],
    pod: &PodToPlace<'_>,
    request: &PodRequest,
    known: impl Fn(&str) -> Option<(f64, u32)>,
    random: impl Fn(&str) -> u64,
) -> Vec<f64> {
    let gpu_policy = request.gpu_policy.unwrap_or(snapshot.rules.gpu_policy);
    let node_policy = request.node_policy.unwrap_or(snapshot.rules.node_policy);
    let wants_model = !request.selectors.use_types.is_empty() || request.selectors.model.is_some();
    let mut scratch = Scratch::default();
    let evaluated: Vec<Option<(f64, u32)>> = names
        .iter()
        .map(|name| {
            known(name).or_else(|| {
                snapshot
                    .evaluate(name, pod, request, gpu_policy, &mut scratch)
                    .ok()
                    .map(|load| (load, scratch.matching))
            })
        })
        .collect();
    let most_matching = evaluated
        .iter()
        .flatten()
        .map(|(_, matching)| *matching)
        .max()
        .unwrap_or(0);
    names
        .iter()
        .zip(evaluated)
        .map(|(name, evaluated)| {
            let Some((load, matching)) = evaluated else {
                return 0.0;
            };
            // The load-aware node policy scores by what the nodes measure
            // (looked up only then: thousands of nodes come with a call).
            let load = if node_policy == NodePolicy::LoadAware {
                snapshot
                    .state
                    .node(name)
                    .map_or(load, |node| measured_load(&node.gpus, &node.usage))
            } else {
                load
            };
            let seed = if node_policy == NodePolicy::Random {
                random(name)
            } else {
                0
            };
            let score = node_score(node_policy, load, seed);
            // Prefer nodes with more GPUs of a requested model.
            if wants_model && most_matching > 0 {
                (score + f64::from(matching) / f64::from(most_matching)) / 2.0
            } else {
                score
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::clock::now_unix_ms;
    use crate::cache::fixtures::{annotated, asking_vgpus, decided, gpu, node, node_with};
    use crate::cache::state::{listed, ClusterState};
    use crate::placement::rules::Rules;
    use k8s_openapi::api::core::v1::Pod;

    #[test]
    fn scores_follow_the_policy() {
        assert!(node_score(NodePolicy::Binpack, 0.8, 0) > node_score(NodePolicy::Binpack, 0.2, 0));
        assert!(node_score(NodePolicy::Spread, 0.8, 0) < node_score(NodePolicy::Spread, 0.2, 0));
        assert_eq!(node_score(NodePolicy::Binpack, 7.0, 0), 1.0);
        let random = node_score(NodePolicy::Random, 0.5, 123_456);
        assert!((0.0..=1.0).contains(&random));
    }

    /// n1 carries 3 pods (12 GiB, 90 percent of its one GPU); n2 is empty
    /// and has two GPUs, one an L4.
    fn two_nodes() -> ClusterState {
        let pods = (0..3)
            .map(|i| decided(&format!("d{i}"), 5, "n1", "GPU-n1-0", true, true))
            .collect();
        let n2 = node_with("n2", vec![gpu("n2", 0, "A10", 24), gpu("n2", 1, "L4", 24)]);
        listed(vec![node("n1", 1), n2], pods)
    }

    fn scores(state: &ClusterState, rules: &Rules, pod: &Pod, random: u64) -> Vec<f64> {
        let snapshot = Snapshot::new(state, rules, now_unix_ms());
        let request = rules.parse(pod).expect("request");
        score_nodes(
            &snapshot,
            &["n1", "n2", "gone"],
            &PodToPlace::of(state, pod),
            &request,
            |_| None,
            |_| random,
        )
    }

    #[test]
    fn node_policies_rank_the_nodes_a_pod_fits() {
        let state = two_nodes();
        let pod = asking_vgpus("p", 1, 1024, 5);
        let rules = |node_policy| Rules {
            node_policy,
            ..Rules::default()
        };
        let binpack = scores(&state, &rules(NodePolicy::Binpack), &pod, 0);
        assert!(
            binpack[0] > binpack[1],
            "the fuller node first: {binpack:?}"
        );
        assert_eq!(binpack[2], 0.0, "a node the pod does not fit scores 0");
        let spread = scores(&state, &rules(NodePolicy::Spread), &pod, 0);
        assert!(spread[1] > spread[0], "the emptier node first: {spread:?}");
        let random = scores(&state, &rules(NodePolicy::Random), &pod, 500);
        assert_eq!(
            &random[..2],
            &[0.5, 0.5],
            "the pod's random number: {random:?}"
        );
    }

    #[test]
    fn load_aware_scores_what_the_nodes_measure() {
        let mut busy = gpu("n1", 0, "A10", 24);
        busy.utilization_percent = Some(90);
        let idle = gpu("n2", 0, "A10", 24);
        let state = listed(
            vec![node_with("n1", vec![busy]), node_with("n2", vec![idle])],
            Vec::new(),
        );
        let rules = Rules {
            node_policy: NodePolicy::LoadAware,
            ..Rules::default()
        };
        let snapshot = Snapshot::new(&state, &rules, now_unix_ms());
        let pod = asking_vgpus("p", 1, 1024, 5);
        let request = rules.parse(&pod).expect("request");
        let scores = score_nodes(
            &snapshot,
            &["n1", "n2"],
            &PodToPlace::of(&state, &pod),
            &request,
            |_| None,
            |_| 0,
        );
        assert!((scores[0] - 0.1).abs() < 1e-9, "{scores:?}");
        assert!((scores[1] - 1.0).abs() < 1e-9, "{scores:?}");
    }

    #[test]
    fn a_pod_asking_for_models_prefers_nodes_with_more_of_them() {
        let state = two_nodes();
        let rules = Rules::default();
        let pod = annotated(
            asking_vgpus("p", 1, 1024, 5),
            vgpu_cluster::resources::USE_GPU_TYPE_ANNOTATION,
            "A10,L4",
        );
        let scored = scores(&state, &rules, &pod, 0);
        let plain = scores(&state, &rules, &asking_vgpus("p", 1, 1024, 5), 0);
        // n2 has two wanted GPUs to n1's one: half its score is that share.
        assert!(
            (scored[1] - (plain[1] + 1.0) / 2.0).abs() < 1e-9,
            "{scored:?} {plain:?}"
        );
        assert!(
            (scored[0] - (plain[0] + 0.5) / 2.0).abs() < 1e-9,
            "{scored:?} {plain:?}"
        );
    }

    #[test]
    fn loads_a_filter_call_computed_are_used_as_they_are() {
        let state = two_nodes();
        let rules = Rules::default();
        let snapshot = Snapshot::new(&state, &rules, now_unix_ms());
        let pod = asking_vgpus("p", 1, 1024, 5);
        let request = rules.parse(&pod).expect("request");
        let scores = score_nodes(
            &snapshot,
            &["n1", "gone"],
            &PodToPlace::of(&state, &pod),
            &request,
            |name| (name == "gone").then_some((0.7, 1)),
            |_| 0,
        );
        assert_eq!(scores[1], 0.7, "known, so not evaluated again");
    }
}
