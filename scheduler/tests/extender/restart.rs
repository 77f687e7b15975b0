//! A restarted extender rebuilds everything from the API and loses nothing.

use crate::harness::*;
use std::time::Duration;
use vgpu_scheduler::extender::Config;

async fn snapshot(h: &Harness) -> serde_json::Value {
    let (status, body) = h.client.get("/debug/state").await.expect("debug state");
    assert_eq!(status, 200);
    serde_json::from_slice(&body).expect("snapshot JSON")
}

#[tokio::test]
async fn a_restarted_extender_knows_what_the_old_one_knew() {
    let mut h = Harness::start(Config {
        bind_wait: Duration::from_millis(300),
        ..test_config()
    })
    .await;
    h.add_nodes(vec![
        node("n1", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]),
        node("n2", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]),
        node("n3", &[gpu("NVIDIA A100", 80)]),
    ])
    .await;
    let mut setup = vgpu("setup", 1, 20480, 100);
    setup.init = true;
    let pods = vec![
        pod("a", &[vgpu("main", 1, 4096, 20)], &[]),
        pod("b", &[vgpu("main", 2, 2048, 10)], &[]),
        pod("c", &[setup, vgpu("main", 1, 1024, 10)], &[]),
        pod(
            "d",
            &[vgpu("main", 1, 8192, 50)],
            &[("nvidia.com/use-gputype", "A100")],
        ),
    ];
    for p in pods {
        let p = h.create_pod(p).await;
        h.schedule_and_allocate(&p).await;
    }
    // One more, decided and bound but not yet admitted by its plugin.
    let pending = h
        .create_pod(pod("pending", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let pending_node = h.schedule(&pending).await.expect("bound");
    let before = snapshot(&h).await;
    assert_eq!(before["pods"], 5);
    assert_eq!(
        before["nodes"][&pending_node]["pending"],
        serde_json::json!(["ml-team/pending"])
    );

    h.restart().await;
    let after = snapshot(&h).await;
    assert_eq!(before, after, "the rebuilt state is the same");

    // The pending pod still holds its node.
    let other = h
        .create_pod(pod("other", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let refused = h.bind(&other, &pending_node).await;
    assert!(
        refused.error.contains("is still admitting ml-team/pending"),
        "{refused:?}"
    );
    h.allocate(&pending).await;
    assert!(h.bind(&other, &pending_node).await.error.is_empty());
}

/// Through the fault proxy: a binding held long enough to crash the
/// extender during it is a fault a real API server does not produce on
/// demand. The protocol's invariant is checked at every pod version the
/// real server stores.
#[tokio::test]
async fn a_bind_cut_off_by_a_restart_leaves_the_pod_whole_either_way() {
    let mut h = Harness::start_behind_proxy(Config {
        bind_wait: Duration::from_millis(300),
        ..test_config()
    })
    .await;
    let pending = PendingPods::watch(h.api.client().clone(), NAMESPACE).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    let cut = h
        .create_pod(pod("cut", &[vgpu("main", 1, 4096, 10)], &[]))
        .await;
    let gate = Gate::new();
    let held = h.proxy().inject(Fault::new(
        Verb::Create,
        ANY_POD_BINDING,
        Action::Hold(gate.clone()),
    ));
    let client = h.client.clone();
    let body = serde_json::json!({
        "PodName": "cut", "PodNamespace": "ml-team", "PodUID": uid_of(&cut), "Node": "n1"
    });
    let interrupted =
        tokio::spawn(async move { client.post("/bind", body.to_string().into_bytes()).await });
    // Decided and counted, then crash mid-binding.
    gate.reached().await;
    h.restart().await;
    h.proxy().remove(held);
    gate.open();
    assert!(
        interrupted.await.expect("task").is_err(),
        "the old extender is gone"
    );

    // The held binding may or may not reach the server once the gate
    // opens (its client is gone); either way the pod is whole: bound with
    // its decision, or neither.
    let stored = h.api.pod("cut").await.expect("pod");
    let bound = stored["spec"]["nodeName"].as_str().map(str::to_string);
    assert_eq!(
        bound.is_some(),
        h.decision(&cut).await.is_some(),
        "bound exactly when decided: {stored}"
    );
    let other = h
        .create_pod(pod("other", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    if bound.is_some() {
        // Bound, not yet admitted: the node is held until it is.
        let refused = h.bind(&other, "n1").await;
        assert!(
            refused.error.contains("is still admitting ml-team/cut"),
            "{refused:?}"
        );
    } else {
        // Never bound: nothing holds the node, and kube-scheduler's retry
        // of the cut pod goes through.
        assert!(h.bind(&cut, "n1").await.error.is_empty());
    }
    h.allocate(&cut).await;
    assert!(h.bind(&other, "n1").await.error.is_empty());
    let last = version_of(&h.api.pod("other").await.expect("pod"));
    let violations = pending.violations_through(last).await;
    assert!(violations.is_empty(), "{violations:?}");
}

/// Through the fault proxy: a binding held long enough to stop the
/// extender during it is a fault a real API server does not produce on
/// demand.
#[tokio::test]
async fn a_stopping_extender_lets_binds_in_flight_finish() {
    let mut h = Harness::start_behind_proxy(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    let p = h
        .create_pod(pod("late-bind", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let gate = Gate::new();
    h.proxy().inject(Fault::new(
        Verb::Create,
        ANY_POD_BINDING,
        Action::Hold(gate.clone()),
    ));
    let client = h.client.clone();
    let body = serde_json::json!({
        "PodName": "late-bind", "PodNamespace": "ml-team", "PodUID": uid_of(&p), "Node": "n1"
    });
    let bind =
        tokio::spawn(async move { client.post("/bind", body.to_string().into_bytes()).await });
    gate.reached().await;
    // SIGTERM arrives while the binding is in flight; the binding is let
    // through once the extender has begun stopping (`join!` polls the
    // stop first, and it runs until it waits for the bind).
    let running = h.running.take().expect("running");
    let addr = running.local_addr;
    tokio::join!(
        running.serve_until(std::future::ready(()), Duration::from_secs(5)),
        async { gate.open() },
    );
    let (status, reply) = bind.await.expect("task").expect("answered");
    assert_eq!(
        (status, reply.as_slice()),
        (200, br#"{"Error":""}"#.as_slice())
    );
    assert_eq!(
        h.api.pod("late-bind").await.expect("pod")["spec"]["nodeName"],
        "n1"
    );
    assert!(vgpu_testkit::extender_client::ExtenderClient::new(addr)
        .get("/healthz")
        .await
        .is_err());
}
