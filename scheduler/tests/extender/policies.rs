//! Each policy picks what it should, on hand-made clusters, through the
//! whole protocol (filter, prioritize, bind) over HTTP.

use crate::harness::*;
use serde_json::json;
use vgpu_cluster::policy::{GpuPolicy, NodePolicy};
use vgpu_cluster::requests::priority::HighPriorityClasses;
use vgpu_scheduler::admission::mutate::AdmissionPolicy;
use vgpu_scheduler::extender::Config;

/// One node, three A10s: GPU 0 has 1 container (12 GiB, 40 %), GPU 1 has
/// 3 small ones (3 GiB, 9 %), GPU 2 has 2 big ones (18 GiB, 60 %).
async fn three_gpu_node(config: Config) -> Harness {
    let h = Harness::start(config).await;
    h.put_node(node(
        "n1",
        &[
            gpu("NVIDIA A10", 24),
            gpu("NVIDIA A10", 24),
            gpu("NVIDIA A10", 24),
        ],
    ))
    .await;
    h.occupy("big", "n1", &[(0, 12, 40)]).await;
    h.occupy("small", "n1", &[(1, 1, 3), (1, 1, 3), (1, 1, 3)])
        .await;
    h.occupy("heavy", "n1", &[(2, 9, 30), (2, 9, 30)]).await;
    h
}

async fn gpu_chosen(h: &Harness, name: &str, annotations: &[(&str, &str)]) -> String {
    let p = h
        .create_pod(pod(name, &[vgpu("main", 1, 4096, 10)], annotations))
        .await;
    let decision = h.schedule_and_allocate(&p).await;
    h.delete_pod(&p).await;
    decision.containers[0].devices[0].uuid.clone()
}

#[tokio::test]
async fn gpu_policies_choose_fewest_tasks_fullest_or_emptiest_gpu() {
    let h = three_gpu_node(test_config()).await;
    assert_eq!(
        gpu_chosen(&h, "default", &[]).await,
        uuid("n1", 0),
        "fewest tasks"
    );
    assert_eq!(
        gpu_chosen(&h, "packed", &[("vgpu.io/gpu-scheduler-policy", "binpack")]).await,
        uuid("n1", 2),
        "binpack: the fullest GPU that fits"
    );
    assert_eq!(
        gpu_chosen(&h, "spread", &[("hami.io/gpu-scheduler-policy", "spread")]).await,
        uuid("n1", 1),
        "spread (HAMi's annotation): the least used GPU"
    );
    assert_eq!(
        gpu_chosen(
            &h,
            "both",
            &[
                ("vgpu.io/gpu-scheduler-policy", "fewest-tasks"),
                ("hami.io/gpu-scheduler-policy", "binpack")
            ]
        )
        .await,
        uuid("n1", 0),
        "vgpu.io wins over hami.io"
    );

    let h = three_gpu_node(Config {
        gpu_policy: GpuPolicy::Binpack,
        ..test_config()
    })
    .await;
    assert_eq!(
        gpu_chosen(&h, "flag", &[]).await,
        uuid("n1", 2),
        "--gpu-policy binpack"
    );
}

/// Three nodes of two A10s: empty, half used, mostly used.
async fn three_nodes(config: Config) -> Harness {
    let h = Harness::start(config).await;
    h.add_nodes(vec![
        node("empty", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]),
        node("half", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]),
        node("full", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]),
    ])
    .await;
    h.occupy("h", "half", &[(0, 12, 50), (1, 12, 50)]).await;
    h.occupy("f", "full", &[(0, 20, 80), (1, 20, 80)]).await;
    h
}

fn score(list: &vgpu_scheduler::extender::wire::HostPriorityList, host: &str) -> i64 {
    list.iter()
        .find(|h| h.host == host)
        .map(|h| h.score)
        .expect("scored")
}

#[tokio::test]
async fn node_policies_binpack_spread_and_random() {
    let h = three_nodes(test_config()).await;
    let nodes = ["empty", "half", "full"];
    let p = h
        .create_pod(pod("p", &[vgpu("main", 1, 2048, 10)], &[]))
        .await;
    let scores = h.prioritize(&p, &nodes).await;
    assert!(
        score(&scores, "full") > score(&scores, "half")
            && score(&scores, "half") > score(&scores, "empty"),
        "binpack (default): {scores:?}"
    );
    assert!(scores.iter().all(|s| (0..=10).contains(&s.score)));
    assert_eq!(h.schedule(&p).await.expect("bound"), "full");
    h.allocate(&p).await;

    for annotation in [
        "vgpu.io/node-scheduler-policy",
        "hami.io/node-scheduler-policy",
    ] {
        let name = format!("spread-{}", &annotation[..4]);
        let p = h
            .create_pod(pod(
                &name,
                &[vgpu("main", 1, 2048, 10)],
                &[(annotation, "spread")],
            ))
            .await;
        let scores = h.prioritize(&p, &nodes).await;
        assert!(
            score(&scores, "empty") > score(&scores, "half")
                && score(&scores, "half") > score(&scores, "full"),
            "spread via {annotation}: {scores:?}"
        );
        assert_eq!(h.schedule(&p).await.expect("bound"), "empty");
        h.allocate(&p).await;
        h.delete_pod(&p).await;
    }

    // Random: different pods get different favourites.
    let h = three_nodes(Config {
        node_policy: NodePolicy::Random,
        ..test_config()
    })
    .await;
    let mut favourites = std::collections::HashSet::new();
    let mut distinct_scores = std::collections::HashSet::new();
    for i in 0..40 {
        let mut p = pod(&format!("r{i}"), &[vgpu("main", 1, 2048, 10)], &[]);
        p["metadata"]["uid"] = json!(format!("random-{i}"));
        let scores = h.prioritize(&p, &nodes).await;
        let again = h.prioritize(&p, &nodes).await;
        assert_eq!(scores, again, "stable for one pod");
        distinct_scores.extend(scores.iter().map(|s| s.score));
        let best = scores.iter().max_by_key(|s| s.score).expect("scores");
        favourites.insert(best.host.clone());
    }
    assert_eq!(
        favourites.len(),
        3,
        "every node is someone's favourite: {favourites:?}"
    );
    assert!(distinct_scores.len() > 3, "{distinct_scores:?}");
}

#[tokio::test]
async fn nodes_with_more_gpus_of_the_wanted_model_score_higher() {
    let h = Harness::start(Config {
        node_policy: NodePolicy::Spread,
        ..test_config()
    })
    .await;
    h.add_nodes(vec![
        node(
            "mixed",
            &[
                gpu("NVIDIA A100-SXM4-80GB", 80),
                gpu("Tesla T4", 16),
                gpu("Tesla T4", 16),
                gpu("Tesla T4", 16),
            ],
        ),
        node("a100s", &[gpu("NVIDIA A100-SXM4-80GB", 80); 4]),
        node("t4s", &[gpu("Tesla T4", 16); 4]),
    ])
    .await;
    let p = h
        .create_pod(pod(
            "m",
            &[vgpu("main", 1, 8192, 20)],
            &[("nvidia.com/use-gputype", "a100")],
        ))
        .await;
    let filtered = h.filter(&p, &["mixed", "a100s", "t4s"]).await;
    assert_eq!(
        filtered.node_names,
        Some(vec!["mixed".to_string(), "a100s".to_string()])
    );
    assert!(filtered.failed_and_unresolvable_nodes["t4s"]
        .contains("not one of nvidia.com/use-gputype (a100)"));
    let scores = h.prioritize(&p, &["mixed", "a100s"]).await;
    assert!(
        score(&scores, "a100s") > score(&scores, "mixed"),
        "{scores:?}"
    );
    assert_eq!(h.schedule(&p).await.expect("bound"), "a100s");
    let decision = h.decision(&p).await.expect("decision");
    assert!(decision.containers[0].devices[0]
        .uuid
        .starts_with("GPU-a100s-"));
}

#[tokio::test]
async fn uuid_and_type_annotations_pick_and_avoid_gpus() {
    let h = Harness::start(test_config()).await;
    h.put_node(node(
        "n1",
        &[
            gpu("NVIDIA A10", 24),
            gpu("Tesla T4", 16),
            gpu("NVIDIA A10", 24),
        ],
    ))
    .await;
    let wanted = uuid("n1", 2);
    let p = h
        .create_pod(pod(
            "u",
            &[vgpu("main", 1, 1024, 10)],
            &[("nvidia.com/use-gpuuuid", &wanted)],
        ))
        .await;
    assert_eq!(
        h.schedule_and_allocate(&p).await.containers[0].devices[0].uuid,
        wanted
    );
    let avoid = format!("{},{}", uuid("n1", 0), uuid("n1", 2));
    let p = h
        .create_pod(pod(
            "v",
            &[vgpu("main", 1, 1024, 10)],
            &[("nvidia.com/nouse-gpuuuid", &avoid)],
        ))
        .await;
    assert_eq!(
        h.schedule_and_allocate(&p).await.containers[0].devices[0].uuid,
        uuid("n1", 1)
    );
    let p = h
        .create_pod(pod(
            "w",
            &[vgpu("main", 2, 1024, 10)],
            &[("nvidia.com/nouse-gputype", "t4")],
        ))
        .await;
    let devices: Vec<String> = h.schedule_and_allocate(&p).await.containers[0]
        .devices
        .iter()
        .map(|d| d.uuid.clone())
        .collect();
    assert_eq!(devices, vec![uuid("n1", 0), uuid("n1", 2)]);
}

#[tokio::test]
async fn init_sidecar_and_regular_containers_get_one_decision_in_admission_order() {
    let h = Harness::start(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 16), gpu("NVIDIA A10", 16)]))
        .await;
    let mut setup = ctr(
        "setup",
        &[
            ("nvidia.com/gpu", "1"),
            ("nvidia.com/gpumem-percentage", "75"),
        ],
    );
    setup.init = true;
    let mut proxy = ctr(
        "proxy",
        &[
            ("nvidia.com/gpu", "1"),
            ("nvidia.com/gpumem", "512"),
            ("nvidia.com/gpucores", "5"),
            ("nvidia.com/priority", "1"),
        ],
    );
    proxy.init = true;
    proxy.sidecar = true;
    let mut main = vgpu("main", 2, 4096, 30);
    main.limits.push(("nvidia.com/priority", "0".into()));
    let p = h
        .create_pod(pod(
            "multi",
            &[setup, proxy, main, ctr("logger", &[("cpu", "100m")])],
            &[],
        ))
        .await;
    let node = h.schedule(&p).await.expect("bound");
    assert_eq!(node, "n1");
    let decision = h.decision(&p).await.expect("decision");
    let names: Vec<(&str, bool)> = decision
        .containers
        .iter()
        .map(|c| (c.name.as_str(), c.init))
        .collect();
    assert_eq!(
        names,
        vec![("setup", true), ("proxy", true), ("main", false)]
    );
    let setup = &decision.containers[0];
    assert_eq!(setup.devices[0].memory_bytes, 12 * GIB, "75 % of 16 GiB");
    let proxy = &decision.containers[1];
    assert_eq!(
        (
            proxy.devices[0].memory_bytes,
            proxy.devices[0].cores_percent,
            proxy.priority
        ),
        (512 * MIB, 5, Some(1))
    );
    let main = &decision.containers[2];
    assert_eq!(main.devices.len(), 2);
    assert_ne!(main.devices[0].uuid, main.devices[1].uuid);
    // Priority 0 (above the default) is the pod's own word, and no
    // PriorityClass may run above the default here: the default.
    assert_eq!(main.priority, None);
    assert!(main
        .devices
        .iter()
        .all(|d| d.memory_bytes == 4096 * MIB && d.cores_percent == 30));
    // The node is busy until the plugin has allocated the pod.
    let pods = &h.running().scheduler.state().read().debug_state(
        vgpu_scheduler::cache::clock::now_unix_ms(),
        h.config.unbound_grace,
        h.config.node_lease_grace,
    );
    assert_eq!(pods.nodes["n1"].pending, vec!["ml-team/multi".to_string()]);
}

#[tokio::test]
async fn elastic_gpu_whole_cards_are_exclusive() {
    let h = Harness::start(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24); 3])).await;
    let p = h
        .create_pod(pod(
            "two-cards",
            // With the GPU count the webhook adds.
            &[ctr(
                "main",
                &[("elasticgpu.io/gpu-core", "200"), ("nvidia.com/gpu", "2")],
            )],
            &[],
        ))
        .await;
    let decision = h.schedule_and_allocate(&p).await;
    let devices = &decision.containers[0].devices;
    assert_eq!(devices.len(), 2);
    assert!(devices
        .iter()
        .all(|d| d.cores_percent == 100 && d.memory_bytes == 24 * GIB));
    let taken: Vec<&str> = devices.iter().map(|d| d.uuid.as_str()).collect();
    let p = h
        .create_pod(pod(
            "small",
            &[ctr(
                "main",
                &[("elasticgpu.io/gpu-memory", "256"), ("nvidia.com/gpu", "1")],
            )],
            &[],
        ))
        .await;
    let decision = h.schedule_and_allocate(&p).await;
    let device = &decision.containers[0].devices[0];
    assert!(
        !taken.contains(&device.uuid.as_str()),
        "whole cards take nobody else"
    );
    assert_eq!(device.memory_bytes, 256 * MIB);
    let p = h
        .create_pod(pod(
            "third",
            &[ctr(
                "main",
                &[("elasticgpu.io/gpu-core", "100"), ("nvidia.com/gpu", "1")],
            )],
            &[],
        ))
        .await;
    let filtered = h.filter(&p, &["n1"]).await;
    assert!(
        filtered.failed_nodes["n1"].contains("container needs it whole"),
        "{filtered:?}"
    );
}

#[tokio::test]
async fn recorded_kube_scheduler_bodies_work_in_both_node_modes() {
    let h = Harness::start(test_config()).await;
    h.add_nodes(vec![
        node(
            "gpu-node-1",
            &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)],
        ),
        node("gpu-node-2", &[gpu("NVIDIA A10", 24)]),
    ])
    .await;
    // nodeCacheCapable: true, the body exactly as recorded.
    let (status, body) = h.post("/filter", fixture_bytes("filter_args.json")).await;
    assert_eq!(status, 200);
    let result: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(result["NodeNames"], json!(["gpu-node-1", "gpu-node-2"]));
    assert_eq!(result["Nodes"], json!(null));
    assert_eq!(result["Error"], "");
    // nodeCacheCapable: false: the passing Node objects come back unchanged.
    let sent = fixture("filter_args_nodes.json");
    let (status, body) = h
        .post("/filter", fixture_bytes("filter_args_nodes.json"))
        .await;
    assert_eq!(status, 200);
    let result: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(result["Nodes"]["items"], sent["Nodes"]["items"]);
    assert_eq!(result["NodeNames"], json!(null));
    let (status, body) = h
        .post("/prioritize", fixture_bytes("filter_args_nodes.json"))
        .await;
    assert_eq!(status, 200);
    let scores: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(scores.as_array().map(Vec::len), Some(2));
    assert!(scores[0]["Host"].is_string() && scores[0]["Score"].is_i64());

    // Elastic GPU Scheduler's URLs answer the same.
    let (status, body) = h
        .post("/scheduler/priorities", fixture_bytes("filter_args.json"))
        .await;
    assert_eq!(status, 200);
    assert!(String::from_utf8_lossy(&body).contains(r#"{"Host":"gpu-node-1","Score":"#));
    let (status, _) = h
        .post("/scheduler/filter", fixture_bytes("filter_args.json"))
        .await;
    assert_eq!(status, 200);

    // The recorded pod, created in the API, bound with the recorded bind
    // body; the API server gave the pod a UID of its own, which replaces
    // the recorded one (the extender refuses a pod whose UID differs).
    let recorded = fixture("pod.json");
    let created = h.create_pod(recorded.clone()).await;
    let mut bind_args = fixture("bind_args.json");
    assert_eq!(bind_args["PodUID"], recorded["metadata"]["uid"]);
    bind_args["PodUID"] = json!(uid_of(&created));
    let (status, body) = h.post("/bind", bind_args.to_string().into_bytes()).await;
    assert_eq!(status, 200);
    assert_eq!(String::from_utf8_lossy(&body), r#"{"Error":""}"#);
    let bound = h.api.pod(&name_of(&recorded)).await.expect("pod");
    assert_eq!(bound["spec"]["nodeName"], "gpu-node-1");
    let decision = decision_of(&bound).expect("decision");
    assert_eq!(decision.node, "gpu-node-1");
    assert_eq!(decision.containers[0].name, "train");
    assert_eq!(
        decision.containers[0].devices[0].memory_bytes,
        3000 * MIB,
        "\"3k\" MiB"
    );
    assert_eq!(decision.containers[0].devices[0].cores_percent, 30);
}

#[tokio::test]
async fn pods_without_gpus_pass_everywhere_but_are_not_bound_by_the_extender() {
    let h = Harness::start(test_config()).await;
    h.add_nodes(vec![
        node_with_annotation("plain", None),
        node("n1", &[gpu("NVIDIA A10", 24)]),
    ])
    .await;
    let p = h
        .create_pod(pod("web", &[ctr("nginx", &[("cpu", "1")])], &[]))
        .await;
    let filtered = h.filter(&p, &["plain", "n1"]).await;
    assert_eq!(
        filtered.node_names,
        Some(vec!["plain".to_string(), "n1".to_string()])
    );
    assert!(filtered.failed_nodes.is_empty() && filtered.failed_and_unresolvable_nodes.is_empty());
    assert!(h
        .prioritize(&p, &["plain", "n1"])
        .await
        .iter()
        .all(|s| s.score == 0));
    // kube-scheduler binds such a pod itself (it asks for none of the
    // extender's managedResources); a bind asked of the extender is not
    // kube-scheduler's, and is refused (hostile::bind_refuses_pods_that_ask_for_no_vgpu).
    let refused = h.bind(&p, "plain").await.error;
    assert!(refused.contains("asks for no vGPU resource"), "{refused}");
    let unbound = h.api.pod("web").await.expect("pod");
    assert!(unbound["spec"]["nodeName"].is_null());
    assert!(h.decision(&p).await.is_none());
}

#[tokio::test]
async fn the_burst_annotation_reaches_every_capped_vgpu_of_the_decision() {
    let h = Harness::start(test_config()).await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 24), gpu("NVIDIA A10", 24)]))
        .await;
    let p = h
        .create_pod(pod(
            "bursty",
            &[vgpu("capped", 1, 1024, 30), vgpu("whole", 1, 1024, 100)],
            &[("vgpu.io/gpucores-burst", "80")],
        ))
        .await;
    let decision = h.schedule_and_allocate(&p).await;
    let burst_of = |name: &str| -> Vec<Option<u32>> {
        decision
            .containers
            .iter()
            .find(|c| c.name == name)
            .expect("container")
            .devices
            .iter()
            .map(|d| d.burst_percent)
            .collect()
    };
    assert_eq!(burst_of("capped"), vec![Some(80)]);
    assert_eq!(
        burst_of("whole"),
        vec![None],
        "an exclusive GPU has no burst"
    );

    let bad = h
        .create_pod(pod(
            "bad-burst",
            &[vgpu("main", 1, 1024, 30)],
            &[("vgpu.io/gpucores-burst", "150")],
        ))
        .await;
    let error = h.schedule(&bad).await.expect_err("refused");
    assert!(error.contains("vgpu.io/gpucores-burst"), "{error}");
}

/// nvidia-gpu-scheduler's pods name their model in an annotation (KubeShare
/// writes model names label-safe, with `-` for spaces): only nodes with that
/// model pass, on them only GPUs of it are given, and nodes with more of it
/// score higher.
#[tokio::test]
async fn the_gpu_model_annotation_filters_and_scores_by_model() {
    let h = Harness::start(test_config()).await;
    h.add_nodes(vec![
        node(
            "mixed",
            &[gpu("Tesla V100-SXM2-32GB", 32), gpu("Tesla T4", 16)],
        ),
        node("v100s", &[gpu("Tesla V100-SXM2-32GB", 32); 2]),
        node("t4s", &[gpu("Tesla T4", 16); 2]),
    ])
    .await;
    let p = h
        .create_pod(pod(
            "model",
            &[vgpu("main", 1, 4096, 20)],
            &[("nvidia-gpu-scheduler/gpu.model", "Tesla-V100-SXM2-32GB")],
        ))
        .await;
    let filtered = h.filter(&p, &["mixed", "v100s", "t4s"]).await;
    assert_eq!(
        filtered.node_names,
        Some(vec!["mixed".to_string(), "v100s".to_string()])
    );
    let why = &filtered.failed_and_unresolvable_nodes["t4s"];
    assert!(
        why.contains("is a Tesla T4, not the nvidia-gpu-scheduler/gpu.model tesla-v100-sxm2-32gb"),
        "{why}"
    );
    let scores = h.prioritize(&p, &["mixed", "v100s"]).await;
    assert!(
        score(&scores, "v100s") > score(&scores, "mixed"),
        "{scores:?}"
    );
    // On the mixed node only its V100 is given.
    assert_eq!(h.bind(&p, "mixed").await.error, "");
    let decision = h.decision(&p).await.expect("decision");
    assert_eq!(decision.containers[0].devices[0].uuid, uuid("mixed", 0));

    // An empty model is an error the user can read.
    let empty = h
        .create_pod(pod(
            "no-model",
            &[vgpu("main", 1, 4096, 20)],
            &[("nvidia-gpu-scheduler/gpu.model", " ")],
        ))
        .await;
    let result = h.filter(&empty, &["mixed"]).await;
    assert!(
        result.error.contains("nvidia-gpu-scheduler/gpu.model") && result.error.contains("empty"),
        "{result:?}"
    );
}

/// Per-GPU cordon (issue: HAMi 2.10's `hami.io/device-cordon`): a node
/// annotation takes single GPUs out of service for new pods, in vgpu's
/// spelling or HAMi's, while what runs on them keeps running.
#[tokio::test]
async fn cordoned_gpus_get_no_new_pods_until_uncordoned() {
    let h = three_gpu_node(test_config()).await;
    let gpus = [
        gpu("NVIDIA A10", 24),
        gpu("NVIDIA A10", 24),
        gpu("NVIDIA A10", 24),
    ];
    // fewest-tasks (the default) chooses GPU 0 (1 task), then 2 (2), then 1 (3).
    assert_eq!(gpu_chosen(&h, "before", &[]).await, uuid("n1", 0));
    let mut cordoned = node("n1", &gpus);
    cordoned["metadata"]["annotations"]["hami.io/device-cordon"] = json!(uuid("n1", 0));
    h.put_node(cordoned.clone()).await;
    assert_eq!(gpu_chosen(&h, "hami", &[]).await, uuid("n1", 2));
    cordoned["metadata"]["annotations"]["vgpu.io/cordoned-gpus"] = json!(uuid("n1", 2));
    h.put_node(cordoned.clone()).await;
    assert_eq!(gpu_chosen(&h, "both", &[]).await, uuid("n1", 1));
    // Every GPU cordoned: kube-scheduler hears why.
    cordoned["metadata"]["annotations"]["vgpu.io/cordoned-gpus"] =
        json!(format!("{}, {}", uuid("n1", 1), uuid("n1", 2)));
    h.put_node(cordoned).await;
    let p = h
        .create_pod(pod("refused", &[vgpu("main", 1, 4096, 10)], &[]))
        .await;
    let filtered = h.filter(&p, &["n1"]).await;
    let reason = filtered
        .failed_and_unresolvable_nodes
        .get("n1")
        .or_else(|| filtered.failed_nodes.get("n1"))
        .cloned()
        .unwrap_or_default();
    for gpu in 0..3 {
        assert!(
            reason.contains(&format!("{} is cordoned", uuid("n1", gpu))),
            "{reason}"
        );
    }
    // Uncordoned: GPU 0 again, its running pod still counted (1 task).
    h.put_node(node("n1", &gpus)).await;
    assert_eq!(gpu_chosen(&h, "after", &[]).await, uuid("n1", 0));
}

#[tokio::test]
async fn only_pods_of_a_named_priority_class_run_above_the_default_priority() {
    let h = Harness::start(Config {
        admission: AdmissionPolicy {
            high_priority_classes: HighPriorityClasses::new(["inference".to_string()]),
            ..AdmissionPolicy::default()
        },
        ..test_config()
    })
    .await;
    h.put_node(node("n1", &[gpu("NVIDIA A10", 16)])).await;
    let classes: kube::Api<k8s_openapi::api::scheduling::v1::PriorityClass> =
        kube::Api::all(h.api.client().clone());
    for (name, value) in [("inference", 1000), ("batch", 10)] {
        let class = serde_json::from_value(json!({"metadata": {"name": name}, "value": value}))
            .expect("a PriorityClass");
        classes
            .create(&kube::api::PostParams::default(), &class)
            .await
            .expect("PriorityClass created");
    }
    let mut asking = vgpu("main", 1, 1024, 30);
    asking.limits.push(("nvidia.com/priority", "0".into()));
    let mut granted = Vec::new();
    for (name, class) in [
        ("plain", None),
        ("batch", Some("batch")),
        ("inference", Some("inference")),
    ] {
        let mut value = pod(name, std::slice::from_ref(&asking), &[]);
        if let Some(class) = class {
            value["spec"]["priorityClassName"] = json!(class);
            // The API server computes it from the class.
            if let Some(spec) = value["spec"].as_object_mut() {
                spec.remove("priority");
            }
        }
        let created = h.create_pod(value).await;
        let decision = h.schedule_and_allocate(&created).await;
        granted.push((name, decision.containers[0].priority));
    }
    assert_eq!(
        granted,
        vec![("plain", None), ("batch", None), ("inference", Some(0))]
    );
}
