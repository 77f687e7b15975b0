//! Bad input gets a clear answer, never a panic or a hang.

use crate::harness::*;
use serde_json::json;
use std::time::Duration;
use vgpu_scheduler::api::ApiSource;
use vgpu_testkit::extender_client::ExtenderClient;

async fn healthy(h: &Harness) {
    let (status, body) = h.client.get("/healthz").await.expect("health");
    assert_eq!((status, body.as_slice()), (200, b"ok".as_slice()));
}

fn error_of(body: &[u8]) -> String {
    let value: serde_json::Value = serde_json::from_slice(body).expect("JSON error body");
    value["Error"].as_str().expect("Error field").to_string()
}

#[tokio::test]
async fn malformed_bodies_get_400_with_the_reason() {
    let h = Harness::start(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    for path in ["/filter", "/prioritize"] {
        for body in [
            &b""[..],
            b"{",
            b"not json",
            b"[1]",
            b"{\"Pod\": 5}",
            b"{\"Pod\": {}, \"NodeNames\": \"n1\"}",
            b"{\"Pod\": {\"spec\": {\"containers\": 7}}, \"NodeNames\": []}",
            b"\xff\xfe\x00",
        ] {
            let (status, reply) = h.post(path, body.to_vec()).await;
            assert_eq!(status, 400, "{path} {body:?}");
            assert!(
                error_of(&reply).starts_with("request body is not ExtenderArgs JSON"),
                "{path}: {}",
                String::from_utf8_lossy(&reply)
            );
        }
    }
    for body in [&b"{"[..], b"{\"PodName\": 1}", b"[1,2]"] {
        let (status, reply) = h.post("/bind", body.to_vec()).await;
        assert_eq!(status, 400);
        assert!(error_of(&reply).starts_with("request body is not ExtenderBindingArgs JSON"));
    }
    for body in [
        &b"{"[..],
        b"{\"Pod\": 5}",
        b"{\"NodeNameToMetaVictims\": []}",
    ] {
        let (status, reply) = h.post("/preempt", body.to_vec()).await;
        assert_eq!(status, 400);
        assert!(error_of(&reply).starts_with("request body is not ExtenderPreemptionArgs JSON"));
    }
    // Every truncation of the recorded body is refused cleanly.
    let recorded = fixture_bytes("filter_args.json");
    for cut in (0..recorded.len()).step_by(37) {
        let (status, _) = h.post("/filter", recorded[..cut].to_vec()).await;
        assert_eq!(status, 400, "cut at {cut}");
    }
    let (status, _) = h
        .client
        .request("GET", "/filter", Vec::new())
        .await
        .expect("answer");
    assert_eq!(status, 405);
    let (status, _) = h
        .client
        .request("POST", "/unreserve", b"{}".to_vec())
        .await
        .expect("answer");
    assert_eq!(status, 404);
    healthy(&h).await;
}

#[tokio::test]
async fn incomplete_arguments_are_explained() {
    let h = Harness::start(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    let (status, reply) = h.post("/filter", br#"{"NodeNames":["n1"]}"#.to_vec()).await;
    assert_eq!(
        (status, error_of(&reply).as_str()),
        (200, "ExtenderArgs has no Pod")
    );
    let p = pod("p", &[vgpu("main", 1, 1024, 10)], &[]);
    let body = json!({ "Pod": p }).to_string().into_bytes();
    let (status, reply) = h.post("/filter", body.clone()).await;
    assert_eq!(
        (status, error_of(&reply).as_str()),
        (200, "ExtenderArgs has neither NodeNames nor Nodes")
    );
    let (status, reply) = h.post("/prioritize", body).await;
    assert_eq!(
        (status, error_of(&reply).as_str()),
        (400, "ExtenderArgs has neither NodeNames nor Nodes")
    );
    // Go's lower-case spellings are accepted too.
    let body = json!({ "pod": p, "nodenames": ["n1"] })
        .to_string()
        .into_bytes();
    let (status, reply) = h.post("/filter", body).await;
    assert_eq!(status, 200);
    let result: serde_json::Value = serde_json::from_slice(&reply).expect("JSON");
    assert_eq!(result["NodeNames"], json!(["n1"]));
    let (status, reply) = h.post("/bind", br#"{"PodName":"p"}"#.to_vec()).await;
    assert_eq!(status, 200);
    assert_eq!(
        error_of(&reply),
        "ExtenderBindingArgs needs PodName, PodNamespace and Node"
    );
    healthy(&h).await;
}

#[tokio::test]
async fn absurd_requests_are_refused_in_words() {
    let h = Harness::start(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    // The last field: whether the API server itself refuses such a pod.
    // Those the API accepts are also created and bound, so that bind's
    // refusal (it reads the pod from the API) is checked too; those it
    // refuses can never be bound, and reach the extender only in a filter
    // or prioritize body (which carries the whole pod).
    type Limits = &'static [(&'static str, &'static str)];
    let cases: &[(Limits, &str, bool)] = &[
        (
            &[("nvidia.com/gpu", "-1")],
            "container \"main\": nvidia.com/gpu \"-1\": must not be negative",
            true,
        ),
        (
            &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "-1")],
            "nvidia.com/gpumem \"-1\": must not be negative",
            true,
        ),
        (
            &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "20E")],
            "nvidia.com/gpumem \"20E\": \"20E\" is too large",
            false,
        ),
        (
            &[("nvidia.com/gpu", "1000")],
            "nvidia.com/gpu \"1000\": at most 16 GPUs per container",
            false,
        ),
        (
            &[("nvidia.com/gpu", "1"), ("nvidia.com/gpucores", "150")],
            "must be from 0 to 100 (percent of one GPU)",
            false,
        ),
        (
            &[("nvidia.com/gpu", "0.5")],
            "nvidia.com/gpu \"0.5\": must be a whole number",
            true,
        ),
        (
            &[
                ("nvidia.com/gpu", "1"),
                ("nvidia.com/priority", "99999999999"),
            ],
            "nvidia.com/priority \"99999999999\": too large",
            false,
        ),
        (
            &[("nvidia.com/gpumem", "1024")],
            "sets nvidia.com/gpumem (1024) without nvidia.com/gpu",
            false,
        ),
    ];
    for (limits, expected, api_refuses) in cases {
        let p = pod("absurd", &[ctr("main", limits)], &[]);
        let result = h.filter(&p, &["n1"]).await;
        assert!(
            result.error.starts_with("pod ml-team/absurd: ") && result.error.contains(expected),
            "{limits:?}: {:?}",
            result.error
        );
        assert!(result.node_names.is_none());
        // Prioritize answers zeros; bind refuses with the same words.
        let scores = h.prioritize(&p, &["n1"]).await;
        assert_eq!(scores[0].score, 0);
        match h.api.try_create_pod(p).await {
            Ok(created) => {
                assert!(!api_refuses, "{limits:?}: the API server took it");
                h.caught_up(version_of(&created), 0).await;
                let bound = h.bind(&created, "n1").await;
                assert!(bound.error.contains(expected), "{:?}", bound.error);
                h.delete_pod(&created).await;
            }
            Err(refused) => assert!(
                *api_refuses && refused.contains(limits[limits.len() - 1].0),
                "{limits:?}: the API server refused it: {refused}"
            ),
        }
    }
    // 10^12 MiB parses, and no GPU is that large.
    let p = pod(
        "terabytes",
        &[ctr(
            "main",
            &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "1T")],
        )],
        &[],
    );
    let result = h.filter(&p, &["n1"]).await;
    assert!(
        result.failed_and_unresolvable_nodes["n1"]
            .contains("GPU-n1-0 has only 24576 MiB in all, container needs 1000000000000 MiB"),
        "{result:?}"
    );
    // An unknown annotation value.
    let p = pod(
        "policy",
        &[vgpu("main", 1, 1024, 10)],
        &[("vgpu.io/node-scheduler-policy", "tight")],
    );
    let result = h.filter(&p, &["n1"]).await;
    assert!(result.error.contains("annotation vgpu.io/node-scheduler-policy: unknown node policy \"tight\" (known: binpack, spread, random, load-aware)"), "{result:?}");
    healthy(&h).await;
}

#[tokio::test]
async fn unknown_nodes_in_bind_are_refused() {
    let h = Harness::start(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    let p = h
        .create_pod(pod("p", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let result = h.bind(&p, "nowhere").await;
    assert!(
        result.error.contains(
            "vgpu-scheduler does not know node nowhere (it is not in its watch of the Kubernetes API)"
        ),
        "{result:?}"
    );
    assert!(h.decision(&p).await.is_none());
    assert!(h.api.pod("p").await.expect("pod")["spec"]["nodeName"].is_null());
}

/// Through the fault proxy: a pod's binding to node n1 held back after its
/// decision is counted (and the node's lock released), while another bind
/// of the same pod to n2 comes in. It is refused: deciding anew under n2's
/// lock would count the pod on both nodes.
#[tokio::test]
async fn a_second_bind_of_a_pod_while_one_runs_is_refused() {
    let h = Harness::start_behind_proxy(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    h.put_node(node("n2", &[gpu("NVIDIA A10", 24)])).await;
    let p = h
        .create_pod(pod("twice", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    h.caught_up(version_of(&p), 0).await;
    let binding = Gate::new();
    h.proxy().inject(Fault::new(
        Verb::Create,
        pod_binding("twice"),
        Action::Hold(binding.clone()),
    ));
    let first = {
        let client = h.client.clone();
        let body = json!({
            "PodName": "twice",
            "PodNamespace": p["metadata"]["namespace"],
            "PodUID": uid_of(&p),
            "Node": "n1",
        });
        tokio::spawn(async move { client.post("/bind", body.to_string().into_bytes()).await })
    };
    // The first bind has decided; its binding waits.
    tokio::time::timeout(Duration::from_secs(20), binding.reached())
        .await
        .expect("the first bind's binding arrives");
    // Refused at once (deciding anew, it would wait for its own binding).
    let second = tokio::time::timeout(Duration::from_secs(10), h.bind(&p, "n2"))
        .await
        .expect("the second bind answers while the first is held");
    assert_eq!(
        second.error,
        "pod ml-team/twice is being bound by another request; kube-scheduler will retry"
    );
    binding.open();
    let (status, reply) = first.await.expect("first bind").expect("answered");
    let reply: serde_json::Value = serde_json::from_slice(&reply).expect("JSON");
    assert_eq!(status, 200);
    assert!(
        reply["Error"].as_str().unwrap_or_default().is_empty(),
        "{reply}"
    );
    let stored = h.api.pod("twice").await.expect("pod");
    assert_eq!(stored["spec"]["nodeName"], "n1");
    assert_eq!(h.decision(&p).await.expect("decision").node, "n1");
    healthy(&h).await;
}

/// Through the fault proxy: lists held back until the extender has been
/// asked while they are missing, a fault a real API server does not
/// produce on demand.
#[tokio::test]
async fn nothing_is_decided_before_the_first_complete_list() {
    let (_server, client) = real_api_server().await;
    let api = Api::new(client.clone());
    api.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    api.put_lease("n1", LONG_LEASE_SECONDS).await;
    let proxy = FaultProxy::start(client).await;
    let lists = Gate::new();
    proxy.inject(Fault::new(
        Verb::List,
        vgpu_testkit::fault_proxy::ANYTHING,
        Action::Hold(lists.clone()),
    ));
    let running = start_extender(&test_config(), &proxy.source(), None).await;
    let client = ExtenderClient::new(running.local_addr);
    let (status, _) = client.get("/readyz").await.expect("readyz");
    assert_eq!(status, 503);
    let (status, body) = client.get("/healthz").await.expect("healthz");
    assert_eq!((status, body.as_slice()), (200, b"ok".as_slice()));
    let p = pod("early", &[vgpu("main", 1, 1024, 10)], &[]);
    let body = json!({ "Pod": p, "NodeNames": ["n1"] })
        .to_string()
        .into_bytes();
    let (status, reply) = client.post("/filter", body.clone()).await.expect("filter");
    assert_eq!(status, 200);
    assert_eq!(
        error_of(&reply),
        "vgpu-scheduler is still listing pods and nodes from the Kubernetes API; retry shortly"
    );
    lists.open();
    assert!(running.wait_ready(Duration::from_secs(10)).await);
    let (status, _) = client.get("/readyz").await.expect("readyz");
    assert_eq!(status, 200);
    let (_, reply) = client.post("/filter", body).await.expect("filter");
    assert_eq!(error_of(&reply), "");
    running.stop();
}

#[tokio::test]
async fn an_unreachable_api_server_is_survived() {
    // Nothing listens there: the extender starts, stays unready, answers.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let dead_addr = dead.local_addr().expect("addr");
    drop(dead);
    let running = start_extender(
        &test_config(),
        &ApiSource::Url(format!("http://{dead_addr}")),
        None,
    )
    .await;
    assert!(!running.wait_ready(Duration::from_millis(300)).await);
    let client = ExtenderClient::new(running.local_addr);
    let (status, _) = client.get("/readyz").await.expect("readyz");
    assert_eq!(status, 503);
    let (status, body) = client
        .post(
            "/bind",
            br#"{"PodName":"p","PodNamespace":"ns","PodUID":"u","Node":"n"}"#.to_vec(),
        )
        .await
        .expect("bind");
    assert_eq!(status, 200);
    assert!(
        error_of(&body).contains("reading pod ns/p failed"),
        "{}",
        error_of(&body)
    );
    running.stop();
}
