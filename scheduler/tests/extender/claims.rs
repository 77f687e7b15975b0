//! Pods holding Elastic GPU claims (the webhook records them in
//! `vgpu.io/elasticgpu-claims`): one claim serves one pod at a time, even
//! when two pods holding it are bound at the same moment, on different nodes.

use crate::harness::*;

fn holding(name: &str, claim: &str) -> serde_json::Value {
    pod(
        name,
        &[vgpu("main", 1, 1024, 20)],
        &[("vgpu.io/elasticgpu-claims", claim)],
    )
}

#[tokio::test]
async fn two_pods_holding_one_claim_are_never_both_placed() {
    let h = Harness::start(test_config()).await;
    h.add_nodes(vec![
        node("n1", &[gpu("NVIDIA A10", 24)]),
        node("n2", &[gpu("NVIDIA A10", 24)]),
    ])
    .await;
    let first = h.create_pod(holding("first", "c")).await;
    let second = h.create_pod(holding("second", "c")).await;
    let other = h.create_pod(holding("other", "d")).await;

    // Bound at once, on different nodes (each bind holds only its own
    // node's lock): exactly one gets the claim.
    let (a, b) = tokio::join!(h.bind(&first, "n1"), h.bind(&second, "n2"));
    let refused: Vec<&str> = [a.error.as_str(), b.error.as_str()]
        .into_iter()
        .filter(|e| !e.is_empty())
        .collect();
    assert_eq!(refused.len(), 1, "exactly one bind must fail: {a:?} {b:?}");
    let expected = format!("ElasticGPUClaim {NAMESPACE}/c is in use by pod {NAMESPACE}/");
    assert!(refused[0].contains(&expected), "{}", refused[0]);
    let (winner, loser) = if a.error.is_empty() {
        (&first, &second)
    } else {
        (&second, &first)
    };
    assert!(h.decision(winner).await.is_some());
    assert!(h.decision(loser).await.is_none());
    // Its node admits it (one pending vGPU pod per node at a time).
    h.allocate(winner).await;

    // The filter turns the other down on every node, for now (not for good).
    let result = h.filter(loser, &["n1", "n2"]).await;
    for node in ["n1", "n2"] {
        let why = result.failed_nodes.get(node).expect("rejected");
        assert!(why.contains(&expected), "{why}");
    }
    assert!(result.failed_and_unresolvable_nodes.is_empty());
    // A pod holding another claim is not held up.
    assert_eq!(h.bind(&other, "n1").await.error, "");

    // The holder gone: the claim serves the other pod.
    h.delete_pod(winner).await;
    assert_eq!(h.bind(loser, "n2").await.error, "");
}
