//! What `Allocate` returns is enough: containers started with exactly the
//! returned environment and mounts (applied here the way the container
//! runtime would, by mapping each in-container path to its host path) run
//! under the shim on the simulated GPU, and each is held to its own memory
//! cap and compute share, accounted in the region the plugin created.
//!
//! Needs the workspace built first (`cargo build --workspace`).

mod support;

use k8s_openapi::api::core::v1::Pod;
use std::path::PathBuf;
use std::time::Duration;
use support::kubelet::FakeKubelet;
use support::node::PluginNode;
use support::*;
use vgpu_cluster::decision::DeviceGrant;
use vgpu_device_plugin::api::v1beta1 as api;
use vgpu_node_contract::region::Region;
use vgpu_testkit::compute::{
    assert_share, process_share, wait_until, BusyMeter, Reference, Workload,
};
use vgpu_testkit::{key_values, number, run_ok, shim_library, Sandbox};

const WAIT: Duration = Duration::from_secs(15);

/// The host path behind `path` in a container with `mounts`.
fn on_host(mounts: &[api::Mount], path: &str) -> PathBuf {
    let mount = mounts
        .iter()
        .filter(|m| path == m.container_path || path.starts_with(&format!("{}/", m.container_path)))
        .max_by_key(|m| m.container_path.len())
        .unwrap_or_else(|| panic!("{path} is not in any mount: {mounts:?}"));
    let rest = path[mount.container_path.len()..].trim_start_matches('/');
    let host = PathBuf::from(&mount.host_path);
    if rest.is_empty() {
        host
    } else {
        host.join(rest)
    }
}

/// A container on `node`'s simulated GPU with the plugin's answer applied.
fn container_sandbox(node: &PluginNode, answer: &api::ContainerAllocateResponse) -> Sandbox {
    let mut sandbox = Sandbox::new("container", 1, "8Gi");
    // The node's simulated GPU, not a private one.
    sandbox
        .set(
            "SIMGPU_STATE",
            &node.sandbox.sim_state.display().to_string(),
        )
        .set(
            "LD_LIBRARY_PATH",
            &node.sandbox.lib_dir.display().to_string(),
        )
        .set("SIMGPU_UUID_SEED", &node.name)
        .unset("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    for (key, value) in &answer.envs {
        let value = if key == "CUDA_DEVICE_MEMORY_SHARED_CACHE" {
            on_host(&answer.mounts, value).display().to_string()
        } else {
            value.clone()
        };
        sandbox.set(key, &value);
    }
    // The runtime mounts ld.so.preload, which names the shim's path in the
    // container: the shim the sandbox preloads must be that one.
    let preload = on_host(&answer.mounts, "/etc/ld.so.preload");
    let listed = std::fs::read_to_string(preload).expect("ld.so.preload");
    let library = on_host(&answer.mounts, listed.trim());
    assert_eq!(library, shim_library());
    sandbox
}

/// `pod` asking to burst to 80 % (the pod annotation).
fn bursting(mut pod: Pod) -> Pod {
    pod.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert("vgpu.io/gpucores-burst".into(), "80".into());
    pod
}

fn grant(uuid: &str, memory_bytes: u64, cores_percent: u32) -> DeviceGrant {
    DeviceGrant {
        uuid: uuid.into(),
        memory_bytes,
        cores_percent,
        burst_percent: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containers_started_with_the_answer_are_held_to_their_own_limits() {
    let api = ControlPlane::start().await;
    api.add_node("gpu-node").await;
    let mut node = PluginNode::new("gpu-node", 1, "8Gi", &api.source(), &[]);
    node.start();
    let mut kubelet = FakeKubelet::start(&node.plugin_dir);
    let registration = kubelet.next_registration(WAIT).await;
    let mut conn = kubelet.connect(&registration).await;
    conn.wait_devices(WAIT, |list| list.len() == 10).await;
    let gpu = eventually(WAIT, "the inventory", || async {
        api.inventory("gpu-node").await
    })
    .await
    .gpus[0]
        .uuid
        .clone();

    let p = api
        .add_pod(pod(
            "app",
            vec![],
            vec![
                asking(container("main", 1), "nvidia.com/priority", "0"),
                container("side", 1),
            ],
        ))
        .await;
    let decision = decide(&p, "gpu-node", |i, _| match i {
        0 => (vec![grant(&gpu, GIB, 30)], Some(0)),
        _ => (vec![grant(&gpu, 3000 * MIB, 50)], None),
    });
    let p = api.bind("app", &decision).await;
    let answers = conn.admit(&p, RESOURCE).await.expect("admitted");
    let main = container_sandbox(&node, &answers[0].2);
    let side = container_sandbox(&node, &answers[1].2);
    assert_eq!(answers[0].2.envs["NVIDIA_VISIBLE_DEVICES"], gpu);

    // Memory: each container stops at its own cap.
    let values = key_values(&run_ok(&mut main.probe("dlsym", &["fill", "67108864"])));
    assert_eq!(
        number(&values, "chunks"),
        16,
        "1 GiB in 64 MiB chunks: {values:?}"
    );
    assert_eq!(number(&values, "refusal"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(number(&values, "mem_total"), 1024 * vgpu_testkit::MIB);
    let values = key_values(&run_ok(&mut side.probe("procaddr", &["fill", "67108864"])));
    assert_eq!(number(&values, "chunks"), 46, "3000 MiB: {values:?}");
    assert_eq!(number(&values, "mem_total"), 3000 * vgpu_testkit::MIB);

    // The regions the plugin created are the ones the shim used.
    let uid = p.metadata.uid.clone().expect("uid");
    let main_region = node.containers_dir.join(format!("{uid}_main/region.cache"));
    let region = Region::open_existing(&main_region).expect("main region");
    assert_eq!(region.device_limit(0), GIB);
    assert_eq!(region.limits().sm_limit[0], 30);
    assert_eq!(region.limits().priority, 0);
    assert_eq!(region.device_uuid(0).as_deref(), Some(gpu.as_str()));

    // Compute: both saturate the GPU at once; each gets its own share.
    let mut meter = BusyMeter::new(&main);
    let window = Duration::from_secs(2);
    let seconds = 1.0 + window.as_secs_f64() + 0.5;
    // The same program uncapped beside them: what the machine lets it reach.
    let mut reference = Reference::start(&[], "burst", "k1ms", seconds, 1);
    let first = Workload::start(&main, "burst", "k1ms", seconds, 1);
    let second = Workload::start(&side, "burst", "k1ms", seconds, 1);
    let start = [meter.read(0, first.pid()), meter.read(0, second.pid())];
    wait_until(start[0].at_ns + 1_000_000_000);
    let settled = [meter.read(0, first.pid()), meter.read(0, second.pid())];
    let reference_settled = reference.read(0);
    wait_until(settled[0].at_ns + window.as_nanos() as u64);
    let end = [meter.read(0, first.pid()), meter.read(0, second.pid())];
    let uncapped = process_share(reference_settled, reference.read(0));
    first.finish();
    second.finish();
    reference.finish();
    assert_share(
        "main",
        process_share(settled[0], end[0]),
        30.0,
        uncapped,
        5.0,
    );
    assert_share(
        "side",
        process_share(settled[1], end[1]),
        50.0,
        uncapped,
        5.0,
    );
}

/// The node monitor, as a process over the plugin's container directories
/// (no NVML, no Kubernetes API: the regions say everything).
struct MonitorProcess(std::process::Child);

impl MonitorProcess {
    fn start(containers_dir: &std::path::Path) -> Self {
        let binary = vgpu_testkit::target_dir().join("vgpu-monitor");
        assert!(
            binary.exists(),
            "{} is missing: build the workspace first",
            binary.display()
        );
        let child = std::process::Command::new(binary)
            .args(["--containers-dir"])
            .arg(containers_dir)
            .args(["--no-nvml", "--no-kubernetes", "--listen", "127.0.0.1:0"])
            .args(["--interval-ms", "50", "--active-window-ms", "300"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start vgpu-monitor");
        Self(child)
    }
}

impl Drop for MonitorProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decided_burst_lets_a_lone_container_use_idle_capacity() {
    let api = ControlPlane::start().await;
    api.add_node("burst-node").await;
    let mut node = PluginNode::new("burst-node", 1, "8Gi", &api.source(), &[]);
    node.start();
    let mut kubelet = FakeKubelet::start(&node.plugin_dir);
    let registration = kubelet.next_registration(WAIT).await;
    let mut conn = kubelet.connect(&registration).await;
    conn.wait_devices(WAIT, |list| list.len() == 10).await;
    let gpu = eventually(WAIT, "the inventory", || async {
        api.inventory("burst-node").await
    })
    .await
    .gpus[0]
        .uuid
        .clone();

    let p = api
        .add_pod(bursting(pod("bursty", vec![], vec![container("main", 1)])))
        .await;
    let decision = decide(&p, "burst-node", |_, _| {
        let mut bursting = grant(&gpu, GIB, 30);
        bursting.burst_percent = Some(80);
        (vec![bursting], None)
    });
    let p = api.bind("bursty", &decision).await;
    let answers = conn.admit(&p, RESOURCE).await.expect("admitted");
    assert_eq!(answers[0].2.envs["VGPU_SM_BURST_LIMIT_0"], "80");
    let main = container_sandbox(&node, &answers[0].2);
    let uid = p.metadata.uid.clone().expect("uid");
    let region =
        Region::open_existing(&node.containers_dir.join(format!("{uid}_main/region.cache")))
            .expect("region");
    assert_eq!(region.limits().sm_burst[0], 80);

    // Alone on the GPU with the monitor running, the container borrows
    // the idle capacity up to its burst; without the burst it would stay
    // at its 30 % share.
    let _monitor = MonitorProcess::start(&node.containers_dir);
    let mut meter = BusyMeter::new(&main);
    let window = Duration::from_secs(2);
    let seconds = 1.5 + window.as_secs_f64() + 0.5;
    let mut reference = Reference::start(&[], "burst", "k1ms", seconds, 1);
    let work = Workload::start(&main, "burst", "k1ms", seconds, 1);
    let start = meter.read(0, work.pid());
    wait_until(start.at_ns + 1_500_000_000);
    let settled = meter.read(0, work.pid());
    let reference_settled = reference.read(0);
    wait_until(settled.at_ns + window.as_nanos() as u64);
    let end = meter.read(0, work.pid());
    let uncapped = process_share(reference_settled, reference.read(0));
    work.finish();
    reference.finish();
    assert_share(
        "lone container with a burst of 80",
        process_share(settled, end),
        80.0,
        uncapped,
        5.0,
    );
}
