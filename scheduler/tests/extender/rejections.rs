//! Every reason a node is turned down, in the words the user sees, and
//! whether kube-scheduler may try preemption for it.

use crate::harness::*;
use std::time::Duration;
use vgpu_scheduler::cache::clock::now_unix_ms;
use vgpu_scheduler::cache::leases::Liveness;
use vgpu_scheduler::extender::Config;

/// Asserts the node was rejected with a message containing `expected`;
/// `permanent` says which map it must be in.
fn rejected(
    result: &vgpu_scheduler::extender::wire::ExtenderFilterResult,
    node: &str,
    permanent: bool,
    expected: &str,
) {
    let (map, other) = if permanent {
        (&result.failed_and_unresolvable_nodes, &result.failed_nodes)
    } else {
        (&result.failed_nodes, &result.failed_and_unresolvable_nodes)
    };
    let message = map
        .get(node)
        .unwrap_or_else(|| panic!("{node} not rejected (permanent: {permanent}): {result:?}"));
    assert!(
        message.contains(expected),
        "{node}: {message:?} lacks {expected:?}"
    );
    // kube-scheduler reads a reason as a format string.
    assert!(!message.contains('%'), "{node}: {message:?} has a %");
    assert!(!other.contains_key(node));
    assert!(
        !result
            .node_names
            .as_ref()
            .is_some_and(|n| n.iter().any(|x| x == node)),
        "{node} passed"
    );
}

#[tokio::test]
async fn node_level_reasons() {
    let h = Harness::start(Config {
        node_lease_grace: Duration::ZERO,
        ..test_config()
    })
    .await;
    h.add_nodes(vec![
        node_with_annotation("no-inventory", None),
        node_with_annotation("bad-inventory", Some("{\"version\":1,\"gpus\":".into())),
        node_with_annotation(
            "future-inventory",
            Some(r#"{"version":9,"gpus":[]}"#.into()),
        ),
        node("no-gpus", &[]),
        node("ok", &[gpu("NVIDIA A10", 24)]),
    ])
    .await;
    h.put_node_without_lease(node("no-lease", &[gpu("NVIDIA A10", 24)]))
        .await;
    // A plugin that renewed a 1 s Lease once and stopped.
    h.put_node(node("stale", &[gpu("NVIDIA A10", 24)])).await;
    h.renew_lease("stale", 1).await;
    let state = h.running().scheduler.state().clone();
    let expired = tokio::time::Instant::now() + Duration::from_secs(10);
    while matches!(
        state
            .read()
            .liveness("stale", now_unix_ms(), Duration::ZERO),
        Liveness::Live { .. }
    ) {
        assert!(
            tokio::time::Instant::now() < expired,
            "the 1 s Lease never ran out"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let p = h
        .create_pod(pod("p", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let result = h
        .filter(
            &p,
            &[
                "no-inventory",
                "bad-inventory",
                "future-inventory",
                "stale",
                "no-lease",
                "no-gpus",
                "ok",
                "ghost",
            ],
        )
        .await;
    assert_eq!(result.node_names, Some(vec!["ok".to_string()]));
    rejected(
        &result,
        "ghost",
        true,
        "vgpu-scheduler does not know this node",
    );
    rejected(
        &result,
        "no-inventory",
        true,
        "node has no vGPU inventory (annotation vgpu.io/node-gpus); is the vgpu device plugin running on it?",
    );
    rejected(
        &result,
        "bad-inventory",
        true,
        "node's vGPU inventory is unreadable: vgpu.io/node-gpus: not valid JSON",
    );
    rejected(
        &result,
        "future-inventory",
        true,
        "format version 9, this build understands 1",
    );
    rejected(
        &result,
        "stale",
        true,
        "s ago (it lasts 1 s, plus 0 s grace): no new vGPU pods until it renews it",
    );
    rejected(
        &result,
        "stale",
        true,
        "the vgpu device plugin on this node last renewed its Lease ",
    );
    rejected(
        &result,
        "no-lease",
        true,
        "the vgpu device plugin on this node holds no Lease (kube-node-lease/vgpu-no-lease): it is not running, or may not write Leases",
    );
    rejected(
        &result,
        "no-gpus",
        true,
        "container \"main\" needs 1 GPU with 1024 MiB and 10 percent compute each; the node has no GPUs",
    );
    // The same with full Node objects (nodeCacheCapable: false).
    let mut objects = Vec::new();
    for n in ["no-inventory", "ok"] {
        objects.push(h.api.node(n).await.expect("node"));
    }
    let result = h.filter_objects(&p, &objects).await;
    let items = result
        .nodes
        .as_ref()
        .and_then(|n| n.items.clone())
        .expect("Nodes");
    assert_eq!(
        items,
        vec![objects[1].clone()],
        "the passing node, unchanged"
    );
    assert!(result.node_names.is_none());
    rejected(&result, "no-inventory", true, "node has no vGPU inventory");
    // The plugins renew again: the nodes are usable again.
    h.renew_lease("stale", LONG_LEASE_SECONDS).await;
    h.renew_lease("no-lease", LONG_LEASE_SECONDS).await;
    let result = h.filter(&p, &["stale", "no-lease"]).await;
    assert_eq!(
        result.node_names,
        Some(vec!["stale".to_string(), "no-lease".to_string()])
    );
    // A deleted node is unknown.
    h.delete_node("ok").await;
    rejected(
        &h.filter(&p, &["ok"]).await,
        "ok",
        true,
        "does not know this node",
    );
}

#[tokio::test]
async fn gpu_level_reasons() {
    let h = Harness::start(test_config()).await;
    let mut sick = gpu("NVIDIA A10", 24);
    sick.healthy = false;
    let mut two_slots = gpu("NVIDIA A10", 24);
    two_slots.split = 2;
    h.add_nodes(vec![
        node("sick", &[sick]),
        node("t4", &[gpu("Tesla T4", 16)]),
        node("small", &[gpu("NVIDIA A10", 8)]),
        node("full-mem", &[gpu("NVIDIA A10", 24)]),
        node("full-cores", &[gpu("NVIDIA A10", 24)]),
        node("full-slots", &[two_slots]),
        node("exclusive", &[gpu("NVIDIA A10", 24)]),
        node("busy", &[gpu("NVIDIA A10", 24)]),
        node("one-gpu", &[gpu("NVIDIA A10", 24)]),
    ])
    .await;
    h.occupy("m", "full-mem", &[(0, 20, 10)]).await;
    h.occupy("c", "full-cores", &[(0, 1, 90)]).await;
    h.occupy("s", "full-slots", &[(0, 1, 1), (0, 1, 1)]).await;
    h.occupy("x", "exclusive", &[(0, 1, 100)]).await;
    h.occupy("b", "busy", &[(0, 1, 5)]).await;

    let check =
        |pod_name: &'static str, containers: Vec<Ctr>, annotations: Vec<(&'static str, String)>| {
            let annotations: Vec<(&str, &str)> =
                annotations.iter().map(|(k, v)| (*k, v.as_str())).collect();
            pod(pod_name, &containers, &annotations)
        };

    let p = check("unhealthy", vec![vgpu("main", 1, 1024, 10)], vec![]);
    rejected(
        &h.filter(&p, &["sick"]).await,
        "sick",
        true,
        "GPU-sick-0 is unhealthy",
    );

    let p = check(
        "wants-a10",
        vec![vgpu("main", 1, 1024, 10)],
        vec![("nvidia.com/use-gputype", "A10,A100".into())],
    );
    rejected(
        &h.filter(&p, &["t4"]).await,
        "t4",
        true,
        "GPU-t4-0 is a Tesla T4, not one of nvidia.com/use-gputype (a10, a100)",
    );
    let p = check(
        "no-t4",
        vec![vgpu("main", 1, 1024, 10)],
        vec![("nvidia.com/nouse-gputype", "T4".into())],
    );
    rejected(
        &h.filter(&p, &["t4"]).await,
        "t4",
        true,
        "GPU-t4-0 is a Tesla T4, excluded by nvidia.com/nouse-gputype (t4)",
    );
    let p = check(
        "wants-uuid",
        vec![vgpu("main", 1, 1024, 10)],
        vec![("nvidia.com/use-gpuuuid", uuid("small", 0))],
    );
    rejected(
        &h.filter(&p, &["t4"]).await,
        "t4",
        true,
        "GPU-t4-0 is not in nvidia.com/use-gpuuuid",
    );
    let p = check(
        "no-uuid",
        vec![vgpu("main", 1, 1024, 10)],
        vec![("nvidia.com/nouse-gpuuuid", uuid("t4", 0))],
    );
    rejected(
        &h.filter(&p, &["t4"]).await,
        "t4",
        true,
        "GPU-t4-0 is excluded by nvidia.com/nouse-gpuuuid",
    );

    let p = check("huge", vec![vgpu("main", 1, 16384, 10)], vec![]);
    rejected(
        &h.filter(&p, &["small"]).await,
        "small",
        true,
        "GPU-small-0 has only 8192 MiB in all, container needs 16384 MiB",
    );
    let p = check("memory", vec![vgpu("main", 1, 8192, 10)], vec![]);
    rejected(
        &h.filter(&p, &["full-mem"]).await,
        "full-mem",
        false,
        "container \"main\" needs 1 GPU with 8192 MiB and 10 percent compute each; none of the node's 1 GPU can take it: \
         GPU-full-mem-0 has 4096 MiB free, container needs 8192 MiB",
    );
    let p = check("cores", vec![vgpu("main", 1, 1024, 20)], vec![]);
    rejected(
        &h.filter(&p, &["full-cores"]).await,
        "full-cores",
        false,
        "GPU-full-cores-0 has 10 percent compute free, container needs 20 percent",
    );
    let p = check("slots", vec![vgpu("main", 1, 1024, 1)], vec![]);
    rejected(
        &h.filter(&p, &["full-slots"]).await,
        "full-slots",
        false,
        "GPU-full-slots-0 already runs 2 container(s), its limit (split count 2)",
    );
    rejected(
        &h.filter(&p, &["exclusive"]).await,
        "exclusive",
        false,
        "GPU-exclusive-0 is taken whole by another container (100 percent compute)",
    );
    let p = check("whole", vec![vgpu("main", 1, 1024, 100)], vec![]);
    rejected(
        &h.filter(&p, &["busy"]).await,
        "busy",
        false,
        "GPU-busy-0 already runs 1 container(s), container needs it whole (100 percent compute)",
    );
    let p = check("two", vec![vgpu("main", 2, 1024, 10)], vec![]);
    rejected(
        &h.filter(&p, &["one-gpu"]).await,
        "one-gpu",
        true,
        "container \"main\" needs 2 GPUs with 1024 MiB and 10 percent compute each; only 1 of the node's 1 GPU can take it",
    );
    // The second container of a pod is the one that does not fit.
    let p = check(
        "pair",
        vec![vgpu("a", 1, 14336, 10), vgpu("b", 1, 14336, 10)],
        vec![],
    );
    rejected(
        &h.filter(&p, &["one-gpu"]).await,
        "one-gpu",
        false,
        "container \"b\" needs 1 GPU with 14336 MiB",
    );
    // Many GPUs: the message lists four and counts the rest.
    h.put_node(node("eight", &[gpu("Tesla T4", 16); 8])).await;
    let p = check(
        "a10-only",
        vec![vgpu("main", 1, 1024, 10)],
        vec![("nvidia.com/use-gputype", "A10".into())],
    );
    rejected(
        &h.filter(&p, &["eight"]).await,
        "eight",
        true,
        "GPU-eight-3 is a Tesla T4, not one of nvidia.com/use-gputype (a10); and 4 more",
    );
}

#[tokio::test]
async fn bind_waits_for_the_pending_pod_and_says_who_it_is() {
    let h = Harness::start(Config {
        bind_wait: Duration::from_millis(400),
        ..test_config()
    })
    .await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]))
        .await;
    let first = h
        .create_pod(pod("first", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let second = h
        .create_pod(pod("second", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    assert!(h.bind(&first, "n1").await.error.is_empty());
    // Filter still lets the node through (it fits); bind refuses to decide
    // while the first pod is being admitted.
    assert_eq!(
        h.filter(&second, &["n1"]).await.node_names,
        Some(vec!["n1".to_string()])
    );
    let started = std::time::Instant::now();
    let refused = h.bind(&second, "n1").await;
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert!(
        refused.error.contains(
            "node n1 is still admitting ml-team/first (its device plugin has not allocated all its GPUs yet"
        ),
        "{refused:?}"
    );
    assert!(h.decision(&second).await.is_none(), "nothing recorded");
    // Allocated while the bind waits (100 ms into its 400): the bind goes
    // through.
    let api = h.api.clone();
    let allocator = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        api.mark_allocated("first").await
    });
    let result = h.bind(&second, "n1").await;
    assert!(result.error.is_empty(), "{result:?}");
    assert!(allocator.await.expect("allocator").is_some());
    assert_eq!(h.decision(&second).await.expect("decision").node, "n1");
}

#[tokio::test]
async fn bind_refusals() {
    let h = Harness::start(test_config()).await;
    h.add_nodes(vec![
        node("n1", &[gpu("NVIDIA A10", 24)]),
        node("n2", &[gpu("NVIDIA A10", 24)]),
    ])
    .await;

    // Fitted at filter time, not at bind time.
    let late = h
        .create_pod(pod("late", &[vgpu("main", 1, 16384, 10)], &[]))
        .await;
    assert_eq!(
        h.filter(&late, &["n1"]).await.node_names,
        Some(vec!["n1".to_string()])
    );
    h.occupy("grabbed", "n1", &[(0, 12, 10)]).await;
    let result = h.bind(&late, "n1").await;
    assert!(
        result.error.contains("pod ml-team/late does not fit on node n1 any more: container \"main\" needs 1 GPU with 16384 MiB"),
        "{result:?}"
    );

    // Already bound elsewhere.
    let placed = h
        .create_pod(pod("placed", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    assert!(h.bind(&placed, "n2").await.error.is_empty());
    h.allocate(&placed).await;
    let result = h.bind(&placed, "n1").await;
    assert!(
        result
            .error
            .contains("pod ml-team/placed is already bound to node n2"),
        "{result:?}"
    );
    assert!(
        h.bind(&placed, "n2").await.error.is_empty(),
        "binding again where it is succeeds"
    );

    // Recreated under the same name.
    let old = h
        .create_pod(pod("again", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    h.delete_pod(&old).await;
    h.create_pod(pod("again", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let result = h.bind(&old, "n2").await;
    assert!(result.error.contains("(it was recreated)"), "{result:?}");

    // Gone.
    let ghost = pod("ghost", &[vgpu("main", 1, 1024, 10)], &[]);
    let result = h.bind(&ghost, "n2").await;
    assert!(
        result
            .error
            .contains("reading pod ml-team/ghost failed: not found"),
        "{result:?}"
    );
}

/// Through the fault proxy: an API server that refuses a binding (500) is
/// a fault a real one does not produce on demand.
#[tokio::test]
async fn a_binding_the_api_refuses_takes_the_decision_back() {
    let h = Harness::start_behind_proxy(test_config()).await;
    h.put_node(node("n2", &[gpu("NVIDIA A10", 24)])).await;
    // The pod is read back (a 500 may come after the write was stored),
    // found unbound, and the node is free at once.
    h.proxy().inject(Fault::new(
        Verb::Create,
        pod_binding("refused"),
        Action::internal_error("injected binding failure"),
    ));
    let refused = h
        .create_pod(pod("refused", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let result = h.bind(&refused, "n2").await;
    assert!(
        result
            .error
            .contains("binding pod ml-team/refused to node n2 failed"),
        "{result:?}"
    );
    assert_eq!(
        h.proxy().count(Verb::Create, ANY_POD_BINDING),
        1,
        "the binding was tried"
    );
    assert!(h.decision(&refused).await.is_none(), "no decision written");
    assert!(
        h.proxy().count(Verb::Patch, ANY_POD) == 0,
        "the binding wrote the decision: no pod was patched"
    );
    let next = h
        .create_pod(pod("next", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    let started = std::time::Instant::now();
    assert!(h.bind(&next, "n2").await.error.is_empty());
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "not blocked by the refused pod"
    );
}

/// Through the fault proxy: a write between the extender's read and its
/// conditional binding is a race a real API server shows only by chance.
#[tokio::test]
async fn a_pod_changed_before_its_binding_is_decided_again() {
    let h = Harness::start_behind_proxy(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]))
        .await;
    let p = h
        .create_pod(pod("moving", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    // Between the extender's read and its write, someone pins the pod to GPU 1.
    let pinned = uuid("n1", 1);
    h.proxy().inject(
        Fault::new(
            Verb::Create,
            pod_binding("moving"),
            Action::ChangeFirst(pin_to_gpu(&pinned)),
        )
        .times(1),
    );
    let result = h.bind(&p, "n1").await;
    assert!(result.error.is_empty(), "{result:?}");
    assert_eq!(
        h.proxy().count_answered(Verb::Create, ANY_POD_BINDING, 409),
        1,
        "the first binding was refused"
    );
    assert_eq!(
        h.proxy().count_answered(Verb::Create, ANY_POD_BINDING, 201),
        1,
        "the second went through"
    );
    let decision = h.decision(&p).await.expect("decision");
    assert_eq!(
        decision.containers[0].devices[0].uuid, pinned,
        "decided again from the new pod"
    );
}

/// Through the fault proxy: a binding stored whose answer is lost (503) is
/// a fault a real API server does not produce on demand. The Kubernetes
/// client retries the 503 and its retry conflicts with the stored binding;
/// the pod, read back, shows the binding and decision were this bind's.
#[tokio::test]
async fn a_binding_whose_answer_is_lost_is_read_back() {
    let h = Harness::start_behind_proxy(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    let p = h
        .create_pod(pod("unanswered", &[vgpu("main", 1, 1024, 10)], &[]))
        .await;
    h.proxy()
        .inject(Fault::new(Verb::Create, pod_binding("unanswered"), Action::LoseAnswer).times(1));
    let result = h.bind(&p, "n1").await;
    assert!(result.error.is_empty(), "stored, so bound: {result:?}");
    assert_eq!(
        h.proxy().count_answered(Verb::Create, ANY_POD_BINDING, 503),
        1
    );
    assert_eq!(
        h.proxy().count_answered(Verb::Create, ANY_POD_BINDING, 409),
        1,
        "the client's retry meets the binding it stored"
    );
    let stored = h.api.pod("unanswered").await.expect("pod");
    assert_eq!(stored["spec"]["nodeName"], "n1");
    assert_eq!(h.decision(&p).await.expect("decision").node, "n1");
}

/// A pod carrying a decision from an earlier grant (an older extender's
/// failed bind) is decided afresh: the old records are removed first, as
/// a Binding cannot remove annotations.
#[tokio::test]
async fn a_pod_with_an_earlier_decision_and_allocation_is_decided_afresh() {
    let h = Harness::start(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24)])).await;
    let stale = [
        (
            "vgpu.io/decision",
            r#"{"version":1,"node":"n9","decided_unix_ms":1,"containers":[]}"#,
        ),
        ("vgpu.io/allocated", "main"),
    ];
    let p = h
        .create_pod(pod("earlier", &[vgpu("main", 1, 1024, 10)], &stale))
        .await;
    let result = h.bind(&p, "n1").await;
    assert!(result.error.is_empty(), "{result:?}");
    let stored = h.api.pod("earlier").await.expect("pod");
    assert_eq!(stored["spec"]["nodeName"], "n1");
    assert_eq!(h.decision(&p).await.expect("decision").node, "n1");
    assert!(
        stored["metadata"]["annotations"]
            .get("vgpu.io/allocated")
            .is_none(),
        "the old allocation record is gone: {stored}"
    );
}
