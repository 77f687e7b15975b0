//! The preempt verb: of the evictions kube-scheduler proposes (its dry run
//! counts a node's GPU resources as one pool), only those that make room on
//! one GPU are kept, and a node where none does is dropped.

use crate::harness::*;
use serde_json::{json, Value};

async fn preempt(
    h: &Harness,
    path: &str,
    pod: &Value,
    victims: &[(&str, Vec<&Value>)],
) -> (u16, Value) {
    let meta: serde_json::Map<String, Value> = victims
        .iter()
        .map(|(node, pods)| {
            let uids: Vec<Value> = pods.iter().map(|p| json!({ "UID": uid_of(p) })).collect();
            (
                node.to_string(),
                json!({ "Pods": uids, "NumPDBViolations": 0 }),
            )
        })
        .collect();
    let body = json!({ "Pod": pod, "NodeNameToMetaVictims": meta });
    let (status, body) = h.post(path, body.to_string().into_bytes()).await;
    (status, serde_json::from_slice(&body).expect("json"))
}

fn kept(result: &Value, node: &str) -> Option<Vec<String>> {
    let pods = result["NodeNameToMetaVictims"].get(node)?["Pods"].as_array()?;
    Some(
        pods.iter()
            .map(|p| p["UID"].as_str().expect("uid").to_string())
            .collect(),
    )
}

#[tokio::test]
async fn only_evictions_that_free_one_gpu_are_kept() {
    let h = Harness::start(test_config()).await;
    // n1: two 24 GiB GPUs, each 60 % taken by one low pod; n2: one GPU,
    // 23 GiB of it taken by one pod.
    h.add_nodes(vec![
        node("n1", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]),
        node("n2", &[gpu("NVIDIA A10", 24)]),
    ])
    .await;
    let mut low = Vec::new();
    for name in ["low-a", "low-b"] {
        let pod = h
            .create_pod(pod(name, &[vgpu("main", 1, 4096, 60)], &[]))
            .await;
        assert_eq!(h.bind(&pod, "n1").await.error, "");
        h.allocate(&pod).await;
        low.push(pod);
    }
    let big = h
        .create_pod(pod("big", &[vgpu("main", 1, 23 * 1024, 10)], &[]))
        .await;
    assert_eq!(h.bind(&big, "n2").await.error, "");
    h.allocate(&big).await;
    let web = h
        .create_pod(pod("web", &[ctr("main", &[("cpu", "1")])], &[]))
        .await;

    // Wants 50 % of a GPU: fits nowhere now.
    let wanting = h
        .create_pod(pod("wanting", &[vgpu("main", 1, 2048, 50)], &[]))
        .await;
    let result = h.filter(&wanting, &["n1", "n2"]).await;
    assert!(result.node_names.unwrap_or_default().is_empty());

    // kube-scheduler proposes both low pods and the CPU pod on n1, and the
    // pod on n2.
    let (status, result) = preempt(
        &h,
        "/preempt",
        &wanting,
        &[("n1", vec![&low[0], &low[1], &web]), ("n2", vec![&big])],
    )
    .await;
    assert_eq!(status, 200, "{result}");
    // On n1 one low pod is enough: the first (most important) is spared;
    // the CPU pod, holding no vGPU, stays proposed.
    let mut on_n1 = kept(&result, "n1").expect("n1 helps");
    on_n1.sort();
    let mut expected = vec![uid_of(&low[1]), uid_of(&web)];
    expected.sort();
    assert_eq!(on_n1, expected, "{result}");
    assert_eq!(kept(&result, "n2"), Some(vec![uid_of(&big)]), "{result}");

    // Evicting the CPU pod alone frees no GPU: n1 is dropped.
    let (status, result) = preempt(
        &h,
        "/apis/nvidia-gpu-scheduler/v1/schedule/preempt",
        &wanting,
        &[("n1", vec![&web])],
    )
    .await;
    assert_eq!(status, 200, "{result}");
    assert_eq!(kept(&result, "n1"), None, "{result}");

    // A pod asking more memory than a GPU has: no eviction helps anywhere.
    let huge = h
        .create_pod(pod("huge", &[vgpu("main", 1, 30 * 1024, 10)], &[]))
        .await;
    let (_, result) = preempt(
        &h,
        "/preempt",
        &huge,
        &[("n1", vec![&low[0], &low[1]]), ("n2", vec![&big])],
    )
    .await;
    assert_eq!(result["NodeNameToMetaVictims"], json!({}), "{result}");

    // A pod that asks for no vGPU: kube-scheduler's proposal stands.
    let (_, result) = preempt(&h, "/scheduler/preempt", &web, &[("n1", vec![&low[0]])]).await;
    assert_eq!(kept(&result, "n1"), Some(vec![uid_of(&low[0])]));

    // Bad bodies are refused in words.
    let (status, body) = h.post("/preempt", b"{".to_vec()).await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("not ExtenderPreemptionArgs"));
}
