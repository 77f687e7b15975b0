//! Which of kube-scheduler's proposed evictions make room for a pod on
//! the GPUs.
//!
//! kube-scheduler's dry run sees only the resources it counts, not which
//! GPU holds what, so only the nodes where its evictions make room for
//! the pod on the GPUs (memory, compute and slots of one GPU per vGPU)
//! are kept, and on each the fewest of the pods holding vGPUs there: they
//! are spared in kube-scheduler's order, most important first, while the
//! pod still fits. Victims holding no vGPU on the node are kept:
//! kube-scheduler needed them for something else.

use crate::placement::claims::claim_in_use;
use crate::placement::coscheduling::{gate, Gate};
use crate::placement::fit::packing::Scratch;
use crate::placement::pod_to_place::PodToPlace;
use crate::placement::rules::pod_key;
use crate::placement::snapshot::Snapshot;
use crate::vocabulary::kubeshare::group_of;
use k8s_openapi::api::core::v1::Pod;
use vgpu_cluster::requests::PodRequest;

/// The evictions proposed on one node: the victims' UIDs and the
/// PodDisruptionBudget violations they make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evictions<'v> {
    pub node: &'v str,
    pub victims: Vec<&'v str>,
    pub violations: i64,
}

/// Of `proposed`, the nodes where evicting makes room for `request` of
/// `pod`, each with the pods to evict. Nothing when the pod's group is not
/// placed yet or one of its claims is in use: no eviction helps then.
pub fn fewest_victims<'v>(
    snapshot: &Snapshot<'_>,
    pod: &Pod,
    request: &PodRequest,
    proposed: &[Evictions<'v>],
) -> Vec<Evictions<'v>> {
    let state = snapshot.state;
    let key = pod_key(pod);
    if let Ok(Some((group, labels))) = group_of(pod) {
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        if gate(state, &group, &labels, uid, snapshot.now_unix_ms) != Gate::Open {
            tracing::info!(
                "preempt {key}: its group {group} is not placed yet; no eviction for it"
            );
            return Vec::new();
        }
    }
    let mut placing = PodToPlace::of(state, pod);
    if let Some(why) = claim_in_use(state, &placing) {
        tracing::info!("preempt {key}: no eviction helps: {why}");
        return Vec::new();
    }
    let policy = request.gpu_policy.unwrap_or(snapshot.rules.gpu_policy);
    let mut scratch = Scratch::default();
    let mut kept = Vec::new();
    for proposal in proposed {
        let node = proposal.node;
        let (holding, other): (Vec<&str>, Vec<&str>) = proposal
            .victims
            .iter()
            .partition(|uid| state.counted_node_of(uid) == Some(node));
        placing.evicted = holding.iter().map(|uid| uid.to_string()).collect();
        if let Err(rejection) = snapshot.evaluate(node, &placing, request, policy, &mut scratch) {
            tracing::info!(
                "preempt {key}: evicting {} pod(s) on {node} does not make room: {rejection}",
                proposal.victims.len()
            );
            continue;
        }
        for spared in &holding {
            let without: Vec<String> = placing
                .evicted
                .iter()
                .filter(|uid| uid.as_str() != *spared)
                .cloned()
                .collect();
            let evicted = std::mem::replace(&mut placing.evicted, without);
            if snapshot
                .evaluate(node, &placing, request, policy, &mut scratch)
                .is_err()
            {
                placing.evicted = evicted;
            }
        }
        let mut evict: Vec<&'v str> = other;
        evict.extend(
            holding
                .iter()
                .copied()
                .filter(|uid| placing.evicted.iter().any(|e| e == uid)),
        );
        if evict.is_empty() {
            tracing::info!("preempt {key}: fits on {node} without evicting anyone");
            continue;
        }
        tracing::info!(
            "preempt {key}: on {node} evict {} of the {} proposed pod(s)",
            evict.len(),
            proposal.victims.len()
        );
        let count = i64::try_from(evict.len()).unwrap_or(i64::MAX);
        kept.push(Evictions {
            node,
            victims: evict,
            violations: proposal.violations.min(count),
        });
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::clock::now_unix_ms;
    use crate::cache::fixtures::{asking_vgpus, decided, labelled, node};
    use crate::cache::state::listed;
    use crate::placement::rules::Rules;
    use crate::vocabulary::kubeshare::{GROUP_HEADCOUNT_LABEL, GROUP_NAME_LABEL};

    /// n1's one GPU carries a, b and c (4 GiB and 30 percent each); n2's
    /// carries d.
    fn crowded() -> crate::cache::state::ClusterState {
        let pods = ["a", "b", "c"]
            .iter()
            .map(|uid| decided(uid, 5, "n1", "GPU-n1-0", true, true))
            .chain([decided("d", 5, "n2", "GPU-n2-0", true, true)])
            .collect();
        listed(vec![node("n1", 1), node("n2", 1)], pods)
    }

    fn preempt<'v>(pod: &Pod, proposed: &[Evictions<'v>]) -> Vec<Evictions<'v>> {
        let state = crowded();
        let rules = Rules::default();
        let request = rules.parse(pod).expect("request");
        fewest_victims(
            &Snapshot::new(&state, &rules, now_unix_ms()),
            pod,
            &request,
            proposed,
        )
    }

    #[test]
    fn the_fewest_vgpu_victims_are_kept_in_kube_schedulers_order() {
        // 50 percent needs two of the three 30 percent pods gone: the first
        // proposed (most important) is spared.
        let pod = asking_vgpus("p", 1, 1024, 50);
        let kept = preempt(
            &pod,
            &[Evictions {
                node: "n1",
                victims: vec!["a", "b", "c", "cpu-only"],
                violations: 3,
            }],
        );
        assert_eq!(
            kept,
            vec![Evictions {
                node: "n1",
                // A victim holding no vGPU here stays: kube-scheduler
                // needed it for something else.
                victims: vec!["cpu-only", "b", "c"],
                violations: 3,
            }]
        );
    }

    #[test]
    fn nodes_where_evicting_makes_no_room_or_no_eviction_is_needed_are_dropped() {
        // 80 percent: evicting one of n1's three leaves 40 percent free;
        // evicting d frees all of n2.
        let pod = asking_vgpus("p", 1, 1024, 80);
        let kept = preempt(
            &pod,
            &[
                Evictions {
                    node: "n1",
                    victims: vec!["a"],
                    violations: 0,
                },
                Evictions {
                    node: "n2",
                    victims: vec!["d"],
                    violations: 1,
                },
            ],
        );
        assert_eq!(
            kept,
            vec![Evictions {
                node: "n2",
                victims: vec!["d"],
                violations: 1,
            }]
        );
        // 10 percent fits on n2 without evicting d.
        let small = asking_vgpus("s", 1, 1024, 10);
        let none = preempt(
            &small,
            &[Evictions {
                node: "n2",
                victims: vec!["d"],
                violations: 0,
            }],
        );
        assert!(none.is_empty(), "{none:?}");
    }

    #[test]
    fn a_pod_of_a_group_not_placed_yet_evicts_nobody() {
        let pod = labelled(
            labelled(asking_vgpus("p", 1, 1024, 80), GROUP_NAME_LABEL, "g"),
            GROUP_HEADCOUNT_LABEL,
            "2",
        );
        let kept = preempt(
            &pod,
            &[Evictions {
                node: "n2",
                victims: vec!["d"],
                violations: 0,
            }],
        );
        assert!(kept.is_empty(), "{kept:?}");
    }
}
