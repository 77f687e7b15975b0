//! Elastic GPU claims in placement: one claim serves one pod at a time,
//! and a pod holding a claim whose slice is held runs on that slice
//! ([`crate::cache::reservations`]).

use crate::cache::state::ClusterState;
use crate::placement::pod_to_place::PodToPlace;
use crate::placement::rejection::Rejection;
use thiserror::Error;
use vgpu_cluster::requests::PodRequest;

/// Another live, placed pod holds a claim the pod holds.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("ElasticGPUClaim {claim} is in use by pod {holder}; one claim serves one pod at a time")]
pub struct ClaimInUse {
    /// `namespace/name` of the claim.
    pub claim: String,
    /// `namespace/name` of the pod holding it.
    pub holder: String,
}

/// Why the pod cannot be placed now, if another pod holds one of its
/// claims.
pub fn claim_in_use(state: &ClusterState, pod: &PodToPlace<'_>) -> Option<ClaimInUse> {
    pod.claims.iter().find_map(|claim| {
        state.holder_of(claim, pod.uid).map(|holder| ClaimInUse {
            claim: claim.clone(),
            holder: holder.key(),
        })
    })
}

/// For a pod holding claims whose slices are held: `request` limited to
/// those slices' GPUs, or why it cannot run on node `name`. `None`: no
/// slice is held for its claims, so it may go anywhere.
pub fn pin_to_slices(
    state: &ClusterState,
    name: &str,
    claims: &[String],
    request: &PodRequest,
) -> Result<Option<PodRequest>, Rejection> {
    let mut gpus: Vec<&str> = Vec::new();
    for claim in claims {
        let Some(slice) = state.reservation_of(claim) else {
            continue;
        };
        if slice.node != name {
            return Err(Rejection::SliceElsewhere {
                claim: claim.clone(),
                elastic_gpu: slice.elastic_gpu.clone(),
                node: slice.node.clone(),
            });
        }
        gpus.extend(slice.gpus.iter().map(String::as_str));
    }
    if gpus.is_empty() {
        return Ok(None);
    }
    let allowed: Vec<String> = gpus
        .iter()
        .filter(|uuid| request.selectors.uuid_allowed(uuid).is_ok())
        .map(|uuid| uuid.to_string())
        .collect();
    if allowed.is_empty() {
        return Err(Rejection::SlicesExcluded {
            gpus: gpus.join(", "),
        });
    }
    let mut pinned = request.clone();
    pinned.selectors.use_uuids = allowed;
    Ok(Some(pinned))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::book::Book;
    use crate::cache::clock::now_unix_ms;
    use crate::cache::fixtures::{annotated, asking_vgpus, decided, elastic_gpu, node, GIB};
    use crate::cache::state::listed;
    use crate::placement::fit::packing::Scratch;
    use crate::placement::rules::Rules;
    use crate::placement::snapshot::Snapshot;
    use crate::vocabulary::claims::USES_CLAIMS_ANNOTATION;

    /// A pod holding claim `ns/c`.
    fn holding(pod: k8s_openapi::api::core::v1::Pod) -> k8s_openapi::api::core::v1::Pod {
        annotated(pod, USES_CLAIMS_ANNOTATION, "c")
    }

    #[test]
    fn a_claim_a_placed_pod_holds_is_in_use_for_every_other_pod() {
        let holder = holding(decided("h", 5, "n1", "GPU-n1-0", true, true));
        let state = listed(vec![node("n1", 1)], vec![holder]);
        let other = holding(asking_vgpus("o", 1, 1024, 10));
        let in_use = claim_in_use(&state, &PodToPlace::of(&state, &other)).expect("in use");
        assert_eq!(
            in_use,
            ClaimInUse {
                claim: "ns/c".into(),
                holder: "ns/h".into()
            }
        );
        assert_eq!(
            in_use.to_string(),
            "ElasticGPUClaim ns/c is in use by pod ns/h; one claim serves one pod at a time"
        );
        // The holder itself, scheduled again, is not in its own way.
        let again = holding(asking_vgpus("h", 1, 1024, 10));
        assert_eq!(claim_in_use(&state, &PodToPlace::of(&state, &again)), None);
        // Nor is a pod holding no claim.
        let plain = asking_vgpus("x", 1, 1024, 10);
        assert_eq!(claim_in_use(&state, &PodToPlace::of(&state, &plain)), None);
    }

    #[test]
    fn a_pod_holding_a_claim_with_a_slice_runs_on_the_slice_alone() {
        let mut state = listed(vec![node("n1", 2), node("n2", 1)], Vec::new());
        // The slice: 2 GiB and 20 percent of GPU-n1-1 for ns/c.
        state.apply(elastic_gpu("egpu-1", 5, "GPU-n1-1"));
        let rules = Rules::default();
        let pod = holding(asking_vgpus("p", 1, 2048, 20));
        let request = rules.parse(&pod).expect("request");
        assert_eq!(
            pin_to_slices(&state, "n2", &["ns/c".into()], &request),
            Err(Rejection::SliceElsewhere {
                claim: "ns/c".into(),
                elastic_gpu: "egpu-1".into(),
                node: "n1".into(),
            })
        );
        let pinned = pin_to_slices(&state, "n1", &["ns/c".into()], &request)
            .expect("pinned")
            .expect("a slice is held");
        assert_eq!(pinned.selectors.use_uuids, vec!["GPU-n1-1".to_string()]);
        assert_eq!(
            pin_to_slices(&state, "n2", &["ns/other".into()], &request),
            Ok(None),
            "a claim without a slice goes anywhere"
        );
        let mut excluding = request.clone();
        excluding.selectors.nouse_uuids = vec!["GPU-n1-1".into()];
        assert_eq!(
            pin_to_slices(&state, "n1", &["ns/c".into()], &excluding),
            Err(Rejection::SlicesExcluded {
                gpus: "GPU-n1-1".into()
            })
        );

        // Evaluated: on n1 it gets GPU-n1-1, whose slice is its own (not
        // counted against it, so all of the GPU's memory is there for it).
        let snapshot = Snapshot::new(&state, &rules, now_unix_ms());
        let mut scratch = Scratch::default();
        let whole = holding(asking_vgpus("p", 1, 24 * 1024, 20));
        let whole_request = rules.parse(&whole).expect("request");
        let placing = PodToPlace::of(&state, &whole);
        snapshot
            .evaluate(
                "n1",
                &placing,
                &whole_request,
                rules.gpu_policy,
                &mut scratch,
            )
            .expect("fits on its slice");
        let decision = snapshot
            .decision("n1", &whole_request, &scratch)
            .expect("decided");
        assert_eq!(decision.containers[0].devices[0].uuid, "GPU-n1-1");
        assert_eq!(decision.containers[0].devices[0].memory_bytes, 24 * GIB);
        // Any other pod sees the slice taken.
        let stranger = asking_vgpus("s", 1, 23 * 1024, 0);
        let stranger_request = rules.parse(&stranger).expect("request");
        let pinned_stranger = PodToPlace::of(&state, &stranger);
        let mut selectors_on_the_slice = stranger_request.clone();
        selectors_on_the_slice.selectors.use_uuids = vec!["GPU-n1-1".into()];
        assert!(matches!(
            snapshot.evaluate(
                "n1",
                &pinned_stranger,
                &selectors_on_the_slice,
                rules.gpu_policy,
                &mut scratch
            ),
            Err(Rejection::NoRoom {
                permanent: false,
                ..
            })
        ));
    }
}
