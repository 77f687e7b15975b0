//! `/metrics` against the truth: the figures in the regions (one written by
//! a real process under the shim, one through the region API) and the
//! simulated driver's own NVML figures.

use crate::common::*;
use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::Duration;
use vgpu_monitor::discovery::read_figures;
use vgpu_node_contract::region::{MemoryKind, Region, RegionLimits, SHARE_FULL};
use vgpu_testkit::{key_values, programs_dir, run_ok, spawn_until_ready, Sandbox};

const UID_A: &str = "6f1c0a52-4b7e-4d5e-9b1a-0c2d3e4f5a6b";
const UID_B: &str = "0a9b8c7d-6e5f-4a3b-8c2d-1e0f9a8b7c6d";

/// A process under the shim holding `bytes` until its stdin closes.
struct Holder {
    child: std::process::Child,
}

impl Holder {
    fn start(sandbox: &Sandbox, bytes: u64) -> Self {
        let child = spawn_until_ready(&mut sandbox.probe("dlsym", &["hold", &bytes.to_string()]));
        Self { child }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(mut stdin) = self.child.stdin.take() {
            let _ = stdin.flush();
        }
        let _ = self.child.wait();
    }
}

#[test]
fn metrics_equal_the_region_and_simulated_driver_figures() {
    let host = HostDir::new("metrics");
    let key_a = format!("{UID_A}_main");
    let key_b = format!("{UID_B}_side");

    // Container A: a real process under the shim, 1 GiB held, context charged.
    let mut sandbox = Sandbox::new("monitor-metrics", 2, "16Gi");
    sandbox
        .set(
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            &host.region_path(&key_a).display().to_string(),
        )
        .set("CUDA_DEVICE_MEMORY_LIMIT", "4Gi")
        .set("CUDA_DEVICE_SM_LIMIT", "40")
        .set("VGPU_CONTEXT_RESERVE", "256Mi")
        .set("CUDA_TASK_PRIORITY", "3");
    let holder = Holder::start(&sandbox, GIB);
    let region_a = Region::open_existing(&host.region_path(&key_a)).expect("region A");
    let uuid = region_a.device_uuid(0).expect("the shim records the UUID");

    // Container B: written through the region API (what the shim does).
    let mut limits = RegionLimits::default();
    limits.memory_limit[0] = 2 * GIB;
    limits.swap_limit[0] = 512 * MIB;
    limits.sm_limit[0] = 25;
    limits.sm_burst[0] = 50;
    let region_b = host.create_region(&key_b, &limits);
    region_b.set_device_uuid(0, &uuid);
    let slot = charge(&region_b, 0, 3 * MIB, MIB, 100 * MIB);
    assert!(region_b
        .reserve(slot, 0, MemoryKind::Data, 4 * GIB)
        .expect("io")
        .is_err());
    region_b
        .reserve_swap(slot, 0, 10 * MIB)
        .expect("io")
        .expect("swap fits");
    let bucket = &region_b.layout().devices[0].compute;
    bucket.launches.store(42, Ordering::Relaxed);
    bucket.throttled_ns.store(2_500_000_000, Ordering::Relaxed);
    bucket.credited_ns.store(7_000_000_000, Ordering::Relaxed);

    let monitor = MonitorProcess::on_simulated_gpu(
        &sandbox,
        &host,
        &["--no-kubernetes", "--hami-metric-names"],
    );
    let a = [("pod", UID_A), ("container", "main"), ("device_index", "0")];
    let b = [("pod", UID_B), ("container", "side"), ("device_index", "0")];
    let samples = monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        let both = value(samples, "vgpu_container_memory_used_bytes", &a).is_some()
            && value(samples, "vgpu_container_memory_used_bytes", &b).is_some()
            && value(
                samples,
                "vgpu_gpu_memory_used_bytes",
                &[("device_index", "0")],
            )
            .is_some();
        both.then(|| samples.to_vec())
    });

    // Against the regions, read independently.
    for (labels, region) in [(&a, &region_a), (&b, &region_b)] {
        let figures = read_figures(region);
        let device = &figures.devices[0];
        let get = |name: &str| value(&samples, name, labels).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(
            get("vgpu_container_memory_used_bytes"),
            device.memory_used as f64
        );
        assert_eq!(
            get("vgpu_container_memory_limit_bytes"),
            device.memory_limit as f64
        );
        assert_eq!(
            get("vgpu_container_memory_peak_bytes"),
            device.peak_used as f64
        );
        assert_eq!(
            get("vgpu_container_memory_context_bytes"),
            device.context as f64
        );
        assert_eq!(
            get("vgpu_container_memory_module_bytes"),
            device.module as f64
        );
        assert_eq!(get("vgpu_container_memory_data_bytes"), device.data as f64);
        assert_eq!(
            get("vgpu_container_swap_used_bytes"),
            device.swap_used as f64
        );
        assert_eq!(
            get("vgpu_container_swap_limit_bytes"),
            device.swap_limit as f64
        );
        assert_eq!(
            get("vgpu_container_oom_events_total"),
            device.oom_events as f64
        );
        assert_eq!(
            get("vgpu_container_kernel_launches_total"),
            device.launches as f64
        );
        assert_eq!(
            get("vgpu_container_throttled_seconds_total"),
            device.throttled_ns as f64 / 1e9
        );
        assert_eq!(
            get("vgpu_container_compute_share_ratio"),
            f64::from(device.sm_limit) / 100.0
        );
        assert_eq!(
            get("vgpu_container_compute_effective_ratio"),
            f64::from(device.sm_effective) / f64::from(SHARE_FULL)
        );
        assert_eq!(get("vgpu_container_priority"), f64::from(figures.priority));
        // HAMi's names carry the same figures.
        let hami = [
            ("pod", labels[0].1),
            ("container", labels[1].1),
            ("vdevice_index", "0"),
            ("zone", "vGPU"),
        ];
        let hami_get =
            |name: &str| value(&samples, name, &hami).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(
            hami_get("hami_vgpu_memory_used_bytes"),
            device.memory_used as f64
        );
        assert_eq!(
            hami_get("hami_vgpu_memory_limit_bytes"),
            device.memory_limit as f64
        );
        assert_eq!(
            hami_get("hami_vgpu_memory_buffer_bytes"),
            device.data as f64
        );
        assert_eq!(
            hami_get("hami_vgpu_memory_context_bytes"),
            device.context as f64
        );
        assert_eq!(
            hami_get("hami_vgpu_memory_module_bytes"),
            device.module as f64
        );
    }
    // And against what was charged: the shim's view of A, the API's of B.
    let get_a = |name: &str| value(&samples, name, &a).expect("A");
    assert!(get_a("vgpu_container_memory_used_bytes") >= (GIB + 256 * MIB) as f64);
    assert_eq!(
        get_a("vgpu_container_memory_context_bytes"),
        (256 * MIB) as f64
    );
    assert_eq!(get_a("vgpu_container_memory_limit_bytes"), (4 * GIB) as f64);
    assert_eq!(get_a("vgpu_container_compute_share_ratio"), 0.4);
    assert_eq!(get_a("vgpu_container_priority"), 3.0);
    let get_b = |name: &str| value(&samples, name, &b).expect("B");
    assert_eq!(
        get_b("vgpu_container_memory_used_bytes"),
        (104 * MIB) as f64
    );
    assert_eq!(
        get_b("vgpu_container_memory_data_bytes"),
        (100 * MIB) as f64
    );
    assert_eq!(get_b("vgpu_container_oom_events_total"), 1.0);
    assert_eq!(get_b("vgpu_container_swap_used_bytes"), (10 * MIB) as f64);
    assert_eq!(get_b("vgpu_container_compute_burst_ratio"), 0.5);
    assert_eq!(get_b("vgpu_container_kernel_launches_total"), 42.0);
    assert_eq!(get_b("vgpu_container_throttled_seconds_total"), 2.5);
    // Labels: the directory name stands in for the pod (no API), the UUID
    // is the region's.
    let series = samples
        .iter()
        .find(|s| s.name == "vgpu_container_memory_used_bytes" && s.labels["pod"] == UID_B)
        .expect("B's series");
    assert_eq!(series.labels["namespace"], "");
    assert_eq!(series.labels["device_uuid"], uuid);
    assert_eq!(
        value(&samples, "vgpu_container_processes", &[("pod", UID_A)]),
        Some(1.0)
    );

    // Against the simulated driver, read by an NVML client without the shim.
    let nvml_view = key_values(&run_ok(
        sandbox
            .command_without_shim(&programs_dir().join("probe"))
            .args(["dlsym", "nvml"]),
    ));
    let gpu0 = [("device_index", "0"), ("device_uuid", uuid.as_str())];
    assert_eq!(
        value(&samples, "vgpu_gpu_memory_total_bytes", &gpu0),
        Some(nvml_view["nvml_total"].parse::<f64>().expect("total"))
    );
    assert_eq!(
        value(&samples, "vgpu_gpu_memory_used_bytes", &gpu0),
        Some(nvml_view["nvml_used"].parse::<f64>().expect("used"))
    );
    assert!(value(&samples, "vgpu_gpu_memory_used_bytes", &gpu0).expect("used") >= GIB as f64);
    assert_eq!(
        value(&samples, "vgpu_gpu_memory_total_bytes", &gpu0),
        Some((16 * GIB) as f64)
    );
    assert_eq!(value(&samples, "vgpu_gpu_containers", &gpu0), Some(2.0));
    assert_eq!(value(&samples, "vgpu_gpu_healthy", &gpu0), Some(1.0));
    for name in [
        "vgpu_gpu_utilization_ratio",
        "vgpu_gpu_temperature_celsius",
        "vgpu_gpu_power_watts",
    ] {
        assert!(value(&samples, name, &gpu0).is_some(), "{name}");
    }
    assert!(value(&samples, "vgpu_gpu_healthy", &[("device_index", "1")]).is_some());
    assert_eq!(
        value(
            &samples,
            "hami_host_gpu_memory_used_bytes",
            &[("device_index", "0"), ("zone", "vGPU")]
        ),
        value(&samples, "vgpu_gpu_memory_used_bytes", &gpu0)
    );

    // The holder exits: its memory leaves the region and the metrics.
    drop(holder);
    monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        (value(samples, "vgpu_container_memory_used_bytes", &a) == Some(0.0)).then_some(())
    });
    assert_eq!(monitor.stop().code(), Some(0), "clean exit on SIGTERM");
}

#[test]
fn new_regions_are_picked_up_and_removed_ones_dropped_without_restart() {
    let host = HostDir::new("rescan");
    let monitor = MonitorProcess::start(
        MonitorProcess::command(),
        &[
            "--containers-dir",
            host.root.to_str().expect("utf8"),
            "--no-nvml",
            "--no-kubernetes",
        ],
    );
    let region = host.create_region("u1_c", &RegionLimits::default());
    region.set_device_uuid(0, "GPU-test");
    let labels = [("pod", "u1"), ("container", "c")];
    monitor.wait_for_metrics(Duration::from_secs(5), |s| {
        value(s, "vgpu_container_memory_used_bytes", &labels).map(|_| ())
    });
    std::fs::remove_dir_all(host.root.join("u1_c")).expect("remove");
    monitor.wait_for_metrics(Duration::from_secs(5), |s| {
        value(s, "vgpu_container_memory_used_bytes", &labels)
            .is_none()
            .then_some(())
    });
    assert!(monitor.log().contains("region u1_c removed"));
    let (status, body) = http_get(monitor.addr, "/healthz").expect("healthz");
    assert_eq!((status, body.trim()), (200, "ok"));
}
