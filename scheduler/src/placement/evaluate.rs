//! Whether a pod fits on one node as the snapshot stands: the node known
//! and its plugin alive, the pod's claims' slices there, room on its GPUs
//! beside everything placed and held, its namespace within its quotas.

use crate::cache::leases::Liveness;
use crate::cache::nodes::Inventory;
use crate::placement::claims::pin_to_slices;
use crate::placement::fit::gpu_check::explain;
use crate::placement::fit::load::node_load;
use crate::placement::fit::packing::{place_pod, Scratch};
use crate::placement::pod_to_place::PodToPlace;
use crate::placement::quota::taken;
use crate::placement::rejection::Rejection;
use crate::placement::snapshot::Snapshot;
use std::borrow::Cow;
use vgpu_cluster::node_lease::lease_name;
use vgpu_cluster::policy::GpuPolicy;
use vgpu_cluster::requests::PodRequest;

impl Snapshot<'_> {
    /// Whether `request` of `pod` fits on node `name` under `policy`; on
    /// success the node's load after placing it (0.0 to 1.0), with the
    /// grants in `scratch`.
    pub fn evaluate(
        &self,
        name: &str,
        pod: &PodToPlace<'_>,
        request: &PodRequest,
        policy: GpuPolicy,
        scratch: &mut Scratch,
    ) -> Result<f64, Rejection> {
        let state = self.state;
        let node = match state.node(name) {
            Some(node) if node.in_api => node,
            _ => return Err(Rejection::UnknownNode),
        };
        match &node.inventory {
            Inventory::Missing => return Err(Rejection::NoInventory),
            Inventory::Invalid(error) => return Err(Rejection::UnreadableInventory(error.clone())),
            Inventory::Valid => {}
        }
        let grace = self.rules.node_lease_grace;
        match state.liveness(name, self.now_unix_ms, grace) {
            Liveness::Live { .. } => {}
            Liveness::Missing => {
                return Err(Rejection::NoLease {
                    lease: lease_name(name),
                })
            }
            Liveness::Expired {
                silent_ms,
                duration_ms,
            } => {
                return Err(Rejection::LeaseExpired {
                    silent_ms,
                    duration_ms,
                    grace_s: grace.as_secs(),
                })
            }
        }
        let gpu_resource = &self.rules.resources.gpu;
        if node.offers_none_of(gpu_resource) {
            return Err(Rejection::PluginDisconnected {
                resource: gpu_resource.clone(),
            });
        }
        let pinned = pin_to_slices(state, name, &pod.claims, request)?;
        let request = pinned.as_ref().unwrap_or(request);
        let recount = pod.counted_node == Some(name)
            || !pod.claims.is_empty()
            || !pod.evicted.is_empty()
            || state
                .groups()
                .holds_on(name, self.now_unix_ms)
                .next()
                .is_some();
        let base = if recount {
            let mut gone: Vec<&str> = Vec::with_capacity(1 + pod.evicted.len());
            gone.push(pod.uid);
            gone.extend(pod.evicted.iter().map(String::as_str));
            let mut base = state.usage_without(node, &gone, &pod.claims);
            state.add_holds(name, node, &gone, self.now_unix_ms, &mut base);
            base
        } else {
            Cow::Borrowed(&node.usage[..])
        };
        match place_pod(&node.gpus, &base, request, policy, scratch) {
            Ok(()) => {
                if let Some(held) = &pod.quota {
                    self.within_quota(held, &pod.evicted, &taken(&base, &scratch.after))?;
                }
                Ok(node_load(&node.gpus, &scratch.after))
            }
            Err(miss) => Err(Rejection::NoRoom {
                explanation: explain(&node.gpus, request, &miss),
                permanent: miss.permanent,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::book::Book;
    use crate::cache::clock::now_unix_ms;
    use crate::cache::fixtures::{asking, asking_vgpus, decided, gpu, node, node_with};
    use crate::cache::state::{listed, ClusterState};
    use crate::placement::rules::Rules;
    use k8s_openapi::api::core::v1::{Node, NodeStatus};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use vgpu_cluster::decision::NODE_INVENTORY_ANNOTATION;

    /// Evaluates `pod` on `name` at `now` under the default rules.
    fn evaluate_at(
        state: &ClusterState,
        name: &str,
        pod: &k8s_openapi::api::core::v1::Pod,
        now: u64,
    ) -> Result<f64, Rejection> {
        let rules = Rules::default();
        let request = rules.parse(pod).expect("a readable request");
        let snapshot = Snapshot::new(state, &rules, now);
        let placing = PodToPlace::of(state, pod);
        snapshot.evaluate(
            name,
            &placing,
            &request,
            rules.gpu_policy,
            &mut Scratch::default(),
        )
    }

    fn evaluate(
        state: &ClusterState,
        name: &str,
        pod: &k8s_openapi::api::core::v1::Pod,
    ) -> Result<f64, Rejection> {
        evaluate_at(state, name, pod, now_unix_ms())
    }

    fn small_pod() -> k8s_openapi::api::core::v1::Pod {
        asking_vgpus("p", 1, 4096, 30)
    }

    #[test]
    fn a_node_not_in_the_watch_is_unknown() {
        let state = listed(vec![node("n1", 1)], Vec::new());
        let rejection = evaluate(&state, "n2", &small_pod()).expect_err("unknown");
        assert_eq!(rejection, Rejection::UnknownNode);
        assert!(rejection.is_permanent());
        // A node known only from a decision naming it is not in the watch.
        let state = listed(
            vec![node("n1", 1)],
            vec![decided("d", 5, "n9", "GPU-n9-0", true, false)],
        );
        assert!(state.node("n9").is_some());
        assert_eq!(
            evaluate(&state, "n9", &small_pod()),
            Err(Rejection::UnknownNode)
        );
    }

    #[test]
    fn a_node_without_a_readable_inventory_takes_nothing() {
        let mut bare = node("bare", 1);
        bare.metadata.annotations = None;
        let mut broken = node("broken", 1);
        broken
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(NODE_INVENTORY_ANNOTATION.into(), "{".into());
        let state = listed(vec![bare, broken], Vec::new());
        let missing = evaluate(&state, "bare", &small_pod()).expect_err("no inventory");
        assert_eq!(missing, Rejection::NoInventory);
        assert!(
            missing
                .to_string()
                .contains("is the vgpu device plugin running"),
            "{missing}"
        );
        match evaluate(&state, "broken", &small_pod()) {
            Err(Rejection::UnreadableInventory(why)) => assert!(!why.is_empty()),
            other => panic!("expected an unreadable inventory, got {other:?}"),
        }
    }

    #[test]
    fn a_node_whose_plugin_holds_no_live_lease_takes_nothing() {
        let mut state = ClusterState::new();
        state.relist(vec![node("n1", 1)]);
        state.relist(Vec::<k8s_openapi::api::coordination::v1::Lease>::new());
        state.relist(Vec::<k8s_openapi::api::core::v1::Pod>::new());
        let missing = evaluate(&state, "n1", &small_pod()).expect_err("no Lease");
        assert_eq!(
            missing,
            Rejection::NoLease {
                lease: "vgpu-n1".into()
            }
        );
        assert!(
            missing.to_string().contains("kube-node-lease/vgpu-n1"),
            "{missing}"
        );
        // The fixture's Lease lasts 40 s; the grace is 10 s more.
        let state = listed(vec![node("n1", 1)], Vec::new());
        let now = now_unix_ms();
        assert!(evaluate_at(&state, "n1", &small_pod(), now + 49_000).is_ok());
        match evaluate_at(&state, "n1", &small_pod(), now + 51_000) {
            Err(Rejection::LeaseExpired {
                silent_ms,
                duration_ms: 40_000,
                grace_s: 10,
            }) => assert!(silent_ms >= 51_000, "{silent_ms}"),
            other => panic!("expected an expired Lease, got {other:?}"),
        }
    }

    #[test]
    fn a_node_whose_kubelet_offers_no_gpus_is_turned_down_until_it_does() {
        let mut disconnected: Node = node("n1", 1);
        disconnected.status = Some(NodeStatus {
            allocatable: Some([("nvidia.com/gpu".to_string(), Quantity("0".into()))].into()),
            ..NodeStatus::default()
        });
        let state = listed(vec![disconnected], Vec::new());
        let rejection = evaluate(&state, "n1", &small_pod()).expect_err("disconnected");
        assert_eq!(
            rejection,
            Rejection::PluginDisconnected {
                resource: "nvidia.com/gpu".into()
            }
        );
    }

    #[test]
    fn no_room_says_why_and_whether_evicting_could_help() {
        let state = listed(
            vec![node_with("n1", vec![gpu("n1", 0, "A10", 24)])],
            (0..3)
                .map(|i| decided(&format!("d{i}"), 5, "n1", "GPU-n1-0", true, true))
                .collect(),
        );
        // 3 pods of 4 GiB and 30 percent: 12 GiB and 10 percent free.
        let too_big = asking_vgpus("big", 1, 30 * 1024, 10);
        match evaluate(&state, "n1", &too_big) {
            Err(Rejection::NoRoom {
                explanation,
                permanent: true,
            }) => assert!(
                explanation
                    .contains("GPU-n1-0 has only 24576 MiB in all, container needs 30720 MiB"),
                "{explanation}"
            ),
            other => panic!("expected a permanent miss, got {other:?}"),
        }
        let crowded = asking_vgpus("more", 1, 16 * 1024, 10);
        match evaluate(&state, "n1", &crowded) {
            Err(Rejection::NoRoom {
                explanation,
                permanent: false,
            }) => assert!(
                explanation.contains("GPU-n1-0 has 12288 MiB free, container needs 16384 MiB"),
                "{explanation}"
            ),
            other => panic!("expected a miss evicting could help, got {other:?}"),
        }
        assert!(evaluate(&state, "n1", &asking_vgpus("fits", 1, 4096, 10)).is_ok());
    }

    #[test]
    fn a_pod_does_not_compete_with_its_own_earlier_decision() {
        // The pod itself holds 4 GiB of the 24 there (decided, unbound);
        // asking for 24 GiB fits only if its own grant is not counted.
        let earlier = decided("p", 5, "n1", "GPU-n1-0", false, false);
        let state = listed(vec![node("n1", 1)], vec![earlier.clone()]);
        let mut again = asking_vgpus("p", 1, 24 * 1024, 0);
        again.metadata.resource_version = Some("6".into());
        let load = evaluate(&state, "n1", &again).expect("fits without itself");
        assert!(load > 0.4, "{load}");
        assert!(matches!(
            evaluate(&state, "n1", &asking_vgpus("q", 1, 24 * 1024, 0)),
            Err(Rejection::NoRoom { .. })
        ));
    }

    #[test]
    fn the_load_after_placing_is_the_mean_of_memory_and_compute() {
        let state = listed(vec![node("n1", 2)], Vec::new());
        // 12 GiB and 50 % on one of two 24 GiB GPUs: memory 1/4, compute 1/4.
        let load = evaluate(&state, "n1", &asking_vgpus("p", 1, 12 * 1024, 50)).expect("fits");
        assert!((load - 0.25).abs() < 1e-9, "{load}");
        // A pod asking for nothing vGPU-like fits with no load.
        let plain = asking("plain", &[("cpu", "1")]);
        assert_eq!(evaluate(&state, "n1", &plain), Ok(0.0));
    }
}
