//! Which of kube-scheduler's candidate nodes a pod fits on, and why not on
//! the others.

use crate::placement::claims::claim_in_use;
use crate::placement::fit::packing::Scratch;
use crate::placement::pod_to_place::PodToPlace;
use crate::placement::snapshot::Snapshot;
use std::collections::BTreeMap;
use vgpu_cluster::requests::PodRequest;

/// A node the pod fits on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fit<'n> {
    pub node: &'n str,
    /// The node's load after placing the pod (0.0 to 1.0).
    pub load: f64,
    /// Healthy GPUs of a model the pod asks for on the node.
    pub matching: u32,
}

/// The candidates sorted out: kube-scheduler's `Nodes`/`NodeNames`,
/// `FailedNodes` and `FailedAndUnresolvableNodes`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeVerdicts<'n> {
    /// In the order the candidates came.
    pub fits: Vec<Fit<'n>>,
    /// Node to why not, where evicting pods might help.
    pub failed: BTreeMap<String, String>,
    /// Node to why not, where evicting pods could not help.
    pub unresolvable: BTreeMap<String, String>,
}

impl<'n> NodeVerdicts<'n> {
    /// Every candidate turned down for one reason that evicting might
    /// change (the pod's group or claim must wait).
    pub fn all_failed(names: impl IntoIterator<Item = &'n str>, why: &str) -> Self {
        Self {
            failed: each_for(names, why),
            ..Self::default()
        }
    }

    /// Every candidate turned down for one reason no eviction changes.
    pub fn all_unresolvable(names: impl IntoIterator<Item = &'n str>, why: &str) -> Self {
        Self {
            unresolvable: each_for(names, why),
            ..Self::default()
        }
    }
}

/// Each of `names` with the same reason.
fn each_for<'n>(names: impl IntoIterator<Item = &'n str>, why: &str) -> BTreeMap<String, String> {
    names
        .into_iter()
        .map(|name| (name.to_string(), why.to_string()))
        .collect()
}

/// Sorts `names` for `request` of `pod`.
pub fn filter_nodes<'n>(
    snapshot: &Snapshot<'_>,
    names: Vec<&'n str>,
    pod: &PodToPlace<'_>,
    request: &PodRequest,
) -> NodeVerdicts<'n> {
    if let Some(in_use) = claim_in_use(snapshot.state, pod) {
        return NodeVerdicts::all_failed(names, &in_use.to_string());
    }
    let policy = request.gpu_policy.unwrap_or(snapshot.rules.gpu_policy);
    let mut scratch = Scratch::default();
    let mut verdicts = NodeVerdicts {
        fits: Vec::with_capacity(names.len()),
        ..NodeVerdicts::default()
    };
    for name in names {
        match snapshot.evaluate(name, pod, request, policy, &mut scratch) {
            Ok(load) => verdicts.fits.push(Fit {
                node: name,
                load,
                matching: scratch.matching,
            }),
            Err(rejection) if rejection.is_permanent() => {
                verdicts
                    .unresolvable
                    .insert(name.to_string(), rejection.to_string());
            }
            Err(rejection) => {
                verdicts
                    .failed
                    .insert(name.to_string(), rejection.to_string());
            }
        }
    }
    verdicts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::clock::now_unix_ms;
    use crate::cache::fixtures::{annotated, asking_vgpus, decided, node};
    use crate::cache::state::listed;
    use crate::placement::rules::Rules;
    use crate::vocabulary::claims::USES_CLAIMS_ANNOTATION;

    #[test]
    fn candidates_are_sorted_into_fits_failures_and_hopeless_ones() {
        // n1: one GPU with 3 pods (12 GiB, 90 percent); n2: two empty GPUs.
        let pods = (0..3)
            .map(|i| decided(&format!("d{i}"), 5, "n1", "GPU-n1-0", true, true))
            .collect();
        let state = listed(vec![node("n1", 1), node("n2", 2)], pods);
        let rules = Rules::default();
        let snapshot = Snapshot::new(&state, &rules, now_unix_ms());
        let pod = asking_vgpus("p", 1, 8 * 1024, 20);
        let request = rules.parse(&pod).expect("request");
        let placing = PodToPlace::of(&state, &pod);
        let verdicts = filter_nodes(&snapshot, vec!["n1", "n2", "gone"], &placing, &request);
        assert_eq!(
            verdicts.fits.iter().map(|f| f.node).collect::<Vec<_>>(),
            vec!["n2"]
        );
        assert_eq!(verdicts.fits[0].matching, 2, "both GPUs are of any model");
        assert_eq!(
            verdicts.failed.keys().collect::<Vec<_>>(),
            vec!["n1"],
            "evicting could make room on n1"
        );
        assert!(
            verdicts.failed["n1"].contains("10 percent compute free, container needs 20 percent"),
            "{}",
            verdicts.failed["n1"]
        );
        assert_eq!(
            verdicts.unresolvable.keys().collect::<Vec<_>>(),
            vec!["gone"]
        );
    }

    #[test]
    fn a_pod_whose_claim_is_in_use_fits_nowhere() {
        let holder = annotated(
            decided("h", 5, "n1", "GPU-n1-0", true, true),
            USES_CLAIMS_ANNOTATION,
            "c",
        );
        let state = listed(vec![node("n1", 2)], vec![holder]);
        let rules = Rules::default();
        let snapshot = Snapshot::new(&state, &rules, now_unix_ms());
        let pod = annotated(asking_vgpus("p", 1, 1024, 10), USES_CLAIMS_ANNOTATION, "c");
        let request = rules.parse(&pod).expect("request");
        let verdicts = filter_nodes(
            &snapshot,
            vec!["n1"],
            &PodToPlace::of(&state, &pod),
            &request,
        );
        assert!(verdicts.fits.is_empty());
        assert!(verdicts.failed["n1"].contains("ElasticGPUClaim ns/c is in use by pod ns/h"));
    }
}
