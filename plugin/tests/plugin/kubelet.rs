//! The plugin run in-process on a fixed GPU list, with health injected
//! through the health-source trait, against a fake kubelet (real gRPC over
//! unix sockets) and a real API server (etcd and kube-apiserver, one per
//! test): registration, re-registration when kubelet restarts, health
//! updates in `ListAndWatch` and in the node inventory, and `Allocate`'s
//! refusals. Needs no simulated GPU. The allocation record written after
//! the answer, with the pod writes refused or lost (which a real server
//! cannot be made to do on cue), is in `records.rs`.

use crate::support::kubelet::{gpus, FakeKubelet, PluginConn};
use crate::support::*;
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::watch;
use vgpu_cluster::decision::DeviceGrant;
use vgpu_node_agent::health::{ManualHealthHandle, Signal};

const WAIT: Duration = Duration::from_secs(10);

struct Harness {
    dir: PathBuf,
    plugin_dir: PathBuf,
    health: ManualHealthHandle,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), vgpu_device_plugin::PluginError>>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.task.abort();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn start_plugin(api: &ControlPlane, node: &str, tag: &str) -> Harness {
    let dir = std::env::temp_dir().join(format!("vgpu-plugin-test-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let plugin_dir = dir.join("device-plugins");
    std::fs::create_dir_all(&plugin_dir).expect("dirs");
    let (health, stop, task) =
        crate::support::kubelet::spawn_in_process(node, &dir, &api.source()).await;
    Harness {
        dir,
        plugin_dir,
        health,
        stop,
        task,
    }
}

fn health_of(conn: &PluginConn, uuid: &str) -> Vec<String> {
    conn.devices
        .borrow()
        .iter()
        .flatten()
        .filter(|d| d.id.starts_with(uuid))
        .map(|d| d.health.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_reports_health_and_registers_again_after_kubelet_restarts() {
    let api = ControlPlane::start().await;
    api.add_node("node-a").await;
    let harness = start_plugin(&api, "node-a", "register").await;
    let mut kubelet = FakeKubelet::start(&harness.plugin_dir);

    let registration = kubelet.next_registration(WAIT).await;
    assert_eq!(registration.version, "v1beta1");
    assert_eq!(registration.resource_name, RESOURCE);
    assert_eq!(registration.endpoint, "vgpu.sock");
    let options = registration.options.expect("options");
    assert!(options.get_preferred_allocation_available);
    assert!(!options.pre_start_required);

    let mut conn = kubelet.connect(&registration).await;
    let devices = conn.wait_devices(WAIT, |list| list.len() == 20).await;
    let [gpu0, gpu1] = [gpus()[0].uuid.clone(), gpus()[1].uuid.clone()];
    assert!(devices.iter().all(|d| d.health == "Healthy"));
    assert_eq!(devices[0].id, format!("{gpu0}::0"));
    assert_eq!(devices[19].id, format!("{gpu1}::9"));
    assert_eq!(
        devices[19].topology.as_ref().map(|t| t.nodes[0].id),
        Some(1),
        "NUMA node"
    );

    // The inventory is published at once; the node's Lease is held by the
    // node and renewed (every quarter of its 2 s).
    let first = eventually(WAIT, "the node inventory", || async {
        api.inventory("node-a").await
    })
    .await;
    assert_eq!(first.gpus, gpus());
    let renewed_at = |lease: &k8s_openapi::api::coordination::v1::Lease| {
        lease.spec.as_ref().and_then(|spec| spec.renew_time.clone())
    };
    let lease = eventually(WAIT, "the node Lease", || async {
        api.lease("node-a").await
    })
    .await;
    let spec = lease.spec.clone().expect("Lease spec");
    assert_eq!(spec.holder_identity.as_deref(), Some("node-a"));
    assert_eq!(spec.lease_duration_seconds, Some(2));
    assert_eq!(
        lease
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("app.kubernetes.io/managed-by")),
        Some(&"vgpu-device-plugin".to_string())
    );
    let first_renewal = renewed_at(&lease).expect("renewTime");
    eventually(WAIT, "a renewal of the node Lease", || async {
        api.lease("node-a")
            .await
            .and_then(|lease| renewed_at(&lease))
            .filter(|renewed| renewed.0 > first_renewal.0)
    })
    .await;

    // A critical XID makes a GPU unhealthy; an application XID does not.
    assert!(harness.health.inject_xid(&gpu1, 79));
    conn.wait_devices(WAIT, |list| {
        list.iter()
            .filter(|d| d.id.starts_with(&gpu1))
            .all(|d| d.health == "Unhealthy")
    })
    .await;
    assert!(health_of(&conn, &gpu0).iter().all(|h| h == "Healthy"));
    eventually(WAIT, "the inventory to show the fault", || async {
        api.inventory("node-a")
            .await
            .filter(|i| !i.gpus[1].healthy && i.gpus[0].healthy)
    })
    .await;
    // Signals are applied in order, so once the recovery below shows, this
    // application XID has been applied too: had it made GPU 0 unhealthy,
    // nothing would make it healthy again and the wait would fail.
    assert!(harness.health.inject_xid(&gpu0, 13));

    // Recovery (here: one good probe, the window being zero).
    assert!(harness.health.send(Signal::Probe {
        uuid: gpu1.clone(),
        result: Ok(()),
    }));
    conn.wait_devices(WAIT, |list| list.iter().all(|d| d.health == "Healthy"))
        .await;
    eventually(WAIT, "the inventory to show the recovery", || async {
        api.inventory("node-a")
            .await
            .filter(|i| i.gpus.iter().all(|g| g.healthy))
    })
    .await;

    // Kubelet restarts: its socket is recreated and every other socket in
    // the directory removed. The plugin serves again and re-registers.
    kubelet.restart().await;
    let again = kubelet.next_registration(WAIT).await;
    assert_eq!(again.endpoint, "vgpu.sock");
    let mut conn = kubelet.connect(&again).await;
    conn.wait_devices(WAIT, |list| list.len() == 20).await;

    // A fault while kubelet is away reaches the next kubelet.
    kubelet.stop().await;
    let handled = harness.health.handled();
    assert!(harness.health.inject_xid(&gpu0, 48));
    eventually(
        WAIT,
        "the fault to be applied while kubelet is away",
        || async { (harness.health.handled() > handled).then_some(()) },
    )
    .await;
    kubelet.restart().await;
    let third = kubelet.next_registration(WAIT).await;
    let mut conn = kubelet.connect(&third).await;
    conn.wait_devices(WAIT, |list| {
        list.iter()
            .filter(|d| d.id.starts_with(&gpu0))
            .all(|d| d.health == "Unhealthy")
            && list.len() == 20
    })
    .await;
    assert!(
        kubelet.try_registration().is_none(),
        "registered once per kubelet"
    );

    // A new kubelet.sock alone (the plugin's socket left in place) is
    // enough to register again, on the same server.
    kubelet.stop().await;
    kubelet.start_again();
    let fourth = kubelet.next_registration(WAIT).await;
    let mut conn = kubelet.connect(&fourth).await;
    conn.wait_devices(WAIT, |list| list.len() == 20).await;

    // A clean stop removes the plugin's socket.
    harness.stop.send(true).expect("stop");
    let socket = harness.plugin_dir.join("vgpu.sock");
    eventually(WAIT, "the plugin to remove its socket", || async {
        (!socket.exists()).then_some(())
    })
    .await;
}

fn grant(uuid: &str, memory: u64, cores: u32) -> DeviceGrant {
    DeviceGrant {
        uuid: uuid.into(),
        memory_bytes: memory,
        cores_percent: cores,
        burst_percent: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_serves_the_pending_pod_and_refuses_what_it_cannot_match() {
    let api = ControlPlane::start().await;
    api.add_node("node-b").await;
    let harness = start_plugin(&api, "node-b", "allocate").await;
    let mut kubelet = FakeKubelet::start(&harness.plugin_dir);
    let registration = kubelet.next_registration(WAIT).await;
    let mut conn = kubelet.connect(&registration).await;
    conn.wait_devices(WAIT, |list| list.len() == 20).await;
    let [gpu0, gpu1] = [gpus()[0].uuid.clone(), gpus()[1].uuid.clone()];

    // Nothing pending: refused, with a message kubelet shows in events.
    let error = conn.allocate_one(1).await.expect_err("no pod");
    assert_eq!(error.code(), tonic::Code::FailedPrecondition);
    assert!(
        error.message().contains("no pod bound to node node-b"),
        "{}",
        error.message()
    );

    // A pod with an init container (1 GPU) and a main container (2 GPUs).
    let p = api
        .add_pod(pod(
            "train",
            vec![container("setup", 1)],
            vec![
                asking(container("main", 2), "nvidia.com/priority", "0"),
                container("sidecar", 0),
            ],
        ))
        .await;
    let decision = decide(&p, "node-b", |i, _| match i {
        0 => (vec![grant(&gpu1, GIB, 10)], None),
        _ => (
            vec![grant(&gpu1, 3000 * MIB, 30), grant(&gpu0, 4 * GIB, 100)],
            Some(0),
        ),
    });
    let p = api.bind("train", &decision).await;
    let answers = conn.admit(&p, RESOURCE).await.expect("admitted");
    api.wait_allocated("train", &["setup", "main"]).await;
    let (name, ids, setup) = &answers[0];
    assert_eq!(name, "setup");
    assert!(
        ids[0].starts_with(&gpu1),
        "preferred the decided GPU: {ids:?}"
    );
    assert_eq!(setup.envs["NVIDIA_VISIBLE_DEVICES"], gpu1);
    assert_eq!(setup.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "1024m");
    assert_eq!(setup.envs["CUDA_DEVICE_SM_LIMIT_0"], "10");
    assert!(!setup.envs.contains_key("CUDA_TASK_PRIORITY"));
    let (_, ids, main) = &answers[1];
    let mut on: Vec<&str> = ids.iter().map(|id| &id[..gpu0.len()]).collect();
    on.sort();
    assert_eq!(on, vec![gpu0.as_str(), gpu1.as_str()]);
    // Host order: GPU 0 is device 0 in the container.
    assert_eq!(
        main.envs["NVIDIA_VISIBLE_DEVICES"],
        format!("{gpu0},{gpu1}")
    );
    assert_eq!(main.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "4096m");
    // A whole GPU is no compute cap, written as HAMi-core's "uncapped".
    assert_eq!(main.envs["CUDA_DEVICE_SM_LIMIT_0"], "0");
    assert_eq!(main.envs["CUDA_DEVICE_MEMORY_LIMIT_1"], "3000m");
    assert_eq!(main.envs["CUDA_DEVICE_SM_LIMIT_1"], "30");
    assert_eq!(main.envs["CUDA_TASK_PRIORITY"], "0");
    assert_eq!(main.envs["CUDA_DEVICE_ORDER"], "PCI_BUS_ID");
    assert_eq!(
        main.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"],
        "/usr/local/vgpu/container/region.cache"
    );
    let uid = p.metadata.uid.clone().expect("uid");
    let region = harness
        .dir
        .join("containers")
        .join(format!("{uid}_main"))
        .join("region.cache");
    let region =
        vgpu_node_contract::region::Region::open_existing(&region).expect("region created");
    assert_eq!(region.device_limit(0), 4 * GIB);
    assert_eq!(region.device_limit(1), 3000 * MIB);
    assert_eq!(region.limits().sm_limit[1], 30);
    assert_eq!(
        std::fs::read_to_string(harness.dir.join("ld.so.preload")).expect("preload"),
        "/usr/local/vgpu/libvgpu.so\n"
    );

    // The pod is complete: another request matches nothing.
    let error = conn.allocate_one(1).await.expect_err("complete");
    assert!(
        error.message().contains("no pod bound"),
        "{}",
        error.message()
    );
    api.mark_running("train").await;

    // A decision granting more than its pod asks for (1 GiB and 10 %) is
    // refused, whoever wrote it: the whole GPU uncapped is not what the
    // extender decides for this pod.
    let g = api
        .add_pod(pod(
            "greedy",
            vec![],
            vec![asking(
                asking(container("g", 1), "nvidia.com/gpumem", "1024"),
                "nvidia.com/gpucores",
                "10",
            )],
        ))
        .await;
    let d = decide(&g, "node-b", |_, _| (vec![grant(&gpu0, 16 * GIB, 0)], None));
    api.bind("greedy", &d).await;
    let error = conn.allocate_one(1).await.expect_err("forged");
    assert!(
        error.message().contains("default/greedy")
            && error.message().contains("does not ask for")
            && error.message().contains("17179869184 bytes"),
        "{}",
        error.message()
    );
    assert!(api.allocated("greedy").await.is_empty(), "nothing recorded");
    api.set_phase("greedy", "Failed").await;

    // Kubelet asks for a different count than decided: refused by name.
    let q = api
        .add_pod(pod("infer", vec![], vec![container("server", 1)]))
        .await;
    let d = decide(&q, "node-b", |_, _| (vec![grant(&gpu0, GIB, 20)], None));
    api.bind("infer", &d).await;
    let error = conn.allocate_one(2).await.expect_err("count");
    assert!(
        error.message().contains("asks for 2 device(s)") && error.message().contains("server"),
        "{}",
        error.message()
    );
    assert!(api.allocated("infer").await.is_empty(), "nothing recorded");

    // Two pending pods: nothing is guessed.
    let r = api
        .add_pod(pod("rogue", vec![], vec![container("x", 1)]))
        .await;
    let d = decide(&r, "node-b", |_, _| (vec![grant(&gpu0, GIB, 20)], None));
    api.bind("rogue", &d).await;
    let error = conn.allocate_one(1).await.expect_err("two pending");
    assert!(
        error.message().contains("default/infer") && error.message().contains("default/rogue"),
        "{}",
        error.message()
    );
    api.set_phase("rogue", "Failed").await;

    // A decided GPU that became unhealthy is refused.
    assert!(harness.health.inject_xid(&gpu0, 79));
    conn.wait_devices(WAIT, |list| list.iter().any(|d| d.health == "Unhealthy"))
        .await;
    let error = conn.allocate_one(1).await.expect_err("unhealthy");
    assert!(error.message().contains("unhealthy"), "{}", error.message());
    assert!(harness.health.send(Signal::Probe {
        uuid: gpu0.clone(),
        result: Ok(()),
    }));
    conn.wait_devices(WAIT, |list| list.iter().all(|d| d.health == "Healthy"))
        .await;

    // Healthy again, the GPU is served to the pod decided for it.
    let (_, answer) = conn.allocate_one(1).await.expect("served once healthy");
    assert_eq!(answer.envs["NVIDIA_VISIBLE_DEVICES"], gpu0);
    api.wait_allocated("infer", &["server"]).await;
}
